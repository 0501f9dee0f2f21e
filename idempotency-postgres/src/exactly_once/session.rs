//! How `PostgresIdempotency`'s transactions begin on a live connection and keep their lease:
//! the isolation level learned once, the lease kept in the process while the record row is
//! locked, and the driver errors the transaction loop acts on.

use super::PostgresIdempotency;
use crate::error::{map_sqlx, Effect};
use crate::store::Level;
use idempotency_core::{Error, Policy};
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

impl PostgresIdempotency {
    /// How many lost connections in a row a transaction's start gets past: one more than the
    /// pool holds, so that after a restart it reaches a live connection past all the dead
    /// idle ones.
    pub(super) fn max_lost(&self) -> u32 {
        self.store
            .pool()
            .options()
            .get_max_connections()
            .saturating_add(1)
    }

    /// Begins the work's transaction on a live connection. `BEGIN` runs in a task of its own
    /// (see `run_in_transaction`); a connection that turns out dead (it died idle in the
    /// pool, as every idle connection does when the server restarts) has the pool's idle
    /// connections checked, and `BEGIN` is sent on the next one, up to
    /// [`PostgresIdempotency::max_lost`] times: nothing ran on it.
    pub(super) async fn begin_transaction(
        &self,
        table: &str,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, Error> {
        let mut lost = 0;
        loop {
            match tokio::spawn(self.store.begin_transaction())
                .await
                .map_err(|e| Error::backend(true, e))?
            {
                Ok(tx) => return Ok(tx),
                Err(e) if crate::error::is_connection_loss(&e) && lost < self.max_lost() => {
                    if lost == 0 {
                        self.store.sweep_idle().await;
                    }
                    lost += 1;
                }
                Err(e) => return Err(map_sqlx(e, table, Effect::None)),
            }
        }
    }
}

/// Whether a core error wraps a lost connection from the driver.
pub(super) fn is_connection_loss(e: &Error) -> bool {
    e.find_source::<sqlx::Error>()
        .is_some_and(crate::error::is_connection_loss)
}

/// `now + d`, saturating far in the future instead of overflowing.
pub(super) fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 366 * 24 * 3600))
}

/// Runs `work` while the record row is locked, keeping the lease in the process: every
/// heartbeat interval (per [`Policy::heartbeat`]) renews it for a lease's length. Returns
/// `None`, dropping (cancelling) the work, once the lease passes without a renewal: the
/// heartbeat is off and the work outlived the lease, or the task was not polled for a whole
/// lease (the process stalled). A work that ends after its lease passed also gets `None`.
/// Renewals stop at `work_deadline` (the lease's [`idempotency_core::Lease::work_deadline`]),
/// so a hung work is cancelled then.
pub(super) async fn keep_alive<F: Future>(
    policy: &Policy,
    until: Instant,
    work_deadline: Instant,
    work: F,
) -> Option<F::Output> {
    let every = policy
        .heartbeat
        .map(|fraction| policy.lease.mul_f64(fraction).max(Duration::from_millis(1)));
    // The deadline, as microseconds after `base` (an atomic, so the future stays `Send`).
    let base = Instant::now();
    let micros = |t: Instant| u64::try_from(t.saturating_duration_since(base).as_micros());
    let deadline = AtomicU64::new(micros(until).unwrap_or(u64::MAX));
    let deadline_at = || {
        base.checked_add(Duration::from_micros(deadline.load(Ordering::Relaxed)))
            .unwrap_or_else(|| later(base, Duration::MAX))
    };
    let beat = async {
        loop {
            let next = match every {
                Some(every) => later(Instant::now(), every).min(deadline_at()),
                None => deadline_at(),
            };
            tokio::time::sleep_until(next.into()).await;
            let now = Instant::now();
            if now >= deadline_at() {
                return;
            }
            // Renewed up to the end of the maximum work time, never past it: a work that
            // hangs loses its lease then, and is cancelled and rolled back.
            if every.is_some() && now < work_deadline {
                let renewed = later(now, policy.lease).min(work_deadline);
                deadline.store(micros(renewed).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
        }
    };
    let work = std::pin::pin!(work);
    let beat = std::pin::pin!(beat);
    match futures::future::select(work, beat).await {
        futures::future::Either::Left((out, _)) => (Instant::now() < deadline_at()).then_some(out),
        futures::future::Either::Right(((), _work)) => None,
    }
}

/// What `PostgresIdempotency` knows of its sessions' isolation level, shared by its clones.
#[derive(Debug, Default)]
pub(super) struct LevelCache(AtomicU8);

impl LevelCache {
    const UNKNOWN: u8 = 0;
    const READ_COMMITTED: u8 = 1;
    const SNAPSHOT: u8 = 2;

    pub(super) fn get(&self) -> Option<Level> {
        match self.0.load(Ordering::Relaxed) {
            Self::READ_COMMITTED => Some(Level::ReadCommitted),
            Self::SNAPSHOT => Some(Level::Snapshot),
            _ => None,
        }
    }

    pub(super) fn set(&self, level: Level) {
        let v = match level {
            Level::ReadCommitted => Self::READ_COMMITTED,
            Level::Snapshot => Self::SNAPSHOT,
        };
        self.0.store(v, Ordering::Relaxed);
    }

    pub(super) fn forget(&self) {
        self.0.store(Self::UNKNOWN, Ordering::Relaxed);
    }
}

/// Whether a core error wraps a serialization failure or deadlock from the driver.
pub(super) fn is_serialization_failure(e: &Error) -> bool {
    matches!(e, Error::Backend { .. })
        && e.find_source::<sqlx::Error>()
            .is_some_and(crate::error::is_serialization_failure)
}
