//! The HTTP suite against the Postgres store on the real server
//! (`IDEMPOTENCY_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`). Each
//! case gets a schema of its own, dropped afterwards.

use idempotency_conformance::TestStore;
use idempotency_core::{Idempotency, Policy};
use idempotency_http_conformance::cases::{assert_problem, send};
use idempotency_http_conformance::server::TestServer;
use idempotency_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use idempotency_postgres::sqlx::{Connection, Executor, PgConnection};
use idempotency_postgres::PostgresStore;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

fn url() -> String {
    std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn unreachable(e: impl std::fmt::Display) -> ! {
    panic!(
        "cannot reach PostgreSQL at {} ({e}).\n\
         Start it with `bash .ci/services` (PostgreSQL on 127.0.0.1:5432, trust auth, database \
         `test`), or point IDEMPOTENCY_TEST_POSTGRES_URL at a server you can write to.",
        url()
    )
}

/// Drops its schema, and everything in it, when dropped.
struct SchemaGuard(String);

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        let schema = self.0.clone();
        // Drop may run inside or outside a runtime: clean up on a thread of its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let options = PgConnectOptions::from_str(&url()).ok()?;
                let mut conn = PgConnection::connect_with(&options).await.ok()?;
                conn.execute(format!(r#"DROP SCHEMA IF EXISTS "{schema}" CASCADE"#).as_str())
                    .await
                    .ok()?;
                conn.close().await.ok()
            })
        })
        .join();
    }
}

async fn factory() -> TestStore {
    let options = PgConnectOptions::from_str(&url()).unwrap_or_else(|e| unreachable(e));
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .unwrap_or_else(|e| unreachable(e));
    let guard = SchemaGuard(format!("idem_http_{}", uuid::Uuid::new_v4().simple()));
    let store = PostgresStore::builder()
        .schema(&guard.0)
        .build(pool)
        .expect("valid names");
    store.migrate().await.expect("migrate");
    TestStore::real_time(Arc::new(store)).with_guard(guard)
}

idempotency_http_conformance::http_conformance_tests!(factory);

/// A Postgres that cannot be reached (nothing listens on the port): 503, handler not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_fails_closed() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let options = PgConnectOptions::from_str(&format!("postgres://postgres@127.0.0.1:{port}/test"))
        .expect("url");
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(options);
    let store = PostgresStore::builder().build(pool).expect("valid names");
    let engine = Idempotency::new(Arc::new(store), Policy::default()).expect("policy");
    let s = TestServer::start(idempotency_tower::IdempotencyLayer::new(engine)).await;
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let r = send(
        client
            .post(s.url("/items"))
            .header("idempotency-key", "down")
            .json(&serde_json::json!({"a": 1})),
    )
    .await;
    assert_problem(&r, 503, "idempotency-store-unavailable");
    assert_eq!(s.executions(), 0);
}
