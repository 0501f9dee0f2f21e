//! Canonical-JSON fingerprints over generated JSON values:
//! - the canonical text parses back to the same value, and canonicalising that is a fixed point;
//! - the fingerprint is the SHA-256 of the canonical text;
//! - any other text for the same value (keys permuted, whitespace, `\u` escapes) has the same
//!   fingerprint, alone and as a JSON request body;
//! - two values have the same fingerprint exactly when they are equal.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use idempotency_core::{canonical_json, Fingerprint};
use idempotency_fuzz::{mutate, write_variant, Json};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

#[derive(Debug, Arbitrary)]
struct Input<'a> {
    a: Json,
    b: Json,
    /// Whether the second value is `b` or a one-node edit of the first.
    edit: bool,
    choices: &'a [u8],
}

fn body_fingerprint(body: &[u8]) -> Fingerprint {
    Fingerprint::builder()
        .method("POST")
        .path("/orders")
        .content_type("application/json; charset=utf-8")
        .body(body)
        .finish()
}

fuzz_target!(|input: Input<'_>| {
    let a = input.a.to_value();
    let canonical = canonical_json(&a);
    let reparsed: Value = serde_json::from_str(&canonical)
        .unwrap_or_else(|e| panic!("canonical text {canonical:?} does not parse: {e}"));
    assert_eq!(
        reparsed, a,
        "canonical text {canonical:?} reads back as another value"
    );
    assert_eq!(canonical_json(&reparsed), canonical, "not a fixed point");

    let fp = Fingerprint::from_json(&a);
    assert_eq!(fp, Fingerprint::from_bytes(canonical.as_bytes()));

    let mut u = Unstructured::new(input.choices);
    let mut variant = String::new();
    if write_variant(&a, &mut u, &mut variant).is_err() {
        return;
    }
    let parsed: Value = serde_json::from_str(&variant)
        .unwrap_or_else(|e| panic!("variant {variant:?} does not parse: {e}"));
    assert_eq!(parsed, a, "variant {variant:?} reads back as another value");
    assert_eq!(
        Fingerprint::from_json_slice(variant.as_bytes()).ok(),
        Some(fp),
        "{variant:?} and {canonical:?}"
    );
    assert_eq!(
        body_fingerprint(variant.as_bytes()),
        body_fingerprint(canonical.as_bytes()),
        "{variant:?} and {canonical:?} as request bodies"
    );

    let b = if input.edit {
        match mutate(&a, &mut u) {
            Ok(b) => b,
            Err(_) => return,
        }
    } else {
        input.b.to_value()
    };
    let fp_b = Fingerprint::from_json(&b);
    assert_eq!(
        a == b,
        fp == fp_b,
        "values {} and {} (equal: {}) vs fingerprints",
        canonical,
        canonical_json(&b),
        a == b
    );
    assert_eq!(a == b, canonical == canonical_json(&b));
    if a != b {
        assert_ne!(
            body_fingerprint(canonical.as_bytes()),
            body_fingerprint(canonical_json(&b).as_bytes())
        );
    }
});
