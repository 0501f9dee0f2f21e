//! Canonical-JSON fingerprints over arbitrary bytes, as a request body would arrive:
//! - parsing never panics, and accepts what serde_json accepts, and besides only numbers
//!   outside the f64 range (which serde_json refuses);
//! - whatever parses has a canonical text that is a fixed point, reads (through serde_json)
//!   as the same value up to f64 rounding, and whose SHA-256 is the fingerprint;
//! - a JSON body is fingerprinted by its canonical text, any other body by its bytes;
//! - every digit counts: changing one digit of a number's integer or fraction part changes
//!   the fingerprint;
//! - a serde_json value and the text serde_json writes for it have one fingerprint.
#![no_main]

use idempotency_core::{canonical_json, canonical_json_slice, Fingerprint};
use idempotency_fuzz::{approx_eq, mantissa_digits};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn body(content_type: &str, body: &[u8]) -> Fingerprint {
    Fingerprint::builder()
        .method("PUT")
        .path("/x")
        .query("a=1")
        .content_type(content_type)
        .body(body)
        .finish()
}

fuzz_target!(|data: &[u8]| {
    let parsed = serde_json::from_slice::<Value>(data);
    let canonical = canonical_json_slice(data);
    let fp = Fingerprint::from_json_slice(data);
    assert_eq!(canonical.is_ok(), fp.is_ok());
    match (&parsed, &canonical) {
        (Ok(_), Err(e)) => panic!("serde_json reads it, but it has no canonical form: {e}"),
        (Err(e), Ok(c)) => assert!(
            e.to_string().starts_with("number out of range"),
            "serde_json refuses it ({e}), yet it canonicalises to {c:?}"
        ),
        _ => {}
    }
    let json_body = body("application/json", data);
    let text_body = body("text/plain", data);
    assert_ne!(
        json_body, text_body,
        "the content type is part of the fingerprint"
    );
    let (Ok(canonical), Ok(fp)) = (canonical, fp) else {
        // Not JSON: hashed as raw bytes, so a body that differs in one byte differs.
        let mut other = data.to_vec();
        other.push(b' ');
        assert_ne!(json_body, body("application/json", &other));
        return;
    };

    assert_eq!(
        canonical_json_slice(canonical.as_bytes()).ok().as_deref(),
        Some(canonical.as_str()),
        "not a fixed point"
    );
    assert_eq!(fp, Fingerprint::from_bytes(canonical.as_bytes()));
    assert_eq!(json_body, body("application/json", canonical.as_bytes()));
    if let Ok(value) = &parsed {
        // Duplicate names keep their order, so the last one still wins.
        let again: Value = serde_json::from_str(&canonical)
            .unwrap_or_else(|e| panic!("canonical text {canonical:?} does not parse: {e}"));
        assert!(
            approx_eq(&again, value),
            "{canonical:?} reads back as another value"
        );
        let text = serde_json::to_vec(value).expect("a value serialises");
        assert_eq!(
            canonical_json_slice(&text).ok(),
            Some(canonical_json(value)),
            "a value and its serialisation"
        );
        assert_eq!(
            Fingerprint::from_json_slice(&text).ok(),
            Some(Fingerprint::from_json(value))
        );
    }

    // Another digit in a number's integer or fraction part is another value.
    let digits = mantissa_digits(data);
    for k in 0..digits.len().min(3) {
        let at = digits[(data.len() + 7 * k) % digits.len()];
        let mut other = data.to_vec();
        other[at] = if data[at] == b'9' { b'0' } else { data[at] + 1 };
        if let Ok(fp_other) = Fingerprint::from_json_slice(&other) {
            assert_ne!(
                fp_other,
                fp,
                "{:?} and {:?}",
                String::from_utf8_lossy(data),
                String::from_utf8_lossy(&other)
            );
        }
        assert_ne!(body("application/json", &other), json_body);
    }
});
