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
        // Printable ASCII (the usual scope) has no control character; anything else is read
        // character by character.
        let printable_ascii = scope.bytes().all(|b| (0x20..0x7f).contains(&b));
        if let Some((position, _)) = (!printable_ascii)
            .then(|| scope.char_indices().find(|(_, c)| c.is_control()))
            .flatten()
        {
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
        let mut out = String::with_capacity(64);
        for (i, part) in parts.into_iter().enumerate() {
            if i > 0 {
                out.push('|');
            }
            push_escaped(&mut out, part.as_ref());
        }
        Self::new(out)
    }

    /// Appends one more part, for example the method and route added by the HTTP layer.
    pub fn join(&self, part: &str) -> Result<Self, ScopeError> {
        let mut out = String::with_capacity(self.0.len() + 1 + part.len());
        out.push_str(&self.0);
        out.push('|');
        push_escaped(&mut out, part);
        Self::new(out)
    }

    /// The scope as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Appends `part` with `\\` and `|` escaped by a `\\`.
fn push_escaped(out: &mut String, part: &str) {
    let mut rest = part;
    while let Some(at) = rest.find(['|', '\\']) {
        out.push_str(&rest[..at]);
        out.push('\\');
        out.push_str(&rest[at..=at]);
        rest = &rest[at + 1..];
    }
    out.push_str(rest);
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
        let escaped = Scope::from_parts(["a|b\\", "|", "é\\|"]).unwrap();
        assert_eq!(escaped.as_str(), r"a\|b\\|\||é\\\|");
        assert_eq!(
            Scope::from_parts(["x"])
                .unwrap()
                .join("|\\")
                .unwrap()
                .as_str(),
            r"x|\|\\"
        );
    }

    #[test]
    fn control_characters_are_found_past_ascii() {
        assert!(Scope::new("tenant é 😀 /books/{id}").is_ok());
        assert_eq!(
            Scope::new("ab\u{7f}"),
            Err(ScopeError::ControlCharacter { position: 2 })
        );
        // U+0085 (NEXT LINE) is a control character of two bytes in UTF-8.
        assert_eq!(
            Scope::new("é\u{85}"),
            Err(ScopeError::ControlCharacter { position: 2 })
        );
        assert_eq!(
            Scope::from_parts(["ok", "b\nc"]),
            Err(ScopeError::ControlCharacter { position: 4 })
        );
    }
}
