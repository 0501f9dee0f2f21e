//! The claim-or-observe statement and the CAS statements, checked field by field against the
//! `# Behavior` contract, plus the expiry index and purge.

use crate::common;

use common::{id, manual_store, req};
use idempotency_core::store::{Cas, Claim, Failure, Reclaim, RecordStatus, Settlement};
use idempotency_core::{FencingToken, Fingerprint, IdempotencyStore};
use idempotency_sqlite::ConnectionMode;
use std::time::Duration;

const S: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_record_is_replaced_with_the_next_token_and_live_ones_count_hits() {
    let (store, clock, _dir) = manual_store(ConnectionMode::DedicatedThread).await;
    let id = id("expiry");
    let r1 = req(&id, b"one", 10 * S, 60 * S);
    let t0 = clock.now_ms();
    let Claim::Claimed { token, lease_until } = store.claim(&r1).await.unwrap() else {
        panic!("first claim must win");
    };
    // A fresh key's token comes from the clock (in microseconds).
    assert_eq!(token, FencingToken(t0 as u64 * 1000));
    let first = token;
    assert_eq!(lease_until.as_millis(), t0 + 10_000);

    for expected_hits in 1..=3u64 {
        let Claim::Existing { record, now } = store.claim(&r1).await.unwrap() else {
            panic!("a live record must be observed");
        };
        assert_eq!(record.hits, expected_hits);
        assert_eq!(record.token, first);
        assert_eq!(record.status, RecordStatus::Pending);
        assert_eq!(now.as_millis(), t0);
        assert_eq!(record.expires_at.as_millis(), t0 + 60_000);
    }
    assert_eq!(
        store.complete(&id, first, b"done", 30 * S).await.unwrap(),
        Cas::Applied
    );
    // A live Completed record is never overwritten, even by another fingerprint.
    let other = req(&id, b"two", 10 * S, 60 * S);
    let Claim::Existing { record, .. } = store.claim(&other).await.unwrap() else {
        panic!("completed record must be observed");
    };
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(record.outcome.as_deref(), Some(&b"done"[..]));
    assert_eq!(record.fingerprint, Fingerprint::from_bytes(b"one"));
    assert_eq!(record.hits, 4);

    // At expires_at exactly the record counts as absent and is replaced, with a token from the
    // clock above the old one.
    clock.advance(30 * S);
    assert!(store.get(&id).await.unwrap().is_none());
    let t1 = clock.now_ms();
    let Claim::Claimed { token, .. } = store.claim(&other).await.unwrap() else {
        panic!("an expired record must be replaced");
    };
    assert_eq!(token, FencingToken(t1 as u64 * 1000));
    assert!(token > first);
    let fresh = store.get(&id).await.unwrap().expect("replaced record");
    assert_eq!(fresh.status, RecordStatus::Pending);
    assert_eq!(fresh.fingerprint, Fingerprint::from_bytes(b"two"));
    assert_eq!((fresh.attempts, fresh.hits), (1, 0));
    assert_eq!(fresh.outcome, None);
    assert_eq!(fresh.failure, None);
    assert_eq!(fresh.created_at.as_millis(), t1);
    assert_eq!(fresh.expires_at.as_millis(), t1 + 60_000);
    // The old holder is fenced.
    assert_eq!(
        store.complete(&id, first, b"late", S).await.unwrap(),
        Cas::Fenced
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_fail_extend_and_stale_snapshots() {
    for mode in [
        ConnectionMode::DedicatedThread,
        ConnectionMode::BlockingPool { connections: 3 },
    ] {
        let (store, clock, _dir) = manual_store(mode).await;
        let id = id("reclaim");
        let r = req(&id, b"p", 10 * S, 100 * S);
        let Claim::Claimed { token: first, .. } = store.claim(&r).await.unwrap() else {
            panic!("a fresh key must be claimed");
        };
        let fp = Fingerprint::from_bytes(b"p");
        // Live lease: no reclaim.
        assert_eq!(
            store
                .reclaim(&id, first, &fp, 10 * S, 100 * S)
                .await
                .unwrap(),
            Reclaim::Lost
        );
        // Extend pushes the lease; the expiry moves only when the lease would outlive it.
        clock.advance(8 * S);
        let before = store.get(&id).await.unwrap().unwrap();
        assert_eq!(
            store.extend(&id, first, 50 * S).await.unwrap(),
            Cas::Applied
        );
        let rec = store.get(&id).await.unwrap().unwrap();
        assert_eq!(
            rec.lease_until.unwrap().as_millis(),
            before.created_at.as_millis() + 58_000
        );
        assert_eq!(rec.expires_at, before.expires_at);
        let other = common::id("extend-expiry");
        let Claim::Claimed {
            token: other_token, ..
        } = store
            .claim(&req(&other, b"p", 10 * S, 20 * S))
            .await
            .unwrap()
        else {
            panic!("a fresh key must be claimed");
        };
        assert_eq!(
            store.extend(&other, other_token, 200 * S).await.unwrap(),
            Cas::Applied
        );
        let rec = store.get(&other).await.unwrap().unwrap();
        assert_eq!(rec.lease_until, Some(rec.expires_at));
        clock.advance(50 * S);
        // Lease passed: the wrong token loses, the right one wins once.
        assert_eq!(
            store
                .reclaim(&id, FencingToken(first.0 + 7), &fp, 10 * S, 100 * S)
                .await
                .unwrap(),
            Reclaim::Lost
        );
        let Reclaim::Reclaimed { token, .. } = store
            .reclaim(&id, first, &fp, 10 * S, 100 * S)
            .await
            .unwrap()
        else {
            panic!("lease passed: reclaim must win");
        };
        assert_eq!(token, first.next());
        assert_eq!(
            store
                .reclaim(&id, first, &fp, 10 * S, 100 * S)
                .await
                .unwrap(),
            Reclaim::Lost
        );
        // The fenced holder can neither fail nor extend.
        let failure = Failure::retryable("boom");
        assert_eq!(
            store.fail(&id, first, &failure, 50 * S).await.unwrap(),
            Cas::Fenced
        );
        assert_eq!(store.extend(&id, first, 50 * S).await.unwrap(), Cas::Fenced);
        assert_eq!(
            store.fail(&id, token, &failure, 50 * S).await.unwrap(),
            Cas::Applied
        );
        let rec = store.get(&id).await.unwrap().unwrap();
        assert_eq!(rec.status, RecordStatus::Failed);
        assert_eq!(rec.failure, Some(failure));
        assert_eq!(rec.attempts, 2);
        // Failed: reclaim at once, with another fingerprint; then complete.
        let fp2 = Fingerprint::from_bytes(b"q");
        let Reclaim::Reclaimed { token, .. } = store
            .reclaim(&id, token, &fp2, 10 * S, 100 * S)
            .await
            .unwrap()
        else {
            panic!("failed record must be reclaimable");
        };
        assert_eq!(token, FencingToken(first.0 + 2));
        assert_eq!(
            store.complete(&id, token, b"ok", 100 * S).await.unwrap(),
            Cas::Applied
        );
        // Stale snapshot: the token read before the completion cannot reclaim it.
        clock.advance(50 * S);
        assert_eq!(
            store
                .reclaim(&id, token, &fp2, 10 * S, 100 * S)
                .await
                .unwrap(),
            Reclaim::Lost
        );
        let rec = store.get(&id).await.unwrap().unwrap();
        assert_eq!(rec.status, RecordStatus::Completed);
        assert_eq!(rec.fingerprint, fp2);
        assert_eq!(rec.outcome.as_deref(), Some(&b"ok"[..]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_only_expired_records_in_batches_using_the_index() {
    let (store, clock, _dir) = manual_store(ConnectionMode::DedicatedThread).await;
    let mut short = Vec::new();
    for i in 0..25 {
        let id = id(&format!("short-{i}"));
        store.claim(&req(&id, b"x", S, 10 * S)).await.unwrap();
        short.push(id);
    }
    let long = id("long");
    store.claim(&req(&long, b"x", S, 1000 * S)).await.unwrap();
    assert_eq!(store.purge_expired(100).await.unwrap(), 0);
    clock.advance(10 * S);
    assert_eq!(store.purge_expired(10).await.unwrap(), 10);
    assert_eq!(store.purge_expired(10).await.unwrap(), 10);
    assert_eq!(store.purge_expired(10).await.unwrap(), 5);
    assert_eq!(store.purge_expired(10).await.unwrap(), 0);
    assert!(store.get(&long).await.unwrap().is_some());
    let table = store.table().to_owned();
    let plan: String = store
        .call(move |conn| {
            conn.query_row(
                &format!(
                    "EXPLAIN QUERY PLAN SELECT rowid FROM \"{table}\" WHERE expires_at <= 5 \
                     ORDER BY expires_at LIMIT 10"
                ),
                [],
                |r| r.get(3),
            )
        })
        .await
        .unwrap()
        .unwrap();
    assert!(
        plan.contains("_expires_at"),
        "purge must use the expiry index: {plan}"
    );
}

trait NowMs {
    fn now_ms(&self) -> i64;
}

impl NowMs for idempotency_core::store::ManualClock {
    fn now_ms(&self) -> i64 {
        idempotency_core::store::Clock::now(self).as_millis()
    }
}

/// A replay only counts a hit, committed with `synchronous = NORMAL` for that one transaction:
/// every connection is back at FULL afterwards (so the next claim or completion is synced), and
/// the hits are counted and readable, in both connection modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_count_hits_and_leave_every_connection_at_synchronous_full() {
    for mode in [
        ConnectionMode::DedicatedThread,
        ConnectionMode::BlockingPool { connections: 3 },
    ] {
        let (store, _clock, _dir) = manual_store(mode).await;
        let id = id("replay-sync");
        let r = req(&id, b"one", 10 * S, 60 * S);
        let Claim::Claimed { token, .. } = store.claim(&r).await.unwrap() else {
            panic!("first claim must win");
        };
        store.complete(&id, token, b"done", 60 * S).await.unwrap();
        let mut tasks = Vec::new();
        for _ in 0..24 {
            let (store, r) = (store.clone(), r.clone());
            tasks.push(tokio::spawn(async move { store.claim(&r).await.unwrap() }));
        }
        let mut seen = Vec::new();
        for t in tasks {
            let Claim::Existing { record, .. } = t.await.unwrap() else {
                panic!("{mode:?}: a completed record was claimed again");
            };
            assert_eq!(record.outcome.as_deref(), Some(&b"done"[..]));
            seen.push(record.hits);
        }
        seen.sort_unstable();
        assert_eq!(
            seen,
            (1..=24).collect::<Vec<u64>>(),
            "{mode:?}: each hit counted once"
        );
        assert_eq!(store.get(&id).await.unwrap().unwrap().hits, 24);
        // Ask every connection of the pool (each call takes whichever is free; enough
        // concurrent calls reach all of them).
        let mut checks = Vec::new();
        for _ in 0..12 {
            let store = store.clone();
            checks.push(tokio::spawn(async move {
                store
                    .call(|conn| {
                        std::thread::sleep(Duration::from_millis(20));
                        conn.query_row("PRAGMA synchronous", [], |row| row.get::<_, i64>(0))
                    })
                    .await
                    .unwrap()
                    .unwrap()
            }));
        }
        for c in checks {
            assert_eq!(
                c.await.unwrap(),
                2,
                "{mode:?}: synchronous must be FULL (2)"
            );
        }
    }
}

/// Group commit: writes queued together share one transaction (one sync), and a write that
/// fails inside it (a reclaim the table's CHECK constraint refuses, its record's attempts
/// being corrupt) undoes only its own changes: every other write of the batch is committed and
/// answered, and the corrupt record is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_commit_shares_transactions_and_isolates_a_failing_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotency_sqlite::SqliteStore::open(dir.path().join("group.db"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let bad = id("corrupt");
    let Claim::Claimed {
        token: bad_token, ..
    } = store
        .claim(&req(&bad, b"x", 600 * S, 600 * S))
        .await
        .unwrap()
    else {
        panic!("a fresh key was not claimed");
    };
    store
        .fail(&bad, bad_token, &Failure::retryable("x"), 600 * S)
        .await
        .unwrap();
    let bad_key = bad.key.as_str().to_owned();
    store
        .call(move |c| {
            c.pragma_update(None, "ignore_check_constraints", true)?;
            c.execute(
                "UPDATE idempotency_records SET attempts = -3 WHERE key = ?1",
                [&bad_key],
            )?;
            c.pragma_update(None, "ignore_check_constraints", false)
        })
        .await
        .unwrap()
        .unwrap();
    let before = store.write_stats();
    let mut completed = 0u64;
    for round in 0..10 {
        let mut tasks = Vec::new();
        for i in 0..32 {
            let (store, id) = (store.clone(), id(&format!("fresh-{round}-{i}")));
            tasks.push(tokio::spawn(async move {
                let Claim::Claimed { token, .. } =
                    store.claim(&req(&id, b"x", 60 * S, 600 * S)).await.unwrap()
                else {
                    panic!("{id} was not claimed");
                };
                let cas = store.complete(&id, token, b"done", 600 * S).await.unwrap();
                assert_eq!(cas, Cas::Applied, "{id}");
                id
            }));
        }
        let failing = {
            let store = store.clone();
            let bad = bad.clone();
            tokio::spawn(async move {
                let fp = Fingerprint::from_bytes(b"x");
                store.reclaim(&bad, bad_token, &fp, 60 * S, 600 * S).await
            })
        };
        for task in tasks {
            let id = task.await.unwrap();
            let record = store
                .get(&id)
                .await
                .unwrap()
                .expect("a committed write is there");
            assert_eq!(record.status, RecordStatus::Completed, "{id}");
            assert_eq!(record.outcome.as_deref(), Some(&b"done"[..]));
            completed += 1;
        }
        match failing.await.unwrap() {
            Err(idempotency_core::Error::CorruptRecord { .. }) => {}
            other => panic!("the reclaim of a corrupt record answered {other:?}"),
        }
    }
    let after = store.write_stats();
    let (writes, transactions) = (
        after.writes - before.writes,
        after.transactions - before.transactions,
    );
    println!("{writes} writes committed in {transactions} transactions");
    // Every claim and completion of a fresh key; not the refused reclaims (their savepoints
    // rolled back, the rest of their batches committed).
    assert_eq!(writes, 2 * completed);
    assert!(
        transactions < writes,
        "{writes} concurrent writes took {transactions} transactions: nothing was batched"
    );
    let bad_key = bad.key.as_str().to_owned();
    let (attempts, status): (i64, String) = store
        .call(move |c| {
            c.query_row(
                "SELECT attempts, status FROM idempotency_records WHERE key = ?1",
                [&bad_key],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!((attempts, status.as_str()), (-3, "failed"));
}

/// A batch of claims is one write transaction (one sync), and so is a batch of settlements;
/// a settlement inside it that fails (a trigger refuses its update) undoes only its own
/// change: every other settlement is committed and
/// answered, and the corrupt record is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_one_transaction_and_a_failing_item_undoes_only_its_own() {
    for mode in [
        ConnectionMode::DedicatedThread,
        ConnectionMode::BlockingPool { connections: 2 },
    ] {
        let (store, _clock, _dir) = manual_store(mode).await;
        let ids: Vec<_> = (0..50).map(|i| id(&format!("batch-{i}"))).collect();
        let requests: Vec<_> = ids
            .iter()
            .map(|id| req(id, b"x", 60 * S, 600 * S))
            .collect();
        let before = store.write_stats();
        let answers = store.claim_many(&requests).await;
        let after = store.write_stats();
        assert_eq!(
            after.transactions - before.transactions,
            1,
            "{mode:?}: 50 claims in one transaction"
        );
        let tokens: Vec<FencingToken> = answers
            .into_iter()
            .map(|a| match a.unwrap() {
                Claim::Claimed { token, .. } => token,
                other => panic!("{mode:?}: a new key answered {other:?}"),
            })
            .collect();

        let bad_key = ids[7].key.as_str().to_owned();
        store
            .call(move |c| {
                c.execute_batch(&format!(
                    "CREATE TRIGGER refuse_one BEFORE UPDATE ON idempotency_records
                     WHEN OLD.key = '{bad_key}'
                     BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END"
                ))
            })
            .await
            .unwrap()
            .unwrap();
        let settlements: Vec<_> = ids
            .iter()
            .zip(&tokens)
            .enumerate()
            .map(|(i, (id, token))| match i % 2 {
                0 => Settlement::complete(id.clone(), *token, b"done".to_vec(), 600 * S),
                _ => Settlement::fail(id.clone(), *token, Failure::retryable("no"), 600 * S),
            })
            .collect();
        let before = store.write_stats();
        let answers = store.settle_many(&settlements).await;
        let after = store.write_stats();
        assert_eq!(
            after.transactions - before.transactions,
            1,
            "{mode:?}: 50 settlements in one transaction"
        );
        for (i, answer) in answers.into_iter().enumerate() {
            match (i, answer) {
                (7, Err(e)) => assert!(e.to_string().contains("refused"), "{mode:?}: {e}"),
                (7, other) => panic!("{mode:?}: the refused settlement: {other:?}"),
                (_, Ok(Cas::Applied)) => {}
                (i, other) => panic!("{mode:?}: settlement {i}: {other:?}"),
            }
        }
        for (i, id) in ids.iter().enumerate() {
            let record = store.get(id).await.unwrap().expect("kept");
            let expected = match i {
                7 => RecordStatus::Pending,
                i if i % 2 == 0 => RecordStatus::Completed,
                _ => RecordStatus::Failed,
            };
            assert_eq!(record.status, expected, "{mode:?}: record {i}");
        }
    }
}
