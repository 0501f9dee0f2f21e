//! The sequential specification of one idempotency key, as a client sees it.
//!
//! A key is a *once-register*: it starts open, and the first execution whose completion
//! commits closes it with that execution's value, for good. Every later request replays that
//! value. While it is open, requests may run the work and fail (releasing the key), find
//! another attempt in progress, or lose their lease. An execution whose work ran but whose
//! outcome could not be stored closes it too, with a permanent failure instead of a value
//! ([`LOST`]): every later request is told it failed for good, and nothing runs again.
//!
//! Linearization points: a replay, an in-progress answer and a run whose work failed take
//! effect at the claim that observed the record; a fresh success at its completion CAS; a read
//! at the read.

use crate::checker::Model;

/// What a client asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// Run the work for the key; if this execution's completion commits, the key's value is
    /// `value` (unique to this call).
    Run {
        /// The value this call's work produces.
        value: u64,
    },
    /// Read the record (`IdempotencyStore::get`).
    Read,
}

/// What it answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Response {
    /// `Answer::Executed(Ok(v))`: this call's execution committed `v`.
    Fresh(u64),
    /// `Answer::Replayed(Ok(v))`: the key holds `v`.
    Replayed(u64),
    /// The work ran and failed with an error that released the key: no effect.
    Released,
    /// The work panicked on an open key: it may have acted, so its key is settled for good
    /// with a permanent failure in the outcome's place ([`LOST`]), or, if the store refused
    /// that write, left Pending (open once its lease passes).
    Panicked,
    /// `Refusal::InProgress` (HTTP 409): another attempt held a live lease.
    InProgress,
    /// The work ran in this call (`v` is the call's own value) and the call was answered,
    /// but whether its completion committed is not known: the HTTP layer delivers a fresh
    /// response even when storing it failed or was fenced. If it committed, it did before
    /// the answer.
    Executed(u64),
    /// `Error::LeaseLost`: this call's completion was fenced; no effect.
    LeaseLost,
    /// A read found the record Completed with `v`.
    ReadCompleted(u64),
    /// A read found no Completed record (absent, Pending or Failed).
    ReadOpen,
    /// No answer (cancelled, timed out, a backend error): the call may or may not have taken
    /// effect, now or later.
    Unknown,
    /// `Refusal::OutcomeLost` (HTTP 422 `idempotency-key-outcome-lost`): the key is closed by
    /// a work whose outcome could not be stored.
    FailedPermanently,
    /// A read found the record Failed for good (not retryable).
    ReadFailed,
}

/// The value of a key closed by a permanent failure in place of an outcome: a work ran (a call
/// answered [`Response::Unknown`] or [`Response::Executed`]) and its outcome could not be
/// stored. No call's own value (each is its sequence number, from 1).
pub const LOST: u64 = u64::MAX;

/// The model: state `None` (open) or `Some(v)` (closed with `v`).
#[derive(Clone, Copy, Debug, Default)]
pub struct OnceRegister;

impl Model for OnceRegister {
    type State = Option<u64>;
    type Input = Call;
    type Output = Response;

    fn init(&self) -> Option<u64> {
        None
    }

    fn step(&self, state: &Option<u64>, input: &Call, output: &Response) -> Vec<Option<u64>> {
        use Response as R;
        match (input, output, state) {
            (Call::Run { value }, R::Fresh(v), None) if v == value => vec![Some(*v)],
            (Call::Run { .. }, R::Replayed(v), Some(held)) if v == held => vec![*state],
            (Call::Run { .. }, R::Released | R::InProgress, None) => vec![None],
            (Call::Run { .. }, R::Panicked, None) => vec![None, Some(LOST)],
            (Call::Run { .. }, R::LeaseLost, _) => vec![*state],
            (Call::Run { value }, R::Executed(v), None) if v == value => {
                vec![None, Some(*v), Some(LOST)]
            }
            // Unknown: it may have committed its value (only onto an open key), or a permanent
            // failure in its place, or nothing.
            (Call::Run { value }, R::Unknown, None) => vec![None, Some(*value), Some(LOST)],
            (Call::Run { .. }, R::Unknown, Some(_)) => vec![*state],
            (Call::Run { .. }, R::FailedPermanently, Some(LOST)) => vec![*state],
            (Call::Read, R::ReadCompleted(v), Some(held)) if v == held => vec![*state],
            (Call::Read, R::ReadFailed, Some(LOST)) => vec![*state],
            (Call::Read, R::ReadOpen, None) => vec![None],
            (Call::Read, R::Unknown, _) => vec![*state],
            _ => vec![],
        }
    }
}

/// A call with the times the checker knows it by, for [`ExpiringOnceRegister`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timed {
    /// The call.
    pub call: Call,
    /// When it was made.
    pub at: u64,
    /// When it was answered (`u64::MAX` when it never was).
    pub by: u64,
}

/// A once-register whose closing expires: a key with a short retention. A committed value is
/// kept for at least `ttl` after its completion (which came after the committing call was
/// made), then the record expires (or is purged) and the key is open again.
///
/// The state is the value and the earliest moment its record may expire. An operation may
/// see the key open again only if it may have taken effect at or after that moment (it was
/// answered then or later, or never). Within a retention the rules are [`OnceRegister`]'s.
#[derive(Clone, Copy, Debug)]
pub struct ExpiringOnceRegister {
    /// The retention, in the history's clock units, less the clock skew allowed.
    pub ttl: u64,
}

impl ExpiringOnceRegister {
    fn closed_by(&self, value: u64, at: u64) -> Option<(u64, u64)> {
        Some((value, at.saturating_add(self.ttl)))
    }
}

impl Model for ExpiringOnceRegister {
    type State = Option<(u64, u64)>;
    type Input = Timed;
    type Output = Response;

    fn init(&self) -> Option<(u64, u64)> {
        None
    }

    fn step(&self, state: &Self::State, input: &Timed, output: &Response) -> Vec<Self::State> {
        use Response as R;
        // Whether the key may be open for this operation: it is, or its value may have expired.
        let open = match state {
            None => true,
            Some((_, expires)) => input.by >= *expires,
        };
        let held = |v: &u64| matches!(state, Some((h, _)) if h == v);
        match (input.call, output) {
            (Call::Run { value }, R::Fresh(v)) if *v == value && open => {
                vec![self.closed_by(value, input.at)]
            }
            (Call::Run { .. }, R::Replayed(v)) if held(v) => vec![*state],
            (Call::Run { .. }, R::Released | R::InProgress) if open => vec![None],
            (Call::Run { .. }, R::Panicked) if open => vec![None, self.closed_by(LOST, input.at)],
            (Call::Run { .. }, R::LeaseLost) => vec![*state],
            // It claimed an open key; it committed before its answer (its value, or a
            // permanent failure in its place), or not.
            (Call::Run { value }, R::Executed(v)) if *v == value && open => {
                vec![
                    None,
                    self.closed_by(value, input.at),
                    self.closed_by(LOST, input.at),
                ]
            }
            // It did nothing, or claimed an open key and committed (its value, or a permanent
            // failure in its place), or not.
            (Call::Run { value }, R::Unknown) if open => {
                let mut next = vec![
                    None,
                    self.closed_by(value, input.at),
                    self.closed_by(LOST, input.at),
                ];
                if state.is_some() {
                    next.push(*state);
                }
                next
            }
            (Call::Run { .. }, R::Unknown) => vec![*state],
            (Call::Run { .. }, R::FailedPermanently) if held(&LOST) => vec![*state],
            (Call::Read, R::ReadCompleted(v)) if held(v) => vec![*state],
            (Call::Read, R::ReadFailed) if held(&LOST) => vec![*state],
            (Call::Read, R::ReadOpen) if open => vec![None],
            (Call::Read, R::Unknown) => vec![*state],
            _ => vec![],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::{check, Operation, Verdict};

    fn op(call: u64, ret: Option<u64>, input: Call, output: Response) -> Operation<Call, Response> {
        Operation {
            call,
            ret,
            input,
            output,
        }
    }

    fn run(value: u64) -> Call {
        Call::Run { value }
    }

    fn verdict(h: &[Operation<Call, Response>]) -> Verdict {
        check(&OnceRegister, h, 1_000_000)
    }

    #[test]
    fn first_run_then_replays() {
        let h = [
            op(0, Some(10), run(1), Response::Fresh(1)),
            op(2, Some(5), run(2), Response::InProgress),
            op(11, Some(12), run(3), Response::Replayed(1)),
            op(13, Some(14), Call::Read, Response::ReadCompleted(1)),
        ];
        assert!(verdict(&h).is_linearizable());
    }

    #[test]
    fn failures_release_the_key_for_a_later_winner() {
        let h = [
            op(0, Some(10), run(1), Response::Released),
            op(11, Some(12), Call::Read, Response::ReadOpen),
            op(13, Some(20), run(2), Response::Fresh(2)),
            op(14, Some(30), run(3), Response::LeaseLost),
            op(31, Some(32), run(4), Response::Replayed(2)),
        ];
        assert!(verdict(&h).is_linearizable());
    }

    #[test]
    fn two_fresh_executions_are_a_violation() {
        // A double effect: two calls both committed, even though they overlap.
        let h = [
            op(0, Some(10), run(1), Response::Fresh(1)),
            op(1, Some(11), run(2), Response::Fresh(2)),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn replay_of_another_value_is_a_violation() {
        let h = [
            op(0, Some(10), run(1), Response::Fresh(1)),
            op(11, Some(12), run(2), Response::Replayed(7)),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn in_progress_after_completion_is_a_violation() {
        // The completion was acknowledged before the claim began: the claim must replay.
        let h = [
            op(0, Some(10), run(1), Response::Fresh(1)),
            op(11, Some(12), run(2), Response::InProgress),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn a_lost_completion_is_a_violation() {
        // The record forgot an acknowledged completion: a later run executed again.
        let h = [
            op(0, Some(10), run(1), Response::Fresh(1)),
            op(11, Some(12), Call::Read, Response::ReadOpen),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn a_replay_before_anything_could_complete_is_a_violation() {
        let h = [
            op(0, Some(5), run(1), Response::Replayed(2)),
            op(6, Some(10), run(2), Response::Fresh(2)),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn an_unknown_run_may_explain_a_replay() {
        // The cancelled call committed after all; later calls replay its value.
        let h = [
            op(0, None, run(1), Response::Unknown),
            op(5, Some(6), run(2), Response::InProgress),
            op(20, Some(21), run(3), Response::Replayed(1)),
            op(22, Some(23), Call::Read, Response::ReadCompleted(1)),
        ];
        assert!(verdict(&h).is_linearizable());
        // …or committed nothing, and a later call ran.
        let h = [
            op(0, None, run(1), Response::Unknown),
            op(20, Some(21), run(3), Response::Fresh(3)),
        ];
        assert!(verdict(&h).is_linearizable());
    }

    #[test]
    fn two_unknown_runs_cannot_both_have_committed() {
        let h = [
            op(0, None, run(1), Response::Unknown),
            op(1, None, run(2), Response::Unknown),
            op(20, Some(21), Call::Read, Response::ReadCompleted(1)),
            op(22, Some(23), Call::Read, Response::ReadCompleted(2)),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn a_fresh_value_that_is_not_the_callers_is_a_violation() {
        let h = [op(0, Some(10), run(1), Response::Fresh(2))];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn an_unstored_outcome_closes_the_key_with_a_permanent_failure() {
        // Call 1's work ran and its outcome could not be stored: a permanent failure was
        // recorded in its place. Every later call is told so; nothing runs again.
        let h = [
            op(0, Some(10), run(1), Response::Unknown),
            op(12, Some(13), run(2), Response::FailedPermanently),
            op(14, Some(15), Call::Read, Response::ReadFailed),
            op(400, Some(410), run(3), Response::FailedPermanently),
        ];
        assert!(verdict(&h).is_linearizable());
        // The same after an HTTP execution whose response was delivered but not stored.
        let mut h = h.to_vec();
        h[0] = op(0, Some(10), run(1), Response::Executed(1));
        assert!(verdict(&h).is_linearizable());
        // A run after that is a second execution.
        h.push(op(500, Some(510), run(5), Response::Fresh(5)));
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
        // And a permanent failure nothing could have recorded is a violation: here every
        // earlier call is known to have done something else.
        let h = [
            op(0, Some(10), run(1), Response::Fresh(1)),
            op(12, Some(13), run(2), Response::FailedPermanently),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
        let h = [
            op(0, Some(10), run(1), Response::Released),
            op(12, Some(13), Call::Read, Response::ReadFailed),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn outcome_unknown_holds_the_key_then_one_rerun_is_allowed() {
        // Call 1's work ran but its completion failed through every try (OutcomeUnknown): a
        // retry in the lease is told InProgress, a read finds no outcome, and after the lease
        // one retry runs again and commits.
        let h = [
            op(0, None, run(1), Response::Unknown),
            op(12, Some(13), run(2), Response::InProgress),
            op(14, Some(15), Call::Read, Response::ReadOpen),
            op(400, Some(410), run(3), Response::Fresh(3)),
            op(420, Some(421), run(4), Response::Replayed(3)),
        ];
        assert!(verdict(&h).is_linearizable());
        // But not a second commit after that.
        let mut h = h.to_vec();
        h.push(op(500, Some(510), run(5), Response::Fresh(5)));
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn an_http_execution_may_or_may_not_have_committed() {
        // Stored: later calls replay it.
        let h = [
            op(0, Some(10), run(1), Response::Executed(1)),
            op(11, Some(12), run(2), Response::Replayed(1)),
        ];
        assert!(verdict(&h).is_linearizable());
        // Not stored (the store failed): the key held, then one retry ran again.
        let h = [
            op(0, Some(10), run(1), Response::Executed(1)),
            op(11, Some(12), run(2), Response::InProgress),
            op(400, Some(410), run(3), Response::Executed(3)),
            op(411, Some(412), run(4), Response::Replayed(3)),
        ];
        assert!(verdict(&h).is_linearizable());
        // An execution after a replay, or a replay of an execution that was not the one
        // stored, is not.
        let h = [
            op(0, Some(10), run(1), Response::Executed(1)),
            op(11, Some(12), run(2), Response::Replayed(1)),
            op(13, Some(20), run(3), Response::Executed(3)),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
        let h = [
            op(0, Some(10), run(1), Response::Executed(1)),
            op(11, Some(20), run(2), Response::Executed(2)),
            op(21, Some(22), run(3), Response::Replayed(1)),
            op(23, Some(24), run(4), Response::Replayed(2)),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
        // Its commit comes before its answer, not after.
        let h = [
            op(0, Some(10), run(1), Response::Executed(1)),
            op(11, Some(12), Call::Read, Response::ReadOpen),
            op(13, Some(14), Call::Read, Response::ReadCompleted(1)),
        ];
        assert!(matches!(verdict(&h), Verdict::Violation { .. }));
    }

    fn timed(
        call: u64,
        ret: Option<u64>,
        input: Call,
        output: Response,
    ) -> Operation<Timed, Response> {
        Operation {
            call,
            ret,
            input: Timed {
                call: input,
                at: call,
                by: ret.unwrap_or(u64::MAX),
            },
            output,
        }
    }

    fn expiring(h: &[Operation<Timed, Response>]) -> Verdict {
        check(&ExpiringOnceRegister { ttl: 100 }, h, 1_000_000)
    }

    #[test]
    fn an_expired_key_runs_again_but_not_within_its_retention() {
        let first = [
            timed(0, Some(10), run(1), Response::Fresh(1)),
            timed(20, Some(21), run(2), Response::Replayed(1)),
        ];
        // After the retention: a new life.
        let mut h = first.to_vec();
        h.push(timed(150, Some(151), Call::Read, Response::ReadOpen));
        h.push(timed(200, Some(210), run(3), Response::Fresh(3)));
        h.push(timed(220, Some(221), run(4), Response::Replayed(3)));
        assert!(expiring(&h).is_linearizable());
        // Within it: a second commit, or the key seen open, is a violation.
        let mut h = first.to_vec();
        h.push(timed(50, Some(60), run(3), Response::Fresh(3)));
        assert!(matches!(expiring(&h), Verdict::Violation { .. }));
        let mut h = first.to_vec();
        h.push(timed(50, Some(60), Call::Read, Response::ReadOpen));
        assert!(matches!(expiring(&h), Verdict::Violation { .. }));
        // Once seen expired, the old value never comes back.
        let mut h = first.to_vec();
        h.push(timed(150, Some(151), Call::Read, Response::ReadOpen));
        h.push(timed(160, Some(161), run(5), Response::Replayed(1)));
        assert!(matches!(expiring(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn an_unknown_commit_on_an_expiring_key_counts_from_its_call() {
        // Call 1's outcome is unknown; a replay of it at 120 is fine (it may have committed
        // late), and so is the key open again at 300.
        let h = [
            timed(0, None, run(1), Response::Unknown),
            timed(120, Some(121), run(2), Response::Replayed(1)),
            timed(300, Some(301), Call::Read, Response::ReadOpen),
        ];
        assert!(expiring(&h).is_linearizable());
    }
}
