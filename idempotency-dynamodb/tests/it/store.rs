//! The DynamoDB store's own behaviour: requests per operation (counted by an SDK
//! interceptor), the item size limit, the table checks, corrupt items, and what clock skew
//! between two instances does.
#![allow(clippy::unwrap_used)]

use crate::support;

use idempotency_testing::dynamodb as common;
use support::{intercepted_store, operation, Between, Requests};

use aws_sdk_dynamodb::config::interceptors::{
    BeforeDeserializationInterceptorContextMut, BeforeTransmitInterceptorContextRef,
};
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::types::AttributeValue;
use idempotency_core::store::{
    Cas, Claim, ClaimRequest, Clock, Failure, ManualClock, Reclaim, RecordStatus, Timestamp,
};
use idempotency_core::{
    Answer, Error, FencingToken, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore,
    Policy, RecordId, Refusal, Scope,
};
use idempotency_dynamodb::{DynamoError, DynamoStore, MAX_OUTCOME_BYTES};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn id(key: &str) -> RecordId {
    RecordId::new(
        IdempotencyKey::new(key).unwrap(),
        Scope::new("orders").unwrap(),
    )
}

/// A claim as the engine makes it by default: hits not counted.
fn request(key: &str, body: &[u8], lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest::new(id(key), Fingerprint::from_bytes(body), lease, ttl).with_count_hit(false)
}

fn ops(list: &[(&str, usize)]) -> BTreeMap<String, usize> {
    list.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
}

const LEASE: Duration = Duration::from_secs(10);
const TTL: Duration = Duration::from_secs(3600);

/// A store on a manual clock, with its requests counted, on a table of its own.
async fn counted_store() -> (DynamoStore, ManualClock, Requests, common::TableGuard) {
    let requests = Requests::default();
    let (store, clock, guard) = intercepted_store(requests.clone()).await;
    (store, clock, requests, guard)
}

#[tokio::test]
async fn each_operation_is_one_request() {
    let (store, clock, requests, _guard) = counted_store().await;
    let req = request("k-1", b"a", LEASE, TTL);

    let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
        panic!("a new key was not claimed");
    };
    assert_eq!(
        requests.take(),
        ops(&[("PutItem", 1)]),
        "claim of a new key"
    );

    let Claim::Existing { .. } = store.claim(&req).await.unwrap() else {
        panic!("a held key was claimed again");
    };
    assert_eq!(
        requests.take(),
        ops(&[("PutItem", 1)]),
        "a claim that finds the record (the losing caller gets it in the same answer)"
    );

    assert_eq!(
        store.extend(&id("k-1"), token, LEASE).await.unwrap(),
        Cas::Applied
    );
    assert_eq!(requests.take(), ops(&[("UpdateItem", 1)]), "extend");

    assert_eq!(
        store
            .complete(&id("k-1"), token, b"done", TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
    assert_eq!(requests.take(), ops(&[("UpdateItem", 1)]), "complete");

    let record = store.get(&id("k-1")).await.unwrap().unwrap();
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(requests.take(), ops(&[("GetItem", 1)]), "get");

    let Claim::Existing { record, .. } = store.claim(&req).await.unwrap() else {
        panic!("a completed key was claimed again");
    };
    assert_eq!(record.outcome.as_deref(), Some(&b"done"[..]));
    assert_eq!(requests.take(), ops(&[("PutItem", 1)]), "a replay");

    // A failure, then a takeover.
    let req2 = request("k-2", b"b", LEASE, TTL);
    let Claim::Claimed { token: t2, .. } = store.claim(&req2).await.unwrap() else {
        panic!("a new key was not claimed");
    };
    requests.take();
    assert_eq!(
        store
            .fail(&id("k-2"), t2, &Failure::retryable("timeout"), TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
    assert_eq!(requests.take(), ops(&[("UpdateItem", 1)]), "fail");
    let Reclaim::Reclaimed { token: t3, .. } = store
        .reclaim(&id("k-2"), t2, &Fingerprint::from_bytes(b"b"), LEASE, TTL)
        .await
        .unwrap()
    else {
        panic!("a failed record was not reclaimed");
    };
    assert_eq!(t3, t2.next());
    assert_eq!(requests.take(), ops(&[("UpdateItem", 1)]), "reclaim");

    // An expired record is claimed again in one request, with a greater token.
    clock.advance(TTL * 2);
    let Claim::Claimed { token: again, .. } = store.claim(&req).await.unwrap() else {
        panic!("an expired key was not claimed");
    };
    assert!(again > token, "token {again} after {token}");
    assert_eq!(
        requests.take(),
        ops(&[("PutItem", 1)]),
        "claim of an expired record"
    );

    // Counting a hit costs a second request.
    let counting = request("k-1", b"a", LEASE, TTL).with_count_hit(true);
    let Claim::Existing { record, .. } = store.claim(&counting).await.unwrap() else {
        panic!("a held key was claimed again");
    };
    assert_eq!(record.hits, 1);
    assert_eq!(
        requests.take(),
        ops(&[("PutItem", 1), ("UpdateItem", 1)]),
        "a claim that counts its hit"
    );
}

/// Through the engine: a work whose outcome is over the item limit ran, and its outcome
/// cannot be kept. A retry, at once or after the lease has passed, is told the first attempt
/// failed for good; the work never runs a second time.
#[tokio::test]
async fn a_work_whose_outcome_is_over_the_item_limit_never_runs_twice() {
    let (store, clock, _requests, _guard) = counted_store().await;
    let engine = Idempotency::new(
        Arc::new(store),
        Policy::default().lease(LEASE).retention(TTL),
    )
    .unwrap();
    let (key, scope) = (IdempotencyKey::random(), Scope::new("orders").unwrap());
    let fingerprint = Fingerprint::from_bytes(b"a");
    let runs = Arc::new(AtomicUsize::new(0));
    let run = || {
        let runs = runs.clone();
        engine.run(&key, &scope, &fingerprint, move |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>("x".repeat(MAX_OUTCOME_BYTES + 1))
        })
    };
    let first = run().await;
    assert!(
        matches!(first, Err(Error::OutcomeUnknown { .. })),
        "{first:?}"
    );
    for later in [Duration::ZERO, LEASE + Duration::from_secs(1)] {
        clock.advance(later);
        let retry = run().await;
        assert!(
            matches!(retry, Ok(Answer::Refused(Refusal::OutcomeLost { .. }))),
            "a retry {later:?} later: {retry:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran twice");
    }
}

#[tokio::test]
async fn an_outcome_over_the_item_limit_is_refused_before_anything_is_sent() {
    let (store, _clock, requests, _guard) = counted_store().await;
    let Claim::Claimed { token, .. } = store
        .claim(&request("big", b"a", LEASE, TTL))
        .await
        .unwrap()
    else {
        panic!("a new key was not claimed");
    };
    requests.take();
    let too_big = vec![7u8; MAX_OUTCOME_BYTES + 1];
    let e = store
        .complete(&id("big"), token, &too_big, TTL)
        .await
        .unwrap_err();
    assert!(
        matches!(
            DynamoError::find(&e),
            Some(DynamoError::ItemTooLarge { outcome, .. }) if *outcome == MAX_OUTCOME_BYTES + 1
        ),
        "{e:?}"
    );
    assert!(!e.is_retryable(), "the same outcome would be refused again");
    let message = "x".repeat(MAX_OUTCOME_BYTES + 1);
    let e = store
        .fail(&id("big"), token, &Failure::permanent(message), TTL)
        .await
        .unwrap_err();
    assert!(matches!(
        DynamoError::find(&e),
        Some(DynamoError::ItemTooLarge { .. })
    ));
    assert_eq!(requests.take(), BTreeMap::new(), "nothing was sent");

    // The record is as the claim left it, and its holder can still settle it.
    let record = store.get(&id("big")).await.unwrap().unwrap();
    assert_eq!(record.status, RecordStatus::Pending);
    assert_eq!(record.token, token);
    assert_eq!(
        store
            .complete(&id("big"), token, b"small", TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
}

#[tokio::test]
async fn verify_accepts_the_created_table_and_names_what_is_wrong_with_others() {
    let (store, _guard) = common::store(Arc::new(ManualClock::new())).await.unwrap();
    store.verify().await.expect("the table create_table made");

    // A table keyed by another attribute.
    let other = DynamoStore::builder()
        .table(store.table())
        .key_attribute("id")
        .build(common::client())
        .unwrap();
    let e = other.verify().await.unwrap_err();
    assert!(
        matches!(DynamoError::find(&e), Some(DynamoError::Schema { problem, .. }) if problem.contains("\"id\"")),
        "{e:?}"
    );

    // TTL set on another attribute.
    let other = DynamoStore::builder()
        .table(store.table())
        .ttl_attribute("expires")
        .build(common::client())
        .unwrap();
    let e = other.verify().await.unwrap_err();
    assert!(
        matches!(DynamoError::find(&e), Some(DynamoError::Schema { problem, .. }) if problem.contains("TTL")),
        "{e:?}"
    );

    // A table that does not exist.
    let missing = DynamoStore::builder()
        .table("idk-test-no-such-table")
        .build(common::client())
        .unwrap();
    assert!(missing.verify().await.is_err());
}

#[test]
fn names_dynamodb_would_refuse_are_config_errors() {
    let client = common::client();
    for table in ["ab", "has space", "ünïcode", &"t".repeat(256)] {
        let e = DynamoStore::builder()
            .table(table)
            .build(client.clone())
            .unwrap_err();
        assert!(matches!(e, DynamoError::TableName(_)), "{table}: {e}");
        assert!(matches!(Error::from(e), Error::Config(_)));
    }
    for (key, ttl) in [
        ("", "ttl"),
        ("pk", ""),
        ("pk", "pk"),
        ("idk_token", "ttl"),
        ("pk", "idk_status"),
    ] {
        let e = DynamoStore::builder()
            .key_attribute(key)
            .ttl_attribute(ttl)
            .build(client.clone())
            .unwrap_err();
        assert!(
            matches!(e, DynamoError::AttributeName { .. }),
            "{key}/{ttl}: {e}"
        );
    }
}

#[tokio::test]
async fn a_corrupt_item_is_refused_and_left_as_it_is() {
    let (store, _guard) = common::store(Arc::new(ManualClock::new())).await.unwrap();
    let client = store.client().clone();
    let corruptions: Vec<(&str, Vec<(&str, AttributeValue)>)> = vec![
        ("no fields", vec![]),
        (
            "a status out of range",
            vec![("idk_status", AttributeValue::N("9".into()))],
        ),
        (
            "a token of the wrong type",
            vec![("idk_token", AttributeValue::S("one".into()))],
        ),
        (
            "a short fingerprint",
            vec![("idk_fingerprint", AttributeValue::B(vec![1, 2].into()))],
        ),
    ];
    let (good, _) = {
        let Claim::Claimed { token, .. } = store
            .claim(&request("template", b"a", LEASE, TTL))
            .await
            .unwrap()
        else {
            panic!("a new key was not claimed");
        };
        (token, ())
    };
    let template = client
        .get_item()
        .table_name(store.table())
        .key("pk", AttributeValue::S("orders\u{1f}template".into()))
        .send()
        .await
        .unwrap()
        .item
        .unwrap();
    assert!(good.0 > 0);
    for (i, (what, changes)) in corruptions.into_iter().enumerate() {
        let key = format!("corrupt-{i}");
        let mut item = if changes.is_empty() {
            Default::default()
        } else {
            template.clone()
        };
        item.insert("pk".into(), AttributeValue::S(format!("orders\u{1f}{key}")));
        for (name, value) in changes {
            item.insert(name.into(), value);
        }
        client
            .put_item()
            .table_name(store.table())
            .set_item(Some(item.clone()))
            .send()
            .await
            .unwrap();
        for e in [
            store
                .claim(&request(&key, b"a", LEASE, TTL))
                .await
                .map(|_| ())
                .unwrap_err(),
            store.get(&id(&key)).await.map(|_| ()).unwrap_err(),
        ] {
            assert!(matches!(e, Error::CorruptRecord { .. }), "{what}: {e:?}");
        }
        let _ = store.complete(&id(&key), FencingToken(1), b"x", TTL).await;
        let after = client
            .get_item()
            .table_name(store.table())
            .key("pk", AttributeValue::S(format!("orders\u{1f}{key}")))
            .send()
            .await
            .unwrap()
            .item
            .unwrap();
        assert_eq!(after, item, "{what}: the corrupt item was changed");
    }
}

/// Two instances on one table, one clock ahead of the other by more than the lease: the one
/// ahead takes over a key whose holder is still working (what skew can do), and the
/// holder's completion is then fenced, never stored over the new holder's. The one behind
/// reads a record live for as much longer as its clock is behind.
#[tokio::test]
async fn clock_skew_between_instances() {
    let skew = LEASE + Duration::from_secs(1);
    let behind = ManualClock::starting_at(Timestamp::from_millis(1_800_000_000_000));
    let (a, _guard) = common::store(Arc::new(behind.clone())).await.unwrap();
    let ahead = ManualClock::starting_at(Clock::now(&behind).saturating_add(skew));
    let b = DynamoStore::builder()
        .table(a.table())
        .clock(Arc::new(ahead.clone()))
        .build(common::client())
        .unwrap();

    let req = request("skewed", b"a", LEASE, TTL);
    let Claim::Claimed { token: held, .. } = a.claim(&req).await.unwrap() else {
        panic!("a new key was not claimed");
    };
    // On B's clock A's lease has passed: B takes the key over while A still works.
    let Claim::Existing { record, now } = b.claim(&req).await.unwrap() else {
        panic!("a held key was claimed again");
    };
    assert!(
        record.lease_until.unwrap() <= now,
        "B sees the lease passed"
    );
    let Reclaim::Reclaimed { token: taken, .. } = b
        .reclaim(
            &id("skewed"),
            held,
            &Fingerprint::from_bytes(b"a"),
            LEASE,
            TTL,
        )
        .await
        .unwrap()
    else {
        panic!("B could not take over a lease its clock sees passed");
    };
    assert_eq!(
        a.complete(&id("skewed"), held, b"from A", TTL)
            .await
            .unwrap(),
        Cas::Fenced,
        "the old holder's completion is fenced"
    );
    assert_eq!(
        b.complete(&id("skewed"), taken, b"from B", TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
    let stored = a.get(&id("skewed")).await.unwrap().unwrap();
    assert_eq!(stored.outcome.as_deref(), Some(&b"from B"[..]));

    // The record expires on B's clock; A, behind by `skew`, still replays it until its own
    // clock gets there.
    ahead.advance(TTL);
    behind.advance(TTL);
    assert!(
        b.get(&id("skewed")).await.unwrap().is_none(),
        "expired for B"
    );
    let Claim::Existing { record, .. } = a.claim(&req).await.unwrap() else {
        panic!("A claimed a record its clock still sees live");
    };
    assert_eq!(record.outcome.as_deref(), Some(&b"from B"[..]));
    behind.advance(skew);
    assert!(
        a.get(&id("skewed")).await.unwrap().is_none(),
        "expired for A too"
    );
}

/// An expired record whose token is not below what the clock gives (written within the
/// same millisecond) is replaced with a token above it: tokens never repeat.
#[tokio::test]
async fn an_expired_record_with_the_clocks_token_is_replaced_with_a_greater_one() {
    let (store, _clock, requests, _guard) = counted_store().await;
    // A lease and TTL of zero: the record is expired the instant it is written, so each claim
    // in the same millisecond replaces it, and the clock gives the same token each time.
    let req = request("zero", b"a", Duration::ZERO, Duration::ZERO);
    let Claim::Claimed { mut token, .. } = store.claim(&req).await.unwrap() else {
        panic!("a new key was not claimed");
    };
    requests.take();
    for _ in 0..3 {
        let Claim::Claimed { token: next, .. } = store.claim(&req).await.unwrap() else {
            panic!("an expired record was not claimed");
        };
        assert_eq!(next, token.next(), "one above the replaced record's");
        assert_eq!(
            requests.take(),
            ops(&[("PutItem", 2)]),
            "the clock's token was not above the record's: a second put, conditioned on it"
        );
        token = next;
    }
}

/// Turns the answer to the next request of one operation into a 500 after DynamoDB applied
/// it: the SDK sends the request again, as it does when an answer is lost.
#[derive(Debug, Clone, Default)]
struct LoseAnswer {
    armed: Arc<Mutex<Option<&'static str>>>,
    last: Arc<Mutex<String>>,
    lost: Arc<Mutex<usize>>,
    /// After the lost answer, answer every send of the same operation as throttled (the
    /// request never reached the condition check), until disarmed.
    then_throttle: Arc<Mutex<Option<&'static str>>>,
    throttled: Arc<Mutex<usize>>,
    /// Runs once, right after the answer is lost (before the SDK sends the write again).
    between: Arc<Mutex<Between>>,
}

impl Intercept for LoseAnswer {
    fn name(&self) -> &'static str {
        "LoseAnswer"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        *self.last.lock().unwrap() = operation(context);
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let mut armed = self.armed.lock().unwrap();
        let last = self.last.lock().unwrap().clone();
        if armed.is_some_and(|op| last == op) {
            assert_eq!(
                context.response().status().as_u16(),
                200,
                "the first send applied"
            );
            *context.response_mut().status_mut() =
                aws_smithy_runtime_api::http::StatusCode::try_from(500u16).unwrap();
            *armed = None;
            *self.lost.lock().unwrap() += 1;
            if let Some(between) = self.between.lock().unwrap().0.take() {
                between();
            }
        } else if self
            .then_throttle
            .lock()
            .unwrap()
            .is_some_and(|op| last == op)
        {
            let response = context.response_mut();
            *response.status_mut() =
                aws_smithy_runtime_api::http::StatusCode::try_from(400u16).unwrap();
            response
                .headers_mut()
                .insert("x-amzn-errortype", "ThrottlingException");
            *response.body_mut() = aws_smithy_types::body::SdkBody::from(
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#ThrottlingException","message":"Rate of requests exceeds the allowed throughput."}"#,
            );
            *self.throttled.lock().unwrap() += 1;
        }
        Ok(())
    }
}

/// Every write the SDK sends again after its first send applied (its answer lost) is
/// answered as the first send would have been: the store knows its own write by the nonce
/// it carries.
#[tokio::test]
async fn a_write_sent_again_after_it_applied_is_answered_as_the_first_send() {
    let lose = LoseAnswer::default();
    let (store, _clock, _guard) = intercepted_store(lose.clone()).await;
    let arm = |op: &'static str| *lose.armed.lock().unwrap() = Some(op);

    arm("PutItem");
    let req = request("again", b"a", LEASE, TTL);
    let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
        panic!("a claim sent again after it applied was not answered as claimed");
    };
    arm("UpdateItem");
    assert_eq!(
        store.extend(&id("again"), token, LEASE).await.unwrap(),
        Cas::Applied
    );
    arm("UpdateItem");
    assert_eq!(
        store
            .fail(&id("again"), token, &Failure::retryable("x"), TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
    arm("UpdateItem");
    let Reclaim::Reclaimed { token: taken, .. } = store
        .reclaim(
            &id("again"),
            token,
            &Fingerprint::from_bytes(b"a"),
            LEASE,
            TTL,
        )
        .await
        .unwrap()
    else {
        panic!("a reclaim sent again after it applied was not answered as reclaimed");
    };
    arm("UpdateItem");
    assert_eq!(
        store
            .complete(&id("again"), taken, b"done", TTL)
            .await
            .unwrap(),
        Cas::Applied
    );
    assert_eq!(*lose.lost.lock().unwrap(), 5, "five answers were lost");
    let record = store.get(&id("again")).await.unwrap().unwrap();
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(record.token, taken);
    assert_eq!(record.attempts, 2);
    // A second completion by the same holder, a call of its own, is still fenced.
    assert_eq!(
        store
            .complete(&id("again"), taken, b"done", TTL)
            .await
            .unwrap(),
        Cas::Fenced
    );
}

/// A holder's write whose first send applied and whose answer was lost, then every send
/// again throttled: the last error is a throttle, but the write applied, so its outcome is
/// unknown; a plain retryable error would let the engine treat it as not stored.
#[tokio::test]
async fn a_write_that_may_have_applied_before_a_throttled_resend_is_an_unknown_outcome() {
    let lose = LoseAnswer::default();
    let (store, _clock, _guard) = intercepted_store(lose.clone()).await;
    let Claim::Claimed { token, .. } = store
        .claim(&request("throttled", b"a", LEASE, TTL))
        .await
        .unwrap()
    else {
        panic!("a new key was not claimed");
    };
    *lose.armed.lock().unwrap() = Some("UpdateItem");
    *lose.then_throttle.lock().unwrap() = Some("UpdateItem");
    let e = store
        .complete(&id("throttled"), token, b"done", TTL)
        .await
        .unwrap_err();
    *lose.then_throttle.lock().unwrap() = None;
    assert_eq!(*lose.lost.lock().unwrap(), 1);
    assert!(
        *lose.throttled.lock().unwrap() >= 1,
        "the SDK sent it again"
    );
    assert!(matches!(e, Error::OutcomeUnknown { .. }), "{e:?}");
    let record = store.get(&id("throttled")).await.unwrap().unwrap();
    assert_eq!(
        record.status,
        RecordStatus::Completed,
        "the first send applied"
    );
}

/// A completion whose first send applied and whose answer was lost, and whose record then
/// expired and was claimed by another caller before the SDK sent the completion again: the
/// resend is refused by a record that is not this holder's, yet the first send stored the
/// outcome (a replay could have read it). That is an unknown outcome, never "fenced" (which
/// would tell the caller its outcome was not stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_whose_record_was_replaced_before_the_resend_is_an_unknown_outcome() {
    let lose = LoseAnswer::default();
    let (store, clock, _guard) = intercepted_store(lose.clone()).await;
    let other = DynamoStore::builder()
        .table(store.table())
        .clock(Arc::new(clock.clone()))
        .build(common::client())
        .unwrap();
    let retention = Duration::from_secs(1);
    let Claim::Claimed { token, .. } = store
        .claim(&request("replaced", b"a", LEASE, retention))
        .await
        .unwrap()
    else {
        panic!("a new key was not claimed");
    };
    let taker = Arc::new(Mutex::new(None));
    lose.between.lock().unwrap().0 = Some(Box::new({
        let (clock, taker) = (clock.clone(), taker.clone());
        move || {
            clock.advance(retention * 2);
            let handle = tokio::runtime::Handle::current();
            let claimed = tokio::task::block_in_place(|| {
                handle.block_on(other.claim(&request("replaced", b"b", LEASE, TTL)))
            });
            *taker.lock().unwrap() = Some(claimed);
        }
    }));
    *lose.armed.lock().unwrap() = Some("UpdateItem");
    let completed = store
        .complete(&id("replaced"), token, b"done", retention)
        .await;
    assert_eq!(*lose.lost.lock().unwrap(), 1);
    let taken = taker
        .lock()
        .unwrap()
        .take()
        .expect("the key was claimed again meanwhile");
    assert!(
        matches!(taken, Ok(Claim::Claimed { token: t, .. }) if t > token),
        "{taken:?}"
    );
    assert!(
        matches!(completed, Err(Error::OutcomeUnknown { .. })),
        "the completion applied, then its resend met another record: {completed:?}"
    );
}

/// Records the `Limit` of every `Scan` request (`None`: a scan without one).
#[derive(Debug, Clone, Default)]
struct ScanLimits(Arc<Mutex<Vec<Option<u64>>>>);

impl Intercept for ScanLimits {
    fn name(&self) -> &'static str {
        "ScanLimits"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        if operation(context) == "Scan" {
            let body = context.request().body().bytes().unwrap_or_default();
            let text = String::from_utf8_lossy(body);
            let limit = text.split("\"Limit\":").nth(1).and_then(|rest| {
                rest.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
                    .parse()
                    .ok()
            });
            self.0.lock().unwrap().push(limit);
        }
        Ok(())
    }
}

/// `purge_expired` reads a bounded number of items per call, whatever the table's size (one
/// `Scan` page of at most `max(10 × batch, 100)` items), and resumes where the last call
/// stopped, so successive calls sweep the whole table and find every expired record.
#[tokio::test]
async fn purge_reads_a_bounded_number_of_items_per_call_and_resumes() {
    let limits = ScanLimits::default();
    let (store, clock, _guard) = intercepted_store(limits.clone()).await;
    let short = Duration::from_secs(1);
    for i in 0..250 {
        let Claim::Claimed { .. } = store
            .claim(&request(&format!("live-{i}"), b"a", LEASE, TTL))
            .await
            .unwrap()
        else {
            panic!("a new key was not claimed");
        };
    }
    for i in 0..5 {
        let Claim::Claimed { .. } = store
            .claim(&request(&format!("expiring-{i}"), b"a", short, short))
            .await
            .unwrap()
        else {
            panic!("a new key was not claimed");
        };
    }
    clock.advance(Duration::from_secs(5));
    let mut removed = 0;
    let mut calls = 0;
    while removed < 5 {
        calls += 1;
        assert!(
            calls <= 30,
            "30 calls purged only {removed} of 5 expired records"
        );
        let n = store.purge_expired(1).await.unwrap();
        assert!(n <= 1, "a batch of 1 deleted {n}");
        removed += n;
        let scans = std::mem::take(&mut *limits.0.lock().unwrap());
        assert_eq!(
            scans,
            vec![Some(100)],
            "one page of at most 100 items per call"
        );
    }
    for i in 0..5 {
        assert!(store
            .get(&id(&format!("expiring-{i}")))
            .await
            .unwrap()
            .is_none());
    }
    let left = store
        .client()
        .scan()
        .table_name(store.table())
        .select(aws_sdk_dynamodb::types::Select::Count)
        .send()
        .await
        .unwrap();
    assert_eq!(left.count, 250, "only the expired records were deleted");
    eprintln!("5 expired records among 255 purged in {calls} calls of one page each");
}
