//! Fault injection against Redis servers this test starts itself: a crash and restart and
//! `SCRIPT FLUSH`es in the middle of a history-checked soak, and a cancellation storm.

use idempotency_core::Scope;
use idempotency_redis::RedisStore;
use idempotency_reliability::soak::{
    soak, EngineRunner, Expect, FailoverRun, Instances, Report, Runner, SoakConfig,
    CALLS_AFTER_RECOVERY,
};
use idempotency_reliability::storm::{
    calibrate, cancellation_storm, next_calls_succeed, storm_keys_settle, StormSize,
};
use idempotency_testing::redis_server::{free_port, RedisServer, ReplicatedCluster, SentinelGroup};
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
    let answered_after = report.answered_after(last_error);
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

/// Two application instances, each with its own store (its own connection) from `connect`,
/// with `wait_for_replicas(1, 2 s)` when `wait`: a call goes to one or the other, so one
/// instance reads what the other wrote. The soak is long enough to outlast the failover and
/// the rejoin, whatever its configured length (a bound: the chaos ends the run
/// [`CALLS_AFTER_RECOVERY`] calls after the rejoin).
async fn failover_runner<F, Fut>(
    topology: &str,
    wait: bool,
    connect: F,
) -> (Arc<dyn Runner>, SoakConfig)
where
    F: Fn(idempotency_redis::RedisStoreBuilder) -> Fut,
    Fut: std::future::Future<Output = Result<RedisStore, idempotency_core::Error>>,
{
    let mut instances = Vec::new();
    for _ in 0..2 {
        let mut builder = RedisStore::builder();
        if wait {
            builder = builder.wait_for_replicas(1, Duration::from_secs(2));
        }
        let store = connect(builder)
            .await
            .unwrap_or_else(|e| panic!("connect to the {topology}: {e}"));
        instances.push(Arc::new(store) as Arc<dyn idempotency_core::IdempotencyStore>);
    }
    let suffix = if wait { "-wait" } else { "" };
    let mut config = SoakConfig::from_env(format!("redis-{topology}-failover{suffix}"));
    config.ops = config.ops.max(20_000);
    let runner: Arc<dyn Runner> = Arc::new(Instances::new(instances, config.lease));
    (runner, config)
}

/// What a failover does to the history: nothing with acknowledged writes; without, the
/// checker must find the loss.
fn expect(wait: bool) -> Expect {
    if wait {
        Expect::Clean
    } else {
        Expect::Loss
    }
}

/// How long a failover soak may run (it takes about 25 s): past it the test fails, saying
/// what became of the failover, instead of hanging the suite.
const FAILOVER_SOAK_LIMIT: Duration = Duration::from_secs(300);

/// Awaits the soak; if it has not ended within [`FAILOVER_SOAK_LIMIT`], panics with what the
/// failover task did (ended, panicked and why, or still running).
async fn soak_or_say_why<T: Send + 'static>(
    soak: impl std::future::Future<Output = Report>,
    chaos: &mut tokio::task::JoinHandle<T>,
) -> Report {
    match tokio::time::timeout(FAILOVER_SOAK_LIMIT, soak).await {
        Ok(report) => report,
        Err(_) => {
            let failover = if chaos.is_finished() {
                match chaos.await {
                    Ok(_) => "ended".to_owned(),
                    Err(e) => format!("failed: {e}"),
                }
            } else {
                "was still running".to_owned()
            };
            panic!(
                "the failover soak did not end within {FAILOVER_SOAK_LIMIT:?}; the failover task {failover}"
            );
        }
    }
}

/// A soak through a store on a Sentinel-managed primary (one replica, three Sentinels), with
/// or without `wait_for_replicas(1, …)`: 1.5 s in, the replication link is cut for a second,
/// then the primary is SIGKILLed; Sentinel
/// promotes the replica, and the crashed server comes back (empty: no persistence) as the new
/// primary's replica, so writes can be acknowledged again. `None` when the run ended before it
/// had calls in flight at the crash and 500 answered after it could write again (it proves
/// nothing then).
async fn failover_soak_once(wait: bool) -> Option<FailoverRun> {
    // The replica replicates through a proxy the test can cut.
    let (group, link) = SentinelGroup::start_with_cuttable_link().await;
    let (runner, config) = failover_runner("sentinel", wait, |builder| {
        builder.connect_sentinel(group.sentinel_urls(), &group.name)
    })
    .await;
    let ending = config.ending.clone();
    let mut chaos = tokio::task::spawn_blocking(move || {
        let mut group = group;
        std::thread::sleep(Duration::from_millis(1_500));
        // The replication link is cut for a second (a network partition between the two
        // servers), so the primary's last writes never reach the replica: it dies with them.
        link.partition();
        std::thread::sleep(Duration::from_millis(1_000));
        let crashed = Instant::now();
        let old = group.crash_primary();
        drop(link);
        let new = group.wait_for_failover(old, Duration::from_secs(60));
        let promoted = Instant::now();
        group.rejoin(old, new);
        let rejoined = Instant::now();
        ending.end_after(CALLS_AFTER_RECOVERY);
        (group, crashed, promoted, rejoined)
    });
    let report = soak_or_say_why(soak(runner, config), &mut chaos).await;
    let (_group, crashed, promoted, rejoined) = chaos.await.expect("chaos");
    // With acknowledged writes, writes are trusted again once a replica is back; without,
    // as soon as the replica is promoted.
    FailoverRun::measure(report, crashed, if wait { rejoined } else { promoted })
}

async fn failover_soak(wait: bool) -> FailoverRun {
    let label = format!(
        "redis sentinel failover, wait_for_replicas {}",
        if wait { "on" } else { "off" }
    );
    FailoverRun::repeat(&label, expect(wait), || failover_soak_once(wait)).await
}

/// With every write acknowledged by the replica before it is trusted, a failover to a replica
/// that missed the primary's last second loses no outcome a caller was told: the whole history, across the promotion,
/// is linearizable with no double effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sentinel_failover_with_acknowledged_writes_loses_nothing() {
    failover_soak(true).await;
}

/// The same failover without `wait_for_replicas`: the writes the primary acknowledged while
/// the link was cut are lost with it, so callers were told outcomes that the new primary
/// does not have (a completed key claimed and run again). The test asserts that the checker
/// finds it: the scenario does bite, so the test above proves something. Its figures are
/// the cost of asynchronous replication.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sentinel_failover_without_acknowledged_writes_loses_outcomes() {
    failover_soak(false).await;
}

/// A soak through stores on a Redis Cluster of three shards (a primary and a replica each),
/// with or without `wait_for_replicas(1, …)`: 1.5 s in, shard 0's replication stream is cut
/// (clients still reach its primary), a second later the primary is SIGKILLed; the cluster
/// promotes its replica on its own, and a fresh server joins as the new primary's replica, so
/// writes can be acknowledged again. `None` when the run ended before it had calls in flight
/// at the crash and 500 answered after the recovery (it proves nothing then).
async fn cluster_failover_soak_once(wait: bool) -> Option<FailoverRun> {
    let cluster = ReplicatedCluster::start().await;
    let (runner, config) = failover_runner("cluster", wait, |builder| {
        builder.connect_cluster(cluster.urls())
    })
    .await;
    let ending = config.ending.clone();
    let mut chaos = tokio::task::spawn_blocking(move || {
        let mut cluster = cluster;
        std::thread::sleep(Duration::from_millis(1_500));
        cluster.cut_replication(0);
        std::thread::sleep(Duration::from_millis(1_000));
        let crashed = Instant::now();
        cluster.crash_primary(0);
        cluster.wait_for_failover(0, Duration::from_secs(60));
        let promoted = Instant::now();
        cluster.rejoin(0);
        let rejoined = Instant::now();
        ending.end_after(CALLS_AFTER_RECOVERY);
        (cluster, crashed, promoted, rejoined)
    });
    let report = soak_or_say_why(soak(runner, config), &mut chaos).await;
    let (_cluster, crashed, promoted, rejoined) = chaos.await.expect("chaos");
    FailoverRun::measure(report, crashed, if wait { rejoined } else { promoted })
}

async fn cluster_failover_soak(wait: bool) -> FailoverRun {
    let label = format!(
        "redis cluster failover, wait_for_replicas {}",
        if wait { "on" } else { "off" }
    );
    FailoverRun::repeat(&label, expect(wait), || cluster_failover_soak_once(wait)).await
}

/// A Redis Cluster fails over on its own, to a replica that missed its primary's last second:
/// without `wait_for_replicas`, the writes acknowledged in that second are lost with the
/// primary, and the checker finds callers told outcomes the cluster no longer has.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_failover_without_acknowledged_writes_loses_outcomes() {
    cluster_failover_soak(false).await;
}

/// The same cluster failover with `wait_for_replicas(1, 2 s)`: each write's `WAIT` goes to
/// its shard's primary with the script, so a write the cut replica never received is not
/// trusted, and the whole history, across the promotion, is linearizable with no double
/// effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_failover_with_acknowledged_writes_loses_nothing() {
    cluster_failover_soak(true).await;
}
