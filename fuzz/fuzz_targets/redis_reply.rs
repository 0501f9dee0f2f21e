//! Redis script replies and stored record hashes: every decoder of the Redis store answers a
//! typed error or a record, never a panic, whatever the server sends back. Inputs are
//! built around the real field names and reply tags so that most of them get deep into the
//! decoders.
#![no_main]

use arbitrary::Arbitrary;
use idempotency_core::{decode_replay, IdempotencyKey, RecordId, Scope};
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

#[derive(Debug, Arbitrary)]
enum FieldName {
    Fp,
    St,
    Tok,
    Lease,
    Out,
    Att,
    Fr,
    Fm,
    Hits,
    Ca,
    Ua,
    Exp,
    Other(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
enum FieldValue {
    Bytes(Vec<u8>),
    Signed(i64),
    Unsigned(u64),
    Hex([u8; 32]),
    Status(u8),
    Flag(bool),
    Raw(Raw),
}

fn text(s: impl Into<Vec<u8>>) -> Value {
    Value::BulkString(s.into())
}

impl FieldValue {
    fn value(&self) -> Value {
        match self {
            FieldValue::Bytes(b) => text(b.clone()),
            FieldValue::Signed(n) => text(n.to_string()),
            FieldValue::Unsigned(n) => text(n.to_string()),
            FieldValue::Hex(d) => text(d.iter().map(|b| format!("{b:02x}")).collect::<String>()),
            FieldValue::Status(n) => {
                text(["pending", "completed", "failed", "Pending", ""][usize::from(*n) % 5])
            }
            FieldValue::Flag(b) => text(if *b { "1" } else { "0" }),
            FieldValue::Raw(r) => r.value(),
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Hash {
    fields: Vec<(FieldName, FieldValue)>,
    /// Drop the last element, leaving an odd count.
    truncate: bool,
}

impl Hash {
    fn flat(&self) -> Vec<Value> {
        let mut flat = Vec::new();
        for (name, value) in &self.fields {
            let name = match name {
                FieldName::Fp => text("fp"),
                FieldName::St => text("st"),
                FieldName::Tok => text("tok"),
                FieldName::Lease => text("lease"),
                FieldName::Out => text("out"),
                FieldName::Att => text("att"),
                FieldName::Fr => text("fr"),
                FieldName::Fm => text("fm"),
                FieldName::Hits => text("hits"),
                FieldName::Ca => text("ca"),
                FieldName::Ua => text("ua"),
                FieldName::Exp => text("exp"),
                FieldName::Other(b) => text(b.clone()),
            };
            flat.push(name);
            flat.push(value.value());
        }
        if self.truncate {
            flat.pop();
        }
        flat
    }
}

#[derive(Debug, Arbitrary)]
enum Tag {
    Claimed,
    Record,
    None,
    Reclaimed,
    Lost,
    Applied,
    Fenced,
    Corrupt,
    Other(Raw),
}

#[derive(Debug, Arbitrary)]
enum Part {
    Raw(Raw),
    Record(Hash),
    Number(FieldValue),
}

#[derive(Debug, Arbitrary)]
enum Reply {
    Tagged(Tag, Vec<Part>),
    Raw(Raw),
}

#[derive(Debug, Arbitrary)]
struct Input {
    hash: Hash,
    reply: Reply,
}

fuzz_target!(|input: Input| {
    let id = RecordId::new(
        Scope::new("fuzz").expect("valid scope"),
        IdempotencyKey::new("k").expect("valid key"),
    );
    if let Ok(record) = __fuzz::decode_record(&id, &input.hash.flat()) {
        assert_eq!(record.id, id);
        let _ = decode_replay::<serde_json::Value>(&record);
    }

    let reply = match &input.reply {
        Reply::Raw(raw) => raw.value(),
        Reply::Tagged(tag, parts) => {
            let tag = match tag {
                Tag::Claimed => text("claimed"),
                Tag::Record => text("record"),
                Tag::None => text("none"),
                Tag::Reclaimed => text("reclaimed"),
                Tag::Lost => text("lost"),
                Tag::Applied => text("applied"),
                Tag::Fenced => text("fenced"),
                Tag::Corrupt => text("corrupt"),
                Tag::Other(raw) => raw.value(),
            };
            let mut items = vec![tag];
            for part in parts {
                items.push(match part {
                    Part::Raw(raw) => raw.value(),
                    Part::Record(hash) => Value::Array(hash.flat()),
                    Part::Number(n) => n.value(),
                });
            }
            Value::Array(items)
        }
    };
    let _ = __fuzz::claim_reply(reply.clone(), &id);
    let _ = __fuzz::reclaim_reply(reply.clone());
    if let Ok(Some(record)) = __fuzz::get_reply(reply.clone(), &id) {
        assert_eq!(record.id, id);
    }
    let _ = __fuzz::cas_reply(reply);
});
