use super::*;
use idempotency_core::{IdempotencyKey, Scope};

const MS: u64 = 1_000_000;
const LEASE: Duration = Duration::from_millis(300);
const EPS: u64 = 5 * MS;

fn id() -> RecordId {
    RecordId::new(
        IdempotencyKey::new("k").expect("key"),
        Scope::new("s").expect("scope"),
    )
}

fn op(kind: OpKind, token: u64, at_ms: u64, applied: Applied, duration: Duration) -> StoreOp {
    StoreOp {
        id: id(),
        kind,
        token,
        invoked: at_ms * MS,
        returned: at_ms * MS + MS,
        applied,
        duration,
    }
}

fn exec(token: u64, value: u64, from_ms: u64, to_ms: u64, end: ExecEnd) -> Execution {
    Execution {
        id: id(),
        token,
        value,
        started: from_ms * MS,
        ended: to_ms * MS,
        end,
        long: false,
    }
}

fn run(ops: &[StoreOp], execs: &[Execution], seen: &[SeenCompleted]) -> Findings {
    check(ops, execs, seen, &HashMap::new(), EPS)
}

fn short(ttl: Duration) -> HashMap<RecordId, Duration> {
    HashMap::from([(id(), ttl)])
}

fn clean(f: &Findings) -> bool {
    f.violations.is_empty() && f.double_effects.is_empty()
}

#[test]
fn outcome_unknown_then_a_takeover_after_the_lease_is_allowed() {
    // Call 1 acted; its completion failed through every try (nothing applied), so the key
    // stayed Pending; call 2 took it over once the lease had passed and completed.
    let ops = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(
            OpKind::Complete,
            10,
            5,
            Applied::Unknown,
            Duration::from_secs(3600),
        ),
        op(OpKind::Reclaim, 11, 301, Applied::Yes, LEASE),
        op(
            OpKind::Complete,
            11,
            310,
            Applied::Yes,
            Duration::from_secs(3600),
        ),
    ];
    let execs = [
        exec(10, 1, 1, 4, ExecEnd::Ok),
        exec(11, 2, 302, 309, ExecEnd::Ok),
    ];
    assert!(clean(&run(&ops, &execs, &[])));
}

#[test]
fn a_second_execution_under_a_live_lease_is_a_double_effect() {
    // The broken engine of old: call 1 acted, its completion failed, and the key was
    // released at once, so call 2 ran while call 1's lease still lived.
    let ops = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(
            OpKind::Complete,
            10,
            5,
            Applied::Unknown,
            Duration::from_secs(3600),
        ),
        op(OpKind::Fail, 10, 6, Applied::Yes, Duration::from_secs(3600)),
        op(OpKind::Reclaim, 11, 20, Applied::Yes, LEASE),
        op(
            OpKind::Complete,
            11,
            30,
            Applied::Yes,
            Duration::from_secs(3600),
        ),
    ];
    let execs = [
        exec(10, 1, 1, 4, ExecEnd::Ok),
        exec(11, 2, 21, 29, ExecEnd::Ok),
    ];
    let f = run(&ops, &execs, &[]);
    assert_eq!(f.double_effects.len(), 1, "{f:?}");
    // And the release itself is reported.
    assert!(
        f.violations.iter().any(|v| v.contains("released token 10")),
        "{f:?}"
    );
}

#[test]
fn a_permanent_failure_after_the_work_acted_closes_the_key() {
    // Call 1 acted and its completion failed through every try; the engine recorded a
    // permanent failure in the outcome's place. That is no release: the key is closed for
    // the record's retention, so a second execution within it is a double effect.
    let ops = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(
            OpKind::Complete,
            10,
            5,
            Applied::Unknown,
            Duration::from_secs(3600),
        ),
        op(
            OpKind::FailPermanently,
            10,
            6,
            Applied::Yes,
            Duration::from_secs(3600),
        ),
    ];
    let f = run(&ops, &[exec(10, 1, 1, 4, ExecEnd::Ok)], &[]);
    assert!(f.violations.is_empty(), "{f:?}");
    assert!(f.double_effects.is_empty(), "{f:?}");
    let mut reran = ops.to_vec();
    reran.push(op(OpKind::Reclaim, 11, 20_000, Applied::Yes, LEASE));
    let execs = [
        exec(10, 1, 1, 4, ExecEnd::Ok),
        exec(11, 2, 20_001, 20_010, ExecEnd::Ok),
    ];
    let f = run(&reran, &execs, &[]);
    assert_eq!(f.double_effects.len(), 1, "{f:?}");
}

#[test]
fn a_dropped_execution_holds_its_key_for_the_lease() {
    let ops = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(OpKind::Reclaim, 11, 100, Applied::Yes, LEASE),
    ];
    let execs = [
        exec(10, 1, 1, 50, ExecEnd::Dropped),
        exec(11, 2, 101, 120, ExecEnd::Ok),
    ];
    assert_eq!(run(&ops, &execs, &[]).double_effects.len(), 1);
    // An execution that failed released the key: a retry at once is fine.
    let execs = [
        exec(10, 1, 1, 50, ExecEnd::Err),
        exec(11, 2, 101, 120, ExecEnd::Ok),
    ];
    let ops_released = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(
            OpKind::Fail,
            10,
            51,
            Applied::Yes,
            Duration::from_secs(3600),
        ),
        op(OpKind::Reclaim, 11, 100, Applied::Yes, LEASE),
    ];
    assert!(clean(&run(&ops_released, &execs, &[])));
}

#[test]
fn heartbeats_extend_what_a_holder_holds() {
    // A long work extended its lease at 100 and 200 ms: held until 500 ms. A takeover at
    // 400 ms is a double effect; one at 510 ms is not.
    let base = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(OpKind::Extend, 10, 100, Applied::Yes, LEASE),
        op(OpKind::Extend, 10, 200, Applied::Yes, LEASE),
    ];
    for (at, doubled) in [(400, true), (510, false)] {
        let mut ops = base.to_vec();
        ops.push(op(OpKind::Reclaim, 11, at, Applied::Yes, LEASE));
        let execs = [
            exec(10, 1, 1, 600, ExecEnd::Ok),
            exec(11, 2, at + 1, at + 5, ExecEnd::Ok),
        ];
        let f = run(&ops, &execs, &[]);
        assert_eq!(!f.double_effects.is_empty(), doubled, "{at}: {f:?}");
    }
}

#[test]
fn a_completed_record_is_held_for_its_retention() {
    let ttl = Duration::from_millis(100);
    let ops = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(OpKind::Complete, 10, 10, Applied::Yes, ttl),
        // Purged and claimed again too early: 50 ms after the completion.
        op(OpKind::Claim, 5_000, 60, Applied::Yes, LEASE),
        op(OpKind::Complete, 5_000, 70, Applied::Yes, ttl),
    ];
    let execs = [
        exec(10, 1, 1, 9, ExecEnd::Ok),
        exec(5_000, 2, 61, 69, ExecEnd::Ok),
    ];
    let expiring = short(ttl);
    let f = check(&ops, &execs, &[], &expiring, EPS);
    assert_eq!(f.double_effects.len(), 1, "{f:?}");
    // After the retention it is a new life of the key.
    let mut ops = ops.to_vec();
    ops[2].invoked = 120 * MS;
    ops[2].returned = 121 * MS;
    ops[3].invoked = 130 * MS;
    let execs = [
        exec(10, 1, 1, 9, ExecEnd::Ok),
        exec(5_000, 2, 122, 129, ExecEnd::Ok),
    ];
    let f = check(&ops, &execs, &[], &expiring, EPS);
    assert!(clean(&f), "{f:?}");
    assert_eq!(f.claims_after_expiry, 1);
    // On a record that never expires, two applied completions are a double effect.
    let f = run(&ops, &execs, &[]);
    assert_eq!(f.double_effects.len(), 1, "{f:?}");
}

#[test]
fn a_stale_holder_that_completes_a_newer_record_is_caught() {
    let ops = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(OpKind::Claim, 400_000, 320, Applied::Yes, LEASE),
        // The stalled holder of token 10 completes after the record was replaced.
        op(
            OpKind::Complete,
            10,
            400,
            Applied::Yes,
            Duration::from_millis(100),
        ),
    ];
    let execs = [
        exec(10, 1, 1, 399, ExecEnd::Ok),
        exec(400_000, 2, 321, 330, ExecEnd::Err),
    ];
    let seen = [SeenCompleted {
        id: id(),
        value: 1,
        token: 400_000,
    }];
    let f = run(&ops, &execs, &seen);
    assert!(
        f.violations
            .iter()
            .any(|v| v.contains("Complete of token 10 applied after token 400000")),
        "{f:?}"
    );
    assert!(
        f.violations
            .iter()
            .any(|v| v.contains("under token 400000")),
        "{f:?}"
    );
    // Fenced, it is counted and fine.
    let mut ops = ops.to_vec();
    ops[2].applied = Applied::No;
    let f = run(&ops, &execs, &[]);
    assert!(clean(&f), "{f:?}");
    assert_eq!(f.stale_writes_fenced, 1);
}

#[test]
fn repeated_or_shrinking_tokens_are_caught() {
    let ops = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(OpKind::Claim, 10, 400, Applied::Yes, LEASE),
    ];
    let f = run(&ops, &[], &[]);
    assert!(
        f.violations.iter().any(|v| v.contains("granted twice")),
        "{f:?}"
    );
    let ops = [
        op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
        op(OpKind::Claim, 9, 400, Applied::Yes, LEASE),
    ];
    let f = run(&ops, &[], &[]);
    assert!(
        f.violations.iter().any(|v| v.contains("is not greater")),
        "{f:?}"
    );
}

#[test]
fn an_execution_with_a_token_never_granted_is_caught() {
    let f = run(&[], &[exec(7, 1, 0, 1, ExecEnd::Ok)], &[]);
    assert!(
        f.violations.iter().any(|v| v.contains("never granted")),
        "{f:?}"
    );
}

#[test]
fn an_unseen_completion_may_end_the_hold_early_on_a_short_retention() {
    // Call 1's work ended at 10 ms and its completion was never answered (the call was
    // dropped while it was in flight): it may have applied, and with a 100 ms retention
    // its record may be gone from 110 ms although the lease ran to 300 ms.
    let ttl = Duration::from_millis(100);
    for (at, doubled) in [(150, false), (80, true)] {
        let ops = [
            op(OpKind::Claim, 10, 0, Applied::Yes, LEASE),
            op(OpKind::Claim, 5_000, at, Applied::Yes, LEASE),
        ];
        let execs = [
            exec(10, 1, 1, 10, ExecEnd::Ok),
            exec(5_000, 2, at + 1, at + 5, ExecEnd::Ok),
        ];
        let f = check(&ops, &execs, &[], &short(ttl), EPS);
        assert_eq!(!f.double_effects.is_empty(), doubled, "{at}: {f:?}");
        // A record kept for long holds for the whole lease.
        assert_eq!(run(&ops, &execs, &[]).double_effects.len(), 1, "{at}");
    }
}
