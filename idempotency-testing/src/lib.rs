#![doc = include_str!("../README.md")]

#[cfg(feature = "mysql")]
pub mod mariadb_server;
#[cfg(feature = "mysql")]
pub mod mysql;
pub mod mysql_wire;
pub mod partition;
pub mod payloads;
#[cfg(feature = "postgres")]
pub mod pg_server;
pub mod pg_wire;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis_server;
#[cfg(feature = "sqlite")]
pub mod sqlite;
