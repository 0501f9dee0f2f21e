//! Request fingerprints: a SHA-256 digest of what the request asks for.
//!
//! JSON is fingerprinted by its canonical text (see [`canonical_json`]), produced by a strict
//! RFC 8259 parser of our own rather than through `serde_json::Value`: a `Value` holds numbers
//! as `u64`, `i64` or `f64` and keeps only the last of two members with one name, so it would
//! merge payloads that differ.

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
    /// [`canonical_json`]): the SHA-256 of [`canonical_json_slice`]'s text, hashed as it is
    /// written (the text is never held whole). Every digit of every number and every member
    /// of every object
    /// counts; key order, whitespace and the way a string is escaped do not.
    ///
    /// Fails on text that is not JSON or that nests arrays and objects deeper than 127 levels
    /// (serde_json's limit); a number outside the `f64` range, such as `1e400`, is JSON and
    /// is fingerprinted like any other.
    pub fn from_json_slice(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        canonical_digest(bytes)
            .map(Self)
            .ok_or_else(|| not_canonicalisable(bytes))
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
/// # Versions
///
/// Before this form, numbers were written as serde_json prints a `Value` (integers and
/// floats apart, `1.0`, `0.0`, `1e+20`), numbers were rounded to an `f64` and duplicate
/// names were dropped. So [`Fingerprint::from_json`] and [`Fingerprint::from_json_slice`]
/// of a payload with floats, numbers beyond 64 bits or duplicate names differ from what
/// older versions computed (integers, strings, `true`, `false`, `null` and the structure
/// around them are written as before). [`FingerprintBuilder`] marks its format, now
/// `idempotency-fingerprint-v3`, so every request fingerprint differs from version 2's.
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
    let mut out = Vec::with_capacity(bytes.len());
    if !canonicalise(bytes, &mut out) {
        return Err(not_canonicalisable(bytes));
    }
    // Only valid UTF-8 is written (the input was checked to be UTF-8).
    String::from_utf8(out).map_err(|_| not_canonicalisable(bytes))
}

/// The SHA-256 of the canonical text of `bytes`, or `None` when they have none.
fn canonical_digest(bytes: &[u8]) -> Option<[u8; 32]> {
    let mut hasher = HashSink::default();
    canonicalise(bytes, &mut hasher).then(|| hasher.finish())
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

/// Where canonical text goes: a hasher (through a small buffer, so the text is never held
/// whole) or a byte buffer.
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

// ---------------------------------------------------------------------------------------
// Text

/// The deepest nesting of arrays and objects that has a canonical form: serde_json's limit
/// (it refuses a 128th level), which this module had while it parsed through serde_json.
const MAX_DEPTH: usize = 127;

/// Writes the canonical text of the JSON text `bytes` into `out`; `false` (with part of the
/// text possibly written) when `bytes` are not JSON or nest too deep.
///
/// One pass parses the text into a flat tape (a node per value, no allocation per value),
/// noting which values are already written in canonical form; a second writes it with object
/// members sorted, copying each such value (and each member from its name to the end of such
/// a value) from the input in one piece.
fn canonicalise<S: Sink>(bytes: &[u8], out: &mut S) -> bool {
    canonicalise_with::<S, true>(bytes, out)
}

/// [`canonicalise`], with `VERBATIM` saying whether spans of the input that are already in
/// canonical form are copied whole. Without it every token is written one by one: the
/// tests compare both writers, which must give the same text.
fn canonicalise_with<S: Sink, const VERBATIM: bool>(bytes: &[u8], out: &mut S) -> bool {
    // Outside strings JSON is ASCII, so this checks the UTF-8 of every string at once.
    if std::str::from_utf8(bytes).is_err() {
        return false;
    }
    let mut parser = Parser {
        s: bytes,
        i: 0,
        tape: Vec::with_capacity(bytes.len() / 8 + 1),
        arena: Vec::new(),
    };
    if parser.document().is_none() {
        return false;
    }
    let mut writer = Writer::<VERBATIM> {
        s: bytes,
        tape: &parser.tape,
        arena: &parser.arena,
        members: Vec::new(),
    };
    writer.value(0, out);
    true
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    /// `a..b`: the literal's text in the input (as for the other literals).
    Null,
    True,
    False,
    /// `a..b`: the number's text in the input.
    Number,
    /// `a..b`: the string's bytes between the quotes in the input, without escapes (so
    /// already canonical).
    Plain,
    /// `a..b`: the decoded string in the arena.
    Decoded,
    /// `a`: where the array starts in the input; `b`: the tape index after its last node.
    Array,
    /// `a`: where the object starts in the input; `b`: the tape index after its last node.
    /// Its members are name and value nodes in turn.
    Object,
}

/// The node's input text is its canonical text: a literal, a plain string, an integer
/// written as canonical, or an array or object without whitespace whose members are in
/// order and whose values are all verbatim.
const VERBATIM: u8 = 1;
/// On a member name: the name, the colon and the value follow each other without
/// whitespace, so the member's input text runs from the name's opening quote to the end of
/// the value.
const TIGHT: u8 = 2;
/// On an object: its members' names are plain and in canonical order as written.
const SORTED: u8 = 4;

#[derive(Debug, Clone, Copy)]
struct Node {
    tag: Tag,
    flags: u8,
    a: usize,
    b: usize,
    /// Where the value's text ends in the input.
    end: usize,
}

impl Node {
    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// Where the value's text starts in the input.
    fn start(&self) -> usize {
        match self.tag {
            // After the opening quote.
            Tag::Plain => self.a - 1,
            // Decoded strings are never copied from the input, so their start is not needed.
            _ => self.a,
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    tape: Vec<Node>,
    /// Decoded strings that had escapes.
    arena: Vec<u8>,
}

impl Parser<'_> {
    fn document(&mut self) -> Option<()> {
        self.ws();
        self.value(0)?;
        self.ws();
        (self.i == self.s.len()).then_some(())
    }

    /// Skips whitespace; whether there was any.
    fn ws(&mut self) -> bool {
        let from = self.i;
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
        self.i != from
    }

    fn node(&mut self, tag: Tag, flags: u8, a: usize, b: usize) {
        self.tape.push(Node {
            tag,
            flags,
            a,
            b,
            end: self.i,
        });
    }

    fn literal(&mut self, text: &[u8], tag: Tag) -> Option<()> {
        if !self.s.get(self.i..)?.starts_with(text) {
            return None;
        }
        let start = self.i;
        self.i += text.len();
        self.node(tag, VERBATIM, start, self.i);
        Some(())
    }

    /// One value at `depth` enclosing arrays and objects.
    fn value(&mut self, depth: usize) -> Option<()> {
        match *self.s.get(self.i)? {
            b'n' => self.literal(b"null", Tag::Null),
            b't' => self.literal(b"true", Tag::True),
            b'f' => self.literal(b"false", Tag::False),
            b'"' => self.string(),
            b'-' | b'0'..=b'9' => {
                let (number, end) = scan_number(self.s, self.i)?;
                let start = self.i;
                self.i = end;
                let flags = if is_canonical_integer(&number) {
                    VERBATIM
                } else {
                    0
                };
                self.node(Tag::Number, flags, start, end);
                Some(())
            }
            b'[' => self.array(depth),
            b'{' => self.object(depth),
            _ => None,
        }
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        let at = self.tape.len();
        self.node(Tag::Array, 0, self.i, 0);
        self.i += 1;
        let mut verbatim = !self.ws();
        if self.s.get(self.i) == Some(&b']') {
            self.i += 1;
        } else {
            loop {
                let element = self.tape.len();
                self.value(depth + 1)?;
                verbatim &= self.tape[element].has(VERBATIM) & !self.ws();
                match self.s.get(self.i)? {
                    b',' => {
                        self.i += 1;
                        verbatim &= !self.ws();
                    }
                    b']' => {
                        self.i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        self.close(at, verbatim);
        Some(())
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        let at = self.tape.len();
        self.node(Tag::Object, 0, self.i, 0);
        self.i += 1;
        let mut tight = !self.ws();
        let mut sorted = true;
        let mut values_verbatim = true;
        let mut previous: Option<NameKey<'_>> = None;
        if self.s.get(self.i) == Some(&b'}') {
            self.i += 1;
        } else {
            loop {
                if self.s.get(self.i) != Some(&b'"') {
                    return None;
                }
                let name = self.tape.len();
                self.string()?;
                let mut member_tight = !self.ws();
                if self.s.get(self.i) != Some(&b':') {
                    return None;
                }
                self.i += 1;
                member_tight &= !self.ws();
                let value = self.tape.len();
                self.value(depth + 1)?;
                let Node { tag, a, b, .. } = self.tape[name];
                if member_tight {
                    self.tape[name].flags |= TIGHT;
                }
                // Names in order as written (ties keep their order): compared as they are
                // in the input, so only plain names count.
                // (`a..b` index the arena for a decoded name, so only plain names are read.)
                if sorted {
                    sorted = tag == Tag::Plain && {
                        let key = NameKey::of(&self.s[a..b]);
                        let in_order = previous.is_none_or(|p| p <= key);
                        previous = Some(key);
                        in_order
                    };
                }
                values_verbatim &= self.tape[value].has(VERBATIM);
                tight &= member_tight & !self.ws();
                match self.s.get(self.i)? {
                    b',' => {
                        self.i += 1;
                        tight &= !self.ws();
                    }
                    b'}' => {
                        self.i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        self.close(at, sorted && tight && values_verbatim);
        if sorted {
            self.tape[at].flags |= SORTED;
        }
        Some(())
    }

    /// Ends the array or object whose node is at `at`, now that its text has been read.
    fn close(&mut self, at: usize, verbatim: bool) {
        let after = self.tape.len();
        let node = &mut self.tape[at];
        node.b = after;
        node.end = self.i;
        if verbatim {
            node.flags |= VERBATIM;
        }
    }

    /// A string starting at its opening quote.
    fn string(&mut self) -> Option<()> {
        self.i += 1;
        let start = self.i;
        self.i += plain_run(self.s.get(self.i..)?);
        match self.s.get(self.i)? {
            b'"' => {
                let end = self.i;
                self.i += 1;
                self.node(Tag::Plain, VERBATIM, start, end);
                return Some(());
            }
            b'\\' => {}
            _ => return None,
        }
        // Escapes: decode into the arena.
        let from = self.arena.len();
        self.arena.extend_from_slice(&self.s[start..self.i]);
        loop {
            match *self.s.get(self.i)? {
                b'"' => {
                    self.i += 1;
                    self.node(Tag::Decoded, 0, from, self.arena.len());
                    return Some(());
                }
                b'\\' => {
                    self.i += 1;
                    let decoded = match *self.s.get(self.i)? {
                        b'"' => b'"',
                        b'\\' => b'\\',
                        b'/' => b'/',
                        b'b' => 0x08,
                        b'f' => 0x0c,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'u' => {
                            self.i += 1;
                            let c = self.unicode_escape()?;
                            let mut buf = [0u8; 4];
                            self.arena
                                .extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            continue;
                        }
                        _ => return None,
                    };
                    self.arena.push(decoded);
                    self.i += 1;
                }
                0x00..=0x1f => return None,
                _ => {
                    let run = plain_run(&self.s[self.i..]);
                    self.arena.extend_from_slice(&self.s[self.i..self.i + run]);
                    self.i += run;
                }
            }
        }
    }

    /// The character of a `\u` escape whose four hex digits start at `self.i`, joining a
    /// surrogate pair; `None` for a lone surrogate.
    fn unicode_escape(&mut self) -> Option<char> {
        let high = self.hex4()?;
        let code = match high {
            0xd800..=0xdbff => {
                if self.s.get(self.i..self.i + 2) != Some(b"\\u") {
                    return None;
                }
                self.i += 2;
                let low = self.hex4()?;
                if !(0xdc00..=0xdfff).contains(&low) {
                    return None;
                }
                0x10000 + ((u32::from(high) - 0xd800) << 10) + (u32::from(low) - 0xdc00)
            }
            0xdc00..=0xdfff => return None,
            _ => u32::from(high),
        };
        let c = char::from_u32(code)?;
        Some(c)
    }

    fn hex4(&mut self) -> Option<u16> {
        let digits = self.s.get(self.i..self.i + 4)?;
        let mut v = 0u16;
        for &d in digits {
            v = v * 16 + u16::from((d as char).to_digit(16)? as u8);
        }
        self.i += 4;
        Some(v)
    }
}

/// Whether a number's text is its canonical text: an integer without a fraction or an
/// exponent, without leading zeros, of at most 21 digits (beyond them the canonical text
/// has an exponent), and not `-0` (which is `0`).
fn is_canonical_integer(n: &Number<'_>) -> bool {
    n.frac.is_empty()
        && n.exp.is_empty()
        && n.int.len() <= 21
        && match n.int {
            b"0" => !n.negative,
            int => int[0] != b'0',
        }
}

/// The length of the run of string bytes that need no decoding: up to a quote, a backslash,
/// a control character (not allowed in a string) or the end. Eight bytes at a time.
fn plain_run(s: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // The high bit of each byte of `v` that is zero. A borrow can also flag a byte above a
    // zero byte, never one below it, so the lowest flag is exact.
    let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let mut i = 0;
    while let Some(chunk) = s.get(i..i + 8) {
        let w = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
        // Bytes below 0x20; bytes from 0x80 up are never flagged (`!w` clears their bit).
        let control = w.wrapping_sub(0x20 * ONES) & !w & HIGH;
        let found =
            zero(w ^ (u64::from(b'"') * ONES)) | zero(w ^ (u64::from(b'\\') * ONES)) | control;
        if found != 0 {
            return i + (found.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    i + s[i..]
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        .unwrap_or(s.len() - i)
}

struct Writer<'a, const VERBATIM: bool> {
    s: &'a [u8],
    tape: &'a [Node],
    arena: &'a [u8],
    /// (name, name's tape index) of the members of the objects being written, innermost
    /// last; a member's value is the node after its name.
    members: Vec<(NameKey<'a>, usize)>,
}

/// A member name, ordered by its bytes; most comparisons are settled by the first eight,
/// read once as a number, without comparing the slices.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct NameKey<'a> {
    /// The first eight bytes, big-endian, zero-padded: a shorter name can only tie with a
    /// longer one here, never be ordered after it.
    head: u64,
    name: &'a [u8],
}

impl<'a> NameKey<'a> {
    #[inline]
    fn of(name: &'a [u8]) -> Self {
        let head = match name.first_chunk::<8>() {
            Some(first) => u64::from_be_bytes(*first),
            None => {
                let mut head = [0u8; 8];
                copy_short(&mut head[..name.len()], name);
                u64::from_be_bytes(head)
            }
        };
        Self { head, name }
    }
}

impl<'a, const COPY: bool> Writer<'a, COPY> {
    /// The tape index after the value at `at`.
    fn after(&self, at: usize) -> usize {
        match self.tape[at].tag {
            Tag::Array | Tag::Object => self.tape[at].b,
            _ => at + 1,
        }
    }

    /// The decoded bytes of the string at `at`.
    fn name(&self, at: usize) -> &'a [u8] {
        let Node { tag, a, b, .. } = self.tape[at];
        if tag == Tag::Decoded {
            &self.arena[a..b]
        } else {
            &self.s[a..b]
        }
    }

    /// Writes the value at tape index `at`.
    fn value<S: Sink>(&mut self, at: usize, out: &mut S) {
        let node = self.tape[at];
        if COPY && node.has(VERBATIM) {
            out.put(&self.s[node.start()..node.end]);
            return;
        }
        let Node { tag, a, b, .. } = node;
        match tag {
            Tag::Null => out.put(b"null"),
            Tag::True => out.put(b"true"),
            Tag::False => out.put(b"false"),
            Tag::Number => {
                let text = &self.s[a..b];
                match scan_number(text, 0) {
                    Some((number, end)) if end == text.len() => write_number(&number, out),
                    // Checked by the parser; keep the text should that ever be wrong.
                    _ => out.put(text),
                }
            }
            Tag::Plain => {
                out.put(b"\"");
                out.put(&self.s[a..b]);
                out.put(b"\"");
            }
            Tag::Decoded => write_string(&self.arena[a..b], out),
            Tag::Array => {
                out.put(b"[");
                let mut i = at + 1;
                while i < b {
                    if i > at + 1 {
                        out.put(b",");
                    }
                    self.value(i, out);
                    i = self.after(i);
                }
                out.put(b"]");
            }
            Tag::Object => {
                let base = self.members.len();
                let mut i = at + 1;
                while i < b {
                    self.members.push((NameKey::of(self.name(i)), i));
                    i = self.after(i + 1);
                }
                // By name, then by position: a stable sort without its buffer. Members
                // already in order as written stay as they are.
                if !(COPY && node.has(SORTED)) {
                    self.members[base..].sort_unstable();
                }
                out.put(b"{");
                for j in base..self.members.len() {
                    if j > base {
                        out.put(b",");
                    }
                    let (_, k) = self.members[j];
                    let (name, value) = (self.tape[k], self.tape[k + 1]);
                    if COPY && name.has(TIGHT) && name.has(VERBATIM) && value.has(VERBATIM) {
                        // `"name":value`, as written.
                        out.put(&self.s[name.start()..value.end]);
                        continue;
                    }
                    self.value(k, out);
                    out.put(b":");
                    self.value(k + 1, out);
                }
                self.members.truncate(base);
                out.put(b"}");
            }
        }
    }
}

/// Builds a fingerprint over the parts of a request. Every part is length-prefixed, so moving
/// bytes from one part to another changes the digest. A body whose content type is JSON
/// (`application/json` or any `+json` type) and that has a canonical form (see
/// [`canonical_json`]: every digit and every member counts, key order and whitespace do not)
/// is canonicalised first; any other body is hashed as raw bytes.
///
/// Headers ([`FingerprintBuilder::header`]) are optional: a fingerprint built without any is
/// the same digest as before headers could be added, so records stored by older versions
/// still match.
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
    /// // Without headers the digest is the one older versions computed.
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
    /// text (hashed as it is written, never held whole); any other body `R` and its bytes.
    ///
    /// The stream starts with its format, `idempotency-fingerprint-v3`. Version 3 writes
    /// numbers by their exact value and keeps duplicate member names; version 2 read JSON
    /// bodies through `serde_json::Value`, so a record stored by it does not match the same
    /// request fingerprinted by version 3 (a retry across the upgrade gets a mismatch, never
    /// a wrong replay).
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
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_form_sorts_every_depth() {
        let a = Fingerprint::from_json_slice(br#"{"a":1,"b":[{"d":1,"c":2}]}"#).unwrap();
        let b = Fingerprint::from_json_slice(br#"{"b":[{"c":2,"d":1}],"a":1}"#).unwrap();
        assert_eq!(a, b);
        let v: serde_json::Value =
            serde_json::from_str(r#"{ "z" : {"y":[3, {"b":null,"a":"\u00e9"}]}, "a":true }"#)
                .unwrap();
        assert_eq!(
            canonical_json(&v),
            r#"{"a":true,"z":{"y":[3,{"a":"é","b":null}]}}"#
        );
    }

    #[test]
    fn json_differences_matter() {
        let a = Fingerprint::from_json_slice(br#"{"a":[1,2]}"#).unwrap();
        let b = Fingerprint::from_json_slice(br#"{"a":[2,1]}"#).unwrap();
        let c = Fingerprint::from_json_slice(br#"{"a":"1"}"#).unwrap();
        let d = Fingerprint::from_json_slice(br#"{"a":1}"#).unwrap();
        assert_ne!(a, b);
        assert_ne!(c, d);
        assert!(Fingerprint::from_json_slice(b"{\"a\":").is_err());
    }

    /// Found by the `fingerprint_text` fuzz target: with serde_json's default best-effort
    /// float parsing, `40201e200` read as 4.0200999999999997e204, whose canonical text read
    /// back as 4.0201e204, so one number written two ways had two fingerprints. The workspace
    /// enables serde_json's `float_roundtrip`, which parses every float exactly.
    #[test]
    fn floats_parse_exactly_so_canonical_text_is_a_fixed_point() {
        for (a, b) in [
            (&b"40201e200"[..], &b"4.0201e204"[..]),
            (b"2.670434942875878e-306", b"0.2670434942875878e-305"),
            (b"[1.5, 0.1]", b"[15e-1, 1e-1]"),
        ] {
            assert_eq!(
                Fingerprint::from_json_slice(a).unwrap(),
                Fingerprint::from_json_slice(b).unwrap(),
                "{} and {}",
                String::from_utf8_lossy(a),
                String::from_utf8_lossy(b)
            );
            let v: serde_json::Value = serde_json::from_slice(a).unwrap();
            let c = canonical_json(&v);
            let again: serde_json::Value = serde_json::from_str(&c).unwrap();
            assert_eq!(again, v);
            assert_eq!(canonical_json(&again), c);
        }
    }

    /// Found by the `fingerprint_value` fuzz target: `-0.0` and `0.0` are equal values but
    /// were written as two canonical texts, so they had two fingerprints. Since numbers are
    /// written by their exact value, every zero is `0`, integer or float.
    #[test]
    fn signed_zeros_are_one_value() {
        let neg: serde_json::Value = serde_json::from_str("-0.0").unwrap();
        let pos: serde_json::Value = serde_json::from_str("0.0").unwrap();
        assert_eq!(neg, pos);
        assert_eq!(canonical_json(&neg), "0");
        assert_eq!(Fingerprint::from_json(&neg), Fingerprint::from_json(&pos));
        assert_eq!(
            Fingerprint::from_json_slice(br#"{"a":[-0.0, -0e3]}"#).unwrap(),
            Fingerprint::from_json_slice(br#"{"a":[0.0, 0e0]}"#).unwrap()
        );
        // An integer zero is the same number as a float zero (it was not, while numbers were
        // written as serde_json's `Value` prints them).
        assert_eq!(
            Fingerprint::from_json_slice(b"0").unwrap(),
            Fingerprint::from_json_slice(b"0.0").unwrap()
        );
        assert_eq!(
            Fingerprint::from_json(&serde_json::json!(0)),
            Fingerprint::from_json(&serde_json::json!(-0.0))
        );
    }

    #[track_caller]
    fn canonical(text: &str) -> String {
        canonical_json_slice(text.as_bytes())
            .unwrap_or_else(|e| panic!("{text:?} has no canonical form: {e}"))
    }

    /// The decision: one text per exact value, every digit kept, ECMAScript's layout.
    #[test]
    fn numbers_are_written_by_exact_value() {
        for (text, expected) in [
            ("1", "1"),
            ("1.0", "1"),
            ("1e0", "1"),
            ("10e-1", "1"),
            ("0.1e1", "1"),
            ("100E-2", "1"),
            ("1E+0", "1"),
            ("-0", "0"),
            ("0.0", "0"),
            ("-0.0", "0"),
            ("-0e5", "0"),
            ("0e-5", "0"),
            ("0.000", "0"),
            ("100", "100"),
            ("1e2", "100"),
            ("1230000", "1230000"),
            ("12.34e1", "123.4"),
            ("1.5", "1.5"),
            ("-1.50", "-1.5"),
            ("0.0012300", "0.00123"),
            ("0.000001", "0.000001"),
            ("1e-6", "0.000001"),
            ("1e-7", "1e-7"),
            ("1.5e-7", "1.5e-7"),
            ("123e-10", "1.23e-8"),
            ("1e20", "100000000000000000000"),
            ("123456789012345678901", "123456789012345678901"),
            ("1e21", "1e+21"),
            ("1234567890123456789012", "1.234567890123456789012e+21"),
            ("0.10000000000000000001", "0.10000000000000000001"),
            ("18446744073709551617", "18446744073709551617"),
            ("-9223372036854775809", "-9223372036854775809"),
            ("1e400", "1e+400"),
            ("-2.50E-400", "-2.5e-400"),
            ("0.00000000000000000000000000000000000000000001", "1e-44"),
        ] {
            assert_eq!(canonical(text), expected, "{text}");
            assert_eq!(canonical(expected), expected, "{expected} is a fixed point");
            assert_eq!(
                Fingerprint::from_json_slice(text.as_bytes()).unwrap(),
                Fingerprint::from_bytes(expected.as_bytes())
            );
        }
        // 1, 1.0, 1e0 and 10e-1 are one payload, alone, as values and as request bodies.
        let one = json_body(br#"{"qty":1}"#);
        for body in [
            &br#"{"qty":1.0}"#[..],
            br#"{"qty":1e0}"#,
            br#"{"qty":10e-1}"#,
        ] {
            assert_eq!(json_body(body), one, "{}", String::from_utf8_lossy(body));
        }
        assert_eq!(
            Fingerprint::from_json(&serde_json::json!({"qty": 1})),
            Fingerprint::from_json(&serde_json::json!({"qty": 1.0}))
        );
    }

    /// Random number texts against an independent normalisation (sign, significant digits,
    /// exponent): one canonical text per exact value, never one for two values; the text is
    /// a fixed point, reads as the same `f64`, and another writing of the same value (more
    /// zeros, the point moved into an exponent) has the same text.
    #[test]
    fn random_numbers_keep_their_value() {
        use std::collections::HashMap;
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let digits = |len: u64, next: &mut dyn FnMut(u64) -> u64| -> String {
            (0..len)
                .map(|_| b"0000123456789"[next(13) as usize] as char)
                .collect()
        };
        let mut by_value: HashMap<(bool, String, i64), String> = HashMap::new();
        let mut by_text: HashMap<String, (bool, String, i64)> = HashMap::new();
        for _ in 0..20_000 {
            let negative = next(2) == 0;
            let int = match next(3) {
                0 => "0".to_string(),
                _ => format!("{}{}", 1 + next(9), digits(next(22), &mut next)),
            };
            let frac = match next(2) {
                0 => String::new(),
                _ => digits(1 + next(22), &mut next),
            };
            let exp: i64 = match next(3) {
                0 => 0,
                _ => next(700) as i64 - 350,
            };
            let mut text = format!("{}{int}", if negative { "-" } else { "" });
            if !frac.is_empty() {
                text.push('.');
                text.push_str(&frac);
            }
            if exp != 0 || next(4) == 0 {
                let e = if next(2) == 0 { 'e' } else { 'E' };
                let sign = if exp < 0 {
                    "-"
                } else if next(2) == 0 {
                    "+"
                } else {
                    ""
                };
                let zeros = "0".repeat(next(3) as usize);
                text.push_str(&format!("{e}{sign}{zeros}{}", exp.abs()));
            }

            // The oracle: value = all × 10^(exp − |frac|), normalised.
            let all = format!("{int}{frac}");
            let significant = all.trim_start_matches('0');
            let key = if significant.is_empty() {
                (false, String::new(), 0)
            } else {
                let trimmed = significant.trim_end_matches('0');
                let shift = (significant.len() - trimmed.len()) as i64;
                (
                    negative,
                    trimmed.to_string(),
                    exp - frac.len() as i64 + shift,
                )
            };

            let c = canonical(&text);
            assert_eq!(canonical(&c), c, "{text}: not a fixed point");
            let (f, g) = (text.parse::<f64>().unwrap(), c.parse::<f64>().unwrap());
            assert!(f == g, "{text} reads as {f:e}, its text {c} as {g:e}");
            if let Some(other) = by_value.insert(key.clone(), c.clone()) {
                assert_eq!(other, c, "{text}: one value, two texts");
            }
            if let Some(other) = by_text.insert(c.clone(), key.clone()) {
                assert_eq!(other, key, "{text}: two values, one text {c}");
            }

            // The same value written another way: `0.<digits, more zeros>e<exp>`.
            let more = next(4) as usize;
            let variant = format!(
                "{}0.{all}{}e{}",
                if negative { "-" } else { "" },
                "0".repeat(more),
                exp - frac.len() as i64 + all.len() as i64
            );
            assert_eq!(canonical(&variant), c, "{variant} and {text}");
        }
        assert!(
            by_value.len() > 15_000,
            "{} distinct values",
            by_value.len()
        );
    }

    /// Exponents beyond 36 digits take an arbitrary-precision path.
    #[test]
    fn enormous_exponents_are_exact() {
        let e40 = format!("1{}", "0".repeat(40));
        let e40m1 = "9".repeat(40);
        let e36 = "9".repeat(36);
        let e37 = format!("1{}", "0".repeat(36));
        for (text, expected) in [
            (format!("1e{e40}"), format!("1e+{e40}")),
            (format!("10e{e40m1}"), format!("1e+{e40}")),
            (format!("0.1e{e40}"), format!("1e+{e40m1}")),
            (format!("1e-{e40}"), format!("1e-{e40}")),
            (
                format!("0.001e-{e40m1}"),
                format!("1e-1{}2", "0".repeat(39)),
            ),
            (format!("12.5e-{e40}"), format!("1.25e-{e40m1}")),
            (format!("-1e{e36}"), format!("-1e+{e36}")),
            (format!("10e{e36}"), format!("1e+{e37}")),
            (format!("1e{e37}"), format!("1e+{e37}")),
            (format!("1e000{e37}"), format!("1e+{e37}")),
            (format!("0.1e{e37}"), format!("1e+{e36}")),
            (format!("0e{e40}"), "0".to_string()),
            (format!("1e-0000{}", "0".repeat(50)), "1".to_string()),
        ] {
            assert_eq!(canonical(&text), expected, "{text}");
            assert_eq!(
                canonical(&expected),
                expected,
                "{expected} is a fixed point"
            );
        }
        assert_distinct(
            format!("1e{e40}").as_bytes(),
            format!("1e{e40m1}").as_bytes(),
        );
    }

    #[test]
    fn duplicate_members_keep_their_order() {
        assert_eq!(
            canonical(r#"{"b":0,"a":1,"\u0061":2,"a":{"y":1,"x":[1,1]}}"#),
            r#"{"a":1,"a":2,"a":{"x":[1,1],"y":1},"b":0}"#
        );
        // Which duplicate wins differs between parsers, so their order is part of the payload.
        assert_distinct(br#"{"a":1,"a":2}"#, br#"{"a":2,"a":1}"#);
        assert_eq!(
            json_body(br#"{"a":1,"b":3,"a":2}"#),
            json_body(br#"{ "b":3, "a":1, "a":2 }"#)
        );
    }

    /// Escapes are resolved and strings written the way serde_json writes them.
    #[test]
    fn strings_are_normalised() {
        assert_eq!(
            canonical(r#"["\u00e9", "\u00E9", "é", "\/", "\ud83d\ude00", "\u0000\u001F\u007f"]"#),
            "[\"é\",\"é\",\"é\",\"/\",\"\u{1f600}\",\"\\u0000\\u001f\u{7f}\"]"
        );
        let mut all = String::new();
        for c in (0u8..0x80)
            .map(char::from)
            .chain(['é', '\u{2028}', '\u{ffff}', '😀'])
        {
            all.push(c);
        }
        let plain = serde_json::to_string(&all).unwrap();
        assert_eq!(canonical(&plain), plain);
        let mut escaped = String::from("\"");
        for c in all.chars() {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                escaped.push_str(&format!("\\u{unit:04X}"));
            }
        }
        escaped.push('"');
        assert_eq!(canonical(&escaped), plain);
    }

    /// Text that is not JSON has no canonical form: `from_json_slice` fails and a request
    /// body is hashed as its bytes. On every input here serde_json agrees that it is not JSON.
    #[test]
    fn only_strict_json_is_canonicalised() {
        let bad: &[&[u8]] = &[
            b"",
            b"  ",
            b"01",
            b"-01",
            b"1.",
            b".5",
            b"+1",
            b"1e",
            b"1e+",
            b"-",
            b"--1",
            b"0x10",
            b"NaN",
            b"Infinity",
            b"[1,]",
            b"[,1]",
            b"[1 2]",
            br#"{"a":1,}"#,
            br#"{"a" 1}"#,
            b"{1:2}",
            br#"{"a":}"#,
            b"[",
            b"{",
            b"\"abc",
            b"1 2",
            b"nul",
            b"truex",
            b"True",
            b"\xef\xbb\xbf1",
            br#""\x""#,
            b"\"a\nb\"",
            b"\"\t\"",
            b"\"\xff\"",
            b"\"\xc3\"",
            br#""\ud800""#,
            br#""\udc00""#,
            br#""\ud800\u0041""#,
            br#""\ud800\n""#,
            br#""\u12""#,
            br#""\u12g4""#,
            b"[1]\x00",
            b"\x0c1",
        ];
        for text in bad {
            let shown = String::from_utf8_lossy(text);
            assert!(
                serde_json::from_slice::<serde_json::Value>(text).is_err(),
                "serde_json reads {shown:?}"
            );
            assert!(Fingerprint::from_json_slice(text).is_err(), "{shown:?}");
            assert!(canonical_json_slice(text).is_err(), "{shown:?}");
            let mut spaced = text.to_vec();
            spaced.push(b' ');
            assert_ne!(
                json_body(text),
                json_body(&spaced),
                "{shown:?} is hashed raw"
            );
        }
        // serde_json's errors (with their positions) are passed on.
        let err = Fingerprint::from_json_slice(b"[1,]").unwrap_err();
        assert!(err.to_string().contains("line 1 column 4"), "{err}");
        let good: &[&[u8]] = &[
            b" \t\n\r1 \t\n\r",
            b"\"\"",
            b"[]",
            b"{}",
            b"[[],{}]",
            b"-0",
            b"\"\xf0\x9f\x98\x80\"",
            br#"{"":null}"#,
        ];
        for text in good {
            let shown = String::from_utf8_lossy(text);
            assert!(
                serde_json::from_slice::<serde_json::Value>(text).is_ok(),
                "{shown:?}"
            );
            assert!(Fingerprint::from_json_slice(text).is_ok(), "{shown:?}");
        }
    }

    /// The depth bound is serde_json's (127 levels), and deeper text never overflows the stack.
    #[test]
    fn nesting_is_bounded() {
        let arrays = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let objects = |n: usize| format!("{}1{}", r#"{"a":"#.repeat(n), "}".repeat(n));
        for n in [126, 127] {
            for text in [arrays(n), objects(n)] {
                assert!(serde_json::from_str::<serde_json::Value>(&text).is_ok());
                assert_eq!(canonical(&text), text);
            }
        }
        for n in [128, 129, 100_000] {
            for text in [arrays(n), objects(n)] {
                if n < 1000 {
                    assert!(serde_json::from_str::<serde_json::Value>(&text).is_err());
                }
                assert!(Fingerprint::from_json_slice(text.as_bytes()).is_err());
                let mut spaced = text.clone().into_bytes();
                spaced.push(b' ');
                assert_ne!(json_body(text.as_bytes()), json_body(&spaced), "hashed raw");
            }
        }
        // Unclosed, far too deep.
        assert!(Fingerprint::from_json_slice("[".repeat(1_000_000).as_bytes()).is_err());
    }

    /// A `Value` and the text serde_json writes for it have one fingerprint.
    #[test]
    fn a_value_and_its_text_agree() {
        use serde_json::json;
        let values = [
            json!(null),
            json!([true, false]),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(0),
            json!(-0.0),
            json!(1.0),
            json!(1e20),
            json!(1e21),
            json!(1.5e-7),
            json!(1e-6),
            json!(123.0),
            json!(5e-324),
            json!(f64::MAX),
            json!(f64::MIN_POSITIVE),
            json!(9007199254740993.0),
            json!(0.1),
            json!(-1234.5678e-200),
            json!({"b": {"d": [1, "x"], "c": 2.5}, "a": "\u{0}\"\\\n\u{1f}é😀", "": []}),
        ];
        for v in values {
            let text = serde_json::to_vec(&v).unwrap();
            let shown = String::from_utf8_lossy(&text);
            assert_eq!(
                canonical_json(&v),
                canonical_json_slice(&text).unwrap(),
                "{shown}"
            );
            assert_eq!(
                Fingerprint::from_json(&v),
                Fingerprint::from_json_slice(&text).unwrap(),
                "{shown}"
            );
            assert_eq!(
                Fingerprint::from_json(&v),
                Fingerprint::from_bytes(canonical_json(&v).as_bytes())
            );
        }
        assert_eq!(canonical_json(&json!(1e21)), "1e+21");
        assert_eq!(canonical_json(&json!(1e20)), "100000000000000000000");
        assert_eq!(canonical_json(&json!(-0.5)), "-0.5");
    }

    /// A JSON request body, fingerprinted as the HTTP layer does.
    fn json_body(body: &[u8]) -> Fingerprint {
        Fingerprint::builder()
            .method("POST")
            .path("/payments")
            .content_type("application/json")
            .body(body)
            .finish()
    }

    /// Both paths (`from_json_slice` and a JSON request body) must tell `a` and `b` apart.
    #[track_caller]
    fn assert_distinct(a: &[u8], b: &[u8]) {
        let (ta, tb) = (String::from_utf8_lossy(a), String::from_utf8_lossy(b));
        let fa = Fingerprint::from_json_slice(a);
        let fb = Fingerprint::from_json_slice(b);
        assert!(fa.is_ok(), "{ta} is JSON: {fa:?}");
        assert!(fb.is_ok(), "{tb} is JSON: {fb:?}");
        assert_ne!(fa.unwrap(), fb.unwrap(), "{ta} and {tb} (from_json_slice)");
        assert_ne!(json_body(a), json_body(b), "{ta} and {tb} (request body)");
    }

    /// Release blocker: serde_json's `Value` holds an f64, so every decimal that rounds to
    /// the same double had one fingerprint, and the second request replayed the first's
    /// outcome instead of getting a mismatch.
    #[test]
    fn decimals_keep_every_digit() {
        assert_distinct(
            br#"{"amount":0.1}"#,
            br#"{"amount":0.10000000000000000001}"#,
        );
        assert_distinct(b"0.1", b"0.10000000000000000001");
        assert_distinct(b"1.0000000000000002", b"1.00000000000000021");
        assert_distinct(b"[9007199254740993.0]", b"[9007199254740992.0]");
    }

    #[test]
    fn integers_beyond_64_bits_keep_every_digit() {
        assert_distinct(b"18446744073709551616", b"18446744073709551617");
        assert_distinct(b"-9223372036854775809", b"-9223372036854775810");
        assert_distinct(
            br#"{"id":123456789012345678901234567890}"#,
            br#"{"id":123456789012345678901234567891}"#,
        );
    }

    #[test]
    fn huge_and_tiny_exponents_keep_every_digit() {
        assert_distinct(b"1e400", b"2e400");
        assert_distinct(b"1e-400", b"2e-400");
        assert_distinct(b"1e-400", b"0");
        assert_distinct(b"[1E+309]", b"[-1E+309]");
        // The same exact value written twice is still one payload.
        assert_eq!(json_body(b"1e400"), json_body(b" 10e399 "));
    }

    /// serde_json's `Value` keeps the last of two members with one name, so the first one
    /// silently did not count.
    #[test]
    fn duplicate_member_names_are_not_dropped() {
        assert_distinct(br#"{"a":1,"a":2}"#, br#"{"a":2}"#);
        assert_distinct(br#"{"a":1,"a":2}"#, br#"{"a":1}"#);
        assert_distinct(br#"{"x":{"a":1,"a":2}}"#, br#"{"x":{"a":2}}"#);
    }

    #[test]
    fn builder_covers_every_part() {
        let base = || {
            Fingerprint::builder()
                .method("post")
                .path("/a")
                .query("x=1")
                .content_type("application/json")
        };
        let fp = base().body(br#"{"a":1,"b":2}"#).finish();
        assert_eq!(fp, base().body(br#"{"b":2, "a":1}"#).finish());
        assert_eq!(
            fp,
            Fingerprint::builder()
                .method("POST")
                .path("/a")
                .query("x=1")
                .content_type("application/json")
                .body(br#"{"b":2,"a":1}"#)
                .finish()
        );
        assert_ne!(fp, base().body(br#"{"a":1,"b":3}"#).finish());
        assert_ne!(fp, base().query("x=2").body(br#"{"a":1,"b":2}"#).finish());
        assert_ne!(
            fp,
            Fingerprint::builder()
                .method("PATCH")
                .path("/a")
                .query("x=1")
                .content_type("application/json")
                .body(br#"{"a":1,"b":2}"#)
                .finish()
        );
        // Bytes cannot move between parts.
        let p1 = Fingerprint::builder().path("/ab").query("c").finish();
        let p2 = Fingerprint::builder().path("/a").query("bc").finish();
        assert_ne!(p1, p2);
        // An empty body and no body differ from a body.
        assert_ne!(base().finish(), base().body(b"").finish());
        // Non-JSON bodies are raw: whitespace matters.
        let t1 = Fingerprint::builder()
            .content_type("text/plain")
            .body(b"a b")
            .finish();
        let t2 = Fingerprint::builder()
            .content_type("text/plain")
            .body(b"a  b")
            .finish();
        assert_ne!(t1, t2);
    }

    /// Headers are length-prefixed parts after the body, present only when added: without
    /// them the digest is the one version 3 computed before headers existed (pinned here),
    /// so records stored by older versions keep matching.
    #[test]
    fn headers_count_and_their_absence_keeps_older_digests() {
        let base = || Fingerprint::builder().method("PATCH").path("/books/1");
        // SHA-256 of the v3 stream: prefix, method, path, no query, no content type, raw `x`.
        assert_eq!(
            base().body(b"x").finish().to_hex(),
            "08a9ce02d1ec332882c4e9882eb09dc144c7ea5503b7e2e15332fc32a0c961e7"
        );
        let v1 = base().body(b"x").header("If-Match", "\"v1\"").finish();
        assert_ne!(v1, base().body(b"x").finish());
        assert_eq!(
            v1,
            base().body(b"x").header("if-match", b"\"v1\"").finish(),
            "names are case-insensitive"
        );
        assert_ne!(v1, base().body(b"x").header("if-match", "\"v2\"").finish());
        assert_ne!(
            v1,
            base().body(b"x").header("if-none-match", "\"v1\"").finish()
        );
        // Bytes cannot move between a name and its value, or between headers.
        assert_ne!(
            base().header("ab", "c").finish(),
            base().header("a", "bc").finish()
        );
        assert_ne!(
            base().header("a", "b").header("c", "d").finish(),
            base().header("a", "bc").finish()
        );
        // An empty value is still a header.
        assert_ne!(base().header("if-match", "").finish(), base().finish());
    }

    #[test]
    fn hex_round_trip() {
        let fp = Fingerprint::from_bytes(b"x");
        assert_eq!(Fingerprint::from_hex(&fp.to_hex()).unwrap(), fp);
        assert!(Fingerprint::from_hex("zz").is_err());
        assert_eq!(Fingerprint::from_slice(fp.as_bytes()), Some(fp));
        assert_eq!(Fingerprint::from_slice(&[1, 2]), None);
    }

    #[test]
    fn json_media_types() {
        assert!(is_json_media_type("application/json"));
        assert!(is_json_media_type("Application/JSON; charset=utf-8"));
        assert!(is_json_media_type("application/merge-patch+json"));
        assert!(!is_json_media_type("text/plain"));
        assert!(!is_json_media_type("application/jsonx"));
    }

    /// Random JSON text, written the way clients write it: compact or spaced, members in
    /// order or not, duplicate names, escapes, numbers in every form.
    fn random_json(next: &mut dyn FnMut(u64) -> u64, depth: u32, out: &mut String) {
        const NAMES: [&str; 9] = ["a", "b", "ab", r"a\u0062", "zz", "sku", r"\u00e9", "", "a"];
        const NUMBERS: [&str; 10] = [
            "0",
            "-0",
            "7",
            "-12",
            "100",
            "1.0",
            "2.50e1",
            "1e400",
            "0.000001",
            "123456789012345678901234",
        ];
        const STRINGS: [&str; 6] = [
            "x",
            "",
            "item number 1 with some text",
            r#"q\\\""#,
            r"\/",
            r"\n\u0001é😀",
        ];
        let ws = |next: &mut dyn FnMut(u64) -> u64, out: &mut String| {
            if next(4) == 0 {
                out.push_str([" ", "\n  ", "\t", "\r\n"][next(4) as usize]);
            }
        };
        ws(next, out);
        match if depth >= 4 { next(4) } else { next(6) } {
            0 => out.push_str(["null", "true", "false"][next(3) as usize]),
            1 => out.push_str(NUMBERS[next(NUMBERS.len() as u64) as usize]),
            2 | 3 => {
                out.push('"');
                out.push_str(STRINGS[next(STRINGS.len() as u64) as usize]);
                out.push('"');
            }
            4 => {
                out.push('[');
                for i in 0..next(4) {
                    if i > 0 {
                        out.push(',');
                    }
                    random_json(next, depth + 1, out);
                }
                ws(next, out);
                out.push(']');
            }
            _ => {
                out.push('{');
                let n = next(5) as usize;
                let mut names: Vec<&str> = (0..n)
                    .map(|_| NAMES[next(NAMES.len() as u64) as usize])
                    .collect();
                if next(2) == 0 {
                    // In canonical order as written, as many serialisers leave them.
                    names.sort_unstable();
                }
                for (i, name) in names.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(next, out);
                    out.push('"');
                    out.push_str(name);
                    out.push('"');
                    ws(next, out);
                    out.push(':');
                    random_json(next, depth + 1, out);
                    ws(next, out);
                }
                out.push('}');
            }
        }
        ws(next, out);
    }

    /// The writer copies spans of input that are already canonical (whole values, and
    /// members from the name's quote to the end of the value); writing every token instead
    /// must give the same text, for random text and for the canonical text itself (where
    /// everything is a span).
    #[test]
    fn copied_spans_are_the_text_written_token_by_token() {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let by_tokens = |text: &[u8]| {
            let mut out = Vec::new();
            canonicalise_with::<_, false>(text, &mut out).then_some(out)
        };
        let mut copied_whole = 0;
        for round in 0..20_000 {
            let mut text = String::new();
            random_json(&mut next, 0, &mut text);
            let expected = by_tokens(text.as_bytes()).expect("random JSON is JSON");
            let written = canonical_json_slice(text.as_bytes()).unwrap();
            assert_eq!(written.as_bytes(), expected, "round {round}: {text}");
            // The canonical text is copied as it is, and is its own canonical text.
            let again = canonical_json_slice(written.as_bytes()).unwrap();
            assert_eq!(again, written, "round {round}: {text}");
            assert_eq!(by_tokens(written.as_bytes()).unwrap(), expected);
            copied_whole += usize::from(text == written);
            // And the digest is the digest of that text.
            assert_eq!(
                Fingerprint::from_json_slice(text.as_bytes()).unwrap(),
                Fingerprint::from_bytes(&expected),
                "round {round}: {text}"
            );
        }
        assert!(
            copied_whole > 1_000,
            "only {copied_whole} texts were already canonical"
        );
        // A body of the shape the HTTP layer sees most, compact and in order, is one span.
        let compact = canonical_json_slice(br#"{"b":[1,{"y":"\u00e9","x":-0}],"a":1.50}"#).unwrap();
        assert_eq!(compact, r#"{"a":1.5,"b":[1,{"x":0,"y":"é"}]}"#);
        assert_eq!(canonical_json_slice(compact.as_bytes()).unwrap(), compact);
    }
}
