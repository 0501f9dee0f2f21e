//! The conformance suite and the Redis-specific cases against the standalone server at
//! `$IDEMPOTENCY_TEST_REDIS_URL` (default `redis://127.0.0.1:6379`).

use crate::support;

use idempotency_conformance::TestStore;
use support::scenarios;

async fn factory() -> TestStore {
    support::standalone().await.into_test_store()
}

// Redis expires records by itself: purge has nothing to count.
idempotency_conformance::conformance_tests!(factory, purge_reports_deletions = false);

/// The suite again with the replay cache in front.
mod replay_cache {
    async fn factory() -> idempotency_conformance::TestStore {
        let mut t = super::factory().await;
        t.store = std::sync::Arc::new(idempotency_cache::ReplayCache::new(t.store));
        t
    }
    idempotency_conformance::conformance_tests!(factory, purge_reports_deletions = false);
}

macro_rules! scenario_tests {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            support::run(support::standalone, scenarios::$name);
        }
    )*};
}

scenario_tests!(
    ttl_after_every_operation,
    script_flush_mid_run,
    corrupt_data_is_a_typed_error,
    hostile_ids_stay_apart,
    concurrent_reclaims_one_winner,
);
