//! The `idempotency-reqwest` client against the real `books-api` binary (SQLite, the default
//! store), with the answer lost after the create committed, many times:
//!
//! - through a loopback proxy that closes the client's connection the moment the server's
//!   answer starts (the book and its key committed together before the server wrote a byte),
//!   either before forwarding anything or after the first bytes of the status line;
//! - with the server killed (SIGKILL) at random points of the request, or the moment the book
//!   is visible in the database, and restarted on the same SQLite file and port.
//!
//! The client's own retries must end in the replay, and no operation may make two books.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/server_process.rs"]
mod server_process;

use idempotency_reqwest::reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use idempotency_reqwest::{
    IdempotencyMiddleware, IdempotentRequestExt, IdempotentResponseExt, RetryPolicy,
};
use rand::Rng;
use serde_json::{json, Value};
use server_process::Server;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const DROPPED_OPERATIONS: usize = 100;
const KILLED_OPERATIONS: usize = 100;
/// Short, so that a kill after the claim and before the commit holds the key briefly.
const LEASE_SECS: &str = "0.2";

fn client() -> ClientWithMiddleware {
    ClientBuilder::new(
        reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
    )
    .with(
        IdempotencyMiddleware::new().retry_policy(
            RetryPolicy::default()
                .max_attempts(60)
                .backoff(Duration::from_millis(10), Duration::from_millis(100))
                // The server's Retry-After is at least a second; its lease is 0.2 s.
                .max_retry_after(Duration::from_millis(250))
                .deadline(Duration::from_secs(20)),
        ),
    )
    .build()
}

fn book(n: usize) -> Value {
    json!({"title": format!("Book {n}"), "author": "Octavia E. Butler", "year": 1979})
}

fn count_books(db: &Path) -> i64 {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn.query_row("SELECT count(*) FROM books", [], |r| r.get(0))
        .unwrap_or(0)
}

async fn books(db: &Path) -> i64 {
    let db = db.to_path_buf();
    tokio::task::spawn_blocking(move || count_books(&db))
        .await
        .unwrap()
}

fn env_for(db: &Path, port: Option<u16>) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("BOOKS_STORE", "sqlite".to_owned()),
        ("BOOKS_DATABASE", db.to_str().unwrap().to_owned()),
        ("BOOKS_LEASE_SECS", LEASE_SECS.to_owned()),
    ];
    if let Some(port) = port {
        env.push(("BOOKS_PORT", port.to_string()));
    }
    env
}

/// A loopback TCP proxy to `upstream` that, while `drops` is above zero, closes the
/// connection carrying the next answer as soon as the answer's first bytes arrive from the
/// server, forwarding none of them or (every other time) the first few.
struct DroppingProxy {
    url: String,
    drops: Arc<AtomicU32>,
    dropped: Arc<AtomicU32>,
}

impl DroppingProxy {
    async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let drops = Arc::new(AtomicU32::new(0));
        let dropped = Arc::new(AtomicU32::new(0));
        let (d, dd) = (drops.clone(), dropped.clone());
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let upstream = upstream.clone();
                let (d, dd) = (d.clone(), dd.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream.as_str()).await {
                        relay(client, server, d, dd).await;
                    }
                });
            }
        });
        Self {
            url,
            drops,
            dropped,
        }
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    drops: Arc<AtomicU32>,
    dropped: Arc<AtomicU32>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match server_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let drop_now = drops
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if drop_now {
            let nth = dropped.fetch_add(1, Ordering::SeqCst);
            if nth % 2 == 1 {
                // A torn status line: the client has started reading an answer it never gets.
                let _ = client_write.write_all(&buf[..n.min(7)]).await;
            }
            break;
        }
        if client_write.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    upstream.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_lost_after_the_commit_are_replayed_to_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("books.sqlite3");
    let server = Server::start(&env_for(&db, None));
    let upstream = server.url.trim_start_matches("http://").to_owned();
    let proxy = DroppingProxy::start(upstream).await;
    let client = client();
    let started = Instant::now();
    let mut attempts = 0;
    for n in 0..DROPPED_OPERATIONS {
        let before = books(&db).await;
        proxy.drops.store(1, Ordering::SeqCst);
        let response = client
            .post(format!("{}/books", proxy.url))
            .header("authorization", "Bearer dropper")
            .json(&book(n))
            .idempotent()
            .send()
            .await
            .unwrap_or_else(|e| panic!("operation {n}: {e}"));
        assert_eq!(response.status(), 201, "operation {n}");
        let outcome = response.idempotency().unwrap().clone();
        assert!(
            outcome.replayed(),
            "operation {n}: the answer after the lost one was not a replay ({outcome:?})"
        );
        assert_eq!(outcome.attempts(), 2, "operation {n}");
        attempts += outcome.attempts();
        assert_eq!(
            proxy.drops.load(Ordering::SeqCst),
            0,
            "operation {n}: no answer was dropped"
        );
        let created: Value = response.json().await.unwrap();
        assert_eq!(created["book"]["title"], format!("Book {n}"));
        assert_eq!(books(&db).await, before + 1, "operation {n}: books made");
    }
    server.kill();
    println!(
        "dropping proxy: {DROPPED_OPERATIONS} operations in {:.1} s, {} answers dropped after the \
         commit ({} before any byte, {} after a torn status line), {attempts} attempts, \
         {DROPPED_OPERATIONS} replays, books per operation always 1",
        started.elapsed().as_secs_f64(),
        proxy.dropped.load(Ordering::SeqCst),
        proxy.dropped.load(Ordering::SeqCst).div_ceil(2),
        proxy.dropped.load(Ordering::SeqCst) / 2,
    );
}

/// What the kills did, for the figures.
#[derive(Debug, Default)]
struct Tally {
    kills: usize,
    killed_after_commit: usize,
    killed_before_commit: usize,
    /// The first attempt's answer arrived (the kill came after it).
    first_attempt_answered: usize,
    /// The answer was lost with the kill; a retry got the replay.
    retry_replayed: usize,
    /// Nothing was committed before the kill; a retry created the book.
    retry_created: usize,
    attempts: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_at_random_points_never_makes_two_books() {
    let dir = tempfile::tempdir().unwrap();
    let db: PathBuf = dir.path().join("books.sqlite3");
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let env = env_for(&db, Some(port));
    let mut server = Server::start(&env);
    let url = server.url.clone();
    let client = client();
    let mut tally = Tally::default();
    let started = Instant::now();
    for n in 0..KILLED_OPERATIONS {
        let before = books(&db).await;
        let request = client
            .post(format!("{url}/books"))
            .header("authorization", "Bearer killer")
            .json(&book(n))
            .idempotent()
            .send();
        let operation = tokio::spawn(request);
        // Half the kills land the moment the book is visible (committed; the answer may not be
        // written yet), the others after a random delay (before, during or after the request).
        if n % 2 == 0 {
            let deadline = Instant::now() + Duration::from_secs(5);
            while books(&db).await == before && Instant::now() < deadline {
                tokio::task::yield_now().await;
            }
        } else {
            let micros = rand::thread_rng().gen_range(0..15_000);
            tokio::time::sleep(Duration::from_micros(micros)).await;
        }
        server.kill();
        tally.kills += 1;
        if books(&db).await > before {
            tally.killed_after_commit += 1;
        } else {
            tally.killed_before_commit += 1;
        }
        server = Server::start(&env);
        assert_eq!(server.url, url, "the server came back on another port");
        let response = operation
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("operation {n}: {e}"));
        assert_eq!(response.status(), 201, "operation {n}");
        let outcome = response.idempotency().unwrap().clone();
        tally.attempts += outcome.attempts();
        match (outcome.attempts(), outcome.replayed()) {
            (1, _) => tally.first_attempt_answered += 1,
            (_, true) => tally.retry_replayed += 1,
            (_, false) => tally.retry_created += 1,
        }
        let created: Value = response.json().await.unwrap();
        assert_eq!(created["book"]["title"], format!("Book {n}"));
        assert_eq!(
            books(&db).await,
            before + 1,
            "operation {n}: books made (replayed: {}, attempts: {})",
            outcome.replayed(),
            outcome.attempts()
        );
    }
    server.kill();
    println!(
        "killed server: {KILLED_OPERATIONS} operations in {:.1} s, {} SIGKILLs and restarts on \
         the same file and port (after the commit {}, before it {}); answered by the first \
         attempt {}, answer lost and replayed to a retry {}, created by a retry {}; {} \
         attempts; books per operation always 1",
        started.elapsed().as_secs_f64(),
        tally.kills,
        tally.killed_after_commit,
        tally.killed_before_commit,
        tally.first_attempt_answered,
        tally.retry_replayed,
        tally.retry_created,
        tally.attempts,
    );
    assert!(
        tally.retry_replayed > 0,
        "no kill landed between the commit and the answer; the campaign proved nothing about it: \
         {tally:?}"
    );
}
