//! A TCP proxy that can partition the network between a client and a server on loopback,
//! then heal it: while partitioned nothing crosses (bytes wait in the sockets, as TCP holds
//! them during a real partition) and after healing everything held goes through in order.
//! It can also hold only the server's replies, so that a request reaches the server and is
//! applied while its answer is lost for as long as the partition lasts; start either when a
//! given request is sent (a transaction's `COMMIT`, say); and sever every connection, as a
//! partition that outlasted the server's patience does.

use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// What crosses the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Open,
    /// Nothing, either way.
    Partitioned,
    /// Requests go through; replies wait.
    RepliesHeld,
}

/// A partitionable proxy in front of one server. Dropping it stops accepting and closes the
/// connections it forwards.
#[derive(Debug)]
pub struct PartitionProxy {
    addr: SocketAddr,
    target: Arc<std::sync::Mutex<SocketAddr>>,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

/// What the proxy and its connections share.
#[derive(Debug)]
struct Shared {
    state: watch::Sender<State>,
    /// A request that, once read, switches the state: its bytes, and the state.
    trigger: std::sync::Mutex<Option<(Vec<u8>, State)>>,
    /// The forwarding tasks of the open connections.
    connections: std::sync::Mutex<Vec<AbortHandle>>,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PartitionProxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(Shared {
            state: watch::channel(State::Open).0,
            trigger: std::sync::Mutex::new(None),
            connections: std::sync::Mutex::new(Vec::new()),
        });
        let target = Arc::new(std::sync::Mutex::new(target));
        let current = target.clone();
        let proxied = shared.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = *lock(&current);
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let requests =
                    tokio::spawn(forward(client_read, server_write, proxied.clone(), false));
                let replies =
                    tokio::spawn(forward(server_read, client_write, proxied.clone(), true));
                let mut open = lock(&proxied.connections);
                open.retain(|t| !t.is_finished());
                open.extend([requests.abort_handle(), replies.abort_handle()]);
            }
        });
        Self {
            addr,
            target,
            shared,
            accept,
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends new connections to `target` from now on (as a virtual address moved to a
    /// promoted standby would); connections already open keep their server.
    pub fn retarget(&self, target: SocketAddr) {
        *lock(&self.target) = target;
    }

    /// Cuts both directions.
    pub fn partition(&self) {
        self.shared.state.send_replace(State::Partitioned);
    }

    /// Lets requests through and holds the replies.
    pub fn hold_replies(&self) {
        self.shared.state.send_replace(State::RepliesHeld);
    }

    /// Cuts both directions as soon as a client sends a request holding `request` (on any
    /// connection): that request is held with everything after it. The proxy sees the bytes
    /// on the wire, so the client must not use TLS (`sslmode=disable`).
    pub fn partition_at(&self, request: &[u8]) {
        assert!(!request.is_empty(), "an empty trigger");
        *lock(&self.shared.trigger) = Some((request.to_vec(), State::Partitioned));
    }

    /// Holds the replies as soon as a client sends a request holding `request`: that request
    /// reaches the server, its answer and every later one are held.
    pub fn hold_replies_after(&self, request: &[u8]) {
        assert!(!request.is_empty(), "an empty trigger");
        *lock(&self.shared.trigger) = Some((request.to_vec(), State::RepliesHeld));
    }

    /// Lets everything through again, the bytes held first.
    pub fn heal(&self) {
        *lock(&self.shared.trigger) = None;
        self.shared.state.send_replace(State::Open);
    }

    /// Closes every connection open on both sides (one accepted at this very moment may
    /// escape), dropping what the proxy holds, and lets
    /// new connections through: a partition that outlasted the server's patience (its
    /// keepalive or timeouts), so that the server ended the sessions and rolled back their
    /// open transactions.
    pub fn sever(&self) {
        *lock(&self.shared.trigger) = None;
        for task in lock(&self.shared.connections).drain(..) {
            task.abort();
        }
        self.shared.state.send_replace(State::Open);
    }
}

impl Drop for PartitionProxy {
    /// Stops accepting and severs every open connection: a test that fails mid-partition
    /// must not leave a session held open (inside a transaction, with its locks) behind it.
    fn drop(&mut self) {
        self.accept.abort();
        self.sever();
    }
}

/// Copies one direction, waiting while the state says it may not cross: before reading (so
/// the bytes stay in the socket) and again before writing what was read. A request that
/// holds the armed trigger switches the state first.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    shared: Arc<Shared>,
    replies: bool,
) {
    let mut state = shared.state.subscribe();
    let may_cross = move |s: &State| match s {
        State::Open => true,
        State::Partitioned => false,
        State::RepliesHeld => !replies,
    };
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if state.wait_for(may_cross).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if !replies {
            let mut trigger = lock(&shared.trigger);
            let hit = trigger
                .as_ref()
                .is_some_and(|(request, _)| buf[..n].windows(request.len()).any(|w| w == request));
            if hit {
                if let Some((_, switched)) = trigger.take() {
                    shared.state.send_replace(switched);
                }
            }
        }
        if state.wait_for(may_cross).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
