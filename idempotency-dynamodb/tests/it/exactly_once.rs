//! Exactly-once on DynamoDB: the work's writes and the record's completion in one
//! `TransactWriteItems`. Each end of a transaction (committed, cancelled by a write's
//! condition, fenced, an answer lost after it applied, a send that never applied, a
//! conflict) is made to happen, by an SDK interceptor where the stand-in cannot make it
//! happen by itself, and the writes are counted on the table afterwards.
#![allow(clippy::unwrap_used)]

use crate::support;

use aws_sdk_dynamodb::config::interceptors::{
    BeforeDeserializationInterceptorContextMut, BeforeTransmitInterceptorContextMut,
};
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::types::{AttributeValue, Put, Update};
use idempotency_core::store::{Claim, ClaimRequest, ManualClock, RecordStatus};
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId,
    Refusal, Scope,
};
use idempotency_dynamodb::{DynamoError, DynamoStore, MAX_TRANSACTION_WRITES};
use idempotency_testing::dynamodb as common;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{intercepted_store, Between, Requests};

const LEASE: Duration = Duration::from_secs(10);

fn scope() -> Scope {
    Scope::new("orders").unwrap()
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).unwrap()
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_bytes(b"one order")
}

fn engine(store: &DynamoStore) -> Idempotency<DynamoStore> {
    Idempotency::builder(store.clone())
        .policy(Policy::default().lease(LEASE))
        .build()
        .unwrap()
}

/// A business item beside the records, in the same table (its own partition key).
fn order(store: &DynamoStore, name: &str) -> Put {
    Put::builder()
        .table_name(store.table())
        .item("pk", AttributeValue::S(format!("order#{name}")))
        .condition_expression("attribute_not_exists(pk)")
        .build()
        .unwrap()
}

/// Adds one to a counter item: unconditional, so running twice would show as 2.
fn bump(store: &DynamoStore, name: &str) -> Update {
    Update::builder()
        .table_name(store.table())
        .key("pk", AttributeValue::S(format!("count#{name}")))
        .update_expression("ADD n :one")
        .expression_attribute_values(":one", AttributeValue::N("1".to_owned()))
        .build()
        .unwrap()
}

/// The counter's value (0 when absent).
async fn count(store: &DynamoStore, name: &str) -> u64 {
    let out = store
        .client()
        .get_item()
        .table_name(store.table())
        .key("pk", AttributeValue::S(format!("count#{name}")))
        .consistent_read(true)
        .send()
        .await
        .unwrap();
    match out.item.and_then(|i| i.get("n").cloned()) {
        Some(AttributeValue::N(n)) => n.parse().unwrap(),
        _ => 0,
    }
}

async fn exists(store: &DynamoStore, pk: &str) -> bool {
    store
        .client()
        .get_item()
        .table_name(store.table())
        .key("pk", AttributeValue::S(pk.to_owned()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .is_some()
}

/// Runs the standard work for `k`: bump its counter, and count the runs.
async fn run_bump(
    engine: &Idempotency<DynamoStore>,
    store: &DynamoStore,
    k: &str,
    runs: &Arc<AtomicUsize>,
) -> Result<Answer<Result<u32, String>>, Error> {
    engine
        .run_in_transaction(&key(k), &scope(), &fingerprint(), |tx, _| {
            let (update, runs) = (bump(store, k), runs.clone());
            Box::pin(async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tx.update(update)?;
                Ok(Ok(7))
            })
        })
        .await
}

#[tokio::test]
async fn writes_and_completion_commit_in_one_request_and_a_retry_replays() {
    let requests = Requests::default();
    let (store, _clock, _guard) = intercepted_store(requests.clone()).await;
    let engine = engine(&store);
    let runs = Arc::new(AtomicUsize::new(0));

    let first = run_bump(&engine, &store, "k1", &runs).await.unwrap();
    assert!(matches!(first, Answer::Executed(Ok(7))), "{first:?}");
    let sent = requests.take();
    assert_eq!(sent.get("TransactWriteItems"), Some(&1), "{sent:?}");
    assert_eq!(sent.get("PutItem"), Some(&1), "the claim: {sent:?}");
    assert_eq!(sent.values().sum::<usize>(), 2, "nothing else: {sent:?}");

    let again = run_bump(&engine, &store, "k1", &runs).await.unwrap();
    assert!(matches!(again, Answer::Replayed(Ok(7))), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(count(&store, "k1").await, 1);
    let record = store.get(&RecordId::new(key("k1"), scope())).await.unwrap();
    assert_eq!(record.unwrap().status, RecordStatus::Completed);
}

/// Bumps a counter and puts the order `name`, which must not exist yet.
async fn run_order(
    engine: &Idempotency<DynamoStore>,
    store: &DynamoStore,
    k: &str,
    name: &str,
) -> Result<Answer<Result<u32, String>>, Error> {
    let (put, update) = (order(store, name), bump(store, "cancelled"));
    engine
        .run_in_transaction(&key(k), &scope(), &fingerprint(), |tx, _| {
            let (put, update) = (put.clone(), update.clone());
            Box::pin(async move {
                tx.update(update)?.put(put)?;
                Ok(Ok(1))
            })
        })
        .await
}

#[tokio::test]
async fn a_failed_condition_cancels_every_write_says_which_and_releases_the_key() {
    let (store, _guard) = common::store(Arc::new(ManualClock::new())).await.unwrap();
    let engine = engine(&store);
    // The order exists already: the work's conditional put of it fails.
    store
        .client()
        .put_item()
        .table_name(store.table())
        .item("pk", AttributeValue::S("order#taken".to_owned()))
        .send()
        .await
        .unwrap();
    let e = run_order(&engine, &store, "c", "taken").await.unwrap_err();
    let Some(DynamoError::TransactionCanceled { writes }) = DynamoError::find(&e) else {
        panic!("not a cancellation: {e:?}");
    };
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert_eq!(writes[0].index, 1, "the put, the second write");
    assert!(!writes[0].completion);
    assert_eq!(writes[0].code, "ConditionalCheckFailed");
    assert!(
        e.to_string().contains("write 1: ConditionalCheckFailed"),
        "{e}"
    );
    assert_eq!(count(&store, "cancelled").await, 0, "nothing applied");
    // Released at once: a retry runs (and, with a free order, commits).
    let record = store
        .get(&RecordId::new(key("c"), scope()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.status, RecordStatus::Failed);
    let retried = run_order(&engine, &store, "c", "free").await.unwrap();
    assert!(matches!(retried, Answer::Executed(Ok(1))), "{retried:?}");
    assert_eq!(count(&store, "cancelled").await, 1);
    assert!(exists(&store, "order#free").await);
}

#[tokio::test]
async fn work_that_fails_writes_nothing() {
    let (store, _guard) = common::store(Arc::new(ManualClock::new())).await.unwrap();
    let engine = engine(&store);
    let update = bump(&store, "declined");
    let outcome = engine
        .run_in_transaction(&key("d"), &scope(), &fingerprint(), |tx, _| {
            let update = update.clone();
            Box::pin(async move {
                tx.update(update)?;
                Ok(Err::<u32, String>("card declined".to_owned()))
            })
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Answer::Executed(Err(ref e)) if e == "card declined"));
    assert_eq!(count(&store, "declined").await, 0);
}

#[tokio::test]
async fn a_fenced_completion_cancels_the_writes_of_the_holder_that_lost_its_lease() {
    let clock = ManualClock::new();
    let (store, _guard) = common::store(Arc::new(clock.clone())).await.unwrap();
    let (slow, taker) = (engine(&store), Arc::new(engine(&store)));
    let id = RecordId::new(key("f"), scope());
    let update = bump(&store, "fenced");
    let result = slow
        .run_in_transaction(&key("f"), &scope(), &fingerprint(), |tx, _| {
            let (update, clock, taker, id) =
                (update.clone(), clock.clone(), taker.clone(), id.clone());
            Box::pin(async move {
                tx.update(update)?;
                // The lease passes while the work runs, and another holder takes the key.
                clock.advance(LEASE + Duration::from_secs(1));
                let begun = taker.begin(&id, &fingerprint()).await.unwrap();
                let idempotency_core::protocol::Begin::Execute(lease) = begun else {
                    panic!("the passed lease was not taken over");
                };
                lease.complete(b"{\"Ok\":8}").await.unwrap();
                Ok(Ok::<u32, String>(7))
            })
        })
        .await;
    assert!(matches!(result, Err(Error::LeaseLost { .. })), "{result:?}");
    assert_eq!(
        count(&store, "fenced").await,
        0,
        "the fenced writes never applied"
    );
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(record.outcome.as_deref(), Some(&b"{\"Ok\":8}"[..]));
}

#[tokio::test]
async fn at_most_99_writes_beside_the_completion_refused_before_anything_is_sent() {
    let requests = Requests::default();
    let (store, _clock, _guard) = intercepted_store(requests.clone()).await;
    let engine = engine(&store);
    let many =
        |n: usize| -> Vec<Update> { (0..n).map(|i| bump(&store, &format!("m{i}"))).collect() };

    let writes = many(MAX_TRANSACTION_WRITES + 1);
    let e = engine
        .run_in_transaction(&key("too-many"), &scope(), &fingerprint(), |tx, _| {
            let writes = writes.clone();
            Box::pin(async move {
                for w in writes {
                    tx.update(w)?;
                }
                Ok(Ok::<u32, String>(1))
            })
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            DynamoError::find(&e),
            Some(DynamoError::TooManyWrites { limit: 99 })
        ),
        "{e:?}"
    );
    let sent = requests.take();
    assert_eq!(sent.get("TransactWriteItems"), None, "{sent:?}");
    assert_eq!(count(&store, "m0").await, 0);

    let writes = many(MAX_TRANSACTION_WRITES);
    let outcome = engine
        .run_in_transaction(&key("full"), &scope(), &fingerprint(), |tx, _| {
            let writes = writes.clone();
            Box::pin(async move {
                for w in writes {
                    tx.update(w)?;
                }
                Ok(Ok::<u32, String>(1))
            })
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Answer::Executed(Ok(1))), "{outcome:?}");
    assert_eq!(count(&store, "m98").await, 1);
}

/// What one send of `TransactWriteItems` meets.
#[derive(Clone, Copy, Debug)]
enum Fate {
    /// It applies, and its answer is lost (a 500 in its place): the SDK sends it again.
    LoseAnswer,
    /// It never reaches the table (sent as a harmless read instead), and this is the answer.
    Divert(Diverted),
}

#[derive(Clone, Copy, Debug)]
enum Diverted {
    ServerError,
    Throttled,
    /// Cancelled for a conflict on the completion (another request was writing the record).
    Conflict,
    /// DynamoDB still runs an earlier send with the same client token.
    InProgress,
}

/// Gives each send of `TransactWriteItems` the next fate in its script (then lets sends
/// through), and counts the sends.
#[derive(Clone, Debug, Default)]
struct Script {
    fates: Arc<Mutex<VecDeque<Fate>>>,
    current: Arc<Mutex<Option<Fate>>>,
    sends: Arc<AtomicUsize>,
    /// Runs once, right after an answer is lost (before the SDK sends it again).
    between: Arc<Mutex<Between>>,
}

impl Script {
    fn then(&self, fate: Fate, times: usize) {
        let mut fates = self.fates.lock().unwrap();
        fates.extend(std::iter::repeat_n(fate, times));
    }
}

impl Intercept for Script {
    fn name(&self) -> &'static str {
        "Script"
    }

    fn modify_before_transmit(
        &self,
        context: &mut BeforeTransmitInterceptorContextMut<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let request = context.request_mut();
        let target = request.headers().get("x-amz-target").unwrap_or("");
        if !target.ends_with(".TransactWriteItems") {
            *self.current.lock().unwrap() = None;
            return Ok(());
        }
        self.sends.fetch_add(1, Ordering::SeqCst);
        let fate = self.fates.lock().unwrap().pop_front();
        if let Some(Fate::Divert(_)) = fate {
            request
                .headers_mut()
                .insert("x-amz-target", "DynamoDB_20120810.DescribeLimits");
        }
        *self.current.lock().unwrap() = fate;
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let Some(fate) = self.current.lock().unwrap().take() else {
            return Ok(());
        };
        let (status, kind, body) = match fate {
            Fate::LoseAnswer | Fate::Divert(Diverted::ServerError) => (500u16, None, String::new()),
            Fate::Divert(Diverted::Throttled) => (
                400,
                Some("ThrottlingException"),
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#ThrottlingException","message":"Rate of requests exceeds the allowed throughput."}"#.to_owned(),
            ),
            Fate::Divert(Diverted::InProgress) => (
                400,
                Some("TransactionInProgressException"),
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#TransactionInProgressException","message":"The transaction with the given request token is already in progress."}"#.to_owned(),
            ),
            Fate::Divert(Diverted::Conflict) => (
                400,
                Some("TransactionCanceledException"),
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#TransactionCanceledException","message":"Transaction cancelled, please refer cancellation reasons for specific reasons [None, TransactionConflict]","CancellationReasons":[{"Code":"None"},{"Code":"TransactionConflict","Message":"Transaction is ongoing for the item"}]}"#.to_owned(),
            ),
        };
        if matches!(fate, Fate::LoseAnswer) {
            assert_eq!(context.response().status().as_u16(), 200, "it applied");
            if let Some(between) = self.between.lock().unwrap().0.take() {
                between();
            }
        }
        let response = context.response_mut();
        *response.status_mut() =
            aws_smithy_runtime_api::http::StatusCode::try_from(status).unwrap();
        if let Some(kind) = kind {
            response.headers_mut().insert("x-amzn-errortype", kind);
        }
        *response.body_mut() = aws_smithy_types::body::SdkBody::from(body);
        Ok(())
    }
}

/// The first send applies and its answer is lost; the SDK sends it again, and DynamoDB
/// cancels that send (the record is completed already). The store knows its own completion
/// in the cancellation and answers as the first send would have.
#[tokio::test]
async fn an_applied_transaction_whose_answer_was_lost_is_committed_once() {
    let script = Script::default();
    let (store, _clock, _guard) = intercepted_store(script.clone()).await;
    let engine = engine(&store);
    let runs = Arc::new(AtomicUsize::new(0));
    script.then(Fate::LoseAnswer, 1);
    let outcome = run_bump(&engine, &store, "lost", &runs).await.unwrap();
    assert!(matches!(outcome, Answer::Executed(Ok(7))), "{outcome:?}");
    assert!(
        script.sends.load(Ordering::SeqCst) >= 2,
        "the SDK sent it again"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(count(&store, "lost").await, 1, "applied once");
    let replay = run_bump(&engine, &store, "lost", &runs).await.unwrap();
    assert!(matches!(replay, Answer::Replayed(Ok(7))), "{replay:?}");
}

/// The first send applies and its answer is lost; before the SDK sends it again, the
/// completed record expires and another caller claims the key. The resend is cancelled by
/// a record that is not this holder's, yet the first send committed the writes and the
/// completion: the caller is told the outcome is unknown, never that its lease was lost
/// (which says nothing of it committed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_applied_transaction_whose_record_was_replaced_before_the_resend_is_unknown() {
    let script = Script::default();
    let (store, clock, _guard) = intercepted_store(script.clone()).await;
    let retention = Duration::from_secs(1);
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default().lease(LEASE).retention(retention))
        .build()
        .unwrap();
    let other = DynamoStore::builder()
        .table(store.table())
        .clock(Arc::new(clock.clone()))
        .build(idempotency_testing::dynamodb::client())
        .unwrap();
    let taker = Arc::new(Mutex::new(None));
    script.between.lock().unwrap().0 = Some(Box::new({
        let (clock, taker) = (clock.clone(), taker.clone());
        move || {
            clock.advance(retention * 2);
            let handle = tokio::runtime::Handle::current();
            let request = ClaimRequest::new(
                RecordId::new(key("replaced"), scope()),
                fingerprint(),
                LEASE,
                retention,
            );
            let claimed = tokio::task::block_in_place(|| handle.block_on(other.claim(&request)));
            *taker.lock().unwrap() = Some(claimed);
        }
    }));
    script.then(Fate::LoseAnswer, 1);
    let runs = Arc::new(AtomicUsize::new(0));
    let outcome = run_bump(&engine, &store, "replaced", &runs).await;
    let taken = taker
        .lock()
        .unwrap()
        .take()
        .expect("the key was claimed again meanwhile");
    assert!(matches!(taken, Ok(Claim::Claimed { .. })), "{taken:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(count(&store, "replaced").await, 1, "the first send applied");
    assert!(
        matches!(outcome, Err(Error::OutcomeUnknown { .. })),
        "applied, then its resend met another record: {outcome:?}"
    );
}

/// The first send applies and its answer is lost, and every send again is throttled: the
/// last error says nothing about the first send, so the store reads the record, finds its
/// completion, and reports the transaction committed.
#[tokio::test]
async fn an_applied_transaction_then_throttled_resends_is_committed_once() {
    let script = Script::default();
    let (store, _clock, _guard) = intercepted_store(script.clone()).await;
    let engine = engine(&store);
    let runs = Arc::new(AtomicUsize::new(0));
    script.then(Fate::LoseAnswer, 1);
    script.then(Fate::Divert(Diverted::Throttled), 10);
    let outcome = run_bump(&engine, &store, "throttled", &runs).await.unwrap();
    assert!(matches!(outcome, Answer::Executed(Ok(7))), "{outcome:?}");
    assert!(script.sends.load(Ordering::SeqCst) >= 2);
    assert_eq!(count(&store, "throttled").await, 1);
}

/// Every send of the transaction answered `answer` without reaching the table: the caller
/// gets `OutcomeUnknown`, the key is held until its lease passes (a duplicate meanwhile is
/// told the key is in progress), then a retry runs the work once.
async fn held_until_the_lease_passes(answer: Diverted, k: &str) {
    let script = Script::default();
    let (store, clock, _guard) = intercepted_store(script.clone()).await;
    let engine = engine(&store);
    let runs = Arc::new(AtomicUsize::new(0));
    script.then(Fate::Divert(answer), 10);
    let e = run_bump(&engine, &store, k, &runs).await.unwrap_err();
    script.fates.lock().unwrap().clear();
    assert!(matches!(e, Error::OutcomeUnknown { .. }), "{e:?}");
    assert_eq!(count(&store, k).await, 0);

    let held = run_bump(&engine, &store, k, &runs).await.unwrap();
    assert!(
        matches!(held, Answer::Refused(Refusal::InProgress { .. })),
        "{held:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    clock.advance(LEASE + Duration::from_secs(1));
    let retried = run_bump(&engine, &store, k, &runs).await.unwrap();
    assert!(matches!(retried, Answer::Executed(Ok(7))), "{retried:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(count(&store, k).await, 1);
}

/// Every answer a 500: whether the transaction applied is unknown to the caller.
#[tokio::test]
async fn a_transaction_of_unknown_outcome_holds_the_key_until_its_lease_passes() {
    held_until_the_lease_passes(Diverted::ServerError, "unknown").await;
}

/// Every answer `TransactionInProgressException` (the SDK sent it again while DynamoDB still
/// ran an earlier send with the same client token): the earlier send may yet apply, so the
/// key is never released for the work to run again meanwhile.
#[tokio::test]
async fn a_transaction_still_in_progress_at_dynamodb_holds_the_key() {
    held_until_the_lease_passes(Diverted::InProgress, "in-progress").await;
}

/// DynamoDB cancels a transaction for a conflict on one of its items when another request
/// writes it meanwhile (the stand-in, serving one request at a time, never does): nothing
/// applied, so the work runs again and its writes apply once.
#[tokio::test]
async fn a_conflict_runs_the_work_again_and_its_writes_apply_once() {
    let script = Script::default();
    let (store, _clock, _guard) = intercepted_store(script.clone()).await;
    let engine = engine(&store);
    let runs = Arc::new(AtomicUsize::new(0));
    script.then(Fate::Divert(Diverted::Conflict), 2);
    let outcome = run_bump(&engine, &store, "conflict", &runs).await.unwrap();
    assert!(matches!(outcome, Answer::Executed(Ok(7))), "{outcome:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 3, "two conflicts, three runs");
    assert_eq!(script.sends.load(Ordering::SeqCst), 3);
    assert_eq!(count(&store, "conflict").await, 1);
}

/// Many callers of one key at once, over many keys: the writes apply once per key, and
/// exactly one caller of each key runs the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_callers_of_one_key_apply_its_writes_once() {
    let (store, _guard) = common::store(Arc::new(idempotency_core::store::SystemClock))
        .await
        .unwrap();
    let engine = Arc::new(engine(&store));
    for round in 0..20 {
        let k = format!("race-{round}");
        let runs = Arc::new(AtomicUsize::new(0));
        let callers: Vec<_> = (0..8)
            .map(|_| {
                let (engine, store, k, runs) =
                    (engine.clone(), store.clone(), k.clone(), runs.clone());
                tokio::spawn(async move { run_bump(&engine, &store, &k, &runs).await })
            })
            .collect();
        let mut fresh = 0;
        for caller in callers {
            match caller.await.unwrap() {
                Ok(Answer::Executed(Ok(7))) => fresh += 1,
                Ok(Answer::Replayed(Ok(7))) | Ok(Answer::Refused(Refusal::InProgress { .. })) => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(fresh, 1, "round {round}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "round {round}");
        assert_eq!(count(&store, &k).await, 1, "round {round}");
    }
}
