//! Turning script replies into records and results, with a typed error for anything off.

use idempotency_core::{
    Error, Failure, FencingToken, Fingerprint, Record, RecordId, RecordStatus, Timestamp,
};
use redis::Value;

/// A script reply split into its tag and the values after it.
pub(crate) struct Reply {
    pub(crate) tag: String,
    pub(crate) rest: Vec<Value>,
}

impl Reply {
    pub(crate) fn parse(value: Value) -> Result<Self, Error> {
        let Value::Array(mut items) = value else {
            return Err(unexpected(format!("expected an array, got {value:?}")));
        };
        if items.is_empty() {
            return Err(unexpected("empty reply"));
        }
        let tag = text(&items.remove(0), "reply tag")?;
        let reply = Self { tag, rest: items };
        if reply.tag == "corrupt" {
            let reason = reply
                .rest
                .first()
                .and_then(|v| text(v, "reason").ok())
                .unwrap_or_else(|| "no reason given".to_owned());
            return Err(Error::corrupt(reason));
        }
        Ok(reply)
    }

    /// The `i`-th value after the tag as a timestamp.
    pub(crate) fn millis(&self, i: usize, what: &str) -> Result<Timestamp, Error> {
        let v = self
            .rest
            .get(i)
            .ok_or_else(|| unexpected(format!("reply has no {what}")))?;
        let s = text(v, what)?;
        s.parse::<i64>()
            .map(Timestamp::from_millis)
            .map_err(|e| unexpected_with(format!("{what} {s:?} is not an integer"), e))
    }

    /// The `i`-th value after the tag as a fencing token.
    pub(crate) fn token(&self, i: usize) -> Result<FencingToken, Error> {
        let v = self
            .rest
            .get(i)
            .ok_or_else(|| unexpected("reply has no token"))?;
        let s = text(v, "token")?;
        s.parse::<u64>()
            .map(FencingToken)
            .map_err(|e| unexpected_with(format!("token {s:?} is not an integer"), e))
    }

    /// The `i`-th value after the tag as a record (an `HGETALL`-style field/value array).
    pub(crate) fn record(&self, i: usize, id: &RecordId) -> Result<Record, Error> {
        match self.rest.get(i) {
            Some(Value::Array(flat)) => decode_record(id, flat),
            other => Err(unexpected(format!("expected a record, got {other:?}"))),
        }
    }

    /// An error for a tag the caller did not expect.
    pub(crate) fn unexpected_tag(&self, op: &str) -> Error {
        unexpected(format!("{op} script replied {:?}", self.tag))
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

fn bytes<'a>(v: &'a Value, what: &str) -> Result<&'a [u8], Error> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.as_bytes()),
        other => Err(unexpected(format!(
            "{what}: expected a string, got {other:?}"
        ))),
    }
}

fn text(v: &Value, what: &str) -> Result<String, Error> {
    String::from_utf8(bytes(v, what)?.to_vec())
        .map_err(|e| unexpected_with(format!("{what} is not UTF-8"), e))
}

/// The fields of a stored record, looked up by name.
struct Fields<'a> {
    pairs: Vec<(&'a [u8], &'a [u8])>,
}

impl<'a> Fields<'a> {
    fn new(flat: &'a [Value]) -> Result<Self, Error> {
        if flat.len() % 2 != 0 {
            return Err(Error::corrupt("record hash has an odd number of elements"));
        }
        let mut pairs = Vec::with_capacity(flat.len() / 2);
        for pair in flat.chunks_exact(2) {
            pairs.push((bytes(&pair[0], "field name")?, bytes(&pair[1], "field")?));
        }
        Ok(Self { pairs })
    }

    fn get(&self, name: &str) -> Option<&'a [u8]> {
        self.pairs
            .iter()
            .find(|(k, _)| *k == name.as_bytes())
            .map(|(_, v)| *v)
    }

    fn str(&self, name: &str) -> Result<Option<&'a str>, Error> {
        self.get(name)
            .map(|v| {
                std::str::from_utf8(v)
                    .map_err(|e| Error::corrupt_with(format!("field {name} is not UTF-8"), e))
            })
            .transpose()
    }

    fn required(&self, name: &str) -> Result<&'a str, Error> {
        self.str(name)?
            .ok_or_else(|| Error::corrupt(format!("missing field {name}")))
    }

    fn number<T: std::str::FromStr>(&self, name: &str) -> Result<T, Error>
    where
        T::Err: std::error::Error + Send + Sync + 'static,
    {
        let s = self.required(name)?;
        s.parse()
            .map_err(|e| Error::corrupt_with(format!("field {name} = {s:?} is not a number"), e))
    }

    fn millis(&self, name: &str) -> Result<Timestamp, Error> {
        self.number::<i64>(name).map(Timestamp::from_millis)
    }
}

/// Decodes a record hash. The scripts already refuse malformed records; this checks again so
/// that nothing reaches the caller unchecked.
pub(crate) fn decode_record(id: &RecordId, flat: &[Value]) -> Result<Record, Error> {
    let record = decode_fields(id, flat)?;
    record.validate()?;
    Ok(record)
}

fn decode_fields(id: &RecordId, flat: &[Value]) -> Result<Record, Error> {
    let f = Fields::new(flat)?;
    let fp = f.required("fp")?;
    let fingerprint = Fingerprint::from_hex(fp)
        .map_err(|e| Error::corrupt_with(format!("field fp = {fp:?} is not a fingerprint"), e))?;
    let st = f.required("st")?;
    let status = RecordStatus::parse(st)
        .ok_or_else(|| Error::corrupt(format!("field st = {st:?} is not a status")))?;
    let lease_until = match f.str("lease")? {
        Some(_) => Some(f.millis("lease")?),
        None => None,
    };
    let failure = match f.str("fr")? {
        Some(fr) => Some(Failure {
            retryable: match fr {
                "1" => true,
                "0" => false,
                other => {
                    return Err(Error::corrupt(format!(
                        "field fr = {other:?} is not 0 or 1"
                    )))
                }
            },
            message: f.str("fm")?.unwrap_or_default().to_owned(),
        }),
        None => None,
    };
    Ok(Record {
        id: id.clone(),
        fingerprint,
        status,
        token: FencingToken(f.number("tok")?),
        lease_until,
        outcome: f.get("out").map(<[u8]>::to_vec),
        attempts: f.number("att")?,
        failure,
        hits: f.number("hits")?,
        created_at: f.millis("ca")?,
        updated_at: f.millis("ua")?,
        expires_at: f.millis("exp")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_core::{IdempotencyKey, Scope};

    fn id() -> RecordId {
        RecordId::new(Scope::new("s").unwrap(), IdempotencyKey::new("k").unwrap())
    }

    fn flat(pairs: &[(&str, &[u8])]) -> Vec<Value> {
        pairs
            .iter()
            .flat_map(|(k, v)| {
                [
                    Value::BulkString(k.as_bytes().to_vec()),
                    Value::BulkString(v.to_vec()),
                ]
            })
            .collect()
    }

    fn good() -> Vec<(&'static str, &'static [u8])> {
        vec![
            ("fp", b"aa".repeat(32).leak()),
            ("st", b"completed"),
            ("tok", b"3"),
            ("out", b"\x00\xffbytes"),
            ("att", b"2"),
            ("fr", b"1"),
            ("fm", b"timeout"),
            ("hits", b"7"),
            ("ca", b"1000"),
            ("ua", b"2000"),
            ("exp", b"3000"),
            ("future-field", b"ignored"),
        ]
    }

    #[test]
    fn decodes_every_field() {
        let r = decode_record(&id(), &flat(&good())).unwrap();
        assert_eq!(r.status, RecordStatus::Completed);
        assert_eq!(r.token, FencingToken(3));
        assert_eq!(r.outcome.as_deref(), Some(&b"\x00\xffbytes"[..]));
        assert_eq!(r.attempts, 2);
        assert_eq!(r.failure, Some(Failure::retryable("timeout")));
        assert_eq!(r.hits, 7);
        assert_eq!(r.lease_until, None);
        assert_eq!(r.expires_at, Timestamp::from_millis(3000));
    }

    #[test]
    fn every_damage_is_a_corrupt_record() {
        let damaged: Vec<(&str, Option<&[u8]>)> = vec![
            ("fp", None),
            ("fp", Some(b"xyz")),
            ("st", Some(b"done")),
            ("tok", Some(b"-1")),
            ("tok", Some(b"1e3")),
            ("att", Some(b"99999999999")),
            ("hits", None),
            ("lease", Some(b"soon")),
            ("fr", Some(b"yes")),
            ("exp", Some(b"")),
            ("fm", Some(b"\xff\xfe")),
        ];
        for (field, value) in damaged {
            let mut pairs = good();
            pairs.retain(|(k, _)| *k != field);
            if let Some(v) = value {
                pairs.push((field, v));
            }
            match decode_record(&id(), &flat(&pairs)) {
                Err(Error::CorruptRecord { .. }) => {}
                other => panic!("{field} = {value:?}: expected CorruptRecord, got {other:?}"),
            }
        }
        let odd = &flat(&good())[1..];
        assert!(matches!(
            decode_record(&id(), odd),
            Err(Error::CorruptRecord { .. })
        ));
    }

    #[test]
    fn corrupt_tag_becomes_corrupt_record() {
        let v = Value::Array(vec![
            Value::BulkString(b"corrupt".to_vec()),
            Value::BulkString(b"the key holds a string, not a hash".to_vec()),
        ]);
        match Reply::parse(v) {
            Err(Error::CorruptRecord { reason, .. }) => assert!(reason.contains("string")),
            Err(other) => panic!("expected CorruptRecord, got {other:?}"),
            Ok(_) => panic!("expected CorruptRecord, got a reply"),
        }
    }
}
