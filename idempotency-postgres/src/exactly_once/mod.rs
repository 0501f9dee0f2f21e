//! The engine helper that completes inside the business transaction.

mod session;

use session::{is_connection_loss, is_serialization_failure, keep_alive, later, LevelCache};

use crate::error::{map_sqlx, Effect};
use crate::store::Level;
use crate::PostgresStore;
use futures::future::BoxFuture;
use futures::FutureExt;
use idempotency_core::{
    decode_replay, encode_outcome, Cas, Error, Fingerprint, Idempotency, IdempotencyKey,
    IdempotencyStore, Lease, Outcome, Policy, Proceed, RecordId, Scope, TransactionEnd,
    WorkContext,
};
use serde::{de::DeserializeOwned, Serialize};
use sqlx::PgConnection;
use std::fmt::Display;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

/// How many times the transaction is run again after a serialization failure or deadlock in
/// the completion or the commit.
const MAX_TRANSACTION_ATTEMPTS: u32 = 8;

/// An [`Idempotency`] engine over a [`PostgresStore`] that runs the work and its completion
/// in one database transaction: exactly-once effects for work whose effects are writes to the
/// same database.
///
/// ```no_run
/// use idempotency_core::{Fingerprint, IdempotencyKey, Policy, Scope};
/// use idempotency_postgres::{PostgresIdempotency, PostgresStore};
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let engine = PostgresIdempotency::new(store, Policy::default())?;
/// let key = IdempotencyKey::new("order-42")?;
/// let scope = Scope::from_parts(["tenant-1", "POST /orders"])?;
/// let fp = Fingerprint::from_json(&serde_json::json!({"sku": "A1", "qty": 2}));
/// let outcome = engine
///     .run_in_transaction(&key, &scope, &fp, |tx, _ctx| {
///         Box::pin(async move {
///             let id: i64 = sqlx::query_scalar(
///                 "INSERT INTO orders (sku, qty) VALUES ('A1', 2) RETURNING id",
///             )
///             .fetch_one(&mut *tx)
///             .await
///             .map_err(|e| e.to_string())?;
///             Ok::<_, String>(id)
///         })
///     })
///     .await?;
/// println!("order {:?}, replayed: {}", outcome.get(), outcome.is_replayed());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct PostgresIdempotency {
    engine: Idempotency,
    store: PostgresStore,
    level: Arc<LevelCache>,
}

/// The former name of [`PostgresIdempotency`], after the pattern of `SqliteIdempotency`.
#[deprecated(since = "0.1.0", note = "renamed to PostgresIdempotency")]
pub type PgIdempotency = PostgresIdempotency;

impl PostgresIdempotency {
    /// An engine over `store` with `policy`.
    pub fn new(store: PostgresStore, policy: Policy) -> Result<Self, Error> {
        let engine = Idempotency::new(Arc::new(store.clone()), policy)?;
        Ok(Self {
            engine,
            store,
            level: Arc::default(),
        })
    }

    /// An exactly-once engine from an `engine` whose store is `store` behind a decorator (one
    /// that adds metrics, tracing or injected faults to the calls): its calls must reach
    /// `store`'s table, or the completion in the work's transaction will not find the record
    /// it claimed. Prefer [`PostgresIdempotency::new`].
    pub fn with_engine(store: PostgresStore, engine: Idempotency) -> Self {
        Self {
            engine,
            store,
            level: Arc::default(),
        }
    }

    /// The plain engine, for work that does not write to this database.
    pub fn engine(&self) -> &Idempotency {
        &self.engine
    }

    /// The store.
    pub fn store(&self) -> &PostgresStore {
        &self.store
    }

    /// Runs `work` once for `(scope, key)` inside a transaction on the store's pool, and
    /// stores its `Ok` outcome in the same transaction.
    ///
    /// - Replays return the stored outcome; the work does not run.
    /// - `Ok(v)`: the completion CAS runs in the work's transaction, then it commits. If the
    ///   lease was lost meanwhile (a stalled holder whose key was reclaimed), the CAS matches
    ///   nothing, the transaction rolls back with all the work's writes, and the result is
    ///   [`Error::LeaseLost`].
    /// - `Err(e)`: the transaction rolls back, then the error is handled per
    ///   [`Policy::errors`] (by default the key is released for a retry) and returned as
    ///   `Fresh(Err(e))`.
    /// - A serialization failure or deadlock in the completion or the commit re-runs the
    ///   transaction (up to 8 times), so `work` must only act through the connection it is
    ///   given. Errors inside `work` are `work`'s to return.
    /// - If the connection dies during the commit, the result is [`Error::OutcomeUnknown`]
    ///   and the key is held (nothing is written) until its lease passes: a retry then finds
    ///   the Completed record and replays the committed outcome, or, if nothing committed,
    ///   takes the key over and runs the work once. Either way the key ends with one committed
    ///   execution. The key is never released while the work's writes may still commit.
    /// - A connection found dead when the transaction begins (every idle connection is, after
    ///   a server restart) is given back, and the transaction begins on the next one.
    ///
    /// # Isolation levels
    ///
    /// The transaction runs at the level the pool's sessions run at (their
    /// `default_transaction_isolation`, set for example in the pool's `after_connect` or with
    /// `ALTER ROLE … SET`); do not issue `SET TRANSACTION` inside `work`, which runs after
    /// this method's first statement. The level is learned from the first statement of the
    /// transaction (or from the last completion: sessions at READ COMMITTED then cost no extra
    /// statement) and decides how the lease is kept while the work runs:
    ///
    /// - **READ COMMITTED**: the heartbeat ([`Policy::heartbeat`]) extends the lease from
    ///   another pooled connection, as in [`Idempotency::run`]. A duplicate request is told
    ///   at once that the key is in progress; a holder that stalls past its lease (no
    ///   heartbeat reached the database) can be taken over, and its completion is then fenced
    ///   and everything it wrote rolls back.
    /// - **REPEATABLE READ and SERIALIZABLE**: a heartbeat committed on another connection
    ///   would make the completion fail to serialize, so instead the transaction's first
    ///   statement locks the record row (`SELECT … FOR NO KEY UPDATE`, checking it is still
    ///   Pending with this holder's token and its lease has not passed) and holds it until
    ///   the commit. Nobody else can change the record meanwhile: a reclaimer, a duplicate
    ///   request's claim, a purge or another completion waits for the transaction to end (or
    ///   skips the row), then finds the record Completed (a replay) or, after a rollback,
    ///   as it was. The lease is kept in the process: every heartbeat interval renews it, and
    ///   if it passes without one (the heartbeat is off and the work outlives the lease, or
    ///   the process stalled), the work is cancelled, the transaction rolls back and the
    ///   result is [`Error::LeaseLost`], leaving the record to be reclaimed. Duplicates
    ///   therefore wait for a running holder instead of getting
    ///   [`Error::InProgress`] at once, each holding a pooled connection while it waits.
    ///   After a serialization failure the lease is extended before the transaction runs
    ///   again; a duplicate that was waiting may have taken the key over first if the work
    ///   outlived the lease, and then the re-run is fenced (nothing was committed).
    ///
    /// A work that never returns holds the key as long as the heartbeat runs, at every level
    /// (and at REPEATABLE READ and SERIALIZABLE keeps the row locked).
    pub async fn run_in_transaction<T, E, F>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        mut work: F,
    ) -> Result<Outcome<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send,
        E: Serialize + DeserializeOwned + Display + Send,
        F: for<'c> FnMut(&'c mut PgConnection, WorkContext) -> BoxFuture<'c, Result<T, E>> + Send,
    {
        let id = RecordId::new(scope.clone(), key.clone());
        let lease = match self.engine.begin(&id, fingerprint).await?.proceed()? {
            Proceed::Replay(record) => return decode_replay(&record).map(Outcome::Replayed),
            Proceed::Execute(lease) => lease,
        };
        let end = AssertUnwindSafe(self.transaction(&lease, &mut work))
            .catch_unwind()
            .await;
        lease.settle_transaction(end).await
    }

    /// Runs the work's transaction under `lease` until it ends (re-running it after
    /// serialization failures and deadlocks), keeping the lease as the isolation level needs.
    /// What then becomes of the key is [`Lease::settle_transaction`]'s to decide.
    async fn transaction<T, E, F>(&self, lease: &Lease, work: &mut F) -> TransactionEnd<T, E>
    where
        T: Serialize + Send,
        E: Serialize + Send,
        F: for<'c> FnMut(&'c mut PgConnection, WorkContext) -> BoxFuture<'c, Result<T, E>> + Send,
    {
        let table = self.store.table_name().qualified();
        let policy = self.engine.policy();
        let mut attempt = 0;
        let mut lost = 0;
        let mut held_lock = false;
        loop {
            attempt += 1;
            if held_lock {
                // The previous attempt (rolled back) kept the lease in the process while it
                // held the row, so the record's own lease may have passed: renew it before
                // running again (fenced if a waiting duplicate took the key meanwhile).
                match self
                    .store
                    .extend(lease.id(), lease.token(), policy.lease)
                    .await
                {
                    Ok(Cas::Applied) => {}
                    Ok(Cas::Fenced) => return TransactionEnd::LeaseLost,
                    // Nothing is committed, but whether the renewal applied is not known:
                    // the key is held until its lease passes, as a dropped lease holds it.
                    Err(e) => return TransactionEnd::Unknown(e),
                }
            }
            // BEGIN runs in a task of its own. sqlx 0.8 leaks an open transaction into the
            // pool when the future of `Pool::begin` is dropped after BEGIN was sent but before
            // its answer (its rollback guard sees depth 0 and queues nothing): the next user
            // of that connection then runs its statements inside a transaction nobody
            // commits, holding their row locks for ever. Spawned, BEGIN always finishes, and
            // a transaction dropped unused (our caller was cancelled) rolls back.
            let mut tx = match self.begin_transaction(&table).await {
                Ok(tx) => tx,
                // Nothing of this attempt ran, and no earlier attempt committed.
                Err(e) => return TransactionEnd::RolledBack(e),
            };
            // How the lease is kept while the work runs: see the isolation levels above.
            let locked_until = if self.level.get() == Some(Level::ReadCommitted) {
                None
            } else {
                let hold = match self.store.hold_in(&mut tx, lease.id(), lease.token()).await {
                    Ok(hold) => hold,
                    Err(e) => {
                        let _ = tx.rollback().await;
                        if is_serialization_failure(&e) && attempt < MAX_TRANSACTION_ATTEMPTS {
                            continue;
                        }
                        // The connection died between BEGIN and this first statement (a
                        // restart): nothing ran; begin again on another connection.
                        if is_connection_loss(&e) && lost < self.max_lost() {
                            if lost == 0 {
                                self.store.sweep_idle().await;
                            }
                            lost += 1;
                            attempt -= 1;
                            continue;
                        }
                        // The work has not run in this attempt and no earlier attempt
                        // committed.
                        return match e {
                            Error::LeaseLost { .. } => TransactionEnd::LeaseLost,
                            e => TransactionEnd::RolledBack(e),
                        };
                    }
                };
                self.level.set(hold.level);
                match (hold.level, hold.lease_left) {
                    (Level::ReadCommitted, _) => None,
                    (Level::Snapshot, Some(left)) if !left.is_zero() => {
                        Some(later(Instant::now(), left))
                    }
                    (Level::Snapshot, _) => {
                        // Reclaimed, settled or expired, or the lease passed before the work
                        // could start: the key is not ours to run.
                        let _ = tx.rollback().await;
                        return TransactionEnd::LeaseLost;
                    }
                }
            };
            held_lock = locked_until.is_some();
            let running = AssertUnwindSafe(work(&mut tx, lease.context())).catch_unwind();
            let ran = match locked_until {
                None => Some(lease.with_heartbeat(running).await),
                Some(until) => keep_alive(policy, until, lease.work_deadline(), running).await,
            };
            let value = match ran {
                Some(Ok(Ok(value))) => value,
                Some(Ok(Err(e))) => {
                    let _ = tx.rollback().await;
                    return TransactionEnd::WorkFailed(e);
                }
                Some(Err(panic)) => {
                    // Roll back before the panic goes on (the key is then released).
                    let _ = tx.rollback().await;
                    std::panic::resume_unwind(panic);
                }
                None => {
                    // The lease passed without a heartbeat while the row was locked: the work
                    // was cancelled; roll back (nothing it did commits) and leave the record,
                    // whose lease has passed, to whoever reclaims it.
                    let _ = tx.rollback().await;
                    return TransactionEnd::LeaseLost;
                }
            };
            // Stored as `Ok(value)` of a `Result<T, E>`, as the plain engine stores it.
            let bytes = match encode_outcome(&Ok::<&T, &E>(&value)) {
                Ok(bytes) => bytes,
                Err(e) => {
                    let _ = tx.rollback().await;
                    return TransactionEnd::RolledBack(e);
                }
            };
            let completed = self
                .store
                .complete_in_reporting(
                    &mut tx,
                    lease.id(),
                    lease.token(),
                    &bytes,
                    lease.ttl(),
                    held_lock,
                )
                .await;
            match completed {
                Ok(level) => self.level.set(level),
                Err(e) => {
                    let _ = tx.rollback().await;
                    if let Error::LeaseLost { .. } = e {
                        return TransactionEnd::LeaseLost;
                    }
                    if is_serialization_failure(&e) {
                        if !held_lock {
                            // A serialization failure cannot happen at READ COMMITTED: the
                            // sessions run at another level; ask again next time.
                            self.level.forget();
                        }
                        if attempt < MAX_TRANSACTION_ATTEMPTS {
                            continue;
                        }
                    }
                    // Nothing committed (the transaction never got to COMMIT).
                    return TransactionEnd::RolledBack(e);
                }
            }
            match tx.commit().await {
                Ok(()) => return TransactionEnd::Committed(value),
                Err(e)
                    if crate::error::is_serialization_failure(&e)
                        && attempt < MAX_TRANSACTION_ATTEMPTS =>
                {
                    continue
                }
                // A lost connection is `OutcomeUnknown`: the commit may have applied. The key
                // holds until its lease passes; a retry then finds the Completed record (and
                // replays it) or, if nothing was committed, reclaims the key and runs the
                // work once.
                Err(e) => return TransactionEnd::Unknown(map_sqlx(e, &table, Effect::Write)),
            }
        }
    }
}
