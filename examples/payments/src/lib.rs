//! The payments example: the whole path a team copies, on axum and Postgres through the one
//! `idempotency` crate.
//!
//! - `POST /payments` sits behind the idempotency layer, one key space per merchant. Its
//!   handler writes the payment row and the key's stored `201` in **one transaction**
//!   (`ClaimedKey::run_in_transaction`): a crash between the two cannot let a retry charge
//!   twice, and every retry of the key is answered with the first payment.
//! - `GET /payments/{id}` reads one back.
//! - The service purges expired keys in the background (`Idempotency::maintain`), and stops
//!   the purge when it stops.
//! - [`client`] is the other side: the reqwest middleware that sends one key per payment and
//!   the same bytes on every retry, and retries only what is safe.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotency::postgres::{sqlx, PostgresStore};
use idempotency::reqwest::reqwest_middleware::{reqwest, ClientBuilder, ClientWithMiddleware};
use idempotency::reqwest::{IdempotencyMiddleware, RetryPolicy};
use idempotency::tower::{ClaimedKey, IdempotencyLayer};
use idempotency::{Idempotency, Maintenance};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use std::sync::Arc;
use std::time::Duration;

/// Any error of the example's setup.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where the service keeps its payments and keys, and for how long a key is replayed.
#[derive(Debug, Clone)]
pub struct Config {
    /// `PAYMENTS_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
    pub postgres_url: String,
    /// `PAYMENTS_SCHEMA`: the schema of the `payments` table and the idempotency keys
    /// (default `payments`).
    pub schema: String,
    /// How long a key's answer is replayed (24 hours by default).
    pub retention: Duration,
    /// How often expired keys are purged (every minute by default).
    pub purge_every: Duration,
}

impl Config {
    /// From the environment, with the defaults above.
    pub fn from_env() -> Self {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
        Self {
            postgres_url: var(
                "PAYMENTS_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            schema: var("PAYMENTS_SCHEMA", "payments"),
            retention: Duration::from_secs(24 * 3600),
            purge_every: Duration::from_secs(60),
        }
    }
}

/// What `POST /payments` takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewPayment {
    /// The amount, in cents (more than zero).
    pub cents: i64,
    /// Three capital letters (`EUR`).
    pub currency: String,
}

/// A payment, as `POST /payments` answers (201) and every retry of it gets again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payment {
    /// The payment's id.
    pub id: i64,
    /// The merchant who asked for it.
    pub merchant: String,
    /// The amount, in cents.
    pub cents: i64,
    /// Its currency.
    pub currency: String,
}

/// A running service.
#[derive(Debug)]
pub struct Running {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Serves until the process ends.
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The purge of expired keys; [`Maintenance::shutdown`] stops it (dropping it does too).
    pub maintenance: Maintenance,
    /// The store of the keys (its pool serves the payments too).
    pub store: PostgresStore,
}

struct App {
    store: PostgresStore,
    /// `"schema".payments`, quoted.
    payments: String,
}

/// Creates the schema, the `payments` table and the keys' table if they are missing, and
/// serves on 127.0.0.1:`port` (0: any free port), purging expired keys meanwhile.
pub async fn start(config: &Config, port: u16) -> Result<Running, BoxError> {
    let store = PostgresStore::builder()
        .schema(&config.schema)
        .connect(&config.postgres_url)
        .await?;
    let schema = format!("\"{}\"", config.schema.replace('"', "\"\""));
    let payments = format!("{schema}.payments");
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
        .execute(store.pool())
        .await?;
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {payments} (
             id bigserial PRIMARY KEY,
             merchant text NOT NULL,
             cents bigint NOT NULL,
             currency text NOT NULL)"
    ))
    .execute(store.pool())
    .await?;
    store.migrate().await?;

    // The engine owns the store; the layer, the handler's transaction and the purge share it.
    let engine = Idempotency::builder(store.clone())
        .retention(config.retention)
        .build()?;
    let maintenance = engine.maintain().purge_every(config.purge_every).spawn();
    let layer =
        IdempotencyLayer::per_caller(engine, |parts| merchant(&parts.headers)).required(true);
    let app = Arc::new(App {
        store: store.clone(),
        payments,
    });
    let router = Router::new()
        .route("/payments", post(create))
        .route_layer(layer)
        .route("/payments/{id}", get(show))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let url = format!("http://{}", listener.local_addr()?);
    let task = tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(Running {
        url,
        task,
        maintenance,
        store,
    })
}

/// The merchant making the request, from `Authorization: Bearer <merchant>`: each merchant's
/// keys are their own. (Any token is accepted here; it stands for your authentication.)
fn merchant(headers: &HeaderMap) -> Option<String> {
    let token = headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")?
        .trim();
    (!token.is_empty()).then(|| token.to_owned())
}

/// A JSON answer.
fn json(status: StatusCode, value: &impl Serialize) -> axum::http::Response<Bytes> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut resp = axum::http::Response::new(Bytes::from(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// A `422` problem document for a request that is not a payment.
fn invalid(detail: &str) -> Response {
    let mut resp = json(
        StatusCode::UNPROCESSABLE_ENTITY,
        &serde_json::json!({
            "type": "https://payments.example/problems/invalid-payment",
            "title": "The payment is not valid",
            "status": 422,
            "detail": detail,
        }),
    );
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    resp.map(Body::from)
}

/// `POST /payments`: the payment row and the stored `201` commit together.
async fn create(
    State(app): State<Arc<App>>,
    claim: ClaimedKey,
    headers: HeaderMap,
    Json(new): Json<NewPayment>,
) -> Response {
    // The layer has refused a request without a merchant already.
    let merchant = merchant(&headers).unwrap_or_default();
    if new.cents <= 0 {
        return invalid("cents must be more than zero");
    }
    if new.currency.len() != 3 || !new.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return invalid("currency must be three capital letters");
    }
    let insert = format!(
        "INSERT INTO {} (merchant, cents, currency) VALUES ($1, $2, $3) RETURNING id",
        app.payments
    );
    claim
        .run_in_transaction(&app.store, |tx: &mut PgConnection| {
            let (insert, merchant, new) = (insert.clone(), merchant.clone(), new.clone());
            Box::pin(async move {
                // `Err` is a database error: the transaction rolls back (and runs again after
                // a serialization failure or a deadlock).
                let id: i64 = sqlx::query_scalar(&insert)
                    .bind(&merchant)
                    .bind(new.cents)
                    .bind(&new.currency)
                    .fetch_one(&mut *tx)
                    .await?;
                let payment = Payment {
                    id,
                    merchant,
                    cents: new.cents,
                    currency: new.currency,
                };
                let mut resp = json(StatusCode::CREATED, &payment);
                if let Ok(location) = HeaderValue::from_str(&format!("/payments/{id}")) {
                    resp.headers_mut().insert(header::LOCATION, location);
                }
                Ok(resp)
            })
        })
        .await
        .map(Body::from)
        .into_response()
}

/// `GET /payments/{id}`.
async fn show(State(app): State<Arc<App>>, Path(id): Path<i64>) -> Response {
    let row: Result<Option<(String, i64, String)>, _> = sqlx::query_as(&format!(
        "SELECT merchant, cents, currency FROM {} WHERE id = $1",
        app.payments
    ))
    .bind(id)
    .fetch_optional(app.store.pool())
    .await;
    match row {
        Ok(Some((merchant, cents, currency))) => {
            let payment = Payment {
                id,
                merchant,
                cents,
                currency,
            };
            json(StatusCode::OK, &payment).map(Body::from)
        }
        Ok(None) => StatusCode::NOT_FOUND.into_response(),
        Err(e) => {
            tracing::error!(error = %e, "reading a payment failed");
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
    }
}

/// The client half: one key per payment (kept across its retries), the same bytes on every
/// attempt, `Retry-After` honoured, `422` never retried, a retry budget of 20 seconds.
pub fn client() -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(
            IdempotencyMiddleware::new().retry_policy(
                RetryPolicy::default()
                    .backoff(Duration::from_millis(50), Duration::from_secs(1))
                    .deadline(Duration::from_secs(20)),
            ),
        )
        .build()
}
