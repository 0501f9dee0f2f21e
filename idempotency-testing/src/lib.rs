#![doc = include_str!("../README.md")]

pub mod pg_wire;
