//! The stored record and the values store primitives return.

use crate::{Error, Fingerprint, IdempotencyKey, Scope, Timestamp};
use std::fmt;
use std::time::Duration;

/// The address of a record: `(scope, key)`.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct RecordId {
    /// Who is calling and what operation it is.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
}

impl RecordId {
    /// Builds a record address: the key in its scope (the argument order of every engine
    /// call, `run(&key, &scope, …)`).
    pub fn new(key: IdempotencyKey, scope: Scope) -> Self {
        Self { scope, key }
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.scope, self.key)
    }
}

/// A fencing token: it grows at every claim and reclaim of a key, over the key's whole
/// history, so a holder that lost its lease can be told apart from every later one.
///
/// # What a token guarantees
///
/// A holder's complete, fail and extend apply only while the record holds its token. Tokens
/// never repeat for a key, even when its record was purged, evicted or lost (a Redis restart
/// without AOF): a fresh record's token is at least the store's clock in microseconds since
/// the Unix epoch, and more than the token of the expired record it replaces; a reclaim adds
/// one. A holder that stalls past its record's expiry therefore cannot complete a newer record
/// of the same key. This holds as long as the store's clock does not step back past the time
/// the old token was issued, and no key is reclaimed more than once per microsecond on
/// average over its record's life.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The token after this one.
    pub fn next(self) -> Self {
        Self(self.0.saturating_add(1))
    }

    /// The token of a fresh record claimed at `now` on the store's clock, replacing the
    /// expired record holding `replaced` (if any): `max(replaced + 1, now in µs)`, at least 1.
    ///
    /// ```
    /// use idempotency_core::FencingToken;
    /// use idempotency_core::store::Timestamp;
    ///
    /// let now = Timestamp::from_millis(1_700_000_000_000);
    /// assert_eq!(FencingToken::fresh(now, None), FencingToken(1_700_000_000_000_000));
    /// // A record reclaimed often holds a token ahead of the clock: the next one is higher.
    /// let ahead = FencingToken(1_700_000_000_000_005);
    /// assert_eq!(FencingToken::fresh(now, Some(ahead)), FencingToken(1_700_000_000_000_006));
    /// ```
    pub fn fresh(now: Timestamp, replaced: Option<FencingToken>) -> Self {
        let micros = u64::try_from(now.as_millis())
            .unwrap_or(0)
            .saturating_mul(1_000);
        let after = replaced.map_or(0, |t| t.0.saturating_add(1));
        Self(micros.max(after).max(1))
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Where a record is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum RecordStatus {
    /// Claimed; the holder of the current token is running the work under a lease.
    Pending,
    /// The work finished and its outcome is stored for replay.
    Completed,
    /// The work failed in a way that released the key; it may be reclaimed.
    Failed,
}

impl RecordStatus {
    /// A stable lower-case name (`pending`, `completed`, `failed`), as stores persist it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }

    /// Parses [`RecordStatus::as_str`]'s output.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(Self::Pending),
            "completed" => Some(Self::Completed),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }
}

impl fmt::Display for RecordStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the last attempt failed, as recorded by [`crate::IdempotencyStore::fail`].
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Failure {
    /// Whether retrying may succeed (a timeout, a 503) as opposed to a permanent error.
    pub retryable: bool,
    /// A short human-readable reason, for operators. Never replayed to clients.
    pub message: String,
}

impl Failure {
    /// A retryable failure with a message.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            retryable: true,
            message: message.into(),
        }
    }

    /// A permanent failure with a message.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            retryable: false,
            message: message.into(),
        }
    }

    /// The permanent failure the engine records in place of a work's outcome that the store
    /// refused through every try; `detail` says why. The work ran and may have acted, so
    /// while the record is kept no request runs under the key again: the same request is
    /// told it failed for good, and another payload is a mismatch, as against a stored
    /// outcome ([`crate::store::decide`]). Its message starts with [`Failure::OUTCOME_NOT_STORED`].
    ///
    /// ```
    /// use idempotency_core::store::Failure;
    ///
    /// let f = Failure::outcome_not_stored("an item over 400 KB");
    /// assert!(f.is_outcome_not_stored() && !f.retryable);
    /// assert!(!Failure::permanent("card declined").is_outcome_not_stored());
    /// ```
    pub fn outcome_not_stored(detail: impl fmt::Display) -> Self {
        Self::permanent(format!("{}: {detail}", Self::OUTCOME_NOT_STORED))
    }

    /// The longest message, in bytes, the engine asks a store to keep: a failure is for
    /// operators, and every store holds this much (a column, an item limit).
    /// [`Failure::bounded`] cuts a longer one.
    pub const MAX_MESSAGE: usize = 4096;

    /// This failure with its message cut to at most [`Failure::MAX_MESSAGE`] bytes, on a
    /// character boundary, ending with `…` where it was cut. The engine bounds every failure
    /// it records this way; the caller still gets the whole error.
    ///
    /// ```
    /// use idempotency_core::store::Failure;
    ///
    /// let f = Failure::retryable("é".repeat(5000)).bounded();
    /// assert!(f.message.len() <= Failure::MAX_MESSAGE && f.message.ends_with('…'));
    /// assert_eq!(Failure::permanent("short").bounded().message, "short");
    /// ```
    #[must_use]
    pub fn bounded(mut self) -> Self {
        const CUT: char = '…';
        if self.message.len() > Self::MAX_MESSAGE {
            let mut end = Self::MAX_MESSAGE - CUT.len_utf8();
            while !self.message.is_char_boundary(end) {
                end -= 1;
            }
            self.message.truncate(end);
            self.message.push(CUT);
        }
        self
    }

    /// How the message of [`Failure::outcome_not_stored`] starts. A permanent failure of your
    /// own whose message starts so is read as one.
    pub const OUTCOME_NOT_STORED: &'static str = "the work ran but its outcome could not be stored";

    /// Whether this is the failure [`Failure::outcome_not_stored`] records.
    pub fn is_outcome_not_stored(&self) -> bool {
        !self.retryable && self.message.starts_with(Self::OUTCOME_NOT_STORED)
    }
}

/// Everything a store keeps for `(scope, key)`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Record {
    /// The record's address.
    pub id: RecordId,
    /// Fingerprint of the request that claimed (or last reclaimed) the key.
    pub fingerprint: Fingerprint,
    /// Where the record is in its life.
    pub status: RecordStatus,
    /// The current fencing token.
    pub token: FencingToken,
    /// While `Pending`: when the holder's lease passes. `None` once completed or failed.
    pub lease_until: Option<Timestamp>,
    /// While `Completed`: the stored outcome bytes, replayed byte-identical.
    pub outcome: Option<Vec<u8>>,
    /// How many times the work was started under this key (1 after the first claim).
    pub attempts: u32,
    /// While `Failed`: what the last failure was.
    pub failure: Option<Failure>,
    /// How many times the record was observed by a later claim (retries, duplicates) that
    /// asked for its hit to be counted ([`ClaimRequest::count_hit`]).
    pub hits: u64,
    /// When the key was first claimed.
    pub created_at: Timestamp,
    /// When the record last changed state.
    pub updated_at: Timestamp,
    /// After this instant the record is treated as absent and may be replaced or purged.
    pub expires_at: Timestamp,
}

impl Record {
    /// Whether the record has expired at `now`.
    pub fn is_expired(&self, now: Timestamp) -> bool {
        now >= self.expires_at
    }

    /// Checks what every store's decoder checks before it hands a stored record out: a token
    /// of at least 1, at least one attempt, a Pending record with a lease, a Completed one with
    /// an outcome, a Failed one with its failure. A record that breaks a rule was not written
    /// by a correct store, and is reported as [`Error::CorruptRecord`] naming the record,
    /// never trusted.
    ///
    /// ```
    /// # use idempotency_core::*;
    /// # use idempotency_core::store::*;
    /// # let id = RecordId::new(IdempotencyKey::new("k").unwrap(), Scope::new("s").unwrap());
    /// let now = Timestamp::from_millis(1_000);
    /// let mut record = Record {
    ///     id,
    ///     fingerprint: Fingerprint::from_bytes(b"body"),
    ///     status: RecordStatus::Completed,
    ///     token: FencingToken(7),
    ///     lease_until: None,
    ///     outcome: Some(b"receipt".to_vec()),
    ///     attempts: 1,
    ///     failure: None,
    ///     hits: 0,
    ///     created_at: now,
    ///     updated_at: now,
    ///     expires_at: now,
    /// };
    /// assert!(record.validate().is_ok());
    /// record.outcome = None;
    /// assert!(matches!(record.validate(), Err(Error::CorruptRecord { .. })));
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        let problem = if self.token.0 < 1 {
            "token 0 is below 1"
        } else if self.attempts < 1 {
            "attempts is 0"
        } else {
            match self.status {
                RecordStatus::Pending if self.lease_until.is_none() => "pending without a lease",
                RecordStatus::Completed if self.outcome.is_none() => "completed without an outcome",
                RecordStatus::Failed if self.failure.is_none() => {
                    "failed without failure information"
                }
                _ => return Ok(()),
            }
        };
        Err(Error::corrupt(format!("record {}: {problem}", self.id)))
    }

    /// Whether the record is `Pending` with a lease that has passed at `now`.
    pub fn lease_passed(&self, now: Timestamp) -> bool {
        self.status == RecordStatus::Pending && self.lease_until.is_none_or(|l| now >= l)
    }

    /// Whether [`crate::IdempotencyStore::reclaim`] by a caller with `fingerprint` may take
    /// the record over at `now`, the token and expiry aside: `Pending` with a passed lease, or
    /// `Failed` with a retryable failure, or a permanent one and another fingerprint (a
    /// permanent failure is final for the request that failed).
    pub fn reclaimable_by(&self, fingerprint: &Fingerprint, now: Timestamp) -> bool {
        match self.status {
            RecordStatus::Failed => {
                self.failure.as_ref().is_none_or(|f| f.retryable)
                    || self.fingerprint != *fingerprint
            }
            _ => self.lease_passed(now),
        }
    }
}

/// How long a claim (or reclaim) keeps its Pending record: the longer of the lease and the
/// retention, so a record never expires under a live lease. Every store computes a claim's
/// `expires_at` as `now + claim_retention(lease, ttl)`.
pub fn claim_retention(lease: Duration, ttl: Duration) -> Duration {
    lease.max(ttl)
}

/// What to claim: the arguments of [`crate::IdempotencyStore::claim`]. Built with
/// [`ClaimRequest::new`], so that a field added later does not break your code.
///
/// ```
/// use idempotency_core::{Fingerprint, IdempotencyKey, RecordId, Scope};
/// use idempotency_core::store::ClaimRequest;
/// use std::time::Duration;
///
/// let id = RecordId::new(IdempotencyKey::new("k-1").unwrap(), Scope::new("orders").unwrap());
/// let fp = Fingerprint::from_bytes(b"body");
/// let request = ClaimRequest::new(id, fp, Duration::from_secs(30), Duration::from_secs(3600))
///     .with_count_hit(false);
/// assert!(!request.count_hit);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// The record's address.
    pub id: RecordId,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the new holder's lease lasts.
    pub lease: Duration,
    /// How long the record is kept; a new Pending record expires after `max(lease, ttl)`.
    pub ttl: Duration,
    /// Whether observing a live record counts a hit. `false` makes the observation a pure
    /// read (no write, no commit), at the price of inexact [`Record::hits`]: a store may
    /// still count an observation that raced with the record's claim, but a claim that finds
    /// the record already live never changes it. See [`crate::Policy::count_hits`].
    pub count_hit: bool,
}

impl ClaimRequest {
    /// A claim of `id` for a request with `fingerprint`: a lease of `lease`, a retention of
    /// `ttl`, and observations of a live record counted as hits.
    pub fn new(id: RecordId, fingerprint: Fingerprint, lease: Duration, ttl: Duration) -> Self {
        Self {
            id,
            fingerprint,
            lease,
            ttl,
            count_hit: true,
        }
    }

    /// Whether observing a live record counts a hit ([`ClaimRequest::count_hit`]).
    pub fn with_count_hit(mut self, count_hit: bool) -> Self {
        self.count_hit = count_hit;
        self
    }

    /// When the Pending record this claim writes expires: `now +`
    /// [`claim_retention`]`(lease, ttl)`.
    pub fn expires_at(&self, now: Timestamp) -> Timestamp {
        now.saturating_add(claim_retention(self.lease, self.ttl))
    }
}

/// What [`crate::IdempotencyStore::claim`] found.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Claim {
    /// No live record existed: a Pending record was written and the caller holds it.
    Claimed {
        /// The caller's fencing token.
        token: FencingToken,
        /// When the caller's lease passes, on the store's clock.
        lease_until: Timestamp,
    },
    /// A live record exists; its `hits` already include this observation when the claim
    /// counted it.
    Existing {
        /// The record as it stood after the observation (and its hit, when counted).
        record: Record,
        /// The store's clock at the moment of the observation.
        now: Timestamp,
    },
}

/// The result of a compare-and-swap on the fencing token.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Cas {
    /// The record was Pending with the expected token and has been updated.
    Applied,
    /// The record was not Pending with that token (another holder reclaimed it, it completed,
    /// it expired or it is gone). Nothing was changed.
    Fenced,
}

/// The result of [`crate::IdempotencyStore::reclaim`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Reclaim {
    /// The caller now holds the record with a new token.
    Reclaimed {
        /// The caller's new fencing token.
        token: FencingToken,
        /// When the caller's lease passes, on the store's clock.
        lease_until: Timestamp,
    },
    /// The record had moved on (another reclaimer won, the holder completed, the lease is
    /// live again, it expired or it is gone). Nothing was changed.
    Lost,
}
