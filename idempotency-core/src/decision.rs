//! The state machine's decision, as a pure function.

use crate::{FencingToken, Fingerprint, Record, RecordStatus, Timestamp};
use std::time::Duration;

/// What to do about a request, given the record found for its key.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Decision {
    /// No live record: claim the key and run the work.
    Claim,
    /// Completed with the same fingerprint: replay the stored outcome; the work does not run.
    Replay,
    /// Another attempt holds a live lease; retry after the given time.
    InProgress {
        /// Time until that lease passes (zero when it is passing right now).
        retry_after: Duration,
    },
    /// The key was used with a different fingerprint: refuse.
    KeyReused,
    /// The record is Failed, or Pending with a passed lease: reclaim it by a CAS on `expected`.
    Reclaim {
        /// The token read, to compare-and-swap against.
        expected: FencingToken,
    },
    /// The last attempt with this fingerprint failed permanently ([`crate::Failure`] with
    /// `retryable = false`): the same request would fail the same way, or its work may have
    /// acted without a storable outcome, so it is not run again while the record lives. A
    /// request with another fingerprint (a corrected one) may still reclaim the key when
    /// [`DecisionOptions::reclaim_failed_with_different_fingerprint`] allows it, unless the
    /// failure stands in for an outcome that could not be stored
    /// ([`crate::Failure::outcome_not_stored`]): that is a [`Decision::KeyReused`], as against
    /// a stored outcome.
    FailedPermanently,
}

/// Options of the decision that come from the engine's policy.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct DecisionOptions {
    /// Whether a `Failed` record may be reclaimed by a request with a different fingerprint.
    /// A failed work took no effect, so a corrected retry may run (default `true`). Never the
    /// failure that stands in for a work's lost outcome ([`crate::Failure::outcome_not_stored`]).
    pub reclaim_failed_with_different_fingerprint: bool,
}

impl DecisionOptions {
    /// The options, with whether a `Failed` record may be reclaimed by a request with a
    /// different fingerprint.
    pub fn new(reclaim_failed_with_different_fingerprint: bool) -> Self {
        Self {
            reclaim_failed_with_different_fingerprint,
        }
    }
}

impl Default for DecisionOptions {
    fn default() -> Self {
        Self {
            reclaim_failed_with_different_fingerprint: true,
        }
    }
}

/// Decides what a request with `fingerprint` gets, given the `record` found for its key (if
/// any) and the store's clock `now`.
///
/// ```
/// use idempotency_core::Fingerprint;
/// use idempotency_core::store::{decide, Decision, DecisionOptions, Timestamp};
///
/// let fp = Fingerprint::from_bytes(b"body");
/// assert_eq!(decide(None, &fp, Timestamp::now(), DecisionOptions::default()), Decision::Claim);
/// ```
pub fn decide(
    record: Option<&Record>,
    fingerprint: &Fingerprint,
    now: Timestamp,
    options: DecisionOptions,
) -> Decision {
    let Some(record) = record else {
        return Decision::Claim;
    };
    if record.is_expired(now) {
        return Decision::Claim;
    }
    let same = record.fingerprint == *fingerprint;
    match record.status {
        RecordStatus::Completed if same => Decision::Replay,
        RecordStatus::Completed => Decision::KeyReused,
        RecordStatus::Pending if !same => Decision::KeyReused,
        RecordStatus::Pending => match record.lease_until {
            Some(until) if until > now => Decision::InProgress {
                retry_after: until.saturating_duration_since(now),
            },
            _ => Decision::Reclaim {
                expected: record.token,
            },
        },
        // The work ran and its outcome was lost: final, as a stored outcome is.
        RecordStatus::Failed if outcome_not_stored(record) => {
            if same {
                Decision::FailedPermanently
            } else {
                Decision::KeyReused
            }
        }
        RecordStatus::Failed if same && is_permanent(record) => Decision::FailedPermanently,
        RecordStatus::Failed if same || options.reclaim_failed_with_different_fingerprint => {
            Decision::Reclaim {
                expected: record.token,
            }
        }
        RecordStatus::Failed => Decision::KeyReused,
    }
}

/// Whether a Failed record's failure says that retrying the same request is pointless.
fn is_permanent(record: &Record) -> bool {
    record.failure.as_ref().is_some_and(|f| !f.retryable)
}

/// Whether a Failed record stands in for an outcome that could not be stored
/// ([`crate::Failure::outcome_not_stored`]).
fn outcome_not_stored(record: &Record) -> bool {
    record
        .failure
        .as_ref()
        .is_some_and(crate::Failure::is_outcome_not_stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The failure that stands in for an outcome the store could not keep is final like a
    /// stored outcome: the same request is told it failed for good, another payload is a
    /// mismatch even where a corrected request may take over other failures.
    #[test]
    fn an_outcome_not_stored_is_final_for_every_payload() {
        let fp = Fingerprint::from_bytes(b"a");
        let other = Fingerprint::from_bytes(b"b");
        let now = Timestamp::from_millis(1_000);
        let mut r = record(
            RecordStatus::Failed,
            fp,
            None,
            Timestamp::from_millis(60_000),
        );
        r.failure = Some(Failure::outcome_not_stored("too large"));
        let allow = DecisionOptions::new(true);
        assert_eq!(
            decide(Some(&r), &fp, now, allow),
            Decision::FailedPermanently
        );
        assert_eq!(decide(Some(&r), &other, now, allow), Decision::KeyReused);
        // Any other permanent failure: a corrected request takes it over.
        r.failure = Some(Failure::permanent("card declined"));
        assert!(matches!(
            decide(Some(&r), &other, now, allow),
            Decision::Reclaim { .. }
        ));
    }
    use crate::{Failure, IdempotencyKey, RecordId, Scope};

    fn record(
        status: RecordStatus,
        fp: Fingerprint,
        lease_until: Option<Timestamp>,
        expires_at: Timestamp,
    ) -> Record {
        record_with_failure(status, fp, lease_until, expires_at, true)
    }

    fn record_with_failure(
        status: RecordStatus,
        fp: Fingerprint,
        lease_until: Option<Timestamp>,
        expires_at: Timestamp,
        retryable: bool,
    ) -> Record {
        Record {
            id: RecordId::new(IdempotencyKey::new("k").unwrap(), Scope::new("s").unwrap()),
            fingerprint: fp,
            status,
            token: FencingToken(7),
            lease_until,
            outcome: (status == RecordStatus::Completed).then(Vec::new),
            attempts: 1,
            failure: (status == RecordStatus::Failed).then(|| Failure {
                retryable,
                message: "m".into(),
            }),
            hits: 0,
            created_at: Timestamp::from_millis(0),
            updated_at: Timestamp::from_millis(0),
            expires_at,
        }
    }

    /// Every status × same/different fingerprint × lease live/passed × expired or not ×
    /// both settings of the failed-reclaim option × retryable or permanent failure, against
    /// the state machine's table.
    #[test]
    fn exhaustive_table() {
        let now = Timestamp::from_millis(10_000);
        let fp = Fingerprint::from_bytes(b"a");
        let other = Fingerprint::from_bytes(b"b");
        let mut cases = 0;
        for status in [
            RecordStatus::Pending,
            RecordStatus::Completed,
            RecordStatus::Failed,
        ] {
            for same in [true, false] {
                for lease_live in [true, false] {
                    for expired in [true, false] {
                        for (reclaim_other, retryable) in
                            [(true, true), (true, false), (false, true), (false, false)]
                        {
                            cases += 1;
                            let lease_until = match status {
                                RecordStatus::Pending if lease_live => {
                                    Some(Timestamp::from_millis(12_500))
                                }
                                RecordStatus::Pending => Some(Timestamp::from_millis(10_000)),
                                // Settled records have no lease; "live" then means nothing.
                                _ => None,
                            };
                            let expires_at =
                                Timestamp::from_millis(if expired { 10_000 } else { 60_000 });
                            let r = record_with_failure(
                                status,
                                if same { fp } else { other },
                                lease_until,
                                expires_at,
                                retryable,
                            );
                            let opts = DecisionOptions {
                                reclaim_failed_with_different_fingerprint: reclaim_other,
                            };
                            let got = decide(Some(&r), &fp, now, opts);
                            let want = if expired {
                                Decision::Claim
                            } else {
                                match (status, same) {
                                    (RecordStatus::Completed, true) => Decision::Replay,
                                    (RecordStatus::Completed, false) => Decision::KeyReused,
                                    (RecordStatus::Pending, false) => Decision::KeyReused,
                                    (RecordStatus::Pending, true) if lease_live => {
                                        Decision::InProgress {
                                            retry_after: Duration::from_millis(2_500),
                                        }
                                    }
                                    (RecordStatus::Pending, true) => Decision::Reclaim {
                                        expected: FencingToken(7),
                                    },
                                    (RecordStatus::Failed, true) if !retryable => {
                                        Decision::FailedPermanently
                                    }
                                    (RecordStatus::Failed, true) => Decision::Reclaim {
                                        expected: FencingToken(7),
                                    },
                                    (RecordStatus::Failed, false) if reclaim_other => {
                                        Decision::Reclaim {
                                            expected: FencingToken(7),
                                        }
                                    }
                                    (RecordStatus::Failed, false) => Decision::KeyReused,
                                }
                            };
                            assert_eq!(got, want, "{status:?} same={same} lease_live={lease_live} expired={expired} reclaim_other={reclaim_other} retryable={retryable}");
                        }
                    }
                }
            }
        }
        assert_eq!(cases, 96);
        assert_eq!(
            decide(None, &fp, now, DecisionOptions::default()),
            Decision::Claim
        );
    }

    #[test]
    fn pending_without_lease_is_reclaimable() {
        let fp = Fingerprint::from_bytes(b"a");
        let r = record(
            RecordStatus::Pending,
            fp,
            None,
            Timestamp::from_millis(99_999),
        );
        assert_eq!(
            decide(
                Some(&r),
                &fp,
                Timestamp::from_millis(1),
                DecisionOptions::default()
            ),
            Decision::Reclaim {
                expected: FencingToken(7)
            }
        );
    }
}
