//! Reading the `Idempotency-Key` header: the reader is `idempotency-core`'s (feature `http`),
//! which the client half shares.

pub use idempotency_core::http::{read_key, read_key_header, KeyHeaderError};
