#![doc = include_str!("../README.md")]

pub mod cases;
pub mod server;
pub mod settled;

pub use idempotency_conformance::{__expand_cases, run_case, TestStore};

/// Calls `$callback!(case, case, …)` with every case name. The single list of cases.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_http_case_list {
    (($($callback:tt)*) $(, $arg:path)*) => {
        $($callback)*! { $($arg,)*
            first_request_runs_then_replays,
            replay_omits_credentials_cookies_and_unlisted_headers,
            quoted_and_bare_keys_are_one_key,
            in_flight_duplicate_gets_409_with_retry_after,
            in_flight_wait_policy_replays,
            different_request_gets_422,
            json_key_order_is_the_same_request,
            missing_key_passes_through_or_400_when_required,
            malformed_keys_get_400,
            oversized_body_gets_413,
            uncovered_methods_pass_through,
            server_errors_408_429_release_the_key,
            answers_of_every_status_are_replayed_after_the_lease,
            unstored_statuses_settle_or_hold_the_key,
            handler_cut_off_by_an_inner_timeout_runs_once,
            handler_that_did_nothing_frees_the_key,
            small_streams_are_stored_oversized_responses_run_once,
            unreplayable_responses_are_recorded_or_released,
            handler_panic_settles_the_key,
            store_outage_fails_closed_or_open,
            concurrent_duplicates_run_once,
            scopes_isolate_callers,
            refusals_are_pluggable,
            corrupt_stored_response_is_500,
            client_timeout_then_retry_gets_the_same_response,
            released_key_accepts_corrected_request,
            handler_outliving_its_lease_runs_once,
            failed_completion_does_not_rerun_handler,
            preconditions_are_part_of_the_request,
            equivalent_media_types_are_one_request,
            structured_field_key_parameters_are_read,
            unidentified_caller_gets_a_challenge,
            retry_after_is_capped_recomputed_and_sent_on_503,
            lost_lease_is_its_own_outcome,
            key_header_validator_and_replay_marker_are_configurable,
            response_hook_sees_fresh_and_replayed,
            fingerprint_hook_selects_what_is_hashed,
            handler_settled_key_is_not_written_again,
            handler_5xx_after_its_commit_is_replayed_not_rerun,
            handler_whose_lease_was_lost_gets_409_and_no_effect,
            handler_rolled_back_frees_the_key,
            heartbeat_stops_when_the_handler_settled_the_key,
        }
    };
}

/// A boxed case, as [`all_cases`] lists them.
pub use idempotency_conformance::CaseFn;

/// Every case with its name, for running the suite by hand.
pub fn all_cases() -> Vec<(&'static str, CaseFn)> {
    __with_http_case_list!((idempotency_conformance::__list_cases), cases)
}

/// Expands to one `#[test]` per HTTP case, each on a fresh tokio runtime with a fresh store
/// from `$factory` (an `async fn() -> idempotency_conformance::TestStore`, the same factory a
/// backend gives the store conformance kit).
///
/// ```no_run
/// use idempotency_conformance::TestStore;
/// use idempotency_memory::MemoryStore;
/// use std::sync::Arc;
///
/// // Builds one isolated store per case.
/// async fn factory() -> TestStore {
///     TestStore::real_time(Arc::new(MemoryStore::new()))
/// }
///
/// idempotency_http_conformance::http_conformance_tests!(factory);
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! http_conformance_tests {
    ($factory:path) => {
        $crate::__with_http_case_list!(($crate::__expand_cases), $crate::cases, $factory);
    };
}
