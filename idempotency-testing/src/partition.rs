//! A TCP proxy that can partition the network between a client and a server on loopback,
//! then heal it: while partitioned nothing crosses (bytes wait in the sockets, as TCP holds
//! them during a real partition) and after healing everything held goes through in order.
//! It can also hold only the server's replies, so that a request reaches the server and is
//! applied while its answer is lost for as long as the partition lasts; start either when a
//! given request is sent (a transaction's `COMMIT`, say); sever every connection, as a
//! partition that outlasted the server's patience does; and cut only the connections that
//! sent a given request (a replica's replication stream, say, while clients go through).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// Bytes that mark the connection whose client sends them.
    marker: std::sync::Mutex<Option<Vec<u8>>>,
    /// What crosses a marked connection, on top of [`Shared::state`].
    marked_state: watch::Sender<State>,
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
            marker: std::sync::Mutex::new(None),
            marked_state: watch::channel(State::Open).0,
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
                let marked = Arc::new(AtomicBool::new(false));
                let requests = tokio::spawn(forward(
                    client_read,
                    server_write,
                    proxied.clone(),
                    marked.clone(),
                    false,
                ));
                let replies = tokio::spawn(forward(
                    server_read,
                    client_write,
                    proxied.clone(),
                    marked,
                    true,
                ));
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

    /// Marks every connection whose client sends a request holding `request`, from the
    /// request on (`REPLCONF`, say: a Redis replica sends it every second), so that
    /// [`partition_marked`](Self::partition_marked) can cut those alone.
    pub fn mark_connections_sending(&self, request: &[u8]) {
        assert!(!request.is_empty(), "an empty marker");
        *lock(&self.shared.marker) = Some(request.to_vec());
    }

    /// Cuts both directions of the marked connections; the others go on.
    pub fn partition_marked(&self) {
        self.shared.marked_state.send_replace(State::Partitioned);
    }

    /// Lets everything through again, the bytes held first.
    pub fn heal(&self) {
        *lock(&self.shared.trigger) = None;
        self.shared.marked_state.send_replace(State::Open);
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
        self.shared.marked_state.send_replace(State::Open);
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

/// Copies one direction, waiting while the state says it may not cross (the marked state
/// too, once the connection is marked): before reading (so the bytes stay in the socket) and
/// again before writing what was read. A request that holds the armed trigger switches the
/// state first; one that holds the marker marks its connection.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    shared: Arc<Shared>,
    marked: Arc<AtomicBool>,
    replies: bool,
) {
    let mut state = shared.state.subscribe();
    let mut marked_state = shared.marked_state.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if !wait_to_cross(&mut state, &mut marked_state, &marked, replies).await {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if !replies {
            let holds = |request: &[u8]| buf[..n].windows(request.len()).any(|w| w == request);
            let mut trigger = lock(&shared.trigger);
            if trigger.as_ref().is_some_and(|(request, _)| holds(request)) {
                if let Some((_, switched)) = trigger.take() {
                    shared.state.send_replace(switched);
                }
            }
            drop(trigger);
            if lock(&shared.marker).as_deref().is_some_and(holds) {
                marked.store(true, Ordering::SeqCst);
            }
        }
        if !wait_to_cross(&mut state, &mut marked_state, &marked, replies).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits until every state that applies to the connection lets bytes cross this way (the
/// marked state too, once it is marked); `false` once the proxy is gone.
async fn wait_to_cross(
    state: &mut watch::Receiver<State>,
    marked_state: &mut watch::Receiver<State>,
    marked: &AtomicBool,
    replies: bool,
) -> bool {
    let may_cross = |s: &State| match s {
        State::Open => true,
        State::Partitioned => false,
        State::RepliesHeld => !replies,
    };
    loop {
        if state.wait_for(may_cross).await.is_err() {
            return false;
        }
        if !marked.load(Ordering::SeqCst) {
            return true;
        }
        if marked_state.wait_for(may_cross).await.is_err() {
            return false;
        }
        if may_cross(&state.borrow()) {
            return true;
        }
    }
}
