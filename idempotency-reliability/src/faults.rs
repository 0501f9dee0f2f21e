//! Store faults for the soak: transient errors on completions and lease extensions, injected
//! at random with the conformance kit's [`FlakyStore`], under a recording of what the store
//! really did ([`RecordingStore`]).
//!
//! The stack, from the engine down:
//!
//! ```text
//! engine -> Dice -> Flaky(Refused, extend) -> Flaky(AckLost, extend)
//!                -> Flaky(Refused, complete) -> Flaky(AckLost, complete)
//!                -> RecordingStore -> the real store
//! ```
//!
//! Before each completion and each extension, `Dice` makes the next call of that operation
//! fail in one of the `FlakyStore`s with probability [`StoreFaults::rate`] (half refused:
//! nothing written, a retryable backend error; half acknowledgement lost: written, then
//! `OutcomeUnknown`). A work may also *doom* its own completion: every try of it fails the
//! same way, so the engine's retries run out and the caller gets `OutcomeUnknown`.

use crate::ledger::{Ledger, RecordingStore};
use idempotency_conformance::{Fault, FlakyOp, FlakyStore};
use idempotency_core::store::{async_trait, Cas, Claim, ClaimRequest, Failure, Reclaim, Record};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often store writes fail.
#[derive(Clone, Copy, Debug)]
pub struct StoreFaults {
    /// The chance that a completion or an extension fails (each try on its own).
    pub rate: f64,
    /// The chance that a call dooms its work's completion: every try fails.
    pub doomed: f64,
}

impl Default for StoreFaults {
    /// 10 % of completions and extensions fail; 4 % of calls doom their completion.
    fn default() -> Self {
        Self {
            rate: 0.10,
            doomed: 0.04,
        }
    }
}

/// Faults injected so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Injected {
    /// Completions refused.
    pub complete_refused: u64,
    /// Completions applied whose answer was lost.
    pub complete_ack_lost: u64,
    /// Extensions refused.
    pub extend_refused: u64,
    /// Extensions applied whose answer was lost.
    pub extend_ack_lost: u64,
    /// Completions doomed (every try fails).
    pub doomed: u64,
}

impl Injected {
    /// Every fault injected.
    pub fn total(&self) -> u64 {
        self.complete_refused + self.complete_ack_lost + self.extend_refused + self.extend_ack_lost
    }
}

/// The instrumented store stack of one soak: a ledger of what the store did, and random
/// faults on its completions and extensions.
#[derive(Debug)]
pub struct FaultRig {
    ledger: Arc<Ledger>,
    recorded: Arc<dyn IdempotencyStore>,
    faulty: Arc<dyn IdempotencyStore>,
    flaky: Flakies,
    doomed: Arc<Mutex<HashMap<(RecordId, u64), Fault>>>,
    doom_count: Arc<AtomicU64>,
    faults: StoreFaults,
}

#[derive(Clone, Debug)]
struct Flakies {
    complete_refused: FlakyStore,
    complete_ack_lost: FlakyStore,
    extend_refused: FlakyStore,
    extend_ack_lost: FlakyStore,
}

impl FaultRig {
    /// The stack over `inner`, with faults per `faults` drawn from `seed`.
    pub fn new(inner: Arc<dyn IdempotencyStore>, faults: StoreFaults, seed: u64) -> Self {
        let ledger = Arc::new(Ledger::new(Instant::now()));
        let recorded: Arc<dyn IdempotencyStore> =
            Arc::new(RecordingStore::new(inner, ledger.clone()));
        let complete_ack_lost = FlakyStore::new(recorded.clone(), Fault::AckLost);
        let complete_refused = FlakyStore::new(Arc::new(complete_ack_lost.clone()), Fault::Refused);
        let extend_ack_lost = FlakyStore::new(Arc::new(complete_refused.clone()), Fault::AckLost);
        let extend_refused = FlakyStore::new(Arc::new(extend_ack_lost.clone()), Fault::Refused);
        let flaky = Flakies {
            complete_refused,
            complete_ack_lost,
            extend_refused,
            extend_ack_lost,
        };
        let doomed = Arc::new(Mutex::new(HashMap::new()));
        let doom_count = Arc::new(AtomicU64::new(0));
        let faulty: Arc<dyn IdempotencyStore> = Arc::new(Dice {
            top: flaky.extend_refused.clone(),
            flaky: flaky.clone(),
            rate: faults.rate,
            rng: Mutex::new(StdRng::seed_from_u64(seed ^ 0xd1ce)),
            doomed: doomed.clone(),
        });
        Self {
            ledger,
            recorded,
            faulty,
            flaky,
            doomed,
            doom_count,
            faults,
        }
    }

    /// The store to give the engines: faults, then the recording, then the real store.
    pub fn store(&self) -> Arc<dyn IdempotencyStore> {
        self.faulty.clone()
    }

    /// The recorded store without faults (for purges, which the ledger counts).
    pub fn recorded(&self) -> Arc<dyn IdempotencyStore> {
        self.recorded.clone()
    }

    /// The ledger.
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// The fault rates.
    pub fn faults(&self) -> StoreFaults {
        self.faults
    }

    /// Makes every try of the completion of `(id, token)` fail with `fault`.
    pub fn doom(&self, id: RecordId, token: u64, fault: Fault) {
        self.doomed
            .lock()
            .expect("doom lock")
            .insert((id, token), fault);
        self.doom_count.fetch_add(1, Ordering::Relaxed);
    }

    /// The faults injected so far (each counted by the `FlakyStore` that injected it).
    pub fn injected(&self) -> Injected {
        Injected {
            complete_refused: self.flaky.complete_refused.injected(),
            complete_ack_lost: self.flaky.complete_ack_lost.injected(),
            extend_refused: self.flaky.extend_refused.injected(),
            extend_ack_lost: self.flaky.extend_ack_lost.injected(),
            doomed: self.doom_count.load(Ordering::Relaxed),
        }
    }
}

/// Rolls the dice before each completion and extension.
#[derive(Debug)]
struct Dice {
    top: FlakyStore,
    flaky: Flakies,
    rate: f64,
    rng: Mutex<StdRng>,
    doomed: Arc<Mutex<HashMap<(RecordId, u64), Fault>>>,
}

impl Dice {
    fn roll(&self) -> Option<Fault> {
        let mut rng = self.rng.lock().expect("dice lock");
        rng.gen_bool(self.rate).then(|| {
            if rng.gen_bool(0.5) {
                Fault::Refused
            } else {
                Fault::AckLost
            }
        })
    }
}

#[async_trait]
impl IdempotencyStore for Dice {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        self.top.claim(request).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        let doomed = self
            .doomed
            .lock()
            .expect("doom lock")
            .get(&(id.clone(), token.0))
            .copied();
        match doomed.or_else(|| self.roll()) {
            Some(Fault::Refused) => self.flaky.complete_refused.inject(FlakyOp::Complete, 1),
            Some(_) => self.flaky.complete_ack_lost.inject(FlakyOp::Complete, 1),
            None => {}
        }
        self.top.complete(id, token, outcome, ttl).await
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.top.fail(id, token, failure, ttl).await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        match self.roll() {
            Some(Fault::Refused) => self.flaky.extend_refused.inject(FlakyOp::Extend, 1),
            Some(_) => self.flaky.extend_ack_lost.inject(FlakyOp::Extend, 1),
            None => {}
        }
        self.top.extend(id, token, lease).await
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        self.top
            .reclaim(id, expected, fingerprint, lease, ttl)
            .await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.top.get(id).await
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        self.top.purge_expired(batch).await
    }
}

/// What the work does if it runs (only the holder of the key runs it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkFault {
    /// Succeeds after a short pause.
    None,
    /// Returns an error (the engine releases the key).
    Error,
    /// Panics.
    Panic,
    /// Stalls past its lease with the heartbeat off, then succeeds: a retry may take the key
    /// over meanwhile and fence it.
    Stall,
    /// Runs for 2–4 leases with the heartbeat on, then succeeds: the heartbeat must keep the
    /// key, so retries are told it is in progress.
    Long,
}
