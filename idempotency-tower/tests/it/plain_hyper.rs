//! The layer in front of a plain hyper service (no axum), over real HTTP.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use idempotency_core::{Idempotency, Policy};
use idempotency_memory::MemoryStore;
use idempotency_tower::{IdempotencyLayer, RequestBody};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tower::ServiceBuilder;

async fn serve(runs: Arc<AtomicU64>) -> String {
    let engine = Idempotency::new(Arc::new(MemoryStore::new()), Policy::default()).unwrap();
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::shared(engine).required(true))
        .service_fn(move |req: Request<RequestBody<Incoming>>| {
            let runs = runs.clone();
            async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let body = req.into_body().collect().await.unwrap().to_bytes();
                let text = format!("run {n} got {}", String::from_utf8_lossy(&body));
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .header("content-type", "text/plain")
                        .body(Full::new(Bytes::from(text)))
                        .unwrap(),
                )
            }
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    format!("http://{addr}/things")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn works_in_front_of_a_plain_hyper_service() {
    let runs = Arc::new(AtomicU64::new(0));
    let url = serve(runs.clone()).await;
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let send = |key: &'static str, body: &'static str| {
        client
            .post(&url)
            .header("idempotency-key", key)
            .header("content-type", "text/plain")
            .body(body)
            .send()
    };
    let first = send("h1", "hello").await.unwrap();
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    assert_eq!(first.text().await.unwrap(), "run 1 got hello");
    let again = send("\"h1\"", "hello").await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["content-type"], "text/plain");
    assert_eq!(again.text().await.unwrap(), "run 1 got hello");
    let other = send("h1", "bye").await.unwrap();
    assert_eq!(other.status(), 422);
    assert_eq!(
        other.headers()["content-type"],
        idempotency_tower::PROBLEM_JSON
    );
    let missing = client.post(&url).body("x").send().await.unwrap();
    assert_eq!(missing.status(), 400);
    // GET is not covered: it runs without a key.
    let get = client.get(&url).send().await.unwrap();
    assert_eq!(get.status(), 201);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
