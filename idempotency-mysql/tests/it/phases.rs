//! Multi-step operations on MySQL/MariaDB (`Idempotency::run_phases`), at every isolation level:
//! the kit's recovery point cases, and the rides flow (a ride row, a charge through a
//! payment service that deduplicates by key, a receipt row with the completion) resumed
//! after its holder dies between the charge and its recovery point.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{Isolation, TableGuard};
use idempotency_conformance::recovery::{recovery_cases, ForeignService, RecoveryKit};
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, PhaseContext, Phases, Policy, Refusal,
    Scope,
};
use idempotency_mysql::sqlx;
use idempotency_mysql::MySqlStore;
use std::sync::Arc;
use std::time::Duration;

const LEVELS: [Isolation; 3] = Isolation::ALL;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_passes_every_recovery_point_case_at_every_level() {
    for level in LEVELS {
        let (store, _guard) = common::store_with(level, 4).await;
        // The database's clock decides: time passes by sleeping, with room for a stalled
        // machine (a record expires only after its retention).
        let (lease, ttl) = (Duration::from_secs(1), Duration::from_secs(2));
        let engine = Idempotency::builder(store.clone())
            .policy(
                Policy::default()
                    .lease(lease)
                    .retention(ttl)
                    .heartbeat(None),
            )
            .build()
            .unwrap();
        let kit = RecoveryKit {
            store,
            engine: engine.into(),
            lease,
            ttl,
            pass: Box::new(|d| Box::pin(tokio::time::sleep(d))),
        };
        if let Err(e) = recovery_cases(&kit).await {
            panic!("{level:?} {e}");
        }
    }
}

fn flow(
    payments: Arc<ForeignService>,
    tables: Arc<(String, String)>,
) -> Phases<MySqlStore, (i64, i64), String> {
    let (rides, receipts) = (tables.0.clone(), tables.1.clone());
    Phases::new("book-ride")
        .phase(
            "create-ride",
            move |tx: &mut sqlx::MySqlConnection, (): (), _: PhaseContext| {
                let sql = format!("INSERT INTO {rides} (route) VALUES ('A to B') RETURNING id");
                Box::pin(async move {
                    let id: i64 = sqlx::query_scalar(&sql).fetch_one(&mut *tx).await?;
                    Ok(Ok(id))
                })
            },
        )
        .foreign("charge", move |ride: i64, ctx: PhaseContext| {
            let payments = payments.clone();
            async move { Ok(Ok((ride, payments.call(ctx.key()).await))) }
        })
        .phase(
            "receipt",
            move |tx: &mut sqlx::MySqlConnection, (ride, charge): (i64, i64), _: PhaseContext| {
                let sql = format!("INSERT INTO {receipts} (ride, charge) VALUES (?, ?)");
                Box::pin(async move {
                    sqlx::query(&sql)
                        .bind(ride)
                        .bind(charge)
                        .execute(&mut *tx)
                        .await?;
                    Ok(Ok((ride, charge)))
                })
            },
        )
}

struct World {
    tables: Arc<(String, String)>,
    _guards: (TableGuard, TableGuard, TableGuard),
    engine: Idempotency<MySqlStore>,
    payments: Arc<ForeignService>,
}

const LEASE: Duration = Duration::from_secs(1);

impl World {
    async fn new(level: Isolation) -> Self {
        let (store, records) = common::store_with(level, 4).await;
        let (rides, receipts) = (TableGuard::new(), TableGuard::new());
        let tables = Arc::new((
            format!("`{}`", rides.table),
            format!("`{}`", receipts.table),
        ));
        common::exec(&format!(
            "CREATE TABLE {} (id BIGINT AUTO_INCREMENT PRIMARY KEY, route TEXT NOT NULL) ENGINE = InnoDB",
            tables.0
        ))
        .await;
        common::exec(&format!(
            "CREATE TABLE {} (ride BIGINT NOT NULL, charge BIGINT NOT NULL) ENGINE = InnoDB",
            tables.1
        ))
        .await;
        let engine = Idempotency::builder(store.clone())
            .policy(
                Policy::default()
                    .lease(LEASE)
                    .retention(Duration::from_secs(3600)),
            )
            .build()
            .unwrap();
        Self {
            tables,
            _guards: (records, rides, receipts),
            engine,
            payments: Arc::default(),
        }
    }

    fn key() -> (IdempotencyKey, Scope, Fingerprint) {
        (
            IdempotencyKey::new("ride-1").unwrap(),
            Scope::new("rides").unwrap(),
            Fingerprint::from_bytes(b"A to B"),
        )
    }

    fn flow(&self) -> Phases<MySqlStore, (i64, i64), String> {
        flow(self.payments.clone(), self.tables.clone())
    }

    async fn run(&self) -> Result<Answer<Result<(i64, i64), String>>, Error> {
        let (key, scope, fp) = Self::key();
        // Through the store's wrapper: the store is not passed a second time.
        self.engine.run_phases(&key, &scope, &fp, self.flow()).await
    }

    /// [`World::run`] again while the key is in progress (for at most 30 s).
    async fn run_when_free(&self) -> Answer<Result<(i64, i64), String>> {
        let started = std::time::Instant::now();
        loop {
            match self.run().await {
                Ok(Answer::Refused(Refusal::InProgress { .. }))
                    if started.elapsed() < Duration::from_secs(30) =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                done => return done.unwrap(),
            }
        }
    }

    /// Runs the flow in a task that dies (is aborted) once its charge was made.
    async fn run_and_die_after_charge(&self) {
        self.payments.hang_after_acting(1);
        let task = {
            let (engine, flow) = (self.engine.clone(), self.flow());
            tokio::spawn(async move {
                let (key, scope, fp) = World::key();
                engine.run_phases(&key, &scope, &fp, flow).await
            })
        };
        self.payments.acted_and_hung().await;
        task.abort();
        let _ = task.await;
    }

    async fn counts(&self) -> (i64, usize, i64) {
        let mut conn = common::admin().await;
        let (rides, receipts): (i64, i64) = sqlx::query_as(&format!(
            "SELECT (SELECT count(*) FROM {}), (SELECT count(*) FROM {})",
            self.tables.0, self.tables.1
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        (rides, self.payments.effects(), receipts)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_died_after_the_charge_is_resumed_there_at_every_level() {
    for level in LEVELS {
        let w = World::new(level).await;
        w.run_and_die_after_charge().await;
        assert_eq!(w.counts().await, (1, 1, 0), "{level:?}: the ride committed");
        // The dead holder's heartbeat stopped with it: its lease passes (a heartbeat that
        // was on its way when it died may still land; then the key is in progress a while).
        tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
        let Answer::Executed(Ok((ride, charge))) = w.run_when_free().await else {
            panic!("{level:?}: not resumed");
        };
        assert_eq!((ride, charge), (1, 1), "{level:?}");
        assert_eq!(w.counts().await, (1, 1, 1), "{level:?}: nothing ran twice");
        let keys = w.payments.keys();
        assert!(keys.len() == 2 && keys[0] == keys[1], "{level:?}: {keys:?}");
        assert_eq!(w.run().await.unwrap(), Answer::Replayed(Ok((1, 1))));
    }
}

/// A table created before the recovery point columns (by an older crate), with a record in
/// it: `migrate` adds the columns and the record stays readable.
#[tokio::test]
async fn a_table_without_recovery_point_columns_is_given_them_by_migrate() {
    let guard = TableGuard::new();
    common::exec(&format!(
        "CREATE TABLE `{t}` (
    scope VARBINARY(1024) NOT NULL, idem_key VARBINARY(255) NOT NULL,
    fingerprint VARBINARY(64) NOT NULL,
    status VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    token BIGINT NOT NULL, claim_nonce BIGINT NOT NULL, revision BIGINT NOT NULL DEFAULT 0,
    lease_until_ms BIGINT NULL, outcome LONGBLOB NULL, attempts INT NOT NULL,
    failure_retryable TINYINT NULL,
    failure_message TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    hits BIGINT NOT NULL, created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL,
    expires_ms BIGINT NOT NULL,
    PRIMARY KEY (scope, idem_key), KEY expires_ms_idx (expires_ms)) ENGINE = InnoDB",
        t = guard.table
    ))
    .await;
    common::exec(&format!(
        "INSERT INTO `{t}` VALUES ('rides', 'old', REPEAT('a', 32), 'completed', 5, 1, 1, NULL,
             '{{\"Ok\":1}}', 1, NULL, NULL, 0, 0, 0, 9999999999999)",
        t = guard.table
    ))
    .await;
    let store = idempotency_mysql::MySqlStore::builder()
        .table(&guard.table)
        .build(common::pool(Isolation::ReadCommitted, 2).await)
        .unwrap();
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    store.verify().await.unwrap();
    let id = idempotency_core::RecordId::new(
        IdempotencyKey::new("old").unwrap(),
        Scope::new("rides").unwrap(),
    );
    let record = idempotency_core::IdempotencyStore::get(&store, &id)
        .await
        .unwrap()
        .expect("the record survived");
    assert_eq!(record.outcome.as_deref(), Some(&br#"{"Ok":1}"#[..]));
    // And the index of multi-step operations, once.
    let mut conn = common::admin().await;
    let indexes: Vec<String> = idempotency_mysql::sqlx::query_scalar(&format!(
        "SELECT CAST(INDEX_NAME AS CHAR) FROM information_schema.STATISTICS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{}' AND COLUMN_NAME = 'op_name'",
        guard.table
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(indexes, ["op_name_idx"]);
}

/// The completer finishes an operation whose holder died after its charge, from the charge
/// on, once the lease has passed; a client's retry then replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_finishes_a_dead_holders_operation_at_every_level() {
    for level in LEVELS {
        let w = World::new(level).await;
        w.run_and_die_after_charge().await;
        let (payments, tables) = (w.payments.clone(), w.tables.clone());
        let make = move || flow(payments.clone(), tables.clone());
        let completer = idempotency_core::Completer::new(&w.engine).operation("book-ride", make);
        // The dead holder's heartbeat stopped with it: its lease passes (a heartbeat that
        // was on its way when it died may still land: rounds go on until one finishes it).
        tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
        let started = std::time::Instant::now();
        loop {
            let round = completer.run_once().await.unwrap();
            assert_eq!(round.errors, 0, "{level:?}: {round}");
            if round.completed == 1 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{level:?}: never finished: {round}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(w.counts().await, (1, 1, 1), "{level:?}: nothing ran twice");
        let keys = w.payments.keys();
        assert!(keys.len() == 2 && keys[0] == keys[1], "{level:?}: {keys:?}");
        assert_eq!(w.run().await.unwrap(), Answer::Replayed(Ok((1, 1))));
        assert_eq!(completer.run_once().await.unwrap().found, 0, "{level:?}");
    }
}
