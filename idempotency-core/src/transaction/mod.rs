//! The exactly-once protocol for stores that complete a record inside the caller's own
//! database transaction (the SQL stores): the store supplies the transaction, core drives
//! every step and applies every rule about what then becomes of the key.
//!
//! A store opts in by implementing [`TransactionalStore`] (begin, complete inside the
//! transaction, commit, roll back, tell a conflict);
//! [`Idempotency::run_in_transaction`](crate::Idempotency::run_in_transaction) then runs the
//! steps, the same on every store:
//!
//! 1. claim the key ([`Idempotency::begin`](crate::Idempotency::begin)): a replay, a refusal,
//!    or a [`Lease`] to run under;
//! 2. begin a transaction, run the work in it while the lease is kept alive (by the
//!    heartbeat, or in the process while the transaction holds the record locked: see
//!    [`Begun`]), [`encode_outcome`], complete the record inside the transaction, commit;
//!    after a conflict ([`TransactionalStore::is_conflict`]) all of it runs again;
//! 3. hand how it ended ([`TransactionEnd`]), or the panic that ended it, to
//!    [`Lease::settle_transaction`], which releases, holds or leaves the key by the rules
//!    below and gives the caller's answer.
//!
//! | the transaction… | [`TransactionEnd`] | the key | the caller gets |
//! |---|---|---|---|
//! | committed the work's writes and the completion | `Committed(v)` | completed (by the commit) | `Executed(Ok(v))` |
//! | rolled back because the work answered `Ok(Err(e))`, its own refusal | `WorkFailed(e)` | released, or `Err(e)` stored by an engine that stores errors ([`ErrorOutcomes`]) | `Executed(Err(e))` |
//! | rolled back because the completion was fenced, or the lease kept in the process passed | `LeaseLost` | another holder's, or left to be reclaimed: untouched | [`Error::LeaseLost`] |
//! | rolled back before its commit (a failed `BEGIN`, a database error of the work, its outer `Err`, or of the completion, an encoding error, a refused commit), when it was not a conflict or was one on the last run | `RolledBack(e)` | released at once (nothing took effect) | `e` |
//! | ended with a commit whose outcome is unknown | `Unknown(e)` | held until its lease passes | `e` |
//! | panicked (its transaction rolled back) | the panic | released at once | the panic, resumed |

pub(crate) mod driver;
mod held;
mod shared;
mod store;

pub use held::{HeldTransaction, Started};
pub use shared::SharedClaim;

pub use store::{Begun, CommitError, TransactionalStore, MAX_TRANSACTION_ATTEMPTS};

use crate::{Answer, Error, ErrorOutcomes, Failure, Lease, Settling};
use serde::Serialize;

/// How one exactly-once transaction ended, as a store reports it to
/// [`Lease::settle_transaction`]. See the [module documentation](self) for what each end
/// does to the key.
#[derive(Debug)]
#[must_use = "a transaction's end must be settled: Lease::settle_transaction"]
#[non_exhaustive]
pub enum TransactionEnd<T, E> {
    /// The work answered `Ok(Ok(value))`, and its writes committed with the record's
    /// completion.
    Committed(T),
    /// The work answered `Ok(Err(e))`, its own refusal, and its transaction rolled back:
    /// nothing of it took effect.
    WorkFailed(E),
    /// The completion inside the transaction was fenced (the lease had passed and another
    /// holder took the key over), and the transaction rolled back.
    LeaseLost,
    /// The transaction failed before its commit was sent (it could not begin, a statement or
    /// the encoding of the outcome failed) and rolled back: nothing took effect.
    RolledBack(Error),
    /// The commit was sent and its outcome is unknown (the connection was lost during
    /// `COMMIT`): the writes may have committed with the completion. The error is what the
    /// caller gets, usually [`Error::OutcomeUnknown`].
    Unknown(Error),
}

/// The bytes a transactional store writes with the completion: the work's result as JSON,
/// the format [`Idempotency::run`](crate::Idempotency::run) stores and
/// [`decode_replay`](crate::protocol::decode_replay) reads. A result that cannot be encoded is an
/// [`Error::Codec`]; report it as [`TransactionEnd::RolledBack`].
pub fn encode_outcome<R: Serialize>(result: &R) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(result).map_err(|source| Error::Codec { source })
}

impl Lease {
    /// Settles the lease after the exactly-once transaction it ran under ended as `end`
    /// (`Err` with the panic's payload when the transaction's future panicked), by the rules
    /// in the [module documentation](crate::transaction): the one place those rules live.
    /// `M` is the engine's treatment of errors (a work's own refusal is released, or stored,
    /// as [`ErrorOutcomes`] says).
    ///
    /// # Panics
    ///
    /// Resumes a panic given in `end` once the key is released.
    pub async fn settle_transaction<M, T, E>(
        self,
        end: std::thread::Result<TransactionEnd<T, E>>,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        M: ErrorOutcomes<E>,
        T: Serialize,
    {
        let end = match end {
            Ok(end) => end,
            Err(panic) => {
                self.release_after_panic().await;
                std::panic::resume_unwind(panic);
            }
        };
        match end {
            TransactionEnd::Committed(value) => {
                self.settled_externally();
                Ok(Answer::Executed(Ok(value)))
            }
            TransactionEnd::WorkFailed(e) => {
                let result: Result<T, E> = Err(e);
                match M::settling(&result) {
                    // Nothing of the work is kept by this path (its transaction rolled back, or
                    // a foreign phase failed, which a retry calls again under the same phase
                    // key): an outcome that cannot be stored holds the key until the lease
                    // passes rather than closing it for good.
                    Settling::Store(bytes) => self.complete_without_effects(&bytes).await?,
                    Settling::Unencodable(codec) => {
                        let _ = self.fail(Failure::permanent(codec.to_string())).await;
                        return Err(codec);
                    }
                    Settling::Release(failure) => self.fail(failure).await?,
                }
                Ok(Answer::Executed(result))
            }
            TransactionEnd::LeaseLost => {
                // The record belongs to the holder that took it over: nothing to release.
                let token = self.token();
                self.settled_externally();
                Err(Error::LeaseLost { token })
            }
            TransactionEnd::RolledBack(e) => {
                // Nothing took effect: release the key now rather than when the lease passes.
                // A result that cannot be encoded would fail the same way again.
                let failure = match &e {
                    Error::Codec { .. } => Failure::permanent(e.to_string()),
                    _ => Failure::retryable(e.to_string()),
                };
                let _ = self.fail(failure).await;
                Err(e)
            }
            TransactionEnd::Unknown(e) => {
                // The writes may have committed: the key is never released while they may
                // still show. A retry after the lease finds the Completed record, or nothing.
                self.hold();
                Err(e)
            }
        }
    }
}
