//! A TCP proxy that can partition the network between a client and a server on loopback,
//! then heal it: while partitioned nothing crosses (bytes wait in the sockets, as TCP holds
//! them during a real partition) and after healing everything held goes through in order.
//! It can also hold only the server's replies, so that a request reaches the server and is
//! applied while its answer is lost for as long as the partition lasts.

use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What crosses the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Open,
    /// Nothing, either way.
    Partitioned,
    /// Requests go through; replies wait.
    RepliesHeld,
}

/// A partitionable proxy in front of one server. Dropping it stops accepting; connections
/// already open keep forwarding until either side closes.
#[derive(Debug)]
pub struct PartitionProxy {
    addr: SocketAddr,
    target: Arc<std::sync::Mutex<SocketAddr>>,
    state: Arc<watch::Sender<State>>,
    accept: tokio::task::JoinHandle<()>,
}

impl PartitionProxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(watch::channel(State::Open).0);
        let shared = state.clone();
        let target = Arc::new(std::sync::Mutex::new(target));
        let current = target.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = *current.lock().unwrap_or_else(|p| p.into_inner());
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(forward(
                    client_read,
                    server_write,
                    shared.subscribe(),
                    false,
                ));
                tokio::spawn(forward(server_read, client_write, shared.subscribe(), true));
            }
        });
        Self {
            addr,
            target,
            state,
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
        *self.target.lock().unwrap_or_else(|p| p.into_inner()) = target;
    }

    /// Cuts both directions.
    pub fn partition(&self) {
        self.state.send_replace(State::Partitioned);
    }

    /// Lets requests through and holds the replies.
    pub fn hold_replies(&self) {
        self.state.send_replace(State::RepliesHeld);
    }

    /// Lets everything through again, the bytes held first.
    pub fn heal(&self) {
        self.state.send_replace(State::Open);
    }
}

impl Drop for PartitionProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies one direction, waiting while the state says it may not cross: before reading (so
/// the bytes stay in the socket) and again before writing what was read.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut state: watch::Receiver<State>,
    replies: bool,
) {
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
        if state.wait_for(may_cross).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
