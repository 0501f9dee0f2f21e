//! Time: retention, expiry, purge and lease extension, on the store's clock.

use super::{
    absent, concurrent_claims, fp, must_claim, must_claim_with_lease, must_observe, present,
    request, unique_id,
};
use crate::{TestStore, TimeControl};
use idempotency_core::store::{Cas, Claim, ClaimRequest, Failure, Reclaim, Record, RecordStatus};
use idempotency_core::FencingToken;

/// Claims `req` and settles it: `Completed`, `Failed`, or left `Pending`.
async fn make(
    t: &TestStore,
    req: &ClaimRequest,
    status: RecordStatus,
    ttl: std::time::Duration,
) -> FencingToken {
    let token = must_claim(t, req).await;
    let cas = match status {
        RecordStatus::Completed => t
            .store
            .complete(&req.id, token, b"outcome", ttl)
            .await
            .expect("complete"),
        RecordStatus::Failed => t
            .store
            .fail(&req.id, token, &Failure::retryable("boom"), ttl)
            .await
            .expect("fail"),
        RecordStatus::Pending => Cas::Applied,
    };
    assert_eq!(
        cas,
        Cas::Applied,
        "settling {} as {status} was refused",
        req.id
    );
    token
}

/// Retention: a record is present before `expires_at` and treated as absent after it, for
/// every status. After expiry `get` returns `None`, the old holder's writes and reclaims are
/// refused (a `fail` does not revive it as Failed), and a claim gets a fresh `Pending` record
/// with a higher token, which the old holder cannot complete, fail or extend.
pub async fn ttl_expiry(t: TestStore) {
    let real = matches!(t.time, TimeControl::Real);
    let mut ttl = t.short_ttl();
    let mut tries = 0;
    let (short, keep_id) = loop {
        tries += 1;
        let started = std::time::Instant::now();
        let mut short = Vec::new();
        for status in [
            RecordStatus::Completed,
            RecordStatus::Failed,
            RecordStatus::Pending,
        ] {
            let id = unique_id("ttl");
            // A Pending record's retention is max(lease, ttl): the lease here is shorter.
            let req = request(&id, fp("a"), t.short_lease(), ttl);
            let token = make(&t, &req, status, ttl).await;
            short.push((req, token, status));
        }
        let keep_id = unique_id("ttl-long");
        let keep = request(&keep_id, fp("a"), t.long(), t.long());
        make(&t, &keep, RecordStatus::Completed, t.long()).await;

        t.advance(ttl / 2).await;
        let mut seen = Vec::new();
        for (req, _, _) in &short {
            let read = t.store.get(&req.id).await.expect("get");
            let claimed = t.store.claim(req).await.expect("claim");
            seen.push((read, claimed));
        }
        // On a real clock every record was written after `started`, so each is live until
        // `started + ttl` at least: checked before then, a missing one is the store's fault.
        // A machine slow enough to reach that point first proves nothing either way: start
        // again on new keys with twice the retention.
        if real && started.elapsed() + std::time::Duration::from_millis(50) >= ttl && tries < 6 {
            ttl *= 2;
            continue;
        }
        for ((req, token, status), (read, claimed)) in short.iter().zip(seen) {
            let r = read
                .unwrap_or_else(|| panic!("expected {} to be present, get returned None", req.id));
            assert_eq!(
                (r.status, r.token),
                (*status, *token),
                "{} changed before expiry",
                req.id
            );
            match claimed {
                Claim::Existing { record, .. } => assert_eq!(
                    record.status, *status,
                    "a claim before expiry changed the record"
                ),
                Claim::Claimed { token, .. } => panic!(
                    "expected the claim of {} to observe a live record, but it was \
                     Claimed({token}) (a live record was overwritten, or the record was lost)",
                    req.id
                ),
            }
        }
        break (short, keep_id);
    };

    t.advance(ttl).await;
    for (req, token, status) in &short {
        absent(&t, &req.id).await;
        assert_eq!(
            t.store
                .complete(&req.id, *token, b"late", t.long())
                .await
                .expect("complete"),
            Cas::Fenced,
            "complete of an expired {status} record was applied"
        );
        assert_eq!(
            t.store
                .extend(&req.id, *token, t.long())
                .await
                .expect("extend"),
            Cas::Fenced,
            "extend of an expired {status} record was applied"
        );
        assert_eq!(
            t.store
                .fail(&req.id, *token, &Failure::retryable("late"), t.long())
                .await
                .expect("fail"),
            Cas::Fenced,
            "fail of an expired {status} record was applied (it revives the record as Failed)"
        );
        absent(&t, &req.id).await;
        assert_eq!(
            t.store
                .reclaim(&req.id, *token, &fp("a"), t.long(), t.long())
                .await
                .expect("reclaim"),
            Reclaim::Lost,
            "reclaim of an expired {status} record won (expired records are absent)"
        );
        absent(&t, &req.id).await;

        // A new claim with another fingerprint: the expired record is gone for good.
        let again = request(&req.id, fp("b"), t.long(), t.long());
        let (new_token, lease_until) = must_claim_with_lease(&t, &again).await;
        assert!(
            new_token > *token,
            "the claim replacing an expired {status} record got token {new_token}, not \
             greater than the replaced record's {token}"
        );
        let r = present(&t, &req.id).await;
        assert_eq!(r.status, RecordStatus::Pending);
        assert_eq!(r.token, new_token);
        assert_eq!(r.fingerprint, fp("b"), "the replacing claim's fingerprint");
        assert_eq!(r.attempts, 1, "a replacing claim starts at attempts = 1");
        assert_eq!(r.hits, 0, "a replacing claim starts at hits = 0");
        assert_eq!(r.outcome, None);
        assert_eq!(r.lease_until, Some(lease_until));
        let before = present(&t, &req.id).await;
        assert_eq!(
            t.store
                .complete(&req.id, *token, b"stale", t.long())
                .await
                .expect("complete"),
            Cas::Fenced,
            "the expired record's holder completed the new record"
        );
        assert_eq!(
            t.store
                .fail(&req.id, *token, &Failure::retryable("stale"), t.long())
                .await
                .expect("fail"),
            Cas::Fenced,
            "the expired record's holder failed the new record"
        );
        assert_eq!(
            t.store
                .extend(&req.id, *token, t.long())
                .await
                .expect("extend"),
            Cas::Fenced,
            "the expired record's holder extended the new record"
        );
        assert_eq!(
            present(&t, &req.id).await,
            before,
            "a stale holder changed the new record"
        );
    }
    let r = present(&t, &keep_id).await;
    assert_eq!(
        r.status,
        RecordStatus::Completed,
        "a long-lived record expired"
    );
}

/// `purge_expired` removes expired records only, in batches, and never a live one — not a
/// Pending record whose lease passed, nor settled records with a long retention.
pub async fn purge_removes_only_expired(t: TestStore) {
    let ttl = t.short_ttl();
    let mut expiring = Vec::new();
    for status in [
        RecordStatus::Completed,
        RecordStatus::Completed,
        RecordStatus::Failed,
        RecordStatus::Failed,
        RecordStatus::Pending,
    ] {
        let id = unique_id("purge-expiring");
        make(
            &t,
            &request(&id, fp("p"), t.short_lease(), ttl),
            status,
            ttl,
        )
        .await;
        expiring.push(id);
    }
    let mut live = Vec::new();
    for (status, lease) in [
        (RecordStatus::Completed, t.long()),
        (RecordStatus::Failed, t.long()),
        (RecordStatus::Pending, t.long()),
        // Its lease passes, but its retention does not: it must stay for a reclaim.
        (RecordStatus::Pending, t.short_lease()),
    ] {
        let id = unique_id("purge-live");
        make(
            &t,
            &request(&id, fp("p"), lease, t.long()),
            status,
            t.long(),
        )
        .await;
        live.push(id);
    }
    let mut before: Vec<Record> = Vec::new();
    for id in &live {
        before.push(present(&t, id).await);
    }

    t.advance(ttl).await;
    t.store.purge_expired(100).await.expect("purge");
    for (id, b) in live.iter().zip(&before) {
        assert_eq!(
            &present(&t, id).await,
            b,
            "purge removed or changed a live {} record",
            b.status
        );
    }
    for id in &expiring {
        absent(&t, id).await;
        must_claim(&t, &request(id, fp("p"), t.long(), t.long())).await;
    }
}

/// `purge_expired` reports what it deleted and honours its batch size: of five expired
/// records, `purge(2)` deletes 2, the next purge the other 3, then nothing is left; a record
/// claimed again after expiry is not purged. (Needs `purge_reports_deletions`.)
pub async fn purge_counts_deletions_in_batches(t: TestStore) {
    assert!(
        t.capabilities.purge_reports_deletions,
        "purge_counts_deletions_in_batches runs only on stores that report purged records"
    );
    let ttl = t.short_ttl();
    let mut expiring = Vec::new();
    for status in [
        RecordStatus::Completed,
        RecordStatus::Completed,
        RecordStatus::Failed,
        RecordStatus::Pending,
        RecordStatus::Pending,
    ] {
        let id = unique_id("purge-count");
        make(
            &t,
            &request(&id, fp("p"), t.short_lease(), ttl),
            status,
            ttl,
        )
        .await;
        expiring.push(id);
    }
    let keep = unique_id("purge-count-live");
    make(
        &t,
        &request(&keep, fp("p"), t.long(), t.long()),
        RecordStatus::Completed,
        t.long(),
    )
    .await;
    t.advance(ttl).await;
    // The store is isolated per case, so exactly our five records are expired.
    assert_eq!(
        t.store.purge_expired(2).await.expect("purge"),
        2,
        "purge(2) of 5 expired"
    );
    assert_eq!(
        t.store.purge_expired(100).await.expect("purge"),
        3,
        "purge of the last 3 expired"
    );
    assert_eq!(
        t.store.purge_expired(100).await.expect("purge"),
        0,
        "nothing left to purge"
    );
    for id in &expiring {
        absent(&t, id).await;
        must_claim(&t, &request(id, fp("p"), t.long(), t.long())).await;
    }
    assert_eq!(
        t.store.purge_expired(100).await.expect("purge"),
        0,
        "purge removed a re-claimed record"
    );
    present(&t, &keep).await;
}

/// `extend` moves the holder's lease to `now + lease` (and the retention to at least that):
/// the key is not reclaimable until the extended lease passes, then it is. A wrong token's
/// extension is refused.
pub async fn extend_moves_lease(t: TestStore) {
    let s = t.short_lease();
    // Retention long: only the lease matters.
    let a = unique_id("extend");
    let req_a = request(&a, fp("x"), s, t.long());
    let token_a = must_claim(&t, &req_a).await;
    // Retention as short as the lease: the extension must also keep the record alive.
    let b = unique_id("extend-retention");
    let req_b = request(&b, fp("x"), s, s);
    let token_b = must_claim(&t, &req_b).await;

    let before = present(&t, &a).await;
    assert_eq!(
        t.store
            .extend(&a, token_a.next(), s * 3)
            .await
            .expect("extend"),
        Cas::Fenced,
        "extend with a token the record does not hold was applied"
    );
    assert_eq!(
        present(&t, &a).await,
        before,
        "a refused extend changed the record"
    );
    let manual_now = match &t.time {
        TimeControl::Manual(clock) => Some(idempotency_core::store::Clock::now(clock)),
        TimeControl::Real => None,
    };
    for (id, token) in [(&a, token_a), (&b, token_b)] {
        assert_eq!(
            t.store.extend(id, token, s * 3).await.expect("extend"),
            Cas::Applied,
            "the holder's extend was refused"
        );
    }
    let extended = present(&t, &a).await;
    let until = extended.lease_until.expect("a Pending record has a lease");
    assert!(
        until > before.lease_until.expect("lease"),
        "extend did not move the lease"
    );
    if let Some(now) = manual_now {
        assert_eq!(
            until,
            now.saturating_add(s * 3),
            "extend sets lease_until = now + lease"
        );
    }
    let rb = present(&t, &b).await;
    assert!(
        rb.expires_at >= rb.lease_until.expect("lease"),
        "extend must move expires_at to at least lease_until"
    );
    assert_eq!(extended.token, token_a, "extend changed the token");
    assert_eq!(extended.status, RecordStatus::Pending);

    // The original lease has passed; the extended one has not.
    t.advance(s).await;
    assert_eq!(
        t.store
            .reclaim(&a, token_a, &fp("x"), t.long(), t.long())
            .await
            .expect("reclaim"),
        Reclaim::Lost,
        "reclaimed after the original lease though the holder extended it"
    );
    let rb = present(&t, &b).await;
    assert_eq!(
        rb.token, token_b,
        "the extended record with a short retention was replaced"
    );

    // Now the extended lease has passed too.
    t.advance(s * 3).await;
    match t
        .store
        .reclaim(&a, token_a, &fp("x"), t.long(), t.long())
        .await
        .expect("reclaim")
    {
        Reclaim::Reclaimed { token, .. } => assert_eq!(token, token_a.next()),
        Reclaim::Lost => panic!("not reclaimable after the extended lease passed"),
    }
    assert_eq!(
        t.store.extend(&a, token_a, t.long()).await.expect("extend"),
        Cas::Fenced,
        "the old holder extended after a reclaim"
    );
}

/// Replays end when the record does: a Completed record answers uncounted claims (replays,
/// which a replay cache in front of the store may answer from memory) only while it lives,
/// and once its retention has passed an uncounted claim takes the key afresh, however many
/// replays came before. A cache that serves a record past its `expires_at` fails here.
pub async fn uncounted_replays_end_at_expiry(t: TestStore) {
    let ttl = t.short_ttl();
    let id = unique_id("replay-expiry");
    let req = request(&id, fp("a"), t.short_lease(), ttl).with_count_hit(false);
    let token = must_claim(&t, &req).await;
    assert_eq!(
        t.store
            .complete(&id, token, b"first", ttl)
            .await
            .expect("complete"),
        Cas::Applied
    );
    for _ in 0..3 {
        let seen = must_observe(&t, &req).await;
        assert_eq!(
            (seen.status, seen.outcome.as_deref()),
            (RecordStatus::Completed, Some(&b"first"[..])),
            "a replay before expiry"
        );
    }
    t.advance(ttl).await;
    match t.store.claim(&req).await.expect("claim") {
        Claim::Claimed { token: again, .. } => {
            assert!(
                again > token,
                "the key's tokens grow: {again} after {token}"
            )
        }
        Claim::Existing { record, now } => panic!(
            "a record past its expiry was answered at {now:?}: {record:?} (a replay served \
             past expires_at)"
        ),
    }
}

/// A claim with [`ClaimRequest::count_hit`] `false` only reads a live record, whatever its
/// status and whether its fingerprint matches: the record comes back exactly as `get` shows
/// it, hits included, and stays so. It still claims an absent key, exactly once among
/// concurrent callers, and an expired one, with a greater token.
pub async fn uncounted_claims_only_read(t: TestStore) {
    let uncounted = |req: ClaimRequest| req.with_count_hit(false);
    for status in [
        RecordStatus::Completed,
        RecordStatus::Failed,
        RecordStatus::Pending,
    ] {
        let id = unique_id("uncounted");
        let counted = request(&id, fp("a"), t.long(), t.long());
        make(&t, &counted, status, t.long()).await;
        // One counted observation, so an uncounted claim that counts anyway shows.
        must_observe(&t, &counted).await;
        let before = present(&t, &id).await;
        assert_eq!(before.hits, 1, "the counted claim of a {status} record");
        for req in [
            uncounted(counted.clone()),
            uncounted(request(&id, fp("other"), t.long(), t.long())),
        ] {
            for _ in 0..3 {
                assert_eq!(
                    must_observe(&t, &req).await,
                    before,
                    "an uncounted claim of a {status} record returned it changed"
                );
            }
        }
        assert_eq!(
            present(&t, &id).await,
            before,
            "an uncounted claim of a {status} record changed it"
        );
    }

    // An absent key: exactly one of many concurrent uncounted claims wins.
    let id = unique_id("uncounted-new");
    let req = uncounted(request(&id, fp("a"), t.short_lease(), t.short_ttl()));
    let mut winners = Vec::new();
    for answer in concurrent_claims(&t, &req, 16).await {
        if let Claim::Claimed { token, .. } = answer {
            winners.push(token);
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "uncounted claims of an absent key: winners {winners:?}"
    );
    let first = present(&t, &id).await;
    assert_eq!(
        (first.status, first.token, first.attempts),
        (RecordStatus::Pending, winners[0], 1)
    );

    // Expired: an uncounted claim replaces it, with a greater token.
    t.advance(t.short_ttl() + t.short_ttl() / 2).await;
    let token = must_claim(&t, &req).await;
    assert!(
        token > first.token,
        "the claim of an expired record reused token {token} (was {})",
        first.token
    );
    let r = present(&t, &id).await;
    assert_eq!(
        (r.status, r.token, r.hits),
        (RecordStatus::Pending, token, 0)
    );
}
