//! Round trips per operation, counted on the wire.
//!
//! `pg_stat_statements` is not loaded on every server, so the store talks to PostgreSQL
//! through a loopback proxy that parses the frontend protocol and counts what the client sends:
//! every `Sync` (extended protocol) or `Query` (simple protocol) is one round trip, because the
//! client then waits for `ReadyForQuery`. A `Sync` with nothing before it is sqlx's pool
//! pinging a connection as it is released (a background task, off the caller's path); it is
//! counted apart. `Parse` messages show whether statements were prepared again.
//!
//! Each case runs twice: on a pool of the caller's (`build(pool)`, each operation takes a
//! connection from the pool and gives it back, so sqlx pings it), and on the store's own pool
//! with `keep_connections(true)` (`connect`; connections kept between operations: no ping at
//! all).
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{Isolation, SchemaGuard};
use futures::future::BoxFuture;
use idempotency_core::protocol::Begin;
use idempotency_core::store::{Claim, ClaimRequest, Failure, Settlement};
use idempotency_core::{
    Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId, Scope,
    WorkContext,
};
use idempotency_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use idempotency_postgres::sqlx::{self, Executor};
use idempotency_postgres::PostgresStore;
use idempotency_testing::pg_wire::{CountingProxy, Counts};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

struct Rig {
    store: PostgresStore,
    proxy: CountingProxy,
    /// The store's own pool, keeping connections between operations (`keep_connections`).
    own: bool,
    _guard: SchemaGuard,
}

/// Which pool the store runs on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PoolKind {
    /// The caller's pool of one connection, passed to `build`.
    User,
    /// The pool `connect` builds, of two connections (one to spare, so the store keeps the
    /// connection it uses: with none to spare it would hand it back to the pool every 100 ms).
    Own,
}

/// A migrated store whose pooled connections go through the counting proxy.
async fn rig(kind: PoolKind) -> Rig {
    let (direct, guard) = common::store(Isolation::ReadCommitted).await;
    drop(direct);
    let options = PgConnectOptions::from_str(&common::url()).unwrap();
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = CountingProxy::start(upstream).await.unwrap();
    let port = proxy.port();
    let builder = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records");
    let store = match kind {
        PoolKind::User => {
            let options = options
                .host("127.0.0.1")
                .port(port)
                .ssl_mode(PgSslMode::Disable);
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .test_before_acquire(false)
                .connect_with(options)
                .await
                .unwrap();
            builder.build(pool).unwrap()
        }
        PoolKind::Own => builder
            .max_connections(2)
            .keep_connections(true)
            .connect(&common::url_with(Some(port), "sslmode=disable"))
            .await
            .unwrap(),
    };
    Rig {
        store,
        proxy,
        own: kind == PoolKind::Own,
        _guard: guard,
    }
}

impl Rig {
    /// Runs `op` and returns what it sent, once the pool's background release has settled.
    async fn count<F: std::future::Future>(&self, op: F) -> (F::Output, Counts) {
        // A pooled connection's release ping is sent in the background: let it land. A kept
        // connection sends none, and a long pause would let the store hand it back to the
        // pool (after 100 ms unused), whose ping would then be counted: keep the pause short.
        let settle = Duration::from_millis(if self.own { 2 } else { 30 });
        tokio::time::sleep(settle).await;
        let before = self.proxy.snapshot();
        let out = op.await;
        tokio::time::sleep(settle).await;
        (out, self.proxy.snapshot() - before)
    }
}

fn request(key: &IdempotencyKey) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new(key.clone(), Scope::new("rt").unwrap()),
        Fingerprint::from_bytes(b"payload"),
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
}

/// Every store operation once, so each statement is prepared on the connection.
/// A settlement completing each claimed key of `batch`.
fn completing(
    batch: &[ClaimRequest],
    answers: Vec<Result<Claim, idempotency_core::Error>>,
) -> Vec<Settlement> {
    batch
        .iter()
        .zip(answers)
        .map(|(req, answer)| match answer.unwrap() {
            Claim::Claimed { token, .. } => {
                Settlement::complete(req.id.clone(), token, b"outcome".to_vec(), req.ttl)
            }
            other => panic!("a new key of the batch was not claimed: {other:?}"),
        })
        .collect()
}

async fn warm_up(store: &PostgresStore) {
    let req = request(&IdempotencyKey::random());
    let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
        panic!()
    };
    store.extend(&req.id, token, req.lease).await.unwrap();
    store.get(&req.id).await.unwrap();
    store
        .fail(&req.id, token, &Failure::retryable("x"), req.ttl)
        .await
        .unwrap();
    store
        .reclaim(&req.id, token, &req.fingerprint, req.lease, req.ttl)
        .await
        .unwrap();
    store
        .complete(&req.id, token.next(), b"1", req.ttl)
        .await
        .unwrap();
    store.claim(&req).await.unwrap();
    let uncounted = req.clone().with_count_hit(false);
    store.claim(&uncounted).await.unwrap();
    store.purge_expired(10).await.unwrap();
    let batch: Vec<ClaimRequest> = (0..2).map(|_| request(&IdempotencyKey::random())).collect();
    let settlements = completing(&batch, store.claim_many(&batch).await);
    store.settle_many(&settlements).await;
    let uncounted_batch: Vec<ClaimRequest> = batch
        .iter()
        .map(|r| r.clone().with_count_hit(false))
        .collect();
    store.claim_many(&uncounted_batch).await;
    let mut tx = store.pool().begin().await.unwrap();
    let _ = store
        .complete_in(&mut tx, &req.id, token, b"1", req.ttl)
        .await;
    tx.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_round_trip_per_operation() {
    round_trips(PoolKind::User).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_round_trip_per_operation_and_no_release_ping_on_the_stores_own_pool() {
    round_trips(PoolKind::Own).await;
}

async fn round_trips(kind: PoolKind) {
    let rig = rig(kind).await;
    let store = &rig.store;
    let mut table = Vec::new();

    // A fresh connection prepares each statement once (Parse + Describe, then execute).
    let key = IdempotencyKey::random();
    let (_, first) = rig.count(store.claim(&request(&key))).await;
    table.push(("claim, first use on a connection", first));
    assert_eq!(first.parses, 1, "the claim is prepared once: {first:?}");

    warm_up(store).await;

    let key = IdempotencyKey::random();
    let req = request(&key);
    let (claimed, claim) = rig.count(store.claim(&req)).await;
    let Claim::Claimed { token, .. } = claimed.unwrap() else {
        panic!("fresh key")
    };
    table.push(("claim (new key)", claim));
    let (_, extend) = rig.count(store.extend(&req.id, token, req.lease)).await;
    table.push(("extend", extend));
    let (_, complete) = rig
        .count(store.complete(&req.id, token, b"outcome", req.ttl))
        .await;
    table.push(("complete", complete));
    let (seen, replay) = rig.count(store.claim(&req)).await;
    assert!(matches!(seen.unwrap(), Claim::Existing { .. }));
    table.push(("claim (replay of a completed key)", replay));
    let uncounted = req.clone().with_count_hit(false);
    let (seen, replay) = rig.count(store.claim(&uncounted)).await;
    assert!(matches!(seen.unwrap(), Claim::Existing { .. }));
    table.push(("claim, hit not counted (replay)", replay));
    let (_, get) = rig.count(store.get(&req.id)).await;
    table.push(("get", get));

    let req2 = request(&IdempotencyKey::random());
    let Claim::Claimed { token: t2, .. } = store.claim(&req2).await.unwrap() else {
        panic!()
    };
    let (_, fail) = rig
        .count(store.fail(&req2.id, t2, &Failure::retryable("boom"), req2.ttl))
        .await;
    table.push(("fail", fail));
    let (_, reclaim) = rig
        .count(store.reclaim(&req2.id, t2, &req2.fingerprint, req2.lease, req2.ttl))
        .await;
    table.push(("reclaim", reclaim));
    let (_, purge) = rig.count(store.purge_expired(100)).await;
    table.push(("purge_expired (one batch)", purge));

    // A queue consumer's batch of 100 new keys: one statement to claim them all, one to
    // settle them all, one to replay them all.
    let batch: Vec<ClaimRequest> = (0..100)
        .map(|_| request(&IdempotencyKey::random()))
        .collect();
    let (answers, claim_many) = rig.count(store.claim_many(&batch)).await;
    let settlements = completing(&batch, answers);
    table.push(("claim_many, 100 new keys", claim_many));
    let (settled, settle_many) = rig.count(store.settle_many(&settlements)).await;
    assert!(settled
        .into_iter()
        .all(|cas| cas.unwrap() == idempotency_core::store::Cas::Applied));
    table.push(("settle_many, 100 completions", settle_many));
    let uncounted_batch: Vec<ClaimRequest> = batch
        .iter()
        .map(|r| r.clone().with_count_hit(false))
        .collect();
    let (replays, replay_many) = rig.count(store.claim_many(&uncounted_batch)).await;
    assert!(replays
        .into_iter()
        .all(|a| matches!(a.unwrap(), Claim::Existing { .. })));
    table.push(("claim_many, 100 replays (hits not counted)", replay_many));

    for (op, counts) in &table[1..] {
        assert_eq!(
            counts.round_trips(),
            1,
            "{op}: exactly one round trip, got {counts:?}"
        );
        assert_eq!(counts.parses, 0, "{op}: prepared statement reused");
        if rig.own {
            assert_eq!(
                counts.bare_syncs, 0,
                "{op}: the store keeps its connection, so the pool never pings it: {counts:?}"
            );
        } else {
            assert!(
                counts.bare_syncs <= 1,
                "{op}: at most the pool's release ping"
            );
        }
    }

    // A key named twice in one batch is claimed by its first request, found by its second:
    // one more statement.
    let mut twice: Vec<ClaimRequest> = (0..10)
        .map(|_| request(&IdempotencyKey::random()))
        .collect();
    twice.push(twice[3].clone());
    let (answers, dup) = rig.count(store.claim_many(&twice)).await;
    let answers: Vec<Claim> = answers.into_iter().map(Result::unwrap).collect();
    assert!(answers[..10]
        .iter()
        .all(|a| matches!(a, Claim::Claimed { .. })));
    assert!(matches!(answers[10], Claim::Existing { .. }), "{answers:?}");
    table.push(("claim_many, 10 new keys and one of them again", dup));
    assert_eq!(dup.round_trips(), 2, "{dup:?}");
    assert_eq!(dup.parses, 0, "{dup:?}");

    // Through the engine: a new key costs claim + complete, a replay one claim.
    let engine =
        Idempotency::new(Arc::new(store.clone()), Policy::default().heartbeat(None)).unwrap();
    let (key, scope, fp) = (
        IdempotencyKey::random(),
        Scope::new("rt").unwrap(),
        Fingerprint::from_bytes(b"p"),
    );
    let (_, run) = rig
        .count(engine.run(&key, &scope, &fp, |_| async { Ok::<_, String>(7) }))
        .await;
    table.push(("engine run, new key (claim + complete)", run));
    assert_eq!(run.round_trips(), 2, "{run:?}");
    let (out, replayed) = rig
        .count(engine.run(&key, &scope, &fp, |_| async { Ok::<_, String>(8) }))
        .await;
    assert!(out.unwrap().is_replayed());
    table.push(("engine run, replay (claim)", replayed));
    assert_eq!(replayed.round_trips(), 1, "{replayed:?}");
    if rig.own {
        assert_eq!(
            run.bare_syncs + replayed.bare_syncs,
            0,
            "{run:?} {replayed:?}"
        );
    }

    // Inside the caller's transaction the completion adds exactly one round trip:
    // BEGIN + complete_in + COMMIT.
    let id = RecordId::new(IdempotencyKey::random(), scope.clone());
    let Begin::Execute(lease) = engine.begin(&id, &fp).await.unwrap() else {
        panic!()
    };
    let (_, in_tx) = rig
        .count(async {
            let mut tx = store.pool().begin().await.unwrap();
            store
                .complete_in(&mut tx, lease.id(), lease.token(), b"1", lease.retention())
                .await
                .unwrap();
            tx.commit().await.unwrap();
        })
        .await;
    lease.settled_externally();
    table.push(("BEGIN + complete_in + COMMIT", in_tx));
    assert_eq!(in_tx.statement_syncs, 1, "{in_tx:?}");
    assert_eq!(in_tx.round_trips(), 3, "{in_tx:?}");

    // The transactional engine with a one-insert work: claim, BEGIN, insert, complete_in,
    // COMMIT.
    let pg_engine = Idempotency::builder(store.clone())
        .policy(Policy::default().heartbeat(None))
        .build()
        .unwrap();
    let orders = format!(r#""{}".orders"#, rig._guard.schema);
    common::exec(&format!("CREATE TABLE {orders} (id bigserial PRIMARY KEY)")).await;
    let insert: Arc<str> = format!("INSERT INTO {orders} DEFAULT VALUES").into();
    let work = insert_work;
    // Prepare the insert once.
    let warm_key = IdempotencyKey::random();
    let _warmed = pg_engine
        .run_in_transaction(&warm_key, &scope, &fp, work(insert.clone()))
        .await
        .unwrap();
    let key = IdempotencyKey::random();
    let (_, txn) = rig
        .count(pg_engine.run_in_transaction(&key, &scope, &fp, work(insert.clone())))
        .await;
    table.push((
        "run_in_transaction, new key (claim, BEGIN, insert, CAS, COMMIT)",
        txn,
    ));
    assert_eq!(txn.round_trips(), 5, "{txn:?}");
    let (_, txn_replay) = rig
        .count(pg_engine.run_in_transaction(&key, &scope, &fp, work(insert.clone())))
        .await;
    table.push(("run_in_transaction, replay", txn_replay));
    assert_eq!(txn_replay.round_trips(), 1, "{txn_replay:?}");

    eprintln!("\n{:<66} round trips  (release pings)  parses", "operation");
    for (op, c) in &table {
        eprintln!(
            "{op:<66} {:>11}  {:>15}  {:>6}",
            c.round_trips(),
            c.bare_syncs,
            c.parses
        );
    }
}

/// Work that inserts one row through the transaction it is given.
fn insert_work(
    insert: Arc<str>,
) -> impl for<'c> FnMut(
    &'c mut sqlx::PgConnection,
    WorkContext,
) -> BoxFuture<'c, Result<Result<i32, String>, sqlx::Error>>
       + Send {
    move |tx, _ctx| {
        let insert = insert.clone();
        Box::pin(async move {
            tx.execute(sqlx::query(&insert)).await?;
            Ok(Ok(1))
        })
    }
}
