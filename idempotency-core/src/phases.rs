//! Multi-step operations that resume instead of restarting: atomic phases and recovery
//! points.
//!
//! Real mutations are rarely one transaction: a ride is booked in the database, charged
//! through a payment provider, then a receipt is queued. With [`Phases`], each step is a
//! **phase**; a database phase runs in its own transaction of a store that keeps **recovery
//! points** ([`RecoveryPoints`]), and its writes commit together with the record's recovery
//! point (the phase reached, and the state the next phase needs), fenced by the holder's
//! token. The last phase commits with the record's completion, and its value is the outcome
//! every retry replays.
//!
//! A retry of the same key after the holder died, once its lease has passed, **resumes** at
//! the last recovery point with its state: phases already committed never run again. A
//! phase that calls another service ([`Phases::foreign`]) runs outside any transaction, so
//! it can run twice (its holder may die after the call and before its recovery point
//! commits): its [`PhaseContext::key`] is the same on every attempt and for every holder, so
//! the other side deduplicates it when sent as that service's idempotency key. That is why
//! a foreign call sits **alone in its phase**: anything else in the phase would be redone
//! with it, and the recovery point right after it is what keeps it from being made again
//! once it is known to have succeeded.
//!
//! What becomes of the key when a phase does not commit follows the exactly-once rules of
//! [`transaction`](crate::transaction): the work's error is recorded as a failure that
//! releases the key (stored, by an engine that stores errors: [`ErrorOutcomes`]), a fenced phase is `LeaseLost`, a commit of
//! unknown outcome holds the key. A store with recovery points keeps them when a record
//! fails and when it is reclaimed, so a retry after a recorded failure also resumes.
//!
//! State between phases is typed: each phase takes the value the phase before returned
//! (serialized as JSON in the recovery point; the first phase takes `()`).
//!
//! The request's own data (what to book, the amount) reaches the first phase through its
//! closure, and the later phases only through that state: a [`Completer`](crate::Completer)
//! resuming an operation has no request. So let the first phase be a database phase that
//! writes what the later ones need and returns it (a completer only ever takes over an
//! operation past it); a foreign call first would leave a completer nothing to call with.

use crate::engine::decode_stored;
use crate::transaction::driver::{renew_kept, transaction, Seal};
use crate::transaction::{TransactionEnd, TransactionalStore};
use crate::{
    Answer, Begin, Error, ErrorOutcomes, Failure, Fingerprint, Idempotency, IdempotencyKey, Lease,
    Operation, Reclaim, RecordId, RecordStatus, Scope,
};
use async_trait::async_trait;
use futures::future::BoxFuture;
use futures::FutureExt;
use serde::{de::DeserializeOwned, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

/// How far a multi-step operation has come: written with the writes of the phase that
/// reached it, in the same transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryPoint {
    /// The operation's name ([`Phases::new`]): a record of another operation is not resumed.
    pub operation: String,
    /// How many phases have committed: the phase to run next.
    pub phase: u16,
    /// The token of the holder that wrote the operation's first recovery point: with the
    /// record's address, the operation's identity, from which foreign keys are derived.
    pub origin: u64,
    /// The state the next phase takes: the JSON of the last committed phase's value.
    pub state: Vec<u8>,
}

impl Abandoned {
    /// An abandoned operation as a store read it back: the record's scope, key and
    /// fingerprint, the operation's name and phase. [`Error::CorruptRecord`] when any of them
    /// is not what a store writes.
    pub fn from_columns(
        scope: &str,
        key: &str,
        fingerprint: &[u8],
        operation: String,
        phase: i64,
    ) -> Result<Self, Error> {
        let corrupt = |detail: String| Error::CorruptRecord {
            reason: format!("the abandoned operation {scope:?} {key:?}: {detail}"),
            source: None,
        };
        let id = RecordId::new(
            IdempotencyKey::new(key).map_err(|e| corrupt(e.to_string()))?,
            Scope::new(scope).map_err(|e| corrupt(e.to_string()))?,
        );
        let fingerprint = Fingerprint::from_slice(fingerprint)
            .ok_or_else(|| corrupt(format!("a fingerprint of {} bytes", fingerprint.len())))?;
        let phase = u16::try_from(phase).map_err(|_| corrupt(format!("phase {phase}")))?;
        Ok(Self {
            id,
            fingerprint,
            operation,
            phase,
        })
    }
}

impl RecoveryPoint {
    /// The recovery point a store read back as nullable columns (name, phase, origin,
    /// state): `None` when they are all NULL, [`Error::CorruptRecord`] when only some are, or
    /// when the phase or the origin is out of range. `what` names the record in the error.
    pub fn from_columns(
        what: &dyn fmt::Display,
        operation: Option<String>,
        phase: Option<i64>,
        origin: Option<i64>,
        state: Option<Vec<u8>>,
    ) -> Result<Option<Self>, Error> {
        let corrupt = |detail: String| Error::CorruptRecord {
            reason: format!("{what}: {detail}"),
            source: None,
        };
        match (operation, phase, origin, state) {
            (None, None, None, None) => Ok(None),
            (Some(operation), Some(phase), Some(origin), Some(state)) => {
                match (u16::try_from(phase), u64::try_from(origin)) {
                    (Ok(phase), Ok(origin)) => Ok(Some(Self {
                        operation,
                        phase,
                        origin,
                        state,
                    })),
                    _ => Err(corrupt(format!(
                        "a recovery point at phase {phase}, origin {origin}"
                    ))),
                }
            }
            _ => Err(corrupt("a recovery point with NULL parts".to_owned())),
        }
    }
}

/// A [`TransactionalStore`] that keeps a recovery point on each record, for [`Phases`].
///
/// A store keeps a record's recovery point while the record lives: a reclaim (a new token)
/// and a recorded failure leave it as it is; a fresh claim of an expired or purged record
/// starts without one.
#[async_trait]
pub trait RecoveryPoints: TransactionalStore {
    /// Inside `transaction`: if `lease`'s token still holds the record (live, Pending) and
    /// its recovery point is at phase `from` (`None`: the record has none yet), sets it to
    /// `to`. Nothing of it is visible before the commit. [`Error::LeaseLost`] when either
    /// condition fails (only the holder moves the recovery point, so a moved one means the
    /// record is no longer this holder's).
    ///
    /// A store whose transactions keep the lease in the process ([`Begun::Locked`](crate::store::Begun))
    /// must also renew the holder's lease for [`Lease::lease`] with it: the record's own lease
    /// may have passed while the phase held the row, and whoever waits for the row would
    /// otherwise take the operation over the moment the phase commits.
    async fn advance_in(
        &self,
        transaction: &mut Self::Transaction,
        lease: &Lease,
        from: Option<u16>,
        to: &RecoveryPoint,
    ) -> Result<(), Error>;

    /// The recovery point of the record `lease` holds (`None` when it has none).
    async fn recovery_point(&self, lease: &Lease) -> Result<Option<RecoveryPoint>, Error>;

    /// Operations whose holder is gone, for the [`Completer`](crate::Completer): live records
    /// with a recovery point of their own that are Pending with their lease passed, or Failed
    /// retryably for at least [`AbandonedQuery::failed_for`]; only of the operations the
    /// query names, claimed fewer than [`AbandonedQuery::max_attempts`] times; at most
    /// [`AbandonedQuery::limit`], least recently written first. Records without a recovery
    /// point (keys of one-step work) are never listed.
    ///
    /// A row the store cannot read back as an [`Abandoned`] is listed as its error
    /// ([`Error::CorruptRecord`]), in its place: one bad row does not hide the others.
    async fn abandoned(
        &self,
        query: &AbandonedQuery,
    ) -> Result<Vec<Result<Abandoned, Error>>, Error>;
}

/// A store shared behind an `Arc` is the same store.
#[async_trait]
impl<S: RecoveryPoints + ?Sized> RecoveryPoints for std::sync::Arc<S> {
    async fn advance_in(
        &self,
        transaction: &mut Self::Transaction,
        lease: &Lease,
        from: Option<u16>,
        to: &RecoveryPoint,
    ) -> Result<(), Error> {
        (**self).advance_in(transaction, lease, from, to).await
    }

    async fn recovery_point(&self, lease: &Lease) -> Result<Option<RecoveryPoint>, Error> {
        (**self).recovery_point(lease).await
    }

    async fn abandoned(
        &self,
        query: &AbandonedQuery,
    ) -> Result<Vec<Result<Abandoned, Error>>, Error> {
        (**self).abandoned(query).await
    }
}

/// Which abandoned operations [`RecoveryPoints::abandoned`] lists: filtered in the store, so
/// that operations a completer will not take (of another kind, given up on, failing again
/// right now) never fill its batches and starve the ones it can finish.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AbandonedQuery {
    /// Only operations of these names.
    pub operations: Vec<String>,
    /// Only records claimed fewer times than this (a record's
    /// [`attempts`](crate::Record::attempts): its first claim and every takeover).
    pub max_attempts: u32,
    /// A Failed operation only once its failure was recorded at least this long ago.
    pub failed_for: Duration,
    /// At most this many.
    pub limit: usize,
}

impl AbandonedQuery {
    /// Up to `limit` abandoned operations named in `operations`, whatever their attempts,
    /// failed ones at once.
    pub fn new<N: Into<String>>(operations: impl IntoIterator<Item = N>, limit: usize) -> Self {
        Self {
            operations: operations.into_iter().map(Into::into).collect(),
            max_attempts: u32::MAX,
            failed_for: Duration::ZERO,
            limit,
        }
    }

    /// Only records claimed fewer than `max_attempts` times.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// Failed operations only once their failure is `failed_for` old.
    pub fn failed_for(mut self, failed_for: Duration) -> Self {
        self.failed_for = failed_for;
        self
    }
}

/// An operation whose holder is gone ([`RecoveryPoints::abandoned`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandoned {
    /// The record's address.
    pub id: RecordId,
    /// The fingerprint of the request that started it.
    pub fingerprint: Fingerprint,
    /// The operation's name.
    pub operation: String,
    /// The phase it stopped at (how many phases committed).
    pub phase: u16,
}

/// What a phase knows about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseContext {
    operation: String,
    name: String,
    phase: u16,
    key: String,
}

impl PhaseContext {
    /// The operation's name.
    pub fn operation(&self) -> &str {
        &self.operation
    }

    /// The phase's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The phase's index (the first is 0).
    pub fn phase(&self) -> u16 {
        self.phase
    }

    /// A key for this phase of this operation: the same on every attempt and for every
    /// holder, different for every other phase, operation and record (a new record of the
    /// same key, after the old one expired, is a new operation). Send it as the idempotency
    /// key of the phase's foreign call. 64 hexadecimal characters.
    pub fn key(&self) -> &str {
        &self.key
    }
}

/// The key of `phase` of the operation `operation` on the record `id` (of `fingerprint`,
/// first recovery point by the holder of token `origin`): SHA-256 over all of them,
/// length-prefixed, in hexadecimal.
pub fn phase_key(
    id: &RecordId,
    fingerprint: &Fingerprint,
    origin: u64,
    operation: &str,
    phase: u16,
) -> String {
    let mut h = Sha256::new();
    h.update(b"idempotency-phase-key-v1");
    for part in [
        id.scope.as_str().as_bytes(),
        id.key.as_str().as_bytes(),
        operation.as_bytes(),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    h.update(fingerprint.as_bytes());
    h.update(origin.to_be_bytes());
    h.update(phase.to_be_bytes());
    hex::encode(h.finalize())
}

type DatabaseRun<S, E> = Box<
    dyn for<'t> FnMut(
            &'t mut <S as TransactionalStore>::Transaction,
            Vec<u8>,
            PhaseContext,
        ) -> BoxFuture<'t, Result<Result<Vec<u8>, E>, Error>>
        + Send,
>;

type ForeignRun<E> = Box<
    dyn FnMut(Vec<u8>, PhaseContext) -> BoxFuture<'static, Result<Result<Vec<u8>, E>, Error>>
        + Send,
>;

enum Step<S: TransactionalStore, E> {
    Database(DatabaseRun<S, E>),
    Foreign(ForeignRun<E>),
}

/// A multi-step operation on the store `S`: its phases, in order, each taking the value the
/// one before returned (`()` for the first), the last one's value of type `T` being the
/// operation's outcome; `E` is the error a phase may end the operation with.
///
/// Built with [`Phases::new`], then [`Phases::phase`] and [`Phases::foreign`] once per
/// phase, and run with [`Idempotency::run_phases`].
pub struct Phases<S: TransactionalStore, T, E> {
    operation: String,
    steps: Vec<(String, Step<S, E>)>,
    _value: PhantomData<fn() -> T>,
}

impl<S: TransactionalStore, T, E> fmt::Debug for Phases<S, T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = self.steps.iter().map(|(name, _)| name.as_str()).collect();
        f.debug_struct("Phases")
            .field("operation", &self.operation)
            .field("phases", &names)
            .finish()
    }
}

impl<S: TransactionalStore, E> Phases<S, (), E> {
    /// An operation named `operation`, without phases yet. The name is written in its
    /// recovery points: a record another operation started is not resumed by this one.
    pub fn new(operation: impl Into<String>) -> Self {
        Self {
            operation: operation.into(),
            steps: Vec::new(),
            _value: PhantomData,
        }
    }
}

/// Pins a closure to the higher-ranked signature of a database phase.
fn database<S, E, F>(run: F) -> F
where
    S: TransactionalStore,
    F: for<'t> FnMut(
        &'t mut S::Transaction,
        Vec<u8>,
        PhaseContext,
    ) -> BoxFuture<'t, Result<Result<Vec<u8>, E>, Error>>,
{
    run
}

/// Pins a closure to the higher-ranked signature of a transaction's work.
fn work<S, T, E, F>(run: F) -> F
where
    S: TransactionalStore,
    F: for<'t> FnMut(
        &'t mut S::Transaction,
        crate::WorkContext,
    ) -> BoxFuture<'t, Result<Result<T, E>, Error>>,
{
    run
}

fn codec(source: serde_json::Error) -> Error {
    Error::Codec { source }
}

impl<S, T, E> Phases<S, T, E>
where
    S: TransactionalStore + 'static,
    T: DeserializeOwned + Send + 'static,
    E: Send + 'static,
{
    /// A phase that writes through the store's transaction: `run` gets the transaction's
    /// connection ([`TransactionalStore::Connection`], as the work of
    /// [`Idempotency::run_in_transaction`] does), the value of the phase before and the
    /// phase's context, and returns its value (or `Err(error)`, what `?` on a failed
    /// statement returns). Its writes commit with the recovery point (or, for the last phase,
    /// the completion), or not at all. Like the work of [`Idempotency::run_in_transaction`],
    /// it runs again after a conflict with a concurrent transaction
    /// ([`TransactionalStore::is_conflict`] of its `Err`), so it acts only through the
    /// connection it is given and returns its database errors as `Err`.
    pub fn phase<N, F>(self, name: impl Into<String>, mut run: F) -> Phases<S, N, E>
    where
        N: Serialize + 'static,
        F: for<'t> FnMut(
                &'t mut S::Connection,
                T,
                PhaseContext,
            ) -> BoxFuture<'t, Result<Result<N, E>, S::WorkError>>
            + Send
            + 'static,
    {
        let erased = database::<S, E, _>(move |tx, input, ctx| {
            let value = match serde_json::from_slice::<T>(&input) {
                Ok(value) => value,
                Err(e) => return futures::future::ready(Err(codec(e))).boxed(),
            };
            let ran = run(S::connection(tx), value, ctx);
            Box::pin(async move { encoded(ran.await.map_err(S::work_error)) })
        });
        self.then(name.into(), Step::Database(Box::new(erased)))
    }

    /// A phase that calls another service, outside any transaction: `run` gets the value of
    /// the phase before and the phase's context, whose [`PhaseContext::key`] it sends as the
    /// call's idempotency key, and returns its value. The recovery point commits after it.
    /// It must do nothing but the call: if its holder dies before the recovery point
    /// commits, the next holder runs it again, and only the other side's deduplication by
    /// the key keeps the call from acting twice.
    pub fn foreign<N, F, Fut>(self, name: impl Into<String>, mut run: F) -> Phases<S, N, E>
    where
        N: Serialize + 'static,
        F: FnMut(T, PhaseContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Result<N, E>, Error>> + Send + 'static,
    {
        let erased: ForeignRun<E> = Box::new(move |input, ctx| {
            let value = match serde_json::from_slice::<T>(&input) {
                Ok(value) => value,
                Err(e) => return futures::future::ready(Err(codec(e))).boxed(),
            };
            let ran = run(value, ctx);
            Box::pin(async move { encoded(ran.await) })
        });
        self.then(name.into(), Step::Foreign(erased))
    }
}

impl<S: TransactionalStore, T, E> Phases<S, T, E> {
    /// This operation with `step` added, whose value is an `N`.
    fn then<N>(mut self, name: String, step: Step<S, E>) -> Phases<S, N, E> {
        self.steps.push((name, step));
        Phases {
            operation: self.operation,
            steps: self.steps,
            _value: PhantomData,
        }
    }
}

/// A phase's result with its value as JSON, as the next phase and the recovery point take it.
fn encoded<N: Serialize, E>(ran: Result<Result<N, E>, Error>) -> Result<Result<Vec<u8>, E>, Error> {
    match ran? {
        Ok(value) => serde_json::to_vec(&value).map(Ok).map_err(codec),
        Err(e) => Ok(Err(e)),
    }
}

/// The recovery point after a phase: written with its writes.
struct Advance {
    from: Option<u16>,
    operation: String,
    phase: u16,
    origin: u64,
}

impl<S: RecoveryPoints> Seal<S, Vec<u8>> for Advance {
    fn encode(&self, value: &Vec<u8>) -> Result<Vec<u8>, Error> {
        Ok(value.clone())
    }

    fn seal<'t>(
        &'t self,
        store: &'t S,
        transaction: &'t mut S::Transaction,
        lease: &'t Lease,
        state: Vec<u8>,
    ) -> BoxFuture<'t, Result<(), Error>> {
        Box::pin(async move {
            let to = RecoveryPoint {
                operation: self.operation.clone(),
                phase: self.phase,
                origin: self.origin,
                state,
            };
            store.advance_in(transaction, lease, self.from, &to).await
        })
    }
}

/// The completion of the last phase, whose value arrives as its JSON.
struct CompleteWithJson;

impl<S: TransactionalStore> Seal<S, Vec<u8>> for CompleteWithJson {
    fn encode(&self, value: &Vec<u8>) -> Result<Vec<u8>, Error> {
        // `Ok(value)` of a `Result`, as `encode_outcome` writes it.
        let mut bytes = Vec::with_capacity(value.len() + 7);
        bytes.extend_from_slice(br#"{"Ok":"#);
        bytes.extend_from_slice(value);
        bytes.push(b'}');
        Ok(bytes)
    }
}

/// A transaction end of the JSON of a value, as one of the value.
fn typed_end<T: DeserializeOwned, E>(end: TransactionEnd<Vec<u8>, E>) -> TransactionEnd<T, E> {
    match end {
        TransactionEnd::Committed(json) => match serde_json::from_slice(&json) {
            Ok(value) => TransactionEnd::Committed(value),
            // Written from a `T` a moment ago; should it not read back, the record is
            // completed all the same: the caller gets the error, a retry the replay.
            Err(e) => TransactionEnd::Unknown(codec(e)),
        },
        TransactionEnd::WorkFailed(e) => TransactionEnd::WorkFailed(e),
        TransactionEnd::LeaseLost => TransactionEnd::LeaseLost,
        TransactionEnd::RolledBack(e) => TransactionEnd::RolledBack(e),
        TransactionEnd::Unknown(e) => TransactionEnd::Unknown(e),
    }
}

impl<S: RecoveryPoints + 'static, M> Idempotency<S, M> {
    /// Runs the multi-step operation `phases` once for `(scope, key)` on the engine's store,
    /// resuming at the record's recovery point when an earlier holder committed phases of it
    /// (see the [module documentation](crate::phases)).
    ///
    /// The key is claimed as by [`Idempotency::begin`] (a replay, a key reused with another
    /// request and a key in progress behave as in [`Idempotency::run`]), except that a failed
    /// operation is never taken over by a request with another fingerprint (it may have
    /// committed phases for the request that started it): that is a key reused, whatever
    /// [`Policy::reclaim_failed_with_different_fingerprint`](crate::Policy) says. An
    /// operation without phases is an [`Error::Config`]; a record whose recovery point this
    /// operation cannot resume (another operation's, or past its last phase) is
    /// [`Error::CannotResume`].
    pub async fn run_phases<T, E>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        phases: Phases<S, T, E>,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        M: ErrorOutcomes<E>,
    {
        self.run_phases_on(&**self.store(), key, scope, fingerprint, phases)
            .await
    }
}

impl<St: ?Sized, M> Idempotency<St, M> {
    /// [`Idempotency::run_phases`] on `store`, which must reach the same records as this
    /// engine's store.
    pub(crate) async fn run_phases_on<S, T, E>(
        &self,
        store: &S,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        phases: Phases<S, T, E>,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        S: RecoveryPoints,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        M: ErrorOutcomes<E>,
    {
        let count = phase_count(&phases)?;
        let id = RecordId::new(key.clone(), scope.clone());
        // A failed operation may have committed phases (a ride written, a card charged) for
        // the request that started it: a request with another fingerprint must not take it
        // over and resume it with that request's state. Such a retry is a mismatch here,
        // whatever the policy allows for one-step work.
        let strict;
        let engine = if self.policy().reclaim_failed_with_different_fingerprint {
            strict = self.with_policy(
                self.policy()
                    .clone()
                    .reclaim_failed_with_different_fingerprint(false),
            )?;
            &strict
        } else {
            self
        };
        let lease = match engine.begin(&id, fingerprint).await? {
            Begin::Replay(record) => {
                return decode_stored(&record, M::replayed).map(Answer::Replayed)
            }
            Begin::Refused(refusal) => return Ok(Answer::Refused(refusal)),
            Begin::Execute(lease) => lease,
        };
        let point = match store.recovery_point(&lease).await {
            Ok(point) => point,
            Err(e) => {
                return lease
                    .settle_transaction::<M, _, _>(Ok(rolled_back(e)))
                    .await
            }
        };
        self.drive_phases(store, &id, fingerprint, lease, point, phases, count)
            .await
    }

    /// Finishes the operation `phases` of the record `id` that an earlier holder left past
    /// its first phase, for a [`Completer`](crate::Completer): never starts one. The record
    /// is taken over only if it is there (live, of `fingerprint`) and a takeover is due (a
    /// passed lease, a recorded failure: a compare-and-swap on the token read), and run only
    /// from a recovery point past the first phase. Anything else is
    /// [`Resumed::NotStarted`] (nothing written), or, for a record the takeover finds
    /// without such a point (its first holder died before its first phase committed), a
    /// retryable failure that leaves the key to its client: its request runs it from the
    /// first phase.
    pub(crate) async fn resume_phases<S, T, E>(
        &self,
        store: &S,
        id: &RecordId,
        fingerprint: &Fingerprint,
        phases: Phases<S, T, E>,
    ) -> Result<Resumed<Answer<Result<T, E>>>, Error>
    where
        S: RecoveryPoints,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        M: ErrorOutcomes<E>,
    {
        let count = phase_count(&phases)?;
        let shown = crate::engine::loggable_record(id, self.policy());
        let during = |op: Operation| {
            let shown = shown.clone();
            move |e: Error| e.during(op, shown)
        };
        let engine_store = self.records().as_ref();
        let Some(record) = engine_store.get(id).await.map_err(during(Operation::Get))? else {
            // Expired or purged since it was listed: a request with its key is a new
            // operation, for its client to start.
            return Ok(Resumed::NotStarted);
        };
        if record.fingerprint != *fingerprint || record.status == RecordStatus::Completed {
            return Ok(Resumed::TakenElsewhere);
        }
        let lease = match engine_store
            .reclaim(
                id,
                record.token,
                fingerprint,
                self.policy().lease,
                self.policy().retention,
            )
            .await
            .map_err(during(Operation::Reclaim))?
        {
            Reclaim::Reclaimed { token, .. } => {
                crate::observe::emit(crate::observe::Event::Reclaim);
                self.lease(id.clone(), token)
            }
            // A live lease, a settled record, another holder first, or a record gone since.
            Reclaim::Lost => return Ok(Resumed::TakenElsewhere),
        };
        let point = match store.recovery_point(&lease).await {
            Ok(Some(point)) if point.phase > 0 => Some(point),
            Ok(_) => {
                // A record taken over between the listing and now (another operation under
                // the key, its holder dead before its first phase): not this completer's.
                let _ = lease
                    .fail(Failure::retryable(
                        "a completer took over an operation not past its first phase, and \
                         left it to its client",
                    ))
                    .await;
                return Ok(Resumed::NotStarted);
            }
            Err(e) => {
                return lease
                    .settle_transaction::<M, _, _>(Ok(rolled_back(e)))
                    .await
                    .map(Resumed::Ran)
            }
        };
        self.drive_phases(store, id, fingerprint, lease, point, phases, count)
            .await
            .map(Resumed::Ran)
    }

    /// Runs `phases` under `lease` from the recovery point `point` (`None`: from the first
    /// phase) to the end, and settles the lease.
    #[allow(clippy::too_many_arguments)]
    async fn drive_phases<S, T, E>(
        &self,
        store: &S,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Lease,
        point: Option<RecoveryPoint>,
        mut phases: Phases<S, T, E>,
        count: u16,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        S: RecoveryPoints,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        M: ErrorOutcomes<E>,
    {
        let id = id.clone();
        let operation = phases.operation.clone();
        let (mut at, origin, mut state, mut written) = match point {
            Some(p) if p.operation != operation || p.phase >= count => {
                let e = Error::CannotResume {
                    operation: operation.clone(),
                    phases: count,
                    found: p.operation,
                    phase: p.phase,
                };
                return lease
                    .settle_transaction::<M, _, _>(Ok(rolled_back(e)))
                    .await;
            }
            Some(p) => (p.phase, p.origin, p.state, true),
            None => (0, lease.token().0, b"null".to_vec(), false),
        };
        // Whether the last phase's transaction kept the lease in the process (the record
        // locked): the record's own lease is then renewed before the next phase.
        let mut kept = false;
        let end = AssertUnwindSafe(async {
            if !written && matches!(phases.steps[0].1, Step::Foreign(_)) {
                // A foreign call first: its key is derived from the operation's origin,
                // which must be known to every later holder before the call is made.
                let start = Advance {
                    from: None,
                    operation: operation.clone(),
                    phase: 0,
                    origin,
                };
                let mut nothing = work::<S, _, E, _>(|_, _| {
                    futures::future::ready(Ok(Ok(b"null".to_vec()))).boxed()
                });
                match transaction(store, &lease, &mut nothing, &start, &mut kept).await {
                    TransactionEnd::Committed(_) => written = true,
                    end => return end,
                }
            }
            loop {
                let last = at + 1 == count;
                let (name, step) = &mut phases.steps[usize::from(at)];
                let ctx = PhaseContext {
                    operation: operation.clone(),
                    name: name.clone(),
                    phase: at,
                    key: phase_key(&id, fingerprint, origin, &operation, at),
                };
                let next = Advance {
                    from: written.then_some(at),
                    operation: operation.clone(),
                    phase: at + 1,
                    origin,
                };
                let end = match step {
                    Step::Database(run) => {
                        let input = state.clone();
                        let mut phase =
                            work::<S, _, E, _>(|tx, _| run(tx, input.clone(), ctx.clone()));
                        if last {
                            transaction(store, &lease, &mut phase, &CompleteWithJson, &mut kept)
                                .await
                        } else {
                            transaction(store, &lease, &mut phase, &next, &mut kept).await
                        }
                    }
                    Step::Foreign(run) => {
                        // Not to be taken over while the call runs.
                        if let Err(end) = renew_kept(&lease, &mut kept).await {
                            return end;
                        }
                        let value = match lease.with_heartbeat(run(state.clone(), ctx)).await {
                            Ok(Ok(value)) => value,
                            Ok(Err(e)) => return TransactionEnd::WorkFailed(e),
                            Err(e) => return TransactionEnd::RolledBack(e),
                        };
                        let mut record = work::<S, _, E, _>(|_, _| {
                            futures::future::ready(Ok(Ok(value.clone()))).boxed()
                        });
                        if last {
                            transaction(store, &lease, &mut record, &CompleteWithJson, &mut kept)
                                .await
                        } else {
                            transaction(store, &lease, &mut record, &next, &mut kept).await
                        }
                    }
                };
                match end {
                    TransactionEnd::Committed(value) if !last => {
                        state = value;
                        at += 1;
                        written = true;
                    }
                    end => return end,
                }
            }
        })
        .catch_unwind()
        .await;
        lease
            .settle_transaction::<M, _, _>(end.map(typed_end))
            .await
    }
}

/// What [`Idempotency::resume_phases`] did.
#[derive(Debug)]
pub(crate) enum Resumed<T> {
    /// It took the operation over and ran it to this end.
    Ran(T),
    /// Nothing to finish: the record is gone, or not past its first phase.
    NotStarted,
    /// Someone else holds or finished it.
    TakenElsewhere,
}

/// The number of `phases`, between 1 and 65,535.
fn phase_count<S: RecoveryPoints, T, E>(phases: &Phases<S, T, E>) -> Result<u16, Error> {
    u16::try_from(phases.steps.len())
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            Error::Config(format!(
                "operation {:?}: between 1 and 65,535 phases, not {}",
                phases.operation,
                phases.steps.len()
            ))
        })
}

fn rolled_back<T, E>(e: Error) -> TransactionEnd<T, E> {
    TransactionEnd::RolledBack(e)
}
