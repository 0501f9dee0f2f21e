//! A network partition between the store and MariaDB, made on demand by a proxy in front of
//! the real server: no call hangs past the store's response timeout, each ends in a defined
//! outcome (a compare-and-swap whose answer did not come is an unknown outcome, a read or a
//! claim a retryable error, the commit of an exactly-once transaction an unknown outcome that
//! holds the key), the connection it was stuck on is closed rather than reused, and once the
//! partition heals the store works again and shows what really happened.
#![allow(clippy::unwrap_used)]

mod common;

use common::TableGuard;
use idempotency_core::{
    Cas, Claim, ClaimRequest, Error, Fingerprint, IdempotencyKey, IdempotencyStore, Policy,
    RecordId, RecordStatus, Scope,
};
use idempotency_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};
use idempotency_mysql::{MysqlError, MysqlIdempotency, MysqlStore};
use idempotency_testing::partition::PartitionProxy;
use std::str::FromStr;
use std::time::{Duration, Instant};

// Generous: a statement on a loaded machine, not partitioned, must never take as long.
const TIMEOUT: Duration = Duration::from_secs(3);
const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);

fn id() -> RecordId {
    RecordId::new(Scope::new("partition").unwrap(), IdempotencyKey::random())
}

fn request(id: &RecordId) -> ClaimRequest {
    ClaimRequest::new(id.clone(), Fingerprint::from_bytes(b"p"), LEASE, TTL)
}

async fn claimed(store: &MysqlStore, id: &RecordId) -> idempotency_core::FencingToken {
    match store.claim(&request(id)).await.unwrap() {
        Claim::Claimed { token, .. } => token,
        other => panic!("a fresh key was found: {other:?}"),
    }
}

/// Runs `call`, which must end (whatever its answer) within the response timeout and a
/// generous margin, and not before the timeout.
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
/// (sqlx pings a connection given back before it is idle again; a partition that cut that
/// ping would leave the pool to open a new connection, whose handshake never gets through:
/// the statement would then not be sent at all, a different case).
async fn an_idle_connection(store: &MysqlStore) {
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
    matches!(MysqlError::find(e), Some(MysqlError::NoAnswer { .. }))
}

async fn partitioned_store(proxy: &PartitionProxy, guard: &TableGuard) -> MysqlStore {
    let options = MySqlConnectOptions::from_str(&common::url())
        .unwrap()
        .host("127.0.0.1")
        .port(proxy.addr().port())
        .ssl_mode(MySqlSslMode::Disabled);
    let pool = idempotency_mysql::sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(TIMEOUT)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .unwrap();
    let store = MysqlStore::builder()
        .table(&guard.table)
        .response_timeout(TIMEOUT)
        .build(pool)
        .unwrap();
    store.migrate().await.unwrap();
    store
}

async fn proxy() -> PartitionProxy {
    let options = MySqlConnectOptions::from_str(&common::url()).unwrap();
    let target = format!("{}:{}", options.get_host(), options.get_port());
    PartitionProxy::start(target.parse().unwrap()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_ends_every_call_in_a_defined_outcome() {
    let proxy = proxy().await;
    let guard = TableGuard::new();
    let store = partitioned_store(&proxy, &guard).await;

    // Cut before the completion's answer comes back: unknown to the caller.
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
    for (what, e) in [
        ("get", bounded("get", store.get(&cut)).await.map(|_| ())),
        (
            "claim",
            bounded("claim", store.claim(&request(&id())))
                .await
                .map(|_| ()),
        ),
    ] {
        let e = e.unwrap_err();
        assert!(
            matches!(
                e,
                Error::Backend {
                    retryable: true,
                    ..
                }
            ),
            "{what}: {e:?}"
        );
    }
    proxy.heal();
    // Unknown means either: the request may still be delivered once the partition heals
    // (TCP held it). Pending with the holder's token, or completed by it; never anything
    // else.
    let r = store.get(&cut).await.unwrap().unwrap();
    match r.status {
        RecordStatus::Pending => {
            assert_eq!(r.token, token);
            assert_eq!(
                store.complete(&cut, token, b"done", TTL).await.unwrap(),
                Cas::Applied
            );
        }
        RecordStatus::Completed => {
            assert_eq!((r.token, r.outcome.as_deref()), (token, Some(&b"done"[..])));
        }
        other => panic!("the cut completion left {other:?}"),
    }

    // The completion reaches the server and applies; its answer is lost: unknown to the
    // caller, and once healed the record shows it applied (what the engine's read-back finds).
    let lost = id();
    let token = claimed(&store, &lost).await;
    an_idle_connection(&store).await;
    proxy.hold_replies();
    let e = bounded("complete", store.complete(&lost, token, b"done", TTL))
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::OutcomeUnknown { .. }) && no_answer(&e),
        "{e:?}"
    );
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

/// The exactly-once transaction: the answers are held from inside the work, so the completion
/// in the transaction, the rollback and the release of the key get none. Nothing hangs: each
/// statement waits out the response timeout, the call ends with a retryable `NoAnswer`, and
/// once healed the key is not completed (nothing of the transaction committed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_during_an_exactly_once_transaction_hangs_nothing() {
    let proxy = std::sync::Arc::new(proxy().await);
    let guard = TableGuard::new();
    let store = partitioned_store(&proxy, &guard).await;
    let engine = MysqlIdempotency::new(store.clone(), Policy::default().lease(LEASE)).unwrap();
    let scope = Scope::new("partition").unwrap();
    let fp = Fingerprint::from_bytes(b"p");

    // Replies held from inside the work: the completion's statement, in the transaction,
    // gets no answer. Nothing commits.
    let key = IdempotencyKey::random();
    let cutter = proxy.clone();
    // Each statement the engine sends meanwhile waits out the response timeout: the
    // completion in the transaction, the rollback, then the release of the key (each try of
    // the settle retry).
    let statements = Policy::default().settle_retry.attempts + 2;
    let limit = TIMEOUT * statements + Duration::from_secs(10);
    let started = Instant::now();
    let out = tokio::time::timeout(
        limit,
        engine.run_in_transaction(&key, &scope, &fp, move |_tx, _ctx| {
            let cutter = cutter.clone();
            Box::pin(async move {
                cutter.hold_replies();
                Ok::<_, String>(7u32)
            })
        }),
    )
    .await
    .expect("run_in_transaction hung through the partition");
    eprintln!(
        "run_in_transaction ended after {:?}: {out:?}",
        started.elapsed()
    );
    let e = out.unwrap_err();
    assert!(no_answer(&e), "{e:?}");
    proxy.heal();
    let record = store
        .get(&RecordId::new(scope.clone(), key.clone()))
        .await
        .unwrap()
        .unwrap();
    assert_ne!(
        record.status,
        RecordStatus::Completed,
        "a transaction whose statements got no answer committed"
    );
}
