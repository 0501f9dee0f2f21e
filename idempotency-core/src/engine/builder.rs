//! [`Idempotency::builder`]: an engine built from the store it owns.

use super::Idempotency;
use crate::{Error, IdempotencyStore, InFlight, Policy, ReleaseErrors, SettleRetry, StoreErrors};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

/// Builds an [`Idempotency`] engine over the store it owns, from [`Idempotency::builder`].
///
/// Every setting starts at [`Policy::default`]; [`IdempotencyBuilder::build`] checks them
/// together ([`Policy::validate`]) and names the one that is wrong.
///
/// ```
/// use idempotency_core::{Idempotency, InFlight};
/// use std::time::Duration;
/// # fn store() -> std::sync::Arc<dyn idempotency_core::IdempotencyStore> { unimplemented!() }
/// # fn example() -> Result<(), idempotency_core::Error> {
/// let engine = Idempotency::builder(store())
///     .lease(Duration::from_secs(10))
///     .retention(Duration::from_secs(24 * 3600))
///     .in_flight(InFlight::wait(Duration::from_secs(5)))
///     .build()?;
/// assert_eq!(engine.policy().retention, Duration::from_secs(24 * 3600));
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct IdempotencyBuilder<S, M = ReleaseErrors> {
    store: S,
    policy: Policy,
    errors: PhantomData<M>,
}

impl Idempotency {
    /// Starts an engine that owns `store`: the store itself (a `PostgresStore`, say: the
    /// engine keeps its type, and with it the transactional paths), or an `Arc` of one
    /// already shared.
    pub fn builder<S: IdempotencyStore + 'static>(store: S) -> IdempotencyBuilder<S> {
        IdempotencyBuilder {
            store,
            policy: Policy::default(),
            errors: PhantomData,
        }
    }
}

impl<S: IdempotencyStore + 'static, M> IdempotencyBuilder<S, M> {
    /// How long a holder may run before another caller may take the key over. Default 30 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.policy.lease = lease;
        self
    }

    /// How long a settled key is kept, and its outcome replayed. Default 24 hours.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.policy.retention = retention;
        self
    }

    /// Stores a work's `Err` like a success and replays it to every retry, for deterministic
    /// answers (a declined payment, an invalid request): the engine's error types are then
    /// `Serialize + DeserializeOwned` ([`StoreErrors`]). Without it a work's `Err` is
    /// recorded as a retryable failure that releases the key for a retry, and an error type
    /// needs only `Display` ([`ReleaseErrors`]).
    ///
    /// ```
    /// use idempotency_core::{Answer, Fingerprint, Idempotency, IdempotencyKey, Scope};
    /// # async fn example(store: std::sync::Arc<dyn idempotency_core::IdempotencyStore>) -> Result<(), idempotency_core::Error> {
    /// #[derive(serde::Serialize, serde::Deserialize, Debug)]
    /// enum Declined { InsufficientFunds, CardExpired }
    ///
    /// let engine = Idempotency::builder(store).store_errors().build()?;
    /// let (key, scope) = (IdempotencyKey::new("charge-9")?, Scope::new("charges")?);
    /// let fp = Fingerprint::from_bytes(b"500 EUR");
    /// let charge = |_ctx| async { Err::<u64, _>(Declined::CardExpired) };
    /// assert!(matches!(
    ///     engine.run(&key, &scope, &fp, charge).await?,
    ///     Answer::Executed(Err(Declined::CardExpired))
    /// ));
    /// // A retry is answered the decline, without charging again.
    /// assert!(matches!(
    ///     engine.run(&key, &scope, &fp, charge).await?,
    ///     Answer::Replayed(Err(Declined::CardExpired))
    /// ));
    /// # Ok(()) }
    /// ```
    pub fn store_errors(self) -> IdempotencyBuilder<S, StoreErrors> {
        IdempotencyBuilder {
            store: self.store,
            policy: self.policy,
            errors: PhantomData,
        }
    }

    /// What a duplicate does while the first attempt runs. Default: answered at once as in
    /// progress.
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.policy.in_flight = in_flight;
        self
    }

    /// Extends the lease every `fraction × lease` while the work runs; `None` turns the
    /// heartbeat off. Default `Some(1/3)`.
    pub fn heartbeat(mut self, fraction: Option<f64>) -> Self {
        self.policy.heartbeat = fraction;
        self
    }

    /// The longest a work is kept leased by the heartbeat. Default 10 minutes.
    pub fn max_work_time(mut self, max: Duration) -> Self {
        self.policy.max_work_time = max;
        self
    }

    /// How a failed completion is tried again. Default: [`SettleRetry::default`].
    pub fn settle_retry(mut self, retry: SettleRetry) -> Self {
        self.policy.settle_retry = retry;
        self
    }

    /// Whether replays and duplicates are counted in the record's `hits`. Default off.
    pub fn count_hits(mut self, count: bool) -> Self {
        self.policy.count_hits = count;
        self
    }

    /// Whether keys are logged as a short hash instead of in clear. Default off.
    pub fn hash_keys_in_logs(mut self, hash: bool) -> Self {
        self.policy.hash_keys_in_logs = hash;
        self
    }

    /// Replaces every setting with `policy`'s (for a policy shared between engines).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The engine, or [`Error::Config`] naming the setting that is out of range.
    pub fn build(self) -> Result<Idempotency<S, M>, Error> {
        self.policy.validate()?;
        let owned = Arc::new(self.store);
        Ok(Idempotency {
            store: owned.clone(),
            owned,
            policy: Arc::new(self.policy),
            errors: PhantomData,
        })
    }
}
