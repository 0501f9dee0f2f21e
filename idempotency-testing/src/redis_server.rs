//! Redis test support: the shared server's URL, per-case key prefixes cleaned up afterwards,
//! and `redis-server` processes and a 3-master cluster that tests start themselves on free
//! loopback ports.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The env var naming the standalone Redis the tests use.
pub const URL_VAR: &str = "IDEMPOTENCY_TEST_REDIS_URL";

/// The standalone Redis URL: `$IDEMPOTENCY_TEST_REDIS_URL` or the local default.
pub fn redis_url() -> String {
    std::env::var(URL_VAR).unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A key prefix no other case uses.
pub fn unique_prefix() -> String {
    format!("idem-test:{}:", uuid::Uuid::new_v4().simple())
}

/// Fails the test with how to start the server.
pub fn unreachable_server(url: &str, e: &dyn std::fmt::Display) -> ! {
    panic!(
        "cannot reach Redis at {url}: {e}. Start it with `bash .ci/services` (Redis on \
         127.0.0.1:6379), or point {URL_VAR} at a running server."
    )
}

/// Deletes every key under a prefix when dropped; on a cluster it also asserts that no node
/// has ever answered `CROSSSLOT`.
#[derive(Debug)]
pub struct Cleanup {
    /// Every node a key may live on.
    pub nodes: Vec<String>,
    /// The prefix whose keys are deleted.
    pub prefix: String,
    /// Whether to fail when a node counted a `CROSSSLOT` error.
    pub check_crossslot: bool,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let mut crossslot = Vec::new();
        for node in &self.nodes {
            let Ok(mut con) = redis::Client::open(node.as_str()).and_then(|c| c.get_connection())
            else {
                continue;
            };
            let pattern = format!("{}*", self.prefix);
            let keys: Vec<String> = match redis::Commands::scan_match(&mut con, &pattern) {
                Ok(iter) => iter.collect(),
                Err(_) => Vec::new(),
            };
            for key in keys {
                let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(key).query(&mut con);
            }
            if self.check_crossslot {
                let stats: String = redis::cmd("INFO")
                    .arg("errorstats")
                    .query(&mut con)
                    .unwrap_or_default();
                crossslot.extend(
                    stats
                        .lines()
                        .filter(|l| l.starts_with("errorstat_CROSSSLOT"))
                        .map(|l| format!("{node}: {l}")),
                );
            }
        }
        if !crossslot.is_empty() && !std::thread::panicking() {
            panic!("cluster nodes answered CROSSSLOT: {crossslot:?}");
        }
    }
}

/// A loopback port that is free, and whose cluster bus port (+10000) is free too.
pub fn free_port() -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = listener.local_addr().expect("local addr").port();
        if port > 55_000 {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Runs `redis-server` under a shell watchdog that stops it when our end of its stdin
/// closes: when this value is dropped, and also when the test process dies in any way, so no
/// server outlives the tests.
const WATCHDOG: &str = r#"
redis-server "$@" >/dev/null 2>&1 &
pid=$!
echo "$pid"
read -r _
kill -TERM "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
if [ -n "$IDEM_TEST_REMOVE_DIR" ]; then rm -rf "$IDEM_TEST_REMOVE_DIR"; fi
"#;

/// A `redis-server` process this test started.
#[derive(Debug)]
pub struct RedisServer {
    /// The loopback port it listens on.
    pub port: u16,
    /// Its working directory (AOF, logs).
    pub dir: PathBuf,
    pid: u32,
    watchdog: Child,
    stdin: Option<ChildStdin>,
}

impl RedisServer {
    /// Starts `redis-server` on `port` with `dir` as its working directory, plus `extra`
    /// arguments, and waits until it answers `PING`. `remove_dir` makes the watchdog delete
    /// `dir` once the server has stopped.
    pub fn start(port: u16, dir: &Path, extra: &[&str], remove_dir: bool) -> Option<Self> {
        Self::launch(None, port, dir, extra, remove_dir)
    }

    /// [`RedisServer::start`], with a configuration file first on the command line when
    /// `config` is given (Sentinel needs one it can rewrite).
    fn launch(
        config: Option<&Path>,
        port: u16,
        dir: &Path,
        extra: &[&str],
        remove_dir: bool,
    ) -> Option<Self> {
        let port_s = port.to_string();
        let mut args: Vec<&str> = config
            .map(|c| c.to_str().expect("utf-8 temp dir"))
            .into_iter()
            .collect();
        args.extend([
            "--port",
            &port_s,
            "--bind",
            "127.0.0.1",
            "--dir",
            dir.to_str().expect("utf-8 temp dir"),
            "--save",
            "",
            "--logfile",
            "redis.log",
            "--protected-mode",
            "no",
        ]);
        args.extend_from_slice(extra);
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(WATCHDOG)
            .arg("redis-watchdog")
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if remove_dir {
            cmd.env("IDEM_TEST_REMOVE_DIR", dir);
        }
        let mut watchdog = cmd.spawn().unwrap_or_else(|e| {
            panic!(
                "cannot run bash to start redis-server ({e}); install it with `bash .ci/services`"
            )
        });
        let mut line = String::new();
        BufReader::new(watchdog.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read redis-server pid");
        let pid = line.trim().parse().expect("redis-server pid");
        let stdin = watchdog.stdin.take();
        let server = Self {
            port,
            dir: dir.to_owned(),
            pid,
            watchdog,
            stdin,
        };
        server.wait_ready(Duration::from_secs(10)).then_some(server)
    }

    /// Starts a server on a free port in a fresh temp dir (removed when it stops), retrying
    /// on another port if the chosen one was taken in the meantime.
    pub fn start_anywhere(extra: &[&str]) -> Self {
        assert_redis_installed();
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("idem-redis-test-")
                .tempdir()
                .expect("temp dir")
                .keep();
            if let Some(s) = Self::start(free_port(), &dir, extra, true) {
                return s;
            }
        }
        panic!("could not start redis-server on a free loopback port (see redis.log in /tmp/idem-redis-test-*)");
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn ping(&self) -> bool {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    fn wait_ready(&self, limit: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            if self.ping() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Kills the server with SIGKILL, as a crash would, and waits until it is gone.
    pub fn crash(mut self) {
        self.signal("-KILL");
        self.stop_watchdog();
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(signal)
            .arg(self.pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {} failed", self.pid);
    }

    fn stop_watchdog(&mut self) {
        drop(self.stdin.take());
        let _ = self.watchdog.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.flush();
        }
        self.stop_watchdog();
    }
}

/// A connection to `url` for a test's own commands (5 s timeouts).
fn admin(url: &str) -> redis::RedisResult<redis::Connection> {
    let conn = redis::Client::open(url)?.get_connection_with_timeout(Duration::from_secs(5))?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    Ok(conn)
}

/// Polls `ready` every 50 ms until it holds, failing the test with `what` after `limit`.
fn wait_until(limit: Duration, what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether the server at `url` reports `role`, and as a replica a live, synced link.
fn has_role(url: &str, role: &str) -> bool {
    let Ok(mut conn) = admin(url) else {
        return false;
    };
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query(&mut conn)
        .unwrap_or_default();
    info.contains(&format!("role:{role}"))
        && (role != "slave"
            || (info.contains("master_link_status:up")
                && !info.contains("master_sync_in_progress:1")))
}

/// A primary, one replica and three Sentinels (quorum 2) on free loopback ports, the
/// Sentinels quick to act: the primary is taken for down after 3 s without an answer.
#[derive(Debug)]
pub struct SentinelGroup {
    /// The name the Sentinels monitor the primary under.
    pub name: String,
    /// The data servers: the first started as the primary, the second as its replica. A
    /// crashed one is `None` until it is restarted.
    pub servers: Vec<Option<RedisServer>>,
    /// The Sentinels.
    pub sentinels: Vec<RedisServer>,
}

impl SentinelGroup {
    /// Starts the group and waits until every Sentinel knows the replica and the other
    /// Sentinels. The Sentinels' failover timeout is 5 s.
    pub fn start() -> Self {
        Self::start_linked(|primary| primary, Duration::from_secs(5))
    }

    /// [`SentinelGroup::start`], with the replica replicating from the port `link` returns
    /// for the primary's port (a proxy of the test's, say, to cut the replication link), and
    /// the Sentinels' `failover-timeout` set to `failover_timeout`. Sentinel repoints a
    /// replica that replicates from an address other than the primary's once that timeout
    /// has passed, so a linked group needs one longer than the test.
    pub fn start_linked(link: impl FnOnce(u16) -> u16, failover_timeout: Duration) -> Self {
        assert_redis_installed();
        let name = "idem-primary".to_owned();
        let primary = RedisServer::start_anywhere(&[]);
        let replica = Self::replica_of(link(primary.port));
        let sentinels: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_sentinel(&name, primary.port, failover_timeout))
            .collect();
        let group = Self {
            name,
            servers: vec![Some(primary), Some(replica)],
            sentinels,
        };
        for sentinel in &group.sentinels {
            wait_until(
                Duration::from_secs(30),
                "a Sentinel did not discover the replica and the other Sentinels",
                || {
                    let Ok(mut conn) = admin(&sentinel.url()) else {
                        return false;
                    };
                    let fields: Vec<String> = redis::cmd("SENTINEL")
                        .arg("MASTER")
                        .arg(&group.name)
                        .query(&mut conn)
                        .unwrap_or_default();
                    let field = |k: &str| {
                        fields
                            .iter()
                            .position(|f| f == k)
                            .and_then(|i| fields.get(i + 1))
                            .cloned()
                    };
                    field("num-slaves").as_deref() == Some("1")
                        && field("num-other-sentinels").as_deref() == Some("2")
                },
            );
        }
        group
    }

    /// [`SentinelGroup::start_linked`] with the replica replicating through a
    /// [`PartitionProxy`](crate::partition::PartitionProxy) the test can cut, and a failover
    /// timeout of 10 minutes (Sentinel leaves that link alone). Call it from async code: it
    /// starts the servers on a blocking thread and the proxy on the current runtime.
    pub async fn start_with_cuttable_link() -> (Self, crate::partition::PartitionProxy) {
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let mut link = None;
            let group = Self::start_linked(
                |primary| {
                    let proxy = runtime.block_on(crate::partition::PartitionProxy::start(
                        ([127, 0, 0, 1], primary).into(),
                    ));
                    let port = proxy.addr().port();
                    link = Some(proxy);
                    port
                },
                Duration::from_secs(600),
            );
            (group, link.expect("the replica's link"))
        })
        .await
        .expect("start the Sentinel group")
    }

    /// Starts a replica of the server on `primary_port` and waits until it has synced.
    fn replica_of(primary_port: u16) -> RedisServer {
        let port = primary_port.to_string();
        let replica = RedisServer::start_anywhere(&["--replicaof", "127.0.0.1", &port]);
        let url = replica.url();
        wait_until(Duration::from_secs(30), "the replica did not sync", || {
            has_role(&url, "slave")
        });
        replica
    }

    /// The Sentinels' URLs.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// The primary's port as the first Sentinel that answers names it.
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            let mut conn = admin(&s.url()).ok()?;
            let addr: Vec<String> = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(&self.name)
                .query(&mut conn)
                .ok()?;
            addr.get(1)?.parse().ok()
        })
    }

    /// Kills the current primary with SIGKILL; returns its port.
    pub fn crash_primary(&mut self) -> u16 {
        let port = self.primary_port().expect("the Sentinels name a primary");
        let slot = self
            .servers
            .iter_mut()
            .find(|s| s.as_ref().is_some_and(|s| s.port == port))
            .expect("the primary is one of the group's servers");
        slot.take().expect("running").crash();
        port
    }

    /// Waits until the Sentinels name a primary other than `old` and it reports the role;
    /// returns its port.
    pub fn wait_for_failover(&self, old: u16, limit: Duration) -> u16 {
        let mut new = None;
        wait_until(limit, "the Sentinels did not promote the replica", || {
            new = self
                .primary_port()
                .filter(|p| *p != old && has_role(&format!("redis://127.0.0.1:{p}"), "master"));
            new.is_some()
        });
        new.expect("checked")
    }

    /// Waits until the server on `port` reports `role` (`master`, or `slave` with a live,
    /// synced link).
    pub fn wait_for_role(&self, port: u16, role: &str, limit: Duration) {
        let url = format!("redis://127.0.0.1:{port}");
        wait_until(limit, &format!("port {port} never became {role}"), || {
            has_role(&url, role)
        });
    }

    /// Restarts the crashed server that listened on `port` as a replica of the primary on
    /// `primary_port` (empty: it kept nothing on disk) that Sentinel never promotes, and
    /// waits until it has synced.
    pub fn rejoin(&mut self, port: u16, primary_port: u16) {
        let slot = self
            .servers
            .iter_mut()
            .find(|s| s.is_none())
            .expect("a crashed server to restart");
        let dir = tempfile::Builder::new()
            .prefix("idem-redis-test-")
            .tempdir()
            .expect("temp dir")
            .keep();
        let primary = primary_port.to_string();
        // Priority 0: Sentinel never promotes it. It comes back empty (nothing persisted),
        // and a failover that promoted it before it synced would empty the data set: the
        // setting Redis documents for servers without persistence that restart on their own.
        let server = RedisServer::start(
            port,
            &dir,
            &[
                "--replicaof",
                "127.0.0.1",
                &primary,
                "--replica-priority",
                "0",
            ],
            true,
        )
        .unwrap_or_else(|| panic!("could not restart redis-server on port {port}"));
        let url = server.url();
        let start = Instant::now();
        while !has_role(&url, "slave") {
            if start.elapsed() > Duration::from_secs(30) {
                let log = |dir: &Path| {
                    let text = std::fs::read_to_string(dir.join("redis.log")).unwrap_or_default();
                    let lines: Vec<&str> = text.lines().collect();
                    lines[lines.len().saturating_sub(40)..].join("\n")
                };
                let sentinels: Vec<String> = self.sentinels.iter().map(|s| log(&s.dir)).collect();
                panic!(
                    "the restarted server did not sync within 30 s; its log:\n{}\nthe Sentinels':\n{}",
                    log(&dir),
                    sentinels.join("\n--\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        *slot = Some(server);
    }
}

impl RedisServer {
    /// Starts a Sentinel on a free port that monitors the primary on `primary_port` as
    /// `name` (quorum 2, a server down after 3 s without an answer: less, and on a loaded
    /// 2-core machine a freshly promoted primary that is slow to answer the Sentinels' new
    /// connection is taken for down and failed over again).
    pub fn start_sentinel(name: &str, primary_port: u16, failover_timeout: Duration) -> Self {
        let failover_ms = failover_timeout.as_millis();
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("idem-sentinel-test-")
                .tempdir()
                .expect("temp dir")
                .keep();
            let config = dir.join("sentinel.conf");
            std::fs::write(
                &config,
                format!(
                    "sentinel monitor {name} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {name} 3000\n\
                     sentinel failover-timeout {name} {failover_ms}\n"
                ),
            )
            .expect("write sentinel.conf");
            if let Some(s) = Self::launch(Some(&config), free_port(), &dir, &["--sentinel"], true) {
                return s;
            }
        }
        panic!("could not start a Sentinel on a free loopback port");
    }
}

/// Fails the test when `redis-server` or `redis-cli` is missing.
pub fn assert_redis_installed() {
    for tool in ["redis-server", "redis-cli"] {
        let ok = Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "{tool} is not installed: run `bash .ci/services`");
    }
}

/// A 3-master Redis Cluster on free loopback ports.
#[derive(Debug)]
pub struct Cluster {
    /// The three primaries.
    pub nodes: Vec<RedisServer>,
}

impl Cluster {
    /// Every primary's URL.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Starts three cluster-enabled servers, joins them with `redis-cli --cluster create` and
    /// waits for `cluster_state:ok` on every node.
    pub fn start() -> Self {
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
            "--appendonly",
            "no",
        ];
        let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start_anywhere(&args)).collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Self { nodes };
        cluster.wait_ok(Duration::from_secs(30));
        cluster
    }

    fn wait_ok(&self, limit: Duration) {
        let start = Instant::now();
        loop {
            let all_ok = self.nodes.iter().all(|n| {
                redis::Client::open(n.url())
                    .and_then(|c| c.get_connection())
                    .and_then(|mut c| redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c))
                    .is_ok_and(|info| {
                        info.contains("cluster_state:ok")
                            && info.contains("cluster_slots_ok:16384")
                            && info.contains("cluster_known_nodes:3")
                    })
            });
            if all_ok {
                return;
            }
            assert!(
                start.elapsed() < limit,
                "the test cluster did not reach cluster_state:ok within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The cluster this test binary shares. Its servers stop when the process exits: each runs
/// under a watchdog that ends it when the process's end of its stdin closes.
pub fn shared_cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(Cluster::start)
}

/// The `cluster-node-timeout` of a [`ReplicatedCluster`]: a primary is taken for failed, and
/// its replica starts an election, after this long without an answer on the cluster bus.
/// Shorter, and on a loaded 2-core machine a node slow to answer is failed over by mistake.
pub const REPLICATED_CLUSTER_NODE_TIMEOUT: Duration = Duration::from_secs(2);

/// One shard of a [`ReplicatedCluster`].
#[derive(Debug)]
struct Shard {
    /// The server started as the primary; `None` once crashed.
    primary: Option<RedisServer>,
    /// Its replica (the primary once a failover promoted it).
    replica: RedisServer,
    /// The proxy in front of the primary, whose address the primary announces.
    link: crate::partition::PartitionProxy,
    /// The server that took the crashed primary's port as the promoted replica's replica.
    rejoined: Option<RedisServer>,
}

/// A Redis Cluster of three shards, each a primary and one replica, on free loopback ports,
/// failing over on its own after [`REPLICATED_CLUSTER_NODE_TIMEOUT`]. Each primary announces
/// the address of a [`PartitionProxy`](crate::partition::PartitionProxy) in front of it, so
/// clients and its replica both reach it through the proxy, and the test can cut the
/// replication stream alone ([`cut_replication`](Self::cut_replication)) while clients go on.
/// Nothing is persisted.
#[derive(Debug)]
pub struct ReplicatedCluster {
    shards: Vec<Shard>,
}

/// The slots of shard `i` of three.
fn shard_slots(i: usize) -> (u16, u16) {
    [(0, 5460), (5461, 10922), (10923, 16383)][i]
}

/// Starts a cluster-enabled server on `port` in a fresh temp dir (removed when it stops).
fn start_cluster_node(port: u16, extra: &[&str]) -> RedisServer {
    let dir = tempfile::Builder::new()
        .prefix("idem-redis-test-")
        .tempdir()
        .expect("temp dir")
        .keep();
    let timeout = REPLICATED_CLUSTER_NODE_TIMEOUT.as_millis().to_string();
    let mut args = vec![
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        &timeout,
        "--appendonly",
        "no",
    ];
    args.extend_from_slice(extra);
    RedisServer::start(port, &dir, &args, true)
        .unwrap_or_else(|| panic!("could not start a cluster node on port {port}"))
}

/// `command` on the server at `url`, failing the test with `what` on an error.
fn run<T: redis::FromRedisValue>(url: &str, what: &str, command: &redis::Cmd) -> T {
    admin(url)
        .and_then(|mut conn| command.query(&mut conn))
        .unwrap_or_else(|e| panic!("{what} on {url}: {e}"))
}

/// The node id of the server at `url`.
fn node_id(url: &str) -> String {
    run(url, "CLUSTER MYID", redis::cmd("CLUSTER").arg("MYID"))
}

/// How many nodes the server at `url` knows, itself included.
fn known_nodes(url: &str) -> usize {
    let nodes: String = run(url, "CLUSTER NODES", redis::cmd("CLUSTER").arg("NODES"));
    nodes.lines().filter(|l| !l.trim().is_empty()).count()
}

/// Whether the server at `url` says the cluster is up, all slots served.
fn cluster_ok(url: &str) -> bool {
    admin(url)
        .and_then(|mut c| redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c))
        .is_ok_and(|info| {
            info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
        })
}

/// Joins the fresh node at `url` to the cluster `via` knows (through `CLUSTER MEET`) as a
/// replica of the primary `primary_id`, and waits until it replicates, synced.
fn join_as_replica(url: &str, port: u16, via: &str, primary_id: &str) {
    let _: String = run(
        via,
        "CLUSTER MEET",
        redis::cmd("CLUSTER").arg("MEET").arg("127.0.0.1").arg(port),
    );
    wait_until(
        Duration::from_secs(30),
        "the new node did not learn of its primary",
        || {
            let nodes: String = run(url, "CLUSTER NODES", redis::cmd("CLUSTER").arg("NODES"));
            nodes.contains(primary_id)
        },
    );
    let _: String = run(
        url,
        "CLUSTER REPLICATE",
        redis::cmd("CLUSTER").arg("REPLICATE").arg(primary_id),
    );
    wait_until(
        Duration::from_secs(30),
        "the new replica did not sync",
        || has_role(url, "slave"),
    );
}

impl ReplicatedCluster {
    /// Starts the six servers and the proxies, assigns the slots, joins the nodes, makes each
    /// replica follow its primary (through the proxy), and waits until every node says the
    /// cluster is up and every replica has synced. Call it from async code: the proxies run
    /// on the current runtime, the servers start on a blocking thread.
    pub async fn start() -> Self {
        assert_redis_installed();
        let mut links = Vec::new();
        let mut primary_ports = Vec::new();
        for _ in 0..3 {
            let port = free_port();
            let link = crate::partition::PartitionProxy::start(std::net::SocketAddr::from((
                [127, 0, 0, 1],
                port,
            )))
            .await;
            // A replica sends `REPLCONF` on its link at least every second.
            link.mark_connections_sending(b"REPLCONF");
            primary_ports.push(port);
            links.push(link);
        }
        let announced: Vec<u16> = links.iter().map(|l| l.addr().port()).collect();
        let ports = primary_ports.clone();
        let servers = tokio::task::spawn_blocking(move || {
            let mut primaries = Vec::new();
            for (port, announced) in ports.iter().zip(&announced) {
                let announced = announced.to_string();
                let bus = (port + 10_000).to_string();
                primaries.push(start_cluster_node(
                    *port,
                    &[
                        "--cluster-announce-port",
                        &announced,
                        "--cluster-announce-bus-port",
                        &bus,
                    ],
                ));
            }
            let replicas: Vec<RedisServer> = (0..3)
                .map(|_| start_cluster_node(free_port(), &[]))
                .collect();
            let all: Vec<&RedisServer> = primaries.iter().chain(&replicas).collect();
            for (epoch, node) in all.iter().enumerate() {
                let _: String = run(
                    &node.url(),
                    "CLUSTER SET-CONFIG-EPOCH",
                    redis::cmd("CLUSTER").arg("SET-CONFIG-EPOCH").arg(epoch + 1),
                );
            }
            for (i, primary) in primaries.iter().enumerate() {
                let (first, last) = shard_slots(i);
                let _: String = run(
                    &primary.url(),
                    "CLUSTER ADDSLOTSRANGE",
                    redis::cmd("CLUSTER")
                        .arg("ADDSLOTSRANGE")
                        .arg(first)
                        .arg(last),
                );
            }
            let first = primaries[0].url();
            for node in &all[1..] {
                let _: String = run(
                    &first,
                    "CLUSTER MEET",
                    redis::cmd("CLUSTER")
                        .arg("MEET")
                        .arg("127.0.0.1")
                        .arg(node.port),
                );
            }
            for node in &all {
                wait_until(
                    Duration::from_secs(30),
                    "the cluster's nodes did not all meet",
                    || known_nodes(&node.url()) == 6,
                );
            }
            for (primary, replica) in primaries.iter().zip(&replicas) {
                let id = node_id(&primary.url());
                let _: String = run(
                    &replica.url(),
                    "CLUSTER REPLICATE",
                    redis::cmd("CLUSTER").arg("REPLICATE").arg(&id),
                );
            }
            for node in &all {
                wait_until(
                    Duration::from_secs(30),
                    "the cluster did not come up",
                    || cluster_ok(&node.url()),
                );
            }
            for replica in &replicas {
                wait_until(Duration::from_secs(30), "a replica did not sync", || {
                    has_role(&replica.url(), "slave")
                });
            }
            (primaries, replicas)
        })
        .await
        .expect("start the cluster");
        let (primaries, replicas) = servers;
        let shards: Vec<Shard> = primaries
            .into_iter()
            .zip(replicas)
            .zip(links)
            .map(|((primary, replica), link)| Shard {
                primary: Some(primary),
                replica,
                link,
                rejoined: None,
            })
            .collect();
        for shard in &shards {
            // The replica must follow its primary through the proxy, or cutting it cuts
            // nothing.
            let info: String = run(
                &shard.replica.url(),
                "INFO replication",
                redis::cmd("INFO").arg("replication"),
            );
            assert!(
                info.contains(&format!("master_port:{}", shard.link.addr().port())),
                "the replica does not replicate through the proxy: {info}"
            );
        }
        Self { shards }
    }

    /// The URLs clients start from (the primaries' announced addresses).
    pub fn urls(&self) -> Vec<String> {
        self.shards
            .iter()
            .map(|s| format!("redis://{}", s.link.addr()))
            .collect()
    }

    /// Cuts the replication stream of shard `i`'s primary (both ways), as a network
    /// partition between it and its replica would, while clients still reach it.
    pub fn cut_replication(&self, i: usize) {
        self.shards[i].link.partition_marked();
    }

    /// Kills shard `i`'s primary with SIGKILL and closes the connections through its proxy
    /// (the replication link with them).
    pub fn crash_primary(&mut self, i: usize) {
        let shard = &mut self.shards[i];
        shard.primary.take().expect("a live primary").crash();
        shard.link.sever();
    }

    /// Waits until shard `i`'s replica is a primary and says the cluster is up again.
    pub fn wait_for_failover(&self, i: usize, limit: Duration) {
        let url = self.shards[i].replica.url();
        wait_until(limit, "the replica was not promoted", || {
            has_role(&url, "master") && cluster_ok(&url)
        });
    }

    /// Starts a fresh, empty server (on a port of its own: the crashed primary is still
    /// listed, failed, at its old address) and joins it as the promoted replica's replica,
    /// so its writes can be acknowledged again; waits until it has synced.
    pub fn rejoin(&mut self, i: usize) {
        let shard = &mut self.shards[i];
        assert!(shard.primary.is_none(), "shard {i}'s primary is still up");
        let node = start_cluster_node(free_port(), &[]);
        let promoted = shard.replica.url();
        let id = node_id(&promoted);
        join_as_replica(&node.url(), node.port, &promoted, &id);
        shard.rejoined = Some(node);
    }
}
