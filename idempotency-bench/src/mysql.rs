//! The MySQL/MariaDB backend and its raw baseline on the same pool: `INSERT IGNORE` (its
//! affected-row count says whether the key was new) then `UPDATE … SET status = 'completed'`,
//! and a primary-key `SELECT` for replay. Both tables live in the server's database under
//! names of their own, dropped at the end.
//!
//! Round trips are counted on the wire by `idempotency_testing::mysql_wire::CountingProxy`,
//! on a second, single-connection pool used only for counting.

use crate::harness::{Backend, Cleanup, Counted, Kind, RawBaseline, RoundTripCounter};
use async_trait::async_trait;
use idempotency_core::store::BoxError;
use idempotency_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions, MySqlSslMode};
use idempotency_mysql::sqlx::{self, ConnectOptions, Connection, Executor, MySqlPool};
use idempotency_mysql::MySqlStore;
use idempotency_testing::mysql_wire::CountingProxy;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// The server: `IDEMPOTENCY_BENCH_MYSQL_URL`, or the local MariaDB.
pub(crate) fn url() -> String {
    std::env::var("IDEMPOTENCY_BENCH_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

fn unreachable(e: impl std::fmt::Display) -> BoxError {
    format!(
        "cannot reach MySQL/MariaDB at {} ({e}). Start it with `bash .ci/services`, or point \
         IDEMPOTENCY_BENCH_MYSQL_URL at a server you can write to.",
        url()
    )
    .into()
}

async fn exec(sql: String) -> Result<(), BoxError> {
    let options = MySqlConnectOptions::from_str(&url())?;
    let mut conn = match tokio::time::timeout(Duration::from_secs(10), options.connect()).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(unreachable(e)),
        Err(_) => return Err(unreachable("no answer within 10 s")),
    };
    conn.execute(sql.as_str()).await?;
    conn.close().await?;
    Ok(())
}

/// The store's table and the raw table, under fresh names; dropped with the guard.
pub(crate) struct Tables {
    records: String,
    raw: String,
    _cleanup: Cleanup,
}

impl Tables {
    async fn create() -> Result<Self, BoxError> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let (records, raw) = (
            format!("idem_bench_{}", &id[..16]),
            format!("idem_bench_raw_{}", &id[..16]),
        );
        exec(format!(
            "CREATE TABLE `{raw}` (k VARBINARY(255) PRIMARY KEY, \
             status VARCHAR(16) NOT NULL, outcome LONGBLOB NULL) ENGINE = InnoDB"
        ))
        .await?;
        let drop = format!("DROP TABLE IF EXISTS `{records}`, `{raw}`");
        Ok(Self {
            records,
            raw,
            _cleanup: Cleanup::new(move || exec(drop)),
        })
    }
}

/// The store's table and a table of rows for the phases table; dropped with the guard.
pub(crate) struct PhasesTables {
    pub rows: String,
    _cleanup: Cleanup,
}

/// A store on a fresh table, a pool of two connections and a table of rows, for the phases
/// table.
pub(crate) async fn phases_store() -> Result<(MySqlStore, PhasesTables), BoxError> {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let (records, rows) = (
        format!("idem_bench_{}", &id[..16]),
        format!("idem_bench_rows_{}", &id[..16]),
    );
    exec(format!(
        "CREATE TABLE `{rows}` (n BIGINT NOT NULL) ENGINE = InnoDB"
    ))
    .await?;
    let drop = format!("DROP TABLE IF EXISTS `{records}`, `{rows}`");
    let tables = PhasesTables {
        rows,
        _cleanup: Cleanup::new(move || exec(drop)),
    };
    let options = MySqlConnectOptions::from_str(&url())?;
    let store = store(pool(options, 2).await?, &records).await?;
    Ok((store, tables))
}

/// A pool like the one `MySqlStoreBuilder::connect` makes (no ping before use), sized for the
/// largest client count.
async fn pool(options: MySqlConnectOptions, size: u32) -> Result<MySqlPool, BoxError> {
    MySqlPoolOptions::new()
        .max_connections(size)
        .min_connections(size)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .map_err(unreachable)
}

async fn store(pool: MySqlPool, table: &str) -> Result<MySqlStore, BoxError> {
    let store = MySqlStore::builder().table(table).build(pool)?;
    store.migrate().await?;
    Ok(store)
}

pub(crate) struct RawMysql {
    pool: MySqlPool,
    insert: String,
    update: String,
    select: String,
}

impl RawMysql {
    fn new(pool: MySqlPool, table: &str) -> Self {
        Self {
            pool,
            insert: format!("INSERT IGNORE INTO `{table}` (k, status) VALUES (?, 'pending')"),
            update: format!("UPDATE `{table}` SET status = 'completed', outcome = ? WHERE k = ?"),
            select: format!("SELECT outcome FROM `{table}` WHERE k = ?"),
        }
    }
}

#[async_trait]
impl RawBaseline for RawMysql {
    async fn new_key_cycle(&self, key: &str, outcome: &[u8]) -> Result<(), BoxError> {
        let inserted = sqlx::query(&self.insert)
            .bind(key.as_bytes())
            .execute(&self.pool)
            .await?;
        if inserted.rows_affected() != 1 {
            return Err("raw insert found the key taken".into());
        }
        sqlx::query(&self.update)
            .bind(outcome)
            .bind(key.as_bytes())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn replay(&self, key: &str) -> Result<Option<Vec<u8>>, BoxError> {
        let row: Option<(Option<Vec<u8>>,)> = sqlx::query_as(&self.select)
            .bind(key.as_bytes())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.and_then(|(o,)| o))
    }
}

struct ProxyCounter(CountingProxy);

#[async_trait]
impl RoundTripCounter for ProxyCounter {
    async fn count(&self) -> Result<u64, BoxError> {
        // sqlx pings a connection as the pool takes it back (in the background, off the
        // caller's path): let it land so it is not mixed into the next count.
        tokio::time::sleep(Duration::from_millis(30)).await;
        Ok(self.0.snapshot().round_trips())
    }

    async fn detail(&self) -> Result<Vec<(String, u64)>, BoxError> {
        let c = self.0.snapshot();
        Ok(vec![
            (
                "statements prepared (COM_STMT_PREPARE)".into(),
                c.get("stmt_prepare"),
            ),
            ("pool liveness pings (COM_PING)".into(), c.get("ping")),
        ])
    }
}

/// The measured backend (pool of `max_clients` connections) and a counted twin (one
/// connection through the proxy), both on the same fresh tables.
async fn backend(max_clients: usize) -> Result<(Backend, Tables), BoxError> {
    let tables = Tables::create().await?;
    let options = MySqlConnectOptions::from_str(&url())?;
    let size = u32::try_from(max_clients.max(1)).unwrap_or(u32::MAX);
    let direct = pool(options.clone(), size).await?;
    let measured = store(direct.clone(), &tables.records).await?;

    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = CountingProxy::start(upstream).await?;
    let proxied = options
        .host("127.0.0.1")
        .port(proxy.port())
        .ssl_mode(MySqlSslMode::Disabled);
    let counted_pool = pool(proxied, 1).await?;
    let counted = store(counted_pool.clone(), &tables.records).await?;
    Ok((
        Backend {
            name: "mysql",
            store: Arc::new(measured),
            raw: Arc::new(RawMysql::new(direct, &tables.raw)),
            round_trips: Some(Counted {
                store: Arc::new(counted),
                raw: Arc::new(RawMysql::new(counted_pool, &tables.raw)),
                counter: Arc::new(ProxyCounter(proxy)),
                method: "command packets counted by a loopback proxy (every command but \
                         COM_STMT_CLOSE and COM_QUIT waits for an answer: one round trip)",
                floor: None,
            }),
            limit: None,
        },
        tables,
    ))
}

/// MySQL/MariaDB in the bench (no scaling table yet).
pub(crate) const KIND: Kind = Kind {
    name: "mysql",
    make: |max_clients| {
        Box::pin(async move {
            let (b, tables) = backend(max_clients).await?;
            Ok(vec![(b, Box::new(tables) as Box<dyn std::any::Any>)])
        })
    },
    scaling: None,
};

/// Redo-log writes and data fsyncs (`Innodb_log_writes`, `Innodb_data_fsyncs`, server-wide)
/// caused by `n` operations of each kind on one connection: does a replay cost a durable
/// write?
pub(crate) async fn log_syncs(n: usize, targets: &mut crate::Targets) -> Result<(), BoxError> {
    let tables = Tables::create().await?;
    let options = MySqlConnectOptions::from_str(&url())?;
    let one = pool(options.clone(), 1).await?;
    let store = store(one.clone(), &tables.records).await?;
    let raw = RawMysql::new(one, &tables.raw);
    let mut admin = options.connect().await.map_err(unreachable)?;
    let scope = crate::harness::scope();
    let ids: Vec<_> = (0..n)
        .map(|i| idempotency_core::RecordId::new(crate::harness::key("syncs", 0, i), scope.clone()))
        .collect();

    async fn counters(admin: &mut sqlx::MySqlConnection) -> Result<(i64, i64), BoxError> {
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SHOW GLOBAL STATUS WHERE Variable_name IN ('Innodb_log_writes', 'Innodb_data_fsyncs')",
        )
        .fetch_all(&mut *admin)
        .await?;
        let get = |name: &str| -> Result<i64, BoxError> {
            Ok(rows
                .iter()
                .find(|(k, _)| k == name)
                .ok_or_else(|| format!("no {name} in SHOW GLOBAL STATUS"))?
                .1
                .parse()?)
        };
        Ok((get("Innodb_log_writes")?, get("Innodb_data_fsyncs")?))
    }

    let mut rows = Vec::new();
    let c0 = counters(&mut admin).await?;
    for id in &ids {
        crate::harness::store_cycle(&store, id.clone()).await?;
    }
    let c1 = counters(&mut admin).await?;
    rows.push((
        "new-key cycles (claim + complete)",
        c1.0 - c0.0,
        c1.1 - c0.1,
    ));
    for id in &ids {
        crate::harness::store_replay(&store, id.clone()).await?;
    }
    let c2 = counters(&mut admin).await?;
    rows.push((
        "replays (claim of a completed key)",
        c2.0 - c1.0,
        c2.1 - c1.1,
    ));
    for (i, _) in ids.iter().enumerate() {
        raw.new_key_cycle(&format!("syncs-{i}"), crate::harness::OUTCOME.as_bytes())
            .await?;
    }
    let c3 = counters(&mut admin).await?;
    rows.push(("raw INSERT IGNORE + UPDATE", c3.0 - c2.0, c3.1 - c2.1));
    for (i, _) in ids.iter().enumerate() {
        raw.replay(&format!("syncs-{i}")).await?;
    }
    let c4 = counters(&mut admin).await?;
    rows.push((
        "raw SELECT (other sessions' writes: the noise floor)",
        c4.0 - c3.0,
        c4.1 - c3.1,
    ));
    println!(
        "\nredo-log writes and fsyncs (Innodb_log_writes, Innodb_data_fsyncs, whole server, so \
         other sessions add to them), {n} operations each on one connection:\n"
    );
    println!("| operations | log writes | fsyncs | fsyncs per operation |");
    println!("|---|---|---|---|");
    for (what, writes, syncs) in &rows {
        println!(
            "| {what} | {writes} | {syncs} | {:.3} |",
            *syncs as f64 / n as f64
        );
    }
    let replay = rows[1].2 as f64 / n as f64;
    targets.check(
        "mysql: a replay costs no fsync",
        format!(
            "{replay:.3} fsyncs per replay (new-key cycle: {:.3}; noise floor: {:.3})",
            rows[0].2 as f64 / n as f64,
            rows[3].2 as f64 / n as f64
        ),
        replay < 0.1,
    );
    drop(tables);
    Ok(())
}
