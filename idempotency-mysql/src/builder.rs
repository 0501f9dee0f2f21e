//! The builder: the table name, pool settings, and how the store is assembled.

use crate::{MySqlError, MySqlStore, TableName};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{ConnectOptions, Connection, MySqlPool};
use std::str::FromStr;
use std::time::Duration;

/// How many times a statement is re-run after a deadlock or lock wait timeout, unless
/// [`MySqlStoreBuilder::conflict_retries`] says otherwise.
pub(crate) const DEFAULT_CONFLICT_RETRIES: u32 = 16;

/// How long the store waits for the answer to one of its statements, unless
/// [`MySqlStoreBuilder::response_timeout`] says otherwise.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// Builds a [`MySqlStore`] with a chosen table and pool settings.
///
/// The name is validated when the store is built ([`MySqlStoreBuilder::connect`] or
/// [`MySqlStoreBuilder::build`]).
#[derive(Clone, Debug)]
pub struct MySqlStoreBuilder {
    table: String,
    max_connections: u32,
    acquire_timeout: Duration,
    connect_timeout: Duration,
    conflict_retries: u32,
    response_timeout: Duration,
}

impl Default for MySqlStoreBuilder {
    fn default() -> Self {
        Self {
            table: TableName::DEFAULT_TABLE.to_owned(),
            max_connections: 10,
            acquire_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            conflict_retries: DEFAULT_CONFLICT_RETRIES,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
        }
    }
}

impl MySqlStoreBuilder {
    /// The table name, in the database the connection names. Default `idempotency_records`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The pool size for [`MySqlStoreBuilder::connect`]. Default 10.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long an operation waits for a pooled connection, for
    /// [`MySqlStoreBuilder::connect`]. Default 10 s.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long [`MySqlStoreBuilder::connect`] waits for the server. Default 10 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How many times an operation is re-run after a deadlock (error 1213) or a lock wait
    /// timeout (1205) before the error is returned as retryable. Default 16.
    pub fn conflict_retries(mut self, n: u32) -> Self {
        self.conflict_retries = n;
        self
    }

    /// How long the store waits for the answer to one of its statements (default
    /// [`DEFAULT_RESPONSE_TIMEOUT`], 30 s). Past it the connection is closed (it is stuck
    /// mid-statement) and the call ends: a read or a claim with a retryable error, a
    /// compare-and-swap with [`idempotency_core::Error::OutcomeUnknown`] (it may have
    /// applied; the engine retries it and reads it back), a statement of an exactly-once
    /// transaction with a retryable error (nothing of the transaction committed), its commit
    /// with an unknown outcome that holds the key. Each has [`MySqlError::NoAnswer`] as its
    /// source. Without it, a network partition (no reset, no answer) would hold a call for as
    /// long as TCP keeps trying, many minutes.
    ///
    /// A statement can legitimately wait this long only on a lock, and InnoDB gives up on a
    /// lock after `innodb_lock_wait_timeout` (50 s by default): keep this above the lock
    /// waits you expect.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Builds the store over an existing pool, whose settings are kept (its `after_connect`,
    /// for example, may set the sessions' isolation level).
    ///
    /// sqlx pools by default ping every connection before handing it out
    /// (`test_before_acquire`), one extra round trip per operation; turn it off to get one
    /// round trip per step.
    pub fn build(self, pool: MySqlPool) -> Result<MySqlStore, MySqlError> {
        let name = TableName::new(&self.table)?;
        Ok(MySqlStore::assemble(
            pool,
            name,
            self.conflict_retries,
            self.response_timeout,
        ))
    }

    /// Connects to `url` (`mysql://user:password@host:port/database?ssl-mode=…`) and builds
    /// the store with its own pool.
    ///
    /// One connection is opened at once to check that the server is reachable and accepts
    /// the credentials, then closed; the pool opens connections as operations need them and
    /// does not ping them before use.
    pub async fn connect(self, url: &str) -> Result<MySqlStore, MySqlError> {
        let name = TableName::new(&self.table)?;
        let lower = url.trim_start().to_ascii_lowercase();
        if !(lower.starts_with("mysql://") || lower.starts_with("mariadb://")) {
            return Err(MySqlError::InvalidUrl {
                source: sqlx::Error::Configuration(
                    "the URL must start with mysql:// or mariadb://".into(),
                ),
            });
        }
        let options = MySqlConnectOptions::from_str(url)
            .map_err(|source| MySqlError::InvalidUrl { source })?
            .log_statements(tracing::log::LevelFilter::Trace);
        let probe = tokio::time::timeout(self.connect_timeout, options.connect()).await;
        let probe = match probe {
            Ok(Ok(conn)) => conn,
            Ok(Err(source)) => return Err(MySqlError::Connect { source }),
            Err(_) => {
                return Err(MySqlError::Connect {
                    source: sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no answer within {:?}", self.connect_timeout),
                    )),
                })
            }
        };
        let _ = probe.close().await;
        let pool = MySqlPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .test_before_acquire(false)
            .connect_lazy_with(options);
        Ok(MySqlStore::assemble(
            pool,
            name,
            self.conflict_retries,
            self.response_timeout,
        ))
    }
}
