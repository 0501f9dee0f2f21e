//! The completer: finishes multi-step operations whose holder died mid-way.

use crate::phases::{Abandoned, AbandonedQuery, Phases, RecoveryPoints, Resumed};
use crate::{
    Answer, Error, ErrorMode, ErrorOutcomes, Idempotency, IdempotencyStore, ReleaseErrors,
};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use serde::{de::DeserializeOwned, Serialize};
use std::collections::HashMap;
use std::fmt::{self, Display};
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Runs one abandoned operation of a registered kind to its end.
type Finish<S, M> = Arc<
    dyn Fn(Idempotency<dyn IdempotencyStore, M>, Arc<S>, Abandoned) -> BoxFuture<'static, Finished>
        + Send
        + Sync,
>;

/// How one abandoned operation ended in the completer's hands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finished {
    /// Driven to its end: its outcome (a value, or an error an engine that stores errors stored) is stored.
    Completed,
    /// Its last phase failed and the failure was recorded: a later round, or a retry,
    /// resumes it.
    Failed,
    /// Someone else holds it now (a client's retry took it over first), or finished it.
    TakenElsewhere,
    /// Not an operation to finish: its record expired or was purged after it was listed,
    /// or it never got past its first phase. Left to its client.
    Skipped,
    /// The store or the operation's definition failed.
    Error,
}

/// What one round of the completer did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompleterRound {
    /// Abandoned operations the store listed.
    pub found: usize,
    /// Driven to their end.
    pub completed: usize,
    /// Whose phase failed again (recorded; resumed later).
    pub failed: usize,
    /// Taken over or finished by someone else first.
    pub taken_elsewhere: usize,
    /// Left alone because there was nothing to finish: not past its first phase, or its
    /// record expired or was purged after it was listed. A completer never starts an
    /// operation (it has no request to start it with); its client's request does.
    pub skipped: usize,
    /// Of an operation no [`Completer::operation`] registered: left alone (a store lists
    /// only registered ones; this counts those a store listed anyway).
    pub unknown: usize,
    /// Ended by an error of the store or of the operation's definition, or listed as a row
    /// the store could not read.
    pub errors: usize,
}

impl Display for CompleterRound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} abandoned: {} completed, {} failed again, {} taken elsewhere, {} skipped, {} \
             unknown, {} errors",
            self.found,
            self.completed,
            self.failed,
            self.taken_elsewhere,
            self.skipped,
            self.unknown,
            self.errors
        )
    }
}

/// Totals over a completer's life, readable while it runs.
#[derive(Debug, Default)]
pub struct CompleterStats {
    rounds: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    taken_elsewhere: AtomicU64,
    skipped: AtomicU64,
    unknown: AtomicU64,
    errors: AtomicU64,
}

impl CompleterStats {
    /// Rounds run.
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }
    /// Operations driven to their end.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }
    /// Operations whose phase failed again.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }
    /// Operations someone else took over first.
    pub fn taken_elsewhere(&self) -> u64 {
        self.taken_elsewhere.load(Ordering::Relaxed)
    }
    /// Operations skipped: nothing to finish (see [`CompleterRound::skipped`]).
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }
    /// Operations of no registered kind, seen.
    pub fn unknown(&self) -> u64 {
        self.unknown.load(Ordering::Relaxed)
    }
    /// Errors.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Counts a round, here and through the `metrics` facade (with the `metrics` feature):
    /// `idempotency_completer_rounds_total`, and `idempotency_completer_operations_total` by
    /// how each operation ended (`end`: `completed`, `failed`, `taken_elsewhere`,
    /// `skipped`, `unknown`, `error`).
    fn add(&self, round: &CompleterRound) {
        tracing::debug!(%round, "completer round");
        self.rounds.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!("idempotency_completer_rounds_total").increment(1);
        for (total, end, n) in [
            (&self.completed, "completed", round.completed),
            (&self.failed, "failed", round.failed),
            (
                &self.taken_elsewhere,
                "taken_elsewhere",
                round.taken_elsewhere,
            ),
            (&self.skipped, "skipped", round.skipped),
            (&self.unknown, "unknown", round.unknown),
            (&self.errors, "error", round.errors),
        ] {
            total.fetch_add(n as u64, Ordering::Relaxed);
            #[cfg(feature = "metrics")]
            if n > 0 {
                metrics::counter!("idempotency_completer_operations_total", "end" => end)
                    .increment(n as u64);
            }
            #[cfg(not(feature = "metrics"))]
            let _ = end;
        }
    }

    /// Counts a round whose listing failed: a round and an error, here and through the
    /// `metrics` facade (`idempotency_completer_rounds_total`,
    /// `idempotency_completer_listing_failures_total`).
    fn listing_failed(&self, e: &Error) {
        tracing::warn!(error = %e, "the completer could not list abandoned operations");
        self.rounds.fetch_add(1, Ordering::Relaxed);
        self.errors.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        {
            metrics::counter!("idempotency_completer_rounds_total").increment(1);
            metrics::counter!("idempotency_completer_listing_failures_total").increment(1);
        }
    }
}

/// Finishes multi-step operations whose holder died: each round lists the store's abandoned
/// operations ([`RecoveryPoints::abandoned`]), takes each over like any retry would (a CAS on
/// its token, once its lease has passed) and runs it from its recovery point to its end with
/// the operation's phases, at most `concurrency` at once. It touches nothing else: keys of
/// one-step work have no recovery point, and operations of a kind it was not given are left
/// alone. A client that retries meanwhile is told the key is in progress, then gets the
/// stored outcome.
///
/// A completer only **finishes** operations, never starts one: it has no request to start
/// one with. It takes over only a record that is still there when its turn comes (read,
/// then taken over by a compare-and-swap on the token read, never claimed afresh) and whose
/// recovery point is past the first phase. An operation not past its first phase, or whose
/// record expired or was purged after the round listed it (a backlog, a short retention),
/// is skipped and counted ([`CompleterRound::skipped`]): a request with its key starts it.
///
/// An operation whose phase fails with an error recorded as a retryable failure is taken
/// up again once that failure is [`Completer::retry_failed_after`] old, and given up once
/// its record has been claimed [`Completer::max_attempts`] times (by clients and completers
/// together): it then stays as it is (Failed, or Pending with its lease passed), for a
/// client's retry to resume, until it expires; after that a request with its key is a new
/// operation. A completer never retries a failing operation in a tight loop or forever.
/// A row the store cannot read is logged and counted in the round's errors, and does not
/// take the place of another in the next round's batch.
pub struct Completer<S: RecoveryPoints, M = ReleaseErrors> {
    engine: Idempotency<dyn IdempotencyStore, M>,
    store: Arc<S>,
    operations: HashMap<String, Finish<S, M>>,
    batch: usize,
    concurrency: usize,
    max_attempts: u32,
    retry_failed_after: Duration,
    stats: Arc<CompleterStats>,
    /// Unreadable rows the last round listed.
    unreadable: AtomicUsize,
}

/// At most this many unreadable rows are listed beyond a round's batch.
const MAX_UNREADABLE_SKIPPED: usize = 10_000;

impl<S: RecoveryPoints, M> fmt::Debug for Completer<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut kinds: Vec<_> = self.operations.keys().collect();
        kinds.sort();
        f.debug_struct("Completer")
            .field("operations", &kinds)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl<S: RecoveryPoints + 'static, M: ErrorMode> Completer<S, M> {
    /// A completer over `engine`'s store, taking operations over with `engine` (its policy's
    /// lease and heartbeat apply to the completer's runs, and its error mode to how a phase
    /// that fails is settled: build it from an engine of the mode your requests run the
    /// operation with). Rounds list up to 100 operations and run up to 4 at once; a failed
    /// operation is taken up again after 10 seconds, and given up after 10 attempts.
    pub fn new(engine: &Idempotency<S, M>) -> Self {
        Self {
            engine: engine.erased(),
            store: engine.store().clone(),
            operations: HashMap::new(),
            batch: 100,
            concurrency: 4,
            max_attempts: 10,
            retry_failed_after: Duration::from_secs(10),
            stats: Arc::default(),
            unreadable: AtomicUsize::new(0),
        }
    }

    /// Operations whose record has been claimed this many times (its first claim and every
    /// takeover, by clients and completers) are no longer taken up. At least 2: every record
    /// was claimed once, so 1 would take nothing up.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(2);
        self
    }

    /// How long after its failure was recorded a failed operation is taken up again.
    pub fn retry_failed_after(mut self, after: Duration) -> Self {
        self.retry_failed_after = after;
        self
    }

    /// How many abandoned operations one round lists, at most (at least 1).
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How many operations run at once, at most (at least 1).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// Registers the kind of operation named `name`: `phases` builds its phases (named
    /// `name` too, as [`Phases::new`] was given), the same the request handlers run.
    pub fn operation<T, E, F>(mut self, name: impl Into<String>, phases: F) -> Self
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        M: ErrorOutcomes<E>,
        F: Fn() -> Phases<S, T, E> + Send + Sync + 'static,
    {
        let phases = Arc::new(phases);
        let finish: Finish<S, M> = Arc::new(move |engine, store, abandoned| {
            let phases = phases.clone();
            async move {
                let Abandoned {
                    id, fingerprint, ..
                } = abandoned;
                let ran = engine
                    .resume_phases(&*store, &id, &fingerprint, phases())
                    .await;
                match ran {
                    Ok(Resumed::NotStarted) => Finished::Skipped,
                    Ok(Resumed::TakenElsewhere) => Finished::TakenElsewhere,
                    Ok(Resumed::Ran(ran)) => match ran {
                        Answer::Executed(Ok(_)) => Finished::Completed,
                        // Stored (the engine stores errors) or recorded as a failure: a recorded
                        // one is listed again.
                        Answer::Executed(Err(_)) if M::STORES_ERRORS => Finished::Completed,
                        Answer::Executed(Err(_)) => Finished::Failed,
                        Answer::Replayed(_) | Answer::Refused(_) => Finished::TakenElsewhere,
                    },
                    Err(Error::LeaseLost { .. }) => Finished::TakenElsewhere,
                    Err(_) => Finished::Error,
                }
            }
            .boxed()
        });
        self.operations.insert(name.into(), finish);
        self
    }

    /// Totals over the completer's life.
    pub fn stats(&self) -> Arc<CompleterStats> {
        self.stats.clone()
    }

    /// One round: lists the abandoned operations and runs each of a registered kind to its
    /// end. `Err` only when the store could not list them.
    pub async fn run_once(&self) -> Result<CompleterRound, Error> {
        let mut names: Vec<&String> = self.operations.keys().collect();
        names.sort();
        // Unreadable rows are never rewritten, so they stay first in the listing: ask for as
        // many more as the last round found, so that they never fill a batch.
        let unreadable = self.unreadable.load(Ordering::Relaxed);
        let query = AbandonedQuery::new(
            names.into_iter().cloned(),
            self.batch.saturating_add(unreadable),
        )
        .max_attempts(self.max_attempts)
        .failed_for(self.retry_failed_after);
        let listed = match self.store.abandoned(&query).await {
            Ok(listed) => listed,
            Err(e) => {
                self.stats.listing_failed(&e);
                return Err(e);
            }
        };
        let mut round = CompleterRound {
            found: listed.len(),
            ..CompleterRound::default()
        };
        let mut unreadable_now = 0;
        let runs: Vec<_> = listed
            .into_iter()
            .filter_map(|abandoned| {
                // A row the store could not read: reported, and the others run.
                let abandoned = abandoned
                    .map_err(|e| {
                        tracing::warn!(error = %e, "the completer skips an unreadable record");
                        round.errors += 1;
                        unreadable_now += 1;
                    })
                    .ok()?;
                match self.operations.get(&abandoned.operation) {
                    // Not past its first phase: nothing to finish, and no request to start
                    // it with. Left untouched for its client.
                    Some(_) if abandoned.phase == 0 => {
                        round.skipped += 1;
                        None
                    }
                    // A phase that panics ends this operation's run, not the completer.
                    Some(finish) => Some(
                        std::panic::AssertUnwindSafe(finish(
                            self.engine.clone(),
                            self.store.clone(),
                            abandoned,
                        ))
                        .catch_unwind()
                        .map(|ended| ended.unwrap_or(Finished::Error)),
                    ),
                    None => {
                        round.unknown += 1;
                        None
                    }
                }
            })
            .collect();
        self.unreadable.store(
            unreadable_now.min(MAX_UNREADABLE_SKIPPED),
            Ordering::Relaxed,
        );
        let mut ends = futures::stream::iter(runs).buffer_unordered(self.concurrency);
        while let Some(end) = ends.next().await {
            match end {
                Finished::Completed => round.completed += 1,
                Finished::Failed => round.failed += 1,
                Finished::TakenElsewhere => round.taken_elsewhere += 1,
                Finished::Skipped => round.skipped += 1,
                Finished::Error => round.errors += 1,
            }
        }
        self.stats.add(&round);
        Ok(round)
    }

    /// Runs a round every `every` until `shutdown` resolves. Shutdown is clean: it stops
    /// between rounds, never in the middle of an operation (a round ends when its runs do,
    /// each bounded by the engine's maximum work time). A round whose listing failed is
    /// counted in [`CompleterStats::errors`] and the next one runs as usual.
    pub async fn run(&self, every: Duration, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown.fuse());
        loop {
            // A failed listing is counted by `run_once`; the next round runs as usual.
            let _ = self.run_once().await;
            futures::select! {
                () = shutdown => return,
                () = tokio::time::sleep(every).fuse() => {}
            }
        }
    }
}
