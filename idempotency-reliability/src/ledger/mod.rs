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

mod check;
#[cfg(test)]
mod tests;

pub use check::{check, Findings, SeenCompleted};

use idempotency_core::store::{async_trait, Cas, Claim, ClaimRequest, Failure, Reclaim, Record};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
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
    /// A failure that releases the key (retryable).
    Fail,
    /// A permanent failure: it closes the key for the record's retention, as a completion
    /// does (the engine records one in the outcome's place when the outcome cannot be
    /// stored).
    FailPermanently,
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
    /// It panicked (the soak's work panics before its effect, so it did nothing; the engine
    /// settles the key for good, since in general a panicking work may have acted).
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
        let kind = if failure.retryable {
            OpKind::Fail
        } else {
            OpKind::FailPermanently
        };
        self.record(id, kind, token.0, invoked, Self::cas(&result), ttl);
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
