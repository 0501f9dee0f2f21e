//! [`PostgresIdempotency`]: the engine that owns a [`PostgresStore`], whose work writes in the
//! transaction that completes its record.

use crate::PostgresStore;
use idempotency_core::Idempotency;

/// The engine that owns a [`PostgresStore`]: [`Idempotency::builder`] over the store builds
/// one. Besides everything the engine does, it runs work and its completion in one
/// database transaction ([`Idempotency::run_in_transaction`], exactly-once effects for work
/// whose effects are writes to the same database: the work gets the transaction's
/// `PgConnection`) and multi-step operations ([`Idempotency::run_phases`]) on the store.
///
/// ```no_run
/// use idempotency_core::{Answer, Fingerprint, Idempotency, IdempotencyKey, Scope};
/// use idempotency_postgres::{PostgresIdempotency, PostgresStore};
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let engine: PostgresIdempotency = Idempotency::builder(store).build()?;
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
///   back. A serialization failure or deadlock (SQLSTATE 40001, 40P01), in the work's own
///   statements as in the completion or the commit, runs the whole transaction again,
///   `work` included (at most
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
/// The transaction runs at the level the pool's sessions run at (their
/// `default_transaction_isolation`, set for example in the pool's `after_connect` or with
/// `ALTER ROLE … SET`); do not issue `SET TRANSACTION` inside `work`, which runs after
/// this method's first statement. The level is learned from the first statement of the
/// transaction (or from the last completion: sessions at READ COMMITTED then cost no extra
/// statement) and decides how the lease is kept while the work runs:
///
/// - **READ COMMITTED**: the heartbeat ([`Policy::heartbeat`](idempotency_core::Policy::heartbeat)) extends the lease from
///   another pooled connection, as in [`Idempotency::run`](idempotency_core::Idempotency::run). A duplicate request is told
///   at once that the key is in progress; a holder that stalls past its lease (no
///   heartbeat reached the database) can be taken over, and its completion is then fenced
///   and everything it wrote rolls back.
/// - **REPEATABLE READ and SERIALIZABLE**: a heartbeat committed on another connection
///   would make the completion fail to serialize, so instead the transaction's first
///   statement locks the record row (`SELECT … FOR UPDATE`, checking it is still
///   Pending with this holder's token and its lease has not passed) and holds it until
///   the commit. Nobody else can change the record meanwhile, and duplicates do not wait
///   for it: a duplicate request's claim and reclaim skip a live row a holder has locked,
///   so the duplicate gets [`Refusal::InProgress`](idempotency_core::Refusal::InProgress) at once (even once the lease in the
///   table has passed: the lock says the holder's transaction is open), a purge skips the
///   row, and after the commit a duplicate finds the record Completed (a replay) or,
///   after a rollback, as it was. (A record whose retention passed while the work runs is
///   waited for again.) The lease is kept in the process: every heartbeat interval renews it, and
///   if it passes without one (the heartbeat is off and the work outlives the lease, or
///   the process stalled), the work is cancelled, the transaction rolls back and the
///   result is [`Error::LeaseLost`](idempotency_core::Error::LeaseLost), leaving the record to be reclaimed.
///   After a serialization failure the lease is extended before the transaction runs
///   again; a duplicate arriving between the rollback and that extension may take the key
///   over if the work outlived the lease, and then the re-run is fenced (nothing was
///   committed).
///
/// `work` must never commit (no `COMMIT` through its connection) and must return a
/// database error it meets rather than swallow it: after an error the transaction is
/// aborted, and only the error tells the engine to run it again after a conflict.
///
/// A work that never returns holds the key as long as the heartbeat runs, at every level
/// (and at REPEATABLE READ and SERIALIZABLE keeps the row locked).
///
/// `M` is what a work's `Err` does to its key: released by default
/// ([`ReleaseErrors`](idempotency_core::ReleaseErrors)), stored on an engine built with
/// `store_errors()` ([`StoreErrors`](idempotency_core::StoreErrors)).
pub type PostgresIdempotency<M = idempotency_core::ReleaseErrors> = Idempotency<PostgresStore, M>;
