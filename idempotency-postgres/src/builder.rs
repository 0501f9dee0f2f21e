//! The builder: schema and table names, pool settings, and how the store is assembled.

use crate::{PostgresError, PostgresStore, TableName};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};
use std::str::FromStr;
use std::time::Duration;

/// How many times a statement is re-run after a serialization failure or deadlock, unless
/// [`PostgresStoreBuilder::serialization_retries`] says otherwise.
pub(crate) const DEFAULT_SERIALIZATION_RETRIES: u32 = 16;

/// Builds a [`PostgresStore`] with a chosen schema, table and pool settings.
///
/// Names are validated when the store is built ([`PostgresStoreBuilder::connect`] or
/// [`PostgresStoreBuilder::build`]).
#[derive(Clone, Debug)]
pub struct PostgresStoreBuilder {
    schema: String,
    table: String,
    max_connections: u32,
    acquire_timeout: Duration,
    connect_timeout: Duration,
    serialization_retries: u32,
    keep_connections: bool,
    response_timeout: Duration,
}

/// How long the store waits for the answer to one of its statements by default.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for PostgresStoreBuilder {
    fn default() -> Self {
        Self {
            schema: TableName::DEFAULT_SCHEMA.to_owned(),
            table: TableName::DEFAULT_TABLE.to_owned(),
            max_connections: 10,
            acquire_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            serialization_retries: DEFAULT_SERIALIZATION_RETRIES,
            keep_connections: false,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
        }
    }
}

impl PostgresStoreBuilder {
    /// The schema holding the table. Default `public`.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The table name. Default `idempotency_records`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The pool size for [`PostgresStoreBuilder::connect`]. Default 10.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long an operation waits for a pooled connection, for
    /// [`PostgresStoreBuilder::connect`]. Default 10 s.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long [`PostgresStoreBuilder::connect`] waits for the server. Default 10 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How many times an operation is re-run after a serialization failure or deadlock
    /// (SQLSTATE 40001/40P01, which sessions at REPEATABLE READ or SERIALIZABLE get under
    /// contention) before the error is returned as retryable. Default 16.
    pub fn serialization_retries(mut self, n: u32) -> Self {
        self.serialization_retries = n;
        self
    }

    /// How long the store waits for the answer to one of its statements (default
    /// [`DEFAULT_RESPONSE_TIMEOUT`], 30 s). Past it the connection is closed (it is stuck
    /// mid-statement) and the call ends: a read or a claim with a retryable error, a
    /// compare-and-swap with [`idempotency_core::Error::OutcomeUnknown`] (it may have
    /// applied; the engine retries it and reads it back), the commit of an exactly-once
    /// transaction with an unknown outcome that holds the key. Each has
    /// [`PostgresError::NoAnswer`] as its source. Without it, a network partition (no reset,
    /// no answer) would hold a call for as long as TCP keeps trying, many minutes.
    ///
    /// A duplicate's claim and reclaim do not wait for a holder: at REPEATABLE READ and
    /// SERIALIZABLE the holder's transaction keeps the record locked (see
    /// [`crate::PostgresIdempotency`]), and they skip that lock on a live record. Two cases
    /// still wait on a lock: a record that expired while its holder's transaction runs (work
    /// outliving a short TTL), and a transaction between its own
    /// [`crate::PostgresStore::complete_in`] and its commit. Otherwise a statement this slow
    /// means the server or the network is stuck.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Whether the store keeps connections checked out between its operations instead of
    /// giving each back to the pool after its statement. Off by default.
    ///
    /// sqlx's pool pings every connection it takes back (a bare `Sync` and its answer, in a
    /// spawned task): through the pool, each operation costs its statement's round trip plus
    /// that ping, a task and their system calls on both sides, which bounds the throughput of
    /// replays. A kept connection runs the next operation's statement directly. It goes back
    /// to the pool (and is pinged there) on any error, when an operation is cancelled
    /// mid-statement, when it has been unused for 100 ms, when the pool is closed, at least
    /// every 10 s (or the pool's `max_lifetime`, if shorter), and, while the pool is
    /// exhausted, at once if someone else holds one of its connections, else within 100 ms.
    /// Your own queries on [`PostgresStore::pool`] may therefore wait up to about 100 ms for
    /// a connection the store keeps when the pool has none idle and cannot open another;
    /// a [`crate::PostgresIdempotency`] transaction that starts waiting while the pool is exhausted
    /// gets one handed back at once. Kept connections also skip the pool's per-checkout hooks
    /// (`before_acquire`, `after_release`, `test_before_acquire`) between those returns.
    ///
    /// **Turn it on only for a pool whose transactions are never left open.** sqlx 0.8 can
    /// put a connection back into the pool inside a transaction: when the future of
    /// `Pool::begin` is dropped after `BEGIN` was sent but before it returned (a request
    /// timeout around your own `store.pool().begin()`, for example), nothing rolls it back.
    /// The store cannot see the server's transaction state through sqlx, so its statements
    /// on such a connection run inside that transaction and are lost when it ends; a kept
    /// connection would carry that on for every operation it serves (up to 10 s), where a
    /// pooled one serves one operation at a time. [`crate::PostgresIdempotency`] begins its own
    /// transactions safely (on a task of their own); a pool used only by the store and by
    /// `PostgresIdempotency` is safe.
    pub fn keep_connections(mut self, keep: bool) -> Self {
        self.keep_connections = keep;
        self
    }

    /// Builds the store over an existing pool.
    ///
    /// The pool's settings are kept, and every operation takes a connection from it and gives
    /// it back, paying sqlx's release ping ([`PostgresStoreBuilder::keep_connections`] opts in
    /// to keeping connections between operations). Note that sqlx pools by default also ping
    /// every connection before handing it out (`test_before_acquire`), one extra round trip
    /// per operation; turn it off to get one round trip per step.
    pub fn build(self, pool: PgPool) -> Result<PostgresStore, PostgresError> {
        let name = TableName::new(&self.schema, &self.table)?;
        Ok(PostgresStore::assemble(
            pool,
            name,
            self.serialization_retries,
            self.keep_connections,
            self.response_timeout,
        ))
    }

    /// Connects to `url` (`postgres://user:password@host:port/database?sslmode=…`) and builds
    /// the store with its own pool.
    ///
    /// One connection is opened at once to check that the server is reachable and accepts
    /// the credentials, then closed; the pool opens connections as operations need them and
    /// does not ping them before use. With [`PostgresStoreBuilder::keep_connections`] the
    /// store also keeps connections between its operations, so a busy store's operations cost
    /// one round trip each and no release ping.
    pub async fn connect(self, url: &str) -> Result<PostgresStore, PostgresError> {
        let name = TableName::new(&self.schema, &self.table)?;
        let lower = url.trim_start().to_ascii_lowercase();
        if !(lower.starts_with("postgres://") || lower.starts_with("postgresql://")) {
            return Err(PostgresError::InvalidUrl {
                source: sqlx::Error::Configuration(
                    "the URL must start with postgres:// or postgresql://".into(),
                ),
            });
        }
        let options = PgConnectOptions::from_str(url)
            .map_err(|source| PostgresError::InvalidUrl { source })?
            .log_statements(tracing::log::LevelFilter::Trace);
        let probe = tokio::time::timeout(self.connect_timeout, options.connect()).await;
        let probe = match probe {
            Ok(Ok(conn)) => conn,
            Ok(Err(source)) => return Err(PostgresError::Connect { source }),
            Err(_) => {
                return Err(PostgresError::Connect {
                    source: sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no answer within {:?}", self.connect_timeout),
                    )),
                })
            }
        };
        // Closing politely is a courtesy; the server cleans up either way.
        let _ = probe.close().await;
        let pool = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .test_before_acquire(false)
            .connect_lazy_with(options);
        Ok(PostgresStore::assemble(
            pool,
            name,
            self.serialization_retries,
            self.keep_connections,
            self.response_timeout,
        ))
    }
}
