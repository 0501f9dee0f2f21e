//! Where SQLite calls run: never on an async worker thread.
//!
//! On the dedicated connection thread, the store's writes are **group-committed**: the
//! thread takes every write queued behind the first (up to [`MAX_BATCH`]) into one
//! transaction, each in its own savepoint, so one failing write does not undo the others,
//! and commits them with one sync. A write is answered only once that commit has
//! succeeded; if it fails, every write of the batch gets the error and nothing of the batch
//! is visible. A failed sync may still leave the batch in the write-ahead log, where a crash
//! or restart can bring it back: the writes' outcome is unknown, not "not written".

use crate::SqliteError;
use idempotency_core::Error;
use rusqlite::{Connection, ErrorCode};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

type Job = Box<dyn FnOnce(&mut Connection) + Send>;
type Caught<R> = std::thread::Result<R>;

/// The most writes one transaction takes.
pub(crate) const MAX_BATCH: usize = 64;

/// What the connection thread is asked to do.
pub(crate) enum Message {
    /// Anything on the connection, alone.
    Plain(Job),
    /// A store write, which may share a transaction with the writes queued behind it.
    Write(Box<dyn Batched>),
}

/// A write run inside the batch's transaction.
pub(crate) trait Batched: Send {
    /// Runs the write (its savepoint is open). Returns whether it succeeded, and how to
    /// answer its caller once the batch's commit is known.
    fn run(self: Box<Self>, conn: &Connection) -> (bool, Box<dyn Answer>);
    /// Answers without running: the batch's transaction could not begin.
    fn refuse(self: Box<Self>, error: &rusqlite::Error);
}

/// The answer of a write that ran, sent once the batch's fate is known.
pub(crate) trait Answer: Send {
    /// `Err` when the batch was not committed (the write's effects are gone).
    fn answer(self: Box<Self>, commit: Result<(), &rusqlite::Error>);
}

struct Write<F, R> {
    f: F,
    reply: oneshot::Sender<Caught<Result<R, Error>>>,
}

impl<F, R> Batched for Write<F, R>
where
    F: FnOnce(&Connection) -> Result<R, Error> + Send,
    R: Send + 'static,
{
    fn run(self: Box<Self>, conn: &Connection) -> (bool, Box<dyn Answer>) {
        let Write { f, reply } = *self;
        let result = catch_unwind(AssertUnwindSafe(|| f(conn)));
        let ok = matches!(result, Ok(Ok(_)));
        (ok, Box::new(Reply { reply, result }))
    }

    fn refuse(self: Box<Self>, error: &rusqlite::Error) {
        let _ = self.reply.send(Ok(Err(batch_error(error))));
    }
}

struct Reply<R> {
    reply: oneshot::Sender<Caught<Result<R, Error>>>,
    result: Caught<Result<R, Error>>,
}

impl<R: Send> Answer for Reply<R> {
    fn answer(self: Box<Self>, commit: Result<(), &rusqlite::Error>) {
        let result = match (commit, self.result) {
            // A write that failed or panicked keeps its own answer: its savepoint was rolled
            // back whatever happened to the batch.
            (_, r @ (Err(_) | Ok(Err(_)))) | (Ok(()), r) => r,
            (Err(e), Ok(Ok(_))) => Ok(Err(batch_error(e))),
        };
        let _ = self.reply.send(result);
    }
}

/// The error each write of a batch gets when the batch could not begin or commit: nothing
/// of the batch is visible (though a failed sync may have left it in the log, see the
/// module docs). rusqlite's error is not `Clone`, so each write gets its own
/// copy of the code and message.
fn batch_error(e: &rusqlite::Error) -> Error {
    let copy = match e {
        rusqlite::Error::SqliteFailure(code, message) => {
            rusqlite::Error::SqliteFailure(*code, message.clone())
        }
        other => rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
            Some(other.to_string()),
        ),
    };
    SqliteError::from(copy).into()
}

/// What a batch whose transaction SQLite rolled back by itself (after an I/O error, a full
/// disk, out of memory) tells the writes that had succeeded in it.
fn rolled_back() -> rusqlite::Error {
    rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error {
            code: ErrorCode::SystemIoFailure,
            extended_code: rusqlite::ffi::SQLITE_IOERR,
        },
        Some(
            "the transaction was rolled back by an error of another write in the same batch".into(),
        ),
    )
}

/// How many store writes were committed, and in how many transactions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Store writes (claims, completions, failures, extensions, reclaims, purges) committed;
    /// a write that failed (its savepoint rolled back) is not counted, and a `claim_many` or
    /// `settle_many` counts as one.
    pub writes: u64,
    /// Transactions that committed them. On the dedicated connection thread, writes queued
    /// together share one (group commit), so this is at most `writes`.
    pub transactions: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    writes: AtomicU64,
    transactions: AtomicU64,
}

impl Counters {
    fn committed(&self, writes: usize) {
        self.writes.fetch_add(writes as u64, Ordering::Relaxed);
        self.transactions.fetch_add(1, Ordering::Relaxed);
    }

    fn read(&self) -> WriteStats {
        WriteStats {
            writes: self.writes.load(Ordering::Relaxed),
            transactions: self.transactions.load(Ordering::Relaxed),
        }
    }
}

/// Runs one batch: `first`, then every write already queued behind it, up to
/// [`MAX_BATCH`], in one transaction. Returns a plain job met while collecting the batch,
/// to run after it.
fn run_batch(
    conn: &mut Connection,
    first: Box<dyn Batched>,
    queue: &mpsc::Receiver<Message>,
    counters: &Counters,
    durability: &str,
) -> Option<Job> {
    // The store's durability, set again before every batch: nothing that ran on this
    // connection before (a replay's hit committed at NORMAL whose restore failed) can leave
    // a batch of claims and completions committed without their sync.
    if let Err(e) = conn
        .prepare_cached(durability)
        .and_then(|mut s| s.execute([]))
    {
        first.refuse(&e);
        return None;
    }
    // IMMEDIATE takes the write lock up front (waiting up to the busy timeout), so the
    // transaction never has to upgrade a read lock, the upgrade that fails with SQLITE_BUSY
    // at once under WAL.
    if let Err(e) = conn.execute_batch("BEGIN IMMEDIATE") {
        first.refuse(&e);
        return None;
    }
    let mut answers: Vec<Box<dyn Answer>> = Vec::new();
    let mut succeeded = 0;
    let mut next = Some(first);
    let mut after = None;
    let mut broken = false;
    while let Some(write) = next.take() {
        let opened = conn.execute_batch("SAVEPOINT w");
        if let Err(e) = opened {
            write.refuse(&e);
            broken = true;
            break;
        }
        let (ok, answer) = write.run(conn);
        if conn.is_autocommit() {
            // SQLite rolled the whole transaction back (an I/O error, a full disk): the
            // writes before this one are gone too.
            answer.answer(Err(&rolled_back()));
            broken = true;
            break;
        }
        succeeded += usize::from(ok);
        let closed = if ok {
            conn.execute_batch("RELEASE w")
        } else {
            conn.execute_batch("ROLLBACK TO w; RELEASE w")
        };
        answers.push(answer);
        if closed.is_err() {
            broken = true;
            break;
        }
        if answers.len() >= MAX_BATCH {
            break;
        }
        match queue.try_recv() {
            Ok(Message::Write(w)) => next = Some(w),
            Ok(Message::Plain(job)) => after = Some(job),
            Err(_) => {}
        }
    }
    let commit = if broken {
        Err(rolled_back())
    } else {
        conn.execute_batch("COMMIT")
    };
    match &commit {
        Ok(()) => counters.committed(succeeded),
        Err(_) if !conn.is_autocommit() => {
            let _ = conn.execute_batch("ROLLBACK");
        }
        Err(_) => {}
    }
    for answer in answers {
        answer.answer(commit.as_ref().map(|_| ()));
    }
    after
}

/// Runs closures against a connection off the async runtime.
pub(crate) enum Executor {
    /// One connection owned by one OS thread; jobs queue on a channel.
    Thread {
        jobs: mpsc::Sender<Message>,
        counters: Arc<Counters>,
    },
    /// A few connections handed to `spawn_blocking`; a semaphore bounds how many are in use.
    Pool {
        connections: Arc<Mutex<Vec<Connection>>>,
        permits: Arc<Semaphore>,
        /// The write gate: the process's writers take turns in the order they came (a fair
        /// semaphore of one) before `BEGIN IMMEDIATE`, instead of polling SQLite's lock in
        /// its busy handler, where a writer can starve for the whole busy timeout while
        /// others keep taking the lock.
        writer: Arc<Semaphore>,
        size: usize,
        counters: Arc<Counters>,
        durability: &'static str,
    },
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Thread { .. } => f.write_str("DedicatedThread"),
            Self::Pool { size, .. } => write!(f, "BlockingPool({size})"),
        }
    }
}

impl Executor {
    /// Starts a connection thread; `open` runs on it and its error is returned here.
    /// `durability` is the `PRAGMA synchronous = …` statement run before every write
    /// transaction.
    pub(crate) async fn thread(
        name: String,
        durability: &'static str,
        open: impl FnOnce() -> Result<Connection, SqliteError> + Send + 'static,
    ) -> Result<Self, SqliteError> {
        let (jobs, queue) = mpsc::channel::<Message>();
        let counters = Arc::new(Counters::default());
        let thread_counters = counters.clone();
        let (ready, opened) = oneshot::channel::<Result<(), SqliteError>>();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let mut conn = match open() {
                    Ok(c) => {
                        let _ = ready.send(Ok(()));
                        c
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                // Ends when the last sender (the last clone of the store) is dropped.
                let mut after = None;
                loop {
                    let message = match after.take() {
                        Some(job) => Message::Plain(job),
                        None => match queue.recv() {
                            Ok(message) => message,
                            Err(_) => return,
                        },
                    };
                    match message {
                        Message::Plain(job) => job(&mut conn),
                        Message::Write(first) => {
                            after =
                                run_batch(&mut conn, first, &queue, &thread_counters, durability)
                        }
                    }
                }
            })
            .map_err(|e| SqliteError::Config(format!("cannot start the connection thread: {e}")))?;
        opened.await.map_err(|_| SqliteError::Closed)??;
        Ok(Self::Thread { jobs, counters })
    }

    /// Opens `size` connections on the blocking pool.
    pub(crate) async fn pool(
        size: usize,
        durability: &'static str,
        open: impl Fn() -> Result<Connection, SqliteError> + Send + 'static,
    ) -> Result<Self, SqliteError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            SqliteError::Config("the blocking-pool mode needs a tokio runtime".into())
        })?;
        let connections = handle
            .spawn_blocking(move || (0..size).map(|_| open()).collect::<Result<Vec<_>, _>>())
            .await
            .map_err(|_| SqliteError::Closed)??;
        Ok(Self::Pool {
            connections: Arc::new(Mutex::new(connections)),
            permits: Arc::new(Semaphore::new(size)),
            writer: Arc::new(Semaphore::new(1)),
            size,
            counters: Arc::default(),
            durability,
        })
    }

    /// Runs `f` on a connection and returns its result. A panic in `f` is resumed here, in
    /// the caller; the connection survives it (an open transaction is rolled back when its
    /// guard unwinds).
    pub(crate) async fn run<R, F>(&self, f: F) -> Result<R, SqliteError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection) -> R + Send + 'static,
    {
        let (reply, result) = oneshot::channel::<Caught<R>>();
        match self {
            Self::Thread { jobs, .. } => {
                let job: Job = Box::new(move |conn| {
                    let _ = reply.send(catch_unwind(AssertUnwindSafe(|| f(conn))));
                });
                jobs.send(Message::Plain(job))
                    .map_err(|_| SqliteError::Closed)?;
            }
            Self::Pool {
                connections,
                permits,
                ..
            } => {
                let handle =
                    tokio::runtime::Handle::try_current().map_err(|_| SqliteError::Closed)?;
                let permit = permits
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| SqliteError::Closed)?;
                let connections = connections.clone();
                // The connection goes back to the pool inside the blocking task, so a caller
                // that is cancelled mid-call cannot lose it.
                handle.spawn_blocking(move || {
                    let taken = connections.lock().ok().and_then(|mut c| c.pop());
                    let Some(mut conn) = taken else {
                        return; // the reply is dropped: the caller sees `Closed`
                    };
                    let r = catch_unwind(AssertUnwindSafe(|| f(&mut conn)));
                    if let Ok(mut c) = connections.lock() {
                        c.push(conn);
                    }
                    drop(permit);
                    let _ = reply.send(r);
                });
            }
        }
        match result.await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(panic)) => resume_unwind(panic),
            Err(_) => Err(SqliteError::Closed),
        }
    }
}

impl Executor {
    /// Writes committed so far, and the transactions that committed them.
    pub(crate) fn write_stats(&self) -> WriteStats {
        match self {
            Self::Thread { counters, .. } | Self::Pool { counters, .. } => counters.read(),
        }
    }

    /// In the pool mode, waits for this process's turn to write (see `Pool::writer`); the
    /// permit is to be held until the write transaction has ended. `None` on the dedicated
    /// thread, where writes take turns on the thread's queue.
    pub(crate) async fn write_gate(&self) -> Result<Option<OwnedSemaphorePermit>, SqliteError> {
        match self {
            Self::Thread { .. } => Ok(None),
            Self::Pool { writer, .. } => writer
                .clone()
                .acquire_owned()
                .await
                .map(Some)
                .map_err(|_| SqliteError::Closed),
        }
    }

    /// Runs the store write `f` in a write transaction (`BEGIN IMMEDIATE`) and returns its
    /// result once the transaction has committed. On the dedicated thread the transaction is
    /// shared with the writes queued behind it (group commit), `f` in its own savepoint; in
    /// the pool mode it is `f`'s alone. An `Err` from `f` rolls back `f`'s writes only. A
    /// panic in `f` is resumed in the caller.
    pub(crate) async fn write<R, F>(&self, f: F) -> Result<R, Error>
    where
        R: Send + 'static,
        F: FnOnce(&Connection) -> Result<R, Error> + Send + 'static,
    {
        let caught = match self {
            Self::Thread { jobs, .. } => {
                let (reply, result) = oneshot::channel();
                jobs.send(Message::Write(Box::new(Write { f, reply })))
                    .map_err(|_| SqliteError::Closed)?;
                result.await.map_err(|_| SqliteError::Closed)?
            }
            Self::Pool {
                counters,
                durability,
                ..
            } => {
                let (counters, durability) = (counters.clone(), *durability);
                let gate = self.write_gate().await?;
                let r = self
                    .run(move |conn| {
                        // Held until the transaction has ended, whatever its caller does.
                        let _gate = gate;
                        catch_unwind(AssertUnwindSafe(|| {
                            conn.prepare_cached(durability)
                                .and_then(|mut s| s.execute([]))
                                .map_err(|e| Error::from(SqliteError::from(e)))?;
                            let tx = conn
                                .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                                .map_err(|e| Error::from(SqliteError::from(e)))?;
                            let r = f(&tx)?;
                            tx.commit().map_err(|e| Error::from(SqliteError::from(e)))?;
                            counters.committed(1);
                            Ok(r)
                        }))
                    })
                    .await?;
                r
            }
        };
        match caught {
            Ok(r) => r,
            Err(panic) => resume_unwind(panic),
        }
    }
}
