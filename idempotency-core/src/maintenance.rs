//! [`Idempotency::maintain`]: the background tasks a service runs beside its engine (the
//! purge of expired keys, the completers of multi-step operations), started with one call and
//! stopped cleanly with another.

use crate::{Completer, CompleterStats, ErrorMode, Idempotency, RecoveryPoints};
use futures::future::BoxFuture;
use futures::FutureExt;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How often [`Maintain`] purges by default.
pub const DEFAULT_PURGE_EVERY: Duration = Duration::from_secs(60);
/// How many records one purge call deletes by default.
pub const DEFAULT_PURGE_BATCH: usize = 1000;

type Task = Box<dyn FnOnce(watch::Receiver<bool>) -> BoxFuture<'static, ()> + Send>;

/// The background tasks of an engine, from [`Idempotency::maintain`]: configure, then
/// [`Maintain::spawn`].
///
/// By default it purges expired keys every minute ([`DEFAULT_PURGE_EVERY`]), in batches of
/// [`DEFAULT_PURGE_BATCH`]; every store also ignores expired records on its own, so the purge
/// only gives their space back. Add a [`Completer`] for each store that keeps multi-step
/// operations.
///
/// ```
/// use idempotency_core::Idempotency;
/// use std::time::Duration;
/// # async fn example(engine: Idempotency) {
/// let maintenance = engine.maintain().purge_every(Duration::from_secs(30)).spawn();
/// // … serve requests; on shutdown:
/// maintenance.shutdown().await;
/// # }
/// ```
#[must_use = "nothing runs until `spawn` is called"]
pub struct Maintain {
    engine: Idempotency,
    purge_every: Option<Duration>,
    purge_batch: usize,
    completers: Vec<(Task, Arc<CompleterStats>)>,
}

impl fmt::Debug for Maintain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Maintain")
            .field("purge_every", &self.purge_every)
            .field("purge_batch", &self.purge_batch)
            .field("completers", &self.completers.len())
            .finish_non_exhaustive()
    }
}

impl<St: ?Sized, M> Idempotency<St, M> {
    /// The background tasks of this engine: a purge of expired keys (on by default, every
    /// minute) and the completers you add. See [`Maintain`].
    pub fn maintain(&self) -> Maintain {
        Maintain {
            // The purge settles no work: what the engine does with errors is not its concern.
            engine: self.erased().releasing_errors(),
            purge_every: Some(DEFAULT_PURGE_EVERY),
            purge_batch: DEFAULT_PURGE_BATCH,
            completers: Vec::new(),
        }
    }
}

impl Maintain {
    /// Purges expired keys every `every` (the first purge runs at once).
    pub fn purge_every(mut self, every: Duration) -> Self {
        self.purge_every = Some(every);
        self
    }

    /// Deletes at most `batch` records per store call (at least 1); a round calls again while
    /// calls come back full.
    pub fn purge_batch(mut self, batch: usize) -> Self {
        self.purge_batch = batch.max(1);
        self
    }

    /// Does not purge (another process purges the same store).
    pub fn no_purge(mut self) -> Self {
        self.purge_every = None;
        self
    }

    /// Runs `completer` every `every`, finishing the operations whose holders died. Build the
    /// completer from an engine of the same kind as the one your requests run the operation
    /// with ([`Completer::new`]): one that stores errors finishes an operation whose phase
    /// ends with an error by storing it, as the request would have.
    pub fn complete<S: RecoveryPoints + 'static, M: ErrorMode>(
        mut self,
        completer: Completer<S, M>,
        every: Duration,
    ) -> Self {
        let stats = completer.stats();
        let task: Task = Box::new(move |mut stop: watch::Receiver<bool>| {
            async move {
                completer
                    .run(every, async move {
                        let _ = stop.wait_for(|stop| *stop).await;
                    })
                    .await;
            }
            .boxed()
        });
        self.completers.push((task, stats));
        self
    }

    /// Starts the tasks on the current Tokio runtime (it panics outside one, as
    /// `tokio::spawn` does).
    pub fn spawn(self) -> Maintenance {
        let (stop, stopped) = watch::channel(false);
        let purge = Arc::new(PurgeStats::default());
        let mut tasks = Vec::new();
        if let Some(every) = self.purge_every {
            tasks.push(tokio::spawn(purge_loop(
                self.engine,
                every,
                self.purge_batch,
                purge.clone(),
                stopped.clone(),
            )));
        }
        let mut completers = Vec::new();
        for (task, stats) in self.completers {
            tasks.push(tokio::spawn(task(stopped.clone())));
            completers.push(stats);
        }
        Maintenance {
            stop,
            tasks,
            purge,
            completers,
        }
    }
}

/// What the purge task has done so far, from [`Maintenance::purge_stats`].
#[derive(Debug, Default)]
pub struct PurgeStats {
    rounds: AtomicU64,
    purged: AtomicU64,
    errors: AtomicU64,
}

impl PurgeStats {
    /// Purge rounds finished (a round calls the store until a call comes back short).
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }
    /// Records deleted.
    pub fn purged(&self) -> u64 {
        self.purged.load(Ordering::Relaxed)
    }
    /// Store calls that failed (each ends its round; the next round runs as usual).
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
}

/// The running tasks of [`Maintain::spawn`]. [`Maintenance::shutdown`] stops them and waits;
/// dropping the handle asks them to stop without waiting.
#[derive(Debug)]
#[must_use = "dropping the handle stops the tasks; keep it, and call `shutdown` when the service stops"]
pub struct Maintenance {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    purge: Arc<PurgeStats>,
    completers: Vec<Arc<CompleterStats>>,
}

impl Maintenance {
    /// The purge task's totals (all zero when purging is off).
    pub fn purge_stats(&self) -> &PurgeStats {
        &self.purge
    }

    /// Each completer's totals, in the order they were added.
    pub fn completer_stats(&self) -> &[Arc<CompleterStats>] {
        &self.completers
    }

    /// Stops every task and waits for it: the purge at once (a purge call cut short deletes
    /// nothing that is not expired), a completer
    /// between two rounds (an operation it is running is finished first). A task that
    /// panicked is reported in the log.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for task in std::mem::take(&mut self.tasks) {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "an idempotency maintenance task ended abnormally");
            }
        }
    }
}

impl Drop for Maintenance {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn purge_loop(
    engine: Idempotency,
    every: Duration,
    batch: usize,
    stats: Arc<PurgeStats>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop) => return,
            _ = tick.tick() => {}
        }
        let mut purged = 0u64;
        loop {
            // A purge deletes only expired records, so a call cut short by the shutdown
            // loses nothing: the next start purges what is left.
            let call = tokio::select! {
                biased;
                _ = stop.wait_for(|stop| *stop) => return,
                call = engine.store().purge_expired(batch) => call,
            };
            match call {
                Ok(n) => {
                    purged += n;
                    stats.purged.fetch_add(n, Ordering::Relaxed);
                    if n < batch as u64 {
                        break;
                    }
                }
                Err(e) => {
                    stats.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "purging expired idempotency keys failed; trying again next round");
                    break;
                }
            }
        }
        stats.rounds.fetch_add(1, Ordering::Relaxed);
        if purged > 0 {
            tracing::info!(purged, "purged expired idempotency keys");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        Cas, Claim, ClaimRequest, Error, Failure, FencingToken, Fingerprint, IdempotencyStore,
        Reclaim, Record, RecordId,
    };
    use async_trait::async_trait;
    use std::collections::VecDeque;
    use std::sync::Mutex;
    use std::time::Instant;

    /// Only purges: answers from a script, then `Ok(0)`; a `None` in the script is a call
    /// that never returns. Records each call's batch.
    #[derive(Debug, Default)]
    struct Purges {
        script: Mutex<VecDeque<Option<Result<u64, Error>>>>,
        calls: Mutex<Vec<usize>>,
    }

    impl Purges {
        fn new(script: impl IntoIterator<Item = Option<Result<u64, Error>>>) -> Arc<Self> {
            Arc::new(Self {
                script: Mutex::new(script.into_iter().collect()),
                calls: Mutex::default(),
            })
        }
        fn calls(&self) -> Vec<usize> {
            self.calls.lock().unwrap().clone()
        }
    }

    fn nothing_else() -> Error {
        Error::backend(false, "this store only purges")
    }

    #[async_trait]
    impl IdempotencyStore for Purges {
        async fn claim(&self, _: &ClaimRequest) -> Result<Claim, Error> {
            Err(nothing_else())
        }
        async fn complete(
            &self,
            _: &RecordId,
            _: FencingToken,
            _: &[u8],
            _: Duration,
        ) -> Result<Cas, Error> {
            Err(nothing_else())
        }
        async fn fail(
            &self,
            _: &RecordId,
            _: FencingToken,
            _: &Failure,
            _: Duration,
        ) -> Result<Cas, Error> {
            Err(nothing_else())
        }
        async fn extend(&self, _: &RecordId, _: FencingToken, _: Duration) -> Result<Cas, Error> {
            Err(nothing_else())
        }
        async fn reclaim(
            &self,
            _: &RecordId,
            _: FencingToken,
            _: &Fingerprint,
            _: Duration,
            _: Duration,
        ) -> Result<Reclaim, Error> {
            Err(nothing_else())
        }
        async fn get(&self, _: &RecordId) -> Result<Option<Record>, Error> {
            Err(nothing_else())
        }
        async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
            self.calls.lock().unwrap().push(batch);
            let next = self.script.lock().unwrap().pop_front();
            match next {
                Some(Some(answer)) => answer,
                Some(None) => futures::future::pending().await,
                None => Ok(0),
            }
        }
    }

    fn engine(store: &Arc<Purges>) -> Idempotency {
        Idempotency::builder(store.clone()).build().unwrap().into()
    }

    /// Polls `done` until it holds, for at most a minute.
    async fn until(what: &str, done: impl Fn() -> bool) {
        let started = Instant::now();
        while !done() {
            assert!(started.elapsed() < Duration::from_secs(60), "never: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn a_round_calls_again_while_calls_come_back_full() {
        let store = Purges::new([Some(Ok(10)), Some(Ok(10)), Some(Ok(3))]);
        let running = engine(&store)
            .maintain()
            .purge_every(Duration::from_secs(3600))
            .purge_batch(10)
            .spawn();
        until("a first round", || running.purge_stats().rounds() == 1).await;
        assert_eq!(running.purge_stats().purged(), 23);
        assert_eq!(store.calls(), vec![10, 10, 10], "stops at the short call");
        running.shutdown().await;
        assert_eq!(store.calls().len(), 3, "no round before the next tick");
    }

    #[tokio::test]
    async fn a_failed_call_ends_its_round_and_the_next_round_runs() {
        let store = Purges::new([Some(Err(Error::backend(true, "down"))), Some(Ok(2))]);
        let running = engine(&store)
            .maintain()
            .purge_every(Duration::from_millis(10))
            .spawn();
        until("two rounds", || running.purge_stats().rounds() >= 2).await;
        let stats = running.purge_stats();
        assert_eq!((stats.errors(), stats.purged()), (1, 2));
        running.shutdown().await;
    }

    #[tokio::test]
    async fn shutdown_cuts_a_purge_call_short_and_returns() {
        let store = Purges::new([None]);
        let running = engine(&store).maintain().spawn();
        until("the hanging call", || store.calls().len() == 1).await;
        tokio::time::timeout(Duration::from_secs(60), running.shutdown())
            .await
            .expect("shutdown waited for a call that never returns");
        assert_eq!(store.calls().len(), 1);
    }

    #[tokio::test]
    async fn without_purge_nothing_is_called() {
        let store = Purges::new([]);
        let running = engine(&store).maintain().no_purge().spawn();
        tokio::time::sleep(Duration::from_millis(50)).await;
        running.shutdown().await;
        assert!(store.calls().is_empty());
    }

    #[tokio::test]
    async fn dropping_the_handle_stops_the_tasks() {
        let store = Purges::new([]);
        let running = engine(&store)
            .maintain()
            .purge_every(Duration::from_millis(5))
            .spawn();
        until("a first call", || !store.calls().is_empty()).await;
        drop(running);
        // The task sees the stop at its next wait; give it time to, then nothing more runs.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let calls = store.calls().len();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            store.calls().len(),
            calls,
            "purged after the handle was dropped"
        );
    }
}
