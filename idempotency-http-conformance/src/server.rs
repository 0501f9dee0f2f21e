//! The service the suite talks to: an axum app behind the layer, served on an ephemeral
//! loopback port, and a store wrapper that can be taken down.

use async_trait::async_trait;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use idempotency_core::store::{Cas, Claim, ClaimRequest, Failure, Reclaim, Record};
use idempotency_core::{
    Error, FencingToken, Fingerprint, Idempotency, IdempotencyStore, Policy, RecordId,
};
use idempotency_tower::{IdempotencyLayer, RoutePart};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Request headers the test handler obeys. None of them is part of the fingerprint, so a retry
/// can drop them and still be "the same request".
pub mod control {
    /// Sleep this many milliseconds before answering.
    pub const DELAY_MS: &str = "x-test-delay-ms";
    /// Answer with this status.
    pub const STATUS: &str = "x-test-status";
    /// Panic instead of answering.
    pub const PANIC: &str = "x-test-panic";
    /// Answer with a streaming body (no exact size).
    pub const STREAM: &str = "x-test-stream";
    /// Answer with a body of this many bytes.
    pub const LARGE: &str = "x-test-large";
    /// Answer with a streaming body (no exact size) of this many bytes, in 512-byte chunks.
    pub const STREAM_LARGE: &str = "x-test-stream-large";
    /// Answer with a streaming body whose second chunk is an error.
    pub const STREAM_FAIL: &str = "x-test-stream-fail";
    /// The caller identity an earlier layer puts in the extensions.
    pub const PRINCIPAL: &str = "x-test-principal";
    /// Mark the response [`idempotency_tower::NothingDone`]: the handler says it did nothing.
    pub const NOTHING_DONE: &str = "x-test-nothing-done";
    /// A timeout layer inside the idempotency layer cuts the handler off after this many
    /// milliseconds and answers `408` (as `tower_http::timeout` does).
    pub const TIMEOUT_MS: &str = "x-test-timeout-ms";
}

/// The caller identity the test app's "authentication" layer sets.
#[derive(Clone, Debug)]
pub struct Principal(pub String);

#[derive(Default, Debug)]
struct AppState {
    executions: AtomicU64,
}

/// One running test service.
#[derive(Debug)]
pub struct TestServer {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    state: Arc<AppState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestServer {
    /// Serves the test app behind `layer` on an ephemeral loopback port.
    pub async fn start(layer: IdempotencyLayer) -> Self {
        let state = Arc::new(AppState::default());
        let app = Router::new()
            .route("/items", post(handler).put(handler).get(handler))
            .route("/items/{id}", post(handler).patch(handler))
            .with_state(state.clone())
            // Inside the idempotency layer: a timeout that cuts the handler off.
            .layer(axum::middleware::from_fn(inner_timeout))
            .layer(layer)
            // An earlier layer: authentication puts the principal in the extensions.
            .layer(axum::middleware::map_request(
                |mut req: Request| async move {
                    if let Some(p) = req
                        .headers()
                        .get(control::PRINCIPAL)
                        .and_then(|v| v.to_str().ok())
                    {
                        let p = Principal(p.to_owned());
                        req.extensions_mut().insert(p);
                    }
                    req
                },
            ));
        let (base, task) = serve(app).await;
        Self { base, state, task }
    }

    /// Serves the test app behind a layer over `store` with `policy`, configured by
    /// `configure`.
    pub async fn with_store(
        store: Arc<dyn IdempotencyStore>,
        policy: Policy,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Self {
        let engine = Idempotency::new(store, policy).expect("a valid policy");
        // One key space, scoped by route template.
        Self::start(configure(
            IdempotencyLayer::shared(engine).route(RoutePart::Template),
        ))
        .await
    }

    /// [`TestServer::with_store`] with a key space per caller: the [`Principal`] an earlier
    /// layer put in the extensions (from the [`control::PRINCIPAL`] header).
    pub async fn per_principal(
        store: Arc<dyn IdempotencyStore>,
        policy: Policy,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Self {
        let engine = Idempotency::new(store, policy).expect("a valid policy");
        let layer = IdempotencyLayer::per_caller(engine, |req| {
            req.extensions.get::<Principal>().map(|p| p.0.clone())
        });
        Self::start(configure(layer.route(RoutePart::Template))).await
    }

    /// The URL of `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// How many times the handler has run (started).
    pub fn executions(&self) -> u64 {
        self.state.executions.load(Ordering::SeqCst)
    }
}

/// Serves `app` on an ephemeral loopback port: its `http://127.0.0.1:PORT` and the server task
/// (abort it to stop the server).
pub async fn serve(app: Router) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind an ephemeral loopback port");
    let addr = listener.local_addr().expect("listener address");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), task)
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// A timeout layer inside the idempotency layer: with [`control::TIMEOUT_MS`], the handler is
/// dropped when the time is up and the answer is `408`.
async fn inner_timeout(req: Request, next: axum::middleware::Next) -> Response {
    let Some(ms) = header(req.headers(), control::TIMEOUT_MS).and_then(|v| v.parse().ok()) else {
        return next.run(req).await;
    };
    match tokio::time::timeout(Duration::from_millis(ms), next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => Response::builder()
            .status(StatusCode::REQUEST_TIMEOUT)
            .body(Body::from("the handler timed out"))
            .unwrap_or_default(),
    }
}

async fn handler(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let n = state.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let (parts, body) = req.into_parts();
    let h = &parts.headers;
    if let Some(ms) = header(h, control::DELAY_MS).and_then(|v| v.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if header(h, control::PANIC).is_some() {
        panic!("handler panicked on purpose (conformance suite)");
    }
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let status = header(h, control::STATUS)
        .and_then(|v| v.parse::<u16>().ok())
        .and_then(|v| StatusCode::from_u16(v).ok())
        .unwrap_or(StatusCode::CREATED);
    if header(h, control::NOTHING_DONE).is_some() {
        let mut resp = Response::new(Body::from("nothing was done"));
        *resp.status_mut() = status;
        resp.extensions_mut().insert(idempotency_tower::NothingDone);
        return resp;
    }
    let builder = Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("location", format!("/items/{n}"))
        .header("etag", format!("\"v{n}\""))
        .header("set-cookie", "session=secret; HttpOnly")
        .header("authorization", "Bearer not-for-replay")
        .header("x-unlisted", "not replayed")
        .header("x-allowlisted", format!("run-{n}"));
    if header(h, control::STREAM).is_some() {
        let chunks =
            (0..3).map(move |i| Ok::<_, std::io::Error>(Bytes::from(format!("chunk-{n}-{i};"))));
        return builder
            .body(Body::from_stream(futures::stream::iter(chunks)))
            .unwrap_or_default();
    }
    if let Some(len) = header(h, control::STREAM_LARGE).and_then(|v| v.parse::<usize>().ok()) {
        let first = b'0' + (n % 10) as u8;
        let chunks = (0..len.div_ceil(512)).map(move |i| {
            let size = (len - i * 512).min(512);
            let mut chunk = vec![b's'; size];
            if i == 0 {
                chunk[0] = first;
            }
            Ok::<_, std::io::Error>(Bytes::from(chunk))
        });
        return builder
            .body(Body::from_stream(futures::stream::iter(chunks)))
            .unwrap_or_default();
    }
    if header(h, control::STREAM_FAIL).is_some() {
        let chunks = [
            Ok(Bytes::from(format!("partial-{n};"))),
            Err(std::io::Error::other(
                "the body failed on purpose (conformance suite)",
            )),
        ];
        return builder
            .body(Body::from_stream(futures::stream::iter(chunks)))
            .unwrap_or_default();
    }
    if let Some(len) = header(h, control::LARGE).and_then(|v| v.parse::<usize>().ok()) {
        let mut big = vec![b'x'; len];
        if let Some(first) = big.first_mut() {
            *first = b'0' + (n % 10) as u8;
        }
        return builder.body(Body::from(big)).unwrap_or_default();
    }
    let received: serde_json::Value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&body).into()));
    let doc = serde_json::json!({
        "execution": n,
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "received": received,
    });
    builder
        .body(Body::from(doc.to_string()))
        .unwrap_or_default()
}

/// Wraps a store so that a case can take it down: while down, every call fails with a
/// retryable backend error (connection refused), as a store whose server went away does. It
/// also counts the completions that reach the store.
#[derive(Debug)]
pub struct Outage {
    inner: Arc<dyn IdempotencyStore>,
    down: AtomicBool,
    completes: AtomicU64,
    extends: AtomicU64,
}

impl Outage {
    /// Wraps `inner`, up.
    pub fn new(inner: Arc<dyn IdempotencyStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            down: AtomicBool::new(false),
            completes: AtomicU64::new(0),
            extends: AtomicU64::new(0),
        })
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn IdempotencyStore> {
        &self.inner
    }

    /// How many completions were sent through the wrapper (down or up).
    pub fn completes(&self) -> u64 {
        self.completes.load(Ordering::SeqCst)
    }

    /// How many extensions (heartbeats) were sent through the wrapper (down or up).
    pub fn extends(&self) -> u64 {
        self.extends.load(Ordering::SeqCst)
    }

    /// Takes the store down (`true`) or brings it back.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), Error> {
        if self.down.load(Ordering::SeqCst) {
            Err(Error::backend(
                true,
                std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    "store is down (outage injected by the HTTP conformance suite)",
                ),
            ))
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl IdempotencyStore for Outage {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        self.check()?;
        self.inner.claim(request).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        self.check()?;
        self.inner.complete(id, token, outcome, ttl).await
    }
    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.check()?;
        self.inner.fail(id, token, failure, ttl).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        self.extends.fetch_add(1, Ordering::SeqCst);
        self.check()?;
        self.inner.extend(id, token, lease).await
    }
    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        self.check()?;
        self.inner
            .reclaim(id, expected, fingerprint, lease, ttl)
            .await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.check()?;
        self.inner.get(id).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        self.check()?;
        self.inner.purge_expired(batch).await
    }
}

/// A header value from a static string (for cases).
pub fn hv(s: &'static str) -> HeaderValue {
    HeaderValue::from_static(s)
}
