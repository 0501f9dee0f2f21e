//! The soak's runner for PostgreSQL's exactly-once path: the work writes a business row in the
//! transaction that also runs the completion CAS ([`PostgresIdempotency::run_in_transaction`]), so
//! the rows can be counted.

use futures::future::BoxFuture;
use idempotency_core::Idempotency;
use idempotency_core::{Fingerprint, IdempotencyKey, IdempotencyStore, Scope};
use idempotency_postgres::sqlx;
use idempotency_postgres::{PostgresIdempotency, PostgresStore};
use idempotency_reliability::soak::{
    soak_policy, RunResult, Runner, Work, WorkFault, BUSINESS_WRITE_FAILED,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Runs work through [`PostgresIdempotency::run_in_transaction`], inserting one row into an
/// `effects` table per execution, in the completion's transaction.
#[derive(Debug)]
pub(crate) struct PgTransactionalRunner {
    engine: PostgresIdempotency,
    stall_engine: PostgresIdempotency,
    effects: Arc<str>,
}

impl PgTransactionalRunner {
    /// Creates the `effects` table (`schema.effects`, no uniqueness: a double effect must be
    /// countable, not prevented) and the engines, with and without the heartbeat.
    pub(crate) async fn new(store: PostgresStore, schema: &str, lease: Duration) -> Self {
        let effects: Arc<str> = format!(r#""{schema}".effects"#).into();
        sqlx::query(&format!(
            "CREATE TABLE {effects} (id bigserial PRIMARY KEY, scope text NOT NULL, \
             key text NOT NULL, value bigint NOT NULL)"
        ))
        .execute(store.pool())
        .await
        .expect("create the effects table");
        Self {
            engine: Idempotency::builder(store.clone())
                .policy(soak_policy(lease, true))
                .build()
                .expect("policy"),
            stall_engine: Idempotency::builder(store)
                .policy(soak_policy(lease, false))
                .build()
                .expect("policy"),
            effects,
        }
    }
}

impl Runner for PgTransactionalRunner {
    fn store(&self) -> Arc<dyn IdempotencyStore> {
        Arc::new(self.engine.store().clone())
    }

    fn run(
        &self,
        key: IdempotencyKey,
        scope: Scope,
        fingerprint: Fingerprint,
        work: Work,
    ) -> BoxFuture<'static, RunResult> {
        let engine = if work.fault == WorkFault::Stall {
            self.stall_engine.clone()
        } else {
            self.engine.clone()
        };
        let effects = self.effects.clone();
        Box::pin(async move {
            let (s, k) = (scope.as_str().to_owned(), key.as_str().to_owned());
            engine
                .run_in_transaction(&key, &scope, &fingerprint, move |tx, _ctx| {
                    let (work, effects, s, k) =
                        (work.clone(), effects.clone(), s.clone(), k.clone());
                    Box::pin(async move {
                        // A failed business write is the work's refusal (`Ok(Err(..))`,
                        // `BUSINESS_WRITE_FAILED`), released by the policy, as the soak expects.
                        Ok(async move {
                            let value = i64::try_from(work.value).map_err(|e| e.to_string())?;
                            sqlx::query(&format!(
                                "INSERT INTO {effects} (scope, key, value) VALUES ($1, $2, $3)"
                            ))
                            .bind(s)
                            .bind(k)
                            .bind(value)
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| format!("{BUSINESS_WRITE_FAILED}: {e}"))?;
                            work.perform().await
                        }
                        .await)
                    })
                })
                .await
        })
    }

    fn effects<'a>(&'a self, scope: &'a Scope) -> BoxFuture<'a, Option<HashMap<String, Vec<u64>>>> {
        Box::pin(async move {
            // A pooled connection that a fault left dead fails once; the pool then opens
            // another.
            let mut tries = 0;
            let rows: Vec<(String, i64)> = loop {
                match sqlx::query_as(&format!(
                    "SELECT key, value FROM {} WHERE scope = $1 ORDER BY id",
                    self.effects
                ))
                .bind(scope.as_str())
                .fetch_all(self.engine.store().pool())
                .await
                {
                    Ok(rows) => break rows,
                    Err(_) if tries < 5 => {
                        tries += 1;
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("read the effects table: {e}"),
                }
            };
            let mut map: HashMap<String, Vec<u64>> = HashMap::new();
            for (key, value) in rows {
                map.entry(key)
                    .or_default()
                    .push(u64::try_from(value).expect("values are positive"));
            }
            Some(map)
        })
    }
}
