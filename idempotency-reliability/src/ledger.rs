//! What the store really did and what each execution of the work did, and the checks on
//! them that a client's answers alone cannot make.
//!
//! [`RecordingStore`] wraps the real store, *under* the fault injection, so it records the
//! ground truth: every lease granted (claim, reclaim, extension) with its token, the times
//! the call was made and answered and the lease it asked for, and every completion and
//! failure with whether it applied. The work records each execution ([`Ledger::start`]):
//! its token, when it started and how it ended. [`check`] then verifies, per record:
//!
//! - **tokens never repeat** and grow in real time: a lease granted after another was
//!   answered has a greater token, also across expiry and purges;
//! - **a fenced holder never writes**: no completion, failure or extension of token `a`
//!   applies after a lease with a greater token was granted;
//! - **every execution holds a granted token**;
//! - **a key is never released after its work acted**: no failure applies for a token whose
//!   execution returned its value or was dropped half-way (it may have acted);
//! - **no second execution while the side effect of one is held** (a double effect): an
//!   execution that acted (returned its value, or was dropped and so may have) holds its key
//!   until the last lease it was certainly granted has passed, or, if its completion applied,
//!   until that record's retention has passed. Another execution of the key that starts
//!   before then is a double effect if it acted too, and two holders at once if it did not;
//! - on records that never expire, **at most one completion applies**.
//!
//! Times are nanoseconds on the soak's monotonic clock; leases run on the store's clock, so
//! [`check`] allows `epsilon` of skew (the store clock has millisecond resolution).

use idempotency_core::{
    async_trait, Cas, Claim, ClaimRequest, Error, Failure, FencingToken, Fingerprint,
    IdempotencyStore, Reclaim, Record, RecordId,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The store operations the ledger records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// A claim that wrote a fresh record (`Claim::Claimed`).
    Claim,
    /// A reclaim (`Reclaim::Reclaimed` when applied).
    Reclaim,
    /// A lease extension.
    Extend,
    /// A completion.
    Complete,
    /// A failure.
    Fail,
}

/// Whether a recorded operation changed the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// It applied (a lease granted, a CAS applied).
    Yes,
    /// It did not (fenced, lost).
    No,
    /// The store answered an error: it may or may not have applied.
    Unknown,
}

/// One recorded store operation.
#[derive(Clone, Debug)]
pub struct StoreOp {
    /// The record.
    pub id: RecordId,
    /// What was asked.
    pub kind: OpKind,
    /// The token granted (claim, reclaim) or the holder's token (the others); 0 when a claim
    /// or reclaim granted nothing.
    pub token: u64,
    /// When the call was made.
    pub invoked: u64,
    /// When it was answered.
    pub returned: u64,
    /// Whether it applied.
    pub applied: Applied,
    /// The lease asked for (claim, reclaim, extend) or the retention (complete, fail).
    pub duration: Duration,
}

/// How an execution of the work ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecEnd {
    /// It returned its value: its side effect happened.
    Ok,
    /// It returned an error: it did nothing (the engine releases the key).
    Err,
    /// It panicked: it did nothing (the engine releases the key).
    Panicked,
    /// Its future was dropped half-way (timeout, abort): it may have acted.
    Dropped,
}

impl ExecEnd {
    /// Whether the execution acted, or may have.
    pub fn acted(self) -> bool {
        matches!(self, Self::Ok | Self::Dropped)
    }
}

/// One execution of the work.
#[derive(Clone, Debug)]
pub struct Execution {
    /// The record.
    pub id: RecordId,
    /// The holder's token.
    pub token: u64,
    /// The value the execution produces (unique to the call).
    pub value: u64,
    /// When it started.
    pub started: u64,
    /// When it ended.
    pub ended: u64,
    /// How it ended.
    pub end: ExecEnd,
    /// Whether it was meant to outlive its lease with the heartbeat on.
    pub long: bool,
}

/// The shared record of store operations and executions.
#[derive(Debug)]
pub struct Ledger {
    origin: Instant,
    ops: Mutex<Vec<StoreOp>>,
    executions: Mutex<Vec<Execution>>,
    latest_grant: Mutex<HashMap<RecordId, u64>>,
    purge_calls: AtomicU64,
    purged: AtomicU64,
}

impl Ledger {
    /// An empty ledger whose clock starts at `origin`.
    pub fn new(origin: Instant) -> Self {
        Self {
            origin,
            ops: Mutex::default(),
            executions: Mutex::default(),
            latest_grant: Mutex::default(),
            purge_calls: AtomicU64::new(0),
            purged: AtomicU64::new(0),
        }
    }

    /// The clock's origin.
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// Nanoseconds since the origin.
    pub fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn push(&self, op: StoreOp) {
        if matches!(op.kind, OpKind::Claim | OpKind::Reclaim) && op.applied == Applied::Yes {
            self.latest_grant
                .lock()
                .expect("ledger lock")
                .insert(op.id.clone(), op.token);
        }
        self.ops.lock().expect("ledger lock").push(op);
    }

    /// The token of the last lease granted on `id` (claim or reclaim).
    pub fn latest_grant(&self, id: &RecordId) -> Option<u64> {
        self.latest_grant
            .lock()
            .expect("ledger lock")
            .get(id)
            .copied()
    }

    /// Records the start of an execution; the guard records its end (dropped or panicking
    /// guards record [`ExecEnd::Dropped`] or [`ExecEnd::Panicked`]).
    pub fn start(self: &Arc<Self>, id: RecordId, token: u64, value: u64, long: bool) -> ExecGuard {
        ExecGuard {
            ledger: self.clone(),
            exec: Some(Execution {
                id,
                token,
                value,
                started: self.now(),
                ended: 0,
                end: ExecEnd::Dropped,
                long,
            }),
        }
    }

    /// Counts one `purge_expired` call that deleted `deleted` records.
    pub fn count_purge(&self, deleted: u64) {
        self.purge_calls.fetch_add(1, Ordering::Relaxed);
        self.purged.fetch_add(deleted, Ordering::Relaxed);
    }

    /// `purge_expired` calls made, and records they deleted.
    pub fn purges(&self) -> (u64, u64) {
        (
            self.purge_calls.load(Ordering::Relaxed),
            self.purged.load(Ordering::Relaxed),
        )
    }

    /// Every store operation recorded so far.
    pub fn ops(&self) -> Vec<StoreOp> {
        self.ops.lock().expect("ledger lock").clone()
    }

    /// Every execution recorded so far.
    pub fn executions(&self) -> Vec<Execution> {
        self.executions.lock().expect("ledger lock").clone()
    }
}

/// Records how an execution ends.
#[derive(Debug)]
pub struct ExecGuard {
    ledger: Arc<Ledger>,
    exec: Option<Execution>,
}

impl ExecGuard {
    /// The execution ended with `end`.
    pub fn finish(mut self, end: ExecEnd) {
        if let Some(mut exec) = self.exec.take() {
            exec.end = end;
            exec.ended = self.ledger.now();
            self.ledger
                .executions
                .lock()
                .expect("ledger lock")
                .push(exec);
        }
    }
}

impl Drop for ExecGuard {
    fn drop(&mut self) {
        if let Some(mut exec) = self.exec.take() {
            exec.end = if std::thread::panicking() {
                ExecEnd::Panicked
            } else {
                ExecEnd::Dropped
            };
            exec.ended = self.ledger.now();
            if let Ok(mut executions) = self.ledger.executions.lock() {
                executions.push(exec);
            }
        }
    }
}

/// A store wrapper that records every lease granted and every settle into a [`Ledger`].
/// Put it directly over the real store, under any fault injection, so that it sees what the
/// store really did.
#[derive(Clone, Debug)]
pub struct RecordingStore {
    inner: Arc<dyn IdempotencyStore>,
    ledger: Arc<Ledger>,
}

impl RecordingStore {
    /// Records what `inner` does into `ledger`.
    pub fn new(inner: Arc<dyn IdempotencyStore>, ledger: Arc<Ledger>) -> Self {
        Self { inner, ledger }
    }

    fn record(
        &self,
        id: &RecordId,
        kind: OpKind,
        token: u64,
        invoked: u64,
        applied: Applied,
        duration: Duration,
    ) {
        self.ledger.push(StoreOp {
            id: id.clone(),
            kind,
            token,
            invoked,
            returned: self.ledger.now(),
            applied,
            duration,
        });
    }

    fn cas(result: &Result<Cas, Error>) -> Applied {
        match result {
            Ok(Cas::Applied) => Applied::Yes,
            Ok(Cas::Fenced) => Applied::No,
            Err(_) => Applied::Unknown,
        }
    }
}

#[async_trait]
impl IdempotencyStore for RecordingStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let invoked = self.ledger.now();
        let result = self.inner.claim(request).await;
        let (token, applied) = match &result {
            Ok(Claim::Claimed { token, .. }) => (token.0, Applied::Yes),
            // An observation changes nothing but a hit count: not recorded.
            Ok(Claim::Existing { .. }) => return result,
            Err(_) => (0, Applied::Unknown),
        };
        self.record(
            &request.id,
            OpKind::Claim,
            token,
            invoked,
            applied,
            request.lease,
        );
        result
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let invoked = self.ledger.now();
        let result = self.inner.complete(id, token, outcome, ttl).await;
        self.record(
            id,
            OpKind::Complete,
            token.0,
            invoked,
            Self::cas(&result),
            ttl,
        );
        result
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let invoked = self.ledger.now();
        let result = self.inner.fail(id, token, failure, ttl).await;
        self.record(id, OpKind::Fail, token.0, invoked, Self::cas(&result), ttl);
        result
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        let invoked = self.ledger.now();
        let result = self.inner.extend(id, token, lease).await;
        self.record(
            id,
            OpKind::Extend,
            token.0,
            invoked,
            Self::cas(&result),
            lease,
        );
        result
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        let invoked = self.ledger.now();
        let result = self
            .inner
            .reclaim(id, expected, fingerprint, lease, ttl)
            .await;
        let (token, applied) = match &result {
            Ok(Reclaim::Reclaimed { token, .. }) => (token.0, Applied::Yes),
            Ok(Reclaim::Lost) => (0, Applied::No),
            Err(_) => (0, Applied::Unknown),
        };
        self.record(id, OpKind::Reclaim, token, invoked, applied, lease);
        result
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.inner.get(id).await
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        let deleted = self.inner.purge_expired(batch).await?;
        self.ledger.count_purge(deleted);
        Ok(deleted)
    }
}

/// A Completed record seen by a read: the value it holds and its token.
#[derive(Clone, Debug)]
pub struct SeenCompleted {
    /// The record.
    pub id: RecordId,
    /// The value it holds.
    pub value: u64,
    /// Its token.
    pub token: u64,
}

/// What [`check`] found.
#[derive(Debug, Default)]
pub struct Findings {
    /// Broken rules other than double effects, each with the record's ledger.
    pub violations: Vec<String>,
    /// Double effects: two executions that acted while one of them held the key, or two
    /// completions of a record that never expires.
    pub double_effects: Vec<String>,
    /// Store operations checked.
    pub ops: usize,
    /// Executions checked.
    pub executions: usize,
    /// Leases granted by a claim on a key that had had a record before (it expired, and was
    /// purged or replaced).
    pub claims_after_expiry: usize,
    /// Completions, failures and extensions of a token that a newer lease had replaced, all
    /// fenced.
    pub stale_writes_fenced: usize,
    /// Completions that applied.
    pub completions_applied: usize,
    /// Extensions that applied.
    pub extensions_applied: usize,
}

/// One record's operations, executions and Completed reads.
type RecordLedger<'a> = (Vec<&'a StoreOp>, Vec<&'a Execution>, Vec<&'a SeenCompleted>);

/// Checks the ledger (see the module docs). `expiring` holds the records whose retention is
/// short enough to pass during the run, with that retention; `epsilon` is the clock skew
/// allowed, in nanoseconds.
pub fn check(
    ops: &[StoreOp],
    executions: &[Execution],
    seen: &[SeenCompleted],
    expiring: &HashMap<RecordId, Duration>,
    epsilon: u64,
) -> Findings {
    let mut findings = Findings {
        ops: ops.len(),
        executions: executions.len(),
        ..Findings::default()
    };
    let mut by_id: BTreeMap<String, RecordLedger<'_>> = BTreeMap::new();
    let mut ids: HashMap<String, &RecordId> = HashMap::new();
    for op in ops {
        let name = op.id.to_string();
        ids.entry(name.clone()).or_insert(&op.id);
        by_id.entry(name).or_default().0.push(op);
    }
    for e in executions {
        let name = e.id.to_string();
        ids.entry(name.clone()).or_insert(&e.id);
        by_id.entry(name).or_default().1.push(e);
    }
    for s in seen {
        let name = s.id.to_string();
        ids.entry(name.clone()).or_insert(&s.id);
        by_id.entry(name).or_default().2.push(s);
    }
    for (name, (ops, execs, seen)) in &by_id {
        let retention = expiring.get(ids[name]).copied();
        check_record(&mut findings, name, ops, execs, seen, retention, epsilon);
    }
    findings
}

fn check_record(
    findings: &mut Findings,
    name: &str,
    ops: &[&StoreOp],
    execs: &[&Execution],
    seen: &[&SeenCompleted],
    retention: Option<Duration>,
    epsilon: u64,
) {
    let mut problems: Vec<String> = Vec::new();
    let mut doubles: Vec<String> = Vec::new();
    let mut grants: Vec<&StoreOp> = ops
        .iter()
        .copied()
        .filter(|o| matches!(o.kind, OpKind::Claim | OpKind::Reclaim) && o.applied == Applied::Yes)
        .collect();
    grants.sort_by_key(|o| o.invoked);
    findings.claims_after_expiry += grants
        .iter()
        .skip(1)
        .filter(|g| g.kind == OpKind::Claim)
        .count();

    // Tokens never repeat, and a lease granted after another was answered has a greater one.
    let mut tokens = HashSet::new();
    for g in &grants {
        if !tokens.insert(g.token) {
            problems.push(format!("token {} was granted twice", g.token));
        }
    }
    for a in &grants {
        for b in &grants {
            if a.returned < b.invoked && a.token >= b.token {
                problems.push(format!(
                    "token {} was granted after token {} had been, yet is not greater",
                    b.token, a.token
                ));
            }
        }
    }

    // A holder whose token a newer lease replaced never writes.
    for op in ops {
        if !matches!(op.kind, OpKind::Extend | OpKind::Complete | OpKind::Fail) {
            continue;
        }
        let replaced = grants
            .iter()
            .find(|g| g.token > op.token && g.returned < op.invoked);
        match (replaced, op.applied) {
            (Some(g), Applied::Yes) => problems.push(format!(
                "{:?} of token {} applied after token {} was granted",
                op.kind, op.token, g.token
            )),
            (Some(_), Applied::No) => findings.stale_writes_fenced += 1,
            _ => {}
        }
        if op.applied == Applied::Yes {
            match op.kind {
                OpKind::Complete => findings.completions_applied += 1,
                OpKind::Extend => findings.extensions_applied += 1,
                _ => {}
            }
        }
    }

    // Every execution holds a granted token, and no failure releases a key whose work acted.
    for e in execs {
        if !tokens.contains(&e.token) {
            problems.push(format!(
                "execution of call {} ran with token {}, which was never granted",
                e.value, e.token
            ));
        }
        if e.end.acted() {
            if let Some(f) = ops
                .iter()
                .find(|o| o.kind == OpKind::Fail && o.token == e.token && o.applied == Applied::Yes)
            {
                problems.push(format!(
                    "call {}'s work ended {:?} (it acted), yet a failure released token {} at {}",
                    e.value,
                    e.end,
                    e.token,
                    f.invoked / 1000
                ));
            }
        }
    }

    // How long each token's holder certainly held the key: until the last lease it was
    // granted passed or, once its completion applied, for the record's retention (the
    // completion ends the lease).
    let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    let mut leased_until: HashMap<u64, u64> = HashMap::new();
    let mut retained_until: HashMap<u64, u64> = HashMap::new();
    for op in ops.iter().filter(|o| o.applied == Applied::Yes) {
        let until = op.invoked.saturating_add(nanos(op.duration));
        let map = match op.kind {
            OpKind::Claim | OpKind::Reclaim | OpKind::Extend => &mut leased_until,
            OpKind::Complete => &mut retained_until,
            OpKind::Fail => continue,
        };
        let entry = map.entry(op.token).or_insert(0);
        *entry = (*entry).max(until);
    }
    for a in execs.iter().filter(|e| e.end.acted()) {
        let Some(&leased) = leased_until.get(&a.token) else {
            continue;
        };
        let until = match (retained_until.get(&a.token), retention) {
            (Some(&retained), _) => retained,
            // A completion may have applied unseen (its answer was an error, or the call was
            // dropped while it was in flight): it came after the work ended, and a short
            // retention may end the hold before the lease would have.
            (None, Some(ttl)) if a.end == ExecEnd::Ok => {
                leased.min(a.ended.saturating_add(nanos(ttl)))
            }
            (None, _) => leased,
        };
        for b in execs.iter().filter(|b| b.token > a.token) {
            if b.started.saturating_add(epsilon) < until {
                let line = format!(
                    "call {} (token {}) started at {} while call {} (token {}, ended {:?}) held \
                     the key until {}",
                    b.value,
                    b.token,
                    b.started / 1000,
                    a.value,
                    a.token,
                    a.end,
                    until / 1000
                );
                if b.end.acted() {
                    doubles.push(line);
                } else {
                    problems.push(format!("two holders at once: {line}"));
                }
            }
        }
    }
    if retention.is_none() {
        let applied: Vec<u64> = ops
            .iter()
            .filter(|o| o.kind == OpKind::Complete && o.applied == Applied::Yes)
            .map(|o| o.token)
            .collect();
        if applied.len() > 1 {
            doubles.push(format!(
                "{} completions applied on a record that never expires (tokens {applied:?})",
                applied.len()
            ));
        }
    }

    // A Completed record holds the value of the execution of its own token.
    let token_of: HashMap<u64, u64> = execs.iter().map(|e| (e.value, e.token)).collect();
    for s in seen {
        match token_of.get(&s.value) {
            Some(&t) if t == s.token => {}
            Some(&t) => problems.push(format!(
                "a read saw call {}'s value under token {}, but that call ran with token {t}",
                s.value, s.token
            )),
            None => problems.push(format!(
                "a read saw call {}'s value, but no execution of that call was recorded",
                s.value
            )),
        }
    }

    if problems.is_empty() && doubles.is_empty() {
        return;
    }
    let dump = dump(ops, execs);
    for p in problems {
        findings
            .violations
            .push(format!("{name}: {p}\n  ledger:\n{dump}"));
    }
    for d in doubles {
        findings
            .double_effects
            .push(format!("{name}: {d}\n  ledger:\n{dump}"));
    }
}

/// The record's ledger in time order (µs), for a report.
fn dump(ops: &[&StoreOp], execs: &[&Execution]) -> String {
    let mut lines: Vec<(u64, String)> = ops
        .iter()
        .map(|o| {
            (
                o.invoked,
                format!(
                    "    [{:>10} .. {:>10}] store {:?} token {} -> {:?} ({} ms)",
                    o.invoked / 1000,
                    o.returned / 1000,
                    o.kind,
                    o.token,
                    o.applied,
                    o.duration.as_millis()
                ),
            )
        })
        .chain(execs.iter().map(|e| {
            (
                e.started,
                format!(
                    "    [{:>10} .. {:>10}] work of call {} with token {} -> {:?}{}",
                    e.started / 1000,
                    e.ended / 1000,
                    e.value,
                    e.token,
                    e.end,
                    if e.long { " (long)" } else { "" }
                ),
            )
        }))
        .collect();
    lines.sort_by_key(|(t, _)| *t);
    lines
        .into_iter()
        .take(60)
        .map(|(_, l)| l)
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_core::{IdempotencyKey, Scope};

    const MS: u64 = 1_000_000;
    const LEASE: Duration = Duration::from_millis(300);
    const EPS: u64 = 5 * MS;

    fn id() -> RecordId {
        RecordId::new(
            Scope::new("s").expect("scope"),
            IdempotencyKey::new("k").expect("key"),
        )
    }

    fn op(kind: OpKind, token: u64, at_ms: u64, applied: Applied, duration: Duration) -> StoreOp {
        StoreOp {
            id: id(),
            kind,
            token,
            invoked: at_ms * MS,
            returned: at_ms * MS + MS,
            applied,
            duration,
        }
    }

    fn exec(token: u64, value: u64, from_ms: u64, to_ms: u64, end: ExecEnd) -> Execution {
        Execution {
            id: id(),
            token,
            value,
            started: from_ms * MS,
            ended: to_ms * MS,
            end,
            long: false,
        }
    }

    fn run(ops: &[StoreOp], execs: &[Execution], seen: &[SeenCompleted]) -> Findings {
        check(ops, execs, seen, &HashMap::new(), EPS)
    }

    fn short(ttl: Duration) -> HashMap<RecordId, Duration> {
        HashMap::from([(id(), ttl)])
    }

    fn clean(f: &Findings) -> bool {
        f.violations.is_empty() && f.double_effects.is_empty()
    }

    #[test]
    fn outcome_unknown_then_a_takeover_after_the_lease_is_allowed() {
        // Call 1 acted; its completion failed through every try (nothing applied), so the key
        // stayed Pending; call 2 took it over once the lease had passed and completed.
        let ops = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(
                OpKind::Complete,
                10,
                5,
                Applied::Unknown,
                Duration::from_secs(3600),
            ),
            op(OpKind::Reclaim, 11, 301, Applied::Yes, LEASE),
            op(
                OpKind::Complete,
                11,
                310,
                Applied::Yes,
                Duration::from_secs(3600),
            ),
        ];
        let execs = [
            exec(10, 1, 1, 4, ExecEnd::Ok),
            exec(11, 2, 302, 309, ExecEnd::Ok),
        ];
        assert!(clean(&run(&ops, &execs, &[])));
    }

    #[test]
    fn a_second_execution_under_a_live_lease_is_a_double_effect() {
        // The broken engine of old: call 1 acted, its completion failed, and the key was
        // released at once, so call 2 ran while call 1's lease still lived.
        let ops = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(
                OpKind::Complete,
                10,
                5,
                Applied::Unknown,
                Duration::from_secs(3600),
            ),
            op(OpKind::Fail, 10, 6, Applied::Yes, Duration::from_secs(3600)),
            op(OpKind::Reclaim, 11, 20, Applied::Yes, LEASE),
            op(
                OpKind::Complete,
                11,
                30,
                Applied::Yes,
                Duration::from_secs(3600),
            ),
        ];
        let execs = [
            exec(10, 1, 1, 4, ExecEnd::Ok),
            exec(11, 2, 21, 29, ExecEnd::Ok),
        ];
        let f = run(&ops, &execs, &[]);
        assert_eq!(f.double_effects.len(), 1, "{f:?}");
        // And the release itself is reported.
        assert!(
            f.violations.iter().any(|v| v.contains("released token 10")),
            "{f:?}"
        );
    }

    #[test]
    fn a_dropped_execution_holds_its_key_for_the_lease() {
        let ops = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(OpKind::Reclaim, 11, 100, Applied::Yes, LEASE),
        ];
        let execs = [
            exec(10, 1, 1, 50, ExecEnd::Dropped),
            exec(11, 2, 101, 120, ExecEnd::Ok),
        ];
        assert_eq!(run(&ops, &execs, &[]).double_effects.len(), 1);
        // An execution that failed released the key: a retry at once is fine.
        let execs = [
            exec(10, 1, 1, 50, ExecEnd::Err),
            exec(11, 2, 101, 120, ExecEnd::Ok),
        ];
        let ops_released = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(
                OpKind::Fail,
                10,
                51,
                Applied::Yes,
                Duration::from_secs(3600),
            ),
            op(OpKind::Reclaim, 11, 100, Applied::Yes, LEASE),
        ];
        assert!(clean(&run(&ops_released, &execs, &[])));
    }

    #[test]
    fn heartbeats_extend_what_a_holder_holds() {
        // A long work extended its lease at 100 and 200 ms: held until 500 ms. A takeover at
        // 400 ms is a double effect; one at 510 ms is not.
        let base = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(OpKind::Extend, 10, 100, Applied::Yes, LEASE),
            op(OpKind::Extend, 10, 200, Applied::Yes, LEASE),
        ];
        for (at, doubled) in [(400, true), (510, false)] {
            let mut ops = base.to_vec();
            ops.push(op(OpKind::Reclaim, 11, at, Applied::Yes, LEASE));
            let execs = [
                exec(10, 1, 1, 600, ExecEnd::Ok),
                exec(11, 2, at + 1, at + 5, ExecEnd::Ok),
            ];
            let f = run(&ops, &execs, &[]);
            assert_eq!(!f.double_effects.is_empty(), doubled, "{at}: {f:?}");
        }
    }

    #[test]
    fn a_completed_record_is_held_for_its_retention() {
        let ttl = Duration::from_millis(100);
        let ops = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(OpKind::Complete, 10, 10, Applied::Yes, ttl),
            // Purged and claimed again too early: 50 ms after the completion.
            op(OpKind::Claim, 5_000, 60, Applied::Yes, LEASE),
            op(OpKind::Complete, 5_000, 70, Applied::Yes, ttl),
        ];
        let execs = [
            exec(10, 1, 1, 9, ExecEnd::Ok),
            exec(5_000, 2, 61, 69, ExecEnd::Ok),
        ];
        let expiring = short(ttl);
        let f = check(&ops, &execs, &[], &expiring, EPS);
        assert_eq!(f.double_effects.len(), 1, "{f:?}");
        // After the retention it is a new life of the key.
        let mut ops = ops.to_vec();
        ops[2].invoked = 120 * MS;
        ops[2].returned = 121 * MS;
        ops[3].invoked = 130 * MS;
        let execs = [
            exec(10, 1, 1, 9, ExecEnd::Ok),
            exec(5_000, 2, 122, 129, ExecEnd::Ok),
        ];
        let f = check(&ops, &execs, &[], &expiring, EPS);
        assert!(clean(&f), "{f:?}");
        assert_eq!(f.claims_after_expiry, 1);
        // On a record that never expires, two applied completions are a double effect.
        let f = run(&ops, &execs, &[]);
        assert_eq!(f.double_effects.len(), 1, "{f:?}");
    }

    #[test]
    fn a_stale_holder_that_completes_a_newer_record_is_caught() {
        let ops = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(OpKind::Claim, 400_000, 320, Applied::Yes, LEASE),
            // The stalled holder of token 10 completes after the record was replaced.
            op(
                OpKind::Complete,
                10,
                400,
                Applied::Yes,
                Duration::from_millis(100),
            ),
        ];
        let execs = [
            exec(10, 1, 1, 399, ExecEnd::Ok),
            exec(400_000, 2, 321, 330, ExecEnd::Err),
        ];
        let seen = [SeenCompleted {
            id: id(),
            value: 1,
            token: 400_000,
        }];
        let f = run(&ops, &execs, &seen);
        assert!(
            f.violations
                .iter()
                .any(|v| v.contains("Complete of token 10 applied after token 400000")),
            "{f:?}"
        );
        assert!(
            f.violations
                .iter()
                .any(|v| v.contains("under token 400000")),
            "{f:?}"
        );
        // Fenced, it is counted and fine.
        let mut ops = ops.to_vec();
        ops[2].applied = Applied::No;
        let f = run(&ops, &execs, &[]);
        assert!(clean(&f), "{f:?}");
        assert_eq!(f.stale_writes_fenced, 1);
    }

    #[test]
    fn repeated_or_shrinking_tokens_are_caught() {
        let ops = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(OpKind::Claim, 10, 400, Applied::Yes, LEASE),
        ];
        let f = run(&ops, &[], &[]);
        assert!(
            f.violations.iter().any(|v| v.contains("granted twice")),
            "{f:?}"
        );
        let ops = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(OpKind::Claim, 9, 400, Applied::Yes, LEASE),
        ];
        let f = run(&ops, &[], &[]);
        assert!(
            f.violations.iter().any(|v| v.contains("is not greater")),
            "{f:?}"
        );
    }

    #[test]
    fn an_execution_with_a_token_never_granted_is_caught() {
        let f = run(&[], &[exec(7, 1, 0, 1, ExecEnd::Ok)], &[]);
        assert!(
            f.violations.iter().any(|v| v.contains("never granted")),
            "{f:?}"
        );
    }

    #[test]
    fn an_unseen_completion_may_end_the_hold_early_on_a_short_retention() {
        // Call 1's work ended at 10 ms and its completion was never answered (the call was
        // dropped while it was in flight): it may have applied, and with a 100 ms retention
        // its record may be gone from 110 ms although the lease ran to 300 ms.
        let ttl = Duration::from_millis(100);
        for (at, doubled) in [(150, false), (80, true)] {
            let ops = [
                op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
                op(OpKind::Claim, 5_000, at, Applied::Yes, LEASE),
            ];
            let execs = [
                exec(10, 1, 1, 10, ExecEnd::Ok),
                exec(5_000, 2, at + 1, at + 5, ExecEnd::Ok),
            ];
            let f = check(&ops, &execs, &[], &short(ttl), EPS);
            assert_eq!(!f.double_effects.is_empty(), doubled, "{at}: {f:?}");
            // A record kept for long holds for the whole lease.
            assert_eq!(run(&ops, &execs, &[]).double_effects.len(), 1, "{at}");
        }
    }
}
