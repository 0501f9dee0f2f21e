//! Exactly-once on SQLite, the transaction-specific steps core drives
//! ([`TransactionalStore`]): a write transaction held open on one connection, the completion
//! run inside it, the commit.

use crate::{SqliteError, SqliteStore};
use idempotency_core::protocol::Lease;
use idempotency_core::store::{async_trait, Begun, CommitError, RecoveryPoint, RecoveryPoints};
use idempotency_core::{Error, TransactionalStore};
use rusqlite::{Transaction, TransactionBehavior};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use tokio::sync::oneshot;

/// A write transaction (`BEGIN IMMEDIATE`) open on one of the store's connections, for
/// [`Idempotency::run_in_transaction`](idempotency_core::Idempotency::run_in_transaction): the connection stays with it until it commits or is
/// dropped (rolled back).
pub struct SqliteTransaction {
    steps: mpsc::Sender<Step>,
    /// The completion `complete_in` (or the recovery point `advance_in`) asked for, run on
    /// the connection with the commit (one hop to the connection instead of two while the
    /// transaction holds the write lock).
    completion: Option<Completion>,
}

/// The record's completion (or recovery point), as the commit step runs it.
type Completion = Box<dyn FnOnce(&Transaction<'_>) -> Result<(), Error> + Send>;

impl std::fmt::Debug for SqliteTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SqliteTransaction")
    }
}

/// What the connection holding the transaction is asked to do next.
enum Step {
    Run(Box<dyn FnOnce(&Transaction<'_>) + Send>),
    /// Runs the completion, then commits; the answer is what stopped it, if anything.
    Commit(Option<Completion>, oneshot::Sender<Result<(), Error>>),
}

pub(crate) fn closed(why: &str) -> Error {
    Error::backend(
        false,
        std::io::Error::other(format!("the transaction ended: {why}")),
    )
}

impl SqliteTransaction {
    /// Runs `f` in the transaction, on its connection's thread. A panic in `f` is resumed
    /// here.
    pub async fn run<R, F>(&mut self, f: F) -> Result<R, Error>
    where
        R: Send + 'static,
        F: FnOnce(&Transaction<'_>) -> R + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let step = move |tx: &Transaction<'_>| {
            let _ = reply.send(catch_unwind(AssertUnwindSafe(|| f(tx))));
        };
        self.steps
            .send(Step::Run(Box::new(step)))
            .map_err(|_| closed("its connection is gone"))?;
        match answer.await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(panic)) => resume_unwind(panic),
            Err(_) => Err(closed("its connection is gone")),
        }
    }
}

#[async_trait]
impl TransactionalStore for SqliteStore {
    type Transaction = SqliteTransaction;
    type Connection = SqliteTransaction;
    type WorkError = Error;

    fn connection(transaction: &mut SqliteTransaction) -> &mut SqliteTransaction {
        transaction
    }

    fn connection_ref(transaction: &SqliteTransaction) -> &SqliteTransaction {
        transaction
    }

    fn work_error(error: Error) -> Error {
        error
    }

    /// Opens the transaction in a job that keeps the connection until the transaction ends;
    /// the heartbeat keeps the lease while the job waits its turn.
    async fn begin(&self, lease: &Lease) -> Result<Begun<SqliteTransaction>, Error> {
        let (steps, queue) = mpsc::channel::<Step>();
        let (began, begun) = oneshot::channel::<Result<(), Error>>();
        let (store, on_thread) = (self.clone(), self.clone());
        let job = move |conn: &mut rusqlite::Connection| {
            let sql = |e| store.inner.sql_error(e);
            // The store's durability, whatever ran on this connection before.
            let sync = store.inner.synchronous.pragma();
            let tx = conn
                .pragma_update(None, "synchronous", sync)
                .and_then(|()| conn.transaction_with_behavior(TransactionBehavior::Immediate));
            let tx = match tx {
                Ok(tx) => tx,
                Err(e) => {
                    let _ = began.send(Err(sql(e)));
                    return;
                }
            };
            if began.send(Ok(())).is_err() {
                return; // the caller is gone: the transaction rolls back
            }
            // Until the handle commits or is dropped (then the transaction rolls back).
            while let Ok(step) = queue.recv() {
                match step {
                    Step::Run(f) => f(&tx),
                    // A fenced completion rolls back (the transaction is dropped); a failed
                    // COMMIT leaves nothing behind in SQLite: it rolls back.
                    Step::Commit(completion, reply) => {
                        let ended = match completion.map_or(Ok(()), |complete| complete(&tx)) {
                            Ok(()) => tx.commit().map_err(sql),
                            Err(e) => Err(e),
                        };
                        let _ = reply.send(ended);
                        return;
                    }
                }
            }
        };
        // The job must reach the connection even if this caller is cancelled meanwhile. In
        // the pool mode it takes the process's turn to write first, and keeps it until the
        // transaction ends.
        tokio::spawn(async move {
            let gate = on_thread.inner.exec.write_gate().await?;
            on_thread
                .call(move |conn| {
                    let _gate = gate;
                    job(conn)
                })
                .await
        });
        match lease.with_heartbeat(begun).await {
            Ok(Ok(())) => Ok(Begun::Open(SqliteTransaction {
                steps,
                completion: None,
            })),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SqliteError::Closed.into()),
        }
    }

    async fn complete_in(
        &self,
        tx: &mut SqliteTransaction,
        lease: &Lease,
        outcome: &[u8],
    ) -> Result<(), Error> {
        let (store, id, token, ttl) = (
            self.clone(),
            lease.id().clone(),
            lease.token(),
            lease.retention(),
        );
        let outcome = outcome.to_vec();
        tx.completion = Some(Box::new(move |tx: &Transaction<'_>| {
            store.complete_in(tx, &id, token, &outcome, ttl)
        }));
        Ok(())
    }

    async fn commit(&self, tx: SqliteTransaction) -> Result<(), CommitError> {
        let (reply, answer) = oneshot::channel();
        if tx.steps.send(Step::Commit(tx.completion, reply)).is_err() {
            return Err(CommitError::NotCommitted(closed("its connection is gone")));
        }
        match answer.await {
            Ok(Ok(())) => Ok(()),
            // A fenced completion (`LeaseLost`) or a refused COMMIT: nothing committed.
            Ok(Err(e)) => Err(CommitError::NotCommitted(e)),
            // The connection's thread went away during COMMIT.
            Err(_) => Err(CommitError::Unknown(Error::OutcomeUnknown {
                source: "the connection went away during COMMIT".into(),
            })),
        }
    }

    async fn rollback(&self, tx: SqliteTransaction) {
        drop(tx);
    }
}

#[async_trait]
impl RecoveryPoints for SqliteStore {
    /// Runs with the commit, as the completion does.
    async fn advance_in(
        &self,
        tx: &mut SqliteTransaction,
        lease: &Lease,
        from: Option<u16>,
        to: &RecoveryPoint,
    ) -> Result<(), Error> {
        let (store, id, token, to) = (self.clone(), lease.id().clone(), lease.token(), to.clone());
        tx.completion = Some(Box::new(move |tx: &Transaction<'_>| {
            store.advance_in(tx, &id, token, from, &to)
        }));
        Ok(())
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
