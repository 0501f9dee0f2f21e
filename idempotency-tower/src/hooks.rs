//! What the layer tells an API's response hook.

use crate::HttpOutcome;
use http::StatusCode;
use idempotency_core::IdempotencyKey;
use std::time::SystemTime;

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
