//! `RedisStoreBuilder::wait_for_replicas`: every write and read is followed, in the same round trip,
//! by `WAIT`, and a write (or what a read saw) fewer replicas acknowledged than asked is not trusted. A primary
//! and a replica of the test's own run on free loopback ports; the replica is killed mid-run
//! and a new one attached.
#![allow(clippy::unwrap_used)]

use idempotency_core::store::{Cas, Claim, ClaimRequest, RecordStatus};
use idempotency_core::{Error, Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope};
use idempotency_redis::{redis, RedisStore};
use idempotency_testing::redis_server::RedisServer;
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);
// Generous: a live replica on a loaded machine must always acknowledge within it.
const ACK_TIMEOUT: Duration = Duration::from_secs(2);

fn request(id: &RecordId) -> ClaimRequest {
    ClaimRequest::new(id.clone(), Fingerprint::from_bytes(b"p"), LEASE, TTL)
}

fn id() -> RecordId {
    RecordId::new(IdempotencyKey::random(), Scope::new("replicas").unwrap())
}

/// A connection of its own to `server`.
fn connection(server: &RedisServer) -> redis::Connection {
    redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap()
}

/// Starts a replica of `primary` and waits until its link is up and it has synced.
fn replica_of(primary: &RedisServer) -> RedisServer {
    let port = primary.port.to_string();
    let replica = RedisServer::start_anywhere(&["--replicaof", "127.0.0.1", &port]);
    let mut conn = connection(&replica);
    let start = Instant::now();
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut conn)
            .unwrap();
        if info.contains("master_link_status:up") && !info.contains("master_sync_in_progress:1") {
            return replica;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the replica never synced: {info}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn exists_on(server: &RedisServer, key: &str) -> bool {
    let mut conn = connection(server);
    redis::cmd("EXISTS")
        .arg(key)
        .query::<i64>(&mut conn)
        .unwrap()
        == 1
}

async fn claimed(store: &RedisStore, id: &RecordId) -> idempotency_core::FencingToken {
    match store.claim(&request(id)).await.unwrap() {
        Claim::Claimed { token, .. } => token,
        other => panic!("a fresh key was found: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_wait_for_replicas_and_an_unacknowledged_write_is_not_trusted() {
    let primary = RedisServer::start_anywhere(&[]);
    let replica = replica_of(&primary);
    let store = RedisStore::builder()
        .wait_for_replicas(1, ACK_TIMEOUT)
        .connect(primary.url())
        .await
        .unwrap();
    let plain = RedisStore::connect(primary.url()).await.unwrap();

    // Acknowledged: once the call returns, the replica has the write.
    let done = id();
    let token = claimed(&store, &done).await;
    assert!(exists_on(&replica, &store.record_key(&done)));
    assert_eq!(
        store.complete(&done, token, b"outcome", TTL).await.unwrap(),
        Cas::Applied
    );
    let held = id();
    let held_token = claimed(&store, &held).await;

    // The replica dies: no write is trusted any more.
    replica.crash();
    let fresh = id();
    let refused = store.claim(&request(&fresh)).await.unwrap_err();
    assert!(
        matches!(
            refused,
            Error::Backend {
                retryable: true,
                ..
            }
        ),
        "a claim no replica acknowledged is a retryable error: {refused:?}"
    );
    let unknown = store
        .complete(&held, held_token, b"outcome", TTL)
        .await
        .unwrap_err();
    assert!(
        matches!(unknown, Error::OutcomeUnknown { .. }),
        "a completion no replica acknowledged is an unknown outcome: {unknown:?}"
    );
    // Reads are not trusted either: `WAIT` after a read waits for every write the server
    // had when it ran, and the unacknowledged completion above is one of them. (A record
    // another instance read now could be gone after a failover.)
    for refused in [
        store.get(&done).await.map(|_| ()),
        store.claim(&request(&done)).await.map(|_| ()),
    ] {
        let e = refused.unwrap_err();
        assert!(
            matches!(
                e,
                Error::Backend {
                    retryable: true,
                    ..
                }
            ) && e
                .find_source::<idempotency_redis::NotAcknowledged>()
                .is_some(),
            "a read no replica acknowledged is a retryable error: {e:?}"
        );
    }
    // Through the engine: the claim is refused before the work could run.
    let engine = idempotency_core::Idempotency::new(
        std::sync::Arc::new(store.clone()),
        idempotency_core::Policy::default(),
    )
    .unwrap();
    let ran = std::sync::atomic::AtomicBool::new(false);
    let through = engine
        .run(
            &IdempotencyKey::random(),
            &Scope::new("replicas").unwrap(),
            &Fingerprint::from_bytes(b"p"),
            |_ctx| async {
                ran.store(true, std::sync::atomic::Ordering::SeqCst);
                Ok::<u32, String>(1)
            },
        )
        .await;
    assert!(through.is_err(), "{through:?}");
    assert!(
        !ran.load(std::sync::atomic::Ordering::SeqCst),
        "the work ran"
    );
    // A store without the option does not wait.
    assert!(matches!(
        plain.claim(&request(&id())).await.unwrap(),
        Claim::Claimed { .. }
    ));

    // A new replica attaches: writes are trusted again, also after the primary forgot its
    // scripts (the pipeline falls back to EVAL). The completion that was not trusted had
    // applied on the primary: the new replica has it, and the engine's read-back of a retry
    // finds this holder's Completed record.
    let replica = replica_of(&primary);
    let mut admin = connection(&primary);
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query::<()>(&mut admin)
        .unwrap();
    let again = id();
    let token = claimed(&store, &again).await;
    assert!(exists_on(&replica, &store.record_key(&again)));
    assert_eq!(
        store
            .complete(&again, token, b"outcome", TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
    let r = store.get(&held).await.unwrap().unwrap();
    assert_eq!((r.status, r.token), (RecordStatus::Completed, held_token));
    assert!(exists_on(&replica, &store.record_key(&held)));
}

/// The key of a record's acknowledgement marker: the record's key and `!ack`.
fn marker_of(store: &RedisStore, id: &RecordId) -> String {
    format!("{}!ack", store.record_key(id))
}

/// From Redis 7.2 (and on Valkey) `WAIT` covers only the writes of the connection it is sent
/// on: after a call that only read, it would answer at once, and a completion another
/// instance wrote could be replayed before any replica had it. So every call writes a marker
/// of its own after what it read, and `WAIT` acknowledges that write: when a read returns, the
/// replica has the marker, which the primary wrote after the record the read saw. (The
/// machine's Redis is 7.0, where `WAIT` after a read also waits: this checks the marker that
/// makes the read path independent of the version.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_is_acknowledged_through_a_write_of_its_own() {
    let primary = RedisServer::start_anywhere(&[]);
    let replica = replica_of(&primary);
    let connect = || {
        RedisStore::builder()
            .wait_for_replicas(1, ACK_TIMEOUT)
            .connect(primary.url())
    };
    // Two instances: one writes the record, the other (a connection that never wrote it)
    // only reads it.
    let (writer, reader) = (connect().await.unwrap(), connect().await.unwrap());
    let done = id();
    let token = claimed(&writer, &done).await;
    assert_eq!(
        writer
            .complete(&done, token, b"outcome", TTL)
            .await
            .unwrap(),
        Cas::Applied
    );

    let read = reader.get(&done).await.unwrap().unwrap();
    assert_eq!(read.status, RecordStatus::Completed);
    assert!(
        exists_on(&replica, &marker_of(&reader, &done)),
        "a get was answered with no write of its own acknowledged"
    );
    redis::cmd("DEL")
        .arg(marker_of(&reader, &done))
        .query::<i64>(&mut connection(&primary))
        .unwrap();
    // A claim that found the completion (the replay's read; counting no hit, so its script
    // writes nothing), then the same in a batch.
    let uncounted = |id: &RecordId| request(id).with_count_hit(false);
    assert!(matches!(
        reader.claim(&uncounted(&done)).await.unwrap(),
        Claim::Existing { record, .. } if record.status == RecordStatus::Completed
    ));
    assert!(
        exists_on(&replica, &marker_of(&reader, &done)),
        "a claim that found the key was answered with no write of its own acknowledged"
    );
    let other = id();
    let token = claimed(&writer, &other).await;
    assert_eq!(
        writer
            .complete(&other, token, b"outcome", TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
    let found = reader.claim_many(&[uncounted(&other)]).await;
    assert!(
        matches!(
            found.as_slice(),
            [Ok(Claim::Existing { record, .. })] if record.status == RecordStatus::Completed
        ),
        "{found:?}"
    );
    assert!(
        exists_on(&replica, &marker_of(&reader, &other)),
        "a batch's claim that found the key was answered with no write of its own acknowledged"
    );
    // The marker is no record: reading the record still works, and the marker goes away.
    let mut conn = connection(&primary);
    let ttl: i64 = redis::cmd("PTTL")
        .arg(marker_of(&reader, &other))
        .query(&mut conn)
        .unwrap();
    assert!(
        ttl > 0 && ttl <= 10_000,
        "the marker lives at most 10 s: {ttl}"
    );
    assert_eq!(
        reader.get(&other).await.unwrap().unwrap().status,
        RecordStatus::Completed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_is_refused_past_the_response_timeout_and_without_replicas() {
    let too_long = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_secs(60))
        .connect("redis://127.0.0.1:6379")
        .await
        .unwrap_err();
    assert!(matches!(too_long, Error::Config(_)), "{too_long:?}");
    let none = RedisStore::builder()
        .wait_for_replicas(0, ACK_TIMEOUT)
        .connect("redis://127.0.0.1:6379")
        .await
        .unwrap_err();
    assert!(matches!(none, Error::Config(_)), "{none:?}");
}

/// On a cluster, `WAIT` goes with its script to the primary of the record's slot and counts
/// that shard's replicas: on the shared cluster, whose shards have none, every write lands
/// on the right primary (no `CROSSSLOT`, no redirect loop) and none is trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_write_no_replica_of_its_shard_acknowledged_is_not_trusted() {
    let cluster = idempotency_testing::redis_server::shared_cluster();
    let store = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_millis(100))
        .connect_cluster(cluster.urls())
        .await
        .unwrap();
    let plain = RedisStore::connect_cluster(cluster.urls()).await.unwrap();
    let mut slots = std::collections::HashSet::new();
    // Enough keys to reach every shard.
    for _ in 0..30 {
        let fresh = id();
        slots.insert(redis::cluster_routing::get_slot(store.record_key(&fresh).as_bytes()) / 5462);
        let refused = store.claim(&request(&fresh)).await.unwrap_err();
        assert!(
            matches!(
                refused,
                Error::Backend {
                    retryable: true,
                    ..
                }
            ),
            "a claim no replica acknowledged is a retryable error: {refused:?}"
        );
        assert!(
            refused.to_string().contains("not trusted"),
            "the error says why: {refused}"
        );
        // The script ran on the key's primary: the Pending record is there.
        assert_eq!(
            plain.get(&fresh).await.unwrap().map(|r| r.status),
            Some(RecordStatus::Pending)
        );
    }
    assert_eq!(slots.len(), 3, "the keys reached every shard");
}
