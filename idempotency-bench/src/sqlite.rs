//! The SQLite backend, in both connection modes, and its raw baseline: `INSERT OR IGNORE` then
//! `UPDATE`, and a primary-key `SELECT` for replay, sent through the store's own connection
//! executor (same thread or pool, same pragmas).

use crate::harness::{Backend, RawBaseline};
use crate::harness::{Filled, Kind, Prepared, Scaling};
use async_trait::async_trait;
use idempotency_core::store::BoxError;
use idempotency_sqlite::{ConnectionMode, SqliteStore};
use std::sync::Arc;

pub(crate) struct RawSqlite {
    store: SqliteStore,
}

#[async_trait]
impl RawBaseline for RawSqlite {
    async fn new_key_cycle(&self, key: &str, outcome: &[u8]) -> Result<(), BoxError> {
        let (key, outcome) = (key.to_owned(), outcome.to_vec());
        self.store
            .call(move |conn| -> Result<(), rusqlite::Error> {
                let inserted = conn
                    .prepare_cached(
                        "INSERT OR IGNORE INTO raw_idempotency (key, status) VALUES (?1, 'pending')",
                    )?
                    .execute([&key])?;
                if inserted == 1 {
                    conn.prepare_cached(
                        "UPDATE raw_idempotency SET status = 'completed', outcome = ?2 WHERE key = ?1",
                    )?
                    .execute(rusqlite::params![key, outcome])?;
                }
                Ok(())
            })
            .await??;
        Ok(())
    }

    async fn replay(&self, key: &str) -> Result<Option<Vec<u8>>, BoxError> {
        let key = key.to_owned();
        let out = self
            .store
            .call(move |conn| -> Result<Option<Vec<u8>>, rusqlite::Error> {
                let mut stmt =
                    conn.prepare_cached("SELECT outcome FROM raw_idempotency WHERE key = ?1")?;
                let mut rows = stmt.query([&key])?;
                match rows.next()? {
                    Some(row) => Ok(row.get(0)?),
                    None => Ok(None),
                }
            })
            .await??;
        Ok(out)
    }
}

/// Opens a store (and the raw table beside it) in a fresh temporary directory.
pub(crate) async fn open(
    mode: ConnectionMode,
) -> Result<(SqliteStore, tempfile::TempDir), BoxError> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::builder(dir.path().join("bench.db"))
        .mode(mode)
        .open()
        .await?;
    store.migrate().await?;
    store
        .call(|conn| {
            conn.execute_batch(
                "CREATE TABLE IF NOT EXISTS raw_idempotency (
                     key TEXT PRIMARY KEY, status TEXT NOT NULL, outcome BLOB)",
            )
        })
        .await??;
    Ok((store, dir))
}

pub(crate) async fn backend(
    name: &'static str,
    mode: ConnectionMode,
) -> Result<(Backend, tempfile::TempDir), BoxError> {
    let (store, dir) = open(mode).await?;
    Ok((
        Backend {
            name,
            store: Arc::new(store.clone()),
            raw: Arc::new(RawSqlite { store }),
            round_trips: None,
            limit: None,
        },
        dir,
    ))
}

/// Fills the store's table with `n` completed records in one transaction (test data setup,
/// not a measured path), keyed as the harness's `key("fill", 0, i)`.
pub(crate) async fn fill(
    store: &SqliteStore,
    n: usize,
    outcome: &'static [u8],
) -> Result<(), BoxError> {
    let table = store.table().to_owned();
    let scope = crate::harness::scope().as_str().to_owned();
    let fp = crate::harness::fingerprint();
    store
        .call(move |conn| -> Result<(), rusqlite::Error> {
            let tx = conn.transaction()?;
            {
                let mut stmt = tx.prepare(&format!(
                    r#"INSERT INTO "{table}" (scope, key, fingerprint, status, token, lease_until,
                        outcome, attempts, failure_retryable, failure_message, hits, created_at,
                        updated_at, expires_at)
                       VALUES (?1, ?2, ?3, 'completed', 1, NULL, ?4, 1, NULL, NULL, 0, 0, 0, ?5)"#
                ))?;
                for i in 0..n {
                    let key = crate::harness::key("fill", 0, i);
                    stmt.execute(rusqlite::params![
                        scope,
                        key.as_str(),
                        fp.as_bytes().as_slice(),
                        outcome,
                        i64::MAX
                    ])?;
                }
            }
            tx.commit()
        })
        .await??;
    Ok(())
}

/// SQLite in the bench: on its dedicated thread and on a blocking pool of 4.
pub(crate) const KIND: Kind = Kind {
    name: "sqlite",
    make: |_| Box::pin(both_modes()),
    scaling: Some(Scaling {
        max_keys: usize::MAX,
        filled: |n| Box::pin(filled(n)),
        in_process_memory: false,
    }),
};

async fn both_modes() -> Result<Vec<Prepared>, BoxError> {
    let (thread, d1) =
        backend("sqlite (dedicated thread)", ConnectionMode::DedicatedThread).await?;
    let (pool, d2) = backend(
        "sqlite (spawn_blocking pool of 4)",
        ConnectionMode::BlockingPool { connections: 4 },
    )
    .await?;
    Ok(vec![(thread, Box::new(d1)), (pool, Box::new(d2))])
}

/// A store on its dedicated thread holding `n` completed records.
async fn filled(n: usize) -> Result<Filled, BoxError> {
    let (store, dir) = open(ConnectionMode::DedicatedThread).await?;
    fill(&store, n, crate::harness::engine_outcome()).await?;
    Ok((Arc::new(store), Box::new(dir)))
}
