//! The core error type.

use crate::{FencingToken, KeyError, ScopeError};
use std::fmt;

/// A boxed error source, kept so callers can walk the chain.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What broke between a caller, the engine and a store.
///
/// Expected answers are not errors: a duplicate in flight, a key reused with another request,
/// a permanent failure and a lost outcome are [`crate::Refusal`]s inside an
/// [`crate::Answer`]; the races a store reports (a claim that found a live record, a CAS that
/// was fenced) are values too ([`crate::Claim`], [`crate::Cas`]). [`Error::is_retryable`]
/// tells whether making the same call again may succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The idempotency key broke a rule.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[from] KeyError),
    /// The scope broke a rule.
    #[error("invalid scope: {0}")]
    InvalidScope(#[from] ScopeError),
    /// The caller's lease was lost: its token was fenced by a newer holder, or the record
    /// completed or expired. Nothing the caller tried to record was written.
    #[error("lease lost: fencing token {token} is no longer the holder of this key")]
    LeaseLost {
        /// The token that was refused.
        token: FencingToken,
    },
    /// A stored record could not be decoded.
    #[error("corrupt stored record: {reason}")]
    CorruptRecord {
        /// What was wrong with it.
        reason: String,
        /// The decoding error, when there is one.
        #[source]
        source: Option<BoxError>,
    },
    /// A value could not be written as JSON: the work's outcome (its `Serialize` failed, or a
    /// map has keys that are not strings) or a request value given to
    /// [`crate::Fingerprint::of`].
    #[error("cannot encode the outcome as JSON: {source}")]
    Codec {
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// The key's stored outcome is JSON that does not fit the caller's type: the type changed
    /// since the outcome was stored (a deploy renamed a field, say), or another program used
    /// the key. Nothing ran and the stored outcome is kept; decode it as the type it was
    /// stored with, or accept both shapes (`#[serde(alias)]`, an untagged enum).
    #[error("the stored outcome does not fit the caller's type: {source}")]
    StoredOutcome {
        /// The serde error, with the path and the expected shape.
        #[source]
        source: serde_json::Error,
    },
    /// The store failed (connection refused, I/O error, unexpected response…).
    #[error("store error ({}): {source}", retry_hint(*retryable))]
    Backend {
        /// Whether the same call may succeed if tried again.
        retryable: bool,
        /// The backend's own error.
        #[source]
        source: BoxError,
    },
    /// The store may or may not have applied a write: the connection died after the request
    /// was sent, or the work ran and its outcome could not be stored after the retries of
    /// [`crate::Policy::settle_retry`]. The key is not released: a lease whose completion
    /// failed records the lost outcome in its place (retries are refused with
    /// [`crate::Refusal::OutcomeLost`]), or, if the store refuses that too, the record stays
    /// Pending until its lease passes and retries are refused with
    /// [`crate::Refusal::InProgress`] until then. No retry is given an outcome that was not
    /// stored. Read the record again before assuming anything.
    #[error("outcome unknown: the store may or may not have applied the write: {source}")]
    OutcomeUnknown {
        /// The transport error.
        #[source]
        source: BoxError,
    },
    /// A store or engine was configured wrongly (bad table name, zero lease…).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A multi-step operation found a recovery point it cannot resume: written by another
    /// operation (an operation renamed by a deploy, or the key used for another operation) or
    /// at a phase past this operation's last (phases removed by a deploy). Nothing ran; the
    /// key is released, and the record keeps its recovery point for the operation that
    /// wrote it.
    #[error(
        "operation {operation:?} ({phases} phases) cannot resume the recovery point of \
         operation {found:?} at phase {phase}"
    )]
    CannotResume {
        /// The operation that was run.
        operation: String,
        /// Its number of phases.
        phases: u16,
        /// The operation named in the recovery point.
        found: String,
        /// The phase the recovery point is at.
        phase: u16,
    },
}

fn retry_hint(retryable: bool) -> &'static str {
    if retryable {
        "a retry is safe"
    } else {
        "not retryable as is"
    }
}

/// The store operation a store error happened in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Operation {
    /// [`crate::IdempotencyStore::claim`].
    Claim,
    /// [`crate::IdempotencyStore::get`].
    Get,
    /// [`crate::IdempotencyStore::reclaim`].
    Reclaim,
    /// [`crate::IdempotencyStore::complete`].
    Complete,
    /// [`crate::IdempotencyStore::fail`].
    Fail,
    /// [`crate::IdempotencyStore::extend`].
    Extend,
    /// [`crate::IdempotencyStore::purge_expired`].
    Purge,
}

impl Operation {
    /// The operation's name, as logs and error messages show it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Get => "get",
            Self::Reclaim => "reclaim",
            Self::Complete => "complete",
            Self::Fail => "fail",
            Self::Extend => "extend",
            Self::Purge => "purge",
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a store error happened: the operation and the record it was about, around the
/// store's own error. The engine puts it in the source of every [`Error::Backend`] and
/// [`Error::OutcomeUnknown`] from a store call, with the record's key hashed when the policy
/// hashes keys in logs, so one log line says where to look:
///
/// ```
/// # use idempotency_core::{Error, Operation};
/// let err = Error::backend(true, "connection refused").during(Operation::Complete, "shop#k-1");
/// assert_eq!(
///     err.to_string(),
///     "store error (a retry is safe): complete of record shop#k-1: connection refused"
/// );
/// assert_eq!(err.store_call().map(|c| c.operation), Some(Operation::Complete));
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{operation} of record {record}: {source}")]
pub struct StoreCall {
    /// The operation that failed.
    pub operation: Operation,
    /// The record, as `scope#key` (the key hashed when the policy says so).
    pub record: String,
    /// The store's error.
    #[source]
    pub source: BoxError,
}

impl Error {
    /// This error with the store operation and the record it happened in, for
    /// [`Error::Backend`] and [`Error::OutcomeUnknown`] (their source becomes a
    /// [`StoreCall`]); any other error, or one that already says where, is returned as it is.
    pub fn during(self, operation: Operation, record: impl fmt::Display) -> Self {
        if self.store_call().is_some() {
            return self;
        }
        let wrap = |source: BoxError| -> BoxError {
            Box::new(StoreCall {
                operation,
                record: record.to_string(),
                source,
            })
        };
        match self {
            Self::Backend { retryable, source } => Self::Backend {
                retryable,
                source: wrap(source),
            },
            Self::OutcomeUnknown { source } => Self::OutcomeUnknown {
                source: wrap(source),
            },
            other => other,
        }
    }

    /// This error, given to each of the `n` calls of a batch that one failure of the whole
    /// batch (a lost connection, a refused statement) touched, for a store's
    /// [`crate::IdempotencyStore::claim_many`] or [`crate::IdempotencyStore::settle_many`]: the
    /// first is this error itself, the others say the same of the same kind (a
    /// [`Error::Backend`] keeps whether it is retryable, an [`Error::OutcomeUnknown`] stays
    /// unknown; any other kind becomes a non-retryable [`Error::Backend`] with its message).
    ///
    /// ```
    /// use idempotency_core::Error;
    /// let errors = Error::backend(true, "connection reset").for_each_of(3);
    /// assert_eq!(errors.len(), 3);
    /// assert!(errors.iter().all(|e| matches!(e, Error::Backend { retryable: true, .. })));
    /// assert!(Error::backend(true, "gone").for_each_of(0).is_empty());
    /// ```
    pub fn for_each_of(self, n: usize) -> Vec<Error> {
        if n == 0 {
            return Vec::new();
        }
        let message = format!("a batch of {n} calls failed: {self}");
        let like = || match &self {
            Self::OutcomeUnknown { .. } => Self::OutcomeUnknown {
                source: message.clone().into(),
            },
            Self::Backend { retryable, .. } => Self::backend(*retryable, message.clone()),
            _ => Self::backend(false, message.clone()),
        };
        let mut out: Vec<Error> = (1..n).map(|_| like()).collect();
        out.insert(0, self);
        out
    }

    /// Where a store error happened, when the engine recorded it.
    pub fn store_call(&self) -> Option<&StoreCall> {
        self.find_source::<StoreCall>()
    }

    /// The first error of type `T` in this error's source chain: how a store crate finds its
    /// own error behind a core one (`PostgresError::find`, `SqliteError::find`), or a caller
    /// the driver's.
    pub fn find_source<T: std::error::Error + 'static>(&self) -> Option<&T> {
        let mut cur = std::error::Error::source(self);
        while let Some(e) = cur {
            if let Some(found) = e.downcast_ref::<T>() {
                return Some(found);
            }
            cur = e.source();
        }
        None
    }

    /// A backend error.
    pub fn backend(retryable: bool, source: impl Into<BoxError>) -> Self {
        Self::Backend {
            retryable,
            source: source.into(),
        }
    }

    /// A corrupt-record error with a reason and no source.
    pub fn corrupt(reason: impl Into<String>) -> Self {
        Self::CorruptRecord {
            reason: reason.into(),
            source: None,
        }
    }

    /// A corrupt-record error that keeps the decoding error.
    pub fn corrupt_with(reason: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::CorruptRecord {
            reason: reason.into(),
            source: Some(source.into()),
        }
    }

    /// Whether sending the same request again (same key, same payload) may succeed.
    ///
    /// True for [`Error::LeaseLost`] (the retry sees the current holder's result),
    /// [`Error::OutcomeUnknown`] (the retry sees what was stored) and retryable backend
    /// errors.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::LeaseLost { .. } | Self::OutcomeUnknown { .. } => true,
            Self::Backend { retryable, .. } => *retryable,
            Self::InvalidKey(_)
            | Self::InvalidScope(_)
            | Self::CorruptRecord { .. }
            | Self::Codec { .. }
            | Self::StoredOutcome { .. }
            | Self::Config(_)
            | Self::CannotResume { .. } => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryability() {
        assert!(Error::OutcomeUnknown {
            source: "reset".into()
        }
        .is_retryable());
        assert!(Error::backend(true, "x").is_retryable());
        assert!(!Error::backend(false, "x").is_retryable());
        assert!(!Error::corrupt("bad").is_retryable());
        assert!(Error::LeaseLost {
            token: FencingToken(3)
        }
        .to_string()
        .contains('3'));
    }
}
