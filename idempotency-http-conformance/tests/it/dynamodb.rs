//! The HTTP suite against the DynamoDB store on the local stand-in
//! (`IDEMPOTENCY_TEST_DYNAMODB_URL`, default `http://127.0.0.1:8000`; `bash .ci/services`
//! starts it). Each case gets a table of its own, deleted afterwards.

use idempotency_conformance::TestStore;
use idempotency_core::store::SystemClock;
use std::sync::Arc;

async fn factory() -> TestStore {
    let (store, guard) = idempotency_testing::dynamodb::spread_store(Arc::new(SystemClock))
        .await
        .expect("a table on the DynamoDB stand-in");
    TestStore::real_time(Arc::new(store)).with_guard(guard)
}

idempotency_http_conformance::http_conformance_tests!(factory);
