//! Behaviour beyond the kit that this store's design answers for: compare-and-swaps whose
//! rewrite changes nothing are still reported applied, lock waits and deadlocks are retried
//! inside the store, a lost connection makes a holder's write's outcome unknown while reads
//! and claims are sent again, and the session time zone does not move any timestamp.
#![allow(clippy::unwrap_used)]

use crate::common;
use idempotency_core::Idempotency;

use common::proxy::CountingProxy;
use common::{Isolation, TableGuard};
use idempotency_core::store::{
    Cas, Claim, ClaimRequest, Failure, Reclaim, RecordStatus, Timestamp,
};
use idempotency_core::{Error, Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope};
use idempotency_mysql::sqlx::mysql::{MySqlPoolOptions, MySqlSslMode};
use idempotency_mysql::sqlx::{self, Connection, Executor};
use idempotency_mysql::{MySqlError, MySqlStore};
use std::time::{Duration, Instant};

fn request(lease: Duration) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new(IdempotencyKey::random(), Scope::new("behavior").unwrap()),
        Fingerprint::from_bytes(b"payload"),
        lease,
        Duration::from_secs(3600),
    )
}

async fn revision(store: &MySqlStore, id: &RecordId) -> i64 {
    let mut conn = common::admin().await;
    let rev = sqlx::query_scalar(&format!(
        "SELECT revision FROM {} WHERE scope = ? AND idem_key = ?",
        store.table_name().quoted()
    ))
    .bind(id.scope.as_str().as_bytes())
    .bind(id.key.as_str().as_bytes())
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let _ = conn.close().await;
    rev
}

/// An extend that writes the very values the record already holds (same lease, same
/// millisecond) still matched the record: it is reported applied, every time, because every
/// compare-and-swap also moves `revision` (MySQL counts changed rows unless the client asks
/// for found rows; sqlx does ask, and the store does not rely on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_rewrites_are_reported_applied() {
    let (store, _guard) = common::store(Isolation::RepeatableRead).await;
    // A lease of 0 ms: every extend writes lease_until = now, and in the same millisecond
    // exactly what the previous one wrote.
    let req = request(Duration::ZERO);
    let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
        panic!("fresh key")
    };
    // Keep it live with a long retention, then extend with a zero lease over and over.
    let before = revision(&store, &req.id).await;
    for i in 0..200 {
        assert_eq!(
            store.extend(&req.id, token, Duration::ZERO).await.unwrap(),
            Cas::Applied,
            "extend {i} matched the record"
        );
    }
    assert_eq!(revision(&store, &req.id).await, before + 200);
    // The same failure twice: the second is fenced (the record is no longer Pending), not
    // "applied" because nothing changed.
    assert_eq!(
        store
            .fail(&req.id, token, &Failure::retryable("x"), req.ttl)
            .await
            .unwrap(),
        Cas::Applied
    );
    assert_eq!(
        store
            .fail(&req.id, token, &Failure::retryable("x"), req.ttl)
            .await
            .unwrap(),
        Cas::Fenced
    );
}

/// Holds the record row locked from another connection for `hold`.
async fn lock_row_for(
    store: &MySqlStore,
    id: &RecordId,
    hold: Duration,
) -> tokio::task::JoinHandle<()> {
    let table = store.table_name().quoted();
    let id = id.clone();
    let locked = std::sync::Arc::new(tokio::sync::Notify::new());
    let signal = locked.clone();
    let task = tokio::spawn(async move {
        let mut conn = common::admin().await;
        let mut tx = conn.begin().await.unwrap();
        sqlx::query(&format!(
            "SELECT token FROM {table} WHERE scope = ? AND idem_key = ? FOR UPDATE"
        ))
        .bind(id.scope.as_str().as_bytes())
        .bind(id.key.as_str().as_bytes())
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        signal.notify_one();
        tokio::time::sleep(hold).await;
        tx.commit().await.unwrap();
    });
    locked.notified().await;
    task
}

/// A lock wait timeout (1205) rolls back only the statement: the store runs it again, and
/// the caller sees the answer; with no retries left it is a retryable backend error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_wait_timeouts_are_retried_inside_the_store() {
    let guard = TableGuard::new();
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION innodb_lock_wait_timeout = 1")
                    .await?;
                Ok(())
            })
        })
        .connect_with(common::options())
        .await
        .unwrap();
    let store = MySqlStore::builder()
        .table(&guard.table)
        .build(pool.clone())
        .unwrap();
    store.migrate().await.unwrap();
    let req = request(Duration::from_secs(60));
    let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
        panic!()
    };
    let holder = lock_row_for(&store, &req.id, Duration::from_millis(1600)).await;
    let started = Instant::now();
    assert_eq!(
        store.extend(&req.id, token, req.lease).await.unwrap(),
        Cas::Applied
    );
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "it waited for the lock"
    );
    holder.await.unwrap();

    let impatient = MySqlStore::builder()
        .table(&guard.table)
        .conflict_retries(0)
        .build(pool)
        .unwrap();
    let holder = lock_row_for(&store, &req.id, Duration::from_millis(1600)).await;
    match impatient.extend(&req.id, token, req.lease).await {
        Err(e @ Error::Backend { .. }) => {
            assert!(e.is_retryable(), "{e:?}");
            assert!(MySqlError::find(&e).is_none());
        }
        other => panic!("expected a retryable backend error, got {other:?}"),
    }
    holder.await.unwrap();
}

/// A store whose single pooled connection goes through a proxy that can cut it.
async fn cuttable() -> (MySqlStore, CountingProxy, TableGuard) {
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
    (store, proxy, guard)
}

/// A holder's compare-and-swap whose connection is lost after the statement was sent:
/// `OutcomeUnknown` (it may have applied), never `Fenced` nor a plain error. Reads and claims
/// are sent again on another connection and answer normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_connections_mid_statement() {
    let (store, proxy, _guard) = cuttable().await;
    let req = request(Duration::from_secs(60));
    let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
        panic!()
    };
    // Prepare every statement on the connection first.
    store.get(&req.id).await.unwrap();
    store.extend(&req.id, token, req.lease).await.unwrap();

    for op in ["complete", "fail", "extend", "reclaim"] {
        let req = request(Duration::from_secs(60));
        let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
            panic!()
        };
        if op == "reclaim" {
            store
                .fail(&req.id, token, &Failure::retryable("x"), req.ttl)
                .await
                .unwrap();
        }
        store
            .complete(&req.id, idempotency_core::FencingToken(1), b"warm", req.ttl)
            .await
            .unwrap();
        let _ = store
            .reclaim(
                &req.id,
                idempotency_core::FencingToken(1),
                &req.fingerprint,
                req.lease,
                req.ttl,
            )
            .await
            .unwrap();
        let _ = store
            .fail(
                &req.id,
                idempotency_core::FencingToken(1),
                &Failure::retryable("w"),
                req.ttl,
            )
            .await
            .unwrap();
        proxy.cut_next_execute();
        let result = match op {
            "complete" => store
                .complete(&req.id, token, b"done", req.ttl)
                .await
                .map(|_| ()),
            "fail" => store
                .fail(&req.id, token, &Failure::retryable("x"), req.ttl)
                .await
                .map(|_| ()),
            "extend" => store.extend(&req.id, token, req.lease).await.map(|_| ()),
            _ => store
                .reclaim(&req.id, token, &req.fingerprint, req.lease, req.ttl)
                .await
                .map(|_| ()),
        };
        assert!(
            matches!(result, Err(Error::OutcomeUnknown { .. })),
            "{op} on a lost connection: expected OutcomeUnknown, got {result:?}"
        );
        // The statement reached the server: it applied, as the next read shows.
        let record = store.get(&req.id).await.unwrap().unwrap();
        let applied = match op {
            "complete" => record.status == RecordStatus::Completed,
            "fail" => record.status == RecordStatus::Failed,
            "extend" => record.status == RecordStatus::Pending,
            _ => record.token == token.next(),
        };
        assert!(applied, "{op}: {record:?}");
    }

    // A read is sent again.
    proxy.cut_next_execute();
    assert!(store.get(&req.id).await.unwrap().is_some());
    // A claim of a new key is sent again: the repeat finds the record its first send wrote
    // (same nonce) and answers Claimed, counting no hit, rather than leaving a Pending record
    // that nobody holds.
    let fresh = request(Duration::from_secs(60));
    proxy.cut_next_execute();
    let before = proxy.snapshot();
    let Claim::Claimed { token, lease_until } = store.claim(&fresh).await.unwrap() else {
        panic!("the resent claim is this caller's")
    };
    let sent = proxy.snapshot() - before;
    assert_eq!(sent.get("stmt_execute"), 2, "sent twice: {sent:?}");
    let first_applied: i64 = {
        use idempotency_mysql::sqlx::Connection;
        let mut conn = common::admin().await;
        let n = sqlx::query_scalar(&format!(
            "SELECT revision FROM {} WHERE idem_key = ?",
            store.table_name().quoted()
        ))
        .bind(fresh.id.key.as_str().as_bytes())
        .fetch_one(&mut conn)
        .await
        .unwrap();
        let _ = conn.close().await;
        n
    };
    assert_eq!(first_applied, 0, "one insert, nothing replaced");
    let record = store.get(&fresh.id).await.unwrap().unwrap();
    assert_eq!(
        (record.token, record.lease_until),
        (token, Some(lease_until))
    );
    assert_eq!(record.hits, 0);
    assert_eq!(
        store
            .complete(&fresh.id, token, b"1", fresh.ttl)
            .await
            .unwrap(),
        Cas::Applied
    );
}

/// A claim whose answer was lost is sent again on a new connection; if, meanwhile, its lease
/// passed and another caller reclaimed the record, the resent claim must not take the record
/// for its own (the reclaimer holds it, with a token of its own): it finds a live record held
/// by someone else. Before the fix the reclaim left the first claim's nonce in place, and the
/// resent claim answered `Claimed` with the reclaimer's token: two holders, one token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_claim_never_takes_over_a_reclaimed_record() {
    let (store, proxy, guard) = cuttable().await;
    // Another application instance, on its own pool straight to the server.
    let (other, _other_guard) = common::store_with(Isolation::RepeatableRead, 2).await;
    let other = MySqlStore::builder()
        .table(&guard.table)
        .build(other.pool().clone())
        .unwrap();
    // Prepare the claim statement on the cuttable connection first.
    let warm = request(Duration::from_secs(60));
    store.claim(&warm).await.unwrap();

    let req = request(Duration::from_millis(300));
    proxy.cut_next_execute();
    proxy.hold_new_connections();
    let first = {
        let store = store.clone();
        let req = req.clone();
        tokio::spawn(async move { store.claim(&req).await })
    };
    // The first send applied: the record is there, held by a claim nobody was told of.
    let deadline = Instant::now() + Duration::from_secs(60);
    let lost = loop {
        if let Some(record) = other.get(&req.id).await.unwrap() {
            break record;
        }
        assert!(Instant::now() < deadline, "the first send never applied");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Once its lease passed, the other instance reclaims it.
    let reclaimed = loop {
        match other
            .reclaim(
                &req.id,
                lost.token,
                &req.fingerprint,
                Duration::from_secs(60),
                req.ttl,
            )
            .await
            .unwrap()
        {
            Reclaim::Reclaimed { token, .. } => break token,
            Reclaim::Lost => {
                assert!(Instant::now() < deadline, "the lease never passed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(reclaimed, lost.token.next());
    // Now the resent claim reaches the server.
    proxy.release_connections();
    let resent = first.await.unwrap().unwrap();
    assert!(
        !matches!(resent, Claim::Claimed { .. }),
        "the resent claim took over the reclaimed record: {resent:?} (the reclaimer holds token {reclaimed:?})"
    );
    let record = other.get(&req.id).await.unwrap().unwrap();
    assert_eq!(
        (record.status, record.token),
        (RecordStatus::Pending, reclaimed)
    );
    assert_eq!(
        other
            .complete(&req.id, reclaimed, b"done", req.ttl)
            .await
            .unwrap(),
        Cas::Applied
    );
}

/// A claim whose answer was lost and whose resend arrives after its own lease passed (the
/// reconnect took longer), with nobody else about: the resend must not start the work on a
/// lease that has passed, which anyone may take over at once. It answers the record as it
/// finds it (Pending, lease passed), and the caller reclaims it with a fresh lease. Before
/// the fix it answered `Claimed` with the passed lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_resent_after_its_lease_passed_is_not_claimed() {
    let (store, proxy, _guard) = cuttable().await;
    let warm = request(Duration::from_secs(60));
    store.claim(&warm).await.unwrap();

    let req = request(Duration::from_millis(300));
    proxy.cut_next_execute();
    proxy.hold_new_connections();
    let first = {
        let (store, req) = (store.clone(), req.clone());
        tokio::spawn(async move { store.claim(&req).await })
    };
    // Wait, on the server's clock, until the first send's lease has passed.
    let (observer, _observer_guard) = common::store_with(Isolation::RepeatableRead, 2).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut conn = common::admin().await;
        let passed: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT CAST(lease_until_ms <= CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', \
             UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED) AS SIGNED) FROM {} WHERE idem_key = ?",
            store.table_name().quoted()
        ))
        .bind(req.id.key.as_str().as_bytes())
        .fetch_optional(&mut conn)
        .await
        .unwrap();
        let _ = conn.close().await;
        if passed == Some(1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the first send's lease never passed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(observer);
    proxy.release_connections();
    match first.await.unwrap().unwrap() {
        Claim::Existing { record, now } => {
            assert_eq!(record.status, RecordStatus::Pending);
            assert!(
                record.lease_until.is_some_and(|l| l <= now),
                "the record's lease had passed: {record:?} at {now:?}"
            );
            // The caller takes it over with a fresh lease and the next token.
            match store
                .reclaim(&req.id, record.token, &req.fingerprint, req.lease, req.ttl)
                .await
                .unwrap()
            {
                Reclaim::Reclaimed { token, .. } => assert_eq!(token, record.token.next()),
                Reclaim::Lost => panic!("the reclaim of a passed lease was lost"),
            }
        }
        other => panic!("a claim resent after its lease passed answered {other:?}"),
    }
}

/// Timestamps come from `UTC_TIMESTAMP(6)` as milliseconds since the epoch: a session in
/// another time zone stores and reads the same instants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_time_zone_moves_nothing() {
    let guard = TableGuard::new();
    let mut stores = Vec::new();
    for zone in ["+00:00", "+09:30", "-11:00"] {
        let set = format!("SET time_zone = '{zone}'");
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .after_connect(move |conn, _| {
                let set = set.clone();
                Box::pin(async move {
                    conn.execute(set.as_str()).await?;
                    Ok(())
                })
            })
            .connect_with(common::options())
            .await
            .unwrap();
        let store = MySqlStore::builder()
            .table(&guard.table)
            .build(pool)
            .unwrap();
        store.migrate().await.unwrap();
        stores.push(store);
    }
    for store in &stores {
        let req = request(Duration::from_secs(60));
        let before = Timestamp::now();
        let Claim::Claimed { lease_until, .. } = store.claim(&req).await.unwrap() else {
            panic!()
        };
        let after = Timestamp::now();
        for other in &stores {
            let record = other.get(&req.id).await.unwrap().unwrap();
            assert_eq!(record.lease_until, Some(lease_until));
            // The server runs on this machine: its clock agrees with ours within a second.
            assert!(
                record.created_at.as_millis() >= before.as_millis() - 1000
                    && record.created_at.as_millis() <= after.as_millis() + 1000,
                "created_at {:?} outside [{before:?}, {after:?}]",
                record.created_at
            );
        }
    }
}

/// Every idle connection of the pool dies at once (as after a server restart; here each is
/// killed with `KILL`): the first operation to meet one has the idle ones checked and the
/// dead ones closed, so at most one holder's write is reported `OutcomeUnknown`, reads and
/// claims are answered, and an exactly-once transaction begins on a live connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_idle_connections_are_swept() {
    const POOL: u32 = 6;
    let (store, _guard) = common::store_with(Isolation::RepeatableRead, POOL).await;
    for _round in 0..3 {
        // Records held, to be completed after the "restart".
        let mut held = Vec::new();
        for _ in 0..POOL {
            let req = request(Duration::from_secs(60));
            let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
                panic!("fresh key")
            };
            held.push((req, token));
        }
        // Fill the pool: every connection out at once, each telling its id.
        let mut conns = Vec::new();
        for _ in 0..POOL {
            conns.push(store.pool().acquire().await.unwrap());
        }
        let mut ids = Vec::new();
        for conn in &mut conns {
            let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                .fetch_one(&mut **conn)
                .await
                .unwrap();
            ids.push(id);
        }
        drop(conns);
        // Let the pool take them back (it pings each as it does).
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.pool().num_idle() < POOL as usize {
            assert!(
                Instant::now() < deadline,
                "the pool never got its connections back"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut admin = common::admin().await;
        for id in &ids {
            admin.execute(format!("KILL {id}").as_str()).await.unwrap();
        }
        let _ = admin.close().await;

        // The holders' completions first: without the sweep each would meet a dead
        // connection and be reported unknown.
        let mut unknown = 0;
        for (req, token) in &held {
            match store.complete(&req.id, *token, b"1", req.ttl).await {
                Ok(Cas::Applied) => {}
                Err(Error::OutcomeUnknown { .. }) => unknown += 1,
                other => panic!("complete after the restart: {other:?}"),
            }
        }
        for (req, _) in &held {
            assert!(store.get(&req.id).await.unwrap().is_some());
        }
        let req = request(Duration::from_secs(60));
        assert!(matches!(
            store.claim(&req).await.unwrap(),
            Claim::Claimed { .. }
        ));
        assert!(unknown <= 1, "{unknown} writes met a dead connection");
    }
}

/// Calls cancelled at every point of their statements (calls under 0–3 ms timeouts, claims,
/// completions and reads, on a pool of 2, until 40 were cut off, at most 20,000) give their
/// connections back: a moment later every pooled connection can be taken at once, and the
/// store answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_calls_give_their_connections_back() {
    const POOL: u32 = 2;
    let (store, _guard) = common::store_with(Isolation::RepeatableRead, POOL).await;
    let mut cut = 0;
    let mut i = 0u64;
    while cut < 40 {
        assert!(i < 20_000, "only {cut} of {i} calls were cut off");
        i += 1;
        let req = request(Duration::from_secs(60));
        let deadline = Duration::from_micros(rand_micros(i));
        let store2 = store.clone();
        let call = async move {
            let claim = store2.claim(&req).await?;
            if let Claim::Claimed { token, .. } = claim {
                store2.complete(&req.id, token, b"1", req.ttl).await?;
            }
            store2.get(&req.id).await.map(|_| ())
        };
        if tokio::time::timeout(deadline, call).await.is_err() {
            cut += 1;
        }
    }
    every_connection_comes_back(&store, POOL, cut).await;
    let req = request(Duration::from_secs(60));
    assert!(matches!(
        store.claim(&req).await.unwrap(),
        Claim::Claimed { .. }
    ));
}

/// Every one of the pool's `size` connections can be taken at once within 20 s of `cut`
/// cancelled calls.
async fn every_connection_comes_back(store: &MySqlStore, size: u32, cut: u32) {
    let started = Instant::now();
    let mut held = Vec::new();
    while held.len() < size as usize {
        match tokio::time::timeout(Duration::from_millis(100), store.pool().acquire()).await {
            Ok(conn) => held.push(conn.unwrap()),
            Err(_) => assert!(
                started.elapsed() < Duration::from_secs(20),
                "{} of {size} connections came back within 20 s of {cut} cancelled calls \
                 (size {}, idle {})",
                held.len(),
                store.pool().size(),
                store.pool().num_idle()
            ),
        }
    }
}

/// A spread of deadlines from 0 to 3 ms, without a random number generator.
fn rand_micros(i: u64) -> u64 {
    (i.wrapping_mul(2_654_435_761) >> 7) % 3_000
}

/// As [`cancelled_calls_give_their_connections_back`], through `run_in_transaction` (0–6 ms
/// timeouts, until 40 were cut off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_transactions_give_their_connections_back() {
    const POOL: u32 = 2;
    let (store, _guard) = common::store_with(Isolation::RepeatableRead, POOL).await;
    let engine = Idempotency::builder(store.clone())
        .policy(idempotency_core::Policy::default().lease(Duration::from_millis(300)))
        .build()
        .unwrap();
    let scope = Scope::new("behavior").unwrap();
    let fp = Fingerprint::from_bytes(b"payload");
    let mut cut = 0;
    let mut i = 0u64;
    while cut < 40 {
        assert!(i < 20_000, "only {cut} of {i} calls were cut off");
        i += 1;
        let key = IdempotencyKey::random();
        let deadline = Duration::from_micros(rand_micros(i) * 2);
        let call = engine.run_in_transaction(&key, &scope, &fp, |tx, _ctx| {
            Box::pin(async move {
                Ok(async move {
                    sqlx::query("SELECT 1")
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok::<u64, String>(1)
                }
                .await)
            })
        });
        if tokio::time::timeout(deadline, call).await.is_err() {
            cut += 1;
        }
    }
    every_connection_comes_back(&store, POOL, cut).await;
}

/// A call cancelled while its connection reads an answer, between a packet's header and its
/// payload, must not cost the pool that connection: sqlx 0.8's MySQL driver has consumed the
/// header by then, so the connection, handed back and checked by the pool, reads the payload
/// as the next header and waits for good for bytes the server never sends. The store closes
/// a connection whose statement was abandoned instead of handing it back. Each round: a pool
/// of one warm connection, a claim cut off while its answer is split after the header, then
/// the pool must hand out a working connection within 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_cancelled_mid_answer_loses_no_connection() {
    let opts = common::options();
    let upstream = format!("{}:{}", opts.get_host(), opts.get_port());
    let guard = TableGuard::new();
    let setup = MySqlStore::builder()
        .table(&guard.table)
        .build(common::pool(Isolation::RepeatableRead, 1).await)
        .unwrap();
    setup.migrate().await.unwrap();
    for round in 0..4 {
        let proxy = CountingProxy::start(upstream.clone()).await.unwrap();
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_with(
                common::options()
                    .host("127.0.0.1")
                    .port(proxy.port())
                    .ssl_mode(MySqlSslMode::Disabled),
            )
            .await
            .unwrap();
        let store = MySqlStore::builder()
            .table(&guard.table)
            .build(pool.clone())
            .unwrap();
        // Warm: the claim statement is prepared on the pool's one connection.
        store
            .claim(&request(Duration::from_secs(60)))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.num_idle() < 1 {
            assert!(Instant::now() < deadline, "the connection never went idle");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        proxy.split_next_reply();
        let req = request(Duration::from_secs(60));
        let cut = tokio::time::timeout(Duration::from_millis(300), store.claim(&req)).await;
        assert!(
            cut.is_err(),
            "round {round}: the claim answered from half a packet"
        );
        proxy.release_split();
        let conn = tokio::time::timeout(Duration::from_secs(10), pool.acquire()).await;
        assert!(
            conn.is_ok(),
            "round {round}: the pool got no connection back within 10 s of a call cancelled \
             mid-answer (size {}, idle {})",
            pool.size(),
            pool.num_idle()
        );
        drop(conn);
        // The cut claim may have applied: claim again (new key) and read it back.
        let req = request(Duration::from_secs(60));
        let claim = tokio::time::timeout(Duration::from_secs(10), store.claim(&req))
            .await
            .unwrap_or_else(|_| panic!("round {round}: the next claim hung"));
        assert!(matches!(claim, Ok(Claim::Claimed { .. })), "{claim:?}");
    }
}
