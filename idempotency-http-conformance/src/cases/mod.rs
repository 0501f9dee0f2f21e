//! The cases. Each one starts its own server over the given store and talks to it with a real
//! HTTP client.

use crate::server::{control, Outage, TestServer};
use bytes::Bytes;
use http::{HeaderName, Method, StatusCode};
use idempotency_conformance::{Fault, FlakyOp, FlakyStore, TestStore};
use idempotency_core::store::ClaimRequest;
use idempotency_core::{Fingerprint, IdempotencyKey, InFlight, Policy, RecordId};
use idempotency_tower::{http_scope, OnUnstored, Refusal};
use reqwest::header::HeaderMap;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod concurrency;
mod hooks;
mod keys;
mod replay;

pub use concurrency::*;
pub use hooks::*;
pub use keys::*;
pub use replay::*;

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

fn patch(c: &reqwest::Client, s: &TestServer, key: &str, body: &Value) -> reqwest::RequestBuilder {
    c.patch(s.url("/items/1"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// Stores a completed record with a replayable response, as an older version of the layer did.
async fn seed(store: &TestStore, id: &RecordId, fp: Fingerprint, status: StatusCode, body: &[u8]) {
    let claim = store
        .store
        .claim(&ClaimRequest::new(
            id.clone(),
            fp,
            Duration::from_secs(60),
            Duration::from_secs(3600),
        ))
        .await
        .expect("claim");
    let idempotency_core::store::Claim::Claimed { token, .. } = claim else {
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

fn retry_after(r: &Reply) -> u64 {
    r.header("retry-after")
        .unwrap_or_else(|| panic!("no Retry-After on {r:?}"))
        .parse()
        .expect("Retry-After in whole seconds")
}

fn outcome_header(l: idempotency_tower::IdempotencyLayer) -> idempotency_tower::IdempotencyLayer {
    l.on_response(|ctx, headers| {
        let label = ctx.outcome().map_or("replayed", |o| o.as_str());
        headers.insert("x-test-outcome", http::HeaderValue::from_static(label));
    })
}

pub use crate::settled::{
    handler_5xx_after_its_commit_is_replayed_not_rerun, handler_rolled_back_frees_the_key,
    handler_settled_key_is_not_written_again, handler_whose_lease_was_lost_gets_409_and_no_effect,
    heartbeat_stops_when_the_handler_settled_the_key,
};
