//! A connection to the primary that Redis Sentinel names, found again after a failover.
//!
//! The driver's `SentinelClient` asks the Sentinels for the primary once and connects to it;
//! it does not notice a failover. This connection keeps one multiplexed connection to the
//! current primary and drops it when a call shows that the primary is gone or no longer a
//! primary (the connection failed, or the server answered `READONLY`: a former primary that
//! came back as a replica). The next call asks the Sentinels again, so calls fail with a
//! retryable error while the Sentinels elect a new primary, then reach it.

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, Value};
use std::sync::Mutex;
use std::time::Duration;

/// The current primary's connection, and a generation number that tells one connection
/// from the next (a call that failed on an old connection must not drop a new one).
struct Current {
    generation: u64,
    connection: MultiplexedConnection,
}

pub(crate) struct SentinelConnection {
    /// Asking the Sentinels takes `&mut`; the lock also makes callers that find no
    /// connection wait for one lookup instead of each running their own.
    client: tokio::sync::Mutex<SentinelClient>,
    current: Mutex<Option<Current>>,
    config: AsyncConnectionConfig,
    /// Bounds one lookup: asking the Sentinels, checking the primary's role, connecting.
    connect_timeout: Duration,
}

impl SentinelConnection {
    /// Asks the Sentinels for the primary and connects to it.
    pub(crate) async fn connect(
        client: SentinelClient,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Result<Self, RedisError> {
        let connection = Self {
            client: tokio::sync::Mutex::new(client),
            current: Mutex::new(None),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(connect_timeout)
                .set_response_timeout(response_timeout),
            connect_timeout,
        };
        connection.get().await?;
        Ok(connection)
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        let current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        current
            .as_ref()
            .map(|c| (c.generation, c.connection.clone()))
    }

    /// The current primary's connection, looked up through the Sentinels if there is none.
    async fn get(&self) -> Result<(u64, MultiplexedConnection), RedisError> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let mut client = self.client.lock().await;
        // Another caller may have connected while this one waited for the lock.
        if let Some(current) = self.current() {
            return Ok(current);
        }
        // Nothing was sent to a primary yet: a failed lookup is reported as a refused
        // connection, which callers retry.
        let connection = match tokio::time::timeout(
            self.connect_timeout,
            client.get_async_connection_with_config(&self.config),
        )
        .await
        {
            Ok(Ok(connection)) => connection,
            Ok(Err(e)) => return Err(not_reached(&e)),
            Err(_) => return Err(not_reached(&"no answer in time")),
        };
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let generation = current.as_ref().map_or(0, |c| c.generation) + 1;
        *current = Some(Current {
            generation,
            connection: connection.clone(),
        });
        Ok((generation, connection))
    }

    /// Forgets connection `generation` after a call on it failed in a way that says the
    /// primary moved, so the next call asks the Sentinels again.
    fn forget(&self, generation: u64, e: &RedisError) {
        if !primary_may_have_moved(e) {
            return;
        }
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.as_ref().is_some_and(|c| c.generation == generation) {
            tracing::debug!(error = %e, "the Redis primary is unreachable or demoted; asking the Sentinels again");
            *current = None;
        }
    }

    /// Sends one command; an error reply from the server comes back as `Err`.
    pub(crate) async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        let (generation, mut connection) = self.get().await?;
        let result = cmd.query_async::<Value>(&mut connection).await;
        if let Err(e) = &result {
            self.forget(generation, e);
        }
        result
    }
}

/// No primary was reached through the Sentinels (none named, the one named is down or not
/// a primary yet, or no Sentinel answered): a refused connection, so nothing was sent.
fn not_reached(e: &dyn std::fmt::Display) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        format!("no Redis primary reached through the Sentinels: {e}"),
    ))
}

/// A call failed because the primary it went to is gone, unreachable, or no longer the
/// primary.
fn primary_may_have_moved(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(e.kind(), ErrorKind::ReadOnly | ErrorKind::MasterDown)
}

/// So a pipeline (a write and its `WAIT`) can be sent with the driver's typed decoding.
impl ConnectionLike for &SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let this: &SentinelConnection = self;
        Box::pin(async move { this.query(cmd).await })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let this: &SentinelConnection = self;
        Box::pin(async move {
            let (generation, mut connection) = this.get().await?;
            let result = connection.req_packed_commands(cmd, offset, count).await;
            match &result {
                Err(e) => this.forget(generation, e),
                // Error replies come back as values here; the pipeline turns them into errors.
                Ok(values) => {
                    for v in values {
                        if let Value::ServerError(e) = v {
                            this.forget(generation, &RedisError::from(e.clone()));
                        }
                    }
                }
            }
            result
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}
