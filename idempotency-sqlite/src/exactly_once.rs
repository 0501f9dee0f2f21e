//! Exactly-once effects: the completion CAS commits or rolls back with the business writes.

use crate::SqliteStore;
use futures::FutureExt;
use idempotency_core::{
    decode_replay, encode_outcome, Error, Fingerprint, Idempotency, IdempotencyKey, Outcome,
    Policy, Proceed, RecordId, Scope, TransactionEnd, WorkContext,
};
use rusqlite::{Transaction, TransactionBehavior};
use serde::{de::DeserializeOwned, Serialize};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

/// The engine of SQLite's exactly-once path: an [`Idempotency`] engine built over one
/// [`SqliteStore`] (it cannot be built over another store), whose
/// [`run_in_transaction`](SqliteIdempotency::run_in_transaction) commits the work's writes and
/// the completion in one transaction. Postgres has the same shape in `PostgresIdempotency`.
///
/// ```no_run
/// # async fn demo(store: idempotency_sqlite::SqliteStore) -> Result<(), idempotency_core::Error> {
/// use idempotency_core::{Fingerprint, IdempotencyKey, Policy, Scope};
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
/// println!("order {:?}, replayed: {}", outcome.get(), outcome.is_replayed());
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
    /// `Fresh(Err(e))`. `work` runs on the connection's thread: keep slow calls to other
    /// systems out of it, since it holds the database's write lock.
    pub async fn run_in_transaction<T, E, F>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        work: F,
    ) -> Result<Outcome<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Serialize + DeserializeOwned + std::fmt::Display + Send + 'static,
        F: FnOnce(&Transaction<'_>, &WorkContext) -> Result<T, E> + Send + 'static,
    {
        let id = RecordId::new(scope.clone(), key.clone());
        let lease = match self.engine.begin(&id, fingerprint).await?.proceed()? {
            Proceed::Replay(record) => return decode_replay(&record).map(Outcome::Replayed),
            Proceed::Execute(lease) => lease,
        };
        let ctx = lease.context();
        let ttl = lease.ttl();
        let store = self.store.clone();
        let in_tx = self.store.call(move |conn| -> TransactionEnd<T, E> {
            // Whatever fails before the commit rolls back with the transaction (dropped).
            let sql = |e| store.inner.sql_error(e);
            // The store's durability, whatever ran on this connection before.
            if let Err(e) =
                conn.pragma_update(None, "synchronous", store.inner.synchronous.pragma())
            {
                return TransactionEnd::RolledBack(sql(e));
            }
            let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
                Ok(tx) => tx,
                Err(e) => return TransactionEnd::RolledBack(sql(e)),
            };
            let value = match work(&tx, &ctx) {
                Ok(value) => value,
                Err(e) => return TransactionEnd::WorkFailed(e),
            };
            // Stored as `Ok(value)` of a `Result<T, E>`, as the plain engine stores it.
            let completed = encode_outcome(&Ok::<&T, &E>(&value))
                .and_then(|bytes| store.complete_in(&tx, &ctx.id, ctx.token, &bytes, ttl));
            match completed {
                Ok(()) => {}
                Err(Error::LeaseLost { .. }) => return TransactionEnd::LeaseLost,
                Err(e) => return TransactionEnd::RolledBack(e),
            }
            // A failed COMMIT leaves nothing behind in SQLite: the transaction rolled back.
            match tx.commit() {
                Ok(()) => TransactionEnd::Committed(value),
                Err(e) => TransactionEnd::RolledBack(sql(e)),
            }
        });
        // The heartbeat keeps the lease while the call waits its turn on the connection; an
        // extension queued behind the transaction finds it settled and stops.
        let end = lease
            .with_heartbeat(AssertUnwindSafe(in_tx).catch_unwind())
            .await
            .map(|called| called.unwrap_or_else(|e| TransactionEnd::RolledBack(e.into())));
        lease.settle_transaction(end).await
    }
}
