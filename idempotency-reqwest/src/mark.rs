//! How a caller marks a request as one idempotent operation.

use idempotency_core::IdempotencyKey;

/// Marks a request as an idempotent operation: the middleware sends it with a key and retries
/// it where that is safe. Put it in the request's extensions (or use
/// [`IdempotentRequestExt`]); requests without it pass through the middleware untouched.
///
/// ```
/// use idempotency_reqwest::{IdempotencyKey, Idempotent};
///
/// // A fresh key (UUID v4), minted once when the request is sent and reused on every retry.
/// let fresh = Idempotent::new();
/// assert!(fresh.key().is_none());
///
/// // A key the caller chose or derived, for example from a queue message's id.
/// let derived = Idempotent::with_key(IdempotencyKey::derive("billing-consumer", "msg-7"));
/// assert_eq!(derived.key(), Some(&IdempotencyKey::derive("billing-consumer", "msg-7")));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Idempotent {
    key: Option<IdempotencyKey>,
}

impl Idempotent {
    /// An operation whose key the middleware mints (a UUID v4), unless the request already has
    /// an `Idempotency-Key` header, which is then used as it is. The minted key is kept for the
    /// request it was minted for: extensions marked with `Idempotent::new()` and reused for
    /// several different requests give each its own key.
    pub fn new() -> Self {
        Self { key: None }
    }

    /// An operation sent with `key`.
    pub fn with_key(key: IdempotencyKey) -> Self {
        Self { key: Some(key) }
    }

    /// The key chosen by the caller, if any.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }
}

/// Marks a `reqwest_middleware` request as idempotent.
///
/// ```
/// use idempotency_reqwest::{IdempotencyKey, IdempotencyMiddleware, IdempotentRequestExt};
///
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::new())
///     .build();
/// let create = client
///     .post("http://127.0.0.1:8080/payments")
///     .json(&serde_json::json!({"amount": 500}))
///     .idempotent();
/// let redelivered = client
///     .post("http://127.0.0.1:8080/payments")
///     .idempotency_key(IdempotencyKey::derive("payments-consumer", "message-41"));
/// # let _ = (create, redelivered);
/// ```
pub trait IdempotentRequestExt: Sized {
    /// Marks the request idempotent with a key the middleware mints (see [`Idempotent::new`]).
    /// A key already given with [`idempotency_key`](Self::idempotency_key) is kept.
    fn idempotent(self) -> Self;

    /// Marks the request idempotent with `key`.
    fn idempotency_key(self, key: IdempotencyKey) -> Self;
}

impl IdempotentRequestExt for reqwest_middleware::RequestBuilder {
    fn idempotent(mut self) -> Self {
        if self.extensions().get::<Idempotent>().is_some() {
            return self;
        }
        self.with_extension(Idempotent::new())
    }

    fn idempotency_key(self, key: IdempotencyKey) -> Self {
        self.with_extension(Idempotent::with_key(key))
    }
}
