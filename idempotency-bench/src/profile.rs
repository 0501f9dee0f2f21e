//! `--profile WORKLOAD`: one workload on the memory store in a tight loop on a current-thread
//! runtime, keys built before the loop. Meant to be run under
//! `valgrind --tool=callgrind --toggle-collect='*hot_loop*'`, which counts the instructions of
//! the loop alone: a figure that a loaded machine does not disturb.

use crate::harness::{self, RawBaseline};
use crate::memory::RawMemory;
use idempotency_core::{BoxError, Claim, ClaimRequest, IdempotencyKey, RecordId};
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
            .map(|k| RecordId::new(scope.clone(), k.clone()))
            .collect();
        if workload.ends_with("replay") {
            for (id, k) in ids.iter().zip(&raw_keys) {
                harness::store_cycle(store.as_ref(), id.clone()).await?;
                raw.new_key_cycle(k, harness::OUTCOME.as_bytes()).await?;
            }
        }
        Ok::<_, BoxError>((store, raw, engine, ids, raw_keys))
    })?;
    let elapsed = hot_loop(&rt, workload, &store, &raw, &engine, &ids, &raw_keys)?;
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
