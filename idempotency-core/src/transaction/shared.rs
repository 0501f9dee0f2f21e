//! [`SharedClaim`]: a holder's claim, handed to work that runs its exactly-once transaction
//! in another task (an HTTP handler behind the layer).

use super::driver::{transaction, Seal};
use super::{TransactionEnd, TransactionalStore};
use crate::{Error, Lease, RecordId, WorkContext};
use futures::future::BoxFuture;
use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A handle on a [`Lease`], for work that runs its exactly-once transaction away from the
/// lease's holder: the HTTP layer gives one to the handler it runs. It runs core's
/// transaction (the heartbeat or the in-process lease, a re-run after each conflict, the
/// completion fenced by the claim's token) and reports how it ended; it never settles the
/// key itself: the holder does, from that end. Cloning it is cheap.
#[derive(Clone)]
pub struct SharedClaim {
    lease: Arc<Lease>,
}

impl fmt::Debug for SharedClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedClaim")
            .field("id", self.lease.id())
            .field("token", &self.lease.token())
            .finish_non_exhaustive()
    }
}

impl Lease {
    /// A [`SharedClaim`] on this lease, for work in another task. The lease itself is still
    /// the one to settle.
    pub fn share(&self) -> SharedClaim {
        SharedClaim {
            lease: Arc::new(self.companion()),
        }
    }
}

/// The completion with bytes the work's value carries (an HTTP response's stored form).
struct Carried<F>(F);

impl<S, T, F> Seal<S, T> for Carried<F>
where
    S: TransactionalStore,
    F: Fn(&T) -> Vec<u8> + Sync,
{
    fn encode(&self, value: &T) -> Result<Vec<u8>, Error> {
        Ok((self.0)(value))
    }
}

impl SharedClaim {
    /// The record claimed.
    pub fn id(&self) -> &RecordId {
        self.lease.id()
    }

    /// The claim's context (record and fencing token), as the engine's exactly-once paths
    /// give it to their work.
    pub fn context(&self) -> WorkContext {
        self.lease.context()
    }

    /// How long the completed record is kept (the engine's retention).
    pub fn retention(&self) -> Duration {
        self.lease.retention()
    }

    /// Runs `work` in a transaction of `store` and completes the record inside it with
    /// `outcome(&value)`, then commits, as
    /// [`Idempotency::run_in_transaction`](crate::Idempotency::run_in_transaction) does
    /// (a conflict runs the whole transaction again), and says how it ended. `work`'s `Err`
    /// is a database error (its transaction rolls back). Settling the key from the end is the
    /// holder's: [`TransactionEnd::Committed`] completed it, [`TransactionEnd::LeaseLost`]
    /// and [`TransactionEnd::RolledBack`] changed nothing, [`TransactionEnd::Unknown`] may
    /// have completed it.
    pub async fn run_in_transaction<S, T, F, O>(
        &self,
        store: &S,
        outcome: O,
        mut work: F,
    ) -> TransactionEnd<T, Infallible>
    where
        S: TransactionalStore,
        T: Send,
        O: Fn(&T) -> Vec<u8> + Sync,
        F: for<'t> FnMut(
                &'t mut S::Transaction,
                WorkContext,
            ) -> BoxFuture<'t, Result<Result<T, Infallible>, Error>>
            + Send,
    {
        let mut kept_in_process = false;
        transaction(
            store,
            &self.lease,
            &mut work,
            &Carried(outcome),
            &mut kept_in_process,
        )
        .await
    }
}
