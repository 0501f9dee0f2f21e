//! Exactly-once on MySQL, the transaction-specific steps core drives
//! ([`TransactionalStore`]): begin on a live connection, complete the record inside the
//! transaction, commit.

use crate::abandon::CloseIfAbandoned;
use crate::error::{is_conflict, is_connection_loss, map_sqlx, Effect};
use crate::{MySqlError, MySqlStore};
use idempotency_core::protocol::Lease;
use idempotency_core::store::{async_trait, Begun, CommitError, RecoveryPoint, RecoveryPoints};
use idempotency_core::{Error, TransactionalStore};
use sqlx::pool::PoolConnection;
use sqlx::{Database, MySql, MySqlConnection, TransactionManager};
use std::time::Duration;

type Manager = <MySql as Database>::TransactionManager;

/// A transaction on one of the store's pooled connections, as
/// [`Idempotency::run_in_transaction`](idempotency_core::Idempotency::run_in_transaction)
/// keeps it: the work, a phase and a held transaction get its `MySqlConnection`.
///
/// Dropped before it committed or rolled back (the work panicked, the call was cancelled,
/// the lease was lost mid-statement), its connection is closed rather than handed back to
/// the pool: the server rolls the transaction back, and a connection left mid-statement,
/// whose protocol state is unknown, never serves another caller.
#[derive(Debug)]
pub struct MySqlTransaction {
    conn: PoolConnection<MySql>,
    open: bool,
}

impl MySqlTransaction {
    /// The connection the transaction runs on.
    pub fn connection(&mut self) -> &mut MySqlConnection {
        &mut self.conn
    }

    /// Commits (`commit`) or rolls back the transaction. The connection goes back to the
    /// pool only when the server answered: after an error, or if this future is dropped
    /// before the answer, `open` is still set and the drop closes it.
    async fn end(mut self, commit: bool, timeout: Duration) -> Result<(), Ended> {
        let ending = async {
            if commit {
                Manager::commit(&mut self.conn).await
            } else {
                Manager::rollback(&mut self.conn).await
            }
        };
        let result = match tokio::time::timeout(timeout, ending).await {
            Ok(answer) => answer.map_err(Ended::Error),
            Err(_) => Err(Ended::NoAnswer),
        };
        self.open = result.is_err();
        result
    }
}

/// How ending a transaction failed.
enum Ended {
    Error(sqlx::Error),
    /// No answer within the response timeout.
    NoAnswer,
}

impl Drop for MySqlTransaction {
    fn drop(&mut self) {
        if self.open {
            self.conn.close_on_drop();
        }
    }
}

#[async_trait]
impl TransactionalStore for MySqlStore {
    type Transaction = MySqlTransaction;
    type Connection = MySqlConnection;
    type WorkError = sqlx::Error;

    fn connection(transaction: &mut MySqlTransaction) -> &mut MySqlConnection {
        transaction.connection()
    }

    fn connection_ref(transaction: &MySqlTransaction) -> &MySqlConnection {
        &transaction.conn
    }

    fn work_error(error: sqlx::Error) -> Error {
        crate::database_error(error)
    }

    /// Begins a transaction and leaves the lease to the heartbeat ([`Begun::Open`]) at every
    /// isolation level. InnoDB's `UPDATE` is a locking read of the latest committed row even
    /// at REPEATABLE READ and SERIALIZABLE (the snapshot only serves plain `SELECT`s), so an
    /// extension committed from another connection while the work runs neither hides the
    /// record from the completion nor makes it fail: no row lock has to be held for the
    /// whole work, and a duplicate request is told at once that the key is in progress
    /// instead of waiting on a lock (up to `innodb_lock_wait_timeout`). Under MariaDB's
    /// snapshot isolation the completion is refused instead once the heartbeat has extended
    /// the record ([`MySqlError::SnapshotIsolation`]).
    async fn begin(&self, _lease: &Lease) -> Result<Begun<MySqlTransaction>, Error> {
        Ok(Begun::Open(self.begin_live().await?))
    }

    async fn complete_in(
        &self,
        tx: &mut MySqlTransaction,
        lease: &Lease,
        outcome: &[u8],
    ) -> Result<(), Error> {
        self.complete_in(
            &mut tx.conn,
            lease.id(),
            lease.token(),
            outcome,
            lease.retention(),
        )
        .await
    }

    async fn commit(&self, tx: MySqlTransaction) -> Result<(), CommitError> {
        match tx.end(true, self.response_timeout).await {
            Ok(()) => Ok(()),
            // The server rolled the transaction back: nothing of it committed.
            Err(Ended::Error(e)) if is_conflict(&e) => Err(CommitError::NotCommitted(map_sqlx(
                e,
                &self.quoted,
                Effect::None,
            ))),
            // A lost connection, no answer, or anything else: the commit may have applied.
            Err(Ended::Error(e)) => Err(CommitError::Unknown(map_sqlx(
                e,
                &self.quoted,
                Effect::Write,
            ))),
            Err(Ended::NoAnswer) => Err(CommitError::Unknown(self.no_answer(Effect::Write))),
        }
    }

    async fn rollback(&self, tx: MySqlTransaction) {
        let _ = tx.end(false, self.response_timeout).await;
    }

    /// Deadlocks (1213, InnoDB rolled the transaction back), lock wait timeouts (1205, the
    /// statement was rolled back; core rolls the rest back before running it again) and rows
    /// changed since the snapshot (1020). A record the heartbeat changed under snapshot
    /// isolation ([`MySqlError::SnapshotIsolation`]) is not one: it would happen again.
    fn is_conflict(&self, e: &Error) -> bool {
        matches!(e, Error::Backend { .. })
            && e.find_source::<sqlx::Error>().is_some_and(is_conflict)
            && !matches!(
                MySqlError::find(e),
                Some(MySqlError::SnapshotIsolation { .. })
            )
    }
}

impl MySqlStore {
    /// Begins a transaction on a live connection. A `BEGIN` whose answer never came (the
    /// call was cancelled) closes its connection, so no pooled connection is ever left
    /// inside a transaction. A dead connection (as every idle one is after a server restart)
    /// is given back and BEGIN sent on the next one.
    async fn begin_live(&self) -> Result<MySqlTransaction, Error> {
        let max_lost = self
            .pool()
            .options()
            .get_max_connections()
            .saturating_add(1);
        let mut lost = 0;
        loop {
            let mut conn = self
                .pool()
                .acquire()
                .await
                .map_err(|e| map_sqlx(e, &self.quoted, Effect::None))?;
            let begun = {
                let mut guard = CloseIfAbandoned::new(&mut conn);
                // Through sqlx's transaction manager, so that the work's own `begin()` on the
                // connection makes a savepoint, never a second `BEGIN` (which would commit).
                // Unanswered in time, the guard closes the connection.
                let begun =
                    tokio::time::timeout(self.response_timeout, Manager::begin(guard.conn(), None))
                        .await
                        .map_err(|_| self.no_answer(Effect::None))?;
                if begun.is_ok() {
                    guard.finished();
                }
                begun
            };
            match begun {
                Ok(_) => return Ok(MySqlTransaction { conn, open: true }),
                Err(e) if is_connection_loss(&e) && lost < max_lost => {
                    if lost == 0 {
                        self.sweep_idle().await;
                    }
                    lost += 1;
                }
                Err(e) => return Err(map_sqlx(e, &self.quoted, Effect::None)),
            }
        }
    }
}

#[async_trait]
impl RecoveryPoints for MySqlStore {
    /// One `UPDATE` in the transaction, fenced as the completion is (and by the phase).
    async fn advance_in(
        &self,
        tx: &mut MySqlTransaction,
        lease: &Lease,
        from: Option<u16>,
        to: &RecoveryPoint,
    ) -> Result<(), Error> {
        MySqlStore::advance_in(self, &mut tx.conn, lease.id(), lease.token(), from, to).await
    }

    async fn recovery_point(&self, lease: &Lease) -> Result<Option<RecoveryPoint>, Error> {
        self.read_recovery_point(lease.id()).await
    }

    async fn abandoned(
        &self,
        query: &idempotency_core::store::AbandonedQuery,
    ) -> Result<Vec<Result<idempotency_core::store::Abandoned, Error>>, Error> {
        self.list_abandoned(query).await
    }
}
