//! A MariaDB server of the test's own (`mariadbd` on a free loopback port, over a data
//! directory `mariadb-install-db` made), to crash and restart without touching the shared
//! server other tests use; and a primary with a replica of the test's own, to fail over.

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
        let tmp = dir.path().join("tmp");
        std::fs::create_dir(&tmp).expect("the data directory's tmpdir");
        let out = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            // A tmpdir of its own: a `mariadbd` starting meanwhile (another test's) deletes
            // the `#sql*` files in its tmpdir, the bootstrap's temporary tables among them
            // when they share `/tmp`.
            .arg(format!("--tmpdir={}", tmp.display()))
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
        Self::start_with(port, data, limit, &[])
    }

    /// As [`start`](Self::start), with `options` (`--name=value`) after the test's own.
    pub fn start_with(
        port: u16,
        data: &DataDir,
        limit: Duration,
        options: &[String],
    ) -> Option<Self> {
        Self::start_with_env(port, data, limit, options, &[])
    }

    /// As [`start_with`](Self::start_with), with `env` added to the server's environment
    /// (for one, [`SlowRedo::env`]).
    pub fn start_with_env(
        port: u16,
        data: &DataDir,
        limit: Duration,
        options: &[String],
        env: &[(String, String)],
    ) -> Option<Self> {
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
            .arg(format!("--tmpdir={}", dir.join("tmp").display()))
            .arg("--skip-grant-tables")
            .arg("--innodb-buffer-pool-size=32M")
            .args(options)
            .envs(env.iter().map(|(k, v)| (k, v)))
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
        use sqlx::{Connection, Executor};
        let mut conn = self.admin().await;
        conn.execute("CREATE DATABASE IF NOT EXISTS test")
            .await
            .expect("create database test");
        let _ = conn.close().await;
    }

    /// A connection of the test's own to this server (no database selected).
    async fn admin(&self) -> sqlx::MySqlConnection {
        use sqlx::ConnectOptions;
        sqlx::mysql::MySqlConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("root")
            .connect()
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "connect to the test's mariadbd on port {}: {e}\n{}",
                    self.port,
                    self.log_tail()
                )
            })
    }

    /// The tail of its error log, for a failing test's message.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
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

/// A slow disk under InnoDB's redo log, on demand: a small library loaded into `mariadbd`
/// (`LD_PRELOAD`, built from C with `cc` by [`new`](Self::new), in a second) makes every write
/// to the redo log wait `delay` while [`hold`](Self::hold) is in force. A test can so crash the server at a known
/// moment of a commit: after the statement has run, before its redo record is in the file.
#[derive(Debug)]
pub struct SlowRedo {
    dir: tempfile::TempDir,
    delay: Duration,
}

impl SlowRedo {
    /// Builds the library; fails the test with what is missing when no C compiler is.
    pub fn new(delay: Duration) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("idem-slow-redo-")
            .tempdir()
            .expect("temp dir");
        let source = dir.path().join("slow_redo.c");
        std::fs::write(&source, include_str!("slow_redo.c")).expect("write the shim's source");
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(dir.path().join("slow_redo.so"))
            .arg(&source)
            .arg("-ldl")
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run cc to build the redo-log shim ({e}); install gcc")
            });
        assert!(
            out.status.success(),
            "cc could not build the redo-log shim: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir, delay }
    }

    /// The environment a server is started with ([`MariadbServer::start_with_env`]).
    pub fn env(&self) -> Vec<(String, String)> {
        let path = |name: &str| self.dir.path().join(name).display().to_string();
        vec![
            ("LD_PRELOAD".to_owned(), path("slow_redo.so")),
            ("SLOW_REDO_FLAG".to_owned(), path("hold")),
            ("SLOW_REDO_ENGAGED".to_owned(), path("engaged")),
            (
                "SLOW_REDO_MS".to_owned(),
                self.delay.as_millis().to_string(),
            ),
        ]
    }

    /// From now on, every write to the redo log waits the delay before it is made.
    pub fn hold(&self) {
        std::fs::write(self.dir.path().join("hold"), b"").expect("raise the shim's flag");
    }

    /// From now on, writes to the redo log go straight through again.
    pub fn release(&self) {
        let _ = std::fs::remove_file(self.dir.path().join("hold"));
    }

    /// Whether a server held a write back since this was made (if not, the library did not
    /// take hold: the server writes its log some other way).
    pub fn engaged(&self) -> bool {
        self.dir.path().join("engaged").exists()
    }
}

/// How a primary started by [`MariadbServer::primary`] acknowledges a commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    /// Asynchronous (MariaDB's default): the commit returns once the primary has it; a
    /// replica gets it later, or never if the primary dies first.
    Asynchronous,
    /// Semi-synchronous, `rpl_semi_sync_master_wait_point = AFTER_SYNC`: the commit is
    /// written to the binary log, and becomes visible and returns only once a replica has
    /// acknowledged receiving it, or once `timeout` (`rpl_semi_sync_master_timeout`) has
    /// passed: then MariaDB silently falls back to asynchronous replication until a replica
    /// catches up again.
    SemiSynchronous {
        /// How long a commit waits for the replica's acknowledgement.
        timeout: Duration,
    },
}

impl Replication {
    fn primary_options(self) -> Vec<String> {
        match self {
            Self::Asynchronous => vec![],
            Self::SemiSynchronous { timeout } => vec![
                "--rpl-semi-sync-master-enabled=ON".to_owned(),
                "--rpl-semi-sync-master-wait-point=AFTER_SYNC".to_owned(),
                format!("--rpl-semi-sync-master-timeout={}", timeout.as_millis()),
            ],
        }
    }

    fn replica_options(self) -> Vec<String> {
        match self {
            Self::Asynchronous => vec![],
            Self::SemiSynchronous { .. } => {
                vec!["--rpl-semi-sync-slave-enabled=ON".to_owned()]
            }
        }
    }
}

/// How long a server of the failover tests may take to start.
const REPLICATED_START: Duration = Duration::from_secs(60);

impl MariadbServer {
    /// Starts a primary over `data` on `port`, writing a binary log with GTIDs
    /// (`--server-id=1`) for replicas to follow, acknowledging commits as `replication` says.
    /// Panics with the server's log when it does not start.
    pub fn primary(port: u16, data: &DataDir, replication: Replication) -> Self {
        let mut options = vec![
            "--server-id=1".to_owned(),
            format!("--log-bin={}", data.path().join("binlog").display()),
            "--binlog-format=ROW".to_owned(),
        ];
        options.extend(replication.primary_options());
        Self::start_with(port, data, REPLICATED_START, &options)
            .unwrap_or_else(|| panic!("the primary did not start on port {port}"))
    }

    /// Starts a server over `data` on `port` (`--server-id=2`, a binary log of its own so it
    /// can be promoted) that will replicate as `replication` says once
    /// [`replicate_from`](Self::replicate_from) points it at a primary.
    pub fn replica(port: u16, data: &DataDir, replication: Replication) -> Self {
        let mut options = vec![
            "--server-id=2".to_owned(),
            format!("--log-bin={}", data.path().join("binlog").display()),
            "--binlog-format=ROW".to_owned(),
            "--log-slave-updates=ON".to_owned(),
        ];
        options.extend(replication.replica_options());
        Self::start_with(port, data, REPLICATED_START, &options)
            .unwrap_or_else(|| panic!("the replica did not start on port {port}"))
    }

    /// Makes this server a replica of the primary reachable at `upstream_port` (the primary,
    /// or a proxy in front of it), from the start of its binary log (GTID `slave_pos`), and
    /// waits until both replication threads run. Call it before the primary takes writes.
    pub async fn replicate_from(&self, upstream_port: u16) {
        use sqlx::Executor;
        let mut conn = self.admin().await;
        conn.execute(
            format!(
                "CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = {upstream_port}, \
                 MASTER_USER = 'root', MASTER_CONNECT_RETRY = 1, MASTER_USE_GTID = slave_pos"
            )
            .as_str(),
        )
        .await
        .unwrap_or_else(|e| panic!("CHANGE MASTER TO: {e}\n{}", self.log_tail()));
        conn.execute("START SLAVE")
            .await
            .unwrap_or_else(|e| panic!("START SLAVE: {e}\n{}", self.log_tail()));
        let start = Instant::now();
        loop {
            let status = slave_status(&mut conn).await;
            let running = |name: &str| status.get(name).map(String::as_str) == Some("Yes");
            if running("Slave_IO_Running") && running("Slave_SQL_Running") {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "replication did not start: {status:?}\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `replicas` semi-synchronous replicas are connected to this primary, so no
    /// commit waits for one that is not there yet.
    pub async fn wait_semi_sync_replicas(&self, replicas: u32) {
        let mut conn = self.admin().await;
        let start = Instant::now();
        loop {
            let clients: Option<(String, String)> =
                sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Rpl_semi_sync_master_clients'")
                    .fetch_optional(&mut conn)
                    .await
                    .expect("read Rpl_semi_sync_master_clients");
            let clients: u32 = clients.and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
            if clients >= replicas {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{clients} semi-synchronous replicas connected after 30 s, not {replicas}\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Promotes a replica whose primary is gone: stops fetching, applies everything it had
    /// received (`MASTER_GTID_WAIT` on the position its I/O thread reached), forgets the
    /// primary and takes writes.
    pub async fn promote(&self) {
        use sqlx::Executor;
        let mut conn = self.admin().await;
        conn.execute("STOP SLAVE IO_THREAD")
            .await
            .unwrap_or_else(|e| panic!("STOP SLAVE IO_THREAD: {e}\n{}", self.log_tail()));
        let status = slave_status(&mut conn).await;
        let received = status.get("Gtid_IO_Pos").cloned().unwrap_or_default();
        let waited: i64 = sqlx::query_scalar("SELECT MASTER_GTID_WAIT(?, 60)")
            .bind(&received)
            .fetch_one(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("MASTER_GTID_WAIT: {e}\n{}", self.log_tail()));
        assert_eq!(
            waited,
            0,
            "the replica did not apply what it received ({received}) within 60 s\n{}",
            self.log_tail()
        );
        for statement in ["STOP SLAVE", "RESET SLAVE ALL", "SET GLOBAL read_only = 0"] {
            conn.execute(statement)
                .await
                .unwrap_or_else(|e| panic!("{statement}: {e}\n{}", self.log_tail()));
        }
    }
}

/// `SHOW SLAVE STATUS` as column name to text (empty when the server replicates nothing).
async fn slave_status(
    conn: &mut sqlx::MySqlConnection,
) -> std::collections::HashMap<String, String> {
    use sqlx::{Column, Executor, Row};
    let Some(row) = conn
        .fetch_optional("SHOW SLAVE STATUS")
        .await
        .expect("SHOW SLAVE STATUS")
    else {
        return Default::default();
    };
    row.columns()
        .iter()
        .map(|column| {
            let value = row
                .try_get::<Option<String>, _>(column.ordinal())
                .ok()
                .flatten()
                .or_else(|| {
                    row.try_get::<Option<Vec<u8>>, _>(column.ordinal())
                        .ok()
                        .flatten()
                        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
                })
                .or_else(|| {
                    row.try_get::<Option<i64>, _>(column.ordinal())
                        .ok()
                        .flatten()
                        .map(|n| n.to_string())
                })
                .or_else(|| {
                    row.try_get::<Option<u64>, _>(column.ordinal())
                        .ok()
                        .flatten()
                        .map(|n| n.to_string())
                })
                .unwrap_or_default();
            (column.name().to_owned(), value)
        })
        .collect()
}

impl Drop for MariadbServer {
    fn drop(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.flush();
        }
        self.stop_watchdog();
    }
}
