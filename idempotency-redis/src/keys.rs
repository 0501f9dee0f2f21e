//! Record key names: `<prefix>{<scope>:<key>}` with both parts percent-escaped.
//!
//! The braces are a Redis Cluster hash tag: only the part between them picks the slot, and
//! the whole record lives in one key, so every script touches one slot. Escaping keeps the tag
//! intact whatever the scope and key contain: `{`, `}`, `:` and `%` never appear raw inside it,
//! so the first `}` after the first `{` is always the tag's end, and `scope:key` splits back
//! unambiguously (the encoding is injective). Glob characters are escaped too, so operators
//! can `SCAN MATCH` on a prefix.

use idempotency_core::{Error, RecordId};
use std::fmt::Write as _;

/// The longest prefix accepted, in bytes.
pub const MAX_PREFIX_LEN: usize = 256;

/// Checks a key prefix: at most [`MAX_PREFIX_LEN`] bytes, no braces (a brace would move the
/// hash tag) and no control characters.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), Error> {
    if prefix.len() > MAX_PREFIX_LEN {
        return Err(Error::Config(format!(
            "Redis key prefix is {} bytes, the limit is {MAX_PREFIX_LEN}",
            prefix.len()
        )));
    }
    if let Some(c) = prefix
        .chars()
        .find(|c| matches!(c, '{' | '}') || c.is_control())
    {
        return Err(Error::Config(format!(
            "Redis key prefix {prefix:?} contains {c:?}: braces would break the cluster hash \
             tag and control characters are not allowed"
        )));
    }
    Ok(())
}

/// Appends `s` to `out`, percent-escaping every byte that is not printable ASCII or that has
/// a meaning in the key layout or in glob patterns.
fn escape_into(out: &mut String, s: &str) {
    for b in s.bytes() {
        let plain = (0x21..=0x7e).contains(&b)
            && !matches!(
                b,
                b'%' | b'{' | b'}' | b':' | b'*' | b'?' | b'[' | b']' | b'\\'
            );
        if plain {
            out.push(char::from(b));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// The Redis key of a record.
pub(crate) fn record_key(prefix: &str, id: &RecordId) -> String {
    let (scope, key) = (id.scope.as_str(), id.key.as_str());
    let mut out = String::with_capacity(prefix.len() + scope.len() + key.len() + 8);
    out.push_str(prefix);
    out.push('{');
    escape_into(&mut out, scope);
    out.push(':');
    escape_into(&mut out, key);
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_core::{IdempotencyKey, Scope};

    fn id(scope: &str, key: &str) -> RecordId {
        RecordId::new(
            IdempotencyKey::new(key).unwrap(),
            Scope::new(scope).unwrap(),
        )
    }

    /// The part Redis Cluster hashes: between the first `{` and the first `}` after it.
    fn hash_tag(key: &str) -> &str {
        let open = key.find('{').unwrap();
        let close = open + 1 + key[open + 1..].find('}').unwrap();
        &key[open + 1..close]
    }

    #[test]
    fn readable_for_plain_input() {
        assert_eq!(
            record_key("idem:", &id("tenant-1|POST /pay", "abc-123")),
            "idem:{tenant-1|POST%20/pay:abc-123}"
        );
    }

    #[test]
    fn braces_and_separators_cannot_break_the_tag() {
        let nasty = [
            ("a}b", "{c"),
            ("a:b", "c"),
            ("a", "b:c"),
            ("{}", "}{"),
            ("%7D", "%3A"),
            ("ünï", "*?[x]\\"),
        ];
        let mut seen = std::collections::HashSet::new();
        for (scope, key) in nasty {
            let k = record_key("p:", &id(scope, key));
            let tag = hash_tag(&k);
            // The tag is everything after the prefix but the closing brace.
            assert_eq!(format!("p:{{{tag}}}"), k, "tag cut short in {k}");
            assert_eq!(tag.matches(':').count(), 1, "{k}");
            assert!(!tag.contains(['{', '}', '*', '?', '[', ']', '\\']), "{k}");
            assert!(seen.insert(k.clone()), "two ids share the key {k}");
        }
    }

    #[test]
    fn encoding_is_injective_at_the_separator() {
        // "a:b" + "c" and "a" + "b:c" join to the same raw text; their keys must differ.
        assert_ne!(
            record_key("", &id("a:b", "c")),
            record_key("", &id("a", "b:c"))
        );
        assert_ne!(
            record_key("", &id("a%", "b")),
            record_key("", &id("a", "%b"))
        );
    }

    #[test]
    fn prefix_rules() {
        assert!(validate_prefix("idempotency:").is_ok());
        assert!(validate_prefix("").is_ok());
        assert!(matches!(validate_prefix("a{b"), Err(Error::Config(_))));
        assert!(matches!(validate_prefix("a}"), Err(Error::Config(_))));
        assert!(matches!(validate_prefix("a\nb"), Err(Error::Config(_))));
        assert!(matches!(
            validate_prefix(&"x".repeat(MAX_PREFIX_LEN + 1)),
            Err(Error::Config(_))
        ));
    }
}
