//! The rides service: `POST /rides` books a ride in three phases with `run_phases`, behind the
//! idempotency layer (which reads the key and answers refusals), and a completer finishes
//! bookings whose process died.

use crate::crash::CrashPoints;
use crate::payments::{Charge, ChargeRequest};
use crate::{open_store, problem, retry_later, serve, Running};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::StatusCode;
use idempotency_core::{Completer, Idempotency, IdempotencyKey, PhaseContext, Phases};
use idempotency_reqwest::{IdempotencyMiddleware, IdempotentRequestExt, RetryPolicy};
use idempotency_sqlite::rusqlite::params;
use idempotency_sqlite::{SqliteIdempotency, SqliteStore, SqliteTransaction};
use idempotency_tower::{IdempotencyLayer, Refusal, RequestKey};
use reqwest_middleware::ClientWithMiddleware;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The operation's name, written in its recovery points.
pub const OPERATION: &str = "book-ride";

const TABLES: &str = "CREATE TABLE IF NOT EXISTS rides (
    id     INTEGER PRIMARY KEY,
    key    TEXT NOT NULL,
    route  TEXT NOT NULL,
    amount INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS outbox (
    id      INTEGER PRIMARY KEY,
    key     TEXT NOT NULL,
    ride    INTEGER NOT NULL,
    charge  INTEGER NOT NULL,
    message TEXT NOT NULL
);";

/// What `POST /rides` takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookRide {
    /// Where from, where to.
    pub route: String,
    /// The fare, in cents.
    pub amount: u32,
}

/// What it answers (201), and every retry of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Booking {
    /// The ride's id.
    pub ride: i64,
    /// Its route.
    pub route: String,
    /// Its fare.
    pub amount: u32,
    /// The payment service's charge.
    pub charge: i64,
    /// The receipt message's id in the outbox.
    pub receipt: i64,
}

/// The state after the first phase: everything the later phases need travels in it (a
/// completer resuming the booking has no request).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Ride {
    id: i64,
    key: String,
    route: String,
    amount: u32,
}

/// The state after the charge.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Charged {
    ride: Ride,
    charge: i64,
}

/// How the rides service runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The SQLite file of the rides, the outbox and the idempotency records.
    pub db: PathBuf,
    /// The payment service's base URL.
    pub payments: String,
    /// The lease of a booking's holder (renewed while it runs).
    pub lease: Duration,
    /// Run the completer in this process.
    pub completer: bool,
    /// Crash points (for the crash campaign and the demo).
    pub crash: CrashPoints,
}

impl Config {
    /// From `RIDES_DB`, `PAYMENTS_URL`, `RIDES_LEASE_MS` (default 5000), `RIDES_COMPLETER`
    /// (`on` or `off`, default `on`) and the crash points' variables.
    pub fn from_env() -> Result<Self, String> {
        let db = std::env::var("RIDES_DB").map_err(|_| "RIDES_DB is not set".to_owned())?;
        let payments =
            std::env::var("PAYMENTS_URL").map_err(|_| "PAYMENTS_URL is not set".to_owned())?;
        let lease = match std::env::var("RIDES_LEASE_MS") {
            Ok(ms) => Duration::from_millis(
                ms.parse()
                    .map_err(|e| format!("RIDES_LEASE_MS={ms} is not milliseconds: {e}"))?,
            ),
            Err(_) => Duration::from_secs(5),
        };
        let completer = match std::env::var("RIDES_COMPLETER").as_deref() {
            Ok("on") | Err(_) => true,
            Ok("off") => false,
            Ok(other) => return Err(format!("RIDES_COMPLETER={other} is neither on nor off")),
        };
        Ok(Self {
            db: db.into(),
            payments,
            lease,
            completer,
            crash: CrashPoints::from_env()?,
        })
    }
}

/// The payment service's client: our client half, talking to our server half.
#[derive(Debug, Clone)]
struct Payments {
    client: ClientWithMiddleware,
    url: String,
}

impl Payments {
    fn new(url: String) -> Self {
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(
                IdempotencyMiddleware::new().retry_policy(
                    RetryPolicy::default()
                        .backoff(Duration::from_millis(50), Duration::from_secs(1))
                        .deadline(Duration::from_secs(20)),
                ),
            )
            .build();
        Self { client, url }
    }

    /// Charges `amount` for `ride` under `key`: one charge however often it is asked.
    async fn charge(&self, key: &str, ride: i64, amount: u32) -> Result<i64, String> {
        let key = IdempotencyKey::new(key).map_err(|e| e.to_string())?;
        let sent = self
            .client
            .post(format!("{}/charges", self.url))
            .json(&ChargeRequest { ride, amount })
            .idempotency_key(key)
            .send()
            .await
            .map_err(|e| format!("the payment service did not charge: {e}"))?;
        if sent.status() != StatusCode::CREATED {
            return Err(format!("the payment service answered {}", sent.status()));
        }
        let charge: Charge = sent
            .json()
            .await
            .map_err(|e| format!("the payment service's answer: {e}"))?;
        Ok(charge.charge)
    }
}

/// The booking's phases. `request` is the key and the request that start it; a completer,
/// which only ever resumes a booking past its first phase, has none.
fn booking(
    request: Option<(IdempotencyKey, BookRide)>,
    payments: Payments,
    crash: CrashPoints,
) -> Phases<SqliteStore, Booking, String> {
    let (at_charge, at_receipt) = (crash.clone(), crash.clone());
    Phases::new(OPERATION)
        .phase(
            "create-ride",
            move |tx: &mut SqliteTransaction, (): (), _: PhaseContext| {
                let (request, crash) = (request.clone(), crash.clone());
                Box::pin(async move {
                    let Some((key, ride)) = request else {
                        return Ok(Err("a booking is started only by its request".to_owned()));
                    };
                    let (k, route, amount) = (key.as_str().to_owned(), ride.route, ride.amount);
                    let row = (k.clone(), route.clone());
                    let id = tx
                        .run(move |t| {
                            t.execute(
                                "INSERT INTO rides (key, route, amount) VALUES (?1, ?2, ?3)",
                                params![row.0, row.1, amount],
                            )?;
                            Ok::<_, idempotency_sqlite::rusqlite::Error>(t.last_insert_rowid())
                        })
                        .await?;
                    let id = match id {
                        Ok(id) => id,
                        Err(e) => return Ok(Err(e.to_string())),
                    };
                    crash.reached("create-ride:written", &k).await;
                    Ok(Ok(Ride {
                        id,
                        key: k,
                        route,
                        amount,
                    }))
                })
            },
        )
        // Alone in its phase: if the process dies after the charge and before its recovery
        // point commits, the next holder asks again with the same key, and is answered with
        // the same charge.
        .foreign("charge", move |ride: Ride, ctx: PhaseContext| {
            let (payments, crash) = (payments.clone(), at_charge.clone());
            async move {
                crash.reached("charge:before-call", &ride.key).await;
                let charge = match payments.charge(ctx.key(), ride.id, ride.amount).await {
                    Ok(charge) => charge,
                    Err(e) => return Ok(Err(e)),
                };
                crash.reached("charge:called", &ride.key).await;
                Ok(Ok(Charged { ride, charge }))
            }
        })
        .phase(
            "receipt",
            move |tx: &mut SqliteTransaction, charged: Charged, _: PhaseContext| {
                let crash = at_receipt.clone();
                Box::pin(async move {
                    crash
                        .reached("receipt:before-write", &charged.ride.key)
                        .await;
                    let Charged { ride, charge } = charged;
                    let message = format!(
                        "ride {} ({}) charged {} cents, charge {charge}",
                        ride.id, ride.route, ride.amount
                    );
                    let (key, id) = (ride.key.clone(), ride.id);
                    let receipt = tx
                        .run(move |t| {
                            t.execute(
                                "INSERT INTO outbox (key, ride, charge, message) \
                                 VALUES (?1, ?2, ?3, ?4)",
                                params![key, id, charge, message],
                            )?;
                            Ok::<_, idempotency_sqlite::rusqlite::Error>(t.last_insert_rowid())
                        })
                        .await?;
                    let receipt = match receipt {
                        Ok(receipt) => receipt,
                        Err(e) => return Ok(Err(e.to_string())),
                    };
                    crash.reached("receipt:written", &ride.key).await;
                    Ok(Ok(Booking {
                        ride: ride.id,
                        route: ride.route,
                        amount: ride.amount,
                        charge,
                        receipt,
                    }))
                })
            },
        )
}

struct App {
    idempotency: SqliteIdempotency,
    payments: Payments,
    crash: CrashPoints,
}

/// Starts the rides service on 127.0.0.1:`port`, and its completer (every 200 ms) if the
/// configuration says so.
pub async fn start(config: &Config, port: u16) -> Result<Running, Box<dyn std::error::Error>> {
    let store = open_store(&config.db, TABLES).await?;
    // One engine, owning the store: the layer, the handler and the completer share it.
    let engine: SqliteIdempotency = Idempotency::builder(store)
        .lease(config.lease)
        .retention(Duration::from_secs(24 * 3600))
        .build()?;
    let payments = Payments::new(config.payments.clone());
    let mut maintenance = engine.maintain();
    if config.completer {
        let (payments, crash) = (payments.clone(), config.crash.clone());
        let completer = Completer::new(&engine)
            .operation(OPERATION, move || {
                booking(None, payments.clone(), crash.clone())
            })
            .retry_failed_after(Duration::from_secs(1));
        maintenance = maintenance.complete(completer, Duration::from_millis(200));
    }
    // The layer reads the key (both forms), names the rider, fingerprints the request and
    // answers refusals; the handler runs the booking under that key itself.
    let layer = IdempotencyLayer::per_caller(engine.clone(), rider)
        .required(true)
        .problem_type_base(crate::PROBLEM_BASE)
        .handler_claims();
    let app = Arc::new(App {
        idempotency: engine,
        payments,
        crash: config.crash.clone(),
    });
    let router = Router::new()
        .route("/rides", post(book))
        .route_layer(layer)
        .with_state(app);
    Ok(serve(router, port, maintenance).await?)
}

/// The rider making the request, from `Authorization: Bearer <token>`: each rider's keys are
/// their own, so two riders who pick the same key make two bookings, and neither is ever
/// answered with the other's. (The example accepts any token; it stands for whatever your
/// authentication establishes.) No rider: `401`.
fn rider(parts: &http::request::Parts) -> Option<String> {
    let rider = parts
        .headers
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")?
        .trim();
    (!rider.is_empty()).then(|| rider.to_owned())
}

/// `POST /rides` with an `Idempotency-Key`, by a rider named in `Authorization: Bearer`.
async fn book(
    State(app): State<Arc<App>>,
    request: RequestKey,
    body: Bytes,
) -> Result<Response, Refusal> {
    let ride: BookRide = match serde_json::from_slice(&body) {
        Ok(ride) => ride,
        Err(e) => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                "bad-booking",
                e.to_string(),
            ))
        }
    };
    let key = request.key();
    let phases = booking(
        Some((key.clone(), ride)),
        app.payments.clone(),
        app.crash.clone(),
    );
    let booking = app
        .idempotency
        .run_phases(key, request.scope(), request.fingerprint(), phases);
    // In progress, key reused, failed for good, outcome lost: the layer's answers.
    match request.run(booking).await? {
        Ok(booking) => {
            if !request.replayed() {
                app.crash.reached("answered", key.as_str()).await;
            }
            Ok((StatusCode::CREATED, axum::Json(booking)).into_response())
        }
        // Recorded as a retryable failure: the same request later resumes the booking.
        Err(e) => Ok(retry_later(
            StatusCode::SERVICE_UNAVAILABLE,
            "booking-failed",
            e,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys are the rider's own: the same key from two riders makes two bookings, a repeat
    /// from the first is replayed its own booking, and a request naming no rider is `401`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn riders_keep_their_keys_apart() {
        let dir = tempfile::tempdir().expect("temp dir");
        let payments =
            crate::payments::start(&dir.path().join("payments.db"), 0, Duration::from_secs(30))
                .await
                .expect("payments");
        let config = Config {
            db: dir.path().join("rides.db"),
            payments: payments.url.clone(),
            lease: Duration::from_secs(5),
            completer: false,
            crash: CrashPoints::default(),
        };
        let rides = start(&config, 0).await.expect("rides");
        let client = reqwest::Client::new();
        let request = BookRide {
            route: "A to B".into(),
            amount: 1200,
        };
        let send = |rider: Option<&'static str>| {
            let mut req = client
                .post(format!("{}/rides", rides.url))
                .header("idempotency-key", "same-key")
                .json(&request);
            if let Some(rider) = rider {
                req = req.bearer_auth(rider);
            }
            req.send()
        };
        let anonymous = send(None).await.expect("answered");
        assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
        assert!(anonymous.headers().contains_key("www-authenticate"));
        let mut bookings = Vec::new();
        for rider in ["rider-a", "rider-b", "rider-a"] {
            let resp = send(Some(rider)).await.expect("answered");
            assert_eq!(resp.status(), StatusCode::CREATED, "{rider}");
            let replayed = resp.headers().contains_key("idempotent-replayed");
            let booking: Booking = resp.json().await.expect("a booking");
            bookings.push((booking, replayed));
        }
        let [(a, false), (b, false), (again, true)] = &bookings[..] else {
            panic!("expected two fresh bookings and a replay: {bookings:?}")
        };
        assert_ne!(a.ride, b.ride, "two riders got one booking");
        assert_eq!(again, a, "the first rider's repeat got another booking");
    }
}
