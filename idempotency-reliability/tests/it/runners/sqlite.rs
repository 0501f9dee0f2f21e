//! The soak's runner for SQLite's exactly-once path: the work writes a business row into an
//! `effects` table in the transaction that also runs the completion CAS.

use futures::future::BoxFuture;
use idempotency_core::{Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Scope};
use idempotency_reliability::soak::{RunResult, Runner, Work, BUSINESS_WRITE_FAILED};
use idempotency_sqlite::rusqlite::params;
use idempotency_sqlite::SqliteStore;
use std::sync::Arc;

/// `SqliteIdempotency::run_in_transaction`: the work inserts its row into `effects` in the completion's
/// transaction.
pub(crate) struct SqliteTransactionalRunner {
    pub store: SqliteStore,
    pub engine: Idempotency<SqliteStore>,
}

impl Runner for SqliteTransactionalRunner {
    fn store(&self) -> Arc<dyn IdempotencyStore> {
        Arc::new(self.store.clone())
    }

    fn run(
        &self,
        key: IdempotencyKey,
        scope: Scope,
        fingerprint: Fingerprint,
        work: Work,
    ) -> BoxFuture<'static, RunResult> {
        let engine = self.engine.clone();
        Box::pin(async move {
            let (s, k) = (scope.as_str().to_owned(), key.as_str().to_owned());
            engine
                .run_in_transaction(&key, &scope, &fingerprint, move |tx, _ctx| {
                    let (s, k) = (s.clone(), k.clone());
                    Box::pin(tx.run(move |tx| {
                        tx.execute(
                            "INSERT INTO effects (scope, key, value) VALUES (?1, ?2, ?3)",
                            params![s, k, i64::try_from(work.value).map_err(|e| e.to_string())?],
                        )
                        .map_err(|e| format!("{BUSINESS_WRITE_FAILED}: {e}"))?;
                        std::thread::sleep(work.duration);
                        Ok::<u64, String>(work.value)
                    }))
                })
                .await
        })
    }
}
