//! The kit tests itself: deliberately broken stores, each with one bug that real stores have
//! shipped, must fail the suite, and the reference memory store must pass all of it.
//!
//! Each broken store wraps a correct `MemoryStore` and breaks one primitive.

use idempotency_conformance::{all_cases, run_case, CaseFn, TestStore};
use idempotency_core::{
    async_trait, Cas, Claim, ClaimRequest, Error, Failure, FencingToken, Fingerprint,
    IdempotencyStore, ManualClock, Reclaim, Record, RecordId, RecordStatus,
};
use idempotency_memory::MemoryStore;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// Claim reads, yields, then inserts: two callers can both see "absent" and both win
    /// (seed 004's "narrow race").
    CheckThenInsertClaim,
    /// Complete writes whatever token the record holds now: a fenced holder overwrites the
    /// new holder's record.
    CompleteIgnoresToken,
    /// Reclaim compares against the token it reads itself, not the caller's: a stale snapshot
    /// takes a record that moved on (Powertools typescript#5714).
    ReclaimIgnoresExpected,
    /// Claim overwrites an in-flight record, like a `SETEX` (idempot-js #182).
    ClaimOverwritesInFlight,
    /// Complete keeps the record forever, ignoring the retention (a write without `EXPIRE`,
    /// Powertools #1181).
    CompleteWithoutExpiry,
    /// Fail reports success but writes nothing: the key is never released.
    FailWritesNothing,
    /// Extend reports success but does not move the lease: heartbeats keep nothing alive.
    ExtendWritesNothing,
}

#[derive(Debug)]
struct Broken {
    inner: MemoryStore,
    bug: Bug,
}

impl Broken {
    async fn current(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.inner.get(id).await
    }
}

#[async_trait]
impl IdempotencyStore for Broken {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        match self.bug {
            Bug::CheckThenInsertClaim => {
                let seen = self.current(&request.id).await?;
                // The gap between the check and the insert.
                tokio::task::yield_now().await;
                tokio::task::yield_now().await;
                match (seen, self.inner.claim(request).await?) {
                    // "INSERT OR REPLACE" after seeing nothing: reports a win either way.
                    (None, Claim::Existing { record, .. }) => Ok(Claim::Claimed {
                        token: record.token,
                        lease_until: record.lease_until.unwrap_or(record.expires_at),
                    }),
                    (_, claim) => Ok(claim),
                }
            }
            Bug::ClaimOverwritesInFlight => match self.inner.claim(request).await? {
                Claim::Existing { record, now } if record.status == RecordStatus::Pending => {
                    // Overwrite: release and retake the key whatever its lease says.
                    self.inner
                        .fail(&request.id, record.token, &Failure::default(), request.ttl)
                        .await?;
                    match self
                        .inner
                        .reclaim(
                            &request.id,
                            record.token,
                            &request.fingerprint,
                            request.lease,
                            request.ttl,
                        )
                        .await?
                    {
                        Reclaim::Reclaimed { token, lease_until } => {
                            Ok(Claim::Claimed { token, lease_until })
                        }
                        Reclaim::Lost => Ok(Claim::Existing { record, now }),
                    }
                }
                other => Ok(other),
            },
            _ => self.inner.claim(request).await,
        }
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        match self.bug {
            Bug::CompleteIgnoresToken => {
                let token = self.current(id).await?.map_or(token, |r| r.token);
                self.inner.complete(id, token, outcome, ttl).await
            }
            Bug::CompleteWithoutExpiry => {
                self.inner
                    .complete(id, token, outcome, Duration::from_secs(100 * 365 * 86_400))
                    .await
            }
            _ => self.inner.complete(id, token, outcome, ttl).await,
        }
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        match self.bug {
            Bug::FailWritesNothing => Ok(Cas::Applied),
            _ => self.inner.fail(id, token, failure, ttl).await,
        }
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        match self.bug {
            Bug::ExtendWritesNothing => Ok(Cas::Applied),
            _ => self.inner.extend(id, token, lease).await,
        }
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        match self.bug {
            Bug::ReclaimIgnoresExpected => {
                let current = self.current(id).await?.map_or(expected, |r| r.token);
                self.inner
                    .reclaim(id, current, fingerprint, lease, ttl)
                    .await
            }
            _ => {
                self.inner
                    .reclaim(id, expected, fingerprint, lease, ttl)
                    .await
            }
        }
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.inner.get(id).await
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        self.inner.purge_expired(batch).await
    }
}

/// Runs every case against stores from `make`, each case on a fresh store, catching panics.
/// Returns the names of the failed cases.
fn failing_cases(make: impl Fn(ManualClock) -> Arc<dyn IdempotencyStore>) -> Vec<&'static str> {
    let mut failed = Vec::new();
    for (name, case) in all_cases() {
        let clock = ManualClock::new();
        let store = make(clock.clone());
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            run_case(
                move || async move { TestStore::manual_time(store, clock) },
                move |t| bounded(case, t),
            )
        }));
        if outcome.is_err() {
            failed.push(name);
        }
    }
    failed
}

async fn bounded(case: CaseFn, t: TestStore) {
    tokio::time::timeout(Duration::from_secs(120), case(t))
        .await
        .expect("the case hung for 120 s");
}

/// Asserts that the suite rejects the store with `bug`, and that `expected` is among the
/// cases that catch it (so the kit keeps the check it was designed with).
fn assert_rejected(bug: Bug, expected: &[&str]) {
    let failed = failing_cases(|clock| {
        Arc::new(Broken {
            inner: MemoryStore::with_clock(Arc::new(clock)),
            bug,
        })
    });
    eprintln!(
        "{bug:?}: {} of {} cases fail: {failed:?}",
        failed.len(),
        all_cases().len()
    );
    assert!(!failed.is_empty(), "the suite passed a store with {bug:?}");
    for name in expected {
        assert!(
            failed.contains(name),
            "{name} no longer catches {bug:?}; failing cases: {failed:?}"
        );
    }
}

#[test]
fn memory_store_passes_every_case() {
    let failed = failing_cases(|clock| Arc::new(MemoryStore::with_clock(Arc::new(clock))));
    assert!(
        failed.is_empty(),
        "the reference memory store fails {failed:?}"
    );
}

#[test]
fn rejects_check_then_insert_claim() {
    assert_rejected(
        Bug::CheckThenInsertClaim,
        &[
            "concurrent_claims_one_winner",
            "engine_concurrent_runs_execute_once",
        ],
    );
}

#[test]
fn rejects_complete_ignoring_token() {
    assert_rejected(
        Bug::CompleteIgnoresToken,
        &[
            "lease_passed_one_taker_old_holder_fenced",
            "model_based_random_sequences",
        ],
    );
}

#[test]
fn rejects_reclaim_ignoring_expected_token() {
    assert_rejected(
        Bug::ReclaimIgnoresExpected,
        &[
            "stale_snapshot_reclaim_loses",
            "model_based_random_sequences",
        ],
    );
}

#[test]
fn rejects_claim_overwriting_in_flight_record() {
    assert_rejected(
        Bug::ClaimOverwritesInFlight,
        &[
            "concurrent_claims_one_winner",
            "live_pending_never_reclaimed",
            "model_based_random_sequences",
        ],
    );
}

#[test]
fn rejects_complete_without_expiry() {
    assert_rejected(
        Bug::CompleteWithoutExpiry,
        &[
            "ttl_expiry",
            "purge_removes_only_expired",
            "model_based_random_sequences",
        ],
    );
}

#[test]
fn rejects_fail_that_writes_nothing() {
    assert_rejected(
        Bug::FailWritesNothing,
        &[
            "fail_then_reclaim",
            "engine_panic_releases_key",
            "engine_error_not_stored",
        ],
    );
}

#[test]
fn rejects_extend_that_writes_nothing() {
    assert_rejected(
        Bug::ExtendWritesNothing,
        &[
            "extend_moves_lease",
            "model_based_random_sequences",
            "engine_heartbeat_keeps_long_work_leased",
        ],
    );
}
