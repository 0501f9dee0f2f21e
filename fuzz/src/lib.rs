//! Shared generators for the fuzz targets: JSON values built from fuzz input, and JSON text
//! that denotes a given value but is written differently (keys permuted, whitespace, string
//! escapes).

use arbitrary::{Arbitrary, Result, Unstructured};
use serde_json::{Map, Number, Value};

/// The deepest value generated. serde_json refuses to parse text nested deeper than 128, and
/// the canonical writer recurses once per level.
pub const MAX_DEPTH: usize = 48;

/// A JSON value as the fuzzer builds it.
#[derive(Debug, Arbitrary)]
pub enum Json {
    Null,
    Bool(bool),
    PosInt(u64),
    NegInt(i64),
    Float(f64),
    /// Floats near integers and zero, where representations are most likely to collide.
    SmallFloat(i8, u8),
    /// `0.0` or `-0.0`.
    Zero(bool),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// The serde_json value, with levels past [`MAX_DEPTH`] cut to `null`.
    pub fn to_value(&self) -> Value {
        self.to_value_at(0)
    }

    fn to_value_at(&self, depth: usize) -> Value {
        if depth >= MAX_DEPTH {
            return Value::Null;
        }
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::PosInt(n) => Value::from(*n),
            Json::NegInt(n) => Value::from(*n),
            Json::Float(f) => float(*f),
            Json::SmallFloat(whole, tenths) => {
                float(f64::from(*whole) + f64::from(*tenths % 10) / 10.0)
            }
            Json::Zero(negative) => float(if *negative { -0.0 } else { 0.0 }),
            Json::String(s) => Value::String(s.clone()),
            Json::Array(items) => {
                Value::Array(items.iter().map(|j| j.to_value_at(depth + 1)).collect())
            }
            Json::Object(entries) => {
                let mut map = Map::new();
                for (k, v) in entries {
                    map.insert(k.clone(), v.to_value_at(depth + 1));
                }
                Value::Object(map)
            }
        }
    }
}

/// A float as serde_json holds it: non-finite values have no JSON form and become `null`.
fn float(f: f64) -> Value {
    Number::from_f64(f).map_or(Value::Null, Value::Number)
}

/// Writes JSON text for `value` that a JSON parser reads back as the same value, choosing the
/// key order, the whitespace and the escapes from `u` (when `u` runs out, the plain form).
pub fn write_variant(value: &Value, u: &mut Unstructured<'_>, out: &mut String) -> Result<()> {
    ws(u, out)?;
    match value {
        Value::Null | Value::Bool(_) | Value::Number(_) => out.push_str(&value.to_string()),
        Value::String(s) => write_string(s, u, out)?,
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    ws(u, out)?;
                    out.push(',');
                }
                write_variant(item, u, out)?;
                ws(u, out)?;
            }
            ws(u, out)?;
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            // Fisher-Yates with choices from the input.
            for i in (1..entries.len()).rev() {
                let j = u.int_in_range(0..=i)?;
                entries.swap(i, j);
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(u, out)?;
                write_string(k, u, out)?;
                ws(u, out)?;
                out.push(':');
                write_variant(v, u, out)?;
                ws(u, out)?;
            }
            ws(u, out)?;
            out.push('}');
        }
    }
    ws(u, out)
}

fn ws(u: &mut Unstructured<'_>, out: &mut String) -> Result<()> {
    let n = if u.is_empty() {
        0
    } else {
        u.int_in_range(0..=2u8)?
    };
    for _ in 0..n {
        out.push(*u.choose(&[' ', '\t', '\n', '\r'])?);
    }
    Ok(())
}

/// A JSON string literal for `s`, each character written plainly or as a `\u` escape (with
/// surrogate pairs outside the BMP), and `/` sometimes as `\/`.
fn write_string(s: &str, u: &mut Unstructured<'_>, out: &mut String) -> Result<()> {
    out.push('"');
    for c in s.chars() {
        let escape_anyway = !u.is_empty() && u.ratio(1u8, 4u8)?;
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '/' if escape_anyway => out.push_str("\\/"),
            c if (c as u32) < 0x20 || escape_anyway => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    Ok(())
}

/// `value` with one node, picked by `u`, replaced by a value built from `u` (which may happen
/// to equal the old one).
pub fn mutate(value: &Value, u: &mut Unstructured<'_>) -> Result<Value> {
    let descend = !u.is_empty() && u.ratio(3u8, 4u8)?;
    match value {
        Value::Array(items) if descend && !items.is_empty() => {
            let i = u.choose_index(items.len())?;
            let mut items = items.clone();
            items[i] = mutate(&items[i], u)?;
            Ok(Value::Array(items))
        }
        Value::Object(map) if descend && !map.is_empty() => {
            let i = u.choose_index(map.len())?;
            let mut map = map.clone();
            if let Some((_, v)) = map.iter_mut().nth(i) {
                *v = mutate(v, u)?;
            }
            Ok(Value::Object(map))
        }
        _ => Ok(Json::arbitrary(u)?.to_value()),
    }
}
