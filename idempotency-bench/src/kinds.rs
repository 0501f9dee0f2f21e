//! The backends the bench knows: one line per store in [`KINDS`]. A store's module says, as
//! its [`Kind`], how to build its measured backends and, when it is measured at scale, a
//! filled store.

use crate::harness::Kind;
use crate::{dynamodb, memory, mysql, postgres, redis, sqlite};

/// Every backend, in the order `all` runs them.
pub(crate) const KINDS: &[Kind] = &[
    memory::KIND,
    sqlite::KIND,
    postgres::KIND,
    mysql::KIND,
    redis::KIND,
    dynamodb::KIND,
];

/// The backend named `name`.
pub(crate) fn find(name: &str) -> Option<&'static Kind> {
    KINDS.iter().find(|k| k.name == name)
}

/// The names, for messages: `memory, sqlite, …`.
pub(crate) fn names() -> String {
    KINDS.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
}
