//! What a work's `Err` does to its key: an engine's type, so that an error type is asked to
//! be serializable only by an engine that stores errors.

use crate::{Error, Failure};
use serde::de::{DeserializeOwned, IgnoredAny};
use serde::{Deserialize, Serialize};
use std::fmt::{Debug, Display};

mod sealed {
    pub trait Sealed {}
}

/// An engine's choice of what a work's `Err` does to its key, made in its type:
/// [`ReleaseErrors`] (the default) or [`StoreErrors`]
/// ([`IdempotencyBuilder::store_errors`](crate::IdempotencyBuilder::store_errors),
/// [`Idempotency::storing_errors`](crate::Idempotency::storing_errors)). Sealed: these two
/// are the choices.
pub trait ErrorMode:
    sealed::Sealed + Copy + Default + Debug + Send + Sync + Unpin + 'static
{
    /// Whether a work's `Err` is stored and replayed (`true`), or recorded as a retryable
    /// failure that releases the key (`false`).
    const STORES_ERRORS: bool;
}

/// The default: a work's `Err` is recorded as a retryable failure that releases the key, so
/// a retry runs the work again, and the caller gets it as `Executed(Err(e))`. Errors are
/// usually transient, and a stored one would be replayed for the whole retention. The error
/// type needs only [`Display`] (its text is the failure's message); only `Ok` values are
/// stored.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ReleaseErrors;

/// A work's `Err` is stored like a success and replayed to every retry: for deterministic
/// answers such as a declined payment or an invalid request. The error type is stored, so it
/// is `Serialize + DeserializeOwned`.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct StoreErrors;

impl sealed::Sealed for ReleaseErrors {}
impl sealed::Sealed for StoreErrors {}

impl ErrorMode for ReleaseErrors {
    const STORES_ERRORS: bool = false;
}

impl ErrorMode for StoreErrors {
    const STORES_ERRORS: bool = true;
}

/// How an engine of mode `Self` settles and replays a work's `Result<T, E>`: what the
/// engine's paths require of the error type `E`. [`ReleaseErrors`] settles any
/// `E: Display`; [`StoreErrors`] any `E: Serialize + DeserializeOwned`.
///
/// An error type with nothing but `Display` runs on the default engine:
///
/// ```
/// # use idempotency_core::*;
/// /// Not `Serialize`: never stored.
/// #[derive(Debug)]
/// struct Declined;
///
/// impl std::fmt::Display for Declined {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("declined")
///     }
/// }
///
/// # async fn example(engine: Idempotency, key: &IdempotencyKey, scope: &Scope, fp: &Fingerprint) -> Result<(), Error> {
/// let answer = engine.run(key, scope, fp, |_ctx| async { Err::<u64, _>(Declined) }).await?;
/// // Released: a retry runs the work again.
/// assert!(matches!(answer, Answer::Executed(Err(Declined))));
/// # Ok(()) }
/// ```
///
/// and an engine that stores errors refuses it at compile time, since it would have to store
/// it:
///
/// ```compile_fail
/// # use idempotency_core::*;
/// # #[derive(Debug)]
/// # struct Declined;
/// # impl std::fmt::Display for Declined {
/// #     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
/// #         f.write_str("declined")
/// #     }
/// # }
/// # async fn example(engine: Idempotency, key: &IdempotencyKey, scope: &Scope, fp: &Fingerprint) -> Result<(), Error> {
/// let storing = engine.storing_errors();
/// let answer = storing.run(key, scope, fp, |_ctx| async { Err::<u64, _>(Declined) }).await?;
/// # Ok(()) }
/// ```
#[diagnostic::on_unimplemented(
    message = "an engine of mode `{Self}` cannot settle a work whose error type is `{E}`",
    note = "the default engine (`ReleaseErrors`) records a work's `Err` as a failure: the error type needs `Display`",
    note = "an engine built with `store_errors()` (`StoreErrors`) stores it: the error type needs `Serialize + DeserializeOwned`"
)]
pub trait ErrorOutcomes<E>: ErrorMode {
    /// What is done with `result`: the bytes stored (`{"Ok": value}` or `{"Err": error}`,
    /// as serde writes a `Result`), or the failure recorded.
    #[doc(hidden)]
    fn settling<T: Serialize>(result: &Result<T, E>) -> Settling;

    /// A stored outcome read back as the work's result.
    #[doc(hidden)]
    fn replayed<T: DeserializeOwned>(bytes: &[u8]) -> Result<Result<T, E>, serde_json::Error>;
}

/// What is done with a work's result.
#[doc(hidden)]
#[derive(Debug)]
pub enum Settling {
    /// Stored: these bytes are replayed.
    Store(Vec<u8>),
    /// Recorded as this failure, which releases the key.
    Release(Failure),
    /// To be stored, and it cannot be encoded ([`Error::Codec`]).
    Unencodable(Error),
}

impl Settling {
    pub(crate) fn stored<R: Serialize + ?Sized>(result: &R) -> Self {
        match serde_json::to_vec(result) {
            Ok(bytes) => Self::Store(bytes),
            Err(source) => Self::Unencodable(Error::Codec { source }),
        }
    }
}

impl<E: Display> ErrorOutcomes<E> for ReleaseErrors {
    fn settling<T: Serialize>(result: &Result<T, E>) -> Settling {
        match result {
            Ok(value) => Settling::stored(&Ok::<&T, ()>(value)),
            Err(e) => Settling::Release(Failure::retryable(e.to_string()).bounded()),
        }
    }

    fn replayed<T: DeserializeOwned>(bytes: &[u8]) -> Result<Result<T, E>, serde_json::Error> {
        /// A stored `Result` whose error is not decoded.
        #[derive(Deserialize)]
        enum Stored<T> {
            Ok(T),
            Err(IgnoredAny),
        }
        match serde_json::from_slice::<Stored<T>>(bytes)? {
            Stored::Ok(value) => Ok(Ok(value)),
            Stored::Err(_) => Err(serde::de::Error::custom(
                "the key's stored outcome is an error, stored by an engine that stores errors; \
                 this engine releases them: read it with one built with `store_errors()`",
            )),
        }
    }
}

impl<E: Serialize + DeserializeOwned> ErrorOutcomes<E> for StoreErrors {
    fn settling<T: Serialize>(result: &Result<T, E>) -> Settling {
        Settling::stored(result)
    }

    fn replayed<T: DeserializeOwned>(bytes: &[u8]) -> Result<Result<T, E>, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error type that is neither `Serialize` nor `Deserialize`.
    #[derive(Debug, PartialEq)]
    struct Declined(&'static str);

    impl Display for Declined {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "declined: {}", self.0)
        }
    }

    #[test]
    fn release_stores_values_as_a_result_and_releases_errors_with_their_text() {
        let Settling::Store(bytes) = ReleaseErrors::settling(&Ok::<_, Declined>(7)) else {
            panic!("an Ok is stored");
        };
        assert_eq!(bytes, br#"{"Ok":7}"#);
        let back: Result<u32, Declined> = ReleaseErrors::replayed(&bytes).unwrap();
        assert_eq!(back, Ok(7));
        match ReleaseErrors::settling(&Err::<u32, _>(Declined("card"))) {
            Settling::Release(failure) => {
                assert!(failure.retryable);
                assert_eq!(failure.message, "declined: card");
            }
            other => panic!("an Err is released, not {other:?}"),
        }
    }

    #[test]
    fn release_reads_a_stored_error_as_an_outcome_that_does_not_fit() {
        let stored = serde_json::to_vec(&Err::<u32, String>("declined".into())).unwrap();
        let e = <ReleaseErrors as ErrorOutcomes<Declined>>::replayed::<u32>(&stored).unwrap_err();
        assert!(e.is_data(), "{e}");
        assert!(e.to_string().contains("store_errors()"), "{e}");
    }

    #[test]
    fn store_keeps_errors_in_the_same_format_release_reads_values_from() {
        let Settling::Store(bytes) = StoreErrors::settling(&Err::<u32, String>("no".into())) else {
            panic!("an Err is stored");
        };
        assert_eq!(bytes, br#"{"Err":"no"}"#);
        let back: Result<u32, String> = StoreErrors::replayed(&bytes).unwrap();
        assert_eq!(back, Err("no".to_string()));
        // A value stored by either mode reads back in the other.
        let Settling::Store(ok) = StoreErrors::settling(&Ok::<u32, String>(3)) else {
            panic!("an Ok is stored");
        };
        let read: Result<u32, Declined> = ReleaseErrors::replayed(&ok).unwrap();
        assert_eq!(read, Ok(3));
    }
}
