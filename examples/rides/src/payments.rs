//! The payment service: `POST /charges` behind `idempotency-tower`, its charge row and the
//! key's completion committed in one SQLite transaction, so that a charge asked for twice
//! with one key is made once and the second ask is answered with the first charge.

use crate::{open_store, problem, serve, Running};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::StatusCode;
use idempotency_core::Idempotency;
use idempotency_sqlite::rusqlite::{params, TransactionBehavior};
use idempotency_sqlite::SqliteStore;
use idempotency_tower::{ClaimedKey, IdempotencyLayer};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

const TABLES: &str = "CREATE TABLE IF NOT EXISTS charges (
    id     INTEGER PRIMARY KEY,
    ride   INTEGER NOT NULL,
    amount INTEGER NOT NULL
);";

/// What `POST /charges` takes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChargeRequest {
    /// The ride charged for.
    pub ride: i64,
    /// In cents.
    pub amount: u32,
}

/// What it answers (201).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Charge {
    /// The charge's id.
    pub charge: i64,
}

/// Starts the payment service over the SQLite file `db` on 127.0.0.1:`port`, holding a
/// charge's key for `lease` while it is made (renewed while it runs).
pub async fn start(
    db: &Path,
    port: u16,
    lease: Duration,
) -> Result<Running, Box<dyn std::error::Error>> {
    let store = open_store(db, TABLES).await?;
    let engine = Idempotency::builder(store.clone())
        .lease(lease)
        .retention(Duration::from_secs(24 * 3600))
        .build()?;
    let maintenance = engine.maintain();
    let layer = IdempotencyLayer::shared(engine)
        .required(true)
        .methods([http::Method::POST])
        .problem_type_base(crate::PROBLEM_BASE);
    let router = Router::new()
        .route("/charges", post(charge).route_layer(layer))
        .with_state(store);
    Ok(serve(router, port, maintenance).await?)
}

/// `POST /charges`: the charge row and the key's completion in one transaction.
async fn charge(
    State(store): State<SqliteStore>,
    claim: Option<ClaimedKey>,
    body: Bytes,
) -> Response {
    let Some(claim) = claim else {
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "not-behind-the-layer",
            "the route is not behind the idempotency layer",
        );
    };
    let request: ChargeRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => return problem(StatusCode::BAD_REQUEST, "bad-charge", e.to_string()),
    };
    let (records, claimed) = (store.clone(), claim.clone());
    let made = store
        .call(
            move |conn| -> Result<Response<Bytes>, idempotency_core::Error> {
                let backend = |e| idempotency_core::Error::backend(true, e);
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(backend)?;
                tx.execute(
                    "INSERT INTO charges (ride, amount) VALUES (?1, ?2)",
                    params![request.ride, request.amount],
                )
                .map_err(backend)?;
                let id = tx.last_insert_rowid();
                let body = serde_json::to_vec(&Charge { charge: id })
                    .map_err(|source| idempotency_core::Error::Codec { source })?;
                let answer = http::Response::builder()
                    .status(StatusCode::CREATED)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Bytes::from(body))
                    .map_err(|e| idempotency_core::Error::backend(false, e))?;
                let prepared = claimed
                    .prepare(answer)
                    .map_err(|e| idempotency_core::Error::backend(false, e))?;
                // Fenced (another request took the key over): `tx` rolls back with the charge.
                records.complete_in(
                    &tx,
                    claimed.id(),
                    claimed.token(),
                    prepared.outcome(),
                    claimed.retention(),
                )?;
                tx.commit().map_err(backend)?;
                Ok(prepared.committed())
            },
        )
        .await;
    match made {
        Ok(Ok(answer)) => answer.map(axum::body::Body::from).into_response(),
        Ok(Err(idempotency_core::Error::LeaseLost { .. })) => {
            claim.lease_lost();
            StatusCode::CONFLICT.into_response()
        }
        Ok(Err(e)) => {
            // The transaction never committed (SQLite rolls back a transaction whose COMMIT
            // failed): nothing was charged, so the key is freed for the retry this 503 asks
            // for, instead of replaying the 503 for the key's retention.
            claim.rolled_back();
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "charge-failed",
                e.to_string(),
            )
        }
        Err(e) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "charge-failed",
            e.to_string(),
        ),
    }
}
