//! PostgreSQL servers of the test's own: a primary over a data directory `initdb` made and a
//! streaming standby `pg_basebackup` copied from it, on free loopback ports, to kill and
//! promote without touching the shared server other tests use.
//!
//! PostgreSQL refuses to run as root: when the tests run as root the servers and tools run as
//! the `postgres` user (`setpriv`), over directories given to it.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Runs `postgres` under a shell watchdog that stops it when our end of its stdin closes:
/// when the [`PgServer`] is dropped, and also when the test process dies in any way, so no
/// server outlives the tests. The first argument is the directory to remove afterwards.
const WATCHDOG: &str = r#"
dir="$1"; shift
"$@" >>"$dir/server.log" 2>&1 &
pid=$!
echo "$pid"
read -r _
kill -QUIT "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
rm -rf "$dir"
"#;

/// The directory of PostgreSQL's server binaries: `$IDEMPOTENCY_TEST_PG_BIN`, or the newest
/// `/usr/lib/postgresql/<version>/bin` (Debian's layout).
fn bin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(find_bin_dir).clone()
}

fn find_bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("IDEMPOTENCY_TEST_PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).unwrap_or_else(|| {
        panic!(
            "no PostgreSQL server binaries under /usr/lib/postgresql: install the \
             postgresql package (`bash .ci/services` does) or set IDEMPOTENCY_TEST_PG_BIN"
        )
    })
}

fn running_as_root() -> bool {
    static ROOT: OnceLock<bool> = OnceLock::new();
    *ROOT.get_or_init(|| {
        Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
    })
}

/// `tool` from [`bin_dir`], run as `postgres` when the tests run as root.
fn command(tool: &str) -> Command {
    let path = bin_dir().join(tool);
    if running_as_root() {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
            .arg(path);
        cmd
    } else {
        Command::new(path)
    }
}

/// A fresh directory the server's user owns.
fn fresh_dir(prefix: &str) -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("temp dir")
        .keep();
    if running_as_root() {
        let ok = Command::new("chown")
            .arg("postgres:postgres")
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "chown postgres {} failed", dir.display());
    }
    dir
}

fn run(mut cmd: Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what} ({e})"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A free loopback port.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local addr").port()
}

/// A `postgres` process this test started.
#[derive(Debug)]
pub struct PgServer {
    /// The loopback port it listens on.
    pub port: u16,
    /// Its directory: `data/` and `server.log`.
    pub dir: PathBuf,
    pid: u32,
    watchdog: Child,
    stdin: Option<ChildStdin>,
}

impl PgServer {
    /// `initdb` and start a primary that streams to standbys, with `settings` (`name=value`,
    /// as for `postgres -c`) on top.
    pub fn primary(settings: &[&str]) -> Self {
        let dir = fresh_dir("idem-pg-primary-");
        let mut initdb = command("initdb");
        initdb
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync"]);
        run(initdb, "initdb");
        let mut all = vec!["wal_level=replica", "max_wal_senders=8"];
        all.extend_from_slice(settings);
        Self::start(dir, &all)
    }

    /// Copies the server on `upstream_port` with `pg_basebackup` (its `primary_conninfo`
    /// names that port: a proxy in front of the primary, say) and starts it as a streaming
    /// standby whose `cluster_name`, and so its name in `synchronous_standby_names`, is
    /// `name`. Waits until the primary sees it streaming.
    pub fn standby(upstream_port: u16, name: &str) -> Self {
        let dir = fresh_dir("idem-pg-standby-");
        let mut backup = command("pg_basebackup");
        backup
            .args(["-h", "127.0.0.1", "-U", "postgres", "-R", "-X", "stream"])
            .args(["--no-sync", "-p"])
            .arg(upstream_port.to_string())
            .arg("-D")
            .arg(dir.join("data"));
        run(backup, "pg_basebackup");
        let cluster = format!("cluster_name={name}");
        Self::start(dir, &[cluster.as_str(), "hot_standby=on"])
    }

    fn start(dir: PathBuf, settings: &[&str]) -> Self {
        for _ in 0..5 {
            let port = free_port();
            let port_s = port.to_string();
            let socket_dir = format!("unix_socket_directories={}", dir.display());
            let mut cmd = Command::new("bash");
            cmd.arg("-c").arg(WATCHDOG).arg("pg-watchdog").arg(&dir);
            let postgres = bin_dir().join("postgres");
            if running_as_root() {
                cmd.args([
                    "setpriv",
                    "--reuid=postgres",
                    "--regid=postgres",
                    "--init-groups",
                ]);
            }
            cmd.arg(postgres)
                .arg("-D")
                .arg(dir.join("data"))
                .args(["-p", &port_s, "-c", "listen_addresses=127.0.0.1", "-c"])
                .arg(&socket_dir)
                .args(["-c", "fsync=on", "-c", "max_connections=100"]);
            for s in settings {
                cmd.args(["-c", s]);
            }
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            let mut watchdog = cmd
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run bash to start postgres ({e})"));
            let mut line = String::new();
            BufReader::new(watchdog.stdout.take().expect("stdout"))
                .read_line(&mut line)
                .expect("read the postgres pid");
            let pid = line.trim().parse().expect("postgres pid");
            let stdin = watchdog.stdin.take();
            let server = Self {
                port,
                dir: dir.clone(),
                pid,
                watchdog,
                stdin,
            };
            if server.wait_ready(Duration::from_secs(30)) {
                return server;
            }
            // The port was taken meanwhile, most likely: the watchdog removes the directory
            // only when asked to stop, which dropping `server` does, so keep the data.
            std::mem::forget(server);
        }
        panic!(
            "could not start postgres over {} (see server.log there)",
            dir.display()
        );
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn wait_ready(&self, limit: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            let mut ready = command("pg_isready");
            ready
                .args(["-h", "127.0.0.1", "-q", "-p"])
                .arg(self.port.to_string());
            if ready.status().is_ok_and(|s| s.success()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Kills the postmaster with SIGKILL, as a crash would (its backends exit once they see
    /// it gone), and waits until its port is closed.
    pub fn crash(mut self) {
        let status = Command::new("kill")
            .arg("-KILL")
            .arg(self.pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -KILL {} failed", self.pid);
        let start = Instant::now();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        while TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the killed postgres still listens"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop_watchdog();
    }

    /// The tail of its log, for a failing test's message.
    pub fn log_tail(&self) -> String {
        tail(&self.dir.join("server.log"))
    }

    fn stop_watchdog(&mut self) {
        drop(self.stdin.take());
        let _ = self.watchdog.wait();
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.flush();
        }
        self.stop_watchdog();
    }
}

impl PgServer {
    /// Promotes a standby (`pg_promote`, waiting until it is done).
    pub async fn promote(&self) {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&self.url())
            .await
            .unwrap_or_else(|e| panic!("connect to the standby: {e}\n{}", self.log_tail()));
        let promoted: bool = sqlx::query_scalar("SELECT pg_promote(true, 60)")
            .fetch_one(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("pg_promote: {e}\n{}", self.log_tail()));
        assert!(
            promoted,
            "the standby was not promoted:\n{}",
            self.log_tail()
        );
        let _ = conn.close().await;
    }
}
