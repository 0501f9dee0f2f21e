//! This crate's error type and how driver errors map onto `idempotency_core::Error`.

use idempotency_core::Error;
use sqlx::error::DatabaseError;

/// What can go wrong setting up or using the Postgres store.
///
/// Constructors and [`crate::PostgresStore::migrate`] return it directly. Store operations
/// return [`idempotency_core::Error`]; the ones caused by the table itself (missing, wrong
/// shape) carry a `PostgresError` as the source of [`Error::Backend`], which
/// [`PostgresError::find`] digs out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostgresError {
    /// A schema or table name broke the identifier rules.
    #[error("invalid {what} name {name:?}: {reason}")]
    InvalidName {
        /// `"schema"` or `"table"`.
        what: &'static str,
        /// The rejected name.
        name: String,
        /// Which rule it broke.
        reason: String,
    },
    /// The connection URL could not be parsed.
    #[error("invalid PostgreSQL connection URL: {source}")]
    InvalidUrl {
        /// The parse error.
        #[source]
        source: sqlx::Error,
    },
    /// The server could not be reached, or refused the connection (unknown database or role,
    /// authentication…).
    #[error("cannot connect to PostgreSQL: {source}")]
    Connect {
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The server did not answer a statement within the store's response timeout
    /// ([`crate::PostgresStoreBuilder::response_timeout`]): a network partition, a server
    /// that stopped answering, or a lock held that long. The connection was closed. A write
    /// that got no answer may have applied; the core error says so
    /// ([`Error::OutcomeUnknown`]).
    #[error("PostgreSQL did not answer within {after:?}; the connection was closed")]
    NoAnswer {
        /// The response timeout.
        after: std::time::Duration,
    },
    /// The store's table (or its schema) does not exist.
    #[error("table {table} does not exist: run PostgresStore::migrate() first")]
    MissingTable {
        /// The schema-qualified table name.
        table: String,
    },
    /// A table with the store's name exists but has another shape.
    #[error("table {table} is not an idempotency table of the shape this crate expects: {detail}")]
    TableShape {
        /// The schema-qualified table name.
        table: String,
        /// What differs.
        detail: String,
    },
    /// The table was migrated by a newer version of this crate.
    #[error(
        "table {table} is at migration {found}, newer than the {supported} this version of \
         idempotency-postgres knows; upgrade the crate"
    )]
    SchemaTooNew {
        /// The schema-qualified table name.
        table: String,
        /// The newest migration recorded in the database.
        found: i64,
        /// The newest migration this crate knows.
        supported: i64,
    },
    /// A migration failed.
    #[error("migrating {table} failed: {detail}")]
    Migrate {
        /// The schema-qualified table name.
        table: String,
        /// What went wrong.
        detail: String,
        /// The driver's error, when there is one.
        #[source]
        source: Option<sqlx::Error>,
    },
    /// Any other database error while setting up.
    #[error("database error: {source}")]
    Database {
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

impl PostgresError {
    /// Whether trying again later may succeed (the server was unreachable, a transient error).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Connect { source } | Self::Database { source } => sqlx_retryable(source),
            Self::Migrate {
                source: Some(source),
                ..
            } => sqlx_retryable(source),
            Self::NoAnswer { .. } => true,
            Self::InvalidName { .. }
            | Self::InvalidUrl { .. }
            | Self::MissingTable { .. }
            | Self::TableShape { .. }
            | Self::SchemaTooNew { .. }
            | Self::Migrate { source: None, .. } => false,
        }
    }

    /// The `PostgresError` behind a core error, if there is one in its source chain.
    pub fn find(error: &Error) -> Option<&PostgresError> {
        error.find_source::<Self>()
    }
}

impl From<PostgresError> for Error {
    fn from(e: PostgresError) -> Self {
        match e {
            PostgresError::InvalidName { .. } | PostgresError::InvalidUrl { .. } => {
                Error::Config(e.to_string())
            }
            other => Error::Backend {
                retryable: other.is_retryable(),
                source: Box::new(other),
            },
        }
    }
}

/// SQLSTATE of a database error, if the error came from the server.
pub(crate) fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Serialization failure or deadlock: the transaction was rolled back and may simply be run
/// again.
pub(crate) fn is_serialization_failure(e: &sqlx::Error) -> bool {
    matches!(sqlstate(e).as_deref(), Some("40001" | "40P01"))
}

/// An integrity constraint refused the statement (SQLSTATE class 23: a unique, foreign-key,
/// check or exclusion violation). At `COMMIT` (a deferred constraint) the server rolled the
/// transaction back: nothing of it committed.
pub(crate) fn is_integrity_violation(e: &sqlx::Error) -> bool {
    sqlstate(e).is_some_and(|code| code.starts_with("23"))
}

/// The connection died or the server went away: whatever was in flight may or may not have
/// been applied.
pub(crate) fn is_connection_loss(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(io) => io.kind() != std::io::ErrorKind::ConnectionRefused,
        sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03")),
        _ => false,
    }
}

fn sqlx_retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            // Transaction rollback, connection exceptions, insufficient resources, operator
            // intervention (shutdown, cancelled statement), lock not available, read-only
            // (a standby, until failover finishes).
            c.starts_with("40")
                || c.starts_with("08")
                || c.starts_with("53")
                || c.starts_with("57")
                || matches!(&*c, "55P03" | "25006")
        }),
        _ => false,
    }
}

/// Does this error say the table is not what we expect? Returns the detail if so.
fn shape_problem(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // undefined column, datatype mismatch, undefined function/operator (a column of
            // another type), no unique constraint matching ON CONFLICT, not-null or check
            // violation (extra or stricter columns), wrong object type (a view…), a number out
            // of range (a column narrower than the values written: a fencing token, the clock
            // in microseconds, does not fit an `integer` token column).
            Some("42703" | "42804" | "42883" | "42P10" | "23502" | "23514" | "42809" | "22003") => {
                Some(db_message(db.as_ref()))
            }
            _ => None,
        },
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::TypeNotFound { .. } => Some(e.to_string()),
        _ => None,
    }
}

fn db_message(db: &dyn DatabaseError) -> String {
    match db.code() {
        Some(code) => format!("{} (SQLSTATE {code})", db.message()),
        None => db.message().to_owned(),
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
    if matches!(sqlstate(&e).as_deref(), Some("42P01" | "3F000")) {
        return PostgresError::MissingTable {
            table: table.to_owned(),
        }
        .into();
    }
    if let Some(detail) = shape_problem(&e) {
        return PostgresError::TableShape {
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
