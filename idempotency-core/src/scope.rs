//! Scopes: who is calling and what operation it is.

use std::fmt;
use std::sync::Arc;

/// Why a string is not a valid [`Scope`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScopeError {
    /// Rule: a scope is never empty (an empty scope would let every caller share keys).
    #[error("scope is empty (a scope names the caller and the operation)")]
    Empty,
    /// Rule: a scope has at most [`Scope::MAX_LEN`] bytes.
    #[error("scope is {len} bytes long (at most {max} bytes)")]
    TooLong {
        /// Length of the rejected scope in bytes.
        len: usize,
        /// The maximum allowed length.
        max: usize,
    },
    /// Rule: a scope contains no control characters.
    #[error("scope has a control character at byte {position}")]
    ControlCharacter {
        /// Byte offset of the first control character.
        position: usize,
    },
}

/// The namespace a key lives in, built from who is calling and what operation it is.
///
/// A record is addressed by `(scope, key)`: the same key sent by two tenants, or to two
/// operations, names two independent records.
///
/// ```
/// use idempotency_core::Scope;
///
/// let scope = Scope::from_parts(["tenant-7", "POST /orders"])?;
/// assert_eq!(scope.as_str(), "tenant-7|POST /orders");
/// // Separators inside a part are escaped, so parts can never run together.
/// assert_ne!(Scope::from_parts(["a|b", "c"])?, Scope::from_parts(["a", "b|c"])?);
/// # Ok::<(), idempotency_core::ScopeError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(Arc<str>);

impl Scope {
    /// The longest scope accepted, in bytes.
    pub const MAX_LEN: usize = 1024;

    /// Validates and wraps a scope string as it is.
    pub fn new(scope: impl Into<String>) -> Result<Self, ScopeError> {
        let scope = scope.into();
        if scope.is_empty() {
            return Err(ScopeError::Empty);
        }
        if scope.len() > Self::MAX_LEN {
            return Err(ScopeError::TooLong {
                len: scope.len(),
                max: Self::MAX_LEN,
            });
        }
        if let Some((position, _)) = scope.char_indices().find(|(_, c)| c.is_control()) {
            return Err(ScopeError::ControlCharacter { position });
        }
        Ok(Self(scope.into()))
    }

    /// Joins parts (tenant, user, method, route…) with `|`, escaping `\` and `|` inside parts
    /// so that different part lists never produce the same scope.
    pub fn from_parts<I, S>(parts: I) -> Result<Self, ScopeError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut out = String::new();
        for (i, part) in parts.into_iter().enumerate() {
            if i > 0 {
                out.push('|');
            }
            for c in part.as_ref().chars() {
                if c == '|' || c == '\\' {
                    out.push('\\');
                }
                out.push(c);
            }
        }
        Self::new(out)
    }

    /// Appends one more part, for example the method and route added by the HTTP layer.
    pub fn join(&self, part: &str) -> Result<Self, ScopeError> {
        let mut out = String::from(&*self.0);
        out.push('|');
        for c in part.chars() {
            if c == '|' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        Self::new(out)
    }

    /// The scope as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Scope").field(&self.0).finish()
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for Scope {
    type Error = ScopeError;
    fn try_from(s: &str) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl TryFrom<String> for Scope {
    type Error = ScopeError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates() {
        assert_eq!(Scope::new(""), Err(ScopeError::Empty));
        assert!(matches!(
            Scope::new("x".repeat(1025)),
            Err(ScopeError::TooLong { len: 1025, .. })
        ));
        assert_eq!(
            Scope::new("a\tb"),
            Err(ScopeError::ControlCharacter { position: 1 })
        );
        assert_eq!(
            Scope::from_parts(Vec::<String>::new()),
            Err(ScopeError::Empty)
        );
    }

    #[test]
    fn parts_are_unambiguous() {
        let a = Scope::from_parts(["a\\", "b"]).unwrap();
        let b = Scope::from_parts(["a", "\\b"]).unwrap();
        assert_ne!(a, b);
        let joined = Scope::from_parts(["t"]).unwrap().join("POST /x").unwrap();
        assert_eq!(joined, Scope::from_parts(["t", "POST /x"]).unwrap());
    }
}
