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
mod outcomes;
pub mod phases;
mod policy;
mod record;
mod scope;
pub mod store;
mod time;
pub mod transaction;

pub use answer::{Answer, Refusal};
pub use completer::{Completer, CompleterRound, CompleterStats};
pub use engine::{
    BatchMessage, BatchReport, Idempotency, IdempotencyBuilder, MessageOutcome, MessageReport,
    WorkContext,
};
pub use error::{Error, Operation};
pub use fingerprint::{
    canonical_json, canonical_json_slice, is_json_media_type, Fingerprint, FingerprintBuilder,
};
pub use key::{IdempotencyKey, KeyError};
pub use maintenance::{
    Maintain, Maintenance, PurgeStats, DEFAULT_PURGE_BATCH, DEFAULT_PURGE_EVERY,
};
pub use observe::{loggable_key, Event};
pub use outcomes::{ErrorMode, ErrorOutcomes, ReleaseErrors, StoreErrors};
pub use phases::{PhaseContext, Phases};
pub use policy::{InFlight, Policy, SettleRetry};
pub use record::{FencingToken, RecordId};
pub use scope::{Scope, ScopeError};
pub use store::IdempotencyStore;
pub use transaction::TransactionalStore;

// What moved into `store` and `protocol`, under its short name inside the crate.
pub(crate) use decision::{decide, Decision, DecisionOptions};
pub(crate) use engine::{Begin, Lease};
pub(crate) use outcomes::Settling;
pub(crate) use phases::RecoveryPoints;
pub(crate) use record::{Cas, Claim, ClaimRequest, Failure, Reclaim, Record, RecordStatus};
pub(crate) use store::{Settle, Settlement};
pub(crate) use time::Timestamp;

/// The manual protocol, for callers who drive a claim themselves instead of handing the
/// engine a closure: [`Idempotency::begin`] answers a [`Begin`]; a [`Begin::Execute`] holds a
/// [`Lease`], which the caller settles (complete, fail, release) when the work ends, and a
/// [`Begin::Replay`] holds the stored [`Record`], read back with
/// [`decode_replay`](protocol::decode_replay). The engine's `run`, `run_in_transaction`,
/// `run_phases` and `run_batch`, and the HTTP layer, do all of this for you; use it when none
/// of them fits (the completion written in a transaction of your own, say, as the SQL stores'
/// `complete_in` allows).
pub mod protocol {
    pub use crate::engine::{decode_replay, Begin, Disposition, Lease};
    pub use crate::record::{Failure, FencingToken, Record, RecordId, RecordStatus};
    pub use crate::transaction::{encode_outcome, SharedClaim, TransactionEnd};
}
