//! End to end against the books API over real HTTP, idempotency records in SQLite (the
//! service's default) or the store `BOOKS_TEST_STORE` names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

const FORCED_STORE: Option<&str> = None;

include!("support/e2e_cases.rs");

/// The service purges expired keys on its schedule: the record is deleted from the SQLite
/// table, not only ignored once it has expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_keys_are_purged_on_a_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("books.sqlite3");
    let mut config = Config::new(&db, StoreChoice::Sqlite);
    config.policy = Policy::default()
        .lease(Duration::from_millis(200))
        .retention(Duration::from_millis(400));
    config.purge_every = Duration::from_millis(100);
    let running = books_api::start(&config, 0).await.unwrap();
    let records = || {
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.busy_timeout(Duration::from_secs(5)).unwrap();
        conn.query_row("SELECT count(*) FROM idempotency_records", [], |r| {
            r.get::<_, i64>(0)
        })
        .unwrap()
    };
    let r = Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("{}/books", running.url))
        .header("authorization", "Bearer purger")
        .header("idempotency-key", "purge-me")
        .header("content-type", "application/json")
        .body(kindred().to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(records(), 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while records() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(records(), 0, "the expired record was never purged");
}

/// A create whose transaction rolled back for sure (here the books table refuses the insert)
/// wrote nothing, book or record: the key is released, and the retry under it creates the
/// book. Before, the 500 was stored like any answer and replayed to every retry, so the key
/// could never create its book.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_transaction_rolled_back_is_run_again_by_its_retry() {
    let s = svc_with(|c| c.store = StoreChoice::Sqlite).await;
    let books = || {
        let conn = rusqlite::Connection::open(&s.config.database).unwrap();
        conn.busy_timeout(Duration::from_secs(5)).unwrap();
        conn
    };
    books()
        .execute_batch(
            "CREATE TRIGGER refuse_books BEFORE INSERT ON books \
             BEGIN SELECT RAISE(ABORT, 'the books table refuses inserts'); END;",
        )
        .unwrap();
    let failed = s.create("rolled-back", &kindred()).send().await.unwrap();
    problem(failed, 500, "handler-failed").await;
    assert_eq!(s.count().await, 0);
    books().execute_batch("DROP TRIGGER refuse_books;").unwrap();
    let retry = s.create("rolled-back", &kindred()).send().await.unwrap();
    assert_eq!(
        retry.status(),
        StatusCode::CREATED,
        "the retry of a rolled-back create was not run again"
    );
    assert!(!replayed(&retry));
    let again = s.create("rolled-back", &kindred()).send().await.unwrap();
    assert!(replayed(&again));
    assert_eq!(s.count().await, 1);
}
