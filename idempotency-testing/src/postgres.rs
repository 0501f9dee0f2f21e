//! PostgreSQL test support: the server URL, admin connections that fail with how to start
//! the server, isolated schemas that drop themselves, pools at a given isolation level.

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection, PgPool};
use std::str::FromStr;
use std::time::Duration;

/// The env var naming the PostgreSQL server the tests use.
pub const URL_VAR: &str = "IDEMPOTENCY_TEST_POSTGRES_URL";

/// The server the tests use: `$IDEMPOTENCY_TEST_POSTGRES_URL`, or the local default.
pub fn url() -> String {
    std::env::var(URL_VAR).unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Fails the test with how to start the server.
pub fn unreachable(e: impl std::fmt::Display) -> ! {
    panic!(
        "cannot reach PostgreSQL at {} ({e}).\n\
         Start it with `bash .ci/services` (PostgreSQL on 127.0.0.1:5432, trust auth, database \
         `test`), or point {URL_VAR} at a server you can write to.",
        url()
    )
}

/// The connect options for [`url`]; fails the test when the URL does not parse.
pub fn options() -> PgConnectOptions {
    PgConnectOptions::from_str(&url()).unwrap_or_else(|e| unreachable(e))
}

/// A direct connection for setup and inspection; fails the test with how to start the server.
///
/// A server with every connection slot taken (`too_many_connections`, as when many tests of
/// one binary run at once) or still starting is asked again for up to 30 s, as sqlx's pools
/// do on their own.
pub async fn admin() -> PgConnection {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match tokio::time::timeout_at(deadline, PgConnection::connect_with(&options())).await {
            Ok(Ok(conn)) => return conn,
            Ok(Err(sqlx::Error::Database(e)))
                if matches!(e.code().as_deref(), Some("53300" | "57P03"))
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(Err(e)) => unreachable(e),
            Err(_) => unreachable("no connection within 30 s"),
        }
    }
}

/// The three isolation levels callers' sessions may run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation {
    /// `READ COMMITTED`, PostgreSQL's default.
    ReadCommitted,
    /// `REPEATABLE READ`.
    RepeatableRead,
    /// `SERIALIZABLE`.
    Serializable,
}

impl Isolation {
    /// Every level.
    pub const ALL: [Isolation; 3] = [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ];

    /// The level as SQL spells it.
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
    /// The schema's name (`idem_t_<uuid>`).
    pub schema: String,
}

impl SchemaGuard {
    /// A fresh schema name; the schema itself is created by whoever uses it (`migrate`).
    #[allow(clippy::new_without_default)]
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
                // A failed test may leave a session inside a transaction on the schema: wait
                // for its locks a bounded time, so that the failure is reported, not hung.
                conn.execute("SET lock_timeout = '10s'").await.ok()?;
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
    pool_with(options(), level, max).await
}

/// As [`pool`], against another URL (a counting proxy).
pub async fn pool_for(url: &str, level: Isolation, max: u32) -> PgPool {
    let options = PgConnectOptions::from_str(url).unwrap_or_else(|e| unreachable(e));
    pool_with(options, level, max).await
}

/// As [`pool`], with the given connect options (another URL, an `application_name` to find
/// the pool's sessions in `pg_stat_activity`…).
pub async fn pool_with(options: PgConnectOptions, level: Isolation, max: u32) -> PgPool {
    let _ = admin().await; // a clear failure when the server is down
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

/// Runs `sql` (one or more statements) on a fresh admin connection.
pub async fn exec(sql: &str) {
    let mut conn = admin().await;
    sqlx::raw_sql(sql)
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The server's clock in Unix milliseconds (`clock_timestamp()`, read on a connection of its
/// own), for checks that a store uses the database's clock.
pub async fn server_now_millis() -> i64 {
    let mut conn = admin().await;
    sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000)::int8")
        .fetch_one(&mut conn)
        .await
        .unwrap_or_else(|e| unreachable(e))
}
