//! End to end against the books API over real HTTP, the idempotency records and the books in
//! the real MariaDB server (`MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`;
//! `bash .ci/services` starts it). Each service has tables of its own, dropped afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used)]

const FORCED_STORE: Option<&str> = Some("mysql");

include!("support/e2e_cases.rs");
