//! The HTTP suite against the MySQL/MariaDB store on the real server (`MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`). Each case gets a table of its own, dropped afterwards.

use idempotency_conformance::TestStore;
use idempotency_core::{Idempotency, Policy};
use idempotency_http_conformance::cases::{assert_problem, send};
use idempotency_http_conformance::server::TestServer;
use idempotency_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use idempotency_mysql::MysqlStore;
use idempotency_testing::mysql::{pool, Isolation, TableGuard};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

async fn factory() -> TestStore {
    // InnoDB's default level: the one most deployments run at.
    let pool = pool(Isolation::RepeatableRead, 8).await;
    let guard = TableGuard::new();
    let store = MysqlStore::builder()
        .table(&guard.table)
        .build(pool)
        .expect("valid name");
    store.migrate().await.expect("migrate");
    TestStore::real_time(Arc::new(store)).with_guard(guard)
}

idempotency_http_conformance::http_conformance_tests!(factory);

/// A server that cannot be reached (nothing listens on the port): 503, handler not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_fails_closed() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let options =
        MySqlConnectOptions::from_str(&format!("mysql://root@127.0.0.1:{port}/test")).expect("url");
    let pool = MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(options);
    let store = MysqlStore::builder().build(pool).expect("valid name");
    let engine = Idempotency::new(Arc::new(store), Policy::default()).expect("policy");
    let s = TestServer::start(
        idempotency_tower::IdempotencyLayer::shared(engine)
            .route(idempotency_tower::RoutePart::Template),
    )
    .await;
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
