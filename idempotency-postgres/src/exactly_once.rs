//! Exactly-once on Postgres, the transaction-specific steps core drives
//! ([`TransactionalStore`]): begin on a live connection, keep the lease as the isolation level
//! needs, complete the record inside the transaction, commit.

use crate::error::{
    is_connection_loss, is_integrity_violation, is_serialization_failure, map_sqlx, Effect,
};
use crate::store::Level;
use crate::PostgresStore;
use idempotency_core::protocol::Lease;
use idempotency_core::store::{
    async_trait, Abandoned, AbandonedQuery, Begun, CommitError, RecoveryPoint, RecoveryPoints,
};
use idempotency_core::{Error, TransactionalStore};
use sqlx::{PgConnection, Postgres};

/// A transaction on one of the store's pooled connections, as
/// [`Idempotency::run_in_transaction`](idempotency_core::Idempotency::run_in_transaction)
/// keeps it: the work, a phase and a held transaction get its `PgConnection`.
#[derive(Debug)]
pub struct PostgresTransaction {
    tx: sqlx::Transaction<'static, Postgres>,
    /// It holds the record row locked since `begin` found it live and held by the lease.
    locked: bool,
}

impl PostgresTransaction {
    /// The connection the transaction runs on.
    pub fn connection(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

#[async_trait]
impl TransactionalStore for PostgresStore {
    type Transaction = PostgresTransaction;
    type Connection = PgConnection;
    type WorkError = sqlx::Error;

    fn connection(transaction: &mut PostgresTransaction) -> &mut PgConnection {
        transaction.connection()
    }

    fn connection_ref(transaction: &PostgresTransaction) -> &PgConnection {
        &transaction.tx
    }

    fn work_error(error: sqlx::Error) -> Error {
        crate::database_error(error)
    }

    /// At READ COMMITTED the heartbeat keeps the lease; at REPEATABLE READ and SERIALIZABLE
    /// an extension committed from outside would fail the completion to serialize, so the
    /// first statement locks the record row (`SELECT … FOR UPDATE`) until the commit.
    /// The level is learned from that statement or from the last completion.
    async fn begin(&self, lease: &Lease) -> Result<Begun<PostgresTransaction>, Error> {
        let mut lost = 0;
        loop {
            let mut tx = self.begin_live().await?;
            if self.level.get() == Some(Level::ReadCommitted) {
                return Ok(Begun::Open(PostgresTransaction { tx, locked: false }));
            }
            let held = self.answered(self.hold_in(&mut tx, lease.id(), lease.token()));
            let hold = match held.await {
                Ok(hold) => hold,
                Err(e) => {
                    let _ = tokio::time::timeout(self.response_timeout, tx.rollback()).await;
                    // The connection died between BEGIN and this first statement (a
                    // restart): nothing ran; begin again on another connection.
                    if lost_connection(&e) && lost < self.max_lost() {
                        self.sweep_after(&mut lost).await;
                        continue;
                    }
                    return Err(e);
                }
            };
            self.level.set(hold.level);
            return match (hold.level, hold.lease_left) {
                (Level::ReadCommitted, _) => {
                    Ok(Begun::Open(PostgresTransaction { tx, locked: false }))
                }
                (Level::Snapshot, Some(lease_left)) if !lease_left.is_zero() => Ok(Begun::Locked {
                    transaction: PostgresTransaction { tx, locked: true },
                    lease_left,
                }),
                // Reclaimed, settled or expired, or the lease passed before the work could
                // start: the key is not ours to run.
                (Level::Snapshot, _) => {
                    let _ = tokio::time::timeout(self.response_timeout, tx.rollback()).await;
                    Err(Error::LeaseLost {
                        token: lease.token(),
                    })
                }
            };
        }
    }

    async fn complete_in(
        &self,
        tx: &mut PostgresTransaction,
        lease: &Lease,
        outcome: &[u8],
    ) -> Result<(), Error> {
        let (id, token, ttl) = (lease.id(), lease.token(), lease.retention());
        let completed = self
            .answered(self.complete_in_reporting(&mut tx.tx, id, token, outcome, ttl, tx.locked))
            .await;
        match completed {
            Ok(level) => self.level.set(level),
            // A serialization failure cannot happen at READ COMMITTED: the sessions run at
            // another level; ask again next time.
            Err(ref e) if !tx.locked && self.is_conflict(e) => self.level.forget(),
            Err(_) => {}
        }
        completed.map(|_| ())
    }

    async fn commit(&self, tx: PostgresTransaction) -> Result<(), CommitError> {
        let Ok(committed) = tokio::time::timeout(self.response_timeout, tx.tx.commit()).await
        else {
            // The COMMIT may have applied.
            return Err(CommitError::Unknown(self.no_answer(Effect::Write)));
        };
        match committed {
            Ok(()) => Ok(()),
            // The server aborted the transaction (a conflict, or a deferred constraint the
            // work's writes broke): nothing of it committed.
            Err(e) if is_serialization_failure(&e) || is_integrity_violation(&e) => Err(
                CommitError::NotCommitted(map_sqlx(e, &self.qualified, Effect::None)),
            ),
            // A lost connection: the commit may have applied.
            Err(e) => Err(CommitError::Unknown(map_sqlx(
                e,
                &self.qualified,
                Effect::Write,
            ))),
        }
    }

    async fn rollback(&self, tx: PostgresTransaction) {
        // Dropped unanswered, the transaction is rolled back when its connection is next
        // used or closed.
        let _ = tokio::time::timeout(self.response_timeout, tx.tx.rollback()).await;
    }

    fn is_conflict(&self, e: &Error) -> bool {
        matches!(e, Error::Backend { .. })
            && e.find_source::<sqlx::Error>()
                .is_some_and(is_serialization_failure)
    }
}

impl PostgresStore {
    /// `statement`'s answer, or [`PostgresError::NoAnswer`](crate::PostgresError::NoAnswer)
    /// (retryable) past the response timeout: inside a transaction nothing commits before
    /// the commit, so a statement without an answer applied nothing.
    async fn answered<T>(
        &self,
        statement: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        tokio::time::timeout(self.response_timeout, statement)
            .await
            .unwrap_or_else(|_| Err(self.no_answer(Effect::None)))
    }

    /// How many lost connections in a row a transaction's start gets past: one more than the
    /// pool holds, so that after a restart it reaches a live connection past all the dead
    /// idle ones.
    fn max_lost(&self) -> u32 {
        self.pool()
            .options()
            .get_max_connections()
            .saturating_add(1)
    }

    /// After the first of `lost` connections, checks the pool's idle ones.
    async fn sweep_after(&self, lost: &mut u32) {
        if *lost == 0 {
            self.sweep_idle().await;
        }
        *lost += 1;
    }

    /// Begins a transaction on a live connection. `BEGIN` runs in a task of its own: sqlx 0.8
    /// leaks an open transaction into the pool when the future of `Pool::begin` is dropped
    /// after BEGIN was sent but before its answer, and the next user of that connection then
    /// runs inside a transaction nobody commits. A dead connection (as every idle one is
    /// after a server restart) is given back and BEGIN sent on the next one.
    async fn begin_live(&self) -> Result<sqlx::Transaction<'static, Postgres>, Error> {
        let mut lost = 0;
        loop {
            let begun = tokio::time::timeout(
                self.response_timeout,
                tokio::spawn(self.begin_transaction()),
            );
            // Unanswered, the spawned BEGIN goes on; its transaction rolls back when it ends.
            match begun
                .await
                .map_err(|_| self.no_answer(Effect::None))?
                .map_err(|e| Error::backend(true, e))?
            {
                Ok(tx) => return Ok(tx),
                Err(e) if is_connection_loss(&e) && lost < self.max_lost() => {
                    self.sweep_after(&mut lost).await
                }
                Err(e) => return Err(map_sqlx(e, &self.qualified, Effect::None)),
            }
        }
    }
}

/// Whether a core error wraps a lost connection from the driver.
fn lost_connection(e: &Error) -> bool {
    e.find_source::<sqlx::Error>()
        .is_some_and(is_connection_loss)
}

#[async_trait]
impl RecoveryPoints for PostgresStore {
    /// One `UPDATE` in the transaction, fenced as the completion is (and by the phase); it
    /// renews the holder's lease too.
    async fn advance_in(
        &self,
        tx: &mut PostgresTransaction,
        lease: &Lease,
        from: Option<u16>,
        to: &RecoveryPoint,
    ) -> Result<(), Error> {
        let (id, token, locked) = (lease.id(), lease.token(), tx.locked);
        let advanced = self
            .answered(PostgresStore::advance_in(
                self,
                &mut tx.tx,
                id,
                token,
                from,
                to,
                lease.lease(),
            ))
            .await;
        // As for the completion: a serialization failure cannot happen at READ COMMITTED, so
        // the sessions run at another level; ask again next time.
        if let Err(ref e) = advanced {
            if !locked && self.is_conflict(e) {
                self.level.forget();
            }
        }
        advanced
    }

    async fn recovery_point(&self, lease: &Lease) -> Result<Option<RecoveryPoint>, Error> {
        self.read_recovery_point(lease.id()).await
    }

    async fn abandoned(
        &self,
        query: &AbandonedQuery,
    ) -> Result<Vec<Result<Abandoned, Error>>, Error> {
        self.list_abandoned(query).await
    }
}
