//! The history-checked soak, once per backend: 16 workers, `IDEMPOTENCY_SOAK_OPS` calls
//! (default 10,000) over 200 engine keys, 80 HTTP keys and 16 short-retention keys, failures
//! injected at random into the work, the calls and the store's completions and extensions,
//! long handlers behind the HTTP layer, a purger running; zero violations and zero double
//! effects. Run with `--nocapture` to see each run's figures.

use crate::runners;

use idempotency_core::store::SystemClock;
use idempotency_core::IdempotencyStore;
use idempotency_mysql::MySqlStore;
use idempotency_postgres::PostgresStore;
use idempotency_redis::RedisStore;
use idempotency_reliability::soak::{soak, EngineRunner, Runner, SoakConfig};
use idempotency_sqlite::{ConnectionMode, SqliteStore};
use idempotency_testing::mysql::{self as my, TableGuard};
use idempotency_testing::postgres::{self as pg, Isolation, SchemaGuard};
use idempotency_testing::redis_server::{self as rs, Cleanup};
use runners::mysql::MySqlTransactionalRunner;
use runners::postgres::PgTransactionalRunner;
use std::sync::Arc;

/// Whether the backend's `purge_expired` deletes records (Redis expires them on its own and
/// purges nothing).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Purge {
    Deletes,
    ExpiresOnItsOwn,
}

async fn run(runner: Arc<dyn Runner>, config: SoakConfig, purge: Purge) {
    let report = soak(runner, config).await;
    eprintln!("{report}");
    report.assert_clean();
    // The run must have exercised what it claims to.
    assert!(
        report.responses.get("fresh").copied().unwrap_or(0) > 0,
        "{report}"
    );
    assert!(
        report.responses.get("replayed").copied().unwrap_or(0) > 0,
        "{report}"
    );
    let x = report.faults.as_ref().expect("a run over the fault rig");
    let i = &x.injected;
    let exercised = [
        ("completions refused", i.complete_refused),
        ("completions whose answer was lost", i.complete_ack_lost),
        ("extensions refused", i.extend_refused),
        ("extensions whose answer was lost", i.extend_ack_lost),
        ("doomed completions", i.doomed),
        ("OutcomeUnknown answers", x.outcome_unknown as u64),
        ("extensions applied", x.extensions_applied as u64),
        ("long engine works", x.long_works as u64),
        ("long HTTP handlers", x.long_handlers as u64),
        (
            "409s while a long handler held its key",
            x.conflicts_during_long as u64,
        ),
        ("commits on short-retention keys", x.short_commits as u64),
        ("claims after expiry", x.claims_after_expiry as u64),
        ("purge calls", x.purge_calls),
        ("stale writes fenced", x.stale_writes_fenced as u64),
    ];
    for (what, n) in exercised {
        assert!(n > 0, "no {what}: the run did not exercise it\n{report}");
    }
    if purge == Purge::Deletes {
        assert!(x.purged > 0, "nothing was purged\n{report}");
    }
}

/// Calls answered after an instant count the soak's calls, never its final reads (a failover
/// run must have had 500 calls answered after the recovery, not 300 and the reads of its
/// 200 keys).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answered_after_counts_calls_not_the_final_reads() {
    let mut config = SoakConfig::from_env("answered-after");
    config.ops = 500;
    let over = config.calls_over.clone();
    let calls_ended = tokio::spawn(async move {
        while !over.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        std::time::Instant::now()
    });
    let store = Arc::new(idempotency_memory::MemoryStore::new());
    let runner = Arc::new(EngineRunner::new(store, config.lease));
    let started = std::time::Instant::now();
    let report = soak(runner, config).await;
    let calls_ended = calls_ended.await.expect("the watcher");
    report.assert_clean();
    assert!(report.answered_after(started) > 0, "{report}");
    assert_eq!(
        report.answered_after(calls_ended),
        0,
        "only the final reads were made after the calls ended"
    );
}

/// The engine over the fault rig: store faults, the ledger, the HTTP layer's engine and the
/// short-retention engines.
fn engine(store: Arc<dyn IdempotencyStore>, config: &SoakConfig) -> Arc<dyn Runner> {
    Arc::new(EngineRunner::with_faults(store, config))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_memory() {
    let config = SoakConfig::from_env("memory");
    let store = Arc::new(idempotency_memory::MemoryStore::new());
    run(engine(store, &config), config, Purge::Deletes).await;
}

async fn sqlite(mode: ConnectionMode, label: &str) {
    let config = SoakConfig::from_env(label);
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::builder(dir.path().join("soak.db"))
        .mode(mode)
        .open()
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    run(engine(Arc::new(store), &config), config, Purge::Deletes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_sqlite_dedicated_thread() {
    sqlite(ConnectionMode::DedicatedThread, "sqlite-thread").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_sqlite_blocking_pool() {
    sqlite(
        ConnectionMode::BlockingPool { connections: 4 },
        "sqlite-pool",
    )
    .await;
}

async fn postgres_store(pool_size: u32) -> (PostgresStore, SchemaGuard) {
    let guard = SchemaGuard::new();
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .build(pg::pool(Isolation::ReadCommitted, pool_size).await)
        .expect("valid names");
    store.migrate().await.expect("migrate");
    (store, guard)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_postgres() {
    let config = SoakConfig::from_env("postgres");
    let (store, _guard) = postgres_store(16).await;
    run(engine(Arc::new(store), &config), config, Purge::Deletes).await;
}

/// Through `PostgresIdempotency::run_in_transaction`: every execution inserts a business row in
/// the completion's transaction, and the rows are counted against the records.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_postgres_transactional() {
    let config = SoakConfig::from_env("postgres-transactional");
    // Stalled holders keep their transaction's connection while they sleep.
    let (store, guard) = postgres_store(24).await;
    let runner = PgTransactionalRunner::new(store, &guard.schema, config.lease).await;
    let report = soak(Arc::new(runner), config).await;
    eprintln!("{report}");
    report.assert_clean();
    assert_eq!(
        report.effect_rows,
        Some(report.committed_effects),
        "one business row per committed key: {report}"
    );
}

async fn mysql_store(pool_size: u32) -> (MySqlStore, TableGuard) {
    let guard = TableGuard::new();
    // InnoDB's default level, REPEATABLE READ: gap locks and deadlocks included.
    let pool = my::pool(my::Isolation::RepeatableRead, pool_size).await;
    let store = MySqlStore::builder()
        .table(&guard.table)
        .build(pool)
        .expect("valid name");
    store.migrate().await.expect("migrate");
    (store, guard)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_mysql() {
    let config = SoakConfig::from_env("mysql");
    let (store, _guard) = mysql_store(16).await;
    run(engine(Arc::new(store), &config), config, Purge::Deletes).await;
}

/// Through `MySqlIdempotency::run_in_transaction`: every execution inserts a business row in
/// the completion's transaction, and the rows are counted against the records.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_mysql_transactional() {
    let config = SoakConfig::from_env("mysql-transactional");
    // Stalled holders keep their transaction's connection while they sleep.
    let (store, _guard) = mysql_store(24).await;
    let effects = TableGuard::new();
    let runner = MySqlTransactionalRunner::new(store, &effects.table, config.lease).await;
    let report = soak(Arc::new(runner), config).await;
    eprintln!("{report}");
    report.assert_clean();
    assert_eq!(
        report.effect_rows,
        Some(report.committed_effects),
        "one business row per committed key: {report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_redis_standalone() {
    let config = SoakConfig::from_env("redis");
    let url = rs::redis_url();
    let prefix = rs::unique_prefix();
    let _cleanup = Cleanup {
        nodes: vec![url.clone()],
        prefix: prefix.clone(),
        check_crossslot: false,
    };
    let store = RedisStore::builder()
        .prefix(prefix)
        .connect(url.as_str())
        .await
        .unwrap_or_else(|e| rs::unreachable_server(&url, &e));
    run(
        engine(Arc::new(store), &config),
        config,
        Purge::ExpiresOnItsOwn,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_redis_cluster() {
    let config = SoakConfig::from_env("redis-cluster");
    let urls = rs::shared_cluster().urls();
    let prefix = rs::unique_prefix();
    let _cleanup = Cleanup {
        nodes: urls.clone(),
        prefix: prefix.clone(),
        check_crossslot: true,
    };
    let store = RedisStore::builder()
        .prefix(prefix)
        .connect_cluster(urls.iter().map(String::as_str))
        .await
        .expect("connect to the test cluster");
    run(
        engine(Arc::new(store), &config),
        config,
        Purge::ExpiresOnItsOwn,
    )
    .await;
}

/// The campaign can fail: a store whose completion ignores the fencing token (it reports a
/// fenced completion as applied, the family of bugs where a stale holder overwrites or
/// believes it committed) is caught as a violation and as double effects.
#[derive(Debug)]
struct IgnoresFencing(idempotency_memory::MemoryStore);

#[idempotency_core::store::async_trait]
impl IdempotencyStore for IgnoresFencing {
    async fn claim(
        &self,
        request: &idempotency_core::store::ClaimRequest,
    ) -> Result<idempotency_core::store::Claim, idempotency_core::Error> {
        self.0.claim(request).await
    }
    async fn complete(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        outcome: &[u8],
        ttl: std::time::Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.0.complete(id, token, outcome, ttl).await?;
        Ok(idempotency_core::store::Cas::Applied)
    }
    async fn fail(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        failure: &idempotency_core::store::Failure,
        ttl: std::time::Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.0.fail(id, token, failure, ttl).await
    }
    async fn extend(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        lease: std::time::Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.0.extend(id, token, lease).await
    }
    async fn reclaim(
        &self,
        id: &idempotency_core::RecordId,
        expected: idempotency_core::FencingToken,
        fingerprint: &idempotency_core::Fingerprint,
        lease: std::time::Duration,
        ttl: std::time::Duration,
    ) -> Result<idempotency_core::store::Reclaim, idempotency_core::Error> {
        self.0.reclaim(id, expected, fingerprint, lease, ttl).await
    }
    async fn get(
        &self,
        id: &idempotency_core::RecordId,
    ) -> Result<Option<idempotency_core::store::Record>, idempotency_core::Error> {
        self.0.get(id).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, idempotency_core::Error> {
        self.0.purge_expired(batch).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_catches_a_store_that_ignores_fencing() {
    let mut config = SoakConfig::from_env("broken-store");
    config.ops = config.ops.min(10_000);
    let store = Arc::new(IgnoresFencing(idempotency_memory::MemoryStore::new()));
    let report = soak(engine(store, &config), config).await;
    eprintln!("{report}");
    assert!(
        !report.violations.is_empty() && !report.double_effects.is_empty(),
        "the broken store went unnoticed: {report}"
    );
    // Both by the clients' answers (the linearizability check and the effect count) and by
    // the ledger (a replaced holder's completion applied).
    let found = |list: &[String], what: &str| list.iter().any(|v| v.contains(what));
    assert!(
        found(&report.violations, "not linearizable")
            && found(&report.double_effects, "committed")
            && found(&report.violations, "applied after token"),
        "the broken store was not caught every way: {report}"
    );
}

/// What answers alone cannot show, the ledger does: a store whose extension answers Applied
/// without moving the lease (a heartbeat that lies). A long work loses its key although it
/// heartbeats, and a retry runs the work again while the lease the store acknowledged still
/// lives. Every answer is one a correct engine could give (the first holder's completion is
/// fenced, the second commits), so only the ledger's double-effect check can catch it.
#[derive(Debug)]
struct LyingHeartbeat(idempotency_memory::MemoryStore);

#[idempotency_core::store::async_trait]
impl IdempotencyStore for LyingHeartbeat {
    async fn claim(
        &self,
        request: &idempotency_core::store::ClaimRequest,
    ) -> Result<idempotency_core::store::Claim, idempotency_core::Error> {
        self.0.claim(request).await
    }
    async fn complete(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        outcome: &[u8],
        ttl: std::time::Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.0.complete(id, token, outcome, ttl).await
    }
    async fn fail(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        failure: &idempotency_core::store::Failure,
        ttl: std::time::Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.0.fail(id, token, failure, ttl).await
    }
    async fn extend(
        &self,
        _id: &idempotency_core::RecordId,
        _token: idempotency_core::FencingToken,
        _lease: std::time::Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        Ok(idempotency_core::store::Cas::Applied)
    }
    async fn reclaim(
        &self,
        id: &idempotency_core::RecordId,
        expected: idempotency_core::FencingToken,
        fingerprint: &idempotency_core::Fingerprint,
        lease: std::time::Duration,
        ttl: std::time::Duration,
    ) -> Result<idempotency_core::store::Reclaim, idempotency_core::Error> {
        self.0.reclaim(id, expected, fingerprint, lease, ttl).await
    }
    async fn get(
        &self,
        id: &idempotency_core::RecordId,
    ) -> Result<Option<idempotency_core::store::Record>, idempotency_core::Error> {
        self.0.get(id).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, idempotency_core::Error> {
        self.0.purge_expired(batch).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_catches_a_heartbeat_that_lies() {
    let mut config = SoakConfig::from_env("lying-heartbeat");
    config.ops = config.ops.min(4_000);
    let store = Arc::new(LyingHeartbeat(idempotency_memory::MemoryStore::new()));
    let report = soak(engine(store, &config), config).await;
    eprintln!("{report}");
    assert!(
        report
            .double_effects
            .iter()
            .any(|d| d.contains("held the key until")),
        "the lying heartbeat went unnoticed: {report}"
    );
}

/// DynamoDB (a table on each local stand-in, each key on one of them), on the system clock:
/// moto answers one request at a time, so the purger scans less often than on the other
/// stores (a scan holds a stand-in).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_dynamodb() {
    let mut config = SoakConfig::from_env("dynamodb");
    config.purge_every = std::time::Duration::from_millis(100);
    let (store, _guards) = idempotency_testing::dynamodb::sharded_store(Arc::new(SystemClock))
        .await
        .expect("a table on each DynamoDB stand-in (bash .ci/services starts them)");
    run(engine(Arc::new(store), &config), config, Purge::Deletes).await;
}

/// DynamoDB behind an unreliable network: 5% of sends throttled (never applied), 2% of
/// writes applied with their answer lost, each sent again by the SDK (up to 4 sends): the
/// store's nonces tell its own applied writes from others' in the resends' answers, and a
/// holder's write that may have applied is an unknown outcome, never a plain failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_dynamodb_flaky_network() {
    let mut config = SoakConfig::from_env("dynamodb-flaky-network");
    config.purge_every = std::time::Duration::from_millis(100);
    let network = idempotency_testing::dynamodb::FlakyNetwork::new(0.05, 0.02, config.seed);
    let (store, _guards) = idempotency_testing::dynamodb::sharded_flaky_store(
        Arc::new(SystemClock),
        network.clone(),
        4,
    )
    .await
    .expect("a table on each DynamoDB stand-in (bash .ci/services starts them)");
    run(engine(Arc::new(store), &config), config, Purge::Deletes).await;
    eprintln!(
        "network faults: {} sends throttled, {} answers of applied writes lost",
        network.throttled(),
        network.answers_lost()
    );
    assert!(network.throttled() > 0 && network.answers_lost() > 0);
}

/// A memory store whose every other `purge_expired` fails (before deleting anything) with
/// `error`.
#[derive(Debug)]
struct PurgeFails {
    inner: idempotency_memory::MemoryStore,
    error: fn() -> idempotency_core::Error,
    calls: std::sync::atomic::AtomicU64,
}

#[idempotency_core::store::async_trait]
impl IdempotencyStore for PurgeFails {
    async fn claim(
        &self,
        request: &idempotency_core::store::ClaimRequest,
    ) -> Result<idempotency_core::store::Claim, idempotency_core::Error> {
        self.inner.claim(request).await
    }
    async fn complete(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        outcome: &[u8],
        ttl: std::time::Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.inner.complete(id, token, outcome, ttl).await
    }
    async fn fail(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        failure: &idempotency_core::store::Failure,
        ttl: std::time::Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.inner.fail(id, token, failure, ttl).await
    }
    async fn extend(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::FencingToken,
        lease: std::time::Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.inner.extend(id, token, lease).await
    }
    async fn reclaim(
        &self,
        id: &idempotency_core::RecordId,
        expected: idempotency_core::FencingToken,
        fingerprint: &idempotency_core::Fingerprint,
        lease: std::time::Duration,
        ttl: std::time::Duration,
    ) -> Result<idempotency_core::store::Reclaim, idempotency_core::Error> {
        self.inner
            .reclaim(id, expected, fingerprint, lease, ttl)
            .await
    }
    async fn get(
        &self,
        id: &idempotency_core::RecordId,
    ) -> Result<Option<idempotency_core::store::Record>, idempotency_core::Error> {
        self.inner.get(id).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, idempotency_core::Error> {
        let n = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n % 2 == 1 {
            return Err((self.error)());
        }
        self.inner.purge_expired(batch).await
    }
}

/// A purge that fails retryably (the network, a throttle) is a fault the next purge makes
/// up for, counted in the report; one that fails for good is an unexpected answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_tells_a_purge_that_failed_retryably_from_one_that_failed_for_good() {
    let run = |error: fn() -> idempotency_core::Error| async move {
        let mut config = SoakConfig::from_env("purge-fails");
        config.ops = config.ops.min(3_000);
        let store = Arc::new(PurgeFails {
            inner: idempotency_memory::MemoryStore::new(),
            error,
            calls: Default::default(),
        });
        let report = soak(engine(store, &config), config).await;
        eprintln!("{report}");
        report
    };
    let retryable = run(|| idempotency_core::Error::backend(true, "throttled")).await;
    retryable.assert_clean();
    let x = retryable.faults.as_ref().expect("the fault rig");
    assert!(x.purges_failed_retryably > 0 && x.purged > 0, "{retryable}");
    let for_good = run(|| idempotency_core::Error::backend(false, "no such table")).await;
    assert!(
        for_good
            .unexpected
            .iter()
            .any(|u| u.contains("purge_expired calls failed")),
        "{for_good}"
    );
}
