//! Decoding a record row: every stored value is checked, and one this crate would never write
//! is reported as corrupt, never trusted.

use crate::error::{map_sqlx, Effect};
use idempotency_core::store::{Failure, Record, RecordStatus, Timestamp};
use idempotency_core::{Error, FencingToken, Fingerprint, RecordId};
use sqlx::postgres::PgRow;
use sqlx::Row;

pub(crate) fn get<'r, T>(row: &'r PgRow, col: &str, table: &str) -> Result<T, Error>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(col)
        .map_err(|e| map_sqlx(e, table, Effect::None))
}

fn non_negative<T: TryFrom<i64>>(v: i64, what: &str, id: &RecordId) -> Result<T, Error> {
    T::try_from(v).map_err(|_| Error::corrupt(format!("record {id} has {what} = {v}")))
}

/// Decodes a record row (the columns of `sql::record_columns`), checking what the database
/// cannot: a stored value this crate did not write is reported as corrupt, never trusted.
pub(crate) fn decode_record(row: &PgRow, id: &RecordId, table: &str) -> Result<Record, Error> {
    let fingerprint: Vec<u8> = get(row, "fingerprint", table)?;
    let fingerprint = Fingerprint::from_slice(&fingerprint).ok_or_else(|| {
        Error::corrupt(format!(
            "record {id} has a {}-byte fingerprint (expected 32)",
            fingerprint.len()
        ))
    })?;
    let status: String = get(row, "status", table)?;
    let status = RecordStatus::parse(&status)
        .ok_or_else(|| Error::corrupt(format!("record {id} has unknown status {status:?}")))?;
    let token: i64 = get(row, "token", table)?;
    let token: u64 = non_negative(token, "token", id)?;
    let outcome: Option<Vec<u8>> = get(row, "outcome", table)?;
    let failure = match (
        get::<Option<bool>>(row, "failure_retryable", table)?,
        get::<Option<String>>(row, "failure_message", table)?,
    ) {
        (Some(retryable), Some(message)) => Some(Failure { retryable, message }),
        (None, None) => None,
        _ => {
            return Err(Error::corrupt(format!(
                "record {id} has half of a failure (retryable and message must be set together)"
            )))
        }
    };
    let ts = |col: &str| get::<i64>(row, col, table).map(Timestamp::from_millis);
    let record = Record {
        id: id.clone(),
        fingerprint,
        status,
        token: FencingToken(token),
        lease_until: get::<Option<i64>>(row, "lease_until_ms", table)?.map(Timestamp::from_millis),
        outcome,
        attempts: non_negative(get::<i32>(row, "attempts", table)?.into(), "attempts", id)?,
        failure,
        hits: non_negative(get::<i64>(row, "hits", table)?, "hits", id)?,
        created_at: ts("created_ms")?,
        updated_at: ts("updated_ms")?,
        expires_at: ts("expires_ms")?,
    };
    record.validate()?;
    Ok(record)
}
