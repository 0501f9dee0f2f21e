//! The rides example: booking a ride is three phases that each commit once, and a booking
//! whose process died part-way is resumed where it stopped, never started over.
//!
//! 1. **create-ride** writes the ride row (SQLite), with the booking's recovery point;
//! 2. **charge** calls the payment service, a second process behind `idempotency-tower`,
//!    through `idempotency-reqwest`, sending the phase's key as its `Idempotency-Key`: the
//!    same on every attempt and for every holder, so a charge made before a crash is replayed,
//!    not made again;
//! 3. **receipt** writes a receipt message to an outbox table, with the key's completion.
//!
//! A client's retry of the same `Idempotency-Key`, or the service's completer when no client
//! comes back, resumes at the last committed phase. See the crate README.

pub mod crash;
pub mod payments;
pub mod rides;

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use serde_json::json;
use std::path::Path;

/// Where problem types of this example live.
pub const PROBLEM_BASE: &str = "https://rides.example/problems/";

/// A problem document (RFC 9457) answer.
pub(crate) fn problem(status: StatusCode, kind: &str, detail: impl Into<String>) -> Response {
    let body = json!({
        "type": format!("{PROBLEM_BASE}{kind}"),
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail.into(),
    });
    let mut resp = (status, body.to_string()).into_response();
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    resp
}

/// `problem` with `Retry-After: 1`: the client may send the same request again.
pub(crate) fn retry_later(status: StatusCode, kind: &str, detail: impl Into<String>) -> Response {
    let mut resp = problem(status, kind, detail);
    resp.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    resp
}

/// A running service: its URL and the task serving it.
#[derive(Debug)]
pub struct Running {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Serves until the process ends; its error if serving failed.
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The purge of expired keys (and the completer, where one runs), stopped when dropped.
    pub maintenance: idempotency_core::Maintenance,
}

/// Serves `router` on 127.0.0.1:`port` (0: an ephemeral port), with its maintenance tasks.
pub(crate) async fn serve(
    router: axum::Router,
    port: u16,
    maintenance: idempotency_core::Maintain,
) -> std::io::Result<Running> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let url = format!("http://{}", listener.local_addr()?);
    let task = tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(Running {
        url,
        task,
        maintenance: maintenance.spawn(),
    })
}

/// Opens the SQLite store of `path` (creating the file and its records table) and creates the
/// business tables with `tables`.
pub(crate) async fn open_store(
    path: &Path,
    tables: &'static str,
) -> Result<idempotency_sqlite::SqliteStore, idempotency_core::Error> {
    let store = idempotency_sqlite::SqliteStore::builder(path)
        .open()
        .await?;
    store.migrate().await?;
    store
        .call(move |c| c.execute_batch(tables))
        .await?
        .map_err(|e| idempotency_core::Error::backend(false, e))?;
    Ok(store)
}
