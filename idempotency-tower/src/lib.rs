#![doc = include_str!("../README.md")]

mod body;
mod claim;
mod config;
mod detach;
mod fingerprint;
mod future;
mod headers;
mod hooks;
mod key;
mod layer;
mod observe;
mod problem;
mod request_key;
mod service;
mod stored;

pub use body::{RequestBody, ResponseBody};
#[cfg(feature = "axum")]
pub use claim::NoClaim;
pub use claim::{ClaimedKey, NothingDone, PrepareError, Prepared};
pub use config::{default_store_status, OnUnreplayable, OnUnstored, RoutePart};
pub use fingerprint::{normalize_media_type, FingerprintInput};
pub use future::ResponseFuture;
pub use headers::{
    DEFAULT_FINGERPRINT_HEADERS, DEFAULT_REPLAYED, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED,
    NEVER_REPLAYED,
};
pub use hooks::ResponseContext;
pub use key::{read_key, read_key_header, KeyHeaderError};
pub use layer::IdempotencyLayer;
pub use observe::{HttpDecision, HttpOutcome};
pub use problem::{retry_after_secs, ProblemJson, Refusal, RefusalResponder, PROBLEM_JSON};
#[cfg(feature = "axum")]
pub use request_key::NoRequestKey;
pub use request_key::RequestKey;
pub use service::{http_scope, IdempotencyService};
pub use stored::{DecodeError, NotReplayable, StoredResponse};
