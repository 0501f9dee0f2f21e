//! How many WAL flushes a replay costs, measured with `pg_stat_wal` (PostgreSQL 14+).
//!
//! ```sh
//! cargo run -p idempotency-postgres --example replay_wal
//! ```
//! Uses `IDEMPOTENCY_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and
//! a scratch schema that it drops afterwards. Other sessions writing to the same server add
//! their own flushes to the counts.

use idempotency_core::{Fingerprint, Idempotency, IdempotencyKey, Policy, Scope};
use idempotency_postgres::sqlx::{self, Executor};
use idempotency_postgres::PostgresStore;
use std::sync::Arc;

const N: usize = 500;

async fn wal_syncs(store: &PostgresStore) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT wal_sync FROM pg_stat_wal")
        .fetch_one(store.pool())
        .await
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let schema = format!("idem_wal_{}", std::process::id());
    let store = PostgresStore::builder()
        .schema(&schema)
        .max_connections(1)
        .connect(&url)
        .await?;
    store.migrate().await?;
    let engine = Idempotency::new(Arc::new(store.clone()), Policy::default().heartbeat(None))?;
    let scope = Scope::new("wal")?;
    let fp = Fingerprint::from_bytes(b"payload");
    let keys: Vec<IdempotencyKey> = (0..N).map(|_| IdempotencyKey::random()).collect();

    let before = wal_syncs(&store).await?;
    for key in &keys {
        let _ = engine
            .run(key, &scope, &fp, |_| async { Ok::<_, String>(1) })
            .await?;
    }
    let after_new = wal_syncs(&store).await?;
    for key in &keys {
        let out = engine
            .run(key, &scope, &fp, |_| async { Ok::<_, String>(2) })
            .await?;
        assert!(out.is_replayed());
    }
    let after_replay = wal_syncs(&store).await?;
    println!(
        "new key (claim + complete): {:.2} WAL flushes per call",
        (after_new - before) as f64 / N as f64
    );
    println!(
        "replay (claim, hit counted): {:.2} WAL flushes per call",
        (after_replay - after_new) as f64 / N as f64
    );
    store
        .pool()
        .execute(format!(r#"DROP SCHEMA "{schema}" CASCADE"#).as_str())
        .await?;
    Ok(())
}
