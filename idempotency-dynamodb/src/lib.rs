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

/// The engine that owns a [`DynamoStore`]: [`Idempotency::builder`] over the store builds
/// one. Besides everything the engine does, it runs work whose writes go into the same
/// `TransactWriteItems` as the record's completion
/// ([`Idempotency::run_in_transaction`]: the work gets a [`DynamoTransaction`] and pushes
/// its writes into it; they are sent, with the completion, when the work returns
/// `Ok(Ok(value))`).
///
/// ```no_run
/// use aws_sdk_dynamodb::types::{AttributeValue, Put};
/// use idempotency_core::{Answer, Error, Fingerprint, Idempotency, IdempotencyKey, Scope};
/// use idempotency_dynamodb::{DynamoIdempotency, DynamoStore};
///
/// # async fn f(store: DynamoStore) -> Result<(), Box<dyn std::error::Error>> {
/// let engine: DynamoIdempotency = Idempotency::builder(store).build()?;
/// let key = IdempotencyKey::new("order-42")?;
/// let scope = Scope::from_parts(["tenant-1", "POST /orders"])?;
/// let fp = Fingerprint::from_bytes(b"A1 x2");
/// let outcome = engine
///     .run_in_transaction(&key, &scope, &fp, |tx, _ctx| {
///         Box::pin(async move {
///             let order = Put::builder()
///                 .table_name("orders")
///                 .item("id", AttributeValue::S("order-42".into()))
///                 .item("sku", AttributeValue::S("A1".into()))
///                 .build()
///                 .map_err(|e| Error::backend(false, e))?;
///             tx.put(order)?; // sent with the completion, or not at all
///             Ok(Ok::<_, String>("order-42".to_owned()))
///         })
///     })
///     .await?;
/// if let Answer::Executed(order) | Answer::Replayed(order) = outcome {
///     println!("order {order:?}");
/// }
/// # Ok(()) }
/// ```
///
/// `M` is what a work's `Err` does to its key: released by default
/// ([`ReleaseErrors`](idempotency_core::ReleaseErrors)), stored on an engine built with
/// `store_errors()` ([`StoreErrors`](idempotency_core::StoreErrors)).
pub type DynamoIdempotency<M = idempotency_core::ReleaseErrors> =
    idempotency_core::Idempotency<DynamoStore, M>;

#[cfg(doc)]
use idempotency_core::Idempotency;
