//! The DynamoDB stand-in the other tests run on, checked against what the store relies on
//! from real DynamoDB, with the raw SDK (no store code): conditional writes that are
//! evaluated against the item as it is and refused with the item in the answer
//! (`ReturnValuesOnConditionCheckFailure = ALL_OLD`), numbers compared as numbers,
//! `TransactWriteItems` all or nothing with a cancellation reason per item, and conditional
//! writes that are atomic under concurrency. If the stand-in stopped doing one of these, the
//! store's own tests could pass for the wrong reason: these fail instead.
#![allow(clippy::unwrap_used)]

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, ConditionCheck, KeySchemaElement, KeyType,
    Put, ReturnConsumedCapacity, ReturnValuesOnConditionCheckFailure, ScalarAttributeType,
    TransactWriteItem, Update,
};
use aws_sdk_dynamodb::Client;
use idempotency_testing::dynamodb as common;
use std::collections::HashMap;
use std::sync::Arc;

/// A table of its own (partition key `pk`, a string), deleted when the guard drops.
async fn table() -> (Client, String, common::TableGuard) {
    let client = common::client();
    let table = format!("idk-standin-{}", uuid::Uuid::new_v4().simple());
    client
        .create_table()
        .table_name(&table)
        .billing_mode(BillingMode::PayPerRequest)
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "no DynamoDB stand-in at {} ({e:?}); start it with `bash .ci/services`",
                common::url()
            )
        });
    let guard = common::TableGuard::for_table(&table);
    (client, table, guard)
}

fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_owned())
}

fn n(v: i64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn item(pk: &str, status: &str, token: i64, expires: i64) -> HashMap<String, AttributeValue> {
    HashMap::from([
        ("pk".to_owned(), s(pk)),
        ("st".to_owned(), s(status)),
        ("tok".to_owned(), n(token)),
        ("exp".to_owned(), n(expires)),
    ])
}

async fn get(client: &Client, table: &str, pk: &str) -> Option<HashMap<String, AttributeValue>> {
    client
        .get_item()
        .table_name(table)
        .key("pk", s(pk))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
}

/// The claim's shape: put unless an item is there and not yet expired.
async fn conditional_put(
    client: &Client,
    table: &str,
    new: HashMap<String, AttributeValue>,
    now: i64,
) -> Result<(), SdkError<PutItemError>> {
    client
        .put_item()
        .table_name(table)
        .set_item(Some(new))
        .condition_expression("attribute_not_exists(pk) OR #exp <= :now")
        .expression_attribute_names("#exp", "exp")
        .expression_attribute_values(":now", n(now))
        .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        .send()
        .await
        .map(|_| ())
}

#[tokio::test]
async fn a_refused_conditional_put_returns_the_item_as_it_is_and_writes_nothing() {
    let (client, table, _guard) = table().await;
    conditional_put(&client, &table, item("k", "pending", 1, 2_000), 1_000)
        .await
        .expect("an absent item is put");

    let refused = conditional_put(&client, &table, item("k", "pending", 2, 3_000), 1_500)
        .await
        .expect_err("a live item refuses the put");
    let Some(PutItemError::ConditionalCheckFailedException(e)) = refused.as_service_error() else {
        panic!("not a condition failure: {refused:?}");
    };
    assert_eq!(
        e.item(),
        Some(&item("k", "pending", 1, 2_000)),
        "ALL_OLD: the refusal carries the item as it is"
    );
    assert_eq!(
        get(&client, &table, "k").await,
        Some(item("k", "pending", 1, 2_000))
    );

    // Numbers are compared as numbers: 10,000 > 2,000 although "10000" < "2000" as text.
    conditional_put(&client, &table, item("k", "pending", 2, 20_000), 10_000)
        .await
        .expect("an expired item is replaced");
    assert_eq!(
        get(&client, &table, "k").await,
        Some(item("k", "pending", 2, 20_000))
    );
    let refused = conditional_put(&client, &table, item("k", "pending", 3, 9_999), 9_999)
        .await
        .expect_err("9,999 is before 20,000");
    assert!(matches!(
        refused.as_service_error(),
        Some(PutItemError::ConditionalCheckFailedException(_))
    ));
}

#[tokio::test]
async fn a_conditional_update_applies_only_on_its_status_and_token() {
    let (client, table, _guard) = table().await;
    conditional_put(&client, &table, item("k", "pending", 7, 2_000), 1_000)
        .await
        .unwrap();
    let complete = |token: i64| {
        client
            .update_item()
            .table_name(&table)
            .key("pk", s("k"))
            .update_expression("SET #st = :done")
            .condition_expression("#st = :pending AND #tok = :tok")
            .expression_attribute_names("#st", "st")
            .expression_attribute_names("#tok", "tok")
            .expression_attribute_values(":done", s("completed"))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":tok", n(token))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
    };
    let fenced = complete(6).await.expect_err("another token is fenced");
    let Some(UpdateItemError::ConditionalCheckFailedException(e)) = fenced.as_service_error()
    else {
        panic!("not a condition failure: {fenced:?}");
    };
    assert_eq!(e.item(), Some(&item("k", "pending", 7, 2_000)));
    assert_eq!(
        get(&client, &table, "k").await,
        Some(item("k", "pending", 7, 2_000))
    );

    complete(7).await.expect("the holder's token applies");
    assert_eq!(
        get(&client, &table, "k").await,
        Some(item("k", "completed", 7, 2_000))
    );
    let again = complete(7).await.expect_err("not pending any more");
    assert!(matches!(
        again.as_service_error(),
        Some(UpdateItemError::ConditionalCheckFailedException(_))
    ));
}

#[tokio::test]
async fn a_cancelled_transaction_writes_nothing_and_says_which_condition_failed() {
    let (client, table, _guard) = table().await;
    conditional_put(&client, &table, item("record", "pending", 3, 2_000), 1_000)
        .await
        .unwrap();
    conditional_put(&client, &table, item("stock", "ok", 0, 2_000), 1_000)
        .await
        .unwrap();
    // A business write, a condition on another item, and the record's fenced completion.
    let transaction = |token: i64, stock_status: &str| {
        client
            .transact_write_items()
            .transact_items(
                TransactWriteItem::builder()
                    .put(
                        Put::builder()
                            .table_name(&table)
                            .set_item(Some(item("order", "new", 0, 2_000)))
                            .condition_expression("attribute_not_exists(pk)")
                            .build()
                            .unwrap(),
                    )
                    .build(),
            )
            .transact_items(
                TransactWriteItem::builder()
                    .condition_check(
                        ConditionCheck::builder()
                            .table_name(&table)
                            .key("pk", s("stock"))
                            .condition_expression("#st = :want")
                            .expression_attribute_names("#st", "st")
                            .expression_attribute_values(":want", s(stock_status))
                            .build()
                            .unwrap(),
                    )
                    .build(),
            )
            .transact_items(
                TransactWriteItem::builder()
                    .update(
                        Update::builder()
                            .table_name(&table)
                            .key("pk", s("record"))
                            .update_expression("SET #st = :done")
                            .condition_expression("#st = :pending AND #tok = :tok")
                            .expression_attribute_names("#st", "st")
                            .expression_attribute_names("#tok", "tok")
                            .expression_attribute_values(":done", s("completed"))
                            .expression_attribute_values(":pending", s("pending"))
                            .expression_attribute_values(":tok", n(token))
                            .return_values_on_condition_check_failure(
                                ReturnValuesOnConditionCheckFailure::AllOld,
                            )
                            .build()
                            .unwrap(),
                    )
                    .build(),
            )
            .send()
    };
    let codes = |e: &SdkError<TransactWriteItemsError>| -> Vec<String> {
        let Some(TransactWriteItemsError::TransactionCanceledException(c)) = e.as_service_error()
        else {
            panic!("not a cancelled transaction: {e:?}");
        };
        c.cancellation_reasons()
            .iter()
            .map(|r| r.code().unwrap_or("").to_owned())
            .collect()
    };

    // The completion is fenced (another token): nothing is written, and the third reason
    // says so, with the record as it is.
    let fenced = transaction(2, "ok").await.expect_err("fenced");
    assert_eq!(codes(&fenced), ["None", "None", "ConditionalCheckFailed"]);
    if let Some(TransactWriteItemsError::TransactionCanceledException(c)) =
        fenced.as_service_error()
    {
        assert_eq!(
            c.cancellation_reasons()[2].item(),
            Some(&item("record", "pending", 3, 2_000)),
            "ALL_OLD on a transaction item: the reason carries the record"
        );
    }
    // A business condition fails: nothing is written either.
    let refused = transaction(3, "sold out").await.expect_err("condition");
    assert_eq!(codes(&refused), ["None", "ConditionalCheckFailed", "None"]);
    assert_eq!(get(&client, &table, "order").await, None);
    assert_eq!(
        get(&client, &table, "record").await,
        Some(item("record", "pending", 3, 2_000))
    );

    // Every condition holds: every write applies.
    transaction(3, "ok").await.expect("applies");
    assert_eq!(
        get(&client, &table, "order").await,
        Some(item("order", "new", 0, 2_000))
    );
    assert_eq!(
        get(&client, &table, "record").await,
        Some(item("record", "completed", 3, 2_000))
    );
}

#[tokio::test]
async fn concurrent_conditional_puts_on_one_key_have_exactly_one_winner() {
    let (client, table, _guard) = table().await;
    let client = Arc::new(client);
    for round in 0..20 {
        let key = format!("k-{round}");
        let racers = (0..16).map(|i| {
            let (client, table, key) = (client.clone(), table.clone(), key.clone());
            tokio::spawn(async move {
                conditional_put(&client, &table, item(&key, "pending", i, 2_000), 1_000).await
            })
        });
        let mut winners = Vec::new();
        for (i, racer) in racers.collect::<Vec<_>>().into_iter().enumerate() {
            match racer.await.unwrap() {
                Ok(()) => winners.push(i as i64),
                Err(e) => assert!(
                    matches!(
                        e.as_service_error(),
                        Some(PutItemError::ConditionalCheckFailedException(_))
                    ),
                    "a loser is refused by the condition: {e:?}"
                ),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        assert_eq!(
            get(&client, &table, &key).await,
            Some(item(&key, "pending", winners[0], 2_000)),
            "round {round}: the item is the winner's"
        );
    }
}

#[tokio::test]
async fn consumed_capacity_is_reported_when_asked_for() {
    let (client, table, _guard) = table().await;
    let put = client
        .put_item()
        .table_name(&table)
        .set_item(Some(item("k", "pending", 1, 2_000)))
        .return_consumed_capacity(ReturnConsumedCapacity::Total)
        .send()
        .await
        .unwrap();
    let consumed = put
        .consumed_capacity()
        .expect("the stand-in reports consumed capacity");
    assert_eq!(consumed.table_name(), Some(table.as_str()));
    assert!(
        consumed.capacity_units().is_some_and(|units| units > 0.0),
        "{consumed:?}"
    );
}
