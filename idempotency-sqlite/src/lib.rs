#![doc = include_str!("../README.md")]

mod builder;
mod decode;
mod error;
mod exactly_once;
mod exec;
mod idempotency;
mod schema;
mod sql;
mod store;

pub use builder::{ConnectionMode, SqliteStoreBuilder, DEFAULT_TABLE};
pub use error::SqliteError;
pub use exactly_once::SqliteTransaction;
pub use exec::WriteStats;
pub use idempotency::SqliteIdempotency;
/// The driver this store runs on, re-exported so your business code uses the same version.
pub use rusqlite;
pub use schema::{validate_table_name, MAX_TABLE_NAME_LEN, SCHEMA_VERSION};
pub use store::{SqliteStore, Synchronous};

/// The row decoder, for the fuzz targets: built only with the `fuzzing` feature. Not part of the API: it may
/// change at any time.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod __fuzz {
    use idempotency_core::store::Record;
    use idempotency_core::Error;

    /// The columns [`decode_record`] reads, in order.
    pub const COLUMNS: &str = crate::sql::COLUMNS;

    /// Decodes one row whose columns are [`COLUMNS`] in order, as every read of the store does.
    pub fn decode_record(row: &rusqlite::Row<'_>) -> Result<Record, Error> {
        crate::decode::decode_record(row)
    }
}
