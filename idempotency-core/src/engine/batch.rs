//! A queue consumer's batch of messages: claimed together, the new ones run, settled
//! together, each message's fate reported in the shape a consumer acknowledges by.

use super::{decode_stored, loggable_record, Acted, Idempotency, Lease};
use crate::{
    ClaimRequest, Error, ErrorOutcomes, Failure, Fingerprint, IdempotencyKey, Operation, RecordId,
    Refusal, Scope, Settle, Settlement, Settling,
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
    /// the same id is refused with [`crate::Refusal::KeyReused`].
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
    Executed(T),
    /// The work ran earlier (a redelivery, a duplicate): its stored outcome. Nothing ran.
    Replayed(T),
    /// The work ran in this batch, but its outcome could not be stored
    /// ([`Error::OutcomeUnknown`]: the lost outcome is recorded in its place where the
    /// store takes it, otherwise the key is held until its lease passes), or another holder
    /// took the key over meanwhile ([`Error::LeaseLost`]).
    Unsettled {
        /// What the work returned.
        result: T,
        /// Why it is not stored.
        error: Error,
    },
    /// The work panicked (its closure, its future, or the outcome's `Serialize` or
    /// `Display`). It may have acted first, so its key is settled for good, as an outcome
    /// that cannot be stored ([`crate::Failure::outcome_not_stored`]): a redelivery is
    /// refused with [`Refusal::OutcomeLost`] and never runs it; `redeliver` is `false`
    /// (acknowledge it, or send it to a dead-letter queue).
    Panicked,
    /// The message was not run: [`Refusal::InProgress`] (another consumer holds it; it is
    /// redelivered), [`Refusal::KeyReused`] (its id was used for another payload),
    /// [`Refusal::FailedPermanently`] or [`Refusal::OutcomeLost`] (those are not).
    Refused(Refusal),
    /// Something broke: the store failed, the record was corrupt, or the work's outcome
    /// could not be encoded (then the work ran, and its key is settled as an outcome lost).
    Failed(Error),
}

/// One message's report: what became of it, and whether the broker should deliver it again.
#[derive(Debug)]
pub struct MessageReport<T> {
    /// What became of it.
    pub outcome: MessageOutcome<T>,
    /// Whether to have the message delivered again (do not acknowledge it, or `nak` it):
    /// its work was released for a retry, is held by another consumer, did not run because
    /// the store failed, or its fate is not known yet. `false` for a stored or replayed
    /// outcome, and for a message no redelivery can help (a key reused, a permanent failure,
    /// a lost outcome, a corrupt record): acknowledge those, or send them to a dead-letter
    /// queue. A store error is redelivered even when it is not retryable as is: the message
    /// did not run, and acknowledging it would lose it.
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
        self.count(|o| {
            matches!(
                o,
                MessageOutcome::Executed(_) | MessageOutcome::Unsettled { .. }
            )
        })
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

/// A settlement for the batch's settler, and where its first answer goes (with when it was
/// sent).
type ToSettle = (
    Settlement,
    futures::channel::oneshot::Sender<(Result<crate::Cas, Error>, Instant)>,
);

/// A message whose work ran without panicking: its result, how it is settled (`Err`: it
/// cannot be encoded), and the answer to its first settlement (`None`: not sent, or lost).
type Ran<R> = (
    R,
    Result<Settle, Error>,
    Option<(Result<crate::Cas, Error>, Instant)>,
);

impl<St: ?Sized, Er> Idempotency<St, Er> {
    /// Runs a batch of messages (a queue consumer's poll): each message's work runs at most
    /// once per key, a redelivered or duplicate message is answered with its stored outcome,
    /// and every message's fate comes back in one [`BatchReport`], with the indices to have
    /// delivered again.
    ///
    /// The batch is claimed with one [`crate::IdempotencyStore::claim_many`] (one round trip
    /// on the stores that batch natively) and the new messages run at most `concurrency` at
    /// a time. Each message is settled as soon as its work ends, together with the others that
    /// ended meanwhile (one [`crate::IdempotencyStore::settle_many`] per group), never waiting
    /// for the slowest; a settlement the batch could not store is retried alone, per
    /// [`crate::Policy::settle_retry`], and read back as [`Lease::complete`] does. Every
    /// claimed message stays under its lease's heartbeat (as [`Idempotency::run`]) from its
    /// claim until its settlement is answered, while it waits for a slot too: no message's
    /// lease passes while this consumer is alive, so a redelivery is told it is in progress
    /// rather than taking it over. A message whose record needs a takeover (a released
    /// failure, a lease that passed) is taken over alone. A message another consumer holds is
    /// not waited for, whatever the policy says: it is reported [`Refusal::InProgress`] and
    /// marked for redelivery. A message named twice in one batch runs once; the second is
    /// reported in progress (or replayed, once the first is stored).
    ///
    /// Outcomes are settled as [`Idempotency::run`] settles them (an `Err` released, or
    /// stored by an engine that stores errors) and stored as JSON. A panic in a message's work (in the closure, before it returns a
    /// future, as much as in the future, or in the outcome's `Serialize`) settles that
    /// message's key for good and is reported as [`MessageOutcome::Panicked`]; every other
    /// message is settled as usual and the batch returns.
    ///
    /// If the batch's future is dropped (a shutdown), the messages already settled stay
    /// settled; a message whose work was running, or had ended and whose settlement was not
    /// yet answered, is held until its lease passes, as for a consumer that crashed, and a
    /// redelivery after that runs it again. Keep the work's effects and its completion in
    /// one transaction where that must never happen.
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
        E: Send,
        Er: ErrorOutcomes<E>,
        F: Fn(M, crate::WorkContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let store = self.store.as_ref();
        let mut reports: Vec<Option<MessageReport<Result<T, E>>>> =
            messages.iter().map(|_| None).collect();
        let requests: Vec<ClaimRequest> = messages
            .iter()
            .map(|m| {
                self.claim_request(RecordId::new(m.key.clone(), scope.clone()), &m.fingerprint)
            })
            .collect();
        let answers = store.claim_many(&requests).await;
        let mut to_run = Vec::new();
        let refused = |e: Result<Refusal, Error>| {
            let (outcome, redeliver) = match e {
                Ok(refusal) => {
                    let redeliver = refusal.is_retryable();
                    (MessageOutcome::Refused(refusal), redeliver)
                }
                Err(e) => {
                    let redeliver = redeliverable(&e);
                    (MessageOutcome::Failed(e), redeliver)
                }
            };
            Some(MessageReport { outcome, redeliver })
        };
        for (index, ((message, request), answer)) in
            messages.into_iter().zip(requests).zip(answers).enumerate()
        {
            let id = request.id.clone();
            let claimed = match answer {
                Ok(claim) => self
                    .begin_after_claim(request, claim)
                    .await
                    .map(Decided::from_begin),
                Err(e) => Err(e.during(Operation::Claim, self.loggable(&id))),
            };
            match claimed {
                Ok(Decided::Run(lease)) => to_run.push(ToRun {
                    index,
                    lease,
                    message: message.message,
                }),
                Ok(Decided::Replay(record)) => {
                    reports[index] = match decode_stored(&record, Er::replayed) {
                        Ok(result) => Some(MessageReport {
                            outcome: MessageOutcome::Replayed(result),
                            redeliver: false,
                        }),
                        Err(e) => refused(Err(e)),
                    };
                }
                Ok(Decided::Refused(refusal)) => reports[index] = refused(Ok(refusal)),
                Err(e) => reports[index] = refused(Err(e)),
            }
        }

        // Run the new ones, at most `concurrency` at a time. Every claimed message is under
        // its lease's heartbeat from now until its first settlement is answered, whether it
        // waits for a slot, runs, or waits for its settlement: no lease passes while this
        // consumer is alive. A message is settled as soon as its work ends, with the others
        // that ended meanwhile (one `settle_many` per group), never waiting for the slowest.
        let slots = tokio::sync::Semaphore::new(concurrency.max(1));
        let (to_settle, mut settling) = futures::channel::mpsc::unbounded::<ToSettle>();
        let settler = async move {
            while let Some(first) = settling.next().await {
                let mut group = vec![first];
                while let Ok(more) = settling.try_recv() {
                    group.push(more);
                }
                let (settlements, replies): (Vec<Settlement>, Vec<_>) = group.into_iter().unzip();
                let sent = Instant::now();
                let mut answers = store.settle_many(&settlements).await.into_iter();
                for reply in replies {
                    let answer = answers.next().unwrap_or_else(|| {
                        Err(Error::backend(
                            true,
                            "the store answered fewer settlements than the batch had",
                        ))
                    });
                    // A message whose future was dropped no longer listens.
                    let _ = reply.send((answer, sent));
                }
            }
        };
        let (work, slots) = (&work, &slots);
        let runs = futures::future::join_all(to_run.into_iter().map(|r| {
            let to_settle = to_settle.clone();
            async move {
                let ToRun {
                    index,
                    lease,
                    message,
                } = r;
                let ctx = lease.context();
                let ttl = self.policy.retention;
                let ran = lease
                    .with_heartbeat(async {
                        // The semaphore is never closed.
                        let permit = slots.acquire().await.ok();
                        // The closure is called inside the guard: a panic before it returns a
                        // future is this message's, as one in the future is.
                        let out = AssertUnwindSafe(async { work(message, ctx).await })
                            .catch_unwind()
                            .await;
                        drop(permit);
                        let Ok(result) = out else {
                            return None;
                        };
                        // The outcome's `Serialize` or the error's `Display` may panic too.
                        let settle = std::panic::catch_unwind(AssertUnwindSafe(|| {
                            classified::<Er, T, E>(&result)
                        }))
                        .ok()?;
                        let first = match &settle {
                            Ok(settle) => {
                                let (reply, answer) = futures::channel::oneshot::channel();
                                let settlement = Settlement {
                                    id: lease.id().clone(),
                                    token: lease.token(),
                                    settle: settle.clone(),
                                    ttl,
                                };
                                let _ = to_settle.unbounded_send((settlement, reply));
                                answer.await.ok()
                            }
                            Err(_) => None,
                        };
                        Some((result, settle, first))
                    })
                    .await;
                drop(to_settle);
                self.finish_message(index, lease, ran).await
            }
        }));
        drop(to_settle);
        let (finished, ()) = futures::join!(runs, settler);
        for (index, outcome, redeliver) in finished {
            reports[index] = Some(MessageReport { outcome, redeliver });
        }
        BatchReport {
            messages: reports
                .into_iter()
                .map(|r| {
                    r.unwrap_or_else(|| MessageReport {
                        outcome: MessageOutcome::Failed(Error::backend(
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

impl<St: ?Sized, Er> Idempotency<St, Er> {
    /// Settles one message of a batch whose work ended (`None`: it panicked) and whose first
    /// settlement was answered: retries alone and reads back as [`Lease::complete`] does.
    async fn finish_message<T, E>(
        &self,
        index: usize,
        lease: Lease,
        ran: Option<Ran<Result<T, E>>>,
    ) -> (usize, MessageOutcome<Result<T, E>>, bool) {
        let Some((result, settle, first)) = ran else {
            tracing::warn!(
                record = %loggable_record(lease.id(), &self.policy),
                "the work of a batch's message panicked; its key is settled for good"
            );
            lease.settle_after_panic().await;
            return (index, MessageOutcome::Panicked, false);
        };
        let (stored, released) = match settle {
            Ok(Settle::Complete(bytes)) => (
                lease.complete_after(first, &bytes, Acted::Maybe).await,
                false,
            ),
            Ok(Settle::Fail(failure)) => (lease.fail_after(first, failure).await, true),
            Err(e) => {
                // The outcome cannot be encoded: the work ran and its outcome is lost, final
                // for every payload, as `run` records it.
                let _ = lease.fail(Failure::outcome_not_stored(&e)).await;
                return (index, MessageOutcome::Failed(e), false);
            }
        };
        match stored {
            Ok(()) => (index, MessageOutcome::Executed(result), released),
            Err(error) => (index, MessageOutcome::Unsettled { result, error }, true),
        }
    }
}

/// What a batch's claim decided for a message.
enum Decided {
    Run(Lease),
    Replay(crate::Record),
    Refused(Refusal),
}

impl Decided {
    /// A message's decision, as [`Idempotency::begin`] made it.
    fn from_begin(begin: super::Begin) -> Self {
        match begin {
            super::Begin::Execute(lease) => Self::Run(lease),
            super::Begin::Replay(record) => Self::Replay(record),
            super::Begin::Refused(refusal) => Self::Refused(refusal),
        }
    }
}

/// How a message's result is settled, per the engine's error outcomes; `Err` when it cannot
/// be encoded.
fn classified<Er, T, E>(result: &Result<T, E>) -> Result<Settle, Error>
where
    Er: ErrorOutcomes<E>,
    T: Serialize,
{
    match Er::settling(result) {
        Settling::Store(bytes) => Ok(Settle::Complete(bytes)),
        Settling::Release(failure) => Ok(Settle::Fail(failure)),
        Settling::Unencodable(e) => Err(e),
    }
}

/// Whether a message that failed with `e` is worth delivering again: every store error
/// (the message did not run, or its fate is not known), never an error about the message
/// itself.
fn redeliverable(e: &Error) -> bool {
    match e {
        Error::Backend { .. } | Error::OutcomeUnknown { .. } | Error::LeaseLost { .. } => true,
        Error::CorruptRecord { .. }
        | Error::Codec { .. }
        | Error::StoredOutcome { .. }
        | Error::InvalidKey(_)
        | Error::InvalidScope(_)
        | Error::Config(_)
        | Error::CannotResume { .. } => false,
    }
}
