//! The history-checked soak: concurrent workers call the engine on a few hot keys at a time
//! while failures are injected at random; every call is recorded with its invocation and
//! response times, then each key's history is checked against [`OnceRegister`] and the
//! committed effects are counted.

use crate::checker::{check, Operation, Verdict};
use crate::model::{Call, OnceRegister, Response};
use futures::future::BoxFuture;
use idempotency_core::{
    decode_replay, Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Outcome,
    Policy, RecordId, RecordStatus, Scope,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

/// The env var that sets the number of operations of a soak run.
pub const OPS_VAR: &str = "IDEMPOTENCY_SOAK_OPS";
/// The env var that fixes the seed of the fault schedule (random by default; printed).
pub const SEED_VAR: &str = "IDEMPOTENCY_SOAK_SEED";
/// Operations per run when [`OPS_VAR`] is not set.
pub const DEFAULT_OPS: usize = 10_000;

/// What an injected panic says; the soak's panic hook keeps these out of the test output.
pub const PANIC_MARKER: &str = "injected panic (reliability soak)";

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
}

/// What the work does if it runs (only the holder of the key runs it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkFault {
    /// Succeeds after a short pause.
    None,
    /// Returns an error (the engine releases the key).
    Error,
    /// Panics.
    Panic,
    /// Stalls past its lease with the heartbeat off, then succeeds: a retry may take the key
    /// over meanwhile and fence it.
    Stall,
}

/// Weights of each call mode and each work fault.
#[derive(Clone, Debug)]
pub struct FaultMix {
    /// Weights of the call modes.
    pub calls: Vec<(CallMode, u32)>,
    /// Weights of the work faults, drawn for every call that may run the work.
    pub work: Vec<(WorkFault, u32)>,
}

impl Default for FaultMix {
    /// Calls: 75 % plain runs, 8 % reads, 8 % timeouts, 9 % cancelled tasks. Work: 45 %
    /// succeeds, 25 % errors, 15 % panics, 15 % stalls past the lease — most keys need a few
    /// executions before one commits.
    fn default() -> Self {
        Self {
            calls: vec![
                (CallMode::Run, 75),
                (CallMode::Read, 8),
                (CallMode::Timeout, 8),
                (CallMode::Cancel, 9),
            ],
            work: vec![
                (WorkFault::None, 45),
                (WorkFault::Error, 25),
                (WorkFault::Panic, 15),
                (WorkFault::Stall, 15),
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
    /// The fault mix.
    pub mix: FaultMix,
    /// The seed of the fault schedule.
    pub seed: u64,
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
            mix: FaultMix::default(),
            seed,
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
}

/// Executions counted by the work itself.
#[derive(Debug, Default)]
struct Counters {
    /// Executions started, by fault: the work faults that were actually injected.
    started: [AtomicU64; 4],
    /// Executions that returned their value.
    succeeded: AtomicU64,
}

fn work_index(f: WorkFault) -> usize {
    match f {
        WorkFault::None => 0,
        WorkFault::Error => 1,
        WorkFault::Panic => 2,
        WorkFault::Stall => 3,
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
        }
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
            WorkFault::None | WorkFault::Stall => {
                self.counters.succeeded.fetch_add(1, Ordering::Relaxed);
                Ok(self.value)
            }
        }
    }
}

/// The engine's answer to one run.
pub type RunResult = Result<Outcome<Result<u64, String>>, Error>;

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
}

/// The soak's policy: a short lease, retention far beyond the run, in-flight duplicates
/// rejected, the heartbeat on (`Some(1/3)`) or off.
pub fn soak_policy(lease: Duration, heartbeat: bool) -> Policy {
    Policy::default()
        .lease(lease)
        .ttl(Duration::from_secs(3600))
        .heartbeat(heartbeat.then_some(1.0 / 3.0))
}

/// [`Idempotency::run`] on a store.
#[derive(Debug)]
pub struct EngineRunner {
    engine: Idempotency,
    stall_engine: Idempotency,
}

impl EngineRunner {
    /// Engines over `store` with [`soak_policy`], with and without the heartbeat.
    pub fn new(store: Arc<dyn IdempotencyStore>, lease: Duration) -> Self {
        Self {
            engine: Idempotency::new(store.clone(), soak_policy(lease, true)).expect("policy"),
            stall_engine: Idempotency::new(store, soak_policy(lease, false)).expect("policy"),
        }
    }
}

impl Runner for EngineRunner {
    fn store(&self) -> Arc<dyn IdempotencyStore> {
        self.engine.store().clone()
    }

    fn run(
        &self,
        key: IdempotencyKey,
        scope: Scope,
        fingerprint: Fingerprint,
        work: Work,
    ) -> BoxFuture<'static, RunResult> {
        let engine = if work.fault == WorkFault::Stall {
            self.stall_engine.clone()
        } else {
            self.engine.clone()
        };
        Box::pin(async move {
            engine
                .run(&key, &scope, &fingerprint, move |_ctx| work.perform())
                .await
        })
    }
}

/// One recorded call.
#[derive(Clone, Debug)]
pub struct Event {
    /// The key's index.
    pub key: usize,
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

fn install_panic_filter() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let injected = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|s| s.starts_with(PANIC_MARKER));
            if !injected {
                default(info);
            }
        }));
    });
}

/// Maps the engine's answer to the model's response; `Err` holds a note for an unknown or
/// unexpected answer.
fn classify(result: RunResult) -> (Response, Option<String>, bool) {
    match result {
        Ok(Outcome::Fresh(Ok(v))) => (Response::Fresh(v), None, false),
        Ok(Outcome::Replayed(Ok(v))) => (Response::Replayed(v), None, false),
        Ok(Outcome::Fresh(Err(e))) => (Response::Released, Some(e), false),
        Ok(Outcome::Replayed(Err(e))) => (
            Response::Unknown,
            Some(format!("UNEXPECTED: a released error was replayed: {e}")),
            false,
        ),
        Err(Error::InProgress { .. }) => (Response::InProgress, None, false),
        Err(Error::LeaseLost { .. }) => (Response::LeaseLost, None, false),
        Err(e @ (Error::Backend { .. } | Error::OutcomeUnknown { .. })) => {
            (Response::Unknown, Some(e.to_string()), true)
        }
        Err(e) => (Response::Unknown, Some(format!("UNEXPECTED: {e:?}")), false),
    }
}

async fn read(
    store: &Arc<dyn IdempotencyStore>,
    id: &RecordId,
) -> (Response, Option<String>, bool) {
    match store.get(id).await {
        Ok(Some(record)) if record.status == RecordStatus::Completed => {
            match decode_replay::<Result<u64, String>>(&record) {
                Ok(Ok(v)) => (Response::ReadCompleted(v), None, false),
                Ok(Err(e)) => (
                    Response::Unknown,
                    Some(format!("UNEXPECTED: a stored error: {e}")),
                    false,
                ),
                Err(e) => (
                    Response::Unknown,
                    Some(format!("UNEXPECTED: undecodable outcome: {e}")),
                    false,
                ),
            }
        }
        Ok(_) => (Response::ReadOpen, None, false),
        Err(e) => (Response::Unknown, Some(e.to_string()), true),
    }
}

struct Shared {
    runner: Arc<dyn Runner>,
    store: Arc<dyn IdempotencyStore>,
    scope: Scope,
    keys: Vec<IdempotencyKey>,
    config: SoakConfig,
    next: AtomicUsize,
    origin: Instant,
    counters: Arc<Counters>,
}

impl Shared {
    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn id(&self, key: usize) -> RecordId {
        RecordId::new(self.scope.clone(), self.keys[key].clone())
    }

    fn fingerprint(&self, key: usize) -> Fingerprint {
        Fingerprint::from_bytes(self.keys[key].as_str().as_bytes())
    }
}

async fn worker(shared: Arc<Shared>, seed: u64) -> Vec<Event> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut events = Vec::new();
    let c = &shared.config;
    let span = c.keys - c.hot_keys + 1;
    loop {
        let seq = shared.next.fetch_add(1, Ordering::Relaxed);
        if seq >= c.ops {
            return events;
        }
        let base = seq * span / c.ops;
        // Mostly the hot keys; sometimes any key met so far, so that records are revisited
        // long after (stalled holders' passed leases are taken over, completions replayed).
        let key = if rng.gen_bool(0.2) {
            rng.gen_range(0..base + c.hot_keys)
        } else {
            base + rng.gen_range(0..c.hot_keys)
        };
        let mode = pick(&c.mix.calls, &mut rng, CallMode::Run);
        let fault = pick(&c.mix.work, &mut rng, WorkFault::None);
        let value = seq as u64 + 1;
        let duration = match fault {
            WorkFault::Stall => c.lease + Duration::from_millis(rng.gen_range(50..250)),
            _ if rng.gen_bool(0.2) => Duration::ZERO,
            _ => Duration::from_micros(rng.gen_range(0..8_000)),
        };
        let work = Work {
            value,
            fault,
            duration,
            counters: shared.counters.clone(),
        };
        // Half the deadlines are tight enough to interrupt even a replay.
        let deadline = Duration::from_micros(if rng.gen_bool(0.5) {
            rng.gen_range(0..500)
        } else {
            rng.gen_range(0..15_000)
        });
        let call = shared.now();
        let run = || {
            shared.runner.run(
                shared.keys[key].clone(),
                shared.scope.clone(),
                shared.fingerprint(key),
                work.clone(),
            )
        };
        let (output, note, backend) = match mode {
            CallMode::Read => read(&shared.store, &shared.id(key)).await,
            CallMode::Timeout => {
                // The timeout runs inside the task, so the call's future is dropped when it
                // fires; the task keeps an injected panic away from the worker.
                let call = run();
                match tokio::spawn(async move { tokio::time::timeout(deadline, call).await }).await
                {
                    Ok(Ok(result)) => classify(result),
                    Ok(Err(_)) => (Response::Unknown, Some("timed out".into()), false),
                    Err(e) if e.is_panic() && fault == WorkFault::Panic => {
                        (Response::Released, None, false)
                    }
                    Err(e) => (
                        Response::Unknown,
                        Some(format!("UNEXPECTED: the call panicked: {e}")),
                        false,
                    ),
                }
            }
            CallMode::Cancel => {
                let task = tokio::spawn(run());
                tokio::time::sleep(deadline).await;
                task.abort();
                match task.await {
                    Ok(result) => classify(result),
                    Err(e) if e.is_cancelled() => {
                        (Response::Unknown, Some("cancelled".into()), false)
                    }
                    Err(e) if e.is_panic() && fault == WorkFault::Panic => {
                        (Response::Released, None, false)
                    }
                    Err(e) => (
                        Response::Unknown,
                        Some(format!("UNEXPECTED: the call panicked: {e}")),
                        false,
                    ),
                }
            }
            CallMode::Run => match tokio::spawn(run()).await {
                Ok(result) => classify(result),
                Err(e) if e.is_panic() && fault == WorkFault::Panic => {
                    (Response::Released, None, false)
                }
                Err(e) => (
                    Response::Unknown,
                    Some(format!(
                        "UNEXPECTED: the call panicked or was cancelled: {e}"
                    )),
                    false,
                ),
            },
        };
        let ended = shared.now();
        let ret = (output != Response::Unknown).then_some(ended);
        let input = if mode == CallMode::Read {
            Call::Read
        } else {
            Call::Run { value }
        };
        // An error released by the engine must come from an injected error.
        let note = match (output, fault, note) {
            (Response::Released, f, Some(n)) if f != WorkFault::Error => Some(format!(
                "UNEXPECTED: the work failed without an injected error: {n}"
            )),
            (_, _, n) => n,
        };
        events.push(Event {
            key,
            mode,
            work: fault,
            op: Operation {
                call,
                ret,
                input,
                output,
            },
            note,
            is_final: false,
            ended,
        });
        if backend {
            // A client backs off when the store fails.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Runs a soak with `runner` and checks it. The caller asserts on the report
/// ([`Report::assert_clean`]).
pub async fn soak(runner: Arc<dyn Runner>, config: SoakConfig) -> Report {
    install_panic_filter();
    let run_id: u64 = rand::thread_rng().gen();
    let scope =
        Scope::from_parts(["soak", &config.label, &format!("{run_id:016x}")]).expect("valid scope");
    let keys = (0..config.keys)
        .map(|k| IdempotencyKey::new(format!("key-{k:03}")).expect("valid key"))
        .collect();
    let store = runner.store();
    let shared = Arc::new(Shared {
        runner,
        store,
        scope,
        keys,
        config: config.clone(),
        next: AtomicUsize::new(0),
        origin: Instant::now(),
        counters: Arc::new(Counters::default()),
    });
    let started = Instant::now();
    let workers: Vec<_> = (0..config.workers)
        .map(|w| tokio::spawn(worker(shared.clone(), config.seed.wrapping_add(w as u64))))
        .collect();
    let mut events = Vec::with_capacity(config.ops + config.keys);
    for w in workers {
        events.extend(w.await.expect("a worker panicked"));
    }
    let run_time = started.elapsed();
    // Let abandoned leases be released (or pass) and cancelled writes land.
    tokio::time::sleep(config.lease + Duration::from_millis(300)).await;
    let mut finals = HashMap::new();
    for key in 0..config.keys {
        let call = shared.now();
        let (output, note, _) = read(&shared.store, &shared.id(key)).await;
        let ended = shared.now();
        finals.insert(key, output);
        events.push(Event {
            key,
            mode: CallMode::Read,
            work: WorkFault::None,
            op: Operation {
                call,
                ret: (output != Response::Unknown).then_some(ended),
                input: Call::Read,
                output,
            },
            note,
            is_final: true,
            ended,
        });
    }
    let effects = shared.runner.effects(&shared.scope).await;
    let check_started = Instant::now();
    let mut report = analyse(&config, &events, &finals, effects.as_ref());
    report.check_time = check_started.elapsed();
    report.origin = Some(shared.origin);
    report.events = events;
    report.run_time = run_time;
    report.executions = shared.counters.succeeded.load(Ordering::Relaxed);
    for f in [
        WorkFault::None,
        WorkFault::Error,
        WorkFault::Panic,
        WorkFault::Stall,
    ] {
        report.executions_by_fault.insert(
            format!("{f:?}"),
            shared.counters.started[work_index(f)].load(Ordering::Relaxed),
        );
    }
    report
}

fn analyse(
    config: &SoakConfig,
    events: &[Event],
    finals: &HashMap<usize, Response>,
    effects: Option<&HashMap<String, Vec<u64>>>,
) -> Report {
    let mut report = Report {
        label: config.label.clone(),
        seed: config.seed,
        keys: config.keys,
        ..Report::default()
    };
    let mut per_key: BTreeMap<usize, Vec<Event>> = BTreeMap::new();
    for e in events {
        per_key.entry(e.key).or_default().push(e.clone());
    }
    for (&key, history) in &per_key {
        report.checked_ops += history.len();
        report.max_history = report.max_history.max(history.len());
        for e in history {
            if !e.is_final {
                report.ops += 1;
                *report.calls.entry(format!("{:?}", e.mode)).or_default() += 1;
            }
            *report
                .responses
                .entry(response_kind(e.op.output).to_owned())
                .or_default() += 1;
            if let Some(note) = &e.note {
                if note.starts_with("UNEXPECTED") {
                    report.unexpected.push(format!("key {key}: {note}"));
                } else if matches!(note.as_str(), "timed out" | "cancelled") {
                    report.interrupted += 1;
                } else if e.op.output == Response::Unknown {
                    report.backend_errors += 1;
                }
            }
        }
        let ops: Vec<_> = history.iter().map(|e| e.op.clone()).collect();
        match check(&OnceRegister, &ops, 5_000_000) {
            Verdict::Linearizable => {}
            Verdict::Violation { deepest } => report.violations.push(format!(
                "key {key}: not linearizable (deepest linearized prefix: {} of {} ops)\n{}",
                deepest.len(),
                ops.len(),
                dump(history)
            )),
            Verdict::Undecided { steps } => report.undecided.push(format!(
                "key {key}: undecided after {steps} steps\n{}",
                dump(history)
            )),
        }
        count_effects(&mut report, key, history, finals.get(&key), effects);
    }
    if let Some(effects) = effects {
        report.effect_rows = Some(effects.values().map(Vec::len).sum());
    }
    report
}

/// Double effects of one key:
/// - two calls answered `Fresh(Ok)` (two executions committed);
/// - a `Fresh(Ok(v))` while the record ends holding something other than `v` (the committed
///   effect was lost or overwritten);
/// - a replay of a value other than the one the record ends with;
/// - with a business table: more than one row, a row without a Completed record, a Completed
///   record without its row, or a row whose value is not the stored one.
fn count_effects(
    report: &mut Report,
    key: usize,
    history: &[Event],
    last: Option<&Response>,
    effects: Option<&HashMap<String, Vec<u64>>>,
) {
    let held = match last {
        Some(Response::ReadCompleted(v)) => Some(*v),
        _ => None,
    };
    if held.is_some() {
        report.committed_effects += 1;
    }
    let fresh: Vec<u64> = history
        .iter()
        .filter_map(|e| match e.op.output {
            Response::Fresh(v) => Some(v),
            _ => None,
        })
        .collect();
    if fresh.len() > 1 {
        report.double_effects.push(format!(
            "key {key}: {} calls committed: {fresh:?}",
            fresh.len()
        ));
    }
    if let Some(v) = fresh.first() {
        if held != Some(*v) {
            report.double_effects.push(format!(
                "key {key}: call {v} committed but the record ends with {held:?}"
            ));
        }
    }
    for e in history {
        if let Response::Replayed(v) | Response::ReadCompleted(v) = e.op.output {
            if held != Some(v) {
                report.double_effects.push(format!(
                    "key {key}: a call saw {v} but the record ends with {held:?}"
                ));
            }
        }
    }
    if let Some(effects) = effects {
        let name = format!("key-{key:03}");
        let rows = effects.get(&name).cloned().unwrap_or_default();
        let expected: Vec<u64> = held.into_iter().collect();
        if rows != expected {
            report.double_effects.push(format!(
                "key {key}: business rows {rows:?}, but the record ends with {held:?}"
            ));
        }
    }
}

fn response_kind(r: Response) -> &'static str {
    match r {
        Response::Fresh(_) => "fresh",
        Response::Replayed(_) => "replayed",
        Response::Released => "released",
        Response::InProgress => "in_progress",
        Response::LeaseLost => "lease_lost",
        Response::Executed(_) => "executed",
        Response::ReadCompleted(_) => "read_completed",
        Response::ReadOpen => "read_open",
        Response::Unknown => "unknown",
    }
}

fn dump(history: &[Event]) -> String {
    let mut sorted: Vec<&Event> = history.iter().collect();
    sorted.sort_by_key(|e| e.op.call);
    sorted
        .iter()
        .take(80)
        .map(|e| {
            format!(
                "  [{:>12} .. {:>12}] {:?}/{:?} {:?} -> {:?}{}",
                e.op.call / 1000,
                e.op.ret.map_or("?".to_owned(), |r| (r / 1000).to_string()),
                e.mode,
                e.work,
                e.op.input,
                e.op.output,
                e.note
                    .as_deref()
                    .map_or(String::new(), |n| format!(" ({n})"))
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
