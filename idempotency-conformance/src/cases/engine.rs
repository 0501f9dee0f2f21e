//! The engine (`idempotency_core::Idempotency`) on top of the store: what users rely on.

use super::{fp, present};
use crate::TestStore;
use idempotency_core::protocol::Begin;
use idempotency_core::store::{Failure, RecordStatus};
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, InFlight, Policy, RecordId, Refusal,
    Scope,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, Barrier};

type Run = Result<Answer<Result<String, String>>, Error>;

fn engine(t: &TestStore, policy: Policy) -> Idempotency {
    Idempotency::new(t.store.clone(), policy).expect("valid policy")
}

fn fresh_address(label: &str) -> (IdempotencyKey, Scope) {
    (
        IdempotencyKey::random(),
        Scope::from_parts(["conformance-engine", label]).expect("valid scope"),
    )
}

/// Runs a work that counts its executions and returns `Ok(value)`.
async fn counted(
    e: &Idempotency,
    key: &IdempotencyKey,
    scope: &Scope,
    fingerprint: &Fingerprint,
    runs: &Arc<AtomicUsize>,
    value: &str,
) -> Run {
    let (runs, value) = (runs.clone(), value.to_string());
    e.run(key, scope, fingerprint, move |_| async move {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, String>(value)
    })
    .await
}

/// 64 concurrent `run` calls with one key: the work runs exactly once; every other call gets
/// `InProgress` or a replay of its outcome; later calls replay it.
pub async fn engine_concurrent_runs_execute_once(t: TestStore) {
    for round in 0..3 {
        let e = engine(&t, Policy::default().lease(t.long()).retention(t.long()));
        let (key, scope) = fresh_address("race");
        let runs = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(64));
        let tasks: Vec<_> = (0..64)
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
                    e.run(&key, &scope, &fp("order"), move |_| async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<_, String>("receipt".to_string())
                    })
                    .await
                })
            })
            .collect();
        let (mut fresh, mut replayed, mut in_progress) = (0, 0, 0);
        for task in tasks {
            match task.await.expect("run task") {
                Ok(Answer::Executed(Ok(v))) if v == "receipt" => fresh += 1,
                Ok(Answer::Replayed(Ok(v))) if v == "receipt" => replayed += 1,
                Ok(Answer::Refused(Refusal::InProgress { .. })) => in_progress += 1,
                other => panic!("round {round}: unexpected answer {other:?}"),
            }
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "round {round}: the work ran {} times for one key",
            runs.load(Ordering::SeqCst)
        );
        assert_eq!(fresh, 1, "round {round}: {fresh} fresh outcomes");
        assert_eq!(fresh + replayed + in_progress, 64);
        match counted(&e, &key, &scope, &fp("order"), &runs, "again").await {
            Ok(Answer::Replayed(Ok(v))) => assert_eq!(v, "receipt"),
            other => panic!("round {round}: a later retry got {other:?}, expected a replay"),
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}

/// A work that panics may have acted before it panicked (charged, then failed to build its
/// answer): the key is settled for good, with a permanent failure in the outcome's place
/// ([`idempotency_core::store::Failure::outcome_not_stored`]). The panic goes on to the caller; a
/// retry is refused with [`Refusal::OutcomeLost`], also after the lease has passed, another
/// payload with [`Refusal::KeyReused`], and neither runs the work.
pub async fn engine_panic_holds_key(t: TestStore) {
    let e = engine(
        &t,
        Policy::default()
            .lease(t.short_lease())
            .retention(t.long())
            .heartbeat(None),
    );
    let (key, scope) = fresh_address("panic");
    let explode = true;
    let task = {
        let (e, key, scope) = (e.clone(), key.clone(), scope.clone());
        tokio::spawn(async move {
            e.run(&key, &scope, &fp("p"), move |_| async move {
                if explode {
                    panic!("deliberate panic inside the work (conformance case)");
                }
                Ok::<String, String>("unreachable".into())
            })
            .await
        })
    };
    let err = task.await.expect_err("the panic must reach the caller");
    assert!(err.is_panic(), "the run task ended without a panic: {err}");
    let r = present(&t, &RecordId::new(key.clone(), scope.clone())).await;
    assert!(
        r.status == RecordStatus::Failed
            && r.failure
                .as_ref()
                .is_some_and(idempotency_core::store::Failure::is_outcome_not_stored),
        "a panicking work must settle the key with the outcome-not-stored failure, found {r:?}"
    );
    let runs = Arc::new(AtomicUsize::new(0));
    for when in ["at once", "after the lease"] {
        match counted(&e, &key, &scope, &fp("p"), &runs, "after panic").await {
            Ok(Answer::Refused(Refusal::OutcomeLost { .. })) => {}
            other => {
                panic!("a retry {when} after a panic got {other:?}, expected OutcomeLost")
            }
        }
        match counted(&e, &key, &scope, &fp("other"), &runs, "other").await {
            Ok(Answer::Refused(Refusal::KeyReused)) => {}
            other => {
                panic!("another payload {when} after a panic got {other:?}, expected KeyReused")
            }
        }
        t.advance(t.short_lease()).await;
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the work ran again after a panic"
    );
}

/// An `Err` outcome is not stored (by default): the key is released, the retry runs, and
/// its `Ok` is what later calls replay.
pub async fn engine_error_not_stored(t: TestStore) {
    let e = engine(&t, Policy::default().lease(t.long()).retention(t.long()));
    let (key, scope) = fresh_address("error");
    let runs = Arc::new(AtomicUsize::new(0));
    let first = {
        let runs = runs.clone();
        e.run(&key, &scope, &fp("e"), move |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Err::<String, String>("transient failure".into())
        })
        .await
    };
    match first {
        Ok(Answer::Executed(Err(msg))) => assert_eq!(msg, "transient failure"),
        other => panic!("the failing work returned {other:?}"),
    }
    let r = present(&t, &RecordId::new(key.clone(), scope.clone())).await;
    assert_eq!(
        r.status,
        RecordStatus::Failed,
        "an Err outcome must release the key"
    );
    assert_eq!(r.outcome, None, "an Err outcome was stored");
    match counted(&e, &key, &scope, &fp("e"), &runs, "second try").await {
        Ok(Answer::Executed(Ok(v))) => assert_eq!(v, "second try"),
        other => panic!("the retry after an error got {other:?}, expected a fresh run"),
    }
    match counted(&e, &key, &scope, &fp("e"), &runs, "third").await {
        Ok(Answer::Replayed(Ok(v))) => assert_eq!(v, "second try"),
        other => panic!("a call after the success got {other:?}, expected its replay"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A work error of any length releases the key as usual: the message kept in the record is
/// cut to [`Failure::MAX_MESSAGE`] bytes on a character boundary (no store refuses it for its
/// size: a column, an item limit), while the caller gets the whole error; a retry runs.
pub async fn engine_long_failure_messages_are_bounded(t: TestStore) {
    let e = engine(&t, Policy::default().lease(t.long()).retention(t.long()));
    let (key, scope) = fresh_address("long-failure");
    // 100 KiB of two-, three- and four-byte characters: a cut at a byte count would land
    // inside one.
    let message = "é€𝄞".repeat(100 * 1024 / 9);
    let first = {
        let message = message.clone();
        e.run(&key, &scope, &fp("f"), move |_| async move {
            Err::<String, String>(message)
        })
        .await
    };
    match first {
        Ok(Answer::Executed(Err(returned))) => {
            assert!(
                returned == message,
                "the caller did not get the whole error"
            )
        }
        other => panic!("the failing work returned {other:?}"),
    }
    let r = present(&t, &RecordId::new(key.clone(), scope.clone())).await;
    assert_eq!(
        r.status,
        RecordStatus::Failed,
        "the key was not released: {r:?}"
    );
    let kept = &r.failure.as_ref().expect("a failure").message;
    assert!(
        kept.len() <= Failure::MAX_MESSAGE && kept.len() >= Failure::MAX_MESSAGE / 2,
        "kept {} bytes of the message, expected at most {} and not much less",
        kept.len(),
        Failure::MAX_MESSAGE
    );
    let kept_text = kept.trim_end_matches('…');
    assert!(
        message.starts_with(kept_text),
        "the kept message is not the start of the error"
    );
    let runs = Arc::new(AtomicUsize::new(0));
    match counted(&e, &key, &scope, &fp("f"), &runs, "second try").await {
        Ok(Answer::Executed(Ok(v))) => assert_eq!(v, "second try"),
        other => panic!("the retry after a long error got {other:?}, expected a fresh run"),
    }
}

/// With `InFlight::Wait`, callers arriving while the first attempt runs wait for it and
/// replay its outcome; their own work never runs.
pub async fn engine_wait_policy_replays(t: TestStore) {
    let e = engine(
        &t,
        Policy::default()
            .lease(t.long())
            .retention(t.long())
            .in_flight(InFlight::wait(Duration::from_secs(20))),
    );
    let (key, scope) = fresh_address("wait");
    let (started_tx, started_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let first = {
        let (e, key, scope) = (e.clone(), key.clone(), scope.clone());
        tokio::spawn(async move {
            e.run(&key, &scope, &fp("w"), move |_| async move {
                let _ = started_tx.send(());
                let _ = release_rx.await;
                Ok::<_, String>("first outcome".to_string())
            })
            .await
        })
    };
    started_rx.await.expect("the first work started");
    let runs = Arc::new(AtomicUsize::new(0));
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            let (e, key, scope, runs) = (e.clone(), key.clone(), scope.clone(), runs.clone());
            tokio::spawn(async move { counted(&e, &key, &scope, &fp("w"), &runs, "waiter").await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    release_tx.send(()).expect("the first work is waiting");
    match first.await.expect("first task") {
        Ok(Answer::Executed(Ok(v))) => assert_eq!(v, "first outcome"),
        other => panic!("the first call got {other:?}"),
    }
    for w in waiters {
        match w.await.expect("waiter task") {
            Ok(Answer::Replayed(Ok(v))) => assert_eq!(v, "first outcome"),
            other => panic!("a waiter got {other:?}, expected the first outcome replayed"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "a waiter's work ran");
}

/// A key reused with a different fingerprint is refused with `Refusal::KeyReused`, while the first attempt
/// runs and after it completed; the mismatching work never runs and the record keeps the
/// first outcome.
pub async fn engine_mismatch(t: TestStore) {
    let e = engine(&t, Policy::default().lease(t.long()).retention(t.long()));
    let (key, scope) = fresh_address("mismatch");
    let id = RecordId::new(key.clone(), scope.clone());
    let runs = Arc::new(AtomicUsize::new(0));

    let Begin::Execute(lease) = e.begin(&id, &fp("original")).await.expect("begin") else {
        panic!("the first begin replayed");
    };
    match counted(&e, &key, &scope, &fp("different"), &runs, "x").await {
        Ok(Answer::Refused(Refusal::KeyReused)) => {}
        other => panic!("a different payload while in flight got {other:?}, expected KeyReused"),
    }
    lease
        .fail(Failure::retryable("released by the case"))
        .await
        .expect("fail");

    match counted(&e, &key, &scope, &fp("original"), &runs, "first").await {
        Ok(Answer::Executed(Ok(v))) => assert_eq!(v, "first"),
        other => panic!("the original payload got {other:?}"),
    }
    let before = present(&t, &id).await;
    match counted(&e, &key, &scope, &fp("different"), &runs, "second").await {
        Ok(Answer::Refused(Refusal::KeyReused)) => {}
        other => panic!("a different payload after completion got {other:?}, expected KeyReused"),
    }
    let after = present(&t, &id).await;
    assert_eq!(
        super::with_hits(&after, before.hits),
        before,
        "a mismatch changed the record"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the mismatching work ran");
}

/// A work that runs for longer than its lease keeps the key: the engine's heartbeat extends
/// the lease through the store, so a retry during the work is told `InProgress` instead of
/// taking the key over, and the work runs once.
pub async fn engine_heartbeat_keeps_long_work_leased(t: TestStore) {
    let lease = Duration::from_millis(900);
    let e = engine(
        &t,
        Policy::default()
            .lease(lease)
            .retention(t.long())
            .heartbeat(Some(1.0 / 3.0)),
    );
    let (key, scope) = fresh_address("heartbeat");
    let (started_tx, started_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let first = {
        let (e, key, scope) = (e.clone(), key.clone(), scope.clone());
        tokio::spawn(async move {
            e.run(&key, &scope, &fp("hb"), move |_| async move {
                let _ = started_tx.send(());
                let _ = release_rx.await;
                Ok::<_, String>("long work".to_string())
            })
            .await
        })
    };
    started_rx.await.expect("the work started");
    let runs = Arc::new(AtomicUsize::new(0));
    // Let the store's clock run well past the original lease, in small steps so that the
    // heartbeat (every lease / 3 of real time) keeps up on a manual clock too.
    let step = Duration::from_millis(150);
    for _ in 0..10 {
        t.advance(step).await;
        if matches!(t.time, crate::TimeControl::Manual(_)) {
            tokio::time::sleep(step).await;
        }
    }
    match counted(&e, &key, &scope, &fp("hb"), &runs, "retry").await {
        Ok(Answer::Refused(Refusal::InProgress { .. })) => {}
        other => panic!(
            "a retry while a heartbeating work runs got {other:?}, expected InProgress (the \
             lease was not extended)"
        ),
    }
    release_tx.send(()).expect("the work is waiting");
    match first.await.expect("first task") {
        Ok(Answer::Executed(Ok(v))) => assert_eq!(v, "long work"),
        other => panic!("the long work got {other:?}, expected its fresh outcome"),
    }
    match counted(&e, &key, &scope, &fp("hb"), &runs, "retry").await {
        Ok(Answer::Replayed(Ok(v))) => assert_eq!(v, "long work"),
        other => panic!("a retry after the long work got {other:?}, expected a replay"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "a retry's work ran");
}
