//! The phases model: the design of multi-step operations holds every rule in every
//! interleaving of its world, and each deliberately broken version is caught with a
//! counterexample.

use idempotency_model_check::phases::{
    check_phases, PhaseReport, PhaseVariant, ABANDONED_OPERATIONS_FINISH, COMPLETER_FINISHES_ONE,
    FINISHES_AFTER_A_RESUME, FOREIGN_CALLS_ONE_KEY, FOREIGN_EFFECT_ONCE, PHASE_COMMITS_ONCE,
};

const RULES: [&str; 4] = [
    PHASE_COMMITS_ONCE,
    FOREIGN_CALLS_ONE_KEY,
    FOREIGN_EFFECT_ONCE,
    ABANDONED_OPERATIONS_FINISH,
];

fn report(r: &PhaseReport) {
    eprintln!(
        "{:?}: {} unique states, depth {}, in {:.2?}",
        r.variant, r.unique_states, r.max_depth, r.elapsed
    );
}

#[test]
fn the_design_holds_every_rule() {
    let r = check_phases(PhaseVariant::Correct, None);
    report(&r);
    for rule in RULES {
        if let Some(trace) = r.discovery(rule) {
            panic!("the design breaks \"{rule}\":\n{trace}");
        }
    }
    // Not vacuous: operations resume mid-way, and the completer finishes abandoned ones.
    for example in [FINISHES_AFTER_A_RESUME, COMPLETER_FINISHES_ONE] {
        assert!(
            r.discovery(example).is_some(),
            "no example of \"{example}\""
        );
    }
}

/// `variant` breaks `rule` (with a counterexample), and no other rule is needed to see it.
fn caught(variant: PhaseVariant, rule: &'static str) {
    let r = check_phases(variant, Some(rule));
    report(&r);
    let trace = r
        .discovery(rule)
        .unwrap_or_else(|| panic!("{variant:?} was not caught by \"{rule}\""));
    eprintln!("counterexample to \"{rule}\":\n{trace}");
}

#[test]
fn a_recovery_point_committed_apart_from_its_writes_runs_a_phase_twice() {
    caught(PhaseVariant::RecoveryPointApart, PHASE_COMMITS_ONCE);
}

#[test]
fn a_completer_that_ignores_the_token_runs_a_phase_twice() {
    caught(PhaseVariant::CompleterIgnoresToken, PHASE_COMMITS_ONCE);
}

#[test]
fn a_foreign_key_per_holder_makes_the_foreign_service_act_twice() {
    caught(PhaseVariant::ForeignKeyPerHolder, FOREIGN_CALLS_ONE_KEY);
    caught(PhaseVariant::ForeignKeyPerHolder, FOREIGN_EFFECT_ONCE);
}

#[test]
fn without_a_completer_an_abandoned_operation_stays_unfinished() {
    caught(PhaseVariant::NoCompleter, ABANDONED_OPERATIONS_FINISH);
}
