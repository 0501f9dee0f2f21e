//! The core error type.

use crate::{FencingToken, KeyError, ScopeError};
use std::time::Duration;

/// A boxed error source, kept so callers can walk the chain.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong between a caller, the engine and a store.
///
/// Expected races that a store reports (a claim that found a live record, a CAS that was
/// fenced) are values ([`crate::Claim`], [`crate::Cas`]); the engine turns the ones the caller
/// must act on into [`Error::Mismatch`], [`Error::InProgress`] and [`Error::LeaseLost`].
/// [`Error::is_retryable`] tells whether sending the same request again may succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The idempotency key broke a rule.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[from] KeyError),
    /// The scope broke a rule.
    #[error("invalid scope: {0}")]
    InvalidScope(#[from] ScopeError),
    /// The key was already used with a different request fingerprint.
    #[error("idempotency key was already used with a different request payload")]
    Mismatch,
    /// Another attempt holds a live lease on the key.
    #[error(
        "a request with this idempotency key is still in progress; retry after {retry_after:?}"
    )]
    InProgress {
        /// How long until that attempt's lease passes.
        retry_after: Duration,
    },
    /// The caller's lease was lost: its token was fenced by a newer holder, or the record
    /// completed or expired. Nothing the caller tried to record was written.
    #[error("lease lost: fencing token {token} is no longer the holder of this key")]
    LeaseLost {
        /// The token that was refused.
        token: FencingToken,
    },
    /// The last attempt with this key and payload failed permanently (a failure recorded with
    /// `retryable = false`), so the work is not run again while the record is kept. A
    /// corrected request (another payload) may still run, per the policy.
    #[error("the request with this idempotency key failed permanently: {message}")]
    FailedPermanently {
        /// The failure's message, for operators (not meant for clients).
        message: String,
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
    /// The outcome could not be serialized, or a stored outcome could not be deserialized into
    /// the caller's type.
    #[error("cannot encode or decode the stored outcome: {source}")]
    Codec {
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// The store failed (connection refused, I/O error, unexpected response…).
    #[error("store error: {source}")]
    Backend {
        /// Whether the same call may succeed if tried again.
        retryable: bool,
        /// The backend's own error.
        #[source]
        source: BoxError,
    },
    /// The store may or may not have applied a write: the connection died after the request
    /// was sent, or the work ran and its outcome could not be stored after the retries of
    /// [`crate::Policy::settle_retry`]. The key is not released: it stays Pending until its
    /// lease passes, so retries are told [`Error::InProgress`] until then and never replay
    /// an outcome that was not stored. Read the record again before assuming anything.
    #[error("outcome unknown: the store may or may not have applied the write: {source}")]
    OutcomeUnknown {
        /// The transport error.
        #[source]
        source: BoxError,
    },
    /// A store or engine was configured wrongly (bad table name, zero lease…).
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl Error {
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
    /// True for [`Error::InProgress`], [`Error::LeaseLost`] (the retry sees the current
    /// holder's result), [`Error::OutcomeUnknown`] and retryable backend errors.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::InProgress { .. } | Self::LeaseLost { .. } | Self::OutcomeUnknown { .. } => true,
            Self::Backend { retryable, .. } => *retryable,
            Self::InvalidKey(_)
            | Self::InvalidScope(_)
            | Self::Mismatch
            | Self::FailedPermanently { .. }
            | Self::CorruptRecord { .. }
            | Self::Codec { .. }
            | Self::Config(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryability() {
        assert!(Error::InProgress {
            retry_after: Duration::from_secs(1)
        }
        .is_retryable());
        assert!(!Error::Mismatch.is_retryable());
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
