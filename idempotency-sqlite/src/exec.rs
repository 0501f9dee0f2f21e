//! Where SQLite calls run: never on an async worker thread.

use crate::SqliteError;
use rusqlite::Connection;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};
use tokio::sync::{oneshot, Semaphore};

type Job = Box<dyn FnOnce(&mut Connection) + Send>;
type Caught<R> = std::thread::Result<R>;

/// Runs closures against a connection off the async runtime.
pub(crate) enum Executor {
    /// One connection owned by one OS thread; jobs queue on a channel.
    Thread(mpsc::Sender<Job>),
    /// A few connections handed to `spawn_blocking`; a semaphore bounds how many are in use.
    Pool {
        connections: Arc<Mutex<Vec<Connection>>>,
        permits: Arc<Semaphore>,
        size: usize,
    },
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Thread(_) => f.write_str("DedicatedThread"),
            Self::Pool { size, .. } => write!(f, "BlockingPool({size})"),
        }
    }
}

impl Executor {
    /// Starts a connection thread; `open` runs on it and its error is returned here.
    pub(crate) async fn thread(
        name: String,
        open: impl FnOnce() -> Result<Connection, SqliteError> + Send + 'static,
    ) -> Result<Self, SqliteError> {
        let (jobs, queue) = mpsc::channel::<Job>();
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
                while let Ok(job) = queue.recv() {
                    job(&mut conn);
                }
            })
            .map_err(|e| SqliteError::Config(format!("cannot start the connection thread: {e}")))?;
        opened.await.map_err(|_| SqliteError::Closed)??;
        Ok(Self::Thread(jobs))
    }

    /// Opens `size` connections on the blocking pool.
    pub(crate) async fn pool(
        size: usize,
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
            size,
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
            Self::Thread(jobs) => {
                let job: Job = Box::new(move |conn| {
                    let _ = reply.send(catch_unwind(AssertUnwindSafe(|| f(conn))));
                });
                jobs.send(job).map_err(|_| SqliteError::Closed)?;
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
