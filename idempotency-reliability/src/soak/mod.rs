//! The history-checked soak: concurrent workers call the engine on a few hot keys at a time
//! while failures are injected at random; every call is recorded with its invocation and
//! response times, then each key's history is checked against [`OnceRegister`] and the
//! committed effects are counted.

use crate::checker::{check, Operation, Verdict};
use crate::faults::{FaultRig, Injected, StoreFaults};
use crate::http::HttpPath;
use crate::ledger::{self, ExecEnd, Execution, SeenCompleted};
use crate::model::{Call, ExpiringOnceRegister, OnceRegister, Response, Timed};
use futures::future::BoxFuture;
use idempotency_conformance::Fault;
use idempotency_core::protocol::decode_replay;
use idempotency_core::store::RecordStatus;
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId,
    Scope, WorkContext,
};
use idempotency_tower::StoredResponse;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

mod check;
mod failover;
mod run;

pub use crate::faults::WorkFault;
pub use failover::{heavy_run, Expect, FailoverRun, CALLS_AFTER_RECOVERY};
pub use run::soak;

/// The env var that sets the number of operations of a soak run.
pub const OPS_VAR: &str = "IDEMPOTENCY_SOAK_OPS";
/// The env var that fixes the seed of the fault schedule (random by default; printed).
pub const SEED_VAR: &str = "IDEMPOTENCY_SOAK_SEED";
/// Operations per run when [`OPS_VAR`] is not set.
pub const DEFAULT_OPS: usize = 10_000;

/// What an injected panic says; the soak's panic hook keeps these out of the test output.
pub const PANIC_MARKER: &str = "injected panic (reliability soak)";

/// How a runner's work begins its error when its own business write failed (the connection
/// died under it, say): the transaction rolled back and the engine released the key, an
/// answer the soak expects when [`SoakConfig::business_writes_may_fail`] says so.
pub const BUSINESS_WRITE_FAILED: &str = "the business write failed";

/// The clock skew allowed between the soak's clock and the store's (whose timestamps have
/// millisecond resolution), in nanoseconds.
pub const CLOCK_SKEW: u64 = 5_000_000;

/// Which records a call goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Space {
    /// The engine's keys ([`SoakConfig::keys`]), kept far beyond the run.
    Engine,
    /// The HTTP layer's keys ([`SoakConfig::http_keys`]).
    Http,
    /// Keys whose records are kept for [`SoakConfig::short_ttl`] only, purged while claimed.
    Short,
}

/// How a call is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CallMode {
    /// Run the work through the engine and wait for the answer.
    Run,
    /// Read the record (`IdempotencyStore::get`) instead.
    Read,
    /// Run, wrapped in a short random timeout: the future is dropped at whatever await point
    /// it has reached.
    Timeout,
    /// Run in a task that is aborted after a short random delay.
    Cancel,
    /// A POST through the HTTP layer.
    Http,
}

/// Weights of each call mode and each work fault.
#[derive(Clone, Debug)]
pub struct FaultMix {
    /// Weights of the call modes.
    pub calls: Vec<(CallMode, u32)>,
    /// Weights of the work faults, drawn for every call that may run the work.
    pub work: Vec<(WorkFault, u32)>,
    /// Weights of the key spaces (the HTTP and short-retention spaces need a runner with a
    /// [`FaultRig`]; without one every call goes to the engine's keys).
    pub spaces: Vec<(Space, u32)>,
    /// Weights of what the HTTP handler does if it runs (`None`, `Error`, `Long`).
    pub http_work: Vec<(WorkFault, u32)>,
}

impl Default for FaultMix {
    /// Calls: 75 % plain runs, 8 % reads, 8 % timeouts, 9 % cancelled tasks. Work: 40 %
    /// succeeds, 25 % errors, 15 % panics, 15 % stalls past the lease, 5 % runs for 2–4
    /// leases with the heartbeat on — most keys need a few executions before one commits.
    /// Spaces: 84 % engine keys, 9 % HTTP, 7 % short retention. HTTP handlers: 50 % answer
    /// at once, 15 % answer 500, 35 % take 2–4 leases.
    fn default() -> Self {
        Self {
            calls: vec![
                (CallMode::Run, 75),
                (CallMode::Read, 8),
                (CallMode::Timeout, 8),
                (CallMode::Cancel, 9),
            ],
            work: vec![
                (WorkFault::None, 40),
                (WorkFault::Error, 25),
                (WorkFault::Panic, 15),
                (WorkFault::Stall, 15),
                (WorkFault::Long, 5),
            ],
            spaces: vec![(Space::Engine, 84), (Space::Http, 9), (Space::Short, 7)],
            http_work: vec![
                (WorkFault::None, 50),
                (WorkFault::Error, 15),
                (WorkFault::Long, 35),
            ],
        }
    }
}

fn pick<T: Copy>(weights: &[(T, u32)], rng: &mut StdRng, default: T) -> T {
    let total: u32 = weights.iter().map(|(_, w)| w).sum();
    if total == 0 {
        return default;
    }
    let mut x = rng.gen_range(0..total);
    for (t, w) in weights {
        if x < *w {
            return *t;
        }
        x -= w;
    }
    default
}

/// A soak run's shape.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// A name for the report.
    pub label: String,
    /// Concurrent workers (16).
    pub workers: usize,
    /// Operations in all (from [`OPS_VAR`], default [`DEFAULT_OPS`]).
    pub ops: usize,
    /// Keys in all (200).
    pub keys: usize,
    /// How many consecutive keys are hot at any moment (4): the run sweeps through the keys,
    /// so every key sees its claim races, failures, takeovers and replays. One call in five
    /// goes to any key met so far instead.
    pub hot_keys: usize,
    /// The engine's lease (300 ms).
    pub lease: Duration,
    /// Keys of the HTTP layer (80), swept through like the engine's, four hot at a time.
    pub http_keys: usize,
    /// The HTTP layer's lease (200 ms); its long handlers take 2–4 of them.
    pub http_lease: Duration,
    /// Keys with a short retention (16), chosen at random.
    pub short_keys: usize,
    /// Their retention (100 ms): a completed record expires, is purged and claimed again.
    pub short_ttl: Duration,
    /// The pause between two `purge_expired` calls of the purger (10 ms).
    pub purge_every: Duration,
    /// Store faults, for runners with a [`FaultRig`].
    pub store_faults: StoreFaults,
    /// The fault mix.
    pub mix: FaultMix,
    /// The seed of the fault schedule.
    pub seed: u64,
    /// Whether a runner's business write may fail without an injected error (its connection
    /// cut by a partition, say): such a call, released with [`BUSINESS_WRITE_FAILED`], is
    /// then expected rather than unexpected (`false`).
    pub business_writes_may_fail: bool,
    /// Set once the workers' calls have all ended, before the final reads: a fault schedule
    /// of the caller's own (a partition, a crash) that runs beside the soak stops there.
    pub calls_over: Arc<AtomicBool>,
    /// Ends the calls before `ops` once a fault schedule beside the soak has met what it
    /// came for (a failover recovered from, enough partitions): `ops` is then only the bound.
    /// The sweep through the keys is paced by `ops`, so a run ended at half of them has swept
    /// half of the keys (every key is still read at the end). One soak per `Ending`.
    pub ending: Arc<Ending>,
}

/// When a soak's calls end: after [`SoakConfig::ops`] calls, or earlier, a given number of
/// calls after a fault schedule beside the soak asked for it ([`Ending::end_after`]). A
/// schedule that waits for its fault to happen and then ends the run makes the soak as long
/// as the fault needs, not as long as a fixed count of calls takes on a loaded machine.
#[derive(Debug)]
pub struct Ending {
    /// Calls started so far.
    started: AtomicUsize,
    /// No call starts at or past this sequence number (`usize::MAX` until asked).
    limit: AtomicUsize,
}

impl Default for Ending {
    fn default() -> Self {
        Self {
            started: AtomicUsize::new(0),
            limit: AtomicUsize::new(usize::MAX),
        }
    }
}

impl Ending {
    /// Lets `calls` more calls start, then ends the run (or keeps the earlier end if one was
    /// asked for already).
    pub fn end_after(&self, calls: usize) {
        let now = self.started.load(Ordering::SeqCst);
        self.limit
            .fetch_min(now.saturating_add(calls), Ordering::SeqCst);
    }

    /// Calls started so far (once the calls are over, up to one more per worker: each
    /// worker's last try to start one).
    pub fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    /// The next call's sequence number, or `None` when the run's calls are over (`ops`
    /// reached, or the end asked for).
    fn next(&self, ops: usize) -> Option<usize> {
        let seq = self.started.fetch_add(1, Ordering::SeqCst);
        (seq < ops.min(self.limit.load(Ordering::SeqCst))).then_some(seq)
    }
}

impl SoakConfig {
    /// The standard run (16 workers, 200 keys, 300 ms leases, the default mix), its length
    /// and seed from the environment.
    pub fn from_env(label: impl Into<String>) -> Self {
        let ops = std::env::var(OPS_VAR)
            .ok()
            .map(|v| {
                v.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{OPS_VAR}={v:?} is not a number"))
            })
            .unwrap_or(DEFAULT_OPS);
        let seed = std::env::var(SEED_VAR)
            .ok()
            .map(|v| {
                v.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{SEED_VAR}={v:?} is not a number"))
            })
            .unwrap_or_else(|| rand::thread_rng().gen());
        Self {
            label: label.into(),
            workers: 16,
            ops,
            keys: 200,
            hot_keys: 4,
            lease: Duration::from_millis(300),
            http_keys: 80,
            http_lease: Duration::from_millis(200),
            short_keys: 16,
            short_ttl: Duration::from_millis(100),
            purge_every: Duration::from_millis(10),
            store_faults: StoreFaults::default(),
            mix: FaultMix::default(),
            seed,
            business_writes_may_fail: false,
            calls_over: Arc::default(),
            ending: Arc::default(),
        }
    }
}

/// One unit of work: sleeps, then succeeds with `value`, fails or panics per its fault.
#[derive(Clone, Debug)]
pub struct Work {
    /// The value a success produces (unique to the call).
    pub value: u64,
    /// What the work does.
    pub fault: WorkFault,
    /// How long the work takes.
    pub duration: Duration,
    counters: Arc<Counters>,
    probe: Option<Probe>,
}

/// What the soak adds to a work when its runner has a [`FaultRig`].
#[derive(Clone, Debug)]
struct Probe {
    rig: Arc<FaultRig>,
    /// Doom the completion: every try fails with this fault.
    doom: Option<Fault>,
    /// The call goes to a short-retention key.
    short: bool,
}

/// Executions counted by the work itself.
#[derive(Debug, Default)]
struct Counters {
    /// Executions started, by fault: the work faults that were actually injected.
    started: [AtomicU64; 5],
    /// Executions that returned their value.
    succeeded: AtomicU64,
}

const WORK_FAULTS: [WorkFault; 5] = [
    WorkFault::None,
    WorkFault::Error,
    WorkFault::Panic,
    WorkFault::Stall,
    WorkFault::Long,
];

fn work_index(f: WorkFault) -> usize {
    match f {
        WorkFault::None => 0,
        WorkFault::Error => 1,
        WorkFault::Panic => 2,
        WorkFault::Stall => 3,
        WorkFault::Long => 4,
    }
}

impl Work {
    /// A work with its own execution counters.
    pub fn new(value: u64, fault: WorkFault, duration: Duration) -> Self {
        Self {
            value,
            fault,
            duration,
            counters: Arc::default(),
            probe: None,
        }
    }

    /// Whether the work goes to a short-retention key.
    pub fn is_short(&self) -> bool {
        self.probe.as_ref().is_some_and(|p| p.short)
    }

    /// Runs the work as the holder of `ctx`: with a [`FaultRig`], the execution is recorded
    /// in its ledger and a doomed completion is armed first.
    pub async fn perform_in(self, ctx: &WorkContext) -> Result<u64, String> {
        let Some(probe) = self.probe.clone() else {
            return self.perform().await;
        };
        if let Some(fault) = probe.doom {
            probe.rig.doom(ctx.id.clone(), ctx.token.0, fault);
        }
        let guard = probe.rig.ledger().start(
            ctx.id.clone(),
            ctx.token.0,
            self.value,
            self.fault == WorkFault::Long,
        );
        let result = self.perform().await;
        guard.finish(if result.is_ok() {
            ExecEnd::Ok
        } else {
            ExecEnd::Err
        });
        result
    }

    /// Runs the work.
    pub async fn perform(self) -> Result<u64, String> {
        self.counters.started[work_index(self.fault)].fetch_add(1, Ordering::Relaxed);
        if !self.duration.is_zero() {
            tokio::time::sleep(self.duration).await;
        }
        match self.fault {
            WorkFault::Error => Err(format!("injected error in call {}", self.value)),
            WorkFault::Panic => panic!("{PANIC_MARKER}: call {}", self.value),
            WorkFault::None | WorkFault::Stall | WorkFault::Long => {
                self.counters.succeeded.fetch_add(1, Ordering::Relaxed);
                Ok(self.value)
            }
        }
    }
}

/// The engine's answer to one run.
pub type RunResult = Result<Answer<Result<u64, String>>, Error>;

/// How a soak runs work: the plain engine, or a backend's transactional helper.
pub trait Runner: Send + Sync + 'static {
    /// The store, for reads.
    fn store(&self) -> Arc<dyn IdempotencyStore>;

    /// Runs `work` for `(scope, key)`; stalls run with the heartbeat off.
    fn run(
        &self,
        key: IdempotencyKey,
        scope: Scope,
        fingerprint: Fingerprint,
        work: Work,
    ) -> BoxFuture<'static, RunResult>;

    /// For runners whose work writes a business row in the completion's transaction: the
    /// committed rows' values per key.
    fn effects<'a>(&'a self, scope: &'a Scope) -> BoxFuture<'a, Option<HashMap<String, Vec<u64>>>> {
        let _ = scope;
        Box::pin(async { None })
    }

    /// For runners built over a [`FaultRig`]: the rig, which turns on store faults, the
    /// ledger checks, the HTTP and short-retention keys and the purger.
    fn rig(&self) -> Option<Arc<FaultRig>> {
        None
    }

    /// The engine behind the HTTP layer (the rig's store, [`SoakConfig::http_lease`]).
    fn http_engine(&self) -> Option<Idempotency> {
        None
    }
}

/// The soak's policy: a short lease, retention far beyond the run, in-flight duplicates
/// rejected, the heartbeat on (`Some(1/3)`) or off.
pub fn soak_policy(lease: Duration, heartbeat: bool) -> Policy {
    Policy::default()
        .lease(lease)
        .retention(Duration::from_secs(3600))
        .heartbeat(heartbeat.then_some(1.0 / 3.0))
}

/// [`Idempotency::run`] on a store.
#[derive(Debug)]
pub struct EngineRunner {
    engine: Idempotency,
    stall_engine: Idempotency,
    rig: Option<Arc<FaultRig>>,
    /// Engines with the short retention, with and without the heartbeat.
    short: Option<(Idempotency, Idempotency)>,
    http: Option<Idempotency>,
}

impl EngineRunner {
    /// Engines over `store` with [`soak_policy`], with and without the heartbeat.
    pub fn new(store: Arc<dyn IdempotencyStore>, lease: Duration) -> Self {
        Self {
            engine: Idempotency::new(store.clone(), soak_policy(lease, true)).expect("policy"),
            stall_engine: Idempotency::new(store, soak_policy(lease, false)).expect("policy"),
            rig: None,
            short: None,
            http: None,
        }
    }

    /// Engines over a [`FaultRig`] on `store`: store faults per [`SoakConfig::store_faults`],
    /// every lease and execution recorded, plus the short-retention engines and the HTTP
    /// layer's engine.
    pub fn with_faults(store: Arc<dyn IdempotencyStore>, config: &SoakConfig) -> Self {
        let rig = Arc::new(FaultRig::new(store, config.store_faults, config.seed));
        let faulty = rig.store();
        let short = |heartbeat| {
            Idempotency::new(
                faulty.clone(),
                soak_policy(config.lease, heartbeat).retention(config.short_ttl),
            )
            .expect("policy")
        };
        let mut runner = Self::new(faulty.clone(), config.lease);
        runner.short = Some((short(true), short(false)));
        runner.http = Some(
            Idempotency::new(faulty.clone(), soak_policy(config.http_lease, true)).expect("policy"),
        );
        runner.rig = Some(rig);
        runner
    }
}

impl Runner for EngineRunner {
    fn store(&self) -> Arc<dyn IdempotencyStore> {
        self.engine.store().clone()
    }

    fn rig(&self) -> Option<Arc<FaultRig>> {
        self.rig.clone()
    }

    fn http_engine(&self) -> Option<Idempotency> {
        self.http.clone()
    }

    fn run(
        &self,
        key: IdempotencyKey,
        scope: Scope,
        fingerprint: Fingerprint,
        work: Work,
    ) -> BoxFuture<'static, RunResult> {
        let stall = work.fault == WorkFault::Stall;
        let engine = match (&self.short, work.is_short()) {
            (Some((_, stall_engine)), true) if stall => stall_engine,
            (Some((engine, _)), true) => engine,
            _ if stall => &self.stall_engine,
            _ => &self.engine,
        }
        .clone();
        Box::pin(async move {
            engine
                .run(&key, &scope, &fingerprint, move |ctx| async move {
                    work.perform_in(&ctx).await
                })
                .await
        })
    }
}

/// Several application instances, each an engine over its own store (its own connection or
/// pool): calls take turns, so one instance reads what another wrote.
#[derive(Debug)]
pub struct Instances {
    engines: Vec<EngineRunner>,
    next: AtomicUsize,
}

impl Instances {
    /// One [`EngineRunner`] per store.
    pub fn new(stores: Vec<Arc<dyn IdempotencyStore>>, lease: Duration) -> Self {
        assert!(!stores.is_empty(), "at least one instance");
        Self {
            engines: stores
                .into_iter()
                .map(|s| EngineRunner::new(s, lease))
                .collect(),
            next: Default::default(),
        }
    }
}

impl Runner for Instances {
    fn store(&self) -> Arc<dyn IdempotencyStore> {
        self.engines[0].store()
    }

    fn run(
        &self,
        key: IdempotencyKey,
        scope: Scope,
        fingerprint: Fingerprint,
        work: Work,
    ) -> BoxFuture<'static, RunResult> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.engines[i % self.engines.len()].run(key, scope, fingerprint, work)
    }
}

/// One recorded call.
#[derive(Clone, Debug)]
pub struct Event {
    /// The key's index (engine keys first, then the HTTP keys, then the short-retention
    /// ones).
    pub key: usize,
    /// The key's space.
    pub space: Space,
    /// How the call was made.
    pub mode: CallMode,
    /// What the work would do if it ran.
    pub work: WorkFault,
    /// The call, its answer and times.
    pub op: Operation<Call, Response>,
    /// The error behind an unknown outcome, or what was unexpected.
    pub note: Option<String>,
    /// Whether this is the read made after the run, not one of the calls.
    pub is_final: bool,
    /// When the call ended (answered, failed or was dropped), in the history's clock: unlike
    /// `op.ret`, also set for unknown outcomes.
    pub ended: u64,
    /// For a read that found a Completed record: its token.
    pub seen_token: Option<u64>,
}

/// What the store faults, the HTTP layer and the purger did, for runners with a
/// [`FaultRig`]: the figures that show the faults were exercised.
#[derive(Clone, Debug, Default)]
pub struct FaultFigures {
    /// Faults injected into completions and extensions.
    pub injected: Injected,
    /// Calls answered `OutcomeUnknown` (every try of a completion failed).
    pub outcome_unknown: usize,
    /// Store operations the ledger checked (leases granted, extensions, completions,
    /// failures).
    pub store_ops: usize,
    /// Executions the ledger checked.
    pub executions: usize,
    /// Completions that applied.
    pub completions_applied: usize,
    /// Extensions that applied.
    pub extensions_applied: usize,
    /// Engine works that ran for 2–4 leases with the heartbeat on.
    pub long_works: usize,
    /// HTTP calls.
    pub http_calls: usize,
    /// HTTP handlers run.
    pub handlers: usize,
    /// HTTP handlers that ran for 2–4 leases.
    pub long_handlers: usize,
    /// HTTP calls answered 409.
    pub http_conflicts: usize,
    /// 409s answered while a long handler of the key was running.
    pub conflicts_during_long: usize,
    /// Calls to short-retention keys.
    pub short_calls: usize,
    /// Fresh commits on short-retention keys.
    pub short_commits: usize,
    /// `purge_expired` calls.
    pub purge_calls: u64,
    /// Records purged.
    pub purged: u64,
    /// `purge_expired` calls that failed with a retryable error (a fault of the network
    /// or the server; the next call purges what they left). A purge that fails otherwise is
    /// an unexpected answer.
    pub purges_failed_retryably: u64,
    /// Leases granted by a claim on a key whose earlier record had expired.
    pub claims_after_expiry: usize,
    /// Writes by a holder whose token a newer lease had replaced, all fenced.
    pub stale_writes_fenced: usize,
}

/// What a soak run found.
#[derive(Debug, Default)]
pub struct Report {
    /// The run's label.
    pub label: String,
    /// The seed of the fault schedule.
    pub seed: u64,
    /// Calls made by the workers.
    pub ops: usize,
    /// Operations checked for linearizability (the calls plus one final read per key).
    pub checked_ops: usize,
    /// Keys checked.
    pub keys: usize,
    /// The most operations one key's history had.
    pub max_history: usize,
    /// Calls, by mode.
    pub calls: BTreeMap<String, usize>,
    /// Timeouts and cancellations that fired (the call's future was dropped before it
    /// answered).
    pub interrupted: usize,
    /// Executions of the work, by the fault injected into them.
    pub executions_by_fault: BTreeMap<String, u64>,
    /// Answers, by kind.
    pub responses: BTreeMap<String, usize>,
    /// Calls whose errors were backend errors (recorded as unknown).
    pub backend_errors: usize,
    /// Answers no correct engine gives (recorded separately; each is a failure).
    pub unexpected: Vec<String>,
    /// Keys whose history is not linearizable, with the history.
    pub violations: Vec<String>,
    /// Keys the checker could not decide within its budget.
    pub undecided: Vec<String>,
    /// Double effects (see the crate docs for what counts), with details.
    pub double_effects: Vec<String>,
    /// Work executions that ran to a successful end (committed or not).
    pub executions: u64,
    /// Keys whose work took effect (Completed at the end): one effect each.
    pub committed_effects: usize,
    /// Business rows counted, for runners that write one.
    pub effect_rows: Option<usize>,
    /// Store faults, HTTP and purge figures, for runners with a [`FaultRig`].
    pub faults: Option<FaultFigures>,
    /// How long the calls took.
    pub run_time: Duration,
    /// How long the check took.
    pub check_time: Duration,
    /// When the run started: event times are nanoseconds since then.
    pub origin: Option<Instant>,
    /// Every recorded call, for assertions of a test's own.
    pub events: Vec<Event>,
}

impl Report {
    /// The instant an event's time (nanoseconds since the origin) stands for.
    pub fn instant(&self, nanos: u64) -> Instant {
        self.origin.expect("a finished run has an origin") + Duration::from_nanos(nanos)
    }

    /// Calls in flight at `at`: made before it, answered (or given up) after.
    pub fn in_flight_at(&self, at: Instant) -> usize {
        self.events
            .iter()
            .filter(|e| self.instant(e.op.call) < at && self.instant(e.ended) > at)
            .count()
    }

    /// Calls made after `at` that were answered (the final reads are not calls).
    pub fn answered_after(&self, at: Instant) -> usize {
        self.events
            .iter()
            .filter(|e| !e.is_final && e.op.ret.is_some() && self.instant(e.op.call) > at)
            .count()
    }

    /// Whether `event` is a call whose store failed (recorded as unknown).
    pub fn is_backend_error(event: &Event) -> bool {
        event.op.output == Response::Unknown
            && event.note.as_deref().is_some_and(|n| {
                !n.starts_with("UNEXPECTED") && n != "timed out" && n != "cancelled"
            })
    }
}

impl Report {
    /// Panics with the report when there is any violation, undecided key, double effect or
    /// unexpected answer.
    pub fn assert_clean(&self) {
        let problems = self.violations.len()
            + self.undecided.len()
            + self.double_effects.len()
            + self.unexpected.len();
        if problems > 0 {
            let mut details = String::new();
            for line in self
                .violations
                .iter()
                .chain(&self.undecided)
                .chain(&self.double_effects)
                .chain(&self.unexpected)
                .take(20)
            {
                details.push_str(line);
                details.push('\n');
            }
            panic!("{self}\n{details}");
        }
    }

    /// How many executions ran with `fault` injected.
    pub fn executed(&self, fault: WorkFault) -> u64 {
        self.executions_by_fault
            .get(&format!("{fault:?}"))
            .copied()
            .unwrap_or(0)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "soak {}: {} calls by 16 workers over {} keys (seed {}), {:.1} s; checked {} operations \
             (longest key history {}) in {:.2} s",
            self.label,
            self.ops,
            self.keys,
            self.seed,
            self.run_time.as_secs_f64(),
            self.checked_ops,
            self.max_history,
            self.check_time.as_secs_f64()
        )?;
        writeln!(
            f,
            "  calls: {:?}; interrupted by their timeout or abort: {}",
            self.calls, self.interrupted
        )?;
        writeln!(
            f,
            "  executions of the work by injected fault: {:?}",
            self.executions_by_fault
        )?;
        writeln!(
            f,
            "  answers: {:?}; backend errors: {}",
            self.responses, self.backend_errors
        )?;
        writeln!(
            f,
            "  executions that succeeded: {}; keys with one committed effect: {}{}",
            self.executions,
            self.committed_effects,
            match self.effect_rows {
                Some(n) => format!("; business rows: {n}"),
                None => String::new(),
            }
        )?;
        if let Some(x) = &self.faults {
            let i = &x.injected;
            writeln!(
                f,
                "  store faults injected: {} (complete refused {} / ack lost {}, extend refused {} \
                 / ack lost {}); completions doomed: {}; answered OutcomeUnknown: {}",
                i.total(),
                i.complete_refused,
                i.complete_ack_lost,
                i.extend_refused,
                i.extend_ack_lost,
                i.doomed,
                x.outcome_unknown
            )?;
            writeln!(
                f,
                "  ledger: {} store operations and {} executions checked; completions applied: \
                 {}; extensions applied: {}; long engine works (2-4 leases, heartbeat on): {}",
                x.store_ops,
                x.executions,
                x.completions_applied,
                x.extensions_applied,
                x.long_works
            )?;
            writeln!(
                f,
                "  http: {} calls, {} handlers run, {} long (2-4 leases); 409s: {}, {} of them \
                 while a long handler held the key",
                x.http_calls,
                x.handlers,
                x.long_handlers,
                x.http_conflicts,
                x.conflicts_during_long
            )?;
            writeln!(
                f,
                "  short retention: {} calls, {} commits; purges: {} calls deleting {} records \
                 ({} failed retryably); claims after expiry: {}; stale writes fenced: {}",
                x.short_calls,
                x.short_commits,
                x.purge_calls,
                x.purged,
                x.purges_failed_retryably,
                x.claims_after_expiry,
                x.stale_writes_fenced
            )?;
        }
        write!(
            f,
            "  violations: {}; undecided: {}; double effects: {}; unexpected answers: {}",
            self.violations.len(),
            self.undecided.len(),
            self.double_effects.len(),
            self.unexpected.len()
        )
    }
}

/// One key of the run.
struct Slot {
    space: Space,
    /// The key's index within its space.
    local: usize,
    key: IdempotencyKey,
    id: RecordId,
}
