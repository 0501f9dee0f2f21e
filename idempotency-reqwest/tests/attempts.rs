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
}

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
        (s.script.pop_front(), s.seen.len() > 1)
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
