//! The engine's policy.

use crate::{DecisionOptions, Error};
use std::time::Duration;

/// What a request does while another attempt holds a live lease on its key.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum InFlight {
    /// Refuse at once with [`Refusal::InProgress`](crate::Refusal::InProgress) and a retry-after (the default; HTTP 409).
    #[default]
    Reject,
    /// Poll with exponential backoff until the other attempt settles, then replay its outcome
    /// (or take the key over if it failed); give up with [`Refusal::InProgress`](crate::Refusal::InProgress) after
    /// `max_wait`.
    Wait {
        /// The longest the caller is kept waiting.
        max_wait: Duration,
        /// The first pause between polls; it doubles up to `max_backoff`.
        initial_backoff: Duration,
        /// The longest pause between polls.
        max_backoff: Duration,
    },
}

impl InFlight {
    /// Wait up to `max_wait`, polling from 10 ms up to 500 ms apart.
    pub fn wait(max_wait: Duration) -> Self {
        Self::Wait {
            max_wait,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(500),
        }
    }
}

/// How a holder retries a store write that settles its lease ([`crate::Lease::complete`],
/// [`crate::Lease::fail`]) when the store answers an error.
///
/// Both writes are compare-and-swaps on the holder's fencing token, so trying again is safe:
/// a write that was applied although its answer was lost is recognised on the next attempt.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct SettleRetry {
    /// How many times the write is tried in all (at least 1).
    pub attempts: u32,
    /// The pause after the first failed try; it doubles up to `max_backoff`.
    pub initial_backoff: Duration,
    /// The longest pause between tries.
    pub max_backoff: Duration,
}

impl SettleRetry {
    /// `attempts` tries in all, `initial_backoff` after the first failed one, doubling up to
    /// `max_backoff`.
    pub fn new(attempts: u32, initial_backoff: Duration, max_backoff: Duration) -> Self {
        Self {
            attempts,
            initial_backoff,
            max_backoff,
        }
    }
}

impl Default for SettleRetry {
    /// 5 tries, 25 ms apart at first, doubling up to 400 ms: pauses of 25, 50, 100 and 200 ms,
    /// 375 ms of waiting in all (plus the tries themselves).
    fn default() -> Self {
        Self {
            attempts: 5,
            initial_backoff: Duration::from_millis(25),
            max_backoff: Duration::from_millis(400),
        }
    }
}

/// How the engine treats a key: lease, retention, what is stored, in-flight behaviour and the
/// lease heartbeat.
///
/// ```
/// use idempotency_core::{InFlight, Policy};
/// use std::time::Duration;
///
/// let policy = Policy::default()
///     .lease(Duration::from_secs(10))
///     .retention(Duration::from_secs(24 * 3600))
///     .in_flight(InFlight::wait(Duration::from_secs(5)))
///     .heartbeat(Some(0.3));
/// assert!(policy.validate().is_ok());
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Policy {
    /// How long a holder may run before another caller may take the key over. Default 30 s.
    pub lease: Duration,
    /// Retention: how long a settled record is kept (and replayed). Default 24 h.
    pub retention: Duration,
    /// Whether a Failed record may be reclaimed by a request with a different fingerprint.
    /// Default `true`: a failed work took no effect, so a corrected retry may run. Never the
    /// failure that stands in for a work's lost outcome ([`crate::Failure::outcome_not_stored`]):
    /// that work ran, and another payload is a mismatch.
    pub reclaim_failed_with_different_fingerprint: bool,
    /// What a duplicate does while the first attempt runs. Default: reject.
    pub in_flight: InFlight,
    /// Extend the lease every `fraction × lease` while the work runs; `None` turns the
    /// heartbeat off. Default `Some(1/3)`.
    pub heartbeat: Option<f64>,
    /// The longest a work is kept leased by the heartbeat, counted from the claim. After it
    /// the heartbeat stops, so a work (or HTTP handler) that hangs holds its key for at most
    /// `max_work_time + lease`; then a retry may take the key over, and the hung holder's
    /// completion is fenced. Default 10 minutes.
    pub max_work_time: Duration,
    /// How a failed completion or failure write is retried. Default: [`SettleRetry::default`].
    pub settle_retry: SettleRetry,
    /// Log keys as a short SHA-256 prefix instead of in clear. Default `false`.
    pub hash_keys_in_logs: bool,
    /// Count every replay and duplicate in the record's `hits`. Default `false`.
    ///
    /// Off, a replay is a pure read, the cheapest operation each store has, and `hits` stays
    /// inexact (0, but for a claim that raced with the record's own). On, each replay is
    /// also a small write: a new row version and a WAL record on Postgres, a write
    /// transaction (and the database's write lock) on SQLite, an 8-byte write on Redis. The
    /// default is off because nothing in the library reads the count (replays, conflicts
    /// and reclaims decide the same either way) while counting cost SQLite more than half
    /// its replay throughput (three quarters at 16 clients) and Postgres a quarter to a
    /// third (the workspace's BENCHMARKS.md has the figures). Turn it on when you watch
    /// `hits` for duplicate traffic.
    pub count_hits: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            reclaim_failed_with_different_fingerprint: true,
            in_flight: InFlight::default(),
            heartbeat: Some(1.0 / 3.0),
            max_work_time: Duration::from_secs(600),
            settle_retry: SettleRetry::default(),
            hash_keys_in_logs: false,
            count_hits: false,
        }
    }
}

impl Policy {
    /// Sets the lease length.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }
    /// Sets the retention of settled records.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }
    /// Sets whether a Failed record may be reclaimed with a different fingerprint.
    pub fn reclaim_failed_with_different_fingerprint(mut self, allow: bool) -> Self {
        self.reclaim_failed_with_different_fingerprint = allow;
        self
    }
    /// Sets the in-flight behaviour.
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }
    /// Sets the heartbeat fraction (`None` turns it off).
    pub fn heartbeat(mut self, fraction: Option<f64>) -> Self {
        self.heartbeat = fraction;
        self
    }
    /// Sets the longest time the heartbeat keeps a work leased.
    pub fn max_work_time(mut self, max: Duration) -> Self {
        self.max_work_time = max;
        self
    }
    /// Sets how failed completions are retried.
    pub fn settle_retry(mut self, retry: SettleRetry) -> Self {
        self.settle_retry = retry;
        self
    }
    /// Sets whether replays and duplicates are counted in the record's `hits`.
    pub fn count_hits(mut self, count: bool) -> Self {
        self.count_hits = count;
        self
    }
    /// Sets whether keys are hashed in logs.
    pub fn hash_keys_in_logs(mut self, hash: bool) -> Self {
        self.hash_keys_in_logs = hash;
        self
    }

    /// Checks the policy: a non-zero lease, retention and maximum work time, a heartbeat fraction in
    /// (0, 1), non-zero backoffs, and at least one settle attempt.
    pub fn validate(&self) -> Result<(), Error> {
        if self.max_work_time.is_zero() {
            return Err(Error::Config(
                "max_work_time must be greater than zero".into(),
            ));
        }
        let retry = self.settle_retry;
        if retry.attempts == 0
            || retry.initial_backoff.is_zero()
            || retry.max_backoff < retry.initial_backoff
        {
            return Err(Error::Config(
                "settle_retry needs attempts >= 1, a non-zero backoff and max_backoff >= initial_backoff"
                    .into(),
            ));
        }
        if self.lease.is_zero() {
            return Err(Error::Config("lease must be greater than zero".into()));
        }
        if self.retention.is_zero() {
            return Err(Error::Config("retention must be greater than zero".into()));
        }
        if let Some(f) = self.heartbeat {
            if !(f > 0.0 && f < 1.0) {
                return Err(Error::Config(format!(
                    "heartbeat fraction must be in (0, 1), got {f}"
                )));
            }
        }
        if let InFlight::Wait {
            initial_backoff,
            max_backoff,
            ..
        } = self.in_flight
        {
            if initial_backoff.is_zero() || max_backoff < initial_backoff {
                return Err(Error::Config(
                    "in-flight backoff must be non-zero and max_backoff >= initial_backoff".into(),
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn decision_options(&self) -> DecisionOptions {
        DecisionOptions {
            reclaim_failed_with_different_fingerprint: self
                .reclaim_failed_with_different_fingerprint,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(Policy::default().validate().is_ok());
        assert!(Policy::default().lease(Duration::ZERO).validate().is_err());
        assert!(Policy::default()
            .retention(Duration::ZERO)
            .validate()
            .is_err());
        assert!(Policy::default().heartbeat(Some(1.0)).validate().is_err());
        assert!(Policy::default()
            .heartbeat(Some(f64::NAN))
            .validate()
            .is_err());
        assert!(Policy::default().heartbeat(None).validate().is_ok());
        assert!(Policy::default()
            .in_flight(InFlight::Wait {
                max_wait: Duration::from_secs(1),
                initial_backoff: Duration::ZERO,
                max_backoff: Duration::ZERO
            })
            .validate()
            .is_err());
        assert!(Policy::default()
            .max_work_time(Duration::ZERO)
            .validate()
            .is_err());
        for bad in [
            SettleRetry {
                attempts: 0,
                ..SettleRetry::default()
            },
            SettleRetry {
                initial_backoff: Duration::ZERO,
                ..SettleRetry::default()
            },
            SettleRetry {
                max_backoff: Duration::from_millis(1),
                ..SettleRetry::default()
            },
        ] {
            assert!(
                Policy::default().settle_retry(bad).validate().is_err(),
                "{bad:?}"
            );
        }
        // Extreme but meaningful settings are accepted (the engine saturates, never
        // overflows).
        assert!(Policy::default()
            .max_work_time(Duration::MAX)
            .in_flight(InFlight::Wait {
                max_wait: Duration::MAX,
                initial_backoff: Duration::MAX,
                max_backoff: Duration::MAX,
            })
            .validate()
            .is_ok());
    }
}
