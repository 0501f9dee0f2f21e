//! End to end against the books API over real HTTP, idempotency records in SQLite (the
//! service's default) or the store `BOOKS_TEST_STORE` names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

const FORCED_STORE: Option<&str> = None;

include!("support/e2e_cases.rs");
