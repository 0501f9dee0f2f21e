//! How driver errors become core errors: whether a script may have run decides between a
//! retryable error and an unknown outcome.

use idempotency_core::Error;
use redis::{ErrorKind, RedisError};

pub(crate) fn config_error(e: RedisError) -> Error {
    Error::Config(format!("invalid Redis connection settings: {e}"))
}

pub(crate) fn connect_error(e: RedisError) -> Error {
    Error::backend(true, e)
}

/// Classifies a failed call. A request that may have reached the server before the
/// connection failed is [`Error::OutcomeUnknown`]: the script may have run. Errors the server
/// sent back mean the script did not run (the scripts validate before writing).
pub(crate) fn call_error(e: RedisError) -> Error {
    if e.is_connection_refusal() {
        return Error::backend(true, e);
    }
    match e.kind() {
        ErrorKind::IoError => Error::OutcomeUnknown {
            source: Box::new(e),
        },
        ErrorKind::BusyLoadingError
        | ErrorKind::TryAgain
        | ErrorKind::ClusterDown
        | ErrorKind::MasterDown
        | ErrorKind::ReadOnly
        | ErrorKind::Moved
        | ErrorKind::Ask
        | ErrorKind::ClusterConnectionNotFound => Error::backend(true, e),
        _ => Error::backend(false, e),
    }
}

/// Read-only calls can be repeated whatever happened, so an unknown outcome is just a
/// retryable failure.
pub(crate) fn read_error(e: Error) -> Error {
    match e {
        Error::OutcomeUnknown { source } => Error::Backend {
            retryable: true,
            source,
        },
        other => other,
    }
}

/// A write (or a read: what it saw) fewer replicas acknowledged than
/// [`RedisStoreBuilder::wait_for_replicas`](crate::RedisStoreBuilder::wait_for_replicas)
/// asks for, within its timeout: the primary has it, but a failover may lose it, so it is
/// not trusted. The source of the [`Error::Backend`] or [`Error::OutcomeUnknown`] the
/// call returns; find it with [`Error::find_source`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{operation}: {acknowledged} of the {wanted} replicas asked for caught up with it \
     within {timeout:?}, so it is not trusted"
)]
pub struct NotAcknowledged {
    /// The store operation (`claim`, `complete`, …).
    pub operation: &'static str,
    /// The replicas asked for.
    pub wanted: u32,
    /// The replicas that acknowledged in time.
    pub acknowledged: u32,
    /// How long the store waited.
    pub timeout: std::time::Duration,
}
