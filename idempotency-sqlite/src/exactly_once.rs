//! Exactly-once effects: the completion CAS commits or rolls back with the business writes.

use crate::SqliteStore;
use futures::FutureExt;
use idempotency_core::{
    decode_replay, Error, ErrorOutcomes, Failure, Fingerprint, Idempotency, IdempotencyKey,
    Outcome, Policy, Proceed, RecordId, Scope, WorkContext,
};
use rusqlite::{Transaction, TransactionBehavior};
use serde::{de::DeserializeOwned, Serialize};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

/// What happened inside the connection's transaction.
enum Step<T, E> {
    /// The work succeeded; its writes and the completion committed together.
    Committed(Result<T, E>),
    /// The work returned an error; its transaction rolled back.
    RolledBack(E),
}

/// The engine of SQLite's exactly-once path: an [`Idempotency`] engine built over one
/// [`SqliteStore`] (it cannot be built over another store), whose
/// [`run_in_transaction`](SqliteIdempotency::run_in_transaction) commits the work's writes and
/// the completion in one transaction. Postgres has the same shape in `PgIdempotency`.
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
        let engine = &self.engine;
        let lease = match engine.begin(&id, fingerprint).await?.proceed()? {
            Proceed::Replay(record) => return decode_replay(&record).map(Outcome::Replayed),
            Proceed::Execute(lease) => lease,
        };
        let ctx = lease.context();
        let ttl = lease.ttl();
        let store = self.store.clone();
        let in_tx = self.store.call(move |conn| -> Result<Step<T, E>, Error> {
            // The store's durability, whatever ran on this connection before.
            conn.pragma_update(None, "synchronous", store.inner.synchronous.pragma())
                .map_err(|e| store.inner.sql_error(e))?;
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| store.inner.sql_error(e))?;
            match work(&tx, &ctx) {
                Ok(value) => {
                    let result: Result<T, E> = Ok(value);
                    let bytes =
                        serde_json::to_vec(&result).map_err(|source| Error::Codec { source })?;
                    // On LeaseLost `tx` is dropped here, rolling back the business writes.
                    store.complete_in(&tx, &ctx.id, ctx.token, &bytes, ttl)?;
                    tx.commit().map_err(|e| store.inner.sql_error(e))?;
                    Ok(Step::Committed(result))
                }
                Err(e) => {
                    drop(tx);
                    Ok(Step::RolledBack(e))
                }
            }
        });
        // The heartbeat keeps the lease while the call waits its turn on the connection; an
        // extension queued behind the transaction finds it settled and changes nothing.
        let step = match lease
            .with_heartbeat(AssertUnwindSafe(in_tx).catch_unwind())
            .await
        {
            Ok(step) => step.map_err(Error::from).and_then(|r| r),
            Err(panic) => {
                // The work panicked inside its transaction, which rolled back: nothing took
                // effect, so the key is released at once (a dropped lease would hold it).
                let _ = lease
                    .fail(Failure::retryable(
                        "the work panicked; its transaction rolled back",
                    ))
                    .await;
                std::panic::resume_unwind(panic);
            }
        };
        match step {
            Ok(Step::Committed(result)) => {
                lease.settled_externally();
                Ok(Outcome::Fresh(result))
            }
            Ok(Step::RolledBack(e)) => {
                match engine.policy().errors {
                    ErrorOutcomes::RecordFailure => {
                        lease.fail(Failure::retryable(e.to_string())).await?
                    }
                    ErrorOutcomes::Store => {
                        let result: Result<T, E> = Err(e);
                        let bytes = match serde_json::to_vec(&result) {
                            Ok(b) => b,
                            Err(source) => {
                                let _ = lease.fail(Failure::permanent(source.to_string())).await;
                                return Err(Error::Codec { source });
                            }
                        };
                        lease.complete(&bytes).await?;
                        return Ok(Outcome::Fresh(result));
                    }
                }
                Ok(Outcome::Fresh(Err(e)))
            }
            Err(e @ Error::LeaseLost { .. }) => {
                // The record belongs to the newer holder: nothing of ours to release.
                lease.settled_externally();
                Err(e)
            }
            Err(e) => {
                // Nothing committed (a failed COMMIT leaves nothing behind in SQLite): release
                // the key now rather than waiting for the lease to pass. If it did commit, this
                // CAS is fenced and changes nothing.
                let failure = match &e {
                    Error::Codec { .. } => Failure::permanent(e.to_string()),
                    _ => Failure::retryable(e.to_string()),
                };
                let _ = lease.fail(failure).await;
                Err(e)
            }
        }
    }
}
