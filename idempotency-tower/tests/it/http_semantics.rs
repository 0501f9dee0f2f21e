//! Behaviour that a real client cannot see over the wire: the `Connection` header of a 413 per
//! HTTP version (hyper strips `Connection` from HTTP/2 responses) and a handler error (which an
//! axum handler cannot return).
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body_util::{BodyExt, Full};
use idempotency_core::Idempotency;
use idempotency_memory::MemoryStore;
use idempotency_tower::{IdempotencyLayer, RequestBody};
use std::convert::Infallible;
use std::sync::Arc;
use tower::{Layer, Service, ServiceExt};

/// A layer with a scope function.
fn layer() -> IdempotencyLayer {
    let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    IdempotencyLayer::per_caller(engine, |_| Some("caller".into()))
}

async fn handle(
    _req: Request<RequestBody<Full<Bytes>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"done"))))
}

macro_rules! handler {
    () => {
        tower::service_fn(handle)
    };
}

#[tokio::test]
async fn connection_close_on_413_only_for_http1() {
    let mut svc = layer().body_limit(4).layer(handler!());
    for (version, close) in [
        (Version::HTTP_10, true),
        (Version::HTTP_11, true),
        (Version::HTTP_2, false),
        (Version::HTTP_3, false),
    ] {
        let req = Request::post("/orders")
            .version(version)
            .header("idempotency-key", "big")
            .body(Full::new(Bytes::from_static(b"too large")))
            .unwrap();
        let resp = ServiceExt::<Request<Full<Bytes>>>::ready(&mut svc)
            .await
            .unwrap()
            .call(req)
            .await
            .unwrap();
        assert_eq!(resp.status(), 413);
        assert_eq!(
            resp.headers().get("connection").is_some(),
            close,
            "{version:?}: {:?}",
            resp.headers()
        );
    }
}

/// A service that counts its calls and fails with an error after it acted.
fn failing_service(
    calls: Arc<std::sync::atomic::AtomicUsize>,
) -> impl Service<
    Request<RequestBody<Full<Bytes>>>,
    Response = Response<Full<Bytes>>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone {
    tower::service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Err::<Response<Full<Bytes>>, _>(std::io::Error::other("failed after acting"))
        }
    })
}

async fn send_keyed<S>(
    svc: &mut S,
    key: &str,
) -> Result<Response<idempotency_tower::ResponseBody<Full<Bytes>>>, S::Error>
where
    S: Service<
        Request<Full<Bytes>>,
        Response = Response<idempotency_tower::ResponseBody<Full<Bytes>>>,
    >,
{
    let req = Request::post("/orders")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    ServiceExt::<Request<Full<Bytes>>>::ready(svc)
        .await?
        .call(req)
        .await
}

/// A handler that returns an error may have acted before it failed: by default the key is
/// settled for good, so a retry gets 422 outcome-lost and the handler has run once.
/// With `OnUnstored::Hold` a retry 100 ms later gets 409 with `Retry-After` (until the lease
/// passes); with `OnUnstored::Release` (handlers that fail only before acting) the retry runs
/// it again.
#[tokio::test]
async fn a_handler_error_settles_the_key_unless_told_otherwise() {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut settled = layer().layer(failing_service(calls.clone()));
    assert!(send_keyed(&mut settled, "err").await.is_err());
    let retry = send_keyed(&mut settled, "err").await.unwrap();
    assert_eq!(retry.status(), 422, "{retry:?}");
    let body = retry.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("idempotency-key-outcome-lost"),
        "{body:?}"
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);

    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut held = layer()
        .on_unstored(idempotency_tower::OnUnstored::Hold)
        .layer(failing_service(calls.clone()));
    assert!(send_keyed(&mut held, "err").await.is_err());
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let retry = send_keyed(&mut held, "err").await.unwrap();
    assert_eq!(retry.status(), 409);
    assert!(retry.headers().contains_key("retry-after"), "{retry:?}");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);

    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut released = layer()
        .on_unstored(idempotency_tower::OnUnstored::Release)
        .layer(failing_service(calls.clone()));
    assert!(send_keyed(&mut released, "err").await.is_err());
    // The key is released before the error is returned.
    assert!(send_keyed(&mut released, "err").await.is_err());
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
}
