//! What a factory hands each case, and how time is moved.

use idempotency_core::{IdempotencyStore, ManualClock};
use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Optional behaviours a store may or may not have; cases that need one check it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// `purge_expired` deletes expired records and reports how many, and until then the
    /// store keeps them (so a claim that replaces one gets a higher token). Stores whose
    /// records expire by themselves (Redis TTLs) set this to `false`: the purge case then only
    /// checks that nothing live is removed and expired records read as absent, and a claim
    /// after expiry may start the key's token again at 1 (the record is gone).
    pub purge_reports_deletions: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            purge_reports_deletions: true,
        }
    }
}

impl Capabilities {
    /// Sets [`Capabilities::purge_reports_deletions`].
    pub fn purge_reports_deletions(mut self, yes: bool) -> Self {
        self.purge_reports_deletions = yes;
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
    guard: Option<Box<dyn Any + Send + Sync>>,
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
            guard: None,
        }
    }

    /// A store that reads `clock`.
    pub fn manual_time(store: Arc<dyn IdempotencyStore>, clock: ManualClock) -> Self {
        Self {
            store,
            time: TimeControl::Manual(clock),
            capabilities: Capabilities::default(),
            guard: None,
        }
    }

    /// Keeps `guard` alive as long as the case runs; its `Drop` cleans up.
    pub fn with_guard(mut self, guard: impl Any + Send + Sync) -> Self {
        self.guard = Some(Box::new(guard));
        self
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
    /// instantly), 400 ms on a real one.
    pub fn short_lease(&self) -> Duration {
        match self.time {
            TimeControl::Manual(_) => Duration::from_secs(30),
            TimeControl::Real => Duration::from_millis(400),
        }
    }

    /// A retention short enough for TTL cases: 60 s manual, 800 ms real.
    pub fn short_ttl(&self) -> Duration {
        match self.time {
            TimeControl::Manual(_) => Duration::from_secs(60),
            TimeControl::Real => Duration::from_millis(800),
        }
    }

    /// A lease or retention no case outlives: one hour.
    pub fn long(&self) -> Duration {
        Duration::from_secs(3600)
    }
}

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
        let store = factory().await;
        case(store).await;
    });
}
