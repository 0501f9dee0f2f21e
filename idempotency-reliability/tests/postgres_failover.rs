//! A PostgreSQL failover in the middle of a history-checked soak: a primary and a streaming
//! standby of the test's own (`initdb`, `pg_basebackup`, ports of their own), the standby
//! replicating through a proxy the test can cut, the application reaching the primary
//! through a second proxy (a virtual address) that is moved to the standby once it is
//! promoted. 1.5 s in, the replication link is cut for a second; then the primary is
//! SIGKILLed, the standby promoted and the address moved.
//!
//! Run with the standby asynchronous, and synchronous with `synchronous_commit` `on` and
//! `remote_apply`: asynchronous replication loses the commits of the cut second (the checker
//! must find that, or the scenario proves nothing), a synchronous standby loses nothing a
//! caller was told, through the engine and through the exactly-once path.

mod runners;

use idempotency_core::IdempotencyStore;
use idempotency_postgres::PostgresStore;
use idempotency_reliability::soak::{soak, FailoverRun, Instances, Runner, SoakConfig};
use idempotency_testing::partition::PartitionProxy;
use idempotency_testing::pg_server::PgServer;
use runners::postgres::PgTransactionalRunner;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replication {
    Asynchronous,
    /// `synchronous_commit` at this level, the standby in `synchronous_standby_names`.
    Synchronous(&'static str),
}

/// What runs the soak's calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// The engine, through two stores (two application instances).
    Engine,
    /// `PostgresIdempotency::run_in_transaction`, a business row per execution in the
    /// completion's transaction.
    ExactlyOnce,
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// One run; `None` when it ended before it had calls in flight at the crash and 500 answered
/// after the switch (it proves nothing then).
async fn failover_soak_once(replication: Replication, path: Path) -> Option<FailoverRun> {
    let settings: Vec<String> = match replication {
        Replication::Asynchronous => vec![],
        Replication::Synchronous(level) => vec![
            "synchronous_standby_names=standby1".to_owned(),
            format!("synchronous_commit={level}"),
        ],
    };
    let primary = tokio::task::spawn_blocking(move || {
        let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
        PgServer::primary(&settings)
    })
    .await
    .expect("start the primary");
    let link = PartitionProxy::start(loopback(primary.port)).await;
    let link_port = link.addr().port();
    let standby = tokio::task::spawn_blocking(move || PgServer::standby(link_port, "standby1"))
        .await
        .expect("start the standby");
    let address = Arc::new(PartitionProxy::start(loopback(primary.port)).await);
    let url = format!("postgres://postgres@{}/postgres", address.addr());

    let connect = || async {
        let store = PostgresStore::builder()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("connect through the address");
        store.migrate().await.expect("migrate");
        store
    };
    let mut config = SoakConfig::from_env(format!("postgres-failover-{replication:?}-{path:?}"));
    // Long enough to outlast the failover, whatever the soak length.
    config.ops = config.ops.max(20_000);
    let runner: Arc<dyn Runner> = match path {
        Path::Engine => {
            // Two application instances, each with its own pool.
            let mut instances: Vec<Arc<dyn IdempotencyStore>> = Vec::new();
            for _ in 0..2 {
                instances.push(Arc::new(connect().await));
            }
            Arc::new(Instances::new(instances, config.lease))
        }
        Path::ExactlyOnce => {
            Arc::new(PgTransactionalRunner::new(connect().await, "public", config.lease).await)
        }
    };
    let chaos = {
        let address = address.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            // The replication link is cut for a second (a network partition between the
            // servers): with a synchronous standby commits wait; without, they go on and
            // never reach it.
            link.partition();
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            let crashed = Instant::now();
            tokio::task::spawn_blocking(move || primary.crash())
                .await
                .expect("crash the primary");
            drop(link);
            standby.promote().await;
            address.retarget(loopback(standby.port));
            (standby, crashed, Instant::now())
        })
    };
    let report = soak(runner, config).await;
    let (_standby, crashed, switched) = chaos.await.expect("chaos");
    FailoverRun::measure(report, crashed, switched)
}

async fn failover_soak(replication: Replication, path: Path) -> FailoverRun {
    let label = format!("postgres failover, {replication:?}, {path:?}");
    FailoverRun::repeat(&label, || failover_soak_once(replication, path)).await
}

/// Asynchronous streaming replication: the commits of the second the link was cut are lost
/// with the primary, and the checker finds callers told outcomes the new primary does not
/// have.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_standby_loses_outcomes() {
    failover_soak(Replication::Asynchronous, Path::Engine)
        .await
        .assert_lost_something();
}

/// `synchronous_commit = on` with the standby named in `synchronous_standby_names`: a commit
/// returns once the standby has flushed it, so the promoted standby has every outcome a
/// caller was told.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_standby_on_loses_nothing() {
    failover_soak(Replication::Synchronous("on"), Path::Engine)
        .await
        .report
        .assert_clean();
}

/// `synchronous_commit = remote_apply`: as `on`, and the standby has also applied the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_standby_remote_apply_loses_nothing() {
    failover_soak(Replication::Synchronous("remote_apply"), Path::Engine)
        .await
        .report
        .assert_clean();
}

/// `synchronous_commit = on` through the exactly-once path: business rows and completions move
/// to the promoted standby together, and no key's work runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_standby_on_keeps_exactly_once() {
    failover_soak(Replication::Synchronous("on"), Path::ExactlyOnce)
        .await
        .report
        .assert_clean();
}
