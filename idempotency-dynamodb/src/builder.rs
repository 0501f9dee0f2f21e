//! [`DynamoStoreBuilder`]: the table, its attribute names, the clock and the timeouts.

use crate::names::Names;
use crate::{DynamoError, DynamoStore};
use idempotency_core::store::{Clock, SystemClock};
use std::sync::Arc;
use std::time::Duration;

/// How long a request may go unanswered before the store gives up on it, by default.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long after its logical expiry a record's TTL attribute lets DynamoDB delete it, by
/// default. DynamoDB deletes expired items within days anyway; the store never reads an
/// expired record as live, whatever is still stored.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(3600);

/// Builds a [`DynamoStore`]: `DynamoStore::builder().table("idempotency").build(client)`.
#[derive(Clone, Debug)]
pub struct DynamoStoreBuilder {
    table: String,
    key: String,
    ttl: String,
    clock: Arc<dyn Clock>,
    response_timeout: Duration,
    retention: Duration,
}

impl Default for DynamoStoreBuilder {
    fn default() -> Self {
        Self {
            table: "idempotency".to_owned(),
            key: "pk".to_owned(),
            ttl: "ttl".to_owned(),
            clock: Arc::new(SystemClock),
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            retention: DEFAULT_RETENTION,
        }
    }
}

impl DynamoStoreBuilder {
    /// The table (default `idempotency`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The table's partition key attribute, of type `S` (default `pk`).
    pub fn key_attribute(mut self, name: impl Into<String>) -> Self {
        self.key = name.into();
        self
    }

    /// The attribute the table's TTL is set on (default `ttl`): the store writes a record's
    /// physical expiry there, in epoch seconds.
    pub fn ttl_attribute(mut self, name: impl Into<String>) -> Self {
        self.ttl = name.into();
        self
    }

    /// The clock leases and expiries are decided on (default: the system clock). DynamoDB
    /// has no clock a condition can read, so this is the application's: see the crate
    /// documentation on clock skew.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// How long a request may go unanswered (default 30 s). Past it, a holder's write is
    /// [`idempotency_core::Error::OutcomeUnknown`] and anything else a retryable error.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long after a record's logical expiry DynamoDB's TTL may delete it (default one
    /// hour).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The store on `client` (built with `aws-config`, or pointed at a local endpoint).
    pub fn build(self, client: aws_sdk_dynamodb::Client) -> Result<DynamoStore, DynamoError> {
        Ok(DynamoStore {
            client,
            names: Arc::new(Names::new(self.table, self.key, self.ttl)?),
            clock: self.clock,
            response_timeout: self.response_timeout,
            retention: self.retention,
            purge_cursor: Arc::default(),
        })
    }
}
