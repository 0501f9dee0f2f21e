//! A round-trip counting proxy for the PostgreSQL frontend protocol.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default, Debug)]
struct Counters {
    statement_syncs: AtomicU64,
    bare_syncs: AtomicU64,
    simple_queries: AtomicU64,
    parses: AtomicU64,
    /// Every distinct statement text prepared, in the order first seen.
    statements: Mutex<Vec<String>>,
}

/// What the clients of a [`CountingProxy`] have sent so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Counts {
    /// `Sync` after Parse/Bind/Execute…: one extended-protocol round trip carrying statements.
    pub statement_syncs: u64,
    /// `Sync` alone: a liveness ping (sqlx's pool sends one as a connection is released).
    pub bare_syncs: u64,
    /// `Query`: one simple-protocol round trip (BEGIN, COMMIT…).
    pub simple_queries: u64,
    /// `Parse`: a statement being prepared.
    pub parses: u64,
}

impl Counts {
    /// Round trips that carried statements.
    pub fn round_trips(&self) -> u64 {
        self.statement_syncs + self.simple_queries
    }
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        Counts {
            statement_syncs: self.statement_syncs - o.statement_syncs,
            bare_syncs: self.bare_syncs - o.bare_syncs,
            simple_queries: self.simple_queries - o.simple_queries,
            parses: self.parses - o.parses,
        }
    }
}

/// A counting proxy on a free loopback port in front of a PostgreSQL server. Connect to
/// `127.0.0.1:{port()}` without TLS.
#[derive(Debug, Clone)]
pub struct CountingProxy {
    port: u16,
    counters: Arc<Counters>,
}

impl CountingProxy {
    /// Starts the proxy in front of `upstream` (`host:port`, a loopback address).
    pub async fn start(upstream: String) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                // Messages are forwarded as they come; don't let Nagle's algorithm hold them.
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut client_rd, mut client_wr) = client.into_split();
                let (mut server_rd, mut server_wr) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut server_rd, &mut client_wr).await;
                });
                let c = c.clone();
                tokio::spawn(async move {
                    let _ = pump(&mut client_rd, &mut server_wr, &c).await;
                    let _ = server_wr.shutdown().await;
                });
            }
        });
        Ok(Self { port, counters })
    }

    /// The loopback port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Every distinct statement text the clients prepared (`Parse`), in the order first seen:
    /// what a driver really sends, to replay it with another client (`pgbench`).
    pub fn statements(&self) -> Vec<String> {
        self.counters
            .statements
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// What has been sent so far.
    pub fn snapshot(&self) -> Counts {
        let c = &self.counters;
        Counts {
            statement_syncs: c.statement_syncs.load(Ordering::SeqCst),
            bare_syncs: c.bare_syncs.load(Ordering::SeqCst),
            simple_queries: c.simple_queries.load(Ordering::SeqCst),
            parses: c.parses.load(Ordering::SeqCst),
        }
    }
}

/// Forwards client→server traffic, counting frontend messages.
async fn pump(
    from: &mut (impl AsyncReadExt + Unpin),
    to: &mut (impl AsyncWriteExt + Unpin),
    c: &Counters,
) -> std::io::Result<()> {
    // Startup: untyped messages (length, then a code); SSL/GSS requests come before the real
    // startup message.
    loop {
        let len = from.read_u32().await?;
        let mut message = len.to_be_bytes().to_vec();
        message.resize(4 + (len as usize).saturating_sub(4), 0);
        from.read_exact(&mut message[4..]).await?;
        // One write per message: written in pieces, Nagle's algorithm holds each piece after
        // the first until the server acknowledges it (up to its delayed-ACK time, 40 ms).
        to.write_all(&message).await?;
        let body = &message[4..];
        let code = body
            .get(..4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            .unwrap_or(0);
        if code != 80_877_103 && code != 80_877_104 {
            break;
        }
    }
    let mut since_sync = 0u32;
    loop {
        let kind = from.read_u8().await?;
        let len = from.read_u32().await?;
        let mut message = vec![kind];
        message.extend_from_slice(&len.to_be_bytes());
        message.resize(5 + (len as usize).saturating_sub(4), 0);
        from.read_exact(&mut message[5..]).await?;
        let body = &message[5..];
        match kind {
            b'S' if since_sync == 0 => {
                c.bare_syncs.fetch_add(1, Ordering::SeqCst);
            }
            b'S' => {
                c.statement_syncs.fetch_add(1, Ordering::SeqCst);
                since_sync = 0;
            }
            b'Q' => {
                c.simple_queries.fetch_add(1, Ordering::SeqCst);
            }
            b'P' => {
                c.parses.fetch_add(1, Ordering::SeqCst);
                since_sync += 1;
                // Body: statement name, then the query, both NUL-terminated.
                let mut parts = body.split(|b| *b == 0);
                if let (Some(_), Some(query)) = (parts.next(), parts.next()) {
                    let query = String::from_utf8_lossy(query).into_owned();
                    if let Ok(mut seen) = c.statements.lock() {
                        if !seen.contains(&query) {
                            seen.push(query);
                        }
                    }
                }
            }
            _ => since_sync += 1,
        }
        to.write_all(&message).await?;
    }
}
