//! Cancellation storms: every call wrapped in a random short timeout (or run in a task that
//! is aborted), so futures are dropped at every await point; then checks that the next calls
//! all succeed.

use crate::soak::{RunResult, Runner, Work, WorkFault};
use idempotency_core::{Answer, Error, Fingerprint, IdempotencyKey, Scope};
use rand::Rng;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What a storm did.
#[derive(Debug, Default)]
pub struct StormReport {
    /// Calls made.
    pub calls: usize,
    /// Calls whose future was dropped before it answered.
    pub interrupted: usize,
    /// Calls that answered in time.
    pub answered: usize,
    /// Answers that were errors other than `InProgress`/`LeaseLost` (a call that was not
    /// cancelled must not be hurt by the ones that were).
    pub errors: Vec<String>,
}

/// The key of storm key `i`.
pub fn storm_key(i: usize) -> IdempotencyKey {
    IdempotencyKey::new(format!("storm-{i:03}")).expect("valid key")
}

fn fingerprint(key: &IdempotencyKey) -> Fingerprint {
    Fingerprint::from_bytes(key.as_str().as_bytes())
}

fn unexpected(result: &RunResult) -> Option<String> {
    match result {
        Ok(_) | Err(Error::LeaseLost { .. }) => None,
        Err(e) => Some(format!("{e:?}")),
    }
}

/// How long `runner` takes per call here and now: the median of `samples` sequential calls on
/// fresh keys of `scope`, without timeouts. Storms draw their deadlines around it, so that a
/// fast disk or an idle machine still sees calls cut at every stage.
pub async fn calibrate(runner: &Arc<dyn Runner>, scope: &Scope, samples: usize) -> Duration {
    let mut took = Vec::with_capacity(samples);
    for i in 0..samples {
        let key = IdempotencyKey::random();
        let work = Work::new(1_000_000 + i as u64, WorkFault::None, Duration::ZERO);
        let started = std::time::Instant::now();
        let result = runner
            .run(key.clone(), scope.clone(), fingerprint(&key), work)
            .await;
        took.push(started.elapsed());
        if let Some(problem) = unexpected(&result) {
            panic!("calibration call failed: {problem}");
        }
    }
    took.sort_unstable();
    took.get(took.len() / 2)
        .copied()
        .unwrap_or(Duration::from_millis(1))
}

/// How much a [`cancellation_storm`] does: at least `calls` calls, and more until at least
/// `min_interrupted` of them were cut off (a fast machine or a slow one answers more calls
/// within the same deadlines), but never more than `calls` × [`StormSize::MAX_FACTOR`].
#[derive(Clone, Copy, Debug)]
pub struct StormSize {
    /// Calls made whatever happens.
    pub calls: usize,
    /// Interruptions the storm keeps going for.
    pub min_interrupted: usize,
}

impl StormSize {
    /// The bound on how far past `calls` a storm goes to reach `min_interrupted`.
    pub const MAX_FACTOR: usize = 20;
}

/// `workers` tasks make calls over `keys` keys (as many as `size` says), each under a timeout
/// drawn from `0..max_deadline` (one in ten instead runs in a task aborted after that delay).
/// The work itself takes 0–2 ms, so the drops land before, during and after it.
pub async fn cancellation_storm(
    runner: Arc<dyn Runner>,
    scope: &Scope,
    workers: usize,
    size: StormSize,
    keys: usize,
    max_deadline: Duration,
) -> StormReport {
    let next = Arc::new(AtomicUsize::new(0));
    let interrupted = Arc::new(AtomicUsize::new(0));
    let max_calls = size.calls.saturating_mul(StormSize::MAX_FACTOR);
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let (runner, scope, next, interrupted) = (
                runner.clone(),
                scope.clone(),
                next.clone(),
                interrupted.clone(),
            );
            tokio::spawn(async move {
                let mut report = StormReport::default();
                loop {
                    let seq = next.fetch_add(1, Ordering::Relaxed);
                    let enough = interrupted.load(Ordering::Relaxed) >= size.min_interrupted;
                    if seq >= max_calls || (seq >= size.calls && enough) {
                        return report;
                    }
                    let (key, deadline, work_ms, abort) = {
                        let mut rng = rand::thread_rng();
                        (
                            storm_key(rng.gen_range(0..keys)),
                            max_deadline.mul_f64(rng.gen::<f64>()),
                            rng.gen_range(0..2_000),
                            rng.gen_bool(0.1),
                        )
                    };
                    let work = Work::new(
                        seq as u64 + 1,
                        WorkFault::None,
                        Duration::from_micros(work_ms),
                    );
                    let call = runner.run(key.clone(), scope.clone(), fingerprint(&key), work);
                    report.calls += 1;
                    let answer = if abort {
                        let task = tokio::spawn(call);
                        tokio::time::sleep(deadline).await;
                        task.abort();
                        task.await.ok()
                    } else {
                        tokio::time::timeout(deadline, call).await.ok()
                    };
                    match answer {
                        Some(result) => {
                            report.answered += 1;
                            report.errors.extend(unexpected(&result));
                        }
                        None => {
                            report.interrupted += 1;
                            interrupted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    let mut total = StormReport::default();
    for t in tasks {
        let r = t.await.expect("a storm worker panicked");
        total.calls += r.calls;
        total.interrupted += r.interrupted;
        total.answered += r.answered;
        total.errors.extend(r.errors);
    }
    total
}

/// `n` calls on fresh keys, `concurrency` at a time, with no timeout: every one must run its
/// work and answer `Executed(Ok)` with its own value. Returns the failures.
pub async fn next_calls_succeed(
    runner: Arc<dyn Runner>,
    scope: &Scope,
    n: usize,
    concurrency: usize,
) -> Vec<String> {
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (runner, scope, next) = (runner.clone(), scope.clone(), next.clone());
            tokio::spawn(async move {
                let mut failures = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return failures;
                    }
                    let key = IdempotencyKey::new(format!("after-{i:05}")).expect("valid key");
                    let value = 1_000_000 + i as u64;
                    let work = Work::new(value, WorkFault::None, Duration::ZERO);
                    match runner
                        .run(key.clone(), scope.clone(), fingerprint(&key), work)
                        .await
                    {
                        Ok(Answer::Executed(Ok(v))) if v == value => {}
                        other => failures.push(format!("{key}: {other:?}")),
                    }
                }
            })
        })
        .collect();
    let mut failures = Vec::new();
    for t in tasks {
        failures.extend(t.await.expect("a worker panicked"));
    }
    failures
}

/// Runs every storm key once more, with no timeout (call it once the storm's leases have
/// passed): each must answer `Ok`, fresh or replayed. Returns the failures.
pub async fn storm_keys_settle(runner: Arc<dyn Runner>, scope: &Scope, keys: usize) -> Vec<String> {
    let mut failures = Vec::new();
    for i in 0..keys {
        let key = storm_key(i);
        let work = Work::new(2_000_000 + i as u64, WorkFault::None, Duration::ZERO);
        match runner
            .run(key.clone(), scope.clone(), fingerprint(&key), work)
            .await
        {
            Ok(Answer::Executed(Ok(_)) | Answer::Replayed(Ok(_))) => {}
            other => failures.push(format!("{key}: {other:?}")),
        }
    }
    failures
}
