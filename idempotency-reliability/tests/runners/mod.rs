//! The runners of the exactly-once paths, one per SQL store, shared by the test binaries (each
//! uses the ones it needs).
#![allow(dead_code)]

pub mod postgres;
pub mod sqlite;
