//! Decoding a record row: every stored value is checked, and one this crate would never write
//! is reported as corrupt, never trusted.

use crate::error::{map_sqlx, Effect};
use idempotency_core::store::{Failure, Record, RecordStatus, Timestamp};
use idempotency_core::{Error, FencingToken, Fingerprint, RecordId};
use sqlx::mysql::MySqlRow;
use sqlx::Row;

/// The position of each column in a record row (`sql::RECORD_COLUMNS`, then what the claim
/// adds). Rows are read by position: sqlx names a row's columns after the prepared
/// statement's metadata, and MariaDB prepares `INSERT … RETURNING` without describing its
/// result columns, so names would not be found in the claim's rows.
pub(crate) mod col {
    pub(crate) const FINGERPRINT: usize = 0;
    pub(crate) const STATUS: usize = 1;
    pub(crate) const TOKEN: usize = 2;
    pub(crate) const LEASE_UNTIL_MS: usize = 3;
    pub(crate) const OUTCOME: usize = 4;
    pub(crate) const ATTEMPTS: usize = 5;
    pub(crate) const FAILURE_RETRYABLE: usize = 6;
    pub(crate) const FAILURE_MESSAGE: usize = 7;
    pub(crate) const HITS: usize = 8;
    pub(crate) const CREATED_MS: usize = 9;
    pub(crate) const UPDATED_MS: usize = 10;
    pub(crate) const EXPIRES_MS: usize = 11;
    /// The claim's: the nonce of the claim that wrote the record.
    pub(crate) const CLAIM_NONCE: usize = 12;
    /// The claim's: the statement's `now`.
    pub(crate) const NOW_MS: usize = 13;
}

pub(crate) fn get<'r, T>(row: &'r MySqlRow, col: usize, table: &str) -> Result<T, Error>
where
    T: sqlx::Decode<'r, sqlx::MySql> + sqlx::Type<sqlx::MySql>,
{
    row.try_get(col)
        .map_err(|e| map_sqlx(e, table, Effect::None))
}

fn non_negative<T: TryFrom<i64>>(v: i64, what: &str, id: &RecordId) -> Result<T, Error> {
    T::try_from(v).map_err(|_| Error::corrupt(format!("record {id} has {what} = {v}")))
}

fn text(bytes: Vec<u8>, what: &str, id: &RecordId) -> Result<String, Error> {
    String::from_utf8(bytes)
        .map_err(|_| Error::corrupt(format!("record {id} has a {what} that is not UTF-8")))
}

/// Decodes a record row (the columns of `sql::RECORD_COLUMNS`), checking what the database
/// cannot: a stored value this crate did not write is reported as corrupt, never trusted.
pub(crate) fn decode_record(row: &MySqlRow, id: &RecordId, table: &str) -> Result<Record, Error> {
    let fingerprint: Vec<u8> = get(row, col::FINGERPRINT, table)?;
    let fingerprint = Fingerprint::from_slice(&fingerprint).ok_or_else(|| {
        Error::corrupt(format!(
            "record {id} has a {}-byte fingerprint (expected 32)",
            fingerprint.len()
        ))
    })?;
    // Text columns are read as bytes: with a binary collation (`_bin`) MySQL describes them
    // as binary strings, which sqlx will not decode as `String`.
    let status = text(get::<Vec<u8>>(row, col::STATUS, table)?, "status", id)?;
    let status = RecordStatus::parse(&status)
        .ok_or_else(|| Error::corrupt(format!("record {id} has unknown status {status:?}")))?;
    let token: u64 = non_negative(get::<i64>(row, col::TOKEN, table)?, "token", id)?;
    let outcome: Option<Vec<u8>> = get(row, col::OUTCOME, table)?;
    let retryable = match get::<Option<i8>>(row, col::FAILURE_RETRYABLE, table)? {
        None => None,
        Some(0) => Some(false),
        Some(1) => Some(true),
        Some(v) => {
            return Err(Error::corrupt(format!(
                "record {id} has failure_retryable = {v} (expected 0 or 1)"
            )))
        }
    };
    let failure = match (
        retryable,
        get::<Option<Vec<u8>>>(row, col::FAILURE_MESSAGE, table)?
            .map(|m| text(m, "failure_message", id))
            .transpose()?,
    ) {
        (Some(retryable), Some(message)) => Some(Failure { retryable, message }),
        (None, None) => None,
        _ => {
            return Err(Error::corrupt(format!(
                "record {id} has half of a failure (retryable and message must be set together)"
            )))
        }
    };
    let ts = |c: usize| get::<i64>(row, c, table).map(Timestamp::from_millis);
    let record = Record {
        id: id.clone(),
        fingerprint,
        status,
        token: FencingToken(token),
        lease_until: get::<Option<i64>>(row, col::LEASE_UNTIL_MS, table)?
            .map(Timestamp::from_millis),
        outcome,
        attempts: non_negative(
            get::<i32>(row, col::ATTEMPTS, table)?.into(),
            "attempts",
            id,
        )?,
        failure,
        hits: non_negative(get::<i64>(row, col::HITS, table)?, "hits", id)?,
        created_at: ts(col::CREATED_MS)?,
        updated_at: ts(col::UPDATED_MS)?,
        expires_at: ts(col::EXPIRES_MS)?,
    };
    record.validate()?;
    Ok(record)
}
