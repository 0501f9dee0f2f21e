//! The service: read the key, fingerprint, claim, run or replay, store.

use crate::claim::{ClaimedKey, NothingDone, Settlement};
use crate::config::{Config, OnUnreplayable, OnUnstored};
use crate::detach::Detachable;
use crate::fingerprint::FingerprintInput;
use crate::future::ResponseFuture;
use crate::headers::{CONNECTION, CONTENT_LENGTH, DIGEST};
use crate::hooks::ResponseContext;
use crate::observe::{record_decision, record_outcome, HttpDecision, HttpOutcome};
use crate::problem::Refusal;
use crate::request_key::RequestKey;
use crate::stored::{NotReplayable, StoredResponse};
use crate::{read_key_header, KeyHeaderError, RequestBody, ResponseBody};
use bytes::Bytes;
use futures::FutureExt;
use http::{HeaderName, HeaderValue, Request, Response, Version};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotency_core::protocol::{Begin, Lease};
use idempotency_core::store::Failure;
use idempotency_core::Refusal as EngineRefusal;
use idempotency_core::{
    loggable_key, Error, Fingerprint, IdempotencyKey, RecordId, Scope, ScopeError,
};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tower_service::Service;
use tracing::Instrument;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service built by [`IdempotencyLayer`](crate::IdempotencyLayer): a covered request with a key runs the wrapped
/// service once, and its retries get the stored response (or a refusal); other requests pass
/// through to the wrapped service untouched.
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

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, taking the layer away.
    pub fn into_inner(self) -> S {
        self.inner
    }
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
    type Future = ResponseFuture<ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // Take the service that was polled ready; leave a fresh clone in its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        if !config.covers(req.method()) {
            return ResponseFuture::new(pass_through(inner, req));
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
        ResponseFuture::new(handle(inner, config, req).instrument(span))
    }
}

async fn pass_through<S, ReqB, ResB>(
    mut inner: S,
    req: Request<ReqB>,
) -> Result<Answer<ResB>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
{
    let resp = inner.call(req.map(RequestBody::passed)).await?;
    Ok(resp.map(ResponseBody::inner))
}

fn refuse<B>(config: &Config, refusal: Refusal) -> Answer<B> {
    tracing::info!(
        status = refusal.status().as_u16(),
        slug = refusal.slug(),
        "idempotency refusal"
    );
    let mut resp = config.responder.respond(&refusal);
    crate::problem::add_headers(
        &mut resp,
        &refusal,
        config.unavailable_retry_after,
        &config.challenge,
    );
    resp.map(ResponseBody::full)
}

/// The `413` for a body over the limit. The rest of the body is left unread, so an HTTP/1.x
/// connection cannot carry another request: say so, or a client reusing it would see its next
/// request fail. HTTP/2 streams are independent (and forbid `Connection`).
fn refuse_body<B>(config: &Config, refusal: Refusal, version: Version) -> Answer<B> {
    let too_large = matches!(refusal, Refusal::BodyTooLarge { .. });
    let mut resp = refuse(config, refusal);
    if too_large && version < Version::HTTP_2 {
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// The key from the configured header, checked by the API's validator.
fn read_request_key(
    config: &Config,
    headers: &http::HeaderMap,
) -> Result<Option<IdempotencyKey>, KeyHeaderError> {
    let key = read_key_header(headers, &config.key_header)?;
    if let (Some(key), Some(validate)) = (&key, &config.key_validator) {
        validate(key).map_err(|reason| KeyHeaderError::Rejected { reason })?;
    }
    Ok(key)
}

/// `Retry-After` for a 409: what was left of the other attempt's lease when the engine looked,
/// less the time spent since (a wait under `InFlight::wait`), capped.
fn in_progress_retry_after(config: &Config, retry_after: Duration, began: Instant) -> Duration {
    retry_after
        .saturating_sub(began.elapsed())
        .min(config.max_retry_after)
}

fn system_time(t: idempotency_core::store::Timestamp) -> Option<SystemTime> {
    let ms = u64::try_from(t.as_millis()).ok()?;
    UNIX_EPOCH.checked_add(Duration::from_millis(ms))
}

/// Lets the API's response hook add its headers.
fn with_hook<B>(
    config: &Config,
    key: &IdempotencyKey,
    mut resp: Answer<B>,
    outcome: Option<HttpOutcome>,
    expires_at: Option<SystemTime>,
) -> Answer<B> {
    if let Some(hook) = &config.response_hook {
        let ctx = ResponseContext {
            key,
            status: resp.status(),
            outcome,
            expires_at,
        };
        hook(&ctx, resp.headers_mut());
    }
    resp
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
    let key = match read_request_key(&config, req.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if config.required => {
            record_decision(HttpDecision::Refused);
            return Ok(refuse(&config, Refusal::KeyRequired));
        }
        Ok(None) => {
            record_decision(HttpDecision::PassThrough);
            return pass_through(inner, req).await;
        }
        Err(e) => {
            record_decision(HttpDecision::Refused);
            return Ok(refuse(&config, Refusal::KeyInvalid(e)));
        }
    };
    let span = tracing::Span::current();
    // The key is hashed for the logs only when a subscriber takes the span.
    if !span.is_disabled() {
        span.record("key", loggable_key(&key, config.hash_keys()));
    }

    let (parts, body) = req.into_parts();
    let route = (config.route)(&parts);
    span.record("route", route.as_str());
    let Some(caller) = (config.scope)(&parts) else {
        record_decision(HttpDecision::Refused);
        return Ok(refuse(&config, Refusal::CallerUnidentified));
    };
    let scope = match http_scope(&caller, &parts.method, &route) {
        Ok(scope) => scope,
        Err(e) => {
            record_decision(HttpDecision::Refused);
            return Ok(refuse(&config, Refusal::ScopeInvalid(e.to_string())));
        }
    };

    let body = match buffer_request(&parts, body, config.body_limit).await {
        Ok(body) => body,
        Err(refusal) => {
            record_decision(HttpDecision::Refused);
            return Ok(refuse_body(&config, refusal, parts.version));
        }
    };
    let fingerprint = fingerprint(&config, &parts, &body);
    let id = RecordId::new(key, scope);
    let mut req = Request::from_parts(parts, RequestBody::buffered(body));
    if config.handler_claims {
        let handed = RequestKey::new(id, fingerprint);
        req.extensions_mut().insert(handed.clone());
        return hand_over(inner, config, req, handed).await;
    }

    let began = Instant::now();
    match config.engine.begin(&id, &fingerprint).await {
        Ok(Begin::Execute(lease)) => {
            record_decision(HttpDecision::Executed);
            execute(inner, config, req, lease).await
        }
        Ok(Begin::Replay(record)) => {
            let Some(bytes) = record.outcome.as_deref() else {
                record_decision(HttpDecision::Unreadable);
                tracing::error!(
                    record = %format_args!(
                        "{}#{}",
                        record.id.scope,
                        loggable_key(&record.id.key, config.hash_keys())
                    ),
                    "completed record has no outcome"
                );
                return Ok(refuse(
                    &config,
                    Refusal::StoredResponseUnreadable("no outcome".into()),
                ));
            };
            match StoredResponse::decode(bytes) {
                Ok(stored) => {
                    record_decision(HttpDecision::Replayed);
                    let resp = replay(&config, stored);
                    let expires_at = system_time(record.expires_at);
                    Ok(with_hook(&config, &id.key, resp, None, expires_at))
                }
                Err(e) => {
                    record_decision(HttpDecision::Unreadable);
                    tracing::error!(error = %e, "stored response cannot be decoded");
                    Ok(refuse(
                        &config,
                        Refusal::StoredResponseUnreadable(e.to_string()),
                    ))
                }
            }
        }
        Ok(Begin::Refused(refusal)) => match refusal {
            EngineRefusal::InProgress { retry_after } => {
                record_decision(HttpDecision::InProgress);
                let retry_after = in_progress_retry_after(&config, retry_after, began);
                Ok(refuse(&config, Refusal::InProgress { retry_after }))
            }
            EngineRefusal::KeyReused => {
                record_decision(HttpDecision::KeyReused);
                Ok(refuse(&config, Refusal::KeyReused))
            }
            EngineRefusal::OutcomeLost { .. } => {
                record_decision(HttpDecision::Refused);
                Ok(refuse(&config, Refusal::OutcomeLost))
            }
            // A permanent failure, and any refusal a later engine adds: not run again.
            _ => {
                record_decision(HttpDecision::Refused);
                Ok(refuse(&config, Refusal::FailedPermanently))
            }
        },
        Err(
            e @ (Error::CorruptRecord { .. } | Error::Codec { .. } | Error::StoredOutcome { .. }),
        ) => {
            record_decision(HttpDecision::Unreadable);
            tracing::error!(error = %e, "stored record cannot be decoded");
            Ok(refuse(
                &config,
                Refusal::StoredResponseUnreadable(e.to_string()),
            ))
        }
        Err(e) if config.fail_open => {
            record_decision(HttpDecision::FailOpen);
            tracing::warn!(error = %e, "idempotency store failed; running the request unprotected (fail-open)");
            pass_through_buffered(inner, req).await
        }
        Err(e) => {
            record_decision(HttpDecision::StoreUnavailable);
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
    Ok(resp.map(ResponseBody::inner))
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
        .get(CONTENT_LENGTH)
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

fn fingerprint(config: &Config, parts: &http::request::Parts, body: &Bytes) -> Fingerprint {
    let input = FingerprintInput {
        parts,
        body,
        headers: &config.fingerprint_headers,
    };
    match &config.fingerprint_hook {
        Some(hook) => hook(&input),
        None => input.default_fingerprint(),
    }
}

/// A stored record as the answer: the response, or the not-replayable answer; marked.
fn replay<B>(config: &Config, stored: StoredResponse) -> Answer<B> {
    let mut resp = match stored.not_replayable {
        Some(reason) => not_replayable(config, &stored, reason),
        None => {
            let mut resp = Response::new(ResponseBody::full(stored.body));
            *resp.status_mut() = stored.status;
            let headers = resp.headers_mut();
            for (name, value) in stored.headers {
                headers.append(name, value);
            }
            resp
        }
    };
    if let Some((name, value)) = &config.replayed_marker {
        resp.headers_mut().insert(name.clone(), value.clone());
    }
    resp
}

/// Headers that describe the body they came with, so they are not sent with a problem
/// document in its place.
fn describes_body(name: &HeaderName) -> bool {
    name.as_str().starts_with("content-") || name == DIGEST
}

/// The answer for a handler that ran but whose response was not kept: the responder's
/// [`Refusal::NotReplayable`] document with the handler's status and its stored headers
/// (`Location`, `ETag`…), less those that described the original body.
fn not_replayable<B>(config: &Config, stored: &StoredResponse, reason: NotReplayable) -> Answer<B> {
    let mut resp = config.responder.respond(&Refusal::NotReplayable {
        status: stored.status,
        reason,
    });
    *resp.status_mut() = stored.status;
    let set_by_responder: Vec<HeaderName> = resp.headers().keys().cloned().collect();
    for (name, value) in &stored.headers {
        if !describes_body(name) && !set_by_responder.contains(name) {
            resp.headers_mut().append(name.clone(), value.clone());
        }
    }
    resp.map(ResponseBody::full)
}

/// Runs the handler where the request is awaited, so that a client that disconnects (or times
/// out) does not cancel the work half-way: if the request's future is dropped before the
/// handler's answer is stored, the rest moves to a task of its own and runs to its end, and
/// the client's retry gets the stored outcome instead of running the work again. The lease is
/// extended by the engine's heartbeat while the handler runs and its body is read (for at most
/// the policy's `max_work_time`).
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
    let work =
        run_and_store(inner, config.clone(), req, lease).instrument(tracing::Span::current());
    match Detachable::new(work).await {
        Ok(result) => result,
        Err(panic) => {
            // The handler panicked: its key was settled for good as not stored, or released
            // when its transaction rolled back or the layer releases unstored answers (and left
            // as it was when the handler settled it itself).
            tracing::error!(panic = panic_message(&panic), "the handler panicked");
            record_outcome(HttpOutcome::HandlerPanicked);
            Ok(refuse(&config, Refusal::HandlerFailed))
        }
    }
}

/// Runs the handler that claims the key itself ([`RequestKey`]), where the request is
/// awaited and to its end if the client disconnects, as [`execute`] does; then marks a
/// replayed answer and writes a refusal the handler returned with the layer's responder.
async fn hand_over<S, ReqB, ResB>(
    mut inner: S,
    config: Arc<Config>,
    req: Request<RequestBody<ReqB>>,
    handed: RequestKey,
) -> Result<Answer<ResB>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let work = inner.call(req).instrument(tracing::Span::current());
    let resp = match Detachable::new(work).await {
        Ok(resp) => resp?,
        Err(panic) => {
            tracing::error!(panic = panic_message(&panic), "the handler panicked");
            record_outcome(HttpOutcome::HandlerPanicked);
            return Ok(refuse(&config, Refusal::HandlerFailed));
        }
    };
    if let Some(refusal) = resp.extensions().get::<Refusal>().cloned() {
        record_decision(match refusal {
            Refusal::InProgress { .. } => HttpDecision::InProgress,
            Refusal::KeyReused => HttpDecision::KeyReused,
            Refusal::StoreUnavailable(_) => HttpDecision::StoreUnavailable,
            _ => HttpDecision::Refused,
        });
        let refusal = match refusal {
            Refusal::InProgress { retry_after } => Refusal::InProgress {
                retry_after: retry_after.min(config.max_retry_after),
            },
            other => other,
        };
        return Ok(refuse(&config, refusal));
    }
    let mut resp = resp.map(ResponseBody::inner);
    if handed.replayed() {
        record_decision(HttpDecision::Replayed);
        if let Some((name, value)) = &config.replayed_marker {
            resp.headers_mut().insert(name.clone(), value.clone());
        }
    } else {
        record_decision(HttpDecision::Executed);
    }
    Ok(with_hook(&config, handed.key(), resp, None, None))
}

fn panic_message(panic: &crate::detach::Panic) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Counts `why` and releases the key: the handler did nothing, or the layer is told so.
async fn release(lease: Lease, why: HttpOutcome) {
    record_outcome(why);
    match lease.fail(Failure::retryable(why.as_str())).await {
        Ok(()) => {}
        Err(e @ Error::LeaseLost { .. }) => {
            tracing::warn!(error = %e, "the key was taken over before it could be released");
        }
        Err(e) => tracing::warn!(error = %e, "could not release the key; its lease will pass"),
    }
}

/// Holds the key until its lease passes, without a write: the handler may have acted, and its
/// answer is not stored.
fn hold(lease: Lease, why: HttpOutcome) {
    record_outcome(why);
    tracing::warn!(
        outcome = why.as_str(),
        "the handler's answer is not stored and it may have acted; the key is held until its \
         lease passes"
    );
    lease.hold();
}

/// Settles `lease` without a write: the handler settled the key itself (or, after a commit of
/// unknown outcome, holds it until its lease passes).
fn settled_by_handler(lease: Lease, settlement: Settlement) {
    if settlement == Settlement::Held {
        hold(lease, HttpOutcome::CommitUnknown);
        return;
    }
    lease.settled_externally();
    match settlement {
        Settlement::Open | Settlement::RolledBack | Settlement::Held => {}
        Settlement::Committed => record_outcome(HttpOutcome::SettledByHandler),
        Settlement::Lost => {
            record_outcome(HttpOutcome::LeaseLost);
            tracing::warn!(
                "the handler's completion was fenced: its lease had passed and another request \
                 holds the key; its transaction rolled back"
            );
        }
    }
}

/// Gives `lease` back unless the handler settled the key itself (committed the completion in
/// its transaction, or found its lease lost): then the lease is settled without a write. A
/// handler whose transaction rolled back left the key for the layer to release.
fn unless_settled_by_handler(claim: &ClaimedKey, lease: Lease) -> Option<Lease> {
    let settlement = claim.settlement();
    if matches!(settlement, Settlement::Open | Settlement::RolledBack) {
        return Some(lease);
    }
    settled_by_handler(lease, settlement);
    None
}

/// What the handler gave, read while the heartbeat runs.
enum Handled<B, E> {
    /// The handler settled the key itself (see [`ClaimedKey`]); its response is delivered as
    /// it is.
    SettledByHandler(Response<B>, Settlement),
    /// The handler's error.
    Error(E),
    /// The handler said it did nothing ([`NothingDone`], or [`ClaimedKey::rolled_back`]).
    NothingDone(Response<B>),
    /// A response that is not stored per the status policy.
    UnstoredStatus(Response<B>),
    /// A response whose body was read (whole, too large, or failing).
    Read(ReadResponse<B>),
}

/// A response body as the layer read it.
enum ReadResponse<B> {
    /// Read whole within the response limit: it is stored.
    Whole(http::response::Parts, Bytes),
    /// Larger than the limit: what was read, then the rest, still to deliver.
    TooLarge(http::response::Parts, ResponseBody<B>),
    /// The body failed while being read.
    Failed(http::response::Parts, BoxError),
}

/// Reads the handler's body up to `limit`, whether it declares its size or streams. A body
/// whose size hint is already over the limit is not read.
async fn read_response<B>(resp: Response<B>, limit: usize) -> ReadResponse<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (parts, body) = resp.into_parts();
    if body.size_hint().lower() > limit as u64 {
        return ReadResponse::TooLarge(parts, ResponseBody::inner(body));
    }
    let mut body = Box::pin(body);
    let mut read = Vec::new();
    loop {
        match body.frame().await {
            None => return ReadResponse::Whole(parts, Bytes::from(read)),
            Some(Err(e)) => return ReadResponse::Failed(parts, e.into()),
            Some(Ok(frame)) => {
                // Trailers are not stored (nor were they before streams were read).
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                read.extend_from_slice(&data);
                if read.len() > limit {
                    return ReadResponse::TooLarge(
                        parts,
                        ResponseBody::spliced(Bytes::from(read), body),
                    );
                }
            }
        }
    }
}

/// Completes the lease with `outcome`: `done` when it is stored, else what went wrong.
async fn complete(lease: Lease, outcome: &StoredResponse, done: HttpOutcome) -> HttpOutcome {
    match lease.complete(&outcome.encode()).await {
        Ok(()) => done,
        Err(e @ Error::LeaseLost { .. }) => {
            // Another attempt took the key over (this one outlived its lease): it owns the
            // record now, and this response is delivered but not stored.
            tracing::warn!(error = %e, "the lease was lost before the response could be stored");
            HttpOutcome::LeaseLost
        }
        Err(e) => {
            // The work ran; its response is delivered. The engine retried the write, then
            // recorded a permanent failure in its place (a retry is told 422 and the handler
            // never runs again) or, if that failed too, left the key Pending (a retry is told
            // 409 until the lease passes).
            tracing::error!(error = %e, "could not store the response");
            HttpOutcome::StoreFailed
        }
    }
}

/// Stores, records or releases what the handler answered, and gives the answer.
async fn settle_response<B>(config: &Config, lease: Lease, read: ReadResponse<B>) -> Answer<B> {
    let key = lease.id().key.clone();
    let retained = SystemTime::now().checked_add(lease.retention());
    let kept = |parts: &http::response::Parts| config.stored_response(parts, Bytes::new());
    let (resp, outcome) = match (read, config.unreplayable) {
        (ReadResponse::Whole(parts, body), _) => {
            let stored = StoredResponse {
                body: body.clone(),
                ..kept(&parts)
            };
            let outcome = complete(lease, &stored, HttpOutcome::Stored).await;
            let resp = Response::from_parts(parts, ResponseBody::full(body));
            (resp, outcome)
        }
        (ReadResponse::TooLarge(parts, body), OnUnreplayable::Release) => {
            release(lease, HttpOutcome::ReleasedTooLarge).await;
            let resp = Response::from_parts(parts, body);
            return with_hook(
                config,
                &key,
                resp,
                Some(HttpOutcome::ReleasedTooLarge),
                None,
            );
        }
        (ReadResponse::TooLarge(parts, body), OnUnreplayable::Record) => {
            let stored = StoredResponse {
                not_replayable: Some(NotReplayable::TooLarge),
                ..kept(&parts)
            };
            let outcome = complete(lease, &stored, HttpOutcome::RecordedTooLarge).await;
            (Response::from_parts(parts, body), outcome)
        }
        (ReadResponse::Failed(_, e), OnUnreplayable::Release) => {
            tracing::error!(error = %e, "the handler's response body failed");
            release(lease, HttpOutcome::ReleasedBodyFailed).await;
            return refuse(config, Refusal::HandlerFailed);
        }
        (ReadResponse::Failed(parts, e), OnUnreplayable::Record) => {
            tracing::error!(error = %e, "the handler's response body failed");
            let stored = StoredResponse {
                not_replayable: Some(NotReplayable::BodyFailed),
                ..kept(&parts)
            };
            let outcome = complete(lease, &stored, HttpOutcome::RecordedBodyFailed).await;
            // The client gets what its retries will get.
            (
                not_replayable(config, &stored, NotReplayable::BodyFailed),
                outcome,
            )
        }
    };
    record_outcome(outcome);
    let expires_at = match outcome {
        HttpOutcome::Stored | HttpOutcome::RecordedTooLarge | HttpOutcome::RecordedBodyFailed => {
            retained
        }
        _ => None,
    };
    with_hook(config, &key, resp, Some(outcome), expires_at)
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
    let claim = ClaimedKey::new(&lease, config.clone());
    req.extensions_mut().insert(claim.clone());
    let handled = async {
        let resp = match inner.call(req).await {
            Ok(resp) => resp,
            Err(e) => return Handled::Error(e),
        };
        match claim.settlement() {
            Settlement::Open => {}
            Settlement::RolledBack => return Handled::NothingDone(resp),
            settlement => return Handled::SettledByHandler(resp, settlement),
        }
        if resp.extensions().get::<NothingDone>().is_some() {
            return Handled::NothingDone(resp);
        }
        if !(config.store_status)(resp.status()) {
            return Handled::UnstoredStatus(resp);
        }
        Handled::Read(read_response(resp, config.response_limit).await)
    };
    let handled = match lease
        .with_heartbeat(AssertUnwindSafe(handled).catch_unwind())
        .await
    {
        Ok(handled) => handled,
        Err(panic) => {
            // The handler may have acted before it panicked: settle the key for good (no
            // retry runs it again), then let the task panic; released only when its own
            // transaction rolled back or the layer is told its handlers fail only before
            // acting. A key the handler settled in its own transaction stays as it
            // committed. The task's failure counts the outcome, once.
            if let Some(lease) = unless_settled_by_handler(&claim, lease) {
                if claim.settlement() == Settlement::RolledBack
                    || config.unstored == OnUnstored::Release
                {
                    lease.release_after_panic().await;
                } else {
                    lease.settle_after_panic().await;
                }
            }
            std::panic::resume_unwind(panic);
        }
    };
    match handled {
        Handled::Error(e) => {
            if let Some(lease) = unless_settled_by_handler(&claim, lease) {
                // The handler may have acted before its error, unless its own transaction
                // rolled back or the layer is told its handlers fail only before acting.
                if claim.settlement() == Settlement::RolledBack {
                    release(lease, HttpOutcome::HandlerError).await;
                } else {
                    match config.unstored {
                        OnUnstored::Release => release(lease, HttpOutcome::HandlerError).await,
                        OnUnstored::Hold => hold(lease, HttpOutcome::HandlerErrorHeld),
                        _ => {
                            let settled = lease
                                .settle_without_outcome("the handler returned an error")
                                .await;
                            // The store refused the stand-in: the key is held until its
                            // lease passes.
                            record_outcome(match settled {
                                true => HttpOutcome::HandlerErrorSettled,
                                false => HttpOutcome::HandlerErrorHeld,
                            });
                        }
                    }
                }
            }
            Err(e)
        }
        Handled::SettledByHandler(resp, settlement) => {
            // The handler's transaction committed the completion (whatever it answers now is
            // its answer, and every retry replays what was committed), or its completion was
            // fenced and it rolled back.
            let key = lease.id().key.clone();
            let expires_at = SystemTime::now().checked_add(lease.retention());
            settled_by_handler(lease, settlement);
            Ok(match settlement {
                Settlement::Lost => refuse(&config, Refusal::LeaseLost),
                Settlement::Held => with_hook(
                    &config,
                    &key,
                    resp.map(ResponseBody::inner),
                    Some(HttpOutcome::CommitUnknown),
                    None,
                ),
                _ => with_hook(
                    &config,
                    &key,
                    resp.map(ResponseBody::inner),
                    Some(HttpOutcome::SettledByHandler),
                    expires_at,
                ),
            })
        }
        Handled::NothingDone(resp) => {
            let key = lease.id().key.clone();
            release(lease, HttpOutcome::ReleasedNothingDone).await;
            let resp = resp.map(ResponseBody::inner);
            let outcome = Some(HttpOutcome::ReleasedNothingDone);
            Ok(with_hook(&config, &key, resp, outcome, None))
        }
        Handled::UnstoredStatus(resp) => {
            let key = lease.id().key.clone();
            let retained = SystemTime::now().checked_add(lease.retention());
            // The handler may have acted before it failed: settle the key with what can be
            // kept of the answer, unless the layer is told otherwise.
            let (outcome, expires_at) = match config.unstored {
                OnUnstored::Release => {
                    release(lease, HttpOutcome::ReleasedStatus).await;
                    (HttpOutcome::ReleasedStatus, None)
                }
                OnUnstored::Hold => {
                    hold(lease, HttpOutcome::HeldStatus);
                    (HttpOutcome::HeldStatus, None)
                }
                _ => {
                    let (parts, body) = resp.into_parts();
                    let stored = StoredResponse {
                        not_replayable: Some(NotReplayable::StatusNotStored),
                        ..config.stored_response(&parts, Bytes::new())
                    };
                    let outcome = complete(lease, &stored, HttpOutcome::RecordedStatus).await;
                    record_outcome(outcome);
                    let resp = Response::from_parts(parts, ResponseBody::inner(body));
                    let expires_at = (outcome == HttpOutcome::RecordedStatus)
                        .then_some(retained)
                        .flatten();
                    return Ok(with_hook(&config, &key, resp, Some(outcome), expires_at));
                }
            };
            let resp = resp.map(ResponseBody::inner);
            Ok(with_hook(&config, &key, resp, Some(outcome), expires_at))
        }
        Handled::Read(read) => Ok(settle_response(&config, lease, read).await),
    }
}

/// The scope the layer gives a request: the caller (from the scope function), the method and
/// the route, joined unambiguously. Public so that tools can address the layer's records in the
/// store.
pub fn http_scope(caller: &str, method: &http::Method, route: &str) -> Result<Scope, ScopeError> {
    Scope::from_parts([caller, method.as_str(), route])
}
