//! The builder: key prefix, retention of expired records, and the connection the store runs on.

use crate::error::{config_error, connect_error};
use crate::keys;
use crate::sentinel::SentinelConnection;
use crate::store::{Connection, RedisStore, ReplicaWait, Scripts};
use idempotency_core::store::duration_millis;
use idempotency_core::Error;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::IntoConnectionInfo;
use std::sync::Arc;
use std::time::Duration;

/// The key prefix used unless [`RedisStoreBuilder::prefix`] sets another.
pub const DEFAULT_PREFIX: &str = "idempotency:";

/// How long an expired record is kept before Redis evicts it, unless
/// [`RedisStoreBuilder::expired_retention`] sets another.
pub const DEFAULT_EXPIRED_RETENTION: Duration = Duration::from_secs(3600);

/// The connect timeout of the connections [`RedisStore::connect`],
/// [`RedisStore::connect_cluster`] and [`RedisStoreBuilder::connect_sentinel`] open.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a call waits for the server's answer on the connections the builder opens,
/// unless [`RedisStoreBuilder::response_timeout`] sets another. A call that times out after
/// being sent is reported as [`Error::OutcomeUnknown`].
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Configures a [`RedisStore`] (key prefix, retention of expired records), then connects it or
/// builds it on a connection you made.
#[derive(Clone, Debug)]
pub struct RedisStoreBuilder {
    pub(crate) prefix: String,
    pub(crate) expired_retention: Duration,
    pub(crate) wait: Option<ReplicaWait>,
    pub(crate) response_timeout: Duration,
}

impl RedisStoreBuilder {
    /// The prefix of every record key (default [`DEFAULT_PREFIX`]), checked when the store is
    /// built: a prefix that holds a brace (it would move the cluster hash tag), a control
    /// character, or is longer than [`MAX_PREFIX_LEN`](crate::MAX_PREFIX_LEN) bytes is an [`Error::Config`].
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

    /// How long a call waits for the server's answer (default [`DEFAULT_RESPONSE_TIMEOUT`]),
    /// on the connections [`connect`](Self::connect), [`connect_cluster`](Self::connect_cluster)
    /// and [`connect_sentinel`](Self::connect_sentinel) open; a connection you configured
    /// yourself ([`build`](Self::build)) keeps its own.
    ///
    /// A call that gets no answer in time ends: a read with a retryable error, a write
    /// (a claim included) with [`Error::OutcomeUnknown`], since the server may have applied
    /// it. The engine then holds the key rather than run the work again. Without a timeout a
    /// network partition would hold every call, and the work behind it, until TCP gave up
    /// (minutes). Shorter than 1 ms is an [`Error::Config`] when the store is built.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Waits, after every write, until `replicas` replicas have acknowledged it, for at most
    /// `timeout` (off by default). Redis replicates asynchronously: without this, a write
    /// the primary acknowledged can be lost when a replica that had not received it is
    /// promoted (a completed outcome lost, so a retry runs the work again; or a claim lost,
    /// so a concurrent retry claims the key again on the new primary).
    ///
    /// Each write script is followed by `WAIT replicas timeout` in the same round trip. When
    /// fewer replicas acknowledge in time, the write is not trusted: a claim that took the key
    /// is a retryable [`Error::Backend`] (its Pending record holds the key until its lease
    /// passes), a completion or a failure is [`Error::OutcomeUnknown`] (the engine retries it
    /// and reads it back, and holds the key if it stays unknown), an extension or a reclaim a
    /// retryable error. Reads are acknowledged too, so a claim that found the key taken, or a
    /// `get`, is answered only once the replicas have what it saw, and is a retryable error
    /// otherwise. Without this, another instance could replay a completion that only the
    /// old primary had, and after the failover the work would run again. A fenced
    /// compare-and-swap answers as usual (it wrote nothing and stops the caller).
    ///
    /// From Redis 7.2 (and on Valkey) `WAIT` covers only the writes of the connection that
    /// sends it, so a call that only read would be acknowledged at once. Every call therefore
    /// writes a marker of its own after its script, in the same round trip, and `WAIT`
    /// acknowledges that: an empty string at `<record key>!ack`, in the record's slot, that
    /// expires after 10 s (it is never read; `SCAN MATCH <prefix>*` lists it beside the
    /// records, and the store's credentials must be allowed to `SET` it). Replicas apply
    /// writes in order, so one that has the marker has everything the call saw, whatever the
    /// server's version. Tested on Redis 7.0 (standalone, Sentinel and Cluster).
    ///
    /// `WAIT` makes a lost write unlikely, not impossible: it says the write reached the
    /// replicas' memory, not their disks, and a failover may still promote a replica that
    /// was not among those that acknowledged. Ask for as many replicas as a failover could
    /// choose from. `WAIT` also blocks the connection it is sent on, so every call on the
    /// store's connection waits behind a write whose replicas are slow, up to `timeout`.
    ///
    /// Standalone servers, Sentinel-managed primaries and Redis Cluster: on a cluster the
    /// `WAIT` goes to the primary of the record's slot with its script, and `replicas` counts
    /// that shard's replicas (give every shard at least that many). `replicas` must be at
    /// least 1 and `timeout` between 1 ms and the connection's response timeout, or building
    /// the store is an [`Error::Config`].
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = Some(ReplicaWait { replicas, timeout });
        self
    }

    /// Connects to a standalone server (or a primary) through a [`ConnectionManager`]: one
    /// multiplexed connection that reconnects on its own, with a 5 s connect timeout, the
    /// [response timeout](Self::response_timeout) and up to three quick reconnect attempts per call.
    ///
    /// `url` is a Redis URL such as `redis://127.0.0.1:6379/0` or
    /// `redis://user:password@host:6379`.
    pub async fn connect(self, url: impl IntoConnectionInfo) -> Result<RedisStore, Error> {
        self.validate()?;
        let client = redis::Client::open(url).map_err(config_error)?;
        // Reconnect attempts back off from about 0.5 s; after three failed attempts the
        // call fails and the next call starts over, so a call never waits more than a few
        // seconds for a server that is down. (The driver's default backoff grows to a minute.)
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(CONNECT_TIMEOUT)
            .set_response_timeout(self.response_timeout)
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
        self.validate()?;
        // A few quick retries cover redirects during resharding and a failover's
        // TRYAGAIN/CLUSTERDOWN; the driver's default (16 retries from 1.3 s) would hold a
        // call for minutes.
        let client = ClusterClient::builder(nodes)
            .connection_timeout(CONNECT_TIMEOUT)
            .response_timeout(self.response_timeout)
            .retries(4)
            .min_retry_wait(50)
            .max_retry_wait(1000)
            .build()
            .map_err(config_error)?;
        let connection = client.get_async_connection().await.map_err(connect_error)?;
        self.build_cluster(connection)
    }

    /// Connects to the primary that Redis Sentinel names `primary_name`, given one or more
    /// Sentinels: the store asks them for the primary, checks that it is one (`ROLE`), and
    /// after a failover finds the new primary the same way. A call that finds the primary
    /// gone (its connection failed, or the server answers `READONLY` because it came back
    /// as a replica) makes the next call ask the Sentinels again, and go on asking while they
    /// elect a new primary: calls made during a failover wait for it, up to the 5 s connect
    /// timeout, then fail with a retryable error (nothing was sent).
    /// Calls that were in flight when the primary died end as usual for a lost connection
    /// (a write's outcome is unknown).
    ///
    /// Replication is asynchronous: a write the old primary acknowledged can be lost in a
    /// failover. [`RedisStoreBuilder::wait_for_replicas`] says what it takes to keep it.
    ///
    /// `sentinels` are Sentinel URLs such as `redis://127.0.0.1:26379`. For a primary that
    /// needs a password, TLS or a database other than 0, build the
    /// [`SentinelClient`] yourself and use [`RedisStoreBuilder::connect_sentinel_client`].
    pub async fn connect_sentinel<T: IntoConnectionInfo>(
        self,
        sentinels: impl IntoIterator<Item = T>,
        primary_name: &str,
    ) -> Result<RedisStore, Error> {
        let client = SentinelClient::build(
            sentinels.into_iter().collect(),
            primary_name.to_owned(),
            None,
            SentinelServerType::Master,
        )
        .map_err(config_error)?;
        self.connect_sentinel_client(client).await
    }

    /// As [`RedisStoreBuilder::connect_sentinel`], with a [`SentinelClient`] you built (its
    /// node settings carry the primary's password, TLS and database). It must ask for the
    /// primary ([`SentinelServerType::Master`]); the store writes.
    pub async fn connect_sentinel_client(
        self,
        client: SentinelClient,
    ) -> Result<RedisStore, Error> {
        self.validate()?;
        let connection =
            SentinelConnection::connect(client, CONNECT_TIMEOUT, self.response_timeout)
                .await
                .map_err(connect_error)?;
        self.with_connection(Connection::Sentinel(Arc::new(connection)))
    }

    /// A store on a connection manager you configured yourself (TLS, auth, timeouts).
    pub fn build(self, manager: ConnectionManager) -> Result<RedisStore, Error> {
        self.with_connection(Connection::Standalone(Box::new(manager)))
    }

    /// A store on a cluster connection you configured yourself.
    pub fn build_cluster(self, connection: ClusterConnection) -> Result<RedisStore, Error> {
        self.with_connection(Connection::Cluster(connection))
    }

    fn validate(&self) -> Result<(), Error> {
        keys::validate_prefix(&self.prefix)?;
        if self.response_timeout < Duration::from_millis(1) {
            return Err(Error::Config(format!(
                "response_timeout must be at least 1 ms, not {:?}",
                self.response_timeout
            )));
        }
        Ok(())
    }

    fn with_connection(self, connection: Connection) -> Result<RedisStore, Error> {
        self.validate()?;
        if let Some(wait) = self.wait {
            if wait.replicas == 0 {
                return Err(Error::Config(
                    "wait_for_replicas needs at least one replica".into(),
                ));
            }
            if wait.timeout < Duration::from_millis(1) || wait.timeout >= self.response_timeout {
                return Err(Error::Config(format!(
                    "wait_for_replicas: the timeout must be between 1 ms and the {:?} \
                     response timeout, not {:?}",
                    self.response_timeout, wait.timeout
                )));
            }
        }
        Ok(RedisStore {
            connection,
            prefix: Arc::from(self.prefix),
            retention_ms: duration_millis(self.expired_retention),
            scripts: Arc::new(Scripts::new()),
            wait: self.wait,
        })
    }
}

/// The store's constructors, beside the builder they start.
impl RedisStore {
    /// Starts configuring a store.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            prefix: DEFAULT_PREFIX.to_owned(),
            expired_retention: DEFAULT_EXPIRED_RETENTION,
            wait: None,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
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
}
