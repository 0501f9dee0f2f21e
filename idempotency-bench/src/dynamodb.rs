//! The DynamoDB backend (the local stand-in, or `IDEMPOTENCY_BENCH_DYNAMODB_URL`) and its raw
//! baseline on the same server through the same SDK: a conditional `PutItem`
//! (`attribute_not_exists`) then an `UpdateItem` marking it completed with the outcome, and a
//! consistent `GetItem` for replay. Each on a table of its own, deleted at the end.
//!
//! Requests are counted by an SDK interceptor on a second client, by operation, so the
//! report shows which requests each operation makes: DynamoDB bills by request (a write unit
//! per KB of the item written, a strongly consistent read unit per 4 KB read; a conditional
//! write whose condition fails still costs its write units).

use crate::harness::{Backend, Cleanup, Counted, Kind, RawBaseline, RoundTripCounter};
use async_trait::async_trait;
use idempotency_core::store::BoxError;
use idempotency_dynamodb::aws_sdk_dynamodb::config::interceptors::{
    AfterDeserializationInterceptorContextRef, BeforeSerializationInterceptorContextMut,
    BeforeTransmitInterceptorContextRef,
};
use idempotency_dynamodb::aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use idempotency_dynamodb::aws_sdk_dynamodb::operation::{
    get_item::{GetItemInput, GetItemOutput},
    put_item::{PutItemInput, PutItemOutput},
    transact_write_items::{TransactWriteItemsInput, TransactWriteItemsOutput},
    update_item::{UpdateItemInput, UpdateItemOutput},
};
use idempotency_dynamodb::aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, ConsumedCapacity, KeySchemaElement, KeyType,
    ReturnConsumedCapacity, ScalarAttributeType,
};
use idempotency_dynamodb::aws_sdk_dynamodb::{self, Client};
use idempotency_dynamodb::DynamoStore;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// The server: `IDEMPOTENCY_BENCH_DYNAMODB_URL`, or the local stand-in.
pub(crate) fn url() -> String {
    std::env::var("IDEMPOTENCY_BENCH_DYNAMODB_URL")
        .unwrap_or_else(|_| idempotency_testing::dynamodb::url())
}

fn unreachable(e: impl std::fmt::Display) -> BoxError {
    format!(
        "cannot reach DynamoDB at {} ({e}). Start the local stand-in with `bash .ci/services`, \
         or point IDEMPOTENCY_BENCH_DYNAMODB_URL at one.",
        url()
    )
    .into()
}

/// Requests sent, by operation (`PutItem`, …), and the capacity units DynamoDB reported
/// consuming for them: every request is sent with `ReturnConsumedCapacity = TOTAL`, and the
/// units of each answer are added up by operation (in thousandths, as
/// `<operation> reported mCU`). An answer that carries none (a write whose condition failed
/// is answered with an error, which carries no consumed capacity, though DynamoDB bills it)
/// adds nothing.
#[derive(Clone, Debug, Default)]
struct Requests(Arc<Mutex<BTreeMap<String, u64>>>);

impl Requests {
    fn add(&self, what: String, n: u64) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(what)
            .or_default() += n;
    }
}

/// Thousandths of a capacity unit.
fn milli_units(c: &ConsumedCapacity) -> u64 {
    (c.capacity_units().unwrap_or(0.0) * 1000.0).round() as u64
}

impl Intercept for Requests {
    fn name(&self) -> &'static str {
        "Requests"
    }

    fn modify_before_serialization(
        &self,
        context: &mut BeforeSerializationInterceptorContextMut<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let input = context.input_mut();
        let total = Some(ReturnConsumedCapacity::Total);
        if let Some(i) = input.downcast_mut::<PutItemInput>() {
            i.return_consumed_capacity = total;
        } else if let Some(i) = input.downcast_mut::<UpdateItemInput>() {
            i.return_consumed_capacity = total;
        } else if let Some(i) = input.downcast_mut::<GetItemInput>() {
            i.return_consumed_capacity = total;
        } else if let Some(i) = input.downcast_mut::<TransactWriteItemsInput>() {
            i.return_consumed_capacity = total;
        }
        Ok(())
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let operation = context
            .request()
            .headers()
            .get("x-amz-target")
            .and_then(|t| t.rsplit('.').next())
            .unwrap_or("?")
            .to_owned();
        self.add(operation, 1);
        Ok(())
    }

    fn read_after_deserialization(
        &self,
        context: &AfterDeserializationInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let Ok(output) = context.output_or_error() else {
            return Ok(());
        };
        let reported = if let Some(o) = output.downcast_ref::<PutItemOutput>() {
            o.consumed_capacity().map(|c| ("PutItem", milli_units(c)))
        } else if let Some(o) = output.downcast_ref::<UpdateItemOutput>() {
            o.consumed_capacity()
                .map(|c| ("UpdateItem", milli_units(c)))
        } else if let Some(o) = output.downcast_ref::<GetItemOutput>() {
            o.consumed_capacity().map(|c| ("GetItem", milli_units(c)))
        } else if let Some(o) = output.downcast_ref::<TransactWriteItemsOutput>() {
            let units = o.consumed_capacity().iter().map(milli_units).sum();
            Some(("TransactWriteItems", units))
        } else {
            None
        };
        if let Some((operation, units)) = reported {
            self.add(format!("{operation} reported mCU"), units);
        }
        Ok(())
    }
}

#[async_trait]
impl RoundTripCounter for Requests {
    async fn count(&self) -> Result<u64, BoxError> {
        Ok(self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(what, _)| !what.ends_with(" reported mCU"))
            .map(|(_, n)| n)
            .sum())
    }

    async fn detail(&self) -> Result<Vec<(String, u64)>, BoxError> {
        Ok(self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect())
    }
}

/// The store's table and the raw one, deleted with the guard.
struct Tables {
    records: String,
    raw: String,
    _cleanup: Cleanup,
}

async fn create_raw_table(client: &Client, table: &str) -> Result<(), BoxError> {
    client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("k")
                .key_type(KeyType::Hash)
                .build()?,
        )
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("k")
                .attribute_type(ScalarAttributeType::S)
                .build()?,
        )
        .send()
        .await
        .map_err(|e| unreachable(aws_sdk_dynamodb::error::DisplayErrorContext(e)))?;
    Ok(())
}

struct RawDynamo {
    client: Client,
    table: String,
}

#[async_trait]
impl RawBaseline for RawDynamo {
    async fn new_key_cycle(&self, key: &str, outcome: &[u8]) -> Result<(), BoxError> {
        self.client
            .put_item()
            .table_name(&self.table)
            .item("k", AttributeValue::S(key.to_owned()))
            .item("status", AttributeValue::S("pending".to_owned()))
            .condition_expression("attribute_not_exists(k)")
            .send()
            .await?;
        self.client
            .update_item()
            .table_name(&self.table)
            .key("k", AttributeValue::S(key.to_owned()))
            .update_expression("SET #s = :c, outcome = :o")
            .expression_attribute_names("#s", "status")
            .expression_attribute_values(":c", AttributeValue::S("completed".to_owned()))
            .expression_attribute_values(":o", AttributeValue::B(outcome.to_vec().into()))
            .send()
            .await?;
        Ok(())
    }

    async fn replay(&self, key: &str) -> Result<Option<Vec<u8>>, BoxError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("k", AttributeValue::S(key.to_owned()))
            .consistent_read(true)
            .send()
            .await?;
        Ok(out
            .item
            .and_then(|i| i.get("outcome").cloned())
            .and_then(|o| o.as_b().ok().map(|b| b.as_ref().to_vec())))
    }
}

fn store(client: Client, table: &str) -> Result<DynamoStore, BoxError> {
    Ok(DynamoStore::builder().table(table).build(client)?)
}

async fn backend() -> Result<(Backend, Tables), BoxError> {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let (records, raw) = (
        format!("idk-bench-{}", &id[..16]),
        format!("idk-bench-raw-{}", &id[..16]),
    );
    let client = idempotency_testing::dynamodb::client_at(&url());
    let measured = store(client.clone(), &records)?;
    measured.create_table().await.map_err(unreachable)?;
    create_raw_table(&client, &raw).await?;
    let cleanup = {
        let (client, records, raw) = (client.clone(), records.clone(), raw.clone());
        Cleanup::new(move || async move {
            for table in [records, raw] {
                client.delete_table().table_name(table).send().await?;
            }
            Ok(())
        })
    };
    let requests = Requests::default();
    let counted_client = Client::from_conf(
        client
            .config()
            .to_builder()
            .interceptor(requests.clone())
            .build(),
    );
    let tables = Tables {
        records: records.clone(),
        raw: raw.clone(),
        _cleanup: cleanup,
    };
    Ok((
        Backend {
            name: "dynamodb",
            store: Arc::new(measured),
            raw: Arc::new(RawDynamo {
                client,
                table: tables.raw.clone(),
            }),
            round_trips: Some(Counted {
                store: Arc::new(store(counted_client.clone(), &tables.records)?),
                raw: Arc::new(RawDynamo {
                    client: counted_client,
                    table: tables.raw.clone(),
                }),
                counter: Arc::new(requests),
                method: "requests counted by an SDK interceptor, by operation",
                floor: None,
            }),
            limit: None,
        },
        tables,
    ))
}

/// DynamoDB in the bench (no scaling table).
pub(crate) const KIND: Kind = Kind {
    name: "dynamodb",
    make: |_| {
        Box::pin(async {
            let (b, tables) = backend().await?;
            Ok(vec![(b, Box::new(tables) as Box<dyn std::any::Any>)])
        })
    },
    scaling: None,
};
