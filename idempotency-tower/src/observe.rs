//! What the layer records about a covered request, as span fields and metric labels: what it
//! decided ([`HttpDecision`]) and, once the handler ran, what became of it ([`HttpOutcome`]).
//! The labels are the enums' `as_str`, and the two functions here are the only places that
//! write them.

/// What the layer did with a request, recorded on the `idempotency.http` span (field
/// `http_decision`) and counted in `idempotency_http_requests_total{decision}`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum HttpDecision {
    /// Not covered, or no key and not required: passed through untouched.
    PassThrough,
    /// Refused before the store was asked (bad key, missing key, body too large…).
    Refused,
    /// The key was claimed and the handler ran.
    Executed,
    /// The stored response was replayed.
    Replayed,
    /// The key was used with a different request.
    Mismatch,
    /// Another request with the key is running.
    InProgress,
    /// The store failed and the layer answered 503.
    StoreUnavailable,
    /// The store failed and the handler ran unprotected (fail-open).
    FailOpen,
    /// The stored response could not be decoded.
    Unreadable,
}

impl HttpDecision {
    /// The label used in spans and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::PassThrough => "pass_through",
            Self::Refused => "refused",
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::Mismatch => "mismatch",
            Self::InProgress => "in_progress",
            Self::StoreUnavailable => "store_unavailable",
            Self::FailOpen => "fail_open",
            Self::Unreadable => "stored_response_unreadable",
        }
    }
}

/// What became of a request that claimed its key and ran the handler (recorded on the
/// `idempotency.http` span as `outcome` and counted in
/// `idempotency_http_outcomes_total{outcome}`). A response hook
/// ([`ResponseContext::outcome`](crate::ResponseContext::outcome)) is told the outcomes that
/// come with the handler's response; [`HttpOutcome::HandlerError`],
/// [`HttpOutcome::HandlerErrorHeld`] and [`HttpOutcome::HandlerPanicked`] have none, so it never sees them.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum HttpOutcome {
    /// Stored for replay.
    Stored,
    /// Not stored because of its status (5xx, 408, 429 by default); the key was released
    /// ([`OnUnstored::Release`](crate::OnUnstored::Release)).
    ReleasedStatus,
    /// Not stored because of its status; the handler may have acted, so the key is held until
    /// its lease passes ([`OnUnstored::Hold`](crate::OnUnstored::Hold), the default).
    HeldStatus,
    /// The handler said it did nothing ([`NothingDone`](crate::NothingDone), or
    /// [`ClaimedKey::rolled_back`](crate::ClaimedKey::rolled_back)); the key was released and
    /// the response not stored.
    ReleasedNothingDone,
    /// Too large to store; the key was released (`OnUnreplayable::Release`).
    ReleasedTooLarge,
    /// Its body failed while being read; the key was released (`OnUnreplayable::Release`).
    ReleasedBodyFailed,
    /// Too large to store; the key records that the handler ran (`OnUnreplayable::Record`).
    RecordedTooLarge,
    /// Its body failed while being read; the key records that the handler ran
    /// (`OnUnreplayable::Record`).
    RecordedBodyFailed,
    /// Storing it failed through the engine's retries; the key stays pending until its lease
    /// passes.
    StoreFailed,
    /// The lease was taken over before the response could be stored (the handler outlived its
    /// lease, for instance): the completion was fenced, another attempt owns the key.
    LeaseLost,
    /// The handler committed the completion in its own transaction ([`crate::ClaimedKey`]):
    /// the layer wrote nothing, and retries replay what the handler committed.
    SettledByHandler,
    /// The handler returned an error; the key was released
    /// ([`OnUnstored::Release`](crate::OnUnstored::Release), or its transaction rolled back).
    HandlerError,
    /// The handler returned an error; it may have acted, so the key is held until its lease
    /// passes ([`OnUnstored::Hold`](crate::OnUnstored::Hold), the default).
    HandlerErrorHeld,
    /// The handler panicked; the key was released (unless the handler had settled it itself).
    HandlerPanicked,
}

impl HttpOutcome {
    /// The label used in spans and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::ReleasedStatus => "released_status",
            Self::HeldStatus => "held_status",
            Self::ReleasedNothingDone => "released_nothing_done",
            Self::ReleasedTooLarge => "released_too_large",
            Self::ReleasedBodyFailed => "response_body_failed",
            Self::RecordedTooLarge => "recorded_too_large",
            Self::RecordedBodyFailed => "recorded_body_failed",
            Self::StoreFailed => "store_failed",
            Self::LeaseLost => "lease_lost",
            Self::SettledByHandler => "settled_by_handler",
            Self::HandlerError => "handler_error",
            Self::HandlerErrorHeld => "handler_error_held",
            Self::HandlerPanicked => "handler_panicked",
        }
    }
}

/// Records `decision` on the current `idempotency.http` span, and counts it.
pub(crate) fn record_decision(decision: HttpDecision) {
    tracing::Span::current().record("http_decision", decision.as_str());
    tracing::debug!(
        http_decision = decision.as_str(),
        "idempotency http decision"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_http_requests_total", "decision" => decision.as_str())
        .increment(1);
}

/// Records `outcome` on the current `idempotency.http` span, and counts it.
pub(crate) fn record_outcome(outcome: HttpOutcome) {
    tracing::Span::current().record("outcome", outcome.as_str());
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_http_outcomes_total", "outcome" => outcome.as_str())
        .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The labels are what dashboards and alerts match on: they never change.
    #[test]
    fn labels_are_stable() {
        let decisions = [
            (HttpDecision::PassThrough, "pass_through"),
            (HttpDecision::Refused, "refused"),
            (HttpDecision::Executed, "executed"),
            (HttpDecision::Replayed, "replayed"),
            (HttpDecision::Mismatch, "mismatch"),
            (HttpDecision::InProgress, "in_progress"),
            (HttpDecision::StoreUnavailable, "store_unavailable"),
            (HttpDecision::FailOpen, "fail_open"),
            (HttpDecision::Unreadable, "stored_response_unreadable"),
        ];
        for (decision, label) in decisions {
            assert_eq!(decision.as_str(), label);
        }
        let outcomes = [
            (HttpOutcome::Stored, "stored"),
            (HttpOutcome::ReleasedStatus, "released_status"),
            (HttpOutcome::ReleasedTooLarge, "released_too_large"),
            (HttpOutcome::ReleasedBodyFailed, "response_body_failed"),
            (HttpOutcome::RecordedTooLarge, "recorded_too_large"),
            (HttpOutcome::RecordedBodyFailed, "recorded_body_failed"),
            (HttpOutcome::StoreFailed, "store_failed"),
            (HttpOutcome::LeaseLost, "lease_lost"),
            (HttpOutcome::SettledByHandler, "settled_by_handler"),
            (HttpOutcome::HandlerError, "handler_error"),
            (HttpOutcome::HandlerPanicked, "handler_panicked"),
        ];
        for (outcome, label) in outcomes {
            assert_eq!(outcome.as_str(), label);
        }
    }
}
