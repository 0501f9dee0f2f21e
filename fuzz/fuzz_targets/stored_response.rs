//! The stored-response encoding of idempotency-tower (what the layer keeps as a record's
//! outcome, in both formats: replayable and not-replayable records): any stored bytes decode to
//! a response or a typed error, never a panic; a decoded response encodes and decodes to
//! itself; any response round-trips.
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use idempotency_tower::{NotReplayable, StoredResponse};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input<'a> {
    stored: &'a [u8],
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: &'a [u8],
    not_replayable: Option<bool>,
}

fuzz_target!(|input: Input<'_>| {
    // Bytes as a store hands them back (possibly written by something else, or damaged).
    if let Ok(decoded) = StoredResponse::decode(input.stored) {
        let again = StoredResponse::decode(&decoded.encode()).expect("re-encoded response decodes");
        assert_eq!(again, decoded);
    }
    // Prefixing a magic (either version) gets the fuzzer past the format check more often.
    for magic in [&b"IDR\x01"[..], b"IDR\x02"] {
        let mut framed = magic.to_vec();
        framed.extend_from_slice(input.stored);
        if let Ok(decoded) = StoredResponse::decode(&framed) {
            let again =
                StoredResponse::decode(&decoded.encode()).expect("re-encoded response decodes");
            assert_eq!(again, decoded);
        }
    }

    let Ok(status) = StatusCode::from_u16(input.status) else {
        return;
    };
    let headers: Vec<(HeaderName, HeaderValue)> = input
        .headers
        .iter()
        .filter_map(|(n, v)| {
            Some((
                HeaderName::from_bytes(n.as_bytes()).ok()?,
                HeaderValue::from_bytes(v).ok()?,
            ))
        })
        .collect();
    let response = StoredResponse {
        status,
        headers,
        body: Bytes::copy_from_slice(input.body),
        not_replayable: input.not_replayable.map(|large| {
            if large {
                NotReplayable::TooLarge
            } else {
                NotReplayable::BodyFailed
            }
        }),
    };
    let encoded = response.encode();
    assert_eq!(StoredResponse::decode(&encoded), Ok(response));
    // Every proper prefix is refused.
    if !encoded.is_empty() {
        let cut = input.status as usize % encoded.len();
        assert!(StoredResponse::decode(&encoded[..cut]).is_err());
    }
});
