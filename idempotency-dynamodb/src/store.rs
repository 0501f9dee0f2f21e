//! The `IdempotencyStore` impl: a conditional `PutItem` per claim, a conditional
//! `UpdateItem` per compare-and-swap, each condition failure answered with the item as it
//! is (`ReturnValuesOnConditionCheckFailure = ALL_OLD`), so no operation needs a second read.

use crate::decode::{
    self, b, n, partition_key, s, status_number, Item, ATTEMPTS, CREATED, EXPIRES, FAILURE,
    FINGERPRINT, HITS, LEASE, MAX_ITEM_BYTES, MAX_OUTCOME_BYTES, NONCE, OUTCOME, RETRYABLE, STATUS,
    TOKEN, UPDATED,
};
use crate::error::{no_answer, sdk_error, Effect};
use crate::names::Names;
use crate::DynamoError;
use async_trait::async_trait;
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure};
use idempotency_core::store::{
    claim_retention, Cas, Claim, ClaimRequest, Clock, Failure, Reclaim, Record, RecordStatus,
    Timestamp,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The fewest items one `purge_expired` call may read, whatever its batch.
pub(crate) const PURGE_MIN_READ: usize = 100;

/// How many times a claim that met an expired record with a higher token, or an extension
/// that met a shorter expiry, tries again before it reports the record as it found it.
const ATTEMPTS_ON_A_MOVING_RECORD: usize = 4;

/// An idempotency store on a DynamoDB table: one item per record.
///
/// Built with [`DynamoStore::builder`]; the table is yours (see
/// [`DynamoStore::create_table`] and [`DynamoStore::verify`]).
#[derive(Clone, Debug)]
pub struct DynamoStore {
    pub(crate) client: aws_sdk_dynamodb::Client,
    pub(crate) names: Arc<Names>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) response_timeout: Duration,
    pub(crate) retention: Duration,
    /// Where the next `purge_expired` resumes its scan (`None`: at the table's start).
    pub(crate) purge_cursor: Arc<std::sync::Mutex<Option<Item>>>,
}

/// The condition of a settlement (complete or fail): the record live, Pending, held by
/// the settling token.
pub(crate) const SETTLE_CONDITION: &str = "#st = :pending AND #tok = :tok AND #exp > :now";

/// A settlement's update, as [`DynamoStore::settle_write`] builds it.
pub(crate) struct SettleWrite {
    pub(crate) update: String,
    pub(crate) names: Vec<(&'static str, String)>,
    pub(crate) values: Vec<(&'static str, AttributeValue)>,
    /// This write's nonce: how a send that applied is known again.
    pub(crate) nonce: String,
}

impl SettleWrite {
    fn names(&self) -> Vec<(&str, &str)> {
        self.names.iter().map(|(p, n)| (*p, n.as_str())).collect()
    }
}

/// What a conditional write answered.
enum Written {
    /// The condition held: the write applied (with the item after it, when asked for).
    Applied(Option<Item>),
    /// The condition failed: the item as it is, and whether the SDK sent the write more than
    /// once (an earlier send may then have applied, its answer lost).
    Refused(Item, Sent),
}

/// How many times the SDK sent one request (it sends again after a throttle, a 5xx or a
/// lost connection), counted by a per-request interceptor.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sends(Arc<std::sync::atomic::AtomicU32>);

/// Whether a request was sent once, or more than once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    Once,
    Again,
}

impl Sends {
    pub(crate) fn sent(&self) -> Sent {
        if self.0.load(Ordering::Relaxed) > 1 {
            Sent::Again
        } else {
            Sent::Once
        }
    }
}

impl aws_sdk_dynamodb::config::Intercept for Sends {
    fn name(&self) -> &'static str {
        "idempotency-dynamodb: sends of one request"
    }

    fn read_before_transmit(
        &self,
        _: &aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef<'_>,
        _: &aws_sdk_dynamodb::config::RuntimeComponents,
        _: &mut aws_sdk_dynamodb::config::ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl DynamoStore {
    /// A builder with the defaults: table `idempotency`, key attribute `pk`, TTL attribute
    /// `ttl`, the system clock.
    pub fn builder() -> crate::DynamoStoreBuilder {
        crate::DynamoStoreBuilder::default()
    }

    /// The SDK client the store sends through.
    pub fn client(&self) -> &aws_sdk_dynamodb::Client {
        &self.client
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.names.table
    }

    /// Runs `request` within the response timeout.
    pub(crate) async fn timed<T>(
        &self,
        effect: Effect,
        request: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        match tokio::time::timeout(self.response_timeout, request).await {
            Ok(r) => r,
            Err(_) => Err(no_answer(self.response_timeout, effect)),
        }
    }

    pub(crate) fn key(&self, id: &RecordId) -> (String, AttributeValue) {
        (self.names.key.clone(), s(partition_key(id)))
    }

    /// The TTL attribute's value for a record whose logical expiry is `expires_at`: epoch
    /// seconds, `retention` later, rounded up.
    fn ttl_value(&self, expires_at: Timestamp) -> AttributeValue {
        let ms = expires_at.saturating_add(self.retention).as_millis().max(0);
        n((ms + 999) / 1000)
    }

    /// A fresh Pending record for `request`, claimed at `now` with `token`.
    fn fresh_item(
        &self,
        request: &ClaimRequest,
        now: Timestamp,
        token: FencingToken,
        nonce: &str,
    ) -> Item {
        let lease_until = now.saturating_add(request.lease);
        let expires_at = request.expires_at(now);
        let (k, v) = self.key(&request.id);
        HashMap::from([
            (k, v),
            (STATUS.to_owned(), n(status_number(RecordStatus::Pending))),
            (TOKEN.to_owned(), n(token.0)),
            (ATTEMPTS.to_owned(), n(1)),
            (HITS.to_owned(), n(0)),
            (LEASE.to_owned(), n(lease_until.as_millis())),
            (
                FINGERPRINT.to_owned(),
                b(request.fingerprint.as_bytes().to_vec()),
            ),
            (CREATED.to_owned(), n(now.as_millis())),
            (UPDATED.to_owned(), n(now.as_millis())),
            (EXPIRES.to_owned(), n(expires_at.as_millis())),
            (self.names.ttl.clone(), self.ttl_value(expires_at)),
            (NONCE.to_owned(), s(nonce)),
        ])
    }

    /// A conditional `PutItem`.
    async fn put(
        &self,
        item: Item,
        condition: &str,
        names: &[(&str, &str)],
        values: Vec<(&str, AttributeValue)>,
    ) -> Result<Written, Error> {
        let mut request = self
            .client
            .put_item()
            .table_name(&self.names.table)
            .set_item(Some(item))
            .condition_expression(condition)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        for (placeholder, name) in names {
            request = request.expression_attribute_names(*placeholder, *name);
        }
        for (placeholder, value) in values {
            request = request.expression_attribute_values(placeholder, value);
        }
        let sends = Sends::default();
        self.timed(Effect::Repeatable, async {
            match request.customize().interceptor(sends.clone()).send().await {
                Ok(_) => Ok(Written::Applied(None)),
                Err(SdkError::ServiceError(e))
                    if matches!(e.err(), PutItemError::ConditionalCheckFailedException(_)) =>
                {
                    match e.into_err() {
                        PutItemError::ConditionalCheckFailedException(c) => c
                            .item
                            .map(|item| Written::Refused(item, sends.sent()))
                            .ok_or_else(|| DynamoError::NoItemReturned("PutItem").into()),
                        _ => unreachable_error(),
                    }
                }
                Err(e) => Err(sdk_error("PutItem", e, Effect::Repeatable)),
            }
        })
        .await
    }

    /// A conditional `UpdateItem` of `id`'s record, answering the item after it when it
    /// applied (if `all_new`).
    #[allow(clippy::too_many_arguments)]
    async fn update(
        &self,
        id: &RecordId,
        update: &str,
        condition: &str,
        names: &[(&str, &str)],
        values: Vec<(&str, AttributeValue)>,
        effect: Effect,
        all_new: bool,
    ) -> Result<Written, Error> {
        let (k, v) = self.key(id);
        let mut request = self
            .client
            .update_item()
            .table_name(&self.names.table)
            .key(k, v)
            .update_expression(update)
            .condition_expression(condition)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        if all_new {
            request = request.return_values(ReturnValue::AllNew);
        }
        for (placeholder, name) in names {
            request = request.expression_attribute_names(*placeholder, *name);
        }
        for (placeholder, value) in values {
            request = request.expression_attribute_values(placeholder, value);
        }
        let sends = Sends::default();
        self.timed(effect, async {
            match request.customize().interceptor(sends.clone()).send().await {
                Ok(out) => Ok(Written::Applied(out.attributes)),
                Err(SdkError::ServiceError(e))
                    if matches!(e.err(), UpdateItemError::ConditionalCheckFailedException(_)) =>
                {
                    match e.into_err() {
                        UpdateItemError::ConditionalCheckFailedException(c) => Ok(
                            // An absent record has no item to return.
                            Written::Refused(c.item.unwrap_or_default(), sends.sent()),
                        ),
                        _ => unreachable_error(),
                    }
                }
                Err(e) => Err(sdk_error("UpdateItem", e, effect)),
            }
        })
        .await
    }

    /// The record in `item`, or `None` for an absent record (an empty item).
    pub(crate) fn decode(&self, id: &RecordId, item: &Item) -> Result<Option<Record>, Error> {
        if item.is_empty() {
            return Ok(None);
        }
        decode::record(&self.names, id, item).map(Some)
    }

    /// Whether `item` is `id`'s record as a write of this call left it: same token and
    /// nonce (claims and reclaims), so an SDK retry of a write that applied is recognised.
    pub(crate) fn written_by(&self, item: &Item, token: FencingToken, nonce: &str) -> bool {
        decode::number::<u64>(item, TOKEN).ok() == Some(token.0)
            && decode::nonce(item) == Some(nonce)
    }

    /// The compare-and-swap shared by complete and fail: live, Pending, held by `token`.
    async fn settle(
        &self,
        id: &RecordId,
        token: FencingToken,
        set: Vec<(&'static str, AttributeValue)>,
        remove: &[&'static str],
        ttl: Duration,
        status: RecordStatus,
    ) -> Result<Cas, Error> {
        let write = self.settle_write(set, remove, ttl, status, token)?;
        let written = self
            .update(
                id,
                &write.update,
                SETTLE_CONDITION,
                &write.names(),
                write.values.clone(),
                Effect::Cas,
                false,
            )
            .await?;
        Ok(match written {
            Written::Applied(_) => Cas::Applied,
            // Sent again by the SDK after the first send applied: the record carries this
            // call's nonce.
            Written::Refused(item, _) if self.written_by(&item, token, &write.nonce) => {
                Cas::Applied
            }
            // Another record now, but an earlier send may have settled this holder's record
            // before it expired and was claimed again: a completion that may be stored (and
            // replayed) is never reported as fenced.
            Written::Refused(_, Sent::Again) => {
                return Err(Error::OutcomeUnknown {
                    source: Box::new(DynamoError::RefusedAfterResend("UpdateItem")),
                })
            }
            Written::Refused(_, Sent::Once) => Cas::Fenced,
        })
    }

    /// The update expression, names and values of a settlement (complete or fail) by
    /// `token`, whose condition is [`SETTLE_CONDITION`]; refused before anything is sent
    /// when the record would pass the item limit.
    pub(crate) fn settle_write(
        &self,
        set: Vec<(&'static str, AttributeValue)>,
        remove: &[&'static str],
        ttl: Duration,
        status: RecordStatus,
        token: FencingToken,
    ) -> Result<SettleWrite, Error> {
        let now = self.clock.now();
        let expires_at = now.saturating_add(ttl);
        let nonce = self.nonce();
        let mut names: Vec<(&'static str, String)> = vec![
            ("#st", STATUS.to_owned()),
            ("#tok", TOKEN.to_owned()),
            ("#exp", EXPIRES.to_owned()),
            ("#ttl", self.names.ttl.clone()),
            ("#ua", UPDATED.to_owned()),
            ("#nonce", NONCE.to_owned()),
        ];
        let mut values = vec![
            (":nonce", s(nonce.clone())),
            (":st", n(status_number(status))),
            (":pending", n(status_number(RecordStatus::Pending))),
            (":tok", n(token.0)),
            (":now", n(now.as_millis())),
            (":exp", n(expires_at.as_millis())),
            (":ttl", self.ttl_value(expires_at)),
        ];
        let mut update =
            String::from("SET #st = :st, #exp = :exp, #ttl = :ttl, #ua = :now, #nonce = :nonce");
        let set_placeholders = ["#s0", "#s1", "#s2"];
        let set_values = [":s0", ":s1", ":s2"];
        let mut size = 0;
        for (i, (name, value)) in set.into_iter().enumerate() {
            update.push_str(&format!(", {} = {}", set_placeholders[i], set_values[i]));
            names.push((set_placeholders[i], name.to_owned()));
            size += match &value {
                AttributeValue::B(b) => b.as_ref().len(),
                AttributeValue::S(s) => s.len(),
                _ => 0,
            };
            values.push((set_values[i], value));
        }
        let remove_placeholders = ["#r0", "#r1", "#r2"];
        if !remove.is_empty() {
            update.push_str(" REMOVE ");
            for (i, name) in remove.iter().enumerate() {
                if i > 0 {
                    update.push_str(", ");
                }
                update.push_str(remove_placeholders[i]);
                names.push((remove_placeholders[i], (*name).to_owned()));
            }
        }
        self.check_size(size)?;
        Ok(SettleWrite {
            update,
            names,
            values,
            nonce,
        })
    }

    /// Refuses a record whose item would pass DynamoDB's limit, before anything is sent.
    /// `payload`: the outcome's or failure's bytes.
    fn check_size(&self, payload: usize) -> Result<(), Error> {
        if payload > MAX_OUTCOME_BYTES {
            return Err(DynamoError::ItemTooLarge {
                size: payload + (MAX_ITEM_BYTES - MAX_OUTCOME_BYTES),
                limit: MAX_ITEM_BYTES,
                outcome: payload,
            }
            .into());
        }
        Ok(())
    }

    /// A fresh nonce: which claim or reclaim wrote a record.
    fn nonce(&self) -> String {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let c = COUNTER.fetch_add(1, Ordering::Relaxed);
        let seed = *NONCE_SEED;
        format!("{seed:016x}{c:016x}")
    }
}

/// Random per process: nonces of two processes never meet.
static NONCE_SEED: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
});

fn unreachable_error<T>() -> Result<T, Error> {
    Err(Error::backend(
        false,
        "the SDK changed an error's kind while reading it",
    ))
}

#[async_trait]
impl IdempotencyStore for DynamoStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let id = &request.id;
        let now = self.clock.now();
        let nonce = self.nonce();
        let lease_until = now.saturating_add(request.lease);
        let key = self.names.key.as_str();
        // First: absent, or expired with a lower token than the clock's.
        let mut token = FencingToken::fresh(now, None);
        let mut condition = "attribute_not_exists(#k) OR (#exp <= :now AND #tok < :tok)";
        let mut replaced: Option<u64> = None;
        for _ in 0..ATTEMPTS_ON_A_MOVING_RECORD {
            let mut values = vec![(":now", n(now.as_millis())), (":tok", n(token.0))];
            if let Some(old) = replaced {
                values.push((":old", n(old)));
            }
            let written = self
                .put(
                    self.fresh_item(request, now, token, &nonce),
                    condition,
                    &[("#k", key), ("#exp", EXPIRES), ("#tok", TOKEN)],
                    values,
                )
                .await?;
            let item = match written {
                Written::Applied(_) => return Ok(Claim::Claimed { token, lease_until }),
                Written::Refused(item, _) if self.written_by(&item, token, &nonce) => {
                    return Ok(Claim::Claimed { token, lease_until })
                }
                Written::Refused(item, _) => item,
            };
            let record = decode::record(&self.names, id, &item)?;
            if record.is_expired(now) {
                // Expired, with a token at or above the clock's: replace exactly that
                // record, with a token above it.
                token = FencingToken::fresh(now, Some(record.token));
                replaced = Some(record.token.0);
                // Absent again (a purge or DynamoDB's TTL deleted it meanwhile) is as good.
                condition =
                    "attribute_not_exists(#k) OR (#tok = :old AND #exp <= :now AND #tok < :tok)";
                continue;
            }
            if !request.count_hit {
                return Ok(Claim::Existing { record, now });
            }
            match self.count_hit(id, now).await? {
                Some(record) => return Ok(Claim::Existing { record, now }),
                // Expired or deleted since: claim it, from the start.
                None => {
                    token = FencingToken::fresh(now, None);
                    condition = "attribute_not_exists(#k) OR (#exp <= :now AND #tok < :tok)";
                    replaced = None;
                }
            }
        }
        Err(Error::backend(
            true,
            "the record kept changing under the claim; try again",
        ))
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.settle(
            id,
            token,
            vec![(OUTCOME, b(outcome.to_vec()))],
            &[LEASE, FAILURE, RETRYABLE],
            ttl,
            RecordStatus::Completed,
        )
        .await
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.settle(
            id,
            token,
            vec![
                (FAILURE, s(failure.message.clone())),
                (RETRYABLE, AttributeValue::Bool(failure.retryable)),
            ],
            &[LEASE, OUTCOME],
            ttl,
            RecordStatus::Failed,
        )
        .await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        let now = self.clock.now();
        let until = now.saturating_add(lease);
        // Usually the record outlives the new lease; when it does not, its expiry moves
        // with the lease, conditioned on the expiry read.
        let nonce = self.nonce();
        let mut update = "SET #lease = :until, #ua = :now, #nonce = :nonce";
        let mut condition = "#st = :pending AND #tok = :tok AND #exp > :now AND #exp >= :until";
        let mut read_expiry: Option<i64> = None;
        for _ in 0..ATTEMPTS_ON_A_MOVING_RECORD {
            let mut names = vec![
                ("#st", STATUS),
                ("#tok", TOKEN),
                ("#exp", EXPIRES),
                ("#lease", LEASE),
                ("#ua", UPDATED),
                ("#nonce", NONCE),
            ];
            let mut values = vec![
                (":nonce", s(nonce.clone())),
                (":pending", n(status_number(RecordStatus::Pending))),
                (":tok", n(token.0)),
                (":now", n(now.as_millis())),
                (":until", n(until.as_millis())),
            ];
            if let Some(old) = read_expiry {
                names.push(("#ttl", &self.names.ttl));
                values.push((":old", n(old)));
                values.push((":ttl", self.ttl_value(until)));
            }
            let written = self
                .update(id, update, condition, &names, values, Effect::Cas, false)
                .await?;
            let item = match written {
                Written::Applied(_) => return Ok(Cas::Applied),
                Written::Refused(item, _) => item,
            };
            let held = decode::number::<u8>(&item, STATUS).ok()
                == Some(status_number(RecordStatus::Pending))
                && decode::number::<u64>(&item, TOKEN).ok() == Some(token.0);
            let expiry = decode::number::<i64>(&item, EXPIRES).ok();
            // Sent again after the first send applied: the record carries this call's nonce.
            if self.written_by(&item, token, &nonce) {
                return Ok(Cas::Applied);
            }
            match expiry {
                // Held, but the record would expire before the new lease: move its expiry
                // with the lease, conditioned on the expiry read.
                Some(e) if held && e > now.as_millis() && e < until.as_millis() => {
                    update = "SET #lease = :until, #exp = :until, #ttl = :ttl, #ua = :now, \
                              #nonce = :nonce";
                    condition = "#st = :pending AND #tok = :tok AND #exp > :now AND #exp = :old";
                    read_expiry = Some(e);
                }
                // Held, and its expiry moved past the new lease meanwhile: the first form.
                Some(e) if held && e > now.as_millis() => {
                    update = "SET #lease = :until, #ua = :now, #nonce = :nonce";
                    condition = "#st = :pending AND #tok = :tok AND #exp > :now AND #exp >= :until";
                    read_expiry = None;
                }
                _ => return Ok(Cas::Fenced),
            }
        }
        // Still held, but its expiry kept moving under this call: not fenced, try again.
        Err(Error::backend(
            true,
            "the record's expiry kept changing under the extension; try again",
        ))
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        let now = self.clock.now();
        let token = expected.next();
        let lease_until = now.saturating_add(lease);
        let expires_at = now.saturating_add(claim_retention(lease, ttl));
        let nonce = self.nonce();
        let written = self
            .update(
                id,
                "SET #tok = :ntok, #st = :pending, #fp = :fp, #att = #att + :one, \
                 #lease = :until, #ua = :now, #exp = :exp, #ttl = :ttl, #nonce = :nonce \
                 REMOVE #out, #fmsg, #fretry",
                "#tok = :expected AND #exp > :now AND \
                 ((#st = :failed AND (#fretry = :true OR #fp <> :fp)) \
                  OR (#st = :pending AND #lease <= :now))",
                &[
                    ("#tok", TOKEN),
                    ("#st", STATUS),
                    ("#fp", FINGERPRINT),
                    ("#att", ATTEMPTS),
                    ("#lease", LEASE),
                    ("#ua", UPDATED),
                    ("#exp", EXPIRES),
                    ("#ttl", &self.names.ttl),
                    ("#nonce", NONCE),
                    ("#out", OUTCOME),
                    ("#fmsg", FAILURE),
                    ("#fretry", RETRYABLE),
                ],
                vec![
                    (":ntok", n(token.0)),
                    (":expected", n(expected.0)),
                    (":pending", n(status_number(RecordStatus::Pending))),
                    (":failed", n(status_number(RecordStatus::Failed))),
                    (":true", AttributeValue::Bool(true)),
                    (":fp", b(fingerprint.as_bytes().to_vec())),
                    (":one", n(1)),
                    (":until", n(lease_until.as_millis())),
                    (":now", n(now.as_millis())),
                    (":exp", n(expires_at.as_millis())),
                    (":ttl", self.ttl_value(expires_at)),
                    (":nonce", s(nonce.clone())),
                ],
                Effect::Cas,
                false,
            )
            .await?;
        Ok(match written {
            Written::Applied(_) => Reclaim::Reclaimed { token, lease_until },
            Written::Refused(item, _) if self.written_by(&item, token, &nonce) => {
                Reclaim::Reclaimed { token, lease_until }
            }
            Written::Refused(_, _) => Reclaim::Lost,
        })
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let now = self.clock.now();
        match self.read_item(id).await? {
            None => Ok(None),
            Some(item) => Ok(self.decode(id, &item)?.filter(|r| !r.is_expired(now))),
        }
    }

    /// Deletes up to `batch` expired records, reading at most `max(10 × batch, 100)` items:
    /// the scan resumes where the last call stopped (after the last item it handled) and
    /// starts over at the table's end, so each call's cost is bounded however large the
    /// table, and successive calls sweep it. A call that fails keeps the place of its last
    /// good page.
    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        let mut start = self
            .purge_cursor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let result = self.purge_from(&mut start, batch).await;
        *self
            .purge_cursor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = start;
        result
    }
}

impl DynamoStore {
    /// [`IdempotencyStore::purge_expired`] from `start` (the table's start when `None`),
    /// which it leaves where the next call should resume: after the last item handled, or
    /// `None` at the table's end.
    async fn purge_from(&self, start: &mut Option<Item>, batch: usize) -> Result<u64, Error> {
        let now = self.clock.now();
        let mut removed = 0u64;
        let want = u64::try_from(batch).unwrap_or(u64::MAX);
        let budget = batch.saturating_mul(10).max(PURGE_MIN_READ);
        let mut read = 0usize;
        while removed < want && read < budget {
            let page_size = i32::try_from((budget - read).min(1_000)).unwrap_or(1_000);
            let request = self
                .client
                .scan()
                .table_name(&self.names.table)
                .consistent_read(true)
                .limit(page_size)
                .filter_expression("#exp <= :now")
                .projection_expression("#k, #tok")
                .expression_attribute_names("#exp", EXPIRES)
                .expression_attribute_names("#k", &self.names.key)
                .expression_attribute_names("#tok", TOKEN)
                .expression_attribute_values(":now", n(now.as_millis()))
                .set_exclusive_start_key(start.clone());
            let page = self
                .timed(Effect::Repeatable, async {
                    request
                        .send()
                        .await
                        .map_err(|e| sdk_error("Scan", e, Effect::Repeatable))
                })
                .await?;
            read += usize::try_from(page.scanned_count).unwrap_or(0).max(1);
            let next = page.last_evaluated_key.filter(|k| !k.is_empty());
            let items = page.items.unwrap_or_default();
            let last = items.len();
            for (i, item) in items.into_iter().enumerate() {
                let Some(key) = item.get(&self.names.key) else {
                    continue;
                };
                if let Some(token) = item.get(TOKEN) {
                    removed += u64::from(self.delete_expired(key, token, now).await?);
                }
                if removed >= want && i + 1 < last {
                    // Stopped inside the page: the next call resumes after this item.
                    *start = Some(HashMap::from([(self.names.key.clone(), key.clone())]));
                    return Ok(removed);
                }
            }
            *start = next;
            if start.is_none() {
                break; // the table's end: the next call starts over
            }
        }
        Ok(removed)
    }

    /// Deletes `key`'s record if it is still the expired record with `token`; whether it did.
    async fn delete_expired(
        &self,
        key: &AttributeValue,
        token: &AttributeValue,
        now: Timestamp,
    ) -> Result<bool, Error> {
        let request = self
            .client
            .delete_item()
            .table_name(&self.names.table)
            .key(&self.names.key, key.clone())
            .condition_expression("#tok = :tok AND #exp <= :now")
            .expression_attribute_names("#tok", TOKEN)
            .expression_attribute_names("#exp", EXPIRES)
            .expression_attribute_values(":tok", token.clone())
            .expression_attribute_values(":now", n(now.as_millis()));
        self.timed(Effect::Repeatable, async {
            match request.send().await {
                Ok(_) => Ok(true),
                Err(SdkError::ServiceError(e))
                    if e.err().is_conditional_check_failed_exception() =>
                {
                    Ok(false)
                }
                Err(e) => Err(sdk_error("DeleteItem", e, Effect::Repeatable)),
            }
        })
        .await
    }

    /// `id`'s item as it is (a consistent read), expired or not.
    pub(crate) async fn read_item(&self, id: &RecordId) -> Result<Option<Item>, Error> {
        let (k, v) = self.key(id);
        let request = self
            .client
            .get_item()
            .table_name(&self.names.table)
            .key(k, v)
            .consistent_read(true);
        let out = self
            .timed(Effect::Repeatable, async {
                request
                    .send()
                    .await
                    .map_err(|e| sdk_error("GetItem", e, Effect::Repeatable))
            })
            .await?;
        Ok(out.item)
    }

    /// Counts a hit on the live record, whichever holder it has now: an `ADD` conditioned
    /// on the record being live, answering the record after it (`None`: it is absent or
    /// expired now, so the claim starts again).
    async fn count_hit(&self, id: &RecordId, now: Timestamp) -> Result<Option<Record>, Error> {
        let written = self
            .update(
                id,
                "ADD #hits :one",
                "attribute_exists(#k) AND #exp > :now",
                &[("#hits", HITS), ("#k", &self.names.key), ("#exp", EXPIRES)],
                vec![(":one", n(1)), (":now", n(now.as_millis()))],
                Effect::Repeatable,
                true,
            )
            .await?;
        match written {
            Written::Applied(Some(item)) => self.decode(id, &item),
            Written::Applied(None) => Err(Error::backend(
                false,
                "UpdateItem with ReturnValues = ALL_NEW returned no item",
            )),
            Written::Refused(..) => Ok(None),
        }
    }
}
