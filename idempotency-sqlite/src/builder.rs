//! Configuring and opening a store: the builder, the connection settings and the open checks.

use crate::error::{self, SqliteError};
use crate::exec::Executor;
use crate::schema::validate_table_name;
use crate::sql::Sql;
use crate::store::{Inner, SqliteStore, Synchronous};
use idempotency_core::store::{Clock, SystemClock};
use rusqlite::{Connection, OpenFlags};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The default table name.
pub const DEFAULT_TABLE: &str = "idempotency_records";

/// How the store keeps SQLite's blocking calls off the async runtime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionMode {
    /// One connection on a dedicated OS thread; calls queue on a channel (the default).
    /// SQLite admits one writer at a time anyway, so a single connection loses little and
    /// never waits on its own process's locks.
    #[default]
    DedicatedThread,
    /// `connections` connections used through `tokio::task::spawn_blocking`. Reads (`get`)
    /// and your own closures run in parallel; writes still take turns on the file lock.
    BlockingPool {
        /// How many connections to open (at least 1).
        connections: usize,
    },
}

/// Configures and opens a [`SqliteStore`].
#[derive(Clone, Debug)]
pub struct SqliteStoreBuilder {
    path: PathBuf,
    table: String,
    synchronous: Synchronous,
    busy_timeout: Duration,
    mode: ConnectionMode,
    clock: Arc<dyn Clock>,
}

impl SqliteStoreBuilder {
    pub(crate) fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            table: DEFAULT_TABLE.to_owned(),
            synchronous: Synchronous::default(),
            busy_timeout: Duration::from_secs(10),
            mode: ConnectionMode::default(),
            clock: Arc::new(SystemClock),
        }
    }

    /// The table to keep records in (default [`DEFAULT_TABLE`]); checked by
    /// [`validate_table_name`] when the store opens.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// `PRAGMA synchronous` (default [`Synchronous::Full`]).
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How long a write waits for another connection's lock before failing with
    /// `SQLITE_BUSY` (default 10 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Dedicated thread or blocking pool (default [`ConnectionMode::DedicatedThread`]).
    pub fn mode(mut self, mode: ConnectionMode) -> Self {
        self.mode = mode;
        self
    }

    /// The clock that decides leases and expiry (default: the system clock). All processes
    /// sharing a database file should use the same host clock.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Opens the database (creating the file when missing), switches it to WAL and applies
    /// the settings. Does not create the table: call [`SqliteStore::migrate`].
    pub async fn open(self) -> Result<SqliteStore, SqliteError> {
        validate_table_name(&self.table)?;
        let settings = OpenSettings {
            path: self.path.clone(),
            synchronous: self.synchronous,
            busy_timeout: self.busy_timeout,
        };
        let durability = self.synchronous.statement();
        let exec = match self.mode {
            ConnectionMode::DedicatedThread => {
                Executor::thread(format!("sqlite-{}", self.table), durability, move || {
                    open_connection(&settings)
                })
                .await?
            }
            ConnectionMode::BlockingPool { connections } => {
                if connections == 0 {
                    return Err(SqliteError::Config(
                        "a blocking pool needs at least one connection".into(),
                    ));
                }
                Executor::pool(connections, durability, move || open_connection(&settings)).await?
            }
        };
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                exec,
                sql: Sql::new(&self.table),
                table: self.table,
                path: self.path,
                clock: self.clock,
                synchronous: self.synchronous,
            }),
        })
    }
}

#[derive(Clone, Debug)]
struct OpenSettings {
    path: PathBuf,
    synchronous: Synchronous,
    busy_timeout: Duration,
}

fn open_connection(s: &OpenSettings) -> Result<Connection, SqliteError> {
    let path = &s.path;
    let not_writable = |source: rusqlite::Error| SqliteError::NotWritable {
        path: path.clone(),
        reason: source.to_string(),
        source: Some(source),
    };
    let classify = |e: rusqlite::Error| {
        use rusqlite::ErrorCode as C;
        match error::code(&e) {
            Some(C::NotADatabase) => SqliteError::NotADatabase {
                path: path.clone(),
                source: e,
            },
            Some(C::CannotOpen | C::ReadOnly | C::PermissionDenied | C::SystemIoFailure) => {
                not_writable(e)
            }
            _ => SqliteError::from(e),
        }
    };
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(classify)?;
    conn.busy_timeout(s.busy_timeout).map_err(classify)?;
    // SQLite falls back to read-only when it may not write the file.
    if conn
        .is_readonly(rusqlite::DatabaseName::Main)
        .map_err(classify)?
    {
        return Err(SqliteError::NotWritable {
            path: path.clone(),
            reason: "the file is read-only".into(),
            source: None,
        });
    }
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(classify)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(SqliteError::Config(format!(
            "{} cannot use write-ahead logging (journal mode stayed {mode:?}); the store needs \
             a file on a local file system",
            path.display()
        )));
    }
    conn.pragma_update(None, "synchronous", s.synchronous.pragma())
        .map_err(classify)?;
    // Prove the file and its directory (for the -wal and -shm files) can be written now,
    // rather than at the first claim: an immediate transaction takes the write lock.
    conn.execute_batch("BEGIN IMMEDIATE; COMMIT;")
        .map_err(classify)?;
    Ok(conn)
}

/// The store's entry point, beside the builder it starts.
impl SqliteStore {
    /// Starts configuring a store on the database file at `path`.
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder::new(path.as_ref())
    }
}
