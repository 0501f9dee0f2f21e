//! The conformance suite and the Redis-specific cases against a 3-master Redis Cluster that
//! this binary starts on free loopback ports (shared by every case, stopped when the process
//! exits). Every case also asserts that no node ever answered CROSSSLOT.

mod support;

use idempotency_conformance::TestStore;
use support::scenarios;

async fn factory() -> TestStore {
    support::cluster().await.into_test_store()
}

idempotency_conformance::conformance_tests!(factory);

macro_rules! scenario_tests {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            support::run(support::cluster, scenarios::$name);
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
