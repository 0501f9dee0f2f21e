//! PostgreSQL records: through the real store against the real server, any values in a
//! record's columns (NULLs, negative or zero tokens and counts, wrong-length fingerprints,
//! unknown statuses, half-set failures, infinite or far-off timestamps) make `get` and `claim`
//! answer a typed error or a record, never a panic.
//!
//! The table is the one `migrate()` creates in a schema of this process's own
//! (`idempotency_fuzz_<pid>`), with its CHECK and NOT NULL constraints dropped so that the
//! corrupt values can be stored. Needs the server at `$IDEMPOTENCY_TEST_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`); start it with `bash .ci/services`.
#![no_main]

use arbitrary::Arbitrary;
use idempotency_core::{Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope};
use idempotency_core::store::{Claim, ClaimRequest, RecordStatus};
use idempotency_core::protocol::decode_replay;
use idempotency_postgres::sqlx;
use idempotency_postgres::PostgresStore;
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
    Any(String),
}

/// A timestamp: NULL, ±infinity, or now plus an offset in milliseconds (which may be out of
/// PostgreSQL's range, in which case the row cannot be stored and the input is skipped).
#[derive(Debug, Arbitrary)]
enum Ts {
    Null,
    Infinity,
    MinusInfinity,
    Offset(i64),
    Near(i16),
}

impl Ts {
    fn get(&self) -> Option<String> {
        match self {
            Ts::Null => None,
            Ts::Infinity => Some("infinity".into()),
            Ts::MinusInfinity => Some("-infinity".into()),
            Ts::Offset(ms) => Some(ms.to_string()),
            Ts::Near(s) => Some((i64::from(*s) * 1000).to_string()),
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Row {
    fingerprint: Bytes,
    status: Status,
    token: Option<i64>,
    lease_until: Ts,
    outcome: Bytes,
    attempts: Option<i32>,
    failure_retryable: Option<bool>,
    failure_message: Option<String>,
    hits: Option<i64>,
    created_at: Ts,
    updated_at: Ts,
    expires_at: Ts,
    /// Also run a claim against the row.
    claim: bool,
}

struct State {
    runtime: tokio::runtime::Runtime,
    store: PostgresStore,
    table: String,
}

fn url() -> String {
    std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let schema = format!("idempotency_fuzz_{}", std::process::id());
        let table = format!(r#""{schema}".records"#);
        let store = runtime.block_on(async {
            let store = PostgresStore::builder()
                .schema(&schema)
                .table("records")
                .max_connections(2)
                .connect(&url())
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot reach PostgreSQL at {} ({e}); start it with `bash .ci/services`",
                        url()
                    )
                });
            // Schemas of earlier runs whose process is gone (libFuzzer exits without running
            // destructors), and one left by an earlier process with this pid.
            let schemas: Vec<String> = sqlx::query_scalar(
                "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'idempotency\\_fuzz\\_%'",
            )
            .fetch_all(store.pool())
            .await
            .expect("list schemas");
            for old in schemas {
                let pid = old.trim_start_matches("idempotency_fuzz_");
                let alive = pid != std::process::id().to_string()
                    && std::path::Path::new(&format!("/proc/{pid}")).exists();
                if !alive {
                    sqlx::raw_sql(&format!(r#"DROP SCHEMA IF EXISTS "{old}" CASCADE"#))
                        .execute(store.pool())
                        .await
                        .expect("drop a leftover schema");
                }
            }
            store.migrate().await.expect("migrate");
            let mut alter = format!(
                "ALTER TABLE {table} DROP CONSTRAINT records_status_check, \
                 DROP CONSTRAINT records_token_check, \
                 DROP CONSTRAINT idempotency_fingerprint_length, \
                 DROP CONSTRAINT idempotency_attempts_positive, \
                 DROP CONSTRAINT idempotency_hits_non_negative"
            );
            for col in [
                "fingerprint", "status", "token", "attempts", "hits", "created_at",
                "updated_at", "expires_at",
            ] {
                alter.push_str(&format!(", ALTER COLUMN {col} DROP NOT NULL"));
            }
            sqlx::raw_sql(&alter)
                .execute(store.pool())
                .await
                .expect("drop the constraints");
            store
        });
        State {
            runtime,
            store,
            table,
        }
    })
}

fn ts(n: usize) -> String {
    format!(
        "(CASE WHEN ${n}::text IS NULL THEN NULL \
              WHEN ${n}::text IN ('infinity', '-infinity') THEN ${n}::text::timestamptz \
              ELSE now() + (${n}::text || ' milliseconds')::interval END)"
    )
}

fuzz_target!(|row: Row| {
    let s = state();
    let id = RecordId::new(
        IdempotencyKey::new("k").expect("valid key"),
        Scope::new("fuzz").expect("valid scope"),
    );
    let status = match &row.status {
        Status::Null => None,
        Status::Known(n) => {
            Some(["pending", "completed", "failed"][usize::from(*n) % 3].to_owned())
        }
        // PostgreSQL text cannot hold NUL.
        Status::Any(t) => Some(t.replace('\0', "")),
    };
    let insert = format!(
        "INSERT INTO {t} AS r (scope, key, fingerprint, status, token, lease_until, outcome,
             attempts, failure_retryable, failure_message, hits, created_at, updated_at, expires_at)
         VALUES ('fuzz', 'k', $1, $2, $3, {lease}, $5, $6, $7, $8, $9, {ca}, {ua}, {exp})
         ON CONFLICT (scope, key) DO UPDATE SET
             (fingerprint, status, token, lease_until, outcome, attempts, failure_retryable,
              failure_message, hits, created_at, updated_at, expires_at) =
             (excluded.fingerprint, excluded.status, excluded.token, excluded.lease_until,
              excluded.outcome, excluded.attempts, excluded.failure_retryable,
              excluded.failure_message, excluded.hits, excluded.created_at,
              excluded.updated_at, excluded.expires_at)",
        t = s.table,
        lease = ts(4),
        ca = ts(10),
        ua = ts(11),
        exp = ts(12),
    );
    s.runtime.block_on(async {
        let stored = sqlx::query(&insert)
            .bind(row.fingerprint.get())
            .bind(status)
            .bind(row.token)
            .bind(row.lease_until.get())
            .bind(row.outcome.get())
            .bind(row.attempts)
            .bind(row.failure_retryable)
            .bind(row.failure_message.as_ref().map(|m| m.replace('\0', "")))
            .bind(row.hits)
            .bind(row.created_at.get())
            .bind(row.updated_at.get())
            .bind(row.expires_at.get())
            .execute(s.store.pool())
            .await;
        if stored.is_err() {
            // A timestamp out of PostgreSQL's range: nothing was stored.
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
