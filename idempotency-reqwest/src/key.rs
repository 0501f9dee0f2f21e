//! Reading a key the caller put in the header, and writing the key the middleware chose.

use http::{HeaderMap, HeaderName, HeaderValue};
use idempotency_core::http::KeyHeaderError;
use idempotency_core::IdempotencyKey;

/// The header the key is sent in (by default; see
/// [`IdempotencyMiddleware::key_header`](crate::IdempotencyMiddleware::key_header)), and the
/// header a server sets on a replayed response (by default; see
/// [`IdempotencyMiddleware::replay_marker`](crate::IdempotencyMiddleware::replay_marker)):
/// the server half's own names.
pub use idempotency_core::http::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};

/// The key in the caller's `name` header: `Ok(None)` without one, `Err(why)` when the header
/// is not one valid key. It is read by the reader the server half uses
/// ([`idempotency_core::http::read_key_header`]), so the client refuses exactly what such a
/// server refuses: the bare form and the draft's quoted structured-field form (`"abc"`, parameters
/// ignored) name the same key.
pub(crate) fn read_key_header(
    headers: &HeaderMap,
    name: &HeaderName,
) -> Result<Option<IdempotencyKey>, String> {
    idempotency_core::http::read_key_header(headers, name).map_err(|e| match e {
        KeyHeaderError::Duplicated { count } => format!(
            "the {name} header is set {count} times; a server cannot know which key is meant"
        ),
        KeyHeaderError::NotUtf8 => format!("the {name} header is not valid UTF-8"),
        KeyHeaderError::BadQuoting { reason } => {
            format!("the {name} header is not a valid quoted string: {reason}")
        }
        KeyHeaderError::AmbiguousComma => format!(
            "the unquoted {name} header contains a comma, which servers read as two joined \
             values; quote the key (\"...\")"
        ),
        KeyHeaderError::Key(e) => format!("the {name} header holds no valid key: {e}"),
        other => format!("the {name} header: {other}"),
    })
}

/// The header value for `key`: the bare key, or the quoted structured-field string when the
/// bare form would be read back as another key (a comma, a leading quote, surrounding
/// whitespace). `Err(why)` for a key no header can carry unambiguously.
pub(crate) fn key_header_value(key: &IdempotencyKey) -> Result<HeaderValue, String> {
    let text = key.as_str();
    let ambiguous = text.contains(',')
        || text.starts_with('"')
        || text.starts_with([' ', '\t'])
        || text.ends_with([' ', '\t']);
    if !ambiguous {
        // A valid key has no control characters, so every byte is allowed in a header value.
        return HeaderValue::from_bytes(text.as_bytes())
            .map_err(|_| "the key cannot be written in a header".to_owned());
    }
    if !text.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err(
            "the key needs quoting (it has a comma, a leading quote or surrounding spaces), \
             and a quoted key can only hold printable ASCII"
                .to_owned(),
        );
    }
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push('"');
    for c in text.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    HeaderValue::from_str(&quoted).map_err(|_| "the key cannot be written in a header".to_owned())
}

/// Whether a response carries the replay marker (`true`, or the structured-field `?1`).
pub(crate) fn is_replayed(headers: &HeaderMap, name: &HeaderName) -> bool {
    headers.get(name).is_some_and(|v| {
        v.to_str().is_ok_and(|v| {
            let v = v.trim();
            v.eq_ignore_ascii_case("true") || v == "?1"
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(values: &[&str]) -> Result<Option<IdempotencyKey>, String> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(IDEMPOTENCY_KEY, HeaderValue::from_str(v).unwrap());
        }
        read_key_header(&h, &IDEMPOTENCY_KEY)
    }

    fn key(s: &str) -> IdempotencyKey {
        IdempotencyKey::new(s).unwrap()
    }

    #[test]
    fn reads_bare_and_quoted_forms_as_one_key() {
        assert_eq!(read(&[]), Ok(None));
        assert_eq!(read(&["order-7"]), Ok(Some(key("order-7"))));
        assert_eq!(read(&["  order-7\t"]), Ok(Some(key("order-7"))));
        assert_eq!(read(&["\"order-7\""]), Ok(Some(key("order-7"))));
        assert_eq!(read(&["\"order-7\";v=1"]), Ok(Some(key("order-7"))));
        assert_eq!(read(&["\"a,\\\"b\""]), Ok(Some(key("a,\"b"))));
    }

    #[test]
    fn refuses_what_a_server_would_refuse() {
        assert!(read(&["a", "b"]).unwrap_err().contains("2 times"));
        assert!(read(&["a,b"]).unwrap_err().contains("comma"));
        assert!(read(&["\"unterminated"]).is_err());
        assert!(read(&[""]).unwrap_err().contains("no valid key"));
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, HeaderValue::from_bytes(b"\xff").unwrap());
        assert!(read_key_header(&h, &IDEMPOTENCY_KEY)
            .unwrap_err()
            .contains("UTF-8"));
    }

    #[test]
    fn written_keys_read_back_as_themselves() {
        for k in [
            "plain",
            "with,comma",
            "\"leading-quote",
            " padded ",
            "back\\slash,",
            "ключ",
            "a b",
        ] {
            let value = key_header_value(&key(k)).unwrap();
            let mut h = HeaderMap::new();
            h.insert(IDEMPOTENCY_KEY, value);
            assert_eq!(
                read_key_header(&h, &IDEMPOTENCY_KEY),
                Ok(Some(key(k))),
                "{k}"
            );
        }
        assert_eq!(
            key_header_value(&key("with,comma")).unwrap(),
            "\"with,comma\""
        );
        assert!(key_header_value(&key("ключ,")).is_err());
    }

    #[test]
    fn replay_marker() {
        let mut h = HeaderMap::new();
        assert!(!is_replayed(&h, &IDEMPOTENT_REPLAYED));
        for (v, expected) in [
            ("true", true),
            ("True", true),
            ("?1", true),
            ("false", false),
        ] {
            h.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static(v));
            assert_eq!(is_replayed(&h, &IDEMPOTENT_REPLAYED), expected, "{v}");
        }
    }
}
