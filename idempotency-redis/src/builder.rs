//! The builder: key prefix, retention of expired records, and the connection the store runs on.

use crate::error::{config_error, connect_error};
use crate::keys;
use crate::store::{Connection, RedisStore, Scripts};
use idempotency_core::{duration_millis, Error};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::IntoConnectionInfo;
use std::sync::Arc;
use std::time::Duration;

/// The key prefix used unless [`RedisStoreBuilder::prefix`] sets another.
pub const DEFAULT_PREFIX: &str = "idempotency:";

/// How long an expired record is kept before Redis evicts it, unless
/// [`RedisStoreBuilder::expired_retention`] sets another.
pub const DEFAULT_EXPIRED_RETENTION: Duration = Duration::from_secs(3600);

/// Timeouts of the connections [`RedisStore::connect`] and [`RedisStore::connect_cluster`]
/// open. A call that times out after being sent is reported as
/// [`Error::OutcomeUnknown`].
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Configures a [`RedisStore`] (key prefix, retention of expired records), then connects it or
/// builds it on a connection you made.
#[derive(Clone, Debug)]
pub struct RedisStoreBuilder {
    pub(crate) prefix: String,
    pub(crate) expired_retention: Duration,
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

/// The store's constructors, beside the builder they start.
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
}
