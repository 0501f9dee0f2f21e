//! A loopback proxy between the books server and the DynamoDB stand-in, so that the test
//! knows when a killed server's requests have settled (DynamoDB has no session to watch: a
//! request that reached it applies whether or not its client is alive) and can hold the
//! books' writes.
//!
//! It forwards whole HTTP/1.1 requests (read to the end of their `Content-Length` body before
//! any byte goes on), so a request from a server killed mid-send never reaches the stand-in.
//! Every connection the server opened is counted until the proxy has read its end and the
//! stand-in has answered every request it forwarded on it: once none is left after a kill,
//! nothing the killed server sent can still apply.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Default)]
struct State {
    /// Connections from the server not yet finished with.
    connections: AtomicUsize,
    /// Whether `TransactWriteItems` requests (a create's book and completion) are held.
    hold: AtomicBool,
    /// Requests held now.
    held: AtomicUsize,
}

/// The proxy; it stops when dropped.
pub(crate) struct Proxy {
    pub(crate) url: String,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream` (`host:port`).
    pub(crate) async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(State::default());
        let shared = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                shared.connections.fetch_add(1, Ordering::SeqCst);
                let (state, upstream) = (shared.clone(), upstream.clone());
                tokio::spawn(async move {
                    let _ = serve(client, &upstream, &state).await;
                    state.connections.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Self { url, state, task }
    }

    /// Connections of the server still open or with a request at the stand-in.
    pub(crate) fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Holds every `TransactWriteItems` from now on (`true`), or stops holding (`false`):
    /// the held requests are then dropped with their connections, as if lost on the way.
    pub(crate) fn hold(&self, hold: bool) {
        self.state.hold.store(hold, Ordering::SeqCst);
    }

    /// Requests held now.
    pub(crate) fn held(&self) -> usize {
        self.state.held.load(Ordering::SeqCst)
    }
}

/// One HTTP/1.1 message, read whole: its head (with the header names lowercased in
/// `headers`) and its body. `None` at the end of the stream.
async fn message(
    reader: &mut BufReader<impl tokio::io::AsyncRead + Unpin>,
) -> std::io::Result<Option<(Vec<u8>, Vec<(String, String)>)>> {
    let mut bytes = Vec::new();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 {
            return if bytes.is_empty() {
                Ok(None)
            } else {
                Err(std::io::ErrorKind::UnexpectedEof.into())
            };
        }
        bytes.extend_from_slice(line.as_bytes());
        if line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
    }
    let length = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).await?;
    bytes.extend_from_slice(&body);
    Ok(Some((bytes, headers)))
}

async fn serve(client: TcpStream, upstream: &str, state: &State) -> std::io::Result<()> {
    let (client_read, mut client_write) = client.into_split();
    let mut client_read = BufReader::new(client_read);
    while let Some((request, headers)) = message(&mut client_read).await? {
        let transaction = headers
            .iter()
            .any(|(n, v)| n == "x-amz-target" && v.ends_with(".TransactWriteItems"));
        if transaction && state.hold.load(Ordering::SeqCst) {
            state.held.fetch_add(1, Ordering::SeqCst);
            while state.hold.load(Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            state.held.fetch_sub(1, Ordering::SeqCst);
            return Ok(()); // dropped, with the connection
        }
        // A connection per request: the stand-in closes each after its answer.
        let (upstream_read, mut upstream_write) = TcpStream::connect(upstream).await?.into_split();
        let mut upstream_read = BufReader::new(upstream_read);
        upstream_write.write_all(&request).await?;
        let Some((response, _)) = message(&mut upstream_read).await? else {
            return Ok(());
        };
        // The client may be gone (killed): the request was answered all the same.
        let _ = client_write.write_all(&response).await;
    }
    Ok(())
}
