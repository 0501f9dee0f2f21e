//! The local DynamoDB stand-in the DynamoDB store's tests run against, and a table per test.

use idempotency_core::{Clock, Error};
use idempotency_dynamodb::aws_sdk_dynamodb::{
    self,
    config::{BehaviorVersion, Credentials, Region},
};
use idempotency_dynamodb::DynamoStore;
use std::sync::Arc;

/// The stand-in's URL: `IDEMPOTENCY_TEST_DYNAMODB_URL`, by default moto's server as
/// `bash .ci/services` starts it.
pub fn url() -> String {
    std::env::var("IDEMPOTENCY_TEST_DYNAMODB_URL")
        .unwrap_or_else(|_| "http://127.0.0.1:8000".to_owned())
}

/// An SDK client for the stand-in: plain HTTP, fixed test credentials.
pub fn client() -> aws_sdk_dynamodb::Client {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url())
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

/// Deletes its table when dropped.
#[derive(Debug)]
pub struct TableGuard {
    client: aws_sdk_dynamodb::Client,
    table: String,
}

impl TableGuard {
    /// A guard for `table` on the stand-in, which something else creates (or has created).
    pub fn for_table(table: impl Into<String>) -> Self {
        Self {
            client: client(),
            table: table.into(),
        }
    }
}

impl Drop for TableGuard {
    fn drop(&mut self) {
        let client = self.client.clone();
        let table = std::mem::take(&mut self.table);
        // Best effort, off the dropping thread (which may be inside a runtime).
        std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                let _ = rt.block_on(client.delete_table().table_name(table).send());
            }
        });
    }
}

/// A store on a new table of its own (created, TTL on), on `clock`.
pub async fn store(clock: Arc<dyn Clock>) -> Result<(DynamoStore, TableGuard), Error> {
    let client = client();
    let table = format!("idk-test-{}", uuid::Uuid::new_v4().simple());
    let store = DynamoStore::builder()
        .table(&table)
        .clock(clock)
        .build(client.clone())?;
    store.create_table().await.map_err(|e| {
        Error::Config(format!(
            "cannot create a table on the DynamoDB stand-in at {} ({e}); start it with \
             `bash .ci/services`",
            url()
        ))
    })?;
    Ok((store, TableGuard { client, table }))
}
