//! What a factory hands each case, and how time is moved.

use futures::future::BoxFuture;
use idempotency_core::store::{Clock, ManualClock, Timestamp};
use idempotency_core::IdempotencyStore;
use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Reads the store's own clock from outside the store (for example `SELECT now()` on the
/// server, or Redis `TIME`), for cases that check the store uses that clock.
pub type ServerClock = Arc<dyn Fn() -> BoxFuture<'static, Timestamp> + Send + Sync>;

/// A [`ServerClock`] that reads the process clock, for real-time stores that use it (an
/// in-process store on the system clock, SQLite on its default clock).
pub fn process_clock() -> ServerClock {
    Arc::new(|| Box::pin(async { Timestamp::now() }))
}

/// Optional behaviours a store may or may not have. A case that needs one is registered by
/// [`crate::conformance_tests!`] only when the store declares it, and shows as ignored (not
/// run) under its own name otherwise; it never passes a weaker version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// `purge_expired` deletes expired records and reports how many. Stores whose records
    /// expire by themselves (Redis TTLs) set this to `false`, and the case that counts
    /// deletions (`purge_counts_deletions_in_batches`) is not run; every other case, including
    /// the ones that race purges with claims and that check tokens keep growing after a
    /// record is gone, runs on every store.
    pub purge_reports_deletions: bool,
    /// The largest outcome a record can hold, for stores with an item size limit
    /// (DynamoDB: 400 KB per item). `None` (the default): outcomes of at least 1 MiB. The
    /// cases store outcomes up to this size; a store with a limit tests its own refusal of
    /// larger ones.
    pub max_outcome_bytes: Option<usize>,
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            purge_reports_deletions: true,
            max_outcome_bytes: None,
        }
    }
}

impl Capabilities {
    /// Sets [`Capabilities::purge_reports_deletions`].
    pub fn purge_reports_deletions(mut self, yes: bool) -> Self {
        self.purge_reports_deletions = yes;
        self
    }

    /// Sets [`Capabilities::max_outcome_bytes`].
    pub fn max_outcome_bytes(mut self, bytes: usize) -> Self {
        self.max_outcome_bytes = Some(bytes);
        self
    }
}

/// How the store's clock is moved forward in a case.
#[derive(Clone, Debug)]
pub enum TimeControl {
    /// The store reads this clock; advancing it is instant.
    Manual(ManualClock),
    /// The store reads a real clock (a server's): advancing sleeps.
    Real,
}

/// One isolated store for one case, with a guard that cleans up when dropped (drops a schema,
/// deletes a key prefix, removes a temp file…).
pub struct TestStore {
    /// The store under test.
    pub store: Arc<dyn IdempotencyStore>,
    /// How to move its clock.
    pub time: TimeControl,
    /// What optional behaviour it has.
    pub capabilities: Capabilities,
    server_clock: Option<ServerClock>,
    guard: Option<Box<dyn Any + Send + Sync>>,
    /// On a real clock, the short lease: see [`TestStore::calibrate`].
    real_lease: Duration,
}

impl fmt::Debug for TestStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestStore")
            .field("store", &self.store)
            .field("time", &self.time)
            .field("capabilities", &self.capabilities)
            .finish_non_exhaustive()
    }
}

impl TestStore {
    /// A store whose clock the kit cannot move (a server's clock): time passes by sleeping.
    pub fn real_time(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            store,
            time: TimeControl::Real,
            capabilities: Capabilities::default(),
            server_clock: None,
            guard: None,
            real_lease: REAL_SHORT_LEASE,
        }
    }

    /// A store that reads `clock`.
    pub fn manual_time(store: Arc<dyn IdempotencyStore>, clock: ManualClock) -> Self {
        Self {
            store,
            time: TimeControl::Manual(clock),
            capabilities: Capabilities::default(),
            server_clock: None,
            guard: None,
            real_lease: REAL_SHORT_LEASE,
        }
    }

    /// Keeps `guard` alive as long as the case runs; its `Drop` cleans up.
    pub fn with_guard(mut self, guard: impl Any + Send + Sync) -> Self {
        self.guard = Some(Box::new(guard));
        self
    }

    /// Gives the kit a way to read the store's clock from outside the store. A manual-time
    /// store's clock is its [`ManualClock`], read without this; a real-time store needs it for
    /// `deadlines_follow_the_store_clock` (declare `server_clock = false` in
    /// [`crate::conformance_tests!`] otherwise).
    pub fn with_server_clock(mut self, read: ServerClock) -> Self {
        self.server_clock = Some(read);
        self
    }

    /// Reads the store's clock: the manual clock, or the reader given to
    /// [`TestStore::with_server_clock`]. `None` for a real-time store without one.
    pub async fn server_now(&self) -> Option<Timestamp> {
        if let Some(read) = &self.server_clock {
            return Some(read().await);
        }
        match &self.time {
            TimeControl::Manual(clock) => Some(clock.now()),
            TimeControl::Real => None,
        }
    }

    /// Sets the capabilities.
    pub fn with_capabilities(mut self, capabilities: Capabilities) -> Self {
        self.capabilities = capabilities;
        self
    }

    /// Moves the store's clock forward by `d` (sleeps for real-time stores, plus a small
    /// margin for clock granularity).
    pub async fn advance(&self, d: Duration) {
        match &self.time {
            TimeControl::Manual(clock) => clock.advance(d),
            TimeControl::Real => tokio::time::sleep(d + Duration::from_millis(20)).await,
        }
    }

    /// A lease short enough for cases to wait out: 30 s on a manual clock (advanced
    /// instantly); on a real one 400 ms, or longer on a slow store (see
    /// [`TestStore::calibrate`]).
    pub fn short_lease(&self) -> Duration {
        match self.time {
            TimeControl::Manual(_) => Duration::from_secs(30),
            TimeControl::Real => self.real_lease,
        }
    }

    /// A retention short enough for TTL cases: 60 s manual, twice the short lease real.
    pub fn short_ttl(&self) -> Duration {
        match self.time {
            TimeControl::Manual(_) => Duration::from_secs(60),
            TimeControl::Real => self.real_lease * 2,
        }
    }

    /// On a real clock, fits the short lease and retention to how fast the store answers
    /// now: cases that must do a few operations within a short lease or before a record
    /// expires would otherwise fail on a loaded machine, where a round trip can take tens of
    /// milliseconds. The lease is [`REAL_SHORT_LEASE`] or 40 times the slowest of a few
    /// reads, whichever is longer (at most 10 s). [`run_case`] calls it before every case.
    pub async fn calibrate(mut self) -> Self {
        if matches!(self.time, TimeControl::Real) {
            let probe = idempotency_core::RecordId::new(
                idempotency_core::IdempotencyKey::random(),
                idempotency_core::Scope::new("kit-calibration").expect("scope"),
            );
            let mut slowest = Duration::ZERO;
            for _ in 0..5 {
                let started = std::time::Instant::now();
                let _ = self.store.get(&probe).await;
                slowest = slowest.max(started.elapsed());
            }
            self.real_lease = (slowest * 40).clamp(REAL_SHORT_LEASE, Duration::from_secs(10));
        }
        self
    }

    /// A lease or retention no case outlives: one hour.
    pub fn long(&self) -> Duration {
        Duration::from_secs(3600)
    }
}

/// The short lease on a real clock when the store answers fast.
pub const REAL_SHORT_LEASE: Duration = Duration::from_millis(400);

/// Runs one case on a fresh multi-threaded runtime, the way the [`crate::conformance_tests`]
/// macro does. Public so that hand-written tests can do the same.
pub fn run_case<F, Fut, C, CFut>(factory: F, case: C)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = TestStore>,
    C: FnOnce(TestStore) -> CFut,
    CFut: std::future::Future<Output = ()>,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("the conformance kit needs a tokio runtime");
    rt.block_on(async move {
        let store = factory().await.calibrate().await;
        case(store).await;
    });
}
