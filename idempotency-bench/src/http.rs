//! The figures peers publish, measured the same way through our tower layer: an axum service
//! on a loopback port, with and without the layer, and one client sending requests one at a
//! time over one keep-alive connection: a fresh key each time, the same key again (a replay),
//! and no middleware at all (idempot-js publishes this table: their SQLite fresh key, 0.19 ms
//! median on an i7-10710U). Every request carries the same 1 KiB JSON body.

use crate::stats::Summary;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use idempotency_core::store::BoxError;
use idempotency_core::{Idempotency, IdempotencyStore, Policy};
use idempotency_tower::IdempotencyLayer;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests per scenario, after as many warm-up requests as a tenth of them.
pub(crate) const REQUESTS: usize = 1_000;
/// The scenarios take turns this many times.
const TURNS: usize = 5;

/// What the handler answers: a small receipt, as in every other workload.
async fn create_order() -> ([(http::HeaderName, &'static str); 1], &'static str) {
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        crate::harness::OUTCOME,
    )
}

/// An axum service on a free loopback port, stopped when dropped.
struct Server {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(app: Router) -> Result<Self, BoxError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { port, task })
    }

    /// One keep-alive HTTP/1.1 connection to the server.
    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, BoxError> {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends one request and reads the whole answer; the answer's status and whether it was a
/// replay.
async fn send(
    sender: &mut SendRequest<Full<Bytes>>,
    key: &str,
    body: &Bytes,
) -> Result<(http::StatusCode, bool), BoxError> {
    let req = http::Request::post("/orders")
        .header(http::header::HOST, "127.0.0.1")
        .header(http::header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Full::new(body.clone()))?;
    sender.ready().await?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let replayed = resp.headers().contains_key("idempotent-replayed");
    resp.into_body().collect().await?;
    Ok((status, replayed))
}

/// `n` requests one at a time over `sender`, with the key `key(i)` makes: their latencies.
/// Every answer must be a 200, replayed or not as `replayed` says.
async fn scenario(
    sender: &mut SendRequest<Full<Bytes>>,
    n: std::ops::Range<usize>,
    key: impl Fn(usize) -> String,
    replayed: bool,
    body: &Bytes,
    samples: &mut Vec<Duration>,
) -> Result<(), BoxError> {
    for i in n {
        let k = key(i);
        let t = Instant::now();
        let (status, was_replayed) = send(sender, &k, body).await?;
        let took = t.elapsed();
        if status != http::StatusCode::OK || was_replayed != replayed {
            return Err(format!(
                "request {i} with key {k}: {status}, replayed {was_replayed} (expected 200, \
                 replayed {replayed})"
            )
            .into());
        }
        samples.push(took);
    }
    Ok(())
}

/// The three scenarios on `store`: no middleware, a fresh key, the same key again.
pub(crate) struct Row {
    pub plain: Summary,
    pub fresh: Summary,
    pub repeat: Summary,
}

/// Measures the three scenarios on `store`, under keys starting with `run`.
pub(crate) async fn measure(store: Arc<dyn IdempotencyStore>, run: &str) -> Result<Row, BoxError> {
    let body = Bytes::from(idempotency_testing::payloads::order_json_1k());
    let engine = Idempotency::new(store, Policy::default())?;
    let plain = Server::start(Router::new().route("/orders", post(create_order))).await?;
    let layered = Server::start(
        Router::new()
            .route("/orders", post(create_order))
            .layer(IdempotencyLayer::shared(engine)),
    )
    .await?;
    let (mut to_plain, mut to_layered) = (plain.connect().await?, layered.connect().await?);
    // The repeated key is answered once first, so every measured request is a replay.
    let repeated = format!("{run}-repeat");
    send(&mut to_layered, &repeated, &body).await?;
    // Warm-up, then the scenarios in turns of a fifth each, so that a slow spell of the
    // machine falls on all three alike.
    let (mut plain, mut fresh, mut repeat) = (Vec::new(), Vec::new(), Vec::new());
    let turn = REQUESTS / TURNS;
    for t in 0..=TURNS {
        let n = match t {
            0 => 0..REQUESTS / 10,
            t => REQUESTS + (t - 1) * turn..REQUESTS + t * turn,
        };
        let plain_key = |i| format!("{run}-plain-{i}");
        let fresh_key = |i| format!("{run}-fresh-{i}");
        let mut samples = [Vec::new(), Vec::new(), Vec::new()];
        scenario(
            &mut to_plain,
            n.clone(),
            plain_key,
            false,
            &body,
            &mut samples[0],
        )
        .await?;
        scenario(
            &mut to_layered,
            n.clone(),
            fresh_key,
            false,
            &body,
            &mut samples[1],
        )
        .await?;
        scenario(
            &mut to_layered,
            n,
            |_| repeated.clone(),
            true,
            &body,
            &mut samples[2],
        )
        .await?;
        if t > 0 {
            let [p, f, r] = samples;
            plain.extend(p);
            fresh.extend(f);
            repeat.extend(r);
        }
    }
    let summary = |s: Vec<Duration>| Summary::from_samples(s, Duration::ZERO);
    let (plain, fresh, repeat) = (summary(plain), summary(fresh), summary(repeat));
    Ok(Row {
        plain,
        fresh,
        repeat,
    })
}

/// Milliseconds with two decimals, as peers publish them.
pub(crate) fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}
