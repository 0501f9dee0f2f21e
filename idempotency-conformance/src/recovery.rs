//! Cases for stores with recovery points ([`RecoveryPoints`], the capability behind
//! `Idempotency::run_phases`): a store that implements it runs every [`RecoveryCase`] with
//! [`recovery_case`]. Stores without it skip these cases and keep passing the rest of the
//! kit.
//!
//! Each case drives the store directly (claims through an engine over the same records, then
//! `begin`, `advance_in`, `commit` or `rollback`, `recovery_point`) and returns what was
//! wrong, so a test can also check that a broken store fails the case meant for it.

use idempotency_core::protocol::{Begin, Lease};
use idempotency_core::store::{
    AbandonedQuery, CommitError, Failure, RecoveryPoint, RecoveryPoints,
};
use idempotency_core::{Error, Fingerprint, Idempotency, IdempotencyKey, RecordId, Scope};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// How a case lets time pass on the store's clock (advancing a manual clock, or sleeping on
/// a real one).
pub type PassTime = Box<dyn Fn(Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// What the cases need: the store, an engine over the same records whose policy has
/// [`RecoveryKit::lease`] and [`RecoveryKit::ttl`], and a way to let time pass.
pub struct RecoveryKit<S> {
    /// The store under test.
    pub store: S,
    /// An engine over the same records, with a lease of `lease` and a retention of `ttl`
    /// (and no heartbeat, so a dropped lease passes when its time has).
    pub engine: Idempotency,
    /// The engine's lease.
    pub lease: Duration,
    /// The engine's retention.
    pub ttl: Duration,
    /// Lets time pass on the store's clock.
    pub pass: PassTime,
}

impl<S> std::fmt::Debug for RecoveryKit<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecoveryKit")
            .field("lease", &self.lease)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// The cases, each a rule of [`RecoveryPoints`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryCase {
    /// A new record has no recovery point; one advanced and committed reads back whole.
    AdvanceCommitsAndReadsBack,
    /// An advance whose transaction rolls back leaves the recovery point where it was.
    RollbackLeavesThePoint,
    /// An advance applies only from the phase the record is at.
    AdvancesOnlyFromWhereItIs,
    /// A holder whose lease another one took over cannot advance, even from the right phase.
    FencedByToken,
    /// A recorded failure and the reclaim after it keep the recovery point.
    KeptAcrossFailureAndReclaim,
    /// A fresh record of the key, after the old one expired, starts without one.
    FreshRecordStartsWithout,
    /// `abandoned` lists operations whose lease passed or whose failure was recorded, and
    /// nothing else: not a live one, not a finished one, not a key without a recovery point.
    AbandonedAreListed,
    /// `abandoned` lists only what its query asks for: operations of the names given, of
    /// records claimed fewer than `max_attempts` times, failures at least `failed_for` old,
    /// at most `limit`, least recently written first.
    AbandonedQueryFilters,
}

impl RecoveryCase {
    /// Every case.
    pub const ALL: [RecoveryCase; 8] = [
        RecoveryCase::AdvanceCommitsAndReadsBack,
        RecoveryCase::RollbackLeavesThePoint,
        RecoveryCase::AdvancesOnlyFromWhereItIs,
        RecoveryCase::FencedByToken,
        RecoveryCase::KeptAcrossFailureAndReclaim,
        RecoveryCase::FreshRecordStartsWithout,
        RecoveryCase::AbandonedAreListed,
        RecoveryCase::AbandonedQueryFilters,
    ];
}

fn point(phase: u16, origin: u64, state: &str) -> RecoveryPoint {
    RecoveryPoint {
        operation: "kit-operation".to_owned(),
        phase,
        origin,
        state: state.as_bytes().to_vec(),
    }
}

fn address(case: RecoveryCase) -> RecordId {
    RecordId::new(
        IdempotencyKey::random(),
        Scope::from_parts(["conformance", "recovery", &format!("{case:?}")]).expect("scope"),
    )
}

async fn lease_of(engine: &Idempotency, id: &RecordId) -> Result<Lease, String> {
    match engine.begin(id, &Fingerprint::from_bytes(b"op")).await {
        Ok(Begin::Execute(lease)) => Ok(lease),
        Ok(other) => Err(format!("the claim of {id} did not give a lease: {other:?}")),
        Err(e) => Err(format!("the claim of {id} failed: {e}")),
    }
}

/// Advances `lease`'s record from `from` to `to` in a transaction of its own and commits:
/// `Ok(Err(e))` when the store refused (at `advance_in` or at the commit).
async fn advance<S: RecoveryPoints>(
    store: &S,
    lease: &Lease,
    from: Option<u16>,
    to: &RecoveryPoint,
    commit: bool,
) -> Result<Result<(), Error>, String> {
    let mut tx = match store.begin(lease).await {
        Ok(idempotency_core::store::Begun::Open(tx)) => tx,
        Ok(idempotency_core::store::Begun::Locked { transaction, .. }) => transaction,
        Ok(_) => return Err("begin answered something unknown".to_owned()),
        // A store whose transaction locks the record first may find it another holder's
        // at once.
        Err(e @ Error::LeaseLost { .. }) => return Ok(Err(e)),
        Err(e) => return Err(format!("begin failed: {e}")),
    };
    if let Err(e) = store.advance_in(&mut tx, lease, from, to).await {
        store.rollback(tx).await;
        return Ok(Err(e));
    }
    if !commit {
        store.rollback(tx).await;
        return Ok(Ok(()));
    }
    match store.commit(tx).await {
        Ok(()) => Ok(Ok(())),
        Err(CommitError::NotCommitted(e)) => Ok(Err(e)),
        Err(CommitError::Unknown(e)) => Err(format!("a commit of unknown outcome: {e}")),
        Err(e) => Err(format!("the commit failed: {e:?}")),
    }
}

async fn read<S: RecoveryPoints>(
    store: &S,
    lease: &Lease,
) -> Result<Option<RecoveryPoint>, String> {
    store
        .recovery_point(lease)
        .await
        .map_err(|e| format!("recovery_point failed: {e}"))
}

fn expect_point(
    found: Option<RecoveryPoint>,
    want: Option<&RecoveryPoint>,
    when: &str,
) -> Result<(), String> {
    if found.as_ref() == want {
        Ok(())
    } else {
        Err(format!(
            "{when}: the recovery point is {found:?}, expected {want:?}"
        ))
    }
}

fn expect_lost(r: Result<(), Error>, when: &str) -> Result<(), String> {
    match r {
        Err(Error::LeaseLost { .. }) => Ok(()),
        other => Err(format!("{when}: expected LeaseLost, got {other:?}")),
    }
}

/// The records of the `abandoned` cases, all of `first`'s operation (and phase): `lease`'s
/// record, held; another at phase 1 whose failure was recorded; one finished; one of a
/// key without a recovery point. In that order.
async fn abandoned_world<S: RecoveryPoints>(
    kit: &RecoveryKit<S>,
    case: RecoveryCase,
    lease: &Lease,
    first: &RecoveryPoint,
) -> Result<[RecordId; 4], String> {
    let (store, engine) = (&kit.store, &kit.engine);
    advance(store, lease, None, first, true)
        .await?
        .map_err(|e| format!("the advance was refused: {e}"))?;
    // The stores keep milliseconds: the next record is written strictly later.
    (kit.pass)(Duration::from_millis(20)).await;
    let (failed_id, done_id, plain_id) = (address(case), address(case), address(case));
    let of = |token: u64, state: &str| RecoveryPoint {
        origin: token,
        state: state.as_bytes().to_vec(),
        ..first.clone()
    };
    let failed = lease_of(engine, &failed_id).await?;
    advance(store, &failed, None, &of(failed.token().0, "f"), true)
        .await?
        .map_err(|e| format!("the advance was refused: {e}"))?;
    failed
        .fail(Failure::retryable("the next phase failed"))
        .await
        .map_err(|e| format!("recording the failure failed: {e}"))?;
    let done = lease_of(engine, &done_id).await?;
    advance(store, &done, None, &of(done.token().0, "d"), true)
        .await?
        .map_err(|e| format!("the advance was refused: {e}"))?;
    done.complete(br#"{"Ok":1}"#)
        .await
        .map_err(|e| format!("the completion failed: {e}"))?;
    let _plain = lease_of(engine, &plain_id).await?;
    Ok([lease.id().clone(), failed_id, done_id, plain_id])
}

/// What `query` lists of the records `ids`, by key: `Err` if the listing failed or a row of
/// them did not read back.
async fn listed<S: RecoveryPoints>(
    store: &S,
    query: &AbandonedQuery,
    ids: &[RecordId],
    when: &str,
) -> Result<Vec<idempotency_core::store::Abandoned>, String> {
    let all = store
        .abandoned(query)
        .await
        .map_err(|e| format!("abandoned failed {when}: {e}"))?;
    let mut mine = Vec::new();
    for row in all {
        // Rows of other cases' records may be listed too; none may be unreadable.
        let row = row.map_err(|e| format!("abandoned listed an unreadable row {when}: {e}"))?;
        if ids.contains(&row.id) {
            mine.push(row);
        }
    }
    Ok(sorted(mine))
}

fn sorted(
    mut all: Vec<idempotency_core::store::Abandoned>,
) -> Vec<idempotency_core::store::Abandoned> {
    all.sort_by(|a, b| a.id.key.as_str().cmp(b.id.key.as_str()));
    all
}

fn sorted_ids(mut all: Vec<RecordId>) -> Vec<RecordId> {
    all.sort_by(|a, b| a.key.as_str().cmp(b.key.as_str()));
    all
}

/// Runs every case against `kit`'s store, in turn: `Err` names the first case that failed and
/// says what was wrong.
pub async fn recovery_cases<S: RecoveryPoints>(kit: &RecoveryKit<S>) -> Result<(), String> {
    for case in RecoveryCase::ALL {
        recovery_case(kit, case)
            .await
            .map_err(|e| format!("{case:?}: {e}"))?;
    }
    Ok(())
}

/// A foreign service for the phases of a test operation: it acts (a charge) once per key,
/// answering a call made again with the same key as the first, and can be told to hang once
/// after acting, as a service whose answer never comes back (its caller then dies, or loses
/// its lease, before its recovery point commits).
#[derive(Debug, Default)]
pub struct ForeignService {
    effects: std::sync::Mutex<std::collections::HashMap<String, i64>>,
    keys: std::sync::Mutex<Vec<String>>,
    hang_after_acting: std::sync::atomic::AtomicUsize,
    acted: tokio::sync::Notify,
}

impl ForeignService {
    /// Acts for `key` (once per key) and answers the effect's number (1 for the first).
    pub async fn call(&self, key: &str) -> i64 {
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(key.to_owned());
        let effect = {
            let mut effects = self.effects.lock().unwrap_or_else(|e| e.into_inner());
            let next = i64::try_from(effects.len())
                .unwrap_or(i64::MAX)
                .saturating_add(1);
            *effects.entry(key.to_owned()).or_insert(next)
        };
        let hang = self
            .hang_after_acting
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| n.checked_sub(1),
            )
            .is_ok();
        if hang {
            self.acted.notify_one();
            futures::future::pending::<()>().await;
        }
        effect
    }

    /// Makes the next `n` calls hang after acting.
    pub fn hang_after_acting(&self, n: usize) {
        self.hang_after_acting
            .store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// Waits for a call that acted and hangs (register before the call could happen: the
    /// wake-up is kept if it comes first).
    pub async fn acted_and_hung(&self) {
        self.acted.notified().await;
    }

    /// How many times it acted (distinct keys).
    pub fn effects(&self) -> usize {
        self.effects.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The key of every call, in order, repeats included.
    pub fn keys(&self) -> Vec<String> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Runs `case` against `kit`'s store: `Err` says what was wrong.
pub async fn recovery_case<S: RecoveryPoints>(
    kit: &RecoveryKit<S>,
    case: RecoveryCase,
) -> Result<(), String> {
    let (store, engine) = (&kit.store, &kit.engine);
    let id = address(case);
    let lease = lease_of(engine, &id).await?;
    let origin = lease.token().0;
    let first = point(1, origin, r#"{"ride":7}"#);
    match case {
        RecoveryCase::AdvanceCommitsAndReadsBack => {
            expect_point(read(store, &lease).await?, None, "a new record")?;
            advance(store, &lease, None, &first, true)
                .await?
                .map_err(|e| format!("the first advance was refused: {e}"))?;
            expect_point(
                read(store, &lease).await?,
                Some(&first),
                "after the advance",
            )?;
            let second = point(2, origin, r#"{"ride":7,"charge":"ch_1"}"#);
            advance(store, &lease, Some(1), &second, true)
                .await?
                .map_err(|e| format!("the second advance was refused: {e}"))?;
            expect_point(
                read(store, &lease).await?,
                Some(&second),
                "after the second advance",
            )
        }
        RecoveryCase::RollbackLeavesThePoint => {
            advance(store, &lease, None, &first, false)
                .await?
                .map_err(|e| format!("the advance was refused: {e}"))?;
            expect_point(
                read(store, &lease).await?,
                None,
                "after a rolled back advance",
            )?;
            advance(store, &lease, None, &first, true)
                .await?
                .map_err(|e| format!("the advance was refused: {e}"))?;
            advance(store, &lease, Some(1), &point(2, origin, "2"), false)
                .await?
                .map_err(|e| format!("the second advance was refused: {e}"))?;
            expect_point(
                read(store, &lease).await?,
                Some(&first),
                "after a rolled back advance",
            )
        }
        RecoveryCase::AdvancesOnlyFromWhereItIs => {
            expect_lost(
                advance(store, &lease, Some(1), &point(2, origin, "2"), true).await?,
                "an advance from phase 1 of a record without a recovery point",
            )?;
            advance(store, &lease, None, &first, true)
                .await?
                .map_err(|e| format!("the advance was refused: {e}"))?;
            expect_lost(
                advance(store, &lease, None, &point(1, origin, "again"), true).await?,
                "an advance from no recovery point of a record at phase 1",
            )?;
            expect_lost(
                advance(store, &lease, Some(2), &point(3, origin, "3"), true).await?,
                "an advance from phase 2 of a record at phase 1",
            )?;
            expect_point(
                read(store, &lease).await?,
                Some(&first),
                "after refused advances",
            )
        }
        RecoveryCase::FencedByToken => {
            advance(store, &lease, None, &first, true)
                .await?
                .map_err(|e| format!("the advance was refused: {e}"))?;
            (kit.pass)(kit.lease + Duration::from_millis(50)).await;
            let taker = lease_of(engine, &id).await?;
            expect_lost(
                advance(store, &lease, Some(1), &point(2, origin, "stale"), true).await?,
                "an advance by the holder whose lease was taken over",
            )?;
            expect_point(
                read(store, &taker).await?,
                Some(&first),
                "after the stale advance",
            )?;
            let next = point(2, origin, "taker");
            advance(store, &taker, Some(1), &next, true)
                .await?
                .map_err(|e| format!("the new holder's advance was refused: {e}"))?;
            expect_point(
                read(store, &taker).await?,
                Some(&next),
                "after the new holder's advance",
            )
        }
        RecoveryCase::KeptAcrossFailureAndReclaim => {
            advance(store, &lease, None, &first, true)
                .await?
                .map_err(|e| format!("the advance was refused: {e}"))?;
            lease
                .fail(Failure::retryable("the next phase failed"))
                .await
                .map_err(|e| format!("recording the failure failed: {e}"))?;
            let again = lease_of(engine, &id).await?;
            expect_point(
                read(store, &again).await?,
                Some(&first),
                "after a failure and a reclaim",
            )
        }
        RecoveryCase::AbandonedAreListed => {
            let ids = abandoned_world(kit, case, &lease, &first).await?;
            let [_, failed_id, ..] = &ids;
            let query = AbandonedQuery::new([first.operation.as_str()], 10_000);
            let early = listed(store, &query, &ids, "while a lease is live").await?;
            if early.iter().map(|a| &a.id).collect::<Vec<_>>() != vec![failed_id] {
                return Err(format!(
                    "while the holders' leases are live, abandoned lists {early:?}; expected only \
                     the operation whose failure was recorded"
                ));
            }
            (kit.pass)(kit.lease + Duration::from_millis(50)).await;
            let late = listed(store, &query, &ids, "after the leases passed").await?;
            let want = [&id, failed_id]
                .map(|id| idempotency_core::store::Abandoned {
                    id: id.clone(),
                    fingerprint: Fingerprint::from_bytes(b"op"),
                    operation: first.operation.clone(),
                    phase: 1,
                })
                .to_vec();
            if late != sorted(want.clone()) {
                return Err(format!(
                    "after the leases passed, abandoned lists {late:?}; expected {want:?} (not \
                     the finished operation, not the key without a recovery point)"
                ));
            }
            Ok(())
        }
        RecoveryCase::AbandonedQueryFilters => {
            // An operation name of this run's own, so that no other record is listed.
            let own = RecoveryPoint {
                operation: format!("kit-filters-{}", IdempotencyKey::random()),
                ..first.clone()
            };
            let op = own.operation.as_str();
            // `lease`'s record is written first, then the failed one.
            let ids = abandoned_world(kit, case, &lease, &own).await?;
            let [held_id, failed_id, ..] = &ids;
            (kit.pass)(kit.lease + Duration::from_millis(50)).await;
            let query = AbandonedQuery::new([op], 10_000);
            let expect =
                |found: Vec<idempotency_core::store::Abandoned>, want: &[&RecordId], what: &str| {
                    let found: Vec<_> = found.into_iter().map(|a| a.id).collect();
                    let want: Vec<RecordId> = want.iter().map(|&id| id.clone()).collect();
                    if found == sorted_ids(want.clone()) {
                        Ok(())
                    } else {
                        Err(format!(
                            "{what}: abandoned lists {found:?}, expected {want:?}"
                        ))
                    }
                };
            expect(
                listed(store, &query, &ids, "of this operation").await?,
                &[held_id, failed_id],
                "asked for this operation",
            )?;
            let other = AbandonedQuery::new(["another-operation", "kit"], 10_000);
            expect(
                listed(store, &other, &ids, "of other operations").await?,
                &[],
                "asked for other operations only",
            )?;
            expect(
                listed(
                    store,
                    &AbandonedQuery::new(["x", op], 10_000),
                    &ids,
                    "of two",
                )
                .await?,
                &[held_id, failed_id],
                "asked for this operation and another",
            )?;
            expect(
                listed(store, &query.clone().max_attempts(1), &ids, "under one").await?,
                &[],
                "asked for records claimed fewer than once (each was claimed once)",
            )?;
            expect(
                listed(store, &query.clone().max_attempts(2), &ids, "under two").await?,
                &[held_id, failed_id],
                "asked for records claimed fewer than twice",
            )?;
            expect(
                listed(
                    store,
                    &query.clone().failed_for(kit.lease),
                    &ids,
                    "a lease old",
                )
                .await?,
                &[held_id, failed_id],
                "asked for failures a lease old (the failure is older than that)",
            )?;
            expect(
                listed(
                    store,
                    &query.clone().failed_for(kit.lease * 10),
                    &ids,
                    "ten leases old",
                )
                .await?,
                &[held_id],
                "asked for failures ten leases old (the failure is younger; the lease passed)",
            )?;
            let oldest = store
                .abandoned(&AbandonedQuery::new([op], 1))
                .await
                .map_err(|e| format!("abandoned with a limit of 1 failed: {e}"))?;
            match oldest.as_slice() {
                [Ok(a)] if &a.id == held_id => Ok(()),
                other => Err(format!(
                    "a limit of 1 listed {other:?}; expected only the least recently written, \
                     {held_id:?}"
                )),
            }
        }
        RecoveryCase::FreshRecordStartsWithout => {
            advance(store, &lease, None, &first, true)
                .await?
                .map_err(|e| format!("the advance was refused: {e}"))?;
            lease
                .fail(Failure::retryable("given up"))
                .await
                .map_err(|e| format!("recording the failure failed: {e}"))?;
            (kit.pass)(kit.ttl + kit.lease + Duration::from_millis(50)).await;
            let fresh = lease_of(engine, &id).await?;
            expect_point(
                read(store, &fresh).await?,
                None,
                "a fresh record after expiry",
            )
        }
    }
}
