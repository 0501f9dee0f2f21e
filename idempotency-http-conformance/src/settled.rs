//! Cases for handlers that settle their key themselves ([`ClaimedKey`]): the completion is
//! written with the handler's own effect (here, the store's completion compare-and-swap stands
//! for the SQL stores' `complete_in` inside the business transaction), and the layer must not
//! write again, must replay what the handler committed whatever it answers afterwards, and must
//! answer a clear problem when the handler's completion is fenced.

use crate::cases::{assert_problem, client, send};
use crate::server::{serve, Outage};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use idempotency_conformance::TestStore;
use idempotency_core::store::Cas;
use idempotency_core::{Idempotency, Policy};
use idempotency_tower::{ClaimedKey, IdempotencyLayer};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Sleep this many milliseconds before committing.
const DELAY_MS: &str = "x-test-delay-ms";
/// Answer with this status after the commit, in place of the committed response.
const STATUS_AFTER_COMMIT: &str = "x-test-status-after-commit";
/// After the commit, go on for this many milliseconds before answering.
const DELAY_AFTER_COMMIT_MS: &str = "x-test-delay-after-commit-ms";
/// Fail before the commit: roll back, tell the layer (`ClaimedKey::rolled_back`), answer 500.
const ROLL_BACK: &str = "x-test-roll-back";

struct App {
    /// Counts the completions that reach the store.
    store: Arc<Outage>,
    /// Effects that committed (the handler's completion was applied).
    effects: AtomicU64,
    /// Handler runs, committed or not.
    runs: AtomicU64,
    /// Extensions sent to the store when the last handler's completion committed.
    extends_at_commit: AtomicU64,
}

struct Server {
    base: String,
    app: Arc<App>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    async fn start(store: &TestStore, policy: Policy) -> Self {
        let counting = Outage::new(store.store.clone());
        let engine = Idempotency::new(counting.clone(), policy).expect("a valid policy");
        let app = Arc::new(App {
            store: counting,
            effects: AtomicU64::new(0),
            runs: AtomicU64::new(0),
            extends_at_commit: AtomicU64::new(0),
        });
        let router = Router::new()
            .route("/orders", post(create).get(create))
            .with_state(app.clone())
            .layer(IdempotencyLayer::shared(engine).required(true));
        let (base, task) = serve(router).await;
        Self {
            base: format!("{base}/orders"),
            app,
            task,
        }
    }

    fn effects(&self) -> u64 {
        self.app.effects.load(Ordering::SeqCst)
    }

    fn completes(&self) -> u64 {
        self.app.store.completes()
    }
}

/// Creates an "order": builds the answer, then commits it with the completion (the store's
/// compare-and-swap, as a SQL handler would inside its transaction).
async fn create(State(app): State<Arc<App>>, claim: ClaimedKey, headers: HeaderMap) -> Response {
    let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(ms) = header(DELAY_MS).and_then(|v| v.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let answer = http::Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("location", format!("/orders/{run}"))
        .header("set-cookie", "session=secret")
        .body(bytes::Bytes::from(format!("{{\"run\":{run}}}")))
        .expect("a response");
    if header(ROLL_BACK).is_some() {
        // The "transaction" failed before the completion and rolled back: nothing was done.
        claim.rolled_back();
        return (StatusCode::INTERNAL_SERVER_ERROR, "rolled back").into_response();
    }
    let prepared = claim.prepare(answer).expect("a small response");
    let cas = app
        .store
        .inner()
        .complete(
            claim.id(),
            claim.token(),
            prepared.outcome(),
            claim.retention(),
        )
        .await;
    match cas {
        Ok(Cas::Applied) => {
            app.effects.fetch_add(1, Ordering::SeqCst);
            let response = prepared.committed();
            app.extends_at_commit
                .store(app.store.extends(), Ordering::SeqCst);
            if let Some(ms) = header(DELAY_AFTER_COMMIT_MS).and_then(|v| v.parse().ok()) {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            match header(STATUS_AFTER_COMMIT).and_then(|v| v.parse::<u16>().ok()) {
                Some(status) => (
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                    "failed after the commit",
                )
                    .into_response(),
                None => response.map(axum::body::Body::from).into_response(),
            }
        }
        Ok(Cas::Fenced) => {
            // The "transaction" rolls back: no effect.
            claim.lease_lost();
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// A handler that commits its completion itself: the layer writes nothing more, the retry
/// replays the committed answer (allowlisted headers only), and the extractor refuses a request
/// that holds no claim.
pub async fn handler_settled_key_is_not_written_again(store: TestStore) {
    let s = Server::start(&store, Policy::default()).await;
    let c = client();
    let key = uuid::Uuid::new_v4().to_string();
    let first = send(c.post(&s.base).header("idempotency-key", &key)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.body.as_ref(), b"{\"run\":1}");
    assert!(!first.replayed());
    assert_eq!(s.completes(), 0, "the layer wrote a completion of its own");
    let again = send(c.post(&s.base).header("idempotency-key", &key)).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("location"), Some("/orders/1"));
    assert_eq!(again.header("set-cookie"), None, "a cookie was stored");
    assert_eq!((s.effects(), s.completes()), (1, 0));
    // GET is not covered: it runs without a claim, and the extractor refuses it.
    let unclaimed = send(c.get(&s.base).header("idempotency-key", &key)).await;
    assert_problem(&unclaimed, 500, "handler-failed");
    assert_eq!(s.effects(), 1);
}

/// A handler that fails after its completion committed (here it answers 500) is replayed, not
/// run again: the retry gets the committed 201.
pub async fn handler_5xx_after_its_commit_is_replayed_not_rerun(store: TestStore) {
    let s = Server::start(&store, Policy::default()).await;
    let c = client();
    let key = uuid::Uuid::new_v4().to_string();
    let first = send(
        c.post(&s.base)
            .header("idempotency-key", &key)
            .header(STATUS_AFTER_COMMIT, "500"),
    )
    .await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR, "{first:?}");
    let retry = send(c.post(&s.base).header("idempotency-key", &key)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(
        retry.replayed(),
        "the committed create ran again: {retry:?}"
    );
    assert_eq!(retry.body.as_ref(), b"{\"run\":1}");
    assert_eq!((s.effects(), s.completes()), (1, 0));
}

/// A handler that goes on for four leases after its own transaction committed the completion
/// (the heartbeat on) is answered with its own 201, not a lost lease: the heartbeat stops once
/// the record is settled (at most one extension, fenced, after the commit), and the retry
/// replays the committed create.
pub async fn heartbeat_stops_when_the_handler_settled_the_key(store: TestStore) {
    let lease = Duration::from_millis(300);
    let s = Server::start(&store, Policy::default().lease(lease)).await;
    let c = client();
    let key = uuid::Uuid::new_v4().to_string();
    let first = send(
        c.post(&s.base)
            .header("idempotency-key", &key)
            .header(DELAY_AFTER_COMMIT_MS, (lease * 4).as_millis().to_string()),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    let after_commit = s.app.store.extends() - s.app.extends_at_commit.load(Ordering::SeqCst);
    assert!(
        after_commit <= 1,
        "{after_commit} extensions after the handler's commit: the heartbeat went on"
    );
    let retry = send(c.post(&s.base).header("idempotency-key", &key)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body.as_ref(), b"{\"run\":1}");
    assert_eq!((s.effects(), s.completes()), (1, 0));
}

/// A handler that stalls past its lease (no heartbeat) while a retry takes the key over: its
/// completion is fenced, its effect rolls back, and it gets `409` `idempotency-key-lease-lost`
/// with `Retry-After`; the key ends with the retry's one effect, which later requests replay.
pub async fn handler_whose_lease_was_lost_gets_409_and_no_effect(store: TestStore) {
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .heartbeat(None);
    let s = Server::start(&store, policy).await;
    let c = client();
    let key = uuid::Uuid::new_v4().to_string();
    let slow = tokio::spawn(send(
        c.post(&s.base)
            .header("idempotency-key", &key)
            .header(DELAY_MS, "1200"),
    ));
    // Past the first lease (with room for a store clock at millisecond precision).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let takeover = send(c.post(&s.base).header("idempotency-key", &key)).await;
    assert_eq!(takeover.status, StatusCode::CREATED, "{takeover:?}");
    assert!(!takeover.replayed());
    assert_eq!(takeover.body.as_ref(), b"{\"run\":2}");
    let slow = slow.await.expect("the slow request");
    assert_problem(&slow, 409, "idempotency-key-lease-lost");
    assert!(slow.header("retry-after").is_some(), "{slow:?}");
    let later = send(c.post(&s.base).header("idempotency-key", &key)).await;
    assert!(later.replayed(), "{later:?}");
    assert_eq!(later.body, takeover.body);
    assert_eq!(s.effects(), 1, "the stalled holder's effect was kept");
    assert_eq!(s.completes(), 0);
}

/// A handler whose own transaction rolled back says so (`ClaimedKey::rolled_back`): its 500 is
/// delivered, the key is released at once, and the retry runs the handler (one effect).
pub async fn handler_rolled_back_frees_the_key(store: TestStore) {
    let s = Server::start(&store, Policy::default()).await;
    let c = client();
    let key = uuid::Uuid::new_v4().to_string();
    let failed = send(
        c.post(&s.base)
            .header("idempotency-key", &key)
            .header(ROLL_BACK, "1"),
    )
    .await;
    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    // The key is released by a background write; give it a moment on slow stores.
    let started = std::time::Instant::now();
    let retry = loop {
        let r = send(c.post(&s.base).header("idempotency-key", &key)).await;
        if r.status != StatusCode::CONFLICT || started.elapsed() > Duration::from_secs(10) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(retry.body.as_ref(), b"{\"run\":2}");
    assert_eq!((s.effects(), s.completes()), (1, 0));
}

/// The check of a service whose `POST /orders` handler writes one row per key with
/// `ClaimedKey::run_in_transaction`, served at `base`: for six keys, three concurrent
/// duplicates each answer `201` or `409` (in progress), at least one `201`; a retry once the
/// key settled gets the same `201` body, replayed; and `rows(key)` counts exactly one row.
/// `label` names the run in failures (an isolation level).
pub async fn one_answer_and_one_row_per_key<R, F>(label: &str, base: &str, rows: R)
where
    R: Fn(String) -> F,
    F: std::future::Future<Output = i64>,
{
    let client = client();
    let post = |key: String| {
        let (client, url) = (client.clone(), format!("{base}/orders"));
        async move {
            let resp = client
                .post(url)
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body("{}")
                .send()
                .await
                .expect("sent");
            let status = resp.status().as_u16();
            (status, resp.text().await.expect("body"))
        }
    };
    for i in 0..6 {
        let key = format!("order-{i}");
        let sent: Vec<(u16, String)> =
            futures::future::join_all((0..3).map(|_| post(key.clone()))).await;
        assert!(
            sent.iter()
                .all(|(status, _)| *status == 201 || *status == 409),
            "{label} {key}: {sent:?}"
        );
        let answers: Vec<&String> = sent
            .iter()
            .filter(|(status, _)| *status == 201)
            .map(|(_, body)| body)
            .collect();
        assert!(!answers.is_empty(), "{label} {key}: {sent:?}");
        // Retries once it settled: the one answer, replayed.
        let retry = loop {
            let (status, body) = post(key.clone()).await;
            if status != 409 {
                break (status, body);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(retry.0, 201, "{label} {key}: {retry:?}");
        assert!(
            answers.iter().all(|a| **a == retry.1),
            "{label} {key}: {sent:?} then {retry:?}"
        );
        assert_eq!(
            rows(key.clone()).await,
            1,
            "{label} {key}: one order per key"
        );
    }
}
