//! The SQLite store's error type.

use rusqlite::ErrorCode;
use std::path::PathBuf;

/// Everything that can go wrong opening, migrating or using a [`crate::SqliteStore`].
///
/// Store operations reached through [`idempotency_core::IdempotencyStore`] return
/// [`idempotency_core::Error`]; a `SqliteError` then travels as the source of
/// [`idempotency_core::Error::Backend`] (convert with `From`), so callers can walk the chain
/// down to it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqliteError {
    /// The table name broke a rule (see [`crate::SqliteStoreBuilder::table`]). The same
    /// variant as `PostgresError::InvalidName`.
    #[error("invalid {what} name {name:?}: {reason}")]
    InvalidName {
        /// `"table"`, the only name this store takes.
        what: &'static str,
        /// The rejected name.
        name: String,
        /// Which rule it broke.
        reason: &'static str,
    },
    /// A setting is out of range (a zero-sized pool, …).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The database file cannot be created or written: a missing or read-only directory, a
    /// read-only file, a path that is a directory.
    #[error("cannot open {path} for writing: {reason}")]
    NotWritable {
        /// The path given to the store.
        path: PathBuf,
        /// What SQLite or the file system said.
        reason: String,
        /// SQLite's error, when there is one.
        #[source]
        source: Option<rusqlite::Error>,
    },
    /// The file exists but is not an SQLite database (or its header is damaged).
    #[error("{path} is not an SQLite database")]
    NotADatabase {
        /// The path given to the store.
        path: PathBuf,
        /// SQLite's error.
        #[source]
        source: rusqlite::Error,
    },
    /// The table exists with columns other than the ones this crate creates. Nothing was
    /// changed; pick another table name or migrate the table by hand.
    #[error("table {table:?} does not have the schema this store expects: {detail}")]
    TableShape {
        /// The table.
        table: String,
        /// The first difference found.
        detail: String,
    },
    /// The table was migrated by a newer version of this crate.
    #[error(
        "table {table:?} is at schema version {found}, newer than the {supported} this version \
         of idempotency-sqlite knows; upgrade the crate"
    )]
    SchemaTooNew {
        /// The table.
        table: String,
        /// The version recorded in the database.
        found: i64,
        /// The newest version this crate knows.
        supported: i64,
    },
    /// The table does not exist: [`crate::SqliteStore::migrate`] has not been run.
    #[error("table {table:?} does not exist; run SqliteStore::migrate() first")]
    MissingTable {
        /// The table.
        table: String,
    },
    /// The connection thread or pool has shut down.
    #[error("the SQLite connection has shut down")]
    Closed,
    /// The database file or its disk is full (`SQLITE_FULL`, or the file reached
    /// `PRAGMA max_page_count`): the write was refused and nothing of it was stored; what
    /// was stored before is kept. Writes go through again once there is space.
    #[error("the database or its disk is full; the write was not stored: {source}")]
    DiskFull {
        /// SQLite's error.
        #[source]
        source: rusqlite::Error,
    },
    /// The database refuses writes (`SQLITE_READONLY`: a read-only file, directory or mount,
    /// or `PRAGMA query_only`): the write was not stored; reads still answer. Writes go
    /// through again once the database is writable.
    #[error("the database is read-only; the write was not stored: {source}")]
    ReadOnly {
        /// SQLite's error.
        #[source]
        source: rusqlite::Error,
    },
    /// Any other SQLite error.
    #[error("sqlite error: {0}")]
    Sqlite(rusqlite::Error),
}

impl SqliteError {
    /// Whether the same call may succeed if tried again: true for lock contention that
    /// outlasted the busy timeout, and transient I/O errors.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Sqlite(e) => is_transient(e),
            _ => false,
        }
    }

    /// Whether this is SQLite's `SQLITE_BUSY` or `SQLITE_LOCKED`: lock contention that lasted
    /// longer than the busy timeout.
    pub fn is_busy(&self) -> bool {
        matches!(self, Self::Sqlite(e) if is_busy(e))
    }

    /// The `SqliteError` behind a core error, if there is one in its source chain.
    ///
    /// ```
    /// # use idempotency_sqlite::SqliteError;
    /// let err: idempotency_core::Error = SqliteError::Closed.into();
    /// assert!(matches!(SqliteError::find(&err), Some(SqliteError::Closed)));
    /// ```
    pub fn find(error: &idempotency_core::Error) -> Option<&SqliteError> {
        error.find_source::<Self>()
    }
}

pub(crate) fn code(e: &rusqlite::Error) -> Option<ErrorCode> {
    e.sqlite_error_code()
}

pub(crate) fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        code(e),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

fn is_transient(e: &rusqlite::Error) -> bool {
    is_busy(e) || matches!(code(e), Some(ErrorCode::SystemIoFailure))
}

impl From<rusqlite::Error> for SqliteError {
    /// A full disk and a read-only database get variants of their own; anything else is
    /// [`SqliteError::Sqlite`].
    fn from(e: rusqlite::Error) -> Self {
        match code(&e) {
            Some(ErrorCode::DiskFull) => Self::DiskFull { source: e },
            Some(ErrorCode::ReadOnly) => Self::ReadOnly { source: e },
            _ => Self::Sqlite(e),
        }
    }
}

impl From<SqliteError> for idempotency_core::Error {
    fn from(e: SqliteError) -> Self {
        idempotency_core::Error::backend(e.is_retryable(), e)
    }
}
