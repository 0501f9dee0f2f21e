//! `RedisStoreBuilder::connect_sentinel`: the store finds the primary through Sentinel, and
//! finds the new one after a failover, whether the old primary died (SIGKILL) or was demoted
//! by a manual failover. A primary, a replica and three Sentinels of the test's own run on
//! free loopback ports.
#![allow(clippy::unwrap_used)]

use idempotency_core::store::{Cas, Claim, ClaimRequest, RecordStatus};
use idempotency_core::{
    Error, FencingToken, Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope,
};
use idempotency_redis::{redis, NotAcknowledged, RedisStore};
use idempotency_testing::redis_server::SentinelGroup;
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);
// Generous: a live replica on a loaded machine must always acknowledge within it.
const ACK_TIMEOUT: Duration = Duration::from_secs(2);
// Sentinel takes the primary for down after 1 s; the election and promotion follow.
const FAILOVER_LIMIT: Duration = Duration::from_secs(60);

fn request(id: &RecordId) -> ClaimRequest {
    ClaimRequest::new(id.clone(), Fingerprint::from_bytes(b"p"), LEASE, TTL)
}

fn id() -> RecordId {
    RecordId::new(IdempotencyKey::random(), Scope::new("sentinel").unwrap())
}

async fn claimed(store: &RedisStore, id: &RecordId) -> FencingToken {
    match store.claim(&request(id)).await.unwrap() {
        Claim::Claimed { token, .. } => token,
        other => panic!("a fresh key was found: {other:?}"),
    }
}

async fn completed(store: &RedisStore) -> RecordId {
    let done = id();
    let token = claimed(store, &done).await;
    assert_eq!(
        store.complete(&done, token, b"outcome", TTL).await.unwrap(),
        Cas::Applied
    );
    done
}

/// Calls `store.get` until it answers, asserting that every failure meanwhile was a
/// retryable error (never a wrong answer); returns the answer and the failures seen.
async fn get_until_answered(
    store: &RedisStore,
    id: &RecordId,
) -> (Option<idempotency_core::store::Record>, usize) {
    let start = Instant::now();
    let mut failures = 0;
    loop {
        match store.get(id).await {
            Ok(r) => return (r, failures),
            Err(
                e @ Error::Backend {
                    retryable: true, ..
                },
            ) => {
                failures += 1;
                assert!(
                    start.elapsed() < FAILOVER_LIMIT,
                    "the store never reached the new primary: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("a read during the failover failed with a non-retryable error: {e:?}"),
        }
    }
}

fn sentinel_store_builder() -> idempotency_redis::RedisStoreBuilder {
    RedisStore::builder().wait_for_replicas(1, ACK_TIMEOUT)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_is_replaced_and_acknowledged_writes_survive() {
    let mut group = tokio::task::spawn_blocking(SentinelGroup::start)
        .await
        .unwrap();
    let store = sentinel_store_builder()
        .connect_sentinel(group.sentinel_urls(), &group.name)
        .await
        .unwrap();
    assert!(format!("{store:?}").contains("sentinel"));

    // Written and acknowledged by the replica before the primary dies.
    let done = completed(&store).await;
    let held = id();
    let held_token = claimed(&store, &held).await;

    let (old, group) = tokio::task::spawn_blocking(move || {
        let old = group.crash_primary();
        (old, group)
    })
    .await
    .unwrap();
    let (new, mut group) = tokio::task::spawn_blocking(move || {
        let new = group.wait_for_failover(old, FAILOVER_LIMIT);
        (new, group)
    })
    .await
    .unwrap();
    assert_ne!(new, old);
    // Until a replica is back, nothing the new primary has can be acknowledged: reads are
    // refused too (retryably). The crashed server rejoins as the new primary's replica.
    let start = Instant::now();
    loop {
        match store.get(&done).await {
            Err(
                e @ Error::Backend {
                    retryable: true, ..
                },
            ) => {
                if e.find_source::<NotAcknowledged>().is_some() {
                    break;
                }
                // Still on the dead primary's connection, or looking for the new one.
                assert!(start.elapsed() < FAILOVER_LIMIT, "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("a read no replica acknowledged was answered: {other:?}"),
        }
    }
    let group = tokio::task::spawn_blocking(move || {
        group.rejoin(old, new);
        group
    })
    .await
    .unwrap();
    let (answer, failures) = get_until_answered(&store, &done).await;
    let record = answer.expect("an acknowledged completion survives the failover");
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(record.outcome.as_deref(), Some(&b"outcome"[..]));
    eprintln!(
        "failover from port {old} to {new}; {failures} reads failed (retryable) after the rejoin"
    );

    // The held key is still held by its holder, whose completion reaches the new primary.
    assert!(matches!(
        store.claim(&request(&held)).await.unwrap(),
        Claim::Existing { .. }
    ));
    assert_eq!(
        store
            .complete(&held, held_token, b"late", TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
    // New keys are claimed on the new primary.
    completed(&store).await;
    drop(group);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_sends_the_store_to_the_new_one() {
    let group = tokio::task::spawn_blocking(SentinelGroup::start)
        .await
        .unwrap();
    // No WAIT: after the switch the demoted primary is the only replica, and it may still
    // be syncing.
    let store = RedisStore::builder()
        .connect_sentinel(group.sentinel_urls(), &group.name)
        .await
        .unwrap();
    let done = completed(&store).await;
    let old = group.primary_port().unwrap();

    // A graceful failover: the old primary stays up, as a replica, and refuses writes.
    let group = tokio::task::spawn_blocking(move || {
        let mut conn = redis::Client::open(group.sentinel_urls()[0].as_str())
            .unwrap()
            .get_connection()
            .unwrap();
        let _: () = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(&group.name)
            .query(&mut conn)
            .unwrap();
        group.wait_for_failover(old, FAILOVER_LIMIT);
        // Until Sentinel reconfigures it, the old primary still takes writes (a write there
        // now would be lost): the case here is the one after, when it refuses them.
        group.wait_for_role(old, "slave", FAILOVER_LIMIT);
        group
    })
    .await
    .unwrap();

    // The store's connection still goes to the old primary, which closed it when it was
    // demoted (Redis 7; older servers keep it open and refuse writes with `READONLY`). A
    // read there fails or answers from the replica; a write is refused, retryably; either
    // way the store then asks the Sentinels again and reaches the new primary.
    let (answer, mut failed) = get_until_answered(&store, &done).await;
    assert_eq!(answer.unwrap().status, RecordStatus::Completed);
    let start = Instant::now();
    let fresh = loop {
        let fresh = id();
        match store.claim(&request(&fresh)).await {
            Ok(Claim::Claimed { token, .. }) => break (fresh, token),
            Ok(other) => panic!("a fresh key was found: {other:?}"),
            Err(Error::Backend {
                retryable: true, ..
            }) => {
                failed += 1;
                assert!(
                    start.elapsed() < FAILOVER_LIMIT,
                    "the store never reached the new primary"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("a claim after the switch failed with a non-retryable error: {e:?}"),
        }
    };
    assert!(
        failed >= 1,
        "no call failed on the demoted primary's connection: the test did not test the switch"
    );
    assert_eq!(
        store
            .complete(&fresh.0, fresh.1, b"outcome", TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
    let record = store.get(&done).await.unwrap().unwrap();
    assert_eq!(record.status, RecordStatus::Completed);
    drop(group);
}

#[tokio::test]
async fn no_sentinel_answering_is_a_retryable_connect_error() {
    let port = idempotency_testing::redis_server::free_port();
    let err = RedisStore::builder()
        .connect_sentinel([format!("redis://127.0.0.1:{port}")], "nobody")
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Backend {
                retryable: true,
                ..
            }
        ),
        "{err:?}"
    );
}

/// One instance completes a key while the replication link is cut; another instance claims
/// the key meanwhile. The completion is on the primary only, so the second instance must not
/// trust it: if it answered with the outcome (a replay) and the primary then died, the new
/// primary would hold the key as Pending, and once the lease passed the work would run again
/// behind an outcome a client was already given. With `wait_for_replicas`, an observation is
/// trusted only once a replica has everything it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_completion_is_not_replayed_by_another_instance() {
    let (group, link) = SentinelGroup::start_with_cuttable_link().await;
    let writer = sentinel_store_builder()
        .connect_sentinel(group.sentinel_urls(), &group.name)
        .await
        .unwrap();
    let reader = sentinel_store_builder()
        .connect_sentinel(group.sentinel_urls(), &group.name)
        .await
        .unwrap();
    // Both instances have run every script once, so nothing waits on a script load later.
    completed(&writer).await;
    let warm = id();
    reader.claim(&request(&warm)).await.unwrap();
    let key = id();
    let token = claimed(&writer, &key).await;

    link.partition();
    let completion = {
        let (writer, key) = (writer.clone(), key.clone());
        tokio::spawn(async move { writer.complete(&key, token, b"outcome", TTL).await })
    };
    // Until the completion reached the primary, the reader sees the key Pending; then it must
    // see an error, never the completed outcome.
    let start = Instant::now();
    let observed = loop {
        let claim = reader.claim(&request(&key).with_count_hit(false)).await;
        match claim {
            Ok(Claim::Existing { record, .. }) if record.status == RecordStatus::Pending => {
                assert!(
                    start.elapsed() < FAILOVER_LIMIT,
                    "the completion never reached the primary"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            other => break other,
        }
    };
    assert!(
        matches!(
            observed,
            Err(Error::Backend {
                retryable: true,
                ..
            })
        ),
        "a completion no replica has was trusted by another instance: {observed:?}"
    );
    let unknown = completion.await.unwrap().unwrap_err();
    assert!(
        matches!(unknown, Error::OutcomeUnknown { .. }),
        "{unknown:?}"
    );

    // What trusting it would have cost: the primary dies with the completion.
    let group = tokio::task::spawn_blocking(move || {
        let mut group = group;
        let old = group.crash_primary();
        drop(link);
        let new = group.wait_for_failover(old, FAILOVER_LIMIT);
        group.rejoin(old, new);
        group
    })
    .await
    .unwrap();
    let (after, _) = get_until_answered(&reader, &key).await;
    assert_eq!(after.unwrap().status, RecordStatus::Pending);
    drop(group);
}
