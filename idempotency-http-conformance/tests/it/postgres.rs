//! The HTTP suite against the Postgres store on the real server
//! (`IDEMPOTENCY_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`). Each
//! case gets a schema of its own, dropped afterwards.

use idempotency_conformance::TestStore;
use idempotency_core::{Idempotency, Policy};
use idempotency_http_conformance::cases::{assert_problem, send};
use idempotency_http_conformance::server::TestServer;
use idempotency_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use idempotency_postgres::PostgresStore;
use idempotency_testing::postgres::{pool, Isolation, SchemaGuard};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

async fn factory() -> TestStore {
    let pool = pool(Isolation::ReadCommitted, 8).await;
    let guard = SchemaGuard::new();
    let store = PostgresStore::builder()
        .schema(&guard.schema)
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

/// A pool at `level`, a store in a schema of its own (dropped with the guard) and an `orders`
/// table beside its records: `(pool, guard, store, "schema".orders)`.
async fn orders_store(
    level: Isolation,
) -> (
    idempotency_postgres::sqlx::PgPool,
    SchemaGuard,
    PostgresStore,
    String,
) {
    let pool = pool(level, 8).await;
    let guard = SchemaGuard::new();
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .build(pool.clone())
        .expect("valid names");
    store.migrate().await.expect("migrate");
    let table = format!("\"{}\".orders", guard.schema);
    idempotency_postgres::sqlx::query(&format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, k text NOT NULL)"
    ))
    .execute(&pool)
    .await
    .expect("orders table");
    (pool, guard, store, table)
}

/// `ClaimedKey::run_in_transaction` over the real server at each isolation level: the order
/// row and the stored answer commit in one call; concurrent duplicates and later retries of
/// each key get the one answer (or `409` while it runs), and each key has exactly one row. The
/// handler's transaction outlives the layer's heartbeat interval (lease 900 ms, heartbeat every
/// 300 ms, the work 400 ms), so at REPEATABLE READ and SERIALIZABLE the heartbeat's writes meet
/// the handler's transaction, whose conflicts run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_exactly_once_at_every_isolation_level() {
    use axum::extract::{Request, State};
    use axum::response::IntoResponse;
    use idempotency_postgres::sqlx;
    use idempotency_tower::{ClaimedKey, IdempotencyLayer};

    struct App {
        store: PostgresStore,
        table: String,
    }

    async fn create(State(app): State<Arc<App>>, req: Request) -> axum::response::Response {
        let claim = req
            .extensions()
            .get::<ClaimedKey>()
            .cloned()
            .expect("claimed");
        let key = claim.id().key.as_str().to_owned();
        let insert = format!("INSERT INTO {} (k) VALUES ($1) RETURNING id", app.table);
        claim
            .run_in_transaction(&app.store, |tx: &mut sqlx::PgConnection| {
                let (insert, key) = (insert.clone(), key.clone());
                Box::pin(async move {
                    let id: i64 = sqlx::query_scalar(&insert)
                        .bind(&key)
                        .fetch_one(&mut *tx)
                        .await?;
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

    for level in [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ] {
        let (pool, _guard, store, table) = orders_store(level).await;
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
                    format!("SELECT count(*) FROM {table} WHERE k = $1"),
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
    }
}

/// `ClaimedKey::run_in_transaction` whose lease passes while its transaction runs (no
/// heartbeat), and another request takes the key over and commits: the stalled handler's
/// completion is fenced, its transaction (its order row included) rolls back, and it answers
/// `409` lease-lost; the key keeps the other request's answer, and the key has one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_one_call_transaction_is_fenced_and_rolls_back() {
    use axum::extract::{Request, State};
    use axum::response::IntoResponse;
    use idempotency_postgres::sqlx;
    use idempotency_tower::{ClaimedKey, IdempotencyLayer};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Instant;
    use tokio::sync::{Notify, Semaphore};

    struct App {
        store: PostgresStore,
        table: String,
        calls: AtomicU32,
        /// The first call signals here once its order row is written…
        written: Notify,
        /// …and takes a permit here before it completes.
        release: Semaphore,
    }

    async fn create(State(app): State<Arc<App>>, req: Request) -> axum::response::Response {
        let claim = req
            .extensions()
            .get::<ClaimedKey>()
            .cloned()
            .expect("claimed");
        let first = app.calls.fetch_add(1, Ordering::SeqCst) == 0;
        let insert = format!("INSERT INTO {} (k) VALUES ('k') RETURNING id", app.table);
        let app2 = app.clone();
        claim
            .run_in_transaction(&app.store, |tx: &mut sqlx::PgConnection| {
                let (insert, app) = (insert.clone(), app2.clone());
                Box::pin(async move {
                    let id: i64 = sqlx::query_scalar(&insert).fetch_one(&mut *tx).await?;
                    if first {
                        app.written.notify_one();
                        app.release.acquire().await.expect("open").forget();
                    }
                    Ok(http::Response::builder()
                        .status(201)
                        .body(bytes::Bytes::from(format!("{{\"order\":{id}}}")))
                        .expect("response"))
                })
            })
            .await
            .map(axum::body::Body::from)
            .into_response()
    }

    let (pool, _guard, store, table) = orders_store(Isolation::ReadCommitted).await;
    let lease = Duration::from_millis(300);
    let engine = Idempotency::builder(store.clone())
        .lease(lease)
        .heartbeat(None)
        .build()
        .expect("engine");
    let app = Arc::new(App {
        store,
        table: table.clone(),
        calls: AtomicU32::new(0),
        written: Notify::new(),
        release: Semaphore::new(0),
    });
    let router = axum::Router::new()
        .route("/orders", axum::routing::post(create))
        .layer(IdempotencyLayer::shared(engine).required(true))
        .with_state(app.clone());
    let (base, task) = idempotency_http_conformance::server::serve(router).await;
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let post = || {
        client
            .post(format!("{base}/orders"))
            .header("idempotency-key", "stalled")
            .header("content-type", "application/json")
            .body("{}")
            .send()
    };
    let stalled = tokio::spawn(post());
    app.written.notified().await;
    // The first holder's lease passes while its transaction waits; the retry takes over.
    let started = Instant::now();
    let taken = loop {
        tokio::time::sleep(lease / 2).await;
        let r = post().await.expect("answered");
        if r.status() != 409 {
            break r;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the key was never taken over"
        );
    };
    assert_eq!(taken.status(), 201);
    let taken = taken.text().await.expect("body");
    app.release.add_permits(1);
    let fenced = stalled.await.expect("task").expect("answered");
    assert_eq!(fenced.status(), 409);
    let problem = fenced.text().await.expect("body");
    assert!(problem.contains("idempotency-key-lease-lost"), "{problem}");
    let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(rows, 1, "the fenced transaction's row committed");
    let again = post().await.expect("answered");
    assert!(again.headers().contains_key("idempotent-replayed"));
    assert_eq!(again.text().await.expect("body"), taken);
    assert_eq!(app.calls.load(Ordering::SeqCst), 2);
    task.abort();
}
