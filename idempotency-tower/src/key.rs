//! Reading the `Idempotency-Key` header.

use http::HeaderMap;
use idempotency_core::{IdempotencyKey, KeyError};

/// The header the key is read from.
pub const IDEMPOTENCY_KEY: http::HeaderName = http::HeaderName::from_static("idempotency-key");

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
    /// The value starts with `"` but is not a valid structured-field string (RFC 8941 §3.3.3).
    #[error("the Idempotency-Key header is not a valid quoted string: {reason}")]
    BadQuoting {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A bare (unquoted) value contains a comma, which is what an intermediary produces when
    /// it joins two header lines; send keys with commas in the quoted form.
    #[error("the unquoted Idempotency-Key contains a comma (use the quoted form, \"...\", for such keys)")]
    AmbiguousComma,
    /// The key breaks a key rule (empty, longer than 255 bytes, control characters).
    #[error(transparent)]
    Key(#[from] KeyError),
}

/// Reads the key from `headers`: `Ok(None)` when there is no `Idempotency-Key` header.
///
/// The bare form (`Idempotency-Key: abc`) and the draft's structured-field string form
/// (`Idempotency-Key: "abc"`) name the same key. Surrounding whitespace is ignored.
///
/// ```
/// use http::HeaderMap;
/// use idempotency_tower::read_key;
///
/// let mut h = HeaderMap::new();
/// h.insert("idempotency-key", "\"order-7\"".parse().unwrap());
/// assert_eq!(read_key(&h).unwrap().unwrap().as_str(), "order-7");
/// h.insert("idempotency-key", "order-7".parse().unwrap());
/// assert_eq!(read_key(&h).unwrap().unwrap().as_str(), "order-7");
/// h.insert("idempotency-key", "\"unterminated".parse().unwrap());
/// assert!(read_key(&h).is_err());
/// ```
pub fn read_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, KeyHeaderError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let extra = values.count();
    if extra > 0 {
        return Err(KeyHeaderError::Duplicated { count: extra + 1 });
    }
    let text = std::str::from_utf8(value.as_bytes()).map_err(|_| KeyHeaderError::NotUtf8)?;
    let text = text.trim_matches(|c| c == ' ' || c == '\t');
    let key = if text.starts_with('"') {
        parse_sf_string(text)?
    } else {
        if text.contains(',') {
            return Err(KeyHeaderError::AmbiguousComma);
        }
        text.to_owned()
    };
    Ok(Some(IdempotencyKey::new(key)?))
}

/// Parses an RFC 8941 sf-string: `"` then printable ASCII, with `\"` and `\\` escapes, then
/// `"` and nothing after it.
fn parse_sf_string(text: &str) -> Result<String, KeyHeaderError> {
    let bad = |reason| KeyHeaderError::BadQuoting { reason };
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().skip(1);
    loop {
        match chars.next() {
            None => return Err(bad("the closing quote is missing")),
            Some('"') => break,
            Some('\\') => match chars.next() {
                Some(c @ ('"' | '\\')) => out.push(c),
                Some(_) => return Err(bad("only \\\" and \\\\ may be escaped")),
                None => return Err(bad("the closing quote is missing")),
            },
            Some(c) if (' '..='~').contains(&c) => out.push(c),
            Some(c) if c.is_control() => {
                // Report control characters with the key rule, at their position in the key.
                return Err(KeyHeaderError::Key(KeyError::ControlCharacter {
                    position: out.len(),
                }));
            }
            Some(_) => return Err(bad("a quoted key may hold printable ASCII only")),
        }
    }
    if chars.next().is_some() {
        return Err(bad("characters follow the closing quote"));
    }
    Ok(out)
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
