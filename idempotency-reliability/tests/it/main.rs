//! The reliability campaign: each file a concern (a store's faults, a failover, a soak), all in
//! one binary so that their tests run side by side (`cargo test -p idempotency-reliability
//! --features campaign --test it MODULE` runs one).

mod dynamodb_faults;
mod mysql_failover;
mod mysql_faults;
mod partition_soak;
mod postgres_failover;
mod postgres_faults;
mod redis_faults;
mod runners;
mod settle_faults;
mod soak;
mod sqlite_faults;
