//! [`MySqlIdempotency`]: the engine that owns a [`MySqlStore`], whose work writes in the
//! transaction that completes its record.

use crate::MySqlStore;
use idempotency_core::Idempotency;

/// The engine that owns a [`MySqlStore`]: [`Idempotency::builder`] over the store builds
/// one. Besides everything the engine does, it runs work and its completion in one
/// database transaction ([`Idempotency::run_in_transaction`], exactly-once effects for work
/// whose effects are writes to the same database: the work gets the transaction's
/// `MySqlConnection`) and multi-step operations ([`Idempotency::run_phases`]) on the store.
///
/// ```no_run
/// use idempotency_core::{Answer, Fingerprint, Idempotency, IdempotencyKey, Scope};
/// use idempotency_mysql::{MySqlIdempotency, MySqlStore};
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MySqlStore::connect("mysql://app@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let engine: MySqlIdempotency = Idempotency::builder(store).build()?;
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
///
/// # In a transaction
///
/// [`Idempotency::run_in_transaction`] runs `work` once for `(scope, key)` inside a
/// transaction on the store's pool, and stores its `Ok` outcome in the same transaction.
///
/// - Replays return the stored outcome; the work does not run.
/// - `Ok(Ok(v))`: the completion CAS runs in the work's transaction, then it commits. If the
///   lease was lost meanwhile (a stalled holder whose key was reclaimed), the CAS matches
///   nothing, the transaction rolls back with all the work's writes, and the result is
///   [`Error::LeaseLost`](idempotency_core::Error::LeaseLost).
/// - `Ok(Err(e))`, the work's own refusal (a declined payment, an invalid request): the
///   transaction rolls back, the key is released for a retry (or, on an engine built with
///   `store_errors()`, the error is stored and replayed) and `e` is returned as
///   `Executed(Err(e))`.
/// - `Err(database_error)`, what `?` on a failed sqlx call returns: the transaction rolls
///   back. A deadlock (1213), a lock wait timeout (1205) or a row changed since the
///   snapshot (1020) in the work's own statements, or a deadlock or lock wait timeout in
///   the completion or the commit, runs the whole transaction again, `work` included (at
///   most
///   [`MAX_TRANSACTION_ATTEMPTS`](idempotency_core::store::MAX_TRANSACTION_ATTEMPTS) runs in all),
///   so `work` must only act through the connection it is given. Any other database error
///   (or a conflict on the last run) releases the key, since nothing committed, and is
///   returned as [`Error::Backend`](idempotency_core::Error::Backend) whose source is the sqlx error
///   (`error.find_source::<sqlx::Error>()`). A database error the work wants stored as its
///   answer (a unique key it calls a duplicate order, say) it returns as `Ok(Err(..))`.
/// - If the connection dies during the commit, the result is [`Error::OutcomeUnknown`](idempotency_core::Error::OutcomeUnknown)
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
/// ([`Policy::heartbeat`](idempotency_core::Policy::heartbeat)) extends the lease from another pooled connection while the
/// work runs, as in [`Idempotency::run`](idempotency_core::Idempotency::run): InnoDB's `UPDATE` reads the latest committed
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
///
/// `M` is what a work's `Err` does to its key: released by default
/// ([`ReleaseErrors`](idempotency_core::ReleaseErrors)), stored on an engine built with
/// `store_errors()` ([`StoreErrors`](idempotency_core::StoreErrors)).
pub type MySqlIdempotency<M = idempotency_core::ReleaseErrors> = Idempotency<MySqlStore, M>;
