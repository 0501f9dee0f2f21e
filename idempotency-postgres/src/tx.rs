//! The engine helper that completes inside the business transaction.

use crate::error::{map_sqlx, Effect};
use crate::PostgresStore;
use futures::future::BoxFuture;
use idempotency_core::{
    decode_replay, Begin, Error, ErrorOutcomes, Failure, Fingerprint, Idempotency, IdempotencyKey,
    Outcome, Policy, RecordId, Scope, WorkContext,
};
use serde::{de::DeserializeOwned, Serialize};
use sqlx::PgConnection;
use std::fmt::Display;
use std::sync::Arc;

/// How many times the transaction is run again after a serialization failure or deadlock in
/// the completion or the commit.
const MAX_TRANSACTION_ATTEMPTS: u32 = 8;

/// An [`Idempotency`] engine over a [`PostgresStore`] that runs the work and its completion
/// in one database transaction: exactly-once effects for work whose effects are writes to the
/// same database.
///
/// ```no_run
/// use idempotency_core::{Fingerprint, IdempotencyKey, Policy, Scope};
/// use idempotency_postgres::{PgIdempotency, PostgresStore};
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let engine = PgIdempotency::new(store, Policy::default())?;
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
pub struct PgIdempotency {
    engine: Idempotency,
    store: PostgresStore,
}

impl PgIdempotency {
    /// An engine over `store` with `policy`.
    pub fn new(store: PostgresStore, policy: Policy) -> Result<Self, Error> {
        let engine = Idempotency::new(Arc::new(store.clone()), policy)?;
        Ok(Self { engine, store })
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
    /// - If the connection dies during the commit, the result is [`Error::OutcomeUnknown`];
    ///   a retry finds either the Completed record or a released key with nothing written.
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
        let lease = match self.engine.begin(&id, fingerprint).await? {
            Begin::Replay(record) => return decode_replay(&record).map(Outcome::Replayed),
            Begin::Execute(lease) => lease,
        };
        let table = self.store.table_name().qualified();
        let mut attempt = 0;
        // Any early return below drops `lease` unsettled, which releases the key in the
        // background (or is fenced, if the record moved on).
        loop {
            attempt += 1;
            let mut tx = self
                .store
                .pool()
                .begin()
                .await
                .map_err(|e| map_sqlx(e, &table, Effect::None))?;
            // The heartbeat extends the lease while the work runs (per the policy).
            let value = match lease.with_heartbeat(work(&mut tx, lease.context())).await {
                Ok(value) => value,
                Err(e) => {
                    let _ = tx.rollback().await;
                    let result: Result<T, E> = Err(e);
                    match self.engine.policy().errors {
                        ErrorOutcomes::Store => lease.complete(&encode(&result)?).await?,
                        ErrorOutcomes::RecordFailure => {
                            let message = match &result {
                                Err(e) => e.to_string(),
                                Ok(_) => String::new(),
                            };
                            lease.fail(Failure::retryable(message)).await?;
                        }
                    }
                    return Ok(Outcome::Fresh(result));
                }
            };
            let result: Result<T, E> = Ok(value);
            let bytes = match encode(&result) {
                Ok(bytes) => bytes,
                Err(e) => {
                    let _ = tx.rollback().await;
                    let _ = lease.fail(Failure::permanent(e.to_string())).await;
                    return Err(e);
                }
            };
            match self
                .store
                .complete_in(&mut tx, lease.id(), lease.token(), &bytes, lease.ttl())
                .await
            {
                Ok(()) => {}
                Err(e) => {
                    let _ = tx.rollback().await;
                    if let Error::LeaseLost { .. } = e {
                        // The record belongs to another holder now: nothing to release.
                        lease.settled_externally();
                        return Err(e);
                    }
                    if is_serialization_failure(&e) && attempt < MAX_TRANSACTION_ATTEMPTS {
                        continue;
                    }
                    return Err(e);
                }
            }
            match tx.commit().await {
                Ok(()) => {
                    lease.settled_externally();
                    return Ok(Outcome::Fresh(result));
                }
                Err(e)
                    if crate::error::is_serialization_failure(&e)
                        && attempt < MAX_TRANSACTION_ATTEMPTS =>
                {
                    continue
                }
                Err(e) => return Err(map_sqlx(e, &table, Effect::Write)),
            }
        }
    }
}

fn encode<R: Serialize>(result: &R) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(result).map_err(|source| Error::Codec { source })
}

/// Whether a core error wraps a serialization failure or deadlock from the driver.
fn is_serialization_failure(e: &Error) -> bool {
    match e {
        Error::Backend { source, .. } => source
            .downcast_ref::<sqlx::Error>()
            .is_some_and(crate::error::is_serialization_failure),
        _ => false,
    }
}
