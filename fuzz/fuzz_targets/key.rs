//! Idempotency keys and scopes: validation accepts exactly what the documented rules allow,
//! reports the rule a bad value breaks, and never panics. Scopes built from parts never
//! collide.
#![no_main]

use arbitrary::Arbitrary;
use idempotency_core::{IdempotencyKey, KeyError, Scope, ScopeError};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input<'a> {
    raw: &'a [u8],
    parts_a: Vec<String>,
    parts_b: Vec<String>,
}

/// The rule a key breaks, computed independently of the crate.
fn expected_key(s: &str) -> Result<(), KeyError> {
    if s.is_empty() {
        return Err(KeyError::Empty);
    }
    if s.len() > 255 {
        return Err(KeyError::TooLong {
            len: s.len(),
            max: 255,
        });
    }
    for (position, c) in s.char_indices() {
        if matches!(u32::from(c), 0..=0x1f | 0x7f..=0x9f) {
            return Err(KeyError::ControlCharacter { position });
        }
    }
    Ok(())
}

fn expected_scope(s: &str) -> Result<(), ScopeError> {
    if s.is_empty() {
        return Err(ScopeError::Empty);
    }
    if s.len() > 1024 {
        return Err(ScopeError::TooLong {
            len: s.len(),
            max: 1024,
        });
    }
    for (position, c) in s.char_indices() {
        if matches!(u32::from(c), 0..=0x1f | 0x7f..=0x9f) {
            return Err(ScopeError::ControlCharacter { position });
        }
    }
    Ok(())
}

fuzz_target!(|input: Input<'_>| {
    if let Ok(text) = std::str::from_utf8(input.raw) {
        let key = IdempotencyKey::new(text);
        assert_eq!(key.clone().map(|_| ()), expected_key(text), "{text:?}");
        if let Ok(key) = key {
            assert_eq!(key.as_str(), text);
            assert_eq!(text.parse::<IdempotencyKey>().as_ref(), Ok(&key));
        }
        let scope = Scope::new(text);
        assert_eq!(scope.map(|_| ()), expected_scope(text), "{text:?}");
    }

    // Different part lists never name the same scope, and join appends one part.
    if let (Ok(a), Ok(b)) = (
        Scope::from_parts(&input.parts_a),
        Scope::from_parts(&input.parts_b),
    ) {
        assert_eq!(
            a == b,
            input.parts_a == input.parts_b,
            "{:?} / {:?}",
            input.parts_a,
            input.parts_b
        );
        if let Some(last) = input.parts_b.first() {
            let mut longer = input.parts_a.clone();
            longer.push(last.clone());
            assert_eq!(a.join(last).ok(), Scope::from_parts(&longer).ok());
        }
    }
});
