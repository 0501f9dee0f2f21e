//! A Redis server that crashes and restarts mid-run, on a port of its own that the test
//! starts: the store reconnects by itself, and what survives depends on AOF.

use crate::support;

use idempotency_core::store::{Cas, Claim, ClaimRequest, Reclaim, RecordStatus};
use idempotency_core::{Error, Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope};
use idempotency_redis::RedisStore;
use std::time::{Duration, Instant};
use support::{free_port, RedisServer};

const HOUR: Duration = Duration::from_secs(3600);

fn id() -> RecordId {
    RecordId::new(
        IdempotencyKey::random(),
        Scope::new("lifecycle").expect("scope"),
    )
}

fn req(id: &RecordId) -> ClaimRequest {
    ClaimRequest::new(id.clone(), Fingerprint::from_bytes(b"payload"), HOUR, HOUR)
}

async fn claim_and_complete(store: &RedisStore, id: &RecordId, outcome: &[u8]) {
    let Claim::Claimed { token, .. } = store.claim(&req(id)).await.expect("claim") else {
        panic!("fresh key observed");
    };
    assert_eq!(
        store
            .complete(id, token, outcome, HOUR)
            .await
            .expect("complete"),
        Cas::Applied
    );
}

/// Crashes the server (SIGKILL), checks that calls fail with retryable errors while it is
/// down, restarts it on the same port and directory, and waits until the store works again.
/// Returns how many calls failed after the restart before one succeeded.
async fn crash_and_restart(
    server: RedisServer,
    store: &RedisStore,
    extra: &[&str],
) -> (RedisServer, usize) {
    let (port, dir) = (server.port, server.dir.clone());
    server.crash();
    for _ in 0..3 {
        let e = store
            .claim(&req(&id()))
            .await
            .expect_err("the server is down");
        assert!(e.is_retryable(), "a refused call must be retryable: {e:?}");
        assert!(
            matches!(e, Error::Backend { .. } | Error::OutcomeUnknown { .. }),
            "{e:?}"
        );
    }
    let server = RedisServer::start(port, &dir, extra, false)
        .unwrap_or_else(|| panic!("could not restart redis-server on port {port}"));
    let start = Instant::now();
    let mut failures = 0;
    loop {
        match store.get(&id()).await {
            Ok(_) => break,
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                failures += 1;
                assert!(
                    start.elapsed() < Duration::from_secs(15),
                    "the store did not reconnect within 15 s: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // Once reconnected, every operation succeeds (the restarted server has no cached
    // scripts: each first call goes through the NOSCRIPT fallback).
    for _ in 0..20 {
        claim_and_complete(store, &id(), b"after").await;
    }
    (server, failures)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_without_aof_reconnects_and_loses_records() {
    let extra = ["--appendonly", "no"];
    let dir = tempfile::tempdir().expect("temp dir");
    let server = RedisServer::start(free_port(), dir.path(), &extra, false)
        .expect("start redis-server on a free port");
    let store = RedisStore::connect(server.url()).await.expect("connect");
    let before = id();
    claim_and_complete(&store, &before, b"before").await;

    let (_server, failures) = crash_and_restart(server, &store, &extra).await;
    assert!(failures <= 5, "{failures} calls failed after the restart");
    assert_eq!(
        store.get(&before).await.expect("get"),
        None,
        "without AOF a restart loses every record (the README says so)"
    );
}

/// A holder whose record was lost with the dataset (a restart without AOF) cannot complete,
/// fail or extend the record a new claim makes after the restart: the new token comes from
/// the server clock, above every token issued before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_after_the_dataset_is_lost() {
    let extra = ["--appendonly", "no"];
    let dir = tempfile::tempdir().expect("temp dir");
    let server = RedisServer::start(free_port(), dir.path(), &extra, false)
        .expect("start redis-server on a free port");
    let store = RedisStore::connect(server.url()).await.expect("connect");
    let key = id();
    let Claim::Claimed { token: old, .. } = store.claim(&req(&key)).await.expect("claim") else {
        panic!("fresh key observed");
    };
    let (_server, _) = crash_and_restart(server, &store, &extra).await;
    assert_eq!(
        store.get(&key).await.expect("get"),
        None,
        "the record survived"
    );
    let Claim::Claimed { token: new, .. } = store.claim(&req(&key)).await.expect("claim") else {
        panic!("a lost record was observed");
    };
    assert!(
        new > old,
        "after the dataset was lost the key got token {new}, not above {old}"
    );
    let failure = idempotency_core::store::Failure::retryable("stale");
    assert_eq!(
        store
            .complete(&key, old, b"stale", HOUR)
            .await
            .expect("complete"),
        Cas::Fenced
    );
    assert_eq!(
        store.fail(&key, old, &failure, HOUR).await.expect("fail"),
        Cas::Fenced
    );
    assert_eq!(
        store.extend(&key, old, HOUR).await.expect("extend"),
        Cas::Fenced
    );
    let r = store.get(&key).await.expect("get").expect("the new record");
    assert_eq!((r.status, r.token), (RecordStatus::Pending, new));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_with_aof_always_keeps_records_and_their_ttl() {
    let extra = ["--appendonly", "yes", "--appendfsync", "always"];
    let dir = tempfile::tempdir().expect("temp dir");
    let server = RedisServer::start(free_port(), dir.path(), &extra, false)
        .expect("start redis-server on a free port");
    let store = RedisStore::connect(server.url()).await.expect("connect");
    let done = id();
    claim_and_complete(&store, &done, b"kept").await;
    let pending = id();
    let Claim::Claimed { token, .. } = store.claim(&req(&pending)).await.expect("claim") else {
        panic!("fresh key observed");
    };

    let (server, _) = crash_and_restart(server, &store, &extra).await;
    let rec = store.get(&done).await.expect("get").expect("survived");
    assert_eq!(rec.status, RecordStatus::Completed);
    assert_eq!(rec.outcome.as_deref(), Some(&b"kept"[..]));
    let rec = store.get(&pending).await.expect("get").expect("survived");
    assert_eq!(rec.status, RecordStatus::Pending);
    assert_eq!(rec.token, token);
    assert_eq!(
        store
            .complete(&pending, token, b"late", HOUR)
            .await
            .expect("complete"),
        Cas::Applied,
        "the holder finishes after the restart"
    );
    let mut con = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("connect");
    for rid in [&done, &pending] {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(store.record_key(rid))
            .query(&mut con)
            .expect("PTTL");
        assert!(ttl > 0, "a record lost its TTL across the restart: {ttl}");
    }
}

#[tokio::test]
async fn unreachable_server_is_a_retryable_error() {
    // Nothing listens on a port that was free a moment ago.
    let url = format!("redis://127.0.0.1:{}", free_port());
    match RedisStore::connect(url.as_str()).await {
        Err(e @ Error::Backend { .. }) => assert!(e.is_retryable(), "{e:?}"),
        other => panic!("expected a retryable backend error, got {other:?}"),
    }
}

#[tokio::test]
async fn bad_settings_are_config_errors() {
    match RedisStore::connect("mongodb://127.0.0.1").await {
        Err(Error::Config(msg)) => assert!(msg.contains("Redis"), "{msg}"),
        other => panic!("expected a config error, got {other:?}"),
    }
    let url = support::redis_url();
    for prefix in ["a{b", "}", "x\ny"] {
        match RedisStore::builder()
            .prefix(prefix)
            .connect(url.as_str())
            .await
        {
            Err(Error::Config(msg)) => assert!(!msg.is_empty()),
            other => panic!("prefix {prefix:?}: expected a config error, got {other:?}"),
        }
    }
    match RedisStore::builder()
        .response_timeout(std::time::Duration::ZERO)
        .connect(url.as_str())
        .await
    {
        Err(Error::Config(msg)) => assert!(msg.contains("response_timeout"), "{msg}"),
        other => panic!("a zero response timeout: expected a config error, got {other:?}"),
    }
    // The wait for replicas must end before the call's own timeout.
    match RedisStore::builder()
        .response_timeout(std::time::Duration::from_millis(500))
        .wait_for_replicas(1, std::time::Duration::from_secs(1))
        .connect(url.as_str())
        .await
    {
        Err(Error::Config(msg)) => assert!(msg.contains("500ms"), "{msg}"),
        other => panic!("a wait past the response timeout: expected a config error, got {other:?}"),
    }
    let store = RedisStore::builder()
        .prefix("ok:")
        .connect(url.as_str())
        .await
        .expect("valid");
    assert_eq!(store.prefix(), "ok:");
}

/// Counts per command since the last `CONFIG RESETSTAT`, from `INFO commandstats`.
fn command_calls(con: &mut redis::Connection) -> Vec<(String, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(con)
        .expect("INFO");
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// On a server of its own, each store operation reaches Redis as exactly one `EVALSHA`:
/// every other command the server counts is one the scripts run inside themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_operation_is_one_evalsha() {
    let server = RedisServer::start_anywhere(&["--appendonly", "no"]);
    let store = RedisStore::connect(server.url()).await.expect("connect");
    let mut con = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("connect");

    // Warm up: the first call of each script goes through the NOSCRIPT fallback.
    let warm = id();
    let Claim::Claimed { token, .. } = store.claim(&req(&warm)).await.expect("claim") else {
        panic!("fresh key observed");
    };
    store.extend(&warm, token, HOUR).await.expect("extend");
    store
        .fail(
            &warm,
            token,
            &idempotency_core::store::Failure::retryable("x"),
            HOUR,
        )
        .await
        .expect("fail");
    let Reclaim::Reclaimed { token, .. } = store
        .reclaim(&warm, token, &req(&warm).fingerprint, HOUR, HOUR)
        .await
        .expect("reclaim")
    else {
        panic!("reclaim lost");
    };
    store
        .complete(&warm, token, b"w", HOUR)
        .await
        .expect("complete");
    store.get(&warm).await.expect("get");

    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .expect("RESETSTAT");
    let mut ops = 0;
    for _ in 0..5 {
        let rid = id();
        let Claim::Claimed { token, .. } = store.claim(&req(&rid)).await.expect("claim") else {
            panic!("fresh key observed");
        };
        store.extend(&rid, token, HOUR).await.expect("extend");
        store
            .fail(
                &rid,
                token,
                &idempotency_core::store::Failure::retryable("x"),
                HOUR,
            )
            .await
            .expect("fail");
        let Reclaim::Reclaimed { token, .. } = store
            .reclaim(&rid, token, &req(&rid).fingerprint, HOUR, HOUR)
            .await
            .expect("reclaim")
        else {
            panic!("reclaim lost");
        };
        store
            .complete(&rid, token, b"done", HOUR)
            .await
            .expect("complete");
        store.claim(&req(&rid)).await.expect("hit");
        store.get(&rid).await.expect("get");
        ops += 7;
    }
    let calls = command_calls(&mut con);
    let inside_scripts = ["time", "type", "get", "set", "setrange"];
    for (name, n) in &calls {
        match name.as_str() {
            "evalsha" => assert_eq!(*n, ops, "{ops} operations sent {n} EVALSHA"),
            // This check's own RESETSTAT and INFO.
            "config|resetstat" | "info" => {}
            other => assert!(
                inside_scripts.contains(&other),
                "the store sent {other} ({n} calls) besides its scripts: {calls:?}"
            ),
        }
    }
    assert!(
        calls.iter().any(|(name, _)| name == "evalsha"),
        "no EVALSHA counted: {calls:?}"
    );
}
