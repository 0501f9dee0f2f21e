//! The exhaustive check: the protocol as built holds every property in every interleaving of
//! its world, and each deliberately broken variant is caught with a counterexample.

use idempotency_model_check::{
    check, Mode, Report, Variant, World, COMPLETED_IS_FINAL, EFFECT_ONCE_PER_LEASE,
    EFFECT_ONCE_PER_RECORD, EVENTUALLY_CLAIMABLE, ONLY_CURRENT_HOLDER_WRITES,
    REACHES_COMPLETION_AFTER_RECLAIM, REPLAY_IS_THE_COMPLETED_OUTCOME,
};

fn safety_properties(mode: Mode) -> Vec<&'static str> {
    let mut all = vec![
        ONLY_CURRENT_HOLDER_WRITES,
        COMPLETED_IS_FINAL,
        REPLAY_IS_THE_COMPLETED_OUTCOME,
        EFFECT_ONCE_PER_LEASE,
        EVENTUALLY_CLAIMABLE,
    ];
    if mode == Mode::Transactional {
        all.push(EFFECT_ONCE_PER_RECORD);
    }
    all
}

/// Explores the whole world and asserts that no property has a counterexample, and that the
/// world reaches a completion after a reclaim (so the properties are not vacuous).
fn holds(world: World) -> Report {
    let mode = world.mode;
    let report = check(world, None);
    eprintln!("{report}");
    assert!(report.complete, "the check stopped early: {report}");
    for property in safety_properties(mode) {
        if let Some(trace) = report.discovery(property) {
            panic!("the protocol violates \"{property}\" ({report}):\n{trace}");
        }
    }
    assert!(
        report.discovery(REACHES_COMPLETION_AFTER_RECLAIM).is_some(),
        "the world never completes a record after a reclaim: it is too small to mean much"
    );
    report
}

#[test]
fn the_protocol_holds_in_plain_mode() {
    holds(World::from_env(Mode::Plain));
}

#[test]
fn the_protocol_holds_in_transactional_mode() {
    holds(World::from_env(Mode::Transactional));
}

#[test]
fn the_protocol_holds_for_two_keys() {
    for mode in [Mode::Plain, Mode::Transactional] {
        holds(World::two_keys(mode));
    }
}

/// Checks `variant` in every mode it applies to, and asserts that the property it targets
/// has a counterexample, printing it.
fn caught(variant: Variant) {
    let property = variant.violates().expect("a broken variant");
    assert!(safety_properties(Mode::Transactional).contains(&property));
    for &mode in variant.modes() {
        let report = check(World::standard(mode).with_variant(variant), Some(property));
        eprintln!("{report}");
        match report.discovery(property) {
            Some(trace) => eprintln!(
                "counterexample to \"{property}\" in {mode:?} mode with {variant:?}:\n{trace}"
            ),
            None => panic!(
                "{variant:?} in {mode:?} mode breaks the protocol, but the check found no \
                 counterexample to \"{property}\" ({report})"
            ),
        }
    }
}

#[test]
fn a_token_that_restarts_after_purge_is_caught() {
    caught(Variant::TokenRestartsAfterPurge);
}

#[test]
fn a_read_then_write_complete_is_caught() {
    caught(Variant::ReadThenWriteComplete);
}

#[test]
fn a_reclaim_without_the_expected_token_check_is_caught() {
    caught(Variant::ReclaimWithoutExpectedToken);
}

#[test]
fn a_reclaim_that_keeps_the_old_fingerprint_is_caught() {
    caught(Variant::ReclaimKeepsFingerprint);
}

#[test]
fn a_reclaim_that_takes_over_a_permanent_failure_is_caught() {
    caught(Variant::ReclaimTakesPermanentFailure);
}

#[test]
fn a_completion_failure_that_releases_the_key_is_caught() {
    caught(Variant::ReleaseOnCompletionError);
}

#[test]
fn a_commit_despite_a_fenced_completion_is_caught() {
    caught(Variant::CommitDespiteFence);
}

#[test]
fn a_heartbeat_without_a_maximum_work_time_is_caught() {
    caught(Variant::UnboundedHeartbeat);
}

/// Every broken variant targets a property checked in its modes, and every property is the
/// target of some broken variant (each check is shown to bite).
#[test]
fn every_broken_variant_targets_a_checked_property() {
    for variant in Variant::BROKEN {
        let property = variant.violates().expect("a broken variant");
        for &mode in variant.modes() {
            assert!(
                safety_properties(mode).contains(&property),
                "{variant:?} targets \"{property}\", which is not checked in {mode:?} mode"
            );
        }
    }
    for property in safety_properties(Mode::Transactional) {
        assert!(
            Variant::BROKEN
                .iter()
                .any(|v| v.violates() == Some(property)),
            "no broken variant shows that \"{property}\" bites"
        );
    }
    assert_eq!(Variant::Real.violates(), None);
}
