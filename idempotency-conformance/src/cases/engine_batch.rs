//! The engine's batch entry point (`Idempotency::run_batch`), a queue consumer's poll, on
//! top of the store.

use super::fp;
use crate::{Fault, FlakyOp, FlakyStore, TestStore};
use idempotency_core::protocol::Begin;
use idempotency_core::store::Failure;
use idempotency_core::{
    BatchMessage, BatchReport, Error, Idempotency, IdempotencyKey, MessageOutcome, Policy,
    RecordId, Refusal, Scope,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Barrier;

/// What a message's work does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    Succeed,
    /// Returns an error, which the default policy records as a retryable failure.
    Err,
    Panic,
}

/// Counts executions per message id and the most works in flight at once.
#[derive(Default)]
struct Ledger {
    runs: Mutex<HashMap<String, usize>>,
    in_flight: AtomicUsize,
    most_in_flight: AtomicUsize,
}

impl Ledger {
    fn runs(&self, id: &str) -> usize {
        self.runs
            .lock()
            .expect("lock")
            .get(id)
            .copied()
            .unwrap_or(0)
    }

    fn total(&self) -> usize {
        self.runs.lock().expect("lock").values().sum()
    }
}

type Report = BatchReport<Result<String, String>>;

/// Runs `batch` (message id, payload, act) as one consumer's poll.
async fn consume(
    e: &Idempotency,
    scope: &Scope,
    batch: &[(String, &str, Act)],
    concurrency: usize,
    ledger: &Arc<Ledger>,
) -> Report {
    let messages = batch
        .iter()
        .map(|(id, payload, act)| {
            BatchMessage::new(
                IdempotencyKey::new(id.clone()).expect("valid key"),
                fp(payload),
                (id.clone(), *act),
            )
        })
        .collect();
    e.run_batch(scope, messages, concurrency, |(id, act), _ctx| {
        let ledger = ledger.clone();
        async move {
            *ledger
                .runs
                .lock()
                .expect("lock")
                .entry(id.clone())
                .or_insert(0) += 1;
            let now = ledger.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            ledger.most_in_flight.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(2)).await;
            ledger.in_flight.fetch_sub(1, Ordering::SeqCst);
            match act {
                Act::Succeed => Ok(format!("done {id}")),
                Act::Err => Err(format!("failed {id}")),
                Act::Panic => panic!("the work of {id} panicked"),
            }
        }
    })
    .await
}

fn ran(outcome: &MessageOutcome<Result<String, String>>) -> Option<&Result<String, String>> {
    match outcome {
        MessageOutcome::Executed(r) => Some(r),
        _ => None,
    }
}

fn replayed(outcome: &MessageOutcome<Result<String, String>>) -> Option<&Result<String, String>> {
    match outcome {
        MessageOutcome::Replayed(r) => Some(r),
        _ => None,
    }
}

/// A batch with every kind of message: new ones (one named twice), one already processed, one
/// reused for another payload, one another consumer holds, one whose last run failed, one
/// whose work fails and one whose work panics. Each is decided as a single run would be, the
/// new works run once each and at most `concurrency` at a time, and the report says which to
/// have delivered again. The redelivery of the whole batch then runs only what was released.
pub async fn engine_batch_runs_each_message_once(t: TestStore) {
    let e = Idempotency::new(
        t.store.clone(),
        Policy::default().lease(t.long()).retention(t.long()),
    )
    .expect("valid policy");
    let scope = Scope::from_parts(["conformance-engine", "batch"]).expect("scope");
    let ledger = Arc::new(Ledger::default());
    let id = |label: &str| format!("{label}-{}", IdempotencyKey::random());
    let (done, reused, held, failed_before) =
        (id("done"), id("reused"), id("held"), id("failed-before"));

    // Set up: a message processed earlier, one whose last run failed, one held elsewhere.
    let setup = vec![
        (done.clone(), "done", Act::Succeed),
        (reused.clone(), "first payload", Act::Succeed),
        (failed_before.clone(), "failed before", Act::Err),
    ];
    let report = consume(&e, &scope, &setup, 4, &ledger).await;
    assert_eq!(report.redeliver(), vec![2], "{report:?}");
    let Begin::Execute(holder) = e
        .begin(
            &RecordId::new(
                IdempotencyKey::new(held.clone()).expect("key"),
                scope.clone(),
            ),
            &fp("held"),
        )
        .await
        .expect("begin")
    else {
        panic!("a new key was not claimed");
    };

    let news: Vec<String> = (0..6).map(|i| id(&format!("new{i}"))).collect();
    let (fails, panics) = (id("fails"), id("panics"));
    let batch = vec![
        (news[0].clone(), "n0", Act::Succeed),
        (done.clone(), "done", Act::Succeed),
        (news[1].clone(), "n1", Act::Succeed),
        (reused.clone(), "another payload", Act::Succeed),
        (news[2].clone(), "n2", Act::Succeed),
        (held.clone(), "held", Act::Succeed),
        (news[1].clone(), "n1", Act::Succeed),
        (failed_before.clone(), "failed before", Act::Succeed),
        (fails.clone(), "fails", Act::Err),
        (news[3].clone(), "n3", Act::Succeed),
        (panics.clone(), "panics", Act::Panic),
        (news[4].clone(), "n4", Act::Succeed),
        (news[5].clone(), "n5", Act::Succeed),
    ];
    let before = ledger.total();
    ledger.most_in_flight.store(0, Ordering::SeqCst);
    let report = consume(&e, &scope, &batch, 2, &ledger).await;
    let m = &report.messages;
    assert_eq!(m.len(), batch.len());
    for i in [0, 2, 4, 9, 11, 12] {
        let (id, ..) = &batch[i];
        assert_eq!(
            ran(&m[i].outcome),
            Some(&Ok(format!("done {id}"))),
            "message {i}: {m:?}"
        );
        assert!(!m[i].redeliver, "message {i} ran and was stored");
    }
    assert_eq!(
        replayed(&m[1].outcome),
        Some(&Ok(format!("done {done}"))),
        "a processed message replays: {:?}",
        m[1]
    );
    assert!(!m[1].redeliver);
    assert!(
        matches!(m[3].outcome, MessageOutcome::Refused(Refusal::KeyReused)),
        "{:?}",
        m[3]
    );
    assert!(
        !m[3].redeliver,
        "a mismatch does not get better by redelivery"
    );
    assert!(
        matches!(
            m[5].outcome,
            MessageOutcome::Refused(Refusal::InProgress { .. })
        ),
        "a held message is not waited for: {:?}",
        m[5]
    );
    assert!(m[5].redeliver);
    assert!(
        matches!(
            m[6].outcome,
            MessageOutcome::Refused(Refusal::InProgress { .. })
        ),
        "a message named again in the batch finds the first one's claim: {:?}",
        m[6]
    );
    assert!(m[6].redeliver);
    assert_eq!(
        ran(&m[7].outcome),
        Some(&Ok(format!("done {failed_before}"))),
        "a released message is taken over: {:?}",
        m[7]
    );
    assert_eq!(ran(&m[8].outcome), Some(&Err(format!("failed {fails}"))));
    assert!(m[8].redeliver, "a released failure is delivered again");
    assert!(
        matches!(m[10].outcome, MessageOutcome::Panicked),
        "{:?}",
        m[10]
    );
    assert!(
        !m[10].redeliver,
        "a panicked message is settled for good: no redelivery runs it"
    );
    assert_eq!(report.redeliver(), vec![5, 6, 8]);
    assert_eq!(report.ran(), 8, "the panicking one is not counted as run");
    assert_eq!(report.replayed(), 1);
    // The work ran for the six new messages, the taken-over one, the failing one and the
    // panicking one: once each.
    assert_eq!(ledger.total() - before, 9);
    for id in news.iter().chain([&failed_before, &fails, &panics]) {
        let expected = if id == &failed_before { 2 } else { 1 };
        assert_eq!(ledger.runs(id), expected, "{id}");
    }
    assert!(
        ledger.most_in_flight.load(Ordering::SeqCst) <= 2,
        "at most two works at a time, saw {}",
        ledger.most_in_flight.load(Ordering::SeqCst)
    );

    // The whole batch delivered again: the stored ones replay, the released ones run again,
    // the held one is still held.
    let before = ledger.total();
    let again = consume(&e, &scope, &batch, 4, &ledger).await;
    let m = &again.messages;
    for i in [0, 1, 2, 4, 6, 7, 9, 11, 12] {
        assert!(replayed(&m[i].outcome).is_some(), "message {i}: {:?}", m[i]);
    }
    assert_eq!(ran(&m[8].outcome), Some(&Err(format!("failed {fails}"))));
    assert!(
        matches!(
            m[10].outcome,
            MessageOutcome::Refused(Refusal::OutcomeLost { .. })
        ),
        "a panicked message is never run again: {:?}",
        m[10]
    );
    assert_eq!(
        ledger.total() - before,
        1,
        "only the released one ran again"
    );
    assert_eq!(again.redeliver(), vec![5, 8]);
    holder
        .fail(Failure::retryable("released by the test"))
        .await
        .expect("release the held key");
}

/// Four consumers poll overlapping batches of the same 40 messages at once (each in its own
/// order), three rounds: every message's work runs exactly once, every other delivery is a
/// replay or in progress (to redeliver), and a final poll replays every message.
pub async fn engine_concurrent_batches_run_each_message_once(t: TestStore) {
    for round in 0..3 {
        let e = Idempotency::new(
            t.store.clone(),
            Policy::default().lease(t.long()).retention(t.long()),
        )
        .expect("valid policy");
        let scope = Scope::from_parts(["conformance-engine", "batch-race"]).expect("scope");
        let ledger = Arc::new(Ledger::default());
        let ids: Vec<String> = (0..40)
            .map(|i| format!("m{i}-{}", IdempotencyKey::random()))
            .collect();
        let barrier = Arc::new(Barrier::new(4));
        let consumers: Vec<_> = (0..4)
            .map(|c| {
                let (e, scope, ledger, barrier) =
                    (e.clone(), scope.clone(), ledger.clone(), barrier.clone());
                // Each consumer in its own order: rotated, odd ones reversed.
                let mut order: Vec<(String, &'static str, Act)> = ids
                    .iter()
                    .map(|id| (id.clone(), "payload", Act::Succeed))
                    .collect();
                order.rotate_left(c * 10);
                if c % 2 == 1 {
                    order.reverse();
                }
                tokio::spawn(async move {
                    barrier.wait().await;
                    let report = consume(&e, &scope, &order, 8, &ledger).await;
                    (order, report)
                })
            })
            .collect();
        let mut fresh: HashMap<String, usize> = HashMap::new();
        for consumer in consumers {
            let (order, report) = consumer.await.expect("consumer task");
            for ((id, ..), m) in order.iter().zip(&report.messages) {
                match &m.outcome {
                    MessageOutcome::Executed(Ok(v)) => {
                        assert_eq!(v, &format!("done {id}"));
                        *fresh.entry(id.clone()).or_insert(0) += 1;
                    }
                    MessageOutcome::Replayed(Ok(v)) => assert_eq!(v, &format!("done {id}")),
                    MessageOutcome::Refused(Refusal::InProgress { .. }) => assert!(m.redeliver),
                    other => panic!("round {round}: {id}: {other:?}"),
                }
            }
        }
        for id in &ids {
            assert_eq!(
                ledger.runs(id),
                1,
                "round {round}: {id} ran {} times",
                ledger.runs(id)
            );
            assert_eq!(fresh.get(id), Some(&1), "round {round}: {id}");
        }
        let batch: Vec<(String, &str, Act)> = ids
            .iter()
            .map(|id| (id.clone(), "payload", Act::Succeed))
            .collect();
        let last = consume(&e, &scope, &batch, 8, &ledger).await;
        assert_eq!(last.replayed(), ids.len(), "round {round}: {last:?}");
        assert_eq!(ledger.total(), ids.len());
    }
}

/// The batch's settlement fails as a whole (refused, or applied with its answer lost): each
/// message's completion is then tried alone and read back, so every outcome is stored and no
/// work runs twice. When the single tries fail too, every message is reported unsettled and
/// to redeliver, a permanent failure is recorded in each outcome's place (a redelivery is told
/// the message failed for good), and the work is not run again; when they applied with every
/// answer lost, the record read back shows each outcome stored.
pub async fn engine_batch_settlement_failure_is_retried_alone(t: TestStore) {
    let scope = Scope::from_parts(["conformance-engine", "batch-settle"]).expect("scope");
    let policy = Policy::default().lease(t.long()).retention(t.long());
    for fault in [Fault::Refused, Fault::AckLost] {
        let flaky = FlakyStore::new(t.store.clone(), fault);
        let e = Idempotency::new(Arc::new(flaky.clone()), policy.clone()).expect("policy");
        let ledger = Arc::new(Ledger::default());
        let batch: Vec<(String, &str, Act)> = (0..5)
            .map(|i| {
                (
                    format!("s{i}-{}", IdempotencyKey::random()),
                    "p",
                    Act::Succeed,
                )
            })
            .collect();
        flaky.inject(FlakyOp::SettleMany, 1);
        let report = consume(&e, &scope, &batch, 4, &ledger).await;
        assert_eq!(flaky.injected(), 1, "{fault:?}");
        for ((id, ..), m) in batch.iter().zip(&report.messages) {
            assert_eq!(
                ran(&m.outcome),
                Some(&Ok(format!("done {id}"))),
                "{fault:?}: {m:?}"
            );
            assert!(
                !m.redeliver,
                "{fault:?}: stored alone after the batch failed"
            );
        }
        let again = consume(&e, &scope, &batch, 4, &ledger).await;
        assert_eq!(again.replayed(), batch.len(), "{fault:?}: {again:?}");
        assert_eq!(ledger.total(), batch.len(), "{fault:?}: each work ran once");

        // Every group's settlement and every single try fail: unsettled (or, when every answer
        // was lost, found stored), not run again. Messages that end at different times are
        // settled in different groups, so every group commit fails, not only the first.
        let batch: Vec<(String, &str, Act)> = (0..3)
            .map(|i| {
                (
                    format!("u{i}-{}", IdempotencyKey::random()),
                    "p",
                    Act::Succeed,
                )
            })
            .collect();
        let ledger = Arc::new(Ledger::default());
        flaky.inject(FlakyOp::SettleMany, 1_000);
        flaky.inject(FlakyOp::Complete, 1_000);
        let report = consume(&e, &scope, &batch, 4, &ledger).await;
        flaky.heal(FlakyOp::SettleMany);
        flaky.heal(FlakyOp::Complete);
        for m in &report.messages {
            match (&m.outcome, fault) {
                // Refused: nothing was stored, and a permanent failure stands in for it.
                (
                    MessageOutcome::Unsettled {
                        result: Ok(_),
                        error,
                    },
                    Fault::Refused,
                ) => {
                    assert!(
                        matches!(error, Error::OutcomeUnknown { .. }),
                        "{fault:?}: {error}"
                    );
                    assert!(m.redeliver, "{fault:?}: {m:?}");
                }
                // A lost answer: the batch applied, and no try could say so; the record, read
                // back once the stand-in is fenced by it, shows the outcome stored.
                (MessageOutcome::Executed(Ok(_)), Fault::AckLost) => {
                    assert!(!m.redeliver, "{fault:?}: {m:?}");
                }
                (other, _) => panic!("{fault:?}: {other:?}"),
            }
        }
        // A redelivery finds the lost outcome recorded in the outcome's place (nothing
        // stored), or the stored outcome.
        let again = consume(&e, &scope, &batch, 4, &ledger).await;
        for m in &again.messages {
            match (&m.outcome, fault) {
                (MessageOutcome::Refused(Refusal::OutcomeLost { .. }), Fault::Refused) => {}
                (MessageOutcome::Replayed(Ok(_)), Fault::AckLost) => {}
                (other, _) => panic!("{fault:?}: a redelivery got {other:?}"),
            }
        }
        assert_eq!(ledger.total(), batch.len(), "{fault:?}: never run twice");
    }
}

/// No claimed message's lease passes while its consumer is alive and has not settled it: a
/// message whose work finished is settled without waiting for the slowest one, and a message
/// waiting for a free slot is kept leased. With one slot, a fast message, a slow one and a
/// queued one: while the slow one runs, the fast one is already Completed on the store, and
/// after the store's clock ran well past the lease, another consumer finds the fast one
/// replayable and the queued one in progress; each work runs once.
pub async fn engine_batch_keeps_every_message_leased_until_settled(t: TestStore) {
    // On a real clock the lease must outlast a few of the store's round trips as they are now
    // (the heartbeat extends it every third of it): a loaded stand-in answers in hundreds of
    // milliseconds.
    let lease = match t.time {
        crate::TimeControl::Manual(_) => Duration::from_millis(900),
        crate::TimeControl::Real => (t.short_lease() * 9 / 4).max(Duration::from_millis(900)),
    };
    let e = Idempotency::new(
        t.store.clone(),
        Policy::default()
            .lease(lease)
            .retention(t.long())
            .heartbeat(Some(1.0 / 3.0)),
    )
    .expect("valid policy");
    let scope = Scope::from_parts(["conformance-engine", "batch-leases"]).expect("scope");
    let ids: Vec<IdempotencyKey> = ["fast", "slow", "queued"]
        .iter()
        .map(|l| IdempotencyKey::new(format!("{l}-{}", IdempotencyKey::random())).expect("key"))
        .collect();
    let ledger = Arc::new(Ledger::default());
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let batch = {
        let (e, scope, ledger) = (e.clone(), scope.clone(), ledger.clone());
        let (started, release) = (started.clone(), release.clone());
        let messages: Vec<_> = ids
            .iter()
            .zip(["fast", "slow", "queued"])
            .map(|(key, label)| BatchMessage::new(key.clone(), fp(label), label))
            .collect();
        tokio::spawn(async move {
            e.run_batch(&scope, messages, 1, move |label: &'static str, _ctx| {
                let (ledger, started, release) = (ledger.clone(), started.clone(), release.clone());
                async move {
                    *ledger
                        .runs
                        .lock()
                        .expect("lock")
                        .entry(label.to_owned())
                        .or_insert(0) += 1;
                    if label == "slow" {
                        started.notify_one();
                        release.notified().await;
                    }
                    Ok::<String, String>(format!("done {label}"))
                }
            })
            .await
        })
    };
    started.notified().await;
    let address = |i: usize| RecordId::new(ids[i].clone(), scope.clone());
    // The fast one is settled while the slow one runs.
    let waited = std::time::Instant::now();
    loop {
        let record = t.store.get(&address(0)).await.expect("get");
        if record
            .as_ref()
            .is_some_and(|r| r.status == idempotency_core::store::RecordStatus::Completed)
        {
            break;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "a finished message was not settled while the batch's slowest work ran: {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The store's clock runs well past the lease, in steps the heartbeat keeps up with.
    let step = lease / 6;
    for _ in 0..10 {
        if let crate::TimeControl::Manual(clock) = &t.time {
            // The heartbeat runs on real time and a loaded store answers slowly: before the
            // store's clock moves on, wait (boundedly) until the heartbeat has extended the
            // batch's leases past the step, so that what the clock does cannot outrun it.
            let past = idempotency_core::store::Clock::now(clock).saturating_add(2 * step);
            let waited = std::time::Instant::now();
            for i in [1, 2] {
                loop {
                    let record = t.store.get(&address(i)).await.expect("get");
                    if record
                        .as_ref()
                        .and_then(|r| r.lease_until)
                        .is_some_and(|until| until >= past)
                    {
                        break;
                    }
                    assert!(
                        waited.elapsed() < Duration::from_secs(30),
                        "the heartbeat did not extend message {i}'s lease past the store's \
                         clock: {record:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        t.advance(step).await;
        if matches!(t.time, crate::TimeControl::Manual(_)) {
            tokio::time::sleep(step).await;
        }
    }
    match e.begin(&address(0), &fp("fast")).await.expect("begin") {
        Begin::Replay(_) => {}
        other => panic!("another consumer of the fast message got {other:?}, expected a replay"),
    }
    match e.begin(&address(2), &fp("queued")).await.expect("begin") {
        Begin::Refused(Refusal::InProgress { .. }) => {}
        other => panic!(
            "another consumer of the message waiting for a slot got {other:?}, expected it in \
             progress (its lease passed while its consumer was alive)"
        ),
    }
    release.notify_one();
    let report = batch.await.expect("the batch ended");
    for (i, m) in report.messages.iter().enumerate() {
        assert!(
            ran(&m.outcome).is_some_and(Result::is_ok),
            "message {i}: {m:?}"
        );
    }
    for label in ["fast", "slow", "queued"] {
        assert_eq!(
            ledger.runs(label),
            1,
            "{label} ran {} times",
            ledger.runs(label)
        );
    }
}

/// An outcome whose `Serialize` panics.
#[derive(Debug, serde::Deserialize)]
struct Explosive(bool);

impl serde::Serialize for Explosive {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.0 {
            panic!("the outcome's Serialize panicked (conformance case)");
        }
        serializer.serialize_bool(false)
    }
}

/// Whatever one message does, every other message's outcome is settled: a work closure that
/// panics before it returns a future (an `unwrap` on a malformed message), a work future
/// that panics, and an outcome whose `Serialize` panics are each reported `Panicked`, with
/// the key settled for good (a redelivery is refused, never run); the other messages are
/// stored, and `run_batch` returns.
pub async fn engine_batch_panics_never_abandon_other_messages(t: TestStore) {
    let e = Idempotency::new(
        t.store.clone(),
        Policy::default().lease(t.long()).retention(t.long()),
    )
    .expect("valid policy");
    let scope = Scope::from_parts(["conformance-engine", "batch-panics"]).expect("scope");
    let labels = [
        "ok-0",
        "closure",
        "ok-1",
        "future",
        "ok-2",
        "serialize",
        "ok-3",
    ];
    let suffix = IdempotencyKey::random();
    let key = |label: &str| IdempotencyKey::new(format!("{label}-{suffix}")).expect("key");
    let messages = || -> Vec<BatchMessage<&'static str>> {
        labels
            .iter()
            .map(|l| BatchMessage::new(key(l), fp(l), *l))
            .collect()
    };
    let ledger = Arc::new(Ledger::default());
    let run = |ledger: Arc<Ledger>| {
        let (e, scope, batch) = (e.clone(), scope.clone(), messages());
        tokio::spawn(async move {
            e.run_batch(&scope, batch, 2, move |label: &'static str, _ctx| {
                *ledger
                    .runs
                    .lock()
                    .expect("lock")
                    .entry(label.to_owned())
                    .or_insert(0) += 1;
                if label == "closure" {
                    panic!("the work closure panicked before returning a future");
                }
                async move {
                    if label == "future" {
                        panic!("the work future panicked");
                    }
                    Ok::<Explosive, String>(Explosive(label == "serialize"))
                }
            })
            .await
        })
    };
    let report = run(ledger.clone())
        .await
        .expect("run_batch must not panic whatever one message does");
    for (i, m) in report.messages.iter().enumerate() {
        if labels[i].starts_with("ok") {
            assert!(
                matches!(&m.outcome, MessageOutcome::Executed(Ok(Explosive(false)))),
                "message {i} ({}): {m:?}",
                labels[i]
            );
            assert!(!m.redeliver);
            let record = t
                .store
                .get(&RecordId::new(key(labels[i]), scope.clone()))
                .await
                .expect("get")
                .expect("the record");
            assert_eq!(
                record.status,
                idempotency_core::store::RecordStatus::Completed
            );
        } else {
            assert!(
                matches!(m.outcome, MessageOutcome::Panicked) && !m.redeliver,
                "message {i} ({}): {m:?}",
                labels[i]
            );
        }
    }
    // Delivered again: the stored ones replay, the panicked ones are refused; nothing runs.
    let again = run(ledger.clone()).await.expect("run_batch must not panic");
    for (i, m) in again.messages.iter().enumerate() {
        let fine = if labels[i].starts_with("ok") {
            matches!(m.outcome, MessageOutcome::Replayed(_))
        } else {
            matches!(
                m.outcome,
                MessageOutcome::Refused(Refusal::OutcomeLost { .. })
            )
        };
        assert!(
            fine && !m.redeliver,
            "redelivered message {i} ({}): {m:?}",
            labels[i]
        );
    }
    assert_eq!(ledger.total(), labels.len(), "a message ran twice");
}
