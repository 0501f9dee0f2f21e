//! The protocol as a `stateright` model: the clients' engine steps, the environment and the
//! properties.

use crate::world::{Mode, Variant, World};
use idempotency_conformance::reference::{RefClaim, RefRecord, ReferenceStore};
use idempotency_core::store::{
    decide, Cas, Decision, DecisionOptions, Failure, Reclaim, RecordStatus, Timestamp,
};
use idempotency_core::{FencingToken, IdempotencyKey, InFlight, RecordId, Scope};
use std::fmt::Write as _;
use std::time::Duration;

/// Only the current holder's complete, fail or extend is ever applied.
pub const ONLY_CURRENT_HOLDER_WRITES: &str =
    "only the current holder's complete, fail or extend applies";
/// A live Completed record never changes (but for its hit count).
pub const COMPLETED_IS_FINAL: &str = "a live completed record never changes";
/// A replay returns the outcome of the execution that completed the record, and only to a
/// request with that execution's fingerprint.
pub const REPLAY_IS_THE_COMPLETED_OUTCOME: &str =
    "a replay returns the completing execution's outcome, for its fingerprint only";
/// Within one live lease the side effect happens at most once (both modes).
pub const EFFECT_ONCE_PER_LEASE: &str = "the side effect happens at most once per live lease";
/// Within one record's retention the side effect happens at most once (transactional mode).
pub const EFFECT_ONCE_PER_RECORD: &str =
    "the side effect happens at most once per record (transactional mode)";
/// Once the clients have stopped, every key becomes claimable.
pub const EVENTUALLY_CLAIMABLE: &str = "no key stays pending for ever once the clients stop";

/// A sanity check that the world reaches what the properties are about: an example, not a
/// violation, is expected.
pub const REACHES_COMPLETION_AFTER_RECLAIM: &str =
    "sometimes a record is completed after a reclaim";

impl Variant {
    /// The property this broken variant is built to violate (`None` for [`Variant::Real`]).
    pub fn violates(self) -> Option<&'static str> {
        Some(match self {
            Variant::Real => return None,
            Variant::TokenRestartsAfterPurge => ONLY_CURRENT_HOLDER_WRITES,
            Variant::ReadThenWriteComplete => COMPLETED_IS_FINAL,
            Variant::ReclaimWithoutExpectedToken => ONLY_CURRENT_HOLDER_WRITES,
            Variant::ReclaimKeepsFingerprint => REPLAY_IS_THE_COMPLETED_OUTCOME,
            Variant::ReclaimTakesPermanentFailure => EFFECT_ONCE_PER_LEASE,
            Variant::ReleaseOnCompletionError => EFFECT_ONCE_PER_LEASE,
            Variant::CommitDespiteFence => EFFECT_ONCE_PER_RECORD,
            Variant::UnboundedHeartbeat => EVENTUALLY_CLAIMABLE,
        })
    }
}

/// Where a client is in the engine's steps.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Phase {
    /// About to claim the key (`claim`).
    Start,
    /// About to read the record again (`get`) and decide.
    Look,
    /// Decided to reclaim the record read, by a CAS on its token.
    Reclaim {
        /// The token read.
        expected: FencingToken,
    },
    /// Wait policy: polling while the holder of `token` has a lease until `until`.
    Waiting {
        /// The holder's token when the wait began.
        token: FencingToken,
        /// When that lease passes, as read.
        until: Timestamp,
    },
    /// Holds the key; the work runs with the heartbeat beating.
    Working {
        /// The holder's token.
        token: FencingToken,
        /// The tick of the claim (the heartbeat stops at the maximum work time after it).
        claimed_at: u8,
    },
    /// The work hangs for ever; only its heartbeat still runs.
    Hung {
        /// The holder's token.
        token: FencingToken,
        /// The tick of the claim.
        claimed_at: u8,
    },
    /// Plain mode: the work acted; the completion is being written (try `attempt`).
    Completing {
        /// The holder's token.
        token: FencingToken,
        /// Which try of the settle policy comes next.
        attempt: u8,
    },
    /// The broken read-then-write complete: the read said Pending with this token.
    WritingCompletion {
        /// The holder's token.
        token: FencingToken,
    },
    /// Recording a failure to release the key (`fail`).
    Releasing {
        /// The holder's token.
        token: FencingToken,
    },
    /// Every try of the completion failed: recording the permanent failure that stands in
    /// for the outcome (`fail` with `Failure::outcome_not_stored`).
    StandingIn {
        /// The holder's token.
        token: FencingToken,
    },
    /// Finished, gave up or crashed: the client takes no more steps.
    Stopped,
}

/// One client's state.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Client {
    /// Where it is.
    pub phase: Phase,
    /// For a waiting client: the tick of its first claim (its wait is bounded from there).
    pub started: Option<u8>,
}

/// What the checker remembers about a key beyond the store, to state the properties.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct KeyGhost {
    /// The client whose claim or reclaim made it the holder of the current record.
    pub holder: Option<u8>,
    /// The client whose completion made the current record Completed.
    pub completed_by: Option<u8>,
    /// Side effects since the current record was created (counted up to 2).
    pub effects_in_record: u8,
    /// Side effects made under a live lease since the last lease passed (counted up to 2).
    pub effects_in_lease: u8,
}

/// Which properties a step has broken (monitors: once set, they stay set).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Broken {
    /// A holder that was not the current one had a write applied.
    pub stale_write: bool,
    /// A live Completed record changed.
    pub completed_changed: bool,
    /// A replay returned another execution's outcome, or to another fingerprint.
    pub bad_replay: bool,
    /// Two side effects under live leases with no lease passing between them.
    pub effect_twice_in_lease: bool,
    /// Two side effects within one record.
    pub effect_twice_in_record: bool,
}

/// The world's state: the clock, the reference store, the clients and the monitors.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct State {
    /// The clock, in ticks.
    pub now: u8,
    /// The store, as the contract says it behaves.
    pub store: ReferenceStore<u8>,
    /// The clients, by index.
    pub clients: Vec<Client>,
    /// What the checker remembers per key.
    pub keys: Vec<KeyGhost>,
    /// What has been broken so far.
    pub broken: Broken,
}

/// What a work does when it runs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Work {
    /// It acts (its side effect) and returns an outcome to store.
    Acts,
    /// It returns an error without acting; the engine records a retryable failure.
    Errs,
    /// It never returns; its heartbeat keeps beating up to the maximum work time.
    Hangs,
}

/// How a completion write (plain mode) or commit (transactional mode) goes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Write {
    /// The store answers.
    Answered,
    /// The store errs without applying it.
    Errs,
    /// It applies, but the answer is lost (the caller sees an error).
    AppliesThenErrs,
}

/// One step of the world.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Action {
    /// The clock moves one tick.
    Tick,
    /// `purge_expired` deletes every expired record.
    Purge,
    /// The client claims its key (`claim`) and decides on what it finds.
    Claim(u8),
    /// The client reads its key (`get`) and decides.
    Look(u8),
    /// The client reclaims by a CAS on the token it read.
    Reclaim(u8),
    /// A waiting client polls and sees the holder settle or its lease pass.
    Poll(u8),
    /// A waiting client gives up at its maximum wait.
    GiveUp(u8),
    /// The holder's work finishes (plain mode; in transactional mode only `Errs` and
    /// `Hangs`, the work's writes being committed by `Commit`).
    Run(u8, Work),
    /// Plain mode: the holder writes its completion.
    Complete(u8, Write),
    /// Transactional mode: the work's writes and the completion CAS commit together.
    Commit(u8, Write),
    /// The second half of the broken read-then-write complete.
    WriteCompletion(u8),
    /// The holder records a failure, releasing the key.
    Release(u8),
    /// The holder records the permanent failure that stands in for an outcome it could not
    /// store.
    StandIn(u8),
    /// The holder's heartbeat extends its lease.
    Heartbeat(u8),
    /// The client crashes: it takes no more steps, and its lease is left to pass.
    Crash(u8),
}

/// The protocol in one [`World`], ready for the checker.
#[derive(Clone, Debug)]
pub struct ProtocolModel {
    world: World,
    ids: Vec<RecordId>,
    options: DecisionOptions,
}

impl ProtocolModel {
    /// The model of `world`.
    pub fn new(world: World) -> Self {
        assert!(
            !world.clients.is_empty() && world.clients.len() <= 8,
            "1 to 8 clients"
        );
        let ids = (0..world.keys())
            .map(|k| {
                RecordId::new(
                    IdempotencyKey::new(format!("key-{k}")).expect("valid key"),
                    Scope::new("model-check").expect("valid scope"),
                )
            })
            .collect();
        let options = DecisionOptions::new(world.policy.reclaim_failed_with_different_fingerprint);
        Self {
            world,
            ids,
            options,
        }
    }

    /// The world explored.
    pub fn world(&self) -> &World {
        &self.world
    }

    fn lease(&self) -> Duration {
        self.world.policy.lease
    }

    fn ttl(&self) -> Duration {
        self.world.policy.retention
    }

    fn key(&self, c: u8) -> u8 {
        self.world.clients[usize::from(c)].key
    }

    fn is_acting(&self, s: &State) -> bool {
        s.now <= self.world.active_until
    }

    /// Whether `key` holds a live Pending record with a live lease: a request is refused.
    pub fn is_in_flight(&self, s: &State, key: u8) -> bool {
        let now = self.world.at(s.now);
        s.store.get(&key, now).is_some_and(|r| {
            r.status == RecordStatus::Pending && r.lease_until.is_some_and(|l| l > now)
        })
    }

    /// Runs the real decision on `record` and moves the client on.
    fn on_read(&self, s: &mut State, c: u8, record: &RefRecord) {
        let spec = self.world.clients[usize::from(c)];
        let key = usize::from(spec.key);
        let now = self.world.at(s.now);
        let decision = decide(
            Some(&record.to_record(self.ids[key].clone(), now)),
            &World::fingerprint(spec.fingerprint),
            now,
            self.options,
        );
        let phase = match decision {
            Decision::Claim => Phase::Start,
            Decision::Replay => {
                let good = s.keys[key].completed_by.is_some_and(|by| {
                    record.outcome.as_deref() == Some(World::outcome(by).as_slice())
                        && self.world.clients[usize::from(by)].fingerprint == spec.fingerprint
                });
                if !good {
                    s.broken.bad_replay = true;
                }
                Phase::Stopped
            }
            Decision::KeyReused | Decision::FailedPermanently => Phase::Stopped,
            Decision::Reclaim { expected } => Phase::Reclaim { expected },
            Decision::InProgress { .. } => match spec.in_flight {
                InFlight::Reject => Phase::Stopped,
                InFlight::Wait { .. } => Phase::Waiting {
                    token: record.token,
                    until: record.lease_until.unwrap_or(now),
                },
            },
        };
        s.clients[usize::from(c)].phase = phase;
    }

    /// A complete, fail or extend by `c` was applied: it must be the current holder.
    fn applied_write(&self, s: &mut State, c: u8) {
        if s.keys[usize::from(self.key(c))].holder != Some(c) {
            s.broken.stale_write = true;
        }
    }

    /// A completion by `c` was applied (`was` is the record before it).
    fn applied_completion(&self, s: &mut State, c: u8, was: Option<RecordStatus>) {
        self.applied_write(s, c);
        if was != Some(RecordStatus::Completed) {
            s.keys[usize::from(self.key(c))].completed_by = Some(c);
        }
    }

    /// `c`'s side effect happens (its business write), holding `token`.
    fn effect(&self, s: &mut State, c: u8, token: FencingToken) {
        let key = self.key(c);
        let now = self.world.at(s.now);
        let live = s.keys[usize::from(key)].holder == Some(c)
            && s.store.get(&key, now).is_some_and(|r| {
                r.is_pending_with(now, token) && r.lease_until.is_some_and(|l| l > now)
            });
        let g = &mut s.keys[usize::from(key)];
        if live {
            g.effects_in_lease = (g.effects_in_lease + 1).min(2);
            if g.effects_in_lease >= 2 {
                s.broken.effect_twice_in_lease = true;
            }
        }
        if self.world.mode == Mode::Transactional {
            g.effects_in_record = (g.effects_in_record + 1).min(2);
            if g.effects_in_record >= 2 {
                s.broken.effect_twice_in_record = true;
            }
        }
    }

    fn status(&self, s: &State, key: u8) -> Option<RecordStatus> {
        s.store.get(&key, self.world.at(s.now)).map(|r| r.status)
    }

    /// The heartbeat's next lease, if it still beats at this tick.
    fn heartbeat_lease(&self, s: &State, claimed_at: u8) -> Option<Duration> {
        if self.world.variant == Variant::UnboundedHeartbeat {
            return Some(self.lease());
        }
        let end = claimed_at + self.world.max_work_ticks();
        (s.now < end).then(|| {
            self.lease()
                .min(crate::world::TICK * u32::from(end - s.now))
        })
    }

    /// One line per key and client, for traces.
    pub fn describe(&self, s: &State) -> String {
        let now = self.world.at(s.now);
        let mut out = format!("t={}", s.now);
        for key in 0..self.world.keys() as u8 {
            match s.store.stored(&key) {
                None => {
                    let _ = write!(out, " | key {key}: absent");
                }
                Some(r) => {
                    let tick = |t: Timestamp| (t.as_millis() - self.world.at(0).as_millis()) / 1000;
                    let _ = write!(
                        out,
                        " | key {key}: {}{} fp={} token={} lease_until={} expires={}{}",
                        if r.is_live(now) { "" } else { "expired " },
                        r.status,
                        r.fingerprint.to_hex().chars().take(6).collect::<String>(),
                        r.token,
                        r.lease_until
                            .map_or("-".to_string(), |t| tick(t).to_string()),
                        tick(r.expires_at),
                        r.outcome.as_ref().map_or(String::new(), |o| {
                            format!(" outcome={}", String::from_utf8_lossy(o))
                        }),
                    );
                }
            }
        }
        for (c, client) in s.clients.iter().enumerate() {
            let _ = write!(
                out,
                "\n      {}: {:?}",
                World::client_name(c as u8),
                client.phase
            );
        }
        out
    }

    fn step(&self, s: &mut State, action: Action) {
        let now = self.world.at(s.now);
        let (lease, ttl) = (self.lease(), self.ttl());
        match action {
            Action::Tick => s.now += 1,
            Action::Purge => {
                s.store.purge_expired(now);
            }
            Action::Claim(c) => {
                let spec = self.world.clients[usize::from(c)];
                let client = &mut s.clients[usize::from(c)];
                if client.started.is_none() && matches!(spec.in_flight, InFlight::Wait { .. }) {
                    client.started = Some(s.now);
                }
                let fp = World::fingerprint(spec.fingerprint);
                match s.store.claim(&spec.key, &fp, lease, ttl, now) {
                    RefClaim::Claimed { token, .. } => {
                        s.keys[usize::from(spec.key)] = KeyGhost {
                            holder: Some(c),
                            ..KeyGhost::default()
                        };
                        s.clients[usize::from(c)].phase = Phase::Working {
                            token,
                            claimed_at: s.now,
                        };
                    }
                    RefClaim::Existing(record) => self.on_read(s, c, &record),
                }
            }
            Action::Look(c) => match s.store.get(&self.key(c), now).cloned() {
                None => s.clients[usize::from(c)].phase = Phase::Start,
                Some(record) => self.on_read(s, c, &record),
            },
            Action::Reclaim(c) => {
                let Phase::Reclaim { expected } = s.clients[usize::from(c)].phase else {
                    unreachable!("reclaim from {:?}", s.clients[usize::from(c)].phase)
                };
                let spec = self.world.clients[usize::from(c)];
                let was = self.status(s, spec.key);
                let fp = World::fingerprint(spec.fingerprint);
                match s.store.reclaim(&spec.key, expected, &fp, lease, ttl, now) {
                    Reclaim::Reclaimed { token, .. } => {
                        let g = &mut s.keys[usize::from(spec.key)];
                        g.holder = Some(c);
                        if was == Some(RecordStatus::Pending) {
                            // A passed lease was taken over: the known gap of leases alone.
                            g.effects_in_lease = 0;
                        }
                        s.clients[usize::from(c)].phase = Phase::Working {
                            token,
                            claimed_at: s.now,
                        };
                    }
                    Reclaim::Lost => s.clients[usize::from(c)].phase = Phase::Look,
                }
            }
            Action::Poll(c) => s.clients[usize::from(c)].phase = Phase::Look,
            Action::GiveUp(c) | Action::Crash(c) => {
                s.clients[usize::from(c)].phase = Phase::Stopped
            }
            Action::Run(c, work) => {
                let Phase::Working { token, claimed_at } = s.clients[usize::from(c)].phase else {
                    unreachable!()
                };
                s.clients[usize::from(c)].phase = match work {
                    Work::Acts => {
                        self.effect(s, c, token);
                        Phase::Completing { token, attempt: 1 }
                    }
                    Work::Errs => Phase::Releasing { token },
                    Work::Hangs => Phase::Hung { token, claimed_at },
                };
            }
            Action::Complete(c, write) => {
                let Phase::Completing { token, attempt } = s.clients[usize::from(c)].phase else {
                    unreachable!()
                };
                let key = self.key(c);
                let outcome = World::outcome(c);
                let was = self.status(s, key);
                let read_then_write = self.world.variant == Variant::ReadThenWriteComplete;
                let phase = match write {
                    Write::Answered if read_then_write => match s.store.get(&key, now) {
                        Some(r) if r.is_pending_with(now, token) => {
                            Phase::WritingCompletion { token }
                        }
                        _ => Phase::Stopped,
                    },
                    Write::Answered => {
                        if s.store.complete(&key, token, &outcome, ttl, now) == Cas::Applied {
                            self.applied_completion(s, c, was);
                        }
                        Phase::Stopped
                    }
                    Write::Errs | Write::AppliesThenErrs => {
                        if write == Write::AppliesThenErrs
                            && s.store.complete(&key, token, &outcome, ttl, now) == Cas::Applied
                        {
                            self.applied_completion(s, c, was);
                        }
                        let attempts = self.world.policy.settle_retry.attempts;
                        if u32::from(attempt) < attempts {
                            // A retry after an applied try is fenced, then recognised by a
                            // read; either way the client stops at its next try.
                            Phase::Completing {
                                token,
                                attempt: attempt + 1,
                            }
                        } else if self.world.variant == Variant::ReleaseOnCompletionError {
                            Phase::Releasing { token }
                        } else {
                            // The outcome is unknown: a permanent failure stands in for it
                            // (or, if the client crashes first, the key stays Pending until
                            // the lease passes).
                            Phase::StandingIn { token }
                        }
                    }
                };
                s.clients[usize::from(c)].phase = phase;
            }
            Action::Commit(c, write) => {
                let Phase::Working { token, .. } = s.clients[usize::from(c)].phase else {
                    unreachable!()
                };
                let key = self.key(c);
                let was = self.status(s, key);
                let phase = match write {
                    // Nothing committed: the exactly-once path releases the key.
                    Write::Errs => Phase::Releasing { token },
                    Write::Answered | Write::AppliesThenErrs => {
                        // The business write commits if and only if the completion CAS
                        // matches (unless the variant commits it regardless).
                        let matches = s
                            .store
                            .get(&key, now)
                            .is_some_and(|r| r.is_pending_with(now, token));
                        if matches || self.world.variant == Variant::CommitDespiteFence {
                            self.effect(s, c, token);
                        }
                        let cas = s.store.complete(&key, token, &World::outcome(c), ttl, now);
                        match cas {
                            Cas::Applied => {
                                self.applied_completion(s, c, was);
                                if write == Write::AppliesThenErrs {
                                    // The commit's answer was lost: the path releases the
                                    // key, and that CAS is fenced.
                                    Phase::Releasing { token }
                                } else {
                                    Phase::Stopped
                                }
                            }
                            Cas::Fenced => Phase::Stopped,
                        }
                    }
                };
                s.clients[usize::from(c)].phase = phase;
            }
            Action::WriteCompletion(c) => {
                let key = self.key(c);
                let was = self.status(s, key);
                if s.store
                    .complete_unchecked(&key, &World::outcome(c), ttl, now)
                    == Cas::Applied
                {
                    self.applied_completion(s, c, was);
                }
                s.clients[usize::from(c)].phase = Phase::Stopped;
            }
            Action::Release(c) => {
                let Phase::Releasing { token } = s.clients[usize::from(c)].phase else {
                    unreachable!()
                };
                let failure = Failure::retryable("released");
                if s.store.fail(&self.key(c), token, &failure, ttl, now) == Cas::Applied {
                    self.applied_write(s, c);
                }
                s.clients[usize::from(c)].phase = Phase::Stopped;
            }
            Action::StandIn(c) => {
                let Phase::StandingIn { token } = s.clients[usize::from(c)].phase else {
                    unreachable!()
                };
                let failure = Failure::outcome_not_stored("every try failed");
                if s.store.fail(&self.key(c), token, &failure, ttl, now) == Cas::Applied {
                    self.applied_write(s, c);
                }
                s.clients[usize::from(c)].phase = Phase::Stopped;
            }
            Action::Heartbeat(c) => {
                let (Phase::Working { token, claimed_at } | Phase::Hung { token, claimed_at }) =
                    s.clients[usize::from(c)].phase
                else {
                    unreachable!()
                };
                let lease = self
                    .heartbeat_lease(s, claimed_at)
                    .expect("the heartbeat beats");
                if s.store.extend(&self.key(c), token, lease, now) == Cas::Applied {
                    self.applied_write(s, c);
                }
            }
        }
    }
}

impl stateright::Model for ProtocolModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            store: ReferenceStore::with_flaw(self.world.variant.store_flaw()),
            clients: vec![
                Client {
                    phase: Phase::Start,
                    started: None,
                };
                self.world.clients.len()
            ],
            keys: vec![KeyGhost::default(); self.world.keys()],
            broken: Broken::default(),
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let now = self.world.at(s.now);
        if s.now < self.world.horizon() {
            actions.push(Action::Tick);
        }
        if (0..self.world.keys() as u8).any(|k| s.store.stored(&k).is_some_and(|r| !r.is_live(now)))
        {
            actions.push(Action::Purge);
        }
        let acting = self.is_acting(s);
        let writes: &[Write] = if self.world.completion_errors {
            &[Write::Answered, Write::Errs, Write::AppliesThenErrs]
        } else {
            &[Write::Answered]
        };
        for (i, client) in s.clients.iter().enumerate() {
            let c = i as u8;
            let key = self.key(c);
            // The heartbeat beats whether or not the client still acts; a beat that would be
            // fenced or change nothing is left out (it leaves the state as it is).
            if let Phase::Working { token, claimed_at } | Phase::Hung { token, claimed_at } =
                client.phase
            {
                if let (Some(lease), Some(r)) =
                    (self.heartbeat_lease(s, claimed_at), s.store.get(&key, now))
                {
                    if r.is_pending_with(now, token)
                        && r.lease_until != Some(now.saturating_add(lease))
                    {
                        actions.push(Action::Heartbeat(c));
                    }
                }
            }
            if !acting || client.phase == Phase::Stopped {
                continue;
            }
            match client.phase {
                Phase::Start => actions.push(Action::Claim(c)),
                Phase::Look => actions.push(Action::Look(c)),
                Phase::Reclaim { .. } => actions.push(Action::Reclaim(c)),
                Phase::Waiting { token, until } => {
                    let settled = match s.store.get(&key, now) {
                        Some(r) => {
                            r.status != RecordStatus::Pending || r.token != token || now >= until
                        }
                        None => true,
                    };
                    if settled {
                        actions.push(Action::Poll(c));
                    }
                    let max_wait = self.world.max_wait_ticks(i).unwrap_or(0);
                    if client.started.is_some_and(|t| s.now >= t + max_wait) {
                        actions.push(Action::GiveUp(c));
                    }
                }
                Phase::Working { .. } => {
                    match self.world.mode {
                        Mode::Plain => actions.push(Action::Run(c, Work::Acts)),
                        Mode::Transactional => {
                            actions.extend(writes.iter().map(|w| Action::Commit(c, *w)))
                        }
                    }
                    actions.push(Action::Run(c, Work::Errs));
                    if self.world.hangs {
                        actions.push(Action::Run(c, Work::Hangs));
                    }
                }
                Phase::Completing { .. } => {
                    actions.extend(writes.iter().map(|w| Action::Complete(c, *w)))
                }
                Phase::WritingCompletion { .. } => actions.push(Action::WriteCompletion(c)),
                Phase::Releasing { .. } => actions.push(Action::Release(c)),
                Phase::StandingIn { .. } => actions.push(Action::StandIn(c)),
                Phase::Hung { .. } | Phase::Stopped => {}
            }
            if self.world.crashes && !matches!(client.phase, Phase::Hung { .. } | Phase::Stopped) {
                actions.push(Action::Crash(c));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        self.step(&mut s, action);
        // A live Completed record is final: nothing but its hit count may change.
        let now = self.world.at(s.now);
        for key in 0..self.world.keys() as u8 {
            if let Some(before) = last.store.stored(&key) {
                if before.status == RecordStatus::Completed && before.is_live(now) {
                    let unchanged = s.store.stored(&key).is_some_and(|after| {
                        RefRecord {
                            hits: before.hits,
                            ..after.clone()
                        } == *before
                    });
                    if !unchanged {
                        s.broken.completed_changed = true;
                    }
                }
            }
        }
        Some(s)
    }

    fn format_action(&self, action: &Action) -> String {
        let name = |c: &u8| World::client_name(*c);
        match action {
            Action::Tick => "the clock ticks".into(),
            Action::Purge => "purge_expired runs".into(),
            Action::Claim(c) => format!("{} claims and decides", name(c)),
            Action::Look(c) => format!("{} reads the record and decides", name(c)),
            Action::Reclaim(c) => format!("{} reclaims", name(c)),
            Action::StandIn(c) => format!("{} records its outcome as not stored", name(c)),
            Action::Poll(c) => format!("{} polls and stops waiting", name(c)),
            Action::GiveUp(c) => format!("{} gives up waiting", name(c)),
            Action::Run(c, w) => format!("{}'s work {w:?}", name(c)),
            Action::Complete(c, w) => format!("{} writes its completion: {w:?}", name(c)),
            Action::Commit(c, w) => format!("{} commits effect and completion: {w:?}", name(c)),
            Action::WriteCompletion(c) => format!("{} writes the completion it checked", name(c)),
            Action::Release(c) => format!("{} records a failure", name(c)),
            Action::Heartbeat(c) => format!("{}'s heartbeat extends", name(c)),
            Action::Crash(c) => format!("{} crashes", name(c)),
        }
    }

    fn properties(&self) -> Vec<stateright::Property<Self>> {
        use stateright::Property;
        let mut properties = vec![
            Property::always(ONLY_CURRENT_HOLDER_WRITES, |_, s: &State| {
                !s.broken.stale_write
            }),
            Property::always(COMPLETED_IS_FINAL, |_, s: &State| {
                !s.broken.completed_changed
            }),
            Property::always(REPLAY_IS_THE_COMPLETED_OUTCOME, |_, s: &State| {
                !s.broken.bad_replay
            }),
            Property::always(EFFECT_ONCE_PER_LEASE, |_, s: &State| {
                !s.broken.effect_twice_in_lease
            }),
            Property::always(EVENTUALLY_CLAIMABLE, |m: &Self, s: &State| {
                s.now < m.world.horizon()
                    || (0..m.world.keys() as u8).all(|k| !m.is_in_flight(s, k))
            }),
            Property::sometimes(REACHES_COMPLETION_AFTER_RECLAIM, |m: &Self, s: &State| {
                let now = m.world.at(s.now);
                (0..m.world.keys() as u8).any(|k| {
                    s.store
                        .get(&k, now)
                        .is_some_and(|r| r.status == RecordStatus::Completed && r.attempts >= 2)
                })
            }),
        ];
        if self.world.mode == Mode::Transactional {
            properties.push(Property::always(EFFECT_ONCE_PER_RECORD, |_, s: &State| {
                !s.broken.effect_twice_in_record
            }));
        }
        properties
    }
}
