//! The store: one Lua script per operation over one key, called with `EVALSHA`.

use crate::decode::{cas_reply, claim_reply, get_reply, reclaim_reply};
use crate::error::{call_error, read_error, NotAcknowledged};
use crate::sentinel::SentinelConnection;
use crate::{keys, scripts};
use async_trait::async_trait;
use idempotency_core::store::{
    duration_millis, Cas, Claim, ClaimRequest, Failure, Reclaim, Record, Settle, Settlement,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, RedisError, Value};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

// Durations handed to the scripts are capped at `MAX_DURATION` (by `duration_millis`), so
// every sum the scripts compute stays an exact integer in Lua's doubles: a stored expiry (at
// most 15 digits) plus a retention, or now plus two capped durations, stays below 2^53.
const _: () = assert!(
    1_000_000_000_000_000 + 2 * (idempotency_core::store::MAX_DURATION.as_millis() as i64)
        < 1 << 53
);

/// The connection the store talks through: every kind multiplexes concurrent calls over
/// shared sockets and reconnects by itself (through Sentinel, to whichever server is the
/// primary now).
#[derive(Clone)]
pub(crate) enum Connection {
    Standalone(Box<ConnectionManager>),
    Cluster(ClusterConnection),
    Sentinel(Arc<SentinelConnection>),
}

impl Connection {
    /// Sends one command; an error reply from the server comes back as `Err`.
    async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Self::Standalone(c) => cmd.query_async(&mut ConnectionManager::clone(c)).await,
            Self::Cluster(c) => cmd.query_async(&mut c.clone()).await,
            Self::Sentinel(c) => c.query(cmd).await,
        }
    }

    /// Sends a pipeline of one script, its acknowledgement marker and its `WAIT`
    /// ([`ReplicaWait::append`]): the script's reply and the number of replicas that
    /// acknowledged. On a cluster the pipeline goes whole to the primary of the script's slot
    /// (the cluster client routes a pipeline by its first keyed command, and follows a
    /// redirect with all of it), so `WAIT` counts that shard's replicas.
    async fn query_with_wait(&self, pipe: &redis::Pipeline) -> Result<(Value, u32), RedisError> {
        let (value, _marker, acknowledged): (Value, Value, u32) = match self {
            Self::Standalone(c) => pipe.query_async(&mut ConnectionManager::clone(c)).await,
            Self::Sentinel(c) => pipe.query_async(&mut &**c).await,
            Self::Cluster(c) => pipe.query_async(&mut c.clone()).await,
        }?;
        Ok((value, acknowledged))
    }

    /// Sends a pipeline and returns every reply, error replies included as values (one
    /// failed call does not hide the others' replies); `Err` only when the pipeline as a
    /// whole failed. On a cluster every command must be in one slot.
    async fn query_pipeline(
        &self,
        pipe: &redis::Pipeline,
        n: usize,
    ) -> Result<Vec<Value>, RedisError> {
        use redis::aio::ConnectionLike;
        match self {
            Self::Standalone(c) => {
                ConnectionManager::clone(c)
                    .req_packed_commands(pipe, 0, n)
                    .await
            }
            Self::Sentinel(c) => (&**c).req_packed_commands(pipe, 0, n).await,
            Self::Cluster(c) => c.clone().req_packed_commands(pipe, 0, n).await,
        }
    }

    pub(crate) fn topology(&self) -> &'static str {
        match self {
            Self::Standalone(_) => "standalone",
            Self::Cluster(_) => "cluster",
            Self::Sentinel(_) => "sentinel",
        }
    }
}

/// One Lua script: its source and SHA-1, for `EVALSHA` with an `EVAL` fallback.
pub(crate) struct Script {
    source: String,
    sha: String,
}

impl Script {
    fn new(source: String) -> Self {
        let sha = redis::Script::new(&source).get_hash().to_owned();
        Self { source, sha }
    }
}

/// How many replicas must acknowledge each write, and how long to wait for them
/// ([`crate::RedisStoreBuilder::wait_for_replicas`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReplicaWait {
    pub(crate) replicas: u32,
    pub(crate) timeout: Duration,
}

/// How long the acknowledgement marker of a call lives ([`ReplicaWait::append`]).
const MARKER_LIFETIME_MS: u64 = 10_000;

/// The acknowledgement marker of the record at `record_key`: `<record key>!ack`, in the
/// record's slot (the hash tag is the record's), never a record's key (those end with `}`).
pub(crate) fn marker_key(record_key: &str) -> String {
    format!("{record_key}!ack")
}

impl ReplicaWait {
    /// Appends to `pipe`, after the calls on `record_key`'s slot: a write of the call's own
    /// (the record's marker, an empty string that lives 10 s), then `WAIT`. Two commands,
    /// two replies: `OK`, then the number of replicas that acknowledged.
    ///
    /// The marker is what makes a read's acknowledgement independent of the server version.
    /// Up to Redis 7.0, `WAIT` waits for every write the server had made when the client's
    /// last command ran, a read included; from Redis 7.2 (and on Valkey) it covers only the
    /// client's own writes, so after a script that only read (a replay, a claim that found the
    /// key, a `get`) it would return at once, and a completion another instance wrote could be
    /// trusted before any replica had it. The marker is written after everything the call
    /// read, and replicas apply the stream in order, so a replica that acknowledged the
    /// marker has what the call saw, on every version.
    fn append(&self, pipe: &mut redis::Pipeline, record_key: &str) {
        pipe.cmd("SET")
            .arg(marker_key(record_key))
            .arg("")
            .arg("PX")
            .arg(MARKER_LIFETIME_MS);
        pipe.cmd("WAIT")
            .arg(self.replicas)
            .arg(duration_millis(self.timeout));
    }
}

pub(crate) struct Scripts {
    claim: Script,
    complete: Script,
    fail: Script,
    extend: Script,
    reclaim: Script,
    get: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
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
    pub(crate) connection: Connection,
    pub(crate) prefix: Arc<str>,
    pub(crate) retention_ms: i64,
    pub(crate) scripts: Arc<Scripts>,
    pub(crate) wait: Option<ReplicaWait>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("topology", &self.connection.topology())
            .field("prefix", &self.prefix)
            .field("expired_retention_ms", &self.retention_ms)
            .field(
                "wait_for_replicas",
                &self.wait.map(|w| (w.replicas, w.timeout)),
            )
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The expired retention in milliseconds, for the scripts.
    fn retention(&self) -> u64 {
        self.retention_ms.unsigned_abs()
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

impl RedisStore {
    /// Runs `script` (a write, or a read that must only be trusted once the replicas have
    /// what it saw): as [`RedisStore::eval`], followed in the same round trip by `WAIT` when
    /// the store waits for replicas. Returns the script's reply and, when the
    /// write was not acknowledged by enough replicas in time, what is missing.
    async fn eval_write(
        &self,
        operation: &'static str,
        script: &Script,
        id: &RecordId,
        args: &[&[u8]],
    ) -> Result<(Value, Option<NotAcknowledged>), Error> {
        let Some(wait) = self.wait else {
            return Ok((self.eval(script, id, args).await?, None));
        };
        let key = self.record_key(id);
        let pipe = |command: &str, body: &str| {
            let mut p = redis::pipe();
            let call = p.cmd(command).arg(body).arg(1).arg(&key);
            for a in args {
                call.arg(*a);
            }
            wait.append(&mut p, &key);
            p
        };
        let send = |p: redis::Pipeline| async move { self.connection.query_with_wait(&p).await };
        let (value, acknowledged) = match send(pipe("EVALSHA", &script.sha)).await {
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                send(pipe("EVAL", &script.source)).await
            }
            other => other,
        }
        .map_err(call_error)?;
        let missing = (acknowledged < wait.replicas).then_some(NotAcknowledged {
            operation,
            wanted: wait.replicas,
            acknowledged,
            timeout: wait.timeout,
        });
        Ok((value, missing))
    }
}

/// One script call of a batch: the script, the record, its arguments.
type Call<'a> = (&'a Script, &'a RecordId, Vec<Vec<u8>>);

/// A call's reply or error, with what the replicas missed of its pipeline.
type CallReply = (Result<Value, Error>, Option<NotAcknowledged>);

impl RedisStore {
    /// Runs each call in one pipeline per cluster slot (one pipeline in all on a single
    /// server), sent concurrently, each followed by `WAIT` when the store waits for replicas:
    /// calls on one key keep their order. Each call's reply, or its error, in order, with what
    /// the replicas missed of its pipeline.
    async fn eval_many(&self, operation: &'static str, calls: &[Call<'_>]) -> Vec<CallReply> {
        let keys: Vec<String> = calls.iter().map(|(_, id, _)| self.record_key(id)).collect();
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let slot = match self.connection {
                Connection::Cluster(_) => redis::cluster_routing::get_slot(key.as_bytes()),
                _ => 0,
            };
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, members)) => members.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        let sent = futures_util::future::join_all(
            groups
                .iter()
                .map(|(_, members)| self.eval_pipeline(operation, calls, &keys, members)),
        )
        .await;
        let mut out: Vec<Option<CallReply>> = (0..calls.len()).map(|_| None).collect();
        for ((_, members), replies) in groups.iter().zip(sent) {
            for (&i, reply) in members.iter().zip(replies) {
                out[i] = Some(reply);
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| (Err(Error::backend(false, "no reply")), None)))
            .collect()
    }

    /// One pipeline of the calls at `members` (all in one slot): their replies, in order.
    async fn eval_pipeline(
        &self,
        operation: &'static str,
        calls: &[Call<'_>],
        keys: &[String],
        members: &[usize],
    ) -> Vec<CallReply> {
        // The first call of each script in the pipeline is an `EVAL` (which caches the
        // script on this node if it was not), the others `EVALSHA`: the pipeline runs in
        // order on one node, so none of them can be refused with `NOSCRIPT`, and no call is
        // ever sent twice.
        let mut pipe = redis::pipe();
        let mut loaded: Vec<&str> = Vec::new();
        for &i in members {
            let (script, _, args) = &calls[i];
            let call = if loaded.contains(&script.sha.as_str()) {
                pipe.cmd("EVALSHA").arg(&script.sha)
            } else {
                loaded.push(&script.sha);
                pipe.cmd("EVAL").arg(&script.source)
            };
            call.arg(1).arg(&keys[i]);
            for a in args {
                call.arg(a.as_slice());
            }
        }
        if let (Some(wait), Some(&first)) = (self.wait, members.first()) {
            wait.append(&mut pipe, &keys[first]);
        }
        let commands = members.len() + 2 * usize::from(self.wait.is_some());
        let mut values = match self.connection.query_pipeline(&pipe, commands).await {
            Ok(values) => values,
            Err(e) => {
                return call_error(e)
                    .for_each_of(members.len())
                    .into_iter()
                    .map(|e| (Err(e), None))
                    .collect()
            }
        };
        let missing = match self.wait {
            None => None,
            Some(wait) => {
                // The last two replies are the marker's and `WAIT`'s: a marker that was not
                // written proves nothing, whatever `WAIT` counted.
                let acknowledged = match (values.pop(), values.pop()) {
                    (Some(Value::Int(n)), Some(Value::Okay)) => u32::try_from(n).unwrap_or(0),
                    _ => 0,
                };
                (acknowledged < wait.replicas).then_some(NotAcknowledged {
                    operation,
                    wanted: wait.replicas,
                    acknowledged,
                    timeout: wait.timeout,
                })
            }
        };
        let mut values = values.into_iter();
        members
            .iter()
            .map(|_| match values.next() {
                Some(Value::ServerError(e)) => (Err(call_error(RedisError::from(e))), None),
                Some(value) => (Ok(value), missing.clone()),
                None => (
                    Err(Error::backend(
                        false,
                        "the pipeline had no reply for this call",
                    )),
                    None,
                ),
            })
            .collect()
    }
}

/// What a write not acknowledged by enough replicas becomes: `unknown` for a completion or a
/// failure (the engine retries it and reads it back), else a retryable error.
fn untrusted(missing: NotAcknowledged, unknown: bool) -> Error {
    match unknown {
        true => Error::OutcomeUnknown {
            source: Box::new(missing),
        },
        false => Error::backend(true, missing),
    }
}

/// A script's packed argument: `head` (a fingerprint, or nothing), then each number as a
/// big-endian unsigned 64-bit integer, then `tail` (a flag byte, or nothing). One argument
/// instead of one per number: Redis builds a Lua string per argument on every call.
fn packed(head: &[u8], numbers: &[u64], tail: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(head.len() + 8 * numbers.len() + tail.len());
    out.extend_from_slice(head);
    for n in numbers {
        out.extend_from_slice(&n.to_be_bytes());
    }
    out.extend_from_slice(tail);
    out
}

/// A duration in whole milliseconds, capped (see `duration_millis`).
fn ms(d: Duration) -> u64 {
    duration_millis(d).unsigned_abs()
}

#[async_trait]
impl IdempotencyStore for RedisStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let args = packed(
            request.fingerprint.as_bytes(),
            &[ms(request.lease), ms(request.ttl), self.retention()],
            &[u8::from(request.count_hit)],
        );
        let (value, missing) = self
            .eval_write("claim", &self.scripts.claim, &request.id, &[&args])
            .await?;
        // A claim that took the key, and also one that found it: `WAIT` after a read waits
        // for every write the server had made when the read ran, so a short count says what
        // was read may be lost in a failover (a completion another instance wrote, say). It
        // must not be answered from.
        match missing {
            Some(missing) => Err(untrusted(missing, false)),
            None => claim_reply(value, &request.id),
        }
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let (value, missing) = self
            .eval_write(
                "complete",
                &self.scripts.complete,
                id,
                &[
                    &packed(&[], &[token.0, ms(ttl), self.retention()], &[]),
                    outcome,
                ],
            )
            .await?;
        match (cas_reply(value, "complete")?, missing) {
            (Cas::Applied, Some(missing)) => Err(untrusted(missing, true)),
            (cas, _) => Ok(cas),
        }
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let (value, missing) = self
            .eval_write(
                "fail",
                &self.scripts.fail,
                id,
                &[
                    &packed(
                        &[],
                        &[token.0, ms(ttl), self.retention()],
                        &[u8::from(failure.retryable)],
                    ),
                    failure.message.as_bytes(),
                ],
            )
            .await?;
        match (cas_reply(value, "fail")?, missing) {
            (Cas::Applied, Some(missing)) => Err(untrusted(missing, true)),
            (cas, _) => Ok(cas),
        }
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        let (value, missing) = self
            .eval_write(
                "extend",
                &self.scripts.extend,
                id,
                &[&packed(&[], &[token.0, ms(lease), self.retention()], &[])],
            )
            .await?;
        match (cas_reply(value, "extend")?, missing) {
            (Cas::Applied, Some(missing)) => Err(untrusted(missing, false)),
            (cas, _) => Ok(cas),
        }
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        let (value, missing) = self
            .eval_write(
                "reclaim",
                &self.scripts.reclaim,
                id,
                &[&packed(
                    fingerprint.as_bytes(),
                    &[expected.0, ms(lease), ms(ttl), self.retention()],
                    &[],
                )],
            )
            .await?;
        match (reclaim_reply(value)?, missing) {
            (Reclaim::Reclaimed { .. }, Some(missing)) => Err(untrusted(missing, false)),
            (reclaim, _) => Ok(reclaim),
        }
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        // With `wait_for_replicas`, a read is trusted only once the replicas have what it saw
        // (the engine reads a completion back after an unknown outcome).
        let (value, missing) = self
            .eval_write("get", &self.scripts.get, id, &[])
            .await
            .map_err(read_error)?;
        if let Some(missing) = missing {
            return Err(untrusted(missing, false));
        }
        get_reply(value, id)
    }

    /// One pipeline for the whole batch (on a cluster, one per slot, sent concurrently):
    /// one round trip, each claim its own script, run in the batch's order.
    async fn claim_many(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
        let args: Vec<Vec<u8>> = requests
            .iter()
            .map(|r| {
                packed(
                    r.fingerprint.as_bytes(),
                    &[ms(r.lease), ms(r.ttl), self.retention()],
                    &[u8::from(r.count_hit)],
                )
            })
            .collect();
        let calls: Vec<Call<'_>> = requests
            .iter()
            .zip(args)
            .map(|(r, a)| (&self.scripts.claim, &r.id, vec![a]))
            .collect();
        self.eval_many("claim", &calls)
            .await
            .into_iter()
            .zip(requests)
            .map(|((value, missing), r)| match missing {
                Some(missing) => Err(untrusted(missing, false)),
                None => value.and_then(|v| claim_reply(v, &r.id)),
            })
            .collect()
    }

    /// One pipeline for the whole batch, as [`RedisStore::claim_many`].
    async fn settle_many(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
        let calls: Vec<Call<'_>> = settlements
            .iter()
            .map(|s| match &s.settle {
                Settle::Complete(outcome) => (
                    &self.scripts.complete,
                    &s.id,
                    vec![
                        packed(&[], &[s.token.0, ms(s.ttl), self.retention()], &[]),
                        outcome.clone(),
                    ],
                ),
                Settle::Fail(failure) => (
                    &self.scripts.fail,
                    &s.id,
                    vec![
                        packed(
                            &[],
                            &[s.token.0, ms(s.ttl), self.retention()],
                            &[u8::from(failure.retryable)],
                        ),
                        failure.message.as_bytes().to_vec(),
                    ],
                ),
            })
            .collect();
        self.eval_many("settle", &calls)
            .await
            .into_iter()
            .map(
                |(value, missing)| match (value.and_then(|v| cas_reply(v, "settle")), missing) {
                    (Ok(Cas::Applied), Some(missing)) => Err(untrusted(missing, true)),
                    (cas, _) => cas,
                },
            )
            .collect()
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
            duration_millis(idempotency_core::store::MAX_DURATION)
        );
        assert_eq!(duration_millis(Duration::from_micros(1)), 1);
    }
}
