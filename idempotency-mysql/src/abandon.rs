//! Connections abandoned mid-statement are closed, never handed back to the pool.
//!
//! sqlx 0.8's MySQL driver reads a packet's header and then its payload in two steps; a
//! future dropped between them (a cancelled call, a timeout) loses the header, and the
//! connection, handed back to the pool, reads the payload as the next header and waits for
//! good for bytes the server never sends: the pool's check of the returned connection hangs
//! and the pool is one connection short for ever. A connection whose statement did not
//! finish is in an unknown protocol state, so the store closes it (the server rolls back
//! whatever transaction it had open) and the pool opens a fresh one when it needs to.

use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection};

/// Marks a pooled connection to be closed on drop unless [`finished`](Self::finished) is
/// called: hold it across a statement.
pub(crate) struct CloseIfAbandoned<'a> {
    conn: &'a mut PoolConnection<MySql>,
    armed: bool,
}

impl<'a> CloseIfAbandoned<'a> {
    pub(crate) fn new(conn: &'a mut PoolConnection<MySql>) -> Self {
        Self { conn, armed: true }
    }

    /// The connection, for the statement.
    pub(crate) fn conn(&mut self) -> &mut MySqlConnection {
        self.conn
    }

    /// The statement ended (with an answer or an error the driver read whole): the
    /// connection may go back to the pool.
    pub(crate) fn finished(mut self) {
        self.armed = false;
    }
}

impl Drop for CloseIfAbandoned<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.close_on_drop();
        }
    }
}
