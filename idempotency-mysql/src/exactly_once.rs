//! Exactly-once on MySQL, the transaction-specific steps core drives
//! ([`TransactionalStore`]): begin on a live connection, complete the record inside the
//! transaction, commit.

use crate::error::{is_conflict, is_connection_loss, map_sqlx, Effect};
use crate::MysqlStore;
use idempotency_core::{async_trait, Begun, CommitError, Error, Lease, TransactionalStore};
use sqlx::{MySql, MySqlConnection};

/// A transaction on one of the store's pooled connections, as
/// [`Idempotency::run_in_transaction`](idempotency_core::Idempotency::run_in_transaction)
/// gives it to the work: write through [`MysqlTransaction::connection`].
#[derive(Debug)]
pub struct MysqlTransaction {
    tx: sqlx::Transaction<'static, MySql>,
}

impl MysqlTransaction {
    /// The connection the transaction runs on.
    pub fn connection(&mut self) -> &mut MySqlConnection {
        &mut self.tx
    }
}

#[async_trait]
impl TransactionalStore for MysqlStore {
    type Transaction = MysqlTransaction;

    /// Begins a transaction and leaves the lease to the heartbeat ([`Begun::Open`]) at every
    /// isolation level. InnoDB's `UPDATE` is a locking read of the latest committed row even
    /// at REPEATABLE READ and SERIALIZABLE (the snapshot only serves plain `SELECT`s), so an
    /// extension committed from another connection while the work runs neither hides the
    /// record from the completion nor makes it fail: no row lock has to be held for the
    /// whole work, and a duplicate request is told at once that the key is in progress
    /// instead of waiting on a lock (up to `innodb_lock_wait_timeout`).
    async fn begin(&self, _lease: &Lease) -> Result<Begun<MysqlTransaction>, Error> {
        Ok(Begun::Open(MysqlTransaction {
            tx: self.begin_live().await?,
        }))
    }

    async fn complete_in(
        &self,
        tx: &mut MysqlTransaction,
        lease: &Lease,
        outcome: &[u8],
    ) -> Result<(), Error> {
        self.complete_in(&mut tx.tx, lease.id(), lease.token(), outcome, lease.ttl())
            .await
    }

    async fn commit(&self, tx: MysqlTransaction) -> Result<(), CommitError> {
        match tx.tx.commit().await {
            Ok(()) => Ok(()),
            // The server rolled the transaction back: nothing of it committed.
            Err(e) if is_conflict(&e) => Err(CommitError::NotCommitted(map_sqlx(
                e,
                &self.quoted,
                Effect::None,
            ))),
            // A lost connection, or anything else: the commit may have applied.
            Err(e) => Err(CommitError::Unknown(map_sqlx(
                e,
                &self.quoted,
                Effect::Write,
            ))),
        }
    }

    async fn rollback(&self, tx: MysqlTransaction) {
        let _ = tx.tx.rollback().await;
    }

    /// Deadlocks (1213, InnoDB rolled the transaction back) and lock wait timeouts (1205,
    /// the statement was rolled back; core rolls the rest back before running it again).
    fn is_conflict(&self, e: &Error) -> bool {
        matches!(e, Error::Backend { .. })
            && e.find_source::<sqlx::Error>().is_some_and(is_conflict)
    }
}

impl MysqlStore {
    /// Begins a transaction on a live connection. `BEGIN` runs in a task of its own: sqlx 0.8
    /// leaks an open transaction into the pool when the future of `Pool::begin` is dropped
    /// after BEGIN was sent but before its answer. A dead connection (as every idle one is
    /// after a server restart) is given back and BEGIN sent on the next one.
    async fn begin_live(&self) -> Result<sqlx::Transaction<'static, MySql>, Error> {
        let max_lost = self
            .pool()
            .options()
            .get_max_connections()
            .saturating_add(1);
        let mut lost = 0;
        loop {
            let pool = self.pool().clone();
            match tokio::spawn(async move { pool.begin().await })
                .await
                .map_err(|e| Error::backend(true, e))?
            {
                Ok(tx) => return Ok(tx),
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
