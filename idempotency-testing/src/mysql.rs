//! MySQL/MariaDB test support: the server URL, admin connections that fail with how to start
//! the server, tables of their own that drop themselves, pools at a given isolation level, the
//! server's clock.

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{ConnectOptions, Connection, Executor, MySqlConnection, MySqlPool};
use std::str::FromStr;
use std::sync::Once;
use std::time::Duration;

/// The env var naming the server the tests use.
pub const URL_VAR: &str = "MYSQL_URL";

/// The server the tests use: `$MYSQL_URL`, or the loopback MariaDB.
pub fn url() -> String {
    std::env::var(URL_VAR).unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// Fails the test with how to start the server.
pub fn unreachable(e: impl std::fmt::Display) -> ! {
    panic!(
        "cannot reach the MariaDB server at {} ({e}).\n\
         Start it with `bash .ci/services` (MariaDB on 127.0.0.1:3306, root with an empty \
         password, database `test`), or point {URL_VAR} at a server you can write to.",
        url()
    )
}

/// The connect options for [`url`]; fails the test when the URL does not parse.
pub fn options() -> MySqlConnectOptions {
    MySqlConnectOptions::from_str(&url()).unwrap_or_else(|e| unreachable(e))
}

/// One connection of our own, outside any store; fails the test with how to start the server.
pub async fn admin() -> MySqlConnection {
    match tokio::time::timeout(Duration::from_secs(10), options().connect()).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => unreachable(e),
        Err(_) => unreachable("no answer within 10 s"),
    }
}

/// Runs one statement on a connection of its own; fails the test when it fails.
pub async fn exec(sql: &str) {
    let mut conn = admin().await;
    if let Err(e) = conn.execute(sql).await {
        panic!("{sql}: {e}");
    }
    let _ = conn.close().await;
}

/// The server's clock, as the store reads it, in milliseconds since the Unix epoch.
pub async fn server_now_millis() -> i64 {
    let mut conn = admin().await;
    let now: i64 = sqlx::query_scalar(
        "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) \
         DIV 1000 AS SIGNED)",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap_or_else(|e| unreachable(e));
    let _ = conn.close().await;
    now
}

/// The isolation level of a pool's sessions.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Isolation {
    /// `READ COMMITTED`.
    ReadCommitted,
    /// `REPEATABLE READ`, InnoDB's default.
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
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }

    /// The level as `@@tx_isolation` reports it.
    pub fn reported(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ-COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE-READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }
}

/// A pool of `max` connections whose sessions run at `level`, never pinged before use (so
/// one operation is one round trip).
pub async fn pool(level: Isolation, max: u32) -> MySqlPool {
    pool_with(options(), level, max).await
}

/// As [`pool`], with the given connect options (a counting proxy's port...).
pub async fn pool_with(options: MySqlConnectOptions, level: Isolation, max: u32) -> MySqlPool {
    let set = format!("SET SESSION TRANSACTION ISOLATION LEVEL {}", level.sql());
    MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(60))
        .test_before_acquire(false)
        .after_connect(move |conn, _| {
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

static PURGE: Once = Once::new();

/// A table name of its own for one test or case (`idem_t_<random>`), dropped with the guard,
/// also when the test panics. The first guard of a test binary drops tables earlier runs left
/// behind (older than an hour).
#[derive(Debug)]
pub struct TableGuard {
    /// The table's name; the table itself is created by whoever uses it (`migrate`).
    pub table: String,
}

impl TableGuard {
    /// A fresh table name.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        PURGE.call_once(|| {
            on_own_runtime(async {
                let Ok(mut conn) = options().connect().await else {
                    return;
                };
                let old: Vec<String> = sqlx::query_scalar(
                    "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES
                     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'idem\\_t\\_%'
                       AND CREATE_TIME < NOW() - INTERVAL 1 HOUR",
                )
                .fetch_all(&mut conn)
                .await
                .unwrap_or_default();
                for t in old {
                    let _ = conn
                        .execute(format!("DROP TABLE IF EXISTS `{t}`").as_str())
                        .await;
                }
                let _ = conn.close().await;
            })
        });
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        Self {
            table: format!("idem_t_{}", &suffix[..20]),
        }
    }
}

impl Drop for TableGuard {
    fn drop(&mut self) {
        let sql = format!("DROP TABLE IF EXISTS `{}`", self.table);
        let table = self.table.clone();
        if !on_own_runtime(async move {
            let Ok(mut conn) = options().connect().await else {
                return false;
            };
            // A test that failed may leave a transaction open on the table (a connection held
            // by a fault proxy): wait for its metadata lock a bounded time, not MariaDB's
            // default of a year, so that the failure is reported instead of hanging.
            let _ = conn.execute("SET SESSION lock_wait_timeout = 10").await;
            let dropped = conn.execute(sql.as_str()).await.is_ok();
            let _ = conn.close().await;
            dropped
        }) {
            eprintln!("warning: could not drop test table {table}");
        }
    }
}

/// Runs `f` to completion on a runtime of its own on another thread (`Drop` may run inside
/// a runtime).
fn on_own_runtime<T: Send + Default + 'static>(
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(|rt| rt.block_on(f))
            .unwrap_or_default()
    })
    .join()
    .unwrap_or_default()
}
