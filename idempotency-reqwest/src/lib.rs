#![doc = include_str!("../README.md")]

mod error;
mod key;
mod mark;
mod middleware;
mod outcome;
mod policy;

pub use error::{Error, LastFailure, Problem};
pub use key::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
pub use mark::{Idempotent, IdempotentRequestExt};
pub use middleware::IdempotencyMiddleware;
pub use outcome::{IdempotencyOutcome, IdempotentResponseExt};
pub use policy::{GiveUpReason, RetryLimits, RetryPolicy};

/// The key type, shared with the server half: the same rules (1 to 255 bytes, no control
/// characters) and the same [`IdempotencyKey::derive`].
pub use idempotency_core::{IdempotencyKey, KeyError};
/// The middleware stack this crate plugs into.
pub use reqwest_middleware;
/// How the backoff between attempts is randomised (see [`RetryPolicy::jitter`]).
pub use retry_policies::Jitter;
