//! When an attempt is retried, and how long the middleware waits before it.

use http::{HeaderMap, StatusCode};
use retry_policies::policies::ExponentialBackoff;
use retry_policies::{Jitter, RetryDecision, RetryPolicy as _};
use std::time::{Duration, SystemTime};

/// How an idempotent operation is retried: how many attempts, how long between them, and
/// until when.
///
/// What is retried is fixed, because only these answers are safe to send again under the same
/// key and may get another answer: connection errors, timeouts, and answers the server did
/// not replay that are `408`, `425`, `429`, a `5xx`, or its `409` saying another attempt holds
/// the key. That `409` is the server's in-progress refusal: a problem document whose `type`
/// ends in `idempotency-key-in-progress` (whatever the base before it), or in
/// `idempotency-key-lease-lost` (another request took the key over), or with the code
/// `IDEMPOTENCY_KEY_IN_PROGRESS` or `IDEMPOTENCY_KEY_LEASE_LOST`; failing a readable problem
/// type, a `409` with a `Retry-After`. Only the first few KiB of a `409`'s body are read to
/// tell ([`MAX_CONFLICT_BODY`](Self::MAX_CONFLICT_BODY)): a larger one is not the refusal.
///
/// Everything else is final and ends the operation at once:
/// - a replayed answer (`Idempotent-Replayed: true`), whatever its status: it is the stored
///   outcome of an earlier attempt, and every retry would be answered with it again. A
///   replayed `2xx`, `3xx` or `5xx` is returned as the response, a replayed `4xx` as the typed
///   error of any other `4xx`;
/// - any other `409` (the handler's own conflict, such as a business rule) and any other `4xx`:
///   a `422` means the key was used with another request, a `400` that the request itself is
///   wrong, and sending it again cannot change that.
///
/// Between attempts the middleware waits what the server's `Retry-After` says (seconds or an
/// HTTP date), capped at [`max_retry_after`](Self::max_retry_after); without one, a
/// jittered exponential backoff (from the `retry-policies` crate): a wait drawn between zero
/// and `min(max_backoff, initial_backoff × 2ⁿ)` before retry `n + 1` (with the default
/// [`Jitter::Full`]). No retry starts once the operation has run for
/// [`deadline`](Self::deadline), or when its wait would end past it; how long a single
/// attempt may take is the request's or the client's own timeout.
///
/// | setting | default |
/// |---|---|
/// | [`max_attempts`](Self::max_attempts) | 8 |
/// | [`backoff`](Self::backoff) | from 100 ms up to 5 s, full jitter |
/// | [`deadline`](Self::deadline) | 30 s |
/// | [`max_retry_after`](Self::max_retry_after) | 10 s |
///
/// Every duration is capped at [`RetryPolicy::MAX_WAIT`].
///
/// ```
/// use idempotency_reqwest::RetryPolicy;
/// use std::time::Duration;
///
/// let policy = RetryPolicy::default()
///     .max_attempts(4)
///     .backoff(Duration::from_millis(50), Duration::from_secs(2))
///     .deadline(Duration::from_secs(10))
///     .max_retry_after(Duration::from_secs(3));
/// assert_eq!(policy.limits().max_attempts, 4);
/// assert_eq!(RetryPolicy::no_retries().limits().max_attempts, 1);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    jitter: Jitter,
    deadline: Duration,
    max_retry_after: Duration,
}

/// The limits of a [`RetryPolicy`] ([`RetryPolicy::limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryLimits {
    /// The most attempts made, the first included.
    pub max_attempts: u32,
    /// No retry starts after the operation has run this long.
    pub deadline: Duration,
    /// The longest server `Retry-After` honoured.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            jitter: Jitter::Full,
            deadline: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(10),
        }
    }
}

impl RetryPolicy {
    /// The longest any configured wait or deadline can be; longer values are taken as this.
    pub const MAX_WAIT: Duration = Duration::from_secs(24 * 60 * 60);

    /// How much of an unreplayed `409`'s body is read to find its problem type; a `409` with a
    /// larger body is not the server's in-progress refusal, and is not retried.
    pub const MAX_CONFLICT_BODY: usize = 4 * 1024;

    /// One attempt, never retried (the key is still sent, so a later retry by hand is safe).
    pub fn no_retries() -> Self {
        Self::default().max_attempts(1)
    }

    /// At most `n` attempts in all, the first included (at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// The exponential backoff between attempts the server gave no `Retry-After` for: from
    /// `initial` up to `max` (an `initial` above `max` is taken as `max`).
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.max_backoff = max.min(Self::MAX_WAIT);
        self.initial_backoff = initial.min(self.max_backoff);
        self
    }

    /// How the backoff is randomised: [`Jitter::Full`] (the default) draws each wait between
    /// zero and the exponential value, [`Jitter::Bounded`] between `initial` and it,
    /// [`Jitter::None`] takes the exponential value itself.
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// No retry starts after the operation has run this long, nor when its wait would end
    /// past it.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline.min(Self::MAX_WAIT);
        self
    }

    /// The longest wait a server's `Retry-After` is honoured for; a longer one is cut to it.
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max.min(Self::MAX_WAIT);
        self
    }

    /// The limits the policy keeps to, as set (after their caps).
    pub fn limits(&self) -> RetryLimits {
        RetryLimits {
            max_attempts: self.max_attempts,
            deadline: self.deadline,
            max_retry_after: self.max_retry_after,
        }
    }

    /// How long to wait before the next attempt, after `attempts` attempts that took
    /// `elapsed` so far, the last one answered with `retry_after` (if any); `Err` when the
    /// operation stops here.
    pub(crate) fn next_wait(
        &self,
        attempts: u32,
        elapsed: Duration,
        retry_after: Option<Duration>,
    ) -> Result<Duration, GiveUpReason> {
        if attempts >= self.max_attempts {
            return Err(GiveUpReason::AttemptsExhausted);
        }
        let wait = match retry_after {
            Some(asked) => asked.min(self.max_retry_after),
            None => self.backoff_wait(attempts.saturating_sub(1)),
        };
        if elapsed.saturating_add(wait) > self.deadline {
            return Err(GiveUpReason::DeadlineReached);
        }
        Ok(wait)
    }

    /// The jittered exponential wait before retry `past_retries + 1`.
    fn backoff_wait(&self, past_retries: u32) -> Duration {
        // The bounds are ordered and capped by the setters, so the builder's assertion holds
        // and its arithmetic cannot overflow.
        let backoff = ExponentialBackoff::builder()
            .retry_bounds(self.initial_backoff, self.max_backoff)
            .jitter(self.jitter)
            .base(2)
            .build_with_max_retries(u32::MAX);
        // The crate answers with a wall-clock instant from its own `now()`; read just after, the
        // wait is at most a few microseconds short.
        match backoff.should_retry(SystemTime::now(), past_retries) {
            RetryDecision::Retry { execute_after } => execute_after
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO)
                .min(self.max_backoff),
            RetryDecision::DoNotRetry => self.max_backoff,
        }
    }
}

/// Why the middleware stopped retrying.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GiveUpReason {
    /// The policy's [`max_attempts`](RetryPolicy::max_attempts) were made.
    AttemptsExhausted,
    /// The next attempt would start past the policy's [`deadline`](RetryPolicy::deadline).
    DeadlineReached,
}

impl std::fmt::Display for GiveUpReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::AttemptsExhausted => "the retry policy's attempts are used up",
            Self::DeadlineReached => "the next attempt would start past the retry deadline",
        })
    }
}

/// What to do with an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StatusClass {
    /// The operation's answer, returned as the response (1xx–3xx, or a replayed 5xx).
    Final,
    /// Safe and useful to send again under the same key.
    Retry,
    /// A 4xx that sending again cannot change.
    Refused,
    /// An unreplayed 409: retried if it is the server's in-progress refusal, else refused; its
    /// headers and body tell (`error::conflict_is_retryable`).
    Conflict,
}

/// What to do with an answer with `status`, `replayed` when it carries the replay marker.
pub(crate) fn classify(status: StatusCode, replayed: bool) -> StatusClass {
    match status.as_u16() {
        // The stored outcome of an earlier attempt: every retry would get it again.
        400..=499 if replayed => StatusClass::Refused,
        _ if replayed => StatusClass::Final,
        409 => StatusClass::Conflict,
        408 | 425 | 429 => StatusClass::Retry,
        400..=499 => StatusClass::Refused,
        500..=599 => StatusClass::Retry,
        _ => StatusClass::Final,
    }
}

/// Whether a transport error is worth another attempt: the request may not have reached the
/// server, or its answer was lost (connection refused or reset, a timeout, a connection
/// closed before the answer). The key makes a second arrival harmless.
pub(crate) fn is_retryable_transport(e: &reqwest::Error) -> bool {
    e.is_connect() || e.is_timeout() || e.is_request()
}

/// The server's `Retry-After`: delay-seconds or an HTTP date (a date in the past is zero).
/// `None` when absent or unreadable.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn classes() {
        let class = |s: u16, replayed: bool| classify(StatusCode::from_u16(s).unwrap(), replayed);
        for s in [200, 201, 204, 304] {
            assert_eq!(class(s, false), StatusClass::Final);
            assert_eq!(class(s, true), StatusClass::Final);
        }
        for s in [408, 425, 429, 500, 502, 503, 504, 599] {
            assert_eq!(class(s, false), StatusClass::Retry, "{s}");
        }
        assert_eq!(class(409, false), StatusClass::Conflict);
        for s in [400, 401, 403, 404, 412, 413, 422, 499] {
            assert_eq!(class(s, false), StatusClass::Refused, "{s}");
        }
        // A replay is the operation's answer, whatever its status.
        for s in [400, 408, 409, 422, 425, 429, 499] {
            assert_eq!(class(s, true), StatusClass::Refused, "{s}");
        }
        for s in [500, 503, 599] {
            assert_eq!(class(s, true), StatusClass::Final, "{s}");
        }
    }

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let read = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::RETRY_AFTER, HeaderValue::from_str(v).unwrap());
            retry_after(&h, now)
        };
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
        assert_eq!(read("3"), Some(Duration::from_secs(3)));
        assert_eq!(read(" 0 "), Some(Duration::ZERO));
        assert_eq!(
            read("18446744073709551615"),
            Some(Duration::from_secs(u64::MAX))
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(7));
        assert_eq!(read(&later), Some(Duration::from_secs(7)));
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(7));
        assert_eq!(read(&earlier), Some(Duration::ZERO));
        assert_eq!(read("soon"), None);
        assert_eq!(read("-1"), None);
    }

    #[test]
    fn retry_after_is_capped_and_attempts_and_deadline_stop() {
        let p = RetryPolicy::default()
            .max_attempts(3)
            .deadline(Duration::from_secs(10))
            .max_retry_after(Duration::from_secs(2));
        let s = Duration::from_secs;
        assert_eq!(p.next_wait(1, s(0), Some(s(1))), Ok(s(1)));
        assert_eq!(p.next_wait(1, s(0), Some(s(3600))), Ok(s(2)));
        assert_eq!(
            p.next_wait(3, s(0), None),
            Err(GiveUpReason::AttemptsExhausted)
        );
        assert_eq!(
            p.next_wait(1, s(9), Some(s(2))),
            Err(GiveUpReason::DeadlineReached)
        );
        assert_eq!(
            p.next_wait(1, Duration::MAX, Some(s(0))),
            Err(GiveUpReason::DeadlineReached)
        );
    }

    #[test]
    fn backoff_stays_within_its_bounds_for_any_setting() {
        let p = RetryPolicy::default()
            .backoff(Duration::from_millis(10), Duration::from_millis(80))
            .max_attempts(u32::MAX)
            .deadline(Duration::MAX);
        for n in [1, 2, 3, 10, 40, u32::MAX - 1] {
            let w = p.next_wait(n, Duration::ZERO, None).unwrap();
            assert!(w <= Duration::from_millis(80), "{n}: {w:?}");
        }
        let bounded = p.clone().jitter(Jitter::Bounded);
        assert!(bounded.next_wait(1, Duration::ZERO, None).unwrap() > Duration::from_millis(9));
        let none = p.jitter(Jitter::None);
        let w = none.next_wait(2, Duration::ZERO, None).unwrap();
        assert!(
            w <= Duration::from_millis(20) && w > Duration::from_millis(19),
            "{w:?}"
        );
        // Extreme settings are capped rather than trusted.
        let extreme = RetryPolicy::default()
            .backoff(Duration::MAX, Duration::MAX)
            .deadline(Duration::MAX)
            .max_retry_after(Duration::MAX)
            .max_attempts(0);
        assert_eq!(extreme.limits().max_attempts, 1);
        assert_eq!(extreme.limits().deadline, RetryPolicy::MAX_WAIT);
        let extreme = extreme.max_attempts(u32::MAX);
        for n in [1, 30, u32::MAX - 1] {
            assert!(extreme.next_wait(n, Duration::ZERO, None).unwrap() <= RetryPolicy::MAX_WAIT);
        }
    }
}
