//! What a store implements to complete records inside its callers' transactions.

use crate::{Error, Lease};
use async_trait::async_trait;
use std::time::Duration;

/// A store that can complete a record inside a database transaction holding the work's own
/// writes, so that both commit together or not at all. The SQL stores implement it;
/// [`Idempotency::run_in_transaction`](crate::Idempotency::run_in_transaction) drives it.
///
/// The store supplies only the transaction-specific steps: begin a transaction, run the
/// fenced completion inside it, commit it (saying whether a failed commit's outcome is
/// unknown), roll it back, and tell a conflict worth running the transaction again for.
/// Core decides everything else: when the work runs, how the lease is kept meanwhile, how
/// often a conflicting transaction runs again, and what becomes of the key after each end
/// (see the [module documentation](crate::transaction)).
///
/// The store must complete the record this engine claimed: the same database and table as
/// the engine's [`IdempotencyStore`](crate::IdempotencyStore) (usually the same value).
///
/// # A complete transactional store
///
/// The toy store of [`IdempotencyStore`](crate::IdempotencyStore)'s documentation, with a
/// ledger beside it as its "business table": a transaction buffers the work's lines and the
/// completion and applies both at the commit under the locks, or neither. A database gives
/// you the transaction; your `complete_in` is then one conditional `UPDATE` inside it, and
/// your `commit` tells a refused commit from one whose answer was lost.
///
#[doc = concat!("```\n", include_str!("../toy_store.rs"), include_str!("../toy_transactional.rs"), "```")]
#[async_trait]
pub trait TransactionalStore: Send + Sync {
    /// An open transaction, as the store keeps it between the steps.
    type Transaction: Send + 'static;

    /// What the work writes through ([`TransactionalStore::connection`] of the
    /// transaction): the connection the transaction runs on (a `PgConnection`), or the
    /// transaction itself.
    type Connection: ?Sized + Send + 'static;

    /// The error the work's own statements return (a `sqlx::Error`), which it passes on
    /// with `?` and the store turns into an [`Error`] ([`TransactionalStore::work_error`]).
    type WorkError: Send + 'static;

    /// The connection of `transaction`, as the work is handed it.
    fn connection(transaction: &mut Self::Transaction) -> &mut Self::Connection;

    /// The connection of `transaction`, read-only (what a
    /// [`HeldTransaction`](crate::transaction::HeldTransaction) derefs to).
    fn connection_ref(transaction: &Self::Transaction) -> &Self::Connection;

    /// A database error of the work as an [`Error`], the way
    /// [`TransactionalStore::is_conflict`] reads it (for a driver's error, an
    /// [`Error::Backend`] whose source is that error).
    fn work_error(error: Self::WorkError) -> Error;

    /// Begins the transaction the work of `lease` runs in, and says how its lease is kept
    /// meanwhile ([`Begun`]). A store whose transactions wait their turn (for a connection,
    /// or a lock) keeps the lease alive while it waits ([`Lease::with_heartbeat`]).
    ///
    /// [`Error::LeaseLost`] when the record is found no longer this holder's; any other
    /// error means nothing began (the transaction runs again if
    /// [`TransactionalStore::is_conflict`] says so, else the key is released).
    async fn begin(&self, lease: &Lease) -> Result<Begun<Self::Transaction>, Error>;

    /// The completion compare-and-swap inside `transaction`: if `lease`'s token still holds
    /// the record (live, Pending), marks it Completed with `outcome` for
    /// [`Lease::retention`], as [`IdempotencyStore::complete`](crate::IdempotencyStore::complete)
    /// does. Returns [`Error::LeaseLost`] when it matches nothing. Nothing of it is visible
    /// before the commit. A store may instead keep the completion and run it as the first
    /// step of [`commit`](TransactionalStore::commit) (to reach its connection once): its
    /// commit then reports a fenced completion as `CommitError::NotCommitted(Error::LeaseLost)`.
    async fn complete_in(
        &self,
        transaction: &mut Self::Transaction,
        lease: &Lease,
        outcome: &[u8],
    ) -> Result<(), Error>;

    /// Commits `transaction`.
    async fn commit(&self, transaction: Self::Transaction) -> Result<(), CommitError>;

    /// Rolls `transaction` back. Best effort: a transaction whose rollback fails is rolled
    /// back by its database when its connection closes.
    async fn rollback(&self, transaction: Self::Transaction);

    /// Whether `error` (from [`begin`](TransactionalStore::begin), from the work (its
    /// `Err`), from [`complete_in`](TransactionalStore::complete_in) or a
    /// [`CommitError::NotCommitted`]) is a conflict with a concurrent transaction (a
    /// serialization failure, a deadlock) that rolled this one back, after which the whole
    /// transaction, work included, runs again after a short random pause (up to 2^n ms after
    /// the nth run, at most 128 ms; at most [`MAX_TRANSACTION_ATTEMPTS`] runs).
    /// By default nothing is.
    fn is_conflict(&self, error: &Error) -> bool {
        let _ = error;
        false
    }
}

/// How many times, at most, one exactly-once call runs its transaction: the first run and
/// the runs again after conflicts ([`TransactionalStore::is_conflict`]).
pub const MAX_TRANSACTION_ATTEMPTS: u32 = 8;

/// A transaction that began, and how the lease is kept while the work runs in it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Begun<T> {
    /// Nothing in the transaction holds the record: the heartbeat extends the lease from
    /// outside it ([`Lease::with_heartbeat`]), as for work outside a transaction. For
    /// transactions that see other sessions' commits (READ COMMITTED).
    Open(T),
    /// The transaction has locked the record (nobody else can change it until the
    /// transaction ends), found it held by this lease with `lease_left` on the store's clock.
    /// An extension committed from outside would then conflict with the transaction (at
    /// REPEATABLE READ or SERIALIZABLE), so the lease is kept in the process instead: renewed
    /// every heartbeat interval, and if it passes without a renewal the work is cancelled,
    /// the transaction rolled back and the caller told [`Error::LeaseLost`]. Before the
    /// transaction runs again after a conflict the record's lease is extended, since the
    /// renewals were never written.
    Locked {
        /// The transaction.
        transaction: T,
        /// The lease the record had left when it was locked.
        lease_left: Duration,
    },
}

/// Why a commit failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum CommitError {
    /// The database refused the commit and rolled the transaction back: nothing of it took
    /// effect.
    NotCommitted(Error),
    /// The commit was sent and its outcome is not known (the connection was lost before its
    /// answer): the work's writes and the completion may have committed. The key is held
    /// until its lease passes. Usually an [`Error::OutcomeUnknown`].
    Unknown(Error),
}

/// A store shared behind an `Arc` is the same store.
#[async_trait]
impl<S: TransactionalStore + ?Sized> TransactionalStore for std::sync::Arc<S> {
    type Transaction = S::Transaction;
    type Connection = S::Connection;
    type WorkError = S::WorkError;

    fn connection(transaction: &mut Self::Transaction) -> &mut Self::Connection {
        S::connection(transaction)
    }

    fn connection_ref(transaction: &Self::Transaction) -> &Self::Connection {
        S::connection_ref(transaction)
    }

    fn work_error(error: Self::WorkError) -> Error {
        S::work_error(error)
    }

    async fn begin(&self, lease: &Lease) -> Result<Begun<Self::Transaction>, Error> {
        (**self).begin(lease).await
    }

    async fn complete_in(
        &self,
        transaction: &mut Self::Transaction,
        lease: &Lease,
        outcome: &[u8],
    ) -> Result<(), Error> {
        (**self).complete_in(transaction, lease, outcome).await
    }

    async fn commit(&self, transaction: Self::Transaction) -> Result<(), CommitError> {
        (**self).commit(transaction).await
    }

    async fn rollback(&self, transaction: Self::Transaction) {
        (**self).rollback(transaction).await
    }

    fn is_conflict(&self, error: &Error) -> bool {
        (**self).is_conflict(error)
    }
}
