//! Exactly-once on DynamoDB, the transaction-specific steps core drives
//! ([`TransactionalStore`]): the work's writes are collected, and the commit sends them with
//! the record's fenced completion as one `TransactWriteItems`, so they apply together or not
//! at all.

use crate::decode::{b, Item, FAILURE, LEASE, OUTCOME, RETRYABLE};
use crate::error::{no_answer, sdk_error, Effect};
use crate::store::{Sends, Sent, SETTLE_CONDITION};
use crate::{DynamoError, DynamoStore};
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{
    ConditionCheck, Delete, Put, ReturnValuesOnConditionCheckFailure, TransactWriteItem, Update,
};
use idempotency_core::protocol::Lease;
use idempotency_core::store::{async_trait, Begun, CommitError, RecordStatus};
use idempotency_core::{Error, FencingToken, RecordId, TransactionalStore};

/// How many writes one transaction's work may add: DynamoDB's limit of 100 actions per
/// `TransactWriteItems`, less the record's completion.
pub const MAX_TRANSACTION_WRITES: usize = 99;

/// The cancellation code DynamoDB gives an action whose condition failed.
const CONDITION_FAILED: &str = "ConditionalCheckFailed";

/// The writes of one exactly-once call, for
/// [`Idempotency::run_in_transaction`](idempotency_core::Idempotency::run_in_transaction):
/// the work adds its writes (puts, updates, deletes, condition checks, on any of your
/// tables), and the store sends them with the record's completion as one
/// `TransactWriteItems` when the work returns `Ok`. Nothing is sent before then: what the
/// work reads, it reads with your own client.
///
/// A write's condition that fails cancels the whole transaction: the caller gets
/// [`DynamoError::TransactionCanceled`], which says which write failed, and nothing took
/// effect (under `run_in_transaction` the key is then released).
///
/// ```
/// use idempotency_dynamodb::aws_sdk_dynamodb::types::{AttributeValue, Put};
/// use idempotency_dynamodb::DynamoTransaction;
///
/// fn order(tx: &mut DynamoTransaction, id: &str) -> Result<(), idempotency_core::Error> {
///     tx.put(
///         Put::builder()
///             .table_name("orders")
///             .item("id", AttributeValue::S(id.to_owned()))
///             .condition_expression("attribute_not_exists(id)")
///             .build()
///             .map_err(|e| idempotency_core::Error::backend(false, e))?,
///     )?;
///     Ok(())
/// }
/// ```
#[derive(Debug, Default)]
pub struct DynamoTransaction {
    writes: Vec<TransactWriteItem>,
    completion: Option<Completion>,
}

/// The record's completion, sent last in the transaction.
#[derive(Debug)]
struct Completion {
    write: TransactWriteItem,
    id: RecordId,
    token: FencingToken,
    nonce: String,
}

impl DynamoTransaction {
    /// Adds a write. [`DynamoError::TooManyWrites`] once the transaction holds
    /// [`MAX_TRANSACTION_WRITES`].
    pub fn push(&mut self, write: TransactWriteItem) -> Result<&mut Self, Error> {
        if self.writes.len() >= MAX_TRANSACTION_WRITES {
            return Err(DynamoError::TooManyWrites {
                limit: MAX_TRANSACTION_WRITES,
            }
            .into());
        }
        self.writes.push(write);
        Ok(self)
    }

    /// Adds a `Put`.
    pub fn put(&mut self, put: Put) -> Result<&mut Self, Error> {
        self.push(TransactWriteItem::builder().put(put).build())
    }

    /// Adds an `Update`.
    pub fn update(&mut self, update: Update) -> Result<&mut Self, Error> {
        self.push(TransactWriteItem::builder().update(update).build())
    }

    /// Adds a `Delete`.
    pub fn delete(&mut self, delete: Delete) -> Result<&mut Self, Error> {
        self.push(TransactWriteItem::builder().delete(delete).build())
    }

    /// Adds a `ConditionCheck`: a condition on an item the transaction does not write.
    pub fn condition_check(&mut self, check: ConditionCheck) -> Result<&mut Self, Error> {
        self.push(TransactWriteItem::builder().condition_check(check).build())
    }

    /// The writes added so far, in order (their indices are the ones
    /// [`DynamoError::TransactionCanceled`] names).
    pub fn writes(&self) -> &[TransactWriteItem] {
        &self.writes
    }
}

/// One action of a cancelled transaction, as DynamoDB gave its reason.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CancelledWrite {
    /// The write's index among [`DynamoTransaction::writes`]; the record's completion, sent
    /// last, has the index [`DynamoTransaction::writes`]`.len()`.
    pub index: usize,
    /// Whether this is the record's completion rather than one of the work's writes.
    pub completion: bool,
    /// DynamoDB's code: `ConditionalCheckFailed`, `TransactionConflict`,
    /// `ThrottlingError`, `ValidationError`, …
    pub code: String,
    /// DynamoDB's message, if it sent one.
    pub message: Option<String>,
}

impl std::fmt::Display for CancelledWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.completion {
            write!(f, "the record's completion: {}", self.code)?;
        } else {
            write!(f, "write {}: {}", self.index, self.code)?;
        }
        match &self.message {
            Some(m) => write!(f, " ({m})"),
            None => Ok(()),
        }
    }
}

/// The actions DynamoDB gave a reason for (every code but `None`).
pub(crate) fn cancelled_writes(
    reasons: &[aws_sdk_dynamodb::types::CancellationReason],
    completion: usize,
) -> Vec<CancelledWrite> {
    reasons
        .iter()
        .enumerate()
        .filter_map(|(index, r)| {
            let code = r.code()?;
            (code != "None").then(|| CancelledWrite {
                index,
                completion: index == completion,
                code: code.to_owned(),
                message: r.message().map(str::to_owned),
            })
        })
        .collect()
}

impl DynamoStore {
    /// Commits `writes` with the completion of `id`'s record by `token` (the record
    /// Completed with `outcome` for `ttl`) as one `TransactWriteItems`: both apply or
    /// neither does. For code that holds a claim outside
    /// [`Idempotency::run_in_transaction`](idempotency_core::Idempotency::run_in_transaction),
    /// such as an HTTP handler under the idempotency layer (its claimed key's id, token and
    /// TTL).
    ///
    /// [`Error::LeaseLost`] when the record is no longer this holder's (nothing applied);
    /// [`Error::OutcomeUnknown`] when whether it applied is not known (an earlier send may
    /// have applied, or may still: hold the key until its lease passes); any other error
    /// means nothing applied (a cancellation by one of your conditions, a request DynamoDB
    /// refuses for its shape).
    pub async fn complete_with(
        &self,
        mut writes: DynamoTransaction,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: std::time::Duration,
    ) -> Result<(), Error> {
        writes.completion = Some(self.completion(id, token, outcome, ttl)?);
        match self.commit(writes).await {
            Ok(()) => Ok(()),
            Err(CommitError::NotCommitted(e) | CommitError::Unknown(e)) => Err(e),
            Err(e) => Err(Error::backend(false, format!("{e:?}"))),
        }
    }

    /// The completion action: the `UpdateItem` of
    /// [`IdempotencyStore::complete`](idempotency_core::IdempotencyStore::complete), as a
    /// transaction action; refused before anything is sent when the record would pass the
    /// item limit.
    fn completion(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: std::time::Duration,
    ) -> Result<Completion, Error> {
        let write = self.settle_write(
            vec![(OUTCOME, b(outcome.to_vec()))],
            &[LEASE, FAILURE, RETRYABLE],
            ttl,
            RecordStatus::Completed,
            token,
        )?;
        let (k, v) = self.key(id);
        let mut update = Update::builder()
            .table_name(self.table())
            .key(k, v)
            .update_expression(write.update)
            .condition_expression(SETTLE_CONDITION)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        for (placeholder, name) in write.names {
            update = update.expression_attribute_names(placeholder, name);
        }
        for (placeholder, value) in write.values {
            update = update.expression_attribute_values(placeholder, value);
        }
        let update = update.build().map_err(|e| Error::backend(false, e))?;
        Ok(Completion {
            write: TransactWriteItem::builder().update(update).build(),
            id: id.clone(),
            token,
            nonce: write.nonce,
        })
    }

    /// Whether `id`'s record, read now, is the completion `nonce` wrote: the transaction
    /// applied. `None` when the record cannot be read.
    async fn applied(&self, completion: &Completion) -> Option<bool> {
        let item = self.read_item(&completion.id).await.ok()?;
        Some(item.is_some_and(|item| self.completed_by(&item, completion)))
    }

    fn completed_by(&self, item: &Item, completion: &Completion) -> bool {
        self.written_by(item, completion.token, &completion.nonce)
            && crate::decode::number::<u8>(item, crate::decode::STATUS).ok()
                == Some(crate::decode::status_number(RecordStatus::Completed))
    }

    /// What a cancelled transaction means.
    ///
    /// A transaction the SDK sent more than once, cancelled by a record that is not this
    /// completion's, is of unknown outcome: an earlier send may have committed before the
    /// record expired and was claimed again.
    async fn cancelled(
        &self,
        reasons: &[aws_sdk_dynamodb::types::CancellationReason],
        index: usize,
        completion: &Completion,
        sent: Sent,
    ) -> Result<(), CommitError> {
        let writes = cancelled_writes(reasons, index);
        if let Some(reason) = reasons.get(index) {
            if reason.code() == Some(CONDITION_FAILED) {
                // The record is not this holder's Pending record any more: fenced, unless
                // it is the completion of this very transaction (an earlier send of it
                // applied, and the SDK sent it again).
                let applied = match reason.item() {
                    Some(item) => Some(self.completed_by(item, completion)),
                    None => self.applied(completion).await,
                };
                return match applied {
                    Some(true) => Ok(()),
                    Some(false) if sent == Sent::Again => {
                        Err(CommitError::Unknown(Error::OutcomeUnknown {
                            source: Box::new(DynamoError::RefusedAfterResend("TransactWriteItems")),
                        }))
                    }
                    Some(false) => Err(CommitError::NotCommitted(Error::LeaseLost {
                        token: completion.token,
                    })),
                    // The record could not be read: an earlier send may have applied.
                    None => Err(CommitError::Unknown(Error::OutcomeUnknown {
                        source: Box::new(DynamoError::TransactionCanceled { writes }),
                    })),
                };
            }
        }
        let conflict = writes.iter().any(|w| w.code == "TransactionConflict");
        let throttled = writes
            .iter()
            .any(|w| w.code == "ThrottlingError" || w.code == "ProvisionedThroughputExceeded");
        let error = DynamoError::TransactionCanceled { writes };
        // An earlier send of this transaction may have applied before this one was
        // cancelled (the work's own conditions then fail): the record tells.
        match self.applied(completion).await {
            Some(true) => return Ok(()),
            Some(false) if sent == Sent::Once => {}
            _ => {
                return Err(CommitError::Unknown(Error::OutcomeUnknown {
                    source: Box::new(error),
                }))
            }
        }
        Err(CommitError::NotCommitted(Error::backend(
            conflict || throttled,
            error,
        )))
    }
}

#[async_trait]
impl TransactionalStore for DynamoStore {
    type Transaction = DynamoTransaction;
    type Connection = DynamoTransaction;
    type WorkError = Error;

    fn connection(transaction: &mut DynamoTransaction) -> &mut DynamoTransaction {
        transaction
    }

    fn connection_ref(transaction: &DynamoTransaction) -> &DynamoTransaction {
        transaction
    }

    fn work_error(error: Error) -> Error {
        error
    }

    /// Nothing to begin on DynamoDB: the writes are collected and sent at the commit, and
    /// the heartbeat keeps the lease meanwhile.
    async fn begin(&self, _lease: &Lease) -> Result<Begun<DynamoTransaction>, Error> {
        Ok(Begun::Open(DynamoTransaction::default()))
    }

    /// Builds the completion (the `UpdateItem` of [`IdempotencyStore::complete`], as a
    /// transaction action); refused before anything is sent when the record would pass
    /// the item limit.
    ///
    /// [`IdempotencyStore::complete`]: idempotency_core::IdempotencyStore::complete
    async fn complete_in(
        &self,
        tx: &mut DynamoTransaction,
        lease: &Lease,
        outcome: &[u8],
    ) -> Result<(), Error> {
        tx.completion =
            Some(self.completion(lease.id(), lease.token(), outcome, lease.retention())?);
        Ok(())
    }

    /// Sends the work's writes and the completion as one `TransactWriteItems`. A send whose
    /// answer is lost or refused after the SDK sent it again is settled by reading the
    /// record: this transaction's completion there means it applied; otherwise a refusal
    /// every send would have met is `NotCommitted`, anything else `Unknown` (the key is held
    /// until its lease passes).
    async fn commit(&self, tx: DynamoTransaction) -> Result<(), CommitError> {
        let Some(completion) = tx.completion else {
            return Err(CommitError::NotCommitted(Error::backend(
                false,
                "a transaction was committed without the record's completion",
            )));
        };
        let index = tx.writes.len();
        let mut writes = tx.writes;
        writes.push(completion.write.clone());
        let request = self
            .client
            .transact_write_items()
            .set_transact_items(Some(writes));
        let sends = Sends::default();
        let sent = tokio::time::timeout(
            self.response_timeout,
            request.customize().interceptor(sends.clone()).send(),
        )
        .await;
        let error = match sent {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(SdkError::ServiceError(e))) => {
                if let TransactWriteItemsError::TransactionCanceledException(c) = e.err() {
                    let reasons = c.cancellation_reasons().to_vec();
                    return self
                        .cancelled(&reasons, index, &completion, sends.sent())
                        .await;
                }
                sdk_error("TransactWriteItems", SdkError::ServiceError(e), Effect::Cas)
            }
            Ok(Err(e)) => sdk_error("TransactWriteItems", e, Effect::Cas),
            Err(_) => no_answer(self.response_timeout, Effect::Cas),
        };
        match error {
            // Every send would have met it (validation, a missing table): nothing applied.
            e @ Error::Backend { .. } => Err(CommitError::NotCommitted(e)),
            // An earlier send may have applied, or may still: the record tells if it has.
            e => match self.applied(&completion).await {
                Some(true) => Ok(()),
                _ => Err(CommitError::Unknown(e)),
            },
        }
    }

    async fn rollback(&self, _tx: DynamoTransaction) {
        // Nothing was sent.
    }

    /// A transaction DynamoDB cancelled for a conflict with another request on one of its
    /// items (`TransactionConflict`): nothing applied, and the work runs again.
    fn is_conflict(&self, error: &Error) -> bool {
        matches!(
            DynamoError::find(error),
            Some(DynamoError::TransactionCanceled { writes })
                if writes.iter().any(|w| w.code == "TransactionConflict")
        )
    }
}
