//! Shared generators for the fuzz targets: JSON values built from fuzz input, and JSON text
//! that denotes a given value but is written differently (keys permuted, whitespace, string
//! escapes, numbers written in other forms with the same exact value), and the comparisons
//! the oracles need.

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
        Value::Null | Value::Bool(_) => out.push_str(&value.to_string()),
        Value::Number(n) => write_number(&n.to_string(), u, out)?,
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

/// Another JSON text for the number serde_json writes as `text`, with the same exact value:
/// trailing zeros added, the point moved (the exponent making up for it), `e` or `E`, an
/// optional `+` and leading zeros in the exponent, `-0` for zero. As serde_json wrote it
/// when `u` runs out.
fn write_number(text: &str, u: &mut Unstructured<'_>, out: &mut String) -> Result<()> {
    if u.is_empty() || !u.ratio(1u8, 2u8)? {
        out.push_str(text);
        return Ok(());
    }
    let (negative, rest) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exp) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().unwrap_or(0)),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    // value = digits × 10^exp
    let mut digits = format!("{int}{frac}").trim_start_matches('0').to_string();
    let mut exp = exp - frac.len() as i64;
    if digits.is_empty() {
        digits.push('0');
    }
    let zero = digits == "0";
    for _ in 0..u.int_in_range(0..=3u8)? {
        digits.push('0');
        exp -= 1;
    }
    // Digits before the point: none (`0.ddd`), or some, never with a leading zero.
    let point = if zero {
        1
    } else {
        u.int_in_range(0..=digits.len())?
    };
    let (int, frac) = digits.split_at(point);
    let exp = exp + frac.len() as i64;
    if negative || (zero && u.ratio(1u8, 2u8)?) {
        out.push('-');
    }
    out.push_str(if int.is_empty() { "0" } else { int });
    if !frac.is_empty() {
        out.push('.');
        out.push_str(frac);
    }
    if exp != 0 || u.ratio(1u8, 4u8)? {
        out.push(*u.choose(&['e', 'E'])?);
        if exp < 0 {
            out.push('-');
        } else if u.ratio(1u8, 2u8)? {
            out.push('+');
        }
        for _ in 0..u.int_in_range(0..=2u8)? {
            out.push('0');
        }
        out.push_str(&exp.unsigned_abs().to_string());
    }
    Ok(())
}

/// Equality of JSON values with numbers compared by the exact value of the text serde_json
/// writes for them (for a float its shortest round-trip form), which is what the canonical
/// form keeps: `1` equals `1.0` and `-0.0` equals `0`, while `0.1` and the next float
/// differ. Independent of the canonical writer: std's `{:e}` writes the significant digits
/// and the exponent of an integer and of a float (shortest form) alike.
pub fn exact_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => exact_text(x) == exact_text(y),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| exact_eq(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| exact_eq(v, w)))
        }
        _ => a == b,
    }
}

fn exact_text(n: &Number) -> String {
    let text = match (n.as_u64(), n.as_i64(), n.as_f64()) {
        (Some(u), _, _) => format!("{u:e}"),
        (_, Some(i), _) => format!("{i:e}"),
        (_, _, Some(f)) => format!("{f:e}"),
        _ => n.to_string(),
    };
    if text == "-0e0" {
        "0e0".to_string()
    } else {
        text
    }
}

/// Equality of JSON values with numbers compared as `f64`s: what survives serde_json reading
/// a text whose numbers have more digits than an `f64` holds (it rounds them correctly, and
/// so does `as f64`).
pub fn approx_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| approx_eq(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| approx_eq(v, w)))
        }
        _ => a == b,
    }
}

/// Positions of the digits of `text` (valid JSON) that are in a number's integer or
/// fraction part, not in a string or an exponent. Changing one of them to another digit
/// changes that number's exact value.
pub fn mantissa_digits(text: &[u8]) -> Vec<usize> {
    let (mut in_string, mut escaped, mut in_exponent) = (false, false, false);
    let mut out = Vec::new();
    for (i, &b) in text.iter().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'e' | b'E' => in_exponent = true,
            b'0'..=b'9' if !in_exponent => out.push(i),
            b'0'..=b'9' | b'+' | b'-' | b'.' => {}
            _ => in_exponent = false,
        }
    }
    out
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
