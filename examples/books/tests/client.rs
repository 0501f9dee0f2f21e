//! The `idempotency-reqwest` client against the books service, in process, over real HTTP:
//! the create's faults are injected under the idempotency layer (`start_with`), the retries
//! are the client's own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::extract::{Request, State};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::IntoResponse;
use books_api::{start_with, Config, StoreChoice};
use idempotency_core::Policy;
use idempotency_reqwest::reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use idempotency_reqwest::{
    Error, IdempotencyKey, IdempotencyMiddleware, IdempotentRequestExt, IdempotentResponseExt,
    RetryPolicy,
};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Faults for the next creates that hold their key: a slow one, a failing one.
#[derive(Debug, Default)]
struct Faults {
    slow_next: AtomicU32,
    fail_next: AtomicU32,
}

const SLOW: Duration = Duration::from_millis(700);

fn take(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

async fn inject(
    State(faults): State<Arc<Faults>>,
    req: Request,
    next: Next,
) -> axum::response::Response {
    if take(&faults.slow_next) {
        tokio::time::sleep(SLOW).await;
    }
    if take(&faults.fail_next) {
        // Failed before the create ran: say so, or the layer stores this 500 and replays it
        // to the retry (a 500 may come from a handler that acted).
        return (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            axum::Extension(idempotency_tower::NothingDone),
            "injected create failure",
        )
            .into_response();
    }
    next.run(req).await
}

struct Svc {
    url: String,
    faults: Arc<Faults>,
    raw: reqwest::Client,
    _dir: tempfile::TempDir,
}

const TOKEN: &str = "Bearer client-tests";

/// The service with the books and the keys in a temporary SQLite file; a one-second lease, so
/// that a 409's `Retry-After` is one second.
async fn svc() -> Svc {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::new(dir.path().join("books.sqlite3"), StoreChoice::Sqlite);
    config.policy = Policy::default().lease(Duration::from_secs(1));
    let faults = Arc::new(Faults::default());
    let layer = from_fn_with_state(faults.clone(), inject);
    let running = start_with(&config, 0, Box::new(move |create| create.layer(layer)))
        .await
        .unwrap();
    Svc {
        url: running.url,
        faults,
        raw: reqwest::Client::builder().no_proxy().build().unwrap(),
        _dir: dir,
    }
}

/// The client under test: attempts time out after `timeout`; short backoffs.
fn client(timeout: Duration) -> ClientWithMiddleware {
    ClientBuilder::new(
        reqwest::Client::builder()
            .no_proxy()
            .timeout(timeout)
            .build()
            .unwrap(),
    )
    .with(
        IdempotencyMiddleware::new().retry_policy(
            RetryPolicy::default()
                .backoff(Duration::from_millis(20), Duration::from_millis(100))
                .max_retry_after(Duration::from_secs(2))
                .deadline(Duration::from_secs(15)),
        ),
    )
    .build()
}

fn kindred() -> String {
    json!({"title": "Kindred", "author": "Octavia E. Butler", "year": 1979}).to_string()
}

impl Svc {
    fn create(
        &self,
        client: &ClientWithMiddleware,
        body: String,
    ) -> idempotency_reqwest::reqwest_middleware::RequestBuilder {
        client
            .post(format!("{}/books", self.url))
            .header("authorization", TOKEN)
            .header("content-type", "application/json")
            .body(body)
    }

    async fn books(&self) -> Vec<Value> {
        let list: Value = self
            .raw
            .get(format!("{}/books", self.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        list["books"].as_array().unwrap().clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_that_timed_out_is_retried_and_replayed() {
    let s = svc().await;
    s.faults.slow_next.store(1, Ordering::SeqCst);
    let client = client(Duration::from_millis(250));
    let response = s
        .create(&client, kindred())
        .idempotent()
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let outcome = response.idempotency().unwrap().clone();
    // The first attempt timed out while its create ran; a retry then found it in progress
    // (409) or finished, and the answer is the first attempt's book.
    assert!(outcome.replayed(), "{outcome:?}");
    assert!(outcome.attempts() >= 2, "{outcome:?}");
    let book: Value = response.json().await.unwrap();
    let books = s.books().await;
    assert_eq!(books.len(), 1);
    assert_eq!(books[0]["id"], book["book"]["id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_progress_409_is_waited_out_and_ends_in_the_replay() {
    let s = svc().await;
    s.faults.slow_next.store(1, Ordering::SeqCst);
    let key = IdempotencyKey::random();
    // Another sender (the same operation from another process, say) is running the create.
    let first = {
        let request = s
            .raw
            .post(format!("{}/books", s.url))
            .header("authorization", TOKEN)
            .header("content-type", "application/json")
            .header("idempotency-key", key.as_str())
            .body(kindred());
        tokio::spawn(request.send())
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let started = Instant::now();
    let response = s
        .create(&client(Duration::from_secs(5)), kindred())
        .idempotency_key(key.clone())
        .send()
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(response.status(), 201);
    let outcome = response.idempotency().unwrap();
    assert_eq!(outcome.key(), &key);
    assert_eq!(outcome.attempts(), 2, "one 409, then the replay");
    assert!(outcome.replayed());
    // The 409 said `Retry-After: 1`: the client waited that second, not its 20 ms backoff.
    assert!(waited >= Duration::from_secs(1), "retried after {waited:?}");
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), 201);
    let replay: Value = response.json().await.unwrap();
    let original: Value = first.json().await.unwrap();
    assert_eq!(replay, original);
    assert_eq!(s.books().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_another_body_is_a_422_never_retried() {
    let s = svc().await;
    let client = client(Duration::from_secs(5));
    let key = IdempotencyKey::random();
    let first = s
        .create(&client, kindred())
        .idempotency_key(key.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    let other = json!({"title": "Dawn", "author": "Octavia E. Butler", "year": 1987}).to_string();
    let started = Instant::now();
    let err = s
        .create(&client, other)
        .idempotency_key(key.clone())
        .send()
        .await
        .unwrap_err();
    let e = Error::find(&err).unwrap();
    let Error::KeyReused {
        key: sent,
        attempts,
        problem,
    } = e
    else {
        panic!("{e:?}")
    };
    assert_eq!(sent, &key);
    assert_eq!(*attempts, 1);
    assert_eq!(
        problem.as_ref().unwrap().code.as_deref(),
        Some("IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD")
    );
    assert!(!e.is_retryable());
    assert!(
        e.to_string().contains("a new operation needs a new key"),
        "{e}"
    );
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(s.books().await.len(), 1);

    // The handler's own 422 (validation) is refused too, and said to be something else.
    let err = s
        .create(&client, json!({"title": ""}).to_string())
        .idempotent()
        .send()
        .await
        .unwrap_err();
    let e = Error::find(&err).unwrap();
    assert!(
        matches!(e, Error::Rejected { status, attempts: 1, .. } if *status == 422),
        "{e:?}"
    );
    assert!(e.problem().unwrap().has_slug("validation-failed"), "{e:?}");
    assert_eq!(s.books().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_create_is_retried_and_runs_once() {
    let s = svc().await;
    s.faults.fail_next.store(2, Ordering::SeqCst);
    let response = s
        .create(&client(Duration::from_secs(5)), kindred())
        .idempotent()
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let outcome = response.idempotency().unwrap();
    // The 500s (which said nothing was done) were not stored: the key was released, and the
    // third attempt created the book.
    assert_eq!(outcome.attempts(), 3);
    assert!(!outcome.replayed());
    assert_eq!(s.books().await.len(), 1);
}
