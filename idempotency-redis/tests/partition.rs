//! A network partition between the store and Redis, made on demand by a proxy in front of
//! the shared server: no call hangs past the connection's 5 s response timeout, each ends in
//! a defined outcome (a write whose answer did not come is an unknown outcome, a read a
//! retryable error), and once the partition heals the store works again on the same
//! connection and shows what really happened.
#![allow(clippy::unwrap_used)]

use idempotency_core::{
    Cas, Claim, ClaimRequest, Error, FencingToken, Fingerprint, IdempotencyKey, IdempotencyStore,
    RecordId, RecordStatus, Scope,
};
use idempotency_redis::RedisStore;
use idempotency_testing::partition::PartitionProxy;
use idempotency_testing::redis_server::{redis_url, unique_prefix, Cleanup};
use std::time::{Duration, Instant};

// The response timeout `RedisStore::connect` sets.
const TIMEOUT: Duration = Duration::from_secs(5);
const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);

fn id() -> RecordId {
    RecordId::new(Scope::new("partition").unwrap(), IdempotencyKey::random())
}

fn request(id: &RecordId) -> ClaimRequest {
    ClaimRequest::new(id.clone(), Fingerprint::from_bytes(b"p"), LEASE, TTL)
}

async fn claimed(store: &RedisStore, id: &RecordId) -> FencingToken {
    match store.claim(&request(id)).await.unwrap() {
        Claim::Claimed { token, .. } => token,
        other => panic!("a fresh key was found: {other:?}"),
    }
}

/// Runs `call`, which must end (whatever its answer) within the response timeout and a
/// generous margin, and not before it.
async fn bounded<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    let started = Instant::now();
    let out = tokio::time::timeout(TIMEOUT + Duration::from_secs(10), call)
        .await
        .unwrap_or_else(|_| panic!("{what} hung through the partition"));
    assert!(
        started.elapsed() >= TIMEOUT - Duration::from_millis(100),
        "{what} answered before its timeout, through a partition"
    );
    out
}

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
        .connect(format!("redis://{}", proxy.addr()))
        .await
        .unwrap();

    // Cut before the completion's answer comes back: unknown to the caller.
    let cut = id();
    let token = claimed(&store, &cut).await;
    proxy.partition();
    let e = bounded("complete", store.complete(&cut, token, b"done", TTL))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::OutcomeUnknown { .. }), "{e:?}");
    // A read is worth trying again; a claim without an answer may have taken the key (its
    // Pending record then holds it until the lease passes): unknown.
    let e = bounded("get", store.get(&cut)).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Backend {
                retryable: true,
                ..
            }
        ),
        "{e:?}"
    );
    let e = bounded("claim", store.claim(&request(&id())))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::OutcomeUnknown { .. }), "{e:?}");
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

    // The late answers of the calls that timed out are not taken for later calls' answers:
    // many calls on the healed connection all answer correctly.
    for _ in 0..50 {
        let k = id();
        let token = claimed(&store, &k).await;
        assert_eq!(
            store.complete(&k, token, b"done", TTL).await.unwrap(),
            Cas::Applied
        );
        let r = store.get(&k).await.unwrap().unwrap();
        assert_eq!((r.status, r.token), (RecordStatus::Completed, token));
    }
}
