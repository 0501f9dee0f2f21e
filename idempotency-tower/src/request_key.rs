//! The key, caller and fingerprint the layer read, handed to a handler that claims the key
//! itself (a multi-step operation, or work in its own transaction).

use crate::problem::Refusal;
use idempotency_core::{Answer, Error, Fingerprint, IdempotencyKey, RecordId, Scope};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What the layer read from a request, handed to a handler on a route where the handler
/// claims the key itself ([`IdempotencyLayer::handler_claims`](crate::IdempotencyLayer::handler_claims)).
/// With the `axum` feature it is an extractor.
///
/// The layer has parsed the `Idempotency-Key` (both forms), identified the caller, built the
/// scope and the fingerprint from the buffered request, and refused what it must (no key, a
/// malformed one, no caller, a body over the limit) before the handler runs. It does not claim
/// the key: the handler runs its operation under [`RequestKey::key`], [`RequestKey::scope`] and
/// [`RequestKey::fingerprint`], typically `run_phases` or `run_in_transaction`, and passes
/// the call to [`RequestKey::run`]. The layer then adds its replay header to a replayed answer,
/// writes a refusal as its own problem document (with `Retry-After` or `WWW-Authenticate`),
/// and keeps running the handler to its end if the client disconnects.
///
/// ```
/// # #[cfg(feature = "axum")]
/// # mod example {
/// use axum::{http::StatusCode, routing::post, Json, Router};
/// use idempotency_core::Idempotency;
/// use idempotency_memory::MemoryStore;
/// use idempotency_tower::{IdempotencyLayer, Refusal, RequestKey};
///
/// async fn create(
///     axum::extract::State(engine): axum::extract::State<Idempotency<MemoryStore>>,
///     request: RequestKey,
///     Json(amount): Json<u64>,
/// ) -> Result<(StatusCode, Json<u64>), Refusal> {
///     let ran = engine.run(request.key(), request.scope(), request.fingerprint(), |_| async move {
///         Ok::<_, String>(amount * 100)
///     });
///     // `Replayed` answers carry the layer's replay header; refusals are its problem documents.
///     match request.run(ran).await? {
///         Ok(cents) => Ok((StatusCode::CREATED, Json(cents))),
///         Err(_) => Err(Refusal::HandlerFailed),
///     }
/// }
///
/// pub fn app() -> Router {
///     let engine = Idempotency::builder(MemoryStore::new()).build().expect("engine");
///     // The caller: the tenant an authentication layer established (here, one for all).
///     let layer = IdempotencyLayer::per_caller(engine.clone(), |_parts| Some("tenant-1".to_owned()))
///         .handler_claims();
///     Router::new()
///         .route("/amounts", post(create))
///         .route_layer(layer)
///         .with_state(engine)
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RequestKey {
    id: RecordId,
    fingerprint: Fingerprint,
    replayed: Arc<AtomicBool>,
}

impl RequestKey {
    pub(crate) fn new(id: RecordId, fingerprint: Fingerprint) -> Self {
        Self {
            id,
            fingerprint,
            replayed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The request's `Idempotency-Key`.
    pub fn key(&self) -> &IdempotencyKey {
        &self.id.key
    }

    /// The scope the layer built: the caller, the method and the route part.
    pub fn scope(&self) -> &Scope {
        &self.id.scope
    }

    /// The record's identity: the scope and the key.
    pub fn id(&self) -> &RecordId {
        &self.id
    }

    /// The request's fingerprint, as the layer computes it for every route (method, path,
    /// query, the fingerprinted headers, the body).
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// Awaits the engine's answer for this request and turns it into the handler's: the value
    /// when the operation ran now or was replayed (the layer marks a replayed answer with its
    /// replay header), or the layer's refusal: in progress (409 with `Retry-After`), key
    /// reused (422), failed permanently, outcome lost, or the store's error (503).
    pub async fn run<T>(
        &self,
        operation: impl Future<Output = Result<Answer<T>, Error>>,
    ) -> Result<T, Refusal> {
        match operation.await {
            Ok(Answer::Executed(value)) => Ok(value),
            Ok(Answer::Replayed(value)) => {
                self.replayed.store(true, Ordering::Relaxed);
                Ok(value)
            }
            Ok(Answer::Refused(refusal)) => Err(Refusal::from(refusal)),
            Err(e) => {
                tracing::error!(error = %e, "the handler's idempotent operation failed");
                Err(Refusal::from(&e))
            }
        }
    }

    /// Whether [`RequestKey::run`] answered with a replay.
    pub fn replayed(&self) -> bool {
        self.replayed.load(Ordering::Relaxed)
    }
}

#[cfg(feature = "axum")]
mod extract {
    use super::RequestKey;
    use crate::problem::{ProblemJson, Refusal, RefusalResponder};
    use axum::extract::FromRequestParts;
    use axum::response::{IntoResponse, Response};
    use http::request::Parts;

    /// The rejection of the [`RequestKey`] extractor: the layer did not hand this request
    /// over (the route is not behind a layer with
    /// [`handler_claims`](crate::IdempotencyLayer::handler_claims), the method is not
    /// covered, or the request had no key and the layer does not require one). Answers 500:
    /// it is a wiring mistake, not the client's.
    #[derive(Debug, Clone, Copy, thiserror::Error)]
    #[error("the idempotency layer did not hand this request's key over: is the route behind a layer with handler_claims()?")]
    pub struct NoRequestKey;

    impl IntoResponse for NoRequestKey {
        fn into_response(self) -> Response {
            tracing::error!("{self}");
            ProblemJson::default()
                .respond(&Refusal::HandlerFailed)
                .map(axum::body::Body::from)
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for RequestKey {
        type Rejection = NoRequestKey;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, NoRequestKey> {
            parts
                .extensions
                .get::<RequestKey>()
                .cloned()
                .ok_or(NoRequestKey)
        }
    }
}

#[cfg(feature = "axum")]
pub use extract::NoRequestKey;
