//! Bad input gets a clear typed error, never a panic, and loses nothing: wrong URLs, names,
//! a missing table, a table of another shape, corrupt stored values.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{Isolation, SchemaGuard};
use idempotency_core::store::{Claim, ClaimRequest};
use idempotency_core::{
    Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId, Scope,
};
use idempotency_postgres::sqlx;
use idempotency_postgres::{PostgresError, PostgresStore};
use std::sync::Arc;
use std::time::Duration;

fn request() -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new(IdempotencyKey::random(), Scope::new("bad-input").unwrap()),
        Fingerprint::from_bytes(b"payload"),
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
}

/// The URL of the test server with its database replaced.
fn url_with_database(db: &str) -> String {
    let url = common::url();
    let (base, _) = url.rsplit_once('/').expect("URL has a database");
    format!("{base}/{db}")
}

#[tokio::test]
async fn wrong_urls_are_typed_errors() {
    let _ = common::admin().await; // fail clearly if the server is down
    let fast = || PostgresStore::builder().connect_timeout(Duration::from_secs(5));

    for garbage in [
        "",
        "not a url",
        "postgres://[::1",
        "mysql://root@127.0.0.1/test",
    ] {
        let err = fast().connect(garbage).await.unwrap_err();
        assert!(
            matches!(err, PostgresError::InvalidUrl { .. }),
            "{garbage:?}: {err}"
        );
        assert!(!err.is_retryable());
        assert!(matches!(Error::from(err), Error::Config(_)));
    }

    // Nothing listens on a port we just released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = fast()
        .connect(&format!("postgres://postgres@127.0.0.1:{port}/test"))
        .await
        .unwrap_err();
    assert!(matches!(err, PostgresError::Connect { .. }), "{err}");
    assert!(
        err.is_retryable(),
        "an unreachable server may come up: {err}"
    );

    let err = fast()
        .connect(&url_with_database("no_such_database_for_idempotency"))
        .await
        .unwrap_err();
    assert!(matches!(err, PostgresError::Connect { .. }), "{err}");
    assert!(
        err.to_string().contains("no_such_database_for_idempotency"),
        "{err}"
    );
    assert!(!err.is_retryable());

    let url = common::url().replacen("postgres@", "no_such_role_for_idempotency@", 1);
    if url != common::url() {
        let err = fast().connect(&url).await.unwrap_err();
        assert!(matches!(err, PostgresError::Connect { .. }), "{err}");
    }

    // The real server works, for contrast.
    fast()
        .connect(&common::url())
        .await
        .expect("the test server accepts connections");
}

#[tokio::test]
async fn invalid_names_are_refused() {
    let pool = common::pool(Isolation::ReadCommitted, 1).await;
    for (schema, table) in [
        ("public", "records; DROP TABLE x"),
        ("", "t"),
        ("pg_catalog", "t"),
        ("s", "has space"),
        ("s", "1digit"),
    ] {
        let err = PostgresStore::builder()
            .schema(schema)
            .table(table)
            .build(pool.clone())
            .unwrap_err();
        assert!(
            matches!(err, PostgresError::InvalidName { .. }),
            "{schema}.{table}: {err}"
        );
        assert!(matches!(Error::from(err), Error::Config(_)));
    }
}

fn assert_missing_table(e: &Error) {
    assert!(
        matches!(
            e,
            Error::Backend {
                retryable: false,
                ..
            }
        ),
        "not retryable: {e:?}"
    );
    assert!(
        matches!(
            PostgresError::find(e),
            Some(PostgresError::MissingTable { .. })
        ),
        "expected MissingTable, got {e:?}"
    );
    assert!(e.to_string().contains("migrate()"), "says what to do: {e}");
}

#[tokio::test]
async fn missing_table_without_migrate() {
    let guard = SchemaGuard::new();
    let pool = common::pool(Isolation::ReadCommitted, 2).await;
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .build(pool)
        .unwrap();
    let req = request();
    // The schema does not exist yet.
    assert_missing_table(&store.claim(&req).await.unwrap_err());
    assert!(matches!(
        store.verify().await,
        Err(PostgresError::MissingTable { .. })
    ));
    // The schema exists, the table does not.
    common::exec(&format!(r#"CREATE SCHEMA "{}""#, guard.schema)).await;
    assert_missing_table(&store.claim(&req).await.unwrap_err());
    assert_missing_table(&store.get(&req.id).await.unwrap_err());
    assert_missing_table(
        &store
            .complete(&req.id, idempotency_core::FencingToken(1), b"x", req.ttl)
            .await
            .unwrap_err(),
    );
    assert_missing_table(&store.purge_expired(10).await.unwrap_err());
    // Through the engine, the same error reaches the caller.
    let engine = Idempotency::new(Arc::new(store.clone()), Policy::default()).unwrap();
    let err = engine
        .run(&req.id.key, &req.id.scope, &req.fingerprint, |_| async {
            Ok::<_, String>(1)
        })
        .await
        .unwrap_err();
    assert_missing_table(&err);
    // After migrate() everything works.
    store.migrate().await.unwrap();
    store.verify().await.unwrap();
    assert!(matches!(
        store.claim(&req).await.unwrap(),
        Claim::Claimed { .. }
    ));
}

fn assert_shape(e: &Error) {
    assert!(
        matches!(
            PostgresError::find(e),
            Some(PostgresError::TableShape { .. })
        ),
        "expected TableShape, got {e:?}"
    );
    assert!(!e.is_retryable());
}

#[tokio::test]
async fn table_of_another_shape() {
    let guard = SchemaGuard::new();
    let s = &guard.schema;
    common::exec(&format!(
        r#"CREATE SCHEMA "{s}";
           CREATE TABLE "{s}".records (scope text, key text, value jsonb, PRIMARY KEY (scope, key));
           INSERT INTO "{s}".records VALUES ('a', 'b', '{{}}');
           -- Right columns, wrong types.
           CREATE TABLE "{s}".narrow (
               scope text, key text, fingerprint bytea, status text, token integer,
               lease_until timestamptz, outcome bytea, attempts integer,
               failure_retryable boolean, failure_message text, hits bigint,
               created_at timestamptz, updated_at timestamptz, expires_at timestamptz,
               PRIMARY KEY (scope, key));
           -- Right columns and types, no unique key for ON CONFLICT.
           CREATE TABLE "{s}".unkeyed (
               scope text, key text, fingerprint bytea, status text, token bigint,
               lease_until timestamptz, outcome bytea, attempts integer,
               failure_retryable boolean, failure_message text, hits bigint,
               created_at timestamptz, updated_at timestamptz, expires_at timestamptz);
           -- A view is not a table.
           CREATE VIEW "{s}".a_view AS SELECT 1 AS x;"#
    ))
    .await;
    let pool = common::pool(Isolation::ReadCommitted, 2).await;
    let store_for = |table: &str| {
        PostgresStore::builder()
            .schema(s)
            .table(table)
            .build(pool.clone())
            .unwrap()
    };
    let req = request();

    let store = store_for("records");
    assert_shape(&store.claim(&req).await.unwrap_err());
    assert_shape(&store.get(&req.id).await.unwrap_err());
    let err = store.verify().await.unwrap_err();
    assert!(
        matches!(&err, PostgresError::TableShape { detail, .. }
            if detail.contains("fingerprint") && detail.contains("missing")),
        "{err}"
    );
    // migrate() refuses it and changes nothing: the foreign row is still there and no
    // migration was recorded.
    let err = store.migrate().await.unwrap_err();
    assert!(matches!(err, PostgresError::TableShape { .. }), "{err}");
    let mut conn = common::admin().await;
    let rows: i64 = sqlx::query_scalar(&format!(r#"SELECT count(*) FROM "{s}".records"#))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(rows, 1);
    let migrations_table: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!(r#""{s}".records_migrations"#))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        migrations_table, None,
        "the failed migration was rolled back"
    );

    let narrow = store_for("narrow");
    let err = narrow.verify().await.unwrap_err();
    assert!(
        matches!(&err, PostgresError::TableShape { detail, .. }
            if detail.contains("token is integer")),
        "{err}"
    );
    // A fresh token (the clock in microseconds) does not fit an int4 token: the claim's
    // insert is the shape error.
    assert_shape(&narrow.claim(&req).await.unwrap_err());

    let unkeyed = store_for("unkeyed");
    assert_shape(&unkeyed.claim(&req).await.unwrap_err());
    assert!(matches!(
        unkeyed.verify().await,
        Err(PostgresError::TableShape { detail, .. }) if detail.contains("(scope, key)")
    ));

    let view = store_for("a_view");
    assert!(matches!(
        view.verify().await,
        Err(PostgresError::TableShape { .. })
    ));
    assert_shape(&view.claim(&req).await.unwrap_err());
}

/// Corrupt values in a stored record are reported as `CorruptRecord`, the record is left as it
/// was, and fixing it makes it readable again.
#[tokio::test]
async fn corrupt_stored_values() {
    let (store, guard) = common::store(Isolation::ReadCommitted).await;
    let table = format!(r#""{}".records"#, guard.schema);
    let engine = Idempotency::new(Arc::new(store.clone()), Policy::default()).unwrap();

    // The table's CHECK constraints refuse what no correct store writes, as SQLite's do.
    let req = request();
    let _ = engine
        .run(&req.id.key, &req.id.scope, &req.fingerprint, |_| async {
            Ok::<_, String>(40)
        })
        .await
        .unwrap();
    for set in [
        "fingerprint = '\\x0102'::bytea",
        "status = 'exploded'",
        "token = 0",
        "attempts = 0",
        "hits = -1",
    ] {
        let mut conn = common::admin().await;
        let refused = sqlx::raw_sql(&format!(
            "UPDATE {table} SET {set} WHERE key = '{}'",
            req.id.key
        ))
        .execute(&mut conn)
        .await
        .expect_err(set);
        assert_eq!(
            refused
                .as_database_error()
                .and_then(|e| e.code())
                .as_deref(),
            Some("23514"),
            "{set}: expected a check violation, got {refused:?}"
        );
    }

    // Past the constraints (a row written by hand, or before they existed), the decoders are
    // the second line.
    common::exec(&format!(
        "ALTER TABLE {table} DROP CONSTRAINT records_status_check;
         ALTER TABLE {table} DROP CONSTRAINT records_token_check;
         ALTER TABLE {table} DROP CONSTRAINT idempotency_fingerprint_length;
         ALTER TABLE {table} DROP CONSTRAINT idempotency_attempts_positive;
         ALTER TABLE {table} DROP CONSTRAINT idempotency_hits_non_negative;"
    ))
    .await;

    let corruptions = [
        ("fingerprint = '\\x0102'::bytea", "fingerprint"),
        ("status = 'exploded'", "status"),
        ("token = -4", "token"),
        ("hits = -5", "hits"),
        ("attempts = -2", "attempts"),
        ("attempts = 0", "attempts is 0"),
        (
            "status = 'pending', lease_until = NULL",
            "pending without a lease",
        ),
        ("outcome = NULL", "without an outcome"),
        ("failure_message = 'half'", "half of a failure"),
    ];
    for (set, what) in corruptions {
        let req = request();
        let out = engine
            .run(&req.id.key, &req.id.scope, &req.fingerprint, |_| async {
                Ok::<_, String>(41)
            })
            .await
            .unwrap();
        assert!(!out.is_replayed());
        let before: Vec<u8> =
            sqlx::query_scalar(&format!("SELECT outcome FROM {table} WHERE key = $1"))
                .bind(req.id.key.as_str())
                .fetch_one(store.pool())
                .await
                .unwrap();
        let snapshot = format!(
            "CREATE TEMP TABLE IF NOT EXISTS saved AS SELECT * FROM {table} WHERE false;
             DELETE FROM saved; INSERT INTO saved SELECT * FROM {table} WHERE key = '{}'",
            req.id.key
        );
        let mut conn = common::admin().await;
        sqlx::raw_sql(&snapshot).execute(&mut conn).await.unwrap();
        sqlx::raw_sql(&format!(
            "UPDATE {table} SET {set} WHERE key = '{}'",
            req.id.key
        ))
        .execute(&mut conn)
        .await
        .unwrap();

        for err in [
            store.get(&req.id).await.unwrap_err(),
            store.claim(&req).await.unwrap_err(),
            engine
                .run(&req.id.key, &req.id.scope, &req.fingerprint, |_| async {
                    Ok::<_, String>(42)
                })
                .await
                .unwrap_err(),
        ] {
            assert!(
                matches!(&err, Error::CorruptRecord { reason, .. } if reason.contains(what)),
                "{set}: expected CorruptRecord mentioning {what:?}, got {err:?}"
            );
            assert!(!err.is_retryable());
        }

        // Nothing was lost: restore the columns and the record replays its outcome.
        sqlx::raw_sql(&format!(
            "UPDATE {table} t SET fingerprint = s.fingerprint, status = s.status,
                 token = s.token, hits = s.hits, attempts = s.attempts, outcome = s.outcome,
                 failure_message = s.failure_message
             FROM saved s WHERE t.scope = s.scope AND t.key = s.key"
        ))
        .execute(&mut conn)
        .await
        .unwrap();
        let record = store.get(&req.id).await.unwrap().unwrap();
        assert_eq!(record.outcome.as_deref(), Some(before.as_slice()));
        let replay = engine
            .run(&req.id.key, &req.id.scope, &req.fingerprint, |_| async {
                Ok::<_, String>(43)
            })
            .await
            .unwrap();
        assert_eq!(replay.into_result().unwrap(), Ok(41));
    }

    // Outcome bytes that are not JSON: a corrupt record on replay (JSON of another shape
    // than the caller's type is `Error::StoredOutcome`).
    let req = request();
    let _ = engine
        .run(&req.id.key, &req.id.scope, &req.fingerprint, |_| async {
            Ok::<_, String>(1)
        })
        .await
        .unwrap();
    common::exec(&format!(
        "UPDATE {table} SET outcome = '\\xff00'::bytea WHERE key = '{}'",
        req.id.key
    ))
    .await;
    let err = engine
        .run(&req.id.key, &req.id.scope, &req.fingerprint, |_| async {
            Ok::<_, String>(2)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::CorruptRecord { .. }), "{err:?}");
}

/// A write whose connection could not be had was never sent: a retryable backend error, not
/// "outcome unknown" (which tells the engine the write may have landed).
#[tokio::test]
async fn writes_without_a_connection_are_not_outcome_unknown() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let options: sqlx::postgres::PgConnectOptions =
        format!("postgres://postgres@127.0.0.1:{port}/test")
            .parse()
            .unwrap();
    for keep in [false, true] {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(500))
            .connect_lazy_with(options.clone());
        let store = PostgresStore::builder()
            .keep_connections(keep)
            .build(pool)
            .unwrap();
        let req = request();
        let token = idempotency_core::FencingToken(1);
        let claim = store.claim(&req).await;
        let complete = store.complete(&req.id, token, b"{}", req.ttl).await;
        for (op, result) in [
            ("claim", claim.map(|_| ())),
            ("complete", complete.map(|_| ())),
        ] {
            match result {
                Err(Error::Backend { retryable, .. }) => {
                    assert!(retryable, "keep {keep}, {op}: a server may come up")
                }
                other => panic!("keep {keep}, {op}: expected a backend error, got {other:?}"),
            }
        }
    }
}
