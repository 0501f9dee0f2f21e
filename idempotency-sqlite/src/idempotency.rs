//! [`SqliteIdempotency`]: the engine that owns a [`SqliteStore`], whose work writes in the
//! transaction that completes its record.

use crate::SqliteStore;
use idempotency_core::Idempotency;

/// The engine that owns a [`SqliteStore`]: [`Idempotency::builder`] over the store builds
/// one. Besides everything the engine does, it runs work and its completion in one
/// transaction ([`Idempotency::run_in_transaction`]: the work's database writes and the
/// completion commit together or not at all) and multi-step operations
/// ([`Idempotency::run_phases`]) on the store.
///
/// ```no_run
/// # async fn demo(store: idempotency_sqlite::SqliteStore) -> Result<(), idempotency_core::Error> {
/// use idempotency_core::{Answer, Fingerprint, Idempotency, IdempotencyKey, Scope};
/// use idempotency_sqlite::rusqlite::params;
///
/// let engine = Idempotency::builder(store).build()?;
/// let (key, scope) = (IdempotencyKey::new("order-7")?, Scope::new("shop|orders")?);
/// let fp = Fingerprint::from_bytes(b"2 apples");
/// let outcome = engine
///     .run_in_transaction(&key, &scope, &fp, |tx, _ctx| {
///         // On the connection's thread, inside the transaction.
///         Box::pin(tx.run(|tx| {
///             tx.execute("INSERT INTO orders (item) VALUES (?1)", params!["apples"])?;
///             Ok::<_, idempotency_sqlite::rusqlite::Error>(tx.last_insert_rowid())
///         }))
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
/// The key is claimed through the engine (a replay, a key reused and a key in progress
/// behave as in [`Idempotency::run`]); then, on one of the store's connections, a `BEGIN
/// IMMEDIATE` transaction is opened and `work` gets it, as a
/// [`SqliteTransaction`](crate::SqliteTransaction) whose
/// [`run`](crate::SqliteTransaction::run) runs a closure on the connection's thread with
/// the `rusqlite::Transaction`. When `work` returns `Ok(Ok(value))`, the completion
/// compare-and-swap runs in the same transaction and it commits:
///
/// - if the lease was lost meanwhile (the holder stalled past it and a retry took the key
///   over), the compare-and-swap matches nothing, the transaction rolls back (business
///   writes included) and the result is
///   [`Error::LeaseLost`](idempotency_core::Error::LeaseLost);
/// - if the process dies before the commit, nothing was written and the key's lease
///   passes, so a retry runs the work again; either way the effect happens once.
///
/// When `work` returns `Ok(Err(e))`, its writes roll back, the error is released for a retry
/// (stored instead on an engine built with `store_errors()`) and is returned as
/// `Executed(Err(e))`. The closure given to `run` holds the database's
/// write lock: keep slow calls to other systems out of it. Holding that lock from its
/// `BEGIN IMMEDIATE`, the transaction cannot conflict with another (no deadlock, no busy
/// error midway), so unlike on Postgres and MySQL nothing here is run again.
///
/// `M` is what a work's `Err` does to its key: released by default
/// ([`ReleaseErrors`](idempotency_core::ReleaseErrors)), stored on an engine built with
/// `store_errors()` ([`StoreErrors`](idempotency_core::StoreErrors)).
pub type SqliteIdempotency<M = idempotency_core::ReleaseErrors> = Idempotency<SqliteStore, M>;
