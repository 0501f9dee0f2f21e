//! The conformance suite and the Redis-specific cases against a 3-master Redis Cluster that
//! this binary starts on free loopback ports (shared by every case, stopped when the process
//! exits). Every case also asserts that no node ever answered CROSSSLOT.

use crate::support;

use idempotency_conformance::TestStore;
use support::scenarios;

async fn factory() -> TestStore {
    support::cluster().await.into_test_store()
}

// Redis expires records by itself: purge has nothing to count.
idempotency_conformance::conformance_tests!(factory, purge_reports_deletions = false);

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

/// The cases above only prove cluster-safety if records land on different nodes: 60 records
/// must reach every primary (each node's SCAN finds some), each readable through the cluster
/// client.
async fn records_spread_over_every_primary(h: support::Harness) {
    use idempotency_core::store::{Claim, ClaimRequest};
    use idempotency_core::{Fingerprint, IdempotencyStore};
    use std::time::Duration;

    let ids: Vec<_> = (0..60)
        .map(|_| idempotency_conformance::cases::unique_id("spread"))
        .collect();
    for id in &ids {
        let req = ClaimRequest::new(
            id.clone(),
            Fingerprint::from_bytes(b"x"),
            Duration::from_secs(60),
            Duration::from_secs(60),
        );
        assert!(matches!(
            h.store.claim(&req).await.expect("claim"),
            Claim::Claimed { .. }
        ));
    }
    for node in h.topology.nodes() {
        let mut con = redis::Client::open(node.as_str())
            .and_then(|c| c.get_connection())
            .expect("connect to a node");
        // SCAN lists only the keys this node holds.
        let pattern = format!("{}*", h.store.prefix());
        let here = redis::Commands::scan_match::<_, String>(&mut con, &pattern)
            .expect("SCAN")
            .count();
        assert!(here > 0, "no record landed on {node}");
    }
    for id in &ids {
        assert!(h.store.get(id).await.expect("get").is_some());
    }
}

#[test]
fn records_reach_every_primary() {
    support::run(support::cluster, records_spread_over_every_primary);
}
