//! Criterion microbenchmarks: the decision, fingerprinting, and the tower layer's added
//! latency over the same axum handler on the memory store.

use axum::routing::post;
use axum::Router;
use criterion::{black_box, criterion_main, Criterion};
use http_body_util::BodyExt;
use idempotency_core::store::{decide, DecisionOptions, Record, RecordStatus, Timestamp};
use idempotency_core::{FencingToken, Fingerprint, IdempotencyKey, RecordId, Scope};
use idempotency_core::{Idempotency, Policy};
use idempotency_memory::MemoryStore;
use idempotency_tower::IdempotencyLayer;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tower::ServiceExt;

fn record() -> Record {
    Record {
        id: RecordId::new(
            IdempotencyKey::new("k").expect("key"),
            Scope::new("tenant|POST /orders").expect("scope"),
        ),
        fingerprint: Fingerprint::from_bytes(b"a"),
        status: RecordStatus::Completed,
        token: FencingToken(1),
        lease_until: None,
        outcome: Some(b"{}".to_vec()),
        attempts: 1,
        failure: None,
        hits: 3,
        created_at: Timestamp::from_millis(0),
        updated_at: Timestamp::from_millis(0),
        expires_at: Timestamp::from_millis(i64::MAX),
    }
}

/// The 1 KiB JSON body every figure here is taken over.
fn body_1k() -> Vec<u8> {
    idempotency_testing::payloads::order_json_1k()
}

fn benches(c: &mut Criterion) {
    let r = record();
    let fp = Fingerprint::from_bytes(b"a");
    let now = Timestamp::from_millis(1_000);
    c.bench_function("decide (completed, same fingerprint)", |b| {
        b.iter(|| {
            decide(
                black_box(Some(&r)),
                black_box(&fp),
                now,
                DecisionOptions::default(),
            )
        })
    });
    let body = body_1k();
    assert!(
        (960..1100).contains(&body.len()),
        "body is {} bytes",
        body.len()
    );
    c.bench_function("fingerprint 1 KiB JSON body (canonical)", |b| {
        b.iter(|| {
            Fingerprint::builder()
                .method("POST")
                .path("/orders")
                .content_type("application/json")
                .body(black_box(&body))
                .finish()
        })
    });
    c.bench_function("fingerprint 1 KiB raw bytes", |b| {
        b.iter(|| Fingerprint::from_bytes(black_box(&body)))
    });
    // What reading the same text costs serde_json, which neither sorts nor writes anything:
    // a floor for any canonicaliser that must parse every byte.
    c.bench_function("serde_json: validate 1 KiB (IgnoredAny)", |b| {
        b.iter(|| serde_json::from_slice::<serde::de::IgnoredAny>(black_box(&body)).expect("JSON"))
    });
    c.bench_function("serde_json: parse 1 KiB into a Value", |b| {
        b.iter(|| serde_json::from_slice::<serde_json::Value>(black_box(&body)).expect("JSON"))
    });
}

async fn create_order() -> ([(http::HeaderName, &'static str); 1], &'static str) {
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        r#"{"order_id":"ord_0123456789","ok":true}"#,
    )
}

fn request(key: &str) -> http::Request<axum::body::Body> {
    http::Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(axum::body::Body::from(body_1k()))
        .expect("request")
}

/// Sends one request through `app` and reads the whole response, as a server would.
async fn call(app: &Router, key: &str) -> http::StatusCode {
    let response = app.clone().oneshot(request(key)).await.expect("infallible");
    let status = response.status();
    let body = response.into_body().collect().await.expect("body");
    black_box(body.to_bytes());
    status
}

/// The same axum handler with and without the layer, on the memory store, driven in process
/// (no sockets) on a current-thread runtime: the difference is what the layer adds. Both
/// requests carry the same headers and the same 1 KiB JSON body, which the layer
/// fingerprints (canonical JSON) on every request, replays included.
fn tower_layer(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let plain = Router::new().route("/orders", post(create_order));
    let engine = Idempotency::new(Arc::new(MemoryStore::new()), Policy::default()).expect("engine");
    let layered = Router::new()
        .route("/orders", post(create_order))
        .layer(IdempotencyLayer::shared(engine.clone()));
    // The same layer fingerprinting the body as raw bytes (SHA-256, no canonical JSON): what
    // the layer costs besides the canonicaliser.
    let raw_fingerprint = Router::new().route("/orders", post(create_order)).layer(
        IdempotencyLayer::shared(engine).fingerprint_with(|input| {
            Fingerprint::builder()
                .method(input.parts().method.as_str())
                .path(input.parts().uri.path())
                .body(input.body())
                .finish()
        }),
    );
    let n = AtomicU64::new(0);
    let fresh_key = || format!("k-{}", n.fetch_add(1, Ordering::Relaxed));

    let mut g = c.benchmark_group("axum handler");
    g.bench_function("without the layer", |b| {
        b.to_async(&rt).iter(|| {
            let key = fresh_key();
            let app = &plain;
            async move { assert_eq!(call(app, &key).await, 200) }
        })
    });
    for (name, app, replayed_key) in [
        ("with the layer", &layered, "replayed-key"),
        (
            "with the layer, body hashed raw",
            &raw_fingerprint,
            "replayed-key-raw",
        ),
    ] {
        g.bench_function(format!("{name}, first execution"), |b| {
            b.to_async(&rt).iter(|| {
                let key = fresh_key();
                async move { assert_eq!(call(app, &key).await, 200) }
            })
        });
        rt.block_on(call(app, replayed_key));
        let replayed = rt.block_on(app.clone().oneshot(request(replayed_key)));
        assert_eq!(
            replayed
                .expect("infallible")
                .headers()
                .get("idempotent-replayed")
                .map(|v| v.as_bytes()),
            Some(&b"true"[..]),
            "the replay benchmark must measure replays"
        );
        g.bench_function(format!("{name}, replay"), |b| {
            b.to_async(&rt)
                .iter(|| async move { assert_eq!(call(app, replayed_key).await, 200) })
        });
    }
    g.finish();
}

// The macros define undocumented public functions.
#[allow(missing_docs)]
mod group {
    use super::{benches, tower_layer};
    criterion::criterion_group!(micro, benches, tower_layer);
}
criterion_main!(group::micro);
