#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

pub use idempotency_core::*;

#[cfg(feature = "memory")]
pub use idempotency_memory::MemoryStore;

/// The SQLite store (feature `sqlite`): [`sqlite::SqliteStore`], and
/// [`sqlite::SqliteIdempotency`] for exactly-once work in your transaction.
#[cfg(feature = "sqlite")]
pub use idempotency_sqlite as sqlite;

/// The Postgres store (feature `postgres`): [`postgres::PostgresStore`], and
/// [`postgres::PostgresIdempotency`] for exactly-once work in your transaction.
#[cfg(feature = "postgres")]
pub use idempotency_postgres as postgres;

/// The MySQL/MariaDB store (feature `mysql`): [`mysql::MySqlStore`], and
/// [`mysql::MySqlIdempotency`] for exactly-once work in your transaction.
#[cfg(feature = "mysql")]
pub use idempotency_mysql as mysql;

/// The Redis store (feature `redis`): [`redis::RedisStore`] on a server, a Cluster or
/// Sentinel.
#[cfg(feature = "redis")]
pub use idempotency_redis as redis;

/// The DynamoDB store (feature `dynamodb`): [`dynamodb::DynamoStore`].
#[cfg(feature = "dynamodb")]
pub use idempotency_dynamodb as dynamodb;

/// The replay cache (feature `cache`): completed records answered from memory until they
/// expire, in front of any store.
#[cfg(feature = "cache")]
pub use idempotency_cache::{ReplayCache, ReplayCacheBuilder};

/// The HTTP server layer (feature `tower`, or `axum` for axum's extractor and route
/// templates): [`tower::IdempotencyLayer`].
#[cfg(feature = "tower")]
pub use idempotency_tower as tower;

/// The HTTP client half (feature `reqwest`): [`reqwest::IdempotencyMiddleware`].
#[cfg(feature = "reqwest")]
pub use idempotency_reqwest as reqwest;

/// The workspace README's examples (the quickstart and every path of "Pick your path"),
/// compiled and run as doctests of this crate, which has every feature in its tests, so that
/// they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct WorkspaceReadme;
