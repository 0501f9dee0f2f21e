//! A network partition between the store and PostgreSQL, made on demand by a proxy in front
//! of the real server: no call hangs past the store's response timeout, each ends in a
//! defined outcome (a write whose answer did not come is an unknown outcome, a read a
//! retryable error), the connection it was stuck on is closed rather than reused, and once
//! the partition heals the store works again and shows what really happened.
#![allow(clippy::unwrap_used)]

mod common;

use common::SchemaGuard;
use idempotency_core::{Cas, Claim, ClaimRequest, Error, Fingerprint, IdempotencyKey};
use idempotency_core::{IdempotencyStore, RecordId, RecordStatus, Scope};
use idempotency_postgres::{PostgresError, PostgresStore};
use idempotency_testing::partition::PartitionProxy;
use std::time::{Duration, Instant};

// Generous: a statement on a loaded machine, not partitioned, must never take as long.
const TIMEOUT: Duration = Duration::from_secs(3);
const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);

fn id() -> RecordId {
    RecordId::new(Scope::new("partition").unwrap(), IdempotencyKey::random())
}

async fn claimed(store: &PostgresStore, id: &RecordId) -> idempotency_core::FencingToken {
    let request = ClaimRequest::new(id.clone(), Fingerprint::from_bytes(b"p"), LEASE, TTL);
    match store.claim(&request).await.unwrap() {
        Claim::Claimed { token, .. } => token,
        other => panic!("a fresh key was found: {other:?}"),
    }
}

/// Runs `call`, which must end (whatever its answer) within the response timeout and a
/// generous margin.
async fn bounded<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    let started = Instant::now();
    let out = tokio::time::timeout(TIMEOUT + Duration::from_secs(10), call)
        .await
        .unwrap_or_else(|_| panic!("{what} hung through the partition"));
    assert!(
        started.elapsed() >= TIMEOUT,
        "{what} answered before its timeout, through a partition"
    );
    out
}

/// Waits until the pool holds an idle connection, so that the next statement is sent on it
/// (sqlx pings a connection given back before it is idle again, and a partition that cuts
/// that ping leaves the pool to open a new one, whose handshake never gets through: the
/// statement is then not sent at all, a different case).
async fn an_idle_connection(store: &PostgresStore) {
    let started = Instant::now();
    while store.pool().num_idle() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no connection went back idle"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

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

    // Cut before the completion reaches the server: unknown to the caller, not applied.
    let cut = id();
    let token = claimed(&store, &cut).await;
    an_idle_connection(&store).await;
    proxy.partition();
    let e = bounded("complete", store.complete(&cut, token, b"done", TTL))
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::OutcomeUnknown { .. }) && no_answer(&e),
        "{e:?}"
    );
    let e = bounded("get", store.get(&cut)).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Backend {
                retryable: true,
                ..
            }
        ) && nothing_answered(&e),
        "{e:?}"
    );
    proxy.heal();
    let r = store.get(&cut).await.unwrap().unwrap();
    assert_eq!((r.status, r.token), (RecordStatus::Pending, token));
    assert_eq!(
        store.complete(&cut, token, b"done", TTL).await.unwrap(),
        Cas::Applied
    );

    // The completion reaches the server and applies; its answer is lost: unknown to the
    // caller, and once healed the record shows it applied (what the engine's read-back finds).
    let lost = id();
    let token = claimed(&store, &lost).await;
    an_idle_connection(&store).await;
    proxy.hold_replies();
    let e = bounded("complete", store.complete(&lost, token, b"done", TTL))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::OutcomeUnknown { .. }), "{e:?}");
    proxy.heal();
    let r = store.get(&lost).await.unwrap().unwrap();
    assert_eq!(
        (r.status, r.token, r.outcome.as_deref()),
        (RecordStatus::Completed, token, Some(&b"done"[..]))
    );

    // Every connection that was stuck was closed: many calls on the healed pool all answer.
    for _ in 0..20 {
        let k = id();
        let token = claimed(&store, &k).await;
        assert_eq!(
            store.complete(&k, token, b"done", TTL).await.unwrap(),
            Cas::Applied
        );
    }
}
