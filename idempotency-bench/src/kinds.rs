//! The backends the bench knows: one line per store in [`KINDS`]. A store's module says how
//! to build its measured backends and, when it is measured at scale, a filled store.

use crate::{memory, postgres, redis, sqlite};
use futures::future::BoxFuture;
use idempotency_core::{BoxError, IdempotencyStore};
use std::any::Any;
use std::sync::Arc;

/// A backend to measure, with whatever must live as long as it (a temp dir, a schema).
pub(crate) type Prepared = (crate::harness::Backend, Box<dyn Any>);

/// A store filled with live keys, with whatever must live as long as it.
pub(crate) type Filled = (Arc<dyn IdempotencyStore>, Box<dyn Any>);

/// What one store adds to the bench.
pub(crate) struct Kind {
    /// The name `--backend` takes.
    pub(crate) name: &'static str,
    /// Its measured backends (a store may be measured in several modes), given the most
    /// clients any measurement runs.
    pub(crate) make: fn(usize) -> BoxFuture<'static, Result<Vec<Prepared>, BoxError>>,
    /// How it is measured as the number of live keys grows, if it is.
    pub(crate) scaling: Option<Scaling>,
}

/// The scaling table of one store.
pub(crate) struct Scaling {
    /// The largest number of live keys it is measured at.
    pub(crate) max_keys: usize,
    /// A store holding `n` completed records keyed as the harness's `key("fill", 0, i)`.
    pub(crate) filled: fn(usize) -> BoxFuture<'static, Result<Filled, BoxError>>,
    /// Whether the process's resident memory per record is its memory per record.
    pub(crate) in_process_memory: bool,
}

/// Every backend, in the order `all` runs them.
pub(crate) const KINDS: &[Kind] = &[memory::KIND, sqlite::KIND, postgres::KIND, redis::KIND];

/// The backend named `name`.
pub(crate) fn find(name: &str) -> Option<&'static Kind> {
    KINDS.iter().find(|k| k.name == name)
}

/// The names, for messages: `memory, sqlite, …`.
pub(crate) fn names() -> String {
    KINDS.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
}
