//! Counters and log helpers.

use crate::IdempotencyKey;
use sha2::{Digest, Sha256};

/// The events the engine counts, each exported as its own counter when the `metrics` feature
/// is on (`idempotency_claims_total`, …).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Event {
    /// A key was claimed fresh.
    Claim,
    /// A stored outcome was replayed.
    Replay,
    /// A key was reused with a different fingerprint.
    KeyReused,
    /// A duplicate found the first attempt still running.
    InProgress,
    /// A failed or stalled record was taken over.
    Reclaim,
    /// A holder's completion, failure or heartbeat was fenced.
    LeaseLost,
    /// A request found its last attempt failed permanently and was not run.
    FailedPermanently,
    /// A work ran but its outcome could not be stored: a permanent failure is recorded in its
    /// place (or, if the store refuses that too, the key is held until its lease passes).
    OutcomeNotStored,
    /// A lease was dropped unsettled (the work was cancelled): the key is held until its
    /// lease passes.
    Abandoned,
}

impl Event {
    /// The counter name.
    pub const fn metric_name(self) -> &'static str {
        match self {
            Self::Claim => "idempotency_claims_total",
            Self::Replay => "idempotency_replays_total",
            Self::KeyReused => "idempotency_key_reused_total",
            Self::InProgress => "idempotency_in_progress_total",
            Self::Reclaim => "idempotency_reclaims_total",
            Self::LeaseLost => "idempotency_lease_lost_total",
            Self::FailedPermanently => "idempotency_failed_permanently_total",
            Self::OutcomeNotStored => "idempotency_outcomes_not_stored_total",
            Self::Abandoned => "idempotency_abandoned_total",
        }
    }

    /// The decision name used in spans.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Replay => "replay",
            Self::KeyReused => "key_reused",
            Self::InProgress => "in_progress",
            Self::Reclaim => "reclaim",
            Self::LeaseLost => "lease_lost",
            Self::FailedPermanently => "failed_permanently",
            Self::OutcomeNotStored => "outcome_not_stored",
            Self::Abandoned => "abandoned",
        }
    }
}

pub(crate) fn emit(event: Event) {
    tracing::Span::current().record("decision", event.as_str());
    tracing::debug!(decision = event.as_str(), "idempotency decision");
    #[cfg(feature = "metrics")]
    metrics::counter!(event.metric_name()).increment(1);
}

/// How a key appears in logs: as it is, or as the first 12 hex digits of its SHA-256.
pub fn loggable_key(key: &IdempotencyKey, hashed: bool) -> String {
    if hashed {
        let digest = Sha256::digest(key.as_str().as_bytes());
        format!("sha256:{}", &hex::encode(digest)[..12])
    } else {
        key.as_str().to_owned()
    }
}
