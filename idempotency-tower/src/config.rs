//! The configuration the layer builds and every service it makes shares.

use crate::fingerprint::FingerprintInput;
use crate::headers::{
    DEFAULT_FINGERPRINT_HEADERS, DEFAULT_REPLAYED, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED,
    NEVER_REPLAYED,
};
use crate::hooks::ResponseContext;
use crate::problem::{ProblemJson, RefusalResponder};
use crate::stored::StoredResponse;
use crate::IdempotencyLayer;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use idempotency_core::{Fingerprint, Idempotency, IdempotencyKey};
use std::sync::Arc;
use std::time::Duration;

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type RouteFn = dyn Fn(&Parts) -> String + Send + Sync;
type StoreStatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;
type FingerprintFn = dyn Fn(&FingerprintInput<'_>) -> Fingerprint + Send + Sync;
type KeyValidatorFn = dyn Fn(&IdempotencyKey) -> Result<(), String> + Send + Sync;
type ResponseHookFn = dyn Fn(&ResponseContext<'_>, &mut HeaderMap) + Send + Sync;

/// What the layer does when the handler ran but its response cannot be stored for replay: the
/// body is larger than the response limit, or it failed while the layer read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnUnreplayable {
    /// Record that the handler ran, with its status and allowlisted headers (the default).
    /// The key is not free for a second execution: a retry gets the original status and
    /// headers (`Location` included) with an `idempotency-response-not-replayable` problem
    /// document as the body, marked replayed.
    #[default]
    Record,
    /// Release the key, so a retry runs the handler again. Only for handlers that are safe to
    /// run twice.
    Release,
}

/// What the layer does with the key when the handler answered with a status the layer was told
/// not to store ([`IdempotencyLayer::store_status`]; by default every status is stored) or
/// returned an error (a `Service` error, not a response).
///
/// A handler that failed may have acted first: it charged a card and then could not build its
/// response, or a timeout layer inside this one cut it off after it wrote. Running it again
/// would act twice, so by default the key is settled for good. A handler that knows it did
/// nothing frees the key itself, whatever this setting: it puts
/// [`NothingDone`](crate::NothingDone) in its response's extensions, or calls
/// [`ClaimedKey::rolled_back`](crate::ClaimedKey::rolled_back) after its own transaction rolled
/// back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnUnstored {
    /// Settle the key for good (the default): an answer is recorded without its body (its
    /// status and replayed headers; a retry is told the handler ran, with that status, and
    /// [`NotReplayable::StatusNotStored`](crate::NotReplayable::StatusNotStored)), an error as
    /// a lost outcome (a retry is told `422` `idempotency-key-outcome-lost`). No
    /// retry runs the handler again while the key is kept.
    #[default]
    Settle,
    /// Hold the key until its lease passes, without a write: a retry gets `409`
    /// `idempotency-key-in-progress` with `Retry-After` until then, and **runs the handler
    /// again** after (the lease is the engine's `Policy::lease`). Only for handlers whose
    /// failures may be retried once the lease has passed.
    Hold,
    /// Release the key at once, so a retry runs the handler again: only for handlers that
    /// fail only before they act. It also releases the key of a handler that panicked.
    Release,
}

/// The layer's options, shared (behind an `Arc`) by every service the layer makes and by the
/// claims it hands to handlers.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) engine: Idempotency,
    pub(crate) methods: Vec<Method>,
    pub(crate) required: bool,
    pub(crate) body_limit: usize,
    pub(crate) response_limit: usize,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) route: Arc<RouteFn>,
    pub(crate) store_status: Arc<StoreStatusFn>,
    pub(crate) replayed: Vec<HeaderName>,
    pub(crate) fail_open: bool,
    pub(crate) responder: Arc<dyn RefusalResponder>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) fingerprint_hook: Option<Arc<FingerprintFn>>,
    pub(crate) unreplayable: OnUnreplayable,
    pub(crate) unstored: OnUnstored,
    pub(crate) challenge: HeaderValue,
    pub(crate) max_retry_after: Duration,
    pub(crate) unavailable_retry_after: Duration,
    pub(crate) key_header: HeaderName,
    pub(crate) key_validator: Option<Arc<KeyValidatorFn>>,
    pub(crate) replayed_marker: Option<(HeaderName, HeaderValue)>,
    pub(crate) response_hook: Option<Arc<ResponseHookFn>>,
    /// The handler claims the key itself ([`IdempotencyLayer::handler_claims`]).
    pub(crate) handler_claims: bool,
}

impl Config {
    /// The defaults documented on [`IdempotencyLayer::per_caller`], for `scope`.
    pub(crate) fn new(engine: Idempotency, scope: Arc<ScopeFn>) -> Self {
        Self {
            engine,
            methods: vec![Method::POST, Method::PATCH],
            required: false,
            body_limit: IdempotencyLayer::DEFAULT_LIMIT,
            response_limit: IdempotencyLayer::DEFAULT_LIMIT,
            scope,
            route: RoutePart::Path.into_fn(),
            store_status: Arc::new(default_store_status),
            replayed: DEFAULT_REPLAYED.to_vec(),
            fail_open: false,
            responder: Arc::new(ProblemJson::default()),
            fingerprint_headers: DEFAULT_FINGERPRINT_HEADERS.to_vec(),
            fingerprint_hook: None,
            unreplayable: OnUnreplayable::Record,
            unstored: OnUnstored::Settle,
            challenge: HeaderValue::from_static("Bearer"),
            max_retry_after: IdempotencyLayer::DEFAULT_MAX_RETRY_AFTER,
            unavailable_retry_after: IdempotencyLayer::DEFAULT_UNAVAILABLE_RETRY_AFTER,
            key_header: IDEMPOTENCY_KEY,
            key_validator: None,
            replayed_marker: Some((IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"))),
            response_hook: None,
            handler_claims: false,
        }
    }

    pub(crate) fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    pub(crate) fn replays(&self, name: &HeaderName) -> bool {
        !NEVER_REPLAYED.contains(name)
            && self.replayed_marker.as_ref().is_none_or(|(m, _)| m != name)
            && self.replayed.contains(name)
    }

    /// The stored form of a response: its status, the headers of the replay allowlist and
    /// `body`.
    pub(crate) fn stored_response(
        &self,
        parts: &http::response::Parts,
        body: Bytes,
    ) -> StoredResponse {
        StoredResponse {
            status: parts.status,
            headers: parts
                .headers
                .iter()
                .filter(|(name, _)| self.replays(name))
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect(),
            body,
            not_replayable: None,
        }
    }

    pub(crate) fn hash_keys(&self) -> bool {
        self.engine.policy().hash_keys_in_logs
    }
}

/// The default rule for which responses are stored: every status. A handler that answered may
/// have acted, whatever it answered (a `500` after the charge, a `503` after a write whose
/// answer was lost), so every retry is given its first answer, replayed, and none runs it
/// again. A handler that knows it did nothing says so ([`NothingDone`](crate::NothingDone)); a
/// rate limiter or a load shedder belongs outside the layer, where its refusals never reach
/// it. What becomes of the key after a status a custom rule does not store is [`OnUnstored`].
pub fn default_store_status(_status: StatusCode) -> bool {
    true
}

/// The route part of every record's scope, beside the caller and the method: set with
/// [`IdempotencyLayer::route`]. It is part of each record's identity, so changing it
/// later makes every key in flight new again: choose it once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RoutePart {
    /// The request path (the default): `/orders/17` and `/orders/18` are two key spaces.
    #[default]
    Path,
    /// axum's matched route template (`/orders/{id}`): the same key sent to two paths of one
    /// route is refused as a key reused (422). It needs the layer inside the router (`Router::route_layer`
    /// or `Router::layer`); a request that reaches it without a matched route is scoped by
    /// its path, and the first such request is logged as a warning.
    #[cfg(feature = "axum")]
    Template,
}

impl RoutePart {
    pub(crate) fn into_fn(self) -> Arc<RouteFn> {
        match self {
            RoutePart::Path => Arc::new(|parts: &Parts| parts.uri.path().to_owned()),
            #[cfg(feature = "axum")]
            RoutePart::Template => Arc::new(template_route),
        }
    }
}

#[cfg(feature = "axum")]
fn template_route(parts: &Parts) -> String {
    use std::sync::atomic::{AtomicBool, Ordering};
    static WARNED: AtomicBool = AtomicBool::new(false);
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return matched.as_str().to_owned();
    }
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            path = parts.uri.path(),
            "the idempotency layer scopes by route template but runs outside an axum router: \
             requests are scoped by their path"
        );
    }
    parts.uri.path().to_owned()
}
