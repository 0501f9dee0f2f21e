//! Shared test support: the server URL, isolated schemas that drop themselves, pools at a
//! given isolation level.
#![allow(dead_code)]

use idempotency_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use idempotency_postgres::sqlx::{self, Connection, Executor, PgConnection, PgPool};
use idempotency_postgres::PostgresStore;
use std::str::FromStr;
use std::time::Duration;

/// The server the tests use: `IDEMPOTENCY_TEST_POSTGRES_URL`, or the local default.
pub fn url() -> String {
    std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn unreachable(e: impl std::fmt::Display) -> ! {
    panic!(
        "cannot reach PostgreSQL at {} ({e}).\n\
         Start it with `bash .ci/services` (PostgreSQL on 127.0.0.1:5432, trust auth, database \
         `test`), or point IDEMPOTENCY_TEST_POSTGRES_URL at a server you can write to.",
        url()
    )
}

/// A direct connection for setup and inspection; fails the test with how to start the server.
pub async fn admin() -> PgConnection {
    let options = PgConnectOptions::from_str(&url()).unwrap_or_else(|e| unreachable(e));
    match tokio::time::timeout(
        Duration::from_secs(10),
        PgConnection::connect_with(&options),
    )
    .await
    {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => unreachable(e),
        Err(_) => unreachable("no answer within 10 s"),
    }
}

/// The three isolation levels callers' sessions may run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Isolation {
    pub const ALL: [Isolation; 3] = [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ];

    pub fn sql(self) -> &'static str {
        match self {
            Self::ReadCommitted => "read committed",
            Self::RepeatableRead => "repeatable read",
            Self::Serializable => "serializable",
        }
    }
}

/// A schema of its own, dropped (with everything in it) when this is dropped — also when the
/// test panics.
#[derive(Debug)]
pub struct SchemaGuard {
    pub schema: String,
}

impl SchemaGuard {
    pub fn new() -> Self {
        Self {
            schema: format!("idem_t_{}", uuid::Uuid::new_v4().simple()),
        }
    }
}

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        let schema = self.schema.clone();
        // Drop may run inside or outside a runtime: clean up on a thread of its own.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let options = PgConnectOptions::from_str(&url()).ok()?;
                let mut conn = PgConnection::connect_with(&options).await.ok()?;
                conn.execute(format!(r#"DROP SCHEMA IF EXISTS "{schema}" CASCADE"#).as_str())
                    .await
                    .ok()?;
                conn.close().await.ok()
            })
        })
        .join();
        if !matches!(done, Ok(Some(()))) {
            eprintln!("warning: could not drop test schema {}", self.schema);
        }
    }
}

/// A pool whose sessions run at `level`, with no ping before each acquire (so one operation
/// is one round trip).
pub async fn pool(level: Isolation, max: u32) -> PgPool {
    pool_for(&url(), level, max).await
}

/// As [`pool`], against another URL (a counting proxy).
pub async fn pool_for(url: &str, level: Isolation, max: u32) -> PgPool {
    let _ = admin().await; // a clear failure when the server is down
    let options = PgConnectOptions::from_str(url).unwrap_or_else(|e| unreachable(e));
    let set = format!("SET default_transaction_isolation = '{}'", level.sql());
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(60))
        .test_before_acquire(false)
        .after_connect(move |conn, _meta| {
            let set = set.clone();
            Box::pin(async move {
                conn.execute(set.as_str()).await?;
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .unwrap_or_else(|e| unreachable(e))
}

/// A migrated store in a fresh schema over a pool at `level`.
pub async fn store(level: Isolation) -> (PostgresStore, SchemaGuard) {
    store_with(level, 8).await
}

/// As [`store`], with a pool of `max` connections.
pub async fn store_with(level: Isolation, max: u32) -> (PostgresStore, SchemaGuard) {
    let guard = SchemaGuard::new();
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .build(pool(level, max).await)
        .expect("valid names");
    store.migrate().await.expect("migrate");
    (store, guard)
}

/// Runs `sql` on a fresh admin connection.
pub async fn exec(sql: &str) {
    let mut conn = admin().await;
    sqlx::raw_sql(sql)
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}
