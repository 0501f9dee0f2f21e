//! The engine's own loop, against a scripted store: bounds and call counts that a real
//! store cannot be made to provoke on demand.

use super::*;
use crate::{Cas, SettleRetry, Timestamp};
use async_trait::async_trait;
use std::collections::VecDeque;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// Answers claims from a script (then repeats the last answer), `get` with a fixed record,
/// and loses every reclaim; counts the calls.
#[derive(Debug, Default)]
struct Scripted {
    claims: Mutex<VecDeque<Claim>>,
    get: Option<Record>,
    /// Each `get` finds `get` with a token one greater than the last: someone else keeps
    /// taking the key over, and losing it again.
    get_moves_on: bool,
    claim_delay: Duration,
    extend_fenced: bool,
    complete_fenced: bool,
    fail_fenced: bool,
    /// Answers of the first completions, before `complete_fenced` applies.
    completes: Mutex<VecDeque<Result<Cas, Error>>>,
    /// Answers of the first failures, before `fail_fenced` applies.
    fails: Mutex<VecDeque<Result<Cas, Error>>>,
    extends: Mutex<Vec<Duration>>,
    claimed: AtomicUsize,
    got: AtomicUsize,
    reclaimed: AtomicUsize,
}

#[async_trait]
impl IdempotencyStore for Scripted {
    async fn claim(&self, _: &ClaimRequest) -> Result<Claim, Error> {
        self.claimed.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.claim_delay).await;
        let mut claims = self.claims.lock().expect("lock");
        let next = if claims.len() > 1 {
            claims.pop_front()
        } else {
            claims.front().cloned()
        };
        Ok(next.expect("a scripted claim"))
    }
    async fn complete(
        &self,
        _: &RecordId,
        _: FencingToken,
        _: &[u8],
        _: Duration,
    ) -> Result<Cas, Error> {
        if let Some(answer) = self.completes.lock().expect("lock").pop_front() {
            return answer;
        }
        Ok(if self.complete_fenced {
            Cas::Fenced
        } else {
            Cas::Applied
        })
    }
    async fn fail(
        &self,
        _: &RecordId,
        _: FencingToken,
        _: &Failure,
        _: Duration,
    ) -> Result<Cas, Error> {
        if let Some(answer) = self.fails.lock().expect("lock").pop_front() {
            return answer;
        }
        Ok(if self.fail_fenced {
            Cas::Fenced
        } else {
            Cas::Applied
        })
    }
    async fn extend(&self, _: &RecordId, _: FencingToken, lease: Duration) -> Result<Cas, Error> {
        self.extends.lock().expect("lock").push(lease);
        Ok(if self.extend_fenced {
            Cas::Fenced
        } else {
            Cas::Applied
        })
    }
    async fn reclaim(
        &self,
        _: &RecordId,
        _: FencingToken,
        _: &Fingerprint,
        _: Duration,
        _: Duration,
    ) -> Result<Reclaim, Error> {
        self.reclaimed.fetch_add(1, Ordering::SeqCst);
        Ok(Reclaim::Lost)
    }
    async fn get(&self, _: &RecordId) -> Result<Option<Record>, Error> {
        let n = self.got.fetch_add(1, Ordering::SeqCst);
        let mut record = self.get.clone();
        if let Some(r) = record.as_mut().filter(|_| self.get_moves_on) {
            r.token = FencingToken(r.token.0 + 1 + n as u64);
        }
        Ok(record)
    }
    async fn purge_expired(&self, _: usize) -> Result<u64, Error> {
        Ok(0)
    }
}

fn id() -> RecordId {
    RecordId::new(
        IdempotencyKey::new("k").expect("key"),
        Scope::new("engine-tests").expect("scope"),
    )
}

fn fp() -> Fingerprint {
    Fingerprint::from_bytes(b"f")
}

fn now() -> Timestamp {
    Timestamp::from_millis(1_000_000)
}

/// A Pending record whose lease ends `lease_ms` after [`now`], expiring in an hour.
fn pending(lease_ms: i64) -> Record {
    Record {
        id: id(),
        fingerprint: fp(),
        status: RecordStatus::Pending,
        token: FencingToken(5),
        lease_until: Some(Timestamp::from_millis(now().as_millis() + lease_ms)),
        outcome: None,
        attempts: 1,
        failure: None,
        hits: 1,
        created_at: now(),
        updated_at: now(),
        expires_at: Timestamp::from_millis(now().as_millis() + 3_600_000),
    }
}

fn engine(store: Arc<Scripted>, policy: Policy) -> Idempotency {
    Idempotency::new(store, policy).expect("policy")
}

#[test]
fn answer_helpers() {
    let executed = Answer::Executed(1);
    let replayed = Answer::Replayed(2);
    let refused: Answer<i32> = Answer::Refused(Refusal::KeyReused);
    assert!(executed.is_executed() && !executed.is_replayed());
    assert!(replayed.is_replayed() && !replayed.is_executed());
    assert!(!refused.is_executed() && !refused.is_replayed());
    assert_eq!(
        (executed.value(), replayed.value(), refused.value()),
        (Some(&1), Some(&2), None)
    );
    assert_eq!(refused.refusal(), Some(&Refusal::KeyReused));
    assert_eq!(executed.clone().map(|n| n * 10), Answer::Executed(10));
    assert_eq!(
        (
            executed.into_result(),
            replayed.into_result(),
            refused.into_result()
        ),
        (Ok(1), Ok(2), Err(Refusal::KeyReused))
    );
    let in_progress = Refusal::InProgress {
        retry_after: Duration::from_secs(2),
    };
    assert!(in_progress.is_retryable());
    assert_eq!(in_progress.retry_after(), Some(Duration::from_secs(2)));
    for final_refusal in [
        Refusal::KeyReused,
        Refusal::FailedPermanently {
            message: "declined".into(),
        },
        Refusal::OutcomeLost {
            message: "too large".into(),
        },
    ] {
        assert!(!final_refusal.is_retryable(), "{final_refusal}");
        assert_eq!(final_refusal.retry_after(), None);
    }
}

/// A record failed with the lost outcome's failure is refused as an outcome lost, not as a
/// permanent failure of the work: the work ran.
#[test]
fn a_lost_outcome_is_refused_apart_from_a_permanent_failure() {
    assert!(matches!(
        Refusal::failed(Some(Failure::outcome_not_stored("over 400 KB"))),
        Refusal::OutcomeLost { message } if message.contains("over 400 KB")
    ));
    assert_eq!(
        Refusal::failed(Some(Failure::permanent("card declined"))),
        Refusal::FailedPermanently {
            message: "card declined".into()
        }
    );
}

#[test]
fn the_engine_keeps_its_store_and_policy() {
    let store = Arc::new(Scripted::default());
    let e = engine(
        store.clone(),
        Policy::default().lease(Duration::from_secs(7)),
    );
    assert_eq!(e.policy().lease, Duration::from_secs(7));
    let dyn_store: Arc<dyn IdempotencyStore> = store;
    assert!(Arc::ptr_eq(e.store(), &dyn_store));
}

/// A store whose claim finds a Pending record past its lease and loses every reclaim; each
/// `get` finds that record again, or (`moves_on`) a newer holder's, also past its lease.
fn losing_reclaims(moves_on: bool) -> Arc<Scripted> {
    let passed = pending(-1);
    Arc::new(Scripted {
        claims: Mutex::new(VecDeque::from([Claim::Existing {
            record: passed.clone(),
            now: now(),
        }])),
        get: Some(passed),
        get_moves_on: moves_on,
        ..Scripted::default()
    })
}

/// A key whose reclaims keep being lost (someone else always wins, and its lease passes
/// too, record after record) is reported in progress after exactly `MAX_ROUNDS` tries, from
/// one claim: every later look is a `get`.
#[tokio::test]
async fn lost_reclaims_give_up_after_max_rounds() {
    let store = losing_reclaims(true);
    let e = engine(store.clone(), Policy::default());
    let got = tokio::time::timeout(Duration::from_secs(5), e.begin(&id(), &fp()))
        .await
        .expect("the engine looped without bound");
    assert!(
        matches!(got, Ok(Begin::Refused(Refusal::InProgress { .. }))),
        "{got:?}"
    );
    assert_eq!(store.reclaimed.load(Ordering::SeqCst), MAX_ROUNDS);
    assert_eq!(
        store.claimed.load(Ordering::SeqCst),
        1,
        "one claim per request"
    );
}

/// A reclaim the store refused while the record stayed as it was (same holder, same token,
/// its lease passed on the table) means the store knows the holder is alive (Postgres at
/// REPEATABLE READ or SERIALIZABLE: the holder's transaction has the row locked and keeps
/// its lease in its process), or that the store's clock has not reached the lease's end yet:
/// the key is in progress. Before, the engine read and reclaimed again, eight rounds in all,
/// then answered in progress without waiting as the policy asked.
#[tokio::test]
async fn a_lost_reclaim_of_an_unchanged_record_is_in_progress_at_once() {
    let store = losing_reclaims(false);
    let e = engine(store.clone(), Policy::default());
    let got = tokio::time::timeout(Duration::from_secs(5), e.begin(&id(), &fp()))
        .await
        .expect("the engine looped without bound");
    assert!(
        matches!(got, Ok(Begin::Refused(Refusal::InProgress { .. }))),
        "{got:?}"
    );
    assert_eq!(
        store.reclaimed.load(Ordering::SeqCst),
        1,
        "the same holder's record was reclaimed again"
    );
}

/// The same, with a policy that waits for a holder in flight: the engine waits (polling with
/// `get`) for up to `max_wait`, as for any key in progress, instead of giving up at once.
#[tokio::test]
async fn a_lost_reclaim_of_an_unchanged_record_is_waited_for() {
    let store = losing_reclaims(false);
    let max_wait = Duration::from_millis(300);
    let e = engine(
        store.clone(),
        Policy::default().in_flight(InFlight::Wait {
            max_wait,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
        }),
    );
    let started = Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(10), e.begin(&id(), &fp()))
        .await
        .expect("the engine looped without bound");
    assert!(
        matches!(got, Ok(Begin::Refused(Refusal::InProgress { .. }))),
        "{got:?}"
    );
    assert!(
        started.elapsed() >= max_wait,
        "gave up after {:?}, before max_wait",
        started.elapsed()
    );
    assert_eq!(store.reclaimed.load(Ordering::SeqCst), 1);
    assert!(store.got.load(Ordering::SeqCst) > 2, "it did not poll");
}

/// When the decision is to claim (the record read had expired), the engine claims again
/// rather than reading again.
#[tokio::test]
async fn a_claim_decision_claims_again() {
    let mut expired = pending(1000);
    expired.expires_at = now();
    let store = Arc::new(Scripted {
        claims: Mutex::new(VecDeque::from([
            Claim::Existing {
                record: expired.clone(),
                now: now(),
            },
            Claim::Claimed {
                token: FencingToken(6),
                lease_until: now(),
            },
        ])),
        get: Some(expired),
        ..Scripted::default()
    });
    let e = engine(store.clone(), Policy::default());
    match e.begin(&id(), &fp()).await {
        Ok(Begin::Execute(lease)) => {
            assert_eq!(lease.token(), FencingToken(6));
            lease.settled_externally();
        }
        other => panic!("after an expired observation the engine got {other:?}"),
    }
    assert_eq!(store.claimed.load(Ordering::SeqCst), 2);
}

/// A waiter never sleeps past `max_wait`, even when a slow store used part of it and the
/// backoff is longer than what is left.
#[tokio::test]
async fn waiting_never_oversleeps_max_wait() {
    let live = pending(3_600_000);
    let store = Arc::new(Scripted {
        claims: Mutex::new(VecDeque::from([Claim::Existing {
            record: live.clone(),
            now: now(),
        }])),
        get: Some(live),
        claim_delay: Duration::from_millis(200),
        ..Scripted::default()
    });
    let max_wait = Duration::from_millis(300);
    let e = engine(
        store,
        Policy::default().in_flight(InFlight::Wait {
            max_wait,
            initial_backoff: Duration::from_secs(10),
            max_backoff: Duration::from_secs(10),
        }),
    );
    let started = Instant::now();
    let got = e.begin(&id(), &fp()).await;
    let waited = started.elapsed();
    assert!(
        matches!(got, Ok(Begin::Refused(Refusal::InProgress { .. }))),
        "{got:?}"
    );
    assert!(
        waited >= max_wait && waited < max_wait + Duration::from_millis(250),
        "gave up after {waited:?} with max_wait {max_wait:?}"
    );
}

/// While the holder's lease is live, a waiter reads the record once per backoff and does
/// not count hits (no claims).
#[tokio::test]
async fn waiting_polls_once_per_backoff() {
    let live = pending(3_600_000);
    let store = Arc::new(Scripted {
        claims: Mutex::new(VecDeque::from([Claim::Existing {
            record: live.clone(),
            now: now(),
        }])),
        get: Some(live),
        ..Scripted::default()
    });
    let backoff = Duration::from_millis(50);
    let e = engine(
        store.clone(),
        Policy::default().in_flight(InFlight::Wait {
            max_wait: Duration::from_millis(500),
            initial_backoff: backoff,
            max_backoff: backoff,
        }),
    );
    let got = e.begin(&id(), &fp()).await;
    assert!(
        matches!(got, Ok(Begin::Refused(Refusal::InProgress { .. }))),
        "{got:?}"
    );
    let polls = store.got.load(Ordering::SeqCst);
    assert!(
        (1..=11).contains(&polls),
        "{polls} reads in 500 ms of 50 ms backoffs (one per backoff expected)"
    );
    assert_eq!(store.claimed.load(Ordering::SeqCst), 1);
}

fn lease_on(store: Arc<Scripted>, policy: Policy) -> Lease {
    Lease::new(store, Arc::new(policy), id(), FencingToken(5))
}

/// The heartbeat marks the lease lost only when an extension is fenced.
#[tokio::test]
async fn is_lost_only_after_a_fenced_extension() {
    let policy = Policy::default()
        .lease(Duration::from_millis(30))
        .heartbeat(Some(0.3));
    let work = || tokio::time::sleep(Duration::from_millis(100));
    let kept = lease_on(Arc::new(Scripted::default()), policy.clone());
    kept.with_heartbeat(work()).await;
    assert!(!kept.is_lost(), "applied extensions marked the lease lost");
    kept.settled_externally();
    let store = Arc::new(Scripted {
        extend_fenced: true,
        ..Scripted::default()
    });
    let taken = lease_on(store.clone(), policy);
    taken.with_heartbeat(work()).await;
    assert!(
        taken.is_lost(),
        "a fenced extension did not mark the lease lost"
    );
    assert_eq!(
        store.extends.lock().expect("lock").len(),
        1,
        "beats after the fence"
    );
    taken.settled_externally();
}

/// A heartbeat fenced because the work's own transaction completed the record (a handler
/// that committed its completion and is still building its response) is not a lost
/// lease: the record, read back, shows this holder's token settled. The heartbeat stops.
/// Fenced with another holder's token, it is lost.
#[tokio::test]
async fn a_heartbeat_fenced_by_our_own_completion_is_not_lost() {
    let policy = Policy::default()
        .lease(Duration::from_millis(30))
        .heartbeat(Some(0.3));
    let ours = Record {
        status: RecordStatus::Completed,
        lease_until: None,
        outcome: Some(b"x".to_vec()),
        ..pending(0)
    };
    let mut theirs = pending(1000);
    theirs.token = FencingToken(6);
    for (record, lost) in [(ours, false), (theirs, true)] {
        let what = format!("{:?} token {}", record.status, record.token);
        let store = Arc::new(Scripted {
            extend_fenced: true,
            get: Some(record),
            ..Scripted::default()
        });
        let lease = lease_on(store.clone(), policy.clone());
        lease
            .with_heartbeat(tokio::time::sleep(Duration::from_millis(100)))
            .await;
        assert_eq!(lease.is_lost(), lost, "{what}");
        assert_eq!(
            store.extends.lock().expect("lock").len(),
            1,
            "{what}: beats after the fence"
        );
        lease.settled_externally();
    }
}

/// The heartbeat never extends past the end of the maximum work time, and stops there.
#[tokio::test]
async fn extensions_end_with_max_work_time() {
    let store = Arc::new(Scripted::default());
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .heartbeat(Some(1.0 / 3.0))
        .max_work_time(Duration::from_millis(450));
    let lease = lease_on(store.clone(), policy);
    lease
        .with_heartbeat(tokio::time::sleep(Duration::from_millis(800)))
        .await;
    let extends = store.extends.lock().expect("lock").clone();
    assert!(
        (2..=4).contains(&extends.len()),
        "extensions after max_work_time: {extends:?}"
    );
    let last = *extends.last().expect("an extension");
    assert!(
        last < Duration::from_millis(200),
        "the last extension ({last:?}) reaches past the maximum work time: {extends:?}"
    );
    lease.settled_externally();
}

#[test]
fn work_deadline_is_claim_plus_max_work_time_and_saturates() {
    let store = Arc::new(Scripted::default());
    let lease = lease_on(
        store.clone(),
        Policy::default().max_work_time(Duration::from_secs(600)),
    );
    let d = lease.work_deadline().duration_since(lease.claimed_at);
    assert_eq!(d, Duration::from_secs(600));
    lease.settled_externally();
    let eternal = lease_on(store, Policy::default().max_work_time(Duration::MAX));
    assert!(
        eternal.work_deadline() > Instant::now() + Duration::from_secs(50 * 365 * 24 * 3600),
        "Duration::MAX does not saturate to the far future"
    );
    eternal.settled_externally();
}

/// A completion fenced at its first try, on a record another holder took over, is
/// `LeaseLost`, also with a retention shorter than the retries (only a try that failed
/// before can have applied unseen). The fence is checked with one read.
#[tokio::test]
async fn a_first_try_fenced_is_lease_lost() {
    let mut theirs = pending(1000);
    theirs.token = FencingToken(6);
    let store = Arc::new(Scripted {
        complete_fenced: true,
        get: Some(theirs),
        ..Scripted::default()
    });
    let lease = lease_on(
        store.clone(),
        Policy::default().retention(Duration::from_millis(500)),
    );
    match lease.complete(b"x").await {
        Err(Error::LeaseLost { token }) => assert_eq!(token, FencingToken(5)),
        other => panic!("a fenced first try got {other:?}"),
    }
    assert_eq!(
        store.got.load(Ordering::SeqCst),
        1,
        "a fenced first try is read back once"
    );
}

/// A client that resends a write which had already applied (a cluster client that
/// reconnects after a reset and sends the script again) gets `Fenced` for its own
/// completion: the read-back finds this holder's Completed record, so it is a success.
#[tokio::test]
async fn a_fenced_first_try_over_our_own_completion_is_success() {
    let ours = Record {
        status: RecordStatus::Completed,
        lease_until: None,
        outcome: Some(b"x".to_vec()),
        ..pending(0)
    };
    let store = Arc::new(Scripted {
        complete_fenced: true,
        get: Some(ours),
        ..Scripted::default()
    });
    let lease = lease_on(store.clone(), Policy::default());
    let got = lease.complete(b"x").await;
    assert!(
        got.is_ok(),
        "our own stored completion came back as {got:?}"
    );
    assert_eq!(store.got.load(Ordering::SeqCst), 1);
}

/// A record that is simply gone (a store restarted without persistence, an eviction, a
/// failover) was not fenced by another holder: after a failed try, then `Fenced`, with no
/// record to read back, the completion's outcome is unknown, never `LeaseLost`. Also at
/// the first try, and with the default (long) retention.
#[tokio::test]
async fn a_fence_with_no_record_is_outcome_unknown() {
    for failed_first in [true, false] {
        let completes = match failed_first {
            true => VecDeque::from([Err(Error::backend(true, "connection reset"))]),
            false => VecDeque::new(),
        };
        let store = Arc::new(Scripted {
            completes: Mutex::new(completes),
            complete_fenced: true,
            get: None,
            ..Scripted::default()
        });
        let lease = lease_on(store, Policy::default());
        match lease.complete(b"x").await {
            Err(Error::OutcomeUnknown { .. }) => {}
            other => {
                panic!("failed first: {failed_first}; a fence with the record gone got {other:?}")
            }
        }
    }
}

/// A release fenced because the record is gone has released the key all the same: the
/// failure is not reported as a lost lease.
#[tokio::test]
async fn a_fenced_release_with_no_record_is_released() {
    let store = Arc::new(Scripted {
        fail_fenced: true,
        get: None,
        ..Scripted::default()
    });
    let lease = lease_on(store.clone(), Policy::default());
    let got = lease.fail(Failure::retryable("nothing was done")).await;
    assert!(got.is_ok(), "a release of a gone record got {got:?}");
    assert_eq!(store.got.load(Ordering::SeqCst), 1);
}

/// A release whose first try applied but whose answer was lost, fenced on its retry because a
/// retry of the request already reclaimed the freed key: the release did its job, and the
/// work's outcome goes to the caller, not `LeaseLost`. A release fenced on its first try (the
/// lease had passed and another caller took the key) is still `LeaseLost`.
#[tokio::test]
async fn a_lost_release_answer_then_a_reclaim_is_released() {
    let mut theirs = pending(1000);
    theirs.token = FencingToken(6);
    // The first try: lost with its outcome unknown (it may have applied), failed before it
    // was sent (it did not), or fenced at once.
    let unknown = || {
        Err(Error::OutcomeUnknown {
            source: "the answer was lost".into(),
        })
    };
    let not_sent = || Err(Error::backend(true, "not sent"));
    for (first_try_failed, first, released) in [
        ("unknown", vec![unknown()], true),
        ("not sent", vec![not_sent()], false),
        ("no", vec![], false),
    ] {
        let store = Arc::new(Scripted {
            fails: Mutex::new(VecDeque::from(first)),
            fail_fenced: true,
            get: Some(theirs.clone()),
            ..Scripted::default()
        });
        let lease = lease_on(store, Policy::default());
        match (lease.fail(Failure::retryable("declined")).await, released) {
            (Ok(()), true) | (Err(Error::LeaseLost { .. }), false) => {}
            (other, _) => panic!(
                "a release (first try failed: {first_try_failed}) fenced by a later token got \
                 {other:?}"
            ),
        }
    }
    // Through the engine: the caller gets the work's error, not LeaseLost.
    let store = Arc::new(Scripted {
        claims: Mutex::new(VecDeque::from([Claim::Claimed {
            token: FencingToken(5),
            lease_until: Timestamp::from_millis(now().as_millis() + 30_000),
        }])),
        fails: Mutex::new(VecDeque::from([Err(Error::OutcomeUnknown {
            source: "lost".into(),
        })])),
        fail_fenced: true,
        get: Some(theirs),
        ..Scripted::default()
    });
    let e = engine(store, Policy::default().heartbeat(None));
    let key = IdempotencyKey::new("k").expect("key");
    let scope = Scope::new("engine-tests").expect("scope");
    let got = e
        .run(&key, &scope, &fp(), |_| async {
            Err::<String, String>("declined".into())
        })
        .await;
    assert!(
        matches!(&got, Ok(Answer::Executed(Err(e))) if e == "declined"),
        "the run got {got:?}"
    );
}

/// A completion that failed, then was fenced on its retry, is an applied one only if the
/// record shows this holder's token in the Completed state; a record another holder took
/// over or completed meanwhile means this outcome was not stored.
#[tokio::test]
async fn a_fence_after_a_failed_try_is_checked_against_the_record() {
    let mut theirs = pending(1000);
    theirs.token = FencingToken(6);
    let mut their_completed = theirs.clone();
    their_completed.status = RecordStatus::Completed;
    their_completed.outcome = Some(b"theirs".to_vec());
    let mut ours_failed = pending(1000);
    ours_failed.status = RecordStatus::Failed;
    for (record, applied) in [
        (theirs, false),
        (their_completed, false),
        (ours_failed, false),
        (
            Record {
                status: RecordStatus::Completed,
                lease_until: None,
                outcome: Some(b"x".to_vec()),
                ..pending(0)
            },
            true,
        ),
    ] {
        let what = format!("{:?} token {}", record.status, record.token);
        let store = Arc::new(Scripted {
            completes: Mutex::new(VecDeque::from([Err(Error::backend(true, "flaky"))])),
            complete_fenced: true,
            get: Some(record),
            ..Scripted::default()
        });
        let lease = lease_on(store, Policy::default());
        match (lease.complete(b"x").await, applied) {
            (Ok(()), true) | (Err(Error::LeaseLost { .. }), false) => {}
            (other, _) => panic!("record {what}: the completion got {other:?}"),
        }
    }
}

/// A store error says which operation failed on which record, with the key hashed when
/// the policy hashes keys in logs, and whether a retry is safe.
#[tokio::test]
async fn store_errors_name_the_operation_and_the_record() {
    let failing = || {
        Mutex::new(VecDeque::from(
            [(); 8].map(|()| Err(Error::backend(true, "connection reset"))),
        ))
    };
    for hashed in [false, true] {
        let policy = Policy::default().hash_keys_in_logs(hashed);
        let store = Arc::new(Scripted {
            completes: failing(),
            ..Scripted::default()
        });
        let err = lease_on(store, policy.clone())
            .complete(b"x")
            .await
            .expect_err("every try fails");
        assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err:?}");
        let call = err.store_call().expect("the error says where");
        assert_eq!(call.operation, Operation::Complete);
        let key = loggable_key(&id().key, hashed);
        assert_eq!(call.record, format!("engine-tests#{key}"));
        assert_eq!(key.starts_with("sha256:"), hashed);
        let line = err.to_string();
        assert!(line.contains("complete of record engine-tests#"), "{line}");
        assert_eq!(line.contains("#k:"), !hashed, "{line}");
    }
    // Claims too, with the retry hint.
    let err = Error::backend(false, "refused").during(Operation::Claim, "s#sha256:abc");
    assert_eq!(
        err.to_string(),
        "store error (not retryable as is): claim of record s#sha256:abc: refused"
    );
    // Saying where twice keeps the first (innermost) place.
    let again = err.during(Operation::Get, "other");
    assert_eq!(
        again.store_call().map(|c| c.operation),
        Some(Operation::Claim)
    );
}

/// With a retention shorter than the retries, a fence after a failed try may hide an
/// applied try whose record has since expired: a record gone or held by another token is
/// `OutcomeUnknown`; one that still holds this token in another state is `LeaseLost`.
#[tokio::test]
async fn a_fence_after_a_failed_try_with_a_short_retention() {
    let mut theirs = pending(1000);
    theirs.token = FencingToken(6);
    let mut ours_failed = pending(1000);
    ours_failed.status = RecordStatus::Failed;
    for (record, unknown) in [
        (None, true),
        (Some(theirs), true),
        (Some(ours_failed), false),
    ] {
        let what = format!("{record:?}");
        let store = Arc::new(Scripted {
            completes: Mutex::new(VecDeque::from([Err(Error::backend(true, "flaky"))])),
            complete_fenced: true,
            get: record,
            ..Scripted::default()
        });
        let lease = lease_on(
            store,
            Policy::default().retention(Duration::from_millis(500)),
        );
        match (lease.complete(b"x").await, unknown) {
            (Err(Error::OutcomeUnknown { .. }), true) | (Err(Error::LeaseLost { .. }), false) => {}
            (other, _) => panic!("record {what}: the completion got {other:?}"),
        }
    }
}

/// Every try of a completion failed, but one had applied (its answer lost, the later tries
/// refused by a store error): the failure that would stand in for the outcome is fenced,
/// and the record, read back, is this holder's Completed one. The outcome is stored:
/// success, not `OutcomeUnknown`.
#[tokio::test]
async fn an_outcome_found_stored_after_every_try_failed_is_success() {
    let completed = Record {
        status: RecordStatus::Completed,
        lease_until: None,
        outcome: Some(b"x".to_vec()),
        ..pending(10_000)
    };
    let store = Arc::new(Scripted {
        completes: Mutex::new(VecDeque::from([
            Err(Error::backend(true, "answer lost")),
            Err(Error::backend(true, "connection reset")),
        ])),
        fail_fenced: true,
        get: Some(completed),
        ..Scripted::default()
    });
    let policy = Policy::default().settle_retry(SettleRetry::new(
        2,
        Duration::from_millis(1),
        Duration::from_millis(1),
    ));
    let got = lease_on(store, policy).complete(b"x").await;
    assert!(got.is_ok(), "{got:?}");
}

/// The failure that stands in for an unstorable outcome "applied" to a record that is gone
/// (purged, evicted, lost with the store's data): nothing stands in for the outcome, and the
/// caller is told the outcome is unknown.
#[tokio::test]
async fn a_stand_in_for_a_record_that_is_gone_is_not_recorded() {
    let store = Arc::new(Scripted {
        completes: Mutex::new(VecDeque::from([Err(Error::backend(false, "too large"))])),
        fail_fenced: true,
        get: None,
        ..Scripted::default()
    });
    let policy = Policy::default().settle_retry(SettleRetry::new(
        1,
        Duration::from_millis(1),
        Duration::from_millis(1),
    ));
    let got = lease_on(store, policy).complete(b"x").await;
    assert!(matches!(got, Err(Error::OutcomeUnknown { .. })), "{got:?}");
}
