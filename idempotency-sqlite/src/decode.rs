//! Row decoding: a stored row becomes a `Record` only if a correct store could have written it.

use idempotency_core::store::{Failure, Record, RecordStatus, Timestamp};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyKey, RecordId, Scope};
use rusqlite::Row;

fn column<T: rusqlite::types::FromSql>(row: &Row<'_>, i: usize, name: &str) -> Result<T, Error> {
    row.get(i)
        .map_err(|e| Error::corrupt_with(format!("column {name} cannot be read"), e))
}

fn non_negative<T: TryFrom<i64>>(v: i64, name: &str) -> Result<T, Error> {
    T::try_from(v).map_err(|_| Error::corrupt(format!("{name} is out of range: {v}")))
}

/// Decodes one row in [`COLUMNS`](crate::sql::COLUMNS) order, refusing anything the store could not have written.
pub(crate) fn decode_record(row: &Row<'_>) -> Result<Record, Error> {
    let scope: String = column(row, 0, "scope")?;
    let key: String = column(row, 1, "key")?;
    let scope = Scope::new(scope).map_err(|e| Error::corrupt_with("stored scope is invalid", e))?;
    let key =
        IdempotencyKey::new(key).map_err(|e| Error::corrupt_with("stored key is invalid", e))?;
    let id = RecordId::new(key, scope);
    let bad = |what: String| Error::corrupt(format!("record {id}: {what}"));

    let fp: Vec<u8> = column(row, 2, "fingerprint")?;
    let fingerprint = Fingerprint::from_slice(&fp)
        .ok_or_else(|| bad(format!("fingerprint is {} bytes, expected 32", fp.len())))?;
    let status: String = column(row, 3, "status")?;
    let status =
        RecordStatus::parse(&status).ok_or_else(|| bad(format!("unknown status {status:?}")))?;
    let token: i64 = column(row, 4, "token")?;
    let token = u64::try_from(token).map_err(|_| bad(format!("token {token} is below 1")))?;
    let lease_until: Option<i64> = column(row, 5, "lease_until")?;
    let outcome: Option<Vec<u8>> = column(row, 6, "outcome")?;
    let attempts: i64 = column(row, 7, "attempts")?;
    let attempts: u32 = non_negative(attempts, "attempts")?;
    let retryable: Option<i64> = column(row, 8, "failure_retryable")?;
    let message: Option<String> = column(row, 9, "failure_message")?;
    let failure = match (retryable, message) {
        (None, None) => None,
        (Some(r @ (0 | 1)), Some(message)) => Some(Failure {
            retryable: r == 1,
            message,
        }),
        (r, m) => {
            return Err(bad(format!(
                "failure columns are inconsistent (retryable {r:?}, message present: {})",
                m.is_some()
            )))
        }
    };
    let hits: i64 = column(row, 10, "hits")?;
    let hits: u64 = non_negative(hits, "hits")?;
    let created_at: i64 = column(row, 11, "created_at")?;
    let updated_at: i64 = column(row, 12, "updated_at")?;
    let expires_at: i64 = column(row, 13, "expires_at")?;

    let record = Record {
        id,
        fingerprint,
        status,
        token: FencingToken(token),
        lease_until: lease_until.map(Timestamp::from_millis),
        outcome,
        attempts,
        failure,
        hits,
        created_at: Timestamp::from_millis(created_at),
        updated_at: Timestamp::from_millis(updated_at),
        expires_at: Timestamp::from_millis(expires_at),
    };
    record.validate()?;
    Ok(record)
}
