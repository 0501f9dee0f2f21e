//! End to end against the books API over real HTTP, idempotency records in the real Postgres
//! server (`IDEMPOTENCY_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`;
//! `bash .ci/services` starts it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

const FORCED_STORE: Option<&str> = Some("postgres");

include!("support/e2e_cases.rs");
