//! The HTTP suite against the Redis store on the real server (`IDEMPOTENCY_TEST_REDIS_URL`,
//! default `redis://127.0.0.1:6379`). Each case gets a key prefix of its own, deleted
//! afterwards.

use idempotency_conformance::{Capabilities, TestStore};
use idempotency_redis::RedisStore;
use idempotency_testing::redis_server::{redis_url, unique_prefix, unreachable_server, Cleanup};
use std::sync::Arc;

async fn factory() -> TestStore {
    let (url, prefix) = (redis_url(), unique_prefix());
    let store = RedisStore::builder()
        .prefix(prefix.clone())
        .connect(url.as_str())
        .await
        .unwrap_or_else(|e| unreachable_server(&url, &e));
    TestStore::real_time(Arc::new(store))
        .with_capabilities(Capabilities::default().purge_reports_deletions(false))
        .with_guard(Cleanup {
            nodes: vec![url],
            prefix,
            check_crossslot: false,
        })
}

idempotency_http_conformance::http_conformance_tests!(factory);
