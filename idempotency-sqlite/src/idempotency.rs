//! The exactly-once engine: an [`Idempotency`] engine over one [`SqliteStore`], whose work
//! writes in the transaction that completes its record.

use crate::exactly_once::closed;
use crate::SqliteStore;
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, Phases, Policy, Scope, WorkContext,
};
use rusqlite::Transaction;
use serde::{de::DeserializeOwned, Serialize};
use std::sync::Arc;

/// The engine of SQLite's exactly-once path: an [`Idempotency`] engine built over one
/// [`SqliteStore`] (it cannot be built over another store), whose
/// [`run_in_transaction`](SqliteIdempotency::run_in_transaction) commits the work's writes and
/// the completion in one transaction. Postgres has the same shape in `PostgresIdempotency`.
///
/// ```no_run
/// # async fn demo(store: idempotency_sqlite::SqliteStore) -> Result<(), idempotency_core::Error> {
/// use idempotency_core::{Answer, Fingerprint, IdempotencyKey, Policy, Scope};
/// use idempotency_sqlite::{rusqlite::params, SqliteIdempotency};
///
/// let engine = SqliteIdempotency::new(store, Policy::default())?;
/// let (key, scope) = (IdempotencyKey::new("order-7")?, Scope::new("shop|orders")?);
/// let fp = Fingerprint::from_bytes(b"2 apples");
/// let outcome = engine
///     .run_in_transaction(&key, &scope, &fp, |tx, _ctx| {
///         tx.execute("INSERT INTO orders (item) VALUES (?1)", params!["apples"])
///             .map_err(|e| e.to_string())?;
///         Ok::<_, String>(tx.last_insert_rowid())
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
pub struct SqliteIdempotency {
    engine: Idempotency,
    store: SqliteStore,
}

impl SqliteIdempotency {
    /// An engine over `store` with `policy` (checked with [`Policy::validate`]).
    pub fn new(store: SqliteStore, policy: Policy) -> Result<Self, Error> {
        let engine = Idempotency::new(Arc::new(store.clone()), policy)?;
        Ok(Self { engine, store })
    }

    /// An exactly-once engine from an `engine` whose store is `store` behind a decorator (one
    /// that adds metrics, tracing or injected faults to the calls): its calls must reach
    /// `store`'s file and table, or the completion in the work's transaction will not find the
    /// record it claimed. Prefer [`SqliteIdempotency::new`].
    pub fn with_engine(store: SqliteStore, engine: Idempotency) -> Self {
        Self { engine, store }
    }

    /// The plain engine, for work that does not write to this database.
    pub fn engine(&self) -> &Idempotency {
        &self.engine
    }

    /// The store.
    pub fn store(&self) -> &SqliteStore {
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
        phases: Phases<SqliteStore, T, E>,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Serialize + DeserializeOwned + std::fmt::Display + Send + 'static,
    {
        self.engine
            .run_phases(&self.store, key, scope, fingerprint, phases)
            .await
    }

    /// Runs `work` once for `(scope, key)` with its database writes and the completion in
    /// **one transaction**, so they commit together or not at all.
    ///
    /// The key is claimed through the engine (replay, mismatch and in-progress behave as in
    /// [`Idempotency::run`]); then, on the store's connection, a `BEGIN IMMEDIATE` transaction
    /// is opened and `work` gets it. When `work` returns `Ok`, the completion CAS
    /// ([`SqliteStore::complete_in`]) runs in the same transaction and it commits:
    ///
    /// - if the lease was lost meanwhile (the holder stalled past it and a retry took the key
    ///   over), the CAS matches nothing, the transaction rolls back — business writes
    ///   included — and the result is [`Error::LeaseLost`];
    /// - if the process dies before the commit, nothing was written and the key's lease
    ///   passes, so a retry runs the work again; either way the effect happens once.
    ///
    /// When `work` returns `Err`, its writes roll back and the error follows the engine's
    /// [`Policy::errors`] (released for a retry by default) and is returned as
    /// `Executed(Err(e))`. `work` runs on the connection's thread: keep slow calls to other
    /// systems out of it, since it holds the database's write lock. Holding that lock from
    /// its `BEGIN IMMEDIATE`, the transaction cannot conflict with another (no deadlock, no
    /// busy error midway), so unlike the Postgres and MySQL engines nothing here is run again.
    pub async fn run_in_transaction<T, E, F>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        work: F,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Serialize + DeserializeOwned + std::fmt::Display + Send + 'static,
        F: FnOnce(&Transaction<'_>, &WorkContext) -> Result<T, E> + Send + 'static,
    {
        // SQLite never reports a conflict, so the work is asked for once.
        let mut work = Some(work);
        let engine = &self.engine;
        engine
            .run_in_transaction(&self.store, key, scope, fingerprint, move |tx, ctx| {
                let work = work.take();
                Box::pin(async move {
                    let work = work.ok_or_else(|| closed("the work already ran"))?;
                    tx.run(move |tx| work(tx, &ctx)).await
                })
            })
            .await
    }
}
