#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod batch;
mod builder;
mod decode;
mod error;
mod exactly_once;
mod idempotency;
mod kept;
mod names;
mod schema;
mod sql;
mod store;

pub use builder::{PostgresStoreBuilder, DEFAULT_RESPONSE_TIMEOUT};
pub use error::{database_error, PostgresError};
pub use exactly_once::PostgresTransaction;
pub use idempotency::PostgresIdempotency;
pub use names::{TableName, MAX_SCHEMA_NAME_LEN, MAX_TABLE_NAME_LEN};
pub use store::PostgresStore;

/// The driver, re-exported so your transactions and this store use the same sqlx.
pub use sqlx;

#[cfg(test)]
mod send_checks {
    use super::*;
    use idempotency_core::{FencingToken, IdempotencyKey, RecordId, Scope};

    fn assert_send<T: Send>(_: &T) {}

    /// The store's own futures can be spawned onto a multi-threaded runtime.
    #[allow(dead_code)]
    fn futures_are_send(store: PostgresStore, conn: &mut sqlx::PgConnection) {
        assert_send(&store.migrate());
        assert_send(&store.verify());
        assert_send(&PostgresStore::connect("postgres://x"));
        let id = RecordId::new(
            IdempotencyKey::new("k").expect("key"),
            Scope::new("s").expect("scope"),
        );
        let ttl = std::time::Duration::from_secs(1);
        assert_send(&store.complete_in(conn, &id, FencingToken(1), b"", ttl));
    }
}
