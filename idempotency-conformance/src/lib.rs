#![doc = include_str!("../README.md")]

pub mod cases;
mod flaky;
mod harness;
pub mod recovery;
pub mod reference;

pub use flaky::{Fault, FlakyOp, FlakyStore};
pub use harness::{
    process_clock, run_case, Capabilities, ServerClock, TestStore, TimeControl, REAL_SHORT_LEASE,
};

/// The name of every case, in the order the macro expands them.
///
/// Kept in one place: [`conformance_tests!`] and [`all_cases`] are both generated from the
/// list in [`__with_case_list!`].
pub fn case_names() -> Vec<&'static str> {
    all_cases().into_iter().map(|(name, _)| name).collect()
}

/// A boxed case, as [`all_cases`] lists them.
pub type CaseFn = fn(TestStore) -> futures::future::BoxFuture<'static, ()>;

/// Every case with its name, the capability-gated ones included, for running the suite by
/// hand (the kit's own self-test runs it against deliberately broken stores this way).
pub fn all_cases() -> Vec<(&'static str, CaseFn)> {
    let mut all = __with_case_list!((__list_cases), cases);
    all.push(__list_cases!(cases, purge_counts_deletions_in_batches).remove(0));
    all.push(__list_cases!(cases, deadlines_follow_the_store_clock).remove(0));
    all
}

/// Implementation detail of both kits (this one and the HTTP suite), the one case-list
/// mechanism: each kit keeps a single list of case names (`__with_case_list!` here) and
/// hands it to these two macros, which build its `all_cases()` and its `#[test]`s.
///
/// `__list_cases!(module, case, …)`: a `Vec<(&str, CaseFn)>` of the named cases.
#[doc(hidden)]
#[macro_export]
macro_rules! __list_cases {
    ($cases:path, $($case:ident),* $(,)?) => {{
        use $cases as __cases;
        let all: ::std::vec::Vec<(&'static str, $crate::CaseFn)> =
            ::std::vec![$((stringify!($case), |s| ::std::boxed::Box::pin(__cases::$case(s)))),*];
        all
    }};
}

/// Implementation detail of both kits: `__expand_cases!(module, factory, case, …)` is one
/// `#[test]` per named case, each on a fresh runtime with a fresh store from `factory`.
#[doc(hidden)]
#[macro_export]
macro_rules! __expand_cases {
    ($cases:path, $factory:path, $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                use $cases as __cases;
                $crate::run_case($factory, __cases::$case);
            }
        )*
    };
}

/// Calls `$callback!(case, case, …)` with every case name. The single list of cases.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_case_list {
    (($($callback:tt)*) $(, $arg:path)*) => {
        $($callback)*! { $($arg,)*
            claim_complete_replay,
            mismatch_leaves_record_unchanged,
            concurrent_claims_one_winner,
            concurrent_reclaims_of_failed_one_winner,
            lease_passed_one_taker_old_holder_fenced,
            stale_snapshot_reclaim_loses,
            live_pending_never_reclaimed,
            completed_record_is_final,
            fail_then_reclaim,
            extend_moves_lease,
            ttl_expiry,
            purge_removes_only_expired,
            scopes_are_independent,
            hits_are_counted,
            uncounted_claims_only_read,
            uncounted_replays_end_at_expiry,
            keys_and_scopes_round_trip,
            model_based_random_sequences,
            engine_concurrent_runs_execute_once,
            engine_panic_holds_key,
            engine_abandoned_work_holds_key_until_lease,
            engine_failed_completion_holds_key,
            engine_fenced_heartbeat_loses_completion,
            engine_wait_policy_takes_over_and_gives_up,
            engine_each_request_counts_one_hit,
            engine_permanent_failure_is_final,
            engine_hung_work_stops_being_extended,
            engine_error_not_stored,
            engine_long_failure_messages_are_bounded,
            engine_wait_policy_replays,
            engine_mismatch,
            engine_heartbeat_keeps_long_work_leased,
            tokens_grow_across_purge_and_expiry,
            concurrent_claims_of_expired_record_one_winner,
            settling_races_takers_after_lease,
            purge_races_fresh_claims,
            extreme_durations_and_tokens,
            long_keys_and_scopes_are_not_truncated,
            batch_claims_answer_as_single_claims,
            overlapping_batches_one_winner_per_key,
            batch_settlements_answer_as_single_settlements,
            engine_batch_runs_each_message_once,
            engine_concurrent_batches_run_each_message_once,
            engine_batch_settlement_failure_is_retried_alone,
            engine_batch_keeps_every_message_leased_until_settled,
            engine_batch_panics_never_abandon_other_messages,
        }
    };
}

/// Expands to one `#[test]` per conformance case, each running on a fresh tokio runtime with a
/// fresh store from `$factory`, an `async fn() -> TestStore`.
///
/// Cases that need an optional capability are gated here, at registration: declare what the
/// store lacks, and those cases are registered as ignored tests under their own names (shown
/// as not run), never as a weaker case that passes. Both flags default to `true`:
/// - `purge_reports_deletions = false`: the store's records expire by themselves and
///   `purge_expired` does not count deletions (Redis); skips
///   `purge_counts_deletions_in_batches`. Also set [`Capabilities::purge_reports_deletions`].
/// - `server_clock = false`: a real-time store whose clock the kit cannot read (no
///   [`TestStore::with_server_clock`]); skips `deadlines_follow_the_store_clock`.
///
/// ```
/// use idempotency_conformance::TestStore;
/// use idempotency_core::store::ManualClock;
/// use idempotency_memory::MemoryStore;
/// use std::sync::Arc;
///
/// // Builds one isolated store per case.
/// async fn factory() -> TestStore {
///     let clock = ManualClock::new();
///     TestStore::manual_time(Arc::new(MemoryStore::builder().clock(Arc::new(clock.clone())).build()), clock)
/// }
///
/// idempotency_conformance::conformance_tests!(factory);
/// // A store without those capabilities would say so:
/// // idempotency_conformance::conformance_tests!(factory, purge_reports_deletions = false, server_clock = false);
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($factory:path) => {
        $crate::conformance_tests!(
            $factory,
            purge_reports_deletions = true,
            server_clock = true
        );
    };
    ($factory:path, purge_reports_deletions = $purge:tt) => {
        $crate::conformance_tests!(
            $factory,
            purge_reports_deletions = $purge,
            server_clock = true
        );
    };
    ($factory:path, server_clock = $clock:tt) => {
        $crate::conformance_tests!(
            $factory,
            purge_reports_deletions = true,
            server_clock = $clock
        );
    };
    ($factory:path, purge_reports_deletions = $purge:tt, server_clock = $clock:tt) => {
        $crate::__with_case_list!(($crate::__expand_cases), $crate::cases, $factory);
        $crate::__idempotency_conformance_gated!(
            $purge,
            "purge_reports_deletions",
            $factory,
            purge_counts_deletions_in_batches
        );
        $crate::__idempotency_conformance_gated!(
            $clock,
            "server_clock",
            $factory,
            deadlines_follow_the_store_clock
        );
    };
}

/// Implementation detail of [`conformance_tests!`]: a case registered only when the store has
/// the capability, and ignored under its own name when it does not.
#[doc(hidden)]
#[macro_export]
macro_rules! __idempotency_conformance_gated {
    (true, $cap:literal, $factory:path, $case:ident) => {
        #[test]
        fn $case() {
            $crate::run_case($factory, $crate::cases::$case);
        }
    };
    (false, $cap:literal, $factory:path, $case:ident) => {
        #[test]
        #[ignore = concat!("not run: the store does not declare the capability ", $cap)]
        fn $case() {}
    };
}
