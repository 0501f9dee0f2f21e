//! Redis script replies and stored records: every decoder of the Redis store answers a typed
//! error or a record, never a panic, whatever the server sends back, and a record it accepts
//! encodes back to the same record. Inputs are built around the real encoding and reply kinds
//! (a kind byte, then 64-bit numbers and a record) so that most of them get deep into the
//! decoders.
#![no_main]

use arbitrary::Arbitrary;
use idempotency_core::{IdempotencyKey, RecordId, Scope};
use idempotency_core::protocol::decode_replay;
use idempotency_redis::__fuzz;
use idempotency_redis::redis::Value;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Raw {
    Nil,
    Int(i64),
    Bulk(Vec<u8>),
    Simple(String),
    Okay,
    Double(f64),
    Bool(bool),
    Array(Vec<Raw>),
    Map(Vec<(Raw, Raw)>),
    Set(Vec<Raw>),
}

impl Raw {
    fn value(&self) -> Value {
        match self {
            Raw::Nil => Value::Nil,
            Raw::Int(n) => Value::Int(*n),
            Raw::Bulk(b) => Value::BulkString(b.clone()),
            Raw::Simple(s) => Value::SimpleString(s.clone()),
            Raw::Okay => Value::Okay,
            Raw::Double(d) => Value::Double(*d),
            Raw::Bool(b) => Value::Boolean(*b),
            Raw::Array(items) => Value::Array(items.iter().map(Raw::value).collect()),
            Raw::Map(pairs) => {
                Value::Map(pairs.iter().map(|(k, v)| (k.value(), v.value())).collect())
            }
            Raw::Set(items) => Value::Set(items.iter().map(Raw::value).collect()),
        }
    }
}

/// A stored record in the store's encoding, with every field free: the tag right or not,
/// any status and flags, any numbers, a message length that may lie, and a cut anywhere.
#[derive(Debug, Arbitrary)]
struct Stored {
    right_tag: bool,
    status: u8,
    flags: u8,
    token: u64,
    attempts: u32,
    hits: u64,
    times: [u64; 4],
    fingerprint: [u8; 32],
    message: Vec<u8>,
    lying_length: Option<u32>,
    outcome: Vec<u8>,
    cut: Option<u16>,
}

impl Stored {
    fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(if self.right_tag { b"idk1" } else { b"idk2" });
        out.extend_from_slice(&[self.status % 5, self.flags % 20]);
        out.extend_from_slice(&self.token.to_be_bytes());
        out.extend_from_slice(&self.attempts.to_be_bytes());
        out.extend_from_slice(&self.hits.to_be_bytes());
        for t in self.times {
            out.extend_from_slice(&t.to_be_bytes());
        }
        out.extend_from_slice(&self.fingerprint);
        let length = self.lying_length.unwrap_or(self.message.len() as u32);
        out.extend_from_slice(&length.to_be_bytes());
        out.extend_from_slice(&self.message);
        out.extend_from_slice(&self.outcome);
        if let Some(cut) = self.cut {
            out.truncate(usize::from(cut));
        }
        out
    }
}

#[derive(Debug, Arbitrary)]
enum Kind {
    Claimed,
    Record,
    Counted,
    None,
    Reclaimed,
    Lost,
    Applied,
    Fenced,
    Corrupt,
    Other(u8),
}

#[derive(Debug, Arbitrary)]
enum Part {
    Number(u64),
    Record(Stored),
    Bytes(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
enum Reply {
    Kinded(Kind, Vec<Part>),
    Raw(Raw),
}

#[derive(Debug, Arbitrary)]
struct Input {
    stored: Stored,
    reply: Reply,
}

fuzz_target!(|input: Input| {
    let id = RecordId::new(
        IdempotencyKey::new("k").expect("valid key"),
        Scope::new("fuzz").expect("valid scope"),
    );
    if let Ok(record) = __fuzz::decode_record(&id, &input.stored.bytes()) {
        assert_eq!(record.id, id);
        let again = __fuzz::decode_record(&id, &__fuzz::encode_record(&record));
        assert_eq!(again.ok().as_ref(), Some(&record), "a decoded record re-encodes");
        let _ = decode_replay::<serde_json::Value>(&record);
    }

    let reply = match &input.reply {
        Reply::Raw(raw) => raw.value(),
        Reply::Kinded(kind, parts) => {
            let mut bytes = vec![match kind {
                Kind::Claimed => b'c',
                Kind::Record => b'r',
                Kind::Counted => b'h',
                Kind::None => b'n',
                Kind::Reclaimed => b'R',
                Kind::Lost => b'l',
                Kind::Applied => b'a',
                Kind::Fenced => b'f',
                Kind::Corrupt => b'x',
                Kind::Other(b) => *b,
            }];
            for part in parts {
                match part {
                    Part::Number(n) => bytes.extend_from_slice(&n.to_be_bytes()),
                    Part::Record(stored) => bytes.extend_from_slice(&stored.bytes()),
                    Part::Bytes(b) => bytes.extend_from_slice(b),
                }
            }
            Value::BulkString(bytes)
        }
    };
    let _ = __fuzz::claim_reply(reply.clone(), &id);
    let _ = __fuzz::reclaim_reply(reply.clone());
    if let Ok(Some(record)) = __fuzz::get_reply(reply.clone(), &id) {
        assert_eq!(record.id, id);
    }
    let _ = __fuzz::cas_reply(reply);
});
