//! Request fingerprints: a SHA-256 digest of what the request asks for.
//!
//! JSON is fingerprinted by its canonical text (see [`canonical_json`]), produced by a strict
//! RFC 8259 parser of our own rather than through `serde_json::Value`: a `Value` holds numbers
//! as `u64`, `i64` or `f64` and keeps only the last of two members with one name, so it would
//! merge payloads that differ.

#[cfg(test)]
mod tape;
#[cfg(test)]
mod tests;
mod text;

#[cfg(test)]
use tape::canonicalise_with;
use text::*;

use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::fmt;

/// A SHA-256 digest identifying the payload sent with a key.
///
/// Reusing a key with a different fingerprint is refused as a mismatch. Build one from raw
/// bytes, from JSON in canonical form, or from the parts of an HTTP request with
/// [`Fingerprint::builder`].
///
/// ```
/// use idempotency_core::Fingerprint;
///
/// let a = Fingerprint::from_json_slice(br#"{"a":1,"b":[{"d":1,"c":2}]}"#)?;
/// let b = Fingerprint::from_json_slice(br#"{"b":[{"c":2,"d":1}],"a":1}"#)?;
/// assert_eq!(a, b);
/// // Numbers count by their exact value: every digit, and only the value.
/// assert_ne!(
///     Fingerprint::from_json_slice(br#"{"amount":0.1}"#)?,
///     Fingerprint::from_json_slice(br#"{"amount":0.10000000000000000001}"#)?,
/// );
/// assert_eq!(
///     Fingerprint::from_json_slice(br#"{"amount":1}"#)?,
///     Fingerprint::from_json_slice(br#"{"amount":1.0}"#)?,
/// );
///
/// let req = Fingerprint::builder()
///     .method("POST")
///     .path("/orders")
///     .query("dry_run=false")
///     .content_type("application/json")
///     .body(br#"{"sku":"A1","qty":2}"#)
///     .finish();
/// assert_ne!(req, Fingerprint::from_bytes(b"something else"));
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps a digest computed elsewhere (for example one read back from a store).
    pub const fn from_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// SHA-256 of raw bytes.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// SHA-256 of the canonical text of an already parsed JSON value (see
    /// [`canonical_json`]): the same fingerprint as [`Fingerprint::from_json_slice`] of the
    /// text `serde_json` serialises `value` to.
    ///
    /// A `Value` cannot hold what its parser dropped: serde_json (without its
    /// `arbitrary_precision` feature) reads a number into a `u64`, `i64` or `f64`, so
    /// `0.10000000000000000001` arrives here as `0.1`, and of two members with one name only
    /// the last is left. **When the payload arrives as bytes, fingerprint the bytes**
    /// ([`Fingerprint::from_json_slice`], or [`FingerprintBuilder::body`] with a JSON content
    /// type): only then is every digit and every member part of the fingerprint.
    pub fn from_json(value: &serde_json::Value) -> Self {
        let mut hasher = HashSink::default();
        write_value(value, &mut hasher);
        Self(hasher.finish())
    }

    /// Parses JSON strictly (RFC 8259) and fingerprints its canonical text (see
    /// [`canonical_json`]): the SHA-256 of [`canonical_json_slice`]'s text. Every digit of
    /// every number and every member of every object counts; key order, whitespace and the
    /// way a string is escaped do not. Text already in canonical form is hashed as it is,
    /// without a copy; other text is written once, in one pass, into a buffer as long as it.
    ///
    /// Fails on text that is not JSON or that nests arrays and objects deeper than 127 levels
    /// (serde_json's limit); a number outside the `f64` range, such as `1e400`, is JSON and
    /// is fingerprinted like any other.
    pub fn from_json_slice(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        canonical_digest(bytes)
            .map(Self)
            .ok_or_else(|| not_canonicalisable(bytes))
    }

    /// The fingerprint of a request value: the SHA-256 of the canonical JSON of what serde
    /// writes for it, so two values that serialize to the same JSON (whatever the order of a
    /// map's entries) share a fingerprint, and a changed field changes it.
    ///
    /// Fails only when `value` cannot be written as JSON (a map whose keys are not strings, a
    /// `Serialize` impl that returns an error), as [`crate::Error::Codec`].
    ///
    /// ```
    /// use idempotency_core::Fingerprint;
    /// #[derive(serde::Serialize)]
    /// struct Charge { amount: u64, currency: &'static str }
    ///
    /// let a = Fingerprint::of(&Charge { amount: 1200, currency: "EUR" })?;
    /// assert_eq!(a, Fingerprint::from_json(&serde_json::json!({"currency": "EUR", "amount": 1200})));
    /// assert_ne!(a, Fingerprint::of(&Charge { amount: 1300, currency: "EUR" })?);
    /// # Ok::<(), idempotency_core::Error>(())
    /// ```
    pub fn of<T: serde::Serialize + ?Sized>(value: &T) -> Result<Self, crate::Error> {
        let text = serde_json::to_vec(value).map_err(|source| crate::Error::Codec { source })?;
        Self::from_json_slice(&text).map_err(|source| crate::Error::Codec { source })
    }

    /// Starts a fingerprint over method, path, query, content type and body.
    pub fn builder<'a>() -> FingerprintBuilder<'a> {
        FingerprintBuilder::default()
    }

    /// The digest bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex of the digest.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses a 64-character hex digest.
    pub fn from_hex(s: &str) -> Result<Self, hex::FromHexError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)?;
        Ok(Self(out))
    }

    /// Wraps a digest from a byte slice, which must be exactly 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 32]>::try_from(bytes).ok().map(Self)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The canonical JSON text of `value`: the same text as [`canonical_json_slice`] gives for
/// the text `serde_json` serialises `value` to (a float is written in its shortest
/// round-trip form first, as serde_json prints it). See [`Fingerprint::from_json`] for what
/// a `Value` has already lost.
///
/// # The canonical form
///
/// Close to RFC 8785 (JCS), but exact for numbers of any size:
///
/// - no whitespace outside strings; `null`, `true` and `false` as they are;
/// - **strings** are decoded (escapes resolved, surrogate pairs joined) and written again
///   with only `"`, `\` and the control characters U+0000 to U+001F escaped (`\b`, `\t`,
///   `\n`, `\f`, `\r`, otherwise `\u00xx` in lower-case hex), everything else as UTF-8. So
///   `"\u00e9"`, `"é"` and `"\u00E9"` are one string, and `"\/"` is `"/"`;
/// - **arrays** keep their order;
/// - **objects** have their members sorted by the UTF-8 bytes of their decoded names (RFC
///   8785 sorts by UTF-16 code units instead), at every depth. Members with the same name
///   are all kept, in the order they were written: `{"a":1,"a":2}` is neither `{"a":2}` nor
///   `{"a":2,"a":1}` (parsers disagree on which duplicate wins, so their order is part of the
///   payload);
/// - **numbers** are written by their exact decimal value, every digit kept, so two numbers
///   have one text exactly when they are equal as mathematical values: `1`, `1.0`, `1e0`,
///   `10e-1` and `0.1e1` are all `1`; `0`, `-0`, `0.0` and `-0e5` are all `0`; while
///   `0.1` and `0.10000000000000000001`, or `18446744073709551616` and
///   `18446744073709551617`, or `1e400` and `2e400`, stay apart. Integers and floats are not
///   told apart: re-serialising a payload (which turns `1.0` into `1` in many languages)
///   must not turn a retry into a mismatch. The text: with the value written as the digits
///   `d₁…d_k` (no leading or trailing zeros) times `10^(n−k)`, it is `d₁…d_k` followed by
///   `n−k` zeros if `k ≤ n ≤ 21`; `d₁…d_n.d_(n+1)…d_k` if `0 < n ≤ 21`; `0.` then `−n`
///   zeros then `d₁…d_k` if `−6 < n ≤ 0`; otherwise `d₁[.d₂…d_k]e±(n−1)`, with a `-` in front
///   of negative values. These are ECMAScript's `Number::toString` rules, so for a number
///   written as the shortest round-trip form of an `f64` (as serde_json and JavaScript write
///   them) the text is RFC 8785's: `100`, `1.5`, `0.000001`, `1e+21`, `1.5e-7`.
///
/// Text that is not JSON (RFC 8259, strictly: no byte order mark, no trailing commas, no
/// lone surrogates, valid UTF-8) or that nests arrays and objects deeper than 127 levels
/// (serde_json's limit) has no canonical form.
///
/// # Format
///
/// Numbers are written by their exact value (never rounded to an `f64`, `1.0` and `1` apart
/// as written) and duplicate member names are kept. [`FingerprintBuilder`] marks the format
/// it hashes (`idempotency-fingerprint-v3`), so a fingerprint of another format never equals
/// one of this format: a record stored under another format is a mismatch, never a wrong
/// replay. The changelog lists each change of format.
pub fn canonical_json(value: &serde_json::Value) -> String {
    let mut out = Vec::new();
    write_value(value, &mut out);
    // Only valid UTF-8 is written: decoded strings, ASCII escapes, numbers and punctuation.
    String::from_utf8(out).unwrap_or_default()
}

/// Parses JSON text strictly (RFC 8259) and returns its canonical text (described at
/// [`canonical_json`]), which keeps every digit of every number and every member of every
/// object. Fails on text that is not JSON or nests deeper than 127 levels.
///
/// ```
/// use idempotency_core::canonical_json_slice;
///
/// let text = canonical_json_slice(br#"{ "b": [1.0, -0, 2.50e1], "a": "\u00e9", "a": 1e400 }"#)?;
/// assert_eq!(text, r#"{"a":"é","a":1e+400,"b":[1,0,25]}"#);
/// # Ok::<(), serde_json::Error>(())
/// ```
pub fn canonical_json_slice(bytes: &[u8]) -> Result<String, serde_json::Error> {
    let mut out = Vec::with_capacity(output_capacity(bytes));
    match canonicalise(bytes, &mut out) {
        None => return Err(not_canonicalisable(bytes)),
        Some(Canonical::Input) => out.extend_from_slice(bytes),
        Some(Canonical::Written) => {}
    }
    // Only valid UTF-8 is written (the input was checked to be UTF-8).
    String::from_utf8(out).map_err(|_| not_canonicalisable(bytes))
}

/// The SHA-256 of the canonical text of `bytes`, or `None` when they have none.
fn canonical_digest(bytes: &[u8]) -> Option<[u8; 32]> {
    let mut out = Vec::with_capacity(output_capacity(bytes));
    let text = match canonicalise(bytes, &mut out)? {
        Canonical::Input => bytes,
        Canonical::Written => &out,
    };
    Some(Sha256::digest(text).into())
}

/// Room for the canonical text of `bytes` (usually shorter, or as long): a little more, for
/// numbers written longer (`1e5` is `100000`).
fn output_capacity(bytes: &[u8]) -> usize {
    bytes
        .len()
        .saturating_add(bytes.len() / 16)
        .saturating_add(16)
}

/// The error for text without a canonical form: serde_json's own when it refuses the text
/// too (with its position), otherwise one of ours. Only on the failure path.
fn not_canonicalisable(bytes: &[u8]) -> serde_json::Error {
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Err(e) => e,
        Ok(_) => {
            <serde_json::Error as serde::de::Error>::custom("JSON text without a canonical form")
        }
    }
}

/// Where canonical text goes: a hasher (through a small buffer) or a byte buffer.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

/// SHA-256 behind a small buffer: canonical text comes in many short pieces (a comma, a
/// quote, a number's digits), and each `update` of the hasher has a cost of its own.
struct HashSink {
    hasher: Sha256,
    buf: [u8; 256],
    len: usize,
}

impl Default for HashSink {
    fn default() -> Self {
        Self {
            hasher: Sha256::new(),
            buf: [0; 256],
            len: 0,
        }
    }
}

impl HashSink {
    fn finish(mut self) -> [u8; 32] {
        self.hasher.update(&self.buf[..self.len]);
        self.hasher.finalize().into()
    }
}

impl Sink for HashSink {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        if let Some(room) = self.buf.get_mut(self.len..self.len + bytes.len()) {
            copy_short(room, bytes);
            self.len += bytes.len();
        } else {
            self.hasher.update(&self.buf[..self.len]);
            self.len = 0;
            if bytes.len() < self.buf.len() {
                self.buf[..bytes.len()].copy_from_slice(bytes);
                self.len = bytes.len();
            } else {
                self.hasher.update(bytes);
            }
        }
    }
}

/// `dst.copy_from_slice(src)` for slices of one length, in a few fixed-size moves when they
/// are short (most pieces of canonical text are), rather than a call to `memcpy`.
#[inline(always)]
fn copy_short(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    if n > 32 || n != dst.len() {
        dst.copy_from_slice(src);
    } else if n >= 16 {
        dst[..16].copy_from_slice(&src[..16]);
        dst[n - 16..].copy_from_slice(&src[n - 16..]);
    } else if n >= 8 {
        dst[..8].copy_from_slice(&src[..8]);
        dst[n - 8..].copy_from_slice(&src[n - 8..]);
    } else if n >= 4 {
        dst[..4].copy_from_slice(&src[..4]);
        dst[n - 4..].copy_from_slice(&src[n - 4..]);
    } else if n > 0 {
        dst[0] = src[0];
        dst[n / 2] = src[n / 2];
        dst[n - 1] = src[n - 1];
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

// ---------------------------------------------------------------------------------------
// Values

fn write_value<S: Sink>(value: &serde_json::Value, out: &mut S) {
    use serde_json::Value;
    match value {
        Value::Null => out.put(b"null"),
        Value::Bool(true) => out.put(b"true"),
        Value::Bool(false) => out.put(b"false"),
        Value::Number(n) => write_value_number(n, out),
        Value::String(s) => write_string(s.as_bytes(), out),
        Value::Array(items) => {
            out.put(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_value(item, out);
            }
            out.put(b"]");
        }
        Value::Object(map) => {
            // Sort explicitly: serde_json's map keeps insertion order when another crate in
            // the build enables its `preserve_order` feature.
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.put(b"{");
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_string(k.as_bytes(), out);
                out.put(b":");
                write_value(v, out);
            }
            out.put(b"}");
        }
    }
}

/// A `Value`'s number, through the text serde_json prints for it (the shortest round-trip
/// form of a float), so that a value and its serialisation have one canonical text.
fn write_value_number<S: Sink>(n: &serde_json::Number, out: &mut S) {
    let mut buf = StackText::default();
    let owned;
    let text: &[u8] = if fmt::write(&mut buf, format_args!("{n}")).is_ok() {
        buf.as_bytes()
    } else {
        // Longer than the buffer: only with serde_json's `arbitrary_precision`, which keeps
        // the number's text as it was read.
        owned = n.to_string();
        owned.as_bytes()
    };
    match scan_number(text, 0) {
        Some((number, end)) if end == text.len() => write_number(&number, out),
        // serde_json prints numbers as JSON numbers; keep its text should that ever change.
        _ => out.put(text),
    }
}

/// A small stack buffer for a number's text.
struct StackText {
    buf: [u8; 48],
    len: usize,
}

impl Default for StackText {
    fn default() -> Self {
        Self {
            buf: [0; 48],
            len: 0,
        }
    }
}

impl StackText {
    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl fmt::Write for StackText {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len.checked_add(s.len()).ok_or(fmt::Error)?;
        self.buf
            .get_mut(self.len..end)
            .ok_or(fmt::Error)?
            .copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Strings

/// Writes a string (valid UTF-8 bytes, escapes already resolved) in canonical form: `"`, `\`
/// and control characters escaped as serde_json and RFC 8785 escape them, the rest as is.
fn write_string<S: Sink>(s: &[u8], out: &mut S) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.put(b"\"");
    let mut run = 0;
    for (i, &b) in s.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => &[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ],
            _ => continue,
        };
        out.put(&s[run..i]);
        out.put(escape);
        run = i + 1;
    }
    out.put(&s[run..]);
    out.put(b"\"");
}

// ---------------------------------------------------------------------------------------
// Numbers

/// A JSON number as written: `-? int (. frac)? ([eE] [+-]? exp)?`, digits as ASCII.
#[derive(Debug, Clone, Copy)]
struct Number<'a> {
    negative: bool,
    int: &'a [u8],
    frac: &'a [u8],
    exp_negative: bool,
    exp: &'a [u8],
}

/// Reads a JSON number (RFC 8259 grammar) starting at `s[i]`; returns it and the index after
/// it.
fn scan_number(s: &[u8], mut i: usize) -> Option<(Number<'_>, usize)> {
    fn digits(s: &[u8], i: usize) -> usize {
        s.get(i..).map_or(0, |rest| {
            rest.iter().take_while(|b| b.is_ascii_digit()).count()
        })
    }
    let negative = s.get(i) == Some(&b'-');
    if negative {
        i += 1;
    }
    let int_len = match s.get(i)? {
        b'0' => 1,
        b'1'..=b'9' => digits(s, i),
        _ => return None,
    };
    let int = &s[i..i + int_len];
    i += int_len;
    let mut frac: &[u8] = &[];
    if s.get(i) == Some(&b'.') {
        let n = digits(s, i + 1);
        if n == 0 {
            return None;
        }
        frac = &s[i + 1..i + 1 + n];
        i += 1 + n;
    }
    let mut exp_negative = false;
    let mut exp: &[u8] = &[];
    if matches!(s.get(i), Some(b'e' | b'E')) {
        i += 1;
        match s.get(i) {
            Some(b'-') => {
                exp_negative = true;
                i += 1;
            }
            Some(b'+') => i += 1,
            _ => {}
        }
        let n = digits(s, i);
        if n == 0 {
            return None;
        }
        exp = &s[i..i + n];
        i += n;
    }
    Some((
        Number {
            negative,
            int,
            frac,
            exp_negative,
            exp,
        },
        i,
    ))
}

/// Exponents with more significant digits than this take the arbitrary-precision path.
const SMALL_EXP_DIGITS: usize = 36;

/// Writes the canonical text of a number's exact value (rules at [`canonical_json`]).
fn write_number<S: Sink>(num: &Number<'_>, out: &mut S) {
    const ZEROS: &[u8; 21] = b"000000000000000000000";
    let (int, frac) = (num.int, num.frac);
    let total = int.len() + frac.len();
    let digit = |i: usize| {
        if i < int.len() {
            int[i]
        } else {
            frac[i - int.len()]
        }
    };
    // The significant digits are positions `lead..total - trail` of `int ++ frac`.
    let lead = (0..total).take_while(|&i| digit(i) == b'0').count();
    if lead == total {
        out.put(b"0");
        return;
    }
    let trail = (0..total).rev().take_while(|&i| digit(i) == b'0').count();
    let k = total - lead - trail;
    let put_digits = |out: &mut S, from: usize, to: usize| {
        // Positions `from..to` of the significant digits.
        let (from, to) = (lead + from, lead + to);
        if from < int.len() {
            out.put(&int[from..to.min(int.len())]);
        }
        if to > int.len() {
            out.put(&frac[from.max(int.len()) - int.len()..to - int.len()]);
        }
    };
    if num.negative {
        out.put(b"-");
    }
    // value = 0.d₁…d_k × 10^n with n = point + exp.
    let point = int.len() as i128 - lead as i128;
    let exp_digits = trim_leading_zeros(num.exp);
    if exp_digits.len() > SMALL_EXP_DIGITS {
        // |exp| ≥ 10^36, far outside every fixed-notation range.
        put_digits(out, 0, 1);
        if k > 1 {
            out.put(b".");
            put_digits(out, 1, k);
        }
        write_big_exponent(num.exp_negative, exp_digits, point - 1, out);
        return;
    }
    let exp = exp_digits
        .iter()
        .fold(0i128, |acc, d| acc * 10 + i128::from(d - b'0'));
    let n = point + if num.exp_negative { -exp } else { exp };
    let k_ = k as i128;
    if k_ <= n && n <= 21 {
        put_digits(out, 0, k);
        out.put(&ZEROS[..(n - k_) as usize]);
    } else if 0 < n && n <= 21 {
        put_digits(out, 0, n as usize);
        out.put(b".");
        put_digits(out, n as usize, k);
    } else if -6 < n && n <= 0 {
        out.put(b"0.");
        out.put(&ZEROS[..(-n) as usize]);
        put_digits(out, 0, k);
    } else {
        put_digits(out, 0, 1);
        if k > 1 {
            out.put(b".");
            put_digits(out, 1, k);
        }
        let e = n - 1;
        out.put(if e < 0 { b"e-" } else { b"e+" });
        write_u128(e.unsigned_abs(), out);
    }
}

fn trim_leading_zeros(digits: &[u8]) -> &[u8] {
    let zeros = digits.iter().take_while(|&&d| d == b'0').count();
    &digits[zeros..]
}

fn write_u128<S: Sink>(mut v: u128, out: &mut S) {
    let mut buf = [0u8; 40];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.put(&buf[i..]);
}

/// Writes `e±|exp + delta|` where `exp` is `±digits` with more than 36 significant digits
/// and `|delta| < 2^64`, so the sum has the sign of `exp`. The only allocation of the number
/// path, for exponents no real payload has.
fn write_big_exponent<S: Sink>(negative: bool, digits: &[u8], delta: i128, out: &mut S) {
    // |exp + delta| = |exp| + delta·sign(exp).
    let delta = if negative { -delta } else { delta };
    let mut magnitude: Vec<u8> = digits.iter().map(|d| d - b'0').collect();
    let mut carry = delta.unsigned_abs();
    let adding = delta >= 0;
    for d in magnitude.iter_mut().rev() {
        if carry == 0 {
            break;
        }
        let step = (carry % 10) as u8;
        carry /= 10;
        if adding {
            let sum = *d + step;
            *d = sum % 10;
            carry += u128::from(sum / 10);
        } else if *d >= step {
            *d -= step;
        } else {
            *d = *d + 10 - step;
            carry += 1;
        }
    }
    if adding && carry > 0 {
        // Cannot happen for |delta| < |exp|, but never lose a digit.
        let mut high = Vec::new();
        write_u128(carry, &mut high);
        magnitude.splice(0..0, high.into_iter().map(|d| d - b'0'));
    }
    out.put(if negative { b"e-" } else { b"e+" });
    let zeros = magnitude.iter().take_while(|&&d| d == 0).count();
    let text: Vec<u8> = magnitude[zeros..].iter().map(|d| d + b'0').collect();
    out.put(&text);
}

/// Builds a fingerprint over the parts of a request. Every part is length-prefixed, so moving
/// bytes from one part to another changes the digest. A body whose content type is JSON
/// (`application/json` or any `+json` type) and that has a canonical form (see
/// [`canonical_json`]: every digit and every member counts, key order and whitespace do not)
/// is canonicalised first; any other body is hashed as raw bytes.
///
/// Headers ([`FingerprintBuilder::header`]) are optional: a fingerprint built without any is
/// the digest of the method, path, query, content type and body alone, and adds nothing for
/// headers to the hashed stream.
#[derive(Debug, Default, Clone)]
pub struct FingerprintBuilder<'a> {
    method: Option<Cow<'a, str>>,
    path: Option<Cow<'a, str>>,
    query: Option<Cow<'a, str>>,
    content_type: Option<Cow<'a, str>>,
    body: Option<&'a [u8]>,
    headers: Vec<(Cow<'a, str>, Vec<u8>)>,
}

impl<'a> FingerprintBuilder<'a> {
    /// The HTTP method (case-insensitive: it is upper-cased).
    pub fn method(mut self, method: impl Into<Cow<'a, str>>) -> Self {
        let method = method.into();
        self.method = Some(if method.bytes().any(|b| b.is_ascii_lowercase()) {
            Cow::Owned(method.to_ascii_uppercase())
        } else {
            method
        });
        self
    }
    /// The request path.
    pub fn path(mut self, path: impl Into<Cow<'a, str>>) -> Self {
        self.path = Some(path.into());
        self
    }
    /// The raw query string (without `?`).
    pub fn query(mut self, query: impl Into<Cow<'a, str>>) -> Self {
        self.query = Some(query.into());
        self
    }
    /// The `Content-Type` header value.
    pub fn content_type(mut self, content_type: impl Into<Cow<'a, str>>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }
    /// The request body, borrowed until [`FingerprintBuilder::finish`] (it is not copied).
    pub fn body(mut self, body: &'a [u8]) -> Self {
        self.body = Some(body);
        self
    }
    /// A request header that is part of the request's meaning (a precondition such as
    /// `If-Match`, a tenant header…). The name is case-insensitive (it is lower-cased); the
    /// value is hashed as given. Headers count in the order they are added, and a name added
    /// twice counts twice, so add them in a fixed order.
    ///
    /// ```
    /// use idempotency_core::Fingerprint;
    ///
    /// let base = || Fingerprint::builder().method("PATCH").path("/books/1");
    /// let v1 = base().header("If-Match", "\"v1\"").finish();
    /// let v2 = base().header("if-match", "\"v2\"").finish();
    /// assert_ne!(v1, v2);
    /// assert_eq!(v1, base().header("if-match", b"\"v1\"").finish());
    /// // A fingerprint without headers differs from one with them.
    /// assert_ne!(base().finish(), v1);
    /// ```
    pub fn header(mut self, name: impl Into<Cow<'a, str>>, value: impl AsRef<[u8]>) -> Self {
        let name = name.into();
        let name = if name.bytes().any(|b| b.is_ascii_uppercase()) {
            Cow::Owned(name.to_ascii_lowercase())
        } else {
            name
        };
        self.headers.push((name, value.as_ref().to_vec()));
        self
    }

    /// Computes the digest. A JSON body contributes `J` and the SHA-256 of its canonical
    /// text (see [`Fingerprint::from_json_slice`]); any other body `R` and its bytes.
    ///
    /// The stream starts with its format, `idempotency-fingerprint-v3`, so a fingerprint of
    /// another format never equals this one (see [`canonical_json`] for the format).
    pub fn finish(self) -> Fingerprint {
        let mut h = Sha256::new();
        h.update(b"idempotency-fingerprint-v3");
        for field in [&self.method, &self.path, &self.query, &self.content_type] {
            match field {
                Some(s) => hash_part(&mut h, &[s.as_bytes()]),
                None => h.update([0u8]),
            }
        }
        let is_json = self.content_type.as_deref().is_some_and(is_json_media_type);
        match self.body {
            None => h.update([0u8]),
            Some(body) => match is_json.then(|| canonical_digest(body)).flatten() {
                Some(digest) => hash_part(&mut h, &[b"J", &digest]),
                None => hash_part(&mut h, &[b"R", body]),
            },
        }
        // Headers come after the body and only when there are some, so a fingerprint without
        // headers is the digest older versions computed. `H`, their count, then each name and
        // value length-prefixed: no header can be read as another.
        if !self.headers.is_empty() {
            h.update(b"H");
            h.update((self.headers.len() as u64).to_be_bytes());
            for (name, value) in &self.headers {
                hash_part(&mut h, &[name.as_bytes()]);
                hash_part(&mut h, &[value]);
            }
        }
        Fingerprint(h.finalize().into())
    }
}

/// Hashes one present part: a marker, its length, then its chunks.
fn hash_part(h: &mut Sha256, chunks: &[&[u8]]) {
    let len: usize = chunks.iter().map(|c| c.len()).sum();
    h.update([1u8]);
    h.update((len as u64).to_be_bytes());
    for c in chunks {
        h.update(c);
    }
}

/// Whether a `Content-Type` value names JSON: `application/json` or a `+json` suffix type,
/// parameters ignored.
pub fn is_json_media_type(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .as_bytes();
    // Compared without regard to case, without a lower-cased copy.
    let Some(subtype) = essence
        .get(..12)
        .filter(|t| t.eq_ignore_ascii_case(b"application/"))
        .map(|_| &essence[12..])
    else {
        return false;
    };
    subtype.eq_ignore_ascii_case(b"json")
        || (subtype.len() >= 5 && subtype[subtype.len() - 5..].eq_ignore_ascii_case(b"+json"))
}
