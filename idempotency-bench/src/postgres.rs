//! The PostgreSQL backend and its raw baseline on the same pool: `INSERT … ON CONFLICT DO
//! NOTHING RETURNING` then `UPDATE … SET status = 'completed'`, and a primary-key `SELECT` for
//! replay. Everything lives in a schema of its own, dropped at the end.
//!
//! Round trips are counted on the wire by `idempotency_testing::pg_wire::CountingProxy`, on a
//! second, single-connection pool used only for counting.

use crate::harness::{
    self, Backend, Cleanup, Counted, LimitWorkload, PhysicalLimit, RawBaseline, RoundTripCounter,
};
use crate::harness::{Filled, Kind, Scaling};
use async_trait::async_trait;
use idempotency_core::store::BoxError;
use idempotency_core::{IdempotencyKey, IdempotencyStore, RecordId};
use idempotency_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use idempotency_postgres::sqlx::{self, Connection, PgConnection, PgPool};
use idempotency_postgres::PostgresStore;
use idempotency_testing::pg_wire::CountingProxy;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// The server: `IDEMPOTENCY_BENCH_POSTGRES_URL`, or the local default.
pub(crate) fn url() -> String {
    std::env::var("IDEMPOTENCY_BENCH_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn unreachable(e: impl std::fmt::Display) -> BoxError {
    format!(
        "cannot reach PostgreSQL at {} ({e}). Start it with `bash .ci/services`, or point \
         IDEMPOTENCY_BENCH_POSTGRES_URL at a server you can write to.",
        url()
    )
    .into()
}

pub(crate) async fn admin() -> Result<PgConnection, BoxError> {
    let options = PgConnectOptions::from_str(&url())?;
    match tokio::time::timeout(
        Duration::from_secs(10),
        PgConnection::connect_with(&options),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(unreachable(e)),
        Err(_) => Err(unreachable("no answer within 10 s")),
    }
}

/// A fresh schema holding the store's table and the raw table; dropped with the guard.
pub(crate) struct Schema {
    pub name: String,
    _cleanup: Cleanup,
}

impl Schema {
    pub(crate) async fn create() -> Result<Self, BoxError> {
        let name = format!("idem_bench_{}", uuid::Uuid::new_v4().simple());
        let mut conn = admin().await?;
        sqlx::query(&format!("CREATE SCHEMA {name}"))
            .execute(&mut conn)
            .await?;
        sqlx::query(&format!(
            "CREATE TABLE {name}.raw (key text PRIMARY KEY, status text NOT NULL, outcome bytea)"
        ))
        .execute(&mut conn)
        .await?;
        let schema = name.clone();
        Ok(Self {
            name,
            _cleanup: Cleanup::new(move || async move {
                let mut conn = admin().await?;
                sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                    .execute(&mut conn)
                    .await?;
                Ok(())
            }),
        })
    }
}

/// A pool like the one `PostgresStoreBuilder::connect` makes (no ping before use), sized for
/// the largest client count.
async fn pool(options: PgConnectOptions, size: u32) -> Result<PgPool, BoxError> {
    PgPoolOptions::new()
        .max_connections(size)
        .min_connections(size)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .map_err(unreachable)
}

/// A store over `pool` that keeps connections between operations
/// (`PostgresStoreBuilder::keep_connections`, off by default): no release ping per operation.
async fn store(pool: PgPool, schema: &str) -> Result<PostgresStore, BoxError> {
    let store = PostgresStore::builder()
        .schema(schema)
        .table("records")
        .keep_connections(true)
        .build(pool)?;
    store.migrate().await?;
    Ok(store)
}

pub(crate) struct RawPostgres {
    pool: PgPool,
    insert: String,
    update: String,
    select: String,
}

impl RawPostgres {
    fn new(pool: PgPool, schema: &str) -> Self {
        Self {
            pool,
            insert: format!(
                "INSERT INTO {schema}.raw (key, status) VALUES ($1, 'pending') \
                 ON CONFLICT DO NOTHING RETURNING key"
            ),
            update: format!(
                "UPDATE {schema}.raw SET status = 'completed', outcome = $2 WHERE key = $1"
            ),
            select: format!("SELECT outcome FROM {schema}.raw WHERE key = $1"),
        }
    }
}

#[async_trait]
impl RawBaseline for RawPostgres {
    async fn new_key_cycle(&self, key: &str, outcome: &[u8]) -> Result<(), BoxError> {
        let inserted = sqlx::query(&self.insert)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        if inserted.is_none() {
            return Err("raw insert found the key taken".into());
        }
        sqlx::query(&self.update)
            .bind(key)
            .bind(outcome)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn replay(&self, key: &str) -> Result<Option<Vec<u8>>, BoxError> {
        let row: Option<(Option<Vec<u8>>,)> = sqlx::query_as(&self.select)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.and_then(|(o,)| o))
    }
}

struct ProxyCounter(CountingProxy);

#[async_trait]
impl RoundTripCounter for ProxyCounter {
    async fn count(&self) -> Result<u64, BoxError> {
        // sqlx pings a connection as the pool takes it back (a bare Sync, in the background
        // and off the caller's path): after every raw statement, and after the store's when it
        // hands a kept connection back (on this pool of one, every 100 ms of use); let it land
        // so it is not mixed into the next count.
        tokio::time::sleep(Duration::from_millis(30)).await;
        Ok(self.0.snapshot().round_trips())
    }

    async fn detail(&self) -> Result<Vec<(String, u64)>, BoxError> {
        let c = self.0.snapshot();
        Ok(vec![
            ("statements prepared (Parse)".into(), c.parses),
            ("pool liveness pings (bare Sync)".into(), c.bare_syncs),
        ])
    }
}

/// The measured backend (pool of `max_clients` connections) and a counted twin (one
/// connection through the proxy), both on the same fresh schema.
pub(crate) async fn backend(max_clients: usize) -> Result<(Backend, Schema), BoxError> {
    let schema = Schema::create().await?;
    let options = PgConnectOptions::from_str(&url())?;
    let size = u32::try_from(max_clients.max(1)).unwrap_or(u32::MAX);
    let direct = pool(options.clone(), size).await?;
    let measured = store(direct.clone(), &schema.name).await?;

    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = CountingProxy::start(upstream).await?;
    let proxied = options
        .host("127.0.0.1")
        .port(proxy.port())
        .ssl_mode(PgSslMode::Disable);
    let counted_pool = pool(proxied, 1).await?;
    let counted = store(counted_pool.clone(), &schema.name).await?;
    let pgbench = Pgbench {
        proxy: proxy.clone(),
        store: counted.clone(),
    };

    Ok((
        Backend {
            name: "postgres",
            store: Arc::new(measured),
            raw: Arc::new(RawPostgres::new(direct, &schema.name)),
            round_trips: Some(Counted {
                store: Arc::new(counted),
                raw: Arc::new(RawPostgres::new(counted_pool, &schema.name)),
                counter: Arc::new(ProxyCounter(proxy)),
                method: "frontend messages counted by a loopback proxy (every Sync or Query is \
                         one round trip)",
                floor: None,
            }),
            limit: Some(Arc::new(pgbench)),
        },
        schema,
    ))
}

/// WAL flushes (`pg_stat_wal.wal_sync`, cluster-wide) caused by `n` operations of each kind on
/// one connection: does a replay cost a durable write?
pub(crate) async fn wal_syncs(n: usize, targets: &mut crate::Targets) -> Result<(), BoxError> {
    let schema = Schema::create().await?;
    let options = PgConnectOptions::from_str(&url())?;
    let one = pool(options, 1).await?;
    let store = store(one.clone(), &schema.name).await?;
    let raw = RawPostgres::new(one.clone(), &schema.name);
    let mut admin = admin().await?;
    let scope = harness::scope();
    let ids: Vec<_> = (0..n)
        .map(|i| idempotency_core::RecordId::new(harness::key("wal", 0, i), scope.clone()))
        .collect();

    // Reads the counter once the measured backend has reported its pending statistics
    // (PostgreSQL 15 batches them for up to a second otherwise).
    async fn syncs(one: &PgPool, admin: &mut PgConnection) -> Result<i64, BoxError> {
        let mut c = one.acquire().await?;
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&mut *c)
            .await?;
        sqlx::query("SELECT 1").execute(&mut *c).await?;
        drop(c);
        // The WAL writer flushes asynchronously committed WAL at least every
        // wal_writer_delay (200 ms by default); give it that long so its flushes are counted.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (v,): (i64,) = sqlx::query_as("SELECT wal_sync FROM pg_stat_wal")
            .fetch_one(&mut *admin)
            .await?;
        Ok(v)
    }

    let mut rows = Vec::new();
    let s0 = syncs(&one, &mut admin).await?;
    for id in &ids {
        harness::store_cycle(&store, id.clone()).await?;
    }
    let s1 = syncs(&one, &mut admin).await?;
    rows.push(("new-key cycles (claim + complete)", s1 - s0));
    for id in &ids {
        harness::store_replay(&store, id.clone()).await?;
    }
    let s2 = syncs(&one, &mut admin).await?;
    rows.push(("replays (claim of a completed key)", s2 - s1));
    for (i, _) in ids.iter().enumerate() {
        raw.new_key_cycle(&format!("wal-{i}"), harness::OUTCOME.as_bytes())
            .await?;
    }
    let s3 = syncs(&one, &mut admin).await?;
    rows.push(("raw INSERT + UPDATE", s3 - s2));
    for (i, _) in ids.iter().enumerate() {
        raw.replay(&format!("wal-{i}")).await?;
    }
    let s4 = syncs(&one, &mut admin).await?;
    rows.push((
        "raw SELECT (other sessions' flushes: the noise floor)",
        s4 - s3,
    ));

    println!(
        "\nWAL flushes (pg_stat_wal.wal_sync, whole server, so other sessions add to it), {n} \
         operations each on one connection:\n"
    );
    println!("| operations | WAL flushes | per operation |");
    println!("|---|---|---|");
    for (what, d) in &rows {
        println!("| {what} | {d} | {:.3} |", *d as f64 / n as f64);
    }
    let replay = rows[1].1 as f64 / n as f64;
    targets.check(
        "postgres: a replay costs no WAL flush",
        format!(
            "{replay:.3} flushes per replay (new-key cycle: {:.3}; noise floor: {:.3})",
            rows[0].1 as f64 / n as f64,
            rows[3].1 as f64 / n as f64
        ),
        replay < 0.1,
    );
    drop(schema);
    Ok(())
}

/// Fills the store's table with `n` completed records in one `INSERT … SELECT
/// generate_series`, keyed as the harness's `key("fill", 0, i)`.
pub(crate) async fn fill(store: &PostgresStore, n: usize) -> Result<(), BoxError> {
    let table = store.table_name().qualified();
    let sql = format!(
        "INSERT INTO {table} (scope, key, fingerprint, status, token, lease_until, outcome,
             attempts, failure_retryable, failure_message, hits, created_at, updated_at,
             expires_at)
         SELECT $1, 'fill-0-' || i, $2, 'completed', 1, NULL, $3, 1, NULL, NULL, 0, now(),
             now(), now() + interval '1 day'
         FROM generate_series(0, $4 - 1) AS i"
    );
    sqlx::query(&sql)
        .bind(harness::scope().as_str())
        .bind(&harness::fingerprint().as_bytes()[..])
        .bind(harness::engine_outcome())
        .bind(i64::try_from(n)?)
        .execute(store.pool())
        .await?;
    sqlx::query(&format!("ANALYZE {table}"))
        .execute(store.pool())
        .await?;
    Ok(())
}

/// A store on a fresh schema and a pool of one connection, for the scaling table.
pub(crate) async fn scaling_store() -> Result<(PostgresStore, Schema), BoxError> {
    let schema = Schema::create().await?;
    let options = PgConnectOptions::from_str(&url())?;
    let one = pool(options, 1).await?;
    Ok((store(one, &schema.name).await?, schema))
}

/// A store on a fresh schema and a pool of two connections, for the phases table.
pub(crate) async fn phases_store() -> Result<(PostgresStore, Schema), BoxError> {
    let schema = Schema::create().await?;
    let options = PgConnectOptions::from_str(&url())?;
    let two = pool(options, 2).await?;
    Ok((store(two, &schema.name).await?, schema))
}

/// `pgbench -M prepared` running the statements the store sends (as the counting proxy saw
/// them) against the same server, on the same schema: the physical limit of the workloads.
struct Pgbench {
    proxy: CountingProxy,
    store: PostgresStore,
}

/// How many completed records the replay script reads, keyed `pgb-replay-<n>`.
const PGBENCH_REPLAY_KEYS: usize = 1000;

impl Pgbench {
    /// The store's claim and complete statements, as the engine sends them by default (the
    /// claim counts no hit: one statement for new keys and replays): sent once each through
    /// the proxy, then read back from it.
    async fn statements(&self) -> Result<(String, String), BoxError> {
        let engine = harness::engine(Arc::new(self.store.clone()))?;
        let key = IdempotencyKey::new(format!("pgb-prime-{}", uuid::Uuid::new_v4()))?;
        harness::engine_cycle(&engine, &harness::scope(), &key).await?;
        harness::engine_replay(&engine, &harness::scope(), &key).await?;
        let seen = self.proxy.statements();
        let find = |what: &str, f: &dyn Fn(&str) -> bool| {
            seen.iter()
                .find(|q| f(q))
                .cloned()
                .ok_or_else(|| format!("the proxy saw no {what} statement"))
        };
        let claim = find("claim", &|q| q.contains("live AS"))?;
        let complete = find("complete", &|q| q.contains("SET status = 'completed'"))?;
        Ok((claim, complete))
    }

    /// The pgbench script of `workload`, built from the store's statements with their
    /// parameters replaced by the values the harness binds.
    async fn script(&self, workload: LimitWorkload) -> Result<String, BoxError> {
        let (claim, complete) = self.statements().await?;
        let scope = format!("'{}'", harness::scope().as_str().replace('\'', "''"));
        let fp = format!("decode('{}', 'hex')", harness::fingerprint().to_hex());
        let bind = |sql: &str, params: &[&str]| {
            let mut sql = sql.to_owned();
            // Highest first, so `$1` never matches the start of `$10`.
            for (i, p) in params.iter().enumerate().rev() {
                sql = sql.replace(&format!("${}", i + 1), p);
            }
            sql
        };
        let lease = "30000";
        let ttl = "86400000";
        Ok(match workload {
            LimitWorkload::NewKey => {
                let key = "('pgb-' || :k::text)";
                format!(
                    "\\set k random(1, 1000000000000000)\n{} \\gset\n{};\n",
                    bind(&claim, &[&scope, key, &fp, lease, ttl]),
                    bind(
                        &complete,
                        &[&scope, key, ":token", "decode('7b7d', 'hex')", ttl]
                    ),
                )
            }
            LimitWorkload::UncountedReplay => {
                let key = "('pgb-replay-' || :n::text)";
                format!(
                    "\\set n random(0, {})\n{};\n",
                    PGBENCH_REPLAY_KEYS - 1,
                    bind(&claim, &[&scope, key, &fp, lease, ttl]),
                )
            }
        })
    }
}

#[async_trait]
impl PhysicalLimit for Pgbench {
    fn method(&self) -> String {
        "pgbench -M prepared, the store's own statements (as the counting proxy saw them), same \
         server and schema"
            .to_owned()
    }

    async fn ops_per_sec(
        &self,
        workload: LimitWorkload,
        clients: usize,
        duration: Duration,
    ) -> Result<f64, BoxError> {
        if workload == LimitWorkload::UncountedReplay {
            let engine = harness::engine(Arc::new(self.store.clone()))?;
            for n in 0..PGBENCH_REPLAY_KEYS {
                let key = IdempotencyKey::new(format!("pgb-replay-{n}"))?;
                let id = RecordId::new(key.clone(), harness::scope());
                if self.store.get(&id).await?.is_none() {
                    harness::engine_cycle(&engine, &harness::scope(), &key).await?;
                }
            }
        }
        let script = self.script(workload).await?;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("workload.sql");
        std::fs::write(&path, &script)?;
        let seconds = duration.as_secs().max(1).to_string();
        let out = tokio::process::Command::new("pgbench")
            .args(["-n", "-M", "prepared", "-T", &seconds])
            .args([
                "-c",
                &clients.to_string(),
                "-j",
                &clients.min(2).to_string(),
            ])
            .arg("-f")
            .arg(&path)
            .arg(url())
            .output()
            .await
            .map_err(|e| format!("cannot run pgbench ({e}); it ships with PostgreSQL"))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!(
                "pgbench failed: {}\n{stdout}\nscript:\n{script}",
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("tps = "))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| format!("no tps in pgbench's output:\n{stdout}").into())
    }
}

/// PostgreSQL in the bench (the scaling table up to 100,000 live keys: filling more takes
/// longer than the rest of the run).
pub(crate) const KIND: Kind = Kind {
    name: "postgres",
    make: |max_clients| {
        Box::pin(async move {
            let (b, schema) = backend(max_clients).await?;
            Ok(vec![(b, Box::new(schema) as Box<dyn std::any::Any>)])
        })
    },
    scaling: Some(Scaling {
        max_keys: 100_000,
        filled: |n| Box::pin(filled(n)),
        in_process_memory: false,
    }),
};

/// A store on a fresh schema holding `n` completed records.
async fn filled(n: usize) -> Result<Filled, BoxError> {
    let (store, schema) = scaling_store().await?;
    fill(&store, n).await?;
    Ok((Arc::new(store), Box::new(schema)))
}
