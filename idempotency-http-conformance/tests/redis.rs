//! The HTTP suite against the Redis store on the real server (`IDEMPOTENCY_TEST_REDIS_URL`,
//! default `redis://127.0.0.1:6379`). Each case gets a key prefix of its own, deleted
//! afterwards.

use idempotency_conformance::{Capabilities, TestStore};
use idempotency_redis::redis;
use idempotency_redis::RedisStore;
use std::sync::Arc;

fn url() -> String {
    std::env::var("IDEMPOTENCY_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Deletes every key under its prefix when dropped.
struct PrefixGuard(String);

impl Drop for PrefixGuard {
    fn drop(&mut self) {
        let Ok(mut con) = redis::Client::open(url()).and_then(|c| c.get_connection()) else {
            return;
        };
        let keys: Vec<String> = redis::Commands::scan_match(&mut con, format!("{}*", self.0))
            .map(|iter| iter.collect())
            .unwrap_or_default();
        for key in keys {
            let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(key).query(&mut con);
        }
    }
}

async fn factory() -> TestStore {
    let prefix = format!("idem-http-test:{}:", uuid::Uuid::new_v4().simple());
    let store = RedisStore::connect(url())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach Redis at {} ({e}). Start it with `bash .ci/services` (Redis on \
                 127.0.0.1:6379), or point IDEMPOTENCY_TEST_REDIS_URL at a running server.",
                url()
            )
        })
        .with_prefix(prefix.clone())
        .expect("valid prefix");
    TestStore::real_time(Arc::new(store))
        .with_capabilities(Capabilities::default().purge_reports_deletions(false))
        .with_guard(PrefixGuard(prefix))
}

idempotency_http_conformance::http_conformance_tests!(factory);
