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

fn client() -> reqwest::Client {
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

/// A streaming response (no exact size) and one over the response limit are delivered whole
/// but not stored, and the key is released.
pub async fn streaming_and_oversized_responses_are_not_stored(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.response_limit(2048)
    })
    .await;
    let c = client();
    let body = json!({"s": 1});
    let streamed = send(post(&c, &s, "/items", "stream", &body).header(control::STREAM, "1")).await;
    assert_eq!(streamed.status, StatusCode::CREATED);
    assert_eq!(&streamed.body[..], b"chunk-1-0;chunk-1-1;chunk-1-2;");
    let again = send(post(&c, &s, "/items", "stream", &body).header(control::STREAM, "1")).await;
    assert!(!again.replayed());
    assert_eq!(&again.body[..], b"chunk-2-0;chunk-2-1;chunk-2-2;");

    let large = send(post(&c, &s, "/items", "large", &body).header(control::LARGE, "4096")).await;
    assert_eq!(large.body.len(), 4096);
    assert_eq!(large.body[0], b'3');
    let again = send(post(&c, &s, "/items", "large", &body).header(control::LARGE, "4096")).await;
    assert!(!again.replayed());
    assert_eq!(again.body[0], b'4');
    // At the limit it is stored.
    let fits = send(post(&c, &s, "/items", "fits", &body).header(control::LARGE, "2048")).await;
    let replay = send(post(&c, &s, "/items", "fits", &body).header(control::LARGE, "2048")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, fits.body);
    assert_eq!(s.executions(), 5);
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

pub use crate::settled::{
    handler_5xx_after_its_commit_is_replayed_not_rerun, handler_settled_key_is_not_written_again,
    handler_whose_lease_was_lost_gets_409_and_no_effect,
};
