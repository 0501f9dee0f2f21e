//! Validated idempotency keys.

use std::fmt;
use std::sync::Arc;

/// Why a string is not a valid [`IdempotencyKey`]. Each variant names the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// Rule: a key has at least one byte.
    #[error("idempotency key is empty (a key must be 1 to {max} bytes)", max = IdempotencyKey::MAX_LEN)]
    Empty,
    /// Rule: a key has at most [`IdempotencyKey::MAX_LEN`] bytes.
    #[error("idempotency key is {len} bytes long (a key must be 1 to {max} bytes)")]
    TooLong {
        /// Length of the rejected key in bytes.
        len: usize,
        /// The maximum allowed length.
        max: usize,
    },
    /// Rule: a key contains no control characters (U+0000–U+001F, U+007F–U+009F).
    #[error("idempotency key has a control character at byte {position} (control characters are not allowed)")]
    ControlCharacter {
        /// Byte offset of the first control character.
        position: usize,
    },
}

/// A client-chosen idempotency key: 1 to 255 bytes of UTF-8 without control characters.
///
/// ```
/// use idempotency_core::IdempotencyKey;
///
/// let key = IdempotencyKey::new("order-42")?;
/// assert_eq!(key.as_str(), "order-42");
/// assert!(IdempotencyKey::new("").is_err());
/// assert!(IdempotencyKey::new("a\nb").is_err());
///
/// // Queue consumers derive the same key from a message id in every process.
/// let a = IdempotencyKey::derive("billing-consumer", "msg-7");
/// let b = IdempotencyKey::derive("billing-consumer", "msg-7");
/// assert_eq!(a, b);
/// # Ok::<(), idempotency_core::KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Arc<str>);

impl IdempotencyKey {
    /// The longest key accepted, in bytes.
    pub const MAX_LEN: usize = 255;

    /// Validates and wraps a key.
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        validate_key(&key)?;
        Ok(Self(key.into()))
    }

    /// Validates and wraps a key given as a slice: one allocation, with no `String` on the
    /// way (a key read from a request header).
    #[cfg(feature = "http")]
    pub(crate) fn from_slice(key: &str) -> Result<Self, KeyError> {
        validate_key(key)?;
        Ok(Self(key.into()))
    }

    /// A fresh random key (UUID v4), for clients that mint their own keys.
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().to_string().into())
    }

    /// A key derived deterministically from a namespace and a message id (UUID v5), so every
    /// process that sees the same message derives the same key. Meant for queue consumers
    /// deduplicating redelivered messages.
    pub fn derive(namespace: &str, message_id: &str) -> Self {
        let ns = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, namespace.as_bytes());
        Self(
            uuid::Uuid::new_v5(&ns, message_id.as_bytes())
                .to_string()
                .into(),
        )
    }

    /// The key as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Consumes the key, returning the inner string.
    pub fn into_inner(self) -> String {
        String::from(&*self.0)
    }
}

pub(crate) fn validate_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > IdempotencyKey::MAX_LEN {
        return Err(KeyError::TooLong {
            len: key.len(),
            max: IdempotencyKey::MAX_LEN,
        });
    }
    if let Some((position, _)) = key.char_indices().find(|(_, c)| c.is_control()) {
        return Err(KeyError::ControlCharacter { position });
    }
    Ok(())
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for IdempotencyKey {
    type Error = KeyError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl TryFrom<&str> for IdempotencyKey {
    type Error = KeyError;
    fn try_from(s: &str) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_boundaries() {
        assert!(IdempotencyKey::new("a").is_ok());
        assert!(IdempotencyKey::new("x".repeat(255)).is_ok());
        assert!(IdempotencyKey::new("ключ-🔑 with spaces").is_ok());
    }

    #[test]
    fn rejects_each_rule() {
        assert_eq!(IdempotencyKey::new(""), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::new("x".repeat(256)),
            Err(KeyError::TooLong { len: 256, max: 255 })
        );
        assert_eq!(
            IdempotencyKey::new("ab\u{7f}"),
            Err(KeyError::ControlCharacter { position: 2 })
        );
        assert_eq!(
            IdempotencyKey::new("\u{0}"),
            Err(KeyError::ControlCharacter { position: 0 })
        );
        assert!(IdempotencyKey::new("a\u{85}").is_err());
    }

    #[test]
    fn random_keys_are_valid_and_distinct() {
        let a = IdempotencyKey::random();
        let b = IdempotencyKey::random();
        assert_ne!(a, b);
        assert!(IdempotencyKey::new(a.as_str()).is_ok());
    }

    #[test]
    fn derive_is_stable_and_namespaced() {
        let a = IdempotencyKey::derive("ns", "m1");
        assert_eq!(a, IdempotencyKey::derive("ns", "m1"));
        assert_ne!(a, IdempotencyKey::derive("ns", "m2"));
        assert_ne!(a, IdempotencyKey::derive("other", "m1"));
        // Pinned so a change of derivation (which would break dedup across deploys) is caught.
        assert_eq!(
            IdempotencyKey::derive("ns", "m1").as_str(),
            uuid::Uuid::new_v5(
                &uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, b"ns"),
                b"m1"
            )
            .to_string()
        );
    }
}
