//! `--profile WORKLOAD`: one workload on the memory store in a tight loop on a current-thread
//! runtime, keys built before the loop. Meant to be run under
//! `valgrind --tool=callgrind --toggle-collect='*hot_loop*'`, which counts the instructions of
//! the loop alone: a figure that a loaded machine does not disturb.

use crate::harness::{self, RawBaseline};
use crate::memory::RawMemory;
use idempotency_core::store::{BoxError, Claim, ClaimRequest};
use idempotency_core::{IdempotencyKey, RecordId};
use idempotency_memory::MemoryStore;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) const WORKLOADS: &[&str] = &[
    "store-cycle",
    "store-replay",
    "engine-cycle",
    "engine-replay",
    "raw-cycle",
    "raw-replay",
    "fingerprint-1k",
    "http-plain",
    "http-first",
    "http-replay",
    "http-first-raw",
    "http-replay-raw",
];

pub(crate) fn run(workload: &str, ops: usize) -> Result<(), BoxError> {
    if !WORKLOADS.contains(&workload) {
        return Err(format!("--profile takes one of {WORKLOADS:?}, not {workload:?}").into());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (store, raw, engine, ids, raw_keys) = rt.block_on(async {
        let store = Arc::new(MemoryStore::new());
        let raw = RawMemory::default();
        let engine = harness::engine(store.clone())?;
        let scope = harness::scope();
        let keys: Vec<IdempotencyKey> = (0..ops).map(|i| harness::key("p", 0, i)).collect();
        let raw_keys: Vec<String> = keys.iter().map(|k| k.as_str().to_owned()).collect();
        let ids: Vec<RecordId> = keys
            .iter()
            .map(|k| RecordId::new(k.clone(), scope.clone()))
            .collect();
        // The `http-*` workloads fill their own store (see `http_loop`).
        if workload.ends_with("replay") && !workload.starts_with("http-") {
            for (id, k) in ids.iter().zip(&raw_keys) {
                harness::store_cycle(store.as_ref(), id.clone()).await?;
                raw.new_key_cycle(k, harness::OUTCOME.as_bytes()).await?;
            }
        }
        Ok::<_, BoxError>((store, raw, engine, ids, raw_keys))
    })?;
    let elapsed = if let Some(http) = workload.strip_prefix("http-") {
        http_loop(&rt, http, engine, &ids)?
    } else {
        hot_loop(&rt, workload, &store, &raw, &engine, &ids, &raw_keys)?
    };
    println!(
        "{workload}: {ops} ops in {elapsed:?}, {:.0} ns/op (wall clock; use callgrind for \
         instruction counts)",
        elapsed.as_nanos() as f64 / ops as f64
    );
    Ok(())
}

/// The measured loop; a plain function (not an `async fn`) so that callgrind's
/// `--toggle-collect='*hot_loop*'` covers everything the runtime polls inside it.
#[inline(never)]
fn hot_loop(
    rt: &tokio::runtime::Runtime,
    workload: &str,
    store: &Arc<MemoryStore>,
    raw: &RawMemory,
    engine: &idempotency_core::Idempotency,
    ids: &[RecordId],
    raw_keys: &[String],
) -> Result<Duration, BoxError> {
    rt.block_on(async {
        let start = Instant::now();
        let fp = harness::fingerprint();
        match workload {
            "store-cycle" => {
                for id in ids {
                    harness::store_cycle(store.as_ref(), id.clone()).await?;
                }
            }
            "store-replay" => {
                for id in ids {
                    let req = ClaimRequest::new(
                        id.clone(),
                        fp,
                        Duration::from_secs(30),
                        Duration::from_secs(3600),
                    );
                    let Claim::Existing { .. } =
                        idempotency_core::IdempotencyStore::claim(store.as_ref(), &req).await?
                    else {
                        return Err("a completed key was claimed".into());
                    };
                }
            }
            "engine-cycle" => {
                for id in ids {
                    harness::engine_cycle(engine, &id.scope, &id.key).await?;
                }
            }
            "engine-replay" => {
                for id in ids {
                    harness::engine_replay(engine, &id.scope, &id.key).await?;
                }
            }
            "fingerprint-1k" => {
                // The request fingerprint the HTTP layer takes of every request, replays
                // included: method, path, content type and a 1 KiB JSON body, canonicalised.
                let body = idempotency_testing::payloads::order_json_1k();
                for _ in ids {
                    std::hint::black_box(
                        idempotency_core::Fingerprint::builder()
                            .method("POST")
                            .path("/orders")
                            .content_type("application/json")
                            .body(std::hint::black_box(&body))
                            .finish(),
                    );
                }
            }
            "raw-cycle" => {
                for k in raw_keys {
                    raw.new_key_cycle(k, harness::OUTCOME.as_bytes()).await?;
                }
            }
            _ => {
                for k in raw_keys {
                    raw.replay(k).await?.ok_or("raw replay found nothing")?;
                }
            }
        }
        Ok(start.elapsed())
    })
}

/// What the handler answers in the `http-*` workloads.
async fn create_order() -> ([(http::HeaderName, &'static str); 1], &'static str) {
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        harness::OUTCOME,
    )
}

/// The `http-*` workloads: the same axum handler without the layer (`plain`), and with it on
/// the memory store, each request a fresh key (`first`) or the same key again (`replay`),
/// with the canonical JSON fingerprint or the body hashed raw (`-raw`: what the layer costs
/// besides the canonicaliser). Requests carry the 1 KiB JSON body and are built before the
/// loop; the loop sends each through the router and reads the whole response, as a server
/// would.
fn http_loop(
    rt: &tokio::runtime::Runtime,
    workload: &str,
    engine: idempotency_core::Idempotency,
    ids: &[RecordId],
) -> Result<Duration, BoxError> {
    use axum::routing::post;
    use axum::Router;
    use idempotency_core::Fingerprint;
    use idempotency_tower::IdempotencyLayer;

    let route = || Router::new().route("/orders", post(create_order));
    let layer = IdempotencyLayer::shared(engine);
    let app = match workload {
        "plain" => route(),
        "first" | "replay" => route().layer(layer),
        "first-raw" | "replay-raw" => route().layer(layer.fingerprint_with(|input| {
            Fingerprint::builder()
                .method(input.parts().method.as_str())
                .path(input.parts().uri.path())
                .body(input.body())
                .finish()
        })),
        other => return Err(format!("no http workload {other:?}").into()),
    };
    let replay = workload.starts_with("replay");
    let body = bytes::Bytes::from(idempotency_testing::payloads::order_json_1k());
    let request = |key: &str| {
        http::Request::post("/orders")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(axum::body::Body::from(body.clone()))
    };
    let requests = ids
        .iter()
        .map(|id| request(if replay { "replayed" } else { id.key.as_str() }))
        .collect::<Result<Vec<_>, _>>()?;
    if replay {
        rt.block_on(send(&app, request("replayed")?))?;
    }
    http_hot_loop(rt, &app, requests)
}

async fn send(
    app: &axum::Router,
    request: http::Request<axum::body::Body>,
) -> Result<(), BoxError> {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let response = app.clone().oneshot(request).await?;
    if response.status() != http::StatusCode::OK {
        return Err(format!("the handler answered {}", response.status()).into());
    }
    std::hint::black_box(response.into_body().collect().await?.to_bytes());
    Ok(())
}

/// The measured loop of the `http-*` workloads (see [`hot_loop`]).
#[inline(never)]
fn http_hot_loop(
    rt: &tokio::runtime::Runtime,
    app: &axum::Router,
    requests: Vec<http::Request<axum::body::Body>>,
) -> Result<Duration, BoxError> {
    rt.block_on(async {
        let start = Instant::now();
        for request in requests {
            send(app, request).await?;
        }
        Ok(start.elapsed())
    })
}
