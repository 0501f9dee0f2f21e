//! A record as a DynamoDB item, and an item back into a record with every attribute checked.

use crate::names::Names;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use idempotency_core::store::{Failure, Record, RecordStatus, Timestamp};
use idempotency_core::{Error, FencingToken, Fingerprint, RecordId};
use std::collections::HashMap;

/// An item as the SDK carries it.
pub(crate) type Item = HashMap<String, AttributeValue>;

// The record's attributes (the key and TTL attributes are the table's, and configurable).
pub(crate) const STATUS: &str = "idk_status";
pub(crate) const TOKEN: &str = "idk_token";
pub(crate) const ATTEMPTS: &str = "idk_attempts";
pub(crate) const HITS: &str = "idk_hits";
pub(crate) const LEASE: &str = "idk_lease_until";
pub(crate) const FINGERPRINT: &str = "idk_fingerprint";
pub(crate) const OUTCOME: &str = "idk_outcome";
pub(crate) const FAILURE: &str = "idk_failure";
pub(crate) const RETRYABLE: &str = "idk_retryable";
pub(crate) const CREATED: &str = "idk_created_at";
pub(crate) const UPDATED: &str = "idk_updated_at";
pub(crate) const EXPIRES: &str = "idk_expires_at";
/// Written by each claim and reclaim: how a request sent again knows its own write.
pub(crate) const NONCE: &str = "idk_nonce";

/// Every attribute name the store writes besides the key and the TTL attribute.
pub(crate) const RECORD_ATTRIBUTES: [&str; 13] = [
    STATUS,
    TOKEN,
    ATTEMPTS,
    HITS,
    LEASE,
    FINGERPRINT,
    OUTCOME,
    FAILURE,
    RETRYABLE,
    CREATED,
    UPDATED,
    EXPIRES,
    NONCE,
];

/// DynamoDB's item size limit: names and values, in bytes.
pub(crate) const MAX_ITEM_BYTES: usize = 400 * 1024;

/// The largest outcome (or failure message) a record holds: the item limit less room for the
/// key (a scope of up to 1024 bytes and a key of up to 255), the attribute names and the
/// numbers.
pub const MAX_OUTCOME_BYTES: usize = MAX_ITEM_BYTES - 4 * 1024;

pub(crate) fn status_number(status: RecordStatus) -> u8 {
    match status {
        RecordStatus::Pending => 1,
        RecordStatus::Completed => 2,
        RecordStatus::Failed => 3,
    }
}

pub(crate) fn n(v: impl ToString) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

pub(crate) fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

pub(crate) fn b(v: impl Into<Vec<u8>>) -> AttributeValue {
    AttributeValue::B(Blob::new(v))
}

/// The partition key of a record: the scope, a unit separator (U+001F, a control character
/// neither a scope nor a key may hold), then the key; so the pair maps to one string and
/// back, byte for byte.
pub(crate) fn partition_key(id: &RecordId) -> String {
    let mut k = String::with_capacity(id.scope.as_str().len() + 1 + id.key.as_str().len());
    k.push_str(id.scope.as_str());
    k.push('\u{1f}');
    k.push_str(id.key.as_str());
    k
}

/// An item back into a record of `id`, every attribute checked, then
/// [`Record::validate`]d. Corrupt data is [`Error::CorruptRecord`], never a panic.
pub(crate) fn record(names: &Names, id: &RecordId, item: &Item) -> Result<Record, Error> {
    let key = string(item, &names.key)?;
    if key != partition_key(id) {
        return Err(Error::corrupt(format!(
            "the item's key {key:?} is not the record's"
        )));
    }
    let status = match number::<u8>(item, STATUS)? {
        1 => RecordStatus::Pending,
        2 => RecordStatus::Completed,
        3 => RecordStatus::Failed,
        other => {
            return Err(Error::corrupt(format!(
                "status {other} is not a record state"
            )))
        }
    };
    let fingerprint = Fingerprint::from_slice(blob(item, FINGERPRINT)?)
        .ok_or_else(|| Error::corrupt("the fingerprint is not 32 bytes"))?;
    let failure = match optional(item, FAILURE) {
        None => None,
        Some(_) => Some(Failure {
            message: string(item, FAILURE)?.to_owned(),
            retryable: match item.get(RETRYABLE) {
                Some(AttributeValue::Bool(b)) => *b,
                _ => return Err(Error::corrupt(format!("{RETRYABLE} is not a boolean"))),
            },
        }),
    };
    let record = Record {
        id: id.clone(),
        fingerprint,
        status,
        token: FencingToken(number(item, TOKEN)?),
        lease_until: match optional(item, LEASE) {
            None => None,
            Some(_) => Some(time(item, LEASE)?),
        },
        outcome: match optional(item, OUTCOME) {
            None => None,
            Some(_) => Some(blob(item, OUTCOME)?.to_vec()),
        },
        attempts: number(item, ATTEMPTS)?,
        failure,
        hits: number(item, HITS)?,
        created_at: time(item, CREATED)?,
        updated_at: time(item, UPDATED)?,
        expires_at: time(item, EXPIRES)?,
    };
    record.validate()?;
    Ok(record)
}

fn optional<'i>(item: &'i Item, name: &str) -> Option<&'i AttributeValue> {
    item.get(name)
        .filter(|v| !matches!(v, AttributeValue::Null(_)))
}

fn string<'i>(item: &'i Item, name: &str) -> Result<&'i str, Error> {
    match item.get(name) {
        Some(AttributeValue::S(s)) => Ok(s),
        Some(_) => Err(Error::corrupt(format!("{name} is not a string"))),
        None => Err(Error::corrupt(format!("{name} is missing"))),
    }
}

fn blob<'i>(item: &'i Item, name: &str) -> Result<&'i [u8], Error> {
    match item.get(name) {
        Some(AttributeValue::B(b)) => Ok(b.as_ref()),
        Some(_) => Err(Error::corrupt(format!("{name} is not binary"))),
        None => Err(Error::corrupt(format!("{name} is missing"))),
    }
}

pub(crate) fn number<T: std::str::FromStr>(item: &Item, name: &str) -> Result<T, Error>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    match item.get(name) {
        Some(AttributeValue::N(n)) => n
            .parse()
            .map_err(|e| Error::corrupt_with(format!("{name} = {n} is out of range"), e)),
        Some(_) => Err(Error::corrupt(format!("{name} is not a number"))),
        None => Err(Error::corrupt(format!("{name} is missing"))),
    }
}

fn time(item: &Item, name: &str) -> Result<Timestamp, Error> {
    Ok(Timestamp::from_millis(number::<i64>(item, name)?))
}

/// The nonce a claim or reclaim wrote, if any.
pub(crate) fn nonce(item: &Item) -> Option<&str> {
    match item.get(NONCE) {
        Some(AttributeValue::S(s)) => Some(s),
        _ => None,
    }
}
