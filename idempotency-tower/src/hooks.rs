//! What the layer tells an API's hooks, and the outcomes it records.

use http::StatusCode;
use idempotency_core::IdempotencyKey;
use std::time::SystemTime;

/// What became of a response the handler gave (recorded on the `idempotency.http` span as
/// `outcome` and counted in `idempotency_http_outcomes_total{outcome}`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum HttpOutcome {
    /// Stored for replay.
    Stored,
    /// Not stored because of its status (5xx, 408, 429 by default); the key was released.
    ReleasedStatus,
    /// Too large to store; the key was released (`Unreplayable::Release`).
    ReleasedTooLarge,
    /// Its body failed while being read; the key was released (`Unreplayable::Release`).
    ReleasedBodyFailed,
    /// Too large to store; the key records that the handler ran (`Unreplayable::Record`).
    RecordedTooLarge,
    /// Its body failed while being read; the key records that the handler ran
    /// (`Unreplayable::Record`).
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
}

impl HttpOutcome {
    /// The label used in spans and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::ReleasedStatus => "released_status",
            Self::ReleasedTooLarge => "released_too_large",
            Self::ReleasedBodyFailed => "response_body_failed",
            Self::RecordedTooLarge => "recorded_too_large",
            Self::RecordedBodyFailed => "recorded_body_failed",
            Self::StoreFailed => "store_failed",
            Self::LeaseLost => "lease_lost",
            Self::SettledByHandler => "settled_by_handler",
        }
    }
}

/// What a response hook ([`crate::IdempotencyLayer::on_response`]) is told about the response
/// it may add headers to.
#[derive(Debug)]
pub struct ResponseContext<'a> {
    pub(crate) key: &'a IdempotencyKey,
    pub(crate) status: StatusCode,
    pub(crate) outcome: Option<HttpOutcome>,
    pub(crate) expires_at: Option<SystemTime>,
}

impl ResponseContext<'_> {
    /// The request's idempotency key.
    pub fn key(&self) -> &IdempotencyKey {
        self.key
    }

    /// The response's status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Whether this response is a replay of a stored one.
    pub fn is_replay(&self) -> bool {
        self.outcome.is_none()
    }

    /// For a fresh response (the handler just ran), what became of it; `None` for a replay.
    pub fn outcome(&self) -> Option<HttpOutcome> {
        self.outcome
    }

    /// When the key's record expires, if it is kept: for a replay, the record's expiry on the
    /// store's clock; for a fresh response that was stored (or recorded not replayable), now
    /// plus the policy's retention on this process's clock (an estimate: the store's clock
    /// decides). `None` when the key was released or its outcome could not be written.
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.expires_at
    }
}
