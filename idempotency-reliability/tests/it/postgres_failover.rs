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
//! caller was told, through the engine and through the exactly-once path, unless a commit's
//! wait for the standby is cancelled.

use crate::runners;

use idempotency_core::store::{Cas, Claim, ClaimRequest, RecordStatus};
use idempotency_core::{Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope};
use idempotency_postgres::PostgresStore;
use idempotency_reliability::soak::{
    soak, Expect, FailoverRun, Instances, Runner, SoakConfig, CALLS_AFTER_RECOVERY,
};
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
    // A bound: the chaos ends the run once it has met the failover.
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
        let (address, ending) = (address.clone(), config.ending.clone());
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
            let switched = Instant::now();
            ending.end_after(CALLS_AFTER_RECOVERY);
            (standby, crashed, switched)
        })
    };
    let report = soak(runner, config).await;
    let (_standby, crashed, switched) = chaos.await.expect("chaos");
    FailoverRun::measure(report, crashed, switched)
}

async fn failover_soak(replication: Replication, path: Path, expect: Expect) -> FailoverRun {
    let label = format!("postgres failover, {replication:?}, {path:?}");
    FailoverRun::repeat(&label, expect, || failover_soak_once(replication, path)).await
}

/// Asynchronous streaming replication: the commits of the second the link was cut are lost
/// with the primary, and the checker finds callers told outcomes the new primary does not
/// have.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_standby_loses_outcomes() {
    failover_soak(Replication::Asynchronous, Path::Engine, Expect::Loss).await;
}

/// `synchronous_commit = on` with the standby named in `synchronous_standby_names`: a commit
/// returns once the standby has flushed it, so the promoted standby has every outcome a
/// caller was told.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_standby_on_loses_nothing() {
    failover_soak(Replication::Synchronous("on"), Path::Engine, Expect::Clean).await;
}

/// `synchronous_commit = remote_apply`: as `on`, and the standby has also applied the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_standby_remote_apply_loses_nothing() {
    failover_soak(
        Replication::Synchronous("remote_apply"),
        Path::Engine,
        Expect::Clean,
    )
    .await;
}

/// `synchronous_commit = on` through the exactly-once path: business rows and completions move
/// to the promoted standby together, and no key's work runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_standby_on_keeps_exactly_once() {
    failover_soak(
        Replication::Synchronous("on"),
        Path::ExactlyOnce,
        Expect::Clean,
    )
    .await;
}

/// PostgreSQL's one exception to a synchronous standby: a commit whose wait for the standby
/// is cancelled (`pg_cancel_backend`) is committed on the primary, visible, and reported to
/// the client as done (with a WARNING), although the standby never got it. The replication
/// link is cut and two stores complete a key each. The store as shipped never cancels a
/// commit: its completion is `OutcomeUnknown` after its response timeout (the server goes on
/// waiting), and is, rightly, not there after the failover. The other's waiting session is
/// cancelled: it is told `Applied`, another session sees the key Completed, and after the
/// failover the key is Pending again: a completion a caller was told, lost. So is one made
/// with a `statement_timeout` in the session: PostgreSQL stops the statement's timer before
/// the commit, so it never cancels the wait (this test checks that too).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_wait_for_the_standby_loses_a_completion_the_caller_was_told() {
    use idempotency_postgres::sqlx;
    const TTL: Duration = Duration::from_secs(3600);
    let primary = tokio::task::spawn_blocking(|| {
        PgServer::primary(&[
            "synchronous_standby_names=standby1",
            "synchronous_commit=on",
        ])
    })
    .await
    .expect("start the primary");
    let link = PartitionProxy::start(loopback(primary.port)).await;
    let link_port = link.addr().port();
    let standby = tokio::task::spawn_blocking(move || PgServer::standby(link_port, "standby1"))
        .await
        .expect("start the standby");
    let url = primary.url();
    let connect = |url: String| async move {
        PostgresStore::builder()
            .response_timeout(Duration::from_secs(1))
            .connect(&url)
            .await
            .expect("connect to the primary")
    };
    let shipped = connect(url.clone()).await;
    shipped.migrate().await.expect("migrate");
    // Sessions with a statement timeout far below the response timeout.
    let timed = connect(format!("{url}?options=-c%20statement_timeout%3D200")).await;
    // Sessions with a name to find them by.
    let cancelled = connect(format!("{url}?application_name=cancelled")).await;
    let timeout: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(timed.pool())
        .await
        .expect("SHOW statement_timeout");
    assert_eq!(timeout, "200ms", "the sessions carry the statement timeout");

    let scope = Scope::new("cancelled-wait").expect("scope");
    let request = |id: &RecordId| {
        ClaimRequest::new(
            id.clone(),
            Fingerprint::from_bytes(b"p"),
            Duration::from_secs(600),
            TTL,
        )
    };
    let claim = |store: PostgresStore, id: RecordId| async move {
        match store.claim(&request(&id)).await.expect("claim") {
            Claim::Claimed { token, .. } => token,
            other => panic!("a fresh key was found: {other:?}"),
        }
    };
    let unknown = RecordId::new(IdempotencyKey::random(), scope.clone());
    let timed_out = RecordId::new(IdempotencyKey::random(), scope.clone());
    let told = RecordId::new(IdempotencyKey::random(), scope);
    // The claims reach the standby before the cut (synchronous commit).
    let unknown_token = claim(shipped.clone(), unknown.clone()).await;
    let timed_out_token = claim(timed.clone(), timed_out.clone()).await;
    let told_token = claim(cancelled.clone(), told.clone()).await;

    link.partition();
    for (store, id, token) in [
        (&shipped, &unknown, unknown_token),
        (&timed, &timed_out, timed_out_token),
    ] {
        let err = store
            .complete(id, token, b"outcome", TTL)
            .await
            .expect_err("the commit waits for the standby");
        assert!(
            matches!(err, idempotency_core::Error::OutcomeUnknown { .. }),
            "{err:?}"
        );
    }
    let completing = {
        let (cancelled, told) = (cancelled.clone(), told.clone());
        tokio::spawn(async move { cancelled.complete(&told, told_token, b"outcome", TTL).await })
    };
    // Cancel its session's wait for the standby.
    let start = Instant::now();
    loop {
        let cancelled: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'cancelled' AND wait_event = 'SyncRep' \
             AND query LIKE '%UPDATE%'",
        )
        .fetch_all(shipped.pool())
        .await
        .expect("cancel the waiting session");
        if cancelled.contains(&true) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no session waited for the standby"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let applied = completing
        .await
        .expect("join")
        .expect("a cancelled wait reports the commit as done");
    assert_eq!(applied, Cas::Applied);
    let seen = shipped.get(&told).await.expect("get").expect("the record");
    assert_eq!(
        seen.status,
        RecordStatus::Completed,
        "the completion is visible on the primary"
    );

    tokio::task::spawn_blocking(move || primary.crash())
        .await
        .expect("crash the primary");
    drop(link);
    standby.promote().await;
    let promoted = connect(standby.url()).await;
    for (id, what) in [
        (&told, "the completion the caller was told"),
        (&timed_out, "the completion whose statement timeout passed"),
        (&unknown, "the unknown completion"),
    ] {
        let after = promoted
            .get(id)
            .await
            .expect("get")
            .expect("the claim survived");
        assert_eq!(
            after.status,
            RecordStatus::Pending,
            "{what} is not on the promoted standby"
        );
    }
}
