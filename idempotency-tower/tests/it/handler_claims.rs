//! `IdempotencyLayer::handler_claims`: the layer reads the key, the caller and the fingerprint
//! and hands them to the handler ([`RequestKey`]), which runs its operation under them itself;
//! the layer marks replays, writes refusals with its own responder, and keeps the handler
//! running when the client goes away.
#![cfg(feature = "axum")]
#![allow(clippy::unwrap_used)]

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use http_body_util::BodyExt;
use idempotency_core::Idempotency;
use idempotency_memory::MemoryStore;
use idempotency_tower::{IdempotencyLayer, Refusal, RequestKey};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tower::ServiceExt;

struct App {
    engine: Idempotency,
    /// Operations started and finished.
    started: AtomicU64,
    finished: AtomicU64,
    /// Each operation takes a permit before it ends: none at first means "wait".
    gate: Semaphore,
}

/// `POST /payments`: an operation that takes a permit from the gate, then answers the body's
/// length as the payment.
async fn pay(
    State(app): State<Arc<App>>,
    request: RequestKey,
    body: axum::body::Bytes,
) -> Result<Response, Refusal> {
    let operation = app.engine.run(
        request.key(),
        request.scope(),
        request.fingerprint(),
        |_| async {
            app.started.fetch_add(1, Ordering::SeqCst);
            app.gate.acquire().await.unwrap().forget();
            app.finished.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(format!("paid {} bytes", body.len()))
        },
    );
    match request.run(operation).await? {
        Ok(paid) => Ok((StatusCode::CREATED, paid).into_response()),
        Err(_) => Err(Refusal::HandlerFailed),
    }
}

fn app(permits: usize) -> (Router, Arc<App>) {
    let engine = Idempotency::builder(MemoryStore::new())
        .lease(Duration::from_secs(60))
        .build()
        .unwrap();
    let app = Arc::new(App {
        engine: engine.clone().into(),
        started: AtomicU64::new(0),
        finished: AtomicU64::new(0),
        gate: Semaphore::new(permits),
    });
    let layer = IdempotencyLayer::per_caller(engine, |parts| {
        let caller = parts.headers.get("x-caller")?.to_str().ok()?;
        Some(caller.to_owned())
    })
    .required(true)
    .problem_type_base("https://pay.example/problems/")
    .max_retry_after(Duration::from_secs(5))
    .handler_claims();
    let router = Router::new()
        .route("/payments", post(pay))
        .route_layer(layer)
        .with_state(app.clone());
    (router, app)
}

fn request(key: Option<&str>, caller: Option<&str>, body: &'static str) -> Request {
    let mut req = http::Request::post("/payments").header("content-type", "text/plain");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    if let Some(caller) = caller {
        req = req.header("x-caller", caller);
    }
    req.body(Body::from(body)).unwrap()
}

/// Status, replay header, `Retry-After`, body.
async fn send(router: &Router, req: Request) -> (StatusCode, bool, Option<String>, String) {
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let replayed = resp.headers().get("idempotent-replayed").is_some();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        replayed,
        retry_after,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_runs_once_and_the_layer_marks_its_replays() {
    let (router, app) = app(10);
    let first = send(&router, request(Some("k-1"), Some("ann"), "12 apples")).await;
    assert_eq!(
        first,
        (StatusCode::CREATED, false, None, "paid 9 bytes".into())
    );
    let again = send(&router, request(Some("k-1"), Some("ann"), "12 apples")).await;
    assert_eq!(
        again,
        (StatusCode::CREATED, true, None, "paid 9 bytes".into())
    );
    assert_eq!(app.started.load(Ordering::SeqCst), 1, "the retry ran again");
    // The same key from another caller is another operation.
    let other = send(&router, request(Some("k-1"), Some("bob"), "12 apples")).await;
    assert_eq!((other.0, other.1), (StatusCode::CREATED, false));
    assert_eq!(app.started.load(Ordering::SeqCst), 2);
    // Another request under the key: the layer's problem document, under its type base.
    let (status, replayed, _, body) =
        send(&router, request(Some("k-1"), Some("ann"), "13 pears")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(!replayed);
    assert!(
        body.contains("https://pay.example/problems/idempotency-key-reused"),
        "{body}"
    );
    assert_eq!(app.started.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_refuses_before_the_handler_runs() {
    let (router, app) = app(10);
    let (status, _, _, body) = send(&router, request(None, Some("ann"), "x")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body.contains("https://pay.example/problems/idempotency-key-required"),
        "{body}"
    );
    let resp = router
        .clone()
        .oneshot(request(Some("k-2"), None, "x"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert!(resp.headers().contains_key("www-authenticate"));
    let too_long = "k".repeat(10_000);
    let (status, _, _, body) = send(&router, request(Some(&too_long), Some("ann"), "x")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(app.started.load(Ordering::SeqCst), 0, "the handler ran");
}

/// A duplicate while the first runs: the layer's 409, its `Retry-After` capped by the layer's
/// `max_retry_after` (the lease is 60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_gets_the_layers_409() {
    let (router, app) = app(0);
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, request(Some("k-3"), Some("ann"), "abc")).await }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while app.started.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the first request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, replayed, retry_after, body) =
        send(&router, request(Some("k-3"), Some("ann"), "abc")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(!replayed);
    assert_eq!(retry_after.as_deref(), Some("5"));
    assert!(body.contains("https://pay.example/problems/"), "{body}");
    app.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false));
    assert_eq!(app.started.load(Ordering::SeqCst), 1);
}

/// The client goes away while the operation runs: the handler is not cancelled half-way; it
/// runs to its end and the retry is answered with its outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_does_not_cancel_the_handler() {
    let (router, app) = app(0);
    let abandoned = tokio::spawn({
        let router = router.clone();
        async move { send(&router, request(Some("k-4"), Some("ann"), "abcd")).await }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while app.started.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    abandoned.abort();
    assert!(abandoned.await.unwrap_err().is_cancelled());
    app.gate.add_permits(1);
    while app.finished.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < deadline,
            "the handler was cancelled with its client"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut retry = send(&router, request(Some("k-4"), Some("ann"), "abcd")).await;
    // The handler stores its outcome just after it finishes: until then the retry is told
    // to wait.
    while retry.0 == StatusCode::CONFLICT {
        assert!(Instant::now() < deadline, "the outcome was never stored");
        tokio::time::sleep(Duration::from_millis(5)).await;
        retry = send(&router, request(Some("k-4"), Some("ann"), "abcd")).await;
    }
    assert_eq!(
        retry,
        (StatusCode::CREATED, true, None, "paid 4 bytes".into())
    );
    assert_eq!(app.started.load(Ordering::SeqCst), 1);
}
