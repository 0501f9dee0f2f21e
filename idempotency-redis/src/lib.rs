#![doc = include_str!("../README.md")]

mod builder;
mod decode;
mod error;
mod keys;
mod scripts;
mod sentinel;
mod store;

pub use builder::{
    RedisStoreBuilder, DEFAULT_EXPIRED_RETENTION, DEFAULT_PREFIX, DEFAULT_RESPONSE_TIMEOUT,
};
pub use error::NotAcknowledged;
pub use keys::MAX_PREFIX_LEN;
/// The Redis driver this store is built on, re-exported so callers use the same version.
pub use redis;
pub use store::RedisStore;

/// The pure decoders of script replies and stored records, for the fuzz targets and the
/// bad-input tests: built only with the `fuzzing` feature. Not part of the API: they may change
/// at any time.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod __fuzz {
    use idempotency_core::store::{Cas, Claim, Reclaim, Record};
    use idempotency_core::{Error, RecordId};
    use redis::Value;

    /// Decodes a stored record (the bytes at its key).
    pub fn decode_record(id: &RecordId, bytes: &[u8]) -> Result<Record, Error> {
        crate::decode::decode_record(id, bytes)
    }

    /// Encodes a record as the scripts store it.
    pub fn encode_record(record: &Record) -> Vec<u8> {
        crate::decode::encode_record(record)
    }

    /// Decodes the claim script's reply.
    pub fn claim_reply(value: Value, id: &RecordId) -> Result<Claim, Error> {
        crate::decode::claim_reply(value, id)
    }

    /// Decodes the reclaim script's reply.
    pub fn reclaim_reply(value: Value) -> Result<Reclaim, Error> {
        crate::decode::reclaim_reply(value)
    }

    /// Decodes the get script's reply.
    pub fn get_reply(value: Value, id: &RecordId) -> Result<Option<Record>, Error> {
        crate::decode::get_reply(value, id)
    }

    /// Decodes the reply of the complete, fail and extend scripts.
    pub fn cas_reply(value: Value) -> Result<Cas, Error> {
        crate::decode::cas_reply(value, "complete")
    }
}
