//! The claim a covered request holds on its key, for handlers that complete the key inside
//! their own database transaction (exactly-once effects through the layer).

use crate::config::Config;
use crate::problem::{ProblemJson, Refusal};
use bytes::Bytes;
use futures::future::BoxFuture;
use http::Response;
use idempotency_core::protocol::Lease;
use idempotency_core::transaction::{SharedClaim, TransactionEnd};
use idempotency_core::{Error, FencingToken, RecordId, TransactionalStore, WorkContext};
use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// What the handler did with its claim, as the layer reads it once the handler returns.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Settlement {
    /// The handler did not settle the key: the layer stores its response (or releases the key)
    /// as for any handler.
    Open,
    /// The handler committed the completion in its own transaction: the layer writes nothing.
    Committed,
    /// The handler's completion was fenced (the lease had passed and another request took the
    /// key over); its transaction rolled back. The layer answers a lease-lost problem.
    Lost,
    /// The handler's transaction rolled back before it completed the key, and it did nothing
    /// else: the layer releases the key at once and delivers its answer unstored.
    RolledBack,
    /// The handler's commit was sent and its outcome is unknown: the layer holds the key until
    /// its lease passes and delivers the answer unstored.
    Held,
}

struct Shared {
    claim: SharedClaim,
    id: RecordId,
    token: FencingToken,
    ttl: Duration,
    config: Arc<Config>,
    settlement: Mutex<Settlement>,
}

impl Shared {
    fn set(&self, to: Settlement) {
        *self
            .settlement
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = to;
    }
}

/// The request's claim on its idempotency key, put in the request extensions by the layer for
/// every request that runs the handler (with the `axum` feature it is also an extractor).
///
/// Most handlers ignore it: the layer stores their response after they return. A handler whose
/// effect is a write to the same SQL database as the idempotency records uses it to make the
/// write and the completion **one transaction**, so that a crash between the two cannot let a
/// retry run the write again. [`ClaimedKey::run_in_transaction`] does it in one call; by hand,
/// the steps are:
///
/// 1. build the response it will answer with, and [`ClaimedKey::prepare`] it: the bytes the
///    layer would store (status, the allowlisted headers and the body);
/// 2. in its transaction, write its rows and the completion compare-and-swap with
///    [`Prepared::outcome`] (`SqliteStore::complete_in` or `PostgresStore::complete_in`, with
///    [`ClaimedKey::id`], [`ClaimedKey::token`] and [`ClaimedKey::retention`]), then commit;
/// 3. answer [`Prepared::committed`]. The layer then writes nothing more, and every retry
///    replays what was committed, even if the handler ends up answering something else (a
///    5xx after the commit is replayed, never re-run).
///
/// If the completion is fenced (the lease passed while the handler stalled and a retry took
/// the key over), the handler drops its transaction, which rolls its writes back, and calls
/// [`ClaimedKey::lease_lost`]: the layer then answers `409` `idempotency-key-lease-lost` and the
/// client's retry gets the newer request's outcome.
///
/// ```
/// use http::{Response, StatusCode};
/// use idempotency_tower::ClaimedKey;
///
/// /// The business transaction: a row and the completion, committed together.
/// fn insert_and_complete(claim: &ClaimedKey, outcome: &[u8]) -> Result<(), String> {
///     // let tx = conn.transaction()?; insert the row;
///     // store.complete_in(&tx, claim.id(), claim.token(), outcome, claim.retention())?;
///     // tx.commit()?;
///     # let _ = (claim, outcome);
///     Ok(())
/// }
///
/// fn create(claim: ClaimedKey) -> Response<bytes::Bytes> {
///     let response = Response::builder()
///         .status(StatusCode::CREATED)
///         .header("content-type", "application/json")
///         .body(bytes::Bytes::from_static(br#"{"id":7}"#))
///         .unwrap();
///     let prepared = match claim.prepare(response) {
///         Ok(prepared) => prepared,
///         Err(e) => return server_error(e.to_string()),
///     };
///     match insert_and_complete(&claim, prepared.outcome()) {
///         Ok(()) => prepared.committed(),
///         Err(e) => server_error(e),
///     }
/// }
/// # fn server_error(e: String) -> Response<bytes::Bytes> {
/// #     let mut r = Response::new(bytes::Bytes::from(e));
/// #     *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
/// #     r
/// # }
/// ```
#[derive(Clone)]
pub struct ClaimedKey {
    shared: Arc<Shared>,
}

impl fmt::Debug for ClaimedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClaimedKey")
            .field("id", &self.shared.id)
            .field("token", &self.shared.token)
            .field("settlement", &self.settlement())
            .finish_non_exhaustive()
    }
}

impl ClaimedKey {
    pub(crate) fn new(lease: &Lease, config: Arc<Config>) -> Self {
        Self {
            shared: Arc::new(Shared {
                claim: lease.share(),
                id: lease.id().clone(),
                token: lease.token(),
                ttl: lease.retention(),
                config,
                settlement: Mutex::new(Settlement::Open),
            }),
        }
    }

    pub(crate) fn settlement(&self) -> Settlement {
        *self
            .shared
            .settlement
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The record the request holds: its scope and key.
    pub fn id(&self) -> &RecordId {
        &self.shared.id
    }

    /// The fencing token of this request's claim.
    pub fn token(&self) -> FencingToken {
        self.shared.token
    }

    /// How long the completed record is kept (the engine's retention), for the completion.
    pub fn retention(&self) -> Duration {
        self.shared.ttl
    }

    /// The id and token together, as the engine's exactly-once paths give them to their work.
    pub fn context(&self) -> WorkContext {
        WorkContext::new(self.shared.id.clone(), self.shared.token)
    }

    /// The stored form of `response`, as the layer would store it: its status, the headers of
    /// the replay allowlist (never credentials, cookies or hop-by-hop headers) and its body.
    /// Write [`Prepared::outcome`] with the completion in your transaction, then answer
    /// [`Prepared::committed`].
    ///
    /// [`PrepareError::TooLarge`] when the body is larger than the layer's response limit: it
    /// could not be replayed.
    pub fn prepare<B: Into<Bytes>>(&self, response: Response<B>) -> Result<Prepared, PrepareError> {
        let (parts, body) = response.into_parts();
        let body: Bytes = body.into();
        let config = &self.shared.config;
        if body.len() > config.response_limit {
            return Err(PrepareError::TooLarge {
                limit: config.response_limit,
            });
        }
        let outcome = config.stored_response(&parts, body.clone()).encode();
        Ok(Prepared {
            claim: self.clone(),
            outcome,
            response: Response::from_parts(parts, body),
        })
    }

    /// Tells the layer that the handler's own transaction rolled back and it did nothing else
    /// (no call to another service, no write elsewhere): the layer releases the key at once,
    /// whatever the handler answers, and the answer is not stored, so a retry runs the
    /// handler again. Without it, the handler's answer (a 5xx, say) is stored and replayed, and
    /// a handler error settles the key for good, because the layer cannot know that nothing
    /// was done ([`crate::OnUnstored`]).
    ///
    /// Call it only when the rollback is certain: not after a `COMMIT` whose outcome is
    /// unknown (a lost connection during the commit), which may have applied.
    pub fn rolled_back(&self) {
        self.shared.set(Settlement::RolledBack);
    }

    /// Runs the handler's transaction and completes the key inside it, **in one call**: begins
    /// a transaction of `store` (the store holding the layer's records), runs `work` in it
    /// with the transaction's connection (a `PgConnection` on Postgres: the store's
    /// `TransactionalStore::Connection`), prepares the response `work` returns (the stored form [`ClaimedKey::prepare`] makes),
    /// completes the key with it inside the transaction and commits; a serialization failure or
    /// a deadlock (the store's conflicts) runs all of it again. It then settles the key with
    /// the layer itself, and returns the response to answer with:
    ///
    /// | the transaction… | the key | the answer |
    /// |---|---|---|
    /// | committed | completed with `work`'s response; retries replay it | `work`'s response |
    /// | was fenced (the lease passed, another request took the key over) | the other request's | `409` `idempotency-key-lease-lost` |
    /// | rolled back (`work`'s `Err`, a refused commit, a response over the limit) | released at once: a retry runs the handler | `500` `handler-failed` for `work`'s `Err`; `503` `idempotency-store-unavailable` for the store's |
    /// | sent its commit and lost the answer | held until its lease passes, then a retry finds it completed or runs it | `503` `idempotency-store-unavailable` |
    ///
    /// `work`'s `Err` is a database error, what `?` on a failed statement returns: its
    /// transaction rolls back. Answer a refusal of
    /// your own (a `409` business conflict, a `422` validation) as an `Ok` response: it is
    /// committed and replayed like any other.
    ///
    /// The store must be the one whose records the layer's engine keeps (a
    /// `PostgresStore`, `SqliteStore`, `MySqlStore` or `DynamoStore` over the same table).
    pub async fn run_in_transaction<S, F>(&self, store: &S, mut work: F) -> Response<Bytes>
    where
        S: TransactionalStore,
        F: for<'c> FnMut(
                &'c mut S::Connection,
            ) -> BoxFuture<'c, Result<Response<Bytes>, S::WorkError>>
            + Send,
    {
        // Whether the last attempt ended in `work`'s own error (not the store's).
        let work_failed = Arc::new(AtomicBool::new(false));
        let end = self
            .shared
            .claim
            .run_in_transaction(
                store,
                |prepared: &Prepared| prepared.outcome.clone(),
                preparing::<S, F>(self, &mut work, &work_failed),
            )
            .await;
        let answer = |refusal: Refusal| {
            let config = &self.shared.config;
            let mut resp = config.responder.respond(&refusal);
            crate::problem::add_headers(
                &mut resp,
                &refusal,
                config.unavailable_retry_after,
                &config.challenge,
            );
            resp
        };
        match end {
            TransactionEnd::Committed(prepared) => prepared.committed(),
            TransactionEnd::LeaseLost => {
                self.lease_lost();
                answer(Refusal::LeaseLost)
            }
            TransactionEnd::RolledBack(e) => {
                tracing::warn!(error = %e, "the handler's transaction rolled back; the key is released");
                self.rolled_back();
                // The handler's own statement failed: its error, not the key store's.
                if work_failed.load(Ordering::Relaxed) {
                    answer(Refusal::HandlerFailed)
                } else {
                    answer(Refusal::from(&e))
                }
            }
            TransactionEnd::Unknown(e) => {
                tracing::warn!(error = %e, "the handler's commit may or may not have applied; the key is held");
                self.shared.set(Settlement::Held);
                answer(Refusal::from(&e))
            }
            TransactionEnd::WorkFailed(never) => match never {},
            // Any end a later core adds: nothing is known to have committed; hold the key.
            _ => {
                self.shared.set(Settlement::Held);
                ProblemJson::default().response(&Refusal::HandlerFailed)
            }
        }
    }

    /// Tells the layer that the handler's completion was fenced and its transaction rolled
    /// back: the layer answers `409` `idempotency-key-lease-lost` in place of the handler's
    /// response, and writes nothing (the record belongs to the request that took it over).
    pub fn lease_lost(&self) {
        self.shared.set(Settlement::Lost);
    }
}

/// `work` as core's transaction runs it: its response prepared in the stored form (a response
/// over the limit is an error that rolls the transaction back).
#[allow(clippy::type_complexity)] // the transaction driver's higher-ranked work signature
fn preparing<'w, S, F>(
    claim: &'w ClaimedKey,
    work: &'w mut F,
    work_failed: &'w Arc<AtomicBool>,
) -> impl for<'t> FnMut(
    &'t mut S::Transaction,
    WorkContext,
) -> BoxFuture<'t, Result<Result<Prepared, Infallible>, Error>>
       + Send
       + 'w
where
    S: TransactionalStore,
    F: for<'c> FnMut(&'c mut S::Connection) -> BoxFuture<'c, Result<Response<Bytes>, S::WorkError>>
        + Send,
{
    move |transaction, _context| {
        let response = work(S::connection(transaction));
        let (claim, work_failed) = (claim.clone(), work_failed.clone());
        Box::pin(async move {
            let response = response.await.map_err(S::work_error);
            work_failed.store(response.is_err(), Ordering::Relaxed);
            let response = response?;
            claim
                .prepare(response)
                .map(Ok)
                .map_err(|e| Error::backend(false, e))
        })
    }
}

/// A marker a handler puts in its response's extensions to say that it did nothing: it
/// failed before acting (a dependency was down, a check refused the request), so a retry may
/// run it again at once. The layer then releases the key and delivers the response unstored,
/// whatever its status.
///
/// Without it, every response is stored and replayed, a 5xx as a 201 (and a status a custom
/// [`store_status`](crate::IdempotencyLayer::store_status) rule leaves out settles the key per
/// [`crate::OnUnstored`]): the handler may have acted before it failed.
///
/// ```
/// use http::{Response, StatusCode};
/// use idempotency_tower::NothingDone;
///
/// /// The payment provider could not be reached: nothing was charged.
/// fn provider_down() -> Response<String> {
///     let mut resp = Response::new("try again".to_owned());
///     *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
///     resp.extensions_mut().insert(NothingDone);
///     resp
/// }
/// # assert!(provider_down().extensions().get::<NothingDone>().is_some());
/// ```
///
/// With axum, return `(StatusCode::SERVICE_UNAVAILABLE, Extension(NothingDone), body)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NothingDone;

/// A response ready to be committed with the handler's transaction; see [`ClaimedKey`].
#[derive(Debug)]
pub struct Prepared {
    claim: ClaimedKey,
    outcome: Vec<u8>,
    response: Response<Bytes>,
}

impl Prepared {
    /// The bytes to write with the completion, in the handler's transaction.
    pub fn outcome(&self) -> &[u8] {
        &self.outcome
    }

    /// Tells the layer the completion committed, and gives back the response to answer with.
    /// Call it only after the commit succeeded.
    pub fn committed(self) -> Response<Bytes> {
        self.claim.shared.set(Settlement::Committed);
        self.response
    }
}

/// Why a response cannot be prepared for a transactional completion.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// The body is larger than the layer's response limit, so it could not be replayed.
    #[error("the response body is larger than the {limit}-byte response limit, so it cannot be replayed")]
    TooLarge {
        /// The limit in bytes.
        limit: usize,
    },
}

#[cfg(feature = "axum")]
mod extract {
    use super::ClaimedKey;
    use crate::problem::{ProblemJson, Refusal, RefusalResponder};
    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum::response::{IntoResponse, Response};
    use http::request::Parts;

    /// The rejection of the [`ClaimedKey`] extractor: the request did not run under the
    /// layer's claim (the route is not behind the layer, the method is not covered, or the
    /// request had no key and the layer does not require one). Answers 500: it is a wiring
    /// mistake, not the client's. Extract `Option<ClaimedKey>` for routes where a key is
    /// optional.
    #[derive(Debug, Clone, Copy, thiserror::Error)]
    #[error("the request holds no idempotency claim: is the route behind the idempotency layer?")]
    pub struct NoClaim;

    impl IntoResponse for NoClaim {
        fn into_response(self) -> Response {
            tracing::error!("{self}");
            ProblemJson::default()
                .respond(&Refusal::HandlerFailed)
                .map(axum::body::Body::from)
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for ClaimedKey {
        type Rejection = NoClaim;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, NoClaim> {
            parts.extensions.get::<ClaimedKey>().cloned().ok_or(NoClaim)
        }
    }

    /// `Option<ClaimedKey>`: `None` where the request runs without a claim (no key on a route
    /// where the key is optional).
    impl<S: Send + Sync> OptionalFromRequestParts<S> for ClaimedKey {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<ClaimedKey>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
pub use extract::NoClaim;
