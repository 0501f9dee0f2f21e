//! The runners of the exactly-once paths, one per SQL store, shared by the campaign's modules.

pub(crate) mod mysql;
pub(crate) mod postgres;
pub(crate) mod sqlite;
