//! This crate's error type and how driver errors map onto `idempotency_core::Error`.

use idempotency_core::Error;
use sqlx::mysql::MySqlDatabaseError;

/// What can go wrong setting up or using the MySQL store.
///
/// Constructors and [`crate::MySqlStore::migrate`] return it directly. Store operations
/// return [`idempotency_core::Error`]; the ones caused by the table itself (missing, wrong
/// shape) carry a `MySqlError` as the source of [`Error::Backend`], which
/// [`MySqlError::find`] digs out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MySqlError {
    /// A table name broke the identifier rules.
    #[error("invalid {what} name {name:?}: {reason}")]
    InvalidName {
        /// `"table"`.
        what: &'static str,
        /// The rejected name.
        name: String,
        /// Which rule it broke.
        reason: String,
    },
    /// The connection URL could not be parsed.
    #[error("invalid MySQL connection URL: {source}")]
    InvalidUrl {
        /// The parse error.
        #[source]
        source: sqlx::Error,
    },
    /// The server could not be reached, or refused the connection (unknown database or user,
    /// authentication…).
    #[error("cannot connect to MySQL: {source}")]
    Connect {
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The store's table does not exist (or the connection names no database).
    #[error("table {table} does not exist: run MySqlStore::migrate() first")]
    MissingTable {
        /// The table name.
        table: String,
    },
    /// A table with the store's name exists but has another shape.
    #[error("table {table} is not an idempotency table of the shape this crate expects: {detail}")]
    TableShape {
        /// The table name.
        table: String,
        /// What differs.
        detail: String,
    },
    /// The server did not answer a statement within the store's response timeout
    /// ([`crate::MySqlStoreBuilder::response_timeout`]): a network partition, a server that
    /// stopped answering, or a lock held that long. The connection was closed. A write that
    /// got no answer may have applied; the core error says so
    /// ([`Error::OutcomeUnknown`]).
    #[error("MySQL did not answer within {after:?}; the connection was closed")]
    NoAnswer {
        /// The response timeout.
        after: std::time::Duration,
    },
    /// MariaDB's snapshot isolation (`innodb_snapshot_isolation`, on by default from 11.8, at
    /// REPEATABLE READ and SERIALIZABLE) refused to write the record inside the work's
    /// transaction (error 1020): another session changed it after the transaction read its
    /// first row, while it was still this holder's. The heartbeat extends it when the work runs
    /// longer than one heartbeat interval, and with
    /// [`Policy::count_hits`](idempotency_core::Policy::count_hits) every duplicate request
    /// counts a hit on it. Nothing committed and the key is released,
    /// so a retry may succeed (it is retryable); for long work, or with hits counted, run the
    /// store's sessions at READ COMMITTED, or with `innodb_snapshot_isolation` off (both in the
    /// pool's `after_connect`).
    #[error(
        "MariaDB's snapshot isolation refused to write the record in {table}, which changed \
         during the work's transaction (error 1020: the heartbeat extended it, or a duplicate \
         counted a hit); nothing committed; for long work run the store's sessions at READ \
         COMMITTED or with innodb_snapshot_isolation off"
    )]
    SnapshotIsolation {
        /// The table name.
        table: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// Any other database error while setting up.
    #[error("database error: {source}")]
    Database {
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

impl MySqlError {
    /// Whether trying again later may succeed (the server was unreachable, a transient error).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Connect { source } | Self::Database { source } => sqlx_retryable(source),
            Self::NoAnswer { .. } | Self::SnapshotIsolation { .. } => true,
            Self::InvalidName { .. }
            | Self::InvalidUrl { .. }
            | Self::MissingTable { .. }
            | Self::TableShape { .. } => false,
        }
    }

    /// The `MySqlError` behind a core error, if there is one in its source chain.
    pub fn find(error: &Error) -> Option<&MySqlError> {
        error.find_source::<Self>()
    }
}

impl From<MySqlError> for Error {
    fn from(e: MySqlError) -> Self {
        match e {
            MySqlError::InvalidName { .. } | MySqlError::InvalidUrl { .. } => {
                Error::Config(e.to_string())
            }
            other => Error::Backend {
                retryable: other.is_retryable(),
                source: Box::new(other),
            },
        }
    }
}

/// The server's error number, if the error came from the server.
pub(crate) fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(|m| m.number()),
        _ => None,
    }
}

/// A deadlock (1213, the transaction was rolled back), a lock wait timeout (1205, the
/// statement was rolled back) or a row changed since the transaction's snapshot read it
/// (1020, MariaDB's `innodb_snapshot_isolation`): nothing of an autocommit statement applied,
/// and it may simply run again; a transaction runs again from its start.
pub(crate) fn is_conflict(e: &sqlx::Error) -> bool {
    matches!(error_number(e), Some(1213 | 1205 | 1020))
}

/// The connection died or the server went away: whatever was in flight may or may not have
/// been applied.
pub(crate) fn is_connection_loss(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(io) => io.kind() != std::io::ErrorKind::ConnectionRefused,
        sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed => true,
        // Server shutdown, connection killed (MySQL, MariaDB), server gone away, lost
        // connection during a query.
        _ => matches!(error_number(e), Some(1053 | 1927 | 4031 | 2006 | 2013)),
    }
}

fn sqlx_retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        // Deadlock, lock wait timeout, row changed since the snapshot, server shutdown, too
        // many connections, connection killed, query interrupted, read-only (a replica until
        // failover finishes).
        _ => matches!(
            error_number(e),
            Some(1213 | 1205 | 1020 | 1053 | 1040 | 1927 | 4031 | 1317 | 1290 | 1836 | 2006 | 2013)
        ),
    }
}

/// Does this error say the table is not what we expect? Returns the detail if so.
fn shape_problem(e: &sqlx::Error) -> Option<String> {
    match e {
        // Unknown column, a column without a default, a value out of range for its column
        // (a narrower type), data too long, an incorrect value for the column's type, a
        // wrong object type (a view).
        sqlx::Error::Database(db)
            if matches!(
                error_number(e),
                Some(1054 | 1364 | 1264 | 1406 | 1366 | 1347 | 1048 | 1292)
            ) =>
        {
            Some(format!(
                "{} (error {})",
                db.message(),
                error_number(e).unwrap_or(0)
            ))
        }
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::TypeNotFound { .. } => Some(e.to_string()),
        _ => None,
    }
}

/// Whether a statement that failed had applied anything.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Effect {
    /// A read, or a statement inside a caller's transaction that has not committed: a lost
    /// connection means nothing was applied.
    None,
    /// An autocommit write (or a commit): a lost connection leaves the outcome unknown.
    Write,
}

/// A database error of the work's own statements inside an exactly-once transaction, as
/// core takes it: [`Error::Backend`] with the sqlx error as its source, so that a conflict (a
/// serialization failure, a deadlock) is told apart
/// ([`is_conflict`](idempotency_core::TransactionalStore::is_conflict)) and the transaction
/// runs again, and any other error releases the key. The store's
/// [`TransactionalStore::work_error`](idempotency_core::TransactionalStore::work_error) applies
/// it to the `sqlx::Error` a work or a phase returns with `?`: call it yourself only where you
/// hand core an [`Error`] (and, say, test [`Idempotency::is_conflict`](idempotency_core::Idempotency::is_conflict)
/// on it). It never blames the store's table: the statement
/// was the work's, on its own tables.
pub fn database_error(e: sqlx::Error) -> Error {
    Error::Backend {
        retryable: sqlx_retryable(&e),
        source: Box::new(e),
    }
}

/// Maps a driver error from a statement on `table` to the core error.
pub(crate) fn map_sqlx(e: sqlx::Error, table: &str, effect: Effect) -> Error {
    // No such table, no database selected, unknown database.
    if matches!(error_number(&e), Some(1146 | 1046 | 1049)) {
        return MySqlError::MissingTable {
            table: table.to_owned(),
        }
        .into();
    }
    if let Some(detail) = shape_problem(&e) {
        return MySqlError::TableShape {
            table: table.to_owned(),
            detail,
        }
        .into();
    }
    if effect == Effect::Write && is_connection_loss(&e) {
        return Error::OutcomeUnknown {
            source: Box::new(e),
        };
    }
    if let sqlx::Error::Configuration(_) = e {
        return Error::Config(e.to_string());
    }
    Error::Backend {
        retryable: sqlx_retryable(&e),
        source: Box::new(e),
    }
}
