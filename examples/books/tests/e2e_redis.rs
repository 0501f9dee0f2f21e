//! End to end against the books API over real HTTP, idempotency records in the real Redis
//! server (`IDEMPOTENCY_TEST_REDIS_URL`, default `redis://127.0.0.1:6379`;
//! `bash .ci/services` starts it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

const FORCED_STORE: Option<&str> = Some("redis");

include!("support/e2e_cases.rs");
