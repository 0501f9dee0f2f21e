//! The store.

use crate::decode::{decode_record, get};
use crate::error::{is_connection_loss, is_serialization_failure, map_sqlx, Effect};
use crate::kept::{Kept, Out};
use crate::schema;
use crate::sql::Statements;
use crate::{PostgresError, PostgresStoreBuilder, TableName};
use async_trait::async_trait;
use futures::future::BoxFuture;
use idempotency_core::store::{
    claim_retention, duration_millis, Cas, Claim, ClaimRequest, Failure, Reclaim, Record,
    Settlement, Timestamp,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use rand::Rng;
use sqlx::postgres::{PgArguments, PgQueryResult, PgRow};
use sqlx::query::Query;
use sqlx::{Connection, PgConnection, PgPool, Postgres};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long [`PostgresStore::sweep_idle`] waits for an idle connection's ping before it
/// takes the connection for dead.
const SWEEP_PING: Duration = Duration::from_secs(1);

/// What [`PostgresStore::run`] does when a statement's connection is lost after it was sent.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum OnLoss {
    /// Send it again on another connection: a read, a claim (a repeat observes what an
    /// applied claim wrote, never claims twice) or a purge.
    Resend,
    /// Report it (for a write, [`Error::OutcomeUnknown`]): a holder's compare-and-swap, which
    /// the engine retries and reads back.
    Report,
}

/// How one attempt at a statement failed: before it was sent (no connection), or after.
enum Attempt {
    NotSent(sqlx::Error),
    Sent(sqlx::Error),
    /// Sent, and no answer came within the response timeout.
    NoAnswer,
}

/// A PostgreSQL [`IdempotencyStore`].
///
/// Each operation is exactly one prepared statement, so one round trip. The database's clock
/// decides leases and expiry. See the crate documentation for the exactly-once path
/// ([`PostgresStore::complete_in`] and [`crate::PostgresIdempotency`]).
///
/// Cloning is cheap: clones share the pool and the connections kept between operations
/// ([`PostgresStoreBuilder::keep_connections`]).
#[derive(Clone, Debug)]
pub struct PostgresStore {
    pool: PgPool,
    kept: Option<Arc<Kept>>,
    name: TableName,
    pub(crate) qualified: Arc<str>,
    pub(crate) sql: Arc<Statements>,
    serialization_retries: u32,
    /// The sessions' isolation level, as the exactly-once path learned it.
    pub(crate) level: Arc<LevelCache>,
    /// How long a statement may take to answer.
    pub(crate) response_timeout: Duration,
}

impl PostgresStore {
    /// A builder, to choose the schema, table and pool settings.
    pub fn builder() -> PostgresStoreBuilder {
        PostgresStoreBuilder::default()
    }

    /// Connects to `url` with the default table `public.idempotency_records`.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), idempotency_postgres::PostgresError> {
    /// let store = idempotency_postgres::PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, PostgresError> {
        Self::builder().connect(url).await
    }

    /// A store over an existing pool with the default table `public.idempotency_records`.
    /// Every operation takes a connection from the pool and gives it back.
    pub fn from_pool(pool: PgPool) -> Self {
        Self::assemble(
            pool,
            TableName::default(),
            crate::builder::DEFAULT_SERIALIZATION_RETRIES,
            false,
            crate::builder::DEFAULT_RESPONSE_TIMEOUT,
        )
    }

    pub(crate) fn assemble(
        pool: PgPool,
        name: TableName,
        serialization_retries: u32,
        keep: bool,
        response_timeout: Duration,
    ) -> Self {
        Self {
            qualified: name.qualified().into(),
            sql: Arc::new(Statements::new(&name)),
            kept: keep.then(|| Kept::new(pool.clone())),
            pool,
            name,
            serialization_retries,
            level: Arc::default(),
            response_timeout,
        }
    }

    /// The pool. When the store keeps connections between operations
    /// ([`PostgresStoreBuilder::keep_connections`]), some of the pool's connections may be
    /// checked out by the store while it is busy (and for 100 ms after).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table.
    pub fn table_name(&self) -> &TableName {
        &self.name
    }

    /// Creates the schema, the table and its expiry index, applying the migrations shipped
    /// with this crate that the database does not have yet, then checks the table's shape.
    ///
    /// Safe to call at every start and from several processes at once (one transaction under
    /// an advisory lock). A table of another shape under the same name is refused with
    /// [`PostgresError::TableShape`] and nothing is changed.
    pub async fn migrate(&self) -> Result<(), PostgresError> {
        let mut conn = self
            .connection()
            .await
            .map_err(|source| PostgresError::Connect { source })?;
        schema::migrate(conn.conn(), &self.name).await
    }

    /// Checks that the table exists and has the shape this crate needs, without changing
    /// anything: [`PostgresError::MissingTable`] or [`PostgresError::TableShape`] otherwise.
    pub async fn verify(&self) -> Result<(), PostgresError> {
        let mut conn = self
            .connection()
            .await
            .map_err(|source| PostgresError::Connect { source })?;
        schema::verify(conn.conn(), &self.name).await
    }

    /// The completion compare-and-swap, inside the caller's transaction.
    ///
    /// Run it in the same transaction as the business writes, then commit. It applies only
    /// if the record is live, `Pending` and still held by `token`; otherwise it returns
    /// [`Error::LeaseLost`] and the caller must roll back (returning the error with `?` drops
    /// the transaction, which rolls it back), so the business writes of a holder that lost its
    /// lease never commit. If the commit's outcome is unknown, a retry finds either the
    /// Completed record (the writes committed) or the Pending one whose lease will pass
    /// (nothing was written).
    ///
    /// The row stays locked until the transaction ends, so a concurrent reclaim waits for it.
    /// At REPEATABLE READ or SERIALIZABLE a concurrent change to the record (a heartbeat, a
    /// takeover) may fail the statement or the commit with a serialization error, reported as
    /// retryable: run the whole transaction again. [`crate::PostgresIdempotency`] does that for you.
    pub async fn complete_in(
        &self,
        tx: &mut PgConnection,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        self.complete_in_reporting(tx, id, token, outcome, ttl, false)
            .await
            .map(|_| ())
    }

    /// [`PostgresStore::complete_in`], also reporting the transaction's isolation level.
    /// `locked`: the transaction holds the record's row lock since [`PostgresStore::hold_in`]
    /// found it live and held by `token`, so its expiry is not checked again (see
    /// `sql::complete_locked`).
    pub(crate) async fn complete_in_reporting(
        &self,
        tx: &mut PgConnection,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
        locked: bool,
    ) -> Result<Level, Error> {
        let Ok(t) = i64::try_from(token.0) else {
            return Err(Error::LeaseLost { token });
        };
        let sql = match locked {
            true => &self.sql.complete_locked,
            false => &self.sql.complete,
        };
        let row = sqlx::query(sql)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .bind(t)
            .bind(outcome)
            .bind(duration_millis(ttl))
            .fetch_optional(&mut *tx)
            .await
            // Nothing commits until the caller commits: a lost connection applied nothing.
            .map_err(|e| map_sqlx(e, &self.qualified, Effect::None))?;
        match row {
            Some(row) => Ok(Level::parse(&get::<String>(
                &row,
                "isolation",
                &self.qualified,
            )?)),
            None => Err(Error::LeaseLost { token }),
        }
    }

    /// Moves the recovery point of `id`'s record held by `token` from phase `from` (`None`:
    /// it has none) to `to`, inside the caller's transaction on `tx`, for
    /// [`RecoveryPoints::advance_in`](idempotency_core::store::RecoveryPoints::advance_in).
    /// [`Error::LeaseLost`] when the record is not that holder's live Pending record at that
    /// phase. The holder's lease is renewed for `lease` with it.
    pub(crate) async fn advance_in(
        &self,
        tx: &mut PgConnection,
        id: &RecordId,
        token: FencingToken,
        from: Option<u16>,
        to: &idempotency_core::store::RecoveryPoint,
        lease: Duration,
    ) -> Result<(), Error> {
        let (Ok(t), Ok(origin)) = (i64::try_from(token.0), i64::try_from(to.origin)) else {
            return Err(Error::LeaseLost { token });
        };
        // Unlike the completion (`complete_locked`), a recovery point is written only to a
        // live record even when the transaction holds its row: a middle phase committed on a
        // record that expired meanwhile would be lost to a fresh claim, which starts the
        // operation over and runs that phase again. The phase rolls back instead.
        let row = sqlx::query(&self.sql.advance)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .bind(t)
            .bind(&to.operation)
            .bind(i32::from(to.phase))
            .bind(origin)
            .bind(&to.state)
            .bind(from.map(i32::from))
            .bind(duration_millis(lease))
            .fetch_optional(&mut *tx)
            .await
            // Nothing commits until the caller commits: a lost connection applied nothing.
            .map_err(|e| map_sqlx(e, &self.qualified, Effect::None))?;
        match row {
            Some(_) => Ok(()),
            None => Err(Error::LeaseLost { token }),
        }
    }

    /// The live operations whose holder is gone that `query` asks for (see
    /// [`RecoveryPoints::abandoned`](idempotency_core::store::RecoveryPoints::abandoned)).
    pub(crate) async fn list_abandoned(
        &self,
        query: &idempotency_core::store::AbandonedQuery,
    ) -> Result<Vec<Result<idempotency_core::store::Abandoned, Error>>, Error> {
        let limit = i64::try_from(query.limit).unwrap_or(i64::MAX);
        let attempts = i32::try_from(query.max_attempts).unwrap_or(i32::MAX);
        // Seconds, at most a century (an interval the server can subtract from now).
        let failed_for = query.failed_for.as_secs_f64().min(3.2e9);
        let rows = self
            .run(Effect::None, OnLoss::Resend, All, || {
                sqlx::query(&self.sql.abandoned)
                    .bind(limit)
                    .bind(&query.operations)
                    .bind(attempts)
                    .bind(failed_for)
            })
            .await?;
        Ok(rows
            .iter()
            .map(|row| {
                idempotency_core::store::Abandoned::from_columns(
                    &get::<String>(row, "scope", &self.qualified)?,
                    &get::<String>(row, "key", &self.qualified)?,
                    &get::<Vec<u8>>(row, "fingerprint", &self.qualified)?,
                    get(row, "op_name", &self.qualified)?,
                    get::<i32>(row, "op_phase", &self.qualified)?.into(),
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
                    .bind(id.scope.as_str())
                    .bind(id.key.as_str())
            })
            .await?;
        let Some(row) = row else { return Ok(None) };
        idempotency_core::store::RecoveryPoint::from_columns(
            &format_args!("the record of {id} in {}", self.qualified),
            get(&row, "op_name", &self.qualified)?,
            get::<Option<i32>>(&row, "op_phase", &self.qualified)?.map(i64::from),
            get(&row, "op_origin", &self.qualified)?,
            get(&row, "op_state", &self.qualified)?,
        )
    }

    /// The first statement of [`crate::PostgresIdempotency`]'s transaction (see `sql::hold`): the
    /// transaction's isolation level and, at REPEATABLE READ or SERIALIZABLE, the record row
    /// locked until the transaction ends, with the lease left on the database clock
    /// (`None`: the record is no longer a live Pending record held by `token`).
    pub(crate) async fn hold_in(
        &self,
        tx: &mut PgConnection,
        id: &RecordId,
        token: FencingToken,
    ) -> Result<Hold, Error> {
        let Ok(t) = i64::try_from(token.0) else {
            return Err(Error::LeaseLost { token });
        };
        let row = sqlx::query(&self.sql.hold)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .bind(t)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| map_sqlx(e, &self.qualified, Effect::None))?;
        let level = Level::parse(&get::<String>(&row, "isolation", &self.qualified)?);
        let left: Option<i64> = get(&row, "lease_left_ms", &self.qualified)?;
        Ok(Hold {
            level,
            lease_left: left.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        })
    }

    /// A connection for one statement or a migration: kept by the store, else from the pool.
    async fn connection(&self) -> Result<Out, sqlx::Error> {
        match &self.kept {
            Some(kept) => kept.checkout().await,
            None => Ok(Out::pooled(self.pool.acquire().await?)),
        }
    }

    /// Begins a transaction on the pool for [`crate::PostgresIdempotency`]. While it waits for a
    /// connection the store gives back the ones it would keep.
    pub(crate) fn begin_transaction(
        &self,
    ) -> impl std::future::Future<Output = Result<sqlx::Transaction<'static, Postgres>, sqlx::Error>>
           + Send
           + 'static {
        let wanted = self.kept.as_ref().map(Kept::begin);
        let pool = self.pool.clone();
        async move {
            let tx = pool.begin().await;
            drop(wanted);
            tx
        }
    }

    /// Runs the statement `query` builds on one connection, re-running it after serialization
    /// failures and deadlocks (the implicit transaction was rolled back, so nothing was
    /// applied). Each attempt takes a connection and, unless its statement completed, gives it
    /// back to the pool, so an attempt after an error runs on another connection.
    ///
    /// A lost connection is most often one that died while it sat idle in the pool: after a
    /// server restart or failover every idle connection is dead, and the pool (which does not
    /// ping before it hands a connection out) would hand them out one by one, each failing
    /// one operation, or each of a completion's retries. So a lost connection first has the
    /// pool's idle connections checked ([`PostgresStore::sweep_idle`]). Then, with
    /// [`OnLoss::Resend`], the statement is sent again on another connection (up to once per
    /// connection the pool can hold, plus one); with [`OnLoss::Report`] (the compare-and-swaps
    /// of a holder, whose caller, the engine, retries them on a pool now clean and reads a
    /// refused retry back) a write's outcome is reported unknown.
    pub(crate) async fn run<'q, X: Fetch>(
        &self,
        effect: Effect,
        on_loss: OnLoss,
        fetch: X,
        mut query: impl FnMut() -> Query<'q, Postgres, PgArguments> + Send,
    ) -> Result<X::Out, Error> {
        let mut attempt = 0u32;
        let mut lost = 0u32;
        let max_lost = self.pool.options().get_max_connections().saturating_add(1);
        // A write whose connection was lost after it was sent may have applied.
        let mut maybe_applied = None;
        loop {
            match self.once(fetch, query()).await {
                Ok(v) => return Ok(v),
                // Not sent again: a partition would hold every attempt as long.
                Err(Attempt::NoAnswer) => return Err(self.no_answer(effect)),
                // No connection, so this statement was never sent.
                Err(Attempt::NotSent(e)) => {
                    return Err(match maybe_applied {
                        Some(lost) => map_sqlx(lost, &self.qualified, Effect::Write),
                        None => map_sqlx(e, &self.qualified, Effect::None),
                    });
                }
                Err(Attempt::Sent(e))
                    if is_serialization_failure(&e) && attempt < self.serialization_retries =>
                {
                    attempt += 1;
                    // Jittered exponential backoff, so the contenders do not collide again.
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
                        return Err(map_sqlx(e, &self.qualified, effect));
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
                    return Err(
                        match (maybe_applied, map_sqlx(e, &self.qualified, effect)) {
                            // An earlier attempt of this write may have applied.
                            (Some(_), e @ Error::Backend { .. }) => Error::OutcomeUnknown {
                                source: Box::new(e),
                            },
                            (_, e) => e,
                        },
                    );
                }
            }
        }
    }

    /// The error of a statement that got no answer within the response timeout: a write's
    /// outcome is unknown, a read is worth trying again.
    pub(crate) fn no_answer(&self, effect: Effect) -> Error {
        let e = PostgresError::NoAnswer {
            after: self.response_timeout,
        };
        match effect {
            Effect::Write => Error::OutcomeUnknown {
                source: Box::new(e),
            },
            Effect::None => e.into(),
        }
    }

    /// Checks the pool's idle connections after a lost one: each gets a ping (at most
    /// [`SWEEP_PING`] each, all at once), and those that do not answer are closed, so the
    /// next operations get live or fresh connections. Costs nothing until a connection is
    /// lost; a connection the store keeps between operations goes back to the pool on its own
    /// error.
    pub(crate) async fn sweep_idle(&self) {
        let mut idle = Vec::new();
        while let Some(conn) = self.pool.try_acquire() {
            idle.push(conn);
        }
        let checked = idle.len();
        let dead = futures::future::join_all(idle.into_iter().map(|mut conn| async move {
            let alive = matches!(
                tokio::time::timeout(SWEEP_PING, conn.ping()).await,
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
        query: Query<'q, Postgres, PgArguments>,
    ) -> Result<X::Out, Attempt> {
        let mut out = self.connection().await.map_err(Attempt::NotSent)?;
        // Dropped mid-statement (the operation was cancelled) or on an error, `out` gives the
        // connection back to the pool, whose release ping or clean-up deals with its state.
        // One stuck past the response timeout is closed: its answer may still come.
        let answer = tokio::time::timeout(self.response_timeout, fetch.run(query, out.conn()));
        let Ok(done) = answer.await else {
            out.discard();
            return Err(Attempt::NoAnswer);
        };
        let done = done.map_err(Attempt::Sent)?;
        out.done();
        Ok(done)
    }

    /// A CAS statement that returns the token when it applied.
    async fn cas(&self, sql: &str, binds: CasBinds<'_>) -> Result<Cas, Error> {
        let Ok(token) = i64::try_from(binds.token.0) else {
            // No stored record can hold a token above i64::MAX.
            return Ok(Cas::Fenced);
        };
        let row = self
            .run(Effect::Write, OnLoss::Report, Optional, || {
                let q = sqlx::query(sql)
                    .bind(binds.id.scope.as_str())
                    .bind(binds.id.key.as_str())
                    .bind(token);
                match binds.extra {
                    Extra::Complete { outcome, ttl_ms } => q.bind(outcome).bind(ttl_ms),
                    Extra::Fail {
                        retryable,
                        message,
                        ttl_ms,
                    } => q.bind(retryable).bind(message).bind(ttl_ms),
                    Extra::Extend { lease_ms } => q.bind(lease_ms),
                }
            })
            .await?;
        Ok(if row.is_some() {
            Cas::Applied
        } else {
            Cas::Fenced
        })
    }
}

/// How [`PostgresStore::run`] runs a statement on a connection, and what it returns.
pub(crate) trait Fetch: Copy + Send {
    type Out: Send;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, Postgres, PgArguments>,
        conn: &'e mut PgConnection,
    ) -> BoxFuture<'e, Result<Self::Out, sqlx::Error>>;
}

/// Exactly one row.
#[derive(Clone, Copy)]
struct One;

/// At most one row.
#[derive(Clone, Copy)]
struct Optional;

/// Every row.
#[derive(Clone, Copy)]
pub(crate) struct All;

impl Fetch for All {
    type Out = Vec<PgRow>;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, Postgres, PgArguments>,
        conn: &'e mut PgConnection,
    ) -> BoxFuture<'e, Result<Vec<PgRow>, sqlx::Error>> {
        Box::pin(query.fetch_all(conn))
    }
}

/// No rows: the rows affected.
#[derive(Clone, Copy)]
struct Execute;

impl Fetch for One {
    type Out = PgRow;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, Postgres, PgArguments>,
        conn: &'e mut PgConnection,
    ) -> BoxFuture<'e, Result<PgRow, sqlx::Error>> {
        Box::pin(query.fetch_one(conn))
    }
}

impl Fetch for Optional {
    type Out = Option<PgRow>;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, Postgres, PgArguments>,
        conn: &'e mut PgConnection,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>> {
        Box::pin(query.fetch_optional(conn))
    }
}

impl Fetch for Execute {
    type Out = PgQueryResult;
    fn run<'q: 'e, 'e>(
        self,
        query: Query<'q, Postgres, PgArguments>,
        conn: &'e mut PgConnection,
    ) -> BoxFuture<'e, Result<PgQueryResult, sqlx::Error>> {
        Box::pin(query.execute(conn))
    }
}

/// How a transaction's isolation level matters to [`crate::PostgresIdempotency`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Level {
    /// READ COMMITTED (or READ UNCOMMITTED, which PostgreSQL runs as READ COMMITTED): each
    /// statement sees the latest committed row, so the completion is not disturbed by
    /// heartbeats committed meanwhile.
    ReadCommitted,
    /// REPEATABLE READ or SERIALIZABLE: one snapshot for the whole transaction, so a row
    /// another session changed after it was taken cannot be updated (40001).
    Snapshot,
}

impl Level {
    fn parse(setting: &str) -> Self {
        match setting {
            "read committed" | "read uncommitted" => Self::ReadCommitted,
            _ => Self::Snapshot,
        }
    }
}

/// What the store knows of its sessions' isolation level, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct LevelCache(AtomicU8);

impl LevelCache {
    const UNKNOWN: u8 = 0;
    const READ_COMMITTED: u8 = 1;
    const SNAPSHOT: u8 = 2;

    pub(crate) fn get(&self) -> Option<Level> {
        match self.0.load(Ordering::Relaxed) {
            Self::READ_COMMITTED => Some(Level::ReadCommitted),
            Self::SNAPSHOT => Some(Level::Snapshot),
            _ => None,
        }
    }

    pub(crate) fn set(&self, level: Level) {
        let v = match level {
            Level::ReadCommitted => Self::READ_COMMITTED,
            Level::Snapshot => Self::SNAPSHOT,
        };
        self.0.store(v, Ordering::Relaxed);
    }

    pub(crate) fn forget(&self) {
        self.0.store(Self::UNKNOWN, Ordering::Relaxed);
    }
}

/// What [`PostgresStore::hold_in`] found.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hold {
    /// The transaction's isolation level.
    pub level: Level,
    /// At [`Level::Snapshot`]: the lease left on the locked record; `None` when the record is
    /// no longer held by the token (or, at [`Level::ReadCommitted`], always: nothing locked).
    pub lease_left: Option<Duration>,
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
impl IdempotencyStore for PostgresStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let lease_ms = duration_millis(request.lease);
        let hold_ms = duration_millis(claim_retention(request.lease, request.ttl));
        let row = self
            .run(Effect::Write, OnLoss::Resend, One, || {
                let sql = match request.count_hit {
                    true => &self.sql.claim,
                    false => &self.sql.observe,
                };
                sqlx::query(sql)
                    .bind(request.id.scope.as_str())
                    .bind(request.id.key.as_str())
                    .bind(&request.fingerprint.as_bytes()[..])
                    .bind(lease_ms)
                    .bind(hold_ms)
            })
            .await?;
        crate::batch::claim_answer(&row, request, &self.qualified)
    }

    async fn claim_many(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
        self.claim_batch(requests).await
    }

    async fn settle_many(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
        self.settle_batch(settlements).await
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
        let Ok(expected) = i64::try_from(expected.0) else {
            return Ok(Reclaim::Lost);
        };
        let (lease_ms, hold_ms) = (
            duration_millis(lease),
            duration_millis(claim_retention(lease, ttl)),
        );
        let row = self
            .run(Effect::Write, OnLoss::Report, Optional, || {
                sqlx::query(&self.sql.reclaim)
                    .bind(id.scope.as_str())
                    .bind(id.key.as_str())
                    .bind(expected)
                    .bind(&fingerprint.as_bytes()[..])
                    .bind(lease_ms)
                    .bind(hold_ms)
            })
            .await?;
        let Some(row) = row else {
            return Ok(Reclaim::Lost);
        };
        let table = &*self.qualified;
        let token: i64 = get(&row, "token", table)?;
        let lease_until: Option<i64> = get(&row, "lease_until_ms", table)?;
        match (u64::try_from(token), lease_until) {
            (Ok(token), Some(lease_until)) => Ok(Reclaim::Reclaimed {
                token: FencingToken(token),
                lease_until: Timestamp::from_millis(lease_until),
            }),
            _ => Err(Error::corrupt(format!(
                "reclaimed record {id} came back without a valid token or lease"
            ))),
        }
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let row = self
            .run(Effect::None, OnLoss::Resend, Optional, || {
                sqlx::query(&self.sql.get)
                    .bind(id.scope.as_str())
                    .bind(id.key.as_str())
            })
            .await?;
        row.map(|row| decode_record(&row, id, &self.qualified))
            .transpose()
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        if batch == 0 {
            return Ok(0);
        }
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let done = self
            .run(Effect::Write, OnLoss::Resend, Execute, || {
                sqlx::query(&self.sql.purge).bind(limit)
            })
            .await?;
        Ok(done.rows_affected())
    }
}
