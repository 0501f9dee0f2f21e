//! A key's whole history: tokens across purges and expiry, races of the writes that replace or
//! remove records, deadlines on the store's own clock, extreme values, and addresses that a
//! store could truncate or hash weakly.

use super::{absent, concurrent_claims, fp, must_claim, present, request, unique_id};
use crate::{TestStore, TimeControl};
use idempotency_core::store::{Cas, Claim, Failure, Reclaim, Record, RecordStatus, Timestamp};
use idempotency_core::{FencingToken, IdempotencyKey, RecordId, Scope};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;

/// Asserts that the holder of `old` can no longer complete, fail, extend or reclaim `id`, and
/// that trying changed nothing.
async fn stale_holder_refused(t: &TestStore, id: &RecordId, old: FencingToken, why: &str) {
    let before = t.store.get(id).await.expect("get");
    assert_eq!(
        t.store
            .complete(id, old, b"stale", t.long())
            .await
            .expect("complete"),
        Cas::Fenced,
        "{why}: the holder of the old token {old} completed the new record"
    );
    assert_eq!(
        t.store
            .fail(id, old, &Failure::retryable("stale"), t.long())
            .await
            .expect("fail"),
        Cas::Fenced,
        "{why}: the holder of the old token {old} failed the new record"
    );
    assert_eq!(
        t.store.extend(id, old, t.long()).await.expect("extend"),
        Cas::Fenced,
        "{why}: the holder of the old token {old} extended the new record"
    );
    assert_eq!(
        t.store.get(id).await.expect("get"),
        before,
        "{why}: a stale holder changed the new record"
    );
}

/// Tokens grow over a key's whole history: after its record expired (and was purged, where
/// the store purges), a new claim gets a token above every token the key had, reclaims
/// included, and the old holders' complete, fail and extend are all refused.
pub async fn tokens_grow_across_purge_and_expiry(t: TestStore) {
    for (label, reclaims, purge) in [
        ("expired", 0, false),
        ("purged", 0, true),
        ("reclaimed-then-purged", 3, true),
    ] {
        let id = unique_id(label);
        let short = request(&id, fp("h"), t.short_lease(), t.short_ttl());
        let mut held = must_claim(&t, &short).await;
        let mut tokens = vec![held];
        for _ in 0..reclaims {
            t.store
                .fail(&id, held, &Failure::retryable("again"), t.short_ttl())
                .await
                .expect("fail");
            held = match t
                .store
                .reclaim(&id, held, &fp("h"), t.short_lease(), t.short_ttl())
                .await
                .expect("reclaim")
            {
                Reclaim::Reclaimed { token, .. } => token,
                Reclaim::Lost => panic!("{label}: the reclaim of a Failed record was lost"),
            };
            tokens.push(held);
        }
        // The holder stalls past the record's retention.
        t.advance(t.short_ttl().max(t.short_lease())).await;
        absent(&t, &id).await;
        if purge {
            t.store.purge_expired(1000).await.expect("purge");
        }
        let fresh = request(&id, fp("other"), t.long(), t.long());
        let new = must_claim(&t, &fresh).await;
        let oldest_max = tokens.iter().max().copied().expect("a token");
        assert!(
            new > oldest_max,
            "{label}: a new claim of a key whose record was gone got token {new}, not above the \
             key's earlier token {oldest_max}: a stalled holder of that token could complete \
             the new record"
        );
        for old in tokens {
            stale_holder_refused(&t, &id, old, label).await;
        }
        let r = present(&t, &id).await;
        assert_eq!((r.status, r.token), (RecordStatus::Pending, new));
        assert_eq!(r.fingerprint, fp("other"));
    }
}

/// 32 concurrent claims of an **expired** record (of each status): exactly one replaces it,
/// the others observe the new record (a check-then-replace lets several win). Four rounds of
/// each status; every record is made first and they expire together (one wait on a real
/// clock, not one per race), then each is raced in turn.
pub async fn concurrent_claims_of_expired_record_one_winner(t: TestStore) {
    let mut expired = Vec::new();
    for round in 0..4 {
        for status in [
            RecordStatus::Completed,
            RecordStatus::Failed,
            RecordStatus::Pending,
        ] {
            let id = unique_id("expired-race");
            let req = request(&id, fp("x"), t.short_lease(), t.short_ttl());
            let old = must_claim(&t, &req).await;
            match status {
                RecordStatus::Completed => {
                    t.store
                        .complete(&id, old, b"old", t.short_ttl())
                        .await
                        .expect("complete");
                }
                RecordStatus::Failed => {
                    t.store
                        .fail(&id, old, &Failure::retryable("old"), t.short_ttl())
                        .await
                        .expect("fail");
                }
                RecordStatus::Pending => {}
            }
            expired.push((round, status, id));
        }
    }
    t.advance(t.short_ttl().max(t.short_lease())).await;
    for (round, status, id) in expired {
        let req = request(&id, fp("x"), t.long(), t.long());
        let mut winners = Vec::new();
        for answer in concurrent_claims(&t, &req, 32).await {
            if let Claim::Claimed { token, .. } = answer {
                winners.push(token);
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "round {round}: {} of 32 concurrent claims of an expired {status} record won \
             ({winners:?})",
            winners.len()
        );
        let r = present(&t, &id).await;
        assert_eq!((r.status, r.token), (RecordStatus::Pending, winners[0]));
        assert_eq!(r.hits, 31, "the 31 observers each count one hit");
    }
}

/// The stalled holder's complete, fail or extend races 16 takers after its lease passed. Each
/// write is one atomic compare-and-swap, so either the holder's write lands first (and no
/// reclaim of a completed or re-leased record wins), or a taker wins and the holder is
/// fenced; the record never ends up holding a taker's token with the holder's write on it.
/// A permanent failure races takers with the holder's own fingerprint (retries of the same
/// request, as when the engine records one for an outcome it could not store): no taker may
/// win once it landed, so the holder's failure and a taker's reclaim never both apply.
pub async fn settling_races_takers_after_lease(t: TestStore) {
    #[derive(Clone, Copy, Debug)]
    enum Write {
        Complete,
        Fail,
        FailPermanently,
        Extend,
    }
    // The race needs a taker to land inside the holder's check-then-write. Released together
    // at a barrier, the last taker to arrive reclaims before the holder is even scheduled, so
    // most rounds start the takers only once the holder's write is in flight (polled until it
    // waits on the store); the others release everyone at once, the other order.
    let rounds = if matches!(t.time, TimeControl::Manual(_)) {
        96
    } else {
        6
    };
    // Every record is claimed first and their leases pass together: one wait on a real
    // clock, not one per race.
    let mut held_records = Vec::new();
    for write in [
        Write::Complete,
        Write::Fail,
        Write::FailPermanently,
        Write::Extend,
    ] {
        for round in 0..rounds {
            let id = unique_id("settle-race");
            let req = request(&id, fp("s"), t.short_lease(), t.long());
            let held = must_claim(&t, &req).await;
            held_records.push((write, round, id, held));
        }
    }
    t.advance(t.short_lease()).await;
    for (write, round, id, held) in held_records {
        // Retries of the same request, or a corrected one.
        let taker_fp = if matches!(write, Write::FailPermanently) {
            fp("s")
        } else {
            fp("taker")
        };
        let holder_first = round % 3 != 2;
        let barrier = Arc::new(Barrier::new(if holder_first { 16 } else { 17 }));
        let holder = {
            let (store, id, barrier, long) =
                (t.store.clone(), id.clone(), barrier.clone(), t.long());
            async move {
                if !holder_first {
                    barrier.wait().await;
                }
                match write {
                    Write::Complete => store.complete(&id, held, b"holder", long).await,
                    Write::Fail => {
                        store
                            .fail(&id, held, &Failure::retryable("holder"), long)
                            .await
                    }
                    Write::FailPermanently => {
                        store
                            .fail(&id, held, &Failure::permanent("holder"), long)
                            .await
                    }
                    Write::Extend => store.extend(&id, held, long).await,
                }
                .expect("the holder's write")
            }
        };
        let spawn_takers = || -> Vec<_> {
            (0..16)
                .map(|_| {
                    let (store, id, barrier, long) =
                        (t.store.clone(), id.clone(), barrier.clone(), t.long());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store
                            .reclaim(&id, held, &taker_fp, long, long)
                            .await
                            .expect("reclaim")
                    })
                })
                .collect()
        };
        let (cas, takers) = if holder_first {
            let mut holder = Box::pin(holder);
            let early = futures::poll!(holder.as_mut());
            let takers = spawn_takers();
            let cas = match early {
                std::task::Poll::Ready(cas) => cas,
                std::task::Poll::Pending => holder.await,
            };
            (cas, takers)
        } else {
            let holder = tokio::spawn(holder);
            let takers = spawn_takers();
            (holder.await.expect("holder task"), takers)
        };
        let applied = cas == Cas::Applied;
        let mut won = Vec::new();
        for taker in takers {
            if let Reclaim::Reclaimed { token, .. } = taker.await.expect("taker task") {
                won.push(token);
            }
        }
        let r = present(&t, &id).await;
        let what = format!("{write:?} round {round}");
        assert!(
            won.len() <= 1,
            "{what}: {} takers reclaimed one record",
            won.len()
        );
        match won.first() {
            Some(&winner) => {
                // The taker's reclaim is the last write: the record is its fresh lease.
                assert_eq!(
                    (r.status, r.token, r.fingerprint),
                    (RecordStatus::Pending, winner, taker_fp),
                    "{what}: a taker won, but the record is not its Pending record (the \
                     holder's write landed on it?): {r:?}"
                );
                assert_eq!(r.outcome, None, "{what}: {r:?}");
                assert_eq!(r.failure, None, "{what}: {r:?}");
                assert!(
                    !applied || matches!(write, Write::Fail),
                    "{what}: the holder's write and a taker's reclaim both applied"
                );
            }
            None => {
                assert!(applied, "{what}: neither the holder nor any taker won");
                let want = match write {
                    Write::Complete => RecordStatus::Completed,
                    Write::Fail | Write::FailPermanently => RecordStatus::Failed,
                    Write::Extend => RecordStatus::Pending,
                };
                assert_eq!((r.status, r.token), (want, held), "{what}: {r:?}");
            }
        }
    }
}

/// Purges race fresh claims of the records they are removing: a purge may delete a record
/// only while it is expired, so every record claimed fresh during the purge is still there
/// afterwards (a purge that selects expired ids, then deletes by id, removes new records).
pub async fn purge_races_fresh_claims(t: TestStore) {
    let n = 48;
    let mut ids = Vec::new();
    for _ in 0..n {
        let id = unique_id("purge-race");
        let token = must_claim(&t, &request(&id, fp("p"), t.short_lease(), t.short_ttl())).await;
        t.store
            .complete(&id, token, b"old", t.short_ttl())
            .await
            .expect("complete");
        ids.push(id);
    }
    t.advance(t.short_ttl()).await;
    let barrier = Arc::new(Barrier::new(n + 4));
    let purgers: Vec<_> = (0..4)
        .map(|_| {
            let (store, barrier) = (t.store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                for _ in 0..n {
                    store.purge_expired(1).await.expect("purge");
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    let claimers: Vec<_> = ids
        .iter()
        .map(|id| {
            let (store, barrier) = (t.store.clone(), barrier.clone());
            let req = request(id, fp("new"), t.long(), t.long());
            tokio::spawn(async move {
                barrier.wait().await;
                match store.claim(&req).await.expect("claim") {
                    Claim::Claimed { token, .. } => token,
                    other => panic!("the fresh claim of an expired record got {other:?}"),
                }
            })
        })
        .collect();
    for p in purgers {
        p.await.expect("purge task");
    }
    for (id, c) in ids.iter().zip(claimers) {
        let token = c.await.expect("claim task");
        let r = t.store.get(id).await.expect("get").unwrap_or_else(|| {
            panic!("a purge deleted the record {id} claimed fresh while it ran (token {token})")
        });
        assert_eq!(
            (r.status, r.token),
            (RecordStatus::Pending, token),
            "{id} after the purge race: {r:?}"
        );
    }
}

/// The store's clock decides every deadline, read back within a tolerance on real clocks:
/// `Existing.now` is the store's clock; a claim sets `lease_until = now + lease` and
/// `expires_at = now + max(lease, ttl)`; complete and fail set `expires_at = now + ttl`;
/// extend sets `lease_until = now + lease` and never lowers `expires_at`; a reclaim moves
/// both. On a manual clock the kit first moves the store's clock a day away from the
/// process's, so a store that reads the application's clock instead of its own is caught.
pub async fn deadlines_follow_the_store_clock(t: TestStore) {
    assert!(
        t.server_now().await.is_some(),
        "deadlines_follow_the_store_clock needs a reading of the store's clock: give the \
         TestStore one with `with_server_clock`, or declare `server_clock = false`"
    );
    if let TimeControl::Manual(clock) = &t.time {
        clock.advance(Duration::from_secs(24 * 3600));
    }
    // Whole milliseconds either way: the store may round its clock.
    let tolerance = 2;
    let window = |before: Timestamp, after: Timestamp, d: Duration| {
        let d = idempotency_core::store::duration_millis(d);
        (
            before.as_millis() + d - tolerance,
            after.as_millis() + d + tolerance,
        )
    };
    let check = |what: &str, got: Timestamp, (lo, hi): (i64, i64)| {
        assert!(
            (lo..=hi).contains(&got.as_millis()),
            "{what} is {got:?}, expected between {lo}ms and {hi}ms on the store's clock (a \
             store must use its own clock and the given durations)"
        );
    };
    let lease = Duration::from_secs(7200);
    let ttl = Duration::from_secs(3600);

    // Claim: lease longer than ttl, so the retention is the lease.
    let id = unique_id("deadlines-claim");
    let before = t.server_now().await.expect("store clock");
    let claimed = t
        .store
        .claim(&request(&id, fp("d"), lease, ttl))
        .await
        .expect("claim");
    let after = t.server_now().await.expect("store clock");
    let Claim::Claimed { token, lease_until } = claimed else {
        panic!("a fresh key was not claimed: {claimed:?}");
    };
    check(
        "Claimed.lease_until",
        lease_until,
        window(before, after, lease),
    );
    let r = present(&t, &id).await;
    check(
        "a claim's expires_at (lease > ttl)",
        r.expires_at,
        window(before, after, lease),
    );
    check(
        "created_at",
        r.created_at,
        window(before, after, Duration::ZERO),
    );

    // Existing.now is the store's clock.
    let before = t.server_now().await.expect("store clock");
    let seen = t
        .store
        .claim(&request(&id, fp("d"), lease, ttl))
        .await
        .expect("claim");
    let after = t.server_now().await.expect("store clock");
    let Claim::Existing { now, .. } = seen else {
        panic!("a live record was not observed: {seen:?}");
    };
    check("Existing.now", now, window(before, after, Duration::ZERO));

    // Extend with a short lease never lowers expires_at; it moves lease_until.
    let kept = present(&t, &id).await.expires_at;
    let short = Duration::from_secs(60);
    let before = t.server_now().await.expect("store clock");
    assert_eq!(
        t.store.extend(&id, token, short).await.expect("extend"),
        Cas::Applied
    );
    let after = t.server_now().await.expect("store clock");
    let r = present(&t, &id).await;
    check(
        "lease_until after extend",
        r.lease_until.expect("a lease"),
        window(before, after, short),
    );
    assert!(
        r.expires_at >= kept,
        "extend lowered expires_at from {kept:?} to {:?}",
        r.expires_at
    );

    // Complete: expires_at = now + ttl.
    let before = t.server_now().await.expect("store clock");
    assert_eq!(
        t.store
            .complete(&id, token, b"ok", ttl)
            .await
            .expect("complete"),
        Cas::Applied
    );
    let after = t.server_now().await.expect("store clock");
    let r = present(&t, &id).await;
    check(
        "expires_at after complete",
        r.expires_at,
        window(before, after, ttl),
    );
    check(
        "updated_at after complete",
        r.updated_at,
        window(before, after, Duration::ZERO),
    );

    // Fail: expires_at = now + ttl; then a reclaim moves the lease and the retention.
    let id = unique_id("deadlines-fail");
    let token = must_claim(&t, &request(&id, fp("d"), lease, ttl)).await;
    let fail_ttl = Duration::from_secs(600);
    let before = t.server_now().await.expect("store clock");
    assert_eq!(
        t.store
            .fail(&id, token, &Failure::retryable("x"), fail_ttl)
            .await
            .expect("fail"),
        Cas::Applied
    );
    let after = t.server_now().await.expect("store clock");
    let r = present(&t, &id).await;
    check(
        "expires_at after fail",
        r.expires_at,
        window(before, after, fail_ttl),
    );
    let (re_lease, re_ttl) = (Duration::from_secs(900), Duration::from_secs(5400));
    let before = t.server_now().await.expect("store clock");
    let reclaimed = t
        .store
        .reclaim(&id, token, &fp("d"), re_lease, re_ttl)
        .await
        .expect("reclaim");
    let after = t.server_now().await.expect("store clock");
    let Reclaim::Reclaimed { lease_until, .. } = reclaimed else {
        panic!("the reclaim of a Failed record was lost");
    };
    check(
        "Reclaimed.lease_until",
        lease_until,
        window(before, after, re_lease),
    );
    let r = present(&t, &id).await;
    check(
        "expires_at after reclaim",
        r.expires_at,
        window(before, after, re_ttl),
    );
    assert_eq!(r.lease_until, Some(lease_until));
}

/// Extreme values are clamped or refused as values, never errors: `Duration::MAX` leases and
/// retentions make a record that is effectively eternal (and can still be settled and
/// reclaimed), and tokens no record can hold (up to `u64::MAX`) are fenced.
pub async fn extreme_durations_and_tokens(t: TestStore) {
    let huge = [Duration::MAX, Duration::from_secs(1000 * 365 * 24 * 3600)];
    for d in huge {
        let id = unique_id("extreme");
        let req = request(&id, fp("e"), d, d);
        let token = match t.store.claim(&req).await {
            Ok(Claim::Claimed { token, .. }) => token,
            other => panic!("a claim with a {d:?} lease and ttl got {other:?}"),
        };
        let r = present(&t, &id).await;
        let century = Duration::from_secs(100 * 365 * 24 * 3600);
        let now = t.server_now().await.unwrap_or_else(Timestamp::now);
        assert!(
            r.expires_at >= now.saturating_add(century)
                && r.lease_until
                    .is_some_and(|l| l >= now.saturating_add(century)),
            "a {d:?} lease and ttl did not clamp to the far future: {r:?}"
        );
        assert_eq!(
            t.store
                .extend(&id, token, d)
                .await
                .expect("extend with a huge lease"),
            Cas::Applied
        );
        assert_eq!(
            t.store
                .fail(&id, token, &Failure::retryable("x"), d)
                .await
                .expect("fail with a huge ttl"),
            Cas::Applied
        );
        let token = match t
            .store
            .reclaim(&id, token, &fp("e"), d, d)
            .await
            .expect("reclaim with huge durations")
        {
            Reclaim::Reclaimed { token, .. } => token,
            Reclaim::Lost => panic!("the reclaim of a Failed record was lost"),
        };
        assert_eq!(
            t.store
                .complete(&id, token, b"ok", d)
                .await
                .expect("complete with a huge ttl"),
            Cas::Applied
        );
        assert_eq!(present(&t, &id).await.status, RecordStatus::Completed);
    }

    let id = unique_id("extreme-tokens");
    let token = must_claim(&t, &request(&id, fp("e"), t.long(), t.long())).await;
    let before = present(&t, &id).await;
    for bad in [
        u64::MAX,
        u64::MAX - 1,
        1 << 63,
        (1 << 63) - 1,
        token.0.wrapping_add(1 << 63),
        0,
    ] {
        let bad = FencingToken(bad);
        if bad == token {
            continue;
        }
        let answers = (
            t.store.complete(&id, bad, b"x", t.long()).await,
            t.store
                .fail(&id, bad, &Failure::retryable("x"), t.long())
                .await,
            t.store.extend(&id, bad, t.long()).await,
            t.store
                .reclaim(&id, bad, &fp("e"), t.long(), t.long())
                .await,
        );
        assert!(
            matches!(
                answers,
                (
                    Ok(Cas::Fenced),
                    Ok(Cas::Fenced),
                    Ok(Cas::Fenced),
                    Ok(Reclaim::Lost)
                )
            ),
            "writes with token {bad} (held: {token}) must be fenced, not errors: {answers:?}"
        );
    }
    assert_eq!(
        present(&t, &id).await,
        before,
        "a foreign token changed the record"
    );
}

/// Keys and scopes are stored whole: 255-byte keys that differ only in their last byte, and
/// 1024-byte scopes that differ only in their last byte, are all different records (a store
/// that truncates, or hashes a prefix, merges them).
pub async fn long_keys_and_scopes_are_not_truncated(t: TestStore) {
    let run = IdempotencyKey::random().into_inner();
    let prefix: String = format!("{run}-")
        .chars()
        .chain(std::iter::repeat('k'))
        .take(254)
        .collect();
    let scope = Scope::from_parts(["conformance", "long-keys", &run]).expect("scope");
    let mut ids = Vec::new();
    for last in ['a', 'b', 'c', 'd'] {
        let key = IdempotencyKey::new(format!("{prefix}{last}")).expect("a 255-byte key");
        assert_eq!(key.as_str().len(), 255);
        ids.push(RecordId::new(key, scope.clone()));
    }
    let scope_prefix: String = format!("{run}|")
        .chars()
        .chain(std::iter::repeat('s'))
        .take(1023)
        .collect();
    let key = IdempotencyKey::new(format!("{run}-shared-key")).expect("key");
    for last in ['a', 'b', 'c', 'd'] {
        let scope = Scope::new(format!("{scope_prefix}{last}")).expect("a 1024-byte scope");
        assert_eq!(scope.as_str().len(), 1024);
        ids.push(RecordId::new(key.clone(), scope));
    }
    let mut tokens = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let req = request(id, fp(&format!("long-{i}")), t.long(), t.long());
        match t.store.claim(&req).await.expect("claim") {
            Claim::Claimed { token, .. } => tokens.push(token),
            Claim::Existing { record, .. } => panic!(
                "{} was claimed as a record that already exists ({}): the store truncates or \
                 hashes keys or scopes weakly",
                id, record.id
            ),
        }
    }
    for (i, (id, token)) in ids.iter().zip(&tokens).enumerate() {
        let outcome = format!("outcome-{i}");
        assert_eq!(
            t.store
                .complete(id, *token, outcome.as_bytes(), t.long())
                .await
                .expect("complete"),
            Cas::Applied
        );
    }
    for (i, id) in ids.iter().enumerate() {
        let r: Record = present(&t, id).await;
        assert_eq!(&r.id, id, "the record's address did not round-trip");
        assert_eq!(
            r.fingerprint,
            fp(&format!("long-{i}")),
            "{id}: another record's data"
        );
        assert_eq!(r.outcome, Some(format!("outcome-{i}").into_bytes()));
    }
}
