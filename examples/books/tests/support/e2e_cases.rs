// End-to-end cases, included by `e2e.rs` (store from `BOOKS_TEST_STORE`, default SQLite),
// `e2e_postgres.rs` (Postgres), `e2e_mysql.rs` (MariaDB) and `e2e_redis.rs` (Redis): the service
// on a loopback port, the books table in a real SQLite file (or beside the records in Postgres
// or MariaDB), a real HTTP client.

use axum::extract::{Request, State};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::IntoResponse;
use books_api::{start_with, Config, StoreChoice, PROBLEM_BASE};
use idempotency_core::Policy;
use reqwest::{Client, RequestBuilder, Response, StatusCode};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Faults the tests inject between the idempotency layer and the create handler: a slow create
/// and failing creates.
#[derive(Debug, Default)]
struct Faults {
    create_delay_ms: AtomicU64,
    fail_next_creates: AtomicU32,
}

impl Faults {
    /// Every create sleeps `d` before the handler runs.
    fn set_create_delay(&self, d: Duration) {
        self.create_delay_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    /// The next `n` creates answer 500 without running the handler.
    fn fail_next_creates(&self, n: u32) {
        self.fail_next_creates.store(n, Ordering::SeqCst);
    }
}

async fn inject(
    State(faults): State<Arc<Faults>>,
    req: Request,
    next: Next,
) -> axum::response::Response {
    let delay = faults.create_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let failing = faults
        .fail_next_creates
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    if failing.is_ok() {
        let doc = json!({
            "type": format!("{PROBLEM_BASE}internal"),
            "title": "Injected create failure",
            "status": 500,
        });
        // The handler did not run: say so, or the layer stores this 500 and replays it to
        // the retry (a 500 may come from a handler that acted).
        return (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            axum::Extension(idempotency_tower::NothingDone),
            [("content-type", "application/problem+json")],
            doc.to_string(),
        )
            .into_response();
    }
    next.run(req).await
}

struct Svc {
    token: String,
    url: String,
    faults: Arc<Faults>,
    config: Config,
    client: Client,
    _dir: tempfile::TempDir,
    /// With MariaDB: the service's two tables, dropped with the service (also when the test
    /// fails).
    _tables: Vec<idempotency_testing::mysql::TableGuard>,
    /// With DynamoDB: the service's two tables, deleted with the service.
    _dynamodb_tables: Vec<idempotency_testing::dynamodb::TableGuard>,
}

/// The store the tests run on: `BOOKS_TEST_STORE` (default `sqlite`, as the service;
/// `postgres` uses `IDEMPOTENCY_TEST_POSTGRES_URL`, `mysql` uses `MYSQL_URL`, `redis` uses
/// `IDEMPOTENCY_TEST_REDIS_URL`, each by default the local server).
fn store_choice() -> StoreChoice {
    let chosen = FORCED_STORE
        .map(str::to_owned)
        .ok_or(())
        .or_else(|()| std::env::var("BOOKS_TEST_STORE"));
    match chosen.as_deref() {
        Ok("memory") => StoreChoice::Memory,
        Err(_) | Ok("sqlite") => StoreChoice::Sqlite,
        Ok("postgres") => StoreChoice::Postgres(
            std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        ),
        Ok("mysql") => StoreChoice::Mysql(idempotency_testing::mysql::url()),
        Ok("dynamodb") => StoreChoice::Dynamodb(idempotency_testing::dynamodb::url()),
        Ok("redis") => StoreChoice::Redis(
            std::env::var("IDEMPOTENCY_TEST_REDIS_URL")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned()),
        ),
        Ok(other) => panic!(
            "BOOKS_TEST_STORE={other} is not a store (sqlite, postgres, mysql, redis, dynamodb, \
             memory)"
        ),
    }
}

async fn svc() -> Svc {
    svc_with(|_| ()).await
}

async fn svc_with(configure: impl FnOnce(&mut Config)) -> Svc {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::new(dir.path().join("books.sqlite3"), store_choice());
    config.policy = Policy::default();
    // Books in Postgres go in a schema of their own, so that each service sees only its books.
    config.postgres_schema = format!("books_{}", uuid::Uuid::new_v4().simple());
    // In MariaDB, in tables of their own, dropped with the service: `idem_t_<random>_books`
    // and `idem_t_<random>_idempotency_records`. The prefix is a fresh name of the shared
    // `TableGuard` (whose first use in the binary also drops the `idem_t_` tables that crashed
    // runs left behind), and the guard is pointed at the books table.
    let tables = match config.store {
        StoreChoice::Mysql(_) => {
            let mut books = idempotency_testing::mysql::TableGuard::new();
            config.mysql_table_prefix = format!("{}_", books.table);
            let (books_table, records_table) = config.mysql_tables();
            books.table = books_table;
            vec![
                books,
                idempotency_testing::mysql::TableGuard {
                    table: records_table,
                },
            ]
        }
        _ => Vec::new(),
    };
    // On DynamoDB, likewise: `books-t-<random>-books` and `books-t-<random>-idempotency`.
    let dynamodb_tables = match config.store {
        StoreChoice::Dynamodb(_) => {
            config.dynamodb_table_prefix = format!("books-t-{}-", uuid::Uuid::new_v4().simple());
            let (books, records) = config.dynamodb_tables();
            vec![
                idempotency_testing::dynamodb::TableGuard::for_table(books),
                idempotency_testing::dynamodb::TableGuard::for_table(records),
            ]
        }
        _ => Vec::new(),
    };
    configure(&mut config);
    let faults = Arc::new(Faults::default());
    let layer = from_fn_with_state(faults.clone(), inject);
    let running = start_with(&config, 0, Box::new(move |create| create.layer(layer)))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot start the books service on {:?}: {e}\n\
             For Postgres, start the local server with `bash .ci/services` (127.0.0.1:5432, \
             database `test`) or set IDEMPOTENCY_TEST_POSTGRES_URL; for MariaDB, the same \
             script starts it (127.0.0.1:3306, root, database `test`) or set MYSQL_URL.",
                config.store
            )
        });
    Svc {
        // One caller per service: records in a shared store never cross test runs.
        token: format!("Bearer {}", uuid::Uuid::new_v4()),
        url: running.url,
        faults,
        config,
        client: Client::builder().no_proxy().build().unwrap(),
        _dir: dir,
        _tables: tables,
        _dynamodb_tables: dynamodb_tables,
    }
}

const TOKEN: &str = "Bearer reader-1";

fn kindred() -> Value {
    json!({"title": "Kindred", "author": "Octavia E. Butler", "year": 1979})
}

impl Svc {
    fn create(&self, key: &str, body: &Value) -> RequestBuilder {
        self.client
            .post(format!("{}/books", self.url))
            .header("authorization", &self.token)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_string())
    }
    async fn count(&self) -> usize {
        let list: Value = self
            .client
            .get(format!("{}/books", self.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        list["books"].as_array().unwrap().len()
    }
    fn book_url(&self, id: &str) -> String {
        format!("{}/books/{id}", self.url)
    }
    async fn created(&self, key: &str) -> (String, String) {
        let r = self.create(key, &kindred()).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        let etag = r.headers()["etag"].to_str().unwrap().to_owned();
        let body: Value = r.json().await.unwrap();
        (body["book"]["id"].as_str().unwrap().to_owned(), etag)
    }
}

fn replayed(r: &Response) -> bool {
    r.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

async fn problem(r: Response, status: u16, slug: &str) -> Value {
    assert_eq!(r.status().as_u16(), status);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let doc: Value = r.json().await.unwrap();
    assert!(
        doc["type"].as_str().unwrap().ends_with(slug),
        "{doc} is not {slug}"
    );
    assert_eq!(doc["status"], status);
    doc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_then_replay_carries_idempotent_replayed() {
    let s = svc().await;
    let first = s.create("k1", &kindred()).send().await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!replayed(&first));
    let location = first.headers()["location"].clone();
    let etag = first.headers()["etag"].clone();
    let body = first.bytes().await.unwrap();
    let again = s.create("k1", &kindred()).send().await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(replayed(&again));
    assert_eq!(again.headers()["location"], location);
    assert_eq!(again.headers()["etag"], etag);
    assert_eq!(again.bytes().await.unwrap(), body);
    assert_eq!(s.count().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_a_client_timeout_returns_the_same_book() {
    let s = svc().await;
    s.faults.set_create_delay(Duration::from_millis(500));
    let timed_out = s
        .create("slow", &kindred())
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(timed_out.is_err_and(|e| e.is_timeout()));
    s.faults.set_create_delay(Duration::ZERO);
    // The client retries as told: while the first attempt runs it gets 409 + Retry-After.
    let start = Instant::now();
    let retry = loop {
        let r = s.create("slow", &kindred()).send().await.unwrap();
        if r.status() != StatusCode::CONFLICT {
            break r;
        }
        assert!(r.headers().contains_key("retry-after"));
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(replayed(&retry));
    let book: Value = retry.json().await.unwrap();
    let list: Value = s
        .client
        .get(format!("{}/books", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["books"].as_array().unwrap().len(), 1);
    assert_eq!(list["books"][0]["id"], book["book"]["id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_posts_with_one_key_create_one_book() {
    let s = Arc::new(svc().await);
    s.faults.set_create_delay(Duration::from_millis(150));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move {
                let r = s.create("race", &kindred()).send().await.unwrap();
                let status = r.status();
                let was_replayed = replayed(&r);
                let body = r.bytes().await.unwrap();
                (status, was_replayed, body)
            })
        })
        .collect();
    let mut fresh = Vec::new();
    let (mut conflicts, mut replays) = (0, 0);
    let mut replay_bodies = Vec::new();
    for t in tasks {
        let (status, was_replayed, body) = t.await.unwrap();
        match (status, was_replayed) {
            (StatusCode::CREATED, false) => fresh.push(body),
            (StatusCode::CREATED, true) => {
                replays += 1;
                replay_bodies.push(body);
            }
            (StatusCode::CONFLICT, _) => conflicts += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(fresh.len(), 1);
    assert_eq!(conflicts + replays, 63);
    assert!(replay_bodies.iter().all(|b| *b == fresh[0]));
    assert_eq!(s.count().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_body_gets_422_and_creates_nothing() {
    let s = svc().await;
    s.created("reuse").await;
    let mut other = kindred();
    other["year"] = json!(1980);
    let r = s.create("reuse", &other).send().await.unwrap();
    let doc = problem(r, 422, "idempotency-key-reused").await;
    assert_eq!(doc["code"], "IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD");
    assert!(doc["type"]
        .as_str()
        .unwrap()
        .starts_with("urn:books-api:problem:"));
    assert_eq!(s.count().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_key_gets_400_and_unknown_caller_401() {
    let s = svc().await;
    let r = s
        .client
        .post(format!("{}/books", s.url))
        .header("authorization", &s.token)
        .json(&kindred())
        .send()
        .await
        .unwrap();
    let doc = problem(r, 400, "idempotency-key-required").await;
    assert!(doc["detail"]
        .as_str()
        .unwrap()
        .contains("Idempotency-Key header is required"));
    let anonymous = s
        .client
        .post(format!("{}/books", s.url))
        .header("idempotency-key", "anon")
        .json(&kindred())
        .send()
        .await
        .unwrap();
    problem(anonymous, 401, "idempotency-caller-unidentified").await;
    assert_eq!(s.count().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_500_is_not_stored_and_the_retry_runs() {
    let s = svc().await;
    s.faults.fail_next_creates(1);
    let failed = s.create("flaky", &kindred()).send().await.unwrap();
    problem(failed, 500, "internal").await;
    assert_eq!(s.count().await, 0);
    let retry = s.create("flaky", &kindred()).send().await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!replayed(&retry));
    let again = s.create("flaky", &kindred()).send().await.unwrap();
    assert!(replayed(&again));
    assert_eq!(s.count().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_has_a_strong_etag_and_304() {
    let s = svc().await;
    let (id, etag) = s.created("g").await;
    assert!(etag.starts_with('"') && !etag.starts_with("W/"));
    let r = s.client.get(s.book_url(&id)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["etag"], etag.as_str());
    let cached = s
        .client
        .get(s.book_url(&id))
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(cached.status(), StatusCode::NOT_MODIFIED);
    assert_eq!(cached.headers()["etag"], etag.as_str());
    assert!(cached.bytes().await.unwrap().is_empty());
    let weak = s
        .client
        .get(s.book_url(&id))
        .header("if-none-match", format!("\"other\", W/{etag}"))
        .send()
        .await
        .unwrap();
    assert_eq!(weak.status(), StatusCode::NOT_MODIFIED);
    let stale = s
        .client
        .get(s.book_url(&id))
        .header("if-none-match", "\"nope\"")
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status(), StatusCode::OK);
    let missing = s.client.get(s.book_url("nope")).send().await.unwrap();
    problem(missing, 404, "not-found").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_patch_updates_removes_and_changes_the_etag() {
    let s = svc().await;
    let (id, etag) = s.created("p").await;
    let r = s
        .client
        .patch(s.book_url(&id))
        .header("content-type", "application/merge-patch+json")
        .header("if-match", &etag)
        .body(r#"{"summary": "A time-travel novel", "year": 1979}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let etag2 = r.headers()["etag"].to_str().unwrap().to_owned();
    assert_ne!(etag2, etag);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["book"]["summary"], "A time-travel novel");
    assert_eq!(body["book"]["title"], "Kindred");
    // null removes a member; application/json is accepted too; no If-Match passes.
    let r = s
        .client
        .patch(s.book_url(&id))
        .header("content-type", "application/json; charset=utf-8")
        .body(r#"{"summary": null, "title": "Kindred (2nd ed.)"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let body: Value = r.json().await.unwrap();
    assert!(body["book"].get("summary").is_none());
    assert_eq!(body["book"]["title"], "Kindred (2nd ed.)");
    let read: Value = s
        .client
        .get(s.book_url(&id))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(read, body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_if_match_gets_412_and_concurrent_patches_have_one_winner() {
    let s = Arc::new(svc().await);
    let (id, etag) = s.created("c").await;
    let patch = |year: i32, tag: String| {
        s.client
            .patch(s.book_url(&id))
            .header("content-type", "application/merge-patch+json")
            .header("if-match", tag)
            .body(json!({ "year": year }).to_string())
            .send()
    };
    let first = patch(1980, etag.clone()).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let stale = patch(1981, etag.clone()).await.unwrap();
    problem(stale, 412, "precondition-failed").await;
    let weak = patch(
        1981,
        format!("W/{}", first.headers()["etag"].to_str().unwrap()),
    )
    .await
    .unwrap();
    assert_eq!(
        weak.status(),
        StatusCode::PRECONDITION_FAILED,
        "If-Match compares strongly"
    );

    // Many writers holding the same tag: the check and the write are one statement, so exactly
    // one lands; every other gets 412. Repeated to give a check-then-write race room to show.
    for round in 0..10 {
        let current = s
            .client
            .get(s.book_url(&id))
            .send()
            .await
            .unwrap()
            .headers()["etag"]
            .to_str()
            .unwrap()
            .to_owned();
        let writers: Vec<_> = (0..16)
            .map(|i| {
                let (s, id, tag) = (s.clone(), id.clone(), current.clone());
                tokio::spawn(async move {
                    s.client
                        .patch(s.book_url(&id))
                        .header("content-type", "application/merge-patch+json")
                        .header("if-match", tag)
                        .body(json!({ "year": 1000 + round * 100 + i }).to_string())
                        .send()
                        .await
                        .unwrap()
                        .status()
                })
            })
            .collect();
        let mut ok = 0;
        for w in writers {
            match w.await.unwrap() {
                StatusCode::OK => ok += 1,
                StatusCode::PRECONDITION_FAILED => {}
                other => panic!("unexpected {other}"),
            }
        }
        assert_eq!(ok, 1, "round {round}: exactly one conditional write lands");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_patch_media_type_gets_415_with_accept_patch() {
    let s = svc().await;
    let (id, _) = s.created("m").await;
    for ct in [
        Some("application/json-patch+json"),
        Some("text/plain"),
        None,
    ] {
        let mut req = s.client.patch(s.book_url(&id)).body(r#"{"year": 1}"#);
        if let Some(ct) = ct {
            req = req.header("content-type", ct);
        }
        let r = req.send().await.unwrap();
        assert_eq!(
            r.headers()["accept-patch"],
            "application/merge-patch+json, application/json"
        );
        problem(r, 415, "unsupported-media-type").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patched_book_is_validated_with_the_create_rules() {
    let s = svc().await;
    let (id, etag) = s.created("v").await;
    let r = s
        .client
        .patch(s.book_url(&id))
        .header("content-type", "application/merge-patch+json")
        .body(r#"{"title": null, "year": 99999, "isbn": "x"}"#)
        .send()
        .await
        .unwrap();
    let doc = problem(r, 422, "validation-failed").await;
    let paths: Vec<&str> = doc["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert!(paths.contains(&"/title"), "{doc}");
    assert!(paths.contains(&"/isbn"), "{doc}");
    let r = s
        .client
        .patch(s.book_url(&id))
        .header("content-type", "application/merge-patch+json")
        .body(r#"{"year": 99999, "author": ""}"#)
        .send()
        .await
        .unwrap();
    let doc = problem(r, 422, "validation-failed").await;
    let paths: Vec<&str> = doc["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"/year") && paths.contains(&"/author"),
        "{doc}"
    );
    // Create uses the same rules.
    let r = s
        .create(
            "bad-create",
            &json!({"title": "", "author": "A", "year": "x"}),
        )
        .send()
        .await
        .unwrap();
    problem(r, 422, "validation-failed").await;
    // Nothing changed.
    let r = s.client.get(s.book_url(&id)).send().await.unwrap();
    assert_eq!(r.headers()["etag"], etag.as_str());
    let missing = s
        .client
        .patch(s.book_url("nope"))
        .header("content-type", "application/merge-patch+json")
        .body("{}")
        .send()
        .await
        .unwrap();
    problem(missing, 404, "not-found").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_get_400_and_create_nothing() {
    let s = svc().await;
    let overlong = "k".repeat(256);
    let cases: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        overlong.into_bytes(),
        b"ctl\tkey".to_vec(),
        "c1\u{9b}x".as_bytes().to_vec(),
        b"\"unterminated".to_vec(),
    ];
    for key in cases {
        let r = s
            .client
            .post(format!("{}/books", s.url))
            .header("authorization", &s.token)
            .header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(&key).unwrap(),
            )
            .json(&kindred())
            .send()
            .await
            .unwrap();
        problem(r, 400, "idempotency-key-invalid").await;
    }
    let dup = s
        .client
        .post(format!("{}/books", s.url))
        .header("authorization", &s.token)
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .json(&kindred())
        .send()
        .await
        .unwrap();
    let doc = problem(dup, 400, "idempotency-key-invalid").await;
    assert!(doc["detail"].as_str().unwrap().contains("2 times"), "{doc}");
    assert_eq!(s.count().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_or_invalid_json_gets_400() {
    let s = svc().await;
    for (key, raw) in [
        ("t1", r#"{"title": "Kindred", "author": "Octavia"#),
        ("t2", "not json"),
        ("t3", ""),
    ] {
        let r = s
            .client
            .post(format!("{}/books", s.url))
            .header("authorization", &s.token)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        problem(r, 400, "bad-request").await;
    }
    // A 400 is a deterministic answer: it is stored and replayed for the same request.
    let again = s
        .client
        .post(format!("{}/books", s.url))
        .header("authorization", &s.token)
        .header("idempotency-key", "t2")
        .header("content-type", "application/json")
        .body("not json")
        .send()
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.status(), StatusCode::BAD_REQUEST);
    let (id, _) = s.created("ok").await;
    let patch = s
        .client
        .patch(s.book_url(&id))
        .header("content-type", "application/merge-patch+json")
        .body(r#"{"year": 19"#)
        .send()
        .await
        .unwrap();
    problem(patch, 400, "bad-request").await;
    assert_eq!(s.count().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_gets_413() {
    let s = svc().await;
    let mut big = kindred();
    big["summary"] = json!("x".repeat(1024 * 1024 + 1));
    let r = s.create("big", &big).send().await.unwrap();
    problem(r, 413, "request-body-too-large").await;
    assert_eq!(s.count().await, 0);
}

/// `cargo run -p books-api` prints the URL it listens on, and the service answers there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_prints_its_url_and_serves() {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_books-api"))
        .env("BOOKS_DATABASE", dir.path().join("books.sqlite3"))
        .env_remove("BOOKS_PORT")
        .env_remove("BOOKS_STORE")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the binary prints its URL")
        .unwrap()
        .unwrap();
    let url = line
        .strip_prefix("books API listening on ")
        .expect("the URL line")
        .to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let client = Client::builder().no_proxy().build().unwrap();
    let r = client
        .post(format!("{url}/books"))
        .header("authorization", TOKEN)
        .header("idempotency-key", "bin")
        .json(&kindred())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let location = r.headers()["location"].to_str().unwrap().to_owned();
    let got = client.get(format!("{url}{location}")).send().await.unwrap();
    assert_eq!(got.status(), StatusCode::OK);
    child.kill().await.unwrap();
}

impl Svc {
    fn patch(&self, id: &str, body: &str) -> RequestBuilder {
        self.client
            .patch(self.book_url(id))
            .header("authorization", &self.token)
            .header("content-type", "application/merge-patch+json")
            .body(body.to_owned())
    }

    /// Writes a book row the way another program would: straight into the table, with a
    /// version of its own choosing.
    async fn insert_directly(&self, id: &str, version: i64) {
        match &self.config.store {
            StoreChoice::Postgres(url) => {
                let pool = idempotency_postgres::sqlx::PgPool::connect(url)
                    .await
                    .unwrap();
                idempotency_postgres::sqlx::query(&format!(
                    "INSERT INTO \"{}\".books (id, title, author, year, version)
                     VALUES ($1, 'Dawn', 'Octavia E. Butler', 1987, $2)",
                    self.config.postgres_schema
                ))
                .bind(id)
                .bind(version)
                .execute(&pool)
                .await
                .unwrap();
            }
            StoreChoice::Mysql(url) => {
                use idempotency_mysql::sqlx::{self, Connection as _};
                let mut conn = sqlx::MySqlConnection::connect(url).await.unwrap();
                let (books, _) = self.config.mysql_tables();
                sqlx::query(&format!(
                    "INSERT INTO `{books}` (id, title, author, year, version)
                     VALUES (?, 'Dawn', 'Octavia E. Butler', 1987, ?)"
                ))
                .bind(id)
                .bind(version)
                .execute(&mut conn)
                .await
                .unwrap();
                conn.close().await.unwrap();
            }
            StoreChoice::Dynamodb(_) => {
                use idempotency_dynamodb::aws_sdk_dynamodb::types::AttributeValue;
                let (books, _) = self.config.dynamodb_tables();
                idempotency_testing::dynamodb::client()
                    .put_item()
                    .table_name(books)
                    .item("id", AttributeValue::S(id.to_owned()))
                    .item("title", AttributeValue::S("Dawn".to_owned()))
                    .item("author", AttributeValue::S("Octavia E. Butler".to_owned()))
                    .item("year", AttributeValue::N("1987".to_owned()))
                    .item("version", AttributeValue::N(version.to_string()))
                    .item("created_at", AttributeValue::N("0".to_owned()))
                    .send()
                    .await
                    .unwrap();
            }
            _ => {
                let conn = rusqlite::Connection::open(&self.config.database).unwrap();
                conn.busy_timeout(Duration::from_secs(5)).unwrap();
                conn.execute(
                    "INSERT INTO books (id, title, author, year, version)
                     VALUES (?1, 'Dawn', 'Octavia E. Butler', 1987, ?2)",
                    rusqlite::params![id, version],
                )
                .unwrap();
            }
        }
    }
}

/// The PATCH is behind the layer, and its preconditions are part of the request: a PATCH
/// answered 412 is not stored, so the retry with the same key and a fresh `If-Match` applies;
/// and a stored 200 is never replayed to a request with another `If-Match`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patch_with_a_key_412_then_fresh_if_match_applies() {
    let s = svc().await;
    let (id, etag) = s.created("pk").await;
    // Someone else changes the book: `etag` is stale now.
    let r = s.patch(&id, r#"{"year": 1980}"#).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let fresh = r.headers()["etag"].to_str().unwrap().to_owned();
    let key = uuid::Uuid::new_v4().to_string();
    let stale = s
        .patch(&id, r#"{"summary": "s"}"#)
        .header("idempotency-key", &key)
        .header("if-match", &etag)
        .send()
        .await
        .unwrap();
    problem(stale, 412, "precondition-failed").await;
    let retried = s
        .patch(&id, r#"{"summary": "s"}"#)
        .header("idempotency-key", &key)
        .header("if-match", &fresh)
        .send()
        .await
        .unwrap();
    assert_eq!(
        retried.status(),
        StatusCode::OK,
        "the stored 412 was replayed"
    );
    assert!(!replayed(&retried));
    let newest = retried.headers()["etag"].to_str().unwrap().to_owned();
    let body: Value = retried.json().await.unwrap();
    assert_eq!(body["book"]["summary"], "s");
    // The same retry again replays the 200.
    let again = s
        .patch(&id, r#"{"summary": "s"}"#)
        .header("idempotency-key", &key)
        .header("if-match", &fresh)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), StatusCode::OK);
    assert!(replayed(&again));
    assert_eq!(again.headers()["etag"].to_str().unwrap(), newest);
}

/// Merge patches that are not objects replace the whole book (RFC 7396) and so fail
/// validation at the root; a nested member where a string belongs fails at its path. Nothing
/// is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_object_and_nested_merge_patches_get_422() {
    let s = svc().await;
    let (id, etag) = s.created("np").await;
    for patch in ["[1]", "\"x\"", "null", "42"] {
        let r = s.patch(&id, patch).send().await.unwrap();
        let doc = problem(r, 422, "validation-failed").await;
        assert_eq!(doc["errors"][0]["path"], "", "{patch}: {doc}");
    }
    let r = s
        .patch(&id, r#"{"title": {"main": "Kindred"}}"#)
        .send()
        .await
        .unwrap();
    let doc = problem(r, 422, "validation-failed").await;
    assert_eq!(doc["errors"][0]["path"], "/title", "{doc}");
    // A nested object inside a removed member is simply gone.
    let r = s
        .patch(&id, r#"{"summary": {"a": null}}"#)
        .send()
        .await
        .unwrap();
    let doc = problem(r, 422, "validation-failed").await;
    assert_eq!(doc["errors"][0]["path"], "/summary", "{doc}");
    let read = s.client.get(s.book_url(&id)).send().await.unwrap();
    assert_eq!(
        read.headers()["etag"].to_str().unwrap(),
        etag,
        "a patch wrote"
    );
}

/// A row written by another program (any version) can be read and patched with its ETag:
/// the conditional update compares the version it read, not a stored tag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_elsewhere_can_be_patched_with_their_etag() {
    let s = svc().await;
    // The table exists once the service has started.
    let id = uuid::Uuid::new_v4().to_string();
    s.insert_directly(&id, 41).await;
    let read = s.client.get(s.book_url(&id)).send().await.unwrap();
    assert_eq!(read.status(), StatusCode::OK);
    let etag = read.headers()["etag"].to_str().unwrap().to_owned();
    let r = s
        .patch(&id, r#"{"year": 1988}"#)
        .header("if-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["book"]["year"], 1988);
    // The old tag is stale now.
    let r = s
        .patch(&id, r#"{"year": 1989}"#)
        .header("if-match", &etag)
        .send()
        .await
        .unwrap();
    problem(r, 412, "precondition-failed").await;
}

/// `GET /` publishes the key retention and where keys are required.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_root_publishes_the_key_retention() {
    let s = svc_with(|c| c.policy = Policy::default().retention(Duration::from_secs(3600))).await;
    let doc: Value = s
        .client
        .get(format!("{}/", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(doc["idempotency"]["key_retention_seconds"], 3600);
    assert_eq!(doc["idempotency"]["required_for"][0], "POST /books");
}
