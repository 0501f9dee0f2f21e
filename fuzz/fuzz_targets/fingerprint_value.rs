//! Canonical-JSON fingerprints over generated JSON values:
//! - the canonical text reads back as the same value (numbers by exact value: `1` is `1.0`),
//!   and canonicalising it, as a value or as text, is a fixed point;
//! - the fingerprint is the SHA-256 of the canonical text, and the same as that of the text
//!   serde_json writes for the value;
//! - any other text for the same value (keys permuted, whitespace, `\u` escapes, numbers
//!   written with other digits for the same exact value) has the same fingerprint, alone and
//!   as a JSON request body;
//! - two values have the same fingerprint exactly when they are equal, numbers compared by
//!   exact value (an oracle of its own, std's `{:e}`, see `exact_eq`).
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use idempotency_core::{canonical_json, canonical_json_slice, Fingerprint};
use idempotency_fuzz::{approx_eq, exact_eq, mutate, write_variant, Json};
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
    assert!(
        exact_eq(&reparsed, &a),
        "canonical text {canonical:?} reads back as another value"
    );
    assert_eq!(canonical_json(&reparsed), canonical, "not a fixed point");
    assert_eq!(
        canonical_json_slice(canonical.as_bytes()).ok().as_deref(),
        Some(canonical.as_str()),
        "not a fixed point as text"
    );

    let fp = Fingerprint::from_json(&a);
    assert_eq!(fp, Fingerprint::from_bytes(canonical.as_bytes()));
    let serialised = serde_json::to_string(&a).expect("a value serialises");
    assert_eq!(
        canonical_json_slice(serialised.as_bytes()).ok().as_deref(),
        Some(canonical.as_str()),
        "the value and its serialisation {serialised:?}"
    );

    let mut u = Unstructured::new(input.choices);
    let mut variant = String::new();
    if write_variant(&a, &mut u, &mut variant).is_err() {
        return;
    }
    // serde_json may round a variant's number (`1.8446744073709551615e19` is an f64), so
    // only as f64s.
    let parsed: Value = serde_json::from_str(&variant)
        .unwrap_or_else(|e| panic!("variant {variant:?} does not parse: {e}"));
    assert!(
        approx_eq(&parsed, &a),
        "variant {variant:?} reads back as another value"
    );
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
    let equal = exact_eq(&a, &b);
    let fp_b = Fingerprint::from_json(&b);
    assert_eq!(
        equal,
        fp == fp_b,
        "values {} and {} (equal: {equal}) vs fingerprints",
        canonical,
        canonical_json(&b),
    );
    assert_eq!(equal, canonical == canonical_json(&b));
    if !equal {
        assert_ne!(
            body_fingerprint(canonical.as_bytes()),
            body_fingerprint(canonical_json(&b).as_bytes())
        );
    }
});
