//! Shared test support: the server URL, tables of their own that drop themselves, pools at a
//! given isolation level, migrated stores on a fresh table, the server's clock.
#![allow(dead_code, unused_imports, clippy::unwrap_used)]

pub(crate) mod proxy;

use idempotency_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use idempotency_mysql::sqlx::{
    self, ConnectOptions, Connection, Executor, MySqlConnection, MySqlPool,
};
use idempotency_mysql::MysqlStore;
use std::str::FromStr;
use std::sync::Once;

/// The server: `MYSQL_URL`, by default the loopback MariaDB.
pub(crate) fn url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

pub(crate) fn options() -> MySqlConnectOptions {
    MySqlConnectOptions::from_str(&url()).expect("MYSQL_URL parses")
}

/// One connection of our own, outside any store.
pub(crate) async fn admin() -> MySqlConnection {
    options()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot reach the MariaDB server at {}: {e}", url()))
}

/// Runs one statement on a connection of its own.
pub(crate) async fn exec(sql: &str) {
    let mut conn = admin().await;
    conn.execute(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let _ = conn.close().await;
}

/// The server's clock, as the store reads it, in milliseconds since the Unix epoch.
pub(crate) async fn server_now_millis() -> i64 {
    let mut conn = admin().await;
    let now: i64 = sqlx::query_scalar(
        "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let _ = conn.close().await;
    now
}

/// The isolation level of a pool's sessions.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Isolation {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Isolation {
    pub(crate) const ALL: [Isolation; 3] = [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ];

    pub(crate) fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }

    /// As `@@transaction_isolation` reports it.
    pub(crate) fn reported(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ-COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE-READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }
}

/// A pool of `max` connections whose sessions run at `level`, never pinged before use.
pub(crate) async fn pool(level: Isolation, max: u32) -> MySqlPool {
    pool_with(options(), level, max).await
}

pub(crate) async fn pool_with(
    options: MySqlConnectOptions,
    level: Isolation,
    max: u32,
) -> MySqlPool {
    let set = format!("SET SESSION TRANSACTION ISOLATION LEVEL {}", level.sql());
    MySqlPoolOptions::new()
        .max_connections(max)
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
        .unwrap_or_else(|e| panic!("cannot reach the MariaDB server at {}: {e}", url()))
}

static PURGE: Once = Once::new();

/// A table name of its own for one test or case (`t_<random>`), dropped with the guard.
/// The first guard of a test binary drops tables earlier runs left behind (older than an
/// hour).
pub(crate) struct TableGuard {
    pub(crate) table: String,
}

impl TableGuard {
    pub(crate) fn new() -> Self {
        PURGE.call_once(|| {
            on_own_runtime(async {
                let mut conn = admin().await;
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
        on_own_runtime(async move {
            if let Ok(mut conn) = options().connect().await {
                let _ = conn.execute(sql.as_str()).await;
                let _ = conn.close().await;
            }
        });
    }
}

/// Runs `f` to completion on a runtime of its own on another thread (from `Drop`, which may
/// run inside a runtime).
fn on_own_runtime<F: std::future::Future<Output = ()> + Send + 'static>(f: F) {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    })
    .join()
    .unwrap();
}

/// A migrated store on a fresh table over a pool of 8 at `level`.
pub(crate) async fn store(level: Isolation) -> (MysqlStore, TableGuard) {
    store_with(level, 8).await
}

/// As [`store`], with a pool of `max` connections.
pub(crate) async fn store_with(level: Isolation, max: u32) -> (MysqlStore, TableGuard) {
    let guard = TableGuard::new();
    let store = MysqlStore::builder()
        .table(&guard.table)
        .build(pool(level, max).await)
        .expect("valid name");
    store.migrate().await.expect("migrate");
    (store, guard)
}
