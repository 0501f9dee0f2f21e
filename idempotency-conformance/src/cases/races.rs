//! Races: concurrent reclaimers and takers, stale snapshots, live leases.

use super::{
    fp, must_claim, must_complete, must_observe_at, present, request, unique_id, with_hits,
};
use crate::{TestStore, TimeControl};
use idempotency_core::store::{
    Cas, Claim, ClaimRequest, Clock, Failure, Reclaim, Record, RecordStatus,
};
use idempotency_core::{FencingToken, Fingerprint, IdempotencyStore};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;

const RECLAIMERS: usize = 32;

/// Runs `RECLAIMERS` tasks released together by a barrier; returns their results in order.
async fn race<T, F, Fut>(t: &TestStore, task: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize, Arc<dyn IdempotencyStore>) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(RECLAIMERS));
    let handles: Vec<_> = (0..RECLAIMERS)
        .map(|i| {
            let barrier = barrier.clone();
            let fut = task(i, t.store.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                fut.await
            })
        })
        .collect();
    let mut out = Vec::with_capacity(RECLAIMERS);
    for h in handles {
        out.push(h.await.expect("racing task panicked"));
    }
    out
}

/// 32 concurrent reclaimers of a Failed record, each with the token it read: exactly one
/// wins, over several rounds, and the record holds the winner's token and fingerprint.
pub async fn concurrent_reclaims_of_failed_one_winner(t: TestStore) {
    for round in 0..8 {
        let id = unique_id("reclaim-race");
        let token = must_claim(&t, &request(&id, fp("x"), t.long(), t.long())).await;
        assert_eq!(
            t.store
                .fail(&id, token, &Failure::retryable("boom"), t.long())
                .await
                .expect("fail"),
            Cas::Applied
        );
        let long = t.long();
        let results = race(&t, |i, store| {
            let id = id.clone();
            async move {
                let fingerprint = fp(&format!("reclaimer-{i}"));
                let r = store
                    .reclaim(&id, token, &fingerprint, long, long)
                    .await
                    .expect("reclaim");
                (fingerprint, r)
            }
        })
        .await;
        let winners: Vec<(Fingerprint, FencingToken)> = results
            .into_iter()
            .filter_map(|(f, r)| match r {
                Reclaim::Reclaimed { token, .. } => Some((f, token)),
                Reclaim::Lost => None,
            })
            .collect();
        assert_eq!(
            winners.len(),
            1,
            "round {round}: {} of {RECLAIMERS} concurrent reclaimers of a Failed record won; \
             exactly one may",
            winners.len()
        );
        let (winner_fp, winner_token) = winners[0];
        assert_eq!(
            winner_token,
            token.next(),
            "reclaim sets token = expected + 1"
        );
        let r = present(&t, &id).await;
        assert_eq!(
            (r.status, r.token, r.fingerprint, r.attempts),
            (RecordStatus::Pending, winner_token, winner_fp, 2),
            "round {round}: the record is not the winner's"
        );
    }
}

/// After the lease passes, exactly one of 32 takers (claim, see the passed lease, reclaim)
/// wins; the old holder's complete, fail, extend and reclaim are then refused and change
/// nothing.
pub async fn lease_passed_one_taker_old_holder_fenced(t: TestStore) {
    let mut held = Vec::new();
    for _ in 0..4 {
        let id = unique_id("taker");
        let req = request(&id, fp("job"), t.short_lease(), t.long());
        let token = must_claim(&t, &req).await;
        held.push((req, token));
    }
    t.advance(t.short_lease()).await;
    for (round, (req, old)) in held.into_iter().enumerate() {
        let id = req.id.clone();
        let req = Arc::new(req);
        let long = t.long();
        let results = race(&t, |_, store| {
            let req = req.clone();
            async move {
                match store.claim(&req).await.expect("claim") {
                    Claim::Claimed { token, .. } => panic!(
                        "a claim replaced a live record whose lease had passed (Claimed({token})); \
                         it must be observed and reclaimed by CAS"
                    ),
                    // Another taker won already: the lease is live again.
                    Claim::Existing { record, now } if !record.lease_passed(now) => None,
                    Claim::Existing { record, .. } => Some(
                        store
                            .reclaim(&req.id, record.token, &req.fingerprint, long, long)
                            .await
                            .expect("reclaim"),
                    ),
                }
            }
        })
        .await;
        let tried = results.iter().filter(|r| r.is_some()).count();
        assert!(tried >= 1, "round {round}: no taker saw the passed lease");
        let winners: Vec<FencingToken> = results
            .into_iter()
            .flatten()
            .filter_map(|r| match r {
                Reclaim::Reclaimed { token, .. } => Some(token),
                Reclaim::Lost => None,
            })
            .collect();
        assert_eq!(
            winners.len(),
            1,
            "round {round}: {} of {RECLAIMERS} takers of a passed lease won; exactly one may",
            winners.len()
        );
        assert_eq!(winners[0], old.next(), "reclaim sets token = expected + 1");
        let after = present(&t, &id).await;
        assert_eq!(after.status, RecordStatus::Pending);
        assert_eq!(after.token, winners[0]);

        // The old holder is fenced.
        assert_eq!(
            t.store
                .complete(&id, old, b"stale holder", t.long())
                .await
                .expect("complete"),
            Cas::Fenced,
            "the old holder completed after a taker won"
        );
        assert_eq!(
            t.store
                .fail(&id, old, &Failure::retryable("stale"), t.long())
                .await
                .expect("fail"),
            Cas::Fenced,
            "the old holder failed the record after a taker won"
        );
        assert_eq!(
            t.store.extend(&id, old, t.long()).await.expect("extend"),
            Cas::Fenced,
            "the old holder extended a lease it lost"
        );
        assert_eq!(
            t.store
                .reclaim(&id, old, &fp("job"), t.long(), t.long())
                .await
                .expect("reclaim"),
            Reclaim::Lost,
            "the old holder reclaimed with its fenced token"
        );
        assert_eq!(
            present(&t, &id).await,
            after,
            "the old holder's refused writes changed the record"
        );
        // And the new holder's writes apply.
        must_complete(&t, &id, winners[0], b"taker").await;
    }
}

/// Reads the record in one task, lets `interleave` change it in another, then reclaims with
/// the token read. Returns the reclaim's result, the record as `interleave` left it, and the
/// record afterwards. Barriers force the order.
async fn stale_read_then_reclaim<F, Fut>(
    t: &TestStore,
    req: ClaimRequest,
    interleave: F,
) -> (Reclaim, Record, Record)
where
    F: FnOnce(Arc<dyn IdempotencyStore>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let seen = Arc::new(Barrier::new(2));
    let changed = Arc::new(Barrier::new(2));
    let long = t.long();
    let id = req.id.clone();
    let reader = {
        let (store, seen, changed) = (t.store.clone(), seen.clone(), changed.clone());
        tokio::spawn(async move {
            let record = match store.claim(&req).await.expect("claim") {
                Claim::Existing { record, .. } => record,
                Claim::Claimed { token, .. } => {
                    panic!("the reader's claim overwrote a live record (Claimed({token}))")
                }
            };
            seen.wait().await;
            changed.wait().await;
            store
                .reclaim(&req.id, record.token, &fp("stale reader"), long, long)
                .await
                .expect("reclaim")
        })
    };
    let writer = {
        let (store, id) = (t.store.clone(), id.clone());
        tokio::spawn(async move {
            seen.wait().await;
            interleave(store.clone()).await;
            let snapshot = store.get(&id).await.expect("get");
            changed.wait().await;
            snapshot
        })
    };
    let snapshot = writer
        .await
        .expect("writer task")
        .expect("the record vanished during the interleaving");
    let result = reader.await.expect("reader task");
    let after = present(t, &id).await;
    (result, snapshot, after)
}

/// The stale-snapshot race (Powertools typescript#5714), forced with barriers: a reader sees
/// a record it could reclaim, the record moves on, and the reader's reclaim with the token it
/// read must fail without touching the record. Three interleavings: the holder of a passed
/// lease completes late; another reclaimer takes a Failed record and completes; another
/// reclaimer takes a Failed record and fails again (same status, newer token).
pub async fn stale_snapshot_reclaim_loses(t: TestStore) {
    let long = t.long();

    // 1. Pending with a passed lease; the holder completes after the reader looked.
    let id = unique_id("stale-pending");
    let req = request(&id, fp("job"), t.short_lease(), t.long());
    let holder = must_claim(&t, &req).await;
    t.advance(t.short_lease()).await;
    let (_, now) = must_observe_at(&t, &req).await;
    let r = present(&t, &id).await;
    assert!(
        r.lease_passed(now),
        "the lease should have passed after advancing by it"
    );
    let (result, snapshot, after) = stale_read_then_reclaim(&t, req, move |store| async move {
        // Nobody took over, so the late holder may still complete.
        let cas = store
            .complete(&id, holder, b"late but valid", long)
            .await
            .expect("complete");
        assert_eq!(
            cas,
            Cas::Applied,
            "the holder of a passed lease that nobody took over could not complete"
        );
    })
    .await;
    assert_eq!(snapshot.status, RecordStatus::Completed);
    assert_eq!(
        result,
        Reclaim::Lost,
        "a reclaim from a stale snapshot (Pending, lease passed) won over a Completed record"
    );
    assert_eq!(
        after, snapshot,
        "a stale reclaim changed the Completed record"
    );

    // 2. Failed; another reclaimer takes it and completes.
    let id = unique_id("stale-failed-completed");
    let req = request(&id, fp("job"), t.long(), t.long());
    let first = must_claim(&t, &req).await;
    t.store
        .fail(&id, first, &Failure::retryable("boom"), long)
        .await
        .expect("fail");
    let (result, snapshot, after) = stale_read_then_reclaim(&t, req, move |store| async move {
        let Reclaim::Reclaimed { token, .. } = store
            .reclaim(&id, first, &fp("job"), long, long)
            .await
            .expect("reclaim")
        else {
            panic!("reclaim of a Failed record with its token was Lost");
        };
        assert_eq!(
            store
                .complete(&id, token, b"second", long)
                .await
                .expect("complete"),
            Cas::Applied
        );
    })
    .await;
    assert_eq!(snapshot.status, RecordStatus::Completed);
    assert_eq!(
        result,
        Reclaim::Lost,
        "a reclaim from a stale snapshot (Failed) won over a Completed record"
    );
    assert_eq!(
        after, snapshot,
        "a stale reclaim changed the Completed record"
    );

    // 3. Failed; another reclaimer takes it and fails again: the status is Failed as the
    //    reader saw it, only the token tells the snapshot is stale.
    let id = unique_id("stale-failed-failed");
    let req = request(&id, fp("job"), t.long(), t.long());
    let first = must_claim(&t, &req).await;
    t.store
        .fail(&id, first, &Failure::retryable("boom"), long)
        .await
        .expect("fail");
    let (result, snapshot, after) = stale_read_then_reclaim(&t, req, move |store| async move {
        let Reclaim::Reclaimed { token, .. } = store
            .reclaim(&id, first, &fp("job"), long, long)
            .await
            .expect("reclaim")
        else {
            panic!("reclaim of a Failed record with its token was Lost");
        };
        assert_eq!(
            store
                .fail(&id, token, &Failure::retryable("again"), long)
                .await
                .expect("fail"),
            Cas::Applied
        );
    })
    .await;
    assert_eq!(snapshot.status, RecordStatus::Failed);
    assert_eq!(snapshot.token, first.next());
    assert_eq!(
        result,
        Reclaim::Lost,
        "a reclaim with a stale token (ABA: Failed again with a newer token) won"
    );
    assert_eq!(after, snapshot, "a stale reclaim changed the record");
}

/// A live Pending record is never reclaimed, with its correct token or any other, alone or by
/// 32 concurrent reclaimers, also when most of the lease has run; a claim only observes it.
///
/// On a real clock a stalled machine can spend a whole lease between two calls, after which a
/// reclaim rightly wins: an attempt that did not end within its lease proves nothing either
/// way, and is made again on a new key with twice the lease (at most 6 attempts).
pub async fn live_pending_never_reclaimed(t: TestStore) {
    let real = matches!(t.time, TimeControl::Real);
    // Twice the short lease, so that waiting one short lease leaves half of it.
    let mut lease = t.short_lease() * 2;
    let mut tries = 0;
    let (id, token, seen) = loop {
        tries += 1;
        let late = |since: std::time::Instant, lease: Duration| {
            real && since.elapsed() + Duration::from_millis(50) >= lease && tries < 6
        };
        let id = unique_id("live");
        let req = request(&id, fp("job"), lease, t.long());
        let claimed = std::time::Instant::now();
        let token = must_claim(&t, &req).await;
        let before = present(&t, &id).await;
        let mut alone = Vec::new();
        for expected in [
            token,
            token.next(),
            FencingToken(0),
            FencingToken(token.0 + 100),
        ] {
            for fingerprint in [fp("job"), fp("other")] {
                let reclaimed = t
                    .store
                    .reclaim(&id, expected, &fingerprint, t.long(), t.long())
                    .await
                    .expect("reclaim");
                alone.push((expected, reclaimed));
            }
        }
        let long = t.long();
        let results = race(&t, |_, store| {
            let id = id.clone();
            async move {
                store
                    .reclaim(&id, token, &fp("job"), long, long)
                    .await
                    .expect("reclaim")
            }
        })
        .await;
        let after_race = present(&t, &id).await;
        if late(claimed, lease) {
            lease *= 2;
            continue;
        }
        for (expected, reclaimed) in alone {
            assert_eq!(
                reclaimed,
                Reclaim::Lost,
                "a live Pending record was reclaimed with token {expected} (holder has {token})"
            );
        }
        assert!(
            results.iter().all(|r| *r == Reclaim::Lost),
            "concurrent reclaimers took a live Pending record: {results:?}"
        );
        assert_eq!(after_race, before, "refused reclaims changed the record");

        // Restart the lease, so that waiting one short lease leaves half of it however long
        // the race took on a real clock.
        let extended = std::time::Instant::now();
        assert_eq!(
            t.store.extend(&id, token, lease).await.expect("extend"),
            Cas::Applied
        );
        let before = present(&t, &id).await;
        t.advance(lease / 2).await;
        let reclaimed = t
            .store
            .reclaim(&id, token, &fp("job"), t.long(), t.long())
            .await
            .expect("reclaim");
        let (seen, now) = must_observe_at(&t, &req).await;
        if late(extended, lease) {
            lease *= 2;
            continue;
        }
        assert_eq!(
            reclaimed,
            Reclaim::Lost,
            "a Pending record was reclaimed before its lease passed"
        );
        assert!(!seen.lease_passed(now), "the lease passed too early");
        assert_eq!(
            seen,
            with_hits(&before, before.hits + 1),
            "a claim of a live Pending record changed more than hits"
        );
        break (id, token, seen);
    };

    // On a manual clock, check the boundary to the millisecond: live until `lease_until`,
    // reclaimable at it.
    if let TimeControl::Manual(clock) = &t.time {
        let until = seen.lease_until.expect("a Pending record has a lease");
        let remaining = until.saturating_duration_since(clock.now());
        t.advance(remaining - Duration::from_millis(1)).await;
        assert_eq!(
            t.store
                .reclaim(&id, token, &fp("job"), t.long(), t.long())
                .await
                .expect("reclaim"),
            Reclaim::Lost,
            "reclaimed 1 ms before the lease passed"
        );
        t.advance(Duration::from_millis(1)).await;
        assert!(
            matches!(
                t.store
                    .reclaim(&id, token, &fp("job"), t.long(), t.long())
                    .await
                    .expect("reclaim"),
                Reclaim::Reclaimed { .. }
            ),
            "not reclaimable at lease_until (the lease passes when now >= lease_until)"
        );
    }
}
