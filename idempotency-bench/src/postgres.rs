//! The PostgreSQL backend and its raw baseline on the same pool: `INSERT … ON CONFLICT DO
//! NOTHING RETURNING` then `UPDATE … SET status = 'completed'`, and a primary-key `SELECT` for
//! replay. Everything lives in a schema of its own, dropped at the end.
//!
//! Round trips are counted on the wire by `idempotency_testing::pg_wire::CountingProxy`, on a
//! second, single-connection pool used only for counting.

use crate::harness::{self, Backend, Cleanup, Counted, RawBaseline, RoundTripCounter};
use async_trait::async_trait;
use idempotency_core::BoxError;
use idempotency_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use idempotency_postgres::sqlx::{self, Connection, PgConnection, PgPool};
use idempotency_postgres::PostgresStore;
use idempotency_testing::pg_wire::CountingProxy;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// The server: `IDEMPOTENCY_BENCH_POSTGRES_URL`, or the local default.
pub fn url() -> String {
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

pub async fn admin() -> Result<PgConnection, BoxError> {
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
pub struct Schema {
    pub name: String,
    _cleanup: Cleanup,
}

impl Schema {
    pub async fn create() -> Result<Self, BoxError> {
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

async fn store(pool: PgPool, schema: &str) -> Result<PostgresStore, BoxError> {
    let store = PostgresStore::builder()
        .schema(schema)
        .table("records")
        .build(pool)?;
    store.migrate().await?;
    Ok(store)
}

pub struct RawPostgres {
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
        // and off the caller's path); let it land so it is not mixed into the next count.
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
pub async fn backend(max_clients: usize) -> Result<(Backend, Schema), BoxError> {
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
            }),
        },
        schema,
    ))
}

/// WAL flushes (`pg_stat_wal.wal_sync`, cluster-wide) caused by `n` operations of each kind on
/// one connection: does a replay cost a durable write?
pub async fn wal_syncs(n: usize, targets: &mut crate::Targets) -> Result<(), BoxError> {
    let schema = Schema::create().await?;
    let options = PgConnectOptions::from_str(&url())?;
    let one = pool(options, 1).await?;
    let store = store(one.clone(), &schema.name).await?;
    let raw = RawPostgres::new(one.clone(), &schema.name);
    let mut admin = admin().await?;
    let scope = harness::scope();
    let ids: Vec<_> = (0..n)
        .map(|i| idempotency_core::RecordId::new(scope.clone(), harness::key("wal", 0, i)))
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
pub async fn fill(store: &PostgresStore, n: usize) -> Result<(), BoxError> {
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
pub async fn scaling_store() -> Result<(PostgresStore, Schema), BoxError> {
    let schema = Schema::create().await?;
    let options = PgConnectOptions::from_str(&url())?;
    let one = pool(options, 1).await?;
    Ok((store(one, &schema.name).await?, schema))
}
