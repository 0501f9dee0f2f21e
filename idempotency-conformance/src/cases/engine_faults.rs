//! The engine under adverse timing and a failing store: the work must never run twice
//! because storing its outcome failed, a fenced heartbeat must lose the completion, and
//! every dropped or abandoned work must follow the documented release rule.

use super::{fp, present};
use crate::{Fault, FlakyOp, FlakyStore, TestStore, TimeControl};
use idempotency_core::protocol::Begin;
use idempotency_core::store::{Failure, Reclaim, RecordStatus};
use idempotency_core::{
    Answer, Error, Idempotency, IdempotencyKey, IdempotencyStore, InFlight, Policy, RecordId,
    Refusal, Scope,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Barrier};

type Run = Result<Answer<Result<String, String>>, Error>;

fn address(label: &str) -> (IdempotencyKey, Scope, RecordId) {
    let key = IdempotencyKey::random();
    let scope = Scope::from_parts(["conformance-engine-faults", label]).expect("valid scope");
    let id = RecordId::new(key.clone(), scope.clone());
    (key, scope, id)
}

fn engine_on(store: Arc<dyn IdempotencyStore>, policy: Policy) -> Idempotency {
    Idempotency::new(store, policy).expect("valid policy")
}

/// Runs a work that counts its executions and returns `Ok(value)`.
async fn counted(
    e: &Idempotency,
    key: &IdempotencyKey,
    scope: &Scope,
    runs: &Arc<AtomicUsize>,
    value: &str,
) -> Run {
    let (runs, value) = (runs.clone(), value.to_string());
    e.run(key, scope, &fp("f"), move |_| async move {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, String>(value)
    })
    .await
}

/// A store error on `complete` after the work ran never lets a retry run it again. A
/// transient error is retried and the outcome stored; a lost answer (the write applied) is
/// recognised; a completion refused through every try (an outcome over the store's item
/// limit) gets `OutcomeUnknown` and a permanent failure recorded in the outcome's place, so
/// retries are refused with `OutcomeLost`, now and after the lease, and another payload is a
/// `KeyReused`; a store that refuses that
/// write too leaves the record Pending, and a retry 100 ms later is told `InProgress`
/// (one-hour lease), not given the key.
pub async fn engine_failed_completion_holds_key(t: TestStore) {
    let policy = Policy::default().lease(t.long()).retention(t.long());
    for fault in [Fault::Refused, Fault::AckLost] {
        // One failed completion: the engine tries again and the outcome is stored.
        let flaky = FlakyStore::new(t.store.clone(), fault);
        let e = engine_on(Arc::new(flaky.clone()), policy.clone());
        let (key, scope, id) = address("complete-once");
        let runs = Arc::new(AtomicUsize::new(0));
        flaky.inject(FlakyOp::Complete, 1);
        match counted(&e, &key, &scope, &runs, "paid").await {
            Ok(Answer::Executed(Ok(v))) => assert_eq!(v, "paid"),
            other => panic!(
                "{fault:?}: one failed completion must be retried and the outcome stored, got \
                 {other:?}"
            ),
        }
        assert_eq!(flaky.injected(), 1, "{fault:?}: the fault was not injected");
        let r = present(&t, &id).await;
        assert_eq!(r.status, RecordStatus::Completed, "{fault:?}: {r:?}");
        match counted(&e, &key, &scope, &runs, "again").await {
            Ok(Answer::Replayed(Ok(v))) => assert_eq!(v, "paid"),
            other => panic!("{fault:?}: the retry got {other:?}, expected the replay"),
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{fault:?}: the work ran twice"
        );
    }

    // Completion refused through every try, the store otherwise up: the failure recorded in
    // the outcome's place answers every retry, and nothing runs again.
    let flaky = FlakyStore::new(t.store.clone(), Fault::Refused);
    let e = engine_on(Arc::new(flaky.clone()), policy.clone());
    let (key, scope, id) = address("complete-refused");
    let runs = Arc::new(AtomicUsize::new(0));
    flaky.inject(FlakyOp::Complete, u64::MAX / 2);
    match counted(&e, &key, &scope, &runs, "charged").await {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!(
            "a work whose outcome cannot be stored must report OutcomeUnknown, got {other:?}"
        ),
    }
    let r = present(&t, &id).await;
    assert_eq!(r.status, RecordStatus::Failed, "{r:?}");
    let failure = r.failure.as_ref().expect("the failure is recorded");
    assert!(
        !failure.retryable && failure.message.contains("could not be stored"),
        "the record must say the work ran and its outcome was lost, for good: {failure:?}"
    );
    for _ in 0..2 {
        match counted(&e, &key, &scope, &runs, "second charge").await {
            Ok(Answer::Refused(Refusal::OutcomeLost { .. })) => {}
            other => panic!("a retry after an unstorable outcome got {other:?}"),
        }
    }
    flaky.heal(FlakyOp::Complete);
    match counted(&e, &key, &scope, &runs, "second charge").await {
        Ok(Answer::Refused(Refusal::OutcomeLost { .. })) => {}
        other => panic!("a retry once the store keeps outcomes again got {other:?}"),
    }
    // Another payload under the key is a mismatch, as against a stored outcome.
    let other = {
        let runs = runs.clone();
        e.run(&key, &scope, &fp("another payload"), move |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>("other".to_owned())
        })
        .await
    };
    assert!(
        matches!(other, Ok(Answer::Refused(Refusal::KeyReused))),
        "another payload under a key whose outcome was lost got {other:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran twice");

    // Completion and the failure both keep failing: no release, the retry waits for the
    // lease.
    let flaky = FlakyStore::new(t.store.clone(), Fault::Refused);
    let e = engine_on(Arc::new(flaky.clone()), policy.clone());
    let (key, scope, id) = address("complete-down");
    let runs = Arc::new(AtomicUsize::new(0));
    flaky.inject(FlakyOp::Complete, u64::MAX / 2);
    flaky.inject(FlakyOp::Fail, u64::MAX / 2);
    match counted(&e, &key, &scope, &runs, "charged").await {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!(
            "a work whose outcome cannot be stored must report OutcomeUnknown, got {other:?}"
        ),
    }
    flaky.heal(FlakyOp::Complete);
    flaky.heal(FlakyOp::Fail);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = present(&t, &id).await;
    assert_eq!(
        r.status,
        RecordStatus::Pending,
        "after the work ran, a failed completion released the key: {r:?}"
    );
    match counted(&e, &key, &scope, &runs, "second charge").await {
        Ok(Answer::Refused(Refusal::InProgress { .. })) => {}
        other => panic!(
            "a retry 100 ms after a failed completion got {other:?}: it must wait for the \
             lease, not run the work again"
        ),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran twice");
}

/// The heartbeat finds the lease taken over mid-work: the lease is marked lost, and the
/// completion is refused with `LeaseLost`, leaving the new holder's record untouched (no
/// outcome stored under its token).
pub async fn engine_fenced_heartbeat_loses_completion(t: TestStore) {
    let lease = Duration::from_millis(300);
    let e = engine_on(
        t.store.clone(),
        Policy::default()
            .lease(lease)
            .retention(t.long())
            .heartbeat(Some(0.2)),
    );
    let long = t.long();
    let (_, _, id) = address("fenced");
    let Begin::Execute(lease_held) = e.begin(&id, &fp("f")).await.expect("begin") else {
        panic!("a fresh key replayed");
    };
    let old = lease_held.token();
    // Someone takes the key over while the work runs (an operator, a reclaimer after a
    // pause): fail it with the holder's token, then reclaim it.
    let store = t.store.clone();
    let taken = {
        let id = id.clone();
        async move {
            store
                .fail(&id, old, &Failure::retryable("taken over"), long)
                .await
                .expect("fail");
            match store
                .reclaim(&id, old, &fp("f"), long, long)
                .await
                .expect("reclaim")
            {
                Reclaim::Reclaimed { token, .. } => token,
                Reclaim::Lost => panic!("the takeover's reclaim was lost"),
            }
        }
    };
    let work = async {
        let new = taken.await;
        // Give the heartbeat (every 60 ms) several beats to find the takeover.
        tokio::time::sleep(Duration::from_millis(400)).await;
        new
    };
    let new = lease_held.with_heartbeat(work).await;
    assert!(
        lease_held.is_lost(),
        "the heartbeat's extend was fenced, but the lease does not say it is lost"
    );
    match lease_held.complete(b"stale outcome").await {
        Err(Error::LeaseLost { token }) => assert_eq!(token, old),
        other => panic!("a fenced holder's completion got {other:?}, expected LeaseLost"),
    }
    let r = present(&t, &id).await;
    assert_eq!(r.status, RecordStatus::Pending, "{r:?}");
    assert_eq!(r.token, new, "the new holder's token was replaced: {r:?}");
    assert_eq!(r.outcome, None, "the fenced holder's outcome was stored");

    // The same through `run`: the outcome is not stored and the caller learns it.
    let (key, scope, id) = address("fenced-run");
    let store = t.store.clone();
    let got: Run = e
        .run(&key, &scope, &fp("f"), move |ctx| async move {
            store
                .fail(&ctx.id, ctx.token, &Failure::retryable("taken over"), long)
                .await
                .expect("fail");
            store
                .reclaim(&ctx.id, ctx.token, &fp("f"), long, long)
                .await
                .expect("reclaim");
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok("stale".to_string())
        })
        .await;
    assert!(
        matches!(got, Err(Error::LeaseLost { .. })),
        "run after a takeover got {got:?}"
    );
    let r = present(&t, &id).await;
    assert_eq!(r.outcome, None, "the fenced run stored its outcome: {r:?}");
}

/// With `InFlight::Wait`: a waiter takes the key over when the holder fails, and runs its own
/// work once; a waiter gives up with `InProgress` once `max_wait` has passed; and one waiting
/// request counts one hit however many times it polls.
pub async fn engine_wait_policy_takes_over_and_gives_up(t: TestStore) {
    let waiting = |max_wait| {
        Policy::default()
            .lease(t.long())
            .retention(t.long())
            .count_hits(true)
            .in_flight(InFlight::Wait {
                max_wait,
                initial_backoff: Duration::from_millis(5),
                max_backoff: Duration::from_millis(40),
            })
    };
    // The holder fails: the waiter takes over.
    let e = engine_on(t.store.clone(), waiting(Duration::from_secs(20)));
    let (key, scope, id) = address("wait-takeover");
    let Begin::Execute(holder) = e.begin(&id, &fp("f")).await.expect("begin") else {
        panic!("a fresh key replayed");
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let waiter = {
        let (e, key, scope, runs) = (e.clone(), key.clone(), scope.clone(), runs.clone());
        tokio::spawn(async move { counted(&e, &key, &scope, &runs, "waiter ran").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the waiter ran while held");
    holder
        .fail(Failure::retryable("holder failed"))
        .await
        .expect("fail");
    match waiter.await.expect("waiter task") {
        Ok(Answer::Executed(Ok(v))) => assert_eq!(v, "waiter ran"),
        other => panic!("a waiter whose holder failed got {other:?}, expected to run"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let r = present(&t, &id).await;
    assert_eq!(r.hits, 1, "one waiting request counted {} hits", r.hits);

    // The holder never settles: the waiter gives up at max_wait.
    let max_wait = Duration::from_millis(400);
    let e = engine_on(t.store.clone(), waiting(max_wait));
    let (key, scope, id) = address("wait-give-up");
    let Begin::Execute(holder) = e.begin(&id, &fp("f")).await.expect("begin") else {
        panic!("a fresh key replayed");
    };
    let started = Instant::now();
    match counted(&e, &key, &scope, &runs, "never").await {
        Ok(Answer::Refused(Refusal::InProgress { retry_after })) => {
            assert!(
                !retry_after.is_zero(),
                "retry_after of a live lease is zero"
            )
        }
        other => panic!("a waiter past max_wait got {other:?}, expected InProgress"),
    }
    let waited = started.elapsed();
    assert!(
        waited >= max_wait,
        "the waiter gave up after {waited:?}, before max_wait {max_wait:?}"
    );
    assert!(
        waited < max_wait + Duration::from_secs(3),
        "the waiter kept waiting for {waited:?} with max_wait {max_wait:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the give-up waiter ran");
    let r = present(&t, &id).await;
    assert_eq!(r.hits, 1, "one waiting request counted {} hits", r.hits);
    holder.fail(Failure::retryable("done")).await.expect("fail");
}

/// Concurrent requests for a key whose lease passed: one reclaims, the others lose the CAS;
/// each request counts exactly one hit (a lost reclaim re-reads, it does not claim again).
pub async fn engine_each_request_counts_one_hit(t: TestStore) {
    // The stalled holder's lease is short, so the case can wait it out; the takers' is long,
    // so that no taker's lease passes while its work runs however slow the machine is (a
    // taker that lost its lease would let another run the work, which is allowed).
    let stalling = engine_on(
        t.store.clone(),
        Policy::default()
            .lease(t.short_lease())
            .retention(t.long())
            .count_hits(true),
    );
    let e = engine_on(
        t.store.clone(),
        Policy::default()
            .lease(t.long())
            .retention(t.long())
            .count_hits(true),
    );
    let (key, scope, id) = address("hits");
    let Begin::Execute(stalled) = stalling.begin(&id, &fp("f")).await.expect("begin") else {
        panic!("a fresh key replayed");
    };
    t.advance(t.short_lease()).await;
    let n = 16;
    let barrier = Arc::new(Barrier::new(n));
    let runs = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (e, key, scope, runs, barrier) = (
                e.clone(),
                key.clone(),
                scope.clone(),
                runs.clone(),
                barrier.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                let (runs2, e2) = (runs.clone(), e.clone());
                e2.run(&key, &scope, &fp("f"), move |_| async move {
                    runs2.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok::<_, String>("taken over".to_string())
                })
                .await
            })
        })
        .collect();
    for task in tasks {
        match task.await.expect("task") {
            Ok(Answer::Executed(Ok(_)) | Answer::Replayed(Ok(_)))
            | Ok(Answer::Refused(Refusal::InProgress { .. })) => {}
            other => panic!("a concurrent taker got {other:?}"),
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the work ran more than once"
    );
    let r = present(&t, &id).await;
    assert_eq!(
        r.hits, n as u64,
        "{n} requests counted {} hits (a lost reclaim claimed again?)",
        r.hits
    );
    drop(stalled);
}

/// The release rule, case by case. Released at once: the work returned an error the policy
/// releases (see `engine_error_not_stored`) or panicked. Held until the lease passes: the
/// work's future was dropped part-way (it may have acted), a lease from `begin` was dropped
/// unsettled, and a completion that could not be stored.
pub async fn engine_abandoned_work_holds_key_until_lease(t: TestStore) {
    let runs = Arc::new(AtomicUsize::new(0));
    for how in [
        Abandoned::TimedOut,
        Abandoned::Aborted,
        Abandoned::LeaseDropped,
    ] {
        // "Held" can only be seen while the lease is live: on a real clock a machine that
        // stalls past the lease between the abandonment and the retry proves nothing, so the
        // case runs again with a lease twice as long, a few times.
        let mut lease = t.short_lease();
        let mut seen = false;
        for _ in 0..5 {
            if abandoned_then_held(&t, how, lease, &runs).await {
                seen = true;
                break;
            }
            lease *= 2;
        }
        assert!(
            seen,
            "{how:?}: every retry came after the lease could have passed (the last one {lease:?})"
        );
    }
}

/// How a work is abandoned.
#[derive(Clone, Copy, Debug)]
enum Abandoned {
    /// Dropped part-way by a timeout, after its side effect.
    TimedOut,
    /// Its task aborted while it ran.
    Aborted,
    /// A lease from `begin`, dropped without being settled.
    LeaseDropped,
}

/// Abandons a work `how` under a lease of `lease`, then checks [`held_then_runs`]. `false`
/// when the retry came too late to tell (the lease could have passed).
async fn abandoned_then_held(
    t: &TestStore,
    how: Abandoned,
    lease: Duration,
    runs: &Arc<AtomicUsize>,
) -> bool {
    let e = engine_on(
        t.store.clone(),
        Policy::default().lease(lease).retention(t.long()),
    );
    let (key, scope, id) = address("abandoned");
    let claimed = Instant::now();
    match how {
        Abandoned::TimedOut => {
            // A caller's timeout that fires once the work has acted: the timer starts when
            // the work does, so a slow claim (a loaded machine, a remote store) cannot make
            // it fire before the side effect.
            let effects = Arc::new(AtomicUsize::new(0));
            let (started_tx, started_rx) = oneshot::channel();
            let fingerprint = fp("f");
            let run = {
                let effects = effects.clone();
                e.run(&key, &scope, &fingerprint, move |_| async move {
                    effects.fetch_add(1, Ordering::SeqCst);
                    let _ = started_tx.send(());
                    futures::future::pending::<()>().await;
                    Ok::<String, String>("never".into())
                })
            };
            tokio::pin!(run);
            tokio::select! {
                _ = &mut run => panic!("the never-ending work finished"),
                started = started_rx => started.expect("the work started"),
            }
            let timed_out = tokio::time::timeout(Duration::from_millis(100), &mut run).await;
            assert!(timed_out.is_err(), "the never-ending work finished");
            assert_eq!(effects.load(Ordering::SeqCst), 1);
        }
        Abandoned::Aborted => {
            let (started_tx, started_rx) = oneshot::channel();
            let task = {
                let (e, key, scope) = (e.clone(), key.clone(), scope.clone());
                tokio::spawn(async move {
                    e.run(&key, &scope, &fp("f"), move |_| async move {
                        let _ = started_tx.send(());
                        futures::future::pending::<()>().await;
                        Ok::<String, String>("never".into())
                    })
                    .await
                })
            };
            started_rx.await.expect("the work started");
            task.abort();
            assert!(
                task.await.expect_err("aborted").is_cancelled(),
                "the task was not cancelled"
            );
        }
        Abandoned::LeaseDropped => {
            let Begin::Execute(lease) = e.begin(&id, &fp("f")).await.expect("begin") else {
                panic!("a fresh key replayed");
            };
            drop(lease);
        }
    }
    held_then_runs(t, &e, &key, &scope, &id, runs, claimed, &format!("{how:?}")).await
}

/// Asserts that the key stays Pending with a live lease (a retry is told `InProgress` and
/// does not run), then that a retry runs once the lease has passed. `false`, having checked
/// nothing about the hold, when the first retry ran and ended after the lease (claimed at
/// `claimed`) could have passed: then it was entitled to.
#[allow(clippy::too_many_arguments)]
async fn held_then_runs(
    t: &TestStore,
    e: &Idempotency,
    key: &IdempotencyKey,
    scope: &Scope,
    id: &RecordId,
    runs: &Arc<AtomicUsize>,
    claimed: Instant,
    what: &str,
) -> bool {
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = runs.load(Ordering::SeqCst);
    let r = present(t, id).await;
    assert_eq!(
        r.status,
        RecordStatus::Pending,
        "{what} released the key at once (it may have acted): {r:?}"
    );
    match counted(e, key, scope, runs, "retry").await {
        Ok(Answer::Refused(Refusal::InProgress { .. })) => {}
        Ok(Answer::Executed(Ok(_))) if claimed.elapsed() >= e.policy().lease => return false,
        other => panic!("a retry right after {what} got {other:?}, expected InProgress"),
    }
    t.advance(e.policy().lease).await;
    match counted(e, key, scope, runs, "retry").await {
        Ok(Answer::Executed(Ok(v))) => assert_eq!(v, "retry"),
        other => panic!("a retry after the lease of {what} passed got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), before + 1);
    true
}

/// A permanent failure (`Failure::retryable = false`) is final for its payload: the same
/// request gets `FailedPermanently` and does not run, while a corrected request (another
/// fingerprint) takes the key over and runs once.
pub async fn engine_permanent_failure_is_final(t: TestStore) {
    let e = engine_on(
        t.store.clone(),
        Policy::default().lease(t.long()).retention(t.long()),
    );
    let (key, scope, id) = address("permanent");
    let runs = Arc::new(AtomicUsize::new(0));
    let first = {
        let runs = runs.clone();
        e.run_with(
            &key,
            &scope,
            &fp("f"),
            |_: &Result<String, String>| {
                idempotency_core::protocol::Disposition::Release(Failure::permanent(
                    "card declined",
                ))
            },
            move |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<String, String>("declined".into())
            },
        )
        .await
    };
    assert!(
        matches!(first, Ok(Answer::Executed(Err(_)))),
        "the failing work: {first:?}"
    );
    let r = present(&t, &id).await;
    assert_eq!(r.status, RecordStatus::Failed);
    assert_eq!(
        r.failure.as_ref().map(|f| f.retryable),
        Some(false),
        "the permanent failure was not stored as such: {r:?}"
    );
    match counted(&e, &key, &scope, &runs, "again").await {
        Ok(Answer::Refused(Refusal::FailedPermanently { message })) => {
            assert_eq!(message, "card declined")
        }
        other => panic!("the same request after a permanent failure got {other:?}"),
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a permanently failed request ran again"
    );
    let corrected = e
        .run(&key, &scope, &fp("corrected"), |_| async {
            Ok::<_, String>("fixed".to_string())
        })
        .await;
    assert!(
        matches!(&corrected, Ok(Answer::Executed(Ok(v))) if v == "fixed"),
        "a corrected request after a permanent failure got {corrected:?}"
    );
}

/// A work that hangs stops being extended once `max_work_time` has passed since the claim:
/// its lease then passes, a retry takes the key over and runs, and the hung work's completion
/// is refused with `LeaseLost`.
pub async fn engine_hung_work_stops_being_extended(t: TestStore) {
    let lease = Duration::from_millis(300);
    let e = engine_on(
        t.store.clone(),
        Policy::default()
            .lease(lease)
            .retention(t.long())
            .heartbeat(Some(1.0 / 3.0))
            .max_work_time(Duration::from_millis(600)),
    );
    let (key, scope, _) = address("hung");
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let hung = {
        let (e, key, scope) = (e.clone(), key.clone(), scope.clone());
        tokio::spawn(async move {
            e.run(&key, &scope, &fp("f"), move |_| async move {
                let _ = release_rx.await;
                Ok::<_, String>("hung work".to_string())
            })
            .await
        })
    };
    // Past max_work_time plus a lease on the real clock.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    if let TimeControl::Manual(_) = t.time {
        // Move the store's clock past the last extension, then give a heartbeat that would
        // still be running the time to extend again from the new time.
        t.advance(Duration::from_secs(10)).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let runs = Arc::new(AtomicUsize::new(0));
    match counted(&e, &key, &scope, &runs, "retry").await {
        Ok(Answer::Executed(Ok(v))) => assert_eq!(v, "retry"),
        other => panic!(
            "a retry after the hung work's max_work_time and lease got {other:?}: the heartbeat \
             kept extending the lease"
        ),
    }
    release_tx.send(()).expect("the hung work is waiting");
    match hung.await.expect("hung task") {
        Err(Error::LeaseLost { .. }) => {}
        other => panic!("the hung work's completion after a takeover got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
