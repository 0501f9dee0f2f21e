//! `ClaimedKey::run_in_transaction`: the handler's rows and its stored answer commit together
//! in one call, over a real SQLite file, and the key is settled by how the transaction ended.
#![allow(clippy::unwrap_used)]

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::BodyExt;
use idempotency_core::{Error, Idempotency};
use idempotency_sqlite::{SqliteStore, SqliteTransaction};
use idempotency_tower::{ClaimedKey, IdempotencyLayer};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tower::ServiceExt;

struct App {
    store: SqliteStore,
    runs: AtomicU64,
}

/// `POST /orders`: one order row, answered `201 {"order": id}`; with `x-fail`, the work's
/// statement fails and its transaction rolls back.
async fn create(State(app): State<Arc<App>>, req: Request) -> Response {
    let claim = req.extensions().get::<ClaimedKey>().cloned().unwrap();
    let fail = req.headers().contains_key("x-fail");
    app.runs.fetch_add(1, Ordering::SeqCst);
    claim
        .run_in_transaction(&app.store, |tx: &mut SqliteTransaction| {
            Box::pin(async move {
                if fail {
                    return Err(Error::backend(false, "the order's insert failed"));
                }
                let id = tx
                    .run(|t| {
                        t.execute("INSERT INTO orders (sku) VALUES ('A1')", [])?;
                        Ok::<_, idempotency_sqlite::rusqlite::Error>(t.last_insert_rowid())
                    })
                    .await?
                    .map_err(|e| Error::backend(false, e))?;
                Ok(http::Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/json")
                    .body(Bytes::from(format!("{{\"order\":{id}}}")))
                    .unwrap())
            })
        })
        .await
        .map(Body::from)
        .into_response()
}

async fn app() -> (Router, Arc<App>, PathBuf) {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let path = std::env::temp_dir().join(format!(
        "tower-exactly-once-{}-{nanos}.db",
        std::process::id()
    ));
    let store = SqliteStore::open(&path).await.unwrap();
    store.migrate().await.unwrap();
    store
        .call(|c| c.execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT)"))
        .await
        .unwrap()
        .unwrap();
    let engine = Idempotency::builder(store.clone()).build().unwrap();
    let app = Arc::new(App {
        store,
        runs: AtomicU64::new(0),
    });
    let router = Router::new()
        .route("/orders", post(create))
        .layer(IdempotencyLayer::shared(engine).required(true))
        .with_state(app.clone());
    (router, app, path)
}

async fn send(router: &Router, key: &str, fail: bool) -> (StatusCode, bool, String) {
    let mut req = http::Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "application/json");
    if fail {
        req = req.header("x-fail", "1");
    }
    let resp = router
        .clone()
        .oneshot(req.body(Body::from("{}")).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let replayed = resp.headers().get("idempotent-replayed").is_some();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        replayed,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

async fn orders(app: &App) -> i64 {
    app.store
        .call(|c| c.query_row("SELECT count(*) FROM orders", [], |r| r.get::<_, i64>(0)))
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_row_and_the_answer_commit_together_and_retries_replay() {
    let (router, app, path) = app().await;
    let first = send(&router, "k-1", false).await;
    assert_eq!(
        first,
        (StatusCode::CREATED, false, "{\"order\":1}".to_owned())
    );
    for _ in 0..3 {
        let again = send(&router, "k-1", false).await;
        assert_eq!(
            again,
            (StatusCode::CREATED, true, "{\"order\":1}".to_owned())
        );
    }
    assert_eq!(orders(&app).await, 1, "one order for one key");
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the handler ran once");
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_releases_the_key_and_a_retry_runs() {
    let (router, app, path) = app().await;
    let (status, replayed, body) = send(&router, "k-2", true).await;
    // The handler's own statement failed, not the key's store: a 500 of the handler's, not a
    // 503 that blames the idempotency store.
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert!(!replayed);
    assert!(body.contains("handler-failed"), "{body}");
    assert_eq!(orders(&app).await, 0, "nothing committed");
    // The key was released at once: the retry runs the handler and commits.
    let retry = send(&router, "k-2", false).await;
    assert_eq!(
        retry,
        (StatusCode::CREATED, false, "{\"order\":1}".to_owned())
    );
    assert_eq!(orders(&app).await, 1);
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
    let _ = std::fs::remove_file(path);
}
