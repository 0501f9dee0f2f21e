//! The store: its handle, the `IdempotencyStore` operations and the compare-and-swap they share.

use crate::decode::decode_record;
use crate::error::SqliteError;
use crate::exec::{Executor, WriteStats};
use crate::schema;
use crate::sql::Sql;
use async_trait::async_trait;
use idempotency_core::store::{
    claim_retention, Cas, Claim, ClaimRequest, Clock, Failure, Reclaim, Record, RecordStatus,
    Settle, Settlement, Timestamp,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use rusqlite::{params, Connection, ToSql, Transaction};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How SQLite syncs the write-ahead log to disk (`PRAGMA synchronous`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Synchronous {
    /// `FULL` (the default): every commit is synced before it returns, so an acknowledged
    /// claim or completion survives a power loss or OS crash, not only an application crash.
    #[default]
    Full,
    /// `NORMAL`: commits survive an application crash, but the last transactions before a
    /// power loss or OS crash may roll back. Faster; choose it knowingly.
    Normal,
}

impl Synchronous {
    /// The statement that sets this level on a connection.
    pub(crate) fn statement(self) -> &'static str {
        match self {
            Self::Full => "PRAGMA synchronous = FULL",
            Self::Normal => "PRAGMA synchronous = NORMAL",
        }
    }

    pub(crate) fn pragma(self) -> &'static str {
        match self {
            Self::Full => "FULL",
            Self::Normal => "NORMAL",
        }
    }
}

/// An [`IdempotencyStore`] in an SQLite database file.
///
/// Cloning is cheap and shares the connection(s). See the crate documentation for the
/// guarantees and the exactly-once API ([`SqliteStore::complete_in`],
/// [`SqliteIdempotency::run_in_transaction`](crate::SqliteIdempotency::run_in_transaction)).
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) exec: Executor,
    pub(crate) sql: Sql,
    pub(crate) table: String,
    pub(crate) path: PathBuf,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) synchronous: Synchronous,
}

impl SqliteStore {
    /// Opens the database file at `path` with the default settings. Does not create the
    /// table: call [`SqliteStore::migrate`].
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, SqliteError> {
        Self::builder(path).open().await
    }

    /// Creates or upgrades the table with the migrations embedded in this crate, then checks
    /// its shape. Idempotent, and safe to run from several processes at once. A table of the
    /// same name with another shape gets [`SqliteError::TableShape`] and is left alone.
    pub async fn migrate(&self) -> Result<(), SqliteError> {
        let inner = self.inner.clone();
        self.inner
            .exec
            .run(move |conn| schema::migrate(conn, &inner.table))
            .await?
    }

    /// Checks that the table exists and has this crate's schema, without changing anything.
    pub async fn verify(&self) -> Result<(), SqliteError> {
        let inner = self.inner.clone();
        self.inner
            .exec
            .run(move |conn| schema::verify(conn, &inner.table))
            .await?
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// How many store writes this store (and its clones) committed, and in how many
    /// transactions. On the dedicated connection thread, writes queued while a transaction
    /// commits share the next one (group commit, one sync for all of them), so
    /// `writes / transactions` is the average batch.
    pub fn write_stats(&self) -> WriteStats {
        self.inner.exec.write_stats()
    }

    /// Runs `f` with one of the store's connections, off the async runtime: for your own
    /// schema setup, reads and business transactions on the same file. Start write
    /// transactions with `TransactionBehavior::Immediate` (see the crate docs). A panic in `f`
    /// is resumed in the caller.
    pub async fn call<R, F>(&self, f: F) -> Result<R, SqliteError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection) -> R + Send + 'static,
    {
        self.inner.exec.run(f).await
    }

    /// The completion compare-and-swap, run inside the caller's transaction `tx` on this
    /// database: if `token` still holds `id` (live, Pending), marks it Completed with
    /// `outcome` and `expires_at = now + ttl`, as [`IdempotencyStore::complete`] does.
    ///
    /// Otherwise returns [`Error::LeaseLost`] and writes nothing: drop `tx` (it rolls back,
    /// taking your business writes with it) and return the error. Nothing becomes visible
    /// until you commit `tx`; once you have, call
    /// [`idempotency_core::protocol::Lease::settled_externally`].
    pub fn complete_in(
        &self,
        tx: &Transaction<'_>,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let now = self.inner.clock.now();
        match self.inner.complete_cas(tx, id, token, outcome, ttl, now)? {
            Cas::Applied => Ok(()),
            Cas::Fenced => Err(Error::LeaseLost { token }),
        }
    }

    /// Moves the recovery point of `id`'s record held by `token` from phase `from` (`None`:
    /// it has none) to `to`, inside the caller's open transaction `tx`, for
    /// [`RecoveryPoints::advance_in`](idempotency_core::store::RecoveryPoints::advance_in).
    /// [`Error::LeaseLost`] when the record is not that holder's live Pending record at that
    /// phase.
    pub fn advance_in(
        &self,
        tx: &Transaction<'_>,
        id: &RecordId,
        token: FencingToken,
        from: Option<u16>,
        to: &idempotency_core::store::RecoveryPoint,
    ) -> Result<(), Error> {
        let now = self.inner.clock.now();
        let Ok(origin) = i64::try_from(to.origin) else {
            return Err(Error::Config(format!(
                "a recovery point's origin token {} does not fit SQLite's INTEGER",
                to.origin
            )));
        };
        let cas = self.inner.cas(
            tx,
            &self.inner.sql.advance,
            id,
            token,
            now,
            &[&to.operation, &to.phase, &origin, &to.state, &from],
        )?;
        match cas {
            Cas::Applied => Ok(()),
            Cas::Fenced => Err(Error::LeaseLost { token }),
        }
    }

    /// The recovery point of `id`'s live record, if it has one.
    pub(crate) async fn read_recovery_point(
        &self,
        id: &RecordId,
    ) -> Result<Option<idempotency_core::store::RecoveryPoint>, Error> {
        let id = id.clone();
        let inner = self.inner.clone();
        self.inner
            .exec
            .run(move |conn| inner.read_point(conn, &id, inner.clock.now()))
            .await?
    }

    /// The live operations whose holder is gone that `query` asks for (see
    /// [`RecoveryPoints::abandoned`](idempotency_core::store::RecoveryPoints::abandoned)).
    pub(crate) async fn list_abandoned(
        &self,
        query: &idempotency_core::store::AbandonedQuery,
    ) -> Result<Vec<Result<idempotency_core::store::Abandoned, Error>>, Error> {
        let inner = self.inner.clone();
        let query = query.clone();
        self.inner
            .exec
            .run(move |conn| inner.read_abandoned(conn, inner.clock.now(), &query))
            .await?
    }

    async fn write<R, F>(&self, f: F) -> Result<R, Error>
    where
        R: Send + 'static,
        F: FnOnce(&Inner, &Connection, Timestamp) -> Result<R, Error> + Send + 'static,
    {
        let inner = self.inner.clone();
        self.inner
            .exec
            .write(move |conn| {
                // Read the clock only once the write lock is held, so writers across
                // processes see time move forward in commit order.
                let now = inner.clock.now();
                f(&inner, conn, now)
            })
            .await
    }
}

#[async_trait]
impl IdempotencyStore for SqliteStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let mut request = request.clone();
        if !request.count_hit || self.inner.synchronous == Synchronous::Full {
            // Read first: a claim of a live record (a replay, a duplicate) is a pure read, or
            // only counts a hit, which is committed without a sync (see `observe`).
            let inner = self.inner.clone();
            let (returned, seen) = self
                .inner
                .exec
                .run(move |conn| {
                    let seen = inner.observe(conn, &request);
                    (request, seen)
                })
                .await?;
            if let Some(claim) = seen? {
                return Ok(claim);
            }
            request = returned;
        }
        self.write(move |inner, tx, now| inner.claim(tx, &request, now))
            .await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let (id, outcome) = (id.clone(), outcome.to_vec());
        self.write(move |inner, tx, now| inner.complete_cas(tx, &id, token, &outcome, ttl, now))
            .await
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let (id, failure) = (id.clone(), failure.clone());
        self.write(move |inner, tx, now| {
            let expires_at = now.saturating_add(ttl).as_millis();
            let extra: [&dyn ToSql; 3] = [&failure.retryable, &failure.message, &expires_at];
            inner.cas(tx, &inner.sql.fail, &id, token, now, &extra)
        })
        .await
    }

    /// The whole batch in one write transaction (on the dedicated thread, shared with the
    /// writes queued behind it): each claim in its own savepoint, in the batch's order, so a
    /// key named twice is claimed by its first request and found by the next, and one
    /// claim's error undoes only its own writes. One sync commits them all. A claim that
    /// does not count hits only reads a live record, as alone.
    async fn claim_many(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
        if requests.is_empty() {
            return Vec::new();
        }
        let (n, requests) = (requests.len(), requests.to_vec());
        let answers = self
            .write(move |inner, tx, now| {
                inner.each_in_savepoint(tx, &requests, |req| {
                    if !req.count_hit {
                        if let Some(record) = inner.read_live(tx, &req.id, now)? {
                            return Ok(Claim::Existing { record, now });
                        }
                    }
                    inner.claim(tx, req, now)
                })
            })
            .await;
        answers.unwrap_or_else(|e| e.for_each_of(n).into_iter().map(Err).collect())
    }

    /// The whole batch in one write transaction, each settlement in its own savepoint, in
    /// the batch's order; one sync commits them all.
    async fn settle_many(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
        if settlements.is_empty() {
            return Vec::new();
        }
        let (n, settlements) = (settlements.len(), settlements.to_vec());
        let answers = self
            .write(move |inner, tx, now| {
                inner.each_in_savepoint(tx, &settlements, |s| {
                    let expires_at = now.saturating_add(s.ttl).as_millis();
                    match &s.settle {
                        Settle::Complete(outcome) => {
                            inner.complete_cas(tx, &s.id, s.token, outcome, s.ttl, now)
                        }
                        Settle::Fail(failure) => {
                            let extra: [&dyn ToSql; 3] =
                                [&failure.retryable, &failure.message, &expires_at];
                            inner.cas(tx, &inner.sql.fail, &s.id, s.token, now, &extra)
                        }
                    }
                })
            })
            .await;
        answers.unwrap_or_else(|e| e.for_each_of(n).into_iter().map(Err).collect())
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        let id = id.clone();
        self.write(move |inner, tx, now| {
            let lease_until = now.saturating_add(lease).as_millis();
            inner.cas(tx, &inner.sql.extend, &id, token, now, &[&lease_until])
        })
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
        // A token above i64::MAX cannot be stored, so no record holds it.
        let Some(stored_token) = token_param(expected) else {
            return Ok(Reclaim::Lost);
        };
        let (id, fingerprint) = (id.clone(), *fingerprint);
        self.write(move |inner, tx, now| {
            let lease_until = now.saturating_add(lease);
            let n = inner.exec_cached(
                tx,
                &inner.sql.reclaim,
                params![
                    id.scope.as_str(),
                    id.key.as_str(),
                    stored_token,
                    now.as_millis(),
                    fingerprint.as_bytes().as_slice(),
                    lease_until.as_millis(),
                    now.saturating_add(claim_retention(lease, ttl)).as_millis()
                ],
            )?;
            Ok(match n {
                0 => Reclaim::Lost,
                _ => Reclaim::Reclaimed {
                    token: expected.next(),
                    lease_until,
                },
            })
        })
        .await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let id = id.clone();
        let inner = self.inner.clone();
        self.inner
            .exec
            .run(move |conn| inner.read_live(conn, &id, inner.clock.now()))
            .await?
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        self.write(move |inner, tx, now| {
            let n = inner.exec_cached(tx, &inner.sql.purge, params![now.as_millis(), batch])?;
            Ok(n as u64)
        })
        .await
    }
}

/// The token of a record claimed fresh at `now`: the clock in microseconds, so a key whose row
/// was purged never gets back a token an old holder may still have (the statement also keeps
/// it above the token of an expired row it replaces).
fn fresh_token(now: Timestamp) -> i64 {
    i64::try_from(FencingToken::fresh(now, None).0).unwrap_or(i64::MAX)
}

/// The token as the table stores it; `None` for a token above `i64::MAX`, which no record can
/// hold.
fn token_param(token: FencingToken) -> Option<i64> {
    i64::try_from(token.0).ok()
}

impl Inner {
    pub(crate) fn sql_error(&self, e: rusqlite::Error) -> Error {
        if let rusqlite::Error::SqliteFailure(f, msg) = &e {
            // Every row this store writes satisfies the table's constraints; a statement that
            // keeps a stored value and fails one found a corrupt record.
            if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_CHECK
                || f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_NOTNULL
            {
                let reason = format!(
                    "a stored record breaks the table's constraints ({})",
                    msg.as_deref().unwrap_or("constraint failed")
                );
                return Error::corrupt_with(reason, e);
            }
        }
        if let rusqlite::Error::SqliteFailure(_, Some(msg)) = &e {
            if msg.starts_with("no such table") {
                return SqliteError::MissingTable {
                    table: self.table.clone(),
                }
                .into();
            }
        }
        SqliteError::from(e).into()
    }

    fn exec_cached(
        &self,
        tx: &Connection,
        sql: &str,
        params: impl rusqlite::Params,
    ) -> Result<usize, Error> {
        tx.prepare_cached(sql)
            .and_then(|mut s| s.execute(params))
            .map_err(|e| self.sql_error(e))
    }

    fn claim(&self, tx: &Connection, req: &ClaimRequest, now: Timestamp) -> Result<Claim, Error> {
        let lease_until = now.saturating_add(req.lease);
        let expires_at = req.expires_at(now);
        let mut stmt = tx
            .prepare_cached(&self.sql.claim)
            .map_err(|e| self.sql_error(e))?;
        let mut rows = stmt
            .query(params![
                req.id.scope.as_str(),
                req.id.key.as_str(),
                req.fingerprint.as_bytes().as_slice(),
                lease_until.as_millis(),
                now.as_millis(),
                expires_at.as_millis(),
                fresh_token(now)
            ])
            .map_err(|e| self.sql_error(e))?;
        let row = rows
            .next()
            .map_err(|e| self.sql_error(e))?
            .ok_or_else(|| Error::corrupt("claim returned no row"))?;
        // The statement sets hits to 0 exactly when it inserted or replaced the record; a
        // live record comes back with hits + 1 >= 1 (a corrupt negative count becomes NULL,
        // which the NOT NULL constraint refuses, so it cannot pass for a fresh claim).
        let record = decode_record(row)?;
        if record.hits == 0 {
            if record.status != RecordStatus::Pending || record.lease_until != Some(lease_until) {
                return Err(Error::corrupt(format!(
                    "record {} came back from a claim with hits = 0 but is not the claimed one",
                    record.id
                )));
            }
            return Ok(Claim::Claimed {
                token: record.token,
                lease_until,
            });
        }
        Ok(Claim::Existing { record, now })
    }

    /// Runs `f` on each item in turn, each in its own savepoint inside the transaction `tx`:
    /// an item whose `f` fails has its writes rolled back, the others keep theirs. `Err` only
    /// when a savepoint cannot be opened or closed (the transaction is then in doubt, and the
    /// whole batch is answered with the error).
    fn each_in_savepoint<T, R>(
        &self,
        tx: &Connection,
        items: &[T],
        mut f: impl FnMut(&T) -> Result<R, Error>,
    ) -> Result<Vec<Result<R, Error>>, Error> {
        let exec = |sql: &str| {
            tx.prepare_cached(sql)
                .and_then(|mut s| s.execute([]))
                .map_err(|e| self.sql_error(e))
        };
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            exec("SAVEPOINT batch_item")?;
            let answer = f(item);
            if tx.is_autocommit() {
                // SQLite rolled the whole transaction back (an I/O error, a full disk): stop
                // here, before a savepoint would open a transaction of its own.
                return Err(answer.err().unwrap_or_else(|| {
                    Error::backend(true, "the batch's transaction was rolled back")
                }));
            }
            if answer.is_err() {
                exec("ROLLBACK TO batch_item")?;
            }
            exec("RELEASE batch_item")?;
            out.push(answer);
        }
        Ok(out)
    }

    /// The abandoned operations `query` asks for, each row read on its own: one that does
    /// not read back is listed as its error.
    fn read_abandoned(
        &self,
        conn: &Connection,
        now: Timestamp,
        query: &idempotency_core::store::AbandonedQuery,
    ) -> Result<Vec<Result<idempotency_core::store::Abandoned, Error>>, Error> {
        let limit = i64::try_from(query.limit).unwrap_or(i64::MAX);
        let operations =
            serde_json::to_string(&query.operations).map_err(|source| Error::Codec { source })?;
        let failed_before = now
            .as_millis()
            .saturating_sub(i64::try_from(query.failed_for.as_millis()).unwrap_or(i64::MAX));
        let mut stmt = conn
            .prepare_cached(&self.sql.abandoned)
            .map_err(|e| self.sql_error(e))?;
        let rows = stmt
            .query_map(
                params![
                    now.as_millis(),
                    limit,
                    operations,
                    i64::from(query.max_attempts),
                    failed_before
                ],
                |r| {
                    let row = (|| -> rusqlite::Result<(String, String, Vec<u8>, String, i64)> {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                    })();
                    Ok(row)
                },
            )
            .map_err(|e| self.sql_error(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.sql_error(e))?;
        Ok(rows
            .into_iter()
            .map(|row| {
                let (scope, key, fingerprint, operation, phase) =
                    row.map_err(|e| Error::CorruptRecord {
                        reason: format!("an abandoned operation in {:?}", self.table),
                        source: Some(Box::new(e)),
                    })?;
                idempotency_core::store::Abandoned::from_columns(
                    &scope,
                    &key,
                    &fingerprint,
                    operation,
                    phase,
                )
            })
            .collect())
    }

    fn read_point(
        &self,
        conn: &Connection,
        id: &RecordId,
        now: Timestamp,
    ) -> Result<Option<idempotency_core::store::RecoveryPoint>, Error> {
        use rusqlite::OptionalExtension;
        type Row = (Option<String>, Option<i64>, Option<i64>, Option<Vec<u8>>);
        let mut stmt = conn
            .prepare_cached(&self.sql.point)
            .map_err(|e| self.sql_error(e))?;
        let row: Option<Row> = stmt
            .query_row(
                params![id.scope.as_str(), id.key.as_str(), now.as_millis()],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .optional()
            .map_err(|e| self.sql_error(e))?;
        match row {
            None => Ok(None),
            Some((operation, phase, origin, state)) => {
                idempotency_core::store::RecoveryPoint::from_columns(
                    &format_args!("the record of {id}"),
                    operation,
                    phase,
                    origin,
                    state,
                )
            }
        }
    }

    fn read_live(
        &self,
        conn: &Connection,
        id: &RecordId,
        now: Timestamp,
    ) -> Result<Option<Record>, Error> {
        self.query_record(conn, &self.sql.get, id, now)
    }

    /// The one record `sql` returns for `?1` scope, `?2` key and `?3` now, or `None`.
    fn query_record(
        &self,
        conn: &Connection,
        sql: &str,
        id: &RecordId,
        now: Timestamp,
    ) -> Result<Option<Record>, Error> {
        let mut stmt = conn.prepare_cached(sql).map_err(|e| self.sql_error(e))?;
        let mut rows = stmt
            .query(params![id.scope.as_str(), id.key.as_str(), now.as_millis()])
            .map_err(|e| self.sql_error(e))?;
        match rows.next().map_err(|e| self.sql_error(e))? {
            Some(row) => decode_record(row).map(Some),
            None => Ok(None),
        }
    }

    /// The claim of a live record, whose only write is `hits + 1`, committed without a sync:
    /// a replay must not cost a durable write.
    ///
    /// A plain `SELECT` (no lock) looks for a live record; when there is one, the increment
    /// runs in its own `BEGIN IMMEDIATE` transaction with `PRAGMA synchronous = NORMAL` for
    /// that transaction alone (the pragma cannot change inside a transaction, so it is set
    /// around it and always put back). In WAL mode NORMAL appends the commit to the log
    /// without an fsync, and still syncs before and after a checkpoint, so it cannot expose
    /// earlier synced commits to loss. A power loss or OS crash (not an application crash)
    /// may forget the last hit counts; a claim, completion or failure is always synced,
    /// and its sync also covers every hit appended before it.
    ///
    /// A claim that does not count hits ([`ClaimRequest::count_hit`] `false`) stops at a read
    /// of the live record: no transaction, no write.
    ///
    /// Returns `None` when there is no live record (or it expired or was purged between the
    /// read and the lock): the caller then claims under `synchronous = FULL`, and that
    /// statement still decides between a new claim and an observation.
    fn observe(&self, conn: &Connection, req: &ClaimRequest) -> Result<Option<Claim>, Error> {
        let id = &req.id;
        if !req.count_hit {
            let now = self.clock.now();
            return Ok(self
                .read_live(conn, id, now)?
                .map(|record| Claim::Existing { record, now }));
        }
        let live = conn
            .prepare_cached(&self.sql.live)
            .and_then(|mut s| {
                s.exists(params![
                    id.scope.as_str(),
                    id.key.as_str(),
                    self.clock.now().as_millis()
                ])
            })
            .map_err(|e| self.sql_error(e))?;
        if !live {
            return Ok(None);
        }
        // Every statement of this path is prepared once per connection (`prepare_cached`):
        // parsing the pragmas, BEGIN and COMMIT on every replay cost more than the update.
        let exec = |sql: &str| {
            conn.prepare_cached(sql)
                .and_then(|mut s| s.execute([]))
                .map_err(|e| self.sql_error(e))
        };
        exec("PRAGMA synchronous = NORMAL")?;
        // Puts FULL back (and ends a transaction left open) if what follows panics: the
        // executor keeps the connection.
        struct Restore<'c>(&'c Connection);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                if !self.0.is_autocommit() {
                    let _ = self.0.execute_batch("ROLLBACK");
                }
                let _ = self
                    .0
                    .pragma_update(None, "synchronous", Synchronous::Full.pragma());
            }
        }
        let guard = Restore(conn);
        let hit = (|| -> Result<Option<Claim>, Error> {
            exec("BEGIN IMMEDIATE")?;
            let now = self.clock.now();
            let record = self.query_record(conn, &self.sql.hit, id, now);
            match record {
                Ok(Some(record)) => {
                    exec("COMMIT")?;
                    Ok(Some(Claim::Existing { record, now }))
                }
                // Nothing was written (or the write failed): roll back.
                other => {
                    exec("ROLLBACK")?;
                    other.map(|_| None)
                }
            }
        })();
        if !conn.is_autocommit() {
            // A COMMIT or ROLLBACK that failed: end the transaction before anything else runs.
            let _ = conn.execute_batch("ROLLBACK");
        }
        // Put FULL back here, where a failure can be reported; the guard is then not needed.
        let restored = exec("PRAGMA synchronous = FULL");
        std::mem::forget(guard);
        let hit = hit?;
        restored?;
        Ok(hit)
    }

    /// The compare-and-swap of complete, fail and extend: runs `sql`, an update under the
    /// shared guard of [`Sql`] (`?1` scope, `?2` key, `?3` token, `?4` now), with `extra` bound from `?5`
    /// on. Applied when it changed the row: the token still held the live Pending record.
    fn cas(
        &self,
        tx: &Connection,
        sql: &str,
        id: &RecordId,
        token: FencingToken,
        now: Timestamp,
        extra: &[&dyn ToSql],
    ) -> Result<Cas, Error> {
        // A token above i64::MAX cannot be stored, so no record holds it.
        let Some(stored_token) = token_param(token) else {
            return Ok(Cas::Fenced);
        };
        let now_ms = now.as_millis();
        let head: [&dyn ToSql; 4] = [&id.scope.as_str(), &id.key.as_str(), &stored_token, &now_ms];
        let params: Vec<&dyn ToSql> = head.iter().chain(extra).copied().collect();
        Ok(match self.exec_cached(tx, sql, params.as_slice())? {
            0 => Cas::Fenced,
            _ => Cas::Applied,
        })
    }

    /// The completion CAS, in the store's own transaction or in the caller's
    /// ([`SqliteStore::complete_in`]).
    fn complete_cas(
        &self,
        tx: &Connection,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
        now: Timestamp,
    ) -> Result<Cas, Error> {
        let expires_at = now.saturating_add(ttl).as_millis();
        self.cas(
            tx,
            &self.sql.complete,
            id,
            token,
            now,
            &[&outcome, &expires_at],
        )
    }
}
