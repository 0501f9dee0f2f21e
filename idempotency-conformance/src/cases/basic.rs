//! Single-caller behaviour: the failure path, settled records, addressing and hit counts.

use super::{
    absent, concurrent_claims, fp, must_claim, must_claim_with_lease, must_complete, must_observe,
    present, request, unique_id, with_hits,
};
use crate::TestStore;
use idempotency_core::store::{Cas, Claim, Failure, Reclaim, RecordStatus};
use idempotency_core::{FencingToken, IdempotencyKey, RecordId, Scope};

/// Fail, then reclaim: the failure is stored, the holder's further writes are refused, and a
/// reclaim bumps the token, increments `attempts`, replaces the fingerprint and clears the
/// lease-less Failed state. A permanent failure is reclaimable only by another fingerprint.
pub async fn fail_then_reclaim(t: TestStore) {
    let id = unique_id("fail-reclaim");
    let req = request(&id, fp("first payload"), t.long(), t.long());
    let token = must_claim(&t, &req).await;
    let failure = Failure::retryable("upstream timed out: ünïcödé \"quoted\" | 100%");
    assert_eq!(
        t.store
            .fail(&id, token, &failure, t.long())
            .await
            .expect("fail"),
        Cas::Applied,
        "fail by the holder was refused"
    );
    let failed = present(&t, &id).await;
    assert_eq!(failed.status, RecordStatus::Failed);
    assert_eq!(failed.token, token, "fail must not change the token");
    assert_eq!(
        failed.failure.as_ref(),
        Some(&failure),
        "the failure is stored"
    );
    assert_eq!(failed.lease_until, None, "a Failed record has no lease");
    assert_eq!(failed.outcome, None, "a Failed record has no outcome");
    assert_eq!(failed.attempts, 1);

    // The record is no longer Pending: the old holder can neither settle it again nor extend.
    let f2 = Failure::permanent("again");
    assert_eq!(
        t.store.fail(&id, token, &f2, t.long()).await.expect("fail"),
        Cas::Fenced,
        "a second fail of a Failed record was applied"
    );
    assert_eq!(
        t.store
            .complete(&id, token, b"late", t.long())
            .await
            .expect("complete"),
        Cas::Fenced,
        "complete of a Failed record was applied"
    );
    assert_eq!(
        t.store.extend(&id, token, t.long()).await.expect("extend"),
        Cas::Fenced,
        "extend of a Failed record was applied"
    );
    assert_eq!(
        present(&t, &id).await,
        failed,
        "refused writes changed the Failed record"
    );

    let observed = must_observe(&t, &req).await;
    assert_eq!(observed.status, RecordStatus::Failed);

    // A corrected retry with another fingerprint takes the key over.
    let corrected = fp("corrected payload");
    let (new_token, lease_until) = match t
        .store
        .reclaim(&id, token, &corrected, t.long(), t.long())
        .await
        .expect("reclaim")
    {
        Reclaim::Reclaimed { token, lease_until } => (token, lease_until),
        Reclaim::Lost => panic!("reclaim of a Failed record with its token was Lost"),
    };
    assert_eq!(new_token, token.next(), "reclaim sets token = expected + 1");
    let r = present(&t, &id).await;
    assert_eq!(r.status, RecordStatus::Pending);
    assert_eq!(r.token, new_token);
    assert_eq!(r.fingerprint, corrected, "reclaim replaces the fingerprint");
    assert_eq!(r.attempts, 2, "reclaim increments attempts");
    assert_eq!(r.lease_until, Some(lease_until), "the new lease is stored");
    assert_eq!(r.outcome, None);
    assert_eq!(
        r.failure, None,
        "reclaim must clear the previous attempt's failure from the new Pending record"
    );
    assert_eq!(r.hits, observed.hits, "reclaim does not change hits");

    // The reclaimed token holds the key; the old one is fenced.
    assert_eq!(
        t.store
            .reclaim(&id, token, &corrected, t.long(), t.long())
            .await
            .expect("reclaim"),
        Reclaim::Lost,
        "a second reclaim with the old token won"
    );
    assert_eq!(
        t.store
            .complete(&id, token, b"old holder", t.long())
            .await
            .expect("complete"),
        Cas::Fenced,
        "the fenced holder completed"
    );
    must_complete(&t, &id, new_token, b"second attempt").await;
    let done = must_observe(&t, &request(&id, corrected, t.long(), t.long())).await;
    assert_eq!(done.status, RecordStatus::Completed);
    assert_eq!(done.outcome.as_deref(), Some(&b"second attempt"[..]));
    assert_eq!(done.attempts, 2);

    // A permanent failure is final for the request that failed: a reclaim with its
    // fingerprint is Lost and changes nothing (the holder may have written it after the
    // reclaimer read the record Pending). Another fingerprint takes it over, any number of
    // times.
    let id = unique_id("fail-permanent");
    let req = request(&id, fp("p0"), t.long(), t.long());
    let mut token = must_claim(&t, &req).await;
    for attempt in 1..=3u32 {
        let failure = Failure::permanent(format!("attempt {attempt}"));
        assert_eq!(
            t.store
                .fail(&id, token, &failure, t.long())
                .await
                .expect("fail"),
            Cas::Applied
        );
        let r = present(&t, &id).await;
        assert_eq!(r.attempts, attempt);
        assert_eq!(r.failure, Some(failure));
        let same = fp(&format!("p{}", attempt - 1));
        assert_eq!(
            t.store
                .reclaim(&id, token, &same, t.long(), t.long())
                .await
                .expect("reclaim"),
            Reclaim::Lost,
            "a permanent failure was reclaimed by the request that failed"
        );
        assert_eq!(
            present(&t, &id).await,
            r,
            "a lost reclaim changed the record"
        );
        token = match t
            .store
            .reclaim(&id, token, &fp(&format!("p{attempt}")), t.long(), t.long())
            .await
            .expect("reclaim")
        {
            Reclaim::Reclaimed { token: new, .. } => {
                assert_eq!(new, token.next());
                new
            }
            Reclaim::Lost => {
                panic!("reclaim of a permanently Failed record by another fingerprint was Lost")
            }
        };
    }
    let r = present(&t, &id).await;
    assert_eq!(r.attempts, 4);
    assert_eq!(r.fingerprint, fp("p3"));
}

/// A Completed record is final: no reclaim (with any token), complete, fail or extend changes
/// it, and a claim only observes it.
pub async fn completed_record_is_final(t: TestStore) {
    let id = unique_id("final");
    let req = request(&id, fp("x"), t.short_lease(), t.long());
    let token = must_claim(&t, &req).await;
    must_complete(&t, &id, token, b"done").await;
    // Past the original lease, so only the status protects the record.
    t.advance(t.short_lease()).await;
    let before = present(&t, &id).await;
    for expected in [token, token.next(), FencingToken(0)] {
        for fingerprint in [fp("x"), fp("y")] {
            assert_eq!(
                t.store
                    .reclaim(&id, expected, &fingerprint, t.long(), t.long())
                    .await
                    .expect("reclaim"),
                Reclaim::Lost,
                "reclaim({expected}) of a Completed record won"
            );
        }
        assert_eq!(
            t.store
                .complete(&id, expected, b"overwrite", t.long())
                .await
                .expect("complete"),
            Cas::Fenced,
            "complete({expected}) of a Completed record was applied"
        );
        assert_eq!(
            t.store
                .fail(&id, expected, &Failure::retryable("x"), t.long())
                .await
                .expect("fail"),
            Cas::Fenced,
            "fail({expected}) of a Completed record was applied"
        );
        assert_eq!(
            t.store
                .extend(&id, expected, t.long())
                .await
                .expect("extend"),
            Cas::Fenced,
            "extend({expected}) of a Completed record was applied"
        );
    }
    assert_eq!(
        present(&t, &id).await,
        before,
        "refused writes changed a Completed record"
    );
    let seen = must_observe(&t, &req).await;
    assert_eq!(
        seen,
        with_hits(&before, before.hits + 1),
        "a claim changed more than hits"
    );
}

/// The same key in two scopes names two independent records; so do `(scope, key)` pairs
/// that a naive `scope + separator + key` concatenation would confuse.
pub async fn scopes_are_independent(t: TestStore) {
    let key = IdempotencyKey::random();
    let a = RecordId::new(key.clone(), scope("tenant-a|charge"));
    let b = RecordId::new(key.clone(), scope("tenant-b|charge"));
    let ta = must_claim(&t, &request(&a, fp("same"), t.long(), t.long())).await;
    let tb = must_claim(&t, &request(&b, fp("same"), t.long(), t.long())).await;
    must_complete(&t, &a, ta, b"outcome a").await;
    assert_eq!(
        t.store
            .fail(&b, tb, &Failure::retryable("b failed"), t.long())
            .await
            .expect("fail"),
        Cas::Applied,
        "completing the record in scope a fenced the one in scope b"
    );
    let ra = present(&t, &a).await;
    let rb = present(&t, &b).await;
    assert_eq!(ra.status, RecordStatus::Completed);
    assert_eq!(ra.outcome.as_deref(), Some(&b"outcome a"[..]));
    assert_eq!(ra.id, a);
    assert_eq!(rb.status, RecordStatus::Failed);
    assert_eq!(rb.outcome, None);
    assert_eq!(rb.id, b);

    // Pairs that collide if a store joins scope and key with a separator without escaping.
    let base = IdempotencyKey::random().into_inner();
    for sep in [
        ":", "|", "#", "/", "\\", " ", "{", "}", ".", "-", "_", "%", "::",
    ] {
        let first = RecordId::new(key_of(&format!("y{sep}z")), scope(&format!("{base}x")));
        let second = RecordId::new(key_of("z"), scope(&format!("{base}x{sep}y")));
        let t1 = must_claim(&t, &request(&first, fp("1"), t.long(), t.long())).await;
        match t
            .store
            .claim(&request(&second, fp("2"), t.long(), t.long()))
            .await
            .expect("claim")
        {
            Claim::Claimed { token, .. } => must_complete(&t, &second, token, b"second").await,
            Claim::Existing { record, .. } => panic!(
                "({}, {}) and ({}, {}) address the same record (separator {sep:?}): {record:?}",
                first.scope, first.key, second.scope, second.key
            ),
        }
        must_complete(&t, &first, t1, b"first").await;
        assert_eq!(
            present(&t, &first).await.outcome.as_deref(),
            Some(&b"first"[..])
        );
        assert_eq!(
            present(&t, &second).await.outcome.as_deref(),
            Some(&b"second"[..])
        );
    }
}

/// Every observation by a claim counts one hit, in the same atomic step; `get` does not count;
/// settling and reclaiming keep the count; concurrent observations are all counted.
pub async fn hits_are_counted(t: TestStore) {
    let id = unique_id("hits");
    let req = request(&id, fp("h"), t.long(), t.long());
    let token = must_claim(&t, &req).await;
    assert_eq!(present(&t, &id).await.hits, 0, "a fresh claim has 0 hits");
    for i in 1..=5u64 {
        assert_eq!(
            must_observe(&t, &req).await.hits,
            i,
            "the observing claim returns the count including itself"
        );
        assert_eq!(present(&t, &id).await.hits, i, "get counted a hit");
    }
    must_complete(&t, &id, token, b"ok").await;
    assert_eq!(present(&t, &id).await.hits, 5, "complete changed hits");
    // A mismatching request is an observation too.
    assert_eq!(
        must_observe(&t, &request(&id, fp("other"), t.long(), t.long()))
            .await
            .hits,
        6
    );

    // Concurrent observations: none is lost.
    let before = present(&t, &id).await.hits;
    let mut seen = Vec::new();
    for answer in concurrent_claims(&t, &req, 64).await {
        match answer {
            Claim::Existing { record, .. } => seen.push(record.hits),
            Claim::Claimed { token, .. } => {
                panic!("a claim overwrote a Completed record (Claimed({token}))")
            }
        }
    }
    assert_eq!(
        present(&t, &id).await.hits,
        before + 64,
        "concurrent observations lost hits"
    );
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(
        seen.len(),
        64,
        "each concurrent observation must see its own count (the increment is atomic)"
    );

    // Failed and reclaimed records keep counting.
    let id = unique_id("hits-failed");
    let req = request(&id, fp("h"), t.long(), t.long());
    let token = must_claim(&t, &req).await;
    t.store
        .fail(&id, token, &Failure::retryable("x"), t.long())
        .await
        .expect("fail");
    assert_eq!(must_observe(&t, &req).await.hits, 1);
    let Reclaim::Reclaimed { .. } = t
        .store
        .reclaim(&id, token, &fp("h"), t.long(), t.long())
        .await
        .expect("reclaim")
    else {
        panic!("reclaim of a Failed record was Lost");
    };
    assert_eq!(present(&t, &id).await.hits, 1, "reclaim changed hits");
    assert_eq!(must_observe(&t, &req).await.hits, 2);
}

/// Keys and scopes with any allowed character, and keys of the maximum length, are stored
/// and returned exactly and address distinct records.
pub async fn keys_and_scopes_round_trip(t: TestStore) {
    let keys: Vec<String> = vec![
        "ключ-🔑-鍵-キー-مفتاح".into(),
        r#""double" 'single' `back`"#.into(),
        "a|b".into(),
        "a\\b".into(),
        "\\".into(),
        "100%".into(),
        "%s%n%d%%".into(),
        "%00%0a".into(),
        "*".into(),
        "a*b?[c]^$".into(),
        "{tag}".into(),
        "{}".into(),
        "}{".into(),
        "a{b}c".into(),
        "a:b:c".into(),
        ":".into(),
        " ".into(),
        " leading and trailing ".into(),
        "'; DROP TABLE idempotency; --".into(),
        "$1 ?1 :name @p".into(),
        "null".into(),
        "\u{200B}zero\u{00A0}width\u{FEFF}".into(),
        "k".repeat(255),
        format!("{}x", "é".repeat(127)),
        format!("{}abc", "🔑".repeat(63)),
    ];
    for k in &keys {
        assert!(k.len() <= IdempotencyKey::MAX_LEN, "test key too long: {k}");
    }
    let base = scope(&format!("round-trip|{}", IdempotencyKey::random()));
    let mut ids: Vec<RecordId> = keys
        .iter()
        .map(|k| RecordId::new(key_of(k), base.clone()))
        .collect();

    let shared_key = IdempotencyKey::random();
    let scopes: Vec<String> = vec![
        "ключ|🔑|鍵".into(),
        r#"tenant "quoted" 'x'"#.into(),
        "a\\|b".into(),
        "100% * ? [x]".into(),
        "{hash-tag}".into(),
        "{".into(),
        "tenant:1:POST /orders/{id}?q=1&r=%20".into(),
        " ".into(),
        "x".repeat(Scope::MAX_LEN),
        format!("{}x", "é".repeat((Scope::MAX_LEN - 1) / 2)),
    ];
    ids.extend(
        scopes
            .iter()
            .map(|s| RecordId::new(shared_key.clone(), scope(s))),
    );
    // Tricky scope and tricky key together.
    ids.extend(
        scopes
            .iter()
            .zip(keys.iter().rev())
            .filter(|(s, _)| s.len() + 36 <= Scope::MAX_LEN)
            .map(|(s, k)| RecordId::new(key_of(k), scope(&format!("{s}{shared_key}")))),
    );

    for (i, id) in ids.iter().enumerate() {
        let (token, _) =
            must_claim_with_lease(&t, &request(id, fp(&format!("fp-{i}")), t.long(), t.long()))
                .await;
        let r = present(&t, id).await;
        assert_eq!(r.id, *id, "the stored address differs from the one claimed");
        must_complete(&t, id, token, format!("outcome-{i}").as_bytes()).await;
    }
    for (i, id) in ids.iter().enumerate() {
        let r = present(&t, id).await;
        assert_eq!(r.id, *id, "the stored address differs after completion");
        assert_eq!(
            r.outcome.as_deref(),
            Some(format!("outcome-{i}").as_bytes()),
            "{id} holds another record's outcome"
        );
        assert_eq!(r.fingerprint, fp(&format!("fp-{i}")));
        let seen = must_observe(&t, &request(id, r.fingerprint, t.long(), t.long())).await;
        assert_eq!(seen.id, *id);
        assert_eq!(seen.hits, 1, "{id} was observed by a claim of another key");
    }
    // Keys differing only in case or Unicode normalisation are different keys.
    let nfc = RecordId::new(key_of("caf\u{e9}"), base.clone());
    let nfd = RecordId::new(key_of("cafe\u{301}"), base.clone());
    let upper = RecordId::new(key_of("CAF\u{c9}"), base.clone());
    for id in [&nfc, &nfd, &upper] {
        let token = must_claim(&t, &request(id, fp("n"), t.long(), t.long())).await;
        must_complete(&t, id, token, id.key.as_str().as_bytes()).await;
    }
    for id in [&nfc, &nfd, &upper] {
        assert_eq!(
            present(&t, id).await.outcome.as_deref(),
            Some(id.key.as_str().as_bytes())
        );
    }
    absent(&t, &RecordId::new(key_of("never-claimed"), base)).await;
}

fn scope(s: &str) -> Scope {
    Scope::new(s).unwrap_or_else(|e| panic!("test scope {s:?} is invalid: {e}"))
}

fn key_of(s: &str) -> IdempotencyKey {
    IdempotencyKey::new(s).unwrap_or_else(|e| panic!("test key {s:?} is invalid: {e}"))
}
