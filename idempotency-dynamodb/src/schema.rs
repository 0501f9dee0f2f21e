//! [`DynamoStore::create_table`] and [`DynamoStore::verify`].

use crate::error::{sdk_error, Effect};
use crate::{DynamoError, DynamoStore};
use aws_sdk_dynamodb::operation::describe_table::DescribeTableOutput;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType, TableStatus,
    TimeToLiveSpecification, TimeToLiveStatus,
};
use idempotency_core::Error;
use std::time::Duration;

impl DynamoStore {
    /// Creates the table (on-demand capacity, the key attribute as its partition key of type
    /// `S`) and turns DynamoDB's TTL on for the TTL attribute, then waits until the table is
    /// active. For tests and local use: in production, declare the table with the rest of
    /// your infrastructure and call [`DynamoStore::verify`] at start-up.
    pub async fn create_table(&self) -> Result<(), Error> {
        let names = &self.names;
        self.client
            .create_table()
            .table_name(&names.table)
            .billing_mode(BillingMode::PayPerRequest)
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(&names.key)
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(|e| Error::backend(false, e))?,
            )
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name(&names.key)
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .map_err(|e| Error::backend(false, e))?,
            )
            .send()
            .await
            .map_err(|e| sdk_error("CreateTable", e, Effect::Repeatable))?;
        for _ in 0..600 {
            let table = self.describe().await?;
            if table.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.client
            .update_time_to_live()
            .table_name(&names.table)
            .time_to_live_specification(
                TimeToLiveSpecification::builder()
                    .attribute_name(&names.ttl)
                    .enabled(true)
                    .build()
                    .map_err(|e| Error::backend(false, e))?,
            )
            .send()
            .await
            .map_err(|e| sdk_error("UpdateTimeToLive", e, Effect::Repeatable))?;
        Ok(())
    }

    /// Checks the table: its only key is the key attribute, a partition key of type `S`,
    /// and DynamoDB's TTL is on for the TTL attribute. The problem is a
    /// [`DynamoError::Schema`].
    pub async fn verify(&self) -> Result<(), Error> {
        let names = &self.names;
        let problem = |problem: String| -> Error {
            DynamoError::Schema {
                table: names.table.clone(),
                problem,
            }
            .into()
        };
        let described = self.describe().await?;
        let table = described
            .table()
            .ok_or_else(|| problem("DescribeTable returned no table".into()))?;
        let keys = table.key_schema();
        let hash_on_key = keys.len() == 1
            && keys[0].attribute_name() == names.key
            && keys[0].key_type() == &KeyType::Hash;
        if !hash_on_key {
            return Err(problem(format!(
                "its key schema must be one partition (HASH) key {:?}, not {:?}",
                names.key, keys
            )));
        }
        let key_type = table
            .attribute_definitions()
            .iter()
            .find(|d| d.attribute_name() == names.key)
            .map(|d| d.attribute_type().clone());
        if key_type != Some(ScalarAttributeType::S) {
            return Err(problem(format!(
                "its key {:?} must be of type S (string), not {:?}",
                names.key, key_type
            )));
        }
        let ttl = self
            .client
            .describe_time_to_live()
            .table_name(&names.table)
            .send()
            .await
            .map_err(|e| sdk_error("DescribeTimeToLive", e, Effect::Repeatable))?;
        let description = ttl.time_to_live_description();
        let status = description.and_then(|d| d.time_to_live_status());
        let attribute = description.and_then(|d| d.attribute_name());
        let on = matches!(
            status,
            Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
        );
        if !on || attribute != Some(names.ttl.as_str()) {
            return Err(problem(format!(
                "DynamoDB's TTL must be on for attribute {:?} (found {:?} on {:?}); without it \
                 expired records are never deleted (they still read as absent)",
                names.ttl, status, attribute
            )));
        }
        Ok(())
    }

    async fn describe(&self) -> Result<DescribeTableOutput, Error> {
        self.client
            .describe_table()
            .table_name(&self.names.table)
            .send()
            .await
            .map_err(|e| sdk_error("DescribeTable", e, Effect::Repeatable))
    }
}
