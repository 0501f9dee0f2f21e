//! Postgres-specific behaviour beyond the conformance kit: batched purges, migrations, the
//! database clock, hit accounting that never leaks into the session, and the transactional
//! engine's error handling.
#![allow(clippy::unwrap_used)]

use crate::common;
use idempotency_core::Idempotency;

use common::{Isolation, SchemaGuard};
use idempotency_core::store::{Claim, ClaimRequest, RecordStatus};
use idempotency_core::{
    Answer, Fingerprint, IdempotencyKey, IdempotencyStore, Policy, RecordId, Scope,
};
use idempotency_postgres::sqlx::{self, Executor};
use idempotency_postgres::{PostgresError, PostgresStore};
use std::time::Duration;

fn request(ttl: Duration) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new(IdempotencyKey::random(), Scope::new("behavior").unwrap()),
        Fingerprint::from_bytes(b"payload"),
        Duration::from_secs(60),
        ttl,
    )
}

/// `n` records whose `expires_at` lies in the past, written directly.
async fn seed_expired(table: &str, n: usize) {
    common::exec(&format!(
        "INSERT INTO {table} (scope, key, fingerprint, status, token, lease_until, outcome,
                              attempts, hits, created_at, updated_at, expires_at)
         SELECT 'expired', 'k' || g, sha256(g::text::bytea), 'completed', 1, NULL, '\\x00',
                1, 0, now() - interval '2 hours', now() - interval '2 hours',
                now() - interval '1 hour' - g * interval '1 second'
         FROM generate_series(1, {n}) g"
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_works_in_batches_and_keeps_live_records() {
    let (store, guard) = common::store(Isolation::ReadCommitted).await;
    let table = format!(r#""{}".records"#, guard.schema);
    seed_expired(&table, 250).await;
    let live = request(Duration::from_secs(3600));
    assert!(matches!(
        store.claim(&live).await.unwrap(),
        Claim::Claimed { .. }
    ));
    assert_eq!(store.purge_expired(0).await.unwrap(), 0);
    assert_eq!(store.purge_expired(100).await.unwrap(), 100);
    assert_eq!(store.purge_expired(100).await.unwrap(), 100);
    assert_eq!(store.purge_expired(100).await.unwrap(), 50);
    assert_eq!(store.purge_expired(100).await.unwrap(), 0);
    assert!(store.get(&live.id).await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_purgers_skip_each_others_rows() {
    for level in Isolation::ALL {
        let (store, guard) = common::store_with(level, 8).await;
        let table = format!(r#""{}".records"#, guard.schema);
        seed_expired(&table, 2000).await;
        let purgers: Vec<_> = (0..6)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut total = 0;
                    loop {
                        let n = store.purge_expired(50).await.expect("purge");
                        assert!(n <= 50, "a batch never exceeds its size");
                        if n == 0 {
                            return total;
                        }
                        total += n;
                    }
                })
            })
            .collect();
        let mut total = 0;
        for p in purgers {
            total += p.await.unwrap();
        }
        // Each purger stops at its first empty batch; sweep whatever rows were locked by
        // another purger at that moment.
        while let n @ 1.. = store.purge_expired(50).await.unwrap() {
            total += n;
        }
        assert_eq!(
            total, 2000,
            "{level:?}: every expired row deleted exactly once"
        );
    }
}

#[tokio::test]
async fn purge_can_use_the_expiry_index() {
    let (store, guard) = common::store(Isolation::ReadCommitted).await;
    let table = format!(r#""{}".records"#, guard.schema);
    seed_expired(&table, 500).await;
    let mut conn = store.pool().acquire().await.unwrap();
    conn.execute("SET enable_seqscan = off").await.unwrap();
    let plan: Vec<String> = sqlx::query_scalar(&format!(
        "EXPLAIN SELECT scope, key FROM {table} WHERE expires_at <= now()
         ORDER BY expires_at LIMIT 100 FOR UPDATE SKIP LOCKED"
    ))
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    conn.execute("RESET enable_seqscan").await.unwrap();
    assert!(
        plan.iter().any(|l| l.contains("records_expires_at_idx")),
        "{plan:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrate_is_idempotent_and_safe_to_race() {
    let guard = SchemaGuard::new();
    let pool = common::pool(Isolation::Serializable, 8).await;
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .build(pool)
        .unwrap();
    let racers: Vec<_> = (0..6)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for r in racers {
        r.await
            .unwrap()
            .expect("every concurrent migrate() succeeds");
    }
    store.migrate().await.unwrap();
    store.verify().await.unwrap();
    let versions: Vec<i32> = sqlx::query_scalar(&format!(
        r#"SELECT version FROM "{}".records_migrations"#,
        guard.schema
    ))
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(versions, vec![1, 2, 3, 4], "each migration applied once");

    // A database migrated by a newer version of the crate is refused, not downgraded.
    common::exec(&format!(
        r#"INSERT INTO "{}".records_migrations (version, description) VALUES (99, 'future')"#,
        guard.schema
    ))
    .await;
    let err = store.migrate().await.unwrap_err();
    assert!(
        matches!(
            &err,
            PostgresError::SchemaTooNew {
                found: 99,
                supported: 4,
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn two_tables_in_one_schema_are_independent() {
    let (a, guard) = common::store(Isolation::ReadCommitted).await;
    let b = PostgresStore::builder()
        .schema(&guard.schema)
        .table("other_records")
        .build(a.pool().clone())
        .unwrap();
    b.migrate().await.unwrap();
    let req = request(Duration::from_secs(60));
    assert!(matches!(
        a.claim(&req).await.unwrap(),
        Claim::Claimed { .. }
    ));
    assert!(matches!(
        b.claim(&req).await.unwrap(),
        Claim::Claimed { .. }
    ));
}

/// Leases come from the database clock: the lease a claim returns lies between the server's
/// time before and after the call, plus the lease.
#[tokio::test]
async fn leases_use_the_database_clock() {
    let (store, _guard) = common::store(Isolation::ReadCommitted).await;
    let mut admin = common::admin().await;
    let db_now = || "SELECT (extract(epoch from clock_timestamp()) * 1000)::int8";
    for _ in 0..5 {
        let req = request(Duration::from_secs(60));
        let before: i64 = sqlx::query_scalar(db_now())
            .fetch_one(&mut admin)
            .await
            .unwrap();
        let Claim::Claimed { lease_until, .. } = store.claim(&req).await.unwrap() else {
            panic!("fresh key")
        };
        let after: i64 = sqlx::query_scalar(db_now())
            .fetch_one(&mut admin)
            .await
            .unwrap();
        let lease_ms = 60_000;
        assert!(
            before - 1 + lease_ms <= lease_until.as_millis()
                && lease_until.as_millis() <= after + lease_ms,
            "lease_until {} outside [{before}, {after}] + lease",
            lease_until.as_millis()
        );
        let seen = store.claim(&req).await.unwrap();
        let Claim::Existing { now, record } = seen else {
            panic!("live")
        };
        assert_eq!(record.lease_until, Some(lease_until));
        assert!(now.as_millis() >= before - 1);
    }
    // A huge lease or TTL is capped, not an overflow error.
    let mut req = request(Duration::MAX);
    req.lease = Duration::MAX;
    assert!(matches!(
        store.claim(&req).await.unwrap(),
        Claim::Claimed { .. }
    ));
}

/// A replay commits asynchronously (no WAL flush per replay); the setting is local to the
/// claim's own transaction and never reaches the next user of the connection.
#[tokio::test]
async fn replay_commit_mode_does_not_leak() {
    let guard = SchemaGuard::new();
    let pool = common::pool(Isolation::ReadCommitted, 1).await;
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .build(pool.clone())
        .unwrap();
    store.migrate().await.unwrap();
    let req = request(Duration::from_secs(60));
    let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
        panic!()
    };
    store
        .complete(&req.id, token, b"done", req.ttl)
        .await
        .unwrap();
    for hits in 1..=3 {
        let Claim::Existing { record, .. } = store.claim(&req).await.unwrap() else {
            panic!()
        };
        assert_eq!(record.hits, hits, "the hit is counted and visible at once");
        // Same (single) pooled connection, next transaction: back to the session's setting.
        let mode: String = sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(mode, "on");
        let mut tx = pool.begin().await.unwrap();
        let mode: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(mode, "on");
        tx.rollback().await.unwrap();
    }
    assert_eq!(store.get(&req.id).await.unwrap().unwrap().hits, 3);
}

/// An error from the work rolls its writes back and, by default, releases the key; a retry
/// runs and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_engine_releases_on_error() {
    let (store, guard) = common::store(Isolation::ReadCommitted).await;
    let orders = format!(r#""{}".orders"#, guard.schema);
    common::exec(&format!(
        "CREATE TABLE {orders} (id bigserial PRIMARY KEY, ref text)"
    ))
    .await;
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    let (key, scope, fp) = (
        IdempotencyKey::random(),
        Scope::new("tenant|orders").unwrap(),
        Fingerprint::from_bytes(b"order"),
    );
    let mut failed_token = None;
    for (attempt, fails) in [(1, true), (2, false)] {
        let insert = format!("INSERT INTO {orders} (ref) VALUES ('{key}')");
        let out = engine
            .run_in_transaction(&key, &scope, &fp, move |tx, ctx| {
                let insert = insert.clone();
                Box::pin(async move {
                    Ok(async move {
                        tx.execute(insert.as_str())
                            .await
                            .map_err(|e| e.to_string())?;
                        if fails {
                            Err("card declined".to_owned())
                        } else {
                            Ok(ctx.token.0)
                        }
                    }
                    .await)
                })
            })
            .await
            .unwrap();
        let count: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {orders}"))
            .fetch_one(store.pool())
            .await
            .unwrap();
        let record = store
            .get(&RecordId::new(key.clone(), scope.clone()))
            .await
            .unwrap()
            .unwrap();
        if fails {
            assert_eq!(out, Answer::Executed(Err("card declined".to_owned())));
            assert_eq!(
                count, 0,
                "attempt {attempt}: the failed work's insert rolled back"
            );
            assert_eq!(record.status, RecordStatus::Failed);
            failed_token = Some(record.token);
        } else {
            // The retry reclaimed the failed record: its token plus one.
            let reclaimed = failed_token.expect("the first attempt failed").next();
            assert_eq!(out, Answer::Executed(Ok(reclaimed.0)));
            assert_eq!(record.token, reclaimed);
            assert_eq!(count, 1);
            assert_eq!(record.status, RecordStatus::Completed);
            assert_eq!(record.attempts, 2);
        }
    }
}

/// A claim that counts no hit writes nothing: the live row keeps its row version (`xmin`,
/// `ctid`) through any number of uncounted observations, while one counted observation writes
/// a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncounted_claims_write_no_row_version() {
    let (store, guard) = common::store(Isolation::ReadCommitted).await;
    let table = format!(r#""{}".records"#, guard.schema);
    let req = request(Duration::from_secs(3600));
    let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
        panic!("a fresh key was not claimed");
    };
    store
        .complete(&req.id, token, b"done", Duration::from_secs(3600))
        .await
        .unwrap();
    let version = || async {
        let row: (String, String) = sqlx::query_as(&format!(
            "SELECT xmin::text, ctid::text FROM {table} WHERE key = $1"
        ))
        .bind(req.id.key.as_str())
        .fetch_one(store.pool())
        .await
        .unwrap();
        row
    };
    let before = version().await;
    let uncounted = req.clone().with_count_hit(false);
    for _ in 0..5 {
        let Claim::Existing { record, .. } = store.claim(&uncounted).await.unwrap() else {
            panic!("a completed record was claimed again");
        };
        assert_eq!(record.status, RecordStatus::Completed);
    }
    assert_eq!(version().await, before, "an uncounted claim wrote the row");
    store.claim(&req).await.unwrap();
    assert_ne!(
        version().await,
        before,
        "a counted claim wrote no row version"
    );
}
