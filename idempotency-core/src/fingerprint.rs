//! Request fingerprints: a SHA-256 digest of what the request asks for.

use sha2::{Digest, Sha256};
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

    /// SHA-256 of the canonical form of a JSON value (object keys sorted at every depth, no
    /// insignificant whitespace), so key order does not change the fingerprint.
    pub fn from_json(value: &serde_json::Value) -> Self {
        let mut hasher = Sha256::new();
        // Hashing cannot fail.
        let _ = write_canonical(value, &mut HashWriter(&mut hasher));
        Self(hasher.finalize().into())
    }

    /// Parses JSON and fingerprints its canonical form.
    pub fn from_json_slice(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        let value: serde_json::Value = serde_json::from_slice(bytes)?;
        Ok(Self::from_json(&value))
    }

    /// Starts a fingerprint over method, path, query, content type and body.
    pub fn builder() -> FingerprintBuilder {
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

/// Writes the canonical JSON text of `value`: objects with keys sorted by their UTF-8 bytes at
/// every depth, arrays in order, strings escaped as `serde_json` escapes them, numbers as
/// `serde_json` prints them (except that a float zero is always `0.0`, never `-0.0`).
pub fn canonical_json(value: &serde_json::Value) -> String {
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = write_canonical(value, &mut out);
    // Only valid UTF-8 is written: serde_json's string escapes, numbers and punctuation.
    String::from_utf8(out).unwrap_or_default()
}

/// SHA-256 as an `io::Write` sink, so the canonical text is hashed as it is produced, with no
/// intermediate buffer.
struct HashWriter<'a>(&'a mut Sha256);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn write_canonical<W: std::io::Write>(
    value: &serde_json::Value,
    out: &mut W,
) -> std::io::Result<()> {
    use serde_json::Value;
    match value {
        Value::Null => out.write_all(b"null"),
        Value::Bool(true) => out.write_all(b"true"),
        Value::Bool(false) => out.write_all(b"false"),
        // -0.0 and 0.0 are equal numbers (and equal `Value`s): one text for both, as in
        // RFC 8785.
        Value::Number(n) if n.is_f64() && n.as_f64() == Some(0.0) => out.write_all(b"0.0"),
        Value::Number(n) => write!(out, "{n}"),
        // serde_json's string escaping is canonical for a given string.
        Value::String(s) => serde_json::to_writer(&mut *out, s).map_err(std::io::Error::other),
        Value::Array(items) => {
            out.write_all(b"[")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write_canonical(item, out)?;
            }
            out.write_all(b"]")
        }
        Value::Object(map) => {
            // Sort explicitly: serde_json's map keeps insertion order when another crate in
            // the build enables its `preserve_order` feature.
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.write_all(b"{")?;
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                serde_json::to_writer(&mut *out, k).map_err(std::io::Error::other)?;
                out.write_all(b":")?;
                write_canonical(v, out)?;
            }
            out.write_all(b"}")
        }
    }
}

/// Builds a fingerprint over the parts of a request. Every part is length-prefixed, so moving
/// bytes from one part to another changes the digest. A body whose content type is JSON
/// (`application/json` or any `+json` type) and that parses is canonicalised first; any other
/// body is hashed as raw bytes.
#[derive(Debug, Default, Clone)]
pub struct FingerprintBuilder {
    method: Option<String>,
    path: Option<String>,
    query: Option<String>,
    content_type: Option<String>,
    body: Option<Vec<u8>>,
}

impl FingerprintBuilder {
    /// The HTTP method (case-insensitive: it is upper-cased).
    pub fn method(mut self, method: &str) -> Self {
        self.method = Some(method.to_ascii_uppercase());
        self
    }
    /// The request path.
    pub fn path(mut self, path: &str) -> Self {
        self.path = Some(path.to_owned());
        self
    }
    /// The raw query string (without `?`).
    pub fn query(mut self, query: &str) -> Self {
        self.query = Some(query.to_owned());
        self
    }
    /// The `Content-Type` header value.
    pub fn content_type(mut self, content_type: &str) -> Self {
        self.content_type = Some(content_type.to_owned());
        self
    }
    /// The request body.
    pub fn body(mut self, body: &[u8]) -> Self {
        self.body = Some(body.to_vec());
        self
    }

    /// Computes the digest. A JSON body contributes `J` and the SHA-256 of its canonical
    /// text (hashed as it is written, never buffered); any other body `R` and its bytes.
    pub fn finish(self) -> Fingerprint {
        let mut h = Sha256::new();
        h.update(b"idempotency-fingerprint-v2");
        for field in [&self.method, &self.path, &self.query, &self.content_type] {
            match field {
                Some(s) => hash_part(&mut h, &[s.as_bytes()]),
                None => h.update([0u8]),
            }
        }
        let is_json = self.content_type.as_deref().is_some_and(is_json_media_type);
        match &self.body {
            None => h.update([0u8]),
            Some(body) => {
                let json = is_json
                    .then(|| serde_json::from_slice::<serde_json::Value>(body).ok())
                    .flatten();
                match json {
                    Some(value) => {
                        hash_part(&mut h, &[b"J", Fingerprint::from_json(&value).as_bytes()])
                    }
                    None => hash_part(&mut h, &[b"R", body]),
                }
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
    /// were written as two canonical texts, so they had two fingerprints.
    #[test]
    fn signed_zeros_are_one_value() {
        let neg: serde_json::Value = serde_json::from_str("-0.0").unwrap();
        let pos: serde_json::Value = serde_json::from_str("0.0").unwrap();
        assert_eq!(neg, pos);
        assert_eq!(canonical_json(&neg), "0.0");
        assert_eq!(Fingerprint::from_json(&neg), Fingerprint::from_json(&pos));
        assert_eq!(
            Fingerprint::from_json_slice(br#"{"a":[-0.0, -0e3]}"#).unwrap(),
            Fingerprint::from_json_slice(br#"{"a":[0.0, 0e0]}"#).unwrap()
        );
        // An integer zero is another value than a float zero, as serde_json compares them.
        assert_ne!(
            Fingerprint::from_json_slice(b"0").unwrap(),
            Fingerprint::from_json_slice(b"0.0").unwrap()
        );
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
}
