//! The kit tests itself: deliberately broken stores, each with one bug that real stores have
//! shipped, must fail the suite, and the reference memory store must pass all of it.
//!
//! Each broken store wraps a correct `MemoryStore` and breaks one primitive.

use idempotency_conformance::{
    all_cases, process_clock, run_case, CaseFn, Fault, FlakyOp, FlakyStore, TestStore,
};
use idempotency_core::store::{
    async_trait, Cas, Claim, ClaimRequest, Clock, Failure, ManualClock, Reclaim, Record,
    RecordStatus, SystemClock, Timestamp,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use idempotency_memory::MemoryStore;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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
    /// A replay cache in front of the store that keeps every Completed record an uncounted
    /// claim found and answers it from memory for ever, ignoring `expires_at`.
    ReplaysPastExpiry,
}

#[derive(Debug)]
struct Broken {
    inner: MemoryStore,
    bug: Bug,
    /// What [`Bug::ReplaysPastExpiry`] answers from memory.
    replays: std::sync::Mutex<std::collections::HashMap<RecordId, Record>>,
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
            Bug::ReplaysPastExpiry if !request.count_hit => {
                let cached = self.replays.lock().expect("lock").get(&request.id).cloned();
                if let Some(record) = cached {
                    let now = record.updated_at;
                    return Ok(Claim::Existing { record, now });
                }
                let claim = self.inner.claim(request).await?;
                if let Claim::Existing { record, .. } = &claim {
                    if record.status == RecordStatus::Completed {
                        self.replays
                            .lock()
                            .expect("lock")
                            .insert(request.id.clone(), record.clone());
                    }
                }
                Ok(claim)
            }
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
                        .fail(
                            &request.id,
                            record.token,
                            &Failure::retryable("overwritten"),
                            request.ttl,
                        )
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

/// Runs every case against stores from `make`, each case on a fresh store and clock, catching
/// panics, `CASES_AT_ONCE` at a time (a case mostly waits on its tasks and its clock). Returns
/// the names of the failed cases, in the kit's order.
fn failing_cases(
    make: impl Fn(ManualClock) -> Arc<dyn IdempotencyStore> + Sync,
) -> Vec<&'static str> {
    const CASES_AT_ONCE: usize = 4;
    let cases = all_cases();
    let next = AtomicUsize::new(0);
    let failed = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..CASES_AT_ONCE {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(name, case)) = cases.get(i) else {
                    return;
                };
                let clock = ManualClock::new();
                let store = make(clock.clone());
                let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    run_case(
                        move || async move { TestStore::manual_time(store, clock) },
                        move |t| bounded(case, t),
                    )
                }));
                if outcome.is_err() {
                    failed.lock().expect("the failed cases").push((i, name));
                }
            });
        }
    });
    let mut failed = failed.into_inner().expect("the failed cases");
    failed.sort_unstable();
    failed.into_iter().map(|(_, name)| name).collect()
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
            inner: MemoryStore::builder().clock(Arc::new(clock)).build(),
            bug,
            replays: Default::default(),
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
    let failed =
        failing_cases(|clock| Arc::new(MemoryStore::builder().clock(Arc::new(clock)).build()));
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
            "engine_panic_holds_key",
            "engine_error_not_stored",
        ],
    );
}

#[test]
fn rejects_replays_past_expiry() {
    assert_rejected(Bug::ReplaysPastExpiry, &["uncounted_replays_end_at_expiry"]);
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

// ---------------------------------------------------------------------------------------------
// Flaws that need a store's insides (which record is absent and which merely expired, what a
// purge selected, how an address is keyed): a small reference store, correct unless a flaw
// is switched on.

/// One flaw of [`RefStore`], each a bug a real store could ship.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flaw {
    /// None: the reference store is correct.
    None,
    /// The claim of an **expired** record reads it, yields, then replaces it: two concurrent
    /// claimers both win (an absent key is inserted atomically).
    ExpiredCheckThenReplace,
    /// complete, fail and extend check the token, yield, then write to whatever record is
    /// there: a taker who reclaimed in between gets the stale holder's write.
    ReadThenWriteSettle,
    /// Purge selects the expired ids, yields, then deletes by id without checking again: a
    /// record claimed fresh in between is deleted.
    PurgeWithoutRecheck,
    /// A fresh key starts at token 1 (and an expired record passes on token + 1): after a
    /// purge, a new record reuses a token an old holder has.
    TokenRestartsAfterPurge,
    /// fail ignores expiry: it revives an expired Pending record as Failed.
    FailRevivesExpired,
    /// complete leaves `expires_at` as the claim set it instead of `now + ttl`.
    CompleteKeepsClaimExpiry,
    /// extend sets `expires_at = lease_until`, lowering it under a long retention.
    ExtendLowersExpiry,
    /// reclaim leaves `expires_at` where it was.
    ReclaimKeepsExpiry,
    /// claim sets `expires_at = now + ttl`, ignoring a longer lease.
    ClaimExpiresAfterTtl,
    /// The store reads the application's clock (the process's) instead of its own.
    AppClock,
    /// Keys are stored truncated to 254 bytes.
    TruncatesKeys,
    /// Scopes are keyed by their first 512 bytes (a weak hash of the scope).
    HashesScopesWeakly,
    /// Durations beyond 100 years are an error instead of clamping.
    OverflowingDurations,
    /// Tokens above `i64::MAX` are an error instead of fenced.
    TokensNearMaxError,
    /// reclaim keeps the previous attempt's failure on the new Pending record.
    ReclaimKeepsFailure,
}

#[derive(Debug)]
struct RefStore {
    records: std::sync::Mutex<std::collections::HashMap<(String, String), Record>>,
    clock: Arc<dyn Clock>,
    flaw: Flaw,
}

type Records<'a> = std::sync::MutexGuard<'a, std::collections::HashMap<(String, String), Record>>;

impl RefStore {
    fn new(clock: Arc<dyn Clock>, flaw: Flaw) -> Self {
        Self {
            records: Default::default(),
            clock,
            flaw,
        }
    }

    fn lock(&self) -> Records<'_> {
        self.records.lock().expect("the reference store's lock")
    }

    fn now(&self) -> Timestamp {
        match self.flaw {
            Flaw::AppClock => Timestamp::now(),
            _ => self.clock.now(),
        }
    }

    fn addr(&self, id: &RecordId) -> (String, String) {
        let (mut scope, mut key) = (id.scope.as_str().to_owned(), id.key.as_str().to_owned());
        if self.flaw == Flaw::TruncatesKeys {
            key.truncate(254);
        }
        if self.flaw == Flaw::HashesScopesWeakly {
            scope.truncate(512);
        }
        (scope, key)
    }

    fn checked(&self, d: Duration) -> Result<Duration, Error> {
        if self.flaw == Flaw::OverflowingDurations && d > Duration::from_secs(100 * 366 * 86_400) {
            return Err(Error::backend(false, "interval out of range"));
        }
        Ok(d)
    }

    fn token_ok(&self, token: FencingToken) -> Result<(), Error> {
        if self.flaw == Flaw::TokensNearMaxError && token.0 > i64::MAX as u64 {
            return Err(Error::backend(false, "bigint out of range"));
        }
        Ok(())
    }

    /// The time between a read and the write that trusts it: a round trip to a database.
    async fn gap() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    fn fresh_token(&self, now: Timestamp, replaced: Option<FencingToken>) -> FencingToken {
        match self.flaw {
            Flaw::TokenRestartsAfterPurge => replaced.map_or(FencingToken(1), FencingToken::next),
            _ => FencingToken::fresh(now, replaced),
        }
    }

    /// The compare-and-swap of complete, fail and extend.
    async fn cas(
        &self,
        id: &RecordId,
        token: FencingToken,
        ignore_expiry: bool,
        write: impl FnOnce(&mut Record, Timestamp),
    ) -> Result<Cas, Error> {
        self.token_ok(token)?;
        let now = self.now();
        let addr = self.addr(id);
        {
            let mut records = self.lock();
            let Some(r) = records.get_mut(&addr) else {
                return Ok(Cas::Fenced);
            };
            let live = ignore_expiry || !r.is_expired(now);
            if !live || r.status != RecordStatus::Pending || r.token != token {
                return Ok(Cas::Fenced);
            }
            if self.flaw != Flaw::ReadThenWriteSettle {
                write(r, now);
                r.updated_at = now;
                return Ok(Cas::Applied);
            }
        }
        Self::gap().await;
        if let Some(r) = self.lock().get_mut(&addr) {
            write(r, now);
            r.updated_at = now;
        }
        Ok(Cas::Applied)
    }
}

#[async_trait]
impl IdempotencyStore for RefStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let (lease, ttl) = (self.checked(request.lease)?, self.checked(request.ttl)?);
        let now = self.now();
        let addr = self.addr(&request.id);
        let lease_until = now.saturating_add(lease);
        let retention = match self.flaw {
            Flaw::ClaimExpiresAfterTtl => ttl,
            _ => lease.max(ttl),
        };
        let fresh = |token| Record {
            id: request.id.clone(),
            fingerprint: request.fingerprint,
            status: RecordStatus::Pending,
            token,
            lease_until: Some(lease_until),
            outcome: None,
            attempts: 1,
            failure: None,
            hits: 0,
            created_at: now,
            updated_at: now,
            expires_at: now.saturating_add(retention),
        };
        let replaced = {
            let mut records = self.lock();
            match records.get_mut(&addr) {
                Some(r) if !r.is_expired(now) => {
                    if request.count_hit {
                        r.hits += 1;
                    }
                    return Ok(Claim::Existing {
                        record: r.clone(),
                        now,
                    });
                }
                Some(r) if self.flaw != Flaw::ExpiredCheckThenReplace => {
                    let token = self.fresh_token(now, Some(r.token));
                    *r = fresh(token);
                    return Ok(Claim::Claimed { token, lease_until });
                }
                Some(r) => r.token,
                None => {
                    let token = self.fresh_token(now, None);
                    records.insert(addr, fresh(token));
                    return Ok(Claim::Claimed { token, lease_until });
                }
            }
        };
        // Saw an expired record: replace it, whatever happened meanwhile.
        Self::gap().await;
        let token = self.fresh_token(now, Some(replaced));
        self.lock().insert(addr, fresh(token));
        Ok(Claim::Claimed { token, lease_until })
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let ttl = self.checked(ttl)?;
        let keep = self.flaw == Flaw::CompleteKeepsClaimExpiry;
        self.cas(id, token, false, |r, now| {
            r.status = RecordStatus::Completed;
            r.outcome = Some(outcome.to_vec());
            r.lease_until = None;
            r.failure = None;
            if !keep {
                r.expires_at = now.saturating_add(ttl);
            }
        })
        .await
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let ttl = self.checked(ttl)?;
        self.cas(
            id,
            token,
            self.flaw == Flaw::FailRevivesExpired,
            |r, now| {
                r.status = RecordStatus::Failed;
                r.failure = Some(failure.clone());
                r.lease_until = None;
                r.expires_at = now.saturating_add(ttl);
            },
        )
        .await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        let lease = self.checked(lease)?;
        let lowers = self.flaw == Flaw::ExtendLowersExpiry;
        self.cas(id, token, false, |r, now| {
            let until = now.saturating_add(lease);
            r.lease_until = Some(until);
            r.expires_at = if lowers {
                until
            } else {
                r.expires_at.max(until)
            };
        })
        .await
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        self.token_ok(expected)?;
        let (lease, ttl) = (self.checked(lease)?, self.checked(ttl)?);
        let now = self.now();
        let mut records = self.lock();
        let Some(r) = records.get_mut(&self.addr(id)) else {
            return Ok(Reclaim::Lost);
        };
        if r.is_expired(now) || r.token != expected || !r.reclaimable_by(fingerprint, now) {
            return Ok(Reclaim::Lost);
        }
        let lease_until = now.saturating_add(lease);
        r.status = RecordStatus::Pending;
        r.token = expected.next();
        r.fingerprint = *fingerprint;
        r.attempts += 1;
        r.lease_until = Some(lease_until);
        r.outcome = None;
        if self.flaw != Flaw::ReclaimKeepsFailure {
            r.failure = None;
        }
        r.updated_at = now;
        if self.flaw != Flaw::ReclaimKeepsExpiry {
            r.expires_at = now.saturating_add(lease.max(ttl));
        }
        Ok(Reclaim::Reclaimed {
            token: r.token,
            lease_until,
        })
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let now = self.now();
        Ok(self
            .lock()
            .get(&self.addr(id))
            .filter(|r| !r.is_expired(now))
            .cloned())
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        let now = self.now();
        let expired: Vec<(String, String)> = {
            let mut records = self.lock();
            let expired: Vec<_> = records
                .iter()
                .filter(|(_, r)| r.is_expired(now))
                .map(|(a, _)| a.clone())
                .take(batch)
                .collect();
            if self.flaw != Flaw::PurgeWithoutRecheck {
                for a in &expired {
                    records.remove(a);
                }
                return Ok(expired.len() as u64);
            }
            expired
        };
        Self::gap().await;
        let mut records = self.lock();
        for a in &expired {
            records.remove(a);
        }
        Ok(expired.len() as u64)
    }
}

/// Asserts that the suite rejects the reference store with `flaw`, on a manual clock, and
/// that `expected` is among the cases that catch it.
fn assert_flaw_rejected(flaw: Flaw, expected: &[&str]) {
    let failed = failing_cases(|clock| Arc::new(RefStore::new(Arc::new(clock), flaw)));
    eprintln!(
        "{flaw:?}: {} of {} cases fail: {failed:?}",
        failed.len(),
        all_cases().len()
    );
    assert!(!failed.is_empty(), "the suite passed a store with {flaw:?}");
    for name in expected {
        assert!(
            failed.contains(name),
            "{name} no longer catches {flaw:?}; failing cases: {failed:?}"
        );
    }
}

/// Asserts that `case` rejects the reference store with `flaw` on a **real** clock (the kit
/// reads the store's clock from outside, with a tolerance), the way server-backed stores run.
fn assert_rejected_on_real_clock(flaw: Flaw, case: &str) {
    let (_, run) = all_cases()
        .into_iter()
        .find(|(name, _)| *name == case)
        .unwrap_or_else(|| panic!("no case {case}"));
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        run_case(
            move || async move {
                TestStore::real_time(Arc::new(RefStore::new(Arc::new(SystemClock), flaw)))
                    .with_server_clock(process_clock())
            },
            move |t| bounded(run, t),
        )
    }));
    assert!(
        outcome.is_err(),
        "{case} passed the store with {flaw:?} on a real clock"
    );
}

#[test]
fn reference_store_passes_every_case() {
    let failed = failing_cases(|clock| Arc::new(RefStore::new(Arc::new(clock), Flaw::None)));
    assert!(failed.is_empty(), "the reference store fails {failed:?}");
    // On a real clock too, for the clock-reading case.
    let (_, run) = all_cases()
        .into_iter()
        .find(|(name, _)| *name == "deadlines_follow_the_store_clock")
        .expect("the case");
    run_case(
        || async {
            TestStore::real_time(Arc::new(RefStore::new(Arc::new(SystemClock), Flaw::None)))
                .with_server_clock(process_clock())
        },
        move |t| bounded(run, t),
    );
}

#[test]
fn rejects_check_then_replace_of_expired_records() {
    assert_flaw_rejected(
        Flaw::ExpiredCheckThenReplace,
        &["concurrent_claims_of_expired_record_one_winner"],
    );
}

#[test]
fn rejects_read_then_write_settling() {
    assert_flaw_rejected(
        Flaw::ReadThenWriteSettle,
        &["settling_races_takers_after_lease"],
    );
}

#[test]
fn rejects_purge_without_recheck() {
    assert_flaw_rejected(Flaw::PurgeWithoutRecheck, &["purge_races_fresh_claims"]);
}

#[test]
fn rejects_tokens_that_restart_after_purge() {
    assert_flaw_rejected(
        Flaw::TokenRestartsAfterPurge,
        &[
            "tokens_grow_across_purge_and_expiry",
            "model_based_random_sequences",
        ],
    );
}

#[test]
fn rejects_fail_reviving_expired_records() {
    assert_flaw_rejected(Flaw::FailRevivesExpired, &["ttl_expiry"]);
}

#[test]
fn rejects_wrong_deadlines_on_both_clocks() {
    for flaw in [
        Flaw::CompleteKeepsClaimExpiry,
        Flaw::ExtendLowersExpiry,
        Flaw::ReclaimKeepsExpiry,
        Flaw::ClaimExpiresAfterTtl,
    ] {
        assert_flaw_rejected(flaw, &["deadlines_follow_the_store_clock"]);
        assert_rejected_on_real_clock(flaw, "deadlines_follow_the_store_clock");
    }
}

#[test]
fn rejects_a_store_on_the_application_clock() {
    assert_flaw_rejected(Flaw::AppClock, &["deadlines_follow_the_store_clock"]);
}

#[test]
fn rejects_truncated_keys_and_weakly_hashed_scopes() {
    for flaw in [Flaw::TruncatesKeys, Flaw::HashesScopesWeakly] {
        assert_flaw_rejected(flaw, &["long_keys_and_scopes_are_not_truncated"]);
    }
}

#[test]
fn rejects_errors_on_extreme_values() {
    for flaw in [Flaw::OverflowingDurations, Flaw::TokensNearMaxError] {
        assert_flaw_rejected(flaw, &["extreme_durations_and_tokens"]);
    }
}

#[test]
fn rejects_reclaim_keeping_the_old_failure() {
    assert_flaw_rejected(
        Flaw::ReclaimKeepsFailure,
        &["model_based_random_sequences", "fail_then_reclaim"],
    );
}

/// On a real clock, a stall longer than the lease between the extension and the checks after
/// it lets the lease pass before them, and a reclaim then rightly wins: the case must not
/// blame the store for it, but try again (a loaded machine once failed DynamoDB's run this
/// way), and still find a correct store correct.
#[test]
fn a_stall_past_the_lease_on_a_real_clock_is_not_blamed_on_the_store() {
    let (_, run) = all_cases()
        .into_iter()
        .find(|(name, _)| *name == "live_pending_never_reclaimed")
        .expect("the case");
    run_case(
        || async {
            // The first extension is applied at once and answered 1.5 s later: longer than
            // the case's lease (twice the short lease, 400 ms for a fast store).
            let memory = MemoryStore::builder().clock(Arc::new(SystemClock)).build();
            let store = FlakyStore::new(
                Arc::new(memory),
                Fault::LateAnswer(Duration::from_millis(1_500)),
            );
            store.inject(FlakyOp::Extend, 1);
            TestStore::real_time(Arc::new(store)).with_server_clock(process_clock())
        },
        move |t| bounded(run, t),
    );
}
