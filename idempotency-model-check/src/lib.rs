#![doc = include_str!("../README.md")]

mod model;
pub mod phases;
mod run;
mod world;

pub use model::*;
pub use run::{check, Report};
pub use world::{ClientSpec, Mode, Variant, World, CLIENTS_ENV, TICK, TICKS_ENV};
