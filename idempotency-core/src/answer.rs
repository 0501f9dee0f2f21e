//! What a call with a key gets: the work's result (executed now or replayed), or a refusal.

use std::fmt;
use std::time::Duration;

/// What a call with an idempotency key gets. Every expected answer is a value: the result of
/// the work (run now, or replayed from the store) or a [`Refusal`]; the `Err` beside it
/// ([`crate::Error`]) means that something broke (the store failed, a record was corrupt).
///
/// ```
/// use idempotency_core::{Answer, Refusal};
///
/// fn respond(answer: Answer<Result<u64, String>>) -> String {
///     match answer {
///         Answer::Executed(Ok(id)) | Answer::Replayed(Ok(id)) => format!("201 payment {id}"),
///         Answer::Executed(Err(e)) | Answer::Replayed(Err(e)) => format!("402 {e}"),
///         Answer::Refused(Refusal::InProgress { retry_after }) => {
///             format!("409 retry after {}s", retry_after.as_secs())
///         }
///         Answer::Refused(refusal) => format!("422 {refusal}"),
///     }
/// }
/// assert_eq!(respond(Answer::Replayed(Ok(7))), "201 payment 7");
/// assert_eq!(respond(Answer::Refused(Refusal::KeyReused)).get(..3), Some("422"));
/// ```
#[derive(Clone, PartialEq, Eq, Debug)]
#[must_use = "an answer says whether the work ran, was replayed or was refused"]
pub enum Answer<T> {
    /// The work ran in this call; this is what it returned.
    Executed(T),
    /// The work ran earlier; this is its stored outcome. Nothing ran now.
    Replayed(T),
    /// The work did not run, and there is no stored outcome to give: see [`Refusal`].
    Refused(Refusal),
}

impl<T> Answer<T> {
    /// The work's result, executed or replayed, or the refusal.
    pub fn into_result(self) -> Result<T, Refusal> {
        match self {
            Self::Executed(t) | Self::Replayed(t) => Ok(t),
            Self::Refused(r) => Err(r),
        }
    }

    /// The work's result, executed or replayed; `None` for a refusal.
    pub fn value(&self) -> Option<&T> {
        match self {
            Self::Executed(t) | Self::Replayed(t) => Some(t),
            Self::Refused(_) => None,
        }
    }

    /// The refusal, if the call was refused.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            Self::Refused(r) => Some(r),
            Self::Executed(_) | Self::Replayed(_) => None,
        }
    }

    /// Whether the work ran in this call.
    pub fn is_executed(&self) -> bool {
        matches!(self, Self::Executed(_))
    }

    /// Whether the answer is a stored outcome, replayed.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Self::Replayed(_))
    }

    /// The answer with its result mapped by `f` (a refusal stays as it is).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Answer<U> {
        match self {
            Self::Executed(t) => Answer::Executed(f(t)),
            Self::Replayed(t) => Answer::Replayed(f(t)),
            Self::Refused(r) => Answer::Refused(r),
        }
    }
}

/// Why a call with a key did not run its work and has no stored outcome to give. These are
/// expected answers, not failures: each tells the caller what to do next.
///
/// | refusal | HTTP | what the caller does |
/// |---|---|---|
/// | [`Refusal::InProgress`] | 409 + `Retry-After` | send the same request again after `retry_after` |
/// | [`Refusal::KeyReused`] | 422 | nothing: the key belongs to another request; use a new key for a new request |
/// | [`Refusal::FailedPermanently`] | 422 | nothing with this key and request: it failed for good |
/// | [`Refusal::OutcomeLost`] | 422 | reconcile: the work ran, and what it returned was not kept |
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Refusal {
    /// Another attempt holds a live lease on the key (and the policy did not wait, or waited
    /// as long as it allows). Sending the same request again after `retry_after` gets its
    /// outcome, or runs the work if that attempt died.
    InProgress {
        /// How long until that attempt's lease passes.
        retry_after: Duration,
    },
    /// The key was already used with a different request (another fingerprint).
    KeyReused,
    /// The last attempt with this key and request failed permanently (a failure recorded
    /// with `retryable = false`): the work is not run again while the record is kept. A
    /// corrected request (another payload) may still run, per the policy.
    FailedPermanently {
        /// The failure's message, for operators (not meant for clients).
        message: String,
    },
    /// The work ran with this key, but its outcome could not be stored (the store refused it
    /// through every retry, it could not be encoded, or the work panicked): the work may
    /// have acted, so it is never run again with this key, and there is nothing to replay.
    OutcomeLost {
        /// What happened, for operators (not meant for clients).
        message: String,
    },
}

impl Refusal {
    /// Whether sending the same request again may get another answer: only for
    /// [`Refusal::InProgress`].
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::InProgress { .. })
    }

    /// How long to wait before sending the same request again, for [`Refusal::InProgress`].
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InProgress { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// The refusal a record failed with `failure` gives a request with its fingerprint.
    pub(crate) fn failed(failure: Option<crate::Failure>) -> Self {
        match failure {
            Some(f) if f.is_outcome_not_stored() => Self::OutcomeLost { message: f.message },
            f => Self::FailedPermanently {
                message: f.map(|f| f.message).unwrap_or_default(),
            },
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InProgress { retry_after } => write!(
                f,
                "a request with this idempotency key is still in progress; retry after {retry_after:?}"
            ),
            Self::KeyReused => {
                f.write_str("idempotency key was already used with a different request payload")
            }
            Self::FailedPermanently { message } => write!(
                f,
                "the request with this idempotency key failed permanently: {message}"
            ),
            Self::OutcomeLost { message } => write!(
                f,
                "the request with this idempotency key ran, but its outcome was not stored: {message}"
            ),
        }
    }
}

impl std::error::Error for Refusal {}
