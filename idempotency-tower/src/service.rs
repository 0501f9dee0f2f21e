//! The service: read the key, fingerprint, claim, run or replay, store.

use crate::claim::{ClaimedKey, Settlement};
use crate::layer::Config;
use crate::problem::Refusal;
use crate::stored::StoredResponse;
use crate::{read_key, RequestBody, ResponseBody};
use bytes::Bytes;
use futures::FutureExt;
use http::{header, HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use idempotency_core::{
    loggable_key, Begin, Error, Failure, Fingerprint, Lease, RecordId, Scope, ScopeError,
};
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_service::Service;
use tracing::Instrument;

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: http::HeaderName =
    http::HeaderName::from_static("idempotent-replayed");

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service built by [`crate::IdempotencyLayer`].
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }
}

/// What the layer did with a request, recorded on the `idempotency.http` span (field
/// `http_decision`) and counted in `idempotency_http_requests_total{decision}`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum HttpDecision {
    /// Not covered, or no key and not required: passed through untouched.
    PassThrough,
    /// Refused before the store was asked (bad key, missing key, body too large…).
    Refused,
    /// The key was claimed and the handler ran.
    Executed,
    /// The stored response was replayed.
    Replayed,
    /// The key was used with a different request.
    Mismatch,
    /// Another request with the key is running.
    InProgress,
    /// The store failed and the layer answered 503.
    StoreUnavailable,
    /// The store failed and the handler ran unprotected (fail-open).
    FailOpen,
    /// The stored response could not be decoded.
    Unreadable,
}

impl HttpDecision {
    /// The label used in spans and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::PassThrough => "pass_through",
            Self::Refused => "refused",
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::Mismatch => "mismatch",
            Self::InProgress => "in_progress",
            Self::StoreUnavailable => "store_unavailable",
            Self::FailOpen => "fail_open",
            Self::Unreadable => "stored_response_unreadable",
        }
    }
}

fn record(decision: HttpDecision) {
    tracing::Span::current().record("http_decision", decision.as_str());
    tracing::debug!(
        http_decision = decision.as_str(),
        "idempotency http decision"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_http_requests_total", "decision" => decision.as_str())
        .increment(1);
}

fn record_outcome(outcome: &'static str) {
    tracing::Span::current().record("outcome", outcome);
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_http_outcomes_total", "outcome" => outcome).increment(1);
}

type Answer<B> = Response<ResponseBody<B>>;

impl<S, ReqB, ResB> Service<Request<ReqB>> for IdempotencyService<S>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Answer<ResB>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // Take the service that was polled ready; leave a fresh clone in its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        if !config.covers(req.method()) {
            return Box::pin(pass_through(inner, req));
        }
        let span = tracing::info_span!(
            "idempotency.http",
            method = %req.method(),
            route = tracing::field::Empty,
            key = tracing::field::Empty,
            // The engine records its own decision (claim, replay, mismatch…) here.
            decision = tracing::field::Empty,
            http_decision = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        Box::pin(handle(inner, config, req).instrument(span))
    }
}

async fn pass_through<S, ReqB, ResB>(
    mut inner: S,
    req: Request<ReqB>,
) -> Result<Answer<ResB>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
{
    let resp = inner.call(req.map(Either::Right)).await?;
    Ok(resp.map(Either::Right))
}

fn refuse<B>(config: &Config, refusal: Refusal) -> Answer<B> {
    tracing::info!(
        status = refusal.status().as_u16(),
        slug = refusal.slug(),
        "idempotency refusal"
    );
    let mut resp = config.responder.respond(&refusal);
    let retry_after = match &refusal {
        Refusal::InProgress { retry_after } => Some(*retry_after),
        // The request that took the key over is running: its outcome is the retry's answer.
        Refusal::LeaseLost => Some(std::time::Duration::from_secs(1)),
        _ => None,
    };
    if let Some(retry_after) = retry_after {
        if !resp.headers().contains_key(header::RETRY_AFTER) {
            resp.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(crate::problem::retry_after_secs(retry_after)),
            );
        }
    }
    if let Refusal::BodyTooLarge { .. } = refusal {
        // The rest of the body is left unread, so the connection cannot carry another request:
        // say so, or a client reusing it would see its next request fail.
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp.map(|b| Either::Left(Full::new(b)))
}

async fn handle<S, ReqB, ResB>(
    inner: S,
    config: Arc<Config>,
    req: Request<ReqB>,
) -> Result<Answer<ResB>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let key = match read_key(req.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if config.required => {
            record(HttpDecision::Refused);
            return Ok(refuse(&config, Refusal::KeyRequired));
        }
        Ok(None) => {
            record(HttpDecision::PassThrough);
            return pass_through(inner, req).await;
        }
        Err(e) => {
            record(HttpDecision::Refused);
            return Ok(refuse(&config, Refusal::KeyInvalid(e)));
        }
    };
    let span = tracing::Span::current();
    span.record("key", loggable_key(&key, config.hash_keys()));

    let (parts, body) = req.into_parts();
    let route = (config.route)(&parts);
    span.record("route", route.as_str());
    let Some(caller) = (config.scope)(&parts) else {
        record(HttpDecision::Refused);
        return Ok(refuse(&config, Refusal::CallerUnidentified));
    };
    let scope = match http_scope(&caller, &parts.method, &route) {
        Ok(scope) => scope,
        Err(e) => {
            record(HttpDecision::Refused);
            return Ok(refuse(&config, Refusal::ScopeInvalid(e.to_string())));
        }
    };

    let body = match buffer_request(&parts, body, config.body_limit).await {
        Ok(body) => body,
        Err(refusal) => {
            record(HttpDecision::Refused);
            return Ok(refuse(&config, refusal));
        }
    };
    let fingerprint = fingerprint(&parts, &body);
    let id = RecordId::new(scope, key);
    let req = Request::from_parts(parts, Either::Left(Full::new(body)));

    match config.engine.begin(&id, &fingerprint).await {
        Ok(Begin::Execute(lease)) => {
            record(HttpDecision::Executed);
            execute(inner, config, req, lease).await
        }
        Ok(Begin::Replay(record_)) => {
            let Some(bytes) = record_.outcome.as_deref() else {
                record(HttpDecision::Unreadable);
                tracing::error!(record = %record_.id, "completed record has no outcome");
                return Ok(refuse(
                    &config,
                    Refusal::StoredResponseUnreadable("no outcome".into()),
                ));
            };
            match StoredResponse::decode(bytes) {
                Ok(stored) => {
                    record(HttpDecision::Replayed);
                    Ok(replay(stored))
                }
                Err(e) => {
                    record(HttpDecision::Unreadable);
                    tracing::error!(error = %e, "stored response cannot be decoded");
                    Ok(refuse(
                        &config,
                        Refusal::StoredResponseUnreadable(e.to_string()),
                    ))
                }
            }
        }
        Err(Error::Mismatch) => {
            record(HttpDecision::Mismatch);
            Ok(refuse(&config, Refusal::Mismatch))
        }
        Err(Error::InProgress { retry_after }) => {
            record(HttpDecision::InProgress);
            Ok(refuse(&config, Refusal::InProgress { retry_after }))
        }
        Err(Error::FailedPermanently { .. }) => {
            record(HttpDecision::Refused);
            Ok(refuse(&config, Refusal::FailedPermanently))
        }
        Err(e @ (Error::CorruptRecord { .. } | Error::Codec { .. })) => {
            record(HttpDecision::Unreadable);
            tracing::error!(error = %e, "stored record cannot be decoded");
            Ok(refuse(
                &config,
                Refusal::StoredResponseUnreadable(e.to_string()),
            ))
        }
        Err(e) if config.fail_open => {
            record(HttpDecision::FailOpen);
            tracing::warn!(error = %e, "idempotency store failed; running the request unprotected (fail-open)");
            pass_through_buffered(inner, req).await
        }
        Err(e) => {
            record(HttpDecision::StoreUnavailable);
            tracing::error!(error = %e, "idempotency store failed; refusing the request (fail closed)");
            Ok(refuse(&config, Refusal::StoreUnavailable(e.to_string())))
        }
    }
}

async fn pass_through_buffered<S, ReqB, ResB>(
    mut inner: S,
    req: Request<RequestBody<ReqB>>,
) -> Result<Answer<ResB>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
{
    let resp = inner.call(req).await?;
    Ok(resp.map(Either::Right))
}

async fn buffer_request<B>(
    parts: &http::request::Parts,
    body: B,
    limit: usize,
) -> Result<Bytes, Refusal>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(Refusal::BodyTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(Refusal::BodyTooLarge { limit }),
        Err(e) => Err(Refusal::BodyUnreadable(e.to_string())),
    }
}

fn fingerprint(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let mut fp = Fingerprint::builder()
        .method(parts.method.as_str())
        .path(parts.uri.path());
    if let Some(query) = parts.uri.query() {
        fp = fp.query(query);
    }
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        fp = fp.content_type(&String::from_utf8_lossy(ct.as_bytes()));
    }
    fp.body(body).finish()
}

fn replay<B>(stored: StoredResponse) -> Answer<B> {
    let mut resp = Response::new(Either::Left(Full::new(stored.body)));
    *resp.status_mut() = stored.status;
    let headers = resp.headers_mut();
    for (name, value) in stored.headers {
        headers.append(name, value);
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    resp
}

/// Runs the handler on a task of its own, so that a client that disconnects (or times out)
/// does not cancel the work half-way: the outcome is still stored, and the client's retry gets
/// it instead of running the work again. The lease is extended by the engine's heartbeat while
/// the handler runs and its body is read (for at most the policy's `max_work_time`).
async fn execute<S, ReqB, ResB>(
    inner: S,
    config: Arc<Config>,
    req: Request<RequestBody<ReqB>>,
    lease: Lease,
) -> Result<Answer<ResB>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let task = tokio::spawn(
        run_and_store(inner, config.clone(), req, lease).instrument(tracing::Span::current()),
    );
    match task.await {
        Ok(result) => result,
        Err(e) => {
            // The handler panicked (its key was released) or the runtime is shutting down
            // (the dropped lease holds the key until it passes).
            tracing::error!(error = %e, "handler task failed");
            record_outcome("handler_panicked");
            Ok(refuse(&config, Refusal::HandlerFailed))
        }
    }
}

async fn release(lease: Lease, why: &'static str) {
    record_outcome(why);
    if let Err(e) = lease.fail(Failure::retryable(why)).await {
        tracing::warn!(error = %e, "could not release the key; its lease will pass");
    }
}

fn record_settlement(settlement: Settlement) {
    match settlement {
        Settlement::Open => {}
        Settlement::Committed => record_outcome("settled_by_handler"),
        Settlement::Lost => {
            record_outcome("lease_lost");
            tracing::warn!(
                "the handler's completion was fenced: its lease had passed and another request \
                 holds the key; its transaction rolled back"
            );
        }
    }
}

/// Gives `lease` back unless the handler settled the key itself (committed the completion in
/// its transaction, or found its lease lost): then the lease is settled without a write.
fn unless_settled_by_handler(claim: &ClaimedKey, lease: Lease) -> Option<Lease> {
    let settlement = claim.settlement();
    if settlement == Settlement::Open {
        return Some(lease);
    }
    lease.settled_externally();
    record_settlement(settlement);
    None
}

/// What the handler gave, read while the heartbeat runs.
enum Handled<B, E> {
    /// The handler settled the key itself (see [`ClaimedKey`]); its response is delivered as
    /// it is.
    SettledByHandler(Response<B>, Settlement),
    /// The handler's error.
    Error(E),
    /// A response that is not stored (per the status policy, streaming or too large), with
    /// why.
    Unstored(Response<B>, &'static str),
    /// A response whose body failed while being read.
    BodyFailed(BoxError),
    /// A response read whole, to store.
    Whole(http::response::Parts, Bytes),
}

async fn run_and_store<S, ReqB, ResB>(
    mut inner: S,
    config: Arc<Config>,
    mut req: Request<RequestBody<ReqB>>,
    lease: Lease,
) -> Result<Answer<ResB>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    let claim = ClaimedKey::new(
        lease.id().clone(),
        lease.token(),
        lease.ttl(),
        config.clone(),
    );
    req.extensions_mut().insert(claim.clone());
    let handled = async {
        let resp = match inner.call(req).await {
            Ok(resp) => resp,
            Err(e) => return Handled::Error(e),
        };
        let settlement = claim.settlement();
        if settlement != Settlement::Open {
            return Handled::SettledByHandler(resp, settlement);
        }
        if !(config.store_status)(resp.status()) {
            return Handled::Unstored(resp, "released_status");
        }
        match resp.body().size_hint().exact() {
            None => return Handled::Unstored(resp, "released_streaming"),
            Some(n) if n > config.response_limit as u64 => {
                return Handled::Unstored(resp, "released_too_large")
            }
            Some(_) => {}
        }
        let (parts, body) = resp.into_parts();
        match Limited::new(body, config.response_limit).collect().await {
            Ok(collected) => Handled::Whole(parts, collected.to_bytes()),
            Err(e) => Handled::BodyFailed(e),
        }
    };
    let handled = match lease
        .with_heartbeat(AssertUnwindSafe(handled).catch_unwind())
        .await
    {
        Ok(handled) => handled,
        Err(panic) => {
            // A panic counts as a failed attempt: release the key, then let the task panic.
            // A key the handler settled in its own transaction stays as it committed.
            if let Some(lease) = unless_settled_by_handler(&claim, lease) {
                release(lease, "handler_panicked").await;
            }
            std::panic::resume_unwind(panic);
        }
    };
    let (parts, body) = match handled {
        Handled::Error(e) => {
            if let Some(lease) = unless_settled_by_handler(&claim, lease) {
                release(lease, "handler_error").await;
            }
            return Err(e);
        }
        Handled::SettledByHandler(resp, settlement) => {
            // The handler's transaction committed the completion (whatever it answers now is
            // its answer, and every retry replays what was committed), or its completion was
            // fenced and it rolled back.
            lease.settled_externally();
            record_settlement(settlement);
            return Ok(match settlement {
                Settlement::Lost => refuse(&config, Refusal::LeaseLost),
                _ => resp.map(Either::Right),
            });
        }
        Handled::Unstored(resp, why) => {
            release(lease, why).await;
            return Ok(resp.map(Either::Right));
        }
        Handled::BodyFailed(e) => {
            tracing::error!(error = %e, "the handler's response body failed");
            release(lease, "response_body_failed").await;
            return Ok(refuse(&config, Refusal::HandlerFailed));
        }
        Handled::Whole(parts, body) => (parts, body),
    };
    let stored = StoredResponse {
        status: parts.status,
        headers: parts
            .headers
            .iter()
            .filter(|(name, _)| config.replays(name))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect(),
        body: body.clone(),
    };
    match lease.complete(&stored.encode()).await {
        Ok(()) => record_outcome("stored"),
        Err(e) => {
            // The work ran; its response is delivered. The engine retried the write and left
            // the key Pending: a retry is told 409 until the lease passes (then it runs
            // again), never given the key at once.
            record_outcome("store_failed");
            tracing::error!(error = %e, "could not store the response");
        }
    }
    Ok(Response::from_parts(parts, Either::Left(Full::new(body))))
}

/// The scope the layer gives a request: the caller (from the scope function), the method and
/// the route, joined unambiguously. Public so that tools can address the layer's records in the
/// store.
pub fn http_scope(caller: &str, method: &http::Method, route: &str) -> Result<Scope, ScopeError> {
    Scope::from_parts([caller, method.as_str(), route])
}
