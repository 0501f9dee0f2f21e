//! The soak's HTTP path: calls through [`IdempotencyLayer`] in front of an in-process tower
//! service whose handler sometimes outlives its lease, so only the layer's heartbeat keeps
//! the key.
//!
//! The request body is the same on every call for a key (it is fingerprinted); what the call
//! wants the handler to do travels in headers the fingerprint ignores: the call's value
//! (echoed as the response body), the fault (`none`; `error`: a 500 from a handler that acted,
//! which the layer stores and replays like a 200; `long`: a sleep of 2–4 leases), how long to
//! sleep, and whether to doom the completion.

use crate::faults::FaultRig;
use crate::faults::WorkFault;
use crate::model::Response as R;
use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotency_conformance::Fault;
use idempotency_core::{Idempotency, IdempotencyKey, RecordId, Scope};
use idempotency_tower::IDEMPOTENT_REPLAYED;
use idempotency_tower::{http_scope, IdempotencyLayer, RequestBody, IDEMPOTENCY_KEY};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tower::{Layer, ServiceExt};

const VALUE: &str = "x-soak-value";
const FAULT: &str = "x-soak-fault";
const SLEEP: &str = "x-soak-sleep-us";
const DOOM: &str = "x-soak-doom";
const HANDLER: &str = "x-soak-handler";
/// The route of every soak request.
pub const ROUTE: &str = "/ops";

/// The layer over an engine, and the handler's state.
#[derive(Debug)]
pub struct HttpPath {
    layer: IdempotencyLayer,
    state: Arc<HandlerState>,
}

#[derive(Debug)]
struct HandlerState {
    rig: Arc<FaultRig>,
    scope: Scope,
}

impl HttpPath {
    /// The layer over `engine`, with every call in the scope of `caller`.
    pub fn new(engine: impl Into<Idempotency>, rig: Arc<FaultRig>, caller: &str) -> Self {
        let scope = http_scope(caller, &http::Method::POST, ROUTE).expect("valid scope");
        let caller = caller.to_owned();
        let layer =
            IdempotencyLayer::per_caller(engine, move |_| Some(caller.clone())).required(true);
        Self {
            layer,
            state: Arc::new(HandlerState { rig, scope }),
        }
    }

    /// The scope of the layer's records.
    pub fn scope(&self) -> &Scope {
        &self.state.scope
    }

    /// One call for `key`: what the handler does if it runs is `fault`, for `sleep`.
    pub async fn call(
        &self,
        key: &IdempotencyKey,
        value: u64,
        fault: WorkFault,
        sleep: Duration,
        doom: Option<Fault>,
    ) -> (R, Option<String>, bool) {
        let state = self.state.clone();
        let service = self
            .layer
            .layer(tower::service_fn(move |req| handle(state.clone(), req)));
        let mut req = Request::post(ROUTE)
            .header(IDEMPOTENCY_KEY, key.as_str())
            .header(header::CONTENT_TYPE, "application/json")
            .header(VALUE, value)
            .header(
                FAULT,
                match fault {
                    WorkFault::Error => "error",
                    WorkFault::Long => "long",
                    _ => "none",
                },
            )
            .header(SLEEP, sleep.as_micros().to_string());
        if let Some(doom) = doom {
            req = req.header(
                DOOM,
                if doom == Fault::Refused {
                    "refused"
                } else {
                    "ack-lost"
                },
            );
        }
        let body = format!(r#"{{"key":"{}"}}"#, key.as_str());
        let req = req
            .body(Full::new(Bytes::from(body)))
            .expect("valid request");
        let Ok(resp) = service.oneshot(req).await;
        let (parts, body) = resp.into_parts();
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                return (
                    R::Unknown,
                    Some(format!("UNEXPECTED: body failed: {e}")),
                    false,
                )
            }
        };
        let text = String::from_utf8_lossy(&body).into_owned();
        let replayed = parts.headers.get(IDEMPOTENT_REPLAYED).is_some();
        match parts.status {
            // A handler's answer, whatever its status: stored and replayed.
            StatusCode::OK | StatusCode::INTERNAL_SERVER_ERROR => match text.parse::<u64>() {
                Ok(v) if replayed => (R::Replayed(v), None, false),
                Ok(v) if v == value => (R::Executed(v), None, false),
                _ => (
                    R::Unknown,
                    Some(format!(
                        "UNEXPECTED: {} with body {text:?} (replayed: {replayed}) for call {value}",
                        parts.status
                    )),
                    false,
                ),
            },
            StatusCode::CONFLICT => (R::InProgress, None, false),
            StatusCode::UNPROCESSABLE_ENTITY if text.contains("idempotency-key-outcome-lost") => {
                (R::FailedPermanently, None, false)
            }
            StatusCode::SERVICE_UNAVAILABLE => (R::Unknown, Some(format!("503: {text}")), true),
            status => (
                R::Unknown,
                Some(format!("UNEXPECTED: {status} {text}")),
                false,
            ),
        }
    }
}

async fn handle(
    state: Arc<HandlerState>,
    req: Request<RequestBody<Full<Bytes>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let value: u64 = header(VALUE).parse().expect("the soak sends a value");
    let sleep = Duration::from_micros(header(SLEEP).parse().expect("the soak sends a sleep"));
    let fault = header(FAULT);
    let key = IdempotencyKey::new(header(IDEMPOTENCY_KEY.as_str())).expect("valid key");
    let id = RecordId::new(key, state.scope.clone());
    // The layer claimed the key just before calling the handler: the last lease granted on
    // it is this handler's.
    let ledger = state.rig.ledger().clone();
    let token = ledger.latest_grant(&id).unwrap_or(0);
    match header(DOOM).as_str() {
        "refused" => state.rig.doom(id.clone(), token, Fault::Refused),
        "ack-lost" => state.rig.doom(id.clone(), token, Fault::AckLost),
        _ => {}
    }
    let guard = ledger.start(id, token, value, fault == "long");
    tokio::time::sleep(sleep).await;
    guard.finish(crate::ledger::ExecEnd::Ok);
    if fault == "error" {
        // It acted, then failed to answer: a 500, which the layer stores as the key's answer.
        let mut resp = Response::new(Full::new(Bytes::from(value.to_string())));
        *resp.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        resp.headers_mut()
            .insert(HANDLER, http::HeaderValue::from_static("error"));
        return Ok(resp);
    }
    Ok(Response::new(Full::new(Bytes::from(value.to_string()))))
}
