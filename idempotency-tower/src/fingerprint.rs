//! What the layer fingerprints: method, path, query, normalised media type, the configured
//! request headers (preconditions by default) and the body.

use crate::headers::CONTENT_TYPE;
use bytes::Bytes;
use http::request::Parts;
use http::HeaderName;
use idempotency_core::{is_json_media_type, Fingerprint, FingerprintBuilder};
use std::borrow::Cow;

/// The request as the layer fingerprints it, handed to a fingerprint hook
/// ([`crate::IdempotencyLayer::fingerprint_with`]).
///
/// [`FingerprintInput::builder`] is the layer's own fingerprint without the body: add the
/// parts of the body that identify the operation (and any other header) and finish it.
#[derive(Debug)]
pub struct FingerprintInput<'a> {
    pub(crate) parts: &'a Parts,
    pub(crate) body: &'a Bytes,
    pub(crate) headers: &'a [HeaderName],
}

impl<'a> FingerprintInput<'a> {
    /// The request's method, URI, headers and extensions.
    pub fn parts(&self) -> &'a Parts {
        self.parts
    }

    /// The buffered request body.
    pub fn body(&self) -> &'a Bytes {
        self.body
    }

    /// The layer's fingerprint so far: method, path, query, normalised content type and the
    /// configured headers that are present, but no body.
    pub fn builder(&self) -> FingerprintBuilder<'a> {
        let parts = self.parts;
        let mut fp = Fingerprint::builder()
            .method(parts.method.as_str())
            .path(parts.uri.path());
        if let Some(query) = parts.uri.query() {
            fp = fp.query(query);
        }
        if let Some(ct) = parts.headers.get(CONTENT_TYPE) {
            fp = fp.content_type(normalized_media_type(ct.as_bytes()));
        }
        for name in self.headers {
            if let Some(value) = header_value(parts, name) {
                fp = fp.header(name.as_str(), value);
            }
        }
        fp
    }

    /// The fingerprint the layer computes without a hook: [`FingerprintInput::builder`] plus
    /// the whole body.
    pub fn default_fingerprint(&self) -> Fingerprint {
        self.builder().body(self.body).finish()
    }
}

/// A header's field lines as one list: elements split at commas outside quoted strings,
/// trimmed, empty ones dropped, joined by `", "`, so one line `"a", "b"` and two lines `"a"`
/// and `"b"` (which an intermediary may join) are one value. `None` when the header is absent.
fn header_value(parts: &Parts, name: &HeaderName) -> Option<Vec<u8>> {
    let mut lines = parts.headers.get_all(name).iter().peekable();
    lines.peek()?;
    let mut out = Vec::new();
    for line in lines {
        for element in split_list(line.as_bytes()) {
            if !out.is_empty() {
                out.extend_from_slice(b", ");
            }
            out.extend_from_slice(element);
        }
    }
    Some(out)
}

/// Splits at commas outside double quotes; trims spaces and tabs; drops empty elements.
fn split_list(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut elements = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, &b) in value.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b',' if !quoted => {
                elements.push(&value[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    elements.push(&value[start..]);
    elements
        .into_iter()
        .map(|e| e.trim_ascii())
        .filter(|e| !e.is_empty())
}

/// A `Content-Type` value in a normal form, so that equivalent media types fingerprint alike:
/// type, subtype and parameter names lower-cased, parameters sorted by name, quoted values
/// unquoted (and quoted again only where a token cannot hold them), `charset` values
/// lower-cased, and `charset=utf-8` dropped from JSON types (UTF-8 is JSON's only encoding,
/// RFC 8259 §8.1). Parameter values other than `charset` keep their case.
///
/// A value in normal form is unchanged (`application/json`, `text/plain`), so requests that
/// sent one keep their fingerprint. A value that is not a media type is kept as it was sent.
///
/// ```
/// use idempotency_tower::normalize_media_type;
///
/// assert_eq!(normalize_media_type(b"application/json"), "application/json");
/// assert_eq!(normalize_media_type(b"Application/JSON; charset=\"UTF-8\""), "application/json");
/// assert_eq!(
///     normalize_media_type(b"text/plain;Format=flowed; charset=UTF-8"),
///     "text/plain;charset=utf-8;format=flowed"
/// );
/// assert_eq!(
///     normalize_media_type(b"multipart/form-data; boundary=\"a b\""),
///     "multipart/form-data;boundary=\"a b\""
/// );
/// ```
pub fn normalize_media_type(value: &[u8]) -> String {
    normalized_media_type(value).into_owned()
}

/// [`normalize_media_type`], borrowing a value that is already in normal form (a lower-case
/// `type/subtype` without parameters, the common case).
fn normalized_media_type(value: &[u8]) -> Cow<'_, str> {
    if let Ok(text) = std::str::from_utf8(value) {
        let lower_token = |s: &str| is_token(s) && !s.bytes().any(|b| b.is_ascii_uppercase());
        // Tokens hold no `;`, `/`, whitespace or quote: nothing to normalise.
        if text
            .split_once('/')
            .is_some_and(|(ty, sub)| lower_token(ty) && lower_token(sub))
        {
            return Cow::Borrowed(text);
        }
    }
    let raw = String::from_utf8_lossy(value);
    Cow::Owned(normalize(&raw).unwrap_or_else(|| raw.into_owned()))
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn normalize(raw: &str) -> Option<String> {
    let mut pieces = split_params(raw)?.into_iter();
    let essence = pieces
        .next()?
        .trim_matches([' ', '\t'])
        .to_ascii_lowercase();
    let (ty, sub) = essence.split_once('/')?;
    if !is_token(ty) || !is_token(sub) {
        return None;
    }
    let json = is_json_media_type(&essence);
    let mut params = Vec::new();
    for piece in pieces {
        let piece = piece.trim_matches([' ', '\t']);
        if piece.is_empty() {
            continue;
        }
        let (name, value) = piece.split_once('=')?;
        let name = name.trim_end_matches([' ', '\t']).to_ascii_lowercase();
        if !is_token(&name) {
            return None;
        }
        let mut value = unquote(value.trim_start_matches([' ', '\t']))?;
        if name == "charset" {
            value = value.to_ascii_lowercase();
            if json && value == "utf-8" {
                continue;
            }
        }
        params.push((name, value));
    }
    params.sort();
    let mut out = essence;
    for (name, value) in params {
        out.push(';');
        out.push_str(&name);
        out.push('=');
        if is_token(&value) {
            out.push_str(&value);
        } else {
            out.push('"');
            for c in value.chars() {
                if c == '"' || c == '\\' {
                    out.push('\\');
                }
                out.push(c);
            }
            out.push('"');
        }
    }
    Some(out)
}

/// Splits at `;` outside quoted strings; `None` when a quote is left open.
fn split_params(raw: &str) -> Option<Vec<&str>> {
    let mut out = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in raw.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ';' if !quoted => {
                out.push(&raw[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if quoted {
        return None;
    }
    out.push(&raw[start..]);
    Some(out)
}

/// A parameter value: a token as it is, or a quoted string with its escapes decoded.
fn unquote(value: &str) -> Option<String> {
    let Some(inner) = value.strip_prefix('"') else {
        return is_token(value).then(|| value.to_owned());
    };
    let mut out = String::new();
    let mut chars = inner.chars();
    loop {
        match chars.next()? {
            '"' => break,
            '\\' => out.push(chars.next()?),
            c => out.push(c),
        }
    }
    chars.next().is_none().then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> String {
        normalize_media_type(s.as_bytes())
    }

    #[test]
    fn equivalent_media_types_are_one() {
        for same in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            "application/json;charset=\"UTF-8\"",
            "application/json ; CHARSET=Utf-8",
        ] {
            assert_eq!(n(same), "application/json", "{same}");
        }
        assert_eq!(
            n("application/problem+json; charset=utf-8"),
            "application/problem+json"
        );
        assert_eq!(n("text/plain"), "text/plain");
        assert_eq!(
            n("text/plain; b=\"x\"; A=y"),
            n("text/plain;a=y;b=x"),
            "names lower-cased and sorted, quotes removed"
        );
    }

    #[test]
    fn different_media_types_still_differ() {
        assert_ne!(n("application/json"), n("text/json"));
        assert_ne!(n("application/json"), n("application/json; charset=latin1"));
        assert_ne!(n("text/plain; charset=utf-8"), n("text/plain"));
        assert_ne!(
            n("text/plain; format=Flowed"),
            n("text/plain; format=flowed")
        );
        assert_ne!(
            n("multipart/form-data; boundary=a"),
            n("multipart/form-data; boundary=b")
        );
        // A value needing quotes stays quoted, so it cannot be read as two parameters.
        assert_eq!(n("text/plain; a=\"x;b=y\""), "text/plain;a=\"x;b=y\"");
        assert_ne!(n("text/plain; a=\"x;b=y\""), n("text/plain; a=x; b=y"));
    }

    #[test]
    fn what_is_not_a_media_type_is_kept_as_sent() {
        for raw in ["json", "", "a/b; c", "a/b; c=\"open", "a b/c", "a/b; c=d e"] {
            assert_eq!(n(raw), raw);
        }
        assert_eq!(normalize_media_type(b"\xff/json"), "\u{fffd}/json");
    }

    #[test]
    fn header_lists_are_joined_and_trimmed() {
        let parts = |lines: &[&str]| {
            let mut b = http::Request::builder();
            for l in lines {
                b = b.header("if-match", *l);
            }
            b.body(()).unwrap().into_parts().0
        };
        let name = HeaderName::from_static("if-match");
        let one = header_value(&parts(&["\"a\", \"b\""]), &name);
        assert_eq!(one.as_deref(), Some(&b"\"a\", \"b\""[..]));
        assert_eq!(header_value(&parts(&["\"a\"", " \"b\" "]), &name), one);
        assert_eq!(header_value(&parts(&["\"a\",\"b\","]), &name), one);
        assert_eq!(
            header_value(&parts(&["\"a,b\""]), &name).as_deref(),
            Some(&b"\"a,b\""[..])
        );
        assert_eq!(header_value(&parts(&[]), &name), None);
        assert_eq!(
            header_value(&parts(&[""]), &name).as_deref(),
            Some(&b""[..])
        );
    }
}
