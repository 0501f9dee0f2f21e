//! The randomized model-based case: random operation sequences run against the store and the
//! reference model of the contract ([`crate::reference`]), comparing every answer.

use crate::reference::{RefClaim, RefRecord, ReferenceStore};
use crate::{TestStore, TimeControl};
use futures::StreamExt;
use idempotency_core::store::{
    Cas, Claim, ClaimRequest, Clock, Failure, Reclaim, Record, RecordStatus, Timestamp,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyKey, RecordId, Scope};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fmt::Write as _;
use std::time::Duration;
use tokio::sync::RwLock;

/// How many random sequences the model-based case runs.
pub const MODEL_SEQUENCES: usize = 500;

/// Set this environment variable to a number to replay the model-based case with that seed
/// (the failure message prints the seed it used).
pub const SEED_ENV: &str = "IDEMPOTENCY_CONFORMANCE_SEED";

const KEYS: usize = 3;
const FINGERPRINTS: [&str; 2] = ["model-a", "model-b"];

#[derive(Clone, Debug)]
enum Op {
    Claim {
        key: usize,
        fp: usize,
        lease: Duration,
        ttl: Duration,
    },
    Complete {
        key: usize,
        token: FencingToken,
        outcome: Vec<u8>,
        ttl: Duration,
    },
    Fail {
        key: usize,
        token: FencingToken,
        failure: Failure,
        ttl: Duration,
    },
    Extend {
        key: usize,
        token: FencingToken,
        lease: Duration,
    },
    Reclaim {
        key: usize,
        expected: FencingToken,
        fp: usize,
        lease: Duration,
        ttl: Duration,
    },
    Get {
        key: usize,
    },
    /// `purge_expired` over the whole store (other sequences' keys included): it may remove
    /// only expired records, which the model already treats as absent.
    Purge,
    Advance(Duration),
}

/// Shared by the sequences of one run.
struct Env<'a> {
    t: &'a TestStore,
    /// Operations hold it shared, time steps exclusively, so the clock does not move while an
    /// operation and its prediction run.
    time: RwLock<()>,
    /// Whether durations and time steps are on a manual clock (exact timestamps, time steps
    /// allowed) or a real one (long durations only, no time steps, so nothing expires or
    /// passes during a run and the model needs no timing).
    manual: Option<idempotency_core::store::ManualClock>,
    run: String,
}

impl Env<'_> {
    fn now(&self) -> Timestamp {
        match &self.manual {
            Some(clock) => clock.now(),
            None => Timestamp::from_millis(0),
        }
    }

    fn lease(&self, rng: &mut StdRng) -> Duration {
        if self.manual.is_some() {
            [Duration::from_secs(10), Duration::from_secs(30)][rng.gen_range(0..2)]
        } else {
            self.t.long()
        }
    }

    fn ttl(&self, rng: &mut StdRng) -> Duration {
        if self.manual.is_some() {
            [
                Duration::from_secs(5),
                Duration::from_secs(20),
                Duration::from_secs(60),
            ][rng.gen_range(0..3)]
        } else {
            self.t.long()
        }
    }
}

/// How often each interesting transition happened, to check the generator reaches them.
#[derive(Clone, Copy, Debug, Default)]
struct Coverage {
    claimed: u64,
    claimed_over_expired: u64,
    observed: u64,
    applied: u64,
    fenced: u64,
    reclaimed_failed: u64,
    reclaimed_passed_lease: u64,
    reclaim_lost: u64,
    expired_reads: u64,
}

impl Coverage {
    fn count(&mut self, cas: Cas) {
        match cas {
            Cas::Applied => self.applied += 1,
            Cas::Fenced => self.fenced += 1,
        }
    }

    fn add(&mut self, o: &Coverage) {
        self.claimed += o.claimed;
        self.claimed_over_expired += o.claimed_over_expired;
        self.observed += o.observed;
        self.applied += o.applied;
        self.fenced += o.fenced;
        self.reclaimed_failed += o.reclaimed_failed;
        self.reclaimed_passed_lease += o.reclaimed_passed_lease;
        self.reclaim_lost += o.reclaim_lost;
        self.expired_reads += o.expired_reads;
    }
}

struct Sequence {
    coverage: Coverage,
    ids: Vec<RecordId>,
    /// What the contract says each key's record is, keyed by the key's index.
    reference: ReferenceStore<usize>,
    /// Every token each key has had, for stale picks.
    tokens: Vec<Vec<FencingToken>>,
    log: String,
}

/// A store call, sent again while it fails with a retryable backend error, which says that
/// nothing was applied (a serialization failure under contention at SERIALIZABLE that
/// outlasted the store's own retries, a busy SQLite): a correct client does the same. A store
/// that applied a write and still answered so would diverge from the model on the retry.
async fn patiently<T, F, Fut>(call: F) -> Result<T, Error>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let mut tries = 0u32;
    loop {
        match call().await {
            Err(Error::Backend {
                retryable: true, ..
            }) if tries < 20 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(5u64 << tries.min(5))).await;
            }
            other => return other,
        }
    }
}

impl Sequence {
    fn pick_token(&self, rng: &mut StdRng, key: usize) -> FencingToken {
        let current = self
            .reference
            .stored(&key)
            .map_or(FencingToken(1), |m| m.token);
        match rng.gen_range(0..10) {
            0..=5 => current,
            6 => FencingToken(current.0.saturating_sub(1)),
            7 => current.next(),
            8 if !self.tokens[key].is_empty() => {
                self.tokens[key][rng.gen_range(0..self.tokens[key].len())]
            }
            _ => FencingToken(rng.gen_range(0..4)),
        }
    }

    fn gen(&self, env: &Env<'_>, rng: &mut StdRng) -> Op {
        let key = rng.gen_range(0..KEYS);
        let fp = rng.gen_range(0..FINGERPRINTS.len());
        // Half of the operations are the ones that move this key's record on (as the engine
        // would call them), so that every transition is reached often; the other half are
        // arbitrary, stale tokens included.
        if rng.gen_bool(0.5) {
            if let Some(op) = self.gen_likely(env, rng, key, fp) {
                return op;
            }
        }
        let roll = rng.gen_range(0..100);
        match roll {
            0..=24 => Op::Claim {
                key,
                fp,
                lease: env.lease(rng),
                ttl: env.ttl(rng),
            },
            25..=39 => {
                let len = if rng.gen_bool(0.2) {
                    0
                } else {
                    rng.gen_range(1..48)
                };
                Op::Complete {
                    key,
                    token: self.pick_token(rng, key),
                    outcome: (0..len).map(|_| rng.gen()).collect(),
                    ttl: env.ttl(rng),
                }
            }
            40..=49 => Op::Fail {
                key,
                token: self.pick_token(rng, key),
                failure: Failure {
                    retryable: rng.gen(),
                    message: format!("failure {}", rng.gen::<u16>()),
                },
                ttl: env.ttl(rng),
            },
            50..=57 => Op::Extend {
                key,
                token: self.pick_token(rng, key),
                lease: env.lease(rng),
            },
            58..=77 => Op::Reclaim {
                key,
                expected: self.pick_token(rng, key),
                fp,
                lease: env.lease(rng),
                ttl: env.ttl(rng),
            },
            78..=88 => Op::Get { key },
            89..=91 => Op::Purge,
            _ if env.manual.is_some() => Op::Advance(
                [
                    Duration::from_millis(1),
                    Duration::from_secs(1),
                    Duration::from_secs(5),
                    Duration::from_secs(10),
                    Duration::from_secs(30),
                ][rng.gen_range(0..5)],
            ),
            _ => Op::Get { key },
        }
    }

    fn gen_likely(&self, env: &Env<'_>, rng: &mut StdRng, key: usize, fp: usize) -> Option<Op> {
        let now = env.now();
        let m = self.reference.get(&key, now)?;
        let token = m.token;
        Some(match m.status {
            RecordStatus::Failed => Op::Reclaim {
                key,
                expected: token,
                fp,
                lease: env.lease(rng),
                ttl: env.ttl(rng),
            },
            RecordStatus::Pending if m.lease_until.is_some_and(|l| l <= now) => Op::Reclaim {
                key,
                expected: token,
                fp,
                lease: env.lease(rng),
                ttl: env.ttl(rng),
            },
            RecordStatus::Pending => match rng.gen_range(0..3) {
                0 => Op::Complete {
                    key,
                    token,
                    outcome: (0..rng.gen_range(0..48)).map(|_| rng.gen()).collect(),
                    ttl: env.ttl(rng),
                },
                1 => Op::Fail {
                    key,
                    token,
                    failure: Failure {
                        retryable: rng.gen(),
                        message: format!("failure {}", rng.gen::<u16>()),
                    },
                    ttl: env.ttl(rng),
                },
                _ => Op::Extend {
                    key,
                    token,
                    lease: env.lease(rng),
                },
            },
            RecordStatus::Completed => return None,
        })
    }

    /// Runs `op` on the store and the model; describes the first difference.
    async fn step(&mut self, env: &Env<'_>, op: &Op) -> Result<(), String> {
        if let Op::Advance(d) = op {
            let _exclusive = env.time.write().await;
            env.t.advance(*d).await;
            return Ok(());
        }
        let _shared = env.time.read().await;
        let now = env.now();
        let store = &env.t.store;
        let manual = env.manual.is_some();
        match op {
            Op::Advance(_) => unreachable!("handled above"),
            Op::Claim {
                key,
                fp,
                lease,
                ttl,
            } => {
                let id = &self.ids[*key];
                let fingerprint = Fingerprint::from_bytes(FINGERPRINTS[*fp].as_bytes());
                let req = ClaimRequest::new(id.clone(), fingerprint, *lease, *ttl);
                let got = patiently(|| store.claim(&req))
                    .await
                    .map_err(|e| format!("claim: {e}"))?;
                let before = self.reference.stored(key).cloned();
                match self.reference.claim(key, &fingerprint, *lease, *ttl, now) {
                    RefClaim::Existing(m) => {
                        self.coverage.observed += 1;
                        let Claim::Existing {
                            record,
                            now: store_now,
                        } = got
                        else {
                            return Err(format!(
                                "claim of a live record returned {got:?}, expected Existing {m:?}"
                            ));
                        };
                        if manual && store_now != now {
                            return Err(format!(
                                "Existing.now is {store_now:?}, the store's clock reads {now:?}"
                            ));
                        }
                        compare(&record, id, &m, manual)
                    }
                    RefClaim::Claimed {
                        lease_until: until, ..
                    } => {
                        let Claim::Claimed { token, lease_until } = got else {
                            return Err(format!(
                                "claim of an absent or expired record returned {got:?}, \
                                 expected Claimed (model: {before:?})"
                            ));
                        };
                        self.coverage.claimed += 1;
                        if before.is_some() {
                            self.coverage.claimed_over_expired += 1;
                        }
                        // Tokens grow over the key's whole history: a record that was
                        // purged, evicted or lost must not let a new one reuse a token.
                        if let Some(old) = self.tokens[*key].iter().max() {
                            if token <= *old {
                                return Err(format!(
                                    "the claim of a key whose earlier records had token {old} \
                                     got token {token}: tokens must grow over the key's whole \
                                     history (model: {before:?})"
                                ));
                            }
                        }
                        if manual && lease_until != until {
                            return Err(format!(
                                "Claimed.lease_until is {lease_until:?}, expected now + lease \
                                 = {until:?}"
                            ));
                        }
                        // The store's clock need not be ours: its token is the record's.
                        self.reference.adopt_token(key, token);
                        self.tokens[*key].push(token);
                        Ok(())
                    }
                }
            }
            Op::Complete {
                key,
                token,
                outcome,
                ttl,
            } => {
                let got = patiently(|| store.complete(&self.ids[*key], *token, outcome, *ttl))
                    .await
                    .map_err(|e| format!("complete: {e}"))?;
                let want = self.reference.complete(key, *token, outcome, *ttl, now);
                self.coverage.count(want);
                expect_eq("complete", got, want, self.reference.stored(key))
            }
            Op::Fail {
                key,
                token,
                failure,
                ttl,
            } => {
                let got = patiently(|| store.fail(&self.ids[*key], *token, failure, *ttl))
                    .await
                    .map_err(|e| format!("fail: {e}"))?;
                let want = self.reference.fail(key, *token, failure, *ttl, now);
                self.coverage.count(want);
                expect_eq("fail", got, want, self.reference.stored(key))
            }
            Op::Extend { key, token, lease } => {
                let got = patiently(|| store.extend(&self.ids[*key], *token, *lease))
                    .await
                    .map_err(|e| format!("extend: {e}"))?;
                let want = self.reference.extend(key, *token, *lease, now);
                self.coverage.count(want);
                expect_eq("extend", got, want, self.reference.stored(key))
            }
            Op::Reclaim {
                key,
                expected,
                fp,
                lease,
                ttl,
            } => {
                let fingerprint = Fingerprint::from_bytes(FINGERPRINTS[*fp].as_bytes());
                let got = patiently(|| {
                    store.reclaim(&self.ids[*key], *expected, &fingerprint, *lease, *ttl)
                })
                .await
                .map_err(|e| format!("reclaim: {e}"))?;
                let before = self.reference.stored(key).cloned();
                match self
                    .reference
                    .reclaim(key, *expected, &fingerprint, *lease, *ttl, now)
                {
                    Reclaim::Reclaimed {
                        token: want_token,
                        lease_until: until,
                    } => {
                        match got {
                            Reclaim::Reclaimed { token, lease_until }
                                if token == want_token && (!manual || lease_until == until) => {}
                            other => {
                                return Err(format!(
                                    "reclaim returned {other:?}, expected Reclaimed with token \
                                     {want_token} and lease_until {until:?} (model {before:?})"
                                ));
                            }
                        }
                        if before.is_some_and(|m| m.status == RecordStatus::Failed) {
                            self.coverage.reclaimed_failed += 1;
                        } else {
                            self.coverage.reclaimed_passed_lease += 1;
                        }
                        self.tokens[*key].push(want_token);
                        Ok(())
                    }
                    Reclaim::Lost => {
                        self.coverage.reclaim_lost += 1;
                        expect_eq("reclaim", got, Reclaim::Lost, self.reference.stored(key))
                    }
                }
            }
            Op::Purge => {
                patiently(|| store.purge_expired(64))
                    .await
                    .map_err(|e| format!("purge_expired: {e}"))?;
                // What a purge removed is checked by the next operations on those keys: a
                // live record must still be there, a new claim must get a higher token. The
                // model keeps its expired records: every primitive treats them as absent.
                Ok(())
            }
            Op::Get { key } => {
                let id = &self.ids[*key];
                let got = patiently(|| store.get(id))
                    .await
                    .map_err(|e| format!("get: {e}"))?;
                match (self.reference.get(key, now), got) {
                    (Some(m), Some(r)) => compare(&r, id, m, manual),
                    (Some(m), None) => Err(format!("get returned None, expected {m:?}")),
                    (None, Some(r)) => Err(format!(
                        "get returned {r:?}, expected None (absent or expired)"
                    )),
                    (None, None) => {
                        if self.reference.stored(key).is_some() {
                            self.coverage.expired_reads += 1;
                        }
                        Ok(())
                    }
                }
            }
        }
    }
}

fn expect_eq<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: T,
    want: T,
    model: Option<&RefRecord>,
) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "{what} returned {got:?}, expected {want:?} (model now {model:?})"
        ))
    }
}

/// Compares a stored record with the model: everything the contract fixes.
fn compare(r: &Record, id: &RecordId, m: &RefRecord, manual: bool) -> Result<(), String> {
    let mut diffs = Vec::new();
    if r.id != *id {
        diffs.push(format!("id {} != {id}", r.id));
    }
    if r.fingerprint != m.fingerprint {
        diffs.push("fingerprint".to_string());
    }
    if r.status != m.status {
        diffs.push(format!("status {} != {}", r.status, m.status));
    }
    if r.token != m.token {
        diffs.push(format!("token {} != {}", r.token, m.token));
    }
    if r.outcome != m.outcome {
        diffs.push(format!("outcome {:?} != {:?}", r.outcome, m.outcome));
    }
    if r.attempts != m.attempts {
        diffs.push(format!("attempts {} != {}", r.attempts, m.attempts));
    }
    if r.hits != m.hits {
        diffs.push(format!("hits {} != {}", r.hits, m.hits));
    }
    if r.failure != m.failure {
        diffs.push(format!("failure {:?} != {:?}", r.failure, m.failure));
    }
    if manual {
        if r.lease_until != m.lease_until {
            diffs.push(format!(
                "lease_until {:?} != {:?}",
                r.lease_until, m.lease_until
            ));
        }
        if r.expires_at != m.expires_at {
            diffs.push(format!(
                "expires_at {:?} != {:?}",
                r.expires_at, m.expires_at
            ));
        }
    } else if r.lease_until.is_some() != m.lease_until.is_some() {
        diffs.push(format!(
            "lease_until {:?}, expected {}",
            r.lease_until,
            if m.lease_until.is_some() {
                "a lease"
            } else {
                "none"
            }
        ));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "record differs from the model: {}\n  store: {r:?}\n  model: {m:?}",
            diffs.join(", ")
        ))
    }
}

async fn run_sequence(env: &Env<'_>, index: usize, seed: u64) -> Result<Coverage, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let scope =
        Scope::from_parts(["model", env.run.as_str(), &index.to_string()]).expect("valid scope");
    let mut seq = Sequence {
        coverage: Coverage::default(),
        ids: (0..KEYS)
            .map(|k| {
                RecordId::new(
                    IdempotencyKey::new(format!("key-{k}")).expect("valid key"),
                    scope.clone(),
                )
            })
            .collect(),
        reference: ReferenceStore::new(),
        tokens: vec![Vec::new(); KEYS],
        log: String::new(),
    };
    let len = rng.gen_range(8..=32);
    for step in 0..len {
        let op = seq.gen(env, &mut rng);
        let _ = writeln!(seq.log, "  {step:>2}: {op:?}");
        if let Err(e) = seq.step(env, &op).await {
            return Err(format!(
                "sequence {index} (seed {seed}) diverged from the model at step {step}: {e}\n\
                 operations:\n{}",
                seq.log
            ));
        }
    }
    Ok(seq.coverage)
}

/// Runs [`MODEL_SEQUENCES`] random sequences of claim, complete, fail, extend, reclaim, get
/// and (on manual clocks) time steps over a few keys, two fingerprints and random tokens
/// (current, stale, future, arbitrary), against the store and a reference model of the
/// contract, comparing every answer: results, status, token, fingerprint, outcome bytes,
/// attempts, hits and, on a manual clock, every timestamp.
///
/// On a real clock only long leases and retentions are used and time is not stepped, so
/// nothing passes or expires during the run (the timing cases cover that). Sequences run
/// concurrently, each on its own keys. The seed is random per run; a failure prints it, and
/// [`SEED_ENV`] replays it.
pub async fn model_based_random_sequences(t: TestStore) {
    let base: u64 = match std::env::var(SEED_ENV) {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("{SEED_ENV}={s:?} is not a u64")),
        Err(_) => rand::random(),
    };
    let manual = match &t.time {
        TimeControl::Manual(clock) => Some(clock.clone()),
        TimeControl::Real => None,
    };
    // On a manual clock every sequence's time steps move the shared clock, so few run at once
    // (a step of one is a pause for the others; too many would expire every record between
    // two operations).
    let concurrency = if manual.is_some() { 4 } else { 16 };
    let env = Env {
        t: &t,
        time: RwLock::new(()),
        manual,
        run: IdempotencyKey::random().into_inner(),
    };
    let results: Vec<Result<Coverage, String>> = futures::stream::iter(0..MODEL_SEQUENCES)
        .map(|i| {
            let env = &env;
            async move { run_sequence(env, i, base.wrapping_add(i as u64)).await }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let mut coverage = Coverage::default();
    let mut failures = Vec::new();
    for r in results {
        match r {
            Ok(c) => coverage.add(&c),
            Err(e) => failures.push(e),
        }
    }
    if let Some(first) = failures.first() {
        panic!(
            "{} of {MODEL_SEQUENCES} random sequences diverged from the model (base seed \
             {base}; rerun with {SEED_ENV}={base}). First:\n{first}",
            failures.len()
        );
    }
    // The generator must reach every transition, or agreement proves little. The minimums are
    // far below the counts 500 sequences reach (tens to hundreds each).
    let mut reached = vec![
        ("claims", coverage.claimed, 20),
        ("observations", coverage.observed, 20),
        ("applied CAS", coverage.applied, 20),
        ("fenced CAS", coverage.fenced, 20),
        ("reclaims of Failed", coverage.reclaimed_failed, 20),
        ("lost reclaims", coverage.reclaim_lost, 20),
    ];
    if env.manual.is_some() {
        reached.extend([
            (
                "claims over expired records",
                coverage.claimed_over_expired,
                10,
            ),
            (
                "reclaims of passed leases",
                coverage.reclaimed_passed_lease,
                10,
            ),
            ("reads of expired records", coverage.expired_reads, 10),
        ]);
    }
    eprintln!("model-based case (seed {base}): {coverage:?}");
    for (what, n, min) in reached {
        assert!(
            n >= min,
            "the random sequences reached {what} only {n} times (seed {base}): the generator \
             no longer covers the contract"
        );
    }
}
