//! The workloads, run the same way against every backend.

use crate::stats::Summary;
use async_trait::async_trait;
use futures::future::BoxFuture;
use idempotency_core::store::{BoxError, Claim, ClaimRequest};
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId,
    Refusal, Scope,
};
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The work's result in every workload: a small receipt, ~40 bytes of JSON ([`OUTCOME`]).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub(crate) struct Receipt {
    pub order_id: String,
    pub ok: bool,
}

pub(crate) fn receipt() -> Receipt {
    Receipt {
        order_id: "ord_0123456789".to_owned(),
        ok: true,
    }
}

/// [`Receipt`] as JSON (39 bytes): what the raw baselines store and replay.
pub(crate) const OUTCOME: &str = "{\"order_id\":\"ord_0123456789\",\"ok\":true}";

/// A workload whose physical limit on the server can be measured by another client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LimitWorkload {
    /// The store's claim and complete statements on fresh keys.
    NewKey,
    /// The store's claim of a completed key, counting no hit (the default).
    UncountedReplay,
}

/// The same statements the store sends, run by the server's own benchmark client (PostgreSQL's
/// `pgbench -M prepared`): the most any client library reaches on this server.
#[async_trait]
pub(crate) trait PhysicalLimit: Send + Sync {
    /// What the limit is measured with, for the report.
    fn method(&self) -> String;
    /// Operations per second of `workload` with `clients` connections for `duration`.
    async fn ops_per_sec(
        &self,
        workload: LimitWorkload,
        clients: usize,
        duration: Duration,
    ) -> Result<f64, BoxError>;
}

/// What a hand-written implementation would send for each workload, on the same driver and
/// connection settings as the store.
#[async_trait]
pub(crate) trait RawBaseline: Send + Sync {
    /// Insert-if-absent of a pending row, then mark it completed with the outcome.
    async fn new_key_cycle(&self, key: &str, outcome: &[u8]) -> Result<(), BoxError>;
    /// Read a completed key's outcome.
    async fn replay(&self, key: &str) -> Result<Option<Vec<u8>>, BoxError>;
}

/// Counts the round trips (statements, commands) sent so far over a counted connection.
#[async_trait]
pub(crate) trait RoundTripCounter: Send + Sync {
    /// Round trips so far, not counting any this call makes itself.
    async fn count(&self) -> Result<u64, BoxError>;
    /// What the counter saw beyond the round trips (commands run inside scripts, statements
    /// prepared), as of now; printed beside the counts.
    async fn detail(&self) -> Result<Vec<(String, u64)>, BoxError> {
        Ok(Vec::new())
    }
}

/// A store and a raw baseline on a connection whose round trips are counted. Kept apart from
/// the measured ones, so throughput is never measured through a counting proxy.
pub(crate) struct Counted {
    pub store: Arc<dyn IdempotencyStore>,
    pub raw: Arc<dyn RawBaseline>,
    pub counter: Arc<dyn RoundTripCounter>,
    /// Where the counts come from, for the report.
    pub method: &'static str,
    /// The least server time a correct script can take, for backends whose server runs the
    /// store's scripts one at a time (Redis).
    pub floor: Option<Arc<dyn ScriptFloor>>,
}

/// Server time per call of the store's scripts, recorded call by call by the server itself,
/// and of the smallest scripts that do what any correct store script must, run on the same
/// server in the same run.
#[async_trait]
pub(crate) trait ScriptFloor: Send + Sync {
    /// Forgets what was recorded, and records the server time of every script call from now.
    async fn record(&self) -> Result<(), BoxError>;
    /// The server µs of each script call since [`ScriptFloor::record`], and stops recording.
    async fn recorded(&self) -> Result<Vec<u64>, BoxError>;
    /// Runs each floor script `n` times, `concurrency` calls at a time, on records of the
    /// size `sample`'s stored record has, and returns the server µs of each call.
    async fn measure(
        &self,
        n: usize,
        concurrency: usize,
        sample: &RecordId,
    ) -> Result<Floors, BoxError>;
}

/// Server µs of each call of the floor scripts.
pub(crate) struct Floors {
    /// Bytes of the record the floor scripts read and write.
    pub record_len: usize,
    /// `TIME`, then `GET` of the record, returned as it is.
    pub read: Vec<u64>,
    /// `TIME`, `GET` of the record, then `SET … PXAT` of a record of the same size.
    pub write: Vec<u64>,
    /// Other ways of calling the same scripts (Redis Functions: `FCALL` of a loaded library).
    pub other: Vec<(String, Vec<u64>)>,
}

/// One backend, ready to measure.
pub(crate) struct Backend {
    pub name: &'static str,
    pub store: Arc<dyn IdempotencyStore>,
    pub raw: Arc<dyn RawBaseline>,
    pub round_trips: Option<Counted>,
    pub limit: Option<Arc<dyn PhysicalLimit>>,
}

/// Runs a blocking clean-up (dropping a schema, deleting keys) when dropped, also on error
/// paths, on a runtime of its own so it works from inside or outside the benchmark's runtime.
type CleanupFn =
    Box<dyn FnOnce() -> futures::future::BoxFuture<'static, Result<(), BoxError>> + Send>;

pub(crate) struct Cleanup(Option<CleanupFn>);

impl Cleanup {
    pub(crate) fn new<F, Fut>(f: F) -> Self
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        Self(Some(Box::new(move || Box::pin(f()))))
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let Some(f) = self.0.take() else { return };
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(f())
        })
        .join();
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("warning: clean-up failed: {e}"),
            Err(_) => eprintln!("warning: clean-up panicked"),
        }
    }
}

/// How long each measurement runs: until `ops` operations or `duration`, whichever is first.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Budget {
    pub ops: usize,
    pub duration: Duration,
}

/// Runs `op` from `clients` concurrent tasks, each on the inputs `prepare(client, i)` built
/// before the clock starts (keys, ids), until the budget's operations or its duration run
/// out, and summarises the latencies.
pub(crate) async fn measure<I, P, F, Fut>(
    clients: usize,
    budget: Budget,
    prepare: P,
    op: F,
) -> Result<Summary, BoxError>
where
    I: Send + 'static,
    P: Fn(usize, usize) -> I,
    F: Fn(I) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send,
{
    let op = Arc::new(op);
    let per_client = budget.ops.div_ceil(clients).max(1);
    let start_line = Arc::new(tokio::sync::Barrier::new(clients + 1));
    let mut tasks = Vec::with_capacity(clients);
    for c in 0..clients {
        let inputs: Vec<I> = (0..per_client).map(|i| prepare(c, i)).collect();
        let (op, start_line) = (op.clone(), start_line.clone());
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::with_capacity(inputs.len());
            start_line.wait().await;
            let started = Instant::now();
            let deadline = started + budget.duration;
            let mut inputs = inputs.into_iter();
            for (i, input) in inputs.by_ref().enumerate() {
                let t = Instant::now();
                op(input).await?;
                samples.push(t.elapsed());
                if i % 64 == 63 && Instant::now() >= deadline {
                    break;
                }
            }
            // Inputs left over when the duration ran out are dropped after the clock stops.
            let finished = Instant::now();
            drop(inputs);
            Ok::<_, BoxError>((samples, started, finished))
        }));
    }
    start_line.wait().await;
    let mut all = Vec::new();
    let mut span: Option<(Instant, Instant)> = None;
    for t in tasks {
        let (samples, started, finished) = t.await??;
        all.extend(samples);
        span = Some(match span {
            None => (started, finished),
            Some((s, f)) => (s.min(started), f.max(finished)),
        });
    }
    let elapsed = span.map_or(Duration::ZERO, |(s, f)| f - s);
    Ok(Summary::from_samples(all, elapsed))
}

/// An engine over `store` with the default policy (heartbeat on, as users run it).
pub(crate) fn engine(store: Arc<dyn IdempotencyStore>) -> Result<Idempotency, Error> {
    Idempotency::new(store, Policy::default())
}

/// The engine with hit counting on: a replay also counts its hit (a write on every store).
pub(crate) fn counted_engine(store: Arc<dyn IdempotencyStore>) -> Result<Idempotency, Error> {
    Idempotency::new(store, Policy::default().count_hits(true))
}

pub(crate) fn scope() -> Scope {
    static SCOPE: std::sync::OnceLock<Scope> = std::sync::OnceLock::new();
    SCOPE
        .get_or_init(|| Scope::from_parts(["bench", "POST /orders"]).expect("valid scope"))
        .clone()
}

/// The request fingerprint every workload uses. Computed once: hashing the request is the
/// caller's cost (the criterion benches measure it), not the store's or the engine's.
pub(crate) fn fingerprint() -> Fingerprint {
    static FP: std::sync::OnceLock<Fingerprint> = std::sync::OnceLock::new();
    *FP.get_or_init(|| Fingerprint::from_bytes(b"{\"sku\":\"A-1\",\"qty\":1}"))
}

pub(crate) fn key(run: &str, client: usize, i: usize) -> IdempotencyKey {
    IdempotencyKey::new(format!("{run}-{client}-{i}")).expect("valid key")
}

/// One new-key cycle through the engine: claim, run, complete.
pub(crate) async fn engine_cycle(
    engine: &Idempotency,
    scope: &Scope,
    key: &IdempotencyKey,
) -> Result<(), BoxError> {
    let out = engine
        .run(key, scope, &fingerprint(), |_| async {
            Ok::<_, String>(receipt())
        })
        .await?;
    if out.is_replayed() {
        return Err("a new key was replayed".into());
    }
    Ok(())
}

/// One replay through the engine; fails if the work would have run.
pub(crate) async fn engine_replay(
    engine: &Idempotency,
    scope: &Scope,
    key: &IdempotencyKey,
) -> Result<(), BoxError> {
    let out = engine
        .run(key, scope, &fingerprint(), |_| async {
            Err::<Receipt, _>(String::from("must not run"))
        })
        .await?;
    if !matches!(out, Answer::Replayed(Ok(_))) {
        return Err("a completed key ran its work again".into());
    }
    Ok(())
}

/// One new-key cycle through the store API alone (claim + complete), no engine.
pub(crate) async fn store_cycle(
    store: &dyn IdempotencyStore,
    id: RecordId,
) -> Result<(), BoxError> {
    let req = ClaimRequest::new(
        id,
        fingerprint(),
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
    .with_count_hit(false);
    match store.claim(&req).await? {
        Claim::Claimed { token, .. } => {
            store
                .complete(&req.id, token, engine_outcome(), req.ttl)
                .await?;
            Ok(())
        }
        Claim::Existing { .. } => Err("a new key was found existing".into()),
    }
}

/// One replay through the store API alone: a claim that must find the completed record.
pub(crate) async fn store_replay(
    store: &dyn IdempotencyStore,
    id: RecordId,
) -> Result<(), BoxError> {
    let req = ClaimRequest::new(
        id,
        fingerprint(),
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
    .with_count_hit(false);
    match store.claim(&req).await? {
        Claim::Existing { .. } => Ok(()),
        Claim::Claimed { .. } => Err("a completed key was claimed".into()),
    }
}

/// [`Receipt`] as the engine stores it (`{"Ok":{…}}`), so keys filled through the store API
/// replay through the engine.
pub(crate) fn engine_outcome() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| serde_json::to_vec(&Ok::<Receipt, String>(receipt())).expect("serialize"))
}

/// How the 64 callers of the same-key race were answered.
#[derive(Debug, Default)]
pub(crate) struct RaceReport {
    pub executions: usize,
    pub fresh: usize,
    pub replayed: usize,
    pub in_progress: usize,
    pub other_errors: usize,
}

/// 64 concurrent `run`s of one key, released together by a barrier.
pub(crate) async fn same_key_race(engine: &Idempotency, run: &str) -> RaceReport {
    let executions = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let key = IdempotencyKey::new(format!("{run}-race")).expect("valid key");
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (engine, key, executions, barrier) = (
            engine.clone(),
            key.clone(),
            executions.clone(),
            barrier.clone(),
        );
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            engine
                .run(&key, &scope(), &fingerprint(), |_| async move {
                    executions.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok::<_, String>(receipt())
                })
                .await
        }));
    }
    let mut report = RaceReport::default();
    for t in tasks {
        match t.await {
            Ok(Ok(Answer::Replayed(_))) => report.replayed += 1,
            Ok(Ok(Answer::Executed(_))) => report.fresh += 1,
            Ok(Ok(Answer::Refused(Refusal::InProgress { .. }))) => report.in_progress += 1,
            _ => report.other_errors += 1,
        }
    }
    report.executions = executions.load(Ordering::SeqCst);
    report
}

/// A backend to measure, with whatever must live as long as it (a temp dir, a schema).
pub(crate) type Prepared = (crate::harness::Backend, Box<dyn Any>);

/// A store filled with live keys, with whatever must live as long as it.
pub(crate) type Filled = (Arc<dyn IdempotencyStore>, Box<dyn Any>);

/// What one store adds to the bench.
pub(crate) struct Kind {
    /// The name `--backend` takes.
    pub(crate) name: &'static str,
    /// Its measured backends (a store may be measured in several modes), given the most
    /// clients any measurement runs.
    pub(crate) make: fn(usize) -> BoxFuture<'static, Result<Vec<Prepared>, BoxError>>,
    /// How it is measured as the number of live keys grows, if it is.
    pub(crate) scaling: Option<Scaling>,
}

/// The scaling table of one store.
pub(crate) struct Scaling {
    /// The largest number of live keys it is measured at.
    pub(crate) max_keys: usize,
    /// A store holding `n` completed records keyed as the harness's `key("fill", 0, i)`.
    pub(crate) filled: fn(usize) -> BoxFuture<'static, Result<Filled, BoxError>>,
    /// Whether the process's resident memory per record is its memory per record.
    pub(crate) in_process_memory: bool,
}
