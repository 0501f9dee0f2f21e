//! Against a small real HTTP server that records every request and answers from a script of
//! failures: every attempt of an operation carries one key and the same bytes, whatever fails
//! in between; what is not safe to retry is not retried.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use idempotency_reqwest::{
    Error, GiveUpReason, IdempotencyKey, IdempotencyMiddleware, IdempotentRequestExt,
    IdempotentResponseExt, LastFailure, RetryPolicy,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use reqwest_middleware::ClientWithMiddleware;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// What the server does with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Closes the connection without answering (after reading the request).
    Drop,
    /// `500`.
    ServerError,
    /// `503` with `Retry-After: 0`.
    Unavailable,
    /// `429` with `Retry-After: 1` (the client caps it).
    TooMany,
    /// `409` with an HTTP-date `Retry-After` a second ahead (the client caps it).
    InProgress,
    /// Answers after the client's timeout.
    Slow,
    /// `400`: not to be retried.
    BadRequest,
    /// The layer's other retryable `409`: another request took the key over
    /// (`idempotency-key-lease-lost`, `Retry-After: 1`; the client caps it).
    LeaseLost,
    /// The in-progress `409` under an API's own problem type base, without `Retry-After`.
    InProgressCustomBase,
    /// A `409` with no readable problem type but a `Retry-After`: a server's own "busy".
    BusyNoType,
    /// The handler's own `409` (a business conflict, `…/out-of-stock`), stored by the
    /// server: replayed (`Idempotent-Replayed: true`) to a later attempt with the key.
    BusinessConflict,
    /// A replayed `409` with a plain JSON body and a `Retry-After` (the handler's answer, as
    /// the server stored it).
    ReplayedConflict,
    /// A `409` whose body is too long to be the server's in-progress refusal, though it
    /// names it and has a `Retry-After`: [`LARGE_CONFLICT_LEN`] bytes.
    LargeConflict,
    /// A replayed `500`: the stored outcome of an earlier attempt.
    ReplayedServerError,
    /// A replayed `503` with `Retry-After: 0`.
    ReplayedUnavailable,
}

/// The length of [`Fault::LargeConflict`]'s body.
const LARGE_CONFLICT_LEN: usize = 40 * 1024;

/// The body of [`Fault::LargeConflict`]: a problem document that names the in-progress
/// refusal, padded to [`LARGE_CONFLICT_LEN`] bytes with a detail whose bytes all differ from
/// their neighbours' (a lost or repeated stretch shows).
fn large_conflict() -> String {
    let head = r#"{"type":"urn:idempotency:problem:idempotency-key-in-progress","detail":""#;
    let tail = r#""}"#;
    let pad: String = (0..LARGE_CONFLICT_LEN - head.len() - tail.len())
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    format!("{head}{pad}{tail}")
}

/// The problem document of [`Fault::BusinessConflict`].
const OUT_OF_STOCK: &str = r#"{"type":"https://example.com/problems/out-of-stock","title":"Out of stock","status":409,"detail":"only 2 left"}"#;

/// One request as the server read it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    method: String,
    uri: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Bytes,
}

#[derive(Default)]
struct Recorder {
    script: VecDeque<Fault>,
    seen: Vec<Seen>,
}

const CLIENT_TIMEOUT: Duration = Duration::from_millis(60);

async fn answer(
    state: Arc<Mutex<Recorder>>,
    req: hyper::Request<Incoming>,
) -> Result<hyper::Response<Full<Bytes>>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    let mut headers: Vec<(String, Vec<u8>)> = parts
        .headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    headers.sort();
    let (fault, earlier) = {
        let mut s = state.lock().unwrap();
        s.seen.push(Seen {
            method: parts.method.to_string(),
            uri: parts.uri.to_string(),
            headers,
            body,
        });
        // Whether an earlier request carried this request's key (the server replays then).
        let key = |seen: &Seen| {
            seen.headers
                .iter()
                .find(|(n, _)| n == "idempotency-key")
                .map(|(_, v)| v.clone())
        };
        let this = s.seen.last().and_then(key);
        let earlier = this.is_some() && s.seen[..s.seen.len() - 1].iter().any(|e| key(e) == this);
        (s.script.pop_front(), earlier)
    };
    let reply = |status: u16| hyper::Response::builder().status(status);
    let resp = match fault {
        None => reply(201)
            .header(
                "idempotent-replayed",
                if earlier { "true" } else { "false" },
            )
            .body(Full::from("created")),
        Some(Fault::Drop) => return Err(std::io::Error::other("dropped on purpose")),
        Some(Fault::ServerError) => reply(500).body(Full::from("boom")),
        Some(Fault::Unavailable) => reply(503).header("retry-after", "0").body(Full::default()),
        Some(Fault::TooMany) => reply(429).header("retry-after", "1").body(Full::default()),
        Some(Fault::InProgress) => reply(409)
            .header(
                "retry-after",
                httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(1)),
            )
            .header("content-type", "application/problem+json")
            .body(Full::from(
                r#"{"type":"urn:idempotency:problem:idempotency-key-in-progress","status":409}"#,
            )),
        Some(Fault::Slow) => {
            tokio::time::sleep(CLIENT_TIMEOUT * 3).await;
            reply(201).body(Full::from("too late"))
        }
        Some(Fault::BadRequest) => reply(400)
            .header("content-type", "application/problem+json")
            .body(Full::from(
                r#"{"type":"urn:x:bad-request","title":"Bad","detail":"no such field"}"#,
            )),
        Some(Fault::LeaseLost) => reply(409)
            .header("retry-after", "1")
            .header("content-type", "application/problem+json")
            .body(Full::from(
                r#"{"type":"urn:idempotency:problem:idempotency-key-lease-lost","status":409,"code":"IDEMPOTENCY_KEY_LEASE_LOST"}"#,
            )),
        Some(Fault::InProgressCustomBase) => reply(409)
            .header("content-type", "application/problem+json; charset=utf-8")
            .body(Full::from(
                r#"{"type":"https://api.example.com/problems/idempotency-key-in-progress","status":409}"#,
            )),
        Some(Fault::BusyNoType) => reply(409)
            .header("retry-after", "0")
            .header("content-type", "text/plain")
            .body(Full::from("busy, try again")),
        Some(Fault::BusinessConflict) => {
            let r = reply(409).header("content-type", "application/problem+json");
            let r = if earlier {
                r.header("idempotent-replayed", "true")
            } else {
                r
            };
            r.body(Full::from(OUT_OF_STOCK))
        }
        Some(Fault::ReplayedConflict) => reply(409)
            .header("idempotent-replayed", "true")
            .header("retry-after", "1")
            .header("content-type", "application/json")
            .body(Full::from(r#"{"error":"seat already taken"}"#)),
        Some(Fault::LargeConflict) => reply(409)
            .header("retry-after", "0")
            .header("content-type", "application/problem+json")
            .body(Full::from(large_conflict())),
        Some(Fault::ReplayedServerError) => reply(500)
            .header("idempotent-replayed", "true")
            .body(Full::from("stored failure")),
        Some(Fault::ReplayedUnavailable) => reply(503)
            .header("idempotent-replayed", "true")
            .header("retry-after", "0")
            .body(Full::from("stored unavailable")),
    };
    resp.map_err(std::io::Error::other)
}

/// The recording server on a loopback port; `http://127.0.0.1:PORT`.
async fn serve(state: Arc<Mutex<Recorder>>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let state = state.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| answer(state.clone(), req));
                // A service error (Fault::Drop) closes the connection without an answer.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    url
}

fn client(policy: RetryPolicy) -> ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(
        reqwest::Client::builder()
            .no_proxy()
            .timeout(CLIENT_TIMEOUT)
            .build()
            .unwrap(),
    )
    .with(IdempotencyMiddleware::new().retry_policy(policy))
    .build()
}

fn fast_policy() -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(8)
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .max_retry_after(Duration::from_millis(5))
        .deadline(Duration::from_secs(10))
}

fn retried_fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        Just(Fault::Drop),
        Just(Fault::ServerError),
        Just(Fault::Unavailable),
        Just(Fault::TooMany),
        Just(Fault::InProgress),
        Just(Fault::Slow),
        Just(Fault::LeaseLost),
        Just(Fault::InProgressCustomBase),
        Just(Fault::BusyNoType),
    ]
}

/// For any sequence of retried failures, the server sees every attempt with one key and the
/// same method, target, headers and body; the answer after them arrives with the attempt count
/// and the replay marker.
#[test]
fn every_attempt_sends_one_key_and_the_same_bytes() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = rt.block_on(serve(state.clone()));
    let client = client(fast_policy());
    let strategy = (
        proptest::collection::vec(retried_fault(), 0..6),
        proptest::collection::vec(any::<u8>(), 0..2048),
        prop_oneof![Just("POST"), Just("PUT"), Just("PATCH")],
        proptest::option::of("[a-z0-9-]{1,40}"),
        proptest::option::of("\"[a-z0-9]{1,16}\""),
    );
    let mut runner = TestRunner::new(Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    });
    let attempts_seen = std::sync::atomic::AtomicUsize::new(0);
    runner
        .run(&strategy, |(faults, body, method, message_id, if_match)| {
            {
                let mut s = state.lock().unwrap();
                s.script = faults.iter().copied().collect();
                s.seen.clear();
            }
            let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
            let mut request = client
                .request(method.clone(), format!("{url}/orders?page=2"))
                .header("content-type", "application/octet-stream")
                .body(body.clone());
            if let Some(tag) = &if_match {
                request = request.header("if-match", tag.as_str());
            }
            let derived = message_id
                .as_ref()
                .map(|id| IdempotencyKey::derive("orders-consumer", id));
            request = match &derived {
                Some(key) => request.idempotency_key(key.clone()),
                None => request.idempotent(),
            };
            let response = rt.block_on(request.send()).unwrap();
            let outcome = response.idempotency().unwrap().clone();
            let status = response.status();
            let seen = state.lock().unwrap().seen.clone();

            prop_assert_eq!(status, reqwest::StatusCode::CREATED);
            prop_assert_eq!(seen.len(), faults.len() + 1);
            prop_assert_eq!(outcome.attempts() as usize, seen.len());
            prop_assert_eq!(outcome.replayed(), !faults.is_empty());
            if let Some(key) = &derived {
                prop_assert_eq!(outcome.key(), key);
            }
            let first = &seen[0];
            prop_assert_eq!(&first.method, method.as_str());
            prop_assert_eq!(&first.uri, "/orders?page=2");
            prop_assert_eq!(&first.body[..], &body[..]);
            let header = |s: &Seen, name: &str| {
                s.headers
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.clone())
            };
            prop_assert_eq!(
                header(first, "idempotency-key"),
                Some(outcome.key().as_str().as_bytes().to_vec())
            );
            prop_assert_eq!(header(first, "if-match"), if_match.map(|t| t.into_bytes()));
            for later in &seen[1..] {
                prop_assert_eq!(later, first);
            }
            attempts_seen.fetch_add(seen.len(), std::sync::atomic::Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
    println!(
        "48 operations, {} attempts, each operation's attempts identical",
        attempts_seen.into_inner()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_is_not_retried_and_says_why() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    state.lock().unwrap().script = [Fault::BadRequest].into();
    let err = client(fast_policy())
        .post(format!("{url}/orders"))
        .body("{}")
        .idempotent()
        .send()
        .await
        .unwrap_err();
    let e = Error::find(&err).unwrap();
    assert!(
        matches!(e, Error::Rejected { status, attempts: 1, .. } if *status == 400),
        "{e:?}"
    );
    assert_eq!(
        e.problem().unwrap().detail.as_deref(),
        Some("no such field")
    );
    assert!(e.to_string().contains("no such field"), "{e}");
    assert!(!e.is_retryable());
    assert_eq!(state.lock().unwrap().seen.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_gives_up_with_the_key_and_the_last_failure() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    state.lock().unwrap().script = [Fault::ServerError, Fault::Drop, Fault::Unavailable].into();
    let err = client(fast_policy().max_attempts(3))
        .post(format!("{url}/orders"))
        .body("{}")
        .idempotent()
        .send()
        .await
        .unwrap_err();
    let e = Error::find(&err).unwrap();
    let Error::GaveUp {
        key,
        attempts,
        reason,
        last,
        ..
    } = e
    else {
        panic!("{e:?}")
    };
    assert_eq!(*attempts, 3);
    assert_eq!(*reason, GiveUpReason::AttemptsExhausted);
    assert!(
        matches!(last, LastFailure::Status { status, retry_after: Some(d), .. }
        if *status == 503 && d.is_zero())
    );
    assert!(e.is_retryable());
    let seen = state.lock().unwrap().seen.clone();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|s| s
        .headers
        .contains(&("idempotency-key".into(), key.as_str().into()))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_body_is_refused_before_anything_is_sent() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    let chunks = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from("{}"))]);
    let err = client(fast_policy())
        .post(format!("{url}/orders?token=secret"))
        .body(reqwest::Body::wrap_stream(chunks))
        .idempotent()
        .send()
        .await
        .unwrap_err();
    let e = Error::find(&err).unwrap();
    assert!(matches!(e, Error::BodyNotReplayable { .. }), "{e:?}");
    assert!(e.to_string().contains("streaming body"), "{e}");
    assert!(!e.to_string().contains("secret"), "{e}");
    assert_eq!(e.attempts(), 0);
    assert!(state.lock().unwrap().seen.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_caller_set_is_kept_and_a_different_mark_refused() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    let client = client(fast_policy());
    state.lock().unwrap().script = [Fault::Drop].into();
    let r = client
        .post(format!("{url}/orders"))
        .header("idempotency-key", "\"caller,key\"")
        .body("{}")
        .idempotent()
        .send()
        .await
        .unwrap();
    assert_eq!(r.idempotency().unwrap().key().as_str(), "caller,key");
    assert_eq!(r.idempotency().unwrap().attempts(), 2);
    assert!(r.was_replayed());
    let seen = std::mem::take(&mut state.lock().unwrap().seen);
    for s in &seen {
        assert!(s
            .headers
            .contains(&("idempotency-key".into(), b"\"caller,key\"".to_vec())));
    }

    let err = client
        .post(format!("{url}/orders"))
        .header("idempotency-key", "one")
        .idempotency_key(IdempotencyKey::new("two").unwrap())
        .send()
        .await
        .unwrap_err();
    assert!(matches!(
        Error::find(&err),
        Some(Error::ConflictingKeys { .. })
    ));
    let err = client
        .post(format!("{url}/orders"))
        .header("idempotency-key", "")
        .idempotent()
        .send()
        .await
        .unwrap_err();
    assert!(matches!(Error::find(&err), Some(Error::InvalidKey { .. })));
    assert!(state.lock().unwrap().seen.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_not_marked_pass_through_untouched() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    state.lock().unwrap().script = [Fault::ServerError].into();
    let r = client(fast_policy())
        .post(format!("{url}/orders"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    assert!(r.idempotency().is_none());
    let seen = state.lock().unwrap().seen.clone();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].headers.iter().all(|(n, _)| n != "idempotency-key"));
}

/// Sends every request twice, as a retrying middleware does when the first answer is lost:
/// a clone of the request it was given, with the same extensions.
struct SendTwice;

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for SendTwice {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let again = req.try_clone().unwrap();
        let _lost = next.clone().run(req, extensions).await?;
        next.run(again, extensions).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retrying_middleware_before_it_resends_the_same_key() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    let client = reqwest_middleware::ClientBuilder::new(
        reqwest::Client::builder().no_proxy().build().unwrap(),
    )
    .with(SendTwice)
    .with(IdempotencyMiddleware::new().retry_policy(fast_policy()))
    .build();
    let r = client
        .post(format!("{url}/orders"))
        .body("{}")
        .idempotent()
        .send()
        .await
        .unwrap();
    assert!(r.was_replayed());
    let seen = state.lock().unwrap().seen.clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0], seen[1], "the resent request differs");
    assert!(seen[0]
        .headers
        .iter()
        .any(|(n, v)| n == "idempotency-key"
            && v == r.idempotency().unwrap().key().as_str().as_bytes()));
}

/// A transport failure's message never carries the request's query string (it may hold a
/// token): not in the error the caller gets, nor anywhere down its source chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_errors_leave_the_query_out() {
    // A port nothing listens on: every attempt is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = client(fast_policy().max_attempts(2))
        .post(format!("http://127.0.0.1:{port}/orders?token=s3cr3t"))
        .body("{}")
        .idempotent()
        .send()
        .await
        .unwrap_err();
    let mut messages = vec![err.to_string(), format!("{err:?}")];
    let mut source: Option<&(dyn std::error::Error + 'static)> =
        Error::find(&err).map(|e| e as &(dyn std::error::Error + 'static));
    while let Some(e) = source {
        messages.push(e.to_string());
        source = e.source();
    }
    for m in &messages {
        assert!(!m.contains("s3cr3t"), "the query leaked: {m}");
    }
}

/// The key header of each request the server saw, in order.
fn keys_seen(state: &Mutex<Recorder>) -> Vec<String> {
    state
        .lock()
        .unwrap()
        .seen
        .iter()
        .map(|s| {
            s.headers
                .iter()
                .find(|(n, _)| n == "idempotency-key")
                .map(|(_, v)| String::from_utf8(v.clone()).unwrap())
                .expect("every marked request carries a key")
        })
        .collect()
}

/// The handler's own `409` is its final answer, stored and replayed by the server: it ends the
/// operation at once (as any other refused `4xx`, with its body), never re-asked until the
/// policy gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_business_409_is_final_and_not_retried() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    // Were it retried, every later attempt would get the stored 409 replayed.
    state.lock().unwrap().script = vec![Fault::BusinessConflict; 8].into();
    let err = client(fast_policy())
        .post(format!("{url}/orders"))
        .body("{}")
        .idempotent()
        .send()
        .await
        .unwrap_err();
    let e = Error::find(&err).unwrap();
    let Error::Rejected {
        status,
        attempts,
        headers,
        body,
        problem,
        ..
    } = e
    else {
        panic!("expected the 409 as the final answer, got: {e}")
    };
    assert_eq!(*status, 409);
    assert_eq!(*attempts, 1);
    assert_eq!(
        &body[..],
        OUT_OF_STOCK.as_bytes(),
        "the body reaches the caller"
    );
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(
        problem.as_ref().unwrap().problem_type.as_deref(),
        Some("https://example.com/problems/out-of-stock")
    );
    assert!(!e.is_retryable());
    assert_eq!(state.lock().unwrap().seen.len(), 1);
}

/// A replayed answer (`Idempotent-Replayed: true`) is the operation's answer whatever its
/// status: a replayed `409` ends the operation after one attempt as a refused `4xx`, even with
/// a `Retry-After` and no problem type (which, unreplayed, read as "busy, retry").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_409_ends_the_operation_after_one_attempt() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    let client = client(fast_policy());

    state.lock().unwrap().script = vec![Fault::ReplayedConflict; 8].into();
    let err = client
        .post(format!("{url}/seats"))
        .body("{}")
        .idempotent()
        .send()
        .await
        .unwrap_err();
    let e = Error::find(&err).unwrap();
    assert!(
        matches!(e, Error::Rejected { status, attempts: 1, body, .. }
            if *status == 409 && &body[..] == br#"{"error":"seat already taken"}"#),
        "expected the replayed 409 after one attempt, got: {e}"
    );
    assert_eq!(state.lock().unwrap().seen.len(), 1);
}

/// A replayed `5xx` is the stored outcome of an earlier attempt, not a transient failure: it
/// is returned as the response after one attempt, body and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_5xx_is_returned_after_one_attempt() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    let client = client(fast_policy());
    for (fault, status, body) in [
        (Fault::ReplayedServerError, 500, "stored failure"),
        (Fault::ReplayedUnavailable, 503, "stored unavailable"),
    ] {
        state.lock().unwrap().script = vec![fault; 8].into();
        let r = client
            .post(format!("{url}/orders"))
            .body("{}")
            .idempotent()
            .send()
            .await
            .unwrap_or_else(|e| panic!("expected the replayed {status} as the response, got: {e}"));
        assert_eq!(r.status(), status);
        assert!(r.was_replayed());
        assert_eq!(r.idempotency().unwrap().attempts(), 1);
        assert_eq!(r.text().await.unwrap(), body);
        assert_eq!(std::mem::take(&mut state.lock().unwrap().seen).len(), 1);
    }
}

/// The server's refusals that mean "another attempt holds the key" are retried: the
/// in-progress `409` (the layer's type, or the slug under an API's own base, with or without
/// `Retry-After`), the lease-lost `409`, and a `409` with no readable type but a `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_and_lease_lost_409s_are_still_retried() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    let client = client(fast_policy());
    for fault in [
        Fault::InProgress,
        Fault::InProgressCustomBase,
        Fault::LeaseLost,
        Fault::BusyNoType,
    ] {
        state.lock().unwrap().script = [fault, fault].into();
        let r = client
            .post(format!("{url}/orders"))
            .body("{}")
            .idempotent()
            .send()
            .await
            .unwrap_or_else(|e| panic!("{fault:?}: {e}"));
        assert_eq!(r.status(), 201, "{fault:?}");
        assert_eq!(r.idempotency().unwrap().attempts(), 3, "{fault:?}");
        let keys = keys_seen(&state);
        assert_eq!(keys.len(), 3, "{fault:?}");
        assert!(keys.iter().all(|k| *k == keys[0]), "{fault:?}");
        state.lock().unwrap().seen.clear();
    }
}

/// One `Extensions` value reused for several operations (`execute_with_extensions`) must not
/// send them under one key, with or without a retrying middleware in front (whose resends of
/// one operation keep that operation's key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_extensions_value_gives_each_operation_its_own_key() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    let plain = client(fast_policy());
    let resending = reqwest_middleware::ClientBuilder::new(
        reqwest::Client::builder().no_proxy().build().unwrap(),
    )
    .with(SendTwice)
    .with(IdempotencyMiddleware::new().retry_policy(fast_policy()))
    .build();
    for (client, sends_per_operation) in [(&plain, 1), (&resending, 2)] {
        let mut extensions = http::Extensions::new();
        extensions.insert(idempotency_reqwest::Idempotent::new());
        let mut outcome_keys = Vec::new();
        for body in [r#"{"item":"a"}"#, r#"{"item":"b"}"#, r#"{"item":"c"}"#] {
            let request = client
                .post(format!("{url}/orders"))
                .body(body)
                .build()
                .unwrap();
            let r = client
                .execute_with_extensions(request, &mut extensions)
                .await
                .unwrap();
            assert_eq!(r.status(), 201);
            outcome_keys.push(r.idempotency().unwrap().key().as_str().to_owned());
        }
        let keys = keys_seen(&state);
        state.lock().unwrap().seen.clear();
        assert_eq!(keys.len(), 3 * sends_per_operation);
        let per_operation: Vec<_> = keys.chunks(sends_per_operation).collect();
        for (sends, outcome_key) in per_operation.iter().zip(&outcome_keys) {
            assert!(
                sends.iter().all(|k| k == outcome_key),
                "an operation's sends carry its one key"
            );
        }
        for (i, a) in outcome_keys.iter().enumerate() {
            for b in &outcome_keys[i + 1..] {
                assert_ne!(
                    a,
                    b,
                    "two operations sent under one key (sends per operation: {sends_per_operation})"
                );
            }
        }
    }
}

/// A key the caller put in the header of one operation stays with that operation: the next
/// one sent through the same `Extensions` value gets a key of its own; a key the caller marked
/// the `Extensions` with is used for every operation sent through it, as asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_the_caller_chose_stay_where_they_were_put() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    let client = client(fast_policy());

    let mut extensions = http::Extensions::new();
    extensions.insert(idempotency_reqwest::Idempotent::new());
    let first = client
        .post(format!("{url}/orders"))
        .header("idempotency-key", "caller-key")
        .body("{}")
        .build()
        .unwrap();
    client
        .execute_with_extensions(first, &mut extensions)
        .await
        .unwrap();
    let second = client
        .post(format!("{url}/orders"))
        .body("{}")
        .build()
        .unwrap();
    let r = client
        .execute_with_extensions(second, &mut extensions)
        .await
        .unwrap();
    assert_ne!(r.idempotency().unwrap().key().as_str(), "caller-key");
    let keys = keys_seen(&state);
    state.lock().unwrap().seen.clear();
    assert_eq!(keys[0], "caller-key");
    assert_ne!(
        keys[1], "caller-key",
        "the second operation took the first one's key"
    );

    let chosen = IdempotencyKey::derive("orders-consumer", "message-9");
    let mut extensions = http::Extensions::new();
    extensions.insert(idempotency_reqwest::Idempotent::with_key(chosen.clone()));
    for body in ["{\"n\":1}", "{\"n\":2}"] {
        let request = client
            .post(format!("{url}/orders"))
            .body(body)
            .build()
            .unwrap();
        let r = client
            .execute_with_extensions(request, &mut extensions)
            .await
            .unwrap();
        assert_eq!(r.idempotency().unwrap().key(), &chosen);
    }
    let keys = keys_seen(&state);
    assert_eq!(keys, vec![chosen.as_str().to_owned(); 2]);
}

/// A `409` is read only up to a bound to find its problem type: one with a longer body is not
/// the in-progress refusal (whatever it names), is not retried, and reaches the caller whole,
/// the bytes read to decide included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_too_long_to_be_the_in_progress_refusal_is_final_and_kept_whole() {
    let state = Arc::new(Mutex::new(Recorder::default()));
    let url = serve(state.clone()).await;
    state.lock().unwrap().script = vec![Fault::LargeConflict; 8].into();
    let err = client(fast_policy())
        .post(format!("{url}/orders"))
        .body("{}")
        .idempotent()
        .send()
        .await
        .unwrap_err();
    let e = Error::find(&err).unwrap();
    let Error::Rejected {
        status,
        attempts,
        body,
        ..
    } = e
    else {
        panic!("expected the long 409 as the final answer, got: {e}")
    };
    assert_eq!(*status, 409);
    assert_eq!(*attempts, 1);
    const {
        assert!(LARGE_CONFLICT_LEN > RetryPolicy::MAX_CONFLICT_BODY);
        assert!(LARGE_CONFLICT_LEN <= Error::MAX_KEPT_BODY);
    }
    assert_eq!(body.len(), LARGE_CONFLICT_LEN);
    assert!(
        body[..] == *large_conflict().as_bytes(),
        "the body was not kept whole"
    );
    assert_eq!(state.lock().unwrap().seen.len(), 1);
}
