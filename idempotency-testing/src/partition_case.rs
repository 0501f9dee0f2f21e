//! The partition scenario every networked store's tests run through a [`PartitionProxy`]:
//! no call hangs past the store's response timeout, each ends in a defined outcome, and once
//! the partition heals the store works again and shows what really happened.

use crate::partition::PartitionProxy;
use idempotency_core::store::{Cas, Claim, ClaimRequest, Failure, Record, RecordStatus};
use idempotency_core::{
    Answer, Error, FencingToken, Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope,
};
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);
/// The lease an extension asks for: longer than [`LEASE`], so that it shows.
const LONGER: Duration = Duration::from_secs(600);

/// A holder's write the scenario cuts: each must end as an unknown outcome, and once healed
/// have applied or not, never anything else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Complete,
    Fail,
    Extend,
}

fn failure() -> Failure {
    Failure {
        retryable: false,
        message: "declined".into(),
    }
}

/// A store behind a proxy, and what its errors must look like.
pub struct PartitionCase<'a> {
    /// The store, connected through `proxy`.
    pub store: &'a dyn IdempotencyStore,
    /// The proxy in front of its server.
    pub proxy: &'a PartitionProxy,
    /// The store's response timeout: a call through a partition must end after it, and not
    /// much later.
    pub timeout: Duration,
    /// Runs before each cut, so that the next statement goes out on an established
    /// connection (a pool that is still pinging the connection it got back would open a new
    /// one, whose handshake the partition cuts: a different case).
    pub settle: &'a dyn Fn() -> Pin<Box<dyn Future<Output = ()> + 'a>>,
    /// Whether an error says the store got no answer (its own error type's variant).
    pub no_answer: fn(&Error) -> bool,
    /// Whether a read's error through the partition is the one the store gives (a
    /// retryable error is checked besides): no answer, say, or no connection to be had.
    pub read_failed: fn(&Error) -> bool,
    /// Whether a claim without an answer must be an unknown outcome (it may have taken the
    /// key) rather than a retryable error.
    pub claim_unknown: bool,
}

impl std::fmt::Debug for PartitionCase<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionCase")
            .field("proxy", &self.proxy.addr())
            .field("timeout", &self.timeout)
            .field("claim_unknown", &self.claim_unknown)
            .finish_non_exhaustive()
    }
}

/// Waits until a pool holds an idle connection (`num_idle` reads the pool's count), so that
/// the next statement is sent on it: sqlx pings a connection given back before it is idle
/// again, and a partition that cut that ping would leave the pool to open a new connection,
/// whose handshake never gets through (the statement would then not be sent at all, a
/// different case). For [`PartitionCase::settle`].
pub async fn an_idle_connection(num_idle: impl Fn() -> usize) {
    let started = Instant::now();
    while num_idle() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no connection went back idle"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether `r` shows the holder's `step` applied to the record it claimed (`before`).
fn applied(step: Step, r: &Record, token: FencingToken, before: &Record) -> bool {
    match step {
        Step::Complete => completed(r, token),
        Step::Fail => {
            r.status == RecordStatus::Failed
                && r.token == token
                && r.failure.as_ref().map(|f| f.message.as_str()) == Some("declined")
        }
        Step::Extend => {
            r.status == RecordStatus::Pending
                && r.token == token
                && r.lease_until > before.lease_until
        }
    }
}

fn completed(r: &Record, token: FencingToken) -> bool {
    (r.status, r.token, r.outcome.as_deref())
        == (RecordStatus::Completed, token, Some(&b"done"[..]))
}

fn id() -> RecordId {
    RecordId::new(
        IdempotencyKey::random(),
        Scope::new("partition").expect("scope"),
    )
}

fn request(id: &RecordId) -> ClaimRequest {
    ClaimRequest::new(id.clone(), Fingerprint::from_bytes(b"p"), LEASE, TTL)
}

async fn claimed(store: &dyn IdempotencyStore, id: &RecordId) -> FencingToken {
    match store.claim(&request(id)).await.expect("claim") {
        Claim::Claimed { token, .. } => token,
        other => panic!("a fresh key was found: {other:?}"),
    }
}

impl PartitionCase<'_> {
    /// Runs `call`, which must end (whatever its answer) after the response timeout and
    /// within a generous margin of it.
    async fn bounded<T>(&self, what: &str, call: impl Future<Output = T>) -> T {
        let started = Instant::now();
        let out = tokio::time::timeout(self.timeout + Duration::from_secs(10), call)
            .await
            .unwrap_or_else(|_| panic!("{what} hung through the partition"));
        assert!(
            started.elapsed() >= self.timeout - Duration::from_millis(100),
            "{what} answered before its timeout, through a partition"
        );
        out
    }

    /// The holder's `step`, made on `k`.
    async fn write(&self, step: Step, k: &RecordId, token: FencingToken) -> Result<Cas, Error> {
        match step {
            Step::Complete => self.store.complete(k, token, b"done", TTL).await,
            Step::Fail => self.store.fail(k, token, &failure(), TTL).await,
            Step::Extend => self.store.extend(k, token, LONGER).await,
        }
    }

    /// After a cut `step`, the healed record `r` must be the holder's: applied, or untouched
    /// (then the holder's write, made again, applies). `before` is the record as claimed.
    async fn settled(
        &self,
        step: Step,
        k: &RecordId,
        token: FencingToken,
        r: Record,
        before: &Record,
    ) {
        let untouched = r.status == RecordStatus::Pending
            && r.token == token
            && r.lease_until == before.lease_until;
        if untouched {
            // Made again, as the engine would. The held request may still reach the server
            // after the heal (TCP delivers what the partition held), before or after this
            // one: then this one finds it applied. Either way the record must show it.
            self.write(step, k, token).await.expect("the write again");
            let r = self.store.get(k).await.expect("get").expect("the record");
            assert!(applied(step, &r, token, before), "{step:?} again: {r:?}");
        } else {
            assert!(
                applied(step, &r, token, before),
                "the cut {step:?} left {r:?}"
            );
        }
    }

    /// The scenario:
    /// - the traffic is cut while a completion is in flight: `OutcomeUnknown` with the
    ///   store's no-answer error; a read meanwhile is a retryable error, a claim a retryable
    ///   error or (`claim_unknown`) an unknown outcome; once healed the record is Pending
    ///   with the holder's token (then completed by it) or already completed by it (TCP may
    ///   deliver the held request after the heal), never anything else;
    /// - the same cut during a failure and during a lease extension: `OutcomeUnknown`, and
    ///   once healed the record is still the holder's, failed or extended by it or not, and
    ///   the holder's write applies when made again;
    /// - only the answers are held while a completion, a failure or an extension is sent:
    ///   `OutcomeUnknown`, and once healed the record shows it applied (what the engine's
    ///   read-back finds) or, when the statement waited for an answer before it could be
    ///   sent, untouched, the write then applying when made again;
    /// - afterwards 20 cycles on the healed store all answer correctly (no stuck connection
    ///   reused, no late answer taken for another call's).
    pub async fn run(&self) {
        let store = self.store;
        let cut = id();
        let token = claimed(store, &cut).await;
        let before = store.get(&cut).await.expect("get").expect("the record");
        (self.settle)().await;
        self.proxy.partition();
        let e = self
            .bounded("complete", store.complete(&cut, token, b"done", TTL))
            .await
            .expect_err("a completion through a partition");
        assert!(
            matches!(e, Error::OutcomeUnknown { .. }) && (self.no_answer)(&e),
            "{e:?}"
        );
        let e = self
            .bounded("get", store.get(&cut))
            .await
            .expect_err("a read through a partition");
        assert!(
            matches!(
                e,
                Error::Backend {
                    retryable: true,
                    ..
                }
            ) && (self.read_failed)(&e),
            "get: {e:?}"
        );
        let e = self
            .bounded("claim", store.claim(&request(&id())))
            .await
            .expect_err("a claim through a partition");
        match self.claim_unknown {
            true => assert!(matches!(e, Error::OutcomeUnknown { .. }), "claim: {e:?}"),
            false => assert!(
                matches!(
                    e,
                    Error::Backend {
                        retryable: true,
                        ..
                    }
                ),
                "claim: {e:?}"
            ),
        }
        self.proxy.heal();
        let r = store.get(&cut).await.expect("get").expect("the record");
        self.settled(Step::Complete, &cut, token, r, &before).await;

        for step in [Step::Fail, Step::Extend] {
            let k = id();
            let token = claimed(store, &k).await;
            let before = store.get(&k).await.expect("get").expect("the record");
            (self.settle)().await;
            self.proxy.partition();
            let e = self
                .bounded(&format!("{step:?}"), self.write(step, &k, token))
                .await
                .expect_err("a holder's write through a partition");
            assert!(
                matches!(e, Error::OutcomeUnknown { .. }) && (self.no_answer)(&e),
                "{step:?}: {e:?}"
            );
            self.proxy.heal();
            let r = store.get(&k).await.expect("get").expect("the record");
            self.settled(step, &k, token, r, &before).await;
        }

        for step in [Step::Complete, Step::Fail, Step::Extend] {
            // The step once on another key first, so that its statement is likely prepared
            // on the connection the next one takes: a statement sqlx has not prepared on a
            // connection waits for the answer to its preparation before it is sent, and
            // then never reaches the server while answers are held.
            let warm = id();
            let warm_token = claimed(store, &warm).await;
            self.write(step, &warm, warm_token)
                .await
                .expect("an uncut write");
            let k = id();
            let token = claimed(store, &k).await;
            let before = store.get(&k).await.expect("get").expect("the record");
            (self.settle)().await;
            self.proxy.hold_replies();
            let e = self
                .bounded(&format!("{step:?}"), self.write(step, &k, token))
                .await
                .expect_err("a holder's write whose answer is held");
            assert!(matches!(e, Error::OutcomeUnknown { .. }), "{step:?}: {e:?}");
            self.proxy.heal();
            let r = store.get(&k).await.expect("get").expect("the record");
            self.settled(step, &k, token, r, &before).await;
        }

        for _ in 0..20 {
            let k = id();
            let token = claimed(store, &k).await;
            assert_eq!(
                store
                    .complete(&k, token, b"done", TTL)
                    .await
                    .expect("complete"),
                Cas::Applied
            );
            let r = store.get(&k).await.expect("get").expect("the record");
            assert_eq!((r.status, r.token), (RecordStatus::Completed, token));
        }
    }
}

/// What the commit case's helpers return.
pub type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A run through a store's transactional helper: the work inserts one business row for the
/// key in the transaction that completes the record, and succeeds with its fencing token.
pub type TransactionalRun<'a> =
    dyn Fn(IdempotencyKey) -> Boxed<'a, Result<Answer<Result<u64, String>>, Error>> + Sync + 'a;

/// The record's status (`None` when there is no record) and the key's business rows, read
/// in one snapshot on a connection that does not cross the proxy.
pub type Snapshot<'a> =
    dyn Fn(IdempotencyKey) -> Boxed<'a, (Option<RecordStatus>, usize)> + Sync + 'a;

/// The exactly-once path through a partition at its `COMMIT`: whatever the partition does,
/// the business row and the completion commit together or not at all, the caller hears an
/// unknown outcome, and a retry ends with exactly one row.
pub struct CommitCase<'a> {
    /// The proxy the store's connections cross.
    pub proxy: &'a PartitionProxy,
    /// The store's response timeout.
    pub timeout: Duration,
    /// The engine's lease: a retry after it takes over a key its holder left Pending.
    pub lease: Duration,
    /// Runs the work once (see [`TransactionalRun`]).
    pub run: &'a TransactionalRun<'a>,
    /// Reads the record and the rows (see [`Snapshot`]).
    pub snapshot: &'a Snapshot<'a>,
    /// Whether an error says the store got no answer (its own error type's variant).
    pub no_answer: fn(&Error) -> bool,
}

impl std::fmt::Debug for CommitCase<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommitCase")
            .field("proxy", &self.proxy.addr())
            .field("timeout", &self.timeout)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// How the partition at the `COMMIT` ends.
#[derive(Clone, Copy, Debug)]
enum AtCommit {
    /// The `COMMIT` is held, then the partition heals: it reaches the server late.
    CutThenHealed,
    /// The `COMMIT` is held and the connection severed: the server never gets it and rolls
    /// the transaction back.
    CutThenSevered,
    /// The `COMMIT` reaches the server and applies; its answer is held, then delivered.
    AnswerHeld,
}

impl CommitCase<'_> {
    /// The three partitions at the `COMMIT` (cut then healed, cut then severed, answer
    /// held), each on a fresh key: the first call is an unknown outcome after the response
    /// timeout; every snapshot shows the row and the completion together or neither; the
    /// retry replays the committed outcome, or (after a rollback, once the lease passed) runs
    /// the work once; the key ends with exactly one row.
    pub async fn run(&self) {
        for how in [
            AtCommit::CutThenHealed,
            AtCommit::CutThenSevered,
            AtCommit::AnswerHeld,
        ] {
            self.once(how).await;
        }
    }

    /// A snapshot that must be consistent: the record Completed with exactly one row, or not
    /// Completed with none. Returns whether it is Completed.
    async fn consistent(&self, key: &IdempotencyKey, how: AtCommit) -> bool {
        let (status, rows) = (self.snapshot)(key.clone()).await;
        let completed = status == Some(RecordStatus::Completed);
        assert_eq!(
            rows,
            usize::from(completed),
            "{how:?}: the record is {status:?} with {rows} business rows"
        );
        completed
    }

    async fn once(&self, how: AtCommit) {
        let key = IdempotencyKey::random();
        match how {
            AtCommit::AnswerHeld => self.proxy.hold_replies_after(b"COMMIT"),
            _ => self.proxy.partition_at(b"COMMIT"),
        }
        let started = Instant::now();
        let first = tokio::time::timeout(
            self.timeout + Duration::from_secs(10),
            (self.run)(key.clone()),
        )
        .await
        .unwrap_or_else(|_| panic!("{how:?}: the run hung through the partition"));
        assert!(
            started.elapsed() >= self.timeout - Duration::from_millis(100),
            "{how:?}: answered before the timeout, through a partition: {first:?}"
        );
        match &first {
            Err(e @ Error::OutcomeUnknown { .. }) if (self.no_answer)(e) => {}
            other => {
                panic!("{how:?}: a commit without an answer must be an unknown outcome: {other:?}")
            }
        }
        // Where the COMMIT is now tells the cases apart: held at the proxy it has not
        // applied; sent with its answer held it has.
        let completed = self.consistent(&key, how).await;
        assert_eq!(
            completed,
            matches!(how, AtCommit::AnswerHeld),
            "{how:?}: the record is {} while the proxy holds what it holds",
            if completed {
                "Completed"
            } else {
                "not Completed"
            }
        );
        match how {
            AtCommit::CutThenSevered => self.proxy.sever(),
            _ => self.proxy.heal(),
        }
        match how {
            AtCommit::CutThenSevered => {
                // Once the lease passes (the response timeout may already have outlasted it)
                // a retry takes over the key its holder left Pending; the COMMIT the server
                // never got must not have applied meanwhile.
                tokio::time::sleep(self.lease.saturating_sub(started.elapsed())).await;
                assert!(
                    !self.consistent(&key, how).await,
                    "{how:?}: a COMMIT the server never got applied"
                );
            }
            _ => {
                // What the proxy held reaches the server: every snapshot until then must be
                // consistent too.
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut now_completed = completed;
                while !now_completed && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    now_completed = self.consistent(&key, how).await;
                }
                assert!(
                    now_completed,
                    "{how:?}: the COMMIT that reached the server did not apply"
                );
            }
        }
        let retry = (self.run)(key.clone())
            .await
            .unwrap_or_else(|e| panic!("{how:?}: the retry: {e:?}"));
        match (how, retry) {
            (AtCommit::CutThenSevered, Answer::Executed(Ok(_))) => {}
            (AtCommit::CutThenHealed | AtCommit::AnswerHeld, Answer::Replayed(Ok(_))) => {}
            (how, other) => panic!("{how:?}: the retry answered {other:?}"),
        }
        assert!(
            self.consistent(&key, how).await,
            "{how:?}: the retry left no completion"
        );
    }
}
