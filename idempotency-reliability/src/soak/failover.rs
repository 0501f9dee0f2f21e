//! A soak that meets one failover: whether it did (calls in flight at the crash, enough
//! answered after the recovery), and its figures.

use super::Report;
use std::future::Future;
use std::time::{Duration, Instant};

/// Calls that must be answered after the recovery for a run to count.
const ANSWERED_AFTER: usize = 500;

/// Calls a failover soak makes after the recovery before it ends
/// ([`Ending::end_after`](super::Ending::end_after)): four times what a run must have answered
/// after it, so that a run ends as soon as it has met its failover, however slowly a loaded
/// machine makes its calls.
pub const CALLS_AFTER_RECOVERY: usize = 4 * ANSWERED_AFTER;

/// What a failover must do to the history of a [`FailoverRun`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Nothing: linearizable, no double effect, no unexpected answer (a setting that keeps
    /// the promise).
    Clean,
    /// A loss the checker finds: violations or double effects, and no unexpected answer (a
    /// setting that does not keep it; the scenario bites).
    Loss,
}

/// One soak run across one failover.
#[derive(Debug)]
pub struct FailoverRun {
    /// The soak's report (the whole history checked).
    pub report: Report,
    /// Calls in flight when the primary died.
    pub spanning: usize,
    /// From the crash to the recovery (the promotion, or the switch of the address).
    pub outage: Duration,
    /// Calls answered after the recovery.
    pub answered_after: usize,
}

impl FailoverRun {
    /// The run's figures, or `None` when it ended before it met the failover: no call in
    /// flight at `crashed`, or fewer than 500 answered after `recovered` (it proves nothing
    /// about the failover then).
    pub fn measure(report: Report, crashed: Instant, recovered: Instant) -> Option<Self> {
        let spanning = report.in_flight_at(crashed);
        let answered_after = report.answered_after(recovered);
        eprintln!("{report}");
        if spanning == 0 || answered_after < ANSWERED_AFTER {
            eprintln!(
                "the run ended before it met the failover ({spanning} calls in flight at the \
                 crash, {answered_after} answered after the recovery)"
            );
            return None;
        }
        Some(Self {
            report,
            spanning,
            outage: recovered.duration_since(crashed),
            answered_after,
        })
    }

    /// Runs `once` until a run met its failover (at most five times), prints its figures
    /// under `label`, and asserts what `expect` says. A setting that must lose outcomes runs
    /// again until one did: on a loaded machine few writes may fall in the window a failover
    /// loses, and a run that lost none proves nothing either way (it must still answer
    /// nothing a correct engine never answers). A clean run whose checker left a key
    /// undecided (its search bound reached, nothing found) runs again too; anything found
    /// fails at once, and the fifth run must be clean and decided.
    pub async fn repeat<F, Fut>(label: &str, expect: Expect, mut once: F) -> Self
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<Self>>,
    {
        for run in 1..=5 {
            let ran = {
                let _heavy = heavy_run().await;
                once().await
            };
            if let Some(f) = ran {
                let r = &f.report;
                eprintln!(
                    "{label}: {} calls, {} checked, 1 failover ({:.1} s from the crash to the \
                     recovery) with {} calls in flight, {} answered after the recovery; {} \
                     failed calls (unknown), {} violations, {} double effects",
                    r.ops,
                    r.checked_ops,
                    f.outage.as_secs_f64(),
                    f.spanning,
                    f.answered_after,
                    r.backend_errors,
                    r.violations.len(),
                    r.double_effects.len(),
                );
                match expect {
                    // A key the checker could not decide within its search bound (many calls
                    // of unknown outcome around the crash make the search explode) proves
                    // nothing either way: run again, unless something was found.
                    Expect::Clean
                        if run < 5
                            && !r.undecided.is_empty()
                            && r.violations.is_empty()
                            && r.double_effects.is_empty()
                            && r.unexpected.is_empty() =>
                    {
                        eprintln!(
                            "{label}, run {run}: {} keys undecided by the checker, nothing found",
                            r.undecided.len()
                        );
                    }
                    Expect::Clean => {
                        r.assert_clean();
                        return f;
                    }
                    Expect::Loss if f.lost_something() || run == 5 => {
                        f.assert_lost_something();
                        return f;
                    }
                    Expect::Loss => {
                        assert!(r.unexpected.is_empty(), "{r}");
                        eprintln!(
                            "{label}, run {run}: the failover lost nothing the checker could see"
                        );
                    }
                }
            }
            eprintln!("{label}, run {run}: running the scenario again");
        }
        panic!("{label}: in five runs the soak never outlasted the failover");
    }

    /// Whether the checker found violations or double effects.
    pub fn lost_something(&self) -> bool {
        !self.report.violations.is_empty() || !self.report.double_effects.is_empty()
    }

    /// Asserts that the checker found what the failover lost (violations or double effects)
    /// and nothing a correct engine never answers: the scenario bites.
    pub fn assert_lost_something(&self) {
        let r = &self.report;
        assert!(r.unexpected.is_empty(), "{r}");
        assert!(
            self.lost_something(),
            "the failover lost nothing the checker could see: {r}"
        );
    }
}

/// How many heavy runs (a failover, a partition soak: servers of their own, a soak and its
/// check) a test process makes at once: `IDEMPOTENCY_HEAVY_RUNS`, 2 unless set. The
/// campaign's tests share one binary and run side by side; more heavy runs at once on a
/// small machine only slow each one down, and a scenario that must see a fault bite (a
/// failover that loses commits) then needs more runs to see it.
fn heavy_runs() -> usize {
    std::env::var("IDEMPOTENCY_HEAVY_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(2)
}

/// Waits for a turn to make a heavy run (a failover, a partition soak: servers of their own,
/// a soak and its check); the turn ends when the guard is dropped. At most
/// `IDEMPOTENCY_HEAVY_RUNS` (2 unless set) run at once in the process.
pub async fn heavy_run() -> tokio::sync::SemaphorePermit<'static> {
    static TURNS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    TURNS
        .get_or_init(|| tokio::sync::Semaphore::new(heavy_runs()))
        .acquire()
        .await
        .expect("the semaphore is never closed")
}
