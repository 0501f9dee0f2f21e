//! Fencing tokens over a key's whole history, tokens the table cannot hold, and durations too
//! long for the timestamp range.
#![allow(clippy::unwrap_used)]

use crate::common;
use idempotency_core::Idempotency;

use common::Isolation;
use idempotency_core::store::{Cas, Claim, ClaimRequest, Failure, Reclaim, Record, RecordStatus};
use idempotency_core::{
    Answer, Error, FencingToken, Fingerprint, IdempotencyKey, IdempotencyStore, Policy, RecordId,
    Scope,
};
use idempotency_postgres::sqlx;
use idempotency_postgres::PostgresStore;
use std::time::Duration;

fn request(lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new(IdempotencyKey::random(), Scope::new("tokens").unwrap()),
        Fingerprint::from_bytes(b"payload"),
        lease,
        ttl,
    )
}

async fn must_claim(store: &PostgresStore, req: &ClaimRequest) -> FencingToken {
    match store.claim(req).await.expect("claim") {
        Claim::Claimed { token, .. } => token,
        other => panic!("expected a claim of {}, got {other:?}", req.id),
    }
}

async fn record(store: &PostgresStore, id: &RecordId) -> Record {
    store
        .get(id)
        .await
        .expect("get")
        .expect("the record is live")
}

/// The database clock in microseconds since the Unix epoch.
async fn db_clock_us() -> i64 {
    let mut conn = common::admin().await;
    sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::int8")
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

#[derive(Clone, Copy, Debug)]
enum StaleOp {
    Complete,
    Fail,
    Extend,
}

impl StaleOp {
    const ALL: [StaleOp; 3] = [StaleOp::Complete, StaleOp::Fail, StaleOp::Extend];

    async fn run(self, store: &PostgresStore, id: &RecordId, token: FencingToken) -> Cas {
        let long = Duration::from_secs(3600);
        match self {
            Self::Complete => store.complete(id, token, b"stale", long).await,
            Self::Fail => {
                store
                    .fail(id, token, &Failure::retryable("stale"), long)
                    .await
            }
            Self::Extend => store.extend(id, token, long).await,
        }
        .expect("a stale CAS is an answer, not an error")
    }
}

/// Regression: a purge deleted the record, a fresh claim started again at token 1, and the
/// stalled holder of the purged record (also token 1) could complete, fail or extend the new
/// record. A fresh record's token now comes from the database clock, so it is greater than
/// any token the key had before the purge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_across_a_purge() {
    let short = Duration::from_millis(40);
    for level in Isolation::ALL {
        let (store, _guard) = common::store(level).await;
        for op in StaleOp::ALL {
            let req = request(short, short);
            let old = must_claim(&store, &req).await;
            // The holder stalls; its record expires and a purge deletes it.
            tokio::time::sleep(Duration::from_millis(150)).await;
            assert!(store.get(&req.id).await.unwrap().is_none(), "expired");
            assert_eq!(store.purge_expired(100).await.unwrap(), 1, "purged");
            let req = ClaimRequest::new(
                req.id,
                req.fingerprint,
                Duration::from_secs(60),
                Duration::from_secs(3600),
            )
            .with_count_hit(req.count_hit);
            let new = must_claim(&store, &req).await;
            let before = record(&store, &req.id).await;
            let cas = op.run(&store, &req.id, old).await;
            let after = record(&store, &req.id).await;
            assert!(
                new > old && cas == Cas::Fenced && after == before,
                "{level:?}: the claim after the purge got token {new} (the purged record's \
                 holder has {old}); the stale holder's {op:?} answered {cas:?}; \
                 record before {before:?}, after {after:?}"
            );
            assert_eq!(after.status, RecordStatus::Pending);
            assert_eq!(after.token, new);
        }
    }
}

/// A fresh record's token is the database clock in microseconds; replacing an expired record
/// takes `max(previous + 1, clock)`, so a previous token ahead of the clock (a clock that
/// stepped back) still grows by one; a reclaim stays `expected + 1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_tokens_come_from_the_database_clock() {
    let (store, guard) = common::store(Isolation::ReadCommitted).await;
    let table = format!(r#""{}".records"#, guard.schema);
    let req = request(Duration::from_secs(60), Duration::from_secs(3600));
    let before = db_clock_us().await;
    let token = must_claim(&store, &req).await;
    let after = db_clock_us().await;
    let token_us = i64::try_from(token.0).expect("a token fits BIGINT");
    assert!(
        before <= token_us && token_us <= after,
        "fresh token {token_us} outside the database clock [{before}, {after}] µs"
    );
    assert_eq!(record(&store, &req.id).await.token, token);

    // A reclaim is expected + 1.
    store
        .fail(&req.id, token, &Failure::retryable("x"), req.ttl)
        .await
        .unwrap();
    let Reclaim::Reclaimed {
        token: reclaimed, ..
    } = store
        .reclaim(&req.id, token, &req.fingerprint, req.lease, req.ttl)
        .await
        .unwrap()
    else {
        panic!("a failed record is reclaimable")
    };
    assert_eq!(reclaimed, token.next());

    // An expired record whose token is behind the clock: the replacement takes the clock.
    common::exec(&format!(
        "UPDATE {table} SET expires_at = now() - interval '1 second', \
         lease_until = now() - interval '2 seconds'"
    ))
    .await;
    let before = db_clock_us().await;
    let replaced = must_claim(&store, &req).await;
    assert!(replaced > reclaimed);
    assert!(i64::try_from(replaced.0).unwrap() >= before);

    // An expired record whose token is ahead of the clock: the replacement is token + 1.
    let ahead = i64::try_from(replaced.0).unwrap() + 3_600_000_000_000;
    common::exec(&format!(
        "UPDATE {table} SET token = {ahead}, expires_at = now() - interval '1 second', \
         lease_until = now() - interval '2 seconds'"
    ))
    .await;
    let next = must_claim(&store, &req).await;
    assert_eq!(next, FencingToken(ahead as u64 + 1));
}

/// Tokens at or above 2^63 fit no BIGINT, so no record holds one: every CAS with such a token
/// is fenced, never an error; `i64::MAX` fits and is simply a token no record holds, until one
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_beyond_bigint_are_fenced() {
    let huge = [u64::MAX, u64::MAX - 1, 1 << 63, i64::MAX as u64].map(FencingToken);
    for level in Isolation::ALL {
        let (store, guard) = common::store(level).await;
        let table = format!(r#""{}".records"#, guard.schema);
        let long = Duration::from_secs(3600);
        // A Pending record and a Failed one (reclaimable by the right token).
        let pending = request(Duration::from_secs(60), long);
        must_claim(&store, &pending).await;
        let failed = request(Duration::from_secs(60), long);
        let t = must_claim(&store, &failed).await;
        store
            .fail(&failed.id, t, &Failure::retryable("x"), long)
            .await
            .unwrap();
        for req in [&pending, &failed] {
            let before = record(&store, &req.id).await;
            for token in huge {
                for op in StaleOp::ALL {
                    assert_eq!(
                        op.run(&store, &req.id, token).await,
                        Cas::Fenced,
                        "{level:?}: {op:?} with {token} on {:?}",
                        before.status
                    );
                }
                assert_eq!(
                    store
                        .reclaim(&req.id, token, &req.fingerprint, req.lease, long)
                        .await
                        .expect("a reclaim with a huge token is an answer"),
                    Reclaim::Lost,
                    "{level:?}: reclaim with {token}"
                );
                let mut tx = store.pool().begin().await.unwrap();
                let err = store
                    .complete_in(&mut tx, &req.id, token, b"x", long)
                    .await
                    .expect_err("fenced");
                assert!(
                    matches!(err, Error::LeaseLost { token: t } if t == token),
                    "{err:?}"
                );
                tx.rollback().await.unwrap();
            }
            assert_eq!(record(&store, &req.id).await, before, "nothing changed");
        }

        // A record that does hold i64::MAX: its holder's CAS applies.
        let max = i64::MAX;
        common::exec(&format!(
            "UPDATE {table} SET token = {max} WHERE key = '{}'",
            pending.id.key
        ))
        .await;
        let max = FencingToken(max as u64);
        assert_eq!(
            StaleOp::Extend.run(&store, &pending.id, max).await,
            Cas::Applied
        );
        assert_eq!(
            StaleOp::Complete.run(&store, &pending.id, max).await,
            Cas::Applied
        );
        let done = record(&store, &pending.id).await;
        assert_eq!((done.status, done.token), (RecordStatus::Completed, max));
    }
}

/// Durations beyond what the timestamp range can hold (`Duration::MAX`, a thousand years) are
/// clamped: the deadline saturates to about a hundred years from now and the record is, in
/// effect, eternal. Nothing errors, nothing wraps into the past.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_durations_clamp() {
    let millennium = Duration::from_secs(1000 * 366 * 24 * 3600);
    let ninety_nine_years_ms: i64 = 99 * 365 * 24 * 3600 * 1000;
    for level in Isolation::ALL {
        let (store, _guard) = common::store(level).await;
        for huge in [Duration::MAX, millennium] {
            let far = |ms: i64, what: &str| {
                let now = chrono_now_ms();
                assert!(
                    ms - now > ninety_nine_years_ms,
                    "{level:?} {huge:?}: {what} {ms} is not far in the future (now {now})"
                );
            };
            // claim → extend → complete, each with the huge duration.
            let req = request(huge, huge);
            let Claim::Claimed { token, lease_until } = store.claim(&req).await.unwrap() else {
                panic!("fresh key")
            };
            far(lease_until.as_millis(), "claimed lease_until");
            let r = record(&store, &req.id).await;
            far(r.expires_at.as_millis(), "claimed expires_at");
            assert_eq!(
                store.extend(&req.id, token, huge).await.unwrap(),
                Cas::Applied
            );
            let r = record(&store, &req.id).await;
            far(r.lease_until.unwrap().as_millis(), "extended lease_until");
            assert_eq!(
                store.complete(&req.id, token, b"done", huge).await.unwrap(),
                Cas::Applied
            );
            far(
                record(&store, &req.id).await.expires_at.as_millis(),
                "completed expires_at",
            );

            // claim → fail → reclaim → complete_in, each with the huge duration.
            let req = request(huge, huge);
            let token = must_claim(&store, &req).await;
            assert_eq!(
                store
                    .fail(&req.id, token, &Failure::retryable("x"), huge)
                    .await
                    .unwrap(),
                Cas::Applied
            );
            far(
                record(&store, &req.id).await.expires_at.as_millis(),
                "failed expires_at",
            );
            let Reclaim::Reclaimed {
                token: reclaimed,
                lease_until,
            } = store
                .reclaim(&req.id, token, &req.fingerprint, huge, huge)
                .await
                .unwrap()
            else {
                panic!("a failed record is reclaimable")
            };
            far(lease_until.as_millis(), "reclaimed lease_until");
            let mut tx = store.pool().begin().await.unwrap();
            store
                .complete_in(&mut tx, &req.id, reclaimed, b"done", huge)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            let r = record(&store, &req.id).await;
            assert_eq!(r.status, RecordStatus::Completed);
            far(
                r.expires_at.as_millis(),
                "completed-in-transaction expires_at",
            );

            // Never purged.
            assert_eq!(store.purge_expired(100).await.unwrap(), 0);

            // Through the transactional engine with a policy of huge lease and TTL.
            let engine = Idempotency::builder(store.clone())
                .policy(Policy::default().lease(huge).retention(huge))
                .build()
                .unwrap();
            let (key, scope, fp) = (
                IdempotencyKey::random(),
                Scope::new("tokens").unwrap(),
                Fingerprint::from_bytes(b"engine"),
            );
            let out = engine
                .run_in_transaction(&key, &scope, &fp, |_tx, _ctx| {
                    Box::pin(async { Ok(async move { Ok::<_, String>(7) }.await) })
                })
                .await
                .unwrap();
            assert_eq!(out, Answer::Executed(Ok(7)));
            let r = record(&store, &RecordId::new(key, scope)).await;
            far(r.expires_at.as_millis(), "engine-completed expires_at");
        }
    }
}

/// The process clock in milliseconds (the database runs on this machine in the tests).
fn chrono_now_ms() -> i64 {
    idempotency_core::store::Timestamp::now().as_millis()
}
