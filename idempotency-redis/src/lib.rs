#![doc = include_str!("../README.md")]

mod decode;
mod keys;
mod scripts;

pub use keys::MAX_PREFIX_LEN;
/// The Redis driver this store is built on, re-exported so callers use the same version.
pub use redis;

use async_trait::async_trait;
use decode::Reply;
use idempotency_core::{
    duration_millis, Cas, Claim, ClaimRequest, Error, Failure, FencingToken, Fingerprint,
    IdempotencyStore, Reclaim, Record, RecordId,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, IntoConnectionInfo, RedisError, Value};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The key prefix used unless [`RedisStoreBuilder::prefix`] sets another.
pub const DEFAULT_PREFIX: &str = "idempotency:";

/// How long an expired record is kept before Redis evicts it, unless
/// [`RedisStoreBuilder::expired_retention`] sets another.
pub const DEFAULT_EXPIRED_RETENTION: Duration = Duration::from_secs(3600);

// Durations handed to the scripts are capped at `MAX_DURATION` (by `duration_millis`), so
// every sum the scripts compute stays an exact integer in Lua's doubles: a stored expiry (at
// most 15 digits) plus a retention, or now plus two capped durations, stays below 2^53.
const _: () = assert!(
    1_000_000_000_000_000 + 2 * (idempotency_core::MAX_DURATION.as_millis() as i64) < 1 << 53
);

/// Timeouts of the connections [`RedisStore::connect`] and [`RedisStore::connect_cluster`]
/// open. A call that times out after being sent is reported as
/// [`Error::OutcomeUnknown`].
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// The connection the store talks through: both kinds multiplex concurrent calls over shared
/// sockets and reconnect by themselves.
#[derive(Clone)]
enum Connection {
    Standalone(Box<ConnectionManager>),
    Cluster(ClusterConnection),
}

impl Connection {
    /// Sends one command; an error reply from the server comes back as `Err`.
    async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Self::Standalone(c) => cmd.query_async(&mut ConnectionManager::clone(c)).await,
            Self::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }
}

/// One Lua script: its source and SHA-1, for `EVALSHA` with an `EVAL` fallback.
struct Script {
    source: String,
    sha: String,
}

impl Script {
    fn new(source: String) -> Self {
        let sha = redis::Script::new(&source).get_hash().to_owned();
        Self { source, sha }
    }
}

struct Scripts {
    claim: Script,
    complete: Script,
    fail: Script,
    extend: Script,
    reclaim: Script,
    get: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            claim: Script::new(scripts::claim()),
            complete: Script::new(scripts::complete()),
            fail: Script::new(scripts::fail()),
            extend: Script::new(scripts::extend()),
            reclaim: Script::new(scripts::reclaim()),
            get: Script::new(scripts::get()),
        }
    }
}

/// An [`IdempotencyStore`] on Redis or Redis Cluster.
///
/// Each record is one string at `<prefix>{<scope>:<key>}` (the braces are a cluster hash tag),
/// and each operation is one Lua script over that one key, called with `EVALSHA`: one round
/// trip, atomic, and cluster-safe by construction. Leases and expiry follow the server's
/// `TIME`. Cloning is cheap and clones share the connection.
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    retention_ms: i64,
    scripts: Arc<Scripts>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let topology = match self.connection {
            Connection::Standalone(_) => "standalone",
            Connection::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore")
            .field("topology", &topology)
            .field("prefix", &self.prefix)
            .field("expired_retention_ms", &self.retention_ms)
            .finish_non_exhaustive()
    }
}

/// Configures a [`RedisStore`] (key prefix, retention of expired records), then connects it or
/// builds it on a connection you made.
#[derive(Clone, Debug)]
pub struct RedisStoreBuilder {
    prefix: String,
    expired_retention: Duration,
}

impl RedisStoreBuilder {
    /// The prefix of every record key (default [`DEFAULT_PREFIX`]), checked when the store is
    /// built: a prefix that holds a brace (it would move the cluster hash tag), a control
    /// character, or is longer than [`MAX_PREFIX_LEN`] bytes is an [`Error::Config`].
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long a record is kept after its `expires_at` before Redis evicts it (default
    /// [`DEFAULT_EXPIRED_RETENTION`]).
    ///
    /// An expired record reads as absent at once. Fencing does not depend on this retention:
    /// a fresh record's token comes from the server clock (in microseconds, and above the
    /// token of an expired record still kept), so a key whose record was evicted, or lost in
    /// a restart without AOF, never hands out a token an old holder still has. Zero evicts
    /// records as soon as they expire.
    pub fn expired_retention(mut self, retention: Duration) -> Self {
        self.expired_retention = retention;
        self
    }

    /// Connects to a standalone server (or a primary) through a [`ConnectionManager`]: one
    /// multiplexed connection that reconnects on its own, with 5 s connect and response
    /// timeouts and up to three quick reconnect attempts per call.
    ///
    /// `url` is a Redis URL such as `redis://127.0.0.1:6379/0` or
    /// `redis://user:password@host:6379`.
    pub async fn connect(self, url: impl IntoConnectionInfo) -> Result<RedisStore, Error> {
        keys::validate_prefix(&self.prefix)?;
        let client = redis::Client::open(url).map_err(config_error)?;
        // Reconnect attempts back off from about 0.5 s; after three failed attempts the
        // call fails and the next call starts over, so a call never waits more than a few
        // seconds for a server that is down. (The driver's default backoff grows to a minute.)
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(CONNECT_TIMEOUT)
            .set_response_timeout(RESPONSE_TIMEOUT)
            .set_factor(2)
            .set_max_delay(500)
            .set_number_of_retries(2);
        let manager = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(connect_error)?;
        self.build(manager)
    }

    /// Connects to a Redis Cluster through the cluster client, given one or more of its
    /// nodes; it discovers the others, follows `MOVED`/`ASK` redirects and reconnects on its
    /// own.
    pub async fn connect_cluster<T: IntoConnectionInfo>(
        self,
        nodes: impl IntoIterator<Item = T>,
    ) -> Result<RedisStore, Error> {
        keys::validate_prefix(&self.prefix)?;
        // A few quick retries cover redirects during resharding and a failover's
        // TRYAGAIN/CLUSTERDOWN; the driver's default (16 retries from 1.3 s) would hold a
        // call for minutes.
        let client = ClusterClient::builder(nodes)
            .connection_timeout(CONNECT_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .retries(4)
            .min_retry_wait(50)
            .max_retry_wait(1000)
            .build()
            .map_err(config_error)?;
        let connection = client.get_async_connection().await.map_err(connect_error)?;
        self.build_cluster(connection)
    }

    /// A store on a connection manager you configured yourself (TLS, auth, timeouts).
    pub fn build(self, manager: ConnectionManager) -> Result<RedisStore, Error> {
        self.with_connection(Connection::Standalone(Box::new(manager)))
    }

    /// A store on a cluster connection you configured yourself.
    pub fn build_cluster(self, connection: ClusterConnection) -> Result<RedisStore, Error> {
        self.with_connection(Connection::Cluster(connection))
    }

    fn with_connection(self, connection: Connection) -> Result<RedisStore, Error> {
        keys::validate_prefix(&self.prefix)?;
        Ok(RedisStore {
            connection,
            prefix: Arc::from(self.prefix),
            retention_ms: duration_millis(self.expired_retention),
            scripts: Arc::new(Scripts::new()),
        })
    }
}

impl RedisStore {
    /// Starts configuring a store.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            prefix: DEFAULT_PREFIX.to_owned(),
            expired_retention: DEFAULT_EXPIRED_RETENTION,
        }
    }

    /// Connects to a standalone server with the default settings: see
    /// [`RedisStoreBuilder::connect`].
    pub async fn connect(url: impl IntoConnectionInfo) -> Result<Self, Error> {
        Self::builder().connect(url).await
    }

    /// Connects to a Redis Cluster with the default settings: see
    /// [`RedisStoreBuilder::connect_cluster`].
    pub async fn connect_cluster<T: IntoConnectionInfo>(
        nodes: impl IntoIterator<Item = T>,
    ) -> Result<Self, Error> {
        Self::builder().connect_cluster(nodes).await
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key that holds the record of `id`: `<prefix>{<scope>:<key>}`, with scope and
    /// key percent-escaped so that neither can break the hash tag.
    pub fn record_key(&self, id: &RecordId) -> String {
        keys::record_key(&self.prefix, id)
    }

    /// Runs `script` on `id`'s key: `EVALSHA`, and on `NOSCRIPT` (after a restart, a failover
    /// or `SCRIPT FLUSH`) `EVAL` with the source, which also caches it again. `EVAL` goes to
    /// the node that owns the key, where `SCRIPT LOAD` would have to reach every primary.
    async fn eval(&self, script: &Script, id: &RecordId, args: &[&[u8]]) -> Result<Value, Error> {
        let key = self.record_key(id);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&script.sha).arg(1).arg(&key);
        for a in args {
            cmd.arg(*a);
        }
        match self.connection.query(&cmd).await {
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(&script.source).arg(1).arg(&key);
                for a in args {
                    cmd.arg(*a);
                }
                self.connection.query(&cmd).await.map_err(call_error)
            }
            other => other.map_err(call_error),
        }
    }
}

fn ms_arg(d: Duration) -> Vec<u8> {
    duration_millis(d).to_string().into_bytes()
}

fn config_error(e: RedisError) -> Error {
    Error::Config(format!("invalid Redis connection settings: {e}"))
}

fn connect_error(e: RedisError) -> Error {
    Error::backend(true, e)
}

/// Classifies a failed call. A request that may have reached the server before the
/// connection failed is [`Error::OutcomeUnknown`]: the script may have run. Errors the server
/// sent back mean the script did not run (the scripts validate before writing).
fn call_error(e: RedisError) -> Error {
    if e.is_connection_refusal() {
        return Error::backend(true, e);
    }
    match e.kind() {
        ErrorKind::IoError => Error::OutcomeUnknown {
            source: Box::new(e),
        },
        ErrorKind::BusyLoadingError
        | ErrorKind::TryAgain
        | ErrorKind::ClusterDown
        | ErrorKind::MasterDown
        | ErrorKind::ReadOnly
        | ErrorKind::Moved
        | ErrorKind::Ask
        | ErrorKind::ClusterConnectionNotFound => Error::backend(true, e),
        _ => Error::backend(false, e),
    }
}

/// Read-only calls can be repeated whatever happened, so an unknown outcome is just a
/// retryable failure.
fn read_error(e: Error) -> Error {
    match e {
        Error::OutcomeUnknown { source } => Error::Backend {
            retryable: true,
            source,
        },
        other => other,
    }
}

fn claim_reply(value: Value, id: &RecordId) -> Result<Claim, Error> {
    let reply = Reply::parse(value)?;
    match reply.tag.as_str() {
        "claimed" => Ok(Claim::Claimed {
            token: reply.token(0)?,
            lease_until: reply.millis(1, "lease deadline")?,
        }),
        "record" => Ok(Claim::Existing {
            now: reply.millis(0, "server time")?,
            record: reply.record(1, id)?,
        }),
        _ => Err(reply.unexpected_tag("claim")),
    }
}

fn reclaim_reply(value: Value) -> Result<Reclaim, Error> {
    let reply = Reply::parse(value)?;
    match reply.tag.as_str() {
        "reclaimed" => Ok(Reclaim::Reclaimed {
            token: reply.token(0)?,
            lease_until: reply.millis(1, "lease deadline")?,
        }),
        "lost" => Ok(Reclaim::Lost),
        _ => Err(reply.unexpected_tag("reclaim")),
    }
}

fn get_reply(value: Value, id: &RecordId) -> Result<Option<Record>, Error> {
    let reply = Reply::parse(value)?;
    match reply.tag.as_str() {
        "record" => reply.record(1, id).map(Some),
        "none" => Ok(None),
        _ => Err(reply.unexpected_tag("get")),
    }
}

/// The pure decoders of script replies and stored records, for the fuzz targets and the
/// bad-input tests: built only with the `fuzzing` feature. Not part of the API: they may change
/// at any time.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod __fuzz {
    use idempotency_core::{Cas, Claim, Error, Reclaim, Record, RecordId};
    use redis::Value;

    /// Decodes a stored record (the bytes at its key).
    pub fn decode_record(id: &RecordId, bytes: &[u8]) -> Result<Record, Error> {
        crate::decode::decode_record(id, bytes)
    }

    /// Encodes a record as the scripts store it.
    pub fn encode_record(record: &Record) -> Vec<u8> {
        crate::decode::encode_record(record)
    }

    /// Decodes the claim script's reply.
    pub fn claim_reply(value: Value, id: &RecordId) -> Result<Claim, Error> {
        crate::claim_reply(value, id)
    }

    /// Decodes the reclaim script's reply.
    pub fn reclaim_reply(value: Value) -> Result<Reclaim, Error> {
        crate::reclaim_reply(value)
    }

    /// Decodes the get script's reply.
    pub fn get_reply(value: Value, id: &RecordId) -> Result<Option<Record>, Error> {
        crate::get_reply(value, id)
    }

    /// Decodes the reply of the complete, fail and extend scripts.
    pub fn cas_reply(value: Value) -> Result<Cas, Error> {
        crate::cas_reply(value, "complete")
    }
}

fn cas_reply(value: Value, op: &str) -> Result<Cas, Error> {
    let reply = Reply::parse(value)?;
    match reply.tag.as_str() {
        "applied" => Ok(Cas::Applied),
        "fenced" => Ok(Cas::Fenced),
        _ => Err(reply.unexpected_tag(op)),
    }
}

#[async_trait]
impl IdempotencyStore for RedisStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let s = &self.scripts;
        let retention = self.retention_ms.to_string();
        let value = self
            .eval(
                &s.claim,
                &request.id,
                &[
                    request.fingerprint.as_bytes(),
                    &ms_arg(request.lease),
                    &ms_arg(request.ttl),
                    retention.as_bytes(),
                    if request.count_hit { b"1" } else { b"0" },
                ],
            )
            .await?;
        claim_reply(value, &request.id)
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let value = self
            .eval(
                &self.scripts.complete,
                id,
                &[
                    token.0.to_string().as_bytes(),
                    outcome,
                    &ms_arg(ttl),
                    self.retention_ms.to_string().as_bytes(),
                ],
            )
            .await?;
        cas_reply(value, "complete")
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let value = self
            .eval(
                &self.scripts.fail,
                id,
                &[
                    token.0.to_string().as_bytes(),
                    if failure.retryable { b"1" } else { b"0" },
                    failure.message.as_bytes(),
                    &ms_arg(ttl),
                    self.retention_ms.to_string().as_bytes(),
                ],
            )
            .await?;
        cas_reply(value, "fail")
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        let value = self
            .eval(
                &self.scripts.extend,
                id,
                &[
                    token.0.to_string().as_bytes(),
                    &ms_arg(lease),
                    self.retention_ms.to_string().as_bytes(),
                ],
            )
            .await?;
        cas_reply(value, "extend")
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        let value = self
            .eval(
                &self.scripts.reclaim,
                id,
                &[
                    expected.0.to_string().as_bytes(),
                    fingerprint.as_bytes(),
                    &ms_arg(lease),
                    &ms_arg(ttl),
                    self.retention_ms.to_string().as_bytes(),
                ],
            )
            .await?;
        reclaim_reply(value)
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let value = self
            .eval(&self.scripts.get, id, &[])
            .await
            .map_err(read_error)?;
        get_reply(value, id)
    }

    /// Redis evicts records by itself (each key's TTL is its `expires_at` plus the expired
    /// retention), so there is nothing to purge: always 0.
    async fn purge_expired(&self, _batch: usize) -> Result<u64, Error> {
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    #[test]
    fn errors_say_whether_the_script_may_have_run() {
        let refused = RedisError::from(io::Error::from(io::ErrorKind::ConnectionRefused));
        assert!(matches!(
            call_error(refused),
            Error::Backend {
                retryable: true,
                ..
            }
        ));
        for kind in [
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::TimedOut,
        ] {
            let e = call_error(RedisError::from(io::Error::from(kind)));
            assert!(matches!(e, Error::OutcomeUnknown { .. }), "{kind:?}: {e:?}");
            assert!(e.is_retryable());
            assert!(matches!(
                read_error(e),
                Error::Backend {
                    retryable: true,
                    ..
                }
            ));
        }
        let busy = RedisError::from((ErrorKind::TryAgain, "TRYAGAIN"));
        assert!(call_error(busy).is_retryable());
        let bug = RedisError::from((ErrorKind::ResponseError, "ERR bad"));
        assert!(matches!(
            call_error(bug),
            Error::Backend {
                retryable: false,
                ..
            }
        ));
        let crossslot = RedisError::from((ErrorKind::CrossSlot, "CROSSSLOT"));
        assert!(!call_error(crossslot).is_retryable());
    }

    #[test]
    fn durations_stay_exact_in_lua() {
        assert_eq!(
            duration_millis(Duration::MAX),
            duration_millis(idempotency_core::MAX_DURATION)
        );
        assert_eq!(duration_millis(Duration::from_micros(1)), 1);
    }
}
