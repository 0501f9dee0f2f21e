//! The runners of the exactly-once paths, one per SQL store, shared by the test binaries (each
//! uses the ones it needs).
#![allow(dead_code)]

pub(crate) mod mysql;
pub(crate) mod postgres;
pub(crate) mod sqlite;
