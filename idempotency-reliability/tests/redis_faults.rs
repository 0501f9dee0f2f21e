//! Fault injection against Redis servers this test starts itself: a crash and restart and
//! `SCRIPT FLUSH`es in the middle of a history-checked soak, and a cancellation storm.

use idempotency_core::Scope;
use idempotency_redis::RedisStore;
use idempotency_reliability::soak::{soak, EngineRunner, Report, Runner, SoakConfig};
use idempotency_reliability::storm::{
    calibrate, cancellation_storm, next_calls_succeed, storm_keys_settle, StormSize,
};
use idempotency_testing::redis_server::{free_port, RedisServer};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn script_flush(url: &str) {
    let mut con = redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .expect("connect for SCRIPT FLUSH");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut con)
        .expect("SCRIPT FLUSH");
}

/// A soak against a server with `appendfsync always`, during which the test runs `SCRIPT
/// FLUSH`, then crashes the server (SIGKILL) and restarts it on the same port and directory,
/// then flushes the scripts again. Service resumes by itself; the flushes cost no error; and
/// since every acknowledged write was on disk, the whole history — across the restart — is
/// still linearizable with no double effect.
///
/// The crash must be noticed (a call in flight fails): a run whose crash fell between calls
/// proves nothing about it, and is run again (at most five runs); every run's history is
/// checked whole all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restart_and_script_flush_under_load() {
    for run in 1..=5 {
        if restart_and_script_flush_once().await {
            return;
        }
        eprintln!("run {run}: the crash fell between calls; running the scenario again");
    }
    panic!("the crash went unnoticed in five runs: no call was in flight when it came");
}

/// One run of [`restart_and_script_flush_under_load`]: `false` when no call noticed the crash.
async fn restart_and_script_flush_once() -> bool {
    let extra = ["--appendonly", "yes", "--appendfsync", "always"];
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let server = RedisServer::start(port, dir.path(), &extra, false)
        .expect("start redis-server on a free port");
    let url = server.url();
    let store = RedisStore::connect(url.as_str()).await.expect("connect");
    let mut config = SoakConfig::from_env("redis-restart");
    // Long enough to outlast the chaos schedule (about 3 s), whatever the soak length.
    config.ops = config.ops.max(10_000);
    let runner: Arc<dyn Runner> = Arc::new(EngineRunner::new(Arc::new(store), config.lease));

    let chaos = {
        let (url, path) = (url.clone(), dir.path().to_owned());
        tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_millis(1_000));
            script_flush(&url);
            let flushed = Instant::now();
            std::thread::sleep(Duration::from_millis(1_000));
            let crashed = Instant::now();
            server.crash();
            let server = RedisServer::start(port, &path, &extra, false)
                .unwrap_or_else(|| panic!("could not restart redis-server on port {port}"));
            let restarted = Instant::now();
            std::thread::sleep(Duration::from_millis(1_000));
            script_flush(&url);
            (server, flushed, crashed, restarted)
        })
    };
    let report = soak(runner, config).await;
    let (_server, flushed, crashed, restarted) = chaos.await.expect("chaos");
    eprintln!("{report}");
    report.assert_clean();

    // When each failed call ended: a call in flight at the crash fails after it.
    let failed: Vec<_> = report
        .events
        .iter()
        .filter(|e| Report::is_backend_error(e))
        .collect();
    let early: Vec<_> = failed
        .iter()
        .filter(|e| report.instant(e.ended) < crashed)
        .map(|e| e.note.clone())
        .collect();
    assert!(
        early.is_empty(),
        "calls failed before the crash (SCRIPT FLUSH must cost no error): {early:?}"
    );
    let errors: Vec<Instant> = failed.iter().map(|e| report.instant(e.ended)).collect();
    if errors.is_empty() {
        return false;
    }
    let last_error = errors.iter().max().copied().expect("some");
    let resumed_after = last_error.saturating_duration_since(restarted);
    assert!(
        resumed_after < Duration::from_secs(5),
        "calls still failed {resumed_after:?} after the restart"
    );
    let answered_after: usize = report
        .events
        .iter()
        .filter(|e| e.op.ret.is_some() && report.instant(e.op.call) > last_error)
        .count();
    assert!(
        answered_after >= 500,
        "only {answered_after} calls answered after the last error: the run ended too soon"
    );
    eprintln!(
        "redis restart under load: SCRIPT FLUSH at {:.1} s and after the restart, crash at {:.1} s, \
         {} calls failed (all between the crash and {:.2} s after the restart), {} answered after",
        flushed.duration_since(report.origin.expect("origin")).as_secs_f64(),
        crashed.duration_since(report.origin.expect("origin")).as_secs_f64(),
        errors.len(),
        resumed_after.as_secs_f64(),
        answered_after
    );
    true
}

/// Every call under a random 0–8 ms timeout (one in ten in an aborted task) against a server
/// of the test's own; afterwards no client is left inside MULTI, and the next 1,000 calls
/// succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancellation_storm_then_every_call_succeeds() {
    let server = RedisServer::start_anywhere(&["--appendonly", "no"]);
    let store = RedisStore::connect(server.url()).await.expect("connect");
    let lease = Duration::from_millis(300);
    let runner: Arc<dyn Runner> = Arc::new(EngineRunner::new(Arc::new(store), lease));
    let scope = Scope::new("storm|redis").expect("scope");
    // Deadlines up to 8 ms or half the measured median call, whichever is shorter: the
    // median is of new-key calls (two scripts each, a few hundred µs), while most storm calls
    // are replays of its 300 keys (one script, often quicker than that median), so longer
    // deadlines would cut off too few of them to prove anything.
    let calibration = Scope::new("storm|calibration").expect("scope");
    let median = calibrate(&runner, &calibration, 30).await;
    let deadline = Duration::from_millis(8)
        .min(median / 2)
        .max(Duration::from_micros(100));
    let report = cancellation_storm(
        runner.clone(),
        &scope,
        16,
        StormSize {
            calls: 3_000,
            min_interrupted: 301,
        },
        300,
        deadline,
    )
    .await;
    eprintln!(
        "redis storm: deadlines up to {deadline:?} (median call {median:?}): {} calls, {} \
         interrupted, {} answered",
        report.calls, report.interrupted, report.answered
    );
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(
        report.interrupted > 300,
        "the storm hardly interrupted anything"
    );
    tokio::time::sleep(lease + Duration::from_millis(200)).await;

    let mut con = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("connect");
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut con)
        .expect("CLIENT LIST");
    for line in clients.lines() {
        let flags = line
            .split(' ')
            .find_map(|f| f.strip_prefix("flags="))
            .unwrap_or("");
        assert!(!flags.contains('x'), "a client is inside MULTI: {line}");
    }

    let failures = next_calls_succeed(
        runner.clone(),
        &Scope::new("after|redis").expect("scope"),
        1_000,
        16,
    )
    .await;
    assert!(failures.is_empty(), "{failures:?}");
    let failures = storm_keys_settle(runner, &scope, 40).await;
    assert!(failures.is_empty(), "{failures:?}");
}
