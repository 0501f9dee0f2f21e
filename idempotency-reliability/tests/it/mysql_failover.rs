//! A MariaDB failover in the middle of a history-checked soak: a primary and a replica of the
//! test's own (`mariadb-install-db`, ports of their own, GTID replication from the first
//! write), the replica following the primary through a proxy the test can cut, the
//! application reaching the primary through a second proxy (a virtual address) that is moved
//! to the replica once it is promoted. 1.5 s in, the replication link is cut for a second;
//! then the primary is SIGKILLed, the replica applies what it received and is promoted, and
//! the address moves.
//!
//! Run with asynchronous replication (MariaDB's default), where the checker must find the
//! commits of the cut second lost (or the scenario proves nothing); semi-synchronous with
//! `AFTER_SYNC` and a timeout longer than any outage, through the engine and through the
//! exactly-once path, where nothing a caller was told is lost; and semi-synchronous with a
//! timeout shorter than the cut, which falls back to asynchronous replication and loses
//! outcomes again.

use crate::runners;

use idempotency_core::IdempotencyStore;
use idempotency_mysql::sqlx::mysql::MySqlConnectOptions;
use idempotency_mysql::MySqlStore;
use idempotency_reliability::soak::{
    soak, Expect, FailoverRun, Instances, Runner, SoakConfig, CALLS_AFTER_RECOVERY,
};
use idempotency_testing::mariadb_server::{DataDir, MariadbServer, Replication};
use idempotency_testing::mysql::{self as my, Isolation};
use idempotency_testing::partition::PartitionProxy;
use idempotency_testing::redis_server::free_port;
use runners::mysql::MySqlTransactionalRunner;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Semi-synchronous replication whose commits wait for the replica for up to 10 minutes:
/// longer than the test.
const SEMI_SYNCHRONOUS: Replication = Replication::SemiSynchronous {
    timeout: Duration::from_secs(600),
};

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// What runs the soak's calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// The engine, through two stores (two application instances).
    Engine,
    /// `MySqlIdempotency::run_in_transaction`, a business row per execution in the
    /// completion's transaction.
    ExactlyOnce,
}

async fn store_at(address: SocketAddr) -> MySqlStore {
    let options = MySqlConnectOptions::new()
        .host("127.0.0.1")
        .port(address.port())
        .username("root")
        .database("test");
    let pool = my::pool_with(options, Isolation::RepeatableRead, 8).await;
    MySqlStore::builder()
        .table("records")
        .build(pool)
        .expect("valid name")
}

/// One run; `None` when it ended before it had calls in flight at the crash and 500 answered
/// after the switch (it proves nothing then).
async fn failover_soak_once(replication: Replication, path: Path) -> Option<FailoverRun> {
    let (primary_data, replica_data) = (DataDir::new(), DataDir::new());
    let (primary_port, replica_port) = (free_port(), free_port());
    // Each server with its data directory, which must outlive it.
    let primary = tokio::task::spawn_blocking(move || {
        let primary = MariadbServer::primary(primary_port, &primary_data, replication);
        (primary, primary_data)
    })
    .await
    .expect("start the primary");
    let link = PartitionProxy::start(loopback(primary.0.port)).await;
    let replica = tokio::task::spawn_blocking(move || {
        let replica = MariadbServer::replica(replica_port, &replica_data, replication);
        (replica, replica_data)
    })
    .await
    .expect("start the replica");
    replica.0.replicate_from(link.addr().port()).await;
    if matches!(replication, Replication::SemiSynchronous { .. }) {
        primary.0.wait_semi_sync_replicas(1).await;
    }
    primary.0.create_test_database().await;
    let address = Arc::new(PartitionProxy::start(loopback(primary.0.port)).await);

    let mut config = SoakConfig::from_env(format!("mysql-failover-{replication:?}-{path:?}"));
    // A bound: the chaos ends the run once it has met the failover.
    config.ops = config.ops.max(20_000);
    let runner: Arc<dyn Runner> = match path {
        Path::Engine => {
            let mut instances: Vec<Arc<dyn IdempotencyStore>> = Vec::new();
            for _ in 0..2 {
                let store = store_at(address.addr()).await;
                store.migrate().await.expect("migrate");
                instances.push(Arc::new(store));
            }
            Arc::new(Instances::new(instances, config.lease))
        }
        Path::ExactlyOnce => {
            let store = store_at(address.addr()).await;
            store.migrate().await.expect("migrate");
            Arc::new(MySqlTransactionalRunner::new(store, "effects", config.lease).await)
        }
    };
    let chaos = {
        let (address, ending) = (address.clone(), config.ending.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            // The replication link is cut for a second (a network partition between the
            // servers): semi-synchronous commits wait for the replica's acknowledgement;
            // asynchronous ones go on and never reach it.
            link.partition();
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            let crashed = Instant::now();
            let (primary, _primary_data) = primary;
            tokio::task::spawn_blocking(move || primary.crash())
                .await
                .expect("crash the primary");
            drop(link);
            let (replica, replica_data) = replica;
            replica.promote().await;
            address.retarget(loopback(replica.port));
            let switched = Instant::now();
            ending.end_after(CALLS_AFTER_RECOVERY);
            (replica, replica_data, crashed, switched)
        })
    };
    let report = soak(runner, config).await;
    let (_replica, _data, crashed, switched) = chaos.await.expect("chaos");
    FailoverRun::measure(report, crashed, switched)
}

async fn failover_soak(replication: Replication, path: Path, expect: Expect) -> FailoverRun {
    let label = format!("mariadb failover, {replication:?}, {path:?}");
    FailoverRun::repeat(&label, expect, || failover_soak_once(replication, path)).await
}

/// Asynchronous replication: the commits of the second the link was cut are lost with the
/// primary, and the checker finds callers told outcomes the promoted replica does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_replica_loses_outcomes() {
    failover_soak(Replication::Asynchronous, Path::Engine, Expect::Loss).await;
}

/// Semi-synchronous replication with `AFTER_SYNC`: a commit becomes visible and returns only
/// once the replica has it, so the promoted replica (after applying what it received) has
/// every outcome a caller was told or read.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn semi_synchronous_replica_loses_nothing() {
    failover_soak(SEMI_SYNCHRONOUS, Path::Engine, Expect::Clean).await;
}

/// The same through the exactly-once path: business rows and completions move to the promoted
/// replica together, and no key's work runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn semi_synchronous_replica_keeps_exactly_once() {
    failover_soak(SEMI_SYNCHRONOUS, Path::ExactlyOnce, Expect::Clean).await;
}

/// Semi-synchronous replication whose timeout (200 ms) is shorter than the cut: the primary
/// stops waiting, falls back to asynchronous replication, and the commits after the fallback
/// are lost with it. The timeout must outlast any outage of the replica for the setting to
/// keep the promise.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn semi_synchronous_replica_with_a_short_timeout_loses_outcomes() {
    let replication = Replication::SemiSynchronous {
        timeout: Duration::from_millis(200),
    };
    failover_soak(replication, Path::Engine, Expect::Loss).await;
}
