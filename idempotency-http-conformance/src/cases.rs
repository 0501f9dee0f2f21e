//! The cases. Each one starts its own server over the given store and talks to it with a real
//! HTTP client.

use crate::server::{control, Outage, Principal, TestServer};
use bytes::Bytes;
use http::{HeaderName, Method, StatusCode};
use idempotency_conformance::{Fault, FlakyOp, FlakyStore, TestStore};
use idempotency_core::{ClaimRequest, Fingerprint, IdempotencyKey, InFlight, Policy, RecordId};
use idempotency_tower::{http_scope, Refusal};
use reqwest::header::HeaderMap;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A response, read to the end.
#[derive(Debug)]
pub struct Reply {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body.
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON (panics with the body when it is not JSON: a case failure).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }
    /// A header as a string.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// Whether it carries `Idempotent-Replayed: true`.
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
    /// The handler execution number the test app wrote in the body.
    pub fn execution(&self) -> u64 {
        self.json()["execution"]
            .as_u64()
            .unwrap_or_else(|| panic!("no execution number in {:?}", self.body))
    }
}

/// Sends a request and reads the whole response.
pub async fn send(req: reqwest::RequestBuilder) -> Reply {
    let resp = req.send().await.expect("the test server answers");
    let status = StatusCode::from_u16(resp.status().as_u16()).expect("a valid status");
    let headers = resp.headers().clone();
    let body = resp.bytes().await.expect("a complete body");
    Reply {
        status,
        headers,
        body,
    }
}

/// Asserts `reply` is an RFC 9457 problem document with `status` and the type slug of
/// `refusal`.
pub fn assert_problem(reply: &Reply, status: u16, slug: &str) {
    assert_eq!(reply.status.as_u16(), status, "status of {reply:?}");
    assert_eq!(
        reply.header("content-type"),
        Some(idempotency_tower::PROBLEM_JSON),
        "content type of {reply:?}"
    );
    let doc = reply.json();
    assert_eq!(doc["status"], status, "problem status in {doc}");
    let ty = doc["type"].as_str().expect("a problem type");
    assert!(
        ty.ends_with(slug),
        "problem type {ty} does not end with {slug}"
    );
    assert!(
        doc["title"].is_string() && doc["detail"].is_string(),
        "{doc}"
    );
    assert!(!reply.replayed(), "a refusal is never marked replayed");
}

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("an HTTP client")
}

fn post(
    c: &reqwest::Client,
    s: &TestServer,
    path: &str,
    key: &str,
    body: &Value,
) -> reqwest::RequestBuilder {
    c.post(s.url(path))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_string())
}

async fn server(store: &TestStore) -> TestServer {
    TestServer::with_store(store.store.clone(), Policy::default(), |l| l).await
}

/// First request runs the handler; the retry gets the stored status, allowlisted headers and
/// body with `Idempotent-Replayed: true`, and the handler does not run again.
pub async fn first_request_runs_then_replays(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"title": "Kindred", "year": 1979});
    let first = send(post(&c, &s, "/items", "k-1", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.execution(), 1);
    assert_eq!(first.json()["received"], body);
    for _ in 0..3 {
        let again = send(post(&c, &s, "/items", "k-1", &body)).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed(), "{again:?}");
        assert_eq!(
            again.body, first.body,
            "the replayed body is byte-identical"
        );
        for h in ["content-type", "location", "etag"] {
            assert_eq!(again.header(h), first.header(h), "replayed {h}");
        }
    }
    assert_eq!(s.executions(), 1);
    // Another key is another operation.
    let other = send(post(&c, &s, "/items", "k-2", &body)).await;
    assert!(!other.replayed());
    assert_eq!(other.execution(), 2);
}

/// `Set-Cookie`, `Authorization` and hop-by-hop headers are never stored, even when
/// allowlisted; headers outside the allowlist are not replayed; the first response keeps them
/// all.
pub async fn replay_omits_credentials_cookies_and_unlisted_headers(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.replay_header(HeaderName::from_static("x-allowlisted"))
            .replay_header(HeaderName::from_static("set-cookie"))
            .replay_header(HeaderName::from_static("authorization"))
            .replay_header(HeaderName::from_static("connection"))
    })
    .await;
    let c = client();
    let body = json!({"a": 1});
    let first = send(post(&c, &s, "/items", "cookie", &body)).await;
    assert!(first.header("set-cookie").is_some());
    assert!(first.header("authorization").is_some());
    assert!(first.header("x-unlisted").is_some());
    let again = send(post(&c, &s, "/items", "cookie", &body)).await;
    assert!(again.replayed());
    assert_eq!(again.header("set-cookie"), None);
    assert_eq!(again.header("authorization"), None);
    assert_eq!(again.header("x-unlisted"), None);
    assert_eq!(again.header("x-allowlisted"), Some("run-1"));
    assert_eq!(s.executions(), 1);
}

/// `Idempotency-Key: abc` and `Idempotency-Key: "abc"` are one key.
pub async fn quoted_and_bare_keys_are_one_key(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"q": true});
    let first = send(post(&c, &s, "/items", "same-key", &body)).await;
    let quoted = send(post(&c, &s, "/items", "\"same-key\"", &body)).await;
    assert!(quoted.replayed(), "{quoted:?}");
    assert_eq!(quoted.body, first.body);
    let first_q = send(post(&c, &s, "/items", r#""q\"k""#, &body)).await;
    let bare = send(post(&c, &s, "/items", r#"q"k"#, &body)).await;
    assert!(!first_q.replayed());
    assert!(bare.replayed());
    assert_eq!(s.executions(), 2);
}

/// A duplicate while the first request runs gets 409 problem+json with `Retry-After` in whole
/// seconds (at least 1); once the first finishes, the duplicate gets the replay.
pub async fn in_flight_duplicate_gets_409_with_retry_after(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"slow": 1});
    let slow = tokio::spawn(send(
        post(&c, &s, "/items", "busy", &body).header(control::DELAY_MS, "700"),
    ));
    wait_for_executions(&s, 1).await;
    let dup = send(post(&c, &s, "/items", "busy", &body)).await;
    assert_problem(
        &dup,
        409,
        Refusal::InProgress {
            retry_after: Duration::ZERO,
        }
        .slug(),
    );
    let retry_after: u64 = dup
        .header("retry-after")
        .expect("Retry-After on 409")
        .parse()
        .expect("Retry-After in whole seconds");
    assert!(retry_after >= 1);
    let first = slow.await.expect("first request");
    assert_eq!(first.status, StatusCode::CREATED);
    let after = send(post(&c, &s, "/items", "busy", &body)).await;
    assert!(after.replayed());
    assert_eq!(after.body, first.body);
    assert_eq!(s.executions(), 1);
}

/// With `InFlight::Wait`, a duplicate waits for the first request and gets its replay.
pub async fn in_flight_wait_policy_replays(store: TestStore) {
    let policy = Policy::default().in_flight(InFlight::wait(Duration::from_secs(10)));
    let s = TestServer::with_store(store.store.clone(), policy, |l| l).await;
    let c = client();
    let body = json!({"wait": 1});
    let slow = tokio::spawn(send(
        post(&c, &s, "/items", "wait", &body).header(control::DELAY_MS, "500"),
    ));
    wait_for_executions(&s, 1).await;
    let dup = send(post(&c, &s, "/items", "wait", &body)).await;
    let first = slow.await.expect("first request");
    assert_eq!(dup.status, StatusCode::CREATED, "{dup:?}");
    assert!(dup.replayed());
    assert_eq!(dup.body, first.body);
    assert_eq!(s.executions(), 1);
}

/// Same key with a different body, query or content type: 422, and the handler does not run.
pub async fn different_request_gets_422(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"amount": 500});
    let first = send(post(&c, &s, "/items", "reuse", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let slug = Refusal::Mismatch.slug();
    let changed = send(post(&c, &s, "/items", "reuse", &json!({"amount": 501}))).await;
    assert_problem(&changed, 422, slug);
    assert_eq!(
        changed.json()["code"],
        "IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD"
    );
    let query = send(post(&c, &s, "/items?dry_run=1", "reuse", &body)).await;
    assert_problem(&query, 422, slug);
    let ctype = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "reuse")
            .header("content-type", "text/plain")
            .body(body.to_string()),
    )
    .await;
    assert_problem(&ctype, 422, slug);
    assert_eq!(s.executions(), 1);
    // The original request still replays.
    assert!(send(post(&c, &s, "/items", "reuse", &body))
        .await
        .replayed());
}

/// JSON bodies are compared in canonical form: key order and whitespace do not matter.
pub async fn json_key_order_is_the_same_request(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let send_raw = |raw: &'static str| {
        c.post(s.url("/items"))
            .header("idempotency-key", "canon")
            .header("content-type", "application/json")
            .body(raw)
    };
    let first = send(send_raw(r#"{"a":1,"b":{"c":2,"d":[1,2]}}"#)).await;
    let again = send(send_raw(r#"{ "b": {"d": [1, 2], "c": 2}, "a": 1 }"#)).await;
    assert!(!first.replayed());
    assert!(again.replayed(), "{again:?}");
    let swapped = send(send_raw(r#"{"a":1,"b":{"c":2,"d":[2,1]}}"#)).await;
    assert_problem(&swapped, 422, Refusal::Mismatch.slug());
    assert_eq!(s.executions(), 1);
}

/// No key: the request passes through (runs every time, no replay); with `required`, it gets
/// 400 "Idempotency-Key header is required" and the handler does not run.
pub async fn missing_key_passes_through_or_400_when_required(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    for n in 1..=2 {
        let r = send(c.post(s.url("/items")).json(&json!({"x": 1}))).await;
        assert_eq!(r.status, StatusCode::CREATED);
        assert!(!r.replayed());
        assert_eq!(r.execution(), n);
    }
    let strict =
        TestServer::with_store(store.store.clone(), Policy::default(), |l| l.required(true)).await;
    let r = send(c.post(strict.url("/items")).json(&json!({"x": 1}))).await;
    assert_problem(&r, 400, Refusal::KeyRequired.slug());
    assert!(r.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .contains("Idempotency-Key header is required"));
    assert_eq!(r.json()["title"], "Idempotency-Key header is required");
    assert_eq!(strict.executions(), 0);
    // Methods the layer does not cover never need a key.
    let get = send(c.get(strict.url("/items"))).await;
    assert_eq!(get.status, StatusCode::CREATED);
}

/// Empty, overlong (256 bytes), control-character, badly quoted, comma-joined and duplicated
/// keys get 400 and never run the handler; a 255-byte key is accepted.
pub async fn malformed_keys_get_400(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let slug = Refusal::KeyInvalid(idempotency_tower::KeyHeaderError::AmbiguousComma).slug();
    let bad: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"\"\"".to_vec(),
        vec![b'k'; 256],
        b"tab\there".to_vec(),
        "c1-control-\u{85}".as_bytes().to_vec(),
        b"\"unterminated".to_vec(),
        b"\"bad\\escape\"".to_vec(),
        b"\"after\"quote".to_vec(),
        b"joined, by-proxy".to_vec(),
        b"\xff\xfe".to_vec(),
    ];
    for key in bad {
        let value = reqwest::header::HeaderValue::from_bytes(&key).expect("sendable header");
        let r = send(
            c.post(s.url("/items"))
                .header("idempotency-key", value)
                .json(&json!({"x": 1})),
        )
        .await;
        assert_problem(&r, 400, slug);
    }
    // Two field lines; reqwest sends each appended value on its own line.
    let dup = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "one")
            .header("idempotency-key", "one")
            .json(&json!({"x": 1})),
    )
    .await;
    assert_problem(&dup, 400, slug);
    assert!(dup.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .contains("times"));
    assert_eq!(s.executions(), 0);
    let longest = "k".repeat(255);
    let ok = send(post(&c, &s, "/items", &longest, &json!({"x": 1}))).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(s.executions(), 1);
}

/// A body over the limit gets 413 whether its length is declared or it is chunked, and the
/// handler does not run; a body at the limit is accepted.
pub async fn oversized_body_gets_413(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.body_limit(1024)
    })
    .await;
    let c = client();
    let slug = Refusal::BodyTooLarge { limit: 0 }.slug();
    let big = "x".repeat(1025);
    let declared = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "big")
            .header("content-type", "text/plain")
            .body(big.clone()),
    )
    .await;
    assert_problem(&declared, 413, slug);
    // The unread rest of the body makes the connection unusable; the layer says so.
    assert_eq!(declared.header("connection"), Some("close"));
    let chunks: Vec<Result<Bytes, std::io::Error>> =
        (0..5).map(|_| Ok(Bytes::from(vec![b'y'; 300]))).collect();
    let chunked = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "big-chunked")
            .header("content-type", "text/plain")
            .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks))),
    )
    .await;
    assert_problem(&chunked, 413, slug);
    assert_eq!(s.executions(), 0);
    let at_limit = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "fits")
            .header("content-type", "text/plain")
            .body("z".repeat(1024)),
    )
    .await;
    assert_eq!(at_limit.status, StatusCode::CREATED);
    // The refused key was never claimed: it works once the body fits.
    let retry = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "big")
            .header("content-type", "text/plain")
            .body("small"),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(s.executions(), 2);
}

/// Methods outside the covered set pass through with their key; the set is configurable.
pub async fn uncovered_methods_pass_through(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    for n in 1..=2 {
        let r = send(
            c.put(s.url("/items"))
                .header("idempotency-key", "put")
                .json(&json!({})),
        )
        .await;
        assert!(!r.replayed());
        assert_eq!(r.execution(), n);
    }
    let covered = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.methods([Method::PUT])
    })
    .await;
    let put = || {
        c.put(covered.url("/items"))
            .header("idempotency-key", "put")
            .json(&json!({}))
    };
    let a = send(put()).await;
    let b = send(put()).await;
    assert!(!a.replayed());
    assert!(b.replayed());
    // POST is no longer covered there.
    let p1 = send(post(&c, &covered, "/items", "post", &json!({}))).await;
    let p2 = send(post(&c, &covered, "/items", "post", &json!({}))).await;
    assert!(!p1.replayed() && !p2.replayed());
    assert_eq!(covered.executions(), 3);
}

/// 5xx, 408 and 429 are delivered but not stored: the key is released and the retry runs the
/// handler. A deterministic client error (404, 400) is stored and replayed.
pub async fn server_errors_408_429_release_the_key(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let mut expected = 0;
    for code in ["500", "503", "408", "429"] {
        let key = format!("released-{code}");
        let body = json!({"code": code});
        let failed = send(post(&c, &s, "/items", &key, &body).header(control::STATUS, code)).await;
        expected += 1;
        assert_eq!(failed.status.as_str(), code);
        assert!(!failed.replayed());
        let retry = send(post(&c, &s, "/items", &key, &body)).await;
        expected += 1;
        assert_eq!(retry.status, StatusCode::CREATED, "retry after {code}");
        assert!(!retry.replayed(), "a {code} is never replayed");
        assert_eq!(retry.execution(), expected);
    }
    for code in ["404", "400"] {
        let key = format!("stored-{code}");
        let body = json!({"code": code});
        let first = send(post(&c, &s, "/items", &key, &body).header(control::STATUS, code)).await;
        expected += 1;
        let again = send(post(&c, &s, "/items", &key, &body)).await;
        assert_eq!(again.status.as_str(), code);
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
    }
    assert_eq!(s.executions(), expected);
}

/// Asserts `reply` is the answer for a handler that ran but whose response was not kept: the
/// handler's `status` and `Location`, a `idempotency-response-not-replayable` problem document
/// as the body, marked replayed when `replayed`.
pub fn assert_not_replayable(reply: &Reply, status: u16, location: Option<&str>, replayed: bool) {
    assert_eq!(reply.status.as_u16(), status, "status of {reply:?}");
    assert_eq!(
        reply.header("content-type"),
        Some(idempotency_tower::PROBLEM_JSON),
        "content type of {reply:?}"
    );
    let doc = reply.json();
    assert!(
        doc["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("idempotency-response-not-replayable")),
        "{doc}"
    );
    assert_eq!(doc["status"], status, "{doc}");
    assert_eq!(
        reply.header("location"),
        location,
        "the stored Location is kept"
    );
    assert_eq!(reply.replayed(), replayed, "{reply:?}");
}

/// A streaming response (no exact size) that ends within the response limit is stored and
/// replayed. A response over the limit, declared or streamed, is delivered whole, and its key
/// records that the handler ran: the retry gets the original status and `Location` with a
/// `idempotency-response-not-replayable` problem document, and the handler does not run again.
pub async fn small_streams_are_stored_oversized_responses_run_once(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.response_limit(2048)
    })
    .await;
    let c = client();
    let body = json!({"s": 1});
    let streamed = send(post(&c, &s, "/items", "stream", &body).header(control::STREAM, "1")).await;
    assert_eq!(streamed.status, StatusCode::CREATED);
    assert!(!streamed.replayed());
    assert_eq!(&streamed.body[..], b"chunk-1-0;chunk-1-1;chunk-1-2;");
    let again = send(post(&c, &s, "/items", "stream", &body).header(control::STREAM, "1")).await;
    assert!(again.replayed(), "a small stream is stored: {again:?}");
    assert_eq!(again.body, streamed.body);
    assert_eq!(again.header("location"), streamed.header("location"));
    assert_eq!(s.executions(), 1);

    let large = send(post(&c, &s, "/items", "large", &body).header(control::LARGE, "4096")).await;
    assert_eq!(large.status, StatusCode::CREATED);
    assert_eq!(large.body.len(), 4096);
    assert_eq!(large.body[0], b'2');
    let again = send(post(&c, &s, "/items", "large", &body).header(control::LARGE, "4096")).await;
    assert_not_replayable(&again, 201, large.header("location"), true);
    assert_eq!(
        s.executions(),
        2,
        "an oversized response is not a second execution"
    );

    // A stream that passes the limit while it is read is delivered whole too.
    let big_stream =
        send(post(&c, &s, "/items", "big-stream", &body).header(control::STREAM_LARGE, "4100"))
            .await;
    assert_eq!(big_stream.status, StatusCode::CREATED);
    assert_eq!(big_stream.body.len(), 4100);
    assert_eq!(big_stream.body[0], b'3');
    assert!(big_stream.body[1..].iter().all(|&b| b == b's'));
    let again = send(post(&c, &s, "/items", "big-stream", &body)).await;
    assert_not_replayable(&again, 201, big_stream.header("location"), true);
    assert_eq!(s.executions(), 3);

    // At the limit it is stored, streamed or not.
    let fits = send(post(&c, &s, "/items", "fits", &body).header(control::LARGE, "2048")).await;
    let replay = send(post(&c, &s, "/items", "fits", &body).header(control::LARGE, "2048")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, fits.body);
    let fits_stream =
        send(post(&c, &s, "/items", "fits-stream", &body).header(control::STREAM_LARGE, "2048"))
            .await;
    let replay = send(post(&c, &s, "/items", "fits-stream", &body)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, fits_stream.body);
    assert_eq!(s.executions(), 5);
}

/// A response body that fails after the handler ran: by default the key records that the
/// handler ran, and the client and its retries get the not-replayable answer (handler not run
/// again). With `Unreplayable::Release`, the client gets 500 and the retry runs the handler,
/// and an oversized response releases the key too.
pub async fn unreplayable_responses_are_recorded_or_released(store: TestStore) {
    let c = client();
    let body = json!({"f": 1});
    let s = server(&store).await;
    let failed =
        send(post(&c, &s, "/items", "fails", &body).header(control::STREAM_FAIL, "1")).await;
    assert_not_replayable(&failed, 201, Some("/items/1"), false);
    assert_eq!(failed.json()["reason"], "body_failed");
    let again = send(post(&c, &s, "/items", "fails", &body)).await;
    assert_not_replayable(&again, 201, Some("/items/1"), true);
    assert_eq!(s.executions(), 1, "a failed body is not a second execution");

    let released = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.response_limit(1024)
            .unreplayable(idempotency_tower::Unreplayable::Release)
    })
    .await;
    let failed = send(
        post(&c, &released, "/items", "fails-released", &body).header(control::STREAM_FAIL, "1"),
    )
    .await;
    assert_problem(&failed, 500, Refusal::HandlerFailed.slug());
    let retry = retry_while_409(|| post(&c, &released, "/items", "fails-released", &body)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    let large =
        send(post(&c, &released, "/items", "large-released", &body).header(control::LARGE, "2000"))
            .await;
    assert_eq!(large.body.len(), 2000);
    let again =
        send(post(&c, &released, "/items", "large-released", &body).header(control::LARGE, "2000"))
            .await;
    assert!(!again.replayed());
    assert_eq!(again.body.len(), 2000);
    assert_eq!(released.executions(), 4);
}

/// A handler that panics gets a 500 problem, and the key is released so the retry runs.
pub async fn handler_panic_releases_the_key(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"p": 1});
    let panicked = send(post(&c, &s, "/items", "panic", &body).header(control::PANIC, "1")).await;
    assert_problem(&panicked, 500, Refusal::HandlerFailed.slug());
    // The key is released by a background write; give it a moment on slow stores.
    let retry = retry_while_409(|| post(&c, &s, "/items", "panic", &body)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(s.executions(), 2);
}

/// The store is down: 503 problem and the handler does not run (fail closed); with
/// `fail_open`, the handler runs unprotected. When the store is back, keys work again.
pub async fn store_outage_fails_closed_or_open(store: TestStore) {
    let outage = Outage::new(store.store.clone());
    let closed = TestServer::with_store(outage.clone(), Policy::default(), |l| l).await;
    let open =
        TestServer::with_store(outage.clone(), Policy::default(), |l| l.fail_open(true)).await;
    let c = client();
    let body = json!({"o": 1});
    outage.set_down(true);
    let r = send(post(&c, &closed, "/items", "outage", &body)).await;
    assert_problem(&r, 503, Refusal::StoreUnavailable(String::new()).slug());
    assert!(
        !String::from_utf8_lossy(&r.body).contains("injected"),
        "store internals leak: {r:?}"
    );
    assert_eq!(closed.executions(), 0);
    let o = send(post(&c, &open, "/items", "outage", &body)).await;
    assert_eq!(o.status, StatusCode::CREATED);
    assert!(!o.replayed());
    assert_eq!(open.executions(), 1);
    outage.set_down(false);
    let first = send(post(&c, &closed, "/items", "outage", &body)).await;
    let again = send(post(&c, &closed, "/items", "outage", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(closed.executions(), 1);
}

/// 64 concurrent requests with one key: the handler runs once; every other request gets 409 or
/// the replay of that one response.
pub async fn concurrent_duplicates_run_once(store: TestStore) {
    let s = Arc::new(server(&store).await);
    let c = client();
    let body = json!({"race": true});
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (c, s, body) = (c.clone(), s.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            send(post(&c, &s, "/items", "race", &body).header(control::DELAY_MS, "200")).await
        }));
    }
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.expect("request task"));
    }
    let fresh: Vec<_> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
        .collect();
    assert_eq!(fresh.len(), 1, "exactly one request runs the handler");
    for r in &replies {
        match r.status {
            StatusCode::CREATED if r.replayed() => assert_eq!(r.body, fresh[0].body),
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => assert_problem(
                r,
                409,
                Refusal::InProgress {
                    retry_after: Duration::ZERO,
                }
                .slug(),
            ),
            other => panic!("unexpected {other}: {r:?}"),
        }
    }
    assert_eq!(s.executions(), 1);
}

/// Records never cross scopes: two callers using the same key run separately; a caller the
/// scope function cannot identify gets 401.
pub async fn scopes_isolate_callers(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.scope(|req| req.extensions.get::<Principal>().map(|p| p.0.clone()))
    })
    .await;
    let c = client();
    let body = json!({"s": 1});
    let alice =
        send(post(&c, &s, "/items", "shared", &body).header(control::PRINCIPAL, "alice")).await;
    let bob = send(post(&c, &s, "/items", "shared", &body).header(control::PRINCIPAL, "bob")).await;
    assert!(!alice.replayed() && !bob.replayed());
    assert_ne!(alice.execution(), bob.execution());
    let alice2 =
        send(post(&c, &s, "/items", "shared", &body).header(control::PRINCIPAL, "alice")).await;
    assert!(alice2.replayed());
    assert_eq!(alice2.body, alice.body);
    let anon = send(post(&c, &s, "/items", "shared", &body)).await;
    assert_problem(&anon, 401, Refusal::CallerUnidentified.slug());
    // A different route is a different operation, so the key is free there.
    let other =
        send(post(&c, &s, "/items/7", "shared", &body).header(control::PRINCIPAL, "alice")).await;
    assert!(!other.replayed());
    assert_eq!(s.executions(), 3);
}

/// Refusals use the configured problem type base, or a user's own error format.
pub async fn refusals_are_pluggable(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.required(true)
            .problem_type_base("https://api.example.test/errors/")
    })
    .await;
    let c = client();
    let r = send(c.post(s.url("/items")).json(&json!({}))).await;
    assert_problem(&r, 400, "idempotency-key-required");
    assert_eq!(
        r.json()["type"],
        "https://api.example.test/errors/idempotency-key-required"
    );

    let custom = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.responder(|refusal: &Refusal| {
            let body =
                json!({"error": {"code": refusal.code(), "retryable": refusal.is_retryable()}});
            http::Response::builder()
                .status(refusal.status())
                .header("content-type", "application/vnd.custom+json")
                .body(Bytes::from(body.to_string()))
                .unwrap_or_default()
        })
    })
    .await;
    let body = json!({"c": 1});
    let slow = tokio::spawn(send(
        post(&c, &custom, "/items", "custom", &body).header(control::DELAY_MS, "400"),
    ));
    wait_for_executions(&custom, 1).await;
    let busy = send(post(&c, &custom, "/items", "custom", &body)).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(
        busy.header("content-type"),
        Some("application/vnd.custom+json")
    );
    assert_eq!(busy.json()["error"]["code"], "IDEMPOTENCY_KEY_IN_PROGRESS");
    assert_eq!(busy.json()["error"]["retryable"], true);
    assert!(
        busy.header("retry-after").is_some(),
        "the layer adds Retry-After"
    );
    let mismatch = send(post(&c, &custom, "/items", "custom", &json!({"c": 2}))).await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        mismatch.json()["error"]["code"],
        "IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD"
    );
    assert_eq!(
        slow.await.expect("first request").status,
        StatusCode::CREATED
    );
}

/// A stored outcome that is not a response this layer wrote answers 500, never panics, and is
/// left as it is.
pub async fn corrupt_stored_response_is_500(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.route(|p| p.uri.path().to_owned())
    })
    .await;
    let body = json!({"corrupt": 1});
    let raw = body.to_string();
    let fingerprint = Fingerprint::builder()
        .method("POST")
        .path("/items")
        .content_type("application/json")
        .body(raw.as_bytes())
        .finish();
    let id = RecordId::new(
        http_scope("anonymous", &Method::POST, "/items").expect("scope"),
        IdempotencyKey::new("corrupt").expect("key"),
    );
    let claim = store
        .store
        .claim(&ClaimRequest {
            id: id.clone(),
            fingerprint,
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("claim");
    let idempotency_core::Claim::Claimed { token, .. } = claim else {
        panic!("fresh key must be claimed: {claim:?}")
    };
    store
        .store
        .complete(
            &id,
            token,
            b"{\"not\":\"a stored response\"}",
            Duration::from_secs(3600),
        )
        .await
        .expect("complete");
    let c = client();
    for _ in 0..2 {
        let r = send(post(&c, &s, "/items", "corrupt", &body)).await;
        assert_problem(
            &r,
            500,
            Refusal::StoredResponseUnreadable(String::new()).slug(),
        );
    }
    assert_eq!(s.executions(), 0);
    let record = store
        .store
        .get(&id)
        .await
        .expect("get")
        .expect("record kept");
    assert_eq!(
        record.outcome.as_deref(),
        Some(&b"{\"not\":\"a stored response\"}"[..])
    );
}

/// A client that times out and retries gets the response of the first attempt: the handler
/// is not cancelled by the disconnect, runs once, and its outcome is stored.
pub async fn client_timeout_then_retry_gets_the_same_response(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"t": 1});
    let timed_out = post(&c, &s, "/items", "timeout", &body)
        .header(control::DELAY_MS, "600")
        .timeout(Duration::from_millis(150))
        .send()
        .await;
    assert!(
        timed_out.is_err_and(|e| e.is_timeout()),
        "the client must time out"
    );
    let retry = retry_while_409(|| post(&c, &s, "/items", "timeout", &body)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.execution(), 1);
    assert_eq!(s.executions(), 1);
}

/// After a released failure (a 500), a retry with a corrected body runs: nothing took effect
/// under the key, so it is not a mismatch.
pub async fn released_key_accepts_corrected_request(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let failed =
        send(post(&c, &s, "/items", "fix", &json!({"v": 1})).header(control::STATUS, "500")).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let corrected = send(post(&c, &s, "/items", "fix", &json!({"v": 2}))).await;
    assert_eq!(corrected.status, StatusCode::CREATED);
    assert_eq!(corrected.json()["received"], json!({"v": 2}));
    let replay = send(post(&c, &s, "/items", "fix", &json!({"v": 2}))).await;
    assert!(replay.replayed());
    let old = send(post(&c, &s, "/items", "fix", &json!({"v": 1}))).await;
    assert_problem(&old, 422, Refusal::Mismatch.slug());
    assert_eq!(s.executions(), 2);
}

async fn wait_for_executions(s: &TestServer, n: u64) {
    let start = Instant::now();
    while s.executions() < n {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "handler never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Sends the request until it is not 409 (at most 10 s), as a client honouring the conflict
/// would.
async fn retry_while_409(make: impl Fn() -> reqwest::RequestBuilder) -> Reply {
    let start = Instant::now();
    loop {
        let r = send(make()).await;
        if r.status != StatusCode::CONFLICT || start.elapsed() > Duration::from_secs(10) {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A handler that runs longer than its lease is not run a second time by a retry: the layer
/// extends the lease while the handler runs. (300 ms lease, 1.5 s handler, retry at 700 ms:
/// 409, then the replay.)
pub async fn handler_outliving_its_lease_runs_once(store: TestStore) {
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .ttl(store.long());
    let s = Arc::new(TestServer::with_store(store.store.clone(), policy, |l| l).await);
    let c = client();
    let body = json!({"slow": true});
    let first = {
        let (c, s, body) = (c.clone(), s.clone(), body.clone());
        tokio::spawn(async move {
            send(post(&c, &s, "/items", "slow", &body).header(control::DELAY_MS, "1500")).await
        })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    // Time passes on the store's clock too (a manual clock only moves when told).
    store.advance(Duration::from_millis(400)).await;
    let retry = send(post(&c, &s, "/items", "slow", &body)).await;
    assert_eq!(
        retry.status,
        StatusCode::CONFLICT,
        "a retry while a handler outlives its lease must get 409, got {retry:?}"
    );
    let first = first.await.expect("first request");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    let after = send(post(&c, &s, "/items", "slow", &body)).await;
    assert_eq!(after.status, StatusCode::CREATED, "{after:?}");
    assert!(
        after.replayed(),
        "the retry after the slow handler: {after:?}"
    );
    assert_eq!(s.executions(), 1, "the slow handler ran twice");
}

/// The handler ran but its response cannot be stored (every completion fails): the client
/// still gets the response, and a retry is told 409 until the lease passes instead of running
/// the handler again.
pub async fn failed_completion_does_not_rerun_handler(store: TestStore) {
    let flaky = FlakyStore::new(store.store.clone(), Fault::Refused);
    flaky.inject(FlakyOp::Complete, u64::MAX / 2);
    let policy = Policy::default().lease(store.long()).ttl(store.long());
    let s = TestServer::with_store(Arc::new(flaky.clone()), policy, |l| l).await;
    let c = client();
    let body = json!({"charge": 1});
    let first = send(post(&c, &s, "/items", "unstored", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(flaky.injected() > 0, "no completion was attempted");
    flaky.heal(FlakyOp::Complete);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let retry = send(post(&c, &s, "/items", "unstored", &body)).await;
    assert_eq!(
        retry.status,
        StatusCode::CONFLICT,
        "a retry after a failed completion must wait for the lease, got {retry:?}"
    );
    assert_eq!(
        s.executions(),
        1,
        "the handler ran again after a failed completion"
    );
}

fn patch(c: &reqwest::Client, s: &TestServer, key: &str, body: &Value) -> reqwest::RequestBuilder {
    c.patch(s.url("/items/1"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// Preconditions are part of the request. A PATCH answered 412 (stored: a deterministic
/// client error) is replayed to the same retry, but the same key with a fresh `If-Match` is a
/// different request: 422, never the stored 412; a new key with the fresh precondition runs.
/// With `fingerprint_headers([])` preconditions do not count (the stored 412 is replayed).
/// A request without preconditions keeps the fingerprint it had before headers counted: a
/// record stored under that fingerprint is replayed.
pub async fn preconditions_are_part_of_the_request(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"title": "Kindred"});
    let stale = send(
        patch(&c, &s, "edit-1", &body)
            .header("if-match", "\"v1\"")
            .header(control::STATUS, "412"),
    )
    .await;
    assert_eq!(stale.status, StatusCode::PRECONDITION_FAILED);
    let same = send(patch(&c, &s, "edit-1", &body).header("if-match", "\"v1\"")).await;
    assert_eq!(same.status, StatusCode::PRECONDITION_FAILED);
    assert!(
        same.replayed(),
        "the same precondition is the same request: {same:?}"
    );
    let fresh = send(patch(&c, &s, "edit-1", &body).header("if-match", "\"v2\"")).await;
    assert_problem(&fresh, 422, Refusal::Mismatch.slug());
    for other in ["if-none-match", "if-unmodified-since", "if-modified-since"] {
        let r = send(
            patch(&c, &s, "edit-1", &body)
                .header("if-match", "\"v1\"")
                .header(other, "Sun, 06 Nov 1994 08:49:37 GMT"),
        )
        .await;
        assert_problem(&r, 422, Refusal::Mismatch.slug());
    }
    // One If-Match line or two (as an intermediary may send them) is one request.
    let one = send(patch(&c, &s, "edit-2", &body).header("if-match", "\"v2\", \"v3\"")).await;
    let two = send(
        patch(&c, &s, "edit-2", &body)
            .header("if-match", "\"v2\"")
            .header("if-match", "\"v3\""),
    )
    .await;
    assert_eq!(one.status, StatusCode::CREATED);
    assert!(two.replayed(), "{two:?}");
    let new_key = send(patch(&c, &s, "edit-3", &body).header("if-match", "\"v2\"")).await;
    assert_eq!(new_key.status, StatusCode::CREATED);
    assert!(!new_key.replayed());
    assert_eq!(s.executions(), 3);

    let unlisted = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.fingerprint_headers([])
    })
    .await;
    let first = send(
        patch(&c, &unlisted, "edit-u", &body)
            .header("if-match", "\"v1\"")
            .header(control::STATUS, "412"),
    )
    .await;
    assert_eq!(first.status, StatusCode::PRECONDITION_FAILED);
    let again = send(patch(&c, &unlisted, "edit-u", &body).header("if-match", "\"v2\"")).await;
    assert_eq!(again.status, StatusCode::PRECONDITION_FAILED);
    assert!(
        again.replayed(),
        "without preconditions in the fingerprint: {again:?}"
    );

    // A record stored under the fingerprint without headers (as before they counted).
    let raw = body.to_string();
    let fingerprint = Fingerprint::builder()
        .method("PATCH")
        .path("/items/1")
        .content_type("application/json")
        .body(raw.as_bytes())
        .finish();
    let id = RecordId::new(
        // The layer's route is axum's matched template (the suite enables the `axum` feature).
        http_scope("anonymous", &Method::PATCH, "/items/:id").expect("scope"),
        IdempotencyKey::new("stored-before").expect("key"),
    );
    seed(
        &store,
        &id,
        fingerprint,
        StatusCode::OK,
        b"{\"seeded\":true}",
    )
    .await;
    let r = send(patch(&c, &s, "stored-before", &body)).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert!(r.replayed());
    assert_eq!(r.json()["seeded"], true);
    assert_eq!(s.executions(), 3);
}

/// Stores a completed record with a replayable response, as an older version of the layer did.
async fn seed(store: &TestStore, id: &RecordId, fp: Fingerprint, status: StatusCode, body: &[u8]) {
    let claim = store
        .store
        .claim(&ClaimRequest {
            id: id.clone(),
            fingerprint: fp,
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(3600),
        })
        .await
        .expect("claim");
    let idempotency_core::Claim::Claimed { token, .. } = claim else {
        panic!("fresh key must be claimed: {claim:?}")
    };
    let stored = idempotency_tower::StoredResponse {
        status,
        headers: vec![(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )],
        body: Bytes::copy_from_slice(body),
        not_replayable: None,
    };
    let encoded = stored.encode();
    assert_eq!(&encoded[..4], b"IDR\x01", "the first format");
    store
        .store
        .complete(id, token, &encoded, Duration::from_secs(3600))
        .await
        .expect("complete");
}

/// Equivalent media types are one request (`application/json`, with `charset=utf-8`, in
/// another case; parameters in another order or quoted); another media type is another
/// request. Query order stays significant.
pub async fn equivalent_media_types_are_one_request(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let with_type = |key: &str, path: &str, ct: &str| {
        c.post(s.url(path))
            .header("idempotency-key", key)
            .header("content-type", ct)
            .body(r#"{"a":1}"#)
    };
    let first = send(with_type("media", "/items", "application/json")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for same in [
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/json;charset=\"UTF-8\"",
    ] {
        let r = send(with_type("media", "/items", same)).await;
        assert!(r.replayed(), "{same}: {r:?}");
        assert_eq!(r.body, first.body);
    }
    for other in [
        "text/plain",
        "application/json; charset=latin1",
        "text/json",
    ] {
        let r = send(with_type("media", "/items", other)).await;
        assert_problem(&r, 422, Refusal::Mismatch.slug());
    }
    let params = send(with_type("params", "/items", "text/plain; b=\"2\"; A=1")).await;
    let reordered = send(with_type("params", "/items", "text/plain;a=1;b=2")).await;
    assert!(!params.replayed());
    assert!(reordered.replayed(), "{reordered:?}");
    let query = send(with_type("query", "/items?a=1&b=2", "application/json")).await;
    let swapped = send(with_type("query", "/items?b=2&a=1", "application/json")).await;
    assert!(!query.replayed());
    assert_problem(&swapped, 422, Refusal::Mismatch.slug());
    assert_eq!(s.executions(), 3);
}

/// The key sent as a structured-field string with parameters (`"abc";v=1`) is the key `abc`;
/// quoted values that are not one string item are still refused.
pub async fn structured_field_key_parameters_are_read(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"sf": 1});
    let first = send(post(&c, &s, "/items", "\"sf-key\";v=1", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    for same in [
        "sf-key",
        "\"sf-key\"",
        "\"sf-key\";v=2;ts=\"x\"",
        "\"sf-key\"; v=1",
    ] {
        let r = send(post(&c, &s, "/items", same, &body)).await;
        assert!(r.replayed(), "{same}: {r:?}");
    }
    let slug = Refusal::KeyInvalid(idempotency_tower::KeyHeaderError::AmbiguousComma).slug();
    for bad in [
        "\"a\", \"b\"",
        "\"sf-key\";V=1",
        "\"sf-key\" ;v=1",
        "\"sf-key\";v=",
    ] {
        let r = send(post(&c, &s, "/items", bad, &body)).await;
        assert_problem(&r, 400, slug);
    }
    assert_eq!(s.executions(), 1);
}

/// A caller the scope function cannot identify gets 401 with a `WWW-Authenticate` challenge
/// (`Bearer` by default, configurable).
pub async fn unidentified_caller_gets_a_challenge(store: TestStore) {
    let scoped = |l: idempotency_tower::IdempotencyLayer| {
        l.scope(|req| req.extensions.get::<Principal>().map(|p| p.0.clone()))
    };
    let s = TestServer::with_store(store.store.clone(), Policy::default(), scoped).await;
    let c = client();
    let r = send(post(&c, &s, "/items", "who", &json!({}))).await;
    assert_problem(&r, 401, Refusal::CallerUnidentified.slug());
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let custom = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        scoped(l).unidentified_challenge(http::HeaderValue::from_static("Basic realm=\"api\""))
    })
    .await;
    let r = send(post(&c, &custom, "/items", "who", &json!({}))).await;
    assert_problem(&r, 401, Refusal::CallerUnidentified.slug());
    assert_eq!(r.header("www-authenticate"), Some("Basic realm=\"api\""));
    assert_eq!(s.executions() + custom.executions(), 0);
}

fn retry_after(r: &Reply) -> u64 {
    r.header("retry-after")
        .unwrap_or_else(|| panic!("no Retry-After on {r:?}"))
        .parse()
        .expect("Retry-After in whole seconds")
}

/// `Retry-After` on 409 is capped (5 s by default, configurable) and, with the wait policy,
/// what is left of the lease after the wait; 503 carries `Retry-After` (1 s by default,
/// configurable).
pub async fn retry_after_is_capped_recomputed_and_sent_on_503(store: TestStore) {
    let c = client();
    // The default lease is 30 s: the 409 says 5.
    let s = server(&store).await;
    let body = json!({"ra": 1});
    let slow = tokio::spawn(send(
        post(&c, &s, "/items", "ra", &body).header(control::DELAY_MS, "600"),
    ));
    wait_for_executions(&s, 1).await;
    let dup = send(post(&c, &s, "/items", "ra", &body)).await;
    assert_problem(&dup, 409, "idempotency-key-in-progress");
    assert_eq!(retry_after(&dup), 5, "{dup:?}");
    assert_eq!(dup.json()["retry_after"], 5);
    slow.await.expect("first request");

    // A 4 s lease, waited on for 2 s: at most 2 s are left when the duplicate is answered.
    let policy = Policy::default()
        .lease(Duration::from_secs(4))
        .in_flight(InFlight::wait(Duration::from_secs(2)));
    let waiting = TestServer::with_store(store.store.clone(), policy, |l| {
        l.max_retry_after(Duration::from_secs(60))
    })
    .await;
    let slow = tokio::spawn(send(
        post(&c, &waiting, "/items", "ra-wait", &body).header(control::DELAY_MS, "3500"),
    ));
    wait_for_executions(&waiting, 1).await;
    let dup = send(post(&c, &waiting, "/items", "ra-wait", &body)).await;
    assert_problem(&dup, 409, "idempotency-key-in-progress");
    let after = retry_after(&dup);
    assert!(
        (1..=2).contains(&after),
        "Retry-After {after} after a 2 s wait on a 4 s lease"
    );
    slow.await.expect("first request");

    let outage = Outage::new(store.store.clone());
    let down = TestServer::with_store(outage.clone(), Policy::default(), |l| l).await;
    let custom = TestServer::with_store(outage.clone(), Policy::default(), |l| {
        l.unavailable_retry_after(Duration::from_secs(3))
    })
    .await;
    outage.set_down(true);
    let r = send(post(&c, &down, "/items", "ra-down", &body)).await;
    assert_problem(&r, 503, Refusal::StoreUnavailable(String::new()).slug());
    assert_eq!(retry_after(&r), 1);
    let r = send(post(&c, &custom, "/items", "ra-down", &body)).await;
    assert_eq!(retry_after(&r), 3);
}

fn outcome_header(l: idempotency_tower::IdempotencyLayer) -> idempotency_tower::IdempotencyLayer {
    l.on_response(|ctx, headers| {
        let label = ctx.outcome().map_or("replayed", |o| o.as_str());
        headers.insert("x-test-outcome", http::HeaderValue::from_static(label));
    })
}

/// A handler that outlives its lease without a heartbeat loses the key to a retry; its
/// completion is fenced and recorded as `lease_lost` (its client still gets its response),
/// and the retry's response is the one stored.
pub async fn lost_lease_is_its_own_outcome(store: TestStore) {
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .heartbeat(None)
        .ttl(store.long());
    let s = Arc::new(TestServer::with_store(store.store.clone(), policy, outcome_header).await);
    let c = client();
    let body = json!({"lost": 1});
    let first = {
        let (c, s, body) = (c.clone(), s.clone(), body.clone());
        tokio::spawn(async move {
            send(post(&c, &s, "/items", "lost", &body).header(control::DELAY_MS, "2000")).await
        })
    };
    wait_for_executions(&s, 1).await;
    // The lease passes (a real-time store sleeps; a manual clock moves).
    store.advance(Duration::from_millis(600)).await;
    assert!(!first.is_finished(), "the first handler is still running");
    let takeover = send(post(&c, &s, "/items", "lost", &body)).await;
    assert_eq!(takeover.status, StatusCode::CREATED, "{takeover:?}");
    assert_eq!(
        takeover.header("x-test-outcome"),
        Some("stored"),
        "{takeover:?}"
    );
    assert_eq!(takeover.execution(), 2);
    let first = first.await.expect("first request");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.execution(), 1);
    assert_eq!(
        first.header("x-test-outcome"),
        Some("lease_lost"),
        "{first:?}"
    );
    let replay = send(post(&c, &s, "/items", "lost", &body)).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("x-test-outcome"), Some("replayed"));
    assert_eq!(
        replay.execution(),
        2,
        "the fenced completion did not overwrite the record"
    );
}

/// The key header name is configurable, a validator publishes the API's key format (refused
/// keys get 400 `idempotency-key-invalid` with its message), and the replay marker is
/// configurable or off.
pub async fn key_header_validator_and_replay_marker_are_configurable(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.key_header(HeaderName::from_static("x-request-key"))
            .validate_key(|key| {
                let s = key.as_str();
                let ok = s.len() == 36
                    && s.char_indices().all(|(i, ch)| match i {
                        8 | 13 | 18 | 23 => ch == '-',
                        _ => ch.is_ascii_hexdigit(),
                    });
                ok.then_some(()).ok_or_else(|| "keys are UUIDs".to_owned())
            })
            .replayed_header(Some((
                HeaderName::from_static("x-cache"),
                http::HeaderValue::from_static("replay"),
            )))
    })
    .await;
    let c = client();
    let body = json!({"k": 1});
    let with_key = |key: &str| {
        c.post(s.url("/items"))
            .header("x-request-key", key)
            .json(&body)
    };
    let bad = send(with_key("not-a-uuid")).await;
    assert_problem(&bad, 400, "idempotency-key-invalid");
    assert!(
        bad.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("keys are UUIDs")),
        "{bad:?}"
    );
    assert_eq!(s.executions(), 0);
    let uuid = "8e2c1f0a-5b7d-4c3e-9f21-0a6b7c8d9e10";
    let first = send(with_key(uuid)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(with_key(uuid)).await;
    assert_eq!(again.header("x-cache"), Some("replay"));
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(again.body, first.body);
    // The default header is not read there: the request passes through.
    let other = send(post(&c, &s, "/items", uuid, &body)).await;
    assert!(other.header("x-cache").is_none());
    assert_eq!(s.executions(), 2);

    let unmarked = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.replayed_header(None)
    })
    .await;
    let first = send(post(&c, &unmarked, "/items", "unmarked", &body)).await;
    let again = send(post(&c, &unmarked, "/items", "unmarked", &body)).await;
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(again.body, first.body);
    assert_eq!(unmarked.executions(), 1);
}

/// The response hook adds headers to fresh and replayed responses, knowing which is which and
/// when the key expires; its headers are not stored.
pub async fn response_hook_sees_fresh_and_replayed(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.on_response(|ctx, headers| {
            let replay = if ctx.is_replay() { "true" } else { "false" };
            headers.insert("x-hook-replay", http::HeaderValue::from_static(replay));
            headers.insert(
                "x-hook-key",
                http::HeaderValue::from_str(ctx.key().as_str()).expect("a header value"),
            );
            if let Some(at) = ctx.expires_at() {
                let secs = at
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                headers.insert("x-hook-expires", http::HeaderValue::from(secs));
            }
        })
        .replay_header(HeaderName::from_static("x-hook-replay"))
    })
    .await;
    let c = client();
    let body = json!({"h": 1});
    let first = send(post(&c, &s, "/items", "hooked", &body)).await;
    assert_eq!(first.header("x-hook-replay"), Some("false"));
    assert_eq!(first.header("x-hook-key"), Some("hooked"));
    let again = send(post(&c, &s, "/items", "hooked", &body)).await;
    assert!(again.replayed());
    assert_eq!(
        again.header("x-hook-replay"),
        Some("true"),
        "hook headers are set on each answer, not stored: {again:?}"
    );
    let expiry = |r: &Reply| -> i64 {
        r.header("x-hook-expires")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no expiry on {r:?}"))
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    let retention = Policy::default().ttl.as_secs() as i64;
    for r in [&first, &again] {
        assert!(
            (expiry(r) - (now + retention)).abs() <= 5,
            "expiry {} for a {retention} s retention",
            expiry(r)
        );
    }
    // Refusals do not reach the hook.
    let mismatch = send(post(&c, &s, "/items", "hooked", &json!({"h": 2}))).await;
    assert_problem(&mismatch, 422, Refusal::Mismatch.slug());
    assert_eq!(mismatch.header("x-hook-replay"), None);
    assert_eq!(s.executions(), 1);
}

/// A fingerprint hook chooses what is compared: here a JSON member the client regenerates on
/// every attempt is left out, so attempts that differ only there are one request, while any
/// other change is still a 422.
pub async fn fingerprint_hook_selects_what_is_hashed(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.fingerprint_with(|req| match serde_json::from_slice::<Value>(req.body()) {
            Ok(mut doc) => {
                if let Some(members) = doc.as_object_mut() {
                    members.remove("sent_at");
                }
                let canonical = idempotency_core::canonical_json(&doc);
                req.builder().body(canonical.as_bytes()).finish()
            }
            Err(_) => req.default_fingerprint(),
        })
    })
    .await;
    let c = client();
    let first = send(post(
        &c,
        &s,
        "/items",
        "hook-fp",
        &json!({"amount": 5, "sent_at": 1}),
    ))
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(post(
        &c,
        &s,
        "/items",
        "hook-fp",
        &json!({"sent_at": 2, "amount": 5}),
    ))
    .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    let changed = send(post(
        &c,
        &s,
        "/items",
        "hook-fp",
        &json!({"amount": 6, "sent_at": 3}),
    ))
    .await;
    assert_problem(&changed, 422, Refusal::Mismatch.slug());
    let query = send(post(&c, &s, "/items?x=1", "hook-fp", &json!({"amount": 5}))).await;
    assert_problem(&query, 422, Refusal::Mismatch.slug());
    assert_eq!(s.executions(), 1);
}

pub use crate::settled::{
    handler_5xx_after_its_commit_is_replayed_not_rerun, handler_settled_key_is_not_written_again,
    handler_whose_lease_was_lost_gets_409_and_no_effect,
};
