//! The books in DynamoDB, in a table beside the idempotency records' table: one item per
//! book (`id`, the members, `version`, `created_at`). A create and its key's completion are
//! one `TransactWriteItems`; a conditional update is one `UpdateItem` conditioned on the
//! version read.

use crate::book::{Book, BookInput};
use crate::repo::{RepoError, Versioned};
use idempotency_dynamodb::aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, Put,
    ScalarAttributeType,
};
use idempotency_dynamodb::aws_sdk_dynamodb::{self, Client};
use idempotency_dynamodb::DynamoStore;
use std::collections::HashMap;

type Item = HashMap<String, AttributeValue>;

/// The books table in DynamoDB, and the records' store whose completion joins a create.
#[derive(Clone, Debug)]
pub(crate) struct DynamoBooks {
    client: Client,
    table: String,
    records: DynamoStore,
}

fn sdk(e: impl std::error::Error + Send + Sync + 'static) -> RepoError {
    RepoError::Dynamo(aws_sdk_dynamodb::error::DisplayErrorContext(e).to_string())
}

fn n(v: impl ToString) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

impl DynamoBooks {
    /// The books in `table` (created when missing, on-demand capacity, key `id`), on the
    /// records' client.
    pub(crate) async fn open(records: DynamoStore, table: String) -> Result<Self, RepoError> {
        let client = records.client().clone();
        let exists = client.describe_table().table_name(&table).send().await;
        if exists.is_err() {
            let created = client
                .create_table()
                .table_name(&table)
                .billing_mode(BillingMode::PayPerRequest)
                .key_schema(
                    KeySchemaElement::builder()
                        .attribute_name("id")
                        .key_type(KeyType::Hash)
                        .build()
                        .map_err(sdk)?,
                )
                .attribute_definitions(
                    AttributeDefinition::builder()
                        .attribute_name("id")
                        .attribute_type(ScalarAttributeType::S)
                        .build()
                        .map_err(sdk)?,
                )
                .send()
                .await;
            // Another instance starting at once may have created it: only a table that is
            // still missing is an error.
            if let Err(e) = created {
                if client
                    .describe_table()
                    .table_name(&table)
                    .send()
                    .await
                    .is_err()
                {
                    return Err(sdk(e));
                }
            }
        }
        Ok(Self {
            client,
            table,
            records,
        })
    }

    /// The conditional put of a new book: its id must be free.
    pub(crate) fn put(&self, book: &Book) -> Result<Put, RepoError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let mut put = Put::builder()
            .table_name(&self.table)
            .item("id", s(&book.id))
            .item("title", s(&book.input.title))
            .item("author", s(&book.input.author))
            .item("year", n(book.input.year))
            .item("version", n(1))
            .item("created_at", n(now))
            .condition_expression("attribute_not_exists(id)");
        if let Some(summary) = &book.input.summary {
            put = put.item("summary", s(summary));
        }
        put.build().map_err(sdk)
    }

    pub(crate) async fn create(&self, book: &Book) -> Result<(), RepoError> {
        let put = self.put(book)?;
        self.client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(put.item))
            .condition_expression("attribute_not_exists(id)")
            .send()
            .await
            .map_err(sdk)?;
        Ok(())
    }

    /// The book's put and the key's completion in one `TransactWriteItems`.
    /// The records' store, whose completion joins a create's transaction.
    pub(crate) fn records(&self) -> &DynamoStore {
        &self.records
    }

    pub(crate) async fn get(&self, id: &str) -> Result<Option<Versioned>, RepoError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("id", s(id))
            .consistent_read(true)
            .send()
            .await
            .map_err(sdk)?;
        out.item.map(|item| versioned(&item)).transpose()
    }

    /// Every book, oldest first (by `created_at`, then id).
    pub(crate) async fn list(&self) -> Result<Vec<Book>, RepoError> {
        let mut rows = Vec::new();
        let mut start = None;
        loop {
            let page = self
                .client
                .scan()
                .table_name(&self.table)
                .consistent_read(true)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(sdk)?;
            for item in page.items() {
                rows.push((number::<i64>(item, "created_at")?, versioned(item)?.book));
            }
            match page.last_evaluated_key {
                Some(k) if !k.is_empty() => start = Some(k),
                _ => break,
            }
        }
        rows.sort_by(|(a, x), (b, y)| a.cmp(b).then_with(|| x.id.cmp(&y.id)));
        Ok(rows.into_iter().map(|(_, book)| book).collect())
    }

    /// Replaces the book if it is still at `version`: one `UpdateItem` conditioned on it.
    /// `false` when the condition failed (changed meanwhile, or gone).
    pub(crate) async fn update_if(&self, book: &Book, version: i64) -> Result<bool, RepoError> {
        let mut set = "SET title = :t, author = :a, #y = :y, version = version + :one".to_owned();
        let mut request = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("id", s(&book.id))
            .condition_expression("version = :v")
            .expression_attribute_names("#y", "year")
            .expression_attribute_values(":t", s(&book.input.title))
            .expression_attribute_values(":a", s(&book.input.author))
            .expression_attribute_values(":y", n(book.input.year))
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":v", n(version));
        match &book.input.summary {
            Some(summary) => {
                set.push_str(", summary = :s");
                request = request.expression_attribute_values(":s", s(summary));
            }
            None => set.push_str(" REMOVE summary"),
        }
        match request.update_expression(set).send().await {
            Ok(_) => Ok(true),
            Err(aws_sdk_dynamodb::error::SdkError::ServiceError(e))
                if e.err().is_conditional_check_failed_exception() =>
            {
                Ok(false)
            }
            Err(e) => Err(sdk(e)),
        }
    }
}

fn text(item: &Item, name: &str) -> Result<String, RepoError> {
    match item.get(name) {
        Some(AttributeValue::S(v)) => Ok(v.clone()),
        other => Err(RepoError::Dynamo(format!(
            "book attribute {name} is {other:?}, not a string"
        ))),
    }
}

fn number<T: std::str::FromStr>(item: &Item, name: &str) -> Result<T, RepoError> {
    match item.get(name) {
        Some(AttributeValue::N(v)) => v
            .parse()
            .map_err(|_| RepoError::Dynamo(format!("book attribute {name} is out of range: {v}"))),
        other => Err(RepoError::Dynamo(format!(
            "book attribute {name} is {other:?}, not a number"
        ))),
    }
}

fn versioned(item: &Item) -> Result<Versioned, RepoError> {
    let summary = match item.get("summary") {
        None => None,
        Some(_) => Some(text(item, "summary")?),
    };
    Ok(Versioned {
        book: Book::new(
            text(item, "id")?,
            BookInput {
                title: text(item, "title")?,
                author: text(item, "author")?,
                year: number(item, "year")?,
                summary,
            },
        ),
        version: number(item, "version")?,
    })
}
