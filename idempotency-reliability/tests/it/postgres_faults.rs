//! Fault injection against the real PostgreSQL server: connections terminated with
//! `pg_terminate_backend` during a standalone `complete` and during the exactly-once commit,
//! and a cancellation storm after which no pooled connection may be left inside a
//! transaction.

use crate::runners;

use idempotency_core::store::{Claim, ClaimRequest, RecordStatus};
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId,
    Refusal, Scope,
};
use idempotency_postgres::sqlx::{self, Connection, PgPool};
use idempotency_postgres::PostgresStore;
use idempotency_reliability::soak::{EngineRunner, Runner};
use idempotency_reliability::storm::{
    calibrate, cancellation_storm, next_calls_succeed, storm_keys_settle, StormSize,
};
use idempotency_testing::postgres::{self as pg, Isolation, SchemaGuard};
use rand::Rng;
use runners::postgres::PgTransactionalRunner;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HOUR: Duration = Duration::from_secs(3600);

fn app_name() -> String {
    format!("idem-reliab-{:016x}", rand::thread_rng().gen::<u64>())
}

/// A pool whose sessions carry `application_name = app`, to find them in
/// `pg_stat_activity`.
async fn app_pool(app: &str, size: u32) -> PgPool {
    pg::pool_with(
        pg::options().application_name(app),
        Isolation::ReadCommitted,
        size,
    )
    .await
}

fn store_on(pool: PgPool, guard: &SchemaGuard) -> PostgresStore {
    PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .build(pool)
        .expect("valid names")
}

/// Each storm: 1,500 calls, and on until more than 100 were cut off (the verdict below needs
/// it), whatever the machine's speed.
const STORM: StormSize = StormSize {
    calls: 1_500,
    min_interrupted: 101,
};

fn scope() -> Scope {
    Scope::new("reliability|faults").expect("scope")
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_bytes(b"the request")
}

/// Waits for a backend of `app` matching `condition` (SQL over pg_stat_activity) and returns
/// its pid.
async fn wait_for_backend(app: &str, condition: &str) -> i32 {
    let mut admin = pg::admin().await;
    let started = Instant::now();
    loop {
        let pid: Option<i32> = sqlx::query_scalar(&format!(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND {condition}"
        ))
        .bind(app)
        .fetch_optional(&mut admin)
        .await
        .expect("read pg_stat_activity");
        if let Some(pid) = pid {
            return pid;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no backend of {app} with {condition} within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn terminate(pid: i32, condition: &str) -> bool {
    let mut admin = pg::admin().await;
    sqlx::query_scalar::<_, bool>(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = $1 AND {condition}"
    ))
    .bind(pid)
    .fetch_optional(&mut admin)
    .await
    .expect("pg_terminate_backend")
    .unwrap_or(false)
}

/// The standalone `complete` is in flight (blocked on the record's row lock, held by another
/// session) when its backend is terminated: the caller gets `Error::OutcomeUnknown`, not a
/// plain backend error; the record is still Pending with the holder's token (never lost);
/// while the lease lives nobody else runs the work, and once it passes exactly one retry
/// runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminated_during_complete_is_outcome_unknown() {
    const KILLS: usize = 6;
    const LEASE: Duration = Duration::from_secs(2);
    let guard = SchemaGuard::new();
    let app = app_name();
    let store = store_on(app_pool(&app, 2).await, &guard);
    store.migrate().await.expect("migrate");
    let table = format!(r#""{}".records"#, guard.schema);
    let engine =
        Idempotency::new(Arc::new(store.clone()), Policy::default().lease(LEASE)).expect("engine");
    let runs = Arc::new(AtomicUsize::new(0));
    let run = |id: RecordId| {
        let (engine, runs) = (engine.clone(), runs.clone());
        async move {
            engine
                .run(&id.key, &id.scope, &fingerprint(), |ctx| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<u64, String>(ctx.token.0)
                })
                .await
        }
    };
    let mut ids = Vec::new();
    for _ in 0..KILLS {
        let id = RecordId::new(IdempotencyKey::random(), scope());
        let request = ClaimRequest::new(id.clone(), fingerprint(), LEASE, HOUR);
        let Claim::Claimed { token, .. } = store.claim(&request).await.expect("claim") else {
            panic!("a fresh key is claimed");
        };
        // Another session locks the row, so the completion waits on it, in flight.
        let mut locker = pg::admin().await;
        let mut tx = locker.begin().await.expect("begin");
        sqlx::query(&format!(
            "SELECT 1 FROM {table} WHERE scope = $1 AND key = $2 FOR UPDATE"
        ))
        .bind(id.scope.as_str())
        .bind(id.key.as_str())
        .execute(&mut *tx)
        .await
        .expect("lock the record");
        let complete = {
            let (store, id) = (store.clone(), id.clone());
            tokio::spawn(async move { store.complete(&id, token, b"{\"Ok\":1}", HOUR).await })
        };
        let pid = wait_for_backend(&app, "wait_event_type = 'Lock'").await;
        assert!(terminate(pid, "true").await, "terminate {pid}");
        let result = complete.await.expect("task");
        assert!(
            matches!(result, Err(Error::OutcomeUnknown { .. })),
            "a connection killed during complete must give OutcomeUnknown, got {result:?}"
        );
        assert!(result.expect_err("error").is_retryable());
        tx.rollback().await.expect("rollback");
        let record = store.get(&id).await.expect("get").expect("never lost");
        assert_eq!(record.status, RecordStatus::Pending, "{record:?}");
        assert_eq!(record.token, token, "the holder's token");
        assert_eq!(record.outcome, None);
        // While the lease lives nobody else may run the work.
        let early = run(id.clone()).await;
        assert!(
            matches!(early, Ok(Answer::Refused(Refusal::InProgress { .. }))),
            "the lease is live: {early:?}"
        );
        ids.push((id, token));
    }

    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    for (id, token) in &ids {
        let retry = run(id.clone()).await.expect("the retry runs");
        assert_eq!(retry, Answer::Executed(Ok(token.next().0)));
        let again = run(id.clone()).await.expect("replay");
        assert_eq!(again, Answer::Replayed(Ok(token.next().0)));
    }
    assert_eq!(runs.load(Ordering::SeqCst), KILLS, "one execution per key");
    eprintln!("terminated during complete: {KILLS} kills, {KILLS} OutcomeUnknown, records Pending with the holder's token, one retry each");
}

/// The commit of `run_in_transaction` is made slow (a deferred constraint trigger sleeps
/// 300 ms at COMMIT) and its backend is terminated at a random moment of it. The caller gets
/// `Error::OutcomeUnknown` whenever the kill lands; the key then holds either the Completed
/// record and its one business row, or (same token) a Pending or released record and no row;
/// a retry after the lease leaves exactly one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminated_during_transactional_commit_never_lost_never_twice() {
    const KILLS: usize = 8;
    const LEASE: Duration = Duration::from_secs(1);
    let guard = SchemaGuard::new();
    let setup = store_on(pg::pool(Isolation::ReadCommitted, 2).await, &guard);
    setup.migrate().await.expect("migrate");
    let s = &guard.schema;
    pg::exec(&format!(
        r#"CREATE TABLE "{s}".effects (id bigserial PRIMARY KEY, key text NOT NULL, token bigint NOT NULL);
           CREATE FUNCTION "{s}".slow_commit() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_sleep(0.3); RETURN NULL; END $$;
           CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON "{s}".effects
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION "{s}".slow_commit();"#
    ))
    .await;
    let effects: Arc<str> = format!(r#""{s}".effects"#).into();
    let cases: Vec<_> = (0..KILLS)
        .map(|_| {
            let (guard_schema, effects) = (guard.schema.clone(), effects.clone());
            tokio::spawn(async move { kill_commit_once(&guard_schema, effects, LEASE).await })
        })
        .collect();
    let mut tally = std::collections::BTreeMap::new();
    for c in cases {
        *tally.entry(c.await.expect("case")).or_insert(0) += 1;
    }
    eprintln!("terminated during the exactly-once commit ({KILLS} attempts): {tally:?}");
    assert!(
        tally.keys().any(|k| k.starts_with("killed")),
        "no kill landed during a commit: {tally:?}"
    );
}

async fn kill_commit_once(schema: &str, effects: Arc<str>, lease: Duration) -> String {
    let app = app_name();
    let store = PostgresStore::builder()
        .schema(schema)
        .table("records")
        .build(app_pool(&app, 2).await)
        .expect("valid names");
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default().lease(lease))
        .build()
        .expect("engine");
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    let killer = {
        let app = app.clone();
        tokio::spawn(async move {
            let pid = wait_for_backend(&app, "state = 'active' AND query = 'COMMIT'").await;
            let delay = rand::thread_rng().gen_range(0..400);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            terminate(pid, "state = 'active' AND query = 'COMMIT'").await
        })
    };
    let run = |effects: Arc<str>, key: IdempotencyKey| {
        let engine = engine.clone();
        async move {
            let k = key.clone();
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
                    let (effects, k) = (effects.clone(), k.clone());
                    Box::pin(async move {
                        Ok(async move {
                            sqlx::query(&format!(
                                "INSERT INTO {effects} (key, token) VALUES ($1, $2)"
                            ))
                            .bind(k.as_str())
                            .bind(i64::try_from(ctx.token.0).expect("small token"))
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| e.to_string())?;
                            Ok::<u64, String>(ctx.token.0)
                        }
                        .await)
                    })
                })
                .await
        }
    };
    let first = run(effects.clone(), key.clone()).await;
    let killed = killer.await.expect("killer");
    let rows = |token: Option<i64>| {
        let (effects, key) = (effects.clone(), key.clone());
        async move {
            let mut admin = pg::admin().await;
            let tokens: Vec<i64> = sqlx::query_scalar(&format!(
                "SELECT token FROM {effects} WHERE key = $1 ORDER BY id"
            ))
            .bind(key.as_str())
            .fetch_all(&mut admin)
            .await
            .expect("read effects");
            assert_eq!(
                tokens,
                token.into_iter().collect::<Vec<_>>(),
                "business rows"
            );
        }
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let record = store.get(&id).await.expect("get").expect("never lost");
    let held = i64::try_from(record.token.0).expect("small token");
    let outcome = match (&first, killed) {
        // The kill came too late: the commit had answered (the backend was past the point
        // where it could be interrupted, or had already replied).
        (Ok(Answer::Executed(Ok(t))), _) => {
            assert_eq!(
                (record.status, record.token.0),
                (RecordStatus::Completed, *t)
            );
            rows(Some(held)).await;
            "kill missed the commit: completed, one row".to_owned()
        }
        (Err(Error::OutcomeUnknown { .. }), true) => {
            // The holder's record: nobody else claimed the key, and the dropped lease holds
            // it Pending (nothing released) unless the commit completed it.
            assert_eq!(record.attempts, 1, "the holder's record: {record:?}");
            assert_ne!(record.status, RecordStatus::Failed, "{record:?}");
            if record.status == RecordStatus::Completed {
                rows(Some(held)).await;
                "killed: OutcomeUnknown, completed with one row".to_owned()
            } else {
                rows(None).await;
                format!("killed: OutcomeUnknown, {} with no row", record.status)
            }
        }
        other => panic!("a kill during the commit must give OutcomeUnknown: {other:?}"),
    };
    // A retry after the lease: exactly one row in the end.
    tokio::time::sleep(lease).await;
    let retry = run(effects.clone(), key.clone()).await.expect("the retry");
    let token = match retry {
        Answer::Executed(Ok(t)) | Answer::Replayed(Ok(t)) => t,
        other => panic!("{other:?}"),
    };
    rows(Some(i64::try_from(token).expect("small"))).await;
    outcome
}

/// Every call under a random 0–60 ms timeout (one in ten in an aborted task), through the
/// plain engine and through `run_in_transaction`, on one pool. Afterwards no session of the
/// pool is `idle in transaction`, every pooled connection runs a statement outside any
/// transaction, the next 1,000 calls succeed, and no key has more than its one business row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancellation_storm_leaves_no_connection_in_a_transaction() {
    const LEASE: Duration = Duration::from_millis(300);
    let guard = SchemaGuard::new();
    let app = app_name();
    let pool = app_pool(&app, 8).await;
    let store = store_on(pool.clone(), &guard);
    store.migrate().await.expect("migrate");
    let plain: Arc<dyn Runner> = Arc::new(EngineRunner::new(Arc::new(store.clone()), LEASE));
    let transactional =
        Arc::new(PgTransactionalRunner::new(store.clone(), &guard.schema, LEASE).await);
    let tx_runner: Arc<dyn Runner> = transactional.clone();
    let (plain_scope, tx_scope) = (
        Scope::new("storm|plain").expect("scope"),
        Scope::new("storm|tx").expect("scope"),
    );
    // Deadlines up to 60 ms or a few times the measured median call, whichever is shorter,
    // so an idle machine's fast calls are still cut at every stage.
    let calibration = Scope::new("storm|calibration").expect("scope");
    let median = calibrate(&plain, &calibration, 30)
        .await
        .max(calibrate(&tx_runner, &calibration, 30).await);
    let deadline = Duration::from_millis(60)
        .min(median * 4)
        .max(Duration::from_micros(200));
    let (a, b) = tokio::join!(
        cancellation_storm(plain.clone(), &plain_scope, 8, STORM, 40, deadline),
        cancellation_storm(tx_runner.clone(), &tx_scope, 8, STORM, 40, deadline),
    );
    eprintln!(
        "postgres storm: plain {} calls ({} interrupted), transactional {} calls ({} interrupted)",
        a.calls, a.interrupted, b.calls, b.interrupted
    );
    assert!(a.errors.is_empty(), "{:?}", a.errors);
    assert!(b.errors.is_empty(), "{:?}", b.errors);
    assert!(
        a.interrupted > 100 && b.interrupted > 100,
        "the storm hardly interrupted anything"
    );

    // Released connections are pinged back into the pool (which flushes a pending ROLLBACK).
    tokio::time::sleep(LEASE + Duration::from_millis(300)).await;
    let mut admin = pg::admin().await;
    let stuck: Vec<(i32, String, Option<String>)> = sqlx::query_as(
        "SELECT pid, state, query FROM pg_stat_activity \
         WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
    )
    .bind(&app)
    .fetch_all(&mut admin)
    .await
    .expect("pg_stat_activity");
    assert!(
        stuck.is_empty(),
        "sessions left inside a transaction: {stuck:?}"
    );
    let size = pool.size();
    let mut held = Vec::new();
    for _ in 0..size {
        held.push(
            tokio::time::timeout(Duration::from_secs(10), pool.acquire())
                .await
                .expect("acquire in time")
                .expect("acquire"),
        );
    }
    for conn in &mut held {
        // A simple-protocol statement outside any transaction is its own transaction: the
        // transaction's start is the statement's.
        let row = sqlx::raw_sql("SELECT now() = statement_timestamp()")
            .fetch_one(&mut **conn)
            .await
            .expect("a pooled connection runs a statement");
        let outside: bool = sqlx::Row::get(&row, 0);
        assert!(outside, "a pooled connection is inside a transaction");
    }
    drop(held);
    eprintln!("postgres storm: {size} pooled connections checked, none in a transaction");

    let failures = next_calls_succeed(
        tx_runner.clone(),
        &Scope::new("after|tx").expect("scope"),
        500,
        8,
    )
    .await;
    assert!(failures.is_empty(), "{failures:?}");
    let failures = next_calls_succeed(
        plain.clone(),
        &Scope::new("after|plain").expect("scope"),
        500,
        8,
    )
    .await;
    assert!(failures.is_empty(), "{failures:?}");
    assert!(storm_keys_settle(plain, &plain_scope, 40).await.is_empty());
    assert!(storm_keys_settle(tx_runner, &tx_scope, 40).await.is_empty());

    // Exactly once under cancellation: one business row per Completed key, none elsewhere.
    let rows = transactional.effects(&tx_scope).await.expect("effects");
    for i in 0..40 {
        let key = idempotency_reliability::storm::storm_key(i);
        let record = store
            .get(&RecordId::new(key.clone(), tx_scope.clone()))
            .await
            .expect("get")
            .expect("settled");
        assert_eq!(record.status, RecordStatus::Completed);
        let stored: Result<u64, String> =
            idempotency_core::protocol::decode_replay(&record).expect("decode");
        assert_eq!(
            rows.get(key.as_str()).cloned().unwrap_or_default(),
            vec![stored.expect("ok")],
            "{key}: one business row, the stored one"
        );
    }
}

/// Regression: `run_in_transaction` cancelled while its BEGIN is in flight must not leave the
/// pooled connection inside a transaction (sqlx 0.8's `Pool::begin` does when its own future
/// is dropped at that point; the soak found it as a pool frozen behind an `idle in
/// transaction` session). One connection, 400 calls under 0–3 ms timeouts, each followed by
/// a check that the connection is outside any transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_begin_leaves_no_transaction_open() {
    let guard = SchemaGuard::new();
    let pool = pg::pool(Isolation::ReadCommitted, 1).await;
    let store = store_on(pool.clone(), &guard);
    store.migrate().await.expect("migrate");
    let engine = Idempotency::builder(store)
        .policy(Policy::default())
        .build()
        .expect("engine");
    let mut in_transaction = 0;
    for i in 0..400u64 {
        let key = IdempotencyKey::random();
        let deadline = Duration::from_micros(rand::thread_rng().gen_range(0..3_000));
        let _ = tokio::time::timeout(
            deadline,
            engine.run_in_transaction(&key, &scope(), &fingerprint(), move |_tx, _ctx| {
                Box::pin(async move { Ok(async move { Ok::<u64, String>(i) }.await) })
            }),
        )
        .await;
        let row = sqlx::raw_sql("SELECT now() = statement_timestamp()")
            .fetch_one(&pool)
            .await
            .expect("the pooled connection runs a statement");
        if !sqlx::Row::get::<bool, _>(&row, 0) {
            in_transaction += 1;
            // Clean up so one leak does not count again.
            sqlx::raw_sql("ROLLBACK")
                .execute(&pool)
                .await
                .expect("rollback");
        }
    }
    assert_eq!(
        in_transaction, 0,
        "the pooled connection was left inside a transaction {in_transaction} times"
    );
}
