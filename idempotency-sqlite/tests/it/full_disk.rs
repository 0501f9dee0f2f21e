//! A database that runs out of space, or becomes read-only, mid-run: every write it refuses
//! is a typed error that says so, nothing already stored is lost, no completion is reported
//! that was not written, and the store works again once the space (or write access) returns.
//! `PRAGMA max_page_count` and `PRAGMA query_only` on the store's connection make both
//! happen on demand.
#![allow(clippy::unwrap_used)]

use crate::common;

use idempotency_core::store::{Cas, Claim, RecordStatus};
use idempotency_core::{FencingToken, IdempotencyStore, RecordId};
use idempotency_sqlite::{ConnectionMode, SqliteError, SqliteStore};
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);

async fn pragma(store: &SqliteStore, name: &'static str, value: i64) {
    store
        .call(move |c| c.pragma_update(None, name, value))
        .await
        .unwrap()
        .unwrap();
}

/// Claims and completes keys with 3 KB outcomes until a write is refused; returns the error,
/// the keys completed before it, and the key whose completion was refused (if it was the
/// completion, not the claim).
async fn fill_until_refused(
    store: &SqliteStore,
    outcome: &[u8],
) -> (
    idempotency_core::Error,
    Vec<RecordId>,
    Option<(RecordId, FencingToken)>,
    RecordId,
) {
    let mut completed = Vec::new();
    for _ in 0..100_000 {
        let id = common::id("full");
        let token = match store.claim(&common::req(&id, b"p", LEASE, TTL)).await {
            Ok(Claim::Claimed { token, .. }) => token,
            Ok(other) => panic!("a fresh key was found: {other:?}"),
            Err(e) => return (e, completed, None, id),
        };
        match store.complete(&id, token, outcome, TTL).await {
            Ok(Cas::Applied) => completed.push(id),
            Ok(Cas::Fenced) => panic!("the holder's completion was fenced"),
            Err(e) => return (e, completed, Some((id.clone(), token)), id),
        }
    }
    panic!("the database never filled up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_a_typed_error_loses_nothing_and_recovers() {
    let (store, _clock, _dir) = common::manual_store(ConnectionMode::DedicatedThread).await;
    let pages: i64 = store
        .call(|c| c.query_row("PRAGMA page_count", [], |r| r.get(0)))
        .await
        .unwrap()
        .unwrap();
    pragma(&store, "max_page_count", pages + 16).await;
    let outcome = vec![7u8; 3000];
    let (full, completed, refused, last) = fill_until_refused(&store, &outcome).await;
    assert!(!completed.is_empty(), "nothing fitted: {full}");
    assert!(
        matches!(SqliteError::find(&full), Some(SqliteError::DiskFull { .. })),
        "a typed error: {full:?}"
    );
    assert!(full.to_string().contains("full"), "{full}");
    // Nothing already stored is lost.
    for id in &completed {
        let r = store.get(id).await.unwrap().expect("a completed record");
        assert_eq!(r.status, RecordStatus::Completed);
        assert_eq!(r.outcome.as_deref(), Some(&outcome[..]));
    }
    // The refused write left nothing half-written: a refused completion leaves its holder's
    // Pending record, a refused claim no record.
    match &refused {
        Some((id, token)) => {
            let r = store.get(id).await.unwrap().expect("the claim was stored");
            assert_eq!((r.status, r.token), (RecordStatus::Pending, *token));
        }
        None => assert!(store.get(&last).await.unwrap().is_none()),
    }
    // Space returns: the refused completion goes through, and new keys are claimed.
    pragma(&store, "max_page_count", 1 << 30).await;
    if let Some((id, token)) = refused {
        assert_eq!(
            store.complete(&id, token, &outcome, TTL).await.unwrap(),
            Cas::Applied
        );
    }
    let id = common::id("after");
    let Claim::Claimed { token, .. } = store
        .claim(&common::req(&id, b"p", LEASE, TTL))
        .await
        .unwrap()
    else {
        panic!("a fresh key was found");
    };
    assert_eq!(
        store.complete(&id, token, &outcome, TTL).await.unwrap(),
        Cas::Applied
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_database_is_a_typed_error_serves_reads_and_recovers() {
    let (store, _clock, _dir) = common::manual_store(ConnectionMode::DedicatedThread).await;
    let outcome = b"stored".to_vec();
    let kept = common::id("kept");
    let Claim::Claimed { token, .. } = store
        .claim(&common::req(&kept, b"p", LEASE, TTL))
        .await
        .unwrap()
    else {
        panic!("a fresh key was found");
    };
    let pending = common::id("pending");
    let Claim::Claimed {
        token: pending_token,
        ..
    } = store
        .claim(&common::req(&pending, b"p", LEASE, TTL))
        .await
        .unwrap()
    else {
        panic!("a fresh key was found");
    };
    assert_eq!(
        store.complete(&kept, token, &outcome, TTL).await.unwrap(),
        Cas::Applied
    );
    pragma(&store, "query_only", 1).await;
    let refused = store
        .complete(&pending, pending_token, &outcome, TTL)
        .await
        .unwrap_err();
    assert!(
        matches!(
            SqliteError::find(&refused),
            Some(SqliteError::ReadOnly { .. })
        ),
        "a typed error: {refused:?}"
    );
    let fresh = common::id("fresh");
    let claim = store
        .claim(&common::req(&fresh, b"p", LEASE, TTL))
        .await
        .unwrap_err();
    assert!(
        matches!(
            SqliteError::find(&claim),
            Some(SqliteError::ReadOnly { .. })
        ),
        "a typed error: {claim:?}"
    );
    // Reads still answer, and nothing was lost or half-written.
    let r = store.get(&kept).await.unwrap().unwrap();
    assert_eq!(
        (r.status, r.outcome),
        (RecordStatus::Completed, Some(outcome.clone()))
    );
    let r = store.get(&pending).await.unwrap().unwrap();
    assert_eq!((r.status, r.token), (RecordStatus::Pending, pending_token));
    assert!(store.get(&fresh).await.unwrap().is_none());
    // Write access returns.
    pragma(&store, "query_only", 0).await;
    assert_eq!(
        store
            .complete(&pending, pending_token, &outcome, TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
}
