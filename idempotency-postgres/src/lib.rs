#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod error;
mod migrate;
mod names;
mod sql;
mod store;
mod tx;

pub use error::PostgresError;
pub use names::{TableName, MAX_SCHEMA_NAME_LEN, MAX_TABLE_NAME_LEN};
pub use store::{PostgresStore, PostgresStoreBuilder};
pub use tx::PgIdempotency;

/// The driver, re-exported so your transactions and this store use the same sqlx.
pub use sqlx;
