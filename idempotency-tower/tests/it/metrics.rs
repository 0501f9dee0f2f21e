//! The outcome counters count each request once.
#![cfg(feature = "metrics")]
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use idempotency_core::{Idempotency, Policy};
use idempotency_memory::MemoryStore;
use idempotency_tower::{IdempotencyLayer, RequestBody};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use std::convert::Infallible;
use std::sync::Arc;
use tower::{Service, ServiceBuilder, ServiceExt};

/// The `idempotency_http_outcomes_total` counter per outcome label.
fn outcomes(recorder: &DebuggingRecorder) -> Vec<(String, u64)> {
    let mut counts: Vec<(String, u64)> = recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == "idempotency_http_outcomes_total")
        .filter_map(|(key, _, _, value)| {
            let label = key.key().labels().find(|l| l.key() == "outcome")?;
            match value {
                DebugValue::Counter(n) => Some((label.value().to_owned(), n)),
                _ => None,
            }
        })
        .collect();
    counts.sort();
    counts
}

/// A handler that panics is one request with one outcome, `handler_panicked`, counted once
/// (the release of its key and the failed task are one event).
#[test]
fn a_panicking_handler_is_counted_once() {
    let recorder = DebuggingRecorder::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let engine = Idempotency::new(Arc::new(MemoryStore::new()), Policy::default()).unwrap();
            let mut svc = ServiceBuilder::new()
                .layer(IdempotencyLayer::shared(engine))
                .service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
                    if true {
                        panic!("deliberate panic in the handler (metrics test)");
                    }
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                });
            let req = Request::post("/orders")
                .header("idempotency-key", "panics")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(b"{}")))
                .unwrap();
            let resp = svc.ready().await.unwrap().call(req).await.unwrap();
            assert_eq!(resp.status(), 500);
            let _ = resp.into_body().collect().await.unwrap();
        })
    });
    assert_eq!(
        outcomes(&recorder),
        vec![("handler_panicked".to_owned(), 1)]
    );
}

/// A handler error whose key the store could not settle (the stand-in failure was refused)
/// is counted as held, not settled: the key stays Pending until its lease passes.
#[test]
fn a_handler_error_the_store_cannot_settle_is_counted_as_held() {
    use idempotency_conformance::{Fault, FlakyOp, FlakyStore};
    let recorder = DebuggingRecorder::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let flaky = FlakyStore::new(Arc::new(MemoryStore::new()), Fault::Refused);
    // Every try of the stand-in write is refused.
    flaky.inject(FlakyOp::Fail, 1_000);
    let store: Arc<dyn idempotency_core::IdempotencyStore> = Arc::new(flaky.clone());
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let engine = Idempotency::new(store.clone(), Policy::default()).unwrap();
            let mut svc = ServiceBuilder::new()
                .layer(IdempotencyLayer::shared(engine))
                .service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
                    Err::<Response<Full<Bytes>>, _>(std::io::Error::other("handler failed"))
                });
            let req = Request::post("/orders")
                .header("idempotency-key", "unsettled")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(b"{}")))
                .unwrap();
            let answer = svc.ready().await.unwrap().call(req).await;
            assert!(answer.is_err(), "the handler's error is returned");
        })
    });
    assert!(flaky.injected() > 0, "the stand-in write was refused");
    assert_eq!(
        outcomes(&recorder),
        vec![("handler_error_held".to_owned(), 1)]
    );
}
