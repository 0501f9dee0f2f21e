//! Redis-specific cases, run against both topologies.

use super::{Harness, Raw};
use idempotency_conformance::cases::unique_id;
use idempotency_core::store::{
    Cas, Claim, ClaimRequest, Failure, Reclaim, RecordStatus, Settlement,
};
use idempotency_core::{
    Error, FencingToken, Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope,
};
use idempotency_redis::RedisStore;
use std::sync::Arc;
use std::time::Duration;

const HOUR: Duration = Duration::from_secs(3600);

fn req(id: &RecordId, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest::new(id.clone(), Fingerprint::from_bytes(b"payload"), lease, ttl)
}

async fn claimed(store: &RedisStore, r: &ClaimRequest) -> FencingToken {
    match store.claim(r).await.expect("claim") {
        Claim::Claimed { token, .. } => token,
        Claim::Existing { record, .. } => panic!("expected Claimed, found {record:?}"),
    }
}

async fn pttl(raw: &Raw, key: &str) -> i64 {
    raw.query(redis::cmd("PTTL").arg(key)).await
}

/// Asserts the record's key has a TTL, and that it lies within `range` milliseconds.
async fn assert_ttl(raw: &Raw, key: &str, after: &str, range: std::ops::RangeInclusive<i64>) {
    let ms = pttl(raw, key).await;
    assert!(ms > 0, "PTTL is {ms} after {after}: the record has no TTL");
    assert!(
        range.contains(&ms),
        "PTTL {ms} after {after} is outside {range:?}"
    );
}

/// `PTTL > 0` after claim, hit, extend, complete, fail and reclaim, and after a claim that
/// replaces an expired record, with the default retention and with none.
pub(crate) async fn ttl_after_every_operation(h: Harness) {
    let raw = h.topology.raw().await;
    let retention_ms = 3_600_000;
    for (store, extra) in [
        (h.store.clone(), retention_ms),
        (
            h.store_with(|b| b.expired_retention(Duration::ZERO)).await,
            0,
        ),
    ] {
        // The key's TTL is expires_at - now + retention; allow a second of slack.
        let around = |ms: i64| (ms + extra - 1_000)..=(ms + extra);

        let id = unique_id("ttl");
        let key = store.record_key(&id);
        let r = req(&id, Duration::from_secs(30), Duration::from_secs(120));
        let token = claimed(&store, &r).await;
        assert_ttl(&raw, &key, "claim", around(120_000)).await;
        assert!(matches!(
            store.claim(&r).await.expect("hit"),
            Claim::Existing { .. }
        ));
        assert_ttl(&raw, &key, "a hit", around(120_000)).await;
        assert_eq!(
            store
                .extend(&id, token, Duration::from_secs(600))
                .await
                .expect("extend"),
            Cas::Applied
        );
        assert_ttl(&raw, &key, "extend", around(600_000)).await;
        assert_eq!(
            store
                .complete(&id, token, b"done", Duration::from_secs(60))
                .await
                .expect("complete"),
            Cas::Applied
        );
        assert_ttl(&raw, &key, "complete", around(60_000)).await;
        assert!(matches!(
            store.claim(&r).await.expect("hit"),
            Claim::Existing { .. }
        ));
        assert_ttl(&raw, &key, "a hit on a completed record", around(60_000)).await;

        let id = unique_id("ttl-fail");
        let key = store.record_key(&id);
        let r = req(&id, Duration::from_secs(30), Duration::from_secs(120));
        let token = claimed(&store, &r).await;
        assert_eq!(
            store
                .fail(
                    &id,
                    token,
                    &Failure::retryable("boom"),
                    Duration::from_secs(90)
                )
                .await
                .expect("fail"),
            Cas::Applied
        );
        assert_ttl(&raw, &key, "fail", around(90_000)).await;
        let failed_token = token;
        let Reclaim::Reclaimed { token, .. } = store
            .reclaim(
                &id,
                token,
                &r.fingerprint,
                Duration::from_secs(30),
                Duration::from_secs(200),
            )
            .await
            .expect("reclaim")
        else {
            panic!("reclaim of a failed record lost");
        };
        assert_ttl(&raw, &key, "reclaim", around(200_000)).await;
        assert_eq!(
            token,
            failed_token.next(),
            "a reclaim adds one to the token"
        );

        // A record that expires: with retention it is kept, without it Redis evicts it; either
        // way the next claim's token is above the old one (it comes from the server clock).
        let id = unique_id("ttl-expire");
        let key = store.record_key(&id);
        let short = req(&id, Duration::from_millis(150), Duration::from_millis(150));
        let first = claimed(&store, &short).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            store.get(&id).await.expect("get"),
            None,
            "an expired record reads as absent"
        );
        let exists: i64 = raw.query(redis::cmd("EXISTS").arg(&key)).await;
        assert_eq!(
            exists,
            i64::from(extra > 0),
            "physical presence after expiry"
        );
        let second = claimed(&store, &short).await;
        assert!(
            second > first,
            "the claim after expiry (retention {extra} ms) got token {second}, not above the \
             old record's {first}"
        );
        assert_ttl(
            &raw,
            &key,
            "a claim replacing an expired record",
            around(150),
        )
        .await;
    }
}

fn flush_scripts(h: &Harness) {
    for node in h.topology.nodes() {
        let mut con = redis::Client::open(node.as_str())
            .and_then(|c| c.get_connection())
            .expect("connect for SCRIPT FLUSH");
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut con)
            .expect("SCRIPT FLUSH");
    }
}

/// `SCRIPT FLUSH` before every operation: each one reloads its script and succeeds.
pub(crate) async fn script_flush_mid_run(h: Harness) {
    let s = &h.store;
    let id = unique_id("flush");
    let r = req(&id, HOUR, HOUR);
    flush_scripts(&h);
    let token = claimed(s, &r).await;
    flush_scripts(&h);
    assert_eq!(
        s.extend(&id, token, HOUR).await.expect("extend"),
        Cas::Applied
    );
    flush_scripts(&h);
    assert_eq!(
        s.complete(&id, token, b"ok", HOUR).await.expect("complete"),
        Cas::Applied
    );
    flush_scripts(&h);
    let rec = s.get(&id).await.expect("get").expect("present");
    assert_eq!(rec.outcome.as_deref(), Some(&b"ok"[..]));
    flush_scripts(&h);
    match s.claim(&r).await.expect("claim") {
        Claim::Existing { record, .. } => assert_eq!(record.hits, 1),
        other => panic!("expected the completed record, got {other:?}"),
    }
    let id = unique_id("flush-2");
    let r = req(&id, HOUR, HOUR);
    let token = claimed(s, &r).await;
    flush_scripts(&h);
    assert_eq!(
        s.fail(&id, token, &Failure::retryable("no"), HOUR)
            .await
            .expect("fail"),
        Cas::Applied
    );
    flush_scripts(&h);
    assert!(matches!(
        s.reclaim(&id, token, &r.fingerprint, HOUR, HOUR)
            .await
            .expect("reclaim"),
        Reclaim::Reclaimed { .. }
    ));
    flush_scripts(&h);
    assert_eq!(s.purge_expired(100).await.expect("purge"), 0);

    // Batches: a pipeline whose scripts were flushed still runs every call exactly once (the
    // first call of each script loads it), across slots on a cluster.
    let ids: Vec<RecordId> = (0..12)
        .map(|i| unique_id(&format!("flush-batch-{i}")))
        .collect();
    let requests: Vec<ClaimRequest> = ids.iter().map(|id| req(id, HOUR, HOUR)).collect();
    flush_scripts(&h);
    let tokens: Vec<FencingToken> = s
        .claim_many(&requests)
        .await
        .into_iter()
        .map(|a| match a.expect("claim in a batch") {
            Claim::Claimed { token, .. } => token,
            other => panic!("expected a claim, got {other:?}"),
        })
        .collect();
    flush_scripts(&h);
    let settlements: Vec<Settlement> = ids
        .iter()
        .zip(&tokens)
        .enumerate()
        .map(|(i, (id, token))| match i % 2 {
            0 => Settlement::complete(id.clone(), *token, b"ok".to_vec(), HOUR),
            _ => Settlement::fail(id.clone(), *token, Failure::retryable("later"), HOUR),
        })
        .collect();
    for (i, answer) in s.settle_many(&settlements).await.into_iter().enumerate() {
        assert_eq!(
            answer.expect("settle in a batch"),
            Cas::Applied,
            "settlement {i}"
        );
    }
}

/// Foreign or damaged data at a record's key: every operation answers
/// [`Error::CorruptRecord`], none panics, and the data is left exactly as it was.
pub(crate) async fn corrupt_data_is_a_typed_error(h: Harness) {
    let raw = h.topology.raw().await;
    let s = &h.store;
    // A well-formed Pending record, as the store wrote it, to damage byte by byte.
    let model = unique_id("corrupt-model");
    s.claim(&req(&model, HOUR, HOUR)).await.expect("claim");
    let good: Vec<u8> = raw.query(redis::cmd("GET").arg(s.record_key(&model))).await;
    assert_eq!(&good[..4], b"idk1", "records are stored in encoding idk1");
    let set = |at: usize, bytes: &[u8]| {
        let mut v = good.clone();
        v[at..at + bytes.len()].copy_from_slice(bytes);
        v
    };
    let damages: Vec<(&str, Vec<u8>)> = vec![
        ("another encoding version", set(0, b"idk0")),
        ("a truncated record", good[..60].to_vec()),
        ("status byte 7", set(4, &[7])),
        ("flags 200", set(5, &[200])),
        ("a token of 2^53", set(6, &(1u64 << 53).to_be_bytes())),
        ("a token of 0", set(6, &0u64.to_be_bytes())),
        ("an expiry of 2^63", set(50, &(1u64 << 63).to_be_bytes())),
        (
            "a failure message past the end",
            set(90, &1000u32.to_be_bytes()),
        ),
        (
            "an update time of 2^63",
            set(42, &(1u64 << 63).to_be_bytes()),
        ),
        (
            "outcome bytes without an outcome",
            [&good[..], b"tail"].concat(),
        ),
        ("a retryable flag without a failure", set(5, &[1 | 4])),
    ];
    // (what, command, arguments after the key)
    let mut cases: Vec<(String, &str, Vec<Vec<u8>>)> = vec![
        ("a string".into(), "SET", vec![b"hello".to_vec()]),
        ("a list".into(), "RPUSH", vec![b"a".to_vec(), b"b".to_vec()]),
        ("a set".into(), "SADD", vec![b"a".to_vec()]),
        (
            "a hash (a record of the encoding before idk1)".into(),
            "HSET",
            vec![
                b"st".to_vec(),
                b"pending".to_vec(),
                b"tok".to_vec(),
                b"4".to_vec(),
            ],
        ),
    ];
    for (what, bytes) in damages {
        cases.push((what.to_owned(), "SET", vec![bytes]));
    }

    for (label, command, args) in cases {
        let id = unique_id("corrupt");
        let key = s.record_key(&id);
        let _: redis::Value = raw.query(redis::cmd(command).arg(&key).arg(&args)).await;
        let _: i64 = raw
            .query(redis::cmd("PEXPIRE").arg(&key).arg(600_000))
            .await;
        let before: Vec<u8> = raw.query(redis::cmd("DUMP").arg(&key)).await;

        let r = req(&id, HOUR, HOUR);
        let results: Vec<(&str, Result<(), Error>)> = vec![
            ("claim", s.claim(&r).await.map(drop)),
            ("get", s.get(&id).await.map(drop)),
            (
                "complete",
                s.complete(&id, FencingToken(4), b"x", HOUR).await.map(drop),
            ),
            (
                "fail",
                s.fail(&id, FencingToken(4), &Failure::retryable("x"), HOUR)
                    .await
                    .map(drop),
            ),
            (
                "extend",
                s.extend(&id, FencingToken(4), HOUR).await.map(drop),
            ),
            (
                "reclaim",
                s.reclaim(&id, FencingToken(4), &r.fingerprint, HOUR, HOUR)
                    .await
                    .map(drop),
            ),
        ];
        for (op, result) in results {
            match result {
                Err(e @ Error::CorruptRecord { .. }) => {
                    assert!(!e.is_retryable());
                    assert!(!e.to_string().is_empty());
                }
                other => panic!("{op} on {label}: expected CorruptRecord, got {other:?}"),
            }
        }
        let after: Vec<u8> = raw.query(redis::cmd("DUMP").arg(&key)).await;
        assert_eq!(before, after, "{label}: the data at the key was modified");
    }
}

/// Scopes and keys full of braces, colons and percent signs: full flows, and distinct ids
/// never share a record.
pub(crate) async fn hostile_ids_stay_apart(h: Harness) {
    let s = &h.store;
    let pairs = [
        ("{tenant}", "}{"),
        ("a:b", "c"),
        ("a", "b:c"),
        ("%7B", "%"),
        ("}", "{}"),
        ("ü {x} *?[", "\\]"),
    ];
    let ids: Vec<RecordId> = pairs
        .iter()
        .map(|(sc, k)| {
            RecordId::new(
                IdempotencyKey::new(*k).expect("key"),
                Scope::new(format!("{sc}-{}", uuid::Uuid::new_v4())).expect("scope"),
            )
        })
        .collect();
    for (i, id) in ids.iter().enumerate() {
        let r = req(id, HOUR, HOUR);
        let token = claimed(s, &r).await;
        let out = format!("outcome-{i}");
        assert_eq!(
            s.complete(id, token, out.as_bytes(), HOUR)
                .await
                .expect("complete"),
            Cas::Applied
        );
    }
    for (i, id) in ids.iter().enumerate() {
        let rec = s.get(id).await.expect("get").expect("present");
        assert_eq!(rec.outcome, Some(format!("outcome-{i}").into_bytes()));
        assert_eq!(rec.status, RecordStatus::Completed);
        assert_eq!(rec.id, *id);
    }
}

/// 32 concurrent reclaims of one failed record, 10 times: exactly one wins each time, and
/// the record then holds the winner's token and one more attempt.
pub(crate) async fn concurrent_reclaims_one_winner(h: Harness) {
    let store = Arc::new(h.store.clone());
    for round in 0..10 {
        let id = unique_id("reclaim-race");
        let r = req(&id, HOUR, HOUR);
        let token = claimed(&store, &r).await;
        store
            .fail(&id, token, &Failure::retryable("x"), HOUR)
            .await
            .expect("fail");
        let barrier = Arc::new(tokio::sync::Barrier::new(32));
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let (store, id, barrier) = (store.clone(), id.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    store
                        .reclaim(&id, token, &Fingerprint::from_bytes(b"payload"), HOUR, HOUR)
                        .await
                        .expect("reclaim")
                })
            })
            .collect();
        let mut winners = Vec::new();
        for t in tasks {
            if let Reclaim::Reclaimed { token, .. } = t.await.expect("task") {
                winners.push(token);
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: {winners:?} won");
        let rec = store.get(&id).await.expect("get").expect("present");
        assert_eq!(rec.token, winners[0]);
        assert_eq!(rec.token, token.next());
        assert_eq!(rec.attempts, 2);
        assert_eq!(rec.status, RecordStatus::Pending);
    }
}
