//! Every header name the layer reads or writes, in one place.

use http::header;
use http::HeaderName;

pub(crate) use http::header::{
    CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE,
};

/// The key header, the replay marker and the fingerprinted preconditions are shared with the
/// client half, from `idempotency-core` (feature `http`).
pub use idempotency_core::http::{
    DEFAULT_FINGERPRINT_HEADERS, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED,
};

/// A digest of the body it came with (RFC 3230), like the `Content-*` headers not sent with a
/// problem document in place of that body.
pub(crate) const DIGEST: HeaderName = HeaderName::from_static("digest");

const SET_COOKIE2: HeaderName = HeaderName::from_static("set-cookie2");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Headers that are never stored or replayed, whatever the allowlist says: credentials,
/// cookies, and hop-by-hop headers (RFC 9110 §7.6.1), plus `Content-Length`, which is
/// recomputed from the stored body, and the default replay marker.
// A static, not a const: names outside `http`'s standard set hold bytes a const cannot lend.
pub static NEVER_REPLAYED: &[HeaderName] = &NEVER_REPLAYED_NAMES;

static NEVER_REPLAYED_NAMES: [HeaderName; 14] = [
    header::SET_COOKIE,
    SET_COOKIE2,
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::CONNECTION,
    KEEP_ALIVE,
    PROXY_CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::CONTENT_LENGTH,
    IDEMPOTENT_REPLAYED,
];

/// Headers replayed by default: the ones that describe the stored body and the created
/// resource.
pub const DEFAULT_REPLAYED: &[HeaderName] = &[
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::CACHE_CONTROL,
    header::EXPIRES,
    header::VARY,
    header::LINK,
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The lists keep the names (and order) they had as strings.
    #[test]
    fn lists_hold_the_documented_names() {
        let names = |list: &[HeaderName]| {
            list.iter()
                .map(|h| h.as_str().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(DEFAULT_FINGERPRINT_HEADERS),
            [
                "if-match",
                "if-none-match",
                "if-unmodified-since",
                "if-modified-since"
            ]
        );
        assert_eq!(
            names(NEVER_REPLAYED),
            [
                "set-cookie",
                "set-cookie2",
                "authorization",
                "proxy-authorization",
                "proxy-authenticate",
                "connection",
                "keep-alive",
                "proxy-connection",
                "te",
                "trailer",
                "transfer-encoding",
                "upgrade",
                "content-length",
                "idempotent-replayed",
            ]
        );
        assert_eq!(
            names(DEFAULT_REPLAYED),
            [
                "content-type",
                "content-encoding",
                "content-language",
                "content-location",
                "location",
                "etag",
                "last-modified",
                "cache-control",
                "expires",
                "vary",
                "link",
            ]
        );
    }
}
