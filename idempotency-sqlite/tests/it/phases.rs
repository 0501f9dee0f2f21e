//! Multi-step operations on SQLite (`Idempotency::run_phases`): a ride written in one
//! transaction, a charge through a payment service that deduplicates by key, a receipt
//! written with the completion. The recovery point commits with each phase's rows; a holder
//! that dies mid-way is resumed, never restarted.
#![allow(clippy::unwrap_used)]

use crate::common;

use idempotency_conformance::recovery::ForeignService;
use idempotency_core::store::{Clock, ManualClock};
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, PhaseContext,
    Phases, Policy, Refusal, Scope,
};
use idempotency_sqlite::rusqlite::{self, params};
use idempotency_sqlite::{ConnectionMode, SqliteStore, SqliteTransaction};
use std::sync::Arc;
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Receipt {
    ride: i64,
    charge: i64,
}

fn flow(payments: Arc<ForeignService>) -> Phases<SqliteStore, Receipt, String> {
    Phases::new("book-ride")
        .phase(
            "create-ride",
            |tx: &mut SqliteTransaction, (): (), _: PhaseContext| {
                Box::pin(async move {
                    let ride = tx
                        .run(|t| {
                            t.execute("INSERT INTO rides (route) VALUES ('A to B')", [])?;
                            Ok::<_, rusqlite::Error>(t.last_insert_rowid())
                        })
                        .await?;
                    Ok(ride.map_err(|e| e.to_string()))
                })
            },
        )
        .foreign("charge", move |ride: i64, ctx: PhaseContext| {
            let payments = payments.clone();
            async move { Ok(Ok((ride, payments.call(ctx.key()).await))) }
        })
        .phase(
            "receipt",
            |tx: &mut SqliteTransaction, (ride, charge): (i64, i64), _: PhaseContext| {
                Box::pin(async move {
                    let written = tx
                        .run(move |t| {
                            t.execute(
                                "INSERT INTO receipts (ride, charge) VALUES (?1, ?2)",
                                params![ride, charge],
                            )
                        })
                        .await?;
                    Ok(written
                        .map(|_| Receipt { ride, charge })
                        .map_err(|e| e.to_string()))
                })
            },
        )
}

struct World {
    store: SqliteStore,
    clock: ManualClock,
    engine: Idempotency<SqliteStore>,
    payments: Arc<ForeignService>,
    _dir: tempfile::TempDir,
}

impl World {
    async fn new(mode: ConnectionMode) -> Self {
        let (store, clock, dir) = common::manual_store(mode).await;
        store
            .call(|c| {
                c.execute_batch(
                    "CREATE TABLE rides (id INTEGER PRIMARY KEY, route TEXT NOT NULL);
                     CREATE TABLE receipts (ride INTEGER NOT NULL, charge INTEGER NOT NULL);",
                )
            })
            .await
            .unwrap()
            .unwrap();
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
            clock,
            engine,
            payments: Arc::default(),
            _dir: dir,
        }
    }

    fn key() -> (IdempotencyKey, Scope, Fingerprint) {
        (
            IdempotencyKey::new("ride-1").unwrap(),
            Scope::new("rides").unwrap(),
            Fingerprint::from_bytes(b"A to B"),
        )
    }

    async fn run(&self) -> Result<Answer<Result<Receipt, String>>, Error> {
        let (key, scope, fp) = Self::key();
        // Through the store's wrapper: the store is not passed a second time.
        self.engine
            .run_phases(&key, &scope, &fp, flow(self.payments.clone()))
            .await
    }

    /// Runs the flow in a task that dies (is aborted) once its charge was made.
    async fn run_and_die_after_charge(&self) {
        self.payments.hang_after_acting(1);
        let (engine, payments) = (self.engine.clone(), self.payments.clone());
        let task = tokio::spawn(async move {
            let (key, scope, fp) = Self::key();
            engine.run_phases(&key, &scope, &fp, flow(payments)).await
        });
        self.payments.acted_and_hung().await;
        task.abort();
        let _ = task.await;
    }

    /// (rides, charges, receipts)
    async fn counts(&self) -> (i64, usize, i64) {
        let (rides, receipts) = self
            .store
            .call(|c| {
                c.query_row(
                    "SELECT (SELECT count(*) FROM rides), (SELECT count(*) FROM receipts)",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
            })
            .await
            .unwrap()
            .unwrap();
        let charges = self.payments.effects();
        (rides, charges, receipts)
    }

    fn keys(&self) -> Vec<String> {
        self.payments.keys()
    }
}

const MODES: [ConnectionMode; 2] = [
    ConnectionMode::DedicatedThread,
    ConnectionMode::BlockingPool { connections: 3 },
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_phases_commit_once_each_and_a_retry_replays() {
    for mode in MODES {
        let w = World::new(mode).await;
        let Answer::Executed(Ok(receipt)) = w.run().await.unwrap() else {
            panic!("{mode:?}: not a fresh success");
        };
        assert_eq!(w.run().await.unwrap(), Answer::Replayed(Ok(receipt)));
        assert_eq!(w.counts().await, (1, 1, 1), "{mode:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_died_after_the_charge_is_resumed_there() {
    for mode in MODES {
        let w = World::new(mode).await;
        w.run_and_die_after_charge().await;
        assert_eq!(w.counts().await, (1, 1, 0), "{mode:?}: the ride committed");
        // Within the dead holder's lease, a retry is told to come back.
        assert!(matches!(
            w.run().await,
            Ok(Answer::Refused(Refusal::InProgress { .. }))
        ));
        w.clock.advance(LEASE + Duration::from_secs(1));
        let Answer::Executed(Ok(receipt)) = w.run().await.unwrap() else {
            panic!("{mode:?}: not resumed");
        };
        assert_eq!(
            w.counts().await,
            (1, 1, 1),
            "{mode:?}: the ride was not written again"
        );
        let keys = w.keys();
        assert!(
            keys.len() == 2 && keys[0] == keys[1],
            "{mode:?}: the charge was sent again with its key: {keys:?}"
        );
        assert_eq!(receipt.charge, 1);
        assert_eq!(w.run().await.unwrap(), Answer::Replayed(Ok(receipt)));
    }
}

/// Once a record has expired, the key is a new operation: a fresh claim starts without the
/// old recovery point, at the first phase, with a new key for its foreign call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_claim_after_expiry_starts_the_operation_over() {
    let w = World::new(ConnectionMode::DedicatedThread).await;
    w.run_and_die_after_charge().await;
    w.clock.advance(Duration::from_secs(7200));
    let outcome = w.run().await.unwrap();
    assert!(matches!(outcome, Answer::Executed(Ok(_))), "{outcome:?}");
    assert_eq!(w.counts().await, (2, 2, 1));
    let keys = w.keys();
    assert!(keys.len() == 2 && keys[0] != keys[1], "{keys:?}");
}

/// A table made by this crate's first schema, with a record in it, is upgraded by
/// `migrate` and keeps its record.
#[tokio::test]
async fn a_table_of_the_first_schema_is_migrated_with_its_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            r#"CREATE TABLE "idempotency_records_migrations" (
                   version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL) STRICT;
               INSERT INTO "idempotency_records_migrations" VALUES (1, 0);
               CREATE TABLE "idempotency_records" (
                   scope TEXT NOT NULL, key TEXT NOT NULL,
                   fingerprint BLOB NOT NULL CHECK (length(fingerprint) = 32),
                   status TEXT NOT NULL CHECK (status IN ('pending', 'completed', 'failed')),
                   token INTEGER NOT NULL CHECK (token >= 1), lease_until INTEGER, outcome BLOB,
                   attempts INTEGER NOT NULL CHECK (attempts >= 1), failure_retryable INTEGER,
                   failure_message TEXT, hits INTEGER NOT NULL CHECK (hits >= 0),
                   created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
                   expires_at INTEGER NOT NULL, PRIMARY KEY (scope, key)) STRICT;
               CREATE INDEX "idempotency_records_expires_at"
                   ON "idempotency_records" (expires_at);
               INSERT INTO "idempotency_records" VALUES ('rides', 'old', zeroblob(32),
                   'completed', 5, NULL, CAST('{"Ok":1}' AS BLOB), 1, NULL, NULL, 0, 0, 0,
                   9999999999999);"#,
        )
        .unwrap();
    }
    let store = SqliteStore::builder(&path).open().await.unwrap();
    store.migrate().await.unwrap();
    let id = idempotency_core::RecordId::new(
        IdempotencyKey::new("old").unwrap(),
        Scope::new("rides").unwrap(),
    );
    let record = idempotency_core::IdempotencyStore::get(&store, &id)
        .await
        .unwrap()
        .expect("the record survived the migration");
    assert_eq!(record.outcome.as_deref(), Some(&br#"{"Ok":1}"#[..]));
    let version: i64 = store
        .call(|c| {
            c.query_row(
                r#"SELECT max(version) FROM "idempotency_records_migrations""#,
                [],
                |r| r.get(0),
            )
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(version, idempotency_sqlite::SCHEMA_VERSION);
}

/// A recovery point left by an older record of the key (a fresh claim by a process of an
/// older crate does not clear it) is not resumed: it is older than the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_point_older_than_the_record_is_not_resumed() {
    let w = World::new(ConnectionMode::DedicatedThread).await;
    w.run_and_die_after_charge().await;
    w.clock.advance(Duration::from_secs(7200));
    // What an older process's fresh claim does: replace the expired record and leave the
    // recovery point columns as they were.
    let (key, scope, _) = World::key();
    let now = w.clock.now().as_millis();
    w.store
        .call(move |c| {
            c.execute(
                "UPDATE idempotency_records SET token = token + 1000, attempts = 1,
                     status = 'pending', lease_until = ?3, created_at = ?3, updated_at = ?3,
                     expires_at = ?3 + 3600000
                 WHERE scope = ?1 AND key = ?2",
                params![scope.as_str(), key.as_str(), now],
            )
        })
        .await
        .unwrap()
        .unwrap();
    w.clock.advance(LEASE + Duration::from_secs(1));
    let outcome = w.run().await.unwrap();
    assert!(matches!(outcome, Answer::Executed(Ok(_))), "{outcome:?}");
    assert_eq!(
        w.counts().await,
        (2, 2, 1),
        "started over at the first phase"
    );
}

/// The kit's recovery point cases, on both connection modes, on the manual clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_passes_every_recovery_point_case() {
    use idempotency_conformance::recovery::{recovery_cases, RecoveryKit};
    for mode in MODES {
        let (store, clock, _dir) = common::manual_store(mode).await;
        let (lease, ttl) = (Duration::from_secs(10), Duration::from_secs(60));
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
            pass: Box::new(move |d| {
                clock.advance(d);
                Box::pin(async {})
            }),
        };
        if let Err(e) = recovery_cases(&kit).await {
            panic!("{mode:?} {e}");
        }
    }
}

fn completer(w: &World) -> idempotency_core::Completer<SqliteStore> {
    let payments = w.payments.clone();
    idempotency_core::Completer::new(&w.engine)
        .operation("book-ride", move || flow(payments.clone()))
}

/// The completer finishes an operation whose holder died after its charge, once the lease
/// has passed (not before), from the charge on; the client's retry then replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_finishes_an_operation_whose_holder_died() {
    let w = World::new(ConnectionMode::DedicatedThread).await;
    w.run_and_die_after_charge().await;
    let completer = completer(&w);
    let early = completer.run_once().await.unwrap();
    assert_eq!(early.found, 0, "listed while its lease is live: {early}");
    w.clock.advance(LEASE + Duration::from_secs(1));
    let round = completer.run_once().await.unwrap();
    assert_eq!((round.found, round.completed), (1, 1), "{round}");
    assert_eq!(w.counts().await, (1, 1, 1), "resumed at the charge");
    let keys = w.keys();
    assert!(keys.len() == 2 && keys[0] == keys[1], "{keys:?}");
    let replay = w.run().await.unwrap();
    assert!(replay.is_replayed(), "{replay:?}");
    assert_eq!(completer.run_once().await.unwrap().found, 0);
    let stats = completer.stats();
    assert_eq!(
        (stats.rounds(), stats.completed(), stats.errors()),
        (3, 1, 0)
    );
}

/// Operations of a kind it was not given are left alone, and so are keys of one-step work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_leaves_other_operations_and_plain_keys_alone() {
    let w = World::new(ConnectionMode::DedicatedThread).await;
    w.run_and_die_after_charge().await;
    // A key of one-step work whose holder died.
    let plain = idempotency_core::RecordId::new(
        IdempotencyKey::new("p-1").unwrap(),
        Scope::new("plain").unwrap(),
    );
    let idempotency_core::protocol::Begin::Execute(lease) = w
        .engine
        .begin(&plain, &Fingerprint::from_bytes(b"p"))
        .await
        .unwrap()
    else {
        panic!("the plain key was not claimed");
    };
    drop(lease);
    w.clock.advance(LEASE + Duration::from_secs(1));
    let nobody = idempotency_core::Completer::new(&w.engine);
    let round = nobody.run_once().await.unwrap();
    assert_eq!(
        (round.found, round.unknown, round.completed),
        (0, 0, 0),
        "{round}"
    );
    assert_eq!(w.counts().await, (1, 1, 0));
}

/// `run` drives rounds until its shutdown resolves, then returns between rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_runs_until_shut_down() {
    let w = World::new(ConnectionMode::DedicatedThread).await;
    w.run_and_die_after_charge().await;
    w.clock.advance(LEASE + Duration::from_secs(1));
    let completer = Arc::new(completer(&w));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = {
        let completer = completer.clone();
        tokio::spawn(async move {
            completer
                .run(Duration::from_millis(10), async {
                    let _ = stopped.await;
                })
                .await
        })
    };
    let stats = completer.stats();
    let started = std::time::Instant::now();
    while stats.completed() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the completer finished nothing"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("it stopped")
        .unwrap();
    assert_eq!(w.counts().await, (1, 1, 1));
}

/// `Idempotency::maintain` runs the completer and the purge in the background until it is
/// shut down: the abandoned operation is finished, the expired key is deleted, and shutdown
/// returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_completes_and_purges_until_shut_down() {
    let w = World::new(ConnectionMode::DedicatedThread).await;
    let plain = IdempotencyKey::new("plain-1").unwrap();
    let scope = Scope::new("plain").unwrap();
    let first = w
        .engine
        .run(&plain, &scope, &Fingerprint::from_bytes(b"p"), |_| async {
            Ok::<_, String>(1)
        })
        .await
        .unwrap();
    assert!(!first.is_replayed());
    w.clock.advance(Duration::from_secs(3601));
    w.run_and_die_after_charge().await;
    w.clock.advance(LEASE + Duration::from_secs(1));

    let maintenance = w
        .engine
        .maintain()
        .purge_every(Duration::from_millis(10))
        .complete(completer(&w), Duration::from_millis(10))
        .spawn();
    let started = std::time::Instant::now();
    while maintenance.completer_stats()[0].completed() == 0
        || maintenance.purge_stats().purged() == 0
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "completed {}, purged {}",
            maintenance.completer_stats()[0].completed(),
            maintenance.purge_stats().purged()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::timeout(Duration::from_secs(60), maintenance.shutdown())
        .await
        .expect("shutdown returned");
    assert_eq!(w.counts().await, (1, 1, 1), "resumed at the charge, once");
    let gone = w
        .store
        .get(&idempotency_core::RecordId::new(plain, scope))
        .await
        .unwrap();
    assert!(gone.is_none(), "the expired key is still stored: {gone:?}");
    assert!(w.run().await.unwrap().is_replayed());
}

/// Starts the operation `name` for `key` (one database phase, then a foreign call that never
/// answers) and kills its holder during the call: an abandoned operation of that kind.
async fn abandon(w: &World, name: &'static str, key: &str) {
    let reached = Arc::new(tokio::sync::Notify::new());
    let flow = {
        let reached = reached.clone();
        Phases::<SqliteStore, (), String>::new(name)
            .phase(
                "write",
                |_: &mut SqliteTransaction, (): (), _: PhaseContext| Box::pin(async { Ok(Ok(())) }),
            )
            .foreign("call", move |(): (), _: PhaseContext| {
                reached.notify_one();
                async {
                    std::future::pending::<()>().await;
                    Ok(Ok(()))
                }
            })
    };
    let engine = w.engine.clone();
    let key = IdempotencyKey::new(key).unwrap();
    let task = tokio::spawn(async move {
        let (_, scope, fp) = World::key();
        engine.run_phases(&key, &scope, &fp, flow).await
    });
    // The first phase and its recovery point committed before the call.
    reached.notified().await;
    task.abort();
    let _ = task.await;
}

/// Operations of kinds a completer was not given do not fill its batches: with a batch of
/// one and older abandoned operations of another kind listed first by age, it still
/// finishes the one it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_of_other_kinds_do_not_starve_the_completer() {
    let w = World::new(ConnectionMode::DedicatedThread).await;
    for n in 0..3 {
        abandon(&w, "ship-parcel", &format!("parcel-{n}")).await;
        w.clock.advance(Duration::from_secs(1));
    }
    w.run_and_die_after_charge().await;
    w.clock.advance(LEASE + Duration::from_secs(1));
    let completer = completer(&w).batch(1);
    let round = completer.run_once().await.unwrap();
    assert_eq!((round.found, round.completed), (1, 1), "{round}");
    assert_eq!(w.counts().await, (1, 1, 1));
}

/// An operation whose phase keeps failing (its error recorded as a retryable failure) is
/// taken up again only once its failure is `retry_failed_after` old, and given up once its
/// record was claimed `max_attempts` times; the charge before it is never made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_operation_is_retried_after_a_pause_and_given_up() {
    let w = World::new(ConnectionMode::DedicatedThread).await;
    w.store
        .call(|c| c.execute_batch("DROP TABLE receipts"))
        .await
        .unwrap()
        .unwrap();
    // The receipt phase fails (no table): the failure is recorded, the charge kept.
    let first = w.run().await.unwrap();
    assert!(matches!(first, Answer::Executed(Err(_))), "{first:?}");
    let completer = completer(&w)
        .retry_failed_after(Duration::from_secs(30))
        .max_attempts(3);
    let mut listed = Vec::new();
    for _ in 0..6 {
        let round = completer.run_once().await.unwrap();
        listed.push((round.found, round.failed));
        w.clock.advance(Duration::from_secs(31));
        let again = completer.run_once().await.unwrap();
        listed.push((again.found, again.failed));
    }
    // Right after each failure: nothing. After the pause: the second and third attempts;
    // then given up.
    assert_eq!(
        listed,
        [
            (0, 0),
            (1, 1),
            (0, 0),
            (1, 1),
            (0, 0),
            (0, 0),
            (0, 0),
            (0, 0),
            (0, 0),
            (0, 0),
            (0, 0),
            (0, 0)
        ]
    );
    assert_eq!(w.payments.effects(), 1, "charged once");
    assert_eq!(w.keys().len(), 1, "the charge was not called again");
}

/// Rows the store cannot read back are reported as errors of the round, and the other
/// operations are finished all the same: unreadable rows, never rewritten, stay first in the
/// listing, but do not fill the next rounds' batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_rows_do_not_stop_the_completer() {
    let w = World::new(ConnectionMode::DedicatedThread).await;
    for n in 0..2 {
        abandon(&w, "book-ride", &format!("ride-bad-{n}")).await;
        w.clock.advance(Duration::from_secs(1));
    }
    w.run_and_die_after_charge().await;
    let table = idempotency_sqlite::DEFAULT_TABLE;
    w.store
        .call(move |c| {
            c.execute(
                &format!(
                    r#"UPDATE "{table}" SET key = 'tab' || char(9) || key WHERE key LIKE 'ride-bad-%'"#
                ),
                [],
            )
        })
        .await
        .unwrap()
        .unwrap();
    w.clock.advance(LEASE + Duration::from_secs(1));
    let completer = completer(&w).batch(1);
    let mut rounds = Vec::new();
    while completer.stats().completed() == 0 {
        assert!(rounds.len() < 5, "never finished: {rounds:?}");
        let round = completer.run_once().await.unwrap();
        rounds.push((round.found, round.completed, round.errors));
    }
    // The first round lists one unreadable row; the next asks for one more row per
    // unreadable one it saw.
    assert_eq!(rounds, [(1, 0, 1), (2, 0, 2), (3, 1, 2)]);
    assert_eq!(w.counts().await, (1, 1, 1));
}

/// Each round is counted through the `metrics` facade, and each operation by how it ended.
#[test]
fn the_completer_counts_its_rounds_as_metrics() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let w = World::new(ConnectionMode::DedicatedThread).await;
            w.run_and_die_after_charge().await;
            w.clock.advance(LEASE + Duration::from_secs(1));
            let completer = completer(&w);
            assert_eq!(completer.run_once().await.unwrap().completed, 1);
            assert_eq!(completer.run_once().await.unwrap().found, 0);
        })
    });
    let mut counters: Vec<(String, Vec<String>, u64)> = recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name().starts_with("idempotency_completer_"))
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Counter(n) => Some((
                key.key().name().to_owned(),
                key.key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect(),
                n,
            )),
            _ => None,
        })
        .collect();
    counters.sort();
    assert_eq!(
        counters,
        [
            (
                "idempotency_completer_operations_total".to_owned(),
                vec!["end=completed".to_owned()],
                1
            ),
            ("idempotency_completer_rounds_total".to_owned(), vec![], 2),
        ]
    );
}

/// The completer only finishes operations, never starts one: an operation whose record
/// expired after the completer listed it and before its turn (a backlog, a short retention)
/// is not claimed afresh and run from its first phase without its request, and one that
/// never got past its first phase is left for its client. Both are skipped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_never_starts_an_operation() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let w = World::new(ConnectionMode::DedicatedThread).await;
    // Two operations past their first phase, "ship-a" written (and listed) before "ship-b".
    abandon(&w, "ship", "ship-a").await;
    w.clock.advance(Duration::from_secs(1));
    abandon(&w, "ship", "ship-b").await;
    w.clock.advance(LEASE + Duration::from_secs(1));
    // The first phase counts its runs; the second, on its first call, lets all but a second
    // of the retention pass: "ship-b" expires while "ship-a" runs.
    let (starts, calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let flow = {
        let (starts, calls, clock) = (starts.clone(), calls.clone(), w.clock.clone());
        move || {
            let (starts, calls, clock) = (starts.clone(), calls.clone(), clock.clone());
            Phases::<SqliteStore, (), String>::new("ship")
                .phase(
                    "write",
                    move |_: &mut SqliteTransaction, (): (), _: PhaseContext| {
                        starts.fetch_add(1, Ordering::SeqCst);
                        Box::pin(async { Ok(Ok(())) })
                    },
                )
                .foreign("call", move |(): (), _: PhaseContext| {
                    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        clock.advance(Duration::from_secs(3600 - 1));
                    }
                    async { Ok(Ok(())) }
                })
        }
    };
    let flow = Arc::new(flow);
    let completer = idempotency_core::Completer::new(&w.engine)
        .operation("ship", {
            let flow = flow.clone();
            move || flow()
        })
        .concurrency(1);
    let round = completer.run_once().await.unwrap();
    assert_eq!(
        starts.load(Ordering::SeqCst),
        0,
        "the completer ran a first phase without a request: {round}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "{round}");
    assert_eq!(
        (round.found, round.completed, round.skipped),
        (2, 1, 1),
        "{round}"
    );
    assert_eq!(completer.stats().skipped(), 1);
    // "ship-b" is a new key for its client: its request runs from the first phase.
    let (_, scope, fp) = World::key();
    let fresh = w
        .engine
        .run_phases(&IdempotencyKey::new("ship-b").unwrap(), &scope, &fp, flow())
        .await
        .unwrap();
    assert!(matches!(fresh, Answer::Executed(Ok(()))), "{fresh:?}");
    assert_eq!(starts.load(Ordering::SeqCst), 1);
}

/// An operation whose first phase is a foreign call, abandoned during that call, is listed at
/// phase 0: the completer leaves it untouched (no takeover, no call without the request)
/// and counts it skipped; its client's retry resumes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_skips_an_operation_not_past_its_first_phase() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let w = World::new(ConnectionMode::DedicatedThread).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let flow = {
        let calls = calls.clone();
        move |hang: bool| {
            let calls = calls.clone();
            Phases::<SqliteStore, (), String>::new("notify")
                .foreign("call", move |(): (), _: PhaseContext| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    async move {
                        if hang {
                            std::future::pending::<()>().await;
                        }
                        Ok(Ok(()))
                    }
                })
                .phase(
                    "write",
                    |_: &mut SqliteTransaction, (): (), _: PhaseContext| {
                        Box::pin(async { Ok(Ok(())) })
                    },
                )
        }
    };
    let (engine, first) = (w.engine.clone(), flow(true));
    let task = tokio::spawn(async move {
        let (_, scope, fp) = World::key();
        let key = IdempotencyKey::new("notify-1").unwrap();
        engine.run_phases(&key, &scope, &fp, first).await
    });
    while calls.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.abort();
    let _ = task.await;
    w.clock.advance(LEASE + Duration::from_secs(1));
    let completer =
        idempotency_core::Completer::new(&w.engine).operation("notify", move || flow(false));
    let round = completer.run_once().await.unwrap();
    assert_eq!((round.found, round.skipped), (1, 1), "{round}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the completer made the call"
    );
}
