//! The middleware: one key per operation, the same request on every attempt, retries only
//! where they are safe.

use crate::error::conflict_is_retryable;
use crate::error::{refusal_kind, Error, LastFailure, Problem, RefusalKind};
use crate::key::{
    is_replayed, key_header_value, read_key_header, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED,
};
use crate::mark::Idempotent;
use crate::outcome::IdempotencyOutcome;
use crate::policy::{classify, is_retryable_transport, retry_after, RetryPolicy, StatusClass};
use bytes::{Bytes, BytesMut};
use http::{Extensions, HeaderMap, HeaderName, StatusCode};
use idempotency_core::{loggable_key, IdempotencyKey};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::time::{Instant, SystemTime};
use tracing::Instrument;

/// How much of a retried answer's body is read for its problem document.
const MAX_RETRIED_BODY: usize = 16 * 1024;

/// A `reqwest_middleware` middleware that sends requests marked [`Idempotent`] with an
/// `Idempotency-Key` and retries them where that is safe.
///
/// For each marked request (one logical operation):
/// - the key is the one in the request's `Idempotency-Key` header if the caller set one
///   (never overwritten), else the one it was marked with, else a fresh UUID v4; every attempt
///   carries that key. A minted key is kept in the extensions with the request it was minted
///   for, so that a retrying middleware in front, resending that request, resends its key; a
///   different request sent with the same extensions is another operation and gets its own;
/// - every attempt sends the same bytes: the request is cloned from the one built by the
///   caller (same headers, same buffered body); a streaming body is refused before the first
///   attempt ([`Error::BodyNotReplayable`]);
/// - answers and failures are retried as [`RetryPolicy`] says: transient failures and the
///   server's in-progress `409`, never a replayed answer (the operation's stored outcome,
///   returned at once whatever its status); a refused `4xx` (replayed or not) ends the
///   operation with a typed [`Error`];
/// - the response carries an [`IdempotencyOutcome`] (key, attempts, replayed).
///
/// Requests that are not marked pass through untouched. Put the middleware before others that
/// retry (so that its policy decides what is retried), and after those that sign or decorate the
/// request only if they do so identically every time.
///
/// Each operation runs in an `idempotency.request` span (method, target, key, attempts,
/// replayed, status) and each attempt in an `idempotency.attempt` span. Keys are logged as the
/// first 12 hex digits of their SHA-256 (the form the server half logs) unless
/// [`hash_keys_in_logs`](Self::hash_keys_in_logs) is turned off.
///
/// ```
/// use idempotency_reqwest::{IdempotencyMiddleware, RetryPolicy};
/// use std::time::Duration;
///
/// let client = reqwest_middleware::ClientBuilder::new(
///     reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?,
/// )
/// .with(
///     IdempotencyMiddleware::new()
///         .retry_policy(RetryPolicy::default().deadline(Duration::from_secs(20))),
/// )
/// .build();
/// # let _ = client;
/// # Ok::<(), reqwest::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyMiddleware {
    policy: RetryPolicy,
    key_header: HeaderName,
    replayed_header: HeaderName,
    hash_keys_in_logs: bool,
}

impl Default for IdempotencyMiddleware {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyMiddleware {
    /// The default [`RetryPolicy`], the key in `Idempotency-Key`, replays read from
    /// `Idempotent-Replayed`, keys hashed in logs.
    pub fn new() -> Self {
        Self {
            policy: RetryPolicy::default(),
            key_header: IDEMPOTENCY_KEY,
            replayed_header: IDEMPOTENT_REPLAYED,
            hash_keys_in_logs: true,
        }
    }

    /// How operations are retried.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The header the key is sent in (default `Idempotency-Key`), for APIs that use another.
    pub fn key_header(mut self, name: HeaderName) -> Self {
        self.key_header = name;
        self
    }

    /// The header that marks a replayed answer (default `Idempotent-Replayed`). A replayed
    /// answer is the operation's outcome: it is never retried, whatever its status.
    pub fn replay_marker(mut self, name: HeaderName) -> Self {
        self.replayed_header = name;
        self
    }

    /// Whether logs and spans show a key's SHA-256 prefix (the default) or the key itself.
    pub fn hash_keys_in_logs(mut self, hash: bool) -> Self {
        self.hash_keys_in_logs = hash;
        self
    }

    /// The retry policy in use.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The key for this operation, after writing it in the request when the caller did not.
    fn settle_key(
        &self,
        req: &mut Request,
        mark: &Idempotent,
        extensions: &mut Extensions,
    ) -> reqwest_middleware::Result<IdempotencyKey> {
        let key = match read_key_header(req.headers(), &self.key_header) {
            Err(reason) => Err(Error::InvalidKey { reason }),
            Ok(Some(header)) => match mark.key() {
                Some(marked) if *marked != header => Err(Error::ConflictingKeys {
                    header,
                    marked: marked.clone(),
                }),
                _ => Ok(header),
            },
            Ok(None) => {
                let key = match mark.key() {
                    Some(marked) => marked.clone(),
                    None => minted_key(req, extensions),
                };
                let value = match key_header_value(&key) {
                    Ok(value) => value,
                    Err(reason) => return Err(Error::InvalidKey { reason }.into()),
                };
                req.headers_mut().insert(self.key_header.clone(), value);
                Ok(key)
            }
        };
        // Into the middleware's error at once: `Error` is large, and anyhow boxes it.
        key.map_err(Into::into)
    }

    async fn run(
        &self,
        req: Request,
        key: IdempotencyKey,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let span = tracing::Span::current();
        let started = Instant::now();
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let Some(attempt) = req.try_clone() else {
                return Err(not_replayable(&req).into());
            };
            let attempt_span = tracing::info_span!(
                "idempotency.attempt",
                attempt = attempts,
                status = tracing::field::Empty,
                error = tracing::field::Empty,
            );
            let result = next
                .clone()
                .run(attempt, extensions)
                .instrument(attempt_span.clone())
                .await;
            span.record("attempts", attempts);
            let (retry_after, last) = match result {
                Ok(mut resp) => {
                    let status = resp.status();
                    attempt_span.record("status", status.as_u16());
                    span.record("status", status.as_u16());
                    let replayed = is_replayed(resp.headers(), &self.replayed_header);
                    match classify(status, replayed) {
                        StatusClass::Final => {
                            span.record("replayed", replayed);
                            tracing::debug!(attempts, replayed, "idempotent request answered");
                            resp.extensions_mut().insert(IdempotencyOutcome {
                                key,
                                attempts,
                                replayed,
                            });
                            return Ok(resp);
                        }
                        StatusClass::Refused => {
                            return Err(refused(resp, key, attempts).await.into());
                        }
                        StatusClass::Conflict => {
                            let headers = resp.headers().clone();
                            let mut body = BodyReader::new(resp);
                            // One byte past the bound tells a body that is longer.
                            body.read_to(RetryPolicy::MAX_CONFLICT_BODY + 1).await;
                            let fits = body.read.len() <= RetryPolicy::MAX_CONFLICT_BODY;
                            if !conflict_is_retryable(&headers, fits.then_some(&body.read[..])) {
                                // The answer is final: the caller gets it whole, as any
                                // refused answer, the bytes read so far included.
                                body.read_to(Error::MAX_KEPT_BODY).await;
                                let body = body.read.freeze();
                                return Err(refusal(status, headers, body, key, attempts).into());
                            }
                            let retry_after = retry_after(&headers, SystemTime::now());
                            let problem = Problem::parse(&headers, &body.read);
                            (
                                retry_after,
                                LastFailure::Status {
                                    status,
                                    retry_after,
                                    problem,
                                },
                            )
                        }
                        StatusClass::Retry => {
                            let retry_after = retry_after(resp.headers(), SystemTime::now());
                            let headers = resp.headers().clone();
                            let body = read_capped(resp, MAX_RETRIED_BODY).await;
                            let problem = Problem::parse(&headers, &body);
                            (
                                retry_after,
                                LastFailure::Status {
                                    status,
                                    retry_after,
                                    problem,
                                },
                            )
                        }
                    }
                }
                // reqwest's message names the whole URL, query included: the query may hold
                // a secret, so it is dropped before the error is logged or kept.
                Err(reqwest_middleware::Error::Reqwest(e)) if is_retryable_transport(&e) => {
                    let e = e.without_url();
                    attempt_span.record("error", tracing::field::display(&e));
                    (None, LastFailure::Transport(e))
                }
                Err(reqwest_middleware::Error::Reqwest(source)) => {
                    let source = source.without_url();
                    attempt_span.record("error", tracing::field::display(&source));
                    return Err(Error::Send {
                        key,
                        attempts,
                        source,
                    }
                    .into());
                }
                // Another middleware's failure: not ours to judge or retry.
                Err(e) => return Err(e),
            };
            match self
                .policy
                .next_wait(attempts, started.elapsed(), retry_after)
            {
                Ok(wait) => {
                    tracing::info!(
                        attempt = attempts,
                        wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                        last = %last,
                        "retrying idempotent request with the same key"
                    );
                    tokio::time::sleep(wait).await;
                }
                Err(reason) => {
                    let elapsed = started.elapsed();
                    tracing::warn!(attempts, %reason, last = %last, "gave up on idempotent request");
                    return Err(Error::GaveUp {
                        key,
                        attempts,
                        elapsed,
                        reason,
                        last,
                    }
                    .into());
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let Some(mark) = extensions.get::<Idempotent>().cloned() else {
            return next.run(req, extensions).await;
        };
        let key = self.settle_key(&mut req, &mark, extensions)?;
        // Refused before anything is sent: a second attempt could not send the same bytes.
        if req.try_clone().is_none() {
            return Err(not_replayable(&req).into());
        }
        let span = tracing::info_span!(
            "idempotency.request",
            method = %req.method(),
            target = %target(&req),
            key = %loggable_key(&key, self.hash_keys_in_logs),
            attempts = tracing::field::Empty,
            replayed = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        self.run(req, key, extensions, next).instrument(span).await
    }
}

/// The request's origin and path; the query is left out of errors and logs.
fn target(req: &Request) -> String {
    let url = req.url();
    format!("{}{}", url.origin().ascii_serialization(), url.path())
}

fn not_replayable(req: &Request) -> Error {
    Error::BodyNotReplayable {
        method: req.method().clone(),
        target: target(req),
    }
}

/// The key minted for an operation, kept in its extensions with the request it was minted for.
///
/// A retrying middleware in front of this one resends a clone of the request it was given
/// (without the key header, which is written in this middleware's copy) with the same
/// extensions: its retries must carry the key minted for the first attempt. A caller may also
/// reuse one `Extensions` value for several operations (`execute_with_extensions`): a request
/// that is not the one the key was minted for is another operation, and gets a key of its own.
/// The request is told by what a server fingerprints: method, URL, content type, precondition
/// headers and body (other headers, which a middleware between may set per attempt, are left
/// out), hashed with SipHash under random keys drawn for each minted key.
#[derive(Clone, Debug)]
struct MintedKey {
    key: IdempotencyKey,
    hasher: RandomState,
    request: u64,
}

impl MintedKey {
    fn new(key: IdempotencyKey, req: &Request) -> Self {
        let hasher = RandomState::new();
        let request = request_hash(&hasher, req);
        Self {
            key,
            hasher,
            request,
        }
    }

    /// The key, if it was minted for `req`.
    fn key_for(&self, req: &Request) -> Option<&IdempotencyKey> {
        (request_hash(&self.hasher, req) == self.request).then_some(&self.key)
    }
}

/// The key minted earlier for this request (a retrying middleware in front resends it), or a
/// fresh one, kept in the extensions for it.
fn minted_key(req: &Request, extensions: &mut Extensions) -> IdempotencyKey {
    if let Some(key) = extensions
        .get::<MintedKey>()
        .and_then(|minted| minted.key_for(req))
    {
        return key.clone();
    }
    let key = IdempotencyKey::random();
    extensions.insert(MintedKey::new(key.clone(), req));
    key
}

/// A hash of what makes `req` one request for a server: method, URL, content type,
/// precondition headers and body.
fn request_hash(hasher: &RandomState, req: &Request) -> u64 {
    let mut h = hasher.build_hasher();
    req.method().as_str().hash(&mut h);
    req.url().as_str().hash(&mut h);
    let names = std::iter::once(&http::header::CONTENT_TYPE)
        .chain(idempotency_core::http::DEFAULT_FINGERPRINT_HEADERS);
    for name in names {
        for value in req.headers().get_all(name) {
            name.as_str().hash(&mut h);
            value.as_bytes().hash(&mut h);
        }
    }
    // A streaming body has no bytes to tell; such a request is refused before it is sent.
    req.body().and_then(reqwest::Body::as_bytes).hash(&mut h);
    h.finish()
}

/// The typed error for a refused answer.
async fn refused(resp: Response, key: IdempotencyKey, attempts: u32) -> Error {
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = read_capped(resp, Error::MAX_KEPT_BODY).await;
    refusal(status, headers, body, key, attempts)
}

/// The typed error for a refused answer whose body (its first [`Error::MAX_KEPT_BODY`]
/// bytes) was read.
fn refusal(
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    key: IdempotencyKey,
    attempts: u32,
) -> Error {
    let problem = Problem::parse(&headers, &body);
    let kind = (status == http::StatusCode::UNPROCESSABLE_ENTITY)
        .then(|| refusal_kind(problem.as_ref()))
        .flatten();
    tracing::info!(
        status = status.as_u16(),
        "idempotent request refused; not retried"
    );
    match kind {
        Some(RefusalKind::KeyReused) => Error::KeyReused {
            key,
            attempts,
            problem,
        },
        Some(RefusalKind::FailedPermanently) => Error::FailedPermanently {
            key,
            attempts,
            problem,
        },
        Some(RefusalKind::OutcomeLost) => Error::OutcomeLost {
            key,
            attempts,
            problem,
        },
        None => Error::Rejected {
            key,
            attempts,
            status,
            headers,
            body,
            problem,
        },
    }
}

/// The body's first `limit` bytes; what was read when the body fails.
async fn read_capped(resp: Response, limit: usize) -> Bytes {
    let mut body = BodyReader::new(resp);
    body.read_to(limit).await;
    body.read.freeze()
}

/// A response's body read up to a bound, then, if need be, further: no byte is lost between
/// the two reads.
struct BodyReader {
    resp: Response,
    /// The bytes read so far, in order.
    read: BytesMut,
    /// The rest of the last chunk, past the bound of the last read.
    rest: Bytes,
}

impl BodyReader {
    fn new(resp: Response) -> Self {
        Self {
            resp,
            read: BytesMut::new(),
            rest: Bytes::new(),
        }
    }

    /// Reads until `limit` bytes are read in all, or the body ends or fails.
    async fn read_to(&mut self, limit: usize) {
        while self.read.len() < limit {
            if self.rest.is_empty() {
                match self.resp.chunk().await {
                    Ok(Some(chunk)) => self.rest = chunk,
                    Ok(None) | Err(_) => break,
                }
            }
            let take = self.rest.len().min(limit - self.read.len());
            self.read.extend_from_slice(&self.rest.split_to(take));
        }
    }
}
