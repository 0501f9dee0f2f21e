#![doc = include_str!("../README.md")]

mod claim;
mod key;
mod layer;
mod problem;
mod service;
mod stored;

#[cfg(feature = "axum")]
pub use claim::NoClaim;
pub use claim::{ClaimedKey, PrepareError, Prepared};
pub use key::{read_key, KeyHeaderError, IDEMPOTENCY_KEY};
pub use layer::{default_store_status, IdempotencyLayer, DEFAULT_REPLAYED, NEVER_REPLAYED};
pub use problem::{retry_after_secs, ProblemJson, Refusal, RefusalResponder, PROBLEM_JSON};
pub use service::{http_scope, HttpDecision, IdempotencyService, IDEMPOTENT_REPLAYED};
pub use stored::{DecodeError, StoredResponse};

/// The request body the wrapped service receives: the buffered body of a covered request
/// (`Left`), or the original body of a request that passed through (`Right`).
pub type RequestBody<B> = http_body_util::Either<http_body_util::Full<bytes::Bytes>, B>;

/// The response body the layer returns: a stored, replayed or refusal body (`Left`), or the
/// handler's own body when it was not buffered (`Right`).
pub type ResponseBody<B> = http_body_util::Either<http_body_util::Full<bytes::Bytes>, B>;
