//! The table's name and the two attribute names that belong to the table's definition.

use crate::decode::RECORD_ATTRIBUTES;
use crate::DynamoError;

/// The table and its key and TTL attribute names, validated.
#[derive(Clone, Debug)]
pub(crate) struct Names {
    pub(crate) table: String,
    /// The partition key attribute (type `S`).
    pub(crate) key: String,
    /// The attribute DynamoDB's TTL deletes by (epoch seconds).
    pub(crate) ttl: String,
}

impl Names {
    pub(crate) fn new(table: String, key: String, ttl: String) -> Result<Self, DynamoError> {
        let valid_table = (3..=255).contains(&table.len())
            && table
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'));
        if !valid_table {
            return Err(DynamoError::TableName(table));
        }
        for name in [&key, &ttl] {
            if name.is_empty() || name.len() > 255 {
                return Err(DynamoError::AttributeName {
                    name: name.clone(),
                    why: "an attribute name is 1 to 255 bytes",
                });
            }
            if RECORD_ATTRIBUTES.contains(&name.as_str()) {
                return Err(DynamoError::AttributeName {
                    name: name.clone(),
                    why: "the store writes a record field under this name",
                });
            }
        }
        if key == ttl {
            return Err(DynamoError::AttributeName {
                name: key,
                why: "the key and the TTL attribute must differ",
            });
        }
        Ok(Self { table, key, ttl })
    }
}
