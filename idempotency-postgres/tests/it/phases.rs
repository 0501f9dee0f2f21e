//! Multi-step operations on Postgres (`Idempotency::run_phases`), at every isolation level:
//! the kit's recovery point cases, and the rides flow (a ride row, a charge through a
//! payment service that deduplicates by key, a receipt row with the completion) resumed
//! after its holder dies between the charge and its recovery point.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{Isolation, SchemaGuard};
use idempotency_conformance::recovery::{recovery_cases, ForeignService, RecoveryKit};
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, PhaseContext, Phases, Policy, Refusal,
    Scope,
};
use idempotency_postgres::sqlx;
use idempotency_postgres::PostgresStore;
use std::sync::Arc;
use std::time::Duration;

const LEVELS: [Isolation; 3] = [
    Isolation::ReadCommitted,
    Isolation::RepeatableRead,
    Isolation::Serializable,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_passes_every_recovery_point_case_at_every_level() {
    common::side_by_side(LEVELS, |level| async move {
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
    })
    .await;
}

fn flow(
    payments: Arc<ForeignService>,
    schema: Arc<str>,
) -> Phases<PostgresStore, (i64, i64), String> {
    let (rides, receipts) = (
        format!(r#""{schema}".rides"#),
        format!(r#""{schema}".receipts"#),
    );
    Phases::new("book-ride")
        .phase(
            "create-ride",
            move |tx: &mut sqlx::PgConnection, (): (), _: PhaseContext| {
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
            move |tx: &mut sqlx::PgConnection, (ride, charge): (i64, i64), _: PhaseContext| {
                let sql = format!("INSERT INTO {receipts} (ride, charge) VALUES ($1, $2)");
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
    store: PostgresStore,
    guard: SchemaGuard,
    engine: Idempotency<PostgresStore>,
    payments: Arc<ForeignService>,
}

const LEASE: Duration = Duration::from_secs(1);

/// The lease of the holders of the long-phase tests, renewed every tenth of it: a stall of
/// the machine under 1.6 s costs them nothing.
const LONG_LEASE: Duration = Duration::from_secs(2);

/// An engine over `store` with [`LONG_LEASE`].
fn long_engine<S: idempotency_core::IdempotencyStore + 'static>(store: S) -> Idempotency<S> {
    Idempotency::builder(store)
        .lease(LONG_LEASE)
        .heartbeat(Some(0.1))
        .retention(Duration::from_secs(3600))
        .build()
        .unwrap()
}

impl World {
    async fn new(level: Isolation) -> Self {
        let (store, guard) = common::store_with(level, 4).await;
        common::exec(&format!(
            r#"CREATE TABLE "{s}".rides (id bigserial PRIMARY KEY, route text NOT NULL);
               CREATE TABLE "{s}".receipts (ride bigint NOT NULL, charge bigint NOT NULL)"#,
            s = guard.schema
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
            store,
            guard,
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

    fn flow(&self) -> Phases<PostgresStore, (i64, i64), String> {
        flow(self.payments.clone(), self.guard.schema.clone().into())
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
            r#"SELECT (SELECT count(*) FROM "{s}".rides), (SELECT count(*) FROM "{s}".receipts)"#,
            s = self.guard.schema
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        (rides, self.payments.effects(), receipts)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_died_after_the_charge_is_resumed_there_at_every_level() {
    common::side_by_side(LEVELS, |level| async move {
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
    })
    .await;
}

/// A flow whose first phase outlives the lease (2.5 long leases, kept alive by the heartbeat),
/// then a foreign call and a fast phase; rides are counted per phase.
fn slow_then_fast(schema: &str) -> Phases<PostgresStore, i64, String> {
    let rides = format!(r#""{schema}".rides"#);
    let first = format!("INSERT INTO {rides} (route) VALUES ('slow') RETURNING id");
    let last = format!("INSERT INTO {rides} (route) VALUES ('fast')");
    Phases::<PostgresStore, (), String>::new("slow-then-fast")
        .phase(
            "slow",
            move |tx: &mut sqlx::PgConnection, (): (), _: PhaseContext| {
                let sql = first.clone();
                Box::pin(async move {
                    let id: i64 = sqlx::query_scalar(&sql).fetch_one(&mut *tx).await.unwrap();
                    tokio::time::sleep(LONG_LEASE * 5 / 2).await;
                    Ok(Ok(id))
                })
            },
        )
        .foreign(
            "call",
            |ride: i64, _: PhaseContext| async move { Ok(Ok(ride)) },
        )
        .phase(
            "fast",
            move |tx: &mut sqlx::PgConnection, ride: i64, _: PhaseContext| {
                let sql = last.clone();
                Box::pin(async move {
                    sqlx::query(&sql).execute(&mut *tx).await.unwrap();
                    Ok(Ok(ride))
                })
            },
        )
}

/// A phase that outlives the lease, kept alive by the heartbeat: at REPEATABLE READ and
/// SERIALIZABLE the lease is kept in the process while the phase holds the record locked, so
/// the record's own lease passes meanwhile. The holder keeps the operation: the next phase is
/// still its own, and a duplicate request and a completer that come once the record's lease
/// has passed, during the phase, are told the key is in progress (or, if they come after the
/// end, get the replay), never take it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_phase_longer_than_the_lease_is_followed_by_the_next_at_every_level() {
    common::side_by_side(LEVELS, |level| async move {
        let w = World::new(level).await;
        let schema = w.guard.schema.clone();
        let holder = {
            let (engine, flow) = (long_engine(w.store.clone()), slow_then_fast(&schema));
            tokio::spawn(async move {
                let (key, scope, fp) = World::key();
                engine.run_phases(&key, &scope, &fp, flow).await
            })
        };
        // The record's lease has passed (at the two snapshot levels); the phase runs on.
        tokio::time::sleep(LONG_LEASE * 3 / 2).await;
        let completer = {
            let schema = schema.clone();
            idempotency_core::Completer::new(&w.engine)
                .operation("slow-then-fast", move || slow_then_fast(&schema))
        };
        let (key, scope, fp) = World::key();
        let engine = w.engine.clone();
        let duplicate = engine.run_phases(&key, &scope, &fp, slow_then_fast(&schema));
        let (duplicate, round) = tokio::join!(duplicate, completer.run_once());
        the_holder_kept_it(level, holder.await.unwrap(), duplicate, round, &w).await;
    })
    .await;
}

/// The completer finishes an operation whose holder died after its charge, from the charge
/// on, once the lease has passed; a client's retry then replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_completer_finishes_a_dead_holders_operation_at_every_level() {
    common::side_by_side(LEVELS, |level| async move {
        let w = World::new(level).await;
        w.run_and_die_after_charge().await;
        let (payments, schema) = (
            w.payments.clone(),
            Arc::<str>::from(w.guard.schema.as_str()),
        );
        let make = move || flow(payments.clone(), schema.clone());
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
    })
    .await;
}

/// The verdict of the long-phase tests: the holder finished its operation (of value 1); a
/// duplicate that came meanwhile was told it was in progress, or got the replay; the
/// completer finished nothing; each phase wrote its ride once.
async fn the_holder_kept_it(
    level: Isolation,
    holder: Result<Answer<Result<i64, String>>, Error>,
    duplicate: Result<Answer<Result<i64, String>>, Error>,
    round: Result<idempotency_core::CompleterRound, Error>,
    w: &World,
) {
    assert!(
        matches!(holder, Ok(Answer::Executed(Ok(1)))),
        "{level:?}: the holder: {holder:?}"
    );
    assert!(
        matches!(
            duplicate,
            Ok(Answer::Refused(Refusal::InProgress { .. })) | Ok(Answer::Replayed(Ok(1)))
        ),
        "{level:?}: the duplicate: {duplicate:?}"
    );
    let round = round.unwrap();
    assert_eq!(round.completed, 0, "{level:?}: the completer: {round}");
    assert_eq!(
        w.counts().await.0,
        2,
        "{level:?}: each phase committed once"
    );
}

/// A store whose lease renewals (`extend`) arrive late, as on a slow network: the holder's
/// renewal after a phase lands well after the phase's commit.
#[derive(Debug)]
struct LateRenewals(PostgresStore);

#[idempotency_core::store::async_trait]
impl idempotency_core::IdempotencyStore for LateRenewals {
    async fn claim(
        &self,
        request: &idempotency_core::store::ClaimRequest,
    ) -> Result<idempotency_core::store::Claim, Error> {
        self.0.claim(request).await
    }
    async fn complete(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<idempotency_core::store::Cas, Error> {
        self.0.complete(id, token, outcome, ttl).await
    }
    async fn fail(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        failure: &idempotency_core::store::Failure,
        ttl: Duration,
    ) -> Result<idempotency_core::store::Cas, Error> {
        self.0.fail(id, token, failure, ttl).await
    }
    async fn extend(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        lease: Duration,
    ) -> Result<idempotency_core::store::Cas, Error> {
        tokio::time::sleep(LONG_LEASE / 10).await;
        self.0.extend(id, token, lease).await
    }
    async fn reclaim(
        &self,
        id: &idempotency_core::RecordId,
        expected: idempotency_core::FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<idempotency_core::store::Reclaim, Error> {
        self.0.reclaim(id, expected, fingerprint, lease, ttl).await
    }
    async fn get(
        &self,
        id: &idempotency_core::RecordId,
    ) -> Result<Option<idempotency_core::store::Record>, Error> {
        self.0.get(id).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        self.0.purge_expired(batch).await
    }
}

/// A middle phase that outlives the lease (2.5 long leases), with the holder's renewals
/// arriving late (a tenth of a lease): at
/// REPEATABLE READ and SERIALIZABLE the record's own lease passes while the phase holds the
/// row, and a duplicate request and a completer wait for the row. When the phase commits,
/// its recovery point renews the lease in the same transaction, so neither takes the
/// operation over before the holder's own renewal lands: the holder finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_middle_phase_is_not_taken_over_when_it_commits_at_every_level() {
    common::side_by_side(LEVELS, |level| async move {
        let w = World::new(level).await;
        let rides = format!(r#""{}".rides"#, w.guard.schema);
        let flow = move || {
            let (first, slow) = (
                format!("INSERT INTO {rides} (route) VALUES ('first') RETURNING id"),
                format!("INSERT INTO {rides} (route) VALUES ('slow')"),
            );
            Phases::<PostgresStore, (), String>::new("fast-slow")
                .phase(
                    "fast",
                    move |tx: &mut sqlx::PgConnection, (): (), _: PhaseContext| {
                        let sql = first.clone();
                        Box::pin(async move {
                            let id: i64 =
                                sqlx::query_scalar(&sql).fetch_one(&mut *tx).await.unwrap();
                            Ok(Ok(id))
                        })
                    },
                )
                .phase(
                    "slow",
                    move |tx: &mut sqlx::PgConnection, ride: i64, _: PhaseContext| {
                        let sql = slow.clone();
                        Box::pin(async move {
                            sqlx::query(&sql).execute(&mut *tx).await.unwrap();
                            tokio::time::sleep(LONG_LEASE * 5 / 2).await;
                            Ok(Ok(ride))
                        })
                    },
                )
                .phase(
                    "last",
                    |_: &mut sqlx::PgConnection, ride: i64, _: PhaseContext| {
                        Box::pin(async move { Ok(Ok(ride)) })
                    },
                )
        };
        let late = long_engine(LateRenewals(w.store.clone()));
        let holder = {
            let (store, flow) = (w.store.clone(), flow.clone()());
            tokio::spawn(async move {
                let (key, scope, fp) = World::key();
                // Record calls through the decorator, phases in the store's transactions.
                late.with_transactions(store)
                    .run_phases(&key, &scope, &fp, flow)
                    .await
            })
        };
        tokio::time::sleep(LONG_LEASE * 3 / 2).await;
        let completer =
            idempotency_core::Completer::new(&w.engine).operation("fast-slow", flow.clone());
        let (key, scope, fp) = World::key();
        let engine = w.engine.clone();
        let duplicate = engine.run_phases(&key, &scope, &fp, flow());
        let (duplicate, round) = tokio::join!(duplicate, completer.run_once());
        the_holder_kept_it(level, holder.await.unwrap(), duplicate, round, &w).await;
    })
    .await;
}
