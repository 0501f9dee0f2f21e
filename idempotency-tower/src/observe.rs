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
    KeyReused,
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
            Self::KeyReused => "key_reused",
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
/// [`HttpOutcome::HandlerErrorHeld`], [`HttpOutcome::HandlerErrorSettled`] and
/// [`HttpOutcome::HandlerPanicked`] have none, so it never sees them.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum HttpOutcome {
    /// Stored for replay.
    Stored,
    /// Not stored because of its status ([`IdempotencyLayer::store_status`](crate::IdempotencyLayer::store_status));
    /// the key was released ([`OnUnstored::Release`](crate::OnUnstored::Release)).
    ReleasedStatus,
    /// Not stored because of its status; the key is held until its lease passes
    /// ([`OnUnstored::Hold`](crate::OnUnstored::Hold)).
    HeldStatus,
    /// Not stored because of its status; the handler may have acted, so the key records that
    /// it ran, with its status and replayed headers, for good
    /// ([`OnUnstored::Settle`](crate::OnUnstored::Settle), the default).
    RecordedStatus,
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
    /// The handler's transaction sent its commit and the answer was lost
    /// ([`crate::ClaimedKey::run_in_transaction`]): its writes and the completion may have
    /// committed, so the key is held until its lease passes and the answer is not stored.
    CommitUnknown,
    /// The handler returned an error; the key was released
    /// ([`OnUnstored::Release`](crate::OnUnstored::Release), or its transaction rolled back).
    HandlerError,
    /// The handler returned an error; the key is held until its lease passes
    /// ([`OnUnstored::Hold`](crate::OnUnstored::Hold), or under the default
    /// [`OnUnstored::Settle`](crate::OnUnstored::Settle) when the store refused to settle it).
    HandlerErrorHeld,
    /// The handler returned an error; it may have acted, so the key is settled for good with a
    /// failure that says the outcome was not stored
    /// ([`OnUnstored::Settle`](crate::OnUnstored::Settle), the default).
    HandlerErrorSettled,
    /// The handler panicked. It may have acted, so the key is settled for good with a failure
    /// that says the outcome was not stored; the key is released only when the handler's
    /// transaction rolled back or [`OnUnstored::Release`](crate::OnUnstored::Release) is set
    /// (and left as the handler settled it, when it did).
    HandlerPanicked,
}

impl HttpOutcome {
    /// The label used in spans and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::ReleasedStatus => "released_status",
            Self::HeldStatus => "held_status",
            Self::RecordedStatus => "recorded_status",
            Self::ReleasedNothingDone => "released_nothing_done",
            Self::ReleasedTooLarge => "released_too_large",
            Self::ReleasedBodyFailed => "response_body_failed",
            Self::RecordedTooLarge => "recorded_too_large",
            Self::RecordedBodyFailed => "recorded_body_failed",
            Self::StoreFailed => "store_failed",
            Self::LeaseLost => "lease_lost",
            Self::SettledByHandler => "settled_by_handler",
            Self::CommitUnknown => "commit_unknown",
            Self::HandlerError => "handler_error",
            Self::HandlerErrorHeld => "handler_error_held",
            Self::HandlerErrorSettled => "handler_error_settled",
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
    counted::decision(decision);
}

/// Records `outcome` on the current `idempotency.http` span, and counts it.
pub(crate) fn record_outcome(outcome: HttpOutcome) {
    tracing::Span::current().record("outcome", outcome.as_str());
    #[cfg(feature = "metrics")]
    counted::outcome(outcome);
}

/// The counters, each with a static key: counting a request allocates nothing (a label
/// given to `metrics::counter!` as an expression is copied into a new key on every call).
#[cfg(feature = "metrics")]
mod counted {
    use super::{HttpDecision, HttpOutcome};
    use metrics::{Key, Label, Level, Metadata};

    /// The target `metrics::counter!` gave these counters before (this module's parent), so
    /// that recorders filtering by target see them as before.
    const TARGET: &str = "idempotency_tower::observe";
    static METADATA: Metadata<'static> = Metadata::new(TARGET, Level::INFO, Some(TARGET));

    /// The static key of metric `$name` with label `$label` = `$value.as_str()`.
    macro_rules! key {
        ($name:literal, $label:literal, $value:expr) => {{
            static LABELS: [Label; 1] = [Label::from_static_parts($label, $value.as_str())];
            static KEY: Key = Key::from_static_parts($name, &LABELS);
            &KEY
        }};
    }

    fn increment(key: &Key) {
        metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA)).increment(1);
    }

    pub(super) fn decision(decision: HttpDecision) {
        use HttpDecision as D;
        macro_rules! each {
            ($($variant:ident),* $(,)?) => {
                match decision {
                    $(D::$variant => key!(
                        "idempotency_http_requests_total",
                        "decision",
                        D::$variant
                    ),)*
                }
            };
        }
        increment(each!(
            PassThrough,
            Refused,
            Executed,
            Replayed,
            KeyReused,
            InProgress,
            StoreUnavailable,
            FailOpen,
            Unreadable,
        ));
    }

    pub(super) fn outcome(outcome: HttpOutcome) {
        use HttpOutcome as O;
        macro_rules! each {
            ($($variant:ident),* $(,)?) => {
                match outcome {
                    $(O::$variant => key!(
                        "idempotency_http_outcomes_total",
                        "outcome",
                        O::$variant
                    ),)*
                }
            };
        }
        increment(each!(
            Stored,
            ReleasedStatus,
            HeldStatus,
            RecordedStatus,
            ReleasedNothingDone,
            ReleasedTooLarge,
            ReleasedBodyFailed,
            RecordedTooLarge,
            RecordedBodyFailed,
            StoreFailed,
            LeaseLost,
            SettledByHandler,
            CommitUnknown,
            HandlerError,
            HandlerErrorHeld,
            HandlerErrorSettled,
            HandlerPanicked,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DECISIONS: [(HttpDecision, &str); 9] = [
        (HttpDecision::PassThrough, "pass_through"),
        (HttpDecision::Refused, "refused"),
        (HttpDecision::Executed, "executed"),
        (HttpDecision::Replayed, "replayed"),
        (HttpDecision::KeyReused, "key_reused"),
        (HttpDecision::InProgress, "in_progress"),
        (HttpDecision::StoreUnavailable, "store_unavailable"),
        (HttpDecision::FailOpen, "fail_open"),
        (HttpDecision::Unreadable, "stored_response_unreadable"),
    ];

    const OUTCOMES: [(HttpOutcome, &str); 16] = [
        (HttpOutcome::Stored, "stored"),
        (HttpOutcome::ReleasedStatus, "released_status"),
        (HttpOutcome::HeldStatus, "held_status"),
        (HttpOutcome::RecordedStatus, "recorded_status"),
        (HttpOutcome::ReleasedNothingDone, "released_nothing_done"),
        (HttpOutcome::ReleasedTooLarge, "released_too_large"),
        (HttpOutcome::ReleasedBodyFailed, "response_body_failed"),
        (HttpOutcome::RecordedTooLarge, "recorded_too_large"),
        (HttpOutcome::RecordedBodyFailed, "recorded_body_failed"),
        (HttpOutcome::StoreFailed, "store_failed"),
        (HttpOutcome::LeaseLost, "lease_lost"),
        (HttpOutcome::SettledByHandler, "settled_by_handler"),
        (HttpOutcome::HandlerError, "handler_error"),
        (HttpOutcome::HandlerErrorHeld, "handler_error_held"),
        (HttpOutcome::HandlerErrorSettled, "handler_error_settled"),
        (HttpOutcome::HandlerPanicked, "handler_panicked"),
    ];

    /// The labels are what dashboards and alerts match on: they never change.
    #[test]
    fn labels_are_stable() {
        for (decision, label) in DECISIONS {
            assert_eq!(decision.as_str(), label);
        }
        for (outcome, label) in OUTCOMES {
            assert_eq!(outcome.as_str(), label);
        }
    }

    /// Each decision and outcome is counted under its own label (the counters' keys are
    /// written out per variant).
    #[cfg(feature = "metrics")]
    #[test]
    fn each_is_counted_under_its_label() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        metrics::with_local_recorder(&recorder, || {
            for (i, (decision, _)) in DECISIONS.into_iter().enumerate() {
                for _ in 0..=i {
                    record_decision(decision);
                }
            }
            for (i, (outcome, _)) in OUTCOMES.into_iter().enumerate() {
                for _ in 0..=i {
                    record_outcome(outcome);
                }
            }
        });
        let counted = |name: &str, label: &str| -> Vec<(String, u64)> {
            let mut counts: Vec<(String, u64)> = recorder
                .snapshotter()
                .snapshot()
                .into_vec()
                .into_iter()
                .filter(|(key, ..)| key.key().name() == name)
                .map(|(key, _, _, value)| {
                    let labels: Vec<_> = key.key().labels().collect();
                    assert_eq!(labels.len(), 1, "{key:?}");
                    assert_eq!(labels[0].key(), label);
                    let DebugValue::Counter(n) = value else {
                        panic!("{key:?} is not a counter");
                    };
                    (labels[0].value().to_owned(), n)
                })
                .collect();
            counts.sort();
            counts
        };
        let expected = |pairs: &[&str]| -> Vec<(String, u64)> {
            let mut v: Vec<(String, u64)> = pairs
                .iter()
                .enumerate()
                .map(|(i, l)| ((*l).to_owned(), i as u64 + 1))
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            counted("idempotency_http_requests_total", "decision"),
            expected(&DECISIONS.map(|(_, l)| l))
        );
        assert_eq!(
            counted("idempotency_http_outcomes_total", "outcome"),
            expected(&OUTCOMES.map(|(_, l)| l))
        );
    }
}
