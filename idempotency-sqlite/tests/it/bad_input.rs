//! Bad input gets a typed error and changes nothing: unwritable paths, files that are not
//! databases, bad table names, foreign tables, and records whose stored bytes are corrupt.

use crate::common;

use common::{id, manual_store, req};
use idempotency_core::store::Claim;
use idempotency_core::{Error, Fingerprint, Idempotency, IdempotencyStore, Policy};
use idempotency_sqlite::{ConnectionMode, SqliteError, SqliteStore};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const S: Duration = Duration::from_secs(1);

#[tokio::test]
async fn a_path_that_cannot_be_written_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let missing_dir = dir.path().join("no").join("such").join("dir").join("x.db");
    let is_dir = dir.path().to_path_buf();
    // Root may write anywhere on a normal file system, but never to procfs.
    let read_only_file = std::path::PathBuf::from("/proc/self/status");
    for path in [missing_dir, is_dir, read_only_file] {
        for mode in [
            ConnectionMode::DedicatedThread,
            ConnectionMode::BlockingPool { connections: 2 },
        ] {
            let err = SqliteStore::builder(&path)
                .mode(mode)
                .open()
                .await
                .expect_err("an unwritable path must be refused");
            assert!(
                matches!(&err, SqliteError::NotWritable { path: p, .. } if *p == path),
                "{path:?}: expected NotWritable, got {err:?}"
            );
            assert!(err.to_string().contains(&path.display().to_string()));
        }
    }
}

#[tokio::test]
async fn a_file_that_is_not_a_database_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.txt");
    let text = "these are my notes, not a database\n".repeat(200);
    std::fs::write(&path, &text).unwrap();
    let err = SqliteStore::open(&path).await.expect_err("must refuse");
    assert!(
        matches!(err, SqliteError::NotADatabase { .. }),
        "expected NotADatabase, got {err:?}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
}

#[tokio::test]
async fn table_names_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let long = "t".repeat(49);
    for bad in [
        "",
        "1records",
        "records; DROP TABLE x",
        "rec\"ords",
        "sqlite_master",
        "SQLITE_records",
        "naïve",
        "has space",
        long.as_str(),
    ] {
        let err = SqliteStore::builder(&path)
            .table(bad)
            .open()
            .await
            .expect_err("bad name must be refused");
        assert!(
            matches!(&err, SqliteError::InvalidName { name, .. } if name == bad),
            "{bad:?}: {err:?}"
        );
    }
    assert!(!path.exists(), "a refused name must not create the file");
    let store = SqliteStore::builder(&path)
        .table("Tenant_42_keys")
        .open()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    store.verify().await.unwrap();
}

#[tokio::test]
async fn a_table_of_another_shape_is_refused_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::builder(dir.path().join("t.db"))
        .table("orders")
        .open()
        .await
        .unwrap();
    let variants = [
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)",
        // Our columns but not STRICT.
        "CREATE TABLE orders (scope TEXT NOT NULL, key TEXT NOT NULL, fingerprint BLOB NOT NULL,
           status TEXT NOT NULL, token INTEGER NOT NULL, lease_until INTEGER, outcome BLOB,
           attempts INTEGER NOT NULL, failure_retryable INTEGER, failure_message TEXT,
           hits INTEGER NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
           expires_at INTEGER NOT NULL, PRIMARY KEY (scope, key))",
        // STRICT, one column missing.
        "CREATE TABLE orders (scope TEXT NOT NULL, key TEXT NOT NULL, fingerprint BLOB NOT NULL,
           status TEXT NOT NULL, token INTEGER NOT NULL, lease_until INTEGER, outcome BLOB,
           attempts INTEGER NOT NULL, failure_retryable INTEGER, failure_message TEXT,
           hits INTEGER NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
           PRIMARY KEY (scope, key)) STRICT",
    ];
    for ddl in variants {
        store
            .call(move |c| c.execute_batch(&format!("DROP TABLE IF EXISTS orders; {ddl};")))
            .await
            .unwrap()
            .unwrap();
        let err = store
            .migrate()
            .await
            .expect_err("foreign table must be refused");
        assert!(
            matches!(&err, SqliteError::TableShape { table, .. } if table == "orders"),
            "{ddl}: {err:?}"
        );
        let err = store.verify().await.expect_err("mismatch");
        assert!(matches!(err, SqliteError::TableShape { .. }), "{err:?}");
        // Nothing was changed: no migrations table, the original table is still there.
        let (ours, sql): (i64, String) = store
            .call(|c| {
                c.query_row(
                    "SELECT (SELECT count(*) FROM sqlite_schema WHERE name = 'orders_migrations'),
                            (SELECT sql FROM sqlite_schema WHERE name = 'orders')",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ours, 0);
        assert_eq!(sql, ddl);
    }
}

#[tokio::test]
async fn a_missing_table_and_a_newer_schema_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("t.db")).await.unwrap();
    let err = store.verify().await.expect_err("no table yet");
    assert!(matches!(err, SqliteError::MissingTable { .. }), "{err:?}");
    // A store call before migrate() says what to do.
    let err = store
        .claim(&req(&id("m"), b"x", S, S))
        .await
        .expect_err("no table yet");
    let source = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<SqliteError>())
        .expect("the SqliteError is kept as the source");
    assert!(
        matches!(source, SqliteError::MissingTable { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("migrate"), "{err}");
    assert!(!err.is_retryable());

    store.migrate().await.unwrap();
    store.migrate().await.unwrap(); // idempotent
    store
        .call(|c| {
            c.execute(
                "INSERT INTO idempotency_records_migrations VALUES (99, 0)",
                [],
            )
        })
        .await
        .unwrap()
        .unwrap();
    let err = store.migrate().await.expect_err("newer schema");
    assert!(
        matches!(err, SqliteError::SchemaTooNew { found: 99, .. }),
        "{err:?}"
    );
}

/// Corrupts one column of a stored record the way a faulty tool or disk might (the schema's
/// CHECK constraints are bypassed to do it), then reads and claims it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_stored_records_are_typed_errors_and_nothing_changes() {
    let corruptions = [
        ("status = 'exploded'", "unknown status"),
        ("fingerprint = x'0102'", "fingerprint is 2 bytes"),
        ("fingerprint = zeroblob(64)", "fingerprint is 64 bytes"),
        ("token = 0", "token 0"),
        ("token = -5", "token -5"),
        ("hits = -1", "hits is out of range"),
        ("attempts = 0", "attempts is 0"),
        ("attempts = 5000000000", "attempts is out of range"),
        ("lease_until = NULL", "pending without a lease"),
        (
            "failure_retryable = 7, failure_message = 'x'",
            "failure columns",
        ),
        ("failure_message = 'only half'", "failure columns"),
        (
            "status = 'completed', lease_until = NULL",
            "completed without an outcome",
        ),
        (
            "status = 'failed', lease_until = NULL",
            "failed without failure",
        ),
    ];
    let (store, _clock, _dir) = manual_store(ConnectionMode::DedicatedThread).await;
    for (assignment, expected) in corruptions {
        let id = id("corrupt");
        let r = req(&id, b"payload", 100 * S, 100 * S);
        assert!(matches!(
            store.claim(&r).await.unwrap(),
            Claim::Claimed { .. }
        ));
        let (scope, key) = (id.scope.to_string(), id.key.to_string());
        let snapshot = move |c: &mut rusqlite::Connection| -> rusqlite::Result<Vec<String>> {
            let mut stmt = c.prepare(
                "SELECT quote(scope) || quote(key) || quote(fingerprint) || status || token || \
                 quote(lease_until) || hits || attempts FROM idempotency_records",
            )?;
            let rows = stmt.query_map([], |r| r.get(0))?;
            rows.collect()
        };
        let sql =
            format!("UPDATE idempotency_records SET {assignment} WHERE scope = ?1 AND key = ?2");
        let changed = store
            .call(move |c| {
                c.pragma_update(None, "ignore_check_constraints", true)?;
                let n = c.execute(&sql, [scope, key]);
                c.pragma_update(None, "ignore_check_constraints", false)?;
                n
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(changed, 1, "{assignment}");
        let before = store.call(snapshot).await.unwrap().unwrap();

        let err = store.get(&id).await.expect_err(assignment);
        assert_corrupt(&err, expected, assignment);
        // A claim either decodes the row and finds it corrupt, or keeps a corrupt value in
        // a row the table's CHECKs refuse: both are reported as a corrupt record.
        let err = store.claim(&r).await.expect_err(assignment);
        assert_corrupt_claim(&err, expected, assignment);
        // The engine surfaces it too, without running the work.
        let engine = Idempotency::new(Arc::new(store.clone()), Policy::default()).unwrap();
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        let fp = Fingerprint::from_bytes(b"payload");
        let err = engine
            .run(&id.key, &id.scope, &fp, |_| async move {
                flag.store(true, Ordering::SeqCst);
                Ok::<_, String>(1)
            })
            .await
            .expect_err(assignment);
        assert_corrupt_claim(&err, expected, assignment);
        assert!(!ran.load(Ordering::SeqCst));
        // The claim that failed to decode was rolled back: not even `hits` moved.
        assert_eq!(
            store.call(snapshot).await.unwrap().unwrap(),
            before,
            "{assignment}"
        );
        store
            .call(|c| c.execute("DELETE FROM idempotency_records", []))
            .await
            .unwrap()
            .unwrap();
    }
}

fn assert_corrupt(err: &Error, expected: &str, what: &str) {
    match err {
        Error::CorruptRecord { .. } => assert!(
            err.to_string().contains(expected),
            "{what}: expected a message containing {expected:?}, got {err}"
        ),
        other => panic!("{what}: expected CorruptRecord, got {other:?}"),
    }
    assert!(!err.is_retryable());
}

fn assert_corrupt_claim(err: &Error, expected: &str, what: &str) {
    if err.to_string().contains("constraint failed") {
        assert_corrupt(err, "breaks the table's constraints", what);
    } else {
        assert_corrupt(err, expected, what);
    }
}
