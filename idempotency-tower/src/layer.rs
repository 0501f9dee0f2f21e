//! The layer and its configuration.

use crate::problem::{ProblemJson, RefusalResponder};
use crate::service::IdempotencyService;
use http::request::Parts;
use http::{HeaderName, Method, StatusCode};
use idempotency_core::Idempotency;
use std::fmt;
use std::sync::Arc;

/// Headers that are never stored or replayed, whatever the allowlist says: credentials,
/// cookies, and hop-by-hop headers (RFC 9110 §7.6.1), plus `Content-Length`, which is
/// recomputed from the stored body.
pub const NEVER_REPLAYED: &[&str] = &[
    "set-cookie",
    "set-cookie2",
    "authorization",
    "proxy-authorization",
    "proxy-authenticate",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "idempotent-replayed",
];

/// Headers replayed by default: the ones that describe the stored body and the created
/// resource.
pub const DEFAULT_REPLAYED: &[&str] = &[
    "content-type",
    "content-encoding",
    "content-language",
    "content-location",
    "location",
    "etag",
    "last-modified",
    "cache-control",
    "expires",
    "vary",
    "link",
];

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type RouteFn = dyn Fn(&Parts) -> String + Send + Sync;
type StoreStatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;

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
}

impl Config {
    pub(crate) fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    pub(crate) fn replays(&self, name: &HeaderName) -> bool {
        !NEVER_REPLAYED.contains(&name.as_str()) && self.replayed.contains(name)
    }

    pub(crate) fn hash_keys(&self) -> bool {
        self.engine.policy().hash_keys_in_logs
    }
}

/// The default rule for which responses are stored: everything except 5xx, 408 and 429,
/// which release the key so that a retry runs the handler again.
pub fn default_store_status(status: StatusCode) -> bool {
    !(status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS)
}

fn default_route(parts: &Parts) -> String {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return matched.as_str().to_owned();
    }
    parts.uri.path().to_owned()
}

/// A tower [`Layer`](tower_layer::Layer) that gives the services it wraps the HTTP behaviour
/// of the IETF `Idempotency-Key` draft. See the crate documentation for the behaviour table.
///
/// ```
/// use idempotency_core::{Idempotency, Policy};
/// use idempotency_memory::MemoryStore;
/// use idempotency_tower::IdempotencyLayer;
/// use http::Method;
/// use std::sync::Arc;
///
/// #[derive(Clone)]
/// struct ApiKey(String);
///
/// let engine = Idempotency::new(Arc::new(MemoryStore::new()), Policy::default()).unwrap();
/// let layer = IdempotencyLayer::new(engine)
///     .required(true)
///     .methods([Method::POST, Method::PATCH, Method::PUT])
///     .body_limit(256 * 1024)
///     // Each API key gets its own key space.
///     .scope(|req| req.extensions.get::<ApiKey>().map(|k| k.0.clone()));
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("engine", &c.engine)
            .field("methods", &c.methods)
            .field("required", &c.required)
            .field("body_limit", &c.body_limit)
            .field("response_limit", &c.response_limit)
            .field("replayed", &c.replayed)
            .field("fail_open", &c.fail_open)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// The default request and response buffer limit: 1 MiB.
    pub const DEFAULT_LIMIT: usize = 1024 * 1024;

    /// A layer over `engine` (its store and policy: lease, retention, in-flight behaviour,
    /// key hashing in logs) with the defaults: POST and PATCH covered, key optional, 1 MiB
    /// limits, one shared scope, 5xx/408/429 not stored, fail closed, problem+json refusals.
    pub fn new(engine: Idempotency) -> Self {
        Self {
            config: Arc::new(Config {
                engine,
                methods: vec![Method::POST, Method::PATCH],
                required: false,
                body_limit: Self::DEFAULT_LIMIT,
                response_limit: Self::DEFAULT_LIMIT,
                scope: Arc::new(|_| Some("anonymous".to_owned())),
                route: Arc::new(default_route),
                store_status: Arc::new(default_store_status),
                replayed: DEFAULT_REPLAYED
                    .iter()
                    .map(|h| HeaderName::from_static(h))
                    .collect(),
                fail_open: false,
                responder: Arc::new(ProblemJson::default()),
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The methods the layer covers (default POST and PATCH). Other methods pass through
    /// untouched, key or not.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.edit(|c| c.methods = methods)
    }

    /// Whether a covered request without a key is refused with 400 (default `false`: it
    /// passes through unprotected).
    pub fn required(self, required: bool) -> Self {
        self.edit(|c| c.required = required)
    }

    /// The largest request body buffered for fingerprinting (default 1 MiB); a larger one gets
    /// 413 and the handler does not run.
    pub fn body_limit(self, bytes: usize) -> Self {
        self.edit(|c| c.body_limit = bytes)
    }

    /// The largest response body stored for replay (default 1 MiB, at most `u32::MAX`); a
    /// larger one is delivered but not stored, and the key is released.
    pub fn response_limit(self, bytes: usize) -> Self {
        let bytes = bytes.min(u32::MAX as usize);
        self.edit(|c| c.response_limit = bytes)
    }

    /// Who the caller is, from the request (typically a principal an authentication layer put
    /// in the extensions). Method and route are added to it to form the scope. `None` answers
    /// 401: a request that should carry an identity and does not is never put in a shared
    /// scope.
    ///
    /// **Without this, every client shares one scope**: two clients that pick the same key
    /// for the same route see each other's responses. Use it whenever callers are
    /// authenticated.
    pub fn scope<F>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.edit(|c| c.scope = Arc::new(f))
    }

    /// The route part of the scope (default: the request path; with the `axum` feature, the
    /// matched route template when the layer runs inside the router, as with
    /// `Router::route_layer`). With a template, the same key sent to two paths of one route
    /// is a mismatch (422); with the path, they are two independent keys.
    pub fn route<F>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> String + Send + Sync + 'static,
    {
        self.edit(|c| c.route = Arc::new(f))
    }

    /// Which statuses are stored and replayed (default [`default_store_status`]). A status
    /// that is not stored releases the key, so a retry runs the handler again.
    pub fn store_status<F>(self, f: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.edit(|c| c.store_status = Arc::new(f))
    }

    /// Adds a header to the replay allowlist ([`DEFAULT_REPLAYED`] to start with). Headers in
    /// [`NEVER_REPLAYED`] are ignored: cookies, credentials and hop-by-hop headers are never
    /// stored.
    pub fn replay_header(self, name: HeaderName) -> Self {
        self.edit(|c| {
            if !c.replayed.contains(&name) {
                c.replayed.push(name);
            }
        })
    }

    /// Replaces the replay allowlist.
    pub fn replay_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names = names.into_iter().collect();
        self.edit(|c| c.replayed = names)
    }

    /// When the store cannot be reached: `false` (the default) answers 503 and does not run
    /// the handler; `true` runs the handler unprotected, so a retry may run it twice. Turn it
    /// on only for operations where a duplicate is cheaper than an outage.
    pub fn fail_open(self, fail_open: bool) -> Self {
        self.edit(|c| c.fail_open = fail_open)
    }

    /// How refusals are written (default [`ProblemJson`]).
    pub fn responder(self, responder: impl RefusalResponder) -> Self {
        let responder = Arc::new(responder);
        self.edit(|c| c.responder = responder)
    }

    /// Problem documents with `type` under `base` (default [`ProblemJson::DEFAULT_TYPE_BASE`]).
    pub fn problem_type_base(self, base: impl Into<String>) -> Self {
        self.responder(ProblemJson::new(base))
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.config.clone())
    }
}
