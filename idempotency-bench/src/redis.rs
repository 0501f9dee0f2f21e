//! The Redis backend and its raw baseline on the same multiplexed connection: `SET NX PX` then
//! `SET`, and `GET` for replay. Keys carry a prefix of their own, deleted at the end.
//!
//! Round trips come from `INFO commandstats` deltas on a Redis server the harness starts for
//! counting alone (on a free loopback port, no persistence), so other clients of the shared
//! server cannot add to them.

use crate::harness::Kind;
use crate::harness::{
    Backend, Cleanup, Counted, Floors, RawBaseline, RoundTripCounter, ScriptFloor,
};
use async_trait::async_trait;
use idempotency_core::store::BoxError;
use idempotency_core::RecordId;
use idempotency_redis::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use idempotency_redis::redis::{self, AsyncCommands};
use idempotency_redis::RedisStore;
use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

/// The server: `IDEMPOTENCY_BENCH_REDIS_URL`, or the local default.
pub(crate) fn url() -> String {
    std::env::var("IDEMPOTENCY_BENCH_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Commands the store's Lua scripts run inside `EVALSHA`: `INFO commandstats` counts them too,
/// but they are not round trips. The raw baseline sends some of the same commands (`GET`,
/// `SET`) itself, so it is counted on a server of its own.
const SCRIPT_INTERNAL: &[&str] = &["get", "set", "setrange", "time", "type"];

/// A connection manager with the settings `RedisStore::connect` uses.
async fn manager(url: &str) -> Result<ConnectionManager, BoxError> {
    let client = redis::Client::open(url)?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Duration::from_secs(5))
        .set_response_timeout(Duration::from_secs(5))
        .set_factor(2)
        .set_max_delay(500)
        .set_number_of_retries(2);
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| {
            format!(
                "cannot reach Redis at {url} ({e}). Start it with `bash .ci/services`, or \
                 point IDEMPOTENCY_BENCH_REDIS_URL at a server you can write to."
            )
            .into()
        })
}

pub(crate) struct RawRedis {
    conn: ConnectionManager,
    prefix: String,
}

#[async_trait]
impl RawBaseline for RawRedis {
    async fn new_key_cycle(&self, key: &str, outcome: &[u8]) -> Result<(), BoxError> {
        let key = format!("{}{key}", self.prefix);
        let mut c = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg("pending")
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .query_async(&mut c)
            .await?;
        if set.is_none() {
            return Err("raw SET NX found the key taken".into());
        }
        let () = redis::cmd("SET")
            .arg(&key)
            .arg(outcome)
            .arg("PX")
            .arg(3_600_000)
            .query_async(&mut c)
            .await?;
        Ok(())
    }

    async fn replay(&self, key: &str) -> Result<Option<Vec<u8>>, BoxError> {
        let mut c = self.conn.clone();
        Ok(c.get(format!("{}{key}", self.prefix)).await?)
    }
}

/// Deletes every key under `prefix` (SCAN + UNLINK).
async fn delete_prefix(url: String, prefix: String) -> Result<(), BoxError> {
    let client = redis::Client::open(url)?;
    let mut c = client.get_multiplexed_async_connection().await?;
    let pattern = format!("{prefix}*");
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut c)
            .await?;
        if !keys.is_empty() {
            let _: i64 = redis::cmd("UNLINK").arg(&keys).query_async(&mut c).await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// A redis-server on a free loopback port in a temporary directory, stopped when dropped.
struct PrivateServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl PrivateServer {
    async fn start() -> Result<Self, BoxError> {
        let dir = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!("cannot start redis-server ({e}); install it with `bash .ci/services`")
            })?;
        let server = Self {
            child,
            port,
            _dir: dir,
        };
        for _ in 0..100 {
            if let Ok(client) = redis::Client::open(server.url()) {
                if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                    let pong: Result<String, _> = redis::cmd("PING").query_async(&mut c).await;
                    if pong.is_ok() {
                        return Ok(server);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err("the private redis-server did not answer within 5 s".into())
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One command's counters from `INFO commandstats`.
#[derive(Clone, Copy, Default)]
struct CommandCount {
    calls: u64,
    usec: u64,
}

/// Reads `INFO commandstats` of a private server, minus the `INFO` that reading is.
async fn command_stats(
    conn: &ConnectionManager,
) -> Result<BTreeMap<String, CommandCount>, BoxError> {
    let mut c = conn.clone();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await?;
    let mut out = BTreeMap::new();
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, fields)) = rest.split_once(':') else {
            continue;
        };
        let field = |key: &str| {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix(key))
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or_else(|| format!("unreadable commandstats line {line:?}"))
        };
        out.insert(
            name.to_owned(),
            CommandCount {
                calls: field("calls=")?,
                usec: field("usec=")?,
            },
        );
    }
    // The server counts an INFO once it has answered it: the ones before this one are in
    // `info`, this one is not. Every INFO comes from this counter.
    out.remove("info");
    Ok(out)
}

/// Round trips on two private servers: the store's (commands inside scripts excluded) and the
/// raw baseline's (every command counted).
struct CommandStats {
    store: ConnectionManager,
    raw: ConnectionManager,
    _servers: [PrivateServer; 2],
}

#[async_trait]
impl RoundTripCounter for CommandStats {
    async fn count(&self) -> Result<u64, BoxError> {
        let store = command_stats(&self.store).await?;
        let raw = command_stats(&self.raw).await?;
        Ok(store
            .iter()
            .filter(|(name, _)| !SCRIPT_INTERNAL.contains(&name.as_str()))
            .chain(raw.iter())
            .map(|(_, n)| n.calls)
            .sum())
    }

    async fn detail(&self) -> Result<Vec<(String, u64)>, BoxError> {
        let store = command_stats(&self.store).await?;
        let mut out: Vec<(String, u64)> = store
            .iter()
            .map(|(name, n)| {
                let label = if SCRIPT_INTERNAL.contains(&name.as_str()) {
                    format!("{name} (inside scripts)")
                } else {
                    name.clone()
                };
                (label, n.calls)
            })
            .collect();
        // Server time of the scripts, in µs: per call, it is the phase's delta divided by
        // the calls' delta.
        for (name, n) in &store {
            if name == "evalsha" {
                out.push(("evalsha server µs".to_owned(), n.usec));
            }
        }
        for (name, n) in command_stats(&self.raw).await? {
            out.push((format!("raw {name}"), n.calls));
        }
        Ok(out)
    }
}

/// The floor scripts: what any correct replay (read) and any correct claim or completion
/// (write) must do, and no more: read the server clock, read the record, and for a write store
/// a record with its physical expiry.
const READ_FLOOR: &str = "local t = redis.call('TIME') return redis.call('GET', KEYS[1])";
const WRITE_FLOOR: &str = "local t = redis.call('TIME') local v = redis.call('GET', KEYS[1]) \
                           redis.call('SET', KEYS[1], ARGV[1], 'PXAT', ARGV[2]) return 1";

/// The floor scripts on the counted server, called serially like the store's scripts there.
struct RedisFloor {
    store: RedisStore,
    conn: ConnectionManager,
}

impl RedisFloor {
    /// Sends `n` calls that `call(i)` builds, `concurrency` at a time, and returns the server
    /// µs of each, from the slow log.
    async fn per_call(
        &self,
        n: usize,
        concurrency: usize,
        call: impl Fn(usize) -> redis::Cmd,
    ) -> Result<Vec<u64>, BoxError> {
        use futures::{StreamExt, TryStreamExt};
        self.record().await?;
        futures::stream::iter(0..n)
            .map(|i| {
                let (cmd, mut c) = (call(i), self.conn.clone());
                async move { cmd.query_async::<redis::Value>(&mut c).await }
            })
            .buffer_unordered(concurrency)
            .try_collect::<Vec<_>>()
            .await?;
        let durations = self.recorded().await?;
        if durations.len() != n {
            let got = durations.len();
            return Err(format!("expected {n} script calls in the slow log, found {got}").into());
        }
        Ok(durations)
    }
}

/// The slow log holds this many entries while recording: more than any phase sends.
const SLOWLOG_ENTRIES: u32 = 100_000;

#[async_trait]
impl ScriptFloor for RedisFloor {
    async fn record(&self) -> Result<(), BoxError> {
        let mut c = self.conn.clone();
        redis::pipe()
            .cmd("CONFIG")
            .arg("SET")
            .arg("slowlog-max-len")
            .arg(SLOWLOG_ENTRIES)
            .ignore()
            .cmd("CONFIG")
            .arg("SET")
            .arg("slowlog-log-slower-than")
            .arg(0)
            .ignore()
            .cmd("SLOWLOG")
            .arg("RESET")
            .ignore()
            .query_async::<()>(&mut c)
            .await?;
        Ok(())
    }

    async fn recorded(&self) -> Result<Vec<u64>, BoxError> {
        let mut c = self.conn.clone();
        let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(-1)
            .query_async(&mut c)
            .await?;
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("slowlog-log-slower-than")
            .arg(-1)
            .query_async(&mut c)
            .await?;
        // Each entry: id, time, duration in µs, the command and its arguments, client, name.
        let mut out = Vec::new();
        for entry in entries {
            let redis::Value::Array(fields) = entry else {
                return Err(format!("unreadable slow log entry {entry:?}").into());
            };
            let (Some(redis::Value::Int(us)), Some(redis::Value::Array(args))) =
                (fields.get(2), fields.get(3))
            else {
                return Err(format!("unreadable slow log entry {fields:?}").into());
            };
            let command = match args.first() {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).to_uppercase(),
                _ => String::new(),
            };
            if ["EVALSHA", "EVAL", "FCALL"].contains(&command.as_str()) {
                out.push(u64::try_from(*us)?);
            }
        }
        Ok(out)
    }

    async fn measure(
        &self,
        n: usize,
        concurrency: usize,
        sample: &RecordId,
    ) -> Result<Floors, BoxError> {
        let mut c = self.conn.clone();
        let record: Vec<u8> = c.get(self.store.record_key(sample)).await?;
        let keys: Vec<String> = (0..n)
            .map(|i| format!("{}floor:{i}", self.store.prefix()))
            .collect();
        let pxat = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
            + 3_600_000;
        let (read_sha, write_sha): (String, String) = (
            redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(READ_FLOOR)
                .query_async(&mut c)
                .await?,
            redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(WRITE_FLOOR)
                .query_async(&mut c)
                .await?,
        );
        let library = format!(
            "#!lua name=idk_bench_floor\n\
             redis.register_function('idk_floor_read', function(KEYS, ARGV) {READ_FLOOR} end)\n\
             redis.register_function('idk_floor_write', function(KEYS, ARGV) {WRITE_FLOOR} end)"
        );
        let _: String = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&library)
            .query_async(&mut c)
            .await?;
        let call = |command: &str, script: &str, i: usize, write: bool| {
            let mut cmd = redis::cmd(command);
            cmd.arg(script).arg(1).arg(&keys[i]);
            if write {
                cmd.arg(&record).arg(pxat.to_string());
            }
            cmd
        };
        // The first pass creates the keys, so the measured writes read a record of the size.
        let c = concurrency;
        self.per_call(n, c, |i| call("EVALSHA", &write_sha, i, true))
            .await?;
        let write = self
            .per_call(n, c, |i| call("EVALSHA", &write_sha, i, true))
            .await?;
        let read = self
            .per_call(n, c, |i| call("EVALSHA", &read_sha, i, false))
            .await?;
        let fwrite = self
            .per_call(n, c, |i| call("FCALL", "idk_floor_write", i, true))
            .await?;
        let fread = self
            .per_call(n, c, |i| call("FCALL", "idk_floor_read", i, false))
            .await?;
        let mut c = self.conn.clone();
        let _: i64 = redis::cmd("UNLINK").arg(&keys).query_async(&mut c).await?;
        Ok(Floors {
            record_len: record.len(),
            read,
            write,
            other: vec![
                (
                    "read floor through FCALL (Redis Functions)".to_owned(),
                    fread,
                ),
                (
                    "write floor through FCALL (Redis Functions)".to_owned(),
                    fwrite,
                ),
            ],
        })
    }
}

/// The measured backend on the shared server and a counted twin on a private one.
pub(crate) async fn backend() -> Result<(Backend, Cleanup), BoxError> {
    let url = url();
    let prefix = format!("idem-bench-{}:", uuid::Uuid::new_v4().simple());
    let conn = manager(&url).await?;
    let store = RedisStore::builder()
        .prefix(prefix.clone())
        .build(conn.clone())?;
    let raw = RawRedis {
        conn,
        prefix: format!("{prefix}raw:"),
    };
    let cleanup = {
        let (url, prefix) = (url.clone(), prefix.clone());
        Cleanup::new(move || delete_prefix(url, prefix))
    };

    let (store_server, raw_server) = (PrivateServer::start().await?, PrivateServer::start().await?);
    let counted_conn = manager(&store_server.url()).await?;
    let counted_store = RedisStore::builder()
        .prefix(prefix.clone())
        .build(counted_conn.clone())?;
    let raw_conn = manager(&raw_server.url()).await?;
    let counted_raw = RawRedis {
        conn: raw_conn.clone(),
        prefix: format!("{prefix}raw:"),
    };
    Ok((
        Backend {
            name: "redis",
            store: Arc::new(store),
            raw: Arc::new(raw),
            round_trips: Some(Counted {
                store: Arc::new(counted_store.clone()),
                raw: Arc::new(counted_raw),
                floor: Some(Arc::new(RedisFloor {
                    store: counted_store.clone(),
                    conn: counted_conn.clone(),
                })),
                counter: Arc::new(CommandStats {
                    store: counted_conn,
                    raw: raw_conn,
                    _servers: [store_server, raw_server],
                }),
                method: "INFO commandstats deltas on two redis-servers of the harness's own, \
                         one for the store and one for the raw baseline (the INFO calls and \
                         the commands scripts run inside EVALSHA excluded)",
            }),
            limit: None,
        },
        cleanup,
    ))
}

/// Redis in the bench (no scaling table).
pub(crate) const KIND: Kind = Kind {
    name: "redis",
    make: |_| {
        Box::pin(async {
            let (b, cleanup) = backend().await?;
            Ok(vec![(b, Box::new(cleanup) as Box<dyn std::any::Any>)])
        })
    },
    scaling: None,
};
