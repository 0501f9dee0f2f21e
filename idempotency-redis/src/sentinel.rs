//! A connection to the primary that Redis Sentinel names, found again after a failover.
//!
//! The driver's `SentinelClient` asks the Sentinels for the primary once and connects to it;
//! it does not notice a failover. This connection keeps one multiplexed connection to the
//! current primary and drops it when a call shows that the primary is gone or no longer a
//! primary (the connection failed, or the server answered `READONLY`: a former primary that
//! came back as a replica). The next call asks the Sentinels again, and goes on asking while
//! they elect a new primary (up to the connect timeout), so a call made during a failover
//! waits for the new primary instead of failing at once.

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, Value};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The current primary's connection, and a generation number that tells one connection
/// from the next (a call that failed on an old connection must not drop a new one).
struct Current {
    generation: u64,
    connection: MultiplexedConnection,
}

/// The Sentinel client and how its last search for a primary ended.
struct Lookup {
    client: SentinelClient,
    /// When the last search gave up, and why: callers that waited for that search fail
    /// with its error instead of each searching again.
    gave_up: Option<(Instant, String)>,
}

/// The first pause between two questions to the Sentinels while no primary is found; it
/// doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(25);
const MAX_PAUSE: Duration = Duration::from_millis(400);

pub(crate) struct SentinelConnection {
    /// Asking the Sentinels takes `&mut`; the lock also makes callers that find no
    /// connection wait for one search instead of each running their own.
    lookup: tokio::sync::Mutex<Lookup>,
    current: Mutex<Option<Current>>,
    config: AsyncConnectionConfig,
    /// How long one search for a primary may take: asking the Sentinels (again and again
    /// while they elect one), checking the primary's role, connecting.
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
            lookup: tokio::sync::Mutex::new(Lookup {
                client,
                gave_up: None,
            }),
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

    /// The current primary's connection. With none, the first caller searches for the
    /// primary through the Sentinels, asking again with a growing pause while they name none
    /// that answers as a primary (during a failover), for up to the connect timeout; callers
    /// that arrive meanwhile wait for its result.
    async fn get(&self) -> Result<(u64, MultiplexedConnection), RedisError> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let arrived = Instant::now();
        let mut lookup = self.lookup.lock().await;
        // Another caller may have connected, or given up, while this one waited.
        if let Some(current) = self.current() {
            return Ok(current);
        }
        if let Some((at, why)) = &lookup.gave_up {
            if *at >= arrived {
                return Err(not_reached(why));
            }
        }
        let deadline = arrived + self.connect_timeout;
        let mut pause = FIRST_PAUSE;
        // Nothing is sent to a primary until one is found: a search that gives up is
        // reported as a refused connection, which callers retry.
        let connection = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let why = match tokio::time::timeout(
                left,
                lookup.client.get_async_connection_with_config(&self.config),
            )
            .await
            {
                Ok(Ok(connection)) => break connection,
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no answer in time".to_owned(),
            };
            if Instant::now() + pause >= deadline {
                lookup.gave_up = Some((Instant::now(), why.clone()));
                return Err(not_reached(&why));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        };
        lookup.gave_up = None;
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
