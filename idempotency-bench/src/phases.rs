//! What a phase costs (`--phases`): a multi-step operation (`Idempotency::run_phases`) against
//! the one-shot exactly-once path (`Idempotency::run_in_transaction`) on each SQL store, in the
//! same run, one client, every operation a fresh key whose steps each insert one row.
//!
//! Four workloads, taking turns in rounds so that a noisy moment of the machine falls on all
//! of them: one transaction of one row, one transaction of three rows, one phase of one row,
//! three phases of one row each. A phase's own cost is what three phases take beyond one
//! transaction of the same three rows, per extra phase.

use crate::stats::{fmt_latency, Summary};
use futures::future::BoxFuture;
use idempotency_core::store::{BoxError, RecoveryPoints};
use idempotency_core::{
    Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, PhaseContext, Phases, Scope,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Inserts one row through a store's transaction.
trait Insert<S: RecoveryPoints>: Clone + Send + Sync + 'static {
    fn insert<'t>(
        &self,
        tx: &'t mut S::Connection,
    ) -> BoxFuture<'t, Result<Result<(), String>, S::WorkError>>;
}

#[derive(Clone)]
struct SqliteInsert;

impl Insert<idempotency_sqlite::SqliteStore> for SqliteInsert {
    fn insert<'t>(
        &self,
        tx: &'t mut idempotency_sqlite::SqliteTransaction,
    ) -> BoxFuture<'t, Result<Result<(), String>, Error>> {
        Box::pin(async move {
            let done = tx
                .run(|t| t.execute("INSERT INTO bench_rows (n) VALUES (1)", []))
                .await?;
            Ok(done.map(|_| ()).map_err(|e| e.to_string()))
        })
    }
}

#[derive(Clone)]
struct PostgresInsert(Arc<str>);

impl Insert<idempotency_postgres::PostgresStore> for PostgresInsert {
    fn insert<'t>(
        &self,
        tx: &'t mut idempotency_postgres::sqlx::PgConnection,
    ) -> BoxFuture<'t, Result<Result<(), String>, idempotency_postgres::sqlx::Error>> {
        let sql = self.0.clone();
        Box::pin(async move {
            idempotency_postgres::sqlx::query(&sql).execute(tx).await?;
            Ok(Ok(()))
        })
    }
}

#[derive(Clone)]
struct MySqlInsert(Arc<str>);

impl Insert<idempotency_mysql::MySqlStore> for MySqlInsert {
    fn insert<'t>(
        &self,
        tx: &'t mut idempotency_mysql::sqlx::MySqlConnection,
    ) -> BoxFuture<'t, Result<Result<(), String>, idempotency_mysql::sqlx::Error>> {
        let sql = self.0.clone();
        Box::pin(async move {
            idempotency_mysql::sqlx::query(&sql).execute(tx).await?;
            Ok(Ok(()))
        })
    }
}

/// The workloads, in the order they take turns.
const WORKLOADS: [&str; 4] = [
    "run_in_transaction, 1 row",
    "run_in_transaction, 3 rows",
    "run_phases, 1 phase",
    "run_phases, 3 phases",
];

/// Runs the four workloads on `store`, `ops` operations each; prints a table and returns the
/// median latencies.
async fn measure<S, I>(name: &str, store: S, insert: I, ops: usize) -> Result<(), BoxError>
where
    S: RecoveryPoints + IdempotencyStore + 'static,
    I: Insert<S>,
{
    let engine = Idempotency::builder(store).build()?;
    let scope = Scope::new("bench-phases")?;
    let fingerprint = Fingerprint::from_bytes(b"bench");
    let rounds = 10;
    let per_round = ops.div_ceil(rounds).max(1);
    let mut samples: [Vec<Duration>; 4] = Default::default();
    let mut elapsed = [Duration::ZERO; 4];
    let run = uuid::Uuid::new_v4().simple().to_string();
    // Round 0 warms up (not counted).
    for round in 0..=rounds {
        for (w, _) in WORKLOADS.iter().enumerate() {
            let started = Instant::now();
            for i in 0..per_round {
                let key = IdempotencyKey::new(format!("{run}-{w}-{round}-{i}"))?;
                let t0 = Instant::now();
                match w {
                    0 | 1 => {
                        let rows = if w == 0 { 1 } else { 3 };
                        let insert = insert.clone();
                        let out = engine
                            .run_in_transaction(&key, &scope, &fingerprint, |tx, _| {
                                let insert = insert.clone();
                                Box::pin(async move {
                                    for _ in 0..rows {
                                        if let Err(e) = insert.insert(tx).await? {
                                            return Ok(Err(e));
                                        }
                                    }
                                    Ok(Ok(()))
                                })
                            })
                            .await?;
                        out.into_result()??;
                    }
                    _ => {
                        let phases = if w == 2 { 1 } else { 3 };
                        let mut op = Phases::<S, (), String>::new("bench");
                        for p in 0..phases {
                            let insert = insert.clone();
                            op = op.phase(
                                format!("step-{p}"),
                                move |tx: &mut S::Connection, (): (), _: PhaseContext| {
                                    insert.insert(tx)
                                },
                            );
                        }
                        let out = engine.run_phases(&key, &scope, &fingerprint, op).await?;
                        out.into_result()??;
                    }
                }
                if round > 0 {
                    samples[w].push(t0.elapsed());
                }
            }
            if round > 0 {
                elapsed[w] += started.elapsed();
            }
        }
    }
    let summaries: Vec<Summary> = samples
        .into_iter()
        .zip(elapsed)
        .map(|(s, e)| Summary::from_samples(s, e))
        .collect();
    println!(
        "\n## {name}: what a phase costs (one client, {} operations each)\n",
        summaries[0].ops
    );
    println!("| workload | ops/s | p50 | p99 |");
    println!("|---|---:|---:|---:|");
    for (w, s) in WORKLOADS.iter().zip(&summaries) {
        println!(
            "| {w} | {:.0} | {} | {} |",
            s.ops_per_sec(),
            fmt_latency(s.p50),
            fmt_latency(s.p99)
        );
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let one_phase = us(summaries[2].p50) - us(summaries[0].p50);
    let per_phase = (us(summaries[3].p50) - us(summaries[1].p50)) / 2.0;
    println!(
        "\n{name}: one phase against one transaction of the same row: {one_phase:+.0} µs at the \
         median ({:.2}x); each phase after the first (three phases against one transaction of \
         the same three rows): {per_phase:+.0} µs ({:.2}x in all)",
        us(summaries[2].p50) / us(summaries[0].p50),
        us(summaries[3].p50) / us(summaries[1].p50),
    );
    Ok(())
}

/// `--phases`: the table for each SQL store among `backends`.
pub(crate) async fn run(backends: &[String], ops: usize) -> Result<(), BoxError> {
    for name in backends {
        match name.as_str() {
            "sqlite" => {
                let (store, _dir) =
                    crate::sqlite::open(idempotency_sqlite::ConnectionMode::DedicatedThread)
                        .await?;
                store
                    .call(|c| c.execute_batch("CREATE TABLE bench_rows (n INTEGER NOT NULL)"))
                    .await??;
                measure("sqlite (dedicated thread)", store, SqliteInsert, ops).await?;
            }
            "postgres" => {
                let (store, schema) = crate::postgres::phases_store().await?;
                let table = format!("{}.bench_rows", schema.name);
                idempotency_postgres::sqlx::query(&format!(
                    "CREATE TABLE {table} (n bigint NOT NULL)"
                ))
                .execute(store.pool())
                .await?;
                let insert = PostgresInsert(format!("INSERT INTO {table} (n) VALUES (1)").into());
                measure("postgres", store, insert, ops).await?;
            }
            "mysql" => {
                let (store, tables) = crate::mysql::phases_store().await?;
                let insert =
                    MySqlInsert(format!("INSERT INTO `{}` (n) VALUES (1)", tables.rows).into());
                measure("mysql", store, insert, ops).await?;
            }
            other => println!("\n{other}: no recovery points (phases run on the SQL stores)"),
        }
    }
    Ok(())
}
