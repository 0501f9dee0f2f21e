//! SQLite helpers.

use idempotency_sqlite::SqliteError;

/// Whether a busy SQLite error (`SQLITE_BUSY`, `SQLITE_LOCKED`) is behind `e`: the tests use it
/// to prove that no lock contention reaches a caller.
pub fn is_busy_error(e: &idempotency_core::Error) -> bool {
    SqliteError::find(e).is_some_and(SqliteError::is_busy)
}
