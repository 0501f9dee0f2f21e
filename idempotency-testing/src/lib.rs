#![doc = include_str!("../README.md")]

pub mod partition;
pub mod payloads;
pub mod pg_wire;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis_server;
#[cfg(feature = "sqlite")]
pub mod sqlite;
