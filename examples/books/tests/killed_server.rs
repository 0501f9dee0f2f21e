//! The exactly-once create, with the real `books-api` binary killed (SIGKILL) between the
//! insert and the answer, many times, on SQLite (the default), on the real Postgres server, on
//! the real MariaDB server and on the local DynamoDB stand-in (through a proxy of the test's,
//! which tells when a killed server's requests have settled and can hold its writes).
//!
//! Each run sends a create with a fresh key, kills the server at one of three points, starts
//! it again on the same database, and retries the same request until it is no longer in
//! progress. The kill points: the moment the book's row becomes visible in the database (the
//! insert committed; the answer may not be written yet), after a random delay, or while the
//! test holds the books' writes (so the kill surely lands before the commit, whatever the
//! machine's load). Whatever the moment of the kill, the key ends with exactly one book: the
//! retry replays the committed create, or (nothing was committed) runs it once.
//!
//! What was committed is read only once it is settled: the killed process is reaped, and on
//! Postgres and MariaDB its server sessions, which finish the statement in hand (a COMMIT
//! included) before they notice their client is gone, have exited.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idempotency_mysql::sqlx::{Connection as _, Executor as _, MySqlConnection, MySqlPool};
use idempotency_postgres::sqlx::{self, PgPool, Postgres, Transaction};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "support/server_process.rs"]
mod server_process;
use server_process::Server;
#[path = "support/dynamodb_proxy.rs"]
mod dynamodb_proxy;
use dynamodb_proxy::Proxy;

const RUNS: usize = 100;
/// Short, so that a retry after a kill before the commit does not wait long for the lease.
const LEASE_SECS: &str = "0.5";
/// How long the test waits for the database to reach a state it expects: only a bound for a
/// poll that normally ends in milliseconds, generous so that a loaded machine does not fail it.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the books are, to see the insert commit from outside the server.
enum Books {
    Sqlite(PathBuf),
    Postgres {
        pool: PgPool,
        schema: String,
        /// The `application_name` of the server's connections, and of no other: unique to the
        /// test, so that `pg_stat_activity` tells when the killed server's backends are gone.
        application_name: String,
    },
    Mysql {
        /// The test's own connections, on the database the test URL names (never on the
        /// server's, so that they are not counted as the server's sessions).
        pool: MySqlPool,
        /// The database of the server's URL, holding its `books` and `idempotency_records`,
        /// created for this test and used by no other client. MariaDB has no
        /// `application_name`, and connection attributes show only in the performance schema
        /// (off by default); but `information_schema.PROCESSLIST` shows every session's
        /// default database, which the server's sessions never change (they never run `USE`),
        /// so the sessions with this `DB` are exactly the server's. (The client port would
        /// name them too, but the test does not know the ports of a process it has killed.)
        database: String,
    },
    Dynamodb {
        /// The test's own client, straight to the stand-in.
        client: idempotency_dynamodb::aws_sdk_dynamodb::Client,
        table: String,
        /// The server's way to the stand-in.
        proxy: Proxy,
    },
}

/// The books' writes held by the test, so that a kill lands before the commit.
enum WritesBlocked {
    /// `BEGIN IMMEDIATE` on the file: the server can neither claim the key nor insert.
    Sqlite(rusqlite::Connection),
    /// `LOCK TABLE books IN EXCLUSIVE MODE`: reads go on and the claim commits; the insert
    /// waits.
    Postgres(Transaction<'static, Postgres>),
    /// `LOCK TABLES books READ` on a connection of its own: it holds the table's metadata lock
    /// in a mode that lets every session read the table but no session write it, whatever the
    /// isolation level (a row or gap lock from a `SELECT … FOR UPDATE` would depend on it: at
    /// READ COMMITTED InnoDB takes no gap locks, and the new book's key could fall in any
    /// gap). The claim, on the records' table, commits; the insert waits for the lock
    /// (`Waiting for table metadata lock`). A session whose client dies while it waits
    /// gives up the wait, and any session that got past it only once the lock was released
    /// still finds its client gone before a COMMIT could arrive: nothing it did commits.
    Mysql(MySqlConnection),
    /// The proxy holds the server's `TransactWriteItems` (the book with the key's
    /// completion): the claim went through; the create's one write waits, and is dropped
    /// when released, as a request lost on the way (the server is dead by then).
    Dynamodb,
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
            Books::Postgres { pool, schema, .. } => {
                sqlx::query_scalar(&format!("SELECT count(*) FROM \"{schema}\".books"))
                    .fetch_one(pool)
                    .await
                    .unwrap_or(0)
            }
            Books::Mysql { pool, database } => {
                sqlx::query_scalar(&format!("SELECT count(*) FROM `{database}`.books"))
                    .fetch_one(pool)
                    .await
                    .expect("count the books in MariaDB")
            }
            Books::Dynamodb { client, table, .. } => {
                let mut count = 0;
                let mut start = None;
                loop {
                    let page = client
                        .scan()
                        .table_name(table)
                        .consistent_read(true)
                        .select(idempotency_dynamodb::aws_sdk_dynamodb::types::Select::Count)
                        .set_exclusive_start_key(start.take())
                        .send()
                        .await;
                    // The server creates the table at its first start.
                    let Ok(page) = page else { return 0 };
                    count += i64::from(page.count);
                    match page.last_evaluated_key {
                        Some(k) if !k.is_empty() => start = Some(k),
                        _ => break count,
                    }
                }
            }
        }
    }

    /// The count once a killed server can no longer change it. SQLite: at once, as the
    /// process was reaped and no other one writes the file. Postgres: once no backend of the
    /// server is left, as a backend whose client died still finishes the statement in hand,
    /// a COMMIT included, before it reads the closed socket and exits. MariaDB: likewise, once
    /// no session of the server is left (its thread ends the statement in hand, then reads
    /// the closed socket, rolls back what is not committed and ends).
    async fn settled_count(&self) -> i64 {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            let live = match self {
                Books::Sqlite(_) => 0,
                Books::Postgres {
                    pool,
                    application_name,
                    ..
                } => backends(pool, application_name, "").await,
                Books::Mysql { pool, database } => sessions(pool, database, "").await,
                // Every connection of the killed server read to its end, and every request
                // it forwarded answered by the stand-in.
                Books::Dynamodb { proxy, .. } => i64::try_from(proxy.connections()).unwrap(),
            };
            if live == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{live} sessions of the killed server still run after {SETTLE_TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.count().await
    }

    async fn block_writes(&self) -> WritesBlocked {
        match self {
            Books::Sqlite(path) => {
                let conn = rusqlite::Connection::open(path).unwrap();
                conn.busy_timeout(Duration::from_secs(5)).unwrap();
                conn.execute_batch("BEGIN IMMEDIATE").unwrap();
                WritesBlocked::Sqlite(conn)
            }
            Books::Postgres { pool, schema, .. } => {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query(&format!("LOCK TABLE \"{schema}\".books IN EXCLUSIVE MODE"))
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                WritesBlocked::Postgres(tx)
            }
            Books::Mysql { database, .. } => {
                let mut conn = idempotency_testing::mysql::admin().await;
                // Text protocol: `LOCK TABLES` is not a statement to prepare.
                conn.execute(format!("LOCK TABLES `{database}`.books READ").as_str())
                    .await
                    .unwrap();
                WritesBlocked::Mysql(conn)
            }
            Books::Dynamodb { proxy, .. } => {
                proxy.hold(true);
                WritesBlocked::Dynamodb
            }
        }
    }

    /// Returns once the server has the request in hand and waits for the writes: on Postgres
    /// and MariaDB, when its insert waits for the lock (the key is claimed by then); on
    /// SQLite, which shows no waiter from outside, after a random delay of up to 20 ms.
    async fn wait_for_blocked_server(&self) {
        match self {
            Books::Sqlite(_) => random_delay().await,
            Books::Postgres {
                pool,
                application_name,
                ..
            } => {
                let deadline = Instant::now() + SETTLE_TIMEOUT;
                while backends(pool, application_name, "AND wait_event_type = 'Lock'").await == 0 {
                    assert!(
                        Instant::now() < deadline,
                        "the server's insert did not wait for the test's lock within \
                         {SETTLE_TIMEOUT:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            Books::Mysql { pool, database } => {
                let deadline = Instant::now() + SETTLE_TIMEOUT;
                while sessions(
                    pool,
                    database,
                    "AND STATE = 'Waiting for table metadata lock'",
                )
                .await
                    == 0
                {
                    assert!(
                        Instant::now() < deadline,
                        "the server's insert did not wait for the test's lock within \
                         {SETTLE_TIMEOUT:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            Books::Dynamodb { proxy, .. } => {
                let deadline = Instant::now() + SETTLE_TIMEOUT;
                while proxy.held() == 0 {
                    assert!(
                        Instant::now() < deadline,
                        "the server's create did not reach the held proxy within \
                         {SETTLE_TIMEOUT:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }
}

impl WritesBlocked {
    async fn release(self, books: &Books) {
        match self {
            WritesBlocked::Sqlite(conn) => conn.execute_batch("ROLLBACK").unwrap(),
            WritesBlocked::Postgres(tx) => tx.rollback().await.unwrap(),
            WritesBlocked::Mysql(mut conn) => {
                conn.execute("UNLOCK TABLES").await.unwrap();
                conn.close().await.unwrap();
            }
            WritesBlocked::Dynamodb => {
                if let Books::Dynamodb { proxy, .. } = books {
                    proxy.hold(false);
                }
            }
        }
    }
}

/// The sessions of the MariaDB server whose default database is `database` (and matching
/// `and`, an extra condition).
async fn sessions(pool: &MySqlPool, database: &str, and: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM information_schema.PROCESSLIST WHERE DB = ? {and}"
    ))
    .bind(database)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The backends named `application_name` (and matching `and`, an extra condition).
async fn backends(pool: &PgPool, application_name: &str, and: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 {and}"
    ))
    .bind(application_name)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn random_delay() {
    let micros = rand::Rng::gen_range(&mut rand::thread_rng(), 0..20_000);
    tokio::time::sleep(Duration::from_micros(micros)).await;
}

/// Where a run kills the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KillPoint {
    /// The moment the book's row is visible: after the commit, maybe before the answer.
    RowVisible,
    /// After a random delay of up to 20 ms: either side of the commit, by chance.
    RandomDelay,
    /// While the test holds the books' writes: surely before the commit.
    WritesBlocked,
}

impl KillPoint {
    /// A fixed share of each: one run in four after a random delay, one in eight with the
    /// writes blocked (on Postgres and MariaDB the claim is left in progress, so its retry
    /// waits out the lease), the rest at the row.
    fn of_run(run: usize) -> Self {
        match (run % 4, run % 8) {
            (3, _) => KillPoint::RandomDelay,
            (_, 1) => KillPoint::WritesBlocked,
            _ => KillPoint::RowVisible,
        }
    }
}

/// What happened in one run, for the figures.
#[derive(Default, Debug)]
struct Tally {
    killed_after_commit: usize,
    killed_before_commit: usize,
    killed_with_writes_blocked: usize,
    /// Runs whose commit became visible only after the kill (a Postgres backend or MariaDB
    /// session outliving its killed client).
    committed_after_kill: usize,
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
        let point = KillPoint::of_run(run);
        let blocked = match point {
            KillPoint::WritesBlocked => Some(books.block_writes().await),
            _ => None,
        };
        let first = tokio::spawn(send(&server.url));
        match point {
            KillPoint::RowVisible => {
                let deadline = Instant::now() + Duration::from_secs(10);
                while books.count().await == before && Instant::now() < deadline {
                    tokio::task::yield_now().await;
                }
            }
            KillPoint::RandomDelay => random_delay().await,
            KillPoint::WritesBlocked => books.wait_for_blocked_server().await,
        }
        server.kill();
        if let Some(blocked) = blocked {
            blocked.release(&books).await;
        }
        // Read at once too, to count the commits that land after the kill.
        let at_kill = books.count().await;
        let settled = books.settled_count().await;
        if settled != at_kill {
            tally.committed_after_kill += 1;
        }
        let committed = settled > before;
        if committed {
            tally.killed_after_commit += 1;
        } else {
            tally.killed_before_commit += 1;
        }
        if point == KillPoint::WritesBlocked {
            assert!(
                !committed,
                "{label} run {run}: the create committed while the test held its writes"
            );
            tally.killed_with_writes_blocked += 1;
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
         (answer already read {}), before it {} (with the writes blocked {}), committed after \
         the kill {}; retries replayed {}, executed {}",
        started.elapsed().as_secs_f64(),
        tally.killed_after_commit,
        tally.answered_before_kill,
        tally.killed_before_commit,
        tally.killed_with_writes_blocked,
        tally.committed_after_kill,
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
    // The schema's name also names the server's connections (63 bytes at most).
    let schema = format!("books_killed_{}", uuid::Uuid::new_v4().simple());
    let separator = if url.contains('?') { '&' } else { '?' };
    let server_url = format!("{url}{separator}application_name={schema}");
    let dir = tempfile::tempdir().unwrap();
    let env = vec![
        ("BOOKS_STORE", "postgres".to_owned()),
        ("BOOKS_POSTGRES_URL", server_url),
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
            application_name: schema.clone(),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_create_killed_between_insert_and_answer_makes_one_book() {
    let database = Database::create().await;
    let pool =
        idempotency_testing::mysql::pool(idempotency_testing::mysql::Isolation::RepeatableRead, 4)
            .await;
    // The server's URL is the test's with the database of its own.
    let mut server_url = reqwest::Url::parse(&idempotency_testing::mysql::url()).unwrap();
    server_url.set_path(&format!("/{}", database.name));
    let dir = tempfile::tempdir().unwrap();
    let env = vec![
        ("BOOKS_STORE", "mysql".to_owned()),
        ("BOOKS_MYSQL_URL", server_url.to_string()),
        (
            "BOOKS_DATABASE",
            path_string(&dir.path().join("unused.sqlite3")),
        ),
    ];
    // The first start creates the books table and the records' table in the database.
    campaign(
        Books::Mysql {
            pool: pool.clone(),
            database: database.name.clone(),
        },
        env,
        "mysql",
    )
    .await;
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_create_killed_between_insert_and_answer_makes_one_book() {
    let prefix = format!("books-killed-{}-", uuid::Uuid::new_v4().simple());
    let (books_table, records_table) = (format!("{prefix}books"), format!("{prefix}idempotency"));
    let _tables = [
        idempotency_testing::dynamodb::TableGuard::for_table(&books_table),
        idempotency_testing::dynamodb::TableGuard::for_table(&records_table),
    ];
    let stand_in = idempotency_testing::dynamodb::url();
    let upstream = reqwest::Url::parse(&stand_in).unwrap();
    let proxy = Proxy::start(format!(
        "{}:{}",
        upstream.host_str().unwrap(),
        upstream.port_or_known_default().unwrap()
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let env = vec![
        ("BOOKS_STORE", "dynamodb".to_owned()),
        ("BOOKS_DYNAMODB_URL", proxy.url.clone()),
        ("BOOKS_DYNAMODB_TABLE_PREFIX", prefix),
        (
            "BOOKS_DATABASE",
            path_string(&dir.path().join("unused.sqlite3")),
        ),
    ];
    // The first start creates both tables.
    campaign(
        Books::Dynamodb {
            client: idempotency_testing::dynamodb::client(),
            table: books_table,
            proxy,
        },
        env,
        "dynamodb",
    )
    .await;
}

/// A database of the test's own on the MariaDB server (`books_killed_<random>`), dropped with
/// its tables when the guard is dropped, also when the test fails. Databases of this name that
/// crashed runs left behind are dropped first, once all their tables are an hour old.
struct Database {
    name: String,
}

impl Database {
    async fn create() -> Self {
        let mut admin = idempotency_testing::mysql::admin().await;
        let stale: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(TABLE_SCHEMA AS CHAR) FROM information_schema.TABLES
             WHERE TABLE_SCHEMA LIKE 'books\\_killed\\_%'
             GROUP BY TABLE_SCHEMA HAVING MAX(CREATE_TIME) < NOW() - INTERVAL 1 HOUR",
        )
        .fetch_all(&mut admin)
        .await
        .unwrap();
        for old in stale {
            let _ = admin
                .execute(format!("DROP DATABASE IF EXISTS `{old}`").as_str())
                .await;
        }
        let name = format!(
            "books_killed_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..20]
        );
        admin
            .execute(format!("CREATE DATABASE `{name}`").as_str())
            .await
            .unwrap();
        admin.close().await.unwrap();
        Self { name }
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS `{}`", self.name);
        // `drop` may run inside the test's runtime: the drop runs on a runtime of its own, on
        // another thread.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                use idempotency_mysql::sqlx::ConnectOptions as _;
                let mut conn = idempotency_testing::mysql::options().connect().await.ok()?;
                let dropped = conn.execute(sql.as_str()).await.is_ok();
                let _ = conn.close().await;
                dropped.then_some(())
            })
        })
        .join()
        .ok()
        .flatten()
        .is_some();
        if !dropped {
            eprintln!("warning: could not drop the test database {}", self.name);
        }
    }
}

fn path_string(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}
