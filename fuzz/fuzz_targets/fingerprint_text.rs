//! Canonical-JSON fingerprints over arbitrary bytes, as a request body would arrive: parsing
//! never panics; whatever parses has a canonical text that is a fixed point and a fingerprint
//! equal to that of its canonical text; a JSON body is fingerprinted by its value, any other
//! body by its bytes.
#![no_main]

use idempotency_core::{canonical_json, Fingerprint};
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
    let fp = Fingerprint::from_json_slice(data);
    assert_eq!(parsed.is_ok(), fp.is_ok());
    let json_body = body("application/json", data);
    let text_body = body("text/plain", data);
    assert_ne!(
        json_body, text_body,
        "the content type is part of the fingerprint"
    );
    match parsed {
        Ok(value) => {
            let canonical = canonical_json(&value);
            let again: Value = serde_json::from_str(&canonical)
                .unwrap_or_else(|e| panic!("canonical text {canonical:?} does not parse: {e}"));
            assert_eq!(again, value, "{canonical:?} reads back as another value");
            assert_eq!(canonical_json(&again), canonical, "not a fixed point");
            let fp = fp.expect("parsed above");
            assert_eq!(fp, Fingerprint::from_json(&again));
            assert_eq!(fp, Fingerprint::from_bytes(canonical.as_bytes()));
            assert_eq!(json_body, body("application/json", canonical.as_bytes()));
        }
        Err(_) => {
            // Not JSON: hashed as raw bytes, so a body that differs in one byte differs.
            let mut other = data.to_vec();
            other.push(b' ');
            assert_ne!(json_body, body("application/json", &other));
        }
    }
});
