//! Multi-step operations: an operation of several phases, each committing its writes with
//! the record's recovery point; a foreign call alone in its phase, sent with a key derived
//! from the operation and the phase; holders that crash between any two steps; and a
//! completer that finishes what they abandoned.
//!
//! This is the design the store operation for recovery points is built to: the model states
//! the rules (a phase's writes and its recovery point commit together, fenced by the
//! holder's token and by the phase they start from; a foreign call's key is the same for
//! every holder; the completer takes an operation over like any holder, by a CAS on its
//! token once its lease has passed) and checks them in every interleaving of a small world.

use stateright::{Checker, HasDiscoveries, Model, Property};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Each phase's writes commit at most once per operation.
pub const PHASE_COMMITS_ONCE: &str = "each phase's writes commit at most once per operation";
/// Every foreign call of a phase carries the same key, whoever makes it.
pub const FOREIGN_CALLS_ONE_KEY: &str = "every foreign call of a phase carries the same key";
/// The foreign service, deduplicating by key, acts at most once per operation.
pub const FOREIGN_EFFECT_ONCE: &str = "the foreign service acts at most once per operation";
/// Once nothing can act any more, no operation is left unfinished: whatever its holders
/// abandoned, the completer drove to the end.
pub const ABANDONED_OPERATIONS_FINISH: &str =
    "an operation whose holders crashed is finished once a completer runs";
/// (An example, not a rule.) An operation is finished by a holder that resumed at a recovery
/// point another holder committed: the world is large enough to mean something.
pub const FINISHES_AFTER_A_RESUME: &str = "an operation finishes after resuming mid-way";
/// (An example.) The completer finishes an operation a client abandoned mid-way.
pub const COMPLETER_FINISHES_ONE: &str = "the completer finishes an abandoned operation";

/// The phases of the operation: 0 and 2 write to the database (a ride, then a receipt and the
/// outcome), 1 calls a foreign service (a charge).
pub const PHASES: u8 = 3;
/// The phase that calls the foreign service, alone in its phase.
pub const FOREIGN_PHASE: u8 = 1;
/// A lease, in ticks.
pub const LEASE: u8 = 2;
/// The last tick at which a client sends a request (or a retry).
pub const LAST_REQUEST: u8 = 2;

/// The protocol as designed, or a deliberately broken version of it that a property must
/// catch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PhaseVariant {
    /// As designed.
    Correct,
    /// A phase's writes commit in one transaction and its recovery point in another: a crash
    /// between the two runs the phase again.
    RecoveryPointApart,
    /// The completer drives any unfinished operation it finds, live lease or not, without
    /// taking it over by a CAS on its token, and its writes are not fenced.
    CompleterIgnoresToken,
    /// The foreign call's key is derived from the holder's token rather than from the
    /// operation: each holder sends a key of its own.
    ForeignKeyPerHolder,
    /// No completer runs: only the clients' retries, which stop.
    NoCompleter,
}

/// The operation's record in the store.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OpRecord {
    /// The current holder's fencing token.
    pub token: u8,
    /// The token of the claim that created the record: the operation's identity, from which
    /// foreign keys are derived.
    pub first_token: u8,
    /// The recovery point: how many phases have committed.
    pub reached: u8,
    /// The tick until which the current holder's lease runs.
    pub lease_until: u8,
}

impl OpRecord {
    fn finished(&self) -> bool {
        self.reached == PHASES
    }
}

/// What a holder (a client or the completer) is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Holder {
    /// Holds nothing; a client may send its request (again).
    Idle,
    /// Holds the operation under `token`, at the start of phase `at` (the recovery point it
    /// read, or the one it committed last).
    Holding {
        /// Its fencing token.
        token: u8,
        /// The operation's first token (its identity).
        first: u8,
        /// The phase it is at.
        at: u8,
    },
    /// Made phase `at`'s foreign call; its recovery point is not committed yet.
    Called {
        /// Its fencing token.
        token: u8,
        /// The operation's first token.
        first: u8,
        /// The phase whose call it made.
        at: u8,
    },
    /// `RecoveryPointApart` only: phase `at`'s writes committed, its recovery point not yet.
    Wrote {
        /// Its fencing token.
        token: u8,
        /// The phase whose writes committed.
        at: u8,
    },
    /// Has the operation's outcome (it finished it, or a replay).
    Done,
    /// Crashed: it does nothing more.
    Crashed,
}

/// The world's state: the store, the holders, the foreign service, and what the properties
/// need to know.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PhaseState {
    /// The clock, in ticks.
    pub now: u8,
    /// The operation's record, once claimed.
    pub record: Option<OpRecord>,
    /// The token the next claim or take-over gets (tokens only grow).
    pub next_token: u8,
    /// Clients `A` and `B` (retries of one request), then the completer.
    pub holders: [Holder; 3],
    /// How many times each phase's writes committed.
    pub commits: [u8; PHASES as usize],
    /// The key of the first foreign call, and whether a later one carried another.
    pub foreign_key: Option<u8>,
    /// Whether a foreign call carried another key than the first.
    pub foreign_key_differs: bool,
    /// The keys the foreign service has acted on (a bit per key), and how many times it
    /// acted.
    pub foreign_seen: u32,
    /// How many times the foreign service acted.
    pub foreign_effects: u8,
    /// Whether a holder resumed at a recovery point another holder committed, and whether
    /// the completer finished the operation.
    pub resumed: bool,
    /// Whether the completer finished the operation.
    pub completer_finished: bool,
}

const COMPLETER: usize = 2;

/// A step of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PhaseAction {
    /// The clock advances a tick.
    Tick,
    /// A client sends its request: claim, resume, replay, or told to retry later.
    Request(usize),
    /// The completer takes over an operation whose lease has passed.
    TakeOver,
    /// A holder runs its phase: commits a database phase (writes and recovery point), or
    /// makes the foreign call.
    RunPhase(usize),
    /// A holder commits the recovery point of the phase whose foreign call (or, in
    /// `RecoveryPointApart`, whose writes) it made.
    CommitRecoveryPoint(usize),
    /// A client crashes (the completer does not: one that did would be restarted).
    Crash(usize),
}

/// The model of a multi-step operation.
#[derive(Clone, Debug)]
pub struct PhaseModel {
    /// The protocol checked.
    pub variant: PhaseVariant,
}

impl PhaseModel {
    /// Whether the clock still moves: until clients have sent their last request and every
    /// lease has passed.
    fn clock_runs(&self, s: &PhaseState) -> bool {
        s.now <= LAST_REQUEST
            || s.record
                .as_ref()
                .is_some_and(|r| !r.finished() && r.lease_until > s.now)
    }

    /// Takes the operation over under a new token (a CAS on the token read).
    fn take_over(&self, s: &mut PhaseState, h: usize) {
        let Some(r) = s.record.as_mut() else { return };
        // Phases another holder committed are not run again: this one resumes after them.
        s.resumed |= r.reached > 0;
        r.token = s.next_token;
        s.next_token += 1;
        r.lease_until = s.now + LEASE;
        s.holders[h] = Holder::Holding {
            token: r.token,
            first: r.first_token,
            at: r.reached,
        };
    }

    /// Commits phase `at`'s recovery point (and, when `writes`, its writes) for the holder
    /// of `token`: applied only if the record is still that holder's and at that phase.
    /// Whether it applied.
    fn commit(&self, s: &mut PhaseState, h: usize, token: u8, at: u8, writes: bool) -> bool {
        let fenced = !(self.variant == PhaseVariant::CompleterIgnoresToken && h == COMPLETER);
        let Some(r) = s.record.as_mut() else {
            return false;
        };
        if fenced && (r.token != token || r.reached != at) {
            s.holders[h] = Holder::Idle;
            return false;
        }
        if writes {
            s.commits[usize::from(at)] += 1;
        }
        r.reached = r.reached.max(at + 1);
        r.lease_until = s.now + LEASE;
        if r.finished() {
            s.holders[h] = Holder::Done;
            if h == COMPLETER {
                s.completer_finished = true;
            }
        } else {
            s.holders[h] = Holder::Holding {
                token,
                first: r.first_token,
                at: at + 1,
            };
        }
        true
    }
}

impl Model for PhaseModel {
    type State = PhaseState;
    type Action = PhaseAction;

    fn init_states(&self) -> Vec<PhaseState> {
        vec![PhaseState {
            now: 0,
            record: None,
            next_token: 1,
            holders: [Holder::Idle; 3],
            commits: [0; PHASES as usize],
            foreign_key: None,
            foreign_key_differs: false,
            foreign_seen: 0,
            foreign_effects: 0,
            resumed: false,
            completer_finished: false,
        }]
    }

    fn actions(&self, s: &PhaseState, actions: &mut Vec<PhaseAction>) {
        if self.clock_runs(s) {
            actions.push(PhaseAction::Tick);
        }
        for h in 0..3 {
            match s.holders[h] {
                Holder::Idle if h < COMPLETER => {
                    // A request that would only be told to retry later changes nothing.
                    let changes = s.now <= LAST_REQUEST
                        && s.record
                            .as_ref()
                            .is_none_or(|r| r.finished() || r.lease_until <= s.now);
                    if changes {
                        actions.push(PhaseAction::Request(h));
                    }
                }
                Holder::Idle => {
                    let takes = match self.variant {
                        PhaseVariant::NoCompleter => false,
                        PhaseVariant::CompleterIgnoresToken => {
                            s.record.as_ref().is_some_and(|r| !r.finished())
                        }
                        _ => s
                            .record
                            .as_ref()
                            .is_some_and(|r| !r.finished() && r.lease_until <= s.now),
                    };
                    if takes {
                        actions.push(PhaseAction::TakeOver);
                    }
                }
                Holder::Holding { .. } => actions.push(PhaseAction::RunPhase(h)),
                Holder::Called { .. } | Holder::Wrote { .. } => {
                    actions.push(PhaseAction::CommitRecoveryPoint(h))
                }
                Holder::Done | Holder::Crashed => {}
            }
            if h < COMPLETER && !matches!(s.holders[h], Holder::Done | Holder::Crashed) {
                actions.push(PhaseAction::Crash(h));
            }
        }
    }

    fn next_state(&self, last: &PhaseState, action: PhaseAction) -> Option<PhaseState> {
        let mut s = last.clone();
        match action {
            PhaseAction::Tick => s.now += 1,
            PhaseAction::Request(h) => match &s.record {
                None => {
                    let token = s.next_token;
                    s.next_token += 1;
                    s.record = Some(OpRecord {
                        token,
                        first_token: token,
                        reached: 0,
                        lease_until: s.now + LEASE,
                    });
                    s.holders[h] = Holder::Holding {
                        token,
                        first: token,
                        at: 0,
                    };
                }
                Some(r) if r.finished() => s.holders[h] = Holder::Done,
                Some(_) => self.take_over(&mut s, h),
            },
            PhaseAction::TakeOver => match self.variant {
                PhaseVariant::CompleterIgnoresToken => {
                    let r = s.record.as_ref()?;
                    s.holders[COMPLETER] = Holder::Holding {
                        token: r.token,
                        first: r.first_token,
                        at: r.reached,
                    };
                }
                _ => self.take_over(&mut s, COMPLETER),
            },
            PhaseAction::RunPhase(h) => {
                let Holder::Holding { token, first, at } = s.holders[h] else {
                    return None;
                };
                if at == FOREIGN_PHASE {
                    let key = match self.variant {
                        PhaseVariant::ForeignKeyPerHolder => token,
                        _ => first,
                    };
                    if s.foreign_key.is_some_and(|k| k != key) {
                        s.foreign_key_differs = true;
                    }
                    s.foreign_key.get_or_insert(key);
                    if s.foreign_seen & (1 << key) == 0 {
                        s.foreign_seen |= 1 << key;
                        s.foreign_effects += 1;
                    }
                    s.holders[h] = Holder::Called { token, first, at };
                } else if self.variant == PhaseVariant::RecoveryPointApart {
                    let r = s.record.as_ref()?;
                    if r.token == token && r.reached == at {
                        s.commits[usize::from(at)] += 1;
                        s.holders[h] = Holder::Wrote { token, at };
                    } else {
                        s.holders[h] = Holder::Idle;
                    }
                } else {
                    self.commit(&mut s, h, token, at, true);
                }
            }
            PhaseAction::CommitRecoveryPoint(h) => match s.holders[h] {
                Holder::Called { token, at, .. } => {
                    self.commit(&mut s, h, token, at, true);
                }
                Holder::Wrote { token, at } => {
                    self.commit(&mut s, h, token, at, false);
                }
                _ => return None,
            },
            PhaseAction::Crash(h) => s.holders[h] = Holder::Crashed,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(PHASE_COMMITS_ONCE, |_, s: &PhaseState| {
                s.commits.iter().all(|&n| n <= 1)
            }),
            Property::always(FOREIGN_CALLS_ONE_KEY, |_, s: &PhaseState| {
                !s.foreign_key_differs
            }),
            Property::always(FOREIGN_EFFECT_ONCE, |_, s: &PhaseState| {
                s.foreign_effects <= 1
            }),
            Property::always(ABANDONED_OPERATIONS_FINISH, |m: &Self, s: &PhaseState| {
                let mut next = Vec::new();
                m.actions(s, &mut next);
                !next.is_empty() || s.record.as_ref().is_none_or(OpRecord::finished)
            }),
            Property::sometimes(FINISHES_AFTER_A_RESUME, |_, s: &PhaseState| {
                s.resumed && s.record.as_ref().is_some_and(OpRecord::finished)
            }),
            Property::sometimes(COMPLETER_FINISHES_ONE, |_, s: &PhaseState| {
                s.completer_finished && s.holders[..COMPLETER].contains(&Holder::Crashed)
            }),
        ]
    }
}

/// What an exhaustive check of the phases model found.
#[derive(Debug)]
pub struct PhaseReport {
    /// The protocol checked.
    pub variant: PhaseVariant,
    /// Distinct states explored.
    pub unique_states: usize,
    /// The longest path explored, in steps.
    pub max_depth: usize,
    /// How long the check took.
    pub elapsed: Duration,
    /// For each property with a discovery (a counterexample for a rule, an example for an
    /// example): the path, one step per line.
    pub discoveries: BTreeMap<&'static str, String>,
}

impl PhaseReport {
    /// The counterexample or example found for `property`, if any.
    pub fn discovery(&self, property: &str) -> Option<&str> {
        self.discoveries.get(property).map(String::as_str)
    }
}

/// Explores every state of the phases world for `variant`, breadth-first (so counterexamples
/// are shortest). With `stop_at`, stops once that property has a discovery.
pub fn check_phases(variant: PhaseVariant, stop_at: Option<&'static str>) -> PhaseReport {
    let model = PhaseModel { variant };
    let started = Instant::now();
    let mut builder = model.clone().checker().threads(1);
    if let Some(name) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])));
    }
    let checker = builder.spawn_bfs().join();
    let discoveries = checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| {
            let mut trace = String::new();
            for (state, action) in path.into_vec() {
                trace.push_str(&format!("  {state:?}\n"));
                if let Some(action) = action {
                    trace.push_str(&format!("    -> {action:?}\n"));
                }
            }
            (name, trace)
        })
        .collect();
    PhaseReport {
        variant,
        unique_states: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        elapsed: started.elapsed(),
        discoveries,
    }
}
