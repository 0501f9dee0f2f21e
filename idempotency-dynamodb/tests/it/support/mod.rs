//! What the DynamoDB store's test files share: SDK interceptors that count requests, and a
//! store whose client runs one.
#![allow(dead_code, clippy::unwrap_used)]

use aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use idempotency_core::store::ManualClock;
use idempotency_dynamodb::DynamoStore;
use idempotency_testing::dynamodb as common;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Counts the requests the SDK sends, by operation (`PutItem`, `UpdateItem`, …).
#[derive(Debug, Clone, Default)]
pub(crate) struct Requests(Arc<Mutex<BTreeMap<String, usize>>>);

impl Intercept for Requests {
    fn name(&self) -> &'static str {
        "Requests"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        *self
            .0
            .lock()
            .unwrap()
            .entry(operation(context))
            .or_default() += 1;
        Ok(())
    }
}

impl Requests {
    /// The requests since the last call, and starts counting again.
    pub(crate) fn take(&self) -> BTreeMap<String, usize> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// The operation a request calls (`PutItem`, …), from its `X-Amz-Target` header.
pub(crate) fn operation(context: &BeforeTransmitInterceptorContextRef<'_>) -> String {
    let target = context
        .request()
        .headers()
        .get("x-amz-target")
        .unwrap_or("?");
    target.rsplit('.').next().unwrap_or("?").to_owned()
}

/// A store on a manual clock, on a table of its own, whose client runs `interceptor`.
pub(crate) async fn intercepted_store(
    interceptor: impl Intercept + 'static,
) -> (DynamoStore, ManualClock, common::TableGuard) {
    let clock = ManualClock::new();
    let (created, guard) = common::store(Arc::new(clock.clone())).await.unwrap();
    let config = common::client()
        .config()
        .to_builder()
        .interceptor(interceptor)
        .build();
    let store = DynamoStore::builder()
        .table(created.table())
        .clock(Arc::new(clock.clone()))
        .build(aws_sdk_dynamodb::Client::from_conf(config))
        .unwrap();
    (store, clock, guard)
}

/// What an interceptor runs once between a lost answer and the request's next send (the
/// record changed meanwhile, say).
#[derive(Default)]
pub(crate) struct Between(pub(crate) Option<Box<dyn FnOnce() + Send>>);

impl std::fmt::Debug for Between {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Between(set)"
        } else {
            "Between(none)"
        })
    }
}
