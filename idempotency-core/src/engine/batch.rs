//! A queue consumer's batch of messages: claimed together, the new ones run, settled
//! together, each message's fate reported in the shape a consumer acknowledges by.

use super::{decode_replay, loggable_record, Acted, Idempotency, Lease};
use crate::{
    ClaimRequest, Error, ErrorOutcomes, Failure, Fingerprint, IdempotencyKey, Operation, RecordId,
    Scope, Settle, Settlement,
};
use futures::{FutureExt, StreamExt};
use serde::{de::DeserializeOwned, Serialize};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

/// One message of a batch for [`Idempotency::run_batch`]: its idempotency key (derived from
/// the message's id, which a redelivery keeps), the fingerprint of its payload, and what the
/// work is given.
#[derive(Clone, Debug)]
pub struct BatchMessage<M> {
    /// The key: the message's id, or what the producer put in it for deduplication.
    pub key: IdempotencyKey,
    /// The payload's fingerprint: a redelivery carries the same one; another message under
    /// the same id is refused with [`Error::Mismatch`].
    pub fingerprint: Fingerprint,
    /// What the work gets for this message (its body, a handle, …).
    pub message: M,
}

impl<M> BatchMessage<M> {
    /// A message keyed by `key`, its payload fingerprinted by `fingerprint`.
    pub fn new(key: IdempotencyKey, fingerprint: Fingerprint, message: M) -> Self {
        Self {
            key,
            fingerprint,
            message,
        }
    }
}

/// What became of one message of a batch.
#[derive(Debug)]
#[non_exhaustive]
pub enum MessageOutcome<T> {
    /// The work ran in this batch, and its outcome was stored (or, for an outcome the
    /// policy releases, the key was released for a redelivery to run it again).
    Ran(T),
    /// The work ran earlier (a redelivery, a duplicate): its stored outcome. Nothing ran.
    Replayed(T),
    /// The work ran in this batch, but its outcome could not be stored
    /// ([`Error::OutcomeUnknown`]: a permanent failure is recorded in its place where the
    /// store takes it, otherwise the key is held until its lease passes), or another holder
    /// took the key over meanwhile ([`Error::LeaseLost`]).
    Unsettled {
        /// What the work returned.
        result: T,
        /// Why it is not stored.
        error: Error,
    },
    /// The work panicked; the key was released (a retryable failure), so a redelivery runs
    /// it again.
    Panicked,
    /// The message was not run: [`Error::InProgress`] (another consumer holds it),
    /// [`Error::Mismatch`] (its id was used for another payload),
    /// [`Error::FailedPermanently`], or a store error.
    Refused(Error),
}

/// One message's report: what became of it, and whether the broker should deliver it again.
#[derive(Debug)]
pub struct MessageReport<T> {
    /// What became of it.
    pub outcome: MessageOutcome<T>,
    /// Whether to have the message delivered again (do not acknowledge it, or `nak` it):
    /// its work was released for a retry, is held by another consumer, or its fate is not
    /// known yet. `false` for a stored or replayed outcome, and for a message no redelivery
    /// can help (a mismatch, a permanent failure, an outcome that cannot be encoded):
    /// acknowledge those, or send them to a dead-letter queue.
    pub redeliver: bool,
}

/// What [`Idempotency::run_batch`] did with each message, in the batch's order.
#[derive(Debug)]
pub struct BatchReport<T> {
    /// One report per message, in the batch's order.
    pub messages: Vec<MessageReport<T>>,
}

impl<T> BatchReport<T> {
    /// The indices (in the batch's order) of the messages to have delivered again: the
    /// shape of SQS's `batchItemFailures` or a list of sequence numbers to `nak`.
    pub fn redeliver(&self) -> Vec<usize> {
        self.messages
            .iter()
            .enumerate()
            .filter(|(_, m)| m.redeliver)
            .map(|(i, _)| i)
            .collect()
    }

    /// How many messages ran their work in this batch.
    pub fn ran(&self) -> usize {
        self.count(|o| matches!(o, MessageOutcome::Ran(_) | MessageOutcome::Unsettled { .. }))
    }

    /// How many messages were answered from a stored outcome (duplicates suppressed).
    pub fn replayed(&self) -> usize {
        self.count(|o| matches!(o, MessageOutcome::Replayed(_)))
    }

    fn count(&self, f: impl Fn(&MessageOutcome<T>) -> bool) -> usize {
        self.messages.iter().filter(|m| f(&m.outcome)).count()
    }
}

/// A message whose work is to run, with what it needs to settle.
struct ToRun<M> {
    index: usize,
    lease: Lease,
    message: M,
}

/// A message whose work ran, or the index and lease of one whose work panicked.
type RanOrPanicked<R> = Result<Ran<R>, (usize, Lease)>;

/// A message whose work ran: how to settle it.
struct Ran<R> {
    index: usize,
    lease: Lease,
    result: R,
    settle: Option<Settle>,
}

impl Idempotency {
    /// Runs a batch of messages (a queue consumer's poll): each message's work runs at most
    /// once per key, a redelivered or duplicate message is answered with its stored outcome,
    /// and every message's fate comes back in one [`BatchReport`], with the indices to have
    /// delivered again.
    ///
    /// The batch is claimed with one [`crate::IdempotencyStore::claim_many`] (one round trip
    /// on the stores that batch natively), the new messages run at most `concurrency` at a
    /// time (each under its lease's heartbeat, as [`Idempotency::run`]), and their outcomes
    /// are stored with one [`crate::IdempotencyStore::settle_many`]; a settlement the batch
    /// could not store is retried alone, per [`crate::Policy::settle_retry`], and read back
    /// as [`Lease::complete`] does. A message whose record needs a takeover (a released
    /// failure, a lease that passed) is taken over alone. A message another consumer holds is
    /// not waited for, whatever the policy says: it is reported [`Error::InProgress`] and
    /// marked for redelivery. A message named twice in one batch runs once; the second is
    /// reported in progress (or replayed, once the first is stored).
    ///
    /// Outcomes are classified as [`Idempotency::run`] does (per [`crate::Policy::errors`])
    /// and stored as JSON. A panic in the work releases that message's key and is reported
    /// as [`MessageOutcome::Panicked`]; the other messages go on.
    ///
    /// ```
    /// # use idempotency_core::*;
    /// # async fn example(store: std::sync::Arc<dyn IdempotencyStore>) -> Result<(), Error> {
    /// let engine = Idempotency::new(store, Policy::default())?;
    /// let scope = Scope::new("orders-consumer")?;
    /// let batch = vec![
    ///     BatchMessage::new(IdempotencyKey::new("msg-1")?, Fingerprint::from_bytes(b"a"), 1),
    ///     BatchMessage::new(IdempotencyKey::new("msg-2")?, Fingerprint::from_bytes(b"b"), 2),
    /// ];
    /// let report = engine
    ///     .run_batch(&scope, batch, 8, |n: i32, _ctx| async move { Ok::<_, String>(n * 10) })
    ///     .await;
    /// for i in report.redeliver() {
    ///     println!("message {i} is to be delivered again");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn run_batch<M, T, E, F, Fut>(
        &self,
        scope: &Scope,
        messages: Vec<BatchMessage<M>>,
        concurrency: usize,
        work: F,
    ) -> BatchReport<Result<T, E>>
    where
        T: Serialize + DeserializeOwned + Send,
        E: Serialize + DeserializeOwned + std::fmt::Display + Send,
        F: Fn(M, crate::WorkContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let store = self.store.as_ref();
        let mut reports: Vec<Option<MessageReport<Result<T, E>>>> =
            messages.iter().map(|_| None).collect();
        let requests: Vec<ClaimRequest> = messages
            .iter()
            .map(|m| {
                self.claim_request(RecordId::new(scope.clone(), m.key.clone()), &m.fingerprint)
            })
            .collect();
        let answers = store.claim_many(&requests).await;
        let mut to_run = Vec::new();
        let refused = |e: Error| {
            let redeliver = redeliverable(&e);
            Some(MessageReport {
                outcome: MessageOutcome::Refused(e),
                redeliver,
            })
        };
        for (index, ((message, request), answer)) in
            messages.into_iter().zip(requests).zip(answers).enumerate()
        {
            let id = request.id.clone();
            let claimed = match answer {
                Ok(claim) => self
                    .begin_after_claim(request, claim)
                    .await
                    .and_then(Decided::from_begin),
                Err(e) => Err(e.during(Operation::Claim, self.loggable(&id))),
            };
            match claimed {
                Ok(Decided::Run(lease)) => to_run.push(ToRun {
                    index,
                    lease,
                    message: message.message,
                }),
                Ok(Decided::Replay(record)) => {
                    reports[index] = match decode_replay(&record) {
                        Ok(result) => Some(MessageReport {
                            outcome: MessageOutcome::Replayed(result),
                            redeliver: false,
                        }),
                        Err(e) => refused(e),
                    };
                }
                Err(e) => reports[index] = refused(e),
            }
        }

        // Run the new ones, at most `concurrency` at a time.
        let errors = self.policy.errors;
        let work = &work;
        let ran: Vec<RanOrPanicked<Result<T, E>>> =
            futures::stream::iter(to_run.into_iter().map(|r| async move {
                let ToRun {
                    index,
                    lease,
                    message,
                } = r;
                let ctx = lease.context();
                let out = lease
                    .with_heartbeat(AssertUnwindSafe(work(message, ctx)).catch_unwind())
                    .await;
                match out {
                    Ok(result) => Ok(classified(index, lease, result, errors)),
                    Err(_panic) => Err((index, lease)),
                }
            }))
            .buffer_unordered(concurrency.max(1))
            .collect()
            .await;

        let mut settled = Vec::new();
        let mut panicked = Vec::new();
        for r in ran {
            match r {
                Ok(ran) => settled.push(ran),
                Err(p) => panicked.push(p),
            }
        }
        for (index, lease) in panicked {
            tracing::warn!(
                record = %loggable_record(lease.id(), &self.policy),
                "the work of a batch's message panicked; its key is released"
            );
            lease.release_after_panic().await;
            reports[index] = Some(MessageReport {
                outcome: MessageOutcome::Panicked,
                redeliver: true,
            });
        }

        // Settle together; each settlement's answer is its lease's first try.
        let settlements: Vec<Settlement> = settled
            .iter()
            .filter_map(|r| {
                r.settle.as_ref().map(|s| Settlement {
                    id: r.lease.id().clone(),
                    token: r.lease.token(),
                    settle: s.clone(),
                    ttl: self.policy.ttl,
                })
            })
            .collect();
        let sent = Instant::now();
        let mut answers = store.settle_many(&settlements).await.into_iter();
        let finishing = settled.into_iter().map(|r| {
            let first = r
                .settle
                .as_ref()
                .and_then(|_| answers.next())
                .map(|answer| (answer, sent));
            async move {
                let Ran {
                    index,
                    lease,
                    result,
                    settle,
                } = r;
                let (stored, released) = match settle {
                    Some(Settle::Complete(bytes)) => (
                        lease.complete_after(first, &bytes, Acted::Maybe).await,
                        false,
                    ),
                    Some(Settle::Fail(failure)) => (lease.fail_after(first, failure).await, true),
                    None => {
                        // The outcome cannot be encoded: the work ran and its outcome is lost,
                        // final for every payload, as `run` records it.
                        let e = serde_json::to_vec(&result)
                            .err()
                            .map(|source| Error::Codec { source })
                            .unwrap_or_else(|| Error::backend(false, "cannot encode"));
                        let _ = lease.fail(Failure::outcome_not_stored(&e)).await;
                        return (index, MessageOutcome::Refused(e), false);
                    }
                };
                match stored {
                    Ok(()) => (index, MessageOutcome::Ran(result), released),
                    Err(error) => (index, MessageOutcome::Unsettled { result, error }, true),
                }
            }
        });
        for (index, outcome, redeliver) in futures::future::join_all(finishing).await {
            reports[index] = Some(MessageReport { outcome, redeliver });
        }
        BatchReport {
            messages: reports
                .into_iter()
                .map(|r| {
                    r.unwrap_or_else(|| MessageReport {
                        outcome: MessageOutcome::Refused(Error::backend(
                            true,
                            "the message got no answer",
                        )),
                        redeliver: true,
                    })
                })
                .collect(),
        }
    }
}

/// What a batch's claim decided for a message.
enum Decided {
    Run(Lease),
    Replay(crate::Record),
}

impl Decided {
    /// A message's decision, as [`Idempotency::begin`] made it; what is not run or replayed
    /// is the error it is refused with.
    fn from_begin(begin: super::Begin) -> Result<Self, Error> {
        match begin {
            super::Begin::Execute(lease) => Ok(Self::Run(lease)),
            super::Begin::Replay(record) => Ok(Self::Replay(record)),
            super::Begin::Mismatch => Err(Error::Mismatch),
            super::Begin::InProgress { retry_after } => Err(Error::InProgress { retry_after }),
            super::Begin::FailedPermanently { message } => {
                Err(Error::FailedPermanently { message })
            }
        }
    }
}

/// How a message's result is settled, per the policy's error outcomes; `None` when it
/// cannot be encoded.
fn classified<T, E>(
    index: usize,
    lease: Lease,
    result: Result<T, E>,
    errors: ErrorOutcomes,
) -> Ran<Result<T, E>>
where
    T: Serialize,
    E: Serialize + std::fmt::Display,
{
    let settle = match (&result, errors) {
        (Err(e), ErrorOutcomes::RecordFailure) => {
            Some(Settle::Fail(Failure::retryable(e.to_string())))
        }
        _ => serde_json::to_vec(&result).ok().map(Settle::Complete),
    };
    Ran {
        index,
        lease,
        result,
        settle,
    }
}

/// Whether a message refused with `e` is worth delivering again.
fn redeliverable(e: &Error) -> bool {
    match e {
        Error::InProgress { .. }
        | Error::Backend { .. }
        | Error::OutcomeUnknown { .. }
        | Error::LeaseLost { .. } => true,
        Error::Mismatch
        | Error::FailedPermanently { .. }
        | Error::CorruptRecord { .. }
        | Error::Codec { .. }
        | Error::InvalidKey(_)
        | Error::InvalidScope(_)
        | Error::Config(_) => false,
    }
}
