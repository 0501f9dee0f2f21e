//! Bad input gets a clear typed error, never a panic, and loses nothing: wrong URLs, names,
//! a missing table, a table of another shape, corrupt stored values written by hand.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{Isolation, TableGuard};
use idempotency_core::store::ClaimRequest;
use idempotency_core::{
    Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId, Scope,
};
use idempotency_mysql::sqlx::{self, Executor};
use idempotency_mysql::{MySqlError, MySqlStore, TableName, MAX_TABLE_NAME_LEN};
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
    let fast = || MySqlStore::builder().connect_timeout(Duration::from_secs(5));

    for garbage in [
        "",
        "not a url",
        "mysql://[::1",
        "postgres://postgres@127.0.0.1/test",
    ] {
        let err = fast().connect(garbage).await.unwrap_err();
        assert!(
            matches!(err, MySqlError::InvalidUrl { .. }),
            "{garbage:?}: {err}"
        );
        assert!(!err.is_retryable());
        assert!(matches!(Error::from(err), Error::Config(_)));
    }

    // Nothing listens on a port we just released: retryable (the server may come up).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = fast()
        .connect(&format!("mysql://root@127.0.0.1:{port}/test"))
        .await
        .unwrap_err();
    assert!(matches!(err, MySqlError::Connect { .. }), "{err}");
    assert!(err.is_retryable(), "{err}");

    // An unknown database and a wrong password: refused, not worth retrying.
    for url in [
        url_with_database("no_such_database_here"),
        "mysql://root:wrong-password@127.0.0.1:3306/test".to_owned(),
    ] {
        let err = fast().connect(&url).await.unwrap_err();
        assert!(matches!(err, MySqlError::Connect { .. }), "{url}: {err}");
        assert!(!err.is_retryable(), "{url}: {err}");
    }
}

#[tokio::test]
async fn invalid_names_are_refused() {
    let long = "t".repeat(MAX_TABLE_NAME_LEN + 1);
    for bad in [
        "",
        "1records",
        "records-v2",
        "records; DROP TABLE users",
        "réc",
        "a`b",
        &long,
    ] {
        let err = TableName::new(bad).unwrap_err();
        assert!(
            matches!(&err, MySqlError::InvalidName { what: "table", name, .. } if name == bad),
            "{bad:?}: {err}"
        );
        assert!(!err.is_retryable());
        let err = MySqlStore::builder()
            .table(bad)
            .connect(&common::url())
            .await
            .unwrap_err();
        assert!(
            matches!(err, MySqlError::InvalidName { .. }),
            "{bad:?}: {err}"
        );
        assert!(matches!(Error::from(err), Error::Config(_)));
    }
    assert!(TableName::new(&"t".repeat(MAX_TABLE_NAME_LEN)).is_ok());
}

fn assert_missing_table(e: &Error) {
    assert!(
        matches!(MySqlError::find(e), Some(MySqlError::MissingTable { .. })),
        "expected MissingTable, got {e:?}"
    );
    assert!(!e.is_retryable(), "{e:?}");
}

#[tokio::test]
async fn missing_table_without_migrate() {
    let guard = TableGuard::new();
    let store = MySqlStore::builder()
        .table(&guard.table)
        .build(common::pool(Isolation::ReadCommitted, 2).await)
        .unwrap();
    let req = request();
    assert_missing_table(&store.claim(&req).await.unwrap_err());
    assert_missing_table(&store.get(&req.id).await.unwrap_err());
    assert_missing_table(
        &store
            .complete(&req.id, idempotency_core::FencingToken(1), b"1", req.ttl)
            .await
            .unwrap_err(),
    );
    assert_missing_table(&store.purge_expired(10).await.unwrap_err());
    let err = store.verify().await.unwrap_err();
    assert!(matches!(err, MySqlError::MissingTable { .. }), "{err}");
    store.migrate().await.unwrap();
    store.verify().await.unwrap();
    // Migrating again changes nothing.
    store.migrate().await.unwrap();
}

fn assert_shape(e: &Error) {
    assert!(
        matches!(MySqlError::find(e), Some(MySqlError::TableShape { .. })),
        "expected TableShape, got {e:?}"
    );
    assert!(!e.is_retryable());
}

#[tokio::test]
async fn table_of_another_shape() {
    // A table of the same name made for something else.
    let guard = TableGuard::new();
    common::exec(&format!(
        "CREATE TABLE `{}` (scope VARBINARY(1024) NOT NULL, idem_key VARBINARY(255) NOT NULL,
             value TEXT, PRIMARY KEY (scope, idem_key)) ENGINE = InnoDB",
        guard.table
    ))
    .await;
    let store = MySqlStore::builder()
        .table(&guard.table)
        .build(common::pool(Isolation::ReadCommitted, 2).await)
        .unwrap();
    let err = store.migrate().await.unwrap_err();
    assert!(matches!(err, MySqlError::TableShape { .. }), "{err}");
    assert!(matches!(
        store.verify().await.unwrap_err(),
        MySqlError::TableShape { .. }
    ));
    // Left unchanged: migrate added none of its columns to it.
    let mut admin = common::admin().await;
    let columns: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.COLUMNS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(&guard.table)
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert_eq!(columns, 3, "the other table's columns changed");
    let req = request();
    assert_shape(&store.claim(&req).await.unwrap_err());
    assert_shape(&store.get(&req.id).await.unwrap_err());

    // The right columns, one of the wrong type (a token that cannot hold the clock in µs).
    let guard2 = TableGuard::new();
    let good = MySqlStore::builder()
        .table(&guard2.table)
        .build(store.pool().clone())
        .unwrap();
    good.migrate().await.unwrap();
    common::exec(&format!(
        "ALTER TABLE `{}` DROP CONSTRAINT token_positive, MODIFY token INT NOT NULL",
        guard2.table
    ))
    .await;
    let err = good.verify().await.unwrap_err();
    assert!(
        matches!(&err, MySqlError::TableShape { detail, .. } if detail.contains("token")),
        "{err}"
    );
    assert_shape(&good.claim(&request()).await.unwrap_err());

    // A table without the expiry index.
    let guard3 = TableGuard::new();
    let unindexed = MySqlStore::builder()
        .table(&guard3.table)
        .build(store.pool().clone())
        .unwrap();
    unindexed.migrate().await.unwrap();
    common::exec(&format!(
        "ALTER TABLE `{}` DROP INDEX expires_ms_idx",
        guard3.table
    ))
    .await;
    let err = unindexed.verify().await.unwrap_err();
    assert!(
        matches!(&err, MySqlError::TableShape { detail, .. } if detail.contains("expires_ms")),
        "{err}"
    );
}

#[tokio::test]
async fn corrupt_stored_values() {
    let (store, guard) = common::store(Isolation::ReadCommitted).await;
    let table = format!("`{}`", guard.table);
    let engine = Idempotency::new(Arc::new(store.clone()), Policy::default()).unwrap();

    // The table's CHECK constraints refuse what no correct store writes.
    let req = request();
    let _ = engine
        .run(&req.id.key, &req.id.scope, &req.fingerprint, |_| async {
            Ok::<_, String>(40)
        })
        .await
        .unwrap();
    for set in [
        "fingerprint = x'0102'",
        "status = 'exploded'",
        "token = 0",
        "attempts = 0",
        "hits = -1",
    ] {
        let mut conn = common::admin().await;
        let refused = conn
            .execute(format!("UPDATE {table} SET {set} WHERE idem_key = '{}'", req.id.key).as_str())
            .await
            .expect_err(set);
        assert_eq!(
            refused
                .as_database_error()
                .and_then(|e| e.code())
                .as_deref(),
            Some("23000"),
            "{set}: expected a check violation, got {refused:?}"
        );
    }

    // Past the constraints (a row written by hand, or before they existed), the decoder is
    // the second line.
    common::exec(&format!(
        "ALTER TABLE {table} DROP CONSTRAINT status_valid, DROP CONSTRAINT token_positive,
             DROP CONSTRAINT fingerprint_length, DROP CONSTRAINT attempts_positive,
             DROP CONSTRAINT hits_non_negative"
    ))
    .await;
    let saved = TableGuard::new();
    common::exec(&format!("CREATE TABLE `{}` LIKE {table}", saved.table)).await;

    let corruptions = [
        ("fingerprint = x'0102'", "fingerprint"),
        ("fingerprint = ''", "fingerprint"),
        ("status = 'exploded'", "status"),
        ("status = 'PENDING'", "status"),
        ("token = -4", "token"),
        ("hits = -5", "hits"),
        ("attempts = -2", "attempts"),
        ("attempts = 0", "attempts is 0"),
        (
            "failure_retryable = 7, failure_message = 'x'",
            "failure_retryable",
        ),
        (
            "status = 'pending', lease_until_ms = NULL",
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
        let before = store.get(&req.id).await.unwrap().unwrap();
        let mut conn = common::admin().await;
        let key = req.id.key.as_str();
        conn.execute(format!("DELETE FROM `{}`", saved.table).as_str())
            .await
            .unwrap();
        conn.execute(
            format!(
                "INSERT INTO `{}` SELECT * FROM {table} WHERE idem_key = '{key}'",
                saved.table
            )
            .as_str(),
        )
        .await
        .unwrap();
        conn.execute(format!("UPDATE {table} SET {set} WHERE idem_key = '{key}'").as_str())
            .await
            .unwrap();

        for err in [
            store.get(&req.id).await.unwrap_err(),
            store.claim(&req).await.unwrap_err(),
            store
                .claim(&req.clone().with_count_hit(false))
                .await
                .unwrap_err(),
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

        // Nothing was lost: restore the row and the record replays its outcome.
        conn.execute(format!("DELETE FROM {table} WHERE idem_key = '{key}'").as_str())
            .await
            .unwrap();
        conn.execute(format!("INSERT INTO {table} SELECT * FROM `{}`", saved.table).as_str())
            .await
            .unwrap();
        let record = store.get(&req.id).await.unwrap().unwrap();
        assert_eq!(record.outcome, before.outcome);
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
        "UPDATE {table} SET outcome = x'ff00' WHERE idem_key = '{}'",
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
    let options: sqlx::mysql::MySqlConnectOptions = format!("mysql://root@127.0.0.1:{port}/test")
        .parse()
        .unwrap();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(options);
    let store = MySqlStore::builder().build(pool).unwrap();
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
                assert!(retryable, "{op}: a server may come up")
            }
            other => panic!("{op}: expected a backend error, got {other:?}"),
        }
    }
}

/// A failure whose message is longer than the `failure_message` column (64 KiB) is recorded,
/// its message cut on a character boundary: before, MariaDB refused the write (error 1406,
/// "data too long"), the call failed as a table of the wrong shape and the key stayed Pending.
#[tokio::test]
async fn a_failure_message_longer_than_its_column_is_cut_not_refused() {
    let (store, _guard) = common::store(Isolation::ReadCommitted).await;
    let request = request();
    let token = match store.claim(&request).await.unwrap() {
        idempotency_core::store::Claim::Claimed { token, .. } => token,
        other => panic!("a fresh key was found: {other:?}"),
    };
    // 100 KiB of two-, three- and four-byte characters: a cut at a byte count would land
    // inside one.
    let message = "é€𝄞".repeat(100 * 1024 / 9);
    let failure = idempotency_core::store::Failure::permanent(message.clone());
    let cas = store
        .fail(&request.id, token, &failure, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(cas, idempotency_core::store::Cas::Applied);
    let record = store.get(&request.id).await.unwrap().unwrap();
    assert_eq!(record.status, idempotency_core::store::RecordStatus::Failed);
    let kept = record.failure.unwrap().message;
    assert!(
        kept.len() <= idempotency_core::store::Failure::MAX_MESSAGE
            && message.starts_with(kept.trim_end_matches('…')),
        "kept {} bytes that are not the start of the message",
        kept.len()
    );
}
