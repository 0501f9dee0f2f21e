//! Multi-step operations (`Idempotency::run_phases`) on the toy store of the store author's
//! guide, given recovery points: a three-phase flow (a ride written to the database, a
//! charge through a foreign service that deduplicates by key, a receipt written to the
//! database) resumes after its holder dies at each point, never running a committed phase
//! again.

include!("../../../idempotency-core/src/toy_store.rs");

use idempotency_conformance::recovery::{recovery_case, recovery_cases, RecoveryCase, RecoveryKit};
use idempotency_core::protocol::Lease;
use idempotency_core::store::{Begun, CommitError, RecoveryPoint, RecoveryPoints};
use idempotency_core::transaction::Started;
use idempotency_core::{
    Answer, BatchMessage, Completer, Idempotency, IdempotencyKey, PhaseContext, Phases, Policy,
    Refusal, Scope, TransactionalStore,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

/// The toy store with recovery points and two "business tables": rides and receipts. A
/// transaction buffers its writes, its recovery point and its completion, and applies them
/// under the locks at the commit, or none of them.
#[derive(Debug, Default)]
struct Bank {
    records: Arc<ToyStore>,
    tables: Mutex<Tables>,
    /// A deliberate flaw, for the kit's cases to catch.
    flaw: Option<Flaw>,
}

/// What a broken bank gets wrong.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Flaw {
    /// Advances from whatever phase the record is at.
    IgnoresFrom,
    /// Advances whoever holds the record now.
    NoTokenFence,
    /// Writes the recovery point at `advance_in`, before (and whether or not) the commit.
    AppliesBeforeCommit,
    /// Reads a recovery point an older record of the key left.
    KeepsStalePoints,
    /// Reads only a recovery point its holder's own token wrote (forgotten at a reclaim).
    ForgetsOnReclaim,
    /// Lists operations whose holder's lease is still live as abandoned.
    ListsLive,
    /// Lists operations of every name, whatever the query asks for.
    IgnoresOperations,
    /// Lists records however often they were claimed.
    IgnoresAttempts,
    /// Lists failures however young.
    IgnoresFailedFor,
    /// Reads `failed_for` a thousand times too short (milliseconds as microseconds).
    FailedForTooShort,
    /// Lists more than the limit.
    IgnoresLimit,
    /// Lists the most recently written first.
    NewestFirst,
}

#[derive(Debug, Default)]
struct Tables {
    points: HashMap<RecordId, RecoveryPoint>,
    rides: Vec<String>,
    receipts: Vec<String>,
}

#[derive(Debug, Default)]
struct Tx {
    rides: Vec<String>,
    receipts: Vec<String>,
    advance: Option<(RecordId, FencingToken, Option<u16>, RecoveryPoint)>,
    completion: Option<(RecordId, FencingToken, Vec<u8>, Duration)>,
}

impl Bank {
    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with_flaw(flaw: Flaw) -> Self {
        Self {
            flaw: Some(flaw),
            ..Self::default()
        }
    }

    /// `id`'s recovery point, if it belongs to the live record: written by a holder whose
    /// token is at least the one the record was created with (`token - attempts + 1`).
    fn current_point(&self, tables: &Tables, id: &RecordId) -> Option<RecoveryPoint> {
        let point = tables.points.get(id)?;
        let (token, attempts) = self.records.atomically(|records, now| {
            records
                .get(id)
                .filter(|r| !r.is_expired(now))
                .map(|r| (r.token.0, u64::from(r.attempts)))
        })?;
        let current = match self.flaw {
            Some(Flaw::KeepsStalePoints) => true,
            Some(Flaw::ForgetsOnReclaim) => point.origin == token,
            _ => point.origin + attempts > token,
        };
        current.then(|| point.clone())
    }
}

#[async_trait]
impl TransactionalStore for Bank {
    type Transaction = Tx;
    type Connection = Tx;
    type WorkError = Error;

    fn connection(tx: &mut Tx) -> &mut Tx {
        tx
    }

    fn connection_ref(tx: &Tx) -> &Tx {
        tx
    }

    fn work_error(error: Error) -> Error {
        error
    }

    async fn begin(&self, _lease: &Lease) -> Result<Begun<Tx>, Error> {
        Ok(Begun::Open(Tx::default()))
    }

    async fn complete_in(&self, tx: &mut Tx, lease: &Lease, outcome: &[u8]) -> Result<(), Error> {
        tx.completion = Some((
            lease.id().clone(),
            lease.token(),
            outcome.to_vec(),
            lease.retention(),
        ));
        Ok(())
    }

    async fn commit(&self, tx: Tx) -> Result<(), CommitError> {
        let mut tables = self.tables();
        let lost = |token| CommitError::NotCommitted(Error::LeaseLost { token });
        if let Some((id, token, from, to)) = &tx.advance {
            let at = self.current_point(&tables, id).map(|p| p.phase);
            if at != *from && self.flaw != Some(Flaw::IgnoresFrom) {
                return Err(lost(*token));
            }
            // The token's compare-and-swap (it changes nothing but the record's update
            // time): the point where the commit takes effect.
            if self.records.settle(id, *token, |_, _| {}) == Cas::Fenced
                && self.flaw != Some(Flaw::NoTokenFence)
            {
                return Err(lost(*token));
            }
            tables.points.insert(id.clone(), to.clone());
        }
        if let Some((id, token, outcome, ttl)) = tx.completion {
            let cas = self.records.settle(&id, token, |r, now| {
                r.status = RecordStatus::Completed;
                r.outcome = Some(outcome);
                r.lease_until = None;
                r.expires_at = now.saturating_add(ttl);
            });
            if cas == Cas::Fenced {
                return Err(lost(token));
            }
        }
        tables.rides.extend(tx.rides);
        tables.receipts.extend(tx.receipts);
        Ok(())
    }

    async fn rollback(&self, _tx: Tx) {}
}

#[async_trait]
impl RecoveryPoints for Bank {
    async fn advance_in(
        &self,
        tx: &mut Tx,
        lease: &Lease,
        from: Option<u16>,
        to: &RecoveryPoint,
    ) -> Result<(), Error> {
        if self.flaw == Some(Flaw::AppliesBeforeCommit) {
            self.tables().points.insert(lease.id().clone(), to.clone());
            return Ok(());
        }
        tx.advance = Some((lease.id().clone(), lease.token(), from, to.clone()));
        Ok(())
    }

    async fn recovery_point(&self, lease: &Lease) -> Result<Option<RecoveryPoint>, Error> {
        let tables = self.tables();
        Ok(self.current_point(&tables, lease.id()))
    }

    async fn abandoned(
        &self,
        query: &idempotency_core::store::AbandonedQuery,
    ) -> Result<Vec<Result<idempotency_core::store::Abandoned, Error>>, Error> {
        let tables = self.tables();
        let ids: Vec<RecordId> = tables.points.keys().cloned().collect();
        let flaw = |f: Flaw| self.flaw == Some(f);
        let failed_for = if flaw(Flaw::FailedForTooShort) {
            query.failed_for / 1000
        } else {
            query.failed_for
        };
        let mut found = Vec::new();
        for id in ids {
            let Some(point) = self.current_point(&tables, &id) else {
                continue;
            };
            if !flaw(Flaw::IgnoresOperations) && !query.operations.contains(&point.operation) {
                continue;
            }
            let live_lease = !flaw(Flaw::ListsLive);
            let record = self.records.atomically(|records, now| {
                records
                    .get(&id)
                    .filter(|r| flaw(Flaw::IgnoresAttempts) || r.attempts < query.max_attempts)
                    .filter(|r| match r.status {
                        RecordStatus::Pending => {
                            !live_lease || r.lease_until.is_none_or(|until| until <= now)
                        }
                        RecordStatus::Failed => {
                            r.failure.as_ref().is_some_and(|f| f.retryable)
                                && (flaw(Flaw::IgnoresFailedFor)
                                    || r.updated_at.as_millis() + failed_for.as_millis() as i64
                                        <= now.as_millis())
                        }
                        RecordStatus::Completed => false,
                    })
                    .map(|r| (r.fingerprint, r.updated_at))
            });
            if let Some((fingerprint, written)) = record {
                found.push((
                    written,
                    idempotency_core::store::Abandoned {
                        id,
                        fingerprint,
                        operation: point.operation,
                        phase: point.phase,
                    },
                ));
            }
        }
        // Least recently written first.
        found.sort_by_key(|(written, _)| *written);
        if flaw(Flaw::NewestFirst) {
            found.reverse();
        }
        if !flaw(Flaw::IgnoresLimit) {
            found.truncate(query.limit);
        }
        Ok(found.into_iter().map(|(_, a)| Ok(a)).collect())
    }
}

/// A payment service that deduplicates charges by key, and can hang a charge after it was
/// made until released (its caller may die before hearing back, or lose its lease).
#[derive(Debug, Default)]
struct Payments {
    charges: Mutex<HashMap<String, u32>>,
    calls: Mutex<Vec<String>>,
    hang_after_charge: AtomicUsize,
    charged: Notify,
    /// Let the first and the second hanging charge answer.
    release: [Notify; 2],
    hung: AtomicUsize,
}

impl Payments {
    async fn charge(&self, key: &str, amount: u32) -> u32 {
        self.calls.lock().expect("lock").push(key.to_owned());
        let id = {
            let mut charges = self.charges.lock().expect("lock");
            let next = charges.len() as u32 + 1;
            *charges
                .entry(key.to_owned())
                .or_insert(next * 1000 + amount)
        };
        if self.hang_after_charge.load(Ordering::SeqCst) > 0 {
            self.hang_after_charge.fetch_sub(1, Ordering::SeqCst);
            let n = self.hung.fetch_add(1, Ordering::SeqCst).min(1);
            self.charged.notify_one();
            self.release[n].notified().await;
        }
        id
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Ride {
    id: String,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Receipt {
    ride: String,
    charge: u32,
}

fn ride_flow(
    payments: Arc<Payments>,
    keys: Arc<Mutex<Vec<String>>>,
    receipt_fails: Arc<AtomicUsize>,
) -> Phases<Arc<Bank>, Receipt, String> {
    Phases::new("book-ride")
        .phase("create-ride", |tx: &mut Tx, (): (), _ctx: PhaseContext| {
            Box::pin(async move {
                let id = format!("ride-{}", tx.rides.len() + 1);
                tx.rides.push(id.clone());
                Ok(Ok(Ride { id }))
            })
        })
        .foreign("charge", move |ride: Ride, ctx: PhaseContext| {
            let payments = payments.clone();
            keys.lock().expect("lock").push(ctx.key().to_owned());
            async move {
                let charge = payments.charge(ctx.key(), 42).await;
                Ok(Ok((ride, charge)))
            }
        })
        .phase(
            "receipt",
            move |tx: &mut Tx, (ride, charge): (Ride, u32), _ctx: PhaseContext| {
                let fails = receipt_fails.load(Ordering::SeqCst) > 0;
                if fails {
                    receipt_fails.fetch_sub(1, Ordering::SeqCst);
                }
                Box::pin(async move {
                    if fails {
                        return Ok(Err("the receipt printer is out of paper".to_owned()));
                    }
                    tx.receipts.push(format!("{} {charge}", ride.id));
                    Ok(Ok(Receipt {
                        ride: ride.id,
                        charge,
                    }))
                })
            },
        )
}

struct World {
    bank: Arc<Bank>,
    engine: Idempotency,
    payments: Arc<Payments>,
    keys: Arc<Mutex<Vec<String>>>,
    receipt_fails: Arc<AtomicUsize>,
    key: IdempotencyKey,
    scope: Scope,
    fingerprint: Fingerprint,
    /// Whether the engine stores a work's errors (`StoreErrors`) rather than releasing them.
    stores_errors: bool,
}

impl World {
    fn new(policy: Policy) -> Self {
        let bank = Arc::new(Bank::default());
        let engine = Idempotency::new(bank.records.clone(), policy).expect("policy");
        Self {
            bank,
            engine,
            payments: Arc::new(Payments::default()),
            keys: Arc::default(),
            receipt_fails: Arc::default(),
            key: IdempotencyKey::new("ride-1").expect("key"),
            scope: Scope::new("rides").expect("scope"),
            fingerprint: Fingerprint::from_bytes(b"from A to B"),
            stores_errors: false,
        }
    }

    /// A world whose engine stores a work's errors and replays them.
    fn storing_errors(policy: Policy) -> Self {
        Self {
            stores_errors: true,
            ..Self::new(policy)
        }
    }

    fn flow(&self) -> Phases<Arc<Bank>, Receipt, String> {
        ride_flow(
            self.payments.clone(),
            self.keys.clone(),
            self.receipt_fails.clone(),
        )
    }

    async fn run(&self) -> Result<Answer<Result<Receipt, String>>, Error> {
        if self.stores_errors {
            return self
                .engine
                .storing_errors()
                .with_transactions(self.bank.clone())
                .run_phases(&self.key, &self.scope, &self.fingerprint, self.flow())
                .await;
        }
        self.engine
            .with_transactions(self.bank.clone())
            .run_phases(&self.key, &self.scope, &self.fingerprint, self.flow())
            .await
    }

    /// Runs the flow in a task that dies (is aborted, its heartbeat with it) once its charge
    /// was made, before the charge's recovery point commits.
    async fn run_and_die_after_charge(&self) {
        let engine = self.engine.clone();
        let (bank, flow) = (self.bank.clone(), self.flow());
        let (key, scope, fp) = (self.key.clone(), self.scope.clone(), self.fingerprint);
        self.payments.hang_after_charge.store(1, Ordering::SeqCst);
        let charged = self.payments.charged.notified();
        let task = tokio::spawn(async move {
            engine
                .with_transactions(bank.clone())
                .run_phases(&key, &scope, &fp, flow)
                .await
        });
        charged.await;
        task.abort();
        let _ = task.await;
    }

    fn counts(&self) -> (usize, usize, usize) {
        let tables = self.bank.tables();
        let charges = self.payments.charges.lock().expect("lock").len();
        (tables.rides.len(), charges, tables.receipts.len())
    }

    fn keys(&self) -> Vec<String> {
        self.keys.lock().expect("lock").clone()
    }
}

fn short_lease() -> Policy {
    Policy::default().lease(Duration::from_millis(300))
}

#[tokio::test]
async fn three_phases_run_once_and_a_retry_replays_the_outcome() {
    let w = World::new(Policy::default());
    let first = w.run().await.expect("runs");
    let Answer::Executed(Ok(receipt)) = first else {
        panic!("not a fresh success: {first:?}");
    };
    assert_eq!(receipt.ride, "ride-1");
    let again = w.run().await.expect("replays");
    assert_eq!(again, Answer::Replayed(Ok(receipt)));
    assert_eq!(w.counts(), (1, 1, 1), "(rides, charges, receipts)");
    assert_eq!(w.keys().len(), 1);
    assert_eq!(w.keys()[0].len(), 64);
}

#[tokio::test]
async fn a_holder_that_dies_after_the_charge_is_resumed_at_the_charge_with_the_same_key() {
    let w = World::new(short_lease());
    w.run_and_die_after_charge().await;
    assert_eq!(w.counts(), (1, 1, 0), "the ride and the charge happened");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let Answer::Executed(Ok(receipt)) = w.run().await.expect("resumes") else {
        panic!("not resumed to a fresh success");
    };
    assert_eq!(w.counts(), (1, 1, 1), "the ride was not written again");
    let keys = w.keys();
    assert_eq!(keys.len(), 2, "the charge was sent again: {keys:?}");
    assert_eq!(
        keys[0], keys[1],
        "with the same key, which the service deduplicated"
    );
    let calls = w.payments.calls.lock().expect("lock").clone();
    assert_eq!(calls, keys);
    assert_eq!(receipt.charge, 1042);
    assert_eq!(w.run().await.expect("runs"), Answer::Replayed(Ok(receipt)));
}

#[tokio::test]
async fn a_failed_phase_is_recorded_and_a_retry_resumes_at_it() {
    let w = World::new(Policy::default());
    w.receipt_fails.store(1, Ordering::SeqCst);
    let first = w.run().await.expect("ends");
    assert!(
        matches!(&first, Answer::Executed(Err(e)) if e.contains("paper")),
        "{first:?}"
    );
    assert_eq!(w.counts(), (1, 1, 0));
    // The failure released the key at once: the retry resumes at the receipt.
    let Answer::Executed(Ok(receipt)) = w.run().await.expect("resumes") else {
        panic!("not resumed");
    };
    assert_eq!(
        w.counts(),
        (1, 1, 1),
        "neither the ride nor the charge ran again"
    );
    assert_eq!(w.keys().len(), 1, "the charge was not even sent again");
    assert_eq!(receipt.ride, "ride-1");
}

#[tokio::test]
async fn a_stored_failure_ends_the_operation_and_is_replayed() {
    let w = World::storing_errors(Policy::default());
    w.receipt_fails.store(1, Ordering::SeqCst);
    let first = w.run().await.expect("ends");
    let Answer::Executed(Err(e)) = first else {
        panic!("{first:?}")
    };
    assert_eq!(w.run().await.expect("runs"), Answer::Replayed(Err(e)));
    assert_eq!(w.counts(), (1, 1, 0));
}

#[tokio::test]
async fn a_holder_that_lost_its_lease_cannot_commit_a_phase() {
    let w = World::new(short_lease().heartbeat(None));
    // The first holder charges and hangs there, past its lease; the second takes over,
    // charges again (deduplicated), and finishes; then the first hears back from the
    // payment service and tries to commit the charge's recovery point.
    w.payments.hang_after_charge.store(1, Ordering::SeqCst);
    let charged = w.payments.charged.notified();
    let stalled = {
        let engine = w.engine.clone();
        let (bank, flow) = (w.bank.clone(), w.flow());
        let (key, scope, fp) = (w.key.clone(), w.scope.clone(), w.fingerprint);
        tokio::spawn(async move {
            engine
                .with_transactions(bank.clone())
                .run_phases(&key, &scope, &fp, flow)
                .await
        })
    };
    charged.await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let Answer::Executed(Ok(receipt)) = w.run().await.expect("takes over") else {
        panic!("not taken over");
    };
    assert_eq!(w.counts(), (1, 1, 1));
    w.payments.release[0].notify_one();
    let stale = stalled.await.expect("the stalled holder ends");
    assert!(
        matches!(stale, Err(Error::LeaseLost { .. })),
        "the stale holder's recovery point committed: {stale:?}"
    );
    assert_eq!(w.run().await.expect("runs"), Answer::Replayed(Ok(receipt)));
    assert_eq!(w.counts(), (1, 1, 1), "nothing ran twice");
}

#[tokio::test]
async fn another_operation_does_not_resume_a_record_it_did_not_start() {
    let w = World::new(short_lease());
    w.run_and_die_after_charge().await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let other: Phases<Arc<Bank>, u8, String> = Phases::new("refund")
        .phase("refund", |_tx: &mut Tx, (): (), _ctx: PhaseContext| {
            Box::pin(async { Ok(Ok(1u8)) })
        });
    let r = w
        .engine
        .with_transactions(w.bank.clone())
        .run_phases(&w.key, &w.scope, &w.fingerprint, other)
        .await;
    assert!(
        matches!(&r, Err(Error::CannotResume { operation, found, phase: 1, phases: 1 })
            if operation == "refund" && found == "book-ride"),
        "{r:?}"
    );
    assert_eq!(w.counts(), (1, 1, 0));
    let none: Phases<Arc<Bank>, (), String> = Phases::new("nothing");
    assert!(matches!(
        w.engine
            .with_transactions(w.bank.clone())
            .run_phases(&w.key, &w.scope, &w.fingerprint, none)
            .await,
        Err(Error::Config(_))
    ));
}

#[tokio::test]
async fn a_first_phase_that_calls_out_gets_one_key_for_every_holder() {
    let w = World::new(short_lease());
    let payments = w.payments.clone();
    let keys = w.keys.clone();
    let flow = move || -> Phases<Arc<Bank>, u32, String> {
        let (payments, keys) = (payments.clone(), keys.clone());
        Phases::new("charge-first").foreign("charge", move |(): (), ctx: PhaseContext| {
            let payments = payments.clone();
            keys.lock().expect("lock").push(ctx.key().to_owned());
            async move { Ok(Ok(payments.charge(ctx.key(), 7).await)) }
        })
    };
    w.payments.hang_after_charge.store(1, Ordering::SeqCst);
    let task = {
        let (engine, bank, f) = (w.engine.clone(), w.bank.clone(), flow());
        let (key, scope, fp) = (w.key.clone(), w.scope.clone(), w.fingerprint);
        tokio::spawn(async move {
            engine
                .with_transactions(bank.clone())
                .run_phases(&key, &scope, &fp, f)
                .await
        })
    };
    w.payments.charged.notified().await;
    task.abort();
    let _ = task.await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let done = w
        .engine
        .with_transactions(w.bank.clone())
        .run_phases(&w.key, &w.scope, &w.fingerprint, flow())
        .await
        .expect("resumes");
    assert_eq!(done, Answer::Executed(Ok(1007)));
    let keys = w.keys();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1]);
    assert_eq!(w.payments.charges.lock().expect("lock").len(), 1);
}

#[tokio::test]
async fn phase_keys_differ_by_phase_operation_record_and_request() {
    use idempotency_core::store::phase_key;
    let id = RecordId::new(
        IdempotencyKey::new("k").expect("key"),
        Scope::new("rides").expect("scope"),
    );
    let other = RecordId::new(
        IdempotencyKey::new("k2").expect("key"),
        Scope::new("rides").expect("scope"),
    );
    let fp = Fingerprint::from_bytes(b"a");
    let base = phase_key(&id, &fp, 7, "book", 1);
    assert_eq!(base, phase_key(&id, &fp, 7, "book", 1));
    for different in [
        phase_key(&id, &fp, 7, "book", 2),
        phase_key(&id, &fp, 7, "bool", 1),
        phase_key(&id, &fp, 8, "book", 1),
        phase_key(&other, &fp, 7, "book", 1),
        phase_key(&id, &Fingerprint::from_bytes(b"b"), 7, "book", 1),
    ] {
        assert_ne!(base, different);
    }
}

#[tokio::test]
async fn a_stale_holder_at_the_same_recovery_point_is_fenced_by_its_token() {
    let w = World::new(short_lease().heartbeat(None));
    // Both holders hang in the charge: the first past its lease, the second (which took
    // over) within it. The first then hears back first, with the recovery point still
    // where it left it: only its token tells it apart.
    w.payments.hang_after_charge.store(2, Ordering::SeqCst);
    let spawn = |w: &World| {
        let engine = w.engine.clone();
        let (bank, flow) = (w.bank.clone(), w.flow());
        let (key, scope, fp) = (w.key.clone(), w.scope.clone(), w.fingerprint);
        tokio::spawn(async move {
            engine
                .with_transactions(bank.clone())
                .run_phases(&key, &scope, &fp, flow)
                .await
        })
    };
    let charged = w.payments.charged.notified();
    let first = spawn(&w);
    charged.await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let charged = w.payments.charged.notified();
    let second = spawn(&w);
    charged.await;
    w.payments.release[0].notify_one();
    let stale = first.await.expect("the first holder ends");
    assert!(
        matches!(stale, Err(Error::LeaseLost { .. })),
        "the stale holder committed: {stale:?}"
    );
    assert_eq!(w.counts(), (1, 1, 0));
    w.payments.release[1].notify_one();
    let done = second
        .await
        .expect("the second holder ends")
        .expect("finishes");
    assert!(matches!(done, Answer::Executed(Ok(_))), "{done:?}");
    assert_eq!(w.counts(), (1, 1, 1));
    let keys = w.keys();
    assert!(keys.len() == 2 && keys[0] == keys[1], "{keys:?}");
}

/// The kit's recovery point cases on `bank`: a lease of 1 s and a retention of 2 s (long
/// enough that a stalled machine does not expire a record mid-case), on the process clock
/// (time passes by sleeping).
fn kit(bank: Bank) -> RecoveryKit<Bank> {
    let (lease, ttl) = (Duration::from_secs(1), Duration::from_secs(2));
    let engine = Idempotency::new(
        bank.records.clone(),
        Policy::default()
            .lease(lease)
            .retention(ttl)
            .heartbeat(None),
    )
    .expect("policy");
    RecoveryKit {
        store: bank,
        engine,
        lease,
        ttl,
        pass: Box::new(|d| Box::pin(tokio::time::sleep(d))),
    }
}

#[tokio::test]
async fn the_toy_bank_passes_every_recovery_point_case() {
    if let Err(e) = recovery_cases(&kit(Bank::default())).await {
        panic!("{e}");
    }
}

#[tokio::test]
async fn each_flawed_bank_fails_the_case_meant_for_it() {
    for (flaw, case) in [
        (Flaw::IgnoresFrom, RecoveryCase::AdvancesOnlyFromWhereItIs),
        (Flaw::NoTokenFence, RecoveryCase::FencedByToken),
        (
            Flaw::AppliesBeforeCommit,
            RecoveryCase::RollbackLeavesThePoint,
        ),
        (
            Flaw::KeepsStalePoints,
            RecoveryCase::FreshRecordStartsWithout,
        ),
        (
            Flaw::ForgetsOnReclaim,
            RecoveryCase::KeptAcrossFailureAndReclaim,
        ),
        (Flaw::ListsLive, RecoveryCase::AbandonedAreListed),
        (Flaw::IgnoresOperations, RecoveryCase::AbandonedQueryFilters),
        (Flaw::IgnoresAttempts, RecoveryCase::AbandonedQueryFilters),
        (Flaw::IgnoresFailedFor, RecoveryCase::AbandonedQueryFilters),
        (Flaw::FailedForTooShort, RecoveryCase::AbandonedQueryFilters),
        (Flaw::IgnoresLimit, RecoveryCase::AbandonedQueryFilters),
        (Flaw::NewestFirst, RecoveryCase::AbandonedQueryFilters),
    ] {
        let kit = kit(Bank::with_flaw(flaw));
        let found = recovery_case(&kit, case).await;
        assert!(found.is_err(), "{flaw:?} passed {case:?}");
        eprintln!("{flaw:?} fails {case:?}: {}", found.unwrap_err());
    }
}

/// A failed operation may have committed phases for the request that started it: a request
/// with another fingerprint is a mismatch, never a takeover that resumes it (even though the
/// policy lets one-step work be reclaimed by another request after a failure).
#[tokio::test]
async fn a_failed_operation_is_not_taken_over_by_another_request() {
    let w = World::new(Policy::default());
    assert!(w.engine.policy().reclaim_failed_with_different_fingerprint);
    w.receipt_fails.store(1, Ordering::SeqCst);
    let first = w.run().await.expect("ends");
    assert!(matches!(first, Answer::Executed(Err(_))), "{first:?}");
    assert_eq!(w.counts(), (1, 1, 0));
    let other = w
        .engine
        .with_transactions(w.bank.clone())
        .run_phases(
            &w.key,
            &w.scope,
            &Fingerprint::from_bytes(b"from C to D"),
            w.flow(),
        )
        .await;
    assert!(
        matches!(other, Ok(Answer::Refused(Refusal::KeyReused))),
        "{other:?}"
    );
    assert_eq!(w.counts(), (1, 1, 0), "nothing of it ran");
    assert_eq!(w.keys().len(), 1, "the charge was not sent again");
    // The request that started it still resumes it.
    let Answer::Executed(Ok(_)) = w.run().await.expect("resumes") else {
        panic!("not resumed");
    };
    assert_eq!(w.counts(), (1, 1, 1));
}

/// An error type that is neither `Serialize` nor `Deserialize`: the default engine, which
/// releases errors, takes it on every path; only an engine that stores errors asks for more.
#[derive(Debug, Clone, PartialEq)]
struct Declined(&'static str);

impl std::fmt::Display for Declined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "declined: {}", self.0)
    }
}

/// A two-phase operation whose second phase declines while `declines` is above zero.
fn declining_flow(declines: Arc<AtomicUsize>) -> Phases<Arc<Bank>, String, Declined> {
    Phases::new("declining")
        .phase("ride", |tx: &mut Tx, (): (), _ctx: PhaseContext| {
            Box::pin(async move {
                tx.rides.push("ride".to_owned());
                Ok(Ok(1u32))
            })
        })
        .phase("receipt", move |tx: &mut Tx, n: u32, _ctx: PhaseContext| {
            let declined = declines.load(Ordering::SeqCst) > 0;
            if declined {
                declines.fetch_sub(1, Ordering::SeqCst);
            }
            Box::pin(async move {
                if declined {
                    return Ok(Err(Declined("receipt")));
                }
                tx.receipts.push(format!("receipt {n}"));
                Ok(Ok(format!("receipt {n}")))
            })
        })
}

#[tokio::test]
async fn an_error_type_that_cannot_be_stored_is_released_on_every_path() {
    let bank = Arc::new(Bank::default());
    let engine = Idempotency::new(bank.records.clone(), Policy::default())
        .expect("policy")
        .with_transactions(bank.clone());
    let scope = Scope::new("declines").expect("scope");
    let fp = Fingerprint::from_bytes(b"order");
    let key = |k: &str| IdempotencyKey::new(k).expect("key");

    // `run`: the error is released; the retry runs the work again and its value is replayed.
    let runs = AtomicUsize::new(0);
    let work = |fail: bool| {
        let runs = &runs;
        move |_ctx| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            if fail {
                Err(Declined("run"))
            } else {
                Ok(7u32)
            }
        }
    };
    let first = engine.run(&key("run"), &scope, &fp, work(true)).await;
    assert_eq!(first.expect("runs"), Answer::Executed(Err(Declined("run"))));
    let second = engine.run(&key("run"), &scope, &fp, work(false)).await;
    assert_eq!(second.expect("runs"), Answer::Executed(Ok(7)));
    let third = engine.run(&key("run"), &scope, &fp, work(true)).await;
    assert_eq!(third.expect("replays"), Answer::Replayed(Ok(7)));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "a retry after an error ran it again, once"
    );

    // `run_in_transaction`: the work's own refusal rolls back and releases the key.
    let refuse = AtomicUsize::new(1);
    let tx_key = key("tx");
    let in_tx = || {
        engine.run_in_transaction(&tx_key, &scope, &fp, |tx: &mut Tx, _ctx| {
            let refused = refuse.fetch_sub(1, Ordering::SeqCst) > 0;
            Box::pin(async move {
                if refused {
                    return Ok(Err(Declined("tx")));
                }
                tx.rides.push("tx".to_owned());
                Ok(Ok(3u32))
            })
        })
    };
    assert_eq!(
        in_tx().await.expect("runs"),
        Answer::Executed(Err(Declined("tx")))
    );
    assert_eq!(in_tx().await.expect("runs"), Answer::Executed(Ok(3)));
    assert_eq!(in_tx().await.expect("replays"), Answer::Replayed(Ok(3)));

    // `begin_transaction`: a refusal releases the key for the next request.
    let Started::Begun(tx) = engine
        .begin_transaction::<u32, Declined>(&key("held"), &scope, &fp)
        .await
        .expect("begins")
    else {
        panic!("not begun");
    };
    assert_eq!(
        tx.refuse(Declined("held")).await.expect("refused"),
        Declined("held")
    );
    let Started::Begun(tx) = engine
        .begin_transaction::<u32, Declined>(&key("held"), &scope, &fp)
        .await
        .expect("begins again")
    else {
        panic!("the refusal did not release the key");
    };
    assert_eq!(tx.commit(5).await.expect("commits"), 5);

    // `run_batch`: a declined message is released and marked for redelivery.
    let batch = vec![
        BatchMessage::new(key("m1"), Fingerprint::from_bytes(b"1"), 1u32),
        BatchMessage::new(key("m2"), Fingerprint::from_bytes(b"2"), 2u32),
    ];
    let report = engine
        .run_batch(&scope, batch, 2, |n: u32, _ctx| async move {
            if n == 2 {
                Err(Declined("batch"))
            } else {
                Ok(n)
            }
        })
        .await;
    assert_eq!(report.redeliver(), vec![1]);

    // `run_phases` and the completer: a declined phase is recorded as a failure after the
    // phase before it committed; the completer finishes it without running that phase again.
    let declines = Arc::new(AtomicUsize::new(1));
    let first = engine
        .run_phases(
            &key("phases"),
            &scope,
            &fp,
            declining_flow(declines.clone()),
        )
        .await;
    assert_eq!(
        first.expect("runs"),
        Answer::Executed(Err(Declined("receipt")))
    );
    let flow = declines.clone();
    let completer = Completer::new(&engine)
        .retry_failed_after(Duration::ZERO)
        .operation("declining", move || declining_flow(flow.clone()));
    let round = completer.run_once().await.expect("a round");
    assert_eq!((round.found, round.completed), (1, 1), "{round:?}");
    let replay = engine
        .run_phases(&key("phases"), &scope, &fp, declining_flow(declines))
        .await;
    assert_eq!(
        replay.expect("replays"),
        Answer::Replayed(Ok("receipt 1".to_owned()))
    );
    let tables = bank.tables();
    assert_eq!(
        (tables.rides.len(), tables.receipts.len()),
        (2, 1),
        "one ride for `run_in_transaction`, one for the operation; one receipt"
    );
}

#[tokio::test]
async fn an_engine_that_stores_errors_replays_them_and_one_that_releases_them_refuses_to_read_them()
{
    let bank = Arc::new(Bank::default());
    let engine = Idempotency::new(bank.records.clone(), Policy::default()).expect("policy");
    let storing = engine.storing_errors();
    let (scope, fp) = (
        Scope::new("stored").expect("scope"),
        Fingerprint::from_bytes(b"x"),
    );
    let key = IdempotencyKey::new("declined").expect("key");
    let runs = AtomicUsize::new(0);
    let decline = |_ctx| async {
        runs.fetch_add(1, Ordering::SeqCst);
        Err::<u32, _>("insufficient funds".to_owned())
    };
    let first = storing.run(&key, &scope, &fp, decline).await.expect("runs");
    assert_eq!(
        first,
        Answer::Executed(Err("insufficient funds".to_owned()))
    );
    let again = storing
        .run(&key, &scope, &fp, decline)
        .await
        .expect("replays");
    assert_eq!(
        again,
        Answer::Replayed(Err("insufficient funds".to_owned()))
    );
    // The releasing engine cannot decode the stored error into its `Declined`: it runs
    // nothing and says the stored outcome does not fit, rather than running the work again.
    let read = engine
        .run(&key, &scope, &fp, |_ctx| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Err::<u32, _>(Declined("again"))
        })
        .await;
    assert!(matches!(read, Err(Error::StoredOutcome { .. })), "{read:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");
}

/// An engine that stores errors starts its completer with `maintain()` like any other, and the
/// completer settles as that engine does: a phase that fails while it finishes an abandoned
/// operation stores the error, which the client's retry is then replayed.
#[tokio::test]
async fn an_engine_that_stores_errors_runs_its_completer_in_the_background() {
    let w = World::storing_errors(short_lease());
    w.run_and_die_after_charge().await;
    // The receipt fails once more: in the completer's run.
    w.receipt_fails.store(1, Ordering::SeqCst);
    let storing = w.engine.storing_errors().with_transactions(w.bank.clone());
    let (payments, keys, fails) = (w.payments.clone(), w.keys.clone(), w.receipt_fails.clone());
    let completer = Completer::new(&storing).operation("book-ride", move || {
        ride_flow(payments.clone(), keys.clone(), fails.clone())
    });
    let maintenance = storing
        .maintain()
        .no_purge()
        .complete(completer, Duration::from_millis(50))
        .spawn();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while maintenance.completer_stats()[0].completed() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the completer did not finish the abandoned operation"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    maintenance.shutdown().await;
    let Answer::Replayed(Err(e)) = w.run().await.expect("replays") else {
        panic!("the completer's stored error is not replayed");
    };
    assert!(e.contains("paper"), "{e}");
    assert_eq!(w.counts(), (1, 1, 0), "one ride, one charge, no receipt");
}
