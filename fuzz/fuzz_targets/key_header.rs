//! The `Idempotency-Key` header parser of idempotency-tower: any header lines give a key or a
//! typed refusal, never a panic; an accepted key obeys the key rules; a valid key sent bare or
//! in the draft's quoted form reads back as itself.
#![no_main]

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderValue};
use idempotency_core::IdempotencyKey;
use idempotency_tower::{read_key, KeyHeaderError, IDEMPOTENCY_KEY};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    lines: Vec<Vec<u8>>,
    key: String,
}

fn headers(values: &[HeaderValue]) -> HeaderMap {
    let mut h = HeaderMap::new();
    // Other headers around it must not matter.
    h.append("content-type", HeaderValue::from_static("application/json"));
    for v in values {
        h.append(IDEMPOTENCY_KEY, v.clone());
    }
    h
}

fn obeys_key_rules(key: &IdempotencyKey) -> bool {
    let s = key.as_str();
    !s.is_empty() && s.len() <= 255 && !s.chars().any(char::is_control)
}

fuzz_target!(|input: Input| {
    // Lines the http crate refuses (CR, LF, NUL…) cannot reach the parser.
    let values: Vec<HeaderValue> = input
        .lines
        .iter()
        .filter_map(|l| HeaderValue::from_bytes(l).ok())
        .collect();
    match (values.len(), read_key(&headers(&values))) {
        (0, result) => assert_eq!(result, Ok(None)),
        (1, Ok(Some(key))) => {
            assert!(obeys_key_rules(&key), "{key:?}");
            let text = std::str::from_utf8(values[0].as_bytes()).expect("accepted as UTF-8");
            let trimmed = text.trim_matches(|c| c == ' ' || c == '\t');
            if !trimmed.starts_with('"') {
                assert_eq!(key.as_str(), trimmed, "a bare key is read as sent");
            }
        }
        (1, Ok(None)) => panic!("a header was sent but no key was read"),
        (1, Err(KeyHeaderError::Duplicated { .. })) => panic!("one line reported as duplicated"),
        (1, Err(_)) => {}
        (n, result) => assert_eq!(result, Err(KeyHeaderError::Duplicated { count: n })),
    }

    let Ok(key) = IdempotencyKey::new(input.key.as_str()) else {
        return;
    };
    let s = key.as_str();
    // The quoted (sf-string) form holds printable ASCII, with `"` and `\` escaped.
    if s.chars().all(|c| (' '..='~').contains(&c)) {
        let quoted = format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""));
        let value = HeaderValue::from_str(&quoted).expect("printable ASCII is a header value");
        assert_eq!(
            read_key(&headers(&[value])),
            Ok(Some(key.clone())),
            "{quoted}"
        );
    }
    // The bare form, for keys that cannot be mistaken for another form.
    let bare_ok = !s.starts_with('"')
        && !s.contains(',')
        && !s.starts_with([' ', '\t'])
        && !s.ends_with([' ', '\t']);
    if bare_ok {
        if let Ok(value) = HeaderValue::from_bytes(s.as_bytes()) {
            assert_eq!(read_key(&headers(&[value])), Ok(Some(key.clone())), "{s:?}");
        }
    }
});
