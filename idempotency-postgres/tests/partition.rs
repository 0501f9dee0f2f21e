//! A network partition between the store and PostgreSQL, made on demand by a proxy in front
//! of the real server: no call hangs past the store's response timeout, each ends in a
//! defined outcome (a write whose answer did not come is an unknown outcome, a read a
//! retryable error), the connection it was stuck on is closed rather than reused, and once
//! the partition heals the store works again and shows what really happened
//! (`idempotency-testing`'s `PartitionCase`).
#![allow(clippy::unwrap_used)]

mod common;

use common::SchemaGuard;
use idempotency_core::Error;
use idempotency_postgres::{PostgresError, PostgresStore};
use idempotency_testing::partition::PartitionProxy;
use idempotency_testing::partition_case::{an_idle_connection, PartitionCase};
use std::time::Duration;

// Generous: a statement on a loaded machine, not partitioned, must never take as long.
const TIMEOUT: Duration = Duration::from_secs(3);

fn no_answer(e: &Error) -> bool {
    matches!(PostgresError::find(e), Some(PostgresError::NoAnswer { .. }))
}

/// No answer to the statement, or no connection to send it on (a new connection's handshake
/// is cut too, and the pool gives up after its acquire timeout).
fn nothing_answered(e: &Error) -> bool {
    no_answer(e)
        || e.find_source::<idempotency_postgres::sqlx::Error>()
            .is_some_and(|e| matches!(e, idempotency_postgres::sqlx::Error::PoolTimedOut))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_ends_every_call_in_a_defined_outcome() {
    let proxy = PartitionProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let guard = SchemaGuard::new();
    let url = format!("postgres://postgres@{}/test", proxy.addr());
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .max_connections(4)
        .response_timeout(TIMEOUT)
        .acquire_timeout(TIMEOUT)
        .connect(&url)
        .await
        .unwrap();
    store.migrate().await.unwrap();

    PartitionCase {
        store: &store,
        proxy: &proxy,
        timeout: TIMEOUT,
        settle: &|| Box::pin(an_idle_connection(|| store.pool().num_idle())),
        no_answer,
        read_failed: nothing_answered,
        claim_unknown: false,
    }
    .run()
    .await;
}
