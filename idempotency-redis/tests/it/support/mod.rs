//! Test support: the shared Redis under test, Redis servers and a 3-master cluster that the
//! tests start themselves on free loopback ports, and per-case key prefixes that are cleaned
//! up afterwards.
#![allow(dead_code)]

pub(crate) mod scenarios;

use idempotency_conformance::{Capabilities, ServerClock, TestStore};
use idempotency_core::store::Timestamp;
use idempotency_redis::{RedisStore, RedisStoreBuilder};
pub(crate) use idempotency_testing::redis_server::*;
use std::sync::Arc;

/// Where a store's keys live, for raw commands in tests.
#[derive(Clone, Debug)]
pub(crate) enum Topology {
    /// One server.
    Standalone(String),
    /// A cluster: every primary's URL.
    Cluster(Vec<String>),
}

impl Topology {
    /// Every node a key may live on.
    pub(crate) fn nodes(&self) -> Vec<String> {
        match self {
            Self::Standalone(url) => vec![url.clone()],
            Self::Cluster(urls) => urls.clone(),
        }
    }

    /// A raw async connection that routes commands like the store does.
    pub(crate) async fn raw(&self) -> Raw {
        match self {
            Self::Standalone(url) => Raw::Single(
                redis::Client::open(url.as_str())
                    .expect("url")
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap_or_else(|e| unreachable_server(url, &e)),
            ),
            Self::Cluster(urls) => Raw::Cluster(
                redis::cluster::ClusterClient::new(urls.clone())
                    .expect("cluster urls")
                    .get_async_connection()
                    .await
                    .expect("connect to the test cluster"),
            ),
        }
    }
}

/// A raw connection for test commands (writing foreign data, reading `PTTL`…).
#[derive(Clone)]
pub(crate) enum Raw {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Raw {
    /// Runs one command.
    pub(crate) async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        match self {
            Self::Single(c) => cmd.query_async(&mut c.clone()).await,
            Self::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
        .unwrap_or_else(|e| panic!("raw command failed: {e}"))
    }
}

/// A store on an isolated prefix, with what a test needs around it.
pub(crate) struct Harness {
    pub store: RedisStore,
    pub topology: Topology,
    pub guard: Cleanup,
}

impl Harness {
    /// Another store on the same servers and prefix, configured by `configure`.
    pub(crate) async fn store_with(
        &self,
        configure: impl FnOnce(RedisStoreBuilder) -> RedisStoreBuilder,
    ) -> RedisStore {
        let builder = configure(RedisStore::builder().prefix(self.guard.prefix.clone()));
        match &self.topology {
            Topology::Standalone(url) => builder.connect(url.as_str()).await,
            Topology::Cluster(urls) => {
                builder
                    .connect_cluster(urls.iter().map(String::as_str))
                    .await
            }
        }
        .expect("connect")
    }

    /// Wraps the store for the conformance kit.
    pub(crate) fn into_test_store(self) -> TestStore {
        let node = self.topology.nodes()[0].clone();
        // The server's clock, read with TIME on a node of its own (every node of the test
        // cluster runs on this machine's clock).
        let server_clock: ServerClock = Arc::new(move || {
            let node = node.clone();
            Box::pin(async move {
                let mut c = redis::Client::open(node.as_str())
                    .expect("url")
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap_or_else(|e| unreachable_server(&node, &e));
                let (secs, micros): (i64, i64) =
                    redis::cmd("TIME").query_async(&mut c).await.expect("TIME");
                Timestamp::from_millis(secs * 1000 + micros / 1000)
            })
        });
        TestStore::real_time(Arc::new(self.store))
            .with_capabilities(Capabilities::default().purge_reports_deletions(false))
            .with_server_clock(server_clock)
            .with_guard(self.guard)
    }
}

/// A store on the standalone server from [`redis_url`], with its own prefix.
pub(crate) async fn standalone() -> Harness {
    let url = redis_url();
    let prefix = unique_prefix();
    let store = RedisStore::builder()
        .prefix(prefix.clone())
        .connect(url.as_str())
        .await
        .unwrap_or_else(|e| unreachable_server(&url, &e));
    Harness {
        store,
        topology: Topology::Standalone(url.clone()),
        guard: Cleanup {
            nodes: vec![url],
            prefix,
            check_crossslot: false,
        },
    }
}

/// A store on this test binary's cluster, with its own prefix.
pub(crate) async fn cluster() -> Harness {
    let urls = shared_cluster().urls();
    let prefix = unique_prefix();
    let store = RedisStore::builder()
        .prefix(prefix.clone())
        .connect_cluster(urls.iter().map(String::as_str))
        .await
        .expect("connect to the test cluster");
    Harness {
        store,
        topology: Topology::Cluster(urls.clone()),
        guard: Cleanup {
            nodes: urls,
            prefix,
            check_crossslot: true,
        },
    }
}

/// Runs a Redis-specific case on a fresh multi-threaded runtime, as the conformance kit runs
/// its cases.
pub(crate) fn run<F, C>(harness: fn() -> F, case: fn(Harness) -> C)
where
    F: std::future::Future<Output = Harness>,
    C: std::future::Future<Output = ()>,
{
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(async move { case(harness().await).await });
}
