//! The payments example: the whole path a team copies, on axum and Postgres through the one
//! `idempotency` crate.
//!
//! - `POST /payments` sits behind the idempotency layer, one key space per merchant. Its
//!   handler writes the payment row and the key's stored `201` in **one transaction**
//!   (`ClaimedKey::run_in_transaction`): a crash between the two cannot let a retry charge
//!   twice, and every retry of the key is answered with the first payment.
//! - `GET /payments/{id}` reads one back.
//! - `POST /payments/{id}/refunds` refunds part of a payment in three phases
//!   (`Idempotency::run_phases` behind the layer, `handler_claims`): the refund row, the card
//!   provider's refund (sent with a key that is the same on every attempt), the row marked
//!   refunded. A refund whose provider call failed, or whose process died, is finished by the
//!   completer, without refunding twice.
//! - The service purges expired keys and runs the completer in the background
//!   (`Idempotency::maintain`), and stops both when it stops.
//! - [`client`] is the other side: the reqwest middleware that sends one key per payment and
//!   the same bytes on every retry, and retries only what is safe.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotency::postgres::PostgresIdempotency;
use idempotency::postgres::{sqlx, PostgresStore};
use idempotency::reqwest::reqwest_middleware::{reqwest, ClientBuilder, ClientWithMiddleware};
use idempotency::reqwest::{IdempotencyMiddleware, RetryPolicy};
use idempotency::tower::{ClaimedKey, IdempotencyLayer, Refusal, RequestKey};
use idempotency::{Completer, Idempotency, Maintenance, PhaseContext, Phases};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// How often the completer looks for refunds to finish (every 5 s by default), and how
    /// long after a failed attempt it takes one up again (30 s by default).
    pub complete_every: Duration,
    /// See `complete_every`.
    pub retry_refunds_after: Duration,
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
            complete_every: Duration::from_secs(5),
            retry_refunds_after: Duration::from_secs(30),
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

/// What `POST /payments/{id}/refunds` takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewRefund {
    /// The amount, in cents: more than zero, at most what the payment has left.
    pub cents: i64,
}

/// A refund, as `POST /payments/{id}/refunds` answers (201) and every retry of it gets again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refund {
    /// The refund's id.
    pub id: i64,
    /// The payment refunded.
    pub payment: i64,
    /// The amount, in cents.
    pub cents: i64,
    /// The card provider's reference for it.
    pub reference: String,
}

/// The card provider's refund API, which deduplicates by idempotency key as real providers
/// do: a refund sent again under the same key is answered with the first one's reference.
/// (It keeps its refunds in a table of its own; it stands for a call to another service.)
#[derive(Debug, Clone)]
pub struct Provider {
    pool: sqlx::PgPool,
    /// `"schema".provider_refunds`, quoted.
    table: String,
    /// This many calls fail before any reaches the provider (a provider outage).
    pub outage: Arc<AtomicUsize>,
}

impl Provider {
    /// Refunds `cents` of `payment`, once per `key`.
    async fn refund(&self, key: &str, payment: i64, cents: i64) -> Result<String, RefundError> {
        let down = self
            .outage
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if down.is_ok() {
            return Err(RefundError::Provider(
                "the card provider is unavailable".into(),
            ));
        }
        let reference = format!("re_{payment}_{}", &key[..12.min(key.len())]);
        sqlx::query(&format!(
            "INSERT INTO {} (key, payment, cents, reference) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (key) DO NOTHING",
            self.table
        ))
        .bind(key)
        .bind(payment)
        .bind(cents)
        .bind(&reference)
        .execute(&self.pool)
        .await
        .map_err(|e| RefundError::Provider(e.to_string()))?;
        sqlx::query_scalar(&format!(
            "SELECT reference FROM {} WHERE key = $1",
            self.table
        ))
        .bind(key)
        .fetch_one(&self.pool)
        .await
        .map_err(|e| RefundError::Provider(e.to_string()))
    }
}

/// Why a refund was not made. Only `Display` is asked of it: the engine releases the key on an
/// error (it does not store errors), so a retry, or the completer, tries again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefundError {
    /// No such payment of this merchant's.
    NoPayment,
    /// More than the payment has left to refund.
    TooMuch {
        /// What it has left, in cents.
        left: i64,
    },
    /// The card provider did not refund (yet).
    Provider(String),
    /// The first phase needs the request; the completer has none (it never starts a refund).
    NoRequest,
}

impl fmt::Display for RefundError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoPayment => f.write_str("no such payment"),
            Self::TooMuch { left } => write!(f, "the payment has {left} cents left to refund"),
            Self::Provider(e) => write!(f, "the card provider: {e}"),
            Self::NoRequest => f.write_str("a refund is started only by its request"),
        }
    }
}

/// The name of the refund operation, for its phases and the completer.
const REFUND: &str = "refund";

/// A refund's phases. `request` (merchant, payment, cents) starts one; the completer, which
/// only ever finishes a refund past its first phase, has none.
fn refund(
    payments: Arc<str>,
    request: Option<(String, i64, i64)>,
    provider: Provider,
) -> Phases<idempotency::postgres::PostgresStore, Refund, RefundError> {
    let settle = payments.clone();
    Phases::new(REFUND)
        .phase(
            "create-refund",
            move |tx: &mut PgConnection, (): (), _: PhaseContext| {
                let (payments, request) = (payments.clone(), request.clone());
                Box::pin(async move {
                    let Some((merchant, payment, cents)) = request else {
                        return Ok(Err(RefundError::NoRequest));
                    };
                    // The payment row is locked: two refunds of it are checked one after the
                    // other, never both against the same amount left.
                    let paid: Option<i64> = sqlx::query_scalar(&format!(
                        "SELECT cents FROM {payments} WHERE id = $1 AND merchant = $2 FOR UPDATE"
                    ))
                    .bind(payment)
                    .bind(&merchant)
                    .fetch_optional(&mut *tx)
                    .await?;
                    let Some(paid) = paid else {
                        return Ok(Err(RefundError::NoPayment));
                    };
                    let refunded: i64 = sqlx::query_scalar(&format!(
                        "SELECT coalesce(sum(cents), 0)::bigint FROM {payments}_refunds \
                         WHERE payment = $1"
                    ))
                    .bind(payment)
                    .fetch_one(&mut *tx)
                    .await?;
                    if cents > paid - refunded {
                        return Ok(Err(RefundError::TooMuch {
                            left: paid - refunded,
                        }));
                    }
                    let id: i64 = sqlx::query_scalar(&format!(
                        "INSERT INTO {payments}_refunds (payment, cents) VALUES ($1, $2) \
                         RETURNING id"
                    ))
                    .bind(payment)
                    .bind(cents)
                    .fetch_one(&mut *tx)
                    .await?;
                    // What the later phases need travels in the state, not in the request.
                    Ok(Ok((id, payment, cents)))
                })
            },
        )
        // Alone in its phase: sent again, with the same key, if its holder dies before the
        // phase's recovery point commits; the provider answers with the first refund.
        .foreign(
            "provider-refund",
            move |(id, payment, cents): (i64, i64, i64), ctx: PhaseContext| {
                let provider = provider.clone();
                async move {
                    let reference = provider.refund(ctx.key(), payment, cents).await;
                    Ok(reference.map(|reference| (id, payment, cents, reference)))
                }
            },
        )
        .phase(
            "mark-refunded",
            move |tx: &mut PgConnection,
                  (id, payment, cents, reference): (i64, i64, i64, String),
                  _: PhaseContext| {
                let payments = settle.clone();
                Box::pin(async move {
                    sqlx::query(&format!(
                        "UPDATE {payments}_refunds SET reference = $2 WHERE id = $1"
                    ))
                    .bind(id)
                    .bind(&reference)
                    .execute(&mut *tx)
                    .await?;
                    Ok(Ok(Refund {
                        id,
                        payment,
                        cents,
                        reference,
                    }))
                })
            },
        )
}

/// A running service.
#[derive(Debug)]
pub struct Running {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Serves until the process ends.
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The purge of expired keys and the completer; [`Maintenance::shutdown`] stops them
    /// (dropping it does too).
    pub maintenance: Maintenance,
    /// The card provider the refunds call.
    pub provider: Provider,
    /// The store of the keys (its pool serves the payments too).
    pub store: PostgresStore,
}

struct App {
    store: PostgresStore,
    /// The engine, for the refunds' phases.
    engine: PostgresIdempotency,
    /// `"schema".payments`, quoted (the refunds are in `"schema".payments_refunds`).
    payments: Arc<str>,
    provider: Provider,
}

/// Creates the schema, the `payments` and `payments_refunds` tables and the keys' table if
/// they are missing, and serves on 127.0.0.1:`port` (0: any free port), purging expired keys
/// and finishing refunds meanwhile.
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
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS {payments} (
             id bigserial PRIMARY KEY,
             merchant text NOT NULL,
             cents bigint NOT NULL,
             currency text NOT NULL);
         CREATE TABLE IF NOT EXISTS {payments}_refunds (
             id bigserial PRIMARY KEY,
             payment bigint NOT NULL REFERENCES {payments} (id),
             cents bigint NOT NULL,
             reference text);
         CREATE TABLE IF NOT EXISTS {schema}.provider_refunds (
             key text PRIMARY KEY,
             payment bigint NOT NULL,
             cents bigint NOT NULL,
             reference text NOT NULL);"
    ))
    .execute(store.pool())
    .await?;
    store.migrate().await?;
    let provider = Provider {
        pool: store.pool().clone(),
        table: format!("{schema}.provider_refunds"),
        outage: Arc::default(),
    };
    let payments: Arc<str> = payments.into();

    // The engine owns the store; the layers, the handlers' transactions, the purge and the
    // completer share it.
    let engine = Idempotency::builder(store.clone())
        .retention(config.retention)
        .build()?;
    let completer = Completer::new(&engine)
        .operation(REFUND, {
            let (payments, provider) = (payments.clone(), provider.clone());
            move || refund(payments.clone(), None, provider.clone())
        })
        .retry_failed_after(config.retry_refunds_after);
    let maintenance = engine
        .maintain()
        .purge_every(config.purge_every)
        .complete(completer, config.complete_every)
        .spawn();
    let layer = IdempotencyLayer::per_caller(engine.clone(), |parts| merchant(&parts.headers))
        .required(true);
    // On the refunds' route the layer reads the key, the merchant and the fingerprint, and the
    // handler runs the phases under them.
    let refunds_layer =
        IdempotencyLayer::per_caller(engine.clone(), |parts| merchant(&parts.headers))
            .required(true)
            .handler_claims();
    let app = Arc::new(App {
        store: store.clone(),
        engine,
        payments,
        provider: provider.clone(),
    });
    let refunds = Router::new()
        .route("/payments/{id}/refunds", post(create_refund))
        .route_layer(refunds_layer);
    let router = Router::new()
        .route("/payments", post(create))
        .route_layer(layer)
        .merge(refunds)
        .route("/payments/{id}", get(show))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let url = format!("http://{}", listener.local_addr()?);
    let task = tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(Running {
        url,
        task,
        maintenance,
        provider,
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

/// `POST /payments/{id}/refunds`: the refund's three phases, under the request's key.
async fn create_refund(
    State(app): State<Arc<App>>,
    Path(payment): Path<i64>,
    request: RequestKey,
    headers: HeaderMap,
    Json(new): Json<NewRefund>,
) -> Result<Response, Refusal> {
    if new.cents <= 0 {
        return Ok(invalid("cents must be more than zero"));
    }
    // The layer has refused a request without a merchant already.
    let merchant = merchant(&headers).unwrap_or_default();
    let phases = refund(
        app.payments.clone(),
        Some((merchant, payment, new.cents)),
        app.provider.clone(),
    );
    let refunded = app.engine.run_phases(
        request.key(),
        request.scope(),
        request.fingerprint(),
        phases,
    );
    // In progress, key reused, failed for good, the store down: the layer's answers.
    Ok(match request.run(refunded).await? {
        Ok(refund) => {
            let mut resp = json(StatusCode::CREATED, &refund);
            if let Ok(location) = HeaderValue::from_str(&format!("/payments/{payment}")) {
                resp.headers_mut().insert(header::LOCATION, location);
            }
            resp.map(Body::from)
        }
        Err(RefundError::NoPayment) => StatusCode::NOT_FOUND.into_response(),
        Err(e @ RefundError::TooMuch { .. }) => invalid(&e.to_string()),
        // Recorded as a retryable failure past its first phase: the completer finishes it,
        // and a retry of the key answers with its refund.
        Err(e) => {
            tracing::warn!(error = %e, "a refund did not finish; the completer will");
            let mut resp = StatusCode::SERVICE_UNAVAILABLE.into_response();
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            resp
        }
    })
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
