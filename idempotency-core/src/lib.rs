#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod answer;
mod completer;
mod decision;
mod engine;
mod error;
mod fingerprint;
#[cfg(feature = "http")]
pub mod http;
mod key;
mod maintenance;
mod observe;
pub mod phases;
mod policy;
mod record;
mod scope;
mod store;
mod time;
pub mod transaction;

pub use answer::{Answer, Refusal};
pub use completer::{Completer, CompleterRound, CompleterStats};
pub use decision::{decide, Decision, DecisionOptions};
pub use engine::{
    decode_replay, BatchMessage, BatchReport, Begin, Disposition, Idempotency, IdempotencyBuilder,
    Lease, MessageOutcome, MessageReport, WorkContext,
};
pub use error::{BoxError, Error, Operation, StoreCall};
pub use fingerprint::{
    canonical_json, canonical_json_slice, is_json_media_type, Fingerprint, FingerprintBuilder,
};
pub use key::{IdempotencyKey, KeyError};
pub use maintenance::{
    Maintain, Maintenance, PurgeStats, DEFAULT_PURGE_BATCH, DEFAULT_PURGE_EVERY,
};
pub use observe::{loggable_key, Event};
pub use phases::{
    phase_key, Abandoned, AbandonedQuery, PhaseContext, Phases, RecoveryPoint, RecoveryPoints,
};
pub use policy::{ErrorOutcomes, InFlight, Policy, SettleRetry};
pub use record::{
    claim_retention, Cas, Claim, ClaimRequest, Failure, FencingToken, Reclaim, Record, RecordId,
    RecordStatus,
};
pub use scope::{Scope, ScopeError};
pub use store::{IdempotencyStore, Settle, Settlement};
pub use time::{duration_millis, Clock, ManualClock, SystemClock, Timestamp, MAX_DURATION};
pub use transaction::{
    encode_outcome, Begun, CommitError, SharedClaim, TransactionEnd, TransactionalStore,
    MAX_TRANSACTION_ATTEMPTS,
};

/// Re-exported so store implementations use the same `async_trait` as the trait.
pub use async_trait::async_trait;
