#![doc = include_str!("../README.md")]

mod error;
mod exactly_once;
mod exec;
mod schema;

pub use error::{is_busy_error, SqliteError};
/// The driver this store runs on, re-exported so your business code uses the same version.
pub use rusqlite;
pub use schema::{validate_table_name, MAX_TABLE_NAME_LEN, SCHEMA_VERSION};

use async_trait::async_trait;
use exec::Executor;
use idempotency_core::{
    claim_retention, Cas, Claim, ClaimRequest, Clock, Error, Failure, FencingToken, Fingerprint,
    IdempotencyKey, IdempotencyStore, Reclaim, Record, RecordId, RecordStatus, Scope, SystemClock,
    Timestamp,
};
use rusqlite::{params, Connection, OpenFlags, Row, Transaction, TransactionBehavior};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The default table name.
pub const DEFAULT_TABLE: &str = "idempotency_records";

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
    fn pragma(self) -> &'static str {
        match self {
            Self::Full => "FULL",
            Self::Normal => "NORMAL",
        }
    }
}

/// How the store keeps SQLite's blocking calls off the async runtime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionMode {
    /// One connection on a dedicated OS thread; calls queue on a channel (the default).
    /// SQLite admits one writer at a time anyway, so a single connection loses little and
    /// never waits on its own process's locks.
    #[default]
    DedicatedThread,
    /// `connections` connections used through `tokio::task::spawn_blocking`. Reads (`get`)
    /// and your own closures run in parallel; writes still take turns on the file lock.
    BlockingPool {
        /// How many connections to open (at least 1).
        connections: usize,
    },
}

/// Configures and opens a [`SqliteStore`].
#[derive(Clone, Debug)]
pub struct SqliteStoreBuilder {
    path: PathBuf,
    table: String,
    synchronous: Synchronous,
    busy_timeout: Duration,
    mode: ConnectionMode,
    clock: Arc<dyn Clock>,
}

impl SqliteStoreBuilder {
    /// The table to keep records in (default [`DEFAULT_TABLE`]); checked by
    /// [`validate_table_name`] when the store opens.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// `PRAGMA synchronous` (default [`Synchronous::Full`]).
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How long a write waits for another connection's lock before failing with
    /// `SQLITE_BUSY` (default 10 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Dedicated thread or blocking pool (default [`ConnectionMode::DedicatedThread`]).
    pub fn mode(mut self, mode: ConnectionMode) -> Self {
        self.mode = mode;
        self
    }

    /// The clock that decides leases and expiry (default: the system clock). All processes
    /// sharing a database file should use the same host clock.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Opens the database (creating the file when missing), switches it to WAL and applies
    /// the settings. Does not create the table: call [`SqliteStore::migrate`].
    pub async fn open(self) -> Result<SqliteStore, SqliteError> {
        validate_table_name(&self.table)?;
        let settings = OpenSettings {
            path: self.path.clone(),
            synchronous: self.synchronous,
            busy_timeout: self.busy_timeout,
        };
        let exec = match self.mode {
            ConnectionMode::DedicatedThread => {
                Executor::thread(format!("sqlite-{}", self.table), move || {
                    open_connection(&settings)
                })
                .await?
            }
            ConnectionMode::BlockingPool { connections } => {
                if connections == 0 {
                    return Err(SqliteError::Config(
                        "a blocking pool needs at least one connection".into(),
                    ));
                }
                Executor::pool(connections, move || open_connection(&settings)).await?
            }
        };
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                exec,
                sql: Sql::new(&self.table),
                table: self.table,
                path: self.path,
                clock: self.clock,
                synchronous: self.synchronous,
            }),
        })
    }
}

#[derive(Clone, Debug)]
struct OpenSettings {
    path: PathBuf,
    synchronous: Synchronous,
    busy_timeout: Duration,
}

fn open_connection(s: &OpenSettings) -> Result<Connection, SqliteError> {
    let path = &s.path;
    let not_writable = |source: rusqlite::Error| SqliteError::NotWritable {
        path: path.clone(),
        reason: source.to_string(),
        source: Some(source),
    };
    let classify = |e: rusqlite::Error| {
        use rusqlite::ErrorCode as C;
        match error::code(&e) {
            Some(C::NotADatabase) => SqliteError::NotADatabase {
                path: path.clone(),
                source: e,
            },
            Some(C::CannotOpen | C::ReadOnly | C::PermissionDenied | C::SystemIoFailure) => {
                not_writable(e)
            }
            _ => SqliteError::Sqlite(e),
        }
    };
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(classify)?;
    conn.busy_timeout(s.busy_timeout).map_err(classify)?;
    // SQLite falls back to read-only when it may not write the file.
    if conn
        .is_readonly(rusqlite::DatabaseName::Main)
        .map_err(classify)?
    {
        return Err(SqliteError::NotWritable {
            path: path.clone(),
            reason: "the file is read-only".into(),
            source: None,
        });
    }
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(classify)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(SqliteError::Config(format!(
            "{} cannot use write-ahead logging (journal mode stayed {mode:?}); the store needs \
             a file on a local file system",
            path.display()
        )));
    }
    conn.pragma_update(None, "synchronous", s.synchronous.pragma())
        .map_err(classify)?;
    // Prove the file and its directory (for the -wal and -shm files) can be written now,
    // rather than at the first claim: an immediate transaction takes the write lock.
    conn.execute_batch("BEGIN IMMEDIATE; COMMIT;")
        .map_err(classify)?;
    Ok(conn)
}

/// An [`IdempotencyStore`] in an SQLite database file.
///
/// Cloning is cheap and shares the connection(s). See the crate documentation for the
/// guarantees and the exactly-once API ([`SqliteStore::complete_in`],
/// [`SqliteStore::run_exactly_once`]).
#[derive(Clone, Debug)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    exec: Executor,
    sql: Sql,
    table: String,
    path: PathBuf,
    clock: Arc<dyn Clock>,
    synchronous: Synchronous,
}

impl SqliteStore {
    /// Starts configuring a store on the database file at `path`.
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            path: path.as_ref().to_path_buf(),
            table: DEFAULT_TABLE.to_owned(),
            synchronous: Synchronous::default(),
            busy_timeout: Duration::from_secs(10),
            mode: ConnectionMode::default(),
            clock: Arc::new(SystemClock),
        }
    }

    /// Opens the database file at `path` with the default settings. Does not create the
    /// table: call [`SqliteStore::migrate`].
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, SqliteError> {
        Self::builder(path).open().await
    }

    /// Creates or upgrades the table with the migrations embedded in this crate, then checks
    /// its shape. Idempotent, and safe to run from several processes at once. A table of the
    /// same name with another shape gets [`SqliteError::SchemaMismatch`] and is left alone.
    pub async fn migrate(&self) -> Result<(), SqliteError> {
        let inner = self.inner.clone();
        self.inner
            .exec
            .run(move |conn| schema::migrate(conn, &inner.table))
            .await?
    }

    /// Checks that the table exists and has this crate's schema, without changing anything.
    pub async fn check_schema(&self) -> Result<(), SqliteError> {
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
    /// [`idempotency_core::Lease::settled_externally`].
    pub fn complete_in(
        &self,
        tx: &Transaction<'_>,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        self.inner.complete_cas(tx, id, token, outcome, ttl)
    }

    async fn write<R, F>(&self, f: F) -> Result<R, Error>
    where
        R: Send + 'static,
        F: FnOnce(&Inner, &Transaction<'_>, Timestamp) -> Result<R, Error> + Send + 'static,
    {
        let inner = self.inner.clone();
        self.inner
            .exec
            .run(move |conn| {
                // IMMEDIATE takes the write lock up front (waiting up to the busy timeout), so
                // the transaction never has to upgrade a read lock, the upgrade that fails
                // with SQLITE_BUSY at once under WAL.
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(|e| inner.sql_error(e))?;
                // Read the clock only once the lock is held, so writers across processes see
                // time move forward in commit order.
                let now = inner.clock.now();
                let r = f(&inner, &tx, now)?;
                tx.commit().map_err(|e| inner.sql_error(e))?;
                Ok(r)
            })
            .await?
    }
}

#[async_trait]
impl IdempotencyStore for SqliteStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let request = request.clone();
        if self.inner.synchronous == Synchronous::Full {
            // Read first: a claim of a live record (a replay, a duplicate) only counts a hit,
            // which is committed without a sync (see `count_hit`).
            let inner = self.inner.clone();
            let (request, hit) = self
                .inner
                .exec
                .run(move |conn| {
                    let hit = inner.count_hit(conn, &request);
                    (request, hit)
                })
                .await?;
            if let Some(claim) = hit? {
                return Ok(claim);
            }
            return self
                .write(move |inner, tx, now| inner.claim(tx, &request, now))
                .await;
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
        // A token above i64::MAX cannot be stored, so no record holds it.
        let Some(stored_token) = token_param(token) else {
            return Ok(Cas::Fenced);
        };
        let (id, outcome) = (id.clone(), outcome.to_vec());
        self.write(move |inner, tx, now| {
            let n = inner.exec_cached(
                tx,
                &inner.sql.complete,
                params![
                    id.scope.as_str(),
                    id.key.as_str(),
                    stored_token,
                    now.as_millis(),
                    outcome,
                    now.saturating_add(ttl).as_millis()
                ],
            )?;
            Ok(cas(n))
        })
        .await
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        // A token above i64::MAX cannot be stored, so no record holds it.
        let Some(stored_token) = token_param(token) else {
            return Ok(Cas::Fenced);
        };
        let (id, failure) = (id.clone(), failure.clone());
        self.write(move |inner, tx, now| {
            let n = inner.exec_cached(
                tx,
                &inner.sql.fail,
                params![
                    id.scope.as_str(),
                    id.key.as_str(),
                    stored_token,
                    now.as_millis(),
                    failure.retryable,
                    failure.message,
                    now.saturating_add(ttl).as_millis()
                ],
            )?;
            Ok(cas(n))
        })
        .await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        // A token above i64::MAX cannot be stored, so no record holds it.
        let Some(stored_token) = token_param(token) else {
            return Ok(Cas::Fenced);
        };
        let id = id.clone();
        self.write(move |inner, tx, now| {
            let n = inner.exec_cached(
                tx,
                &inner.sql.extend,
                params![
                    id.scope.as_str(),
                    id.key.as_str(),
                    stored_token,
                    now.as_millis(),
                    now.saturating_add(lease).as_millis()
                ],
            )?;
            Ok(cas(n))
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
            .run(move |conn| {
                let now = inner.clock.now();
                let mut stmt = conn
                    .prepare_cached(&inner.sql.get)
                    .map_err(|e| inner.sql_error(e))?;
                let mut rows = stmt
                    .query(params![id.scope.as_str(), id.key.as_str(), now.as_millis()])
                    .map_err(|e| inner.sql_error(e))?;
                match rows.next().map_err(|e| inner.sql_error(e))? {
                    Some(row) => decode_record(row).map(Some),
                    None => Ok(None),
                }
            })
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

fn cas(changed: usize) -> Cas {
    match changed {
        0 => Cas::Fenced,
        _ => Cas::Applied,
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
    fn sql_error(&self, e: rusqlite::Error) -> Error {
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
        SqliteError::Sqlite(e).into()
    }

    fn exec_cached(
        &self,
        tx: &Transaction<'_>,
        sql: &str,
        params: impl rusqlite::Params,
    ) -> Result<usize, Error> {
        tx.prepare_cached(sql)
            .and_then(|mut s| s.execute(params))
            .map_err(|e| self.sql_error(e))
    }

    fn claim(
        &self,
        tx: &Transaction<'_>,
        req: &ClaimRequest,
        now: Timestamp,
    ) -> Result<Claim, Error> {
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
    /// Returns `None` when there is no live record (or it expired or was purged between the
    /// read and the lock): the caller then claims under `synchronous = FULL`, and that
    /// statement still decides between a new claim and an observation.
    fn count_hit(&self, conn: &Connection, req: &ClaimRequest) -> Result<Option<Claim>, Error> {
        let id = &req.id;
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
        conn.pragma_update(None, "synchronous", Synchronous::Normal.pragma())
            .map_err(|e| self.sql_error(e))?;
        // Puts FULL back if what follows panics (the executor keeps the connection).
        struct Restore<'c>(&'c Connection);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                let _ = self
                    .0
                    .pragma_update(None, "synchronous", Synchronous::Full.pragma());
            }
        }
        let guard = Restore(conn);
        let hit = (|| -> Result<Option<Claim>, Error> {
            let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)
                .map_err(|e| self.sql_error(e))?;
            let now = self.clock.now();
            let record = {
                let mut stmt = tx
                    .prepare_cached(&self.sql.hit)
                    .map_err(|e| self.sql_error(e))?;
                let mut rows = stmt
                    .query(params![id.scope.as_str(), id.key.as_str(), now.as_millis()])
                    .map_err(|e| self.sql_error(e))?;
                match rows.next().map_err(|e| self.sql_error(e))? {
                    Some(row) => Some(decode_record(row)?),
                    None => None,
                }
            };
            match record {
                Some(record) => {
                    tx.commit().map_err(|e| self.sql_error(e))?;
                    Ok(Some(Claim::Existing { record, now }))
                }
                // Nothing was written; dropping the transaction rolls it back.
                None => Ok(None),
            }
        })();
        // Put FULL back here, where a failure can be reported; the guard is then not needed.
        let restored = conn.pragma_update(None, "synchronous", Synchronous::Full.pragma());
        std::mem::forget(guard);
        let hit = hit?;
        restored.map_err(|e| self.sql_error(e))?;
        Ok(hit)
    }

    fn complete_cas(
        &self,
        tx: &Transaction<'_>,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<(), Error> {
        let now = self.clock.now();
        let stored_token = token_param(token).ok_or(Error::LeaseLost { token })?;
        let n = self.exec_cached(
            tx,
            &self.sql.complete,
            params![
                id.scope.as_str(),
                id.key.as_str(),
                stored_token,
                now.as_millis(),
                outcome,
                now.saturating_add(ttl).as_millis()
            ],
        )?;
        match cas(n) {
            Cas::Applied => Ok(()),
            Cas::Fenced => Err(Error::LeaseLost { token }),
        }
    }
}

const COLUMNS: &str = "scope, key, fingerprint, status, token, lease_until, outcome, attempts, \
                       failure_retryable, failure_message, hits, created_at, updated_at, expires_at";

/// Every statement, with the (validated, quoted) table name baked in.
#[derive(Debug)]
struct Sql {
    claim: String,
    complete: String,
    fail: String,
    extend: String,
    reclaim: String,
    get: String,
    purge: String,
    live: String,
    hit: String,
}

impl Sql {
    fn new(table: &str) -> Self {
        // Shared CAS guard: ?1 scope, ?2 key, ?3 token, ?4 now.
        let held = "scope = ?1 AND key = ?2 AND token = ?3 AND expires_at > ?4";
        // In the upsert, bare column names are the existing row and `excluded` is the new
        // one; every SET expression reads the existing row, and `expires_at` is set last.
        let fresh = "expires_at <= ?5";
        Self {
            claim: format!(
                r#"INSERT INTO "{table}" ({COLUMNS})
                   VALUES (?1, ?2, ?3, 'pending', ?7, ?4, NULL, 1, NULL, NULL, 0, ?5, ?5, ?6)
                   ON CONFLICT (scope, key) DO UPDATE SET
                     fingerprint       = CASE WHEN {fresh} THEN excluded.fingerprint ELSE fingerprint END,
                     status            = CASE WHEN {fresh} THEN 'pending' ELSE status END,
                     token             = CASE WHEN {fresh} THEN max(token + 1, ?7) ELSE token END,
                     lease_until       = CASE WHEN {fresh} THEN excluded.lease_until ELSE lease_until END,
                     outcome           = CASE WHEN {fresh} THEN NULL ELSE outcome END,
                     attempts          = CASE WHEN {fresh} THEN 1 ELSE attempts END,
                     failure_retryable = CASE WHEN {fresh} THEN NULL ELSE failure_retryable END,
                     failure_message   = CASE WHEN {fresh} THEN NULL ELSE failure_message END,
                     hits              = CASE WHEN {fresh} THEN 0 WHEN hits >= 0 THEN hits + 1 END,
                     created_at        = CASE WHEN {fresh} THEN excluded.created_at ELSE created_at END,
                     updated_at        = CASE WHEN {fresh} THEN excluded.updated_at ELSE updated_at END,
                     expires_at        = CASE WHEN {fresh} THEN excluded.expires_at ELSE expires_at END
                   RETURNING {COLUMNS}"#
            ),
            // ?5 outcome, ?6 expires_at
            complete: format!(
                r#"UPDATE "{table}" SET status = 'completed', outcome = ?5, lease_until = NULL,
                     failure_retryable = NULL, failure_message = NULL,
                     updated_at = ?4, expires_at = ?6
                   WHERE {held} AND status = 'pending'"#
            ),
            // ?5 retryable, ?6 message, ?7 expires_at
            fail: format!(
                r#"UPDATE "{table}" SET status = 'failed', failure_retryable = ?5,
                     failure_message = ?6, lease_until = NULL, updated_at = ?4, expires_at = ?7
                   WHERE {held} AND status = 'pending'"#
            ),
            // ?5 lease_until
            extend: format!(
                r#"UPDATE "{table}" SET lease_until = ?5, expires_at = max(expires_at, ?5),
                     updated_at = ?4
                   WHERE {held} AND status = 'pending'"#
            ),
            // ?5 fingerprint, ?6 lease_until, ?7 expires_at
            reclaim: format!(
                r#"UPDATE "{table}" SET status = 'pending', token = token + 1, fingerprint = ?5,
                     attempts = attempts + 1, lease_until = ?6, outcome = NULL,
                     failure_retryable = NULL, failure_message = NULL,
                     updated_at = ?4, expires_at = ?7
                   WHERE {held}
                     AND (status = 'failed'
                          OR (status = 'pending' AND (lease_until IS NULL OR lease_until <= ?4)))"#
            ),
            get: format!(
                r#"SELECT {COLUMNS} FROM "{table}" WHERE scope = ?1 AND key = ?2 AND expires_at > ?3"#
            ),
            purge: format!(
                r#"DELETE FROM "{table}" WHERE rowid IN (
                     SELECT rowid FROM "{table}" WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)"#
            ),
            // ?3 now
            live: format!(
                r#"SELECT 1 FROM "{table}" WHERE scope = ?1 AND key = ?2 AND expires_at > ?3"#
            ),
            // The observation half of the claim: only hits change (a corrupt negative count
            // becomes NULL, which the NOT NULL constraint refuses, as in the claim).
            hit: format!(
                r#"UPDATE "{table}" SET hits = CASE WHEN hits >= 0 THEN hits + 1 END
                   WHERE scope = ?1 AND key = ?2 AND expires_at > ?3
                   RETURNING {COLUMNS}"#
            ),
        }
    }
}

fn column<T: rusqlite::types::FromSql>(row: &Row<'_>, i: usize, name: &str) -> Result<T, Error> {
    row.get(i)
        .map_err(|e| Error::corrupt_with(format!("column {name} cannot be read"), e))
}

fn non_negative<T: TryFrom<i64>>(v: i64, name: &str) -> Result<T, Error> {
    T::try_from(v).map_err(|_| Error::corrupt(format!("{name} is out of range: {v}")))
}

/// The row decoder, reachable from the fuzz targets in `fuzz/`. Not part of the API: it may
/// change at any time.
#[doc(hidden)]
pub mod __fuzz {
    use idempotency_core::{Error, Record};

    /// The columns [`decode_record`] reads, in order.
    pub const COLUMNS: &str = super::COLUMNS;

    /// Decodes one row whose columns are [`COLUMNS`] in order, as every read of the store does.
    pub fn decode_record(row: &rusqlite::Row<'_>) -> Result<Record, Error> {
        super::decode_record(row)
    }
}

/// Decodes one row in [`COLUMNS`] order, refusing anything the store could not have written.
fn decode_record(row: &Row<'_>) -> Result<Record, Error> {
    let scope: String = column(row, 0, "scope")?;
    let key: String = column(row, 1, "key")?;
    let scope = Scope::new(scope).map_err(|e| Error::corrupt_with("stored scope is invalid", e))?;
    let key =
        IdempotencyKey::new(key).map_err(|e| Error::corrupt_with("stored key is invalid", e))?;
    let id = RecordId::new(scope, key);
    let bad = |what: String| Error::corrupt(format!("record {id}: {what}"));

    let fp: Vec<u8> = column(row, 2, "fingerprint")?;
    let fingerprint = Fingerprint::from_slice(&fp)
        .ok_or_else(|| bad(format!("fingerprint is {} bytes, expected 32", fp.len())))?;
    let status: String = column(row, 3, "status")?;
    let status =
        RecordStatus::parse(&status).ok_or_else(|| bad(format!("unknown status {status:?}")))?;
    let token: i64 = column(row, 4, "token")?;
    let token = u64::try_from(token).map_err(|_| bad(format!("token {token} is below 1")))?;
    let lease_until: Option<i64> = column(row, 5, "lease_until")?;
    let outcome: Option<Vec<u8>> = column(row, 6, "outcome")?;
    let attempts: i64 = column(row, 7, "attempts")?;
    let attempts: u32 = non_negative(attempts, "attempts")?;
    let retryable: Option<i64> = column(row, 8, "failure_retryable")?;
    let message: Option<String> = column(row, 9, "failure_message")?;
    let failure = match (retryable, message) {
        (None, None) => None,
        (Some(r @ (0 | 1)), Some(message)) => Some(Failure {
            retryable: r == 1,
            message,
        }),
        (r, m) => {
            return Err(bad(format!(
                "failure columns are inconsistent (retryable {r:?}, message present: {})",
                m.is_some()
            )))
        }
    };
    let hits: i64 = column(row, 10, "hits")?;
    let hits: u64 = non_negative(hits, "hits")?;
    let created_at: i64 = column(row, 11, "created_at")?;
    let updated_at: i64 = column(row, 12, "updated_at")?;
    let expires_at: i64 = column(row, 13, "expires_at")?;

    let record = Record {
        id,
        fingerprint,
        status,
        token: FencingToken(token),
        lease_until: lease_until.map(Timestamp::from_millis),
        outcome,
        attempts,
        failure,
        hits,
        created_at: Timestamp::from_millis(created_at),
        updated_at: Timestamp::from_millis(updated_at),
        expires_at: Timestamp::from_millis(expires_at),
    };
    record.validate()?;
    Ok(record)
}
