//! Connections the store keeps checked out between its own operations.
//!
//! sqlx's pool pings every connection it takes back (`PoolConnection`'s drop spawns a task
//! that sends a bare `Sync` and waits for `ReadyForQuery`), so an operation run through
//! `&PgPool` costs its statement's round trip plus a ping, a spawned task and their syscalls
//! on both sides. An operation here takes a connection the store kept (else one from the
//! pool), runs its one statement on it and, only when that statement completed, keeps the
//! connection for the next operation. Anything else gives the connection back to the pool the
//! normal way (drop), so sqlx's ping and clean-up still handle it: an error (a broken
//! connection is never kept), a cancelled operation (a future dropped mid-statement), a
//! closed pool.
//!
//! An operation that finds nothing kept waits on the pool; a connection another operation
//! keeps meanwhile is handed to it directly (it would otherwise wait until the reaper gives
//! the kept connection back).
//!
//! Only the store's single autocommit statements run on kept connections, so a kept
//! connection is never inside a transaction or in the middle of a result.
//!
//! Kept connections are checked out of the pool, so they must not starve its other users
//! (transactions, the caller's queries through [`crate::PostgresStore::pool`]):
//!
//! - a connection kept unused for [`IDLE`] goes back to the pool (a reaper task, spawned
//!   when the first one is kept, holding only a `Weak`; it exits when nothing is kept or the
//!   store is gone);
//! - all of them go back at once when the pool is closed, so `pool.close()` does not wait;
//! - when the pool is exhausted (at its maximum size, nothing idle) a connection is not kept
//!   if someone else holds one of the pool's connections (they may want another), or if it
//!   has been out of the pool for [`EXHAUSTED_LAP`] (so a waiter we cannot see gets a turn);
//! - whatever the pool's state, a connection goes back after [`LAP`] out of it (or the pool's
//!   `max_lifetime`, if shorter), so the pool's lifetime checks still run;
//! - a transaction [`PostgresIdempotency`](crate::PostgresIdempotency) is about to begin takes priority:
//!   while it waits and the pool is exhausted, operations give their connections back, and
//!   one kept connection is handed back at once.

use futures::FutureExt;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// A connection kept unused this long goes back to the pool.
pub(crate) const IDLE: Duration = Duration::from_millis(100);

/// While the pool is exhausted, a connection goes back to the pool once it has been out of it
/// this long.
pub(crate) const EXHAUSTED_LAP: Duration = Duration::from_millis(100);

/// A connection goes back to the pool once it has been out of it this long (or the pool's
/// `max_lifetime`, if shorter).
pub(crate) const LAP: Duration = Duration::from_secs(10);

/// The connections kept by one store and its clones.
pub(crate) struct Kept {
    pool: PgPool,
    state: Mutex<State>,
    /// Connections the store holds: in operations, and kept.
    ours: AtomicUsize,
    /// Transactions waiting for a connection (see [`Kept::begin`]).
    wanted: AtomicUsize,
    /// The store's operations waiting for a connection from the pool.
    waiting: AtomicUsize,
    /// Wakes one of them when a connection is kept.
    handoff: Notify,
    lap: Duration,
}

#[derive(Default)]
struct State {
    /// Most recently used last.
    parked: Vec<Parked>,
    reaper: bool,
}

struct Parked {
    conn: PoolConnection<Postgres>,
    out_since: Instant,
    parked_at: Instant,
}

impl fmt::Debug for Kept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kept")
            .field("kept", &self.lock().parked.len())
            .field("held", &self.ours.load(Ordering::Relaxed))
            .finish()
    }
}

impl Kept {
    pub(crate) fn new(pool: PgPool) -> Arc<Self> {
        let lap = pool
            .options()
            .get_max_lifetime()
            .map_or(LAP, |l| l.min(LAP));
        Arc::new(Self {
            pool,
            state: Mutex::default(),
            ours: AtomicUsize::new(0),
            wanted: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            handoff: Notify::new(),
            lap,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; a poisoned one still holds valid state.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection for one statement: a kept one, else one from the pool. While it waits
    /// for the pool, a connection another operation keeps is handed to it directly (else the
    /// operations queued on the pool would wait for kept connections to be reaped).
    pub(crate) async fn checkout(self: &Arc<Self>) -> Result<Out, sqlx::Error> {
        if let Some(p) = self.take() {
            return Ok(self.kept_out(p));
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(self);
        // One acquire for the whole wait, so its place in the pool's queue is kept.
        let acquire = self.pool.acquire();
        tokio::pin!(acquire);
        loop {
            let notified = self.handoff.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(p) = self.take() {
                return Ok(self.kept_out(p));
            }
            tokio::select! {
                biased;
                conn = &mut acquire => {
                    if notified.as_mut().now_or_never().is_some() {
                        // A kept connection was meant for us: pass the word on.
                        self.handoff.notify_one();
                    }
                    let conn = conn?;
                    self.ours.fetch_add(1, Ordering::Relaxed);
                    return Ok(Out {
                        conn: Some(conn),
                        out_since: Instant::now(),
                        kept: Some(self.clone()),
                    });
                }
                () = &mut notified => {}
            }
        }
    }

    fn kept_out(self: &Arc<Self>, p: Parked) -> Out {
        Out {
            conn: Some(p.conn),
            out_since: p.out_since,
            kept: Some(self.clone()),
        }
    }

    /// The most recently used kept connection (the others age out), unless the pool is closed.
    fn take(&self) -> Option<Parked> {
        let mut state = self.lock();
        if self.pool.is_closed() {
            let all = std::mem::take(&mut state.parked);
            drop(state);
            self.hand_back(all);
            return None;
        }
        state.parked.pop()
    }

    /// Keeps `out`'s connection for the next operation, or gives it back to the pool (see the
    /// module documentation).
    fn checkin(self: &Arc<Self>, mut out: Out) {
        if !self.should_keep(&out) {
            return; // `out` drops: back to the pool
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(conn) = out.conn.take() else { return };
        let parked = Parked {
            conn,
            out_since: out.out_since,
            parked_at: Instant::now(),
        };
        let mut state = self.lock();
        if self.pool.is_closed() {
            drop(state);
            self.hand_back(vec![parked]);
            return;
        }
        state.parked.push(parked);
        let spawn = !state.reaper;
        state.reaper = true;
        drop(state);
        if self.waiting.load(Ordering::Relaxed) > 0 {
            self.handoff.notify_one();
        }
        if spawn {
            let close = self.pool.close_event();
            // The flag goes with the task's future, so a future dropped before it ever runs
            // (its runtime shutting down) clears it, and the next connection kept spawns a
            // reaper again.
            let flag = ReaperFlag(Some(Arc::downgrade(self)));
            runtime.spawn(reap(Arc::downgrade(self), close, flag));
        }
    }

    fn should_keep(&self, out: &Out) -> bool {
        let pool = &self.pool;
        if pool.is_closed() {
            return false;
        }
        // Never the case after the store's own statements; a guard, not a check of the
        // server's status (sqlx counts only the transactions it began).
        if out.conn.as_ref().is_none_or(|c| c.is_in_transaction()) {
            return false;
        }
        let out_for = out.out_since.elapsed();
        if out_for >= self.lap {
            return false;
        }
        let max = pool.options().get_max_connections();
        let (size, idle) = (pool.size(), pool.num_idle());
        if size >= max && idle == 0 {
            // Exhausted: whoever else wants a connection waits for one to come back.
            let in_use = usize::try_from(size).unwrap_or(usize::MAX);
            let others = in_use.saturating_sub(self.ours.load(Ordering::Relaxed));
            if others > 0 || self.wanted.load(Ordering::Relaxed) > 0 || out_for >= EXHAUSTED_LAP {
                return false;
            }
        }
        self.lock().parked.len() < usize::try_from(max).unwrap_or(usize::MAX)
    }

    /// Gives connections back to the pool.
    fn hand_back(&self, conns: Vec<Parked>) {
        self.ours.fetch_sub(conns.len(), Ordering::Relaxed);
        drop(conns);
    }

    /// Marks a transaction as waiting for a connection until the guard drops, and hands a
    /// kept connection back to the pool at once if the pool has none to offer.
    pub(crate) fn begin(self: &Arc<Self>) -> Wanted {
        self.wanted.fetch_add(1, Ordering::Relaxed);
        let pool = &self.pool;
        if pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections() {
            let mut state = self.lock();
            if !state.parked.is_empty() {
                // The oldest: the one the reaper would hand back first.
                let oldest = state.parked.remove(0);
                drop(state);
                self.hand_back(vec![oldest]);
            }
        }
        Wanted(self.clone())
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let parked = std::mem::take(&mut self.lock().parked);
        if parked.is_empty() || tokio::runtime::Handle::try_current().is_ok() {
            return; // dropped here: back to the pool
        }
        // Outside a runtime sqlx cannot spawn the task that takes a connection back (its drop
        // would panic): close the sockets and give the pool its permits back directly.
        let min = self.pool.options().get_min_connections();
        for p in parked {
            if min == 0 {
                drop(p.conn.detach());
            } else {
                // Even a detached connection's drop spawns a task when the pool keeps a
                // minimum: leak it rather than panic (the pool is being torn down anyway).
                std::mem::forget(p.conn);
            }
        }
    }
}

/// Hands back kept connections unused for [`IDLE`], and all of them when the pool closes;
/// exits when nothing is kept or the store is gone.
async fn reap(kept: Weak<Kept>, close: sqlx::pool::CloseEvent, mut flag: ReaperFlag) {
    tokio::pin!(close);
    let mut closed = false;
    loop {
        let next = {
            let Some(k) = kept.upgrade() else { return };
            let now = Instant::now();
            let closing = closed || k.pool.is_closed();
            let mut state = k.lock();
            let (old, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut state.parked)
                .into_iter()
                .partition(|p| closing || now.duration_since(p.parked_at) >= IDLE);
            state.parked = keep;
            let next = state.parked.iter().map(|p| p.parked_at + IDLE).min();
            if next.is_none() {
                state.reaper = false;
                flag.0 = None;
            }
            drop(state);
            k.hand_back(old);
            match next {
                Some(next) => next,
                None => return,
            }
        };
        tokio::select! {
            () = tokio::time::sleep_until(next.into()) => {}
            () = &mut close, if !closed => closed = true,
        }
    }
}

/// Clears the reaper flag if the reaper task is dropped before it exits normally (its runtime
/// shut down), so the next kept connection spawns another.
struct ReaperFlag(Option<Weak<Kept>>);

impl Drop for ReaperFlag {
    fn drop(&mut self) {
        if let Some(kept) = self.0.take().and_then(|w| w.upgrade()) {
            kept.lock().reaper = false;
        }
    }
}

/// A connection checked out for one statement, from [`Kept::checkout`] or straight from the
/// pool ([`Out::pooled`]). Dropped, it goes back to the pool.
pub(crate) struct Out {
    conn: Option<PoolConnection<Postgres>>,
    out_since: Instant,
    kept: Option<Arc<Kept>>,
}

impl Out {
    /// A connection from the pool, given back when dropped.
    pub(crate) fn pooled(conn: PoolConnection<Postgres>) -> Self {
        Self {
            conn: Some(conn),
            out_since: Instant::now(),
            kept: None,
        }
    }

    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        self.conn
            .as_mut()
            .expect("the connection is present until the guard goes")
    }

    /// The connection is stuck mid-statement: close it instead of giving it back.
    pub(crate) fn discard(mut self) {
        if let Some(conn) = self.conn.as_mut() {
            conn.close_on_drop();
        }
    }

    /// The statement run on this connection completed: keep it for the next one if it came
    /// from [`Kept::checkout`] and may be kept; else give it back to the pool.
    pub(crate) fn done(self) {
        if let Some(kept) = self.kept.clone() {
            kept.checkin(self);
        }
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            if let Some(kept) = &self.kept {
                kept.ours.fetch_sub(1, Ordering::Relaxed);
            }
            drop(conn);
        }
    }
}

/// An operation waiting for a connection: see [`Kept::checkout`].
struct Waiting<'a>(&'a Kept);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A transaction waiting for a connection: see [`Kept::begin`].
pub(crate) struct Wanted(Arc<Kept>);

impl Drop for Wanted {
    fn drop(&mut self) {
        self.0.wanted.fetch_sub(1, Ordering::Relaxed);
    }
}
