//! Round trips per operation, counted on the wire.
//!
//! The store talks to the server through a loopback proxy that reads the client's MySQL
//! packets and counts commands (a packet with sequence id 0 starts one): every command but
//! `COM_STMT_CLOSE` and `COM_QUIT` waits for the server's answer, so each is one round trip.
//! sqlx's pool pings a connection as it takes it back (`COM_PING`, in a background task, off
//! the caller's path): counted apart. `COM_STMT_PREPARE` shows whether statements were
//! prepared again.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::proxy::{CountingProxy, Counts};
use common::{Isolation, TableGuard};
use futures::future::BoxFuture;
use idempotency_core::protocol::Begin;
use idempotency_core::store::{Claim, ClaimRequest, Failure};
use idempotency_core::{
    Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId, Scope,
    WorkContext,
};
use idempotency_mysql::sqlx::mysql::MySqlSslMode;
use idempotency_mysql::sqlx::{self, Executor};
use idempotency_mysql::MySqlStore;
use std::sync::Arc;
use std::time::Duration;

pub(crate) struct Rig {
    pub(crate) store: MySqlStore,
    pub(crate) proxy: CountingProxy,
    pub(crate) _guard: TableGuard,
}

/// A migrated store on a pool of one connection that goes through the counting proxy.
pub(crate) async fn rig() -> Rig {
    let guard = TableGuard::new();
    let options = common::options();
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = CountingProxy::start(upstream).await.unwrap();
    let options = options
        .host("127.0.0.1")
        .port(proxy.port())
        .ssl_mode(MySqlSslMode::Disabled);
    let pool = common::pool_with(options, Isolation::RepeatableRead, 1).await;
    let store = MySqlStore::builder()
        .table(&guard.table)
        .build(pool)
        .unwrap();
    store.migrate().await.unwrap();
    Rig {
        store,
        proxy,
        _guard: guard,
    }
}

impl Rig {
    /// Runs `op` and returns what it sent, once the pool's background release has settled.
    pub(crate) async fn count<F: std::future::Future>(&self, op: F) -> (F::Output, Counts) {
        let settle = Duration::from_millis(30);
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
async fn warm_up(store: &MySqlStore) {
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
    store.purge_expired(10).await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let _ = store
        .complete_in(&mut tx, &req.id, token, b"1", req.ttl)
        .await;
    tx.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_round_trip_per_operation() {
    let rig = rig().await;
    let store = &rig.store;
    let mut table = Vec::new();

    // A fresh statement is prepared once on its connection, then executed.
    let key = IdempotencyKey::random();
    let (_, first) = rig.count(store.claim(&request(&key))).await;
    table.push(("claim, first use on a connection", first.clone()));
    assert_eq!(first.get("stmt_prepare"), 1, "{first:?}");

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

    for (op, counts) in &table[1..] {
        assert_eq!(
            counts.round_trips(),
            1,
            "{op}: exactly one round trip, got {counts:?}"
        );
        assert_eq!(counts.get("stmt_execute"), 1, "{op}: {counts:?}");
        assert_eq!(
            counts.get("stmt_prepare"),
            0,
            "{op}: prepared statement reused"
        );
        assert!(
            counts.get("ping") <= 1,
            "{op}: at most the pool's release ping"
        );
    }

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
    table.push(("engine run, new key (claim + complete)", run.clone()));
    assert_eq!(run.round_trips(), 2, "{run:?}");
    let (out, replayed) = rig
        .count(engine.run(&key, &scope, &fp, |_| async { Ok::<_, String>(8) }))
        .await;
    assert!(out.unwrap().is_replayed());
    table.push(("engine run, replay (claim)", replayed.clone()));
    assert_eq!(replayed.round_trips(), 1, "{replayed:?}");

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
    table.push(("BEGIN + complete_in + COMMIT", in_tx.clone()));
    assert_eq!(in_tx.get("stmt_execute"), 1, "{in_tx:?}");
    assert_eq!(in_tx.round_trips(), 3, "{in_tx:?}");

    // The transactional engine with a one-insert work: claim, BEGIN, insert, complete_in,
    // COMMIT.
    let my_engine = Idempotency::builder(store.clone())
        .policy(Policy::default().heartbeat(None))
        .build()
        .unwrap();
    let orders_guard = TableGuard::new();
    let orders = format!("`{}`", orders_guard.table);
    common::exec(&format!(
        "CREATE TABLE {orders} (id BIGINT AUTO_INCREMENT PRIMARY KEY) ENGINE = InnoDB"
    ))
    .await;
    let insert: Arc<str> = format!("INSERT INTO {orders} () VALUES ()").into();
    let _warmed = my_engine
        .run_in_transaction(
            &IdempotencyKey::random(),
            &scope,
            &fp,
            insert_work(insert.clone()),
        )
        .await
        .unwrap();
    let key = IdempotencyKey::random();
    let (_, txn) = rig
        .count(my_engine.run_in_transaction(&key, &scope, &fp, insert_work(insert.clone())))
        .await;
    table.push((
        "run_in_transaction, new key (claim, BEGIN, insert, CAS, COMMIT)",
        txn.clone(),
    ));
    assert_eq!(txn.round_trips(), 5, "{txn:?}");
    let (_, txn_replay) = rig
        .count(my_engine.run_in_transaction(&key, &scope, &fp, insert_work(insert.clone())))
        .await;
    table.push(("run_in_transaction, replay", txn_replay.clone()));
    assert_eq!(txn_replay.round_trips(), 1, "{txn_replay:?}");

    eprintln!(
        "\n{:<66} round trips  (release pings)  prepares",
        "operation"
    );
    for (op, c) in &table {
        eprintln!(
            "{op:<66} {:>11}  {:>15}  {:>8}",
            c.round_trips(),
            c.get("ping"),
            c.get("stmt_prepare")
        );
    }
    drop(orders_guard);
}

/// Work that inserts one row through the transaction it is given.
fn insert_work(
    insert: Arc<str>,
) -> impl for<'c> FnMut(
    &'c mut sqlx::MySqlConnection,
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
