#![doc = include_str!("../README.md")]

pub mod checker;
pub mod faults;
pub mod http;
pub mod ledger;
pub mod model;
pub mod soak;
pub mod storm;
