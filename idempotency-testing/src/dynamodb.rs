//! The local DynamoDB stand-in the DynamoDB store's tests run against, and a table per test.

use idempotency_core::store::{Cas, Claim, ClaimRequest, Clock, Failure, Reclaim, Record};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use idempotency_dynamodb::aws_sdk_dynamodb::{
    self,
    config::{BehaviorVersion, Credentials, Region},
};
use idempotency_dynamodb::DynamoStore;
use std::sync::Arc;
use std::time::Duration;

/// The stand-in's URL: `IDEMPOTENCY_TEST_DYNAMODB_URL`, by default moto's server as
/// `bash .ci/services` starts it.
pub fn url() -> String {
    std::env::var("IDEMPOTENCY_TEST_DYNAMODB_URL")
        .unwrap_or_else(|_| "http://127.0.0.1:8000".to_owned())
}

/// Every stand-in the per-test tables of [`store`] are spread over:
/// `IDEMPOTENCY_TEST_DYNAMODB_URLS` (comma-separated), else [`url`] alone. A stand-in serves
/// one request at a time; tests that run side by side go faster on several.
pub fn urls() -> Vec<String> {
    std::env::var("IDEMPOTENCY_TEST_DYNAMODB_URLS")
        .ok()
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .filter(|urls| !urls.is_empty())
        .unwrap_or_else(|| vec![url()])
}

/// The next of [`urls`], in turn.
fn next_url() -> String {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let urls = urls();
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    urls[n % urls.len()].clone()
}

/// An SDK client for the stand-in: plain HTTP, fixed test credentials.
pub fn client() -> aws_sdk_dynamodb::Client {
    client_at(&url())
}

/// An SDK client for a stand-in at `url`: plain HTTP, fixed test credentials.
pub fn client_at(url: &str) -> aws_sdk_dynamodb::Client {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

/// Deletes its table when dropped.
#[derive(Debug)]
pub struct TableGuard {
    client: aws_sdk_dynamodb::Client,
    table: String,
}

impl TableGuard {
    /// A guard for `table` on the stand-in, which something else creates (or has created).
    pub fn for_table(table: impl Into<String>) -> Self {
        Self {
            client: client(),
            table: table.into(),
        }
    }
}

impl Drop for TableGuard {
    fn drop(&mut self) {
        let client = self.client.clone();
        let table = std::mem::take(&mut self.table);
        // Best effort, off the dropping thread (which may be inside a runtime).
        std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                let _ = rt.block_on(client.delete_table().table_name(table).send());
            }
        });
    }
}

/// A store on a new table of its own (created, TTL on), on `clock`, on the stand-in at
/// [`url`] (where [`client`] reaches it too).
pub async fn store(clock: Arc<dyn Clock>) -> Result<(DynamoStore, TableGuard), Error> {
    store_at_url(clock, url()).await
}

/// [`store`], on the next of the stand-ins [`urls`] lists, in turn: for tests that reach the
/// table only through the store (the kit's cases), so that many of them side by side spread
/// their requests over several stand-ins.
pub async fn spread_store(clock: Arc<dyn Clock>) -> Result<(DynamoStore, TableGuard), Error> {
    store_at_url(clock, next_url()).await
}

/// A store on a table of its own on every stand-in [`urls`] lists, each key on one of them
/// (by a hash of its address): for the kit's cases, whose long ones (the model-based
/// sequences, the settling races) would otherwise wait on one stand-in that serves one
/// request at a time. Every operation of a key goes to the same table, so each key keeps the
/// semantics of one store; a purge sweeps the tables in turn, at most `batch` items in all.
pub async fn sharded_store(
    clock: Arc<dyn Clock>,
) -> Result<(ShardedStore, Vec<TableGuard>), Error> {
    sharded(|url| store_at_url(clock.clone(), url)).await
}

/// A [`ShardedStore`] over one store per stand-in [`urls`] lists, each made by `make`.
async fn sharded<F, Fut>(make: F) -> Result<(ShardedStore, Vec<TableGuard>), Error>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<(DynamoStore, TableGuard), Error>>,
{
    let mut shards: Vec<Arc<dyn IdempotencyStore>> = Vec::new();
    let mut guards = Vec::new();
    for url in urls() {
        let (store, guard) = make(url).await?;
        shards.push(Arc::new(store));
        guards.push(guard);
    }
    Ok((ShardedStore { shards }, guards))
}

/// See [`sharded_store`].
#[derive(Debug)]
pub struct ShardedStore {
    shards: Vec<Arc<dyn IdempotencyStore>>,
}

impl ShardedStore {
    fn shard(&self, id: &RecordId) -> &dyn IdempotencyStore {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        id.hash(&mut h);
        let n = self.shards.len() as u64;
        let i = usize::try_from(h.finish() % n).unwrap_or(0);
        self.shards[i].as_ref()
    }
}

#[async_trait::async_trait]
impl IdempotencyStore for ShardedStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        self.shard(&request.id).claim(request).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.shard(id).complete(id, token, outcome, ttl).await
    }
    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.shard(id).fail(id, token, failure, ttl).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        self.shard(id).extend(id, token, lease).await
    }
    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        self.shard(id)
            .reclaim(id, expected, fingerprint, lease, ttl)
            .await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.shard(id).get(id).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        let mut purged = 0u64;
        for shard in &self.shards {
            let left = batch.saturating_sub(usize::try_from(purged).unwrap_or(usize::MAX));
            if left == 0 {
                break;
            }
            purged += shard.purge_expired(left).await?;
        }
        Ok(purged)
    }
}

async fn store_at_url(
    clock: Arc<dyn Clock>,
    at: String,
) -> Result<(DynamoStore, TableGuard), Error> {
    let client = client_at(&at);
    let table = format!("idk-test-{}", uuid::Uuid::new_v4().simple());
    let store = DynamoStore::builder()
        .table(&table)
        .clock(clock)
        .build(client.clone())?;
    store.create_table().await.map_err(|e| {
        Error::Config(format!(
            "cannot create a table on the DynamoDB stand-in at {} ({e}); start it with \
             `bash .ci/services`",
            at
        ))
    })?;
    Ok((store, TableGuard { client, table }))
}

/// An SDK interceptor that makes the network between the store and DynamoDB unreliable, at
/// random per send (each attempt of a request, the SDK's resends included):
///
/// - **throttled**: the request never reaches the table (it is sent as a harmless
///   `DescribeLimits` instead) and is answered `400 ThrottlingException`, as DynamoDB
///   answers a request over its throughput; the SDK backs off and sends it again;
/// - **answer lost**: a write applies and its answer is replaced by a `500`, as when a
///   connection drops after DynamoDB applied it; the SDK sends it again, and the resend meets
///   the changed item.
///
/// Scans, and the table's own management (create, describe, TTL), are left alone. Counts
/// what it did in [`FlakyNetwork::throttled`] and [`FlakyNetwork::answers_lost`].
#[derive(Clone, Debug)]
pub struct FlakyNetwork {
    /// Per million sends.
    throttle_ppm: u32,
    lose_answer_ppm: u32,
    state: Arc<FlakyState>,
}

#[derive(Debug, Default)]
struct FlakyState {
    seed: std::sync::atomic::AtomicU64,
    throttled: std::sync::atomic::AtomicU64,
    answers_lost: std::sync::atomic::AtomicU64,
}

/// What one send meets, kept in the send's own config bag (sends of many requests run at
/// once through one client).
#[derive(Clone, Copy, Debug)]
enum SendFate {
    Throttled,
    AnswerLost,
}

impl aws_smithy_types::config_bag::Storable for SendFate {
    type Storer = aws_smithy_types::config_bag::StoreReplace<Self>;
}

impl FlakyNetwork {
    /// Throttles `throttled` and loses the answer of `answer_lost` of all sends (fractions,
    /// 0 to 1), on a schedule from `seed`.
    pub fn new(throttled: f64, answer_lost: f64, seed: u64) -> Self {
        let ppm = |f: f64| (f.clamp(0.0, 1.0) * 1e6) as u32;
        let state = FlakyState::default();
        state
            .seed
            .store(seed | 1, std::sync::atomic::Ordering::Relaxed);
        Self {
            throttle_ppm: ppm(throttled),
            lose_answer_ppm: ppm(answer_lost),
            state: Arc::new(state),
        }
    }

    /// Sends throttled so far.
    pub fn throttled(&self) -> u64 {
        self.state
            .throttled
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Writes applied whose answer was lost so far.
    pub fn answers_lost(&self) -> u64 {
        self.state
            .answers_lost
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A number in 0..1,000,000 (a splitmix64 step).
    fn roll(&self) -> u32 {
        let mut z = self
            .state
            .seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % 1_000_000) as u32
    }
}

impl aws_sdk_dynamodb::config::Intercept for FlakyNetwork {
    fn name(&self) -> &'static str {
        "FlakyNetwork"
    }

    fn modify_before_transmit(
        &self,
        context: &mut aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextMut<
            '_,
        >,
        _: &aws_sdk_dynamodb::config::RuntimeComponents,
        cfg: &mut aws_sdk_dynamodb::config::ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let request = context.request_mut();
        let operation = request
            .headers()
            .get("x-amz-target")
            .and_then(|t| t.rsplit('.').next())
            .unwrap_or("")
            .to_owned();
        let write = matches!(
            operation.as_str(),
            "PutItem" | "UpdateItem" | "DeleteItem" | "TransactWriteItems"
        );
        let read = operation == "GetItem";
        let roll = self.roll();
        let fate = if (write || read) && roll < self.throttle_ppm {
            request
                .headers_mut()
                .insert("x-amz-target", "DynamoDB_20120810.DescribeLimits");
            Some(SendFate::Throttled)
        } else if write && roll < self.throttle_ppm + self.lose_answer_ppm {
            Some(SendFate::AnswerLost)
        } else {
            None
        };
        match fate {
            Some(fate) => {
                cfg.interceptor_state().store_put(fate);
            }
            None => {
                cfg.interceptor_state().unset::<SendFate>();
            }
        }
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut aws_sdk_dynamodb::config::interceptors::BeforeDeserializationInterceptorContextMut<'_>,
        _: &aws_sdk_dynamodb::config::RuntimeComponents,
        cfg: &mut aws_sdk_dynamodb::config::ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let Some(fate) = cfg.load::<SendFate>().copied() else {
            return Ok(());
        };
        let response = context.response_mut();
        let ordering = std::sync::atomic::Ordering::Relaxed;
        match fate {
            SendFate::Throttled => {
                self.state.throttled.fetch_add(1, ordering);
                *response.status_mut() =
                    aws_smithy_runtime_api::http::StatusCode::try_from(400u16)?;
                response
                    .headers_mut()
                    .insert("x-amzn-errortype", "ThrottlingException");
                *response.body_mut() = aws_smithy_types::body::SdkBody::from(
                    r#"{"__type":"com.amazonaws.dynamodb.v20120810#ThrottlingException","message":"Rate of requests exceeds the allowed throughput."}"#,
                );
            }
            // Only a write that applied loses its answer (a refused one keeps its refusal).
            SendFate::AnswerLost if response.status().as_u16() == 200 => {
                self.state.answers_lost.fetch_add(1, ordering);
                *response.status_mut() =
                    aws_smithy_runtime_api::http::StatusCode::try_from(500u16)?;
                *response.body_mut() = aws_smithy_types::body::SdkBody::from("");
            }
            SendFate::AnswerLost => {}
        }
        Ok(())
    }
}

/// A store on a new table of its own (created, TTL on), on `clock`, whose client sends
/// through `network` and retries as a latency-bound service would configure it: up to
/// `attempts` sends, backing off from 10 ms.
pub async fn flaky_store(
    clock: Arc<dyn Clock>,
    network: FlakyNetwork,
    attempts: u32,
) -> Result<(DynamoStore, TableGuard), Error> {
    flaky_store_at(clock, network, attempts, url()).await
}

/// [`flaky_store`] on every stand-in [`urls`] lists, each key on one of them as in
/// [`sharded_store`], every shard's client sending through `network`: for soaks, whose
/// calls would otherwise queue at one stand-in that serves one request at a time.
pub async fn sharded_flaky_store(
    clock: Arc<dyn Clock>,
    network: FlakyNetwork,
    attempts: u32,
) -> Result<(ShardedStore, Vec<TableGuard>), Error> {
    sharded(|url| flaky_store_at(clock.clone(), network.clone(), attempts, url)).await
}

async fn flaky_store_at(
    clock: Arc<dyn Clock>,
    network: FlakyNetwork,
    attempts: u32,
    at: String,
) -> Result<(DynamoStore, TableGuard), Error> {
    let (created, guard) = store_at_url(clock.clone(), at.clone()).await?;
    let config = client_at(&at)
        .config()
        .to_builder()
        .interceptor(network)
        .retry_config(
            aws_sdk_dynamodb::config::retry::RetryConfig::standard()
                .with_max_attempts(attempts)
                .with_initial_backoff(std::time::Duration::from_millis(10)),
        )
        .build();
    let store = DynamoStore::builder()
        .table(created.table())
        .clock(clock)
        .build(aws_sdk_dynamodb::Client::from_conf(config))?;
    Ok((store, guard))
}

/// A stand-in server of the test's own (moto's, through `.ci/dynamodb-local.py`, as
/// `bash .ci/services` installs it), on a loopback port, that the test can crash and start
/// again: with a journal, a server started again replays the writes it acknowledged before.
/// It stops when dropped, and when the test process dies (a watchdog shell holds it).
#[derive(Debug)]
pub struct MotoServer {
    /// The loopback port it listens on.
    pub port: u16,
    pid: u32,
    watchdog: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
}

/// Runs the server in the background, prints its pid, and kills it when its stdin closes.
const MOTO_WATCHDOG: &str = r#"
"$0" "$@" >"${IDEM_MOTO_LOG:-/dev/null}" 2>&1 &
pid=$!
echo "$pid"
read -r _
kill -KILL "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
"#;

/// The Python of the stand-in's virtualenv, as `.ci/services` installs it.
fn moto_python() -> std::path::PathBuf {
    let tools = std::env::var_os("IDEMPOTENCY_TOOLS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/idempotency")
        });
    tools.join("moto-5.1.22/bin/python")
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

impl MotoServer {
    /// Starts a stand-in on `port` (with `journal`, replaying it first) and waits until it
    /// answers, for up to `within`.
    pub async fn start(
        port: u16,
        journal: Option<&std::path::Path>,
        within: std::time::Duration,
    ) -> Self {
        use std::io::BufRead as _;
        let python = moto_python();
        assert!(
            python.exists(),
            "no DynamoDB stand-in at {} (install it with `bash .ci/services`)",
            python.display()
        );
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../.ci/dynamodb-local.py");
        let mut cmd = std::process::Command::new("bash");
        cmd.arg("-c")
            .arg(MOTO_WATCHDOG)
            .arg(&python)
            .arg(script)
            .arg("127.0.0.1")
            .arg(port.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        if let Some(journal) = journal {
            cmd.env("IDEMPOTENCY_DYNAMODB_JOURNAL", journal);
        }
        let mut watchdog = cmd.spawn().expect("run bash to start the stand-in");
        let mut line = String::new();
        std::io::BufReader::new(watchdog.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the stand-in's pid");
        let pid = line.trim().parse().expect("the stand-in's pid");
        let stdin = watchdog.stdin.take();
        let server = Self {
            port,
            pid,
            watchdog,
            stdin,
        };
        let client = client_at(&server.url());
        let deadline = std::time::Instant::now() + within;
        while client.list_tables().send().await.is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the stand-in on port {port} did not answer within {within:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        server
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Kills it with SIGKILL, and waits until it is gone.
    pub fn crash(mut self) {
        let _ = std::process::Command::new("kill")
            .arg("-KILL")
            .arg(self.pid.to_string())
            .status();
        self.stop_watchdog();
    }

    fn stop_watchdog(&mut self) {
        drop(self.stdin.take());
        let _ = self.watchdog.wait();
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        self.stop_watchdog();
    }
}

/// A store on a new table (created, TTL on) on the stand-in at `url`, on `clock`. The table
/// goes with the server.
pub async fn store_at(url: &str, clock: Arc<dyn Clock>) -> Result<DynamoStore, Error> {
    let store = DynamoStore::builder()
        .table("records")
        .clock(clock)
        .build(client_at(url))?;
    store.create_table().await?;
    Ok(store)
}
