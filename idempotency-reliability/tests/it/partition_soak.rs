//! Network partitions in the middle of a history-checked soak, per networked backend: the
//! store reaches its server through a proxy that, [`CUTS`] times (the calls end during the
//! last), black-holes both directions or lets requests through and holds the answers, for a random
//! time around the store's response timeout, then heals (or, after a long cut, severs every
//! connection, as a server that gave up on its clients would). Every call ends in a defined
//! outcome (the checker treats a call that got no answer as unknown: it may apply later or
//! never), no key's history may be non-linearizable, no completed outcome may be lost and no
//! work may take effect twice (on the exactly-once paths, counted as business rows).
//!
//! PostgreSQL and MariaDB run their exactly-once path (`run_in_transaction`, a business row
//! in the completion's transaction); Redis runs the engine.

use crate::runners;

use idempotency_mysql::MySqlStore;
use idempotency_postgres::PostgresStore;
use idempotency_redis::RedisStore;
use idempotency_reliability::soak::{soak, Ending, EngineRunner, Report, Runner, SoakConfig};
use idempotency_testing::mysql::{self as my, TableGuard};
use idempotency_testing::partition::PartitionProxy;
use idempotency_testing::postgres::{self as pg, SchemaGuard};
use idempotency_testing::redis_server::{redis_url, unique_prefix, Cleanup};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use runners::mysql::MySqlTransactionalRunner;
use runners::postgres::PgTransactionalRunner;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The stores' response timeout (and pool acquire timeout): a call through a cut gives up
/// after it.
const TIMEOUT: Duration = Duration::from_secs(1);

/// Cuts a run makes, half of each kind; its calls end during the last (the run's count of
/// calls is only a bound), so a run is as long as its cuts, however slowly a loaded machine
/// makes calls.
const CUTS: usize = 20;

/// Cuts of each kind that must meet calls in flight for a run to count.
const MIN_CUTS_IN_FLIGHT: usize = 4;

/// Cuts of each kind that a call must have noticed (a store error) for a run to count.
const MIN_CUTS_NOTICED: usize = 2;

/// No soak run may take longer: a call that hangs through a partition fails the test here
/// instead of stalling the suite.
const RUN_LIMIT: Duration = Duration::from_secs(600);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum CutKind {
    /// Nothing crosses, either way.
    Partition,
    /// Requests reach the server; the answers wait.
    RepliesHeld,
}

/// One cut the chaos made.
#[derive(Clone, Copy, Debug)]
struct Cut {
    kind: CutKind,
    at: Instant,
    length: Duration,
    /// Whether it ended with every connection severed rather than healed.
    severed: bool,
}

/// Sleeps `length`, or less when the calls end first; returns whether they did.
async fn sleep_unless_over(length: Duration, over: &AtomicBool) -> bool {
    let until = Instant::now() + length;
    while Instant::now() < until {
        if over.load(Ordering::Relaxed) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10).min(until - Instant::now())).await;
    }
    over.load(Ordering::Relaxed)
}

/// Cuts the proxy until the soak's calls are over, then heals at once, so that the final
/// reads get through; when the [`CUTS`]th cut begins, no call starts any more, and the cut
/// lasts until the calls in flight have ended (at most ten timeouts). 0.2–0.7 s healthy, then a partition or held answers (taking turns) for
/// 0.25–2.5 response timeouts, healed, or severed one time in three when the cut outlasted
/// the timeout.
async fn chaos(
    proxy: Arc<PartitionProxy>,
    over: Arc<AtomicBool>,
    ending: Arc<Ending>,
    seed: u64,
) -> Vec<Cut> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cuts = Vec::new();
    loop {
        if sleep_unless_over(Duration::from_millis(rng.gen_range(200..700)), &over).await {
            return cuts;
        }
        // Taking turns, so that each kind meets enough calls.
        let kind = if cuts.len() % 2 == 0 {
            CutKind::Partition
        } else {
            CutKind::RepliesHeld
        };
        let mut length = TIMEOUT.mul_f64(rng.gen_range(0.25..2.5));
        let at = Instant::now();
        match kind {
            CutKind::Partition => proxy.partition(),
            CutKind::RepliesHeld => proxy.hold_replies(),
        }
        if cuts.len() + 1 == CUTS {
            // The last cut: no call starts any more, and the cut lasts until those in flight
            // have ended (each within its timeouts; at most ten), then heals for the final
            // reads.
            ending.end_after(0);
            length = 10 * TIMEOUT;
        }
        let ended_early = sleep_unless_over(length, &over).await;
        let severed = !ended_early && length > TIMEOUT && rng.gen_bool(1.0 / 3.0);
        if severed {
            proxy.sever();
        } else {
            proxy.heal();
        }
        cuts.push(Cut {
            kind,
            at,
            length: at.elapsed(),
            severed,
        });
        if ended_early {
            return cuts;
        }
    }
}

/// One soak through the proxy under the chaos; `false` when fewer than
/// [`MIN_CUTS_IN_FLIGHT`] cuts of each kind met calls in flight, or fewer than
/// [`MIN_CUTS_NOTICED`] of each kind were noticed by a call (it proves too little then).
async fn partition_soak_once(
    backend: &str,
    ops: usize,
    proxy: Arc<PartitionProxy>,
    runner: Arc<dyn Runner>,
) -> bool {
    let mut config = SoakConfig::from_env(format!("{backend}-partitions"));
    // A bound: the chaos ends the calls after its cuts.
    config.ops = config.ops.max(ops);
    // A cut may kill a connection under the work's own business write.
    config.business_writes_may_fail = true;
    let chaos = tokio::spawn(chaos(
        proxy.clone(),
        config.calls_over.clone(),
        config.ending.clone(),
        config.seed,
    ));
    let report = tokio::time::timeout(RUN_LIMIT, soak(runner, config))
        .await
        .unwrap_or_else(|_| panic!("{backend}: the soak hung through a partition"));
    let cuts = chaos.await.expect("the chaos task");
    proxy.heal();
    eprintln!("{report}");
    let mut in_flight: BTreeMap<CutKind, (usize, usize)> = BTreeMap::new();
    // Cuts a call noticed: one ended with a store error while the cut lasted or within a
    // response timeout or two after.
    let mut noticed: BTreeMap<CutKind, usize> = BTreeMap::new();
    for cut in &cuts {
        let calls = report.in_flight_at(cut.at);
        let entry = in_flight.entry(cut.kind).or_default();
        if calls > 0 {
            entry.0 += 1;
            entry.1 += calls;
        }
        let until = cut.at + cut.length + 2 * TIMEOUT;
        if report.events.iter().any(|e| {
            let ended = report.instant(e.ended);
            Report::is_backend_error(e) && ended >= cut.at && ended <= until
        }) {
            *noticed.entry(cut.kind).or_default() += 1;
        }
    }
    let unknown = report.responses.get("unknown").copied().unwrap_or(0);
    eprintln!(
        "partition soak {backend}: {} calls, {} cuts ({} partitions, {} with the answers held, \
         {} severed, {:.1} s cut in all); cuts that met calls in flight and the calls they met: \
         {in_flight:?}; cuts a call noticed: {noticed:?}; backend errors {}, unknown answers (no answer, timed out or cancelled) {unknown}; violations {}, double \
         effects {}, committed effects {}, business rows {:?}",
        report.ops,
        cuts.len(),
        cuts.iter().filter(|c| c.kind == CutKind::Partition).count(),
        cuts.iter()
            .filter(|c| c.kind == CutKind::RepliesHeld)
            .count(),
        cuts.iter().filter(|c| c.severed).count(),
        cuts.iter().map(|c| c.length.as_secs_f64()).sum::<f64>(),
        report.backend_errors,
        report.violations.len(),
        report.double_effects.len(),
        report.committed_effects,
        report.effect_rows,
    );
    // Whatever the cuts met, the history must hold.
    report.assert_clean();
    let met = |kind| in_flight.get(&kind).map_or(0, |&(cuts, _)| cuts);
    let seen = |kind| noticed.get(&kind).copied().unwrap_or(0);
    if met(CutKind::Partition) < MIN_CUTS_IN_FLIGHT
        || met(CutKind::RepliesHeld) < MIN_CUTS_IN_FLIGHT
        || seen(CutKind::Partition) < MIN_CUTS_NOTICED
        || seen(CutKind::RepliesHeld) < MIN_CUTS_NOTICED
    {
        eprintln!("{backend}: too few cuts met calls or were noticed; running the scenario again");
        return false;
    }
    true
}

/// Runs the scenario until a run meets enough cuts (at most five runs), each run making
/// `ops` calls at most (the chaos ends them during its [`CUTS`]th cut).
async fn partition_soak<F, Fut>(backend: &str, ops: usize, mut setup: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = (Arc<PartitionProxy>, Arc<dyn Runner>)>,
{
    for _ in 0..5 {
        let _heavy = idempotency_reliability::soak::heavy_run().await;
        let (proxy, runner) = setup().await;
        if partition_soak_once(backend, ops, proxy, runner).await {
            return;
        }
    }
    panic!("{backend}: in five runs the cuts never met enough calls in flight");
}

/// `url` with its server's address replaced by the proxy's.
fn through(url: &str, server: SocketAddr, proxy: &PartitionProxy) -> String {
    let server = server.to_string();
    assert!(
        url.contains(&server),
        "the test server's URL {url} does not name it as {server}"
    );
    url.replace(&server, &proxy.addr().to_string())
}

fn loopback(host: &str, port: u16) -> SocketAddr {
    format!("{host}:{port}")
        .parse()
        .unwrap_or_else(|e| panic!("the test server's address {host}:{port}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_exactly_once_through_partitions() {
    let mut guards = Vec::new();
    partition_soak("postgres", 20_000, || {
        let guard = SchemaGuard::new();
        let schema = guard.schema.clone();
        guards.push(guard);
        async move {
            let options = pg::options();
            let server = loopback(options.get_host(), options.get_port());
            let proxy = Arc::new(PartitionProxy::start(server).await);
            let url = through(&pg::url(), server, &proxy);
            let store = PostgresStore::builder()
                .schema(&schema)
                .table("records")
                .max_connections(16)
                .response_timeout(TIMEOUT)
                .acquire_timeout(TIMEOUT)
                .connect(&url)
                .await
                .expect("connect through the proxy");
            store.migrate().await.expect("migrate");
            let lease = SoakConfig::from_env("lease").lease;
            let runner: Arc<dyn Runner> =
                Arc::new(PgTransactionalRunner::new(store, &schema, lease).await);
            (proxy, runner)
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_exactly_once_through_partitions() {
    let mut guards = Vec::new();
    partition_soak("mariadb", 20_000, || {
        let (records, effects) = (TableGuard::new(), TableGuard::new());
        let (table, effects_table) = (records.table.clone(), effects.table.clone());
        guards.push((records, effects));
        async move {
            let options = my::options();
            let server = loopback(options.get_host(), options.get_port());
            let proxy = Arc::new(PartitionProxy::start(server).await);
            let url = through(&my::url(), server, &proxy);
            let store = MySqlStore::builder()
                .table(&table)
                .max_connections(16)
                .response_timeout(TIMEOUT)
                .acquire_timeout(TIMEOUT)
                .connect(&url)
                .await
                .expect("connect through the proxy");
            store.migrate().await.expect("migrate");
            let lease = SoakConfig::from_env("lease").lease;
            let runner: Arc<dyn Runner> =
                Arc::new(MySqlTransactionalRunner::new(store, &effects_table, lease).await);
            (proxy, runner)
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_engine_through_partitions() {
    let upstream = redis_url()
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    let mut cleanups = Vec::new();
    partition_soak("redis", 40_000, || {
        let prefix = unique_prefix();
        cleanups.push(Cleanup {
            nodes: vec![redis_url()],
            prefix: prefix.clone(),
            check_crossslot: false,
        });
        let upstream = upstream.clone();
        async move {
            let server: SocketAddr = upstream
                .parse()
                .unwrap_or_else(|e| panic!("the test server's address {upstream}: {e}"));
            let proxy = Arc::new(PartitionProxy::start(server).await);
            let store = RedisStore::builder()
                .prefix(&prefix)
                .response_timeout(TIMEOUT)
                .connect(format!("redis://{}", proxy.addr()))
                .await
                .expect("connect through the proxy");
            let lease = SoakConfig::from_env("lease").lease;
            let runner: Arc<dyn Runner> = Arc::new(EngineRunner::new(Arc::new(store), lease));
            (proxy, runner)
        }
    })
    .await;
}
