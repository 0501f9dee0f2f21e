//! A MariaDB server of the test's own (`mariadbd` on a free loopback port, over a data
//! directory `mariadb-install-db` made), to crash and restart without touching the shared
//! server other tests use.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `mariadbd` under a shell watchdog that stops it when our end of its stdin closes:
/// when the [`MariadbServer`] is dropped, and also when the test process dies in any way, so
/// no server outlives the tests.
const WATCHDOG: &str = r#"
mariadbd "$@" >/dev/null 2>&1 &
pid=$!
echo "$pid"
read -r _
kill -TERM "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
"#;

/// A data directory made by `mariadb-install-db`, removed when dropped (after its server).
#[derive(Debug)]
pub struct DataDir {
    dir: tempfile::TempDir,
}

impl DataDir {
    /// Makes a fresh data directory (about a second); fails the test with what is missing
    /// when the tools are not installed.
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("idem-mariadb-test-")
            .tempdir()
            .expect("temp dir");
        let data = dir.path().join("data");
        let out = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg("--user=root")
            .arg("--auth-root-authentication-method=normal")
            .arg("--skip-test-db")
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run mariadb-install-db ({e}); install the mariadb-server package \
                     (`bash .ci/services` does)"
                )
            });
        assert!(
            out.status.success(),
            "mariadb-install-db failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir }
    }

    /// The directory holding `data/`, the socket and the error log.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Default for DataDir {
    fn default() -> Self {
        Self::new()
    }
}

/// A `mariadbd` process this test started.
#[derive(Debug)]
pub struct MariadbServer {
    /// The loopback port it listens on.
    pub port: u16,
    /// The directory of its [`DataDir`].
    pub dir: PathBuf,
    pid: u32,
    watchdog: Child,
    stdin: Option<ChildStdin>,
}

impl MariadbServer {
    /// Starts `mariadbd` over `data` on `port` (no grant tables: anyone on loopback may
    /// connect, as root) and waits until it accepts connections, at most `limit` (crash
    /// recovery after [`crash`](Self::crash) is part of the start). `None` when it did not.
    pub fn start(port: u16, data: &DataDir, limit: Duration) -> Option<Self> {
        let dir = data.path().to_owned();
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(WATCHDOG)
            .arg("mariadb-watchdog")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg("--user=root")
            .arg(format!("--port={port}"))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", dir.join("mysqld.sock").display()))
            .arg(format!("--pid-file={}", dir.join("mysqld.pid").display()))
            .arg(format!("--log-error={}", dir.join("error.log").display()))
            .arg("--skip-grant-tables")
            .arg("--innodb-buffer-pool-size=32M")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut watchdog = cmd.spawn().unwrap_or_else(|e| {
            panic!("cannot run bash to start mariadbd ({e}); install it with `bash .ci/services`")
        });
        let mut line = String::new();
        BufReader::new(watchdog.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read mariadbd pid");
        let pid = line.trim().parse().expect("mariadbd pid");
        let stdin = watchdog.stdin.take();
        let server = Self {
            port,
            dir,
            pid,
            watchdog,
            stdin,
        };
        server.wait_ready(limit).then_some(server)
    }

    /// `mysql://root@127.0.0.1:<port>/test` (create the database with
    /// [`create_test_database`](Self::create_test_database)).
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    /// Creates the `test` database the [`url`](Self::url) names, if it is not there yet.
    pub async fn create_test_database(&self) {
        use sqlx::{ConnectOptions, Connection, Executor};
        let options = sqlx::mysql::MySqlConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("root");
        let mut conn = options
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connect to the test's mariadbd: {e}"));
        conn.execute("CREATE DATABASE IF NOT EXISTS test")
            .await
            .expect("create database test");
        let _ = conn.close().await;
    }

    fn wait_ready(&self, limit: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Kills the server with SIGKILL, as a crash would, and waits until it is gone.
    pub fn crash(mut self) {
        let status = Command::new("kill")
            .arg("-KILL")
            .arg(self.pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -KILL {} failed", self.pid);
        self.stop_watchdog();
    }

    fn stop_watchdog(&mut self) {
        drop(self.stdin.take());
        let _ = self.watchdog.wait();
    }
}

impl Drop for MariadbServer {
    fn drop(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.flush();
        }
        self.stop_watchdog();
    }
}
