//! End to end against the books API over real HTTP, the idempotency records and the books in
//! the local DynamoDB stand-in (`IDEMPOTENCY_TEST_DYNAMODB_URL`, default
//! `http://127.0.0.1:8000`; `bash .ci/services` starts it). Each service has tables of its
//! own, deleted afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used)]

const FORCED_STORE: Option<&str> = Some("dynamodb");

include!("support/e2e_cases.rs");
