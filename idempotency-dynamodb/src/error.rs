//! The store's own errors, and how the SDK's errors become core errors: whether a request
//! may have been applied decides between a retryable error and an unknown outcome.

use crate::exactly_once::CancelledWrite;
use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use idempotency_core::Error;
use std::time::Duration;

/// What the DynamoDB store refuses or reports, beside the SDK's own errors. Reach it from an
/// [`idempotency_core::Error`] with [`DynamoError::find`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DynamoError {
    /// A table name DynamoDB would refuse (3 to 255 characters of `a-z A-Z 0-9 _ - .`).
    #[error(
        "invalid DynamoDB table name {0:?}: 3 to 255 characters of a-z, A-Z, 0-9, '_', '-' and '.'"
    )]
    TableName(String),
    /// An attribute name that is empty, longer than 255 bytes, or one the store uses for a
    /// record field.
    #[error("invalid attribute name {name:?}: {why}")]
    AttributeName {
        /// The name given.
        name: String,
        /// Why it cannot be used.
        why: &'static str,
    },
    /// A record would be larger than DynamoDB's item limit (400 KB, names and values
    /// counted); nothing was written.
    #[error(
        "the record would be {size} bytes, over DynamoDB's item limit of {limit} bytes \
         (the outcome is {outcome} bytes); nothing was written"
    )]
    ItemTooLarge {
        /// The item's size as DynamoDB counts it.
        size: usize,
        /// The limit.
        limit: usize,
        /// The outcome's (or failure message's) share of it.
        outcome: usize,
    },
    /// The table is not what the store needs: [`crate::DynamoStore::verify`]'s findings.
    #[error("table {table}: {problem}")]
    Schema {
        /// The table.
        table: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The work of an exactly-once call added more writes than one `TransactWriteItems`
    /// holds beside the record's completion.
    #[error("a DynamoDB transaction holds at most {limit} writes beside the record's completion")]
    TooManyWrites {
        /// [`crate::MAX_TRANSACTION_WRITES`].
        limit: usize,
    },
    /// DynamoDB cancelled an exactly-once call's transaction: the send it answered applied
    /// nothing (the store reads the record back before it reports that nothing applied at
    /// all). Each action it gave a reason for, by index (a write's condition that failed is
    /// `ConditionalCheckFailed`).
    #[error(
        "DynamoDB cancelled the transaction, nothing of it applied: {}",
        list(writes)
    )]
    TransactionCanceled {
        /// The actions DynamoDB gave a reason for.
        writes: Vec<CancelledWrite>,
    },
    /// No answer within the store's response timeout; the request may still be applied.
    #[error("no answer from DynamoDB within {0:?}")]
    NoAnswer(Duration),
    /// DynamoDB answered a condition failure without the item, which the store asks for
    /// (`ReturnValuesOnConditionCheckFailure = ALL_OLD`): a server that does not implement
    /// it.
    #[error("a conditional {0} failed and DynamoDB returned no item (ReturnValuesOnConditionCheckFailure is not honoured)")]
    NoItemReturned(&'static str),
    /// DynamoDB refused a write because the record is no longer this holder's, but the SDK
    /// had sent the write more than once: an earlier send may have applied before the
    /// record changed (its answer lost, then the record expired and was claimed again).
    #[error("a {0} that was sent more than once was refused by a record that is no longer this holder's: an earlier send may have applied")]
    RefusedAfterResend(&'static str),
    /// The SDK's error, with what the store was doing.
    #[error("DynamoDB {operation}: {message}")]
    Sdk {
        /// The request (`PutItem`, `UpdateItem`, …).
        operation: &'static str,
        /// The SDK's error with its context: DynamoDB's code and message when it sent one.
        message: String,
        /// The SDK's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

fn list(writes: &[CancelledWrite]) -> String {
    if writes.is_empty() {
        return "no reason given".to_owned();
    }
    writes
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl DynamoError {
    /// The store's error inside a core error, if there is one.
    pub fn find(error: &Error) -> Option<&DynamoError> {
        error.find_source::<DynamoError>()
    }
}

impl From<DynamoError> for Error {
    fn from(e: DynamoError) -> Self {
        match e {
            DynamoError::TableName(_) | DynamoError::AttributeName { .. } => {
                Error::Config(e.to_string())
            }
            other => Error::backend(false, other),
        }
    }
}

/// Whether the request can have changed a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// A read, or a write the store recognises when it is sent again (a claim, by its
    /// nonce): a lost answer is a retryable error.
    Repeatable,
    /// A holder's compare-and-swap: a lost answer is an unknown outcome.
    Cas,
}

/// Classifies a failed request.
///
/// The SDK may have sent the request more than once (it retries throttled requests, lost
/// answers, 5xx answers and a `TransactionInProgressException`), and the error is the last
/// send's. So a holder's write that failed is [`Error::OutcomeUnknown`] unless the failure is
/// one every send would have met: a request that could not be built, or one DynamoDB refuses
/// for its shape or its table (validation, serialization, a missing table, an item
/// collection over its size). Any other answer (a throttle, a transaction still in progress
/// with the same client token, credentials that expired between sends, a code this store
/// does not know) does not say that an earlier send did not apply.
pub(crate) fn sdk_error<E>(
    operation: &'static str,
    e: SdkError<E, HttpResponse>,
    effect: Effect,
) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let (retryable, deterministic) = match &e {
        SdkError::ConstructionFailure(_) => (false, true),
        SdkError::ServiceError(service) => match service.err().code() {
            Some(
                "ProvisionedThroughputExceededException"
                | "ThrottlingException"
                | "RequestLimitExceeded"
                | "TransactionConflictException",
            ) => (true, false),
            Some(
                "InternalServerError"
                | "ServiceUnavailable"
                | "InternalFailure"
                | "TransactionInProgressException",
            ) => (true, false),
            // A 5xx without a code DynamoDB uses (a proxy's error page): anything happened.
            _ if service.raw().status().is_server_error() => (true, false),
            // Refused for the request's shape or its table: so was every send of it.
            Some(
                "ValidationException"
                | "SerializationException"
                | "ResourceNotFoundException"
                | "ItemCollectionSizeLimitExceededException",
            ) => (false, true),
            // Anything else (expired credentials, a code this store does not know): an
            // earlier send may have applied.
            _ => (false, false),
        },
        // Timeouts, dispatch failures, unreadable answers: the request may have applied.
        _ => (true, false),
    };
    let source = DynamoError::Sdk {
        operation,
        message: aws_sdk_dynamodb::error::DisplayErrorContext(&e).to_string(),
        source: Box::new(e),
    };
    if effect == Effect::Cas && !deterministic {
        Error::OutcomeUnknown {
            source: Box::new(source),
        }
    } else {
        Error::backend(retryable, source)
    }
}

/// A request the response timeout cut short.
pub(crate) fn no_answer(timeout: Duration, effect: Effect) -> Error {
    match effect {
        Effect::Cas => Error::OutcomeUnknown {
            source: Box::new(DynamoError::NoAnswer(timeout)),
        },
        Effect::Repeatable => Error::backend(true, DynamoError::NoAnswer(timeout)),
    }
}
