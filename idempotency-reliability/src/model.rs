//! The sequential specification of one idempotency key, as a client sees it.
//!
//! A key is a *once-register*: it starts open, and the first execution whose completion
//! commits closes it with that execution's value, for good. Every later request replays that
//! value. While it is open, requests may run the work and fail (releasing the key), find
//! another attempt in progress, or lose their lease.
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
    /// `Outcome::Fresh(Ok(v))`: this call's execution committed `v`.
    Fresh(u64),
    /// `Outcome::Replayed(Ok(v))`: the key holds `v`.
    Replayed(u64),
    /// The work ran and failed (an error released the key, or it panicked): no effect.
    Released,
    /// `Error::InProgress`: another attempt held a live lease.
    InProgress,
    /// `Error::LeaseLost`: this call's completion was fenced; no effect.
    LeaseLost,
    /// A read found the record Completed with `v`.
    ReadCompleted(u64),
    /// A read found no Completed record (absent, Pending or Failed).
    ReadOpen,
    /// No answer (cancelled, timed out, a backend error): the call may or may not have taken
    /// effect, now or later.
    Unknown,
}

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
            (Call::Run { .. }, R::LeaseLost, _) => vec![*state],
            // Unknown: it may have committed its value (only onto an open key), or not.
            (Call::Run { value }, R::Unknown, None) => vec![None, Some(*value)],
            (Call::Run { .. }, R::Unknown, Some(_)) => vec![*state],
            (Call::Read, R::ReadCompleted(v), Some(held)) if v == held => vec![*state],
            (Call::Read, R::ReadOpen, None) => vec![None],
            (Call::Read, R::Unknown, _) => vec![*state],
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
}
