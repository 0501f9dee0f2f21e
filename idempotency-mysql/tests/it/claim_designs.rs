//! The claim's design, measured: claim-or-observe must insert a record or find the live one
//! and return it, atomically. Four ways on MariaDB, each timed over the same new-key claims on
//! one connection and counted on the wire:
//!
//! 1. `INSERT … ON DUPLICATE KEY UPDATE … RETURNING` (the store's claim): one statement.
//! 2. a stored procedure doing the upsert and the read in its own transaction: one `CALL`.
//! 3. the upsert, then a `SELECT`: two statements, and not atomic (the record may change in
//!    between).
//! 4. `INSERT IGNORE` and a `SELECT` in one transaction: BEGIN, INSERT, SELECT, COMMIT.
//!
//! The store uses the first: as few round trips as the procedure, without a routine to
//! create, grant and migrate beside the table. The figures are printed (`--nocapture`); the
//! round trips are asserted.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::proxy::CountingProxy;
use common::{Isolation, TableGuard};
use idempotency_core::store::{Claim, ClaimRequest};
use idempotency_core::{Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope};
use idempotency_mysql::sqlx::mysql::MySqlSslMode;
use idempotency_mysql::sqlx::{self, Executor, MySqlPool};
use idempotency_mysql::MySqlStore;
use std::time::{Duration, Instant};

const ROUNDS: usize = 300;

const COLUMNS: &str = "scope, idem_key, fingerprint, status, token, claim_nonce, revision, \
    lease_until_ms, outcome, attempts, failure_retryable, failure_message, hits, created_ms, \
    updated_ms, expires_ms";

const NOW: &str =
    "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)";

fn values() -> String {
    format!(
        "VALUES (?, ?, ?, 'pending', {NOW} * 1000, 1, 0, {NOW} + 60000, NULL, 1, NULL, NULL, 0, \
         {NOW}, {NOW}, {NOW} + 3600000)"
    )
}

fn upsert(t: &str) -> String {
    format!(
        "INSERT INTO {t} ({COLUMNS}) {} ON DUPLICATE KEY UPDATE hits = hits + 1",
        values()
    )
}

fn select(t: &str) -> String {
    format!(
        "SELECT fingerprint, status, token, hits, expires_ms FROM {t} \
         WHERE scope = ? AND idem_key = ?"
    )
}

#[derive(Clone, Copy, Debug)]
enum Design {
    OneStatement,
    Procedure,
    UpsertThenSelect,
    InsertIgnoreInTransaction,
}

async fn claim_once(
    design: Design,
    store: &MySqlStore,
    pool: &MySqlPool,
    t: &str,
    proc_name: &str,
) {
    let key = IdempotencyKey::random();
    let scope = b"designs".as_slice();
    let fp = [7u8; 32];
    match design {
        Design::OneStatement => {
            let req = ClaimRequest::new(
                RecordId::new(key, Scope::new("designs").unwrap()),
                Fingerprint::from_bytes(b"x"),
                Duration::from_secs(60),
                Duration::from_secs(3600),
            );
            assert!(matches!(
                store.claim(&req).await.unwrap(),
                Claim::Claimed { .. }
            ));
        }
        Design::Procedure => {
            let row: (Vec<u8>, i64) = sqlx::query_as(&format!("CALL {proc_name}(?, ?, ?)"))
                .bind(scope)
                .bind(key.as_str().as_bytes())
                .bind(&fp[..])
                .fetch_one(pool)
                .await
                .unwrap();
            assert_eq!(row.0.len(), 32);
        }
        Design::UpsertThenSelect => {
            let mut conn = pool.acquire().await.unwrap();
            sqlx::query(&upsert(t))
                .bind(scope)
                .bind(key.as_str().as_bytes())
                .bind(&fp[..])
                .execute(&mut *conn)
                .await
                .unwrap();
            sqlx::query(&select(t))
                .bind(scope)
                .bind(key.as_str().as_bytes())
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        }
        Design::InsertIgnoreInTransaction => {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(&format!("INSERT IGNORE INTO {t} ({COLUMNS}) {}", values()))
                .bind(scope)
                .bind(key.as_str().as_bytes())
                .bind(&fp[..])
                .execute(&mut *tx)
                .await
                .unwrap();
            sqlx::query(&select(t))
                .bind(scope)
                .bind(key.as_str().as_bytes())
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_designs_compared() {
    let guard = TableGuard::new();
    let t = format!("`{}`", guard.table);
    let proc_name = format!("`{}_claim`", guard.table);
    let options = common::options();
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = CountingProxy::start(upstream).await.unwrap();
    let counted = common::pool_with(
        options
            .clone()
            .host("127.0.0.1")
            .port(proxy.port())
            .ssl_mode(MySqlSslMode::Disabled),
        Isolation::RepeatableRead,
        1,
    )
    .await;
    let direct = common::pool(Isolation::RepeatableRead, 1).await;
    let store = MySqlStore::builder()
        .table(&guard.table)
        .build(direct.clone())
        .unwrap();
    store.migrate().await.unwrap();
    let counted_store = MySqlStore::builder()
        .table(&guard.table)
        .build(counted.clone())
        .unwrap();
    direct
        .execute(
            format!(
                "CREATE PROCEDURE {proc_name}(IN p_scope VARBINARY(1024), IN p_key VARBINARY(255),
                     IN p_fp VARBINARY(64))
                 BEGIN
                     DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
                     START TRANSACTION;
                     INSERT INTO {t} ({COLUMNS})
                     VALUES (p_scope, p_key, p_fp, 'pending', {NOW} * 1000, 1, 0, {NOW} + 60000,
                             NULL, 1, NULL, NULL, 0, {NOW}, {NOW}, {NOW} + 3600000)
                     ON DUPLICATE KEY UPDATE hits = hits + 1;
                     SELECT fingerprint, token FROM {t} WHERE scope = p_scope AND idem_key = p_key;
                     COMMIT;
                 END"
            )
            .as_str(),
        )
        .await
        .unwrap();

    let designs = [
        (Design::OneStatement, 1),
        (Design::Procedure, 1),
        (Design::UpsertThenSelect, 2),
        (Design::InsertIgnoreInTransaction, 4),
    ];
    eprintln!(
        "\n{:<28} round trips  mean µs (direct, {ROUNDS} new keys)",
        "design"
    );
    for (design, expected) in designs {
        // Warm (prepare) and count on the proxied pool.
        claim_once(design, &counted_store, &counted, &t, &proc_name).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        let before = proxy.snapshot();
        claim_once(design, &counted_store, &counted, &t, &proc_name).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        let counts = proxy.snapshot() - before;
        assert_eq!(counts.round_trips(), expected, "{design:?}: {counts:?}");
        // Time on a direct connection.
        claim_once(design, &store, &direct, &t, &proc_name).await;
        let start = Instant::now();
        for _ in 0..ROUNDS {
            claim_once(design, &store, &direct, &t, &proc_name).await;
        }
        let mean = start.elapsed().as_micros() / ROUNDS as u128;
        eprintln!(
            "{:<28} {:>11}  {mean:>7}",
            format!("{design:?}"),
            counts.round_trips()
        );
    }
    direct
        .execute(format!("DROP PROCEDURE IF EXISTS {proc_name}").as_str())
        .await
        .unwrap();
}
