//! MySQL/MariaDB records: through the real store against the real server, any values in a
//! record's columns (NULLs, negative or zero tokens and counts, wrong-length fingerprints,
//! unknown statuses, bytes that are not UTF-8, half-set failures, far-off timestamps) make
//! `get` and `claim` answer a typed error or a record, never a panic.
//!
//! The table is the one `migrate()` creates (`idempotency_fuzz_<pid>`), with its CHECK and
//! NOT NULL constraints dropped so that the corrupt values can be stored. Needs the server at
//! `$MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); start it with
//! `bash .ci/services`.
#![no_main]

use arbitrary::Arbitrary;
use idempotency_core::{Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope};
use idempotency_core::store::{Claim, ClaimRequest, RecordStatus};
use idempotency_core::protocol::decode_replay;
use idempotency_mysql::sqlx;
use idempotency_mysql::MySqlStore;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use std::time::Duration;

#[derive(Debug, Arbitrary)]
enum Bytes {
    Null,
    Digest([u8; 32]),
    Any(Vec<u8>),
}

impl Bytes {
    fn get(&self) -> Option<Vec<u8>> {
        match self {
            Bytes::Null => None,
            Bytes::Digest(d) => Some(d.to_vec()),
            Bytes::Any(b) => Some(b.clone()),
        }
    }
}

#[derive(Debug, Arbitrary)]
enum Status {
    Null,
    Known(u8),
    Any(Vec<u8>),
}

/// Milliseconds since the epoch: NULL, the extremes, or the server's now plus an offset.
#[derive(Debug, Arbitrary)]
enum Ms {
    Null,
    Min,
    Max,
    Offset(i32),
    Raw(i64),
}

#[derive(Debug, Arbitrary)]
struct Row {
    fingerprint: Bytes,
    status: Status,
    token: Option<i64>,
    lease_until: Ms,
    outcome: Bytes,
    attempts: Option<i32>,
    failure_retryable: Option<i8>,
    failure_message: Option<Vec<u8>>,
    hits: Option<i64>,
    created: Ms,
    updated: Ms,
    expires: Ms,
    /// Also run a claim against the row.
    claim: bool,
}

struct State {
    runtime: tokio::runtime::Runtime,
    store: MySqlStore,
    table: String,
    now_ms: i64,
}

fn url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let name = format!("idempotency_fuzz_{}", std::process::id());
        let table = format!("`{name}`");
        let (store, now_ms) = runtime.block_on(async {
            let store = MySqlStore::builder()
                .table(&name)
                .max_connections(2)
                .connect(&url())
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot reach MySQL/MariaDB at {} ({e}); start it with `bash .ci/services`",
                        url()
                    )
                });
            // Tables of earlier runs whose process is gone (libFuzzer exits without running
            // destructors), and one left by an earlier process with this pid.
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'idempotency\\_fuzz\\_%'",
            )
            .fetch_all(store.pool())
            .await
            .expect("list tables");
            for old in tables {
                let pid = old.trim_start_matches("idempotency_fuzz_");
                let alive = pid != std::process::id().to_string()
                    && std::path::Path::new(&format!("/proc/{pid}")).exists();
                if !alive {
                    sqlx::raw_sql(&format!("DROP TABLE IF EXISTS `{old}`"))
                        .execute(store.pool())
                        .await
                        .expect("drop a leftover table");
                }
            }
            store.migrate().await.expect("migrate");
            let mut alter = format!(
                "ALTER TABLE {table} DROP CONSTRAINT status_valid, \
                 DROP CONSTRAINT token_positive, DROP CONSTRAINT fingerprint_length, \
                 DROP CONSTRAINT attempts_positive, DROP CONSTRAINT hits_non_negative"
            );
            for (col, ty) in [
                ("fingerprint", "VARBINARY(64)"),
                ("status", "VARBINARY(64)"),
                ("token", "BIGINT"),
                ("claim_nonce", "BIGINT"),
                ("attempts", "INT"),
                ("hits", "BIGINT"),
                ("created_ms", "BIGINT"),
                ("updated_ms", "BIGINT"),
                ("expires_ms", "BIGINT"),
            ] {
                alter.push_str(&format!(", MODIFY {col} {ty} NULL"));
            }
            alter.push_str(", MODIFY failure_message BLOB NULL");
            sqlx::raw_sql(&alter)
                .execute(store.pool())
                .await
                .expect("drop the constraints");
            let now_ms: i64 = sqlx::query_scalar(
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) \
                 DIV 1000 AS SIGNED)",
            )
            .fetch_one(store.pool())
            .await
            .expect("the server's clock");
            (store, now_ms)
        });
        State {
            runtime,
            store,
            table,
            now_ms,
        }
    })
}

impl Ms {
    fn get(&self, now: i64) -> Option<i64> {
        match self {
            Ms::Null => None,
            Ms::Min => Some(i64::MIN),
            Ms::Max => Some(i64::MAX),
            Ms::Offset(o) => Some(now.saturating_add(i64::from(*o))),
            Ms::Raw(v) => Some(*v),
        }
    }
}

fuzz_target!(|row: Row| {
    let s = state();
    let id = RecordId::new(
        IdempotencyKey::new("k").expect("valid key"),
        Scope::new("fuzz").expect("valid scope"),
    );
    let status = match &row.status {
        Status::Null => None,
        Status::Known(n) => Some(
            ["pending", "completed", "failed"][usize::from(*n) % 3]
                .as_bytes()
                .to_vec(),
        ),
        Status::Any(t) => Some(t.clone()),
    };
    let now = s.now_ms;
    let insert = format!(
        "REPLACE INTO {t} (scope, idem_key, fingerprint, status, token, claim_nonce, revision,
             lease_until_ms, outcome, attempts, failure_retryable, failure_message, hits,
             created_ms, updated_ms, expires_ms)
         VALUES ('fuzz', 'k', ?, ?, ?, 0, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        t = s.table,
    );
    s.runtime.block_on(async {
        let stored = sqlx::query(&insert)
            .bind(row.fingerprint.get())
            .bind(status)
            .bind(row.token)
            .bind(row.lease_until.get(now))
            .bind(row.outcome.get())
            .bind(row.attempts)
            .bind(row.failure_retryable)
            .bind(row.failure_message.clone())
            .bind(row.hits)
            .bind(row.created.get(now))
            .bind(row.updated.get(now))
            .bind(row.expires.get(now))
            .execute(s.store.pool())
            .await;
        if stored.is_err() {
            // A value the column cannot hold: nothing was stored.
            return;
        }
        if let Ok(Some(record)) = s.store.get(&id).await {
            assert_eq!(record.id, id);
            assert!(record.token.0 >= 1, "{record:?}");
            if record.status == RecordStatus::Completed {
                assert!(record.outcome.is_some(), "{record:?}");
                let _ = decode_replay::<serde_json::Value>(&record);
            }
        }
        if row.claim {
            let request = ClaimRequest::new(
                id.clone(),
                Fingerprint::from_bytes(b"fuzz"),
                Duration::from_secs(30),
                Duration::from_secs(60),
            );
            if let Ok(Claim::Existing { record, .. }) = s.store.claim(&request).await {
                assert!(record.token.0 >= 1, "{record:?}");
            }
        }
    });
});
