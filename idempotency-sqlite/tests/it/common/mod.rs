//! Helpers shared by the integration tests.
#![allow(dead_code)]

use idempotency_core::store::{ClaimRequest, ManualClock};
use idempotency_core::{Fingerprint, IdempotencyKey, RecordId, Scope};
use idempotency_sqlite::{ConnectionMode, SqliteStore};
use std::sync::Arc;
use std::time::Duration;

/// A migrated store on a manual clock in its own temp dir (kept alive by the returned guard).
pub(crate) async fn manual_store(
    mode: ConnectionMode,
) -> (SqliteStore, ManualClock, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = ManualClock::new();
    let store = SqliteStore::builder(dir.path().join("test.db"))
        .clock(Arc::new(clock.clone()))
        .mode(mode)
        .open()
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    (store, clock, dir)
}

pub(crate) fn id(label: &str) -> RecordId {
    RecordId::new(
        IdempotencyKey::random(),
        Scope::from_parts(["sqlite-tests", label]).expect("scope"),
    )
}

pub(crate) fn req(id: &RecordId, payload: &[u8], lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest::new(id.clone(), Fingerprint::from_bytes(payload), lease, ttl)
}
