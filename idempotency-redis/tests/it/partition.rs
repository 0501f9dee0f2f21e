//! A network partition between the store and Redis, made on demand by a proxy in front of
//! the shared server: no call hangs past the store's response timeout, each ends in
//! a defined outcome (a write whose answer did not come, a claim included, is an unknown
//! outcome, a read a retryable error), and once the partition heals the store works again
//! on the same connection and shows what really happened (`idempotency-testing`'s
//! `PartitionCase`).
#![allow(clippy::unwrap_used)]

use idempotency_redis::RedisStore;
use idempotency_testing::partition::PartitionProxy;
use idempotency_testing::partition_case::PartitionCase;
use idempotency_testing::redis_server::{redis_url, unique_prefix, Cleanup};
use std::time::Duration;

fn timed_out(e: &idempotency_core::Error) -> bool {
    e.find_source::<idempotency_redis::redis::RedisError>()
        .is_some_and(|r| r.is_timeout())
}

// Generous: a call on a loaded machine, not partitioned, must never take as long.
const TIMEOUT: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_ends_every_call_in_a_defined_outcome() {
    let upstream = redis_url()
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    let proxy = PartitionProxy::start(upstream.parse().unwrap()).await;
    let prefix = unique_prefix();
    let _cleanup = Cleanup {
        nodes: vec![redis_url()],
        prefix: prefix.clone(),
        check_crossslot: false,
    };
    let store = RedisStore::builder()
        .prefix(&prefix)
        .response_timeout(TIMEOUT)
        .connect(format!("redis://{}", proxy.addr()))
        .await
        .unwrap();

    PartitionCase {
        store: &store,
        proxy: &proxy,
        timeout: TIMEOUT,
        // One multiplexed connection, always established.
        settle: &|| Box::pin(async {}),
        // A call without an answer times out: a write's outcome is unknown, a read is
        // retryable.
        no_answer: timed_out,
        read_failed: timed_out,
        claim_unknown: true,
    }
    .run()
    .await;
}
