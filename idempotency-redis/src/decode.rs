//! Turning script replies into records and results, with a typed error for anything off.
//!
//! A record is stored as one string in the encoding `idk1` that [`crate::scripts`]
//! describes; [`decode_record`] reads it and checks every rule a record must keep.

use idempotency_core::store::{Cas, Claim, Failure, Reclaim, Record, RecordStatus, Timestamp};
use idempotency_core::{Error, FencingToken, Fingerprint, RecordId};
use redis::Value;

/// The encoding's tag and version, the record's first four bytes.
pub(crate) const TAG: &[u8; 4] = b"idk1";
/// The fixed part of a record, before the failure message and the outcome.
pub(crate) const HEADER_LEN: usize = 94;

const HAS_LEASE: u8 = 1;
const HAS_FAILURE: u8 = 2;
const RETRYABLE: u8 = 4;
const HAS_OUTCOME: u8 = 8;

/// A script reply: one string, a kind byte and then its fields (big-endian 64-bit numbers,
/// then a record where there is one); see the table in [`crate::scripts`].
pub(crate) struct Reply {
    bytes: Vec<u8>,
}

impl Reply {
    pub(crate) fn parse(value: Value) -> Result<Self, Error> {
        let bytes = match value {
            Value::BulkString(bytes) => bytes,
            other => return Err(unexpected(format!("expected a string, got {other:?}"))),
        };
        match bytes.first() {
            None => Err(unexpected("empty reply")),
            Some(b'x') => Err(Error::corrupt(String::from_utf8_lossy(&bytes[1..]))),
            Some(_) => Ok(Self { bytes }),
        }
    }

    /// The kind byte.
    fn kind(&self) -> u8 {
        self.bytes[0]
    }

    /// The `i`-th number after the kind byte.
    fn u64(&self, i: usize, what: &str) -> Result<u64, Error> {
        let at = 1 + 8 * i;
        self.bytes
            .get(at..at + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_be_bytes)
            .ok_or_else(|| {
                unexpected(format!(
                    "a reply of kind {:?} and {} bytes has no {what}",
                    char::from(self.kind()),
                    self.bytes.len()
                ))
            })
    }

    /// The `i`-th number after the kind byte as a timestamp.
    fn millis(&self, i: usize, what: &str) -> Result<Timestamp, Error> {
        let n = self.u64(i, what)?;
        i64::try_from(n)
            .map(Timestamp::from_millis)
            .map_err(|e| unexpected_with(format!("{what} {n} is out of range"), e))
    }

    /// The `i`-th number after the kind byte as a fencing token.
    fn token(&self, i: usize) -> Result<FencingToken, Error> {
        self.u64(i, "token").map(FencingToken)
    }

    /// Refuses a reply longer than its kind and `fields` numbers.
    fn exactly(self, fields: usize) -> Result<Self, Error> {
        match self.bytes.len() == 1 + 8 * fields {
            true => Ok(self),
            false => Err(unexpected(format!(
                "a reply of kind {:?} has {} bytes, not {}",
                char::from(self.kind()),
                self.bytes.len(),
                1 + 8 * fields
            ))),
        }
    }

    /// The stored record after the kind byte and `fields` numbers.
    fn record(&self, fields: usize, id: &RecordId) -> Result<Record, Error> {
        match self.bytes.get(1 + 8 * fields..) {
            Some(bytes) => decode_record(id, bytes),
            None => Err(unexpected(format!(
                "a reply of {} bytes has no record",
                self.bytes.len()
            ))),
        }
    }

    /// A record reply (`r`, or `h` with the hit the script just counted, which replaces the
    /// stored count since the script wrote it after the read), with the server's time.
    fn existing(&self, id: &RecordId) -> Result<(Timestamp, Record), Error> {
        let now = self.millis(0, "server time")?;
        match self.kind() {
            b'h' => {
                let hits = self.u64(1, "hit count")?;
                let mut record = self.record(2, id)?;
                record.hits = hits;
                Ok((now, record))
            }
            _ => Ok((now, self.record(1, id)?)),
        }
    }

    /// An error for a kind the caller did not expect.
    fn unexpected_kind(&self, op: &str) -> Error {
        unexpected(format!(
            "{op} script replied with kind {:?}",
            char::from(self.kind())
        ))
    }
}

/// A reply that does not have the shape the scripts produce: a protocol-level surprise, not
/// a corrupt record.
fn unexpected(reason: impl Into<String>) -> Error {
    Error::backend(false, format!("unexpected Redis reply: {}", reason.into()))
}

fn unexpected_with(reason: String, source: impl std::error::Error) -> Error {
    Error::backend(false, format!("unexpected Redis reply: {reason}: {source}"))
}

/// The fixed-width fields of a record's header, read at their offsets.
struct Header<'a>(&'a [u8; HEADER_LEN]);

impl Header<'_> {
    fn bytes<const N: usize>(&self, at: usize) -> [u8; N] {
        let mut out = [0; N];
        out.copy_from_slice(&self.0[at..at + N]);
        out
    }

    fn u64(&self, at: usize) -> u64 {
        u64::from_be_bytes(self.bytes(at))
    }

    /// A time or count that must fit an `i64`.
    fn i64(&self, at: usize, what: &str) -> Result<i64, Error> {
        let n = self.u64(at);
        i64::try_from(n).map_err(|e| Error::corrupt_with(format!("{what} {n} is out of range"), e))
    }

    fn millis(&self, at: usize, what: &str) -> Result<Timestamp, Error> {
        self.i64(at, what).map(Timestamp::from_millis)
    }
}

/// Decodes a stored record. The scripts already refuse what they cannot read; this checks
/// every field again, and [`Record::validate`], so that nothing reaches the caller unchecked.
pub(crate) fn decode_record(id: &RecordId, bytes: &[u8]) -> Result<Record, Error> {
    let Some((head, tail)) = bytes.split_first_chunk::<HEADER_LEN>() else {
        return Err(Error::corrupt(format!(
            "record of {} bytes is shorter than its {HEADER_LEN}-byte header",
            bytes.len()
        )));
    };
    let h = Header(head);
    if &h.bytes::<4>(0) != TAG {
        return Err(Error::corrupt(format!(
            "record is not of encoding idk1 (it starts with {:?})",
            String::from_utf8_lossy(&head[..4])
        )));
    }
    let status = match head[4] {
        1 => RecordStatus::Pending,
        2 => RecordStatus::Completed,
        3 => RecordStatus::Failed,
        other => {
            return Err(Error::corrupt(format!(
                "status byte {other} is not 1, 2 or 3"
            )))
        }
    };
    let flags = head[5];
    if flags > HAS_LEASE | HAS_FAILURE | RETRYABLE | HAS_OUTCOME {
        return Err(Error::corrupt(format!("flags {flags} out of range")));
    }
    let message_len = u32::from_be_bytes(h.bytes(90)) as usize;
    if message_len > tail.len() {
        return Err(Error::corrupt(format!(
            "failure message of {message_len} bytes runs past the end of the record"
        )));
    }
    let (message, outcome) = tail.split_at(message_len);
    let failure = if flags & HAS_FAILURE != 0 {
        Some(Failure {
            retryable: flags & RETRYABLE != 0,
            message: std::str::from_utf8(message)
                .map_err(|e| Error::corrupt_with("failure message is not UTF-8", e))?
                .to_owned(),
        })
    } else if !message.is_empty() || flags & RETRYABLE != 0 {
        return Err(Error::corrupt("failure details without a failure"));
    } else {
        None
    };
    let outcome = if flags & HAS_OUTCOME != 0 {
        Some(outcome.to_vec())
    } else if !outcome.is_empty() {
        return Err(Error::corrupt("outcome bytes without an outcome"));
    } else {
        None
    };
    let lease_until = match flags & HAS_LEASE != 0 {
        true => Some(h.millis(26, "lease deadline")?),
        false => None,
    };
    let record = Record {
        id: id.clone(),
        fingerprint: Fingerprint::from_digest(h.bytes(58)),
        status,
        token: FencingToken(h.u64(6)),
        lease_until,
        outcome,
        attempts: u32::from_be_bytes(h.bytes(14)),
        failure,
        hits: h.i64(18, "hit count")? as u64,
        created_at: h.millis(34, "creation time")?,
        updated_at: h.millis(42, "update time")?,
        expires_at: h.millis(50, "expiry")?,
    };
    record.validate()?;
    Ok(record)
}

/// Encodes a record as the scripts store it: for the fuzz targets and tests, which build
/// stored records without a server.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn encode_record(record: &Record) -> Vec<u8> {
    let message = record.failure.as_ref().map_or("", |f| f.message.as_str());
    let mut flags = 0;
    if record.lease_until.is_some() {
        flags |= HAS_LEASE;
    }
    if let Some(failure) = &record.failure {
        flags |= HAS_FAILURE;
        if failure.retryable {
            flags |= RETRYABLE;
        }
    }
    if record.outcome.is_some() {
        flags |= HAS_OUTCOME;
    }
    let status = match record.status {
        RecordStatus::Pending => 1,
        RecordStatus::Completed => 2,
        RecordStatus::Failed => 3,
    };
    let millis = |t: Timestamp| (t.as_millis().max(0) as u64).to_be_bytes();
    let mut out = Vec::with_capacity(HEADER_LEN + message.len());
    out.extend_from_slice(TAG);
    out.extend_from_slice(&[status, flags]);
    out.extend_from_slice(&record.token.0.to_be_bytes());
    out.extend_from_slice(&record.attempts.to_be_bytes());
    out.extend_from_slice(&record.hits.to_be_bytes());
    out.extend_from_slice(&millis(
        record.lease_until.unwrap_or(Timestamp::from_millis(0)),
    ));
    out.extend_from_slice(&millis(record.created_at));
    out.extend_from_slice(&millis(record.updated_at));
    out.extend_from_slice(&millis(record.expires_at));
    out.extend_from_slice(record.fingerprint.as_bytes());
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    out.extend_from_slice(record.outcome.as_deref().unwrap_or_default());
    out
}

pub(crate) fn claim_reply(value: Value, id: &RecordId) -> Result<Claim, Error> {
    let reply = Reply::parse(value)?;
    match reply.kind() {
        b'c' => {
            let reply = reply.exactly(2)?;
            Ok(Claim::Claimed {
                token: reply.token(0)?,
                lease_until: reply.millis(1, "lease deadline")?,
            })
        }
        b'r' | b'h' => {
            let (now, record) = reply.existing(id)?;
            Ok(Claim::Existing { now, record })
        }
        _ => Err(reply.unexpected_kind("claim")),
    }
}

pub(crate) fn reclaim_reply(value: Value) -> Result<Reclaim, Error> {
    let reply = Reply::parse(value)?;
    match reply.kind() {
        b'R' => {
            let reply = reply.exactly(2)?;
            Ok(Reclaim::Reclaimed {
                token: reply.token(0)?,
                lease_until: reply.millis(1, "lease deadline")?,
            })
        }
        b'l' => reply.exactly(0).map(|_| Reclaim::Lost),
        _ => Err(reply.unexpected_kind("reclaim")),
    }
}

pub(crate) fn get_reply(value: Value, id: &RecordId) -> Result<Option<Record>, Error> {
    let reply = Reply::parse(value)?;
    match reply.kind() {
        b'r' => reply.existing(id).map(|(_, record)| Some(record)),
        b'n' => reply.exactly(0).map(|_| None),
        _ => Err(reply.unexpected_kind("get")),
    }
}

pub(crate) fn cas_reply(value: Value, op: &str) -> Result<Cas, Error> {
    let reply = Reply::parse(value)?;
    match reply.kind() {
        b'a' => reply.exactly(0).map(|_| Cas::Applied),
        b'f' => reply.exactly(0).map(|_| Cas::Fenced),
        _ => Err(reply.unexpected_kind(op)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_core::{IdempotencyKey, Scope};

    fn id() -> RecordId {
        RecordId::new(IdempotencyKey::new("k").unwrap(), Scope::new("s").unwrap())
    }

    fn good() -> Record {
        Record {
            id: id(),
            fingerprint: Fingerprint::from_bytes(b"payload"),
            status: RecordStatus::Completed,
            token: FencingToken(3),
            lease_until: None,
            outcome: Some(b"\x00\xffbytes".to_vec()),
            attempts: 2,
            failure: Some(Failure::retryable("timeout")),
            hits: 7,
            created_at: Timestamp::from_millis(1000),
            updated_at: Timestamp::from_millis(2000),
            expires_at: Timestamp::from_millis(3000),
        }
    }

    #[test]
    fn decodes_what_it_encodes() {
        let mut pending = good();
        pending.status = RecordStatus::Pending;
        pending.lease_until = Some(Timestamp::from_millis(2500));
        pending.outcome = None;
        pending.failure = None;
        let mut empty_outcome = good();
        empty_outcome.outcome = Some(Vec::new());
        empty_outcome.failure = None;
        for record in [good(), pending, empty_outcome] {
            assert_eq!(
                decode_record(&id(), &encode_record(&record)).unwrap(),
                record
            );
        }
    }

    #[test]
    fn every_damage_is_a_corrupt_record() {
        let good = encode_record(&good());
        let set = |at: usize, bytes: &[u8]| {
            let mut v = good.clone();
            v[at..at + bytes.len()].copy_from_slice(bytes);
            v
        };
        let damaged: Vec<(&str, Vec<u8>)> = vec![
            ("another tag", set(0, b"idk2")),
            ("truncated", good[..HEADER_LEN - 1].to_vec()),
            ("empty", Vec::new()),
            ("status 0", set(4, &[0])),
            ("status 4", set(4, &[4])),
            ("unknown flag", set(5, &[16 | 8 | 2])),
            ("no outcome flag", set(5, &[2 | 4])),
            ("token 0", set(6, &0u64.to_be_bytes())),
            ("attempts 0", set(14, &0u32.to_be_bytes())),
            ("hits above i64", set(18, &u64::MAX.to_be_bytes())),
            ("expiry above i64", set(50, &u64::MAX.to_be_bytes())),
            ("message too long", set(90, &1000u32.to_be_bytes())),
            ("message not UTF-8", set(HEADER_LEN, b"\xff")),
        ];
        for (what, bytes) in damaged {
            match decode_record(&id(), &bytes) {
                Err(Error::CorruptRecord { .. }) => {}
                other => panic!("{what}: expected CorruptRecord, got {other:?}"),
            }
        }
    }

    #[test]
    fn corrupt_kind_becomes_corrupt_record() {
        let v = Value::BulkString(b"xthe key holds a hash, not a record".to_vec());
        match Reply::parse(v) {
            Err(Error::CorruptRecord { reason, .. }) => assert!(reason.contains("hash")),
            Err(other) => panic!("expected CorruptRecord, got {other:?}"),
            Ok(_) => panic!("expected CorruptRecord, got a reply"),
        }
    }

    fn reply(kind: u8, numbers: &[u64], record: Option<&Record>) -> Value {
        let mut bytes = vec![kind];
        for n in numbers {
            bytes.extend_from_slice(&n.to_be_bytes());
        }
        if let Some(record) = record {
            bytes.extend_from_slice(&encode_record(record));
        }
        Value::BulkString(bytes)
    }

    #[test]
    fn a_counted_hit_replaces_the_stored_count() {
        let Claim::Existing { now, record } =
            claim_reply(reply(b'h', &[5, 8], Some(&good())), &id()).unwrap()
        else {
            panic!("expected the record");
        };
        assert_eq!(record.hits, 8);
        assert_eq!(now, Timestamp::from_millis(5));
        let Claim::Existing { record, .. } =
            claim_reply(reply(b'r', &[5], Some(&good())), &id()).unwrap()
        else {
            panic!("expected the record");
        };
        assert_eq!(record, good());
    }

    #[test]
    fn every_kind_decodes_and_every_misshape_is_an_error() {
        assert!(matches!(
            claim_reply(reply(b'c', &[7, 9], None), &id()),
            Ok(Claim::Claimed { token: FencingToken(7), lease_until }) if lease_until == Timestamp::from_millis(9)
        ));
        assert!(matches!(
            reclaim_reply(reply(b'R', &[8, 9], None)),
            Ok(Reclaim::Reclaimed {
                token: FencingToken(8),
                ..
            })
        ));
        assert!(matches!(
            reclaim_reply(reply(b'l', &[], None)),
            Ok(Reclaim::Lost)
        ));
        assert!(matches!(get_reply(reply(b'n', &[], None), &id()), Ok(None)));
        assert!(matches!(
            get_reply(reply(b'r', &[1], Some(&good())), &id()),
            Ok(Some(_))
        ));
        assert!(matches!(
            cas_reply(reply(b'a', &[], None), "complete"),
            Ok(Cas::Applied)
        ));
        assert!(matches!(
            cas_reply(reply(b'f', &[], None), "complete"),
            Ok(Cas::Fenced)
        ));
        let misshapen = [
            claim_reply(reply(b'c', &[7], None), &id()).err(),
            claim_reply(reply(b'c', &[7, 9, 1], None), &id()).err(),
            claim_reply(reply(b'c', &[7, u64::MAX], None), &id()).err(),
            claim_reply(reply(b'r', &[], None), &id()).err(),
            claim_reply(reply(b'a', &[], None), &id()).err(),
            claim_reply(Value::Array(vec![]), &id()).err(),
            claim_reply(Value::BulkString(vec![]), &id()).err(),
            cas_reply(reply(b'a', &[1], None), "complete").err(),
            cas_reply(reply(b'r', &[1], Some(&good())), "complete").err(),
            get_reply(reply(b'n', &[1], None), &id()).err(),
            reclaim_reply(reply(b'c', &[7, 9], None)).err(),
        ];
        for (i, e) in misshapen.into_iter().enumerate() {
            match e {
                Some(Error::Backend {
                    retryable: false, ..
                }) => {}
                other => panic!("case {i}: expected a non-retryable backend error, got {other:?}"),
            }
        }
        // A record cut short inside a reply is a corrupt record, not a protocol surprise.
        let mut cut = encode_record(&good());
        cut.truncate(HEADER_LEN - 1);
        let mut bytes = vec![b'r'];
        bytes.extend_from_slice(&1u64.to_be_bytes());
        bytes.extend_from_slice(&cut);
        assert!(matches!(
            claim_reply(Value::BulkString(bytes), &id()),
            Err(Error::CorruptRecord { .. })
        ));
    }
}
