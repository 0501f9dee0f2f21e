//! The exactly-once create, with the real `books-api` binary killed (SIGKILL) between the
//! insert and the answer, many times, on SQLite (the default) and on the real Postgres server.
//!
//! Each run sends a create with a fresh key, kills the server either the moment the book's row
//! becomes visible in the database (the insert committed; the answer may not be written yet)
//! or after a random delay, starts it again on the same database, and retries the same request
//! until it is no longer in progress. Whatever the moment of the kill, the key ends with
//! exactly one book: the retry replays the committed create, or (nothing was committed) runs it
//! once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idempotency_postgres::sqlx::{self, PgPool};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "support/server_process.rs"]
mod server_process;
use server_process::Server;

const RUNS: usize = 100;
/// Short, so that a retry after a kill before the commit does not wait long for the lease.
const LEASE_SECS: &str = "0.5";

/// Where the books are, to see the insert commit from outside the server.
enum Books {
    Sqlite(PathBuf),
    Postgres { pool: PgPool, schema: String },
}

impl Books {
    async fn count(&self) -> i64 {
        match self {
            Books::Sqlite(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || {
                    let conn = rusqlite::Connection::open_with_flags(
                        &path,
                        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
                    )
                    .unwrap();
                    conn.busy_timeout(Duration::from_secs(5)).unwrap();
                    conn.query_row("SELECT count(*) FROM books", [], |r| r.get(0))
                        .unwrap_or(0)
                })
                .await
                .unwrap()
            }
            Books::Postgres { pool, schema } => {
                sqlx::query_scalar(&format!("SELECT count(*) FROM \"{schema}\".books"))
                    .fetch_one(pool)
                    .await
                    .unwrap_or(0)
            }
        }
    }
}

/// What happened in one run, for the figures.
#[derive(Default, Debug)]
struct Tally {
    killed_after_commit: usize,
    killed_before_commit: usize,
    answered_before_kill: usize,
    retries_replayed: usize,
    retries_executed: usize,
}

async fn campaign(books: Books, mut env: Vec<(&str, String)>, label: &str) {
    env.push(("BOOKS_LEASE_SECS", LEASE_SECS.to_owned()));
    let client = Client::builder().no_proxy().build().unwrap();
    let body = json!({"title": "Kindred", "author": "Octavia E. Butler", "year": 1979});
    let mut server = Server::start(&env);
    let mut tally = Tally::default();
    let started = Instant::now();
    for run in 0..RUNS {
        let key = uuid::Uuid::new_v4().to_string();
        let send = |url: &str| {
            client
                .post(format!("{url}/books"))
                .header("authorization", "Bearer killer")
                .header("idempotency-key", &key)
                .header("content-type", "application/json")
                .timeout(Duration::from_secs(10))
                .body(body.to_string())
                .send()
        };
        let before = books.count().await;
        let first = tokio::spawn(send(&server.url));
        // Two kill points: the moment the insert is visible (most runs), or a random delay.
        if run % 4 != 3 {
            let deadline = Instant::now() + Duration::from_secs(10);
            while books.count().await == before && Instant::now() < deadline {
                tokio::task::yield_now().await;
            }
        } else {
            let micros = rand::Rng::gen_range(&mut rand::thread_rng(), 0..20_000);
            tokio::time::sleep(Duration::from_micros(micros)).await;
        }
        server.kill();
        let committed = books.count().await > before;
        if committed {
            tally.killed_after_commit += 1;
        } else {
            tally.killed_before_commit += 1;
        }
        let first = first.await.unwrap();
        let first_book = match first {
            Ok(r) if r.status() == StatusCode::CREATED => {
                tally.answered_before_kill += 1;
                let v: Value = r.json().await.unwrap();
                Some(v["book"]["id"].as_str().unwrap().to_owned())
            }
            Ok(r) => panic!("{label} run {run}: the first answer was {}", r.status()),
            Err(_) => None,
        };

        server = Server::start(&env);
        let deadline = Instant::now() + Duration::from_secs(20);
        let retry = loop {
            let r = send(&server.url).await.unwrap();
            if r.status() != StatusCode::CONFLICT || Instant::now() > deadline {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            retry.status(),
            StatusCode::CREATED,
            "{label} run {run}: the retry got {}",
            retry.status()
        );
        let replayed = retry
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let retry_book: Value = retry.json().await.unwrap();
        let retry_book = retry_book["book"]["id"].as_str().unwrap().to_owned();
        let after = books.count().await;
        assert_eq!(
            after,
            before + 1,
            "{label} run {run}: the key created {} books (committed before the kill: {committed}, \
             retry replayed: {replayed})",
            after - before
        );
        if committed {
            assert!(
                replayed,
                "{label} run {run}: a committed create was run again"
            );
            tally.retries_replayed += 1;
        } else {
            assert!(
                !replayed,
                "{label} run {run}: nothing committed, yet a replay"
            );
            tally.retries_executed += 1;
        }
        if let Some(id) = first_book {
            assert_eq!(
                id, retry_book,
                "{label} run {run}: the replay is another book"
            );
        }
    }
    server.kill();
    println!(
        "{label}: {RUNS} runs in {:.1} s, books per key always 1; killed after the commit {} \
         (answer already read {}), before it {}; retries replayed {}, executed {}",
        started.elapsed().as_secs_f64(),
        tally.killed_after_commit,
        tally.answered_before_kill,
        tally.killed_before_commit,
        tally.retries_replayed,
        tally.retries_executed,
    );
    assert!(
        tally.killed_after_commit > tally.answered_before_kill,
        "{label}: no kill landed between the commit and the answer; the campaign proved \
         nothing about that window"
    );
    assert!(
        tally.killed_before_commit > 0,
        "{label}: no kill landed before the commit; the campaign proved nothing about it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_create_killed_between_insert_and_answer_makes_one_book() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("books.sqlite3");
    let env = vec![
        ("BOOKS_STORE", "sqlite".to_owned()),
        ("BOOKS_DATABASE", path_string(&db)),
    ];
    campaign(Books::Sqlite(db), env, "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_create_killed_between_insert_and_answer_makes_one_book() {
    let url = std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = PgPool::connect(&url).await.unwrap_or_else(|e| {
        panic!("cannot reach Postgres at {url} ({e}); start it with `bash .ci/services`")
    });
    let schema = format!("books_killed_{}", uuid::Uuid::new_v4().simple());
    let dir = tempfile::tempdir().unwrap();
    let env = vec![
        ("BOOKS_STORE", "postgres".to_owned()),
        ("BOOKS_POSTGRES_URL", url.clone()),
        ("BOOKS_POSTGRES_SCHEMA", schema.clone()),
        (
            "BOOKS_DATABASE",
            path_string(&dir.path().join("unused.sqlite3")),
        ),
    ];
    // The first start creates the schema and the books table.
    campaign(
        Books::Postgres {
            pool: pool.clone(),
            schema: schema.clone(),
        },
        env,
        "postgres",
    )
    .await;
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}

fn path_string(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}
