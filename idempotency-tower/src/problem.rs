//! Refusals and how they are written: RFC 9457 problem documents by default, or your format.

use crate::headers::CONTENT_TYPE;
use crate::{KeyHeaderError, NotReplayable};
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use std::fmt;
use std::time::Duration;

/// The media type of RFC 9457 problem documents.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Why the layer answered instead of the handler (or in place of the handler's outcome).
///
/// Each refusal has an HTTP status, a stable type slug clients can match on, and a code in the
/// style of the seeds (`IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD`). Neither changes
/// between releases.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The layer is `required` and the request had no `Idempotency-Key`. 400.
    KeyRequired,
    /// The `Idempotency-Key` header is malformed. 400.
    KeyInvalid(KeyHeaderError),
    /// The scope function found no caller identity for this request. 401.
    CallerUnidentified,
    /// The scope built from the caller, method and route is not a valid scope. 400.
    ScopeInvalid(String),
    /// The request body is larger than the buffer limit. 413.
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The request body could not be read. 400.
    BodyUnreadable(String),
    /// Another request with this key is still running. 409, with `Retry-After`.
    InProgress {
        /// When the other attempt's lease passes.
        retry_after: Duration,
    },
    /// The key was used before with a different request. 422.
    KeyReused,
    /// The earlier request with this key failed permanently and is not run again. 422.
    FailedPermanently,
    /// The earlier request with this key ran, but its response could not be stored (or its
    /// handler panicked): it may have taken effect, and is not run again. 422.
    OutcomeLost,
    /// The idempotency store could not be reached or failed. 503 (fail closed).
    StoreUnavailable(String),
    /// The stored response for this key could not be decoded. 500.
    StoredResponseUnreadable(String),
    /// The handler ran, but its response could not be kept for replay (too large, or its body
    /// failed): answered with the handler's status, so a client does not take it for a
    /// failure and run the operation again under a new key.
    NotReplayable {
        /// The handler's status.
        status: StatusCode,
        /// Why the response was not kept.
        reason: NotReplayable,
    },
    /// The handler failed without a response (it panicked or returned an error). 500.
    HandlerFailed,
    /// The request stalled past its lease and another request with the key took it over; the
    /// handler's transactional completion was fenced and its writes rolled back. 409, with
    /// `Retry-After`: the retry gets the outcome of the request that holds the key.
    LeaseLost,
}

impl From<idempotency_core::Refusal> for Refusal {
    /// The layer's refusal for the engine's: what a handler that runs the engine itself
    /// (`run_phases`, a transaction) answers with, in the layer's words.
    fn from(refusal: idempotency_core::Refusal) -> Self {
        use idempotency_core::Refusal as Engine;
        match refusal {
            Engine::InProgress { retry_after } => Self::InProgress { retry_after },
            Engine::KeyReused => Self::KeyReused,
            Engine::OutcomeLost { .. } => Self::OutcomeLost,
            // A permanent failure, and any refusal a later engine adds: not run again.
            _ => Self::FailedPermanently,
        }
    }
}

impl From<&idempotency_core::Error> for Refusal {
    /// The layer's answer to an engine error: the store failing (or a write of unknown
    /// outcome) is `503` with `Retry-After`, a fenced completion `409` lease-lost, a stored
    /// record that cannot be read `500`, and anything else the handler's failure (`500`).
    fn from(error: &idempotency_core::Error) -> Self {
        use idempotency_core::Error;
        match error {
            Error::LeaseLost { .. } => Self::LeaseLost,
            Error::Backend { .. } | Error::OutcomeUnknown { .. } => {
                Self::StoreUnavailable(error.to_string())
            }
            Error::CorruptRecord { .. } | Error::StoredOutcome { .. } => {
                Self::StoredResponseUnreadable(error.to_string())
            }
            Error::InvalidScope(e) => Self::ScopeInvalid(e.to_string()),
            _ => Self::HandlerFailed,
        }
    }
}

impl Refusal {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::KeyRequired
            | Self::KeyInvalid(_)
            | Self::ScopeInvalid(_)
            | Self::BodyUnreadable(_) => StatusCode::BAD_REQUEST,
            Self::CallerUnidentified => StatusCode::UNAUTHORIZED,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::InProgress { .. } | Self::LeaseLost => StatusCode::CONFLICT,
            Self::KeyReused | Self::FailedPermanently | Self::OutcomeLost => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            Self::StoreUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::NotReplayable { status, .. } => *status,
            Self::StoredResponseUnreadable(_) | Self::HandlerFailed => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The stable type slug, appended to the problem type base.
    pub fn slug(&self) -> &'static str {
        match self {
            Self::KeyRequired => "idempotency-key-required",
            Self::KeyInvalid(_) => "idempotency-key-invalid",
            Self::CallerUnidentified => "idempotency-caller-unidentified",
            Self::ScopeInvalid(_) => "idempotency-scope-invalid",
            Self::BodyTooLarge { .. } => "request-body-too-large",
            Self::BodyUnreadable(_) => "request-body-unreadable",
            Self::InProgress { .. } => "idempotency-key-in-progress",
            Self::KeyReused => "idempotency-key-reused",
            Self::FailedPermanently => "idempotency-key-failed-permanently",
            Self::OutcomeLost => "idempotency-key-outcome-lost",
            Self::StoreUnavailable(_) => "idempotency-store-unavailable",
            Self::StoredResponseUnreadable(_) => "idempotency-stored-response-unreadable",
            Self::NotReplayable { .. } => "idempotency-response-not-replayable",
            Self::HandlerFailed => "handler-failed",
            Self::LeaseLost => "idempotency-key-lease-lost",
        }
    }

    /// The stable code, for clients that match on codes rather than types.
    pub fn code(&self) -> &'static str {
        match self {
            Self::KeyRequired => "IDEMPOTENCY_KEY_REQUIRED",
            Self::KeyInvalid(_) => "IDEMPOTENCY_KEY_INVALID",
            Self::CallerUnidentified => "IDEMPOTENCY_CALLER_UNIDENTIFIED",
            Self::ScopeInvalid(_) => "IDEMPOTENCY_SCOPE_INVALID",
            Self::BodyTooLarge { .. } => "REQUEST_BODY_TOO_LARGE",
            Self::BodyUnreadable(_) => "REQUEST_BODY_UNREADABLE",
            Self::InProgress { .. } => "IDEMPOTENCY_KEY_IN_PROGRESS",
            Self::KeyReused => "IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD",
            Self::FailedPermanently => "IDEMPOTENCY_KEY_FAILED_PERMANENTLY",
            Self::OutcomeLost => "IDEMPOTENCY_KEY_OUTCOME_LOST",
            Self::StoreUnavailable(_) => "IDEMPOTENCY_STORE_UNAVAILABLE",
            Self::StoredResponseUnreadable(_) => "IDEMPOTENCY_STORED_RESPONSE_UNREADABLE",
            Self::NotReplayable { .. } => "IDEMPOTENCY_RESPONSE_NOT_REPLAYABLE",
            Self::HandlerFailed => "HANDLER_FAILED",
            Self::LeaseLost => "IDEMPOTENCY_KEY_LEASE_LOST",
        }
    }

    /// A short, fixed summary of the problem type.
    pub fn title(&self) -> &'static str {
        match self {
            Self::KeyRequired => "Idempotency-Key header is required",
            Self::KeyInvalid(_) => "The Idempotency-Key header is malformed",
            Self::CallerUnidentified => "The caller could not be identified",
            Self::ScopeInvalid(_) => "The idempotency scope is invalid",
            Self::BodyTooLarge { .. } => "The request body is too large",
            Self::BodyUnreadable(_) => "The request body could not be read",
            Self::InProgress { .. } => "A request with this Idempotency-Key is still in progress",
            Self::KeyReused => "This Idempotency-Key was used with a different request",
            Self::FailedPermanently => "The request with this Idempotency-Key failed permanently",
            Self::OutcomeLost => {
                "The request with this Idempotency-Key ran, but its response was not kept"
            }
            Self::StoreUnavailable(_) => "The idempotency store is unavailable",
            Self::StoredResponseUnreadable(_) => "The stored response could not be read",
            Self::NotReplayable { .. } => "The request ran, but its response was not kept",
            Self::HandlerFailed => "The request failed on the server",
            Self::LeaseLost => "This request lost its claim on the Idempotency-Key",
        }
    }

    /// What happened in this occurrence, safe to show to the client (no store internals).
    pub fn detail(&self) -> String {
        match self {
            Self::KeyRequired => {
                "Idempotency-Key header is required: send one unique key per operation and reuse it on every retry".into()
            }
            Self::KeyInvalid(e) => e.to_string(),
            Self::CallerUnidentified => {
                "idempotent requests need an authenticated caller to scope the key to".into()
            }
            Self::ScopeInvalid(_) => "the caller identity and route do not form a valid idempotency scope".into(),
            Self::BodyTooLarge { limit } => {
                format!("the request body is larger than the {limit}-byte limit for idempotent requests")
            }
            Self::BodyUnreadable(_) => "the request body could not be read to the end".into(),
            Self::InProgress { retry_after } => format!(
                "the first request with this key is still running, or it ended without a stored \
                 outcome (storing it failed, or the service holds such keys) and the key is \
                 held until its lease passes; retry after {} s",
                retry_after_secs(*retry_after)
            ),
            Self::KeyReused => "the key was already used with a different method, path, query, content type or body; use a new key for a new operation".into(),
            Self::FailedPermanently => "the first request with this key failed in a way that retrying will not fix; it is not run again under this key".into(),
            Self::OutcomeLost => "the first request with this key ran, but its response could not be stored; it may have taken effect and is not run again under this key: check its effect before sending a new request with a new key".into(),
            Self::StoreUnavailable(_) => "the request was not run because its key could not be recorded; retry later".into(),
            Self::StoredResponseUnreadable(_) => "the outcome stored for this key cannot be replayed".into(),
            Self::NotReplayable { status, reason } => {
                let why = match reason {
                    NotReplayable::TooLarge => "was too large to keep",
                    NotReplayable::BodyFailed => "failed while it was being read",
                    NotReplayable::StatusNotStored => "has a status this service does not keep",
                };
                format!(
                    "the request with this key ran and answered {}, but its response {why}; it is not run again under this key (the status and headers such as Location are the original ones)",
                    status.as_u16()
                )
            }
            Self::HandlerFailed => "the request failed before producing a response; a retry with the same key is told what became of it".into(),
            Self::LeaseLost => "this request took longer than its lease and another request with the key took it over; nothing it did was kept. Retry with the same key to get the outcome of that request".into(),
        }
    }

    /// Whether sending the same request again may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::InProgress { .. }
                | Self::StoreUnavailable(_)
                | Self::HandlerFailed
                | Self::LeaseLost
        )
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.status(), self.slug(), self.detail())
    }
}

/// `Retry-After` in whole seconds: rounded up, at least 1.
pub fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.max(1)
}

/// Writes refusals as responses. Implement it (or pass a closure
/// `Fn(&Refusal) -> Response<Bytes>`) to answer in your API's own error format.
///
/// The layer adds `Retry-After` to an [`Refusal::InProgress`] answer when the responder did
/// not set it.
pub trait RefusalResponder: Send + Sync + 'static {
    /// The response for `refusal`.
    fn respond(&self, refusal: &Refusal) -> Response<Bytes>;
}

impl<F> RefusalResponder for F
where
    F: Fn(&Refusal) -> Response<Bytes> + Send + Sync + 'static,
{
    fn respond(&self, refusal: &Refusal) -> Response<Bytes> {
        self(refusal)
    }
}

/// The default responder: an RFC 9457 `application/problem+json` document whose `type` is
/// `type_base` followed by the refusal's slug, with `code` as an extension member.
///
/// ```
/// use idempotency_tower::{ProblemJson, Refusal, RefusalResponder};
///
/// let r = ProblemJson::new("https://api.example.com/problems/").respond(&Refusal::KeyReused);
/// assert_eq!(r.status(), 422);
/// let doc: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
/// assert_eq!(doc["type"], "https://api.example.com/problems/idempotency-key-reused");
/// assert_eq!(doc["code"], "IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD");
/// ```
#[derive(Debug, Clone)]
pub struct ProblemJson {
    type_base: String,
}

impl ProblemJson {
    /// The default type base, a URN so that no documentation host is implied.
    pub const DEFAULT_TYPE_BASE: &'static str = "urn:idempotency:problem:";

    /// Problem types under `type_base` (for example your API's error documentation URL).
    pub fn new(type_base: impl Into<String>) -> Self {
        Self {
            type_base: type_base.into(),
        }
    }
}

impl ProblemJson {
    /// The whole answer to `refusal`: the problem document with the headers its status calls
    /// for, as the layer sends it (`Retry-After` on a `409` in progress or lease lost and on a
    /// `503`, one second for the store's outage; `WWW-Authenticate: Bearer` on a `401`).
    ///
    /// ```
    /// use idempotency_tower::{ProblemJson, Refusal};
    /// use std::time::Duration;
    ///
    /// let engine = idempotency_core::Refusal::InProgress { retry_after: Duration::from_millis(1500) };
    /// let r = ProblemJson::new("urn:rides:problem:").response(&Refusal::from(engine));
    /// assert_eq!(r.status(), 409);
    /// assert_eq!(r.headers()["retry-after"], "2");
    /// ```
    pub fn response(&self, refusal: &Refusal) -> Response<Bytes> {
        let mut resp = self.respond(refusal);
        add_headers(
            &mut resp,
            refusal,
            crate::IdempotencyLayer::DEFAULT_UNAVAILABLE_RETRY_AFTER,
            &HeaderValue::from_static("Bearer"),
        );
        resp
    }
}

/// Adds the headers `refusal`'s status calls for, unless the responder set them itself.
pub(crate) fn add_headers(
    resp: &mut Response<Bytes>,
    refusal: &Refusal,
    unavailable_retry_after: Duration,
    challenge: &HeaderValue,
) {
    use crate::headers::{RETRY_AFTER, WWW_AUTHENTICATE};
    let (name, value) = match refusal {
        Refusal::InProgress { retry_after } => (
            RETRY_AFTER,
            HeaderValue::from(retry_after_secs(*retry_after)),
        ),
        Refusal::StoreUnavailable(_) => (
            RETRY_AFTER,
            HeaderValue::from(retry_after_secs(unavailable_retry_after)),
        ),
        // The request that took the key over is running: its outcome is the retry's answer.
        Refusal::LeaseLost => (RETRY_AFTER, HeaderValue::from(1u64)),
        Refusal::CallerUnidentified => (WWW_AUTHENTICATE, challenge.clone()),
        _ => return,
    };
    if !resp.headers().contains_key(&name) {
        resp.headers_mut().insert(name, value);
    }
}

/// With the `axum` feature a refusal is a response: the default problem document
/// ([`ProblemJson::response`]). The response carries the refusal in its extensions, so that
/// behind a layer with [`handler_claims`](crate::IdempotencyLayer::handler_claims) the layer
/// writes it with its own responder and problem types instead.
#[cfg(feature = "axum")]
impl axum::response::IntoResponse for Refusal {
    fn into_response(self) -> axum::response::Response {
        let mut resp = ProblemJson::default()
            .response(&self)
            .map(axum::body::Body::from);
        resp.extensions_mut().insert(self);
        resp
    }
}

impl Default for ProblemJson {
    fn default() -> Self {
        Self::new(Self::DEFAULT_TYPE_BASE)
    }
}

impl RefusalResponder for ProblemJson {
    fn respond(&self, refusal: &Refusal) -> Response<Bytes> {
        let status = refusal.status();
        let mut doc = serde_json::json!({
            "type": format!("{}{}", self.type_base, refusal.slug()),
            "title": refusal.title(),
            "status": status.as_u16(),
            "detail": refusal.detail(),
            "code": refusal.code(),
        });
        if let Refusal::InProgress { retry_after } = refusal {
            doc["retry_after"] = retry_after_secs(*retry_after).into();
        }
        if let Refusal::BodyTooLarge { limit } = refusal {
            doc["limit"] = (*limit).into();
        }
        if let Refusal::NotReplayable { reason, .. } = refusal {
            doc["reason"] = reason.as_str().into();
        }
        let body = serde_json::to_vec(&doc).unwrap_or_default();
        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = status;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every engine refusal and error has one answer in the layer's words, with the headers
    /// its status calls for.
    #[test]
    fn engine_refusals_and_errors_convert_to_the_layers_answers() {
        use idempotency_core::{Error, Refusal as Engine};
        let cases = [
            (
                Refusal::from(Engine::InProgress {
                    retry_after: Duration::from_millis(2500),
                }),
                409,
                "idempotency-key-in-progress",
                Some("3"),
            ),
            (
                Refusal::from(Engine::KeyReused),
                422,
                "idempotency-key-reused",
                None,
            ),
            (
                Refusal::from(Engine::FailedPermanently {
                    message: "declined".into(),
                }),
                422,
                "idempotency-key-failed-permanently",
                None,
            ),
            (
                Refusal::from(Engine::OutcomeLost {
                    message: "too large".into(),
                }),
                422,
                "idempotency-key-outcome-lost",
                None,
            ),
            (
                Refusal::from(&Error::backend(true, "connection refused")),
                503,
                "idempotency-store-unavailable",
                Some("1"),
            ),
            (
                Refusal::from(&Error::LeaseLost {
                    token: idempotency_core::FencingToken(4),
                }),
                409,
                "idempotency-key-lease-lost",
                Some("1"),
            ),
            (
                Refusal::from(&Error::corrupt("bad")),
                500,
                "idempotency-stored-response-unreadable",
                None,
            ),
            (
                Refusal::from(&Error::Config("x".into())),
                500,
                "handler-failed",
                None,
            ),
        ];
        for (refusal, status, slug, retry_after) in cases {
            assert_eq!((refusal.status().as_u16(), refusal.slug()), (status, slug));
            let resp = ProblemJson::new("urn:t:").response(&refusal);
            assert_eq!(resp.status().as_u16(), status, "{refusal:?}");
            assert_eq!(
                resp.headers()
                    .get(http::header::RETRY_AFTER)
                    .map(|v| v.to_str().unwrap()),
                retry_after,
                "{refusal:?}"
            );
            let doc: serde_json::Value = serde_json::from_slice(resp.body()).unwrap();
            assert_eq!(doc["type"], format!("urn:t:{slug}"));
        }
    }

    #[test]
    fn retry_after_rounds_up_to_at_least_one() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1000)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }

    #[test]
    fn every_refusal_is_a_problem_document() {
        let all = [
            Refusal::KeyRequired,
            Refusal::KeyInvalid(KeyHeaderError::AmbiguousComma),
            Refusal::CallerUnidentified,
            Refusal::ScopeInvalid("internal-42".into()),
            Refusal::BodyTooLarge { limit: 10 },
            Refusal::BodyUnreadable("internal-42".into()),
            Refusal::InProgress {
                retry_after: Duration::from_millis(1500),
            },
            Refusal::KeyReused,
            Refusal::StoreUnavailable("internal-42".into()),
            Refusal::StoredResponseUnreadable("internal-42".into()),
            Refusal::NotReplayable {
                status: StatusCode::CREATED,
                reason: NotReplayable::TooLarge,
            },
            Refusal::HandlerFailed,
            Refusal::LeaseLost,
        ];
        let mut slugs = std::collections::HashSet::new();
        for r in &all {
            let resp = ProblemJson::default().respond(r);
            assert_eq!(resp.status(), r.status());
            assert_eq!(resp.headers()[CONTENT_TYPE], PROBLEM_JSON);
            let doc: serde_json::Value = serde_json::from_slice(resp.body()).unwrap();
            assert_eq!(doc["status"], r.status().as_u16());
            assert_eq!(
                doc["type"],
                format!("{}{}", ProblemJson::DEFAULT_TYPE_BASE, r.slug())
            );
            assert!(!doc["title"].as_str().unwrap().is_empty());
            assert!(!doc["detail"].as_str().unwrap().is_empty());
            assert!(slugs.insert(r.slug()), "duplicate slug {}", r.slug());
            // Internal messages never reach the client.
            if let Refusal::StoreUnavailable(m) | Refusal::StoredResponseUnreadable(m) = r {
                assert!(!doc["detail"].as_str().unwrap().contains(m.as_str()));
            }
        }
        let resp = ProblemJson::default().respond(&all[6]);
        let doc: serde_json::Value = serde_json::from_slice(resp.body()).unwrap();
        assert_eq!(doc["retry_after"], 2);
    }
}
