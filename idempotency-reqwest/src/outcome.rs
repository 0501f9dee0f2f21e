//! What the caller learns about an idempotent operation that got its answer.

use idempotency_core::IdempotencyKey;

/// How an idempotent operation went, on its response: the key, the attempts, and whether the
/// server replayed a stored outcome (`Idempotent-Replayed: true`) rather than running the
/// operation for this attempt. Read it with [`IdempotentResponseExt::idempotency`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyOutcome {
    pub(crate) key: IdempotencyKey,
    pub(crate) attempts: u32,
    pub(crate) replayed: bool,
}

impl IdempotencyOutcome {
    /// The key every attempt was sent with: log it, or store it with the operation.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// How many attempts were made, this answer's included (1 when the first one answered).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the answer is a replay of an earlier attempt's outcome. An earlier attempt ran
    /// the operation (its answer was lost, or it was still running when a retry arrived);
    /// this one did not run it again.
    pub fn replayed(&self) -> bool {
        self.replayed
    }
}

/// Reads the [`IdempotencyOutcome`] the middleware puts on a response.
///
/// ```no_run
/// # async fn demo(client: reqwest_middleware::ClientWithMiddleware) -> Result<(), reqwest_middleware::Error> {
/// use idempotency_reqwest::{IdempotentRequestExt, IdempotentResponseExt};
///
/// let response = client.post("http://127.0.0.1:8080/payments").idempotent().send().await?;
/// if let Some(outcome) = response.idempotency() {
///     println!("key {} after {} attempts, replayed: {}", outcome.key(), outcome.attempts(), outcome.replayed());
/// }
/// # Ok(()) }
/// ```
pub trait IdempotentResponseExt {
    /// The outcome, on a response to a request marked idempotent.
    fn idempotency(&self) -> Option<&IdempotencyOutcome>;

    /// Whether the response is a replay (false for requests not marked idempotent).
    fn was_replayed(&self) -> bool {
        self.idempotency().is_some_and(IdempotencyOutcome::replayed)
    }
}

impl IdempotentResponseExt for reqwest::Response {
    fn idempotency(&self) -> Option<&IdempotencyOutcome> {
        self.extensions().get::<IdempotencyOutcome>()
    }
}
