#![doc = include_str!("../README.md")]

mod builder;
mod decode;
mod error;
mod exactly_once;
mod names;
mod schema;
mod store;

pub use aws_sdk_dynamodb;
pub use builder::{DynamoStoreBuilder, DEFAULT_RESPONSE_TIMEOUT, DEFAULT_RETENTION};
pub use decode::MAX_OUTCOME_BYTES;
pub use error::DynamoError;
pub use exactly_once::{CancelledWrite, DynamoTransaction, MAX_TRANSACTION_WRITES};
pub use store::DynamoStore;
