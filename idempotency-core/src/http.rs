//! The HTTP side of a key, shared by the server half (`idempotency-tower`) and the client
//! half (`idempotency-reqwest`) without either depending on the other: the header names and
//! the `Idempotency-Key` reader. Behind the `http` feature.

use crate::{IdempotencyKey, KeyError};
use http::{header, HeaderMap, HeaderName};

/// The header the key is read from (by default; a server can choose another).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header that marks a replayed response (by default; a server can choose another).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Request headers fingerprinted by default: the preconditions of RFC 9110 §13.1 that change
/// what a request does (`If-Range` only matters to range GETs). A request that sends none of
/// them has the fingerprint it had before headers counted.
pub const DEFAULT_FINGERPRINT_HEADERS: &[HeaderName] = &[
    header::IF_MATCH,
    header::IF_NONE_MATCH,
    header::IF_UNMODIFIED_SINCE,
    header::IF_MODIFIED_SINCE,
];

/// Why an `Idempotency-Key` header was refused. Each variant is answered with 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHeaderError {
    /// The header was sent more than once; which one the client meant cannot be known.
    #[error("the Idempotency-Key header was sent {count} times (send it once)")]
    Duplicated {
        /// How many field lines carried it.
        count: usize,
    },
    /// The value is not valid UTF-8.
    #[error("the Idempotency-Key header is not valid UTF-8")]
    NotUtf8,
    /// The value starts with `"` but is not a valid structured-field string item (RFC 9651
    /// §3.3.3, parameters allowed).
    #[error("the Idempotency-Key header is not a valid quoted string: {reason}")]
    BadQuoting {
        /// What is wrong with it (the structured-field parser's message).
        reason: String,
    },
    /// A bare (unquoted) value contains a comma, which is what an intermediary produces when
    /// it joins two header lines; send keys with commas in the quoted form.
    #[error("the unquoted Idempotency-Key contains a comma (use the quoted form, \"...\", for such keys)")]
    AmbiguousComma,
    /// The key breaks a key rule (empty, longer than 255 bytes, control characters).
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The API's key validator (`IdempotencyLayer::validate_key` in `idempotency-tower`) refused
    /// the key.
    #[error("the Idempotency-Key is not in this API's key format: {reason}")]
    Rejected {
        /// The validator's message.
        reason: String,
    },
}

/// Reads the key from `headers`: `Ok(None)` when there is no `Idempotency-Key` header.
///
/// The bare form (`Idempotency-Key: abc`) and the draft's structured-field string form
/// (`Idempotency-Key: "abc"`) name the same key. A quoted value is parsed as an RFC 8941/9651
/// structured-field item (with the `sfv` crate), so parameters after it are read and ignored
/// (`"abc";v=1` is the key `abc`). Surrounding whitespace is ignored.
///
/// ```
/// use http::HeaderMap;
/// use idempotency_core::http::read_key;
///
/// let mut h = HeaderMap::new();
/// h.insert("idempotency-key", "\"order-7\"".parse().unwrap());
/// assert_eq!(read_key(&h).unwrap().unwrap().as_str(), "order-7");
/// h.insert("idempotency-key", "order-7".parse().unwrap());
/// assert_eq!(read_key(&h).unwrap().unwrap().as_str(), "order-7");
/// h.insert("idempotency-key", "\"order-7\";v=1".parse().unwrap());
/// assert_eq!(read_key(&h).unwrap().unwrap().as_str(), "order-7");
/// h.insert("idempotency-key", "\"unterminated".parse().unwrap());
/// assert!(read_key(&h).is_err());
/// ```
pub fn read_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, KeyHeaderError> {
    read_key_header(headers, &IDEMPOTENCY_KEY)
}

/// [`read_key`] from the header `name` (for APIs that use another header name, see
/// `IdempotencyLayer::key_header` in `idempotency-tower`).
///
/// ```
/// use http::{HeaderMap, HeaderName};
/// use idempotency_core::http::read_key_header;
///
/// let name = HeaderName::from_static("x-request-key");
/// let mut h = HeaderMap::new();
/// h.insert(&name, "k-1".parse().unwrap());
/// assert_eq!(read_key_header(&h, &name).unwrap().unwrap().as_str(), "k-1");
/// ```
pub fn read_key_header(
    headers: &HeaderMap,
    name: &HeaderName,
) -> Result<Option<IdempotencyKey>, KeyHeaderError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let extra = values.count();
    if extra > 0 {
        return Err(KeyHeaderError::Duplicated { count: extra + 1 });
    }
    let text = std::str::from_utf8(value.as_bytes()).map_err(|_| KeyHeaderError::NotUtf8)?;
    let text = text.trim_matches(|c| c == ' ' || c == '\t');
    if text.starts_with('"') {
        return Ok(Some(IdempotencyKey::new(parse_sf_string(text)?)?));
    }
    if text.contains(',') {
        return Err(KeyHeaderError::AmbiguousComma);
    }
    Ok(Some(IdempotencyKey::from_slice(text)?))
}

/// Parses a structured-field item whose bare item is a string (RFC 9651 §3.3.3), parameters
/// allowed and ignored.
fn parse_sf_string(text: &str) -> Result<String, KeyHeaderError> {
    match sfv::Parser::new(text).parse::<sfv::Item>() {
        Ok(item) => match item.bare_item.as_string() {
            Some(s) => Ok(s.as_str().to_owned()),
            // Cannot happen for text starting with `"`; refused rather than assumed.
            None => Err(KeyHeaderError::BadQuoting {
                reason: "the value is not a structured-field string".into(),
            }),
        },
        Err(e) => {
            // A control character inside the quotes is reported with the key rule, at its
            // position in the key (what is before it parsed, so its escapes are pairs).
            if let Some(at) = e.index() {
                let found = text.get(at..).and_then(|t| t.chars().next());
                if found.is_some_and(char::is_control) {
                    let inside = text.get(1..at).unwrap_or("");
                    return Err(KeyHeaderError::Key(KeyError::ControlCharacter {
                        position: decoded_len(inside),
                    }));
                }
            }
            Err(KeyHeaderError::BadQuoting {
                reason: format!("{e:#}"),
            })
        }
    }
}

/// The length of sf-string content once its `\x` escapes are decoded.
fn decoded_len(escaped: &str) -> usize {
    let mut n = 0;
    let mut chars = escaped.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            chars.next();
        }
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn read(values: &[&[u8]]) -> Result<Option<IdempotencyKey>, KeyHeaderError> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(IDEMPOTENCY_KEY, HeaderValue::from_bytes(v).unwrap());
        }
        read_key(&h)
    }

    fn key(s: &str) -> Option<IdempotencyKey> {
        Some(IdempotencyKey::new(s).unwrap())
    }

    #[test]
    fn bare_and_quoted_are_the_same_key() {
        assert_eq!(read(&[b"abc"]).unwrap(), key("abc"));
        assert_eq!(read(&[b"\"abc\""]).unwrap(), key("abc"));
        assert_eq!(read(&[b"  \"abc\"\t"]).unwrap(), key("abc"));
        assert_eq!(read(&[br#""a\"b\\c""#]).unwrap(), key(r#"a"b\c"#));
        assert_eq!(read(&[b"\"a,b\""]).unwrap(), key("a,b"));
        assert_eq!(read(&[]).unwrap(), None);
    }

    /// The draft's field is a structured-field string: parameters after it are read, not
    /// refused. Bare values keep today's reading (as sent), parameters or not.
    #[test]
    fn structured_field_parameters_are_read() {
        assert_eq!(read(&[b"\"abc\";v=1"]).unwrap(), key("abc"));
        assert_eq!(read(&[b"\"abc\";v=1;ts=\"x\";ok"]).unwrap(), key("abc"));
        assert_eq!(read(&[br#""a\"b";p=?1"#]).unwrap(), key(r#"a"b"#));
        assert_eq!(
            read(&[b"\"abc\"; v=1"]).unwrap(),
            key("abc"),
            "SP after ';'"
        );
        assert_eq!(read(&[b"abc;v=1"]).unwrap(), key("abc;v=1"));
        for bad in [
            &b"\"abc\" ;v=1"[..],
            b"\"abc\";V=1",
            b"\"abc\";=1",
            b"\"a\", \"b\"",
            b"\"abc\";v=\"unterminated",
        ] {
            assert!(
                matches!(read(&[bad]), Err(KeyHeaderError::BadQuoting { .. })),
                "{bad:?}: {:?}",
                read(&[bad])
            );
        }
        assert!(matches!(
            read(&[b"\"ab\\\"\tc\""]),
            Err(KeyHeaderError::Key(KeyError::ControlCharacter {
                position: 3
            }))
        ));
    }

    #[test]
    fn refuses_each_malformation() {
        assert_eq!(read(&[b""]), Err(KeyHeaderError::Key(KeyError::Empty)));
        assert_eq!(read(&[b"\"\""]), Err(KeyHeaderError::Key(KeyError::Empty)));
        assert_eq!(read(&[b"   "]), Err(KeyHeaderError::Key(KeyError::Empty)));
        assert!(matches!(
            read(&[&[b'x'; 256]]),
            Err(KeyHeaderError::Key(KeyError::TooLong { len: 256, .. }))
        ));
        assert_eq!(read(&[&[b'x'; 255]]).unwrap(), key(&"x".repeat(255)));
        assert!(matches!(
            read(&[b"a\tb"]),
            Err(KeyHeaderError::Key(KeyError::ControlCharacter {
                position: 1
            }))
        ));
        assert!(matches!(
            read(&[b"\"a\tb\""]),
            Err(KeyHeaderError::Key(KeyError::ControlCharacter {
                position: 1
            }))
        ));
        assert!(matches!(
            read(&["a\u{85}".as_bytes()]),
            Err(KeyHeaderError::Key(KeyError::ControlCharacter { .. }))
        ));
        assert_eq!(read(&[b"\xff\xfe"]), Err(KeyHeaderError::NotUtf8));
        for bad in [
            &b"\"abc"[..],
            b"\"abc\"x",
            b"\"a\\x\"",
            b"\"abc\\",
            "\"caf\u{e9}\"".as_bytes(),
        ] {
            assert!(
                matches!(read(&[bad]), Err(KeyHeaderError::BadQuoting { .. })),
                "{bad:?}"
            );
        }
        assert_eq!(read(&[b"a, b"]), Err(KeyHeaderError::AmbiguousComma));
        assert_eq!(
            read(&[b"a", b"a"]),
            Err(KeyHeaderError::Duplicated { count: 2 })
        );
    }
}
