//! The world to explore: its clients, its policy, its clock and the variant of the protocol.

use idempotency_conformance::reference::Flaw;
use idempotency_core::store::Timestamp;
use idempotency_core::{Fingerprint, InFlight, Policy};
use std::time::Duration;

/// One tick of the world's clock. Policy durations are whole numbers of ticks.
pub const TICK: Duration = Duration::from_secs(1);

/// The environment variable that sets how many clients [`World::from_env`] has.
pub const CLIENTS_ENV: &str = "IDEMPOTENCY_MODEL_CHECK_CLIENTS";

/// The environment variable that sets how many ticks the clients of [`World::from_env`] act.
pub const TICKS_ENV: &str = "IDEMPOTENCY_MODEL_CHECK_TICKS";

/// The store's clock at tick 0 (a realistic epoch, so tokens follow the real rule).
const EPOCH_MILLIS: i64 = 1_700_000_000_000;

/// How a holder's side effect and its completion reach the store.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Mode {
    /// The engine's `run`: the work acts, then the completion is written (and retried per the
    /// settle policy). A holder that stalls past its lease can act again after a takeover.
    Plain,
    /// The SQL stores' exactly-once path: the work's writes and the completion CAS commit in
    /// one transaction, together or not at all.
    Transactional,
}

/// The protocol as built, or with one deliberate bug, to prove that a property bites.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Variant {
    /// The protocol as built: the reference store and the engine's steps.
    Real,
    /// The store issues a fresh record's token from a per-record counter, so a key whose
    /// record was purged starts again at 1.
    TokenRestartsAfterPurge,
    /// The store's complete reads the record, then writes it in a second step.
    ReadThenWriteComplete,
    /// The store's reclaim does not check that the record still holds the expected token.
    ReclaimWithoutExpectedToken,
    /// The store's reclaim keeps the old fingerprint.
    ReclaimKeepsFingerprint,
    /// The store's reclaim takes over a permanent failure with the failed request's
    /// fingerprint.
    ReclaimTakesPermanentFailure,
    /// The engine releases the key (records a failure) as soon as the completion fails,
    /// although the work has acted.
    ReleaseOnCompletionError,
    /// The exactly-once path commits the business write even when the completion CAS
    /// matched no row.
    CommitDespiteFence,
    /// The heartbeat keeps extending a hung work's lease, with no maximum work time.
    UnboundedHeartbeat,
}

impl Variant {
    /// Every broken variant, with the property each is built to violate.
    pub const BROKEN: [Variant; 8] = [
        Variant::TokenRestartsAfterPurge,
        Variant::ReadThenWriteComplete,
        Variant::ReclaimWithoutExpectedToken,
        Variant::ReclaimKeepsFingerprint,
        Variant::ReclaimTakesPermanentFailure,
        Variant::ReleaseOnCompletionError,
        Variant::CommitDespiteFence,
        Variant::UnboundedHeartbeat,
    ];

    /// The modes the variant applies to: a broken completion write exists only where the
    /// completion is written apart from the work, a broken commit only in a transaction.
    pub fn modes(self) -> &'static [Mode] {
        match self {
            // The failure that stands in for a lost outcome is written apart from the work.
            Variant::ReadThenWriteComplete
            | Variant::ReleaseOnCompletionError
            | Variant::ReclaimTakesPermanentFailure => &[Mode::Plain],
            Variant::CommitDespiteFence => &[Mode::Transactional],
            _ => &[Mode::Plain, Mode::Transactional],
        }
    }

    /// The reference store's flaw for this variant.
    pub fn store_flaw(self) -> Flaw {
        match self {
            Variant::TokenRestartsAfterPurge => Flaw::TokenRestartsAfterPurge,
            Variant::ReclaimWithoutExpectedToken => Flaw::ReclaimIgnoresExpectedToken,
            Variant::ReclaimKeepsFingerprint => Flaw::ReclaimKeepsFingerprint,
            Variant::ReclaimTakesPermanentFailure => Flaw::ReclaimTakesPermanentFailure,
            _ => Flaw::None,
        }
    }
}

/// One client: it sends one request for `key` with one of two fingerprints.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ClientSpec {
    /// Which key (0 or 1).
    pub key: u8,
    /// Which request body (0 or 1): two clients with the same one are retries of each other.
    pub fingerprint: u8,
    /// What the client does while another holds a live lease.
    pub in_flight: InFlight,
}

impl ClientSpec {
    /// A client that is refused while another holds the key.
    pub fn reject(key: u8, fingerprint: u8) -> Self {
        Self {
            key,
            fingerprint,
            in_flight: InFlight::Reject,
        }
    }

    /// A client that waits up to `max_wait_ticks` for the holder to settle.
    pub fn wait(key: u8, fingerprint: u8, max_wait_ticks: u8) -> Self {
        Self {
            key,
            fingerprint,
            in_flight: InFlight::wait(TICK * u32::from(max_wait_ticks)),
        }
    }
}

/// The world: clients, the engine's policy, how long clients act, and the variant.
#[derive(Clone, Debug)]
pub struct World {
    /// The clients, each sending one request.
    pub clients: Vec<ClientSpec>,
    /// How effects and completions reach the store.
    pub mode: Mode,
    /// The engine's policy: lease, retention, maximum work time and settle attempts are
    /// used, in whole ticks.
    pub policy: Policy,
    /// Clients act up to this tick; after it only the environment does (the clock, purges,
    /// the heartbeats of hung works), up to [`World::horizon`].
    pub active_until: u8,
    /// Whether a client may crash at any step.
    pub crashes: bool,
    /// Whether a work may hang for ever (its heartbeat still beating).
    pub hangs: bool,
    /// Whether a completion write may fail (before or after it applied).
    pub completion_errors: bool,
    /// The protocol as built, or a broken variant.
    pub variant: Variant,
}

fn ticks(d: Duration) -> u8 {
    assert!(
        d.subsec_nanos() == 0 && d.as_secs() >= 1 && d.as_secs() <= 50,
        "the model's durations are whole ticks of {TICK:?} between 1 and 50, got {d:?}"
    );
    d.as_secs() as u8
}

impl World {
    /// The default world: three clients on one key (two retries of one request and a
    /// different request), the second waiting while the key is in flight; leases of 2 ticks,
    /// retention of 3, maximum work time of 3, two settle attempts; clients act for 4 ticks.
    pub fn standard(mode: Mode) -> Self {
        Self {
            clients: vec![
                ClientSpec::reject(0, 0),
                ClientSpec::wait(0, 0, 2),
                ClientSpec::reject(0, 1),
            ],
            mode,
            policy: Policy::default()
                .lease(TICK * 2)
                .retention(TICK * 3)
                .max_work_time(TICK * 3)
                .settle_retry({
                    let retry = idempotency_core::SettleRetry::default();
                    idempotency_core::SettleRetry::new(2, retry.initial_backoff, retry.max_backoff)
                }),
            active_until: 4,
            crashes: true,
            hangs: true,
            completion_errors: true,
            variant: Variant::Real,
        }
    }

    /// [`World::standard`], enlarged by environment variables for a longer run:
    /// `IDEMPOTENCY_MODEL_CHECK_CLIENTS` (how many clients, default 3: further ones alternate
    /// between a waiting retry of request 0 and a refused request 1) and
    /// `IDEMPOTENCY_MODEL_CHECK_TICKS` (how many ticks the clients act, default 4).
    pub fn from_env(mode: Mode) -> Self {
        let read = |name: &str, default: u8, max: u8| match std::env::var(name) {
            Ok(v) => match v.parse::<u8>() {
                Ok(n) if (1..=max).contains(&n) => n,
                _ => panic!("{name}={v:?}: expected a number from 1 to {max}"),
            },
            Err(_) => default,
        };
        let mut world = Self::standard(mode);
        let clients = read(CLIENTS_ENV, 3, 8);
        world.active_until = read(TICKS_ENV, 4, 40);
        world.clients = (0..clients)
            .map(|c| match c {
                0 => ClientSpec::reject(0, 0),
                c if c % 2 == 1 => ClientSpec::wait(0, 0, 2),
                _ => ClientSpec::reject(0, 1),
            })
            .collect();
        world
    }

    /// Two keys: two clients with different requests on key 0, one on key 1.
    pub fn two_keys(mode: Mode) -> Self {
        Self {
            clients: vec![
                ClientSpec::reject(0, 0),
                ClientSpec::reject(0, 1),
                ClientSpec::reject(1, 0),
            ],
            ..Self::standard(mode)
        }
    }

    /// The same world with another variant.
    pub fn with_variant(mut self, variant: Variant) -> Self {
        self.variant = variant;
        self
    }

    /// How many keys the clients use.
    pub fn keys(&self) -> usize {
        self.clients
            .iter()
            .map(|c| usize::from(c.key) + 1)
            .max()
            .unwrap_or(0)
    }

    pub(crate) fn lease_ticks(&self) -> u8 {
        ticks(self.policy.lease)
    }

    pub(crate) fn max_work_ticks(&self) -> u8 {
        ticks(self.policy.max_work_time)
    }

    pub(crate) fn max_wait_ticks(&self, client: usize) -> Option<u8> {
        match self.clients[client].in_flight {
            InFlight::Reject => None,
            InFlight::Wait { max_wait, .. } => Some(ticks(max_wait)),
        }
    }

    /// The last tick: long enough after the clients stop for every lease the engine can hold
    /// to pass (a claim's lease, or a hung work's heartbeat, which extends it up to the
    /// maximum work time after the claim).
    pub fn horizon(&self) -> u8 {
        self.active_until + self.max_work_ticks().max(self.lease_ticks())
    }

    /// The store's clock at `tick`.
    pub fn at(&self, tick: u8) -> Timestamp {
        Timestamp::from_millis(EPOCH_MILLIS).saturating_add(TICK * u32::from(tick))
    }

    /// The fingerprint of request body `n`.
    pub fn fingerprint(n: u8) -> Fingerprint {
        Fingerprint::from_bytes(&[b'r', b'e', b'q', b'-', b'a' + n])
    }

    /// The outcome bytes client `c`'s work produces: they name the execution.
    pub fn outcome(c: u8) -> Vec<u8> {
        vec![b'A' + c]
    }

    /// A short name for client `c`.
    pub fn client_name(c: u8) -> char {
        (b'A' + c) as char
    }
}
