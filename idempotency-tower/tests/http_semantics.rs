//! Behaviour that a real client cannot see over the wire: the `Connection` header of a 413 per
//! HTTP version (hyper strips `Connection` from HTTP/2 responses), and the shared-scope warning.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body_util::Full;
use idempotency_core::{Idempotency, Policy};
use idempotency_memory::MemoryStore;
use idempotency_tower::{IdempotencyLayer, RequestBody};
use std::convert::Infallible;
use std::io::Write;
use std::sync::{Arc, Mutex};
use tower::{Layer, Service, ServiceExt};

fn layer() -> IdempotencyLayer {
    let engine = Idempotency::new(Arc::new(MemoryStore::new()), Policy::default()).unwrap();
    IdempotencyLayer::new(engine)
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

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn required_without_scope_warns_once_per_layer() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let count = || {
        String::from_utf8(captured.0.lock().unwrap().clone())
            .unwrap()
            .matches("has no scope function")
            .count()
    };
    let shared = layer().required(true);
    let _a = shared.layer(handler!());
    let _b = shared.clone().layer(handler!());
    let _c = shared.layer(handler!());
    assert_eq!(count(), 1, "once per layer, clones included");
    let _other = layer().required(true).layer(handler!());
    assert_eq!(count(), 2, "another layer warns for itself");
    let _scoped = layer()
        .required(true)
        .scope(|_| Some("caller".into()))
        .layer(handler!());
    let _optional = layer().layer(handler!());
    assert_eq!(count(), 2, "no warning with a scope, or without required");
}
