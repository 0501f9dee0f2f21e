//! A loopback proxy in front of the server that counts what the client sends, by MySQL
//! command: every command packet (sequence id 0) but `COM_STMT_CLOSE` and `COM_QUIT` waits
//! for the server's answer, so each is one round trip. `COM_PING` (sqlx's pool pings a
//! connection as it takes it back, in the background) is counted apart, and
//! `COM_STMT_PREPARE` shows whether statements were prepared again.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// What the proxy cuts next (`CountingProxy::cut_next_*`).
const CUT_NONE: u8 = 0;
const CUT_AFTER_EXECUTE: u8 = 1;
const CUT_AFTER_COMMIT: u8 = 2;
const CUT_INSTEAD_OF_COMMIT: u8 = 3;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Command packets seen, by kind.
#[derive(Clone, Default, Debug, PartialEq, Eq)]
pub struct Counts {
    /// By command name (`query`, `stmt_prepare`, `stmt_execute`, `ping`...).
    pub by_command: BTreeMap<&'static str, u64>,
}

impl Counts {
    /// Commands that wait for an answer, pings left out.
    pub fn round_trips(&self) -> u64 {
        self.by_command
            .iter()
            .filter(|(k, _)| !matches!(**k, "ping" | "stmt_close" | "quit"))
            .map(|(_, v)| v)
            .sum()
    }

    /// How many `command` packets were seen.
    pub fn get(&self, command: &str) -> u64 {
        self.by_command.get(command).copied().unwrap_or(0)
    }
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, before: Counts) -> Counts {
        let mut by_command = BTreeMap::new();
        for (k, v) in self.by_command {
            let d = v - before.by_command.get(k).copied().unwrap_or(0);
            if d > 0 {
                by_command.insert(k, d);
            }
        }
        Counts { by_command }
    }
}

fn command_name(byte: u8) -> &'static str {
    match byte {
        0x01 => "quit",
        0x02 => "init_db",
        0x03 => "query",
        0x0e => "ping",
        0x16 => "stmt_prepare",
        0x17 => "stmt_execute",
        0x19 => "stmt_close",
        0x1a => "stmt_reset",
        0x1f => "reset_connection",
        _ => "other",
    }
}

/// A loopback proxy that counts the client's commands and can cut a connection at a chosen
/// command.
#[derive(Debug)]
pub struct CountingProxy {
    port: u16,
    cut: Arc<AtomicU8>,
    split: Arc<Split>,
    counts: Arc<Mutex<Counts>>,
    queries: Arc<Mutex<Vec<String>>>,
    hold: tokio::sync::watch::Sender<bool>,
}

impl CountingProxy {
    /// Listens on a free loopback port and forwards each connection to `upstream`
    /// (`host:port`).
    pub async fn start(upstream: String) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let counts = Arc::new(Mutex::new(Counts::default()));
        let queries = Arc::new(Mutex::new(Vec::new()));
        let (c, q) = (counts.clone(), queries.clone());
        let cut = Arc::new(AtomicU8::new(CUT_NONE));
        let armed = cut.clone();
        let split = Arc::new(Split::default());
        let splitting = split.clone();
        let (hold, mut held) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                // A held connection waits here, accepted but not yet answered by the server.
                if held.wait_for(|held| !*held).await.is_err() {
                    break;
                }
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(pipe(
                    client,
                    server,
                    c.clone(),
                    q.clone(),
                    armed.clone(),
                    splitting.clone(),
                ));
            }
        });
        Ok(Self {
            port,
            cut,
            split,
            counts,
            queries,
            hold,
        })
    }

    /// New connections are accepted but not passed on to the server until
    /// [`release_connections`](Self::release_connections): a client that reconnects waits
    /// for the server's greeting, as behind a slow network.
    pub fn hold_new_connections(&self) {
        self.hold.send_replace(true);
    }

    /// Passes on the connections held since [`hold_new_connections`](Self::hold_new_connections),
    /// and every new one.
    pub fn release_connections(&self) {
        self.hold.send_replace(false);
    }

    /// The next `COM_STMT_EXECUTE` is passed on whole, then its connection is cut in both
    /// directions before any answer reaches the client: a statement whose answer is lost.
    pub fn cut_next_execute(&self) {
        self.cut.store(CUT_AFTER_EXECUTE, Ordering::SeqCst);
    }

    /// The next `COMMIT` is passed on (`forward`: the server commits) or dropped (the server
    /// sees the client go and rolls back), and its connection cut before any answer reaches
    /// the client: a commit whose outcome the client cannot know.
    pub fn cut_next_commit(&self, forward: bool) {
        let mode = if forward {
            CUT_AFTER_COMMIT
        } else {
            CUT_INSTEAD_OF_COMMIT
        };
        self.cut.store(mode, Ordering::SeqCst);
    }

    /// The next piece of the server's answers that reaches the proxy is passed on only in
    /// part (its first 4 bytes: a packet header), the rest held until
    /// [`release_split`](Self::release_split): a client reading a packet sees its header and
    /// then waits for the payload.
    pub fn split_next_reply(&self) {
        self.split.armed.store(true, Ordering::SeqCst);
    }

    /// Passes on what [`split_next_reply`](Self::split_next_reply) held.
    pub fn release_split(&self) {
        self.split.release.notify_one();
    }

    /// The port to point the client at.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The counts so far.
    pub fn snapshot(&self) -> Counts {
        lock(&self.counts).clone()
    }

    /// The SQL of every `COM_QUERY` and `COM_STMT_PREPARE` so far.
    pub fn statements(&self) -> Vec<String> {
        lock(&self.queries).clone()
    }
}

/// A reply to pass on in two parts.
#[derive(Debug, Default)]
struct Split {
    armed: AtomicBool,
    release: tokio::sync::Notify,
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    counts: Arc<Mutex<Counts>>,
    queries: Arc<Mutex<Vec<String>>>,
    cut: Arc<AtomicU8>,
    split: Arc<Split>,
) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let cutting = Arc::new(AtomicBool::new(false));
    let cutting_down = cutting.clone();
    let down = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if cutting_down.load(Ordering::SeqCst) {
                break;
            }
            if n > 4
                && split
                    .armed
                    .compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                if cw.write_all(&buf[..4]).await.is_err() {
                    break;
                }
                split.release.notified().await;
                if cw.write_all(&buf[4..n]).await.is_err() {
                    break;
                }
                continue;
            }
            if cw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = cw.shutdown().await;
    });
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match cr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        // Whole packets: 3-byte length, 1-byte sequence id, payload.
        let mut at = 0;
        let mut cut_now = false;
        let mut forward = true;
        while pending.len() - at >= 4 {
            let len = usize::from(pending[at])
                | usize::from(pending[at + 1]) << 8
                | usize::from(pending[at + 2]) << 16;
            if pending.len() - at < 4 + len {
                break;
            }
            let seq = pending[at + 3];
            if seq == 0 && len > 0 {
                let payload = &pending[at + 4..at + 4 + len];
                let name = command_name(payload[0]);
                if matches!(name, "query" | "stmt_prepare") {
                    lock(&queries).push(String::from_utf8_lossy(&payload[1..]).into_owned());
                }
                *lock(&counts).by_command.entry(name).or_default() += 1;
                let is_commit = name == "query"
                    && String::from_utf8_lossy(&payload[1..])
                        .trim()
                        .eq_ignore_ascii_case("commit");
                let mode = cut.load(Ordering::SeqCst);
                let hit = match mode {
                    CUT_AFTER_EXECUTE => name == "stmt_execute",
                    CUT_AFTER_COMMIT | CUT_INSTEAD_OF_COMMIT => is_commit,
                    _ => false,
                };
                if hit
                    && cut
                        .compare_exchange(mode, CUT_NONE, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                {
                    cut_now = true;
                    forward = mode != CUT_INSTEAD_OF_COMMIT;
                    cutting.store(true, Ordering::SeqCst);
                }
            }
            at += 4 + len;
        }
        pending.drain(..at);
        if cut_now && !forward {
            break;
        }
        if sw.write_all(&buf[..n]).await.is_err() {
            break;
        }
        if cut_now {
            // Let the statement reach the server, then drop the client's side.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            break;
        }
    }
    let _ = sw.shutdown().await;
    if cutting.load(Ordering::SeqCst) {
        down.abort();
    }
    let _ = down.await;
}

/// A poisoned lock still holds valid counts (a test thread panicked while counting).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
