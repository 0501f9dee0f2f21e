//! Time as the store sees it: millisecond timestamps and injectable clocks.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, on the store's clock.
///
/// Leases and expiry are decided by the store's clock (Postgres `now()`, Redis `TIME`, the
/// process clock for the memory and SQLite stores), so every timestamp in a [`crate::Record`]
/// and every `now` handed to [`crate::store::decide`] comes from the same clock.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(i64);

impl Timestamp {
    /// From milliseconds since the Unix epoch.
    pub const fn from_millis(ms: i64) -> Self {
        Self(ms)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// The process clock, now.
    pub fn now() -> Self {
        // Whole seconds and milliseconds in u64 arithmetic: `as_millis` would divide a u128.
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| {
                let ms = d
                    .as_secs()
                    .saturating_mul(1000)
                    .saturating_add(u64::from(d.subsec_millis()));
                i64::try_from(ms).unwrap_or(i64::MAX)
            })
            .unwrap_or(0);
        Self(ms)
    }

    /// This instant plus a duration, saturating; `d` is capped at [`MAX_DURATION`] first.
    pub fn saturating_add(self, d: Duration) -> Self {
        Self(self.0.saturating_add(duration_millis(d)))
    }

    /// How long from `earlier` to `self`; zero when `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }
}

/// The longest lease or retention any store keeps: 100 years (of 366 days). Longer durations
/// are capped to it, so `Duration::MAX` means "for ever" in effect without overflowing any
/// store's range (PostgreSQL's timestamps, the exact integers of Redis's Lua).
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 366 * 24 * 3600);

/// A duration in whole milliseconds, capped at [`MAX_DURATION`] and rounded up so a non-zero
/// duration never becomes zero. Every store converts durations with it.
pub fn duration_millis(d: Duration) -> i64 {
    // u64 arithmetic (`as_nanos` is a u128): MAX_DURATION in milliseconds fits easily.
    let d = d.min(MAX_DURATION);
    let ms = d.as_secs() * 1000 + u64::from(d.subsec_nanos()).div_ceil(1_000_000);
    i64::try_from(ms).unwrap_or(i64::MAX)
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Timestamp({}ms)", self.0)
    }
}

/// A source of the current time for stores that use the process clock.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;

    /// A reading of a monotonic clock: how long since some fixed moment of this process.
    /// Only differences between two readings mean anything. Unlike [`Clock::now`], it never
    /// steps when the wall clock is set (an NTP step, an operator), so a deadline measured on
    /// it lasts exactly as long as it says.
    ///
    /// The default reads [`std::time::Instant`]; a test clock overrides it, so that its time
    /// passes for both readings.
    fn monotonic(&self) -> Duration {
        process_instant()
    }
}

/// [`std::time::Instant`] now, as the time since the first call in this process.
fn process_instant() -> Duration {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed()
}

/// The system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that only moves when told to, for tests. Clones share the same time.
///
/// [`ManualClock::advance`] moves both its wall reading ([`Clock::now`]) and its monotonic one
/// ([`Clock::monotonic`]); [`ManualClock::set`] moves the wall reading only, as a wall clock
/// set by NTP or an operator does.
///
/// ```
/// use idempotency_core::store::{Clock, ManualClock};
/// use std::time::Duration;
///
/// let clock = ManualClock::new();
/// let t0 = clock.now();
/// clock.advance(Duration::from_secs(5));
/// assert_eq!(clock.now().as_millis() - t0.as_millis(), 5_000);
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock {
    wall: Arc<AtomicI64>,
    /// Milliseconds the clock was advanced by, in all: its monotonic reading.
    monotonic: Arc<AtomicI64>,
}

impl ManualClock {
    /// A manual clock starting at the current system time.
    pub fn new() -> Self {
        Self::starting_at(Timestamp::now())
    }

    /// A manual clock starting at `t`.
    pub fn starting_at(t: Timestamp) -> Self {
        Self {
            wall: Arc::new(AtomicI64::new(t.as_millis())),
            monotonic: Arc::new(AtomicI64::new(0)),
        }
    }

    /// Moves the clock forward: its wall and its monotonic readings.
    pub fn advance(&self, d: Duration) {
        let ms = duration_millis(d);
        self.wall.fetch_add(ms, Ordering::SeqCst);
        self.monotonic.fetch_add(ms, Ordering::SeqCst);
    }

    /// Sets the wall reading, forward or back, as a wall clock is set; the monotonic reading
    /// does not move.
    pub fn set(&self, t: Timestamp) {
        self.wall.store(t.as_millis(), Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.wall.load(Ordering::SeqCst))
    }

    fn monotonic(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.monotonic.load(Ordering::SeqCst)).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic() {
        let t = Timestamp::from_millis(1_000);
        assert_eq!(
            t.saturating_add(Duration::from_micros(1)).as_millis(),
            1_001
        );
        assert_eq!(t.saturating_add(Duration::from_secs(2)).as_millis(), 3_000);
        assert_eq!(
            Timestamp::from_millis(3_000).saturating_duration_since(t),
            Duration::from_secs(2)
        );
        assert_eq!(
            t.saturating_duration_since(Timestamp::from_millis(5_000)),
            Duration::ZERO
        );
        assert_eq!(
            Timestamp::from_millis(i64::MAX)
                .saturating_add(Duration::MAX)
                .as_millis(),
            i64::MAX
        );
    }
}
