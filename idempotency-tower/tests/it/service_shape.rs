//! The service's shape as tower-http's middleware have it: a named response future, named body
//! types, and access to the wrapped service.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use idempotency_core::Idempotency;
use idempotency_memory::MemoryStore;
use idempotency_tower::{
    IdempotencyLayer, IdempotencyService, RequestBody, ResponseBody, ResponseFuture,
};
use std::convert::Infallible;
use std::future::{ready, Ready};
use std::task::{Context, Poll};
use tower::{Layer, Service, ServiceExt};

/// Answers with what it saw of the request body: its size hint and its bytes.
#[derive(Clone, Debug, Default)]
struct Echo {
    calls: usize,
}

impl Service<Request<RequestBody<Full<Bytes>>>> for Echo {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<RequestBody<Full<Bytes>>>) -> Self::Future {
        self.calls += 1;
        let body = req.into_body();
        let hint = body.size_hint().exact();
        let bytes = futures::executor::block_on(body.collect())
            .unwrap()
            .to_bytes();
        let text = format!("{hint:?} {}", String::from_utf8_lossy(&bytes));
        ready(Ok(Response::new(Full::new(Bytes::from(text)))))
    }
}

fn service() -> IdempotencyService<Echo> {
    let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    IdempotencyLayer::shared(engine).layer(Echo::default())
}

async fn text(resp: Response<ResponseBody<Full<Bytes>>>) -> String {
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn the_future_is_named_and_bodies_forward_their_size() {
    let mut svc = service();
    let covered = Request::post("/orders")
        .header("idempotency-key", "k1")
        .body(Full::new(Bytes::from_static(b"order")))
        .unwrap();
    let future: ResponseFuture<Full<Bytes>, Infallible> = svc.ready().await.unwrap().call(covered);
    let resp = future.await.unwrap();
    assert_eq!(resp.body().size_hint().exact(), Some(13));
    assert_eq!(text(resp).await, "Some(5) order");

    let passed = Request::get("/orders")
        .body(Full::new(Bytes::from_static(b"as sent")))
        .unwrap();
    let resp = svc.ready().await.unwrap().call(passed).await.unwrap();
    assert_eq!(text(resp).await, "Some(7) as sent");
}

#[tokio::test]
async fn the_wrapped_service_is_reachable() {
    let mut svc = service();
    let req = Request::post("/orders")
        .header("idempotency-key", "k2")
        .body(Full::new(Bytes::new()))
        .unwrap();
    svc.ready().await.unwrap().call(req).await.unwrap();
    // `call` hands the request to the service polled ready and keeps a clone of it.
    assert_eq!(svc.get_ref().calls, 0);
    svc.get_mut().calls = 7;
    assert_eq!(svc.get_ref().calls, 7);
    assert_eq!(svc.into_inner().calls, 7);
}
