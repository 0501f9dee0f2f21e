//! Runs every row of the root README's "Bad inputs and what they get" table: `in-process` rows
//! through the real code, which must give the documented error; the others by checking that
//! the test they name exists.
#![allow(clippy::unwrap_used)]

use idempotency_bad_inputs::{documented, literal, literals, rows, Row};
use idempotency_core::protocol::decode_replay;
use idempotency_core::store::{ClaimRequest, Record, RecordStatus, Timestamp};
use idempotency_core::{
    FencingToken, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId,
    Scope,
};
use idempotency_memory::MemoryStore;
use idempotency_postgres::PostgresStore;
use idempotency_redis::RedisStore;
use idempotency_sqlite::SqliteStore;
use idempotency_tower::{read_key, StoredResponse, IDEMPOTENCY_KEY};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .to_path_buf()
}

fn text(row: &Row) -> String {
    let bytes = literal(&row.example)
        .unwrap_or_else(|| panic!("README line {}: example is not a literal", row.line));
    String::from_utf8(bytes).expect("a UTF-8 example")
}

fn id(key: &str) -> RecordId {
    RecordId::new(
        IdempotencyKey::new(key).expect("key"),
        Scope::new("bad-inputs").expect("scope"),
    )
}

fn request(id: &RecordId) -> ClaimRequest {
    ClaimRequest::new(
        id.clone(),
        Fingerprint::from_bytes(b"payload"),
        Duration::from_secs(600),
        Duration::from_secs(3600),
    )
}

fn err_of<T: std::fmt::Debug, E: std::fmt::Debug>(ty: &str, r: Result<T, E>) -> String {
    match r {
        Ok(v) => format!("accepted: {v:?}"),
        Err(e) => format!("{ty}::{e:?}"),
    }
}

/// A valid Redis record hash, field by field.
async fn sqlite_open(row: &Row, dir: &Path) -> String {
    let path = match row.example.as_str() {
        "missing/dir/x.db" => dir.join("missing").join("dir").join("x.db"),
        "<directory>" => dir.to_path_buf(),
        "<text file>" => {
            let p = dir.join("notes.txt");
            std::fs::write(&p, "these are my notes, not a database\n".repeat(200)).unwrap();
            p
        }
        other => PathBuf::from(other),
    };
    let before = std::fs::read(&path).ok();
    let got = err_of("SqliteError", SqliteStore::open(&path).await);
    if path.starts_with(dir) && path.is_file() {
        assert_eq!(std::fs::read(&path).ok(), before, "{path:?} was changed");
    }
    got
}

async fn sqlite_table(row: &Row, dir: &Path) -> String {
    let store = SqliteStore::builder(dir.join("t.db"))
        .table("orders")
        .open()
        .await
        .expect("open");
    match row.example.as_str() {
        "<no table>" => err_of("Error", store.claim(&request(&id("k"))).await),
        "<migration 99 recorded>" => {
            store.migrate().await.expect("migrate");
            store
                .call(|c| c.execute("INSERT INTO orders_migrations VALUES (99, 0)", []))
                .await
                .expect("call")
                .expect("insert");
            err_of("SqliteError", store.migrate().await)
        }
        ddl => {
            let sql = format!("DROP TABLE IF EXISTS orders; {ddl};");
            store
                .call(move |c| c.execute_batch(&sql))
                .await
                .expect("call")
                .expect("create the foreign table");
            let got = err_of("SqliteError", store.migrate().await);
            let kept: String = store
                .call(|c| {
                    c.query_row(
                        "SELECT sql FROM sqlite_schema WHERE name = 'orders'",
                        [],
                        |r| r.get(0),
                    )
                })
                .await
                .expect("call")
                .expect("the foreign table is still there");
            assert_eq!(kept, ddl, "the foreign table was changed");
            got
        }
    }
}

async fn sqlite_record(row: &Row, dir: &Path) -> String {
    let store = SqliteStore::open(dir.join("r.db")).await.expect("open");
    store.migrate().await.expect("migrate");
    let id = id("corrupt");
    store.claim(&request(&id)).await.expect("claim");
    let sql = format!(
        "UPDATE idempotency_records SET {} WHERE key = 'corrupt'",
        row.example
    );
    let changed = store
        .call(move |c| {
            c.pragma_update(None, "ignore_check_constraints", true)?;
            let n = c.execute(&sql, []);
            c.pragma_update(None, "ignore_check_constraints", false)?;
            n
        })
        .await
        .expect("call")
        .expect("corrupt the record");
    assert_eq!(changed, 1);
    err_of("Error", store.get(&id).await)
}

/// A well-formed completed record in the Redis store's encoding, damaged at one field.
fn redis_record(row: &Row) -> String {
    let (field, value) = row
        .example
        .split_once(" = ")
        .unwrap_or_else(|| panic!("README line {}: expected `field = value`", row.line));
    let good = Record {
        id: id("k"),
        fingerprint: Fingerprint::from_bytes(b"payload"),
        status: RecordStatus::Completed,
        token: FencingToken(3),
        lease_until: None,
        outcome: Some(b"{}".to_vec()),
        attempts: 1,
        failure: None,
        hits: 0,
        created_at: Timestamp::from_millis(1000),
        updated_at: Timestamp::from_millis(1000),
        expires_at: Timestamp::from_millis(9000),
    };
    let mut bytes = idempotency_redis::__fuzz::encode_record(&good);
    let number = || -> u64 { value.parse().expect("a number") };
    let mut put = |at: usize, b: &[u8]| bytes[at..at + b.len()].copy_from_slice(b);
    match field {
        "tag" => put(0, &literal(value).expect("a literal value")),
        "status" => put(4, &[number() as u8]),
        "flags" => put(5, &[number() as u8]),
        "token" => put(6, &number().to_be_bytes()),
        "expiry" => put(50, &number().to_be_bytes()),
        "message length" => put(90, &(number() as u32).to_be_bytes()),
        "length" => bytes.truncate(number() as usize),
        other => panic!("README line {}: no field {other:?}", row.line),
    }
    err_of(
        "Error",
        idempotency_redis::__fuzz::decode_record(&id("k"), &bytes),
    )
}

async fn check(row: &Row, dir: &Path) -> String {
    match row.place.as_str() {
        "key" => err_of("KeyError", IdempotencyKey::new(text(row))),
        "scope" => err_of("ScopeError", Scope::new(text(row))),
        "Idempotency-Key header" => {
            let lines = literals(&row.example).expect("header lines");
            let mut headers = http::HeaderMap::new();
            for line in lines {
                headers.append(
                    IDEMPOTENCY_KEY,
                    http::HeaderValue::from_bytes(&line).expect("a header value"),
                );
            }
            err_of("KeyHeaderError", read_key(&headers))
        }
        "fingerprint" => err_of("FromHexError", Fingerprint::from_hex(&text(row))),
        "JSON body" => {
            let body = literal(&row.example).expect("a body");
            assert!(Fingerprint::from_json_slice(&body).is_err());
            let fp = |b: &[u8]| {
                Fingerprint::builder()
                    .method("POST")
                    .path("/books")
                    .content_type("application/json")
                    .body(b)
                    .finish()
            };
            let mut spaced = body.clone();
            spaced.push(b' ');
            // Raw bytes: one more space is another request, as it is for any non-JSON body.
            if fp(&body) != fp(&spaced) {
                "raw bytes".to_owned()
            } else {
                "canonicalised".to_owned()
            }
        }
        "engine policy" => {
            let policy = match row.example.as_str() {
                "lease = 0" => Policy::default().lease(Duration::ZERO),
                "retention = 0" => Policy::default().retention(Duration::ZERO),
                "heartbeat = 1.0" => Policy::default().heartbeat(Some(1.0)),
                other => panic!("README line {}: unknown policy {other}", row.line),
            };
            err_of(
                "Error",
                Idempotency::new(Arc::new(MemoryStore::new()), policy).map(|_| ()),
            )
        }
        "stored outcome" => {
            let record = Record {
                id: id("k"),
                fingerprint: Fingerprint::from_bytes(b"x"),
                status: RecordStatus::Completed,
                token: FencingToken(1),
                lease_until: None,
                outcome: literal(&row.example),
                attempts: 1,
                failure: None,
                hits: 0,
                created_at: Timestamp::from_millis(0),
                updated_at: Timestamp::from_millis(0),
                expires_at: Timestamp::from_millis(1),
            };
            err_of("Error", decode_replay::<serde_json::Value>(&record))
        }
        "stored response" => err_of(
            "DecodeError",
            StoredResponse::decode(&literal(&row.example).expect("bytes")),
        ),
        "SQLite open" => sqlite_open(row, dir).await,
        "SQLite table name" => err_of(
            "SqliteError",
            SqliteStore::builder(dir.join("names.db"))
                .table(text(row))
                .open()
                .await,
        ),
        "SQLite table" => sqlite_table(row, dir).await,
        "SQLite record" => sqlite_record(row, dir).await,
        "PostgreSQL URL" => err_of(
            "PostgresError",
            PostgresStore::builder()
                .connect_timeout(Duration::from_secs(5))
                .connect(&text(row))
                .await,
        ),
        "PostgreSQL name" => {
            let parts = literals(&row.example).expect("schema, table");
            let [schema, table] = &parts[..] else {
                panic!("README line {}: expected schema and table", row.line)
            };
            // A lazy pool never connects: names are checked before any I/O.
            let pool = idempotency_postgres::sqlx::postgres::PgPoolOptions::new()
                .connect_lazy("postgres://postgres@127.0.0.1:5432/test")
                .expect("lazy pool");
            err_of(
                "PostgresError",
                PostgresStore::builder()
                    .schema(String::from_utf8(schema.clone()).unwrap())
                    .table(String::from_utf8(table.clone()).unwrap())
                    .build(pool),
            )
        }
        "Redis URL" => err_of("Error", RedisStore::connect(text(row).as_str()).await),
        "Redis record" => redis_record(row),
        other => panic!(
            "README line {}: no in-process check for {other:?}; add one here or name a test",
            row.line
        ),
    }
}

/// `path::function`: the file exists and defines the function.
fn named_test_exists(row: &Row) {
    let (path, function) = row.checked_by.rsplit_once("::").unwrap_or_else(|| {
        panic!(
            "README line {}: `checked by` must be in-process or path::test",
            row.line
        )
    });
    let source = std::fs::read_to_string(root().join(path))
        .unwrap_or_else(|e| panic!("README line {}: cannot read {path}: {e}", row.line));
    assert!(
        source.contains(&format!("fn {function}(")),
        "README line {}: {path} has no test named {function}",
        row.line
    );
}

#[tokio::test(flavor = "current_thread")]
async fn every_row_of_the_readme_table_holds() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("root README");
    let rows = rows(&readme);
    assert!(
        rows.len() >= 50,
        "the table was not found or lost rows ({} rows)",
        rows.len()
    );
    let mut failures = Vec::new();
    let (mut ran, mut named) = (0, 0);
    for row in &rows {
        if row.checked_by == "in-process" {
            let dir = tempfile::tempdir().expect("temp dir");
            let actual = check(row, dir.path()).await;
            ran += 1;
            if !documented(&row.gets, &actual) {
                failures.push(format!(
                    "README line {} ({} / {}): documented `{}`, got `{actual}`",
                    row.line, row.place, row.input, row.gets
                ));
            }
        } else {
            named_test_exists(row);
            named += 1;
        }
    }
    println!(
        "{} rows: {ran} run in process, {named} checked by named tests",
        rows.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
