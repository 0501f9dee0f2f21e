//! Fault injection against DynamoDB (the local stand-in): a stand-in of the test's own crashed
//! (SIGKILL) and started again in the middle of a history-checked soak. (Throttling and lost
//! answers run in `tests/it/soak.rs`, `soak_dynamodb_flaky_network`.)

use idempotency_core::store::SystemClock;
use idempotency_reliability::soak::{soak, EngineRunner, Report, Runner, SoakConfig, OPS_VAR};
use idempotency_testing::dynamodb::{free_port, store_at, MotoServer};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a stand-in may take to start (moto imports slowly; a restart replays its
/// journal first).
const START: Duration = Duration::from_secs(60);

/// The calls of one run: several times what the crash, the restart and the 500 calls
/// answered after it take on a loaded machine.
const RESTART_OPS: usize = 3_000;

/// A soak of [`RESTART_OPS`] calls (or `IDEMPOTENCY_SOAK_OPS`, if more) against a stand-in the
/// test starts with a journal (every acknowledged write synced before its answer, replayed at
/// start, as DynamoDB keeps what it acknowledged); at 1.5 s it is SIGKILLed and started again on the same port and
/// journal. No call may fail before the crash, none later than 10 s after the restart, and
/// the whole history, across the restart, must be linearizable with no double effect. A run
/// whose crash came after the soak proves nothing about it and is run again (at most five
/// runs); every run's history is checked whole all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restart_mid_soak() {
    for run in 1..=5 {
        let _heavy = idempotency_reliability::soak::heavy_run().await;
        if restart_mid_soak_once().await {
            return;
        }
        eprintln!("run {run}: the soak did not outlast the crash; running the scenario again");
    }
    panic!("in five runs the soak never outlasted the crash and the restart");
}

/// One run of [`restart_mid_soak`]: `false` when no call noticed the crash.
async fn restart_mid_soak_once() -> bool {
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let port = free_port();
    let server = MotoServer::start(port, Some(&journal), START).await;
    let store = store_at(&server.url(), Arc::new(SystemClock))
        .await
        .expect("a table on the test's stand-in");
    let mut config = SoakConfig::from_env("dynamodb-restart");
    // Long enough to outlast the crash at 1.5 s and the restart, then answer 500 calls (a run
    // that did not is run again, below), unless `IDEMPOTENCY_SOAK_OPS` asks for a longer one.
    // On one stand-in that syncs every write to its journal the default soak length took
    // four minutes, most of it after the restart had been proved.
    config.ops = match std::env::var(OPS_VAR) {
        Ok(_) => config.ops.max(RESTART_OPS),
        Err(_) => RESTART_OPS,
    };
    let runner: Arc<dyn Runner> = Arc::new(EngineRunner::new(Arc::new(store), config.lease));
    let chaos = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let crashed = Instant::now();
        server.crash();
        let server = MotoServer::start(port, Some(&journal), START).await;
        (server, crashed, Instant::now(), dir)
    });
    let report = soak(runner, config).await;
    let (_server, crashed, restarted, _dir) = chaos.await.expect("chaos");
    eprintln!("{report}");
    report.assert_clean();
    let failed: Vec<Instant> = report
        .events
        .iter()
        .filter(|e| Report::is_backend_error(e))
        .map(|e| report.instant(e.ended))
        .collect();
    let early = failed.iter().filter(|t| **t < crashed).count();
    assert_eq!(early, 0, "{early} calls failed before the crash");
    let spanning = report.in_flight_at(crashed);
    let answered_after = report.answered_after(restarted);
    if spanning == 0 || answered_after < 500 {
        // The run ended before (or just as) the crash came: it proves nothing about it.
        return false;
    }
    if let Some(last_error) = failed.iter().max() {
        let resumed_after = last_error.saturating_duration_since(restarted);
        assert!(
            resumed_after < Duration::from_secs(10),
            "calls still failed {resumed_after:?} after the restart"
        );
    }
    eprintln!(
        "dynamodb restart under load: crash at {:.1} s with {spanning} calls in flight, \
         restarted {:.1} s later; {} calls failed, {answered_after} answered after the restart",
        crashed
            .duration_since(report.origin.expect("origin"))
            .as_secs_f64(),
        restarted.duration_since(crashed).as_secs_f64(),
        failed.len(),
    );
    true
}
