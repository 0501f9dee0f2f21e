//! The exactly-once engine: an [`Idempotency`] engine over one [`MySqlStore`], whose
//! work writes in the transaction that completes its record.

use crate::error::database_error;
use crate::MySqlStore;
use futures::future::BoxFuture;
use futures::FutureExt;
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, Phases, Policy, Scope, WorkContext,
};
use serde::{de::DeserializeOwned, Serialize};
use sqlx::MySqlConnection;
use std::fmt::Display;
use std::sync::Arc;

/// An [`Idempotency`] engine over a [`MySqlStore`] that runs the work and its completion
/// in one database transaction: exactly-once effects for work whose effects are writes to the
/// same database.
///
/// ```no_run
/// use idempotency_core::{Answer, Fingerprint, IdempotencyKey, Policy, Scope};
/// use idempotency_mysql::{MySqlIdempotency, MySqlStore};
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MySqlStore::connect("mysql://app@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let engine = MySqlIdempotency::new(store, Policy::default())?;
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
///             .await?; // a database error: rolled back, and run again after a conflict
///             Ok(Ok::<_, String>(id)) // the work's answer; `Ok(Err(refusal))` to refuse
///         })
///     })
///     .await?;
/// match outcome {
///     Answer::Executed(order) => println!("order {order:?} written now"),
///     Answer::Replayed(order) => println!("order {order:?} written before"),
///     Answer::Refused(refusal) => println!("not written: {refusal}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct MySqlIdempotency {
    engine: Idempotency,
    store: MySqlStore,
}

impl MySqlIdempotency {
    /// An engine over `store` with `policy`.
    pub fn new(store: MySqlStore, policy: Policy) -> Result<Self, Error> {
        let engine = Idempotency::new(Arc::new(store.clone()), policy)?;
        Ok(Self { engine, store })
    }

    /// An exactly-once engine from an `engine` whose store is `store` behind a decorator (one
    /// that adds metrics, tracing or injected faults to the calls): its calls must reach
    /// `store`'s table, or the completion in the work's transaction will not find the record
    /// it claimed. Prefer [`MySqlIdempotency::new`].
    pub fn with_engine(store: MySqlStore, engine: Idempotency) -> Self {
        Self { engine, store }
    }

    /// The plain engine, for work that does not write to this database.
    pub fn engine(&self) -> &Idempotency {
        &self.engine
    }

    /// The store.
    pub fn store(&self) -> &MySqlStore {
        &self.store
    }

    /// Runs the multi-step operation `phases` once for `(scope, key)` on this store, resuming
    /// at its last recovery point after a holder died:
    /// [`Idempotency::run_phases`](idempotency_core::Idempotency::run_phases) without passing
    /// the store a second time.
    pub async fn run_phases<T, E>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        phases: Phases<MySqlStore, T, E>,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Serialize + DeserializeOwned + std::fmt::Display + Send + 'static,
    {
        self.engine
            .run_phases(&self.store, key, scope, fingerprint, phases)
            .await
    }

    /// Runs `work` once for `(scope, key)` inside a transaction on the store's pool, and
    /// stores its `Ok` outcome in the same transaction.
    ///
    /// - Replays return the stored outcome; the work does not run.
    /// - `Ok(Ok(v))`: the completion CAS runs in the work's transaction, then it commits. If the
    ///   lease was lost meanwhile (a stalled holder whose key was reclaimed), the CAS matches
    ///   nothing, the transaction rolls back with all the work's writes, and the result is
    ///   [`Error::LeaseLost`].
    /// - `Ok(Err(e))`, the work's own refusal (a declined payment, an invalid request): the
    ///   transaction rolls back, then the error is handled per [`Policy::errors`] (by default
    ///   the key is released for a retry) and returned as `Executed(Err(e))`.
    /// - `Err(database_error)`, what `?` on a failed sqlx call returns: the transaction rolls
    ///   back. A deadlock (1213), a lock wait timeout (1205) or a row changed since the
    ///   snapshot (1020) in the work's own statements, or a deadlock or lock wait timeout in
    ///   the completion or the commit, runs the whole transaction again, `work` included (at
    ///   most
    ///   [`MAX_TRANSACTION_ATTEMPTS`](idempotency_core::MAX_TRANSACTION_ATTEMPTS) runs in all),
    ///   so `work` must only act through the connection it is given. Any other database error
    ///   (or a conflict on the last run) releases the key, since nothing committed, and is
    ///   returned as [`Error::Backend`] whose source is the sqlx error
    ///   (`error.find_source::<sqlx::Error>()`). A database error the work wants stored as its
    ///   answer (a unique key it calls a duplicate order, say) it returns as `Ok(Err(..))`.
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
    /// The transaction runs at the level the pool's sessions run at (set for example with
    /// `SET SESSION TRANSACTION ISOLATION LEVEL …` in the pool's `after_connect`); do not
    /// issue `SET TRANSACTION` inside `work`, which runs after the transaction began. At
    /// every level (READ COMMITTED, REPEATABLE READ, SERIALIZABLE) the heartbeat
    /// ([`Policy::heartbeat`]) extends the lease from another pooled connection while the
    /// work runs, as in [`Idempotency::run`]: InnoDB's `UPDATE` reads the latest committed
    /// row whatever the transaction's snapshot, so the completion inside the transaction
    /// sees the extended lease, and no row lock is held while the work runs. A duplicate
    /// request is told at once that the key is in progress; a holder that stalls past its
    /// lease can be taken over, and its completion is then fenced and everything it wrote
    /// rolls back. Under MariaDB's snapshot isolation (`innodb_snapshot_isolation`, on by
    /// default from 11.8) a record the heartbeat extended after the work's first read cannot
    /// be completed in its transaction: the call ends with
    /// [`MySqlError::SnapshotIsolation`](crate::MySqlError::SnapshotIsolation)
    /// and the key is released; run long work at READ COMMITTED or with it off.
    ///
    /// `work` must never commit (no `COMMIT`, no statement that commits implicitly, such as
    /// DDL or `LOCK TABLES`) and must return a database error it meets rather than swallow
    /// it: after a deadlock InnoDB has rolled its writes back, and only the error tells the
    /// engine to run it all again.
    ///
    /// A work that never returns holds the key as long as the heartbeat runs.
    pub async fn run_in_transaction<T, E, F>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        mut work: F,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Serialize + DeserializeOwned + Display + Send + 'static,
        F: for<'c> FnMut(
                &'c mut MySqlConnection,
                WorkContext,
            ) -> BoxFuture<'c, Result<Result<T, E>, sqlx::Error>>
            + Send,
    {
        let engine = &self.engine;
        engine
            .run_in_transaction(&self.store, key, scope, fingerprint, |tx, ctx| {
                work(tx.connection(), ctx)
                    .map(|ran| ran.map_err(database_error))
                    .boxed()
            })
            .await
    }
}
