//! Why an idempotent operation did not end with a response.

use crate::policy::GiveUpReason;
use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use idempotency_core::IdempotencyKey;
use std::fmt;
use std::time::Duration;

/// Why an idempotent request did not end with its answer.
///
/// The middleware returns it inside [`reqwest_middleware::Error::Middleware`]; get it back
/// with [`Error::find`]. Each variant that was sent carries the key and the number of
/// attempts, so the operation can be logged, stored, or retried later under the same key.
///
/// ```
/// # async fn demo(client: reqwest_middleware::ClientWithMiddleware) {
/// use idempotency_reqwest::{Error, IdempotentRequestExt};
///
/// match client.post("http://127.0.0.1:8080/payments").idempotent().send().await {
///     Ok(response) => { /* the operation's answer, first or replayed */ }
///     Err(e) => match Error::find(&e) {
///         Some(Error::KeyReused { .. }) => { /* a bug: one key, two different requests */ }
///         Some(e) if e.is_retryable() => { /* try again later with e.key() */ }
///         Some(e) => eprintln!("refused: {e}"),
///         None => eprintln!("another middleware failed: {e}"),
///     },
/// }
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request's body is a stream, which cannot be sent a second time byte for byte. Not
    /// sent at all. Give the request its body as bytes (`.body(Vec<u8>)`, `.json(..)`), or
    /// send it without marking it idempotent.
    #[error(
        "the idempotent request {method} {target} has a streaming body, which cannot be sent \
         again byte for byte; it was not sent (give it a buffered body, for example bytes or \
         .json(..))"
    )]
    BodyNotReplayable {
        /// The request's method.
        method: Method,
        /// The request's origin and path (the query is left out, it may hold secrets).
        target: String,
    },
    /// The key cannot be used: the caller's `Idempotency-Key` header is malformed or set twice,
    /// or the key cannot be written in a header. Not sent.
    #[error("the idempotent request was not sent: {reason}")]
    InvalidKey {
        /// What is wrong with it.
        reason: String,
    },
    /// The request carries an `Idempotency-Key` header and was marked with another key. Not
    /// sent: the middleware never overwrites a key the caller set, and sending the header's
    /// key would break the promise the other one made.
    #[error(
        "the idempotent request was not sent: its Idempotency-Key header holds one key and it \
         was marked with another"
    )]
    ConflictingKeys {
        /// The key in the header.
        header: IdempotencyKey,
        /// The key the request was marked with.
        marked: IdempotencyKey,
    },
    /// `422`: the server has seen this key with a different request (method, path, query,
    /// content type, body or a fingerprinted header). Not retried: a new operation needs a
    /// new key, and the same operation must be sent with the same bytes.
    #[error(
        "the server refused the request (422): its key was used before with a different \
         request; a new operation needs a new key{}",
        detail(problem)
    )]
    KeyReused {
        /// The key that was sent.
        key: IdempotencyKey,
        /// Attempts made (the refused one included).
        attempts: u32,
        /// The server's problem document, when it sent one.
        problem: Option<Problem>,
    },
    /// `422`: the first request with this key failed in a way the server will not run again
    /// under the key. Not retried.
    #[error(
        "the server refused the request (422): the first request with this key failed \
         permanently and is not run again under it{}",
        detail(problem)
    )]
    FailedPermanently {
        /// The key that was sent.
        key: IdempotencyKey,
        /// Attempts made (the refused one included).
        attempts: u32,
        /// The server's problem document, when it sent one.
        problem: Option<Problem>,
    },
    /// `422`: the first request with this key ran, but the server could not keep its answer:
    /// it may have taken effect, and is not run again under the key. Not retried; find out
    /// whether it took effect before sending the operation again under a new key.
    #[error(
        "the server refused the request (422): the first request with this key ran, but its \
         answer was not kept; it may have taken effect{}",
        detail(problem)
    )]
    OutcomeLost {
        /// The key that was sent.
        key: IdempotencyKey,
        /// Attempts made (the refused one included).
        attempts: u32,
        /// The server's problem document, when it sent one.
        problem: Option<Problem>,
    },
    /// Another `4xx` (`400`, `401`, `404`, a validation `422`, a `409` that is the handler's
    /// own conflict rather than the server's in-progress refusal…), or any `4xx` the server
    /// replayed (`Idempotent-Replayed: true`, the stored answer of an earlier attempt): the
    /// request itself is refused, and sending it again cannot change that. Not retried.
    #[error("the server refused the request ({status}){}", detail(problem))]
    Rejected {
        /// The key that was sent.
        key: IdempotencyKey,
        /// Attempts made (the refused one included).
        attempts: u32,
        /// The answer's status.
        status: StatusCode,
        /// The answer's headers.
        headers: HeaderMap,
        /// The answer's body (its first [`Error::MAX_KEPT_BODY`] bytes).
        body: Bytes,
        /// The server's problem document, when it sent one.
        problem: Option<Problem>,
    },
    /// Every attempt failed in a way worth retrying, and the policy stopped. Nothing says
    /// whether the operation ran: send it again later **with the same key** and the server
    /// runs it once or replays its outcome.
    #[error("gave up after {attempts} attempts in {elapsed:.1?} ({reason}); the last {last}")]
    GaveUp {
        /// The key that was sent.
        key: IdempotencyKey,
        /// Attempts made.
        attempts: u32,
        /// Time since the first attempt started.
        elapsed: Duration,
        /// Why the policy stopped.
        reason: GiveUpReason,
        /// What the last attempt got.
        #[source]
        last: LastFailure,
    },
    /// The request failed in a way another attempt cannot fix (an invalid URL, a redirect
    /// loop, a body error). Not retried.
    #[error("the idempotent request failed after {attempts} attempts: {source}")]
    Send {
        /// The key that was sent.
        key: IdempotencyKey,
        /// Attempts made.
        attempts: u32,
        /// reqwest's error.
        #[source]
        source: reqwest::Error,
    },
}

impl Error {
    /// How many bytes of a refused answer's body are kept in [`Error::Rejected`].
    pub const MAX_KEPT_BODY: usize = 64 * 1024;

    /// The idempotency error inside a `reqwest_middleware` error, if the idempotency
    /// middleware returned it.
    pub fn find(e: &reqwest_middleware::Error) -> Option<&Error> {
        match e {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<Error>(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }

    /// The key the request was sent with; `None` when it was not sent.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        match self {
            Self::KeyReused { key, .. }
            | Self::FailedPermanently { key, .. }
            | Self::OutcomeLost { key, .. }
            | Self::Rejected { key, .. }
            | Self::GaveUp { key, .. }
            | Self::Send { key, .. } => Some(key),
            Self::BodyNotReplayable { .. }
            | Self::InvalidKey { .. }
            | Self::ConflictingKeys { .. } => None,
        }
    }

    /// How many attempts were made (0 when the request was not sent).
    pub fn attempts(&self) -> u32 {
        match self {
            Self::KeyReused { attempts, .. }
            | Self::FailedPermanently { attempts, .. }
            | Self::OutcomeLost { attempts, .. }
            | Self::Rejected { attempts, .. }
            | Self::GaveUp { attempts, .. }
            | Self::Send { attempts, .. } => *attempts,
            Self::BodyNotReplayable { .. }
            | Self::InvalidKey { .. }
            | Self::ConflictingKeys { .. } => 0,
        }
    }

    /// The status of the answer that ended the operation, if it ended with one.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::KeyReused { .. } | Self::FailedPermanently { .. } | Self::OutcomeLost { .. } => {
                Some(StatusCode::UNPROCESSABLE_ENTITY)
            }
            Self::Rejected { status, .. } => Some(*status),
            Self::GaveUp {
                last: LastFailure::Status { status, .. },
                ..
            } => Some(*status),
            _ => None,
        }
    }

    /// The server's problem document, if the answer that ended the operation had one.
    pub fn problem(&self) -> Option<&Problem> {
        match self {
            Self::KeyReused { problem, .. }
            | Self::FailedPermanently { problem, .. }
            | Self::OutcomeLost { problem, .. }
            | Self::Rejected { problem, .. }
            | Self::GaveUp {
                last: LastFailure::Status { problem, .. },
                ..
            } => problem.as_ref(),
            _ => None,
        }
    }

    /// Whether sending the same request again, with the same key, may succeed: true only for
    /// [`Error::GaveUp`].
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::GaveUp { .. })
    }
}

impl From<Error> for reqwest_middleware::Error {
    fn from(e: Error) -> Self {
        reqwest_middleware::Error::Middleware(anyhow::Error::new(e))
    }
}

/// What the last attempt of an operation that gave up got.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LastFailure {
    /// An answer worth retrying: an unreplayed `5xx`, `408`, `425` or `429`, or the server's
    /// `409` saying another attempt holds the key (see [`RetryPolicy`](crate::RetryPolicy)).
    #[error("answer was {status}{}", detail(problem))]
    Status {
        /// The answer's status.
        status: StatusCode,
        /// Its `Retry-After`, when it had one.
        retry_after: Option<Duration>,
        /// Its problem document, when it had one.
        problem: Option<Problem>,
    },
    /// No answer: the connection failed or was closed, or the attempt timed out.
    #[error("attempt failed: {0}")]
    Transport(#[source] reqwest::Error),
}

/// The members of an RFC 9457 problem document a client acts on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// `type`: a URI naming the problem.
    pub problem_type: Option<String>,
    /// `title`: a short summary of the problem type.
    pub title: Option<String>,
    /// `detail`: what happened in this occurrence.
    pub detail: Option<String>,
    /// `code`: a stable code, as some servers add (for example
    /// `IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD`).
    pub code: Option<String>,
}

impl Problem {
    /// Reads a problem document from a JSON body (`application/problem+json` or
    /// `application/json`); `None` when it is not one.
    pub fn parse(headers: &HeaderMap, body: &[u8]) -> Option<Self> {
        let media = headers
            .get(http::header::CONTENT_TYPE)?
            .to_str()
            .ok()?
            .split(';')
            .next()?
            .trim()
            .to_ascii_lowercase();
        if media != "application/problem+json" && media != "application/json" {
            return None;
        }
        let doc: serde_json::Value = serde_json::from_slice(body).ok()?;
        let member = |name: &str| doc.get(name).and_then(|v| v.as_str()).map(str::to_owned);
        let problem = Self {
            problem_type: member("type"),
            title: member("title"),
            detail: member("detail"),
            code: member("code"),
        };
        (problem != Self::default()).then_some(problem)
    }

    /// Whether the problem type ends with `slug` (problem types are often a base URI followed
    /// by a slug, such as `…/idempotency-key-reused`).
    pub fn has_slug(&self, slug: &str) -> bool {
        self.problem_type.as_deref().is_some_and(|t| {
            t.strip_suffix(slug)
                .is_some_and(|base| base.is_empty() || base.ends_with([':', '/', '#']))
        })
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self
            .detail
            .as_deref()
            .or(self.title.as_deref())
            .unwrap_or("no detail");
        match &self.problem_type {
            Some(t) => write!(f, "{text} ({t})"),
            None => f.write_str(text),
        }
    }
}

fn detail(problem: &Option<Problem>) -> String {
    problem
        .as_ref()
        .map(|p| format!(": {p}"))
        .unwrap_or_default()
}

/// The codes and slugs a server following the Idempotency-Key draft uses for a refused key.
pub(crate) fn refusal_kind(problem: Option<&Problem>) -> Option<RefusalKind> {
    let p = problem?;
    let code = p.code.as_deref();
    if p.has_slug("idempotency-key-reused")
        || code == Some("IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD")
    {
        Some(RefusalKind::KeyReused)
    } else if p.has_slug("idempotency-key-failed-permanently")
        || code == Some("IDEMPOTENCY_KEY_FAILED_PERMANENTLY")
    {
        Some(RefusalKind::FailedPermanently)
    } else if p.has_slug("idempotency-key-outcome-lost")
        || code == Some("IDEMPOTENCY_KEY_OUTCOME_LOST")
    {
        Some(RefusalKind::OutcomeLost)
    } else {
        None
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RefusalKind {
    KeyReused,
    FailedPermanently,
    OutcomeLost,
}

/// The problem type slugs and codes of the `409`s that say another attempt holds the key:
/// the server's in-progress refusal, and its lease-lost one (the request that took the key
/// over answers the retry).
const KEY_HELD_ELSEWHERE: [(&str, &str); 2] = [
    ("idempotency-key-in-progress", "IDEMPOTENCY_KEY_IN_PROGRESS"),
    ("idempotency-key-lease-lost", "IDEMPOTENCY_KEY_LEASE_LOST"),
];

/// Whether an unreplayed `409` says another attempt holds the key, so that a retry may get
/// another answer. `body` is its body, `None` when it is longer than
/// [`RetryPolicy::MAX_CONFLICT_BODY`] (then it is not the server's refusal). A problem
/// document with a type (other than `about:blank`) or a code decides by them; without one,
/// a `Retry-After` does.
pub(crate) fn conflict_is_retryable(headers: &HeaderMap, body: Option<&[u8]>) -> bool {
    let Some(body) = body else {
        return false;
    };
    let problem = Problem::parse(headers, body);
    let problem_type = problem
        .as_ref()
        .and_then(|p| p.problem_type.as_deref())
        .map(str::trim)
        .filter(|t| !t.is_empty() && !t.eq_ignore_ascii_case("about:blank"));
    let code = problem
        .as_ref()
        .and_then(|p| p.code.as_deref())
        .map(str::trim);
    if problem_type.is_none() && code.is_none() {
        return headers.contains_key(http::header::RETRY_AFTER);
    }
    KEY_HELD_ELSEWHERE.iter().any(|(slug, expected_code)| {
        problem_type.is_some_and(|t| type_ends_with(t, slug))
            || code.is_some_and(|c| c.eq_ignore_ascii_case(expected_code))
    })
}

/// Whether a problem type ends in `slug`, whatever the base before it (a URN, a URL, a
/// fragment) and however cased; a trailing `/` is ignored.
fn type_ends_with(problem_type: &str, slug: &str) -> bool {
    let t = problem_type.trim_end_matches('/').as_bytes();
    t.len() >= slug.len() && t[t.len() - slug.len()..].eq_ignore_ascii_case(slug.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn json(ct: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
        h
    }

    #[test]
    fn problem_documents_are_read_and_matched() {
        let body = br#"{"type":"urn:books-api:problem:idempotency-key-reused","title":"t",
            "status":422,"code":"IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD"}"#;
        let p = Problem::parse(&json("application/problem+json"), body).unwrap();
        assert!(p.has_slug("idempotency-key-reused"));
        assert!(!p.has_slug("key-reused"));
        assert_eq!(refusal_kind(Some(&p)), Some(RefusalKind::KeyReused));
        let other = Problem::parse(
            &json("application/json; charset=utf-8"),
            br#"{"type":"urn:x:validation-failed"}"#,
        )
        .unwrap();
        assert_eq!(refusal_kind(Some(&other)), None);
        assert_eq!(Problem::parse(&json("text/plain"), body), None);
        assert_eq!(Problem::parse(&json("application/json"), b"[1]"), None);
        assert_eq!(
            Problem::parse(&json("application/json"), b"{\"a\":1}"),
            None
        );
        assert_eq!(Problem::parse(&HeaderMap::new(), body), None);
        assert_eq!(Problem::parse(&json("application/json"), b"\xff{"), None);
    }

    /// A failure and a lost outcome are told apart, by slug or by code, as the tower layer
    /// sends them.
    #[test]
    fn a_lost_outcome_is_not_a_permanent_failure() {
        let kind = |body: &[u8]| {
            refusal_kind(Problem::parse(&json("application/problem+json"), body).as_ref())
        };
        assert_eq!(
            kind(br#"{"type":"urn:x:problem:idempotency-key-outcome-lost"}"#),
            Some(RefusalKind::OutcomeLost)
        );
        assert_eq!(
            kind(br#"{"type":"about:blank","code":"IDEMPOTENCY_KEY_OUTCOME_LOST"}"#),
            Some(RefusalKind::OutcomeLost)
        );
        assert_eq!(
            kind(br#"{"type":"urn:x:problem:idempotency-key-failed-permanently"}"#),
            Some(RefusalKind::FailedPermanently)
        );
        let lost = Error::OutcomeLost {
            key: IdempotencyKey::new("k").unwrap(),
            attempts: 1,
            problem: None,
        };
        assert!(lost.to_string().contains("may have taken effect"), "{lost}");
        assert_eq!(lost.status(), Some(StatusCode::UNPROCESSABLE_ENTITY));
        assert!(!lost.is_retryable());
    }

    #[test]
    fn errors_say_why_and_travel_through_reqwest_middleware() {
        let e = Error::KeyReused {
            key: IdempotencyKey::new("k").unwrap(),
            attempts: 1,
            problem: None,
        };
        assert!(e
            .to_string()
            .contains("used before with a different request"));
        let wrapped: reqwest_middleware::Error = e.into();
        let found = Error::find(&wrapped).unwrap();
        assert_eq!(found.attempts(), 1);
        assert_eq!(found.status(), Some(StatusCode::UNPROCESSABLE_ENTITY));
        assert!(!found.is_retryable());
    }

    #[test]
    fn only_the_key_held_elsewhere_409_is_retried() {
        let headers = |ct: Option<&'static str>, retry_after: bool| {
            let mut h = HeaderMap::new();
            if let Some(ct) = ct {
                h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
            }
            if retry_after {
                h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            h
        };
        let problem = headers(Some("application/problem+json"), false);
        let problem_ra = headers(Some("application/problem+json"), true);
        let retried = |h: &HeaderMap, body: &str| conflict_is_retryable(h, Some(body.as_bytes()));
        for t in [
            "urn:idempotency:problem:idempotency-key-in-progress",
            "https://api.example.com/problems/idempotency-key-in-progress",
            "https://api.example.com/problems/Idempotency-Key-In-Progress/",
            "https://api.example.com/errors#idempotency-key-in-progress",
            "idempotency-key-in-progress",
            "urn:idempotency:problem:idempotency-key-lease-lost",
        ] {
            let body = format!(r#"{{"type":"{t}","status":409}}"#);
            assert!(retried(&problem, &body), "{t}");
            assert!(retried(&problem_ra, &body), "{t}");
        }
        // The code alone names it too (a type that says nothing more).
        for body in [
            r#"{"code":"IDEMPOTENCY_KEY_IN_PROGRESS"}"#,
            r#"{"type":"about:blank","code":"IDEMPOTENCY_KEY_LEASE_LOST"}"#,
        ] {
            assert!(retried(&problem, body), "{body}");
        }
        // The handler's own conflicts are final, Retry-After or not.
        for body in [
            r#"{"type":"https://example.com/problems/out-of-stock","status":409}"#,
            r#"{"type":"urn:x:idempotency-key-in-progress-elsewhere"}"#,
            r#"{"code":"SEAT_TAKEN"}"#,
        ] {
            assert!(!retried(&problem, body), "{body}");
            assert!(!retried(&problem_ra, body), "{body}");
        }
        // No readable type: a Retry-After decides.
        for (h, body) in [
            (headers(Some("text/plain"), true), "busy"),
            (headers(None, true), ""),
            (problem_ra.clone(), r#"{"title":"Conflict"}"#),
            (problem_ra.clone(), r#"{"type":"about:blank"}"#),
            (
                headers(Some("application/json"), true),
                r#"{"error":"busy"}"#,
            ),
        ] {
            assert!(retried(&h, body), "{body}");
            let mut without = h.clone();
            without.remove(http::header::RETRY_AFTER);
            assert!(!retried(&without, body), "{body}");
        }
        // A body past the bound is not the server's refusal, whatever else.
        assert!(!conflict_is_retryable(&problem_ra, None));
    }
}
