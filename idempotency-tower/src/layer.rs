//! The layer: a builder over the shared configuration.

use crate::config::{Config, OnUnreplayable, OnUnstored, RoutePart};
use crate::fingerprint::FingerprintInput;
use crate::hooks::ResponseContext;
use crate::problem::{ProblemJson, RefusalResponder};
use crate::service::IdempotencyService;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use idempotency_core::{Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A tower [`Layer`](tower_layer::Layer) that gives the services it wraps the HTTP behaviour
/// of the IETF `Idempotency-Key` draft. See the crate documentation for the behaviour table.
///
/// A layer is built with its key space chosen: [`IdempotencyLayer::per_caller`] (each caller
/// its own) or [`IdempotencyLayer::shared`] (one for every caller, on purpose).
///
/// ```
/// use idempotency_core::Idempotency;
/// use idempotency_memory::MemoryStore;
/// use idempotency_tower::IdempotencyLayer;
/// use http::Method;
///
/// #[derive(Clone)]
/// struct ApiKey(String);
///
/// let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
/// // Each API key gets its own key space.
/// let layer = IdempotencyLayer::per_caller(engine, |req| {
///     req.extensions.get::<ApiKey>().map(|k| k.0.clone())
/// })
/// .required(true)
/// .methods([Method::POST, Method::PATCH, Method::PUT])
/// .body_limit(256 * 1024);
/// ```
///
/// A layer without the choice does not compile:
///
/// ```compile_fail
/// # use idempotency_core::Idempotency;
/// # use idempotency_memory::MemoryStore;
/// # use idempotency_tower::IdempotencyLayer;
/// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
/// let layer = IdempotencyLayer::new(engine);
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
            .field("fingerprint_headers", &c.fingerprint_headers)
            .field("unreplayable", &c.unreplayable)
            .field("unstored", &c.unstored)
            .field("max_retry_after", &c.max_retry_after)
            .field("unavailable_retry_after", &c.unavailable_retry_after)
            .field("key_header", &c.key_header)
            .field("replayed_marker", &c.replayed_marker)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// The default request and response buffer limit: 1 MiB.
    pub const DEFAULT_LIMIT: usize = 1024 * 1024;

    /// The default cap on `Retry-After` of a 409 (another request with the key is running).
    pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(5);

    /// The default `Retry-After` of a 503 (the store is unavailable).
    pub const DEFAULT_UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

    /// A layer over `engine` in which each caller has its own key space: `caller` says who
    /// sent the request (typically a principal an authentication layer put in the
    /// extensions), and the method and route are added to it to form each record's scope.
    /// `None` answers 401: a request that should carry an identity and does not is never put
    /// in a shared key space.
    ///
    /// The other settings start at their defaults: POST and PATCH covered, key optional,
    /// 1 MiB limits, every status stored and replayed (5xx, 408 and 429 included), fail
    /// closed, problem+json refusals, preconditions fingerprinted, unreplayable responses
    /// recorded, the route part of the scope the request path ([`RoutePart::Path`]). The
    /// engine brings the store and the policy (lease, retention, in-flight behaviour, key
    /// hashing in logs).
    pub fn per_caller<F, M>(
        engine: impl Into<Idempotency<dyn IdempotencyStore, M>>,
        caller: F,
    ) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        Self {
            config: Arc::new(Config::new(
                engine.into().releasing_errors(),
                Arc::new(caller),
            )),
        }
    }

    /// A layer over `engine` in which every caller shares one key space: two clients that
    /// pick the same key for the same route get each other's responses (the stored status,
    /// headers and body are replayed to whoever sends the key and the same request), and a
    /// client can probe for keys others used. Choose it only when there is one client, or
    /// when callers are not told apart and responses hold nothing of one caller's that
    /// another may not see; otherwise use [`IdempotencyLayer::per_caller`]. The defaults are
    /// those of [`IdempotencyLayer::per_caller`].
    pub fn shared<M>(engine: impl Into<Idempotency<dyn IdempotencyStore, M>>) -> Self {
        Self {
            config: Arc::new(Config::new(
                engine.into().releasing_errors(),
                Arc::new(|_: &Parts| Some("anonymous".to_owned())),
            )),
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

    /// The largest response body stored for replay (default 1 MiB, at most `u32::MAX`). A
    /// body without an exact size (a stream) is read up to the limit and stored when it ends
    /// within it, so the client gets it once it is read whole. A larger body is delivered
    /// whole but not stored; what happens to the key is [`IdempotencyLayer::on_unreplayable`].
    pub fn response_limit(self, bytes: usize) -> Self {
        let bytes = bytes.min(u32::MAX as usize);
        self.edit(|c| c.response_limit = bytes)
    }

    /// The route part of the scope: the request path (the default) or, with the `axum`
    /// feature, the matched route template ([`RoutePart`]). With a template, the same key
    /// sent to two paths of one route is refused as a key reused (422); with the path, they are two
    /// independent keys. It is part of every record's identity: choose it once.
    pub fn route(self, route: RoutePart) -> Self {
        self.edit(|c| c.route = route.into_fn())
    }

    /// The route part of the scope, computed by `f` from the request (a route name your
    /// router puts in the extensions, say). Part of every record's identity, like
    /// [`IdempotencyLayer::route`].
    pub fn route_with<F>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> String + Send + Sync + 'static,
    {
        self.edit(|c| c.route = Arc::new(f))
    }

    /// Which statuses are stored and replayed (default
    /// [`default_store_status`](crate::default_store_status): every status). After a status
    /// that is not stored the key is settled for good without the body, held until its lease
    /// passes, or released at once, per [`IdempotencyLayer::on_unstored`].
    pub fn store_status<F>(self, f: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.edit(|c| c.store_status = Arc::new(f))
    }

    /// Adds a header to the replay allowlist ([`DEFAULT_REPLAYED`](crate::DEFAULT_REPLAYED)
    /// to start with). Headers in [`NEVER_REPLAYED`](crate::NEVER_REPLAYED) are ignored:
    /// cookies, credentials and hop-by-hop headers are never stored.
    pub fn store_header(self, name: HeaderName) -> Self {
        self.edit(|c| {
            if !c.replayed.contains(&name) {
                c.replayed.push(name);
            }
        })
    }

    /// Replaces the replay allowlist.
    pub fn store_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names = names.into_iter().collect();
        self.edit(|c| c.replayed = names)
    }

    /// When the store cannot be reached: `false` (the default) answers 503 and does not run
    /// the handler; `true` runs the handler unprotected, so a retry may run it twice. Turn it
    /// on only for operations where a duplicate is cheaper than an outage.
    pub fn fail_open(self, fail_open: bool) -> Self {
        self.edit(|c| c.fail_open = fail_open)
    }

    /// The handler claims the key itself, on the layer's reading of the request: the layer
    /// parses the key, identifies the caller, buffers the body and builds the scope and the
    /// fingerprint (refusing what it must, as on every route), then runs the handler with a
    /// [`RequestKey`](crate::RequestKey) in the request's extensions **without claiming the
    /// key**. The handler runs its operation under that key (`run_phases` for a multi-step
    /// operation, `run_in_transaction` for work in its own transaction) and hands the call to
    /// [`RequestKey::run`](crate::RequestKey::run); the layer adds the replay header to a
    /// replayed answer, writes refusals with its responder, and runs the handler to its end if
    /// the client disconnects. Nothing is stored by the layer: the operation's own record is
    /// the key's, so put such routes behind a layer of their own (`route_layer`).
    pub fn handler_claims(self) -> Self {
        self.edit(|c| c.handler_claims = true)
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

    /// The request headers that are part of the fingerprint (default
    /// [`DEFAULT_FINGERPRINT_HEADERS`](crate::DEFAULT_FINGERPRINT_HEADERS): `If-Match`,
    /// `If-None-Match`, `If-Unmodified-Since`, `If-Modified-Since`). Only headers a request
    /// sends count, so a request without any has the fingerprint it had before headers
    /// counted. A header's field lines are read as one list (`"a", "b"` in one line or two).
    ///
    /// With preconditions in the fingerprint, a request answered `412 Precondition Failed`
    /// and sent again under the same key with a fresh `If-Match` is a different request:
    /// `422`, never the stored `412`. Send a new key with the new precondition.
    ///
    /// ```
    /// # use idempotency_core::Idempotency;
    /// # use idempotency_memory::MemoryStore;
    /// # use idempotency_tower::IdempotencyLayer;
    /// # use http::HeaderName;
    /// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    /// let layer = IdempotencyLayer::shared(engine).fingerprint_headers([
    ///     HeaderName::from_static("if-match"),
    ///     HeaderName::from_static("x-tenant"),
    /// ]);
    /// ```
    pub fn fingerprint_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names = names.into_iter().collect();
        self.edit(|c| c.fingerprint_headers = names)
    }

    /// Chooses what is hashed, for APIs whose clients send the same operation with bytes that
    /// change on every attempt (a regenerated multipart boundary, a timestamp member). The
    /// hook gets the request and its body; [`FingerprintInput::builder`] is the layer's own
    /// fingerprint without the body, to which the hook adds what identifies the operation.
    /// What the hook leaves out is not compared: two requests that differ only there are one
    /// request, and the second gets the first's response.
    ///
    /// ```
    /// # use idempotency_core::{canonical_json, Idempotency, Policy};
    /// # use idempotency_memory::MemoryStore;
    /// # use idempotency_tower::{FingerprintInput, IdempotencyLayer};
    /// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    /// // Clients stamp each attempt with `sent_at`: leave it out of the comparison.
    /// let layer = IdempotencyLayer::shared(engine).fingerprint_with(|req: &FingerprintInput<'_>| {
    ///     match serde_json::from_slice::<serde_json::Value>(req.body()) {
    ///         Ok(mut doc) => {
    ///             if let Some(members) = doc.as_object_mut() {
    ///                 members.remove("sent_at");
    ///             }
    ///             req.builder().body(canonical_json(&doc).as_bytes()).finish()
    ///         }
    ///         // Not JSON: compare the whole body, as without the hook.
    ///         Err(_) => req.default_fingerprint(),
    ///     }
    /// });
    /// ```
    pub fn fingerprint_with<F>(self, f: F) -> Self
    where
        F: Fn(&FingerprintInput<'_>) -> Fingerprint + Send + Sync + 'static,
    {
        self.edit(|c| c.fingerprint_hook = Some(Arc::new(f)))
    }

    /// What to do when the handler ran but its response cannot be stored (larger than the
    /// response limit, or its body failed while read): [`OnUnreplayable::Record`] (the default)
    /// keeps the key from running the handler again, [`OnUnreplayable::Release`] frees it.
    pub fn on_unreplayable(self, unreplayable: OnUnreplayable) -> Self {
        self.edit(|c| c.unreplayable = unreplayable)
    }

    /// What to do with the key when the handler answered a status that is not stored, or
    /// returned an error: [`OnUnstored::Settle`] (the default) settles it for good, because
    /// the handler may have acted before it failed; [`OnUnstored::Hold`] holds it until its
    /// lease passes and then runs the handler again; [`OnUnstored::Release`] frees it at once,
    /// for handlers that fail only before they act. A handler that did nothing can free
    /// the key itself under either rule ([`NothingDone`](crate::NothingDone),
    /// [`ClaimedKey::rolled_back`](crate::ClaimedKey::rolled_back)).
    pub fn on_unstored(self, unstored: OnUnstored) -> Self {
        self.edit(|c| c.unstored = unstored)
    }

    /// The `WWW-Authenticate` challenge sent with the `401` for a caller the scope function
    /// cannot identify (default `Bearer`; RFC 9110 §11.6.1 requires one on every 401). A
    /// responder that sets the header itself wins.
    ///
    /// ```
    /// # use idempotency_core::Idempotency;
    /// # use idempotency_memory::MemoryStore;
    /// # use idempotency_tower::IdempotencyLayer;
    /// # use http::HeaderValue;
    /// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    /// let layer = IdempotencyLayer::shared(engine)
    ///     .unidentified_challenge(HeaderValue::from_static("Bearer realm=\"api\""));
    /// ```
    pub fn unidentified_challenge(self, challenge: HeaderValue) -> Self {
        self.edit(|c| c.challenge = challenge)
    }

    /// The largest `Retry-After` sent with a `409` while another request with the key runs
    /// (default 5 s). The other request's lease may last much longer (30 s by default, and
    /// the heartbeat keeps extending it), while most handlers finish in far less: the cap
    /// keeps clients from waiting out a whole lease. With `InFlight::wait`, the value is
    /// what is left of the lease after the wait.
    ///
    /// ```
    /// # use idempotency_core::Idempotency;
    /// # use idempotency_memory::MemoryStore;
    /// # use idempotency_tower::IdempotencyLayer;
    /// # use std::time::Duration;
    /// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    /// let layer = IdempotencyLayer::shared(engine).max_retry_after(Duration::from_secs(2));
    /// ```
    pub fn max_retry_after(self, cap: Duration) -> Self {
        self.edit(|c| c.max_retry_after = cap)
    }

    /// The `Retry-After` sent with a `503` when the store is unavailable (default 1 s; whole
    /// seconds, at least 1).
    ///
    /// ```
    /// # use idempotency_core::Idempotency;
    /// # use idempotency_memory::MemoryStore;
    /// # use idempotency_tower::IdempotencyLayer;
    /// # use std::time::Duration;
    /// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    /// let layer = IdempotencyLayer::shared(engine).unavailable_retry_after(Duration::from_secs(3));
    /// ```
    pub fn unavailable_retry_after(self, after: Duration) -> Self {
        self.edit(|c| c.unavailable_retry_after = after)
    }

    /// The header the key is read from (default [`IDEMPOTENCY_KEY`](crate::IDEMPOTENCY_KEY),
    /// `Idempotency-Key`).
    ///
    /// ```
    /// # use idempotency_core::Idempotency;
    /// # use idempotency_memory::MemoryStore;
    /// # use idempotency_tower::IdempotencyLayer;
    /// # use http::HeaderName;
    /// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    /// let layer = IdempotencyLayer::shared(engine).key_header(HeaderName::from_static("x-idempotency-key"));
    /// ```
    pub fn key_header(self, name: HeaderName) -> Self {
        self.edit(|c| c.key_header = name)
    }

    /// Checks keys against the API's published key format, after the header rules (one line,
    /// not empty, at most 255 bytes, no control characters). A key the validator refuses gets
    /// `400` `idempotency-key-invalid` whose `detail` carries the validator's message, and the
    /// handler does not run.
    ///
    /// ```
    /// # use idempotency_core::Idempotency;
    /// # use idempotency_memory::MemoryStore;
    /// # use idempotency_tower::IdempotencyLayer;
    /// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    /// // Keys are UUIDs (8-4-4-4-12 hexadecimal digits).
    /// let layer = IdempotencyLayer::shared(engine).validate_key(|key| {
    ///     let groups: Vec<&str> = key.as_str().split('-').collect();
    ///     let lengths: Vec<usize> = groups.iter().map(|g| g.len()).collect();
    ///     let hex = groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_hexdigit()));
    ///     if lengths == [8, 4, 4, 4, 12] && hex {
    ///         Ok(())
    ///     } else {
    ///         Err("keys are UUIDs, such as 8e2c1f0a-5b7d-4c3e-9f21-0a6b7c8d9e10".into())
    ///     }
    /// });
    /// ```
    pub fn validate_key<F>(self, f: F) -> Self
    where
        F: Fn(&IdempotencyKey) -> Result<(), String> + Send + Sync + 'static,
    {
        self.edit(|c| c.key_validator = Some(Arc::new(f)))
    }

    /// The header that marks a replayed response (default
    /// [`IDEMPOTENT_REPLAYED`](crate::IDEMPOTENT_REPLAYED)`: true`), or `None` for no marker. The marker's name is never stored, whatever the allowlist says.
    ///
    /// Clients use it to tell a replayed answer from a fresh one: `idempotency-reqwest` takes a
    /// replayed 5xx as final, and without the marker (or under a name it was not told of)
    /// retries it until its deadline, each retry answered with the same replay.
    ///
    /// ```
    /// # use idempotency_core::Idempotency;
    /// # use idempotency_memory::MemoryStore;
    /// # use idempotency_tower::IdempotencyLayer;
    /// # use http::{HeaderName, HeaderValue};
    /// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    /// let layer = IdempotencyLayer::shared(engine).replay_marker(Some((
    ///     HeaderName::from_static("x-cache"),
    ///     HeaderValue::from_static("replay"),
    /// )));
    /// ```
    pub fn replay_marker(self, marker: Option<(HeaderName, HeaderValue)>) -> Self {
        self.edit(|c| c.replayed_marker = marker)
    }

    /// Called on every response to a request whose key was claimed (the handler's, once
    /// settled) or replayed, to add the API's own headers. The [`ResponseContext`] says whether
    /// it is a replay, what became of a fresh response, and when the key expires. Headers it
    /// adds are not stored: it is called again on each replay. Refusals and requests that
    /// pass through (no key, fail-open) do not reach it.
    ///
    /// ```
    /// # use idempotency_core::Idempotency;
    /// # use idempotency_memory::MemoryStore;
    /// # use idempotency_tower::IdempotencyLayer;
    /// # use http::HeaderValue;
    /// # use std::time::UNIX_EPOCH;
    /// # let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    /// let layer = IdempotencyLayer::shared(engine).on_response(|ctx, headers| {
    ///     // When the key can be reused, in seconds since the epoch.
    ///     if let Some(at) = ctx.expires_at().and_then(|t| t.duration_since(UNIX_EPOCH).ok()) {
    ///         headers.insert("idempotency-key-expires", HeaderValue::from(at.as_secs()));
    ///     }
    ///     if ctx.is_replay() {
    ///         headers.insert("x-served-from", HeaderValue::from_static("idempotency-store"));
    ///     }
    /// });
    /// ```
    pub fn on_response<F>(self, f: F) -> Self
    where
        F: Fn(&ResponseContext<'_>, &mut HeaderMap) + Send + Sync + 'static,
    {
        self.edit(|c| c.response_hook = Some(Arc::new(f)))
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.config.clone())
    }
}
