//! A linearizability checker in the style of Porcupine: the Wing & Gong search with Lowe's
//! memoization (a state is never explored twice with the same set of operations linearized).
//!
//! A history is a list of [`Operation`]s, each with its invocation and response times. An
//! operation whose response is unknown (the call was cancelled, the connection died) has no
//! response time: it may take effect at any moment after its invocation, or never, and the
//! [`Model`] says which states it may leave.
//!
//! The model may be nondeterministic: [`Model::step`] returns every state an operation may
//! leave, and the search tries each.

use std::collections::HashSet;
use std::fmt::Debug;
use std::hash::Hash;

/// A sequential specification.
pub trait Model {
    /// The object's state.
    type State: Clone + Eq + Hash + Debug;
    /// What a call asked for.
    type Input: Debug;
    /// What it answered.
    type Output: Debug;

    /// The state before any operation.
    fn init(&self) -> Self::State;

    /// Every state the operation may leave when applied to `state` and answering `output`;
    /// empty when that answer is impossible from `state`.
    fn step(
        &self,
        state: &Self::State,
        input: &Self::Input,
        output: &Self::Output,
    ) -> Vec<Self::State>;
}

/// One operation of a history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation<I, O> {
    /// When the call was made (any monotonic unit).
    pub call: u64,
    /// When its response arrived; `None` when it never did (the outcome is unknown).
    pub ret: Option<u64>,
    /// What was asked.
    pub input: I,
    /// What was answered.
    pub output: O,
}

/// The checker's verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Some order of the operations, consistent with real time, satisfies the model.
    Linearizable,
    /// None does. `deepest` is the longest sequence of operations (by index) the search could
    /// linearize, a starting point for reading the history.
    Violation {
        /// Operation indices, in the order they were linearized.
        deepest: Vec<usize>,
    },
    /// The search gave up after `steps` steps without a verdict.
    Undecided {
        /// Steps taken.
        steps: u64,
    },
}

impl Verdict {
    /// Whether the history was found linearizable.
    pub fn is_linearizable(&self) -> bool {
        matches!(self, Self::Linearizable)
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    time: u64,
    is_return: bool,
    op: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Bits(Vec<u64>);

impl Bits {
    fn new(n: usize) -> Self {
        Self(vec![0; n.div_ceil(64)])
    }
    fn get(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }
    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
    fn clear(&mut self, i: usize) {
        self.0[i / 64] &= !(1 << (i % 64));
    }
}

struct Frame<S> {
    op: usize,
    /// The entry index of the op's call, to resume the scan after it on backtrack.
    pos: usize,
    prev: S,
    /// The next candidate state of this op to try on backtrack.
    next_candidate: usize,
}

/// Checks `history` against `model`, giving up after `max_steps` search steps.
pub fn check<M: Model>(
    model: &M,
    history: &[Operation<M::Input, M::Output>],
    max_steps: u64,
) -> Verdict {
    let n = history.len();
    let mut entries: Vec<Entry> = Vec::with_capacity(2 * n);
    for (op, o) in history.iter().enumerate() {
        entries.push(Entry {
            time: o.call,
            is_return: false,
            op,
        });
        entries.push(Entry {
            time: o.ret.unwrap_or(u64::MAX),
            is_return: true,
            op,
        });
    }
    // At equal times calls come first: such operations overlap, the permissive reading.
    entries.sort_by_key(|e| (e.time, e.is_return, e.op));

    let mut linearized = Bits::new(n);
    let mut done = 0usize;
    let mut state = model.init();
    let mut cache: HashSet<(Bits, M::State)> = HashSet::new();
    let mut stack: Vec<Frame<M::State>> = Vec::new();
    let mut deepest: Vec<usize> = Vec::new();
    let mut pos = 0usize;
    let mut steps = 0u64;

    // Tries the candidates of `op` from `from`: returns the first whose (set, state) is new.
    let try_op = |op: usize,
                  from: usize,
                  state: &M::State,
                  linearized: &Bits,
                  cache: &mut HashSet<(Bits, M::State)>|
     -> Option<(usize, M::State)> {
        let o = &history[op];
        let candidates = model.step(state, &o.input, &o.output);
        for (i, next) in candidates.into_iter().enumerate().skip(from) {
            let mut bits = linearized.clone();
            bits.set(op);
            if cache.insert((bits, next.clone())) {
                return Some((i, next));
            }
        }
        None
    };

    loop {
        if done == n {
            return Verdict::Linearizable;
        }
        steps += 1;
        if steps > max_steps {
            return Verdict::Undecided { steps };
        }
        // The next entry of an operation not yet linearized.
        while pos < entries.len() && linearized.get(entries[pos].op) {
            pos += 1;
        }
        let entry = entries[pos];
        if !entry.is_return {
            match try_op(entry.op, 0, &state, &linearized, &mut cache) {
                Some((candidate, next)) => {
                    stack.push(Frame {
                        op: entry.op,
                        pos,
                        prev: std::mem::replace(&mut state, next),
                        next_candidate: candidate + 1,
                    });
                    linearized.set(entry.op);
                    done += 1;
                    if stack.len() > deepest.len() {
                        deepest = stack.iter().map(|f| f.op).collect();
                    }
                    pos = 0;
                }
                None => pos += 1,
            }
            continue;
        }
        // A response arrived for an operation not linearized yet: undo the last choice, and
        // try its next candidate or resume the scan after it.
        let Some(frame) = stack.pop() else {
            return Verdict::Violation { deepest };
        };
        linearized.clear(frame.op);
        done -= 1;
        state = frame.prev;
        match try_op(
            frame.op,
            frame.next_candidate,
            &state,
            &linearized,
            &mut cache,
        ) {
            Some((candidate, next)) => {
                stack.push(Frame {
                    op: frame.op,
                    pos: frame.pos,
                    prev: std::mem::replace(&mut state, next),
                    next_candidate: candidate + 1,
                });
                linearized.set(frame.op);
                done += 1;
                pos = 0;
            }
            None => pos = frame.pos + 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read/write register holding an integer, initially 0.
    struct Register;

    #[derive(Debug, Clone, Copy)]
    enum RegOp {
        Write(i32),
        Read,
    }

    impl Model for Register {
        type State = i32;
        type Input = RegOp;
        type Output = Option<i32>;
        fn init(&self) -> i32 {
            0
        }
        fn step(&self, state: &i32, input: &RegOp, output: &Option<i32>) -> Vec<i32> {
            match (input, output) {
                (RegOp::Write(v), _) => vec![*v],
                (RegOp::Read, Some(v)) if v == state => vec![*state],
                (RegOp::Read, None) => vec![*state], // unknown read
                (RegOp::Read, Some(_)) => vec![],
            }
        }
    }

    fn op(
        call: u64,
        ret: Option<u64>,
        input: RegOp,
        output: Option<i32>,
    ) -> Operation<RegOp, Option<i32>> {
        Operation {
            call,
            ret,
            input,
            output,
        }
    }

    #[test]
    fn empty_history_is_linearizable() {
        assert!(check(&Register, &[], 1000).is_linearizable());
    }

    #[test]
    fn concurrent_write_and_read_may_see_either_value() {
        // write(1) overlaps both reads: one sees 0, the next sees 1.
        let h = [
            op(0, Some(10), RegOp::Write(1), None),
            op(1, Some(2), RegOp::Read, Some(0)),
            op(3, Some(4), RegOp::Read, Some(1)),
        ];
        assert!(check(&Register, &h, 10_000).is_linearizable());
    }

    #[test]
    fn stale_read_after_a_completed_write_is_rejected() {
        // write(1) returned before the read began, yet the read saw 0.
        let h = [
            op(0, Some(1), RegOp::Write(1), None),
            op(2, Some(3), RegOp::Read, Some(0)),
        ];
        assert!(matches!(
            check(&Register, &h, 10_000),
            Verdict::Violation { .. }
        ));
    }

    #[test]
    fn reads_that_disagree_on_order_are_rejected() {
        // Two concurrent writes; one reader sees 1 then 2, the other 2 then 1: no single order.
        let h = [
            op(0, Some(100), RegOp::Write(1), None),
            op(0, Some(100), RegOp::Write(2), None),
            op(10, Some(11), RegOp::Read, Some(1)),
            op(20, Some(21), RegOp::Read, Some(2)),
            op(10, Some(11), RegOp::Read, Some(2)),
            op(20, Some(21), RegOp::Read, Some(1)),
        ];
        assert!(matches!(
            check(&Register, &h, 100_000),
            Verdict::Violation { .. }
        ));
        // Without the last read it is fine.
        assert!(check(&Register, &h[..5], 100_000).is_linearizable());
    }

    #[test]
    fn a_write_with_unknown_outcome_may_take_effect_late() {
        // The write's response never came; a read long after sees its value.
        let h = [
            op(0, None, RegOp::Write(7), None),
            op(50, Some(51), RegOp::Read, Some(0)),
            op(60, Some(61), RegOp::Read, Some(7)),
        ];
        assert!(check(&Register, &h, 10_000).is_linearizable());
        // But not before it was invoked.
        let h = [
            op(10, None, RegOp::Write(7), None),
            op(0, Some(5), RegOp::Read, Some(7)),
        ];
        assert!(matches!(
            check(&Register, &h, 10_000),
            Verdict::Violation { .. }
        ));
    }

    #[test]
    fn the_step_budget_is_reported() {
        let h: Vec<_> = (0..20)
            .map(|i| op(0, Some(100), RegOp::Write(i), None))
            .chain(std::iter::once(op(200, Some(201), RegOp::Read, Some(99))))
            .collect();
        assert!(matches!(
            check(&Register, &h, 50),
            Verdict::Undecided { .. }
        ));
    }

    #[test]
    fn a_long_linearizable_history_is_checked_quickly() {
        // 400 sequential writes each followed by a read of its value, with overlaps.
        let mut h = Vec::new();
        for i in 0..400u64 {
            let v = i32::try_from(i).unwrap();
            h.push(op(10 * i, Some(10 * i + 5), RegOp::Write(v), None));
            h.push(op(10 * i + 6, Some(10 * i + 12), RegOp::Read, Some(v)));
        }
        assert!(check(&Register, &h, 1_000_000).is_linearizable());
    }
}
