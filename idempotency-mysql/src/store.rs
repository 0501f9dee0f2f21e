//! The store.

use crate::abandon::CloseIfAbandoned;
use crate::decode::{col, decode_record, get};
use crate::error::{error_number, is_conflict, is_connection_loss, map_sqlx, Effect};
use crate::schema;
use crate::sql::Statements;
use crate::{MySqlError, MySqlStoreBuilder, TableName};
use async_trait::async_trait;
use futures::future::BoxFuture;
use idempotency_core::store::{
    claim_retention, duration_millis, Cas, Claim, ClaimRequest, Failure, Reclaim, Record,
    RecordStatus, Timestamp,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use rand::Rng;
use sqlx::mysql::{MySqlArguments, MySqlQueryResult, MySqlRow};
use sqlx::query::Query;
use sqlx::{MySql, MySqlConnection, MySqlPool};
use std::sync::Arc;
use std::time::Duration;

/// How long [`MySqlStore::sweep_idle`] waits for an idle connection's ping before it takes
/// the connection for dead.
const SWEEP_PING: Duration = Duration::from_secs(1);

/// What [`MySqlStore::run`] does when a statement's connection is lost after it was sent.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum OnLoss {
    /// Send it again on another connection: a read, a claim (a repeat observes what an
    /// applied claim wrote, never claims twice) or a purge.
    Resend,
    /// Report it (for a write, [`Error::OutcomeUnknown`]): a holder's compare-and-swap, which
    /// the engine retries and reads back.
    Report,
}

/// How one attempt at a statement failed: before it was sent (no connection), after, or
/// with no answer within the response timeout (the connection was closed).
enum Attempt {
    NotSent(sqlx::Error),
    Sent(sqlx::Error),
    NoAnswer,
}

/// A MySQL (MariaDB) [`IdempotencyStore`].
///
/// Each operation is exactly one prepared statement, so one round trip. The server's clock
/// decides leases and expiry. See the crate documentation for the exactly-once path
/// ([`crate::MySqlIdempotency`]).
///
/// Cloning is cheap: clones share the pool.
#[derive(Clone, Debug)]
pub struct MySqlStore {
    pool: MySqlPool,
    name: TableName,
    pub(crate) quoted: Arc<str>,
    pub(crate) sql: Arc<Statements>,
    conflict_retries: u32,
    pub(crate) response_timeout: Duration,
}

impl MySqlStore {
    /// A builder, to choose the table and pool settings.
    pub fn builder() -> MySqlStoreBuilder {
        MySqlStoreBuilder::default()
    }

    /// Connects to `url` with the default table `idempotency_records` in the URL's database.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), idempotency_mysql::MySqlError> {
    /// let store = idempotency_mysql::MySqlStore::connect("mysql://app@127.0.0.1/app").await?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, MySqlError> {
        Self::builder().connect(url).await
    }

    /// A store over an existing pool with the default table `idempotency_records`. Every
    /// operation takes a connection from the pool and gives it back.
    pub fn from_pool(pool: MySqlPool) -> Self {
        Self::assemble(
            pool,
            TableName::default(),
            crate::builder::DEFAULT_CONFLICT_RETRIES,
            crate::builder::DEFAULT_RESPONSE_TIMEOUT,
        )
    }

    pub(crate) fn assemble(
        pool: MySqlPool,
        name: TableName,
        conflict_retries: u32,
        response_timeout: Duration,
    ) -> Self {
        Self {
            quoted: name.quoted().into(),
            sql: Arc::new(Statements::new(&name)),
            pool,
            name,
            conflict_retries,
            response_timeout,
        }
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The table.
    pub fn table_name(&self) -> &TableName {
        &self.name
    }

    /// Creates the table and its expiry index if they do not exist, then checks the table's
    /// shape ([`MySqlStore::verify`]).
    ///
    /// Safe to call at every start and from several processes at once
    /// (`CREATE TABLE IF NOT EXISTS`). A table of another shape under the same name is
    /// refused with [`MySqlError::TableShape`] and nothing is changed.
    ///
    /// Logs a warning when the server is not set up to keep what it showed across a crash
    /// (see [`MySqlStore::verify`]).
    pub async fn migrate(&self) -> Result<(), MySqlError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|source| MySqlError::Connect { source })?;
        schema::migrate(&mut conn, &self.name).await?;
        warn_unless_durable(&mut conn).await;
        Ok(())
    }

    /// Checks that the table exists and has the shape this crate needs, without changing
    /// anything: [`MySqlError::MissingTable`] or [`MySqlError::TableShape`] otherwise.
    ///
    /// Also logs a warning (`tracing`, at `WARN`) when the server's settings let a crash lose
    /// what other sessions already saw: `innodb_flush_log_at_trx_commit` other than 1 or 3,
    /// the binary log off (InnoDB then shows a commit to other sessions before its redo record
    /// is written, so a crash can undo a completion that retries were already answered from,
    /// and the key runs again), or `sync_binlog = 0` (a power loss can lose commits).
    pub async fn verify(&self) -> Result<(), MySqlError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|source| MySqlError::Connect { source })?;
        schema::verify(&mut conn, &self.name).await?;
        warn_unless_durable(&mut conn).await;
        Ok(())
    }

    /// The completion compare-and-swap, inside the caller's transaction.
    ///
    /// Run it in the same transaction as the business writes, then commit. It applies only
    /// if the record is live, `Pending` and still held by `token`; otherwise it returns
    /// [`Error::LeaseLost`] and the caller must roll back, so the business writes of a holder
    /// that lost its lease never commit. An InnoDB `UPDATE` reads the latest committed row
    /// whatever the isolation level, so a heartbeat committed meanwhile from another
    /// connection does not make it miss (except under MariaDB's snapshot isolation, where it
    /// is refused: [`MySqlError::SnapshotIsolation`]). The row stays locked until the
    /// transaction ends.
    /// [`crate::MySqlIdempotency`] does all of this for you.
    ///
    /// Unanswered within the response timeout, the statement ends with a retryable error
    /// whose source is [`MySqlError::NoAnswer`]: nothing committed, but the connection is
    /// stuck mid-statement, so close it (`close_on_drop` on a pooled connection) rather than
    /// roll back on it.
    pub async fn complete_in(
        &self,
        tx: &mut MySqlConnection,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let Ok(t) = i64::try_from(token.0) else {
            return Err(Error::LeaseLost { token });
        };
        let statement = sqlx::query(&self.sql.complete)
            .bind(outcome)
            .bind(duration_millis(ttl))
            .bind(id.scope.as_str().as_bytes())
            .bind(id.key.as_str().as_bytes())
            .bind(t)
            .execute(&mut *tx);
        let done = tokio::time::timeout(self.response_timeout, statement)
            .await
            // Nothing commits until the caller commits: a statement without an answer, or a
            // lost connection, applied nothing.
            .map_err(|_| self.no_answer(Effect::None))?;
        let done = match done {
            Ok(done) => done,
            Err(e) => return Err(self.in_transaction_error(e, id, token).await),
        };
        match done.rows_affected() {
            0 => Err(Error::LeaseLost { token }),
            _ => Ok(()),
        }
    }

    /// Moves the recovery point of `id`'s record held by `token` from phase `from` (`None`:
    /// it has none) to `to`, inside the caller's transaction on `tx`, for
    /// [`RecoveryPoints::advance_in`](idempotency_core::store::RecoveryPoints::advance_in).
    /// [`Error::LeaseLost`] when the record is not that holder's live Pending record at that
    /// phase.
    pub(crate) async fn advance_in(
        &self,
        tx: &mut MySqlConnection,
        id: &RecordId,
        token: FencingToken,
        from: Option<u16>,
        to: &idempotency_core::store::RecoveryPoint,
    ) -> Result<(), Error> {
        let (Ok(t), Ok(origin)) = (i64::try_from(token.0), i64::try_from(to.origin)) else {
            return Err(Error::LeaseLost { token });
        };
        let statement = sqlx::query(&self.sql.advance)
            .bind(to.operation.as_str())
            .bind(i32::from(to.phase))
            .bind(origin)
            .bind(to.state.as_slice())
            .bind(id.scope.as_str().as_bytes())
            .bind(id.key.as_str().as_bytes())
            .bind(t)
            .bind(from.map(i32::from))
            .execute(&mut *tx);
        let done = tokio::time::timeout(self.response_timeout, statement)
            .await
            // Nothing commits until the caller commits: a statement without an answer, or a
            // lost connection, applied nothing.
            .map_err(|_| self.no_answer(Effect::None))?;
        let done = match done {
            Ok(done) => done,
            Err(e) => return Err(self.in_transaction_error(e, id, token).await),
        };
        match done.rows_affected() {
            0 => Err(Error::LeaseLost { token }),
            _ => Ok(()),
        }
    }

    /// The error of a write to the record inside the work's transaction. Under MariaDB's
    /// snapshot isolation a record changed by another session after the transaction's
    /// snapshot cannot be written in it (1020): if the record is no longer this holder's
    /// (taken over), the lease was lost; else the heartbeat extended it during a long work
    /// (or a duplicate counted a hit), which running the transaction again would likely
    /// meet the same way, so it is [`MySqlError::SnapshotIsolation`], not a conflict.
    async fn in_transaction_error(
        &self,
        e: sqlx::Error,
        id: &RecordId,
        token: FencingToken,
    ) -> Error {
        if error_number(&e) != Some(1020) {
            return map_sqlx(e, &self.quoted, Effect::None);
        }
        let ours = |r: &Record| r.token == token && r.status == RecordStatus::Pending;
        match IdempotencyStore::get(self, id).await {
            // Taken over, settled or gone: no longer this holder's to write.
            Ok(record) if !record.as_ref().is_some_and(ours) => Error::LeaseLost { token },
            // Still this holder's, or not known (nothing here committed either way).
            _ => MySqlError::SnapshotIsolation {
                table: self.quoted.to_string(),
                source: e,
            }
            .into(),
        }
    }

    /// The live operations whose holder is gone that `query` asks for (see
    /// [`RecoveryPoints::abandoned`](idempotency_core::store::RecoveryPoints::abandoned)); a row
    /// that does not read back is listed as its error.
    pub(crate) async fn list_abandoned(
        &self,
        query: &idempotency_core::store::AbandonedQuery,
    ) -> Result<Vec<Result<idempotency_core::store::Abandoned, Error>>, Error> {
        if query.operations.is_empty() {
            return Ok(Vec::new());
        }
        let limit = u64::try_from(query.limit).unwrap_or(u64::MAX);
        // `op_name IN (?, …)`, which reads the index of operations (`op_name_idx`).
        let names = vec!["?"; query.operations.len()].join(", ");
        let statement = self.sql.abandoned.replace("{names}", &names);
        // Signed, so that `now - failed_for` may go below zero; at most a century.
        let failed_for = i64::try_from(query.failed_for.as_millis())
            .unwrap_or(i64::MAX)
            .min(3_200_000_000_000);
        let rows = self
            .run(Effect::None, OnLoss::Resend, All, || {
                let mut q = sqlx::query(&statement);
                for name in &query.operations {
                    q = q.bind(name);
                }
                q.bind(query.max_attempts).bind(failed_for).bind(limit)
            })
            .await?;
        let utf8 = |bytes: Vec<u8>, what: &str| {
            String::from_utf8(bytes).map_err(|_| {
                Error::corrupt(format!("an abandoned operation's {what} is not UTF-8"))
            })
        };
        Ok(rows
            .into_iter()
            .map(|row| {
                idempotency_core::store::Abandoned::from_columns(
                    &utf8(get(&row, 0, &self.quoted)?, "scope")?,
                    &utf8(get(&row, 1, &self.quoted)?, "key")?,
                    &get::<Vec<u8>>(&row, 2, &self.quoted)?,
                    utf8(get(&row, 3, &self.quoted)?, "operation name")?,
                    get::<i32>(&row, 4, &self.quoted)?.into(),
                )
            })
            .collect())
    }

    /// The recovery point of `id`'s live record, if it has one of its own.
    pub(crate) async fn read_recovery_point(
        &self,
        id: &RecordId,
    ) -> Result<Option<idempotency_core::store::RecoveryPoint>, Error> {
        let row = self
            .run(Effect::None, OnLoss::Resend, Optional, || {
                sqlx::query(&self.sql.point)
                    .bind(id.scope.as_str().as_bytes())
                    .bind(id.key.as_str().as_bytes())
            })
            .await?;
        let Some(row) = row else { return Ok(None) };
        // Read as bytes, as every text column of the store is (a binary collation).
        let name: Option<Vec<u8>> = get(&row, 0, &self.quoted)?;
        let Ok(name) = name.map(String::from_utf8).transpose() else {
            return Err(Error::corrupt(format!(
                "the record of {id} has an operation name that is not UTF-8"
            )));
        };
        idempotency_core::store::RecoveryPoint::from_columns(
            &format_args!("the record of {id} in {}", self.quoted),
            name,
            get::<Option<i32>>(&row, 1, &self.quoted)?.map(i64::from),
            get(&row, 2, &self.quoted)?,
            get(&row, 3, &self.quoted)?,
        )
    }

    /// Runs the statement `query` builds on one connection, re-running it after deadlocks
    /// and lock wait timeouts (the autocommit statement was rolled back, so nothing was
    /// applied), with a jittered backoff. Each attempt takes a connection from the pool.
    ///
    /// A lost connection is most often one that died idle in the pool: after a server
    /// restart or failover every idle connection is dead, and the pool (which does not ping
    /// before it hands a connection out) would hand them out one by one, each failing one
    /// operation. So a lost connection first has the pool's idle connections checked
    /// ([`MySqlStore::sweep_idle`]). Then the statement is, with [`OnLoss::Resend`], sent again on another connection (up to once per
    /// connection the pool can hold, plus one); with [`OnLoss::Report`] (a holder's
    /// compare-and-swap, which the engine retries and reads back) a write's outcome is
    /// reported unknown.
    async fn run<'q, X: Fetch>(
        &self,
        effect: Effect,
        on_loss: OnLoss,
        fetch: X,
        mut query: impl FnMut() -> Query<'q, MySql, MySqlArguments> + Send,
    ) -> Result<X::Out, Error> {
        let mut attempt = 0u32;
        let mut lost = 0u32;
        let max_lost = self.pool.options().get_max_connections().saturating_add(1);
        // A write whose connection was lost after it was sent may have applied.
        let mut maybe_applied = None;
        loop {
            match self.once(fetch, query()).await {
                Ok(v) => return Ok(v),
                // Not sent again: in a partition the next connection would wait as long.
                Err(Attempt::NoAnswer) => {
                    let unknown = on_loss == OnLoss::Report && effect == Effect::Write;
                    return Err(self.no_answer(if unknown { Effect::Write } else { Effect::None }));
                }
                Err(Attempt::NotSent(e)) => {
                    return Err(match maybe_applied {
                        Some(lost) => map_sqlx(lost, &self.quoted, Effect::Write),
                        None => map_sqlx(e, &self.quoted, Effect::None),
                    });
                }
                Err(Attempt::Sent(e)) if is_conflict(&e) && attempt < self.conflict_retries => {
                    attempt += 1;
                    let cap_ms = 1u64 << attempt.min(6);
                    let ms = rand::thread_rng().gen_range(0..=cap_ms);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                Err(Attempt::Sent(e)) if is_connection_loss(&e) => {
                    if lost == 0 {
                        self.sweep_idle().await;
                    }
                    lost += 1;
                    if on_loss == OnLoss::Report || lost > max_lost {
                        return Err(map_sqlx(e, &self.quoted, effect));
                    }
                    tracing::debug!(
                        error = %e,
                        lost,
                        "the connection was lost; sending the statement on another connection"
                    );
                    if effect == Effect::Write {
                        maybe_applied = Some(e);
                    }
                }
                Err(Attempt::Sent(e)) => {
                    return Err(match (maybe_applied, map_sqlx(e, &self.quoted, effect)) {
                        // An earlier attempt of this write may have applied.
                        (Some(_), e @ Error::Backend { .. }) => Error::OutcomeUnknown {
                            source: Box::new(e),
                        },
                        (_, e) => e,
                    });
                }
            }
        }
    }

    /// Checks the pool's idle connections after a lost one: each gets a ping (at most
    /// [`SWEEP_PING`] each, all at once), and those that do not answer are closed, so the
    /// next operations get live or fresh connections. Costs nothing until a connection is
    /// lost.
    pub(crate) async fn sweep_idle(&self) {
        let mut idle = Vec::new();
        while let Some(conn) = self.pool.try_acquire() {
            idle.push(conn);
        }
        let checked = idle.len();
        let dead = futures::future::join_all(idle.into_iter().map(|mut conn| async move {
            let alive = matches!(
                tokio::time::timeout(SWEEP_PING, sqlx::Connection::ping(&mut *conn)).await,
                Ok(Ok(()))
            );
            if !alive {
                conn.close_on_drop();
            }
            usize::from(!alive)
        }))
        .await
        .into_iter()
        .sum::<usize>();
        tracing::debug!(
            checked,
            dead,
            "a connection was lost: checked the idle ones"
        );
    }

    async fn once<'q, X: Fetch>(
        &self,
        fetch: X,
        query: Query<'q, MySql, MySqlArguments>,
    ) -> Result<X::Out, Attempt> {
        let mut conn = self.pool.acquire().await.map_err(Attempt::NotSent)?;
        // Dropped mid-statement (the operation was cancelled), the connection is closed
        // rather than handed back in an unknown state; after an error the pool's release
        // ping finds a broken one.
        let mut guard = CloseIfAbandoned::new(&mut conn);
        let answer = tokio::time::timeout(self.response_timeout, fetch.run(query, guard.conn()));
        // No answer in time: the guard, still armed, closes the connection (its answer may
        // yet come, and would be read as the next statement's).
        let out = answer.await.map_err(|_| Attempt::NoAnswer)?;
        guard.finished();
        out.map_err(Attempt::Sent)
    }

    /// The error of a statement that got no answer within the response timeout: a write's
    /// outcome is unknown, anything else is worth trying again.
    pub(crate) fn no_answer(&self, effect: Effect) -> Error {
        let e = MySqlError::NoAnswer {
            after: self.response_timeout,
        };
        match effect {
            Effect::Write => Error::OutcomeUnknown {
                source: Box::new(e),
            },
            _ => e.into(),
        }
    }

    /// A compare-and-swap statement: applied when it matched the record.
    async fn cas(&self, sql: &str, binds: CasBinds<'_>) -> Result<Cas, Error> {
        let Ok(token) = i64::try_from(binds.token.0) else {
            // No stored record can hold a token above i64::MAX.
            return Ok(Cas::Fenced);
        };
        let done = self
            .run(Effect::Write, OnLoss::Report, Execute, || {
                let q = sqlx::query(sql);
                let q = match binds.extra {
                    Extra::Complete { outcome, ttl_ms } => q.bind(outcome).bind(ttl_ms),
                    Extra::Fail {
                        retryable,
                        message,
                        ttl_ms,
                    } => q.bind(retryable).bind(message).bind(ttl_ms),
                    Extra::Extend { lease_ms } => q.bind(lease_ms).bind(lease_ms),
                };
                q.bind(binds.id.scope.as_str().as_bytes())
                    .bind(binds.id.key.as_str().as_bytes())
                    .bind(token)
            })
            .await?;
        Ok(match done.rows_affected() {
            0 => Cas::Fenced,
            _ => Cas::Applied,
        })
    }
}

/// How [`MySqlStore::run`] runs a statement on a connection, and what it returns.
trait Fetch: Copy + Send {
    type Out: Send;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, MySql, MySqlArguments>,
        conn: &'e mut MySqlConnection,
    ) -> BoxFuture<'e, Result<Self::Out, sqlx::Error>>;
}

/// Exactly one row.
#[derive(Clone, Copy)]
struct One;

/// At most one row.
#[derive(Clone, Copy)]
struct Optional;

/// No rows: the rows affected.
#[derive(Clone, Copy)]
struct Execute;

/// Every row.
#[derive(Clone, Copy)]
struct All;

impl Fetch for All {
    type Out = Vec<MySqlRow>;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, MySql, MySqlArguments>,
        conn: &'e mut MySqlConnection,
    ) -> BoxFuture<'e, Result<Vec<MySqlRow>, sqlx::Error>> {
        Box::pin(query.fetch_all(conn))
    }
}

impl Fetch for One {
    type Out = MySqlRow;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, MySql, MySqlArguments>,
        conn: &'e mut MySqlConnection,
    ) -> BoxFuture<'e, Result<MySqlRow, sqlx::Error>> {
        Box::pin(query.fetch_one(conn))
    }
}

impl Fetch for Optional {
    type Out = Option<MySqlRow>;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, MySql, MySqlArguments>,
        conn: &'e mut MySqlConnection,
    ) -> BoxFuture<'e, Result<Option<MySqlRow>, sqlx::Error>> {
        Box::pin(query.fetch_optional(conn))
    }
}

impl Fetch for Execute {
    type Out = MySqlQueryResult;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, MySql, MySqlArguments>,
        conn: &'e mut MySqlConnection,
    ) -> BoxFuture<'e, Result<MySqlQueryResult, sqlx::Error>> {
        Box::pin(query.execute(conn))
    }
}

struct CasBinds<'a> {
    id: &'a RecordId,
    token: FencingToken,
    extra: Extra<'a>,
}

#[derive(Clone, Copy)]
enum Extra<'a> {
    Complete {
        outcome: &'a [u8],
        ttl_ms: i64,
    },
    Fail {
        retryable: bool,
        message: &'a str,
        ttl_ms: i64,
    },
    Extend {
        lease_ms: i64,
    },
}

#[async_trait]
impl IdempotencyStore for MySqlStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let lease_ms = duration_millis(request.lease);
        let hold_ms = duration_millis(claim_retention(request.lease, request.ttl));
        // Written only if this statement inserts or replaces the record: the one sign of a
        // won claim that no other claim can forge. The same nonce goes with every send, so a
        // claim sent again after its connection was lost recognises the record its first send
        // wrote as its own (and counts no hit for it) instead of leaving it held by nobody.
        let table = &*self.quoted;
        let nonce: i64 = rand::thread_rng().gen_range(1..=i64::MAX);
        let sends = std::sync::atomic::AtomicU32::new(0);
        let row = self
            .run(Effect::Write, OnLoss::Resend, One, || {
                sends.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                sqlx::query(&self.sql.claim)
                    .bind(request.id.scope.as_str().as_bytes())
                    .bind(request.id.key.as_str().as_bytes())
                    .bind(&request.fingerprint.as_bytes()[..])
                    .bind(nonce)
                    .bind(lease_ms)
                    .bind(hold_ms)
                    .bind(i64::from(request.count_hit))
            })
            .await?;
        // By position: sqlx names a row's columns after the prepared statement's metadata, and
        // MariaDB prepares `INSERT … RETURNING` without describing its result columns.
        let now_ms: i64 = get(&row, col::NOW_MS, table)?;
        let won: i64 = get(&row, col::CLAIM_NONCE, table)?;
        if won == nonce {
            let token: i64 = get(&row, col::TOKEN, table)?;
            let lease_until: Option<i64> = get(&row, col::LEASE_UNTIL_MS, table)?;
            let (Ok(token), Some(lease_until)) = (u64::try_from(token), lease_until) else {
                return Err(Error::corrupt(format!(
                    "claimed record {} came back without a valid token or lease",
                    request.id
                )));
            };
            // A claim sent again after its lease passed (the first send's answer was lost and
            // reconnecting took longer) must not start the work on a lease anyone may take
            // over: it is answered as the record it finds, which the caller reclaims.
            let resent = sends.load(std::sync::atomic::Ordering::Relaxed) > 1;
            if !resent || lease_until > now_ms {
                return Ok(Claim::Claimed {
                    token: FencingToken(token),
                    lease_until: Timestamp::from_millis(lease_until),
                });
            }
        }
        let record = decode_record(&row, &request.id, table)?;
        Ok(Claim::Existing {
            record,
            now: Timestamp::from_millis(now_ms),
        })
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let extra = Extra::Complete {
            outcome,
            ttl_ms: duration_millis(ttl),
        };
        self.cas(&self.sql.complete, CasBinds { id, token, extra })
            .await
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        // The column holds 64 KiB: a longer message would be refused (error 1406) and the
        // key left Pending. Keep what the engine keeps of any failure.
        let bounded;
        let failure = if failure.message.len() > Failure::MAX_MESSAGE {
            bounded = failure.clone().bounded();
            &bounded
        } else {
            failure
        };
        let extra = Extra::Fail {
            retryable: failure.retryable,
            message: &failure.message,
            ttl_ms: duration_millis(ttl),
        };
        self.cas(&self.sql.fail, CasBinds { id, token, extra })
            .await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        let extra = Extra::Extend {
            lease_ms: duration_millis(lease),
        };
        self.cas(&self.sql.extend, CasBinds { id, token, extra })
            .await
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        let Ok(expected_i) = i64::try_from(expected.0) else {
            return Ok(Reclaim::Lost);
        };
        let (lease_ms, hold_ms) = (
            duration_millis(lease),
            duration_millis(claim_retention(lease, ttl)),
        );
        let done = self
            .run(Effect::Write, OnLoss::Report, Execute, || {
                sqlx::query(&self.sql.reclaim)
                    .bind(&fingerprint.as_bytes()[..])
                    .bind(lease_ms)
                    .bind(hold_ms)
                    .bind(id.scope.as_str().as_bytes())
                    .bind(id.key.as_str().as_bytes())
                    .bind(expected_i)
                    .bind(&fingerprint.as_bytes()[..])
            })
            .await?;
        if done.rows_affected() == 0 {
            return Ok(Reclaim::Lost);
        }
        // The new lease, as `LAST_INSERT_ID(expr)` reported it in the statement's answer.
        let lease_until = i64::try_from(done.last_insert_id()).map_err(|_| {
            Error::corrupt(format!(
                "reclaimed record {id} came back with lease {}",
                done.last_insert_id()
            ))
        })?;
        Ok(Reclaim::Reclaimed {
            token: expected.next(),
            lease_until: Timestamp::from_millis(lease_until),
        })
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let row = self
            .run(Effect::None, OnLoss::Resend, Optional, || {
                sqlx::query(&self.sql.get)
                    .bind(id.scope.as_str().as_bytes())
                    .bind(id.key.as_str().as_bytes())
            })
            .await?;
        row.map(|row| decode_record(&row, id, &self.quoted))
            .transpose()
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        if batch == 0 {
            return Ok(0);
        }
        let limit = u64::try_from(batch).unwrap_or(u64::MAX);
        let done = self
            .run(Effect::Write, OnLoss::Resend, Execute, || {
                sqlx::query(&self.sql.purge).bind(limit)
            })
            .await?;
        Ok(done.rows_affected())
    }
}

/// What a server's durability settings lack for the store's guarantees across a crash, as
/// sentences; empty when nothing.
fn durability_gaps(flush_log_at_trx_commit: i64, log_bin: i64, sync_binlog: i64) -> Vec<String> {
    let mut gaps = Vec::new();
    if !matches!(flush_log_at_trx_commit, 1 | 3) {
        gaps.push(format!(
            "innodb_flush_log_at_trx_commit = {flush_log_at_trx_commit}: a crash can lose \
             commits that were answered (set it to 1)"
        ));
    }
    if log_bin == 0 {
        gaps.push(
            "the binary log is off: InnoDB shows a commit to other sessions before its redo \
             record is written, so a crash can undo a completion that retries were already \
             answered from, and the key runs again (start the server with log_bin and \
             sync_binlog = 1)"
                .to_owned(),
        );
    } else if sync_binlog == 0 {
        gaps.push(
            "sync_binlog = 0: a power loss or an operating system crash can lose commits \
             (set it to 1)"
                .to_owned(),
        );
    }
    gaps
}

/// Reads the server's durability settings and logs what [`durability_gaps`] finds. A server
/// that does not answer the question (a proxy, a permission) is only noted at `DEBUG`.
async fn warn_unless_durable(conn: &mut sqlx::MySqlConnection) {
    let settings = sqlx::query_as::<_, (i64, i64, i64)>(
        "SELECT CAST(@@global.innodb_flush_log_at_trx_commit AS SIGNED),
                CAST(@@global.log_bin AS SIGNED), CAST(@@global.sync_binlog AS SIGNED)",
    )
    .fetch_one(&mut *conn)
    .await;
    match settings {
        Ok((flush, log_bin, sync_binlog)) => {
            for gap in durability_gaps(flush, log_bin, sync_binlog) {
                tracing::warn!(
                    "MariaDB is not set up to keep what it showed across a crash: {gap}"
                );
            }
        }
        Err(e) => tracing::debug!(error = %e, "could not read the server's durability settings"),
    }
}

#[cfg(test)]
mod durability_tests {
    use super::durability_gaps;

    #[test]
    fn only_the_binary_log_synced_at_every_commit_is_without_gaps() {
        assert!(durability_gaps(1, 1, 1).is_empty());
        assert!(durability_gaps(3, 1, 1).is_empty());
        let gaps = durability_gaps(1, 0, 0);
        assert_eq!(gaps.len(), 1);
        assert!(gaps[0].contains("binary log is off"), "{gaps:?}");
        assert!(durability_gaps(1, 1, 0)[0].contains("sync_binlog = 0"));
        assert_eq!(durability_gaps(2, 0, 0).len(), 2);
    }
}
