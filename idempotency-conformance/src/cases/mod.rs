//! The conformance cases. Each is a `pub async fn(TestStore)` that panics on a violation.
//!
//! The cases are grouped by theme in submodules and re-exported here, so every case is
//! `idempotency_conformance::cases::<name>`. The helpers at the top are public for
//! hand-written tests of a store.

mod basic;
mod batch;
mod engine;
mod engine_batch;
mod engine_faults;
mod history;
mod model;
mod races;
mod time;

pub use basic::*;
pub use batch::*;
pub use engine::*;
pub use engine_batch::*;
pub use engine_faults::*;
pub use history::*;
pub use model::*;
pub use races::*;
pub use time::*;

use crate::TestStore;
use idempotency_core::store::{Cas, Claim, ClaimRequest, Record, RecordStatus, Timestamp};
use idempotency_core::{FencingToken, Fingerprint, IdempotencyKey, RecordId, Scope};
use std::sync::Arc;
use std::time::Duration;

/// A record address unique to this call.
pub fn unique_id(label: &str) -> RecordId {
    RecordId::new(
        IdempotencyKey::random(),
        Scope::from_parts(["conformance", label]).expect("valid scope"),
    )
}

/// A claim request for `id` with `fingerprint`, a lease and a TTL.
pub fn request(
    id: &RecordId,
    fingerprint: Fingerprint,
    lease: Duration,
    ttl: Duration,
) -> ClaimRequest {
    ClaimRequest::new(id.clone(), fingerprint, lease, ttl)
}

/// A fingerprint of `label`'s bytes.
pub fn fp(label: &str) -> Fingerprint {
    Fingerprint::from_bytes(label.as_bytes())
}

/// Claims `id`, asserting that it was claimed, and returns the token.
pub async fn must_claim(t: &TestStore, req: &ClaimRequest) -> FencingToken {
    must_claim_with_lease(t, req).await.0
}

/// Claims `id`, asserting that it was claimed, and returns the token and lease deadline.
pub async fn must_claim_with_lease(t: &TestStore, req: &ClaimRequest) -> (FencingToken, Timestamp) {
    match t.store.claim(req).await.expect("claim") {
        Claim::Claimed { token, lease_until } => (token, lease_until),
        Claim::Existing { record, .. } => {
            panic!(
                "expected the claim of {} to be Claimed, found a live record {record:?}",
                req.id
            )
        }
    }
}

/// Claims `id`, asserting that a live record exists, and returns it.
pub async fn must_observe(t: &TestStore, req: &ClaimRequest) -> Record {
    must_observe_at(t, req).await.0
}

/// Claims `id`, asserting that a live record exists, and returns it with the store's `now`.
pub async fn must_observe_at(t: &TestStore, req: &ClaimRequest) -> (Record, Timestamp) {
    match t.store.claim(req).await.expect("claim") {
        Claim::Existing { record, now } => (record, now),
        Claim::Claimed { token, .. } => panic!(
            "expected the claim of {} to observe a live record, but it was Claimed({token}) \
             (a live record was overwritten, or the record was lost)",
            req.id
        ),
    }
}

/// `n` claims of `req` released together behind a barrier, each in its own task; their
/// answers, in spawn order.
pub async fn concurrent_claims(t: &TestStore, req: &ClaimRequest, n: usize) -> Vec<Claim> {
    let req = Arc::new(req.clone());
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (store, req, barrier) = (t.store.clone(), req.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.claim(&req).await.expect("claim")
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(n);
    for task in tasks {
        answers.push(task.await.expect("task"));
    }
    answers
}

/// Reads `id`, asserting that it is present (live).
pub async fn present(t: &TestStore, id: &RecordId) -> Record {
    t.store
        .get(id)
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("expected {id} to be present, get returned None"))
}

/// Reads `id`, asserting that it is absent (or expired).
pub async fn absent(t: &TestStore, id: &RecordId) {
    if let Some(r) = t.store.get(id).await.expect("get") {
        panic!("expected {id} to be absent, found {r:?}");
    }
}

/// Completes `id` with `token`, asserting that the CAS applied.
pub async fn must_complete(t: &TestStore, id: &RecordId, token: FencingToken, outcome: &[u8]) {
    assert_eq!(
        t.store
            .complete(id, token, outcome, t.long())
            .await
            .expect("complete"),
        Cas::Applied,
        "complete({id}, token {token}) by the holder was refused"
    );
}

/// `record` with `hits` replaced, to compare records that differ only by observations.
pub fn with_hits(record: &Record, hits: u64) -> Record {
    Record {
        hits,
        ..record.clone()
    }
}

/// Claim, complete, then replay byte-identical outcomes: a JSON one, an empty one and a
/// 1 MiB binary one holding every byte value (on a store with an item size limit, the
/// largest it declares in [`crate::Capabilities::max_outcome_bytes`]).
pub async fn claim_complete_replay(t: TestStore) {
    // 1 MiB, or the most a store with an item size limit holds.
    let big_len = t
        .capabilities
        .max_outcome_bytes
        .map_or(1024 * 1024, |max| max.min(1024 * 1024));
    let big: Vec<u8> = (0..u32::try_from(big_len).expect("an outcome size fits u32"))
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    for outcome in [br#"{"ok":true}"#.to_vec(), Vec::new(), big] {
        let id = unique_id("replay");
        let fp = fp("payload");
        let req = request(&id, fp, t.long(), t.long());
        let token = must_claim(&t, &req).await;
        let pending = t
            .store
            .get(&id)
            .await
            .expect("get")
            .expect("pending record present");
        assert_eq!(pending.status, RecordStatus::Pending);
        assert_eq!(pending.token, token);
        assert_eq!(pending.fingerprint, fp);
        assert_eq!(pending.attempts, 1);
        assert!(
            pending.lease_until.is_some(),
            "a Pending record has a lease"
        );
        assert_eq!(
            t.store
                .complete(&id, token, &outcome, t.long())
                .await
                .expect("complete"),
            Cas::Applied
        );
        let seen = must_observe(&t, &req).await;
        assert_eq!(seen.status, RecordStatus::Completed);
        assert_eq!(seen.token, token);
        assert_eq!(
            seen.outcome.as_deref(),
            Some(outcome.as_slice()),
            "outcome replayed byte-identical"
        );
        assert_eq!(seen.lease_until, None, "a Completed record has no lease");
        // Completing twice is refused: the record is no longer Pending.
        assert_eq!(
            t.store
                .complete(&id, token, b"other", t.long())
                .await
                .expect("complete"),
            Cas::Fenced
        );
        let again = t.store.get(&id).await.expect("get").expect("present");
        assert_eq!(again.outcome.as_deref(), Some(outcome.as_slice()));
    }
}

/// A claim with a different fingerprint observes the record and changes nothing but hits.
pub async fn mismatch_leaves_record_unchanged(t: TestStore) {
    let id = unique_id("mismatch");
    let fp = fp("a");
    let req = request(&id, fp, t.long(), t.long());
    let token = must_claim(&t, &req).await;
    t.store
        .complete(&id, token, b"first", t.long())
        .await
        .expect("complete");
    let before = t.store.get(&id).await.expect("get").expect("present");
    let other = request(&id, self::fp("b"), t.long(), t.long());
    let seen = must_observe(&t, &other).await;
    assert_eq!(
        seen.fingerprint, fp,
        "the stored fingerprint is the first request's"
    );
    let after = t.store.get(&id).await.expect("get").expect("present");
    assert_eq!(after.hits, before.hits + 1);
    assert_eq!(
        Record {
            hits: before.hits,
            ..after
        },
        before,
        "a mismatching claim changed the record"
    );
}

/// 64 concurrent claims of one key: exactly one `Claimed`, and 63 observe the same token.
pub async fn concurrent_claims_one_winner(t: TestStore) {
    for round in 0..5 {
        let id = unique_id("race");
        let req = request(&id, fp("x"), t.long(), t.long());
        let mut winners = Vec::new();
        let mut observed = Vec::new();
        for answer in concurrent_claims(&t, &req, 64).await {
            match answer {
                Claim::Claimed { token, .. } => winners.push(token),
                Claim::Existing { record, .. } => observed.push(record.token),
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "round {round}: {} claims won",
            winners.len()
        );
        assert!(
            observed.iter().all(|t| *t == winners[0]),
            "observers saw another token"
        );
        let r = t.store.get(&id).await.expect("get").expect("present");
        assert_eq!(r.hits, 63, "every observation counts one hit");
    }
}
