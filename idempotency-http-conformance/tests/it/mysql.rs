//! The HTTP suite against the MySQL/MariaDB store on the real server (`MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`). Each case gets a table of its own, dropped afterwards.

use idempotency_conformance::TestStore;
use idempotency_core::{Idempotency, Policy};
use idempotency_http_conformance::cases::{assert_problem, send};
use idempotency_http_conformance::server::TestServer;
use idempotency_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use idempotency_mysql::MySqlStore;
use idempotency_testing::mysql::{pool, Isolation, TableGuard};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

async fn factory() -> TestStore {
    // InnoDB's default level: the one most deployments run at.
    let pool = pool(Isolation::RepeatableRead, 8).await;
    let guard = TableGuard::new();
    let store = MySqlStore::builder()
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
    let store = MySqlStore::builder().build(pool).expect("valid name");
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

/// `ClaimedKey::run_in_transaction` over the real server at each isolation level, as on
/// Postgres: the order row and the stored answer commit in one call; concurrent duplicates
/// and later retries of each key get the one answer (or `409` while it runs), and each key has
/// exactly one row. The handler's transaction outlives the layer's heartbeat interval (lease
/// 900 ms, heartbeat every 300 ms, the work 400 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_exactly_once_at_every_isolation_level() {
    use axum::extract::{Request, State};
    use axum::response::IntoResponse;
    use idempotency_mysql::sqlx;
    use idempotency_tower::{ClaimedKey, IdempotencyLayer};

    struct App {
        store: MySqlStore,
        table: String,
    }

    async fn create(State(app): State<Arc<App>>, req: Request) -> axum::response::Response {
        let claim = req
            .extensions()
            .get::<ClaimedKey>()
            .cloned()
            .expect("claimed");
        let key = claim.id().key.as_str().to_owned();
        let (insert, last) = (
            format!("INSERT INTO {} (k) VALUES (?)", app.table),
            "SELECT LAST_INSERT_ID()".to_owned(),
        );
        claim
            .run_in_transaction(&app.store, |tx: &mut sqlx::MySqlConnection| {
                let (insert, last, key) = (insert.clone(), last.clone(), key.clone());
                Box::pin(async move {
                    sqlx::query(&insert).bind(&key).execute(&mut *tx).await?;
                    let id: u64 = sqlx::query_scalar(&last).fetch_one(&mut *tx).await?;
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    Ok(http::Response::builder()
                        .status(201)
                        .header("content-type", "application/json")
                        .body(bytes::Bytes::from(format!("{{\"order\":{id}}}")))
                        .expect("response"))
                })
            })
            .await
            .map(axum::body::Body::from)
            .into_response()
    }

    for level in Isolation::ALL {
        let pool = pool(level, 8).await;
        let guard = TableGuard::new();
        let store = MySqlStore::builder()
            .table(&guard.table)
            .build(pool.clone())
            .expect("valid name");
        store.migrate().await.expect("migrate");
        let table = format!("{}_orders", guard.table);
        idempotency_testing::mysql::exec(&format!(
            "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(64) NOT NULL) ENGINE=InnoDB"
        ))
        .await;
        let engine = Idempotency::builder(store.clone())
            .lease(Duration::from_millis(900))
            .build()
            .expect("engine");
        let app = Arc::new(App {
            store,
            table: table.clone(),
        });
        let router = axum::Router::new()
            .route("/orders", axum::routing::post(create))
            .layer(IdempotencyLayer::shared(engine).required(true))
            .with_state(app);
        let (base, task) = idempotency_http_conformance::server::serve(router).await;
        let label = format!("{level:?}");
        idempotency_http_conformance::settled::one_answer_and_one_row_per_key(
            &label,
            &base,
            |key| {
                let (pool, count) = (
                    pool.clone(),
                    format!("SELECT count(*) FROM {table} WHERE k = ?"),
                );
                async move {
                    sqlx::query_scalar::<_, i64>(&count)
                        .bind(key)
                        .fetch_one(&pool)
                        .await
                        .expect("count")
                }
            },
        )
        .await;
        task.abort();
        idempotency_testing::mysql::exec(&format!("DROP TABLE IF EXISTS {table}")).await;
    }
}
