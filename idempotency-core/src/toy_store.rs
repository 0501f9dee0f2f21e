use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use idempotency_core::store::{async_trait, Cas, Claim, ClaimRequest, Failure, Reclaim, Record, RecordStatus, Timestamp};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Every record in one map behind one mutex; time from the process clock. Each method takes
/// the lock once, so each is one atomic step, as the contract asks (a database store makes
/// each one statement, or one script, instead).
#[derive(Debug, Default)]
pub struct ToyStore {
    records: Mutex<HashMap<RecordId, Record>>,
}

impl ToyStore {
    /// Runs `step` under the lock with the store's `now`.
    fn atomically<R>(
        &self,
        step: impl FnOnce(&mut HashMap<RecordId, Record>, Timestamp) -> R,
    ) -> R {
        // A panic while the lock was held left no half-written record (every step writes
        // a record whole), so a poisoned lock is still good.
        let mut records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        step(&mut records, Timestamp::now())
    }

    /// The compare-and-swap that `complete`, `fail` and `extend` share: it applies only to
    /// the live, Pending record that holds `token`.
    fn settle(
        &self,
        id: &RecordId,
        token: FencingToken,
        change: impl FnOnce(&mut Record, Timestamp),
    ) -> Cas {
        self.atomically(|records, now| match records.get_mut(id) {
            Some(r)
                if !r.is_expired(now) && r.status == RecordStatus::Pending && r.token == token =>
            {
                change(r, now);
                r.updated_at = now;
                Cas::Applied
            }
            _ => Cas::Fenced,
        })
    }
}

#[async_trait]
impl IdempotencyStore for ToyStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        Ok(self.atomically(|records, now| {
            let replaced = match records.get_mut(&request.id) {
                // A live record is observed, never overwritten; its hit counted if asked.
                Some(r) if !r.is_expired(now) => {
                    if request.count_hit {
                        r.hits = r.hits.saturating_add(1);
                    }
                    return Claim::Existing {
                        record: r.clone(),
                        now,
                    };
                }
                Some(expired) => Some(expired.token),
                None => None,
            };
            // From the clock (and above the record it replaces), so that a key whose record
            // was purged never hands out a token an old holder may still have.
            let token = FencingToken::fresh(now, replaced);
            let lease_until = now.saturating_add(request.lease);
            let record = Record {
                id: request.id.clone(),
                fingerprint: request.fingerprint,
                status: RecordStatus::Pending,
                token,
                lease_until: Some(lease_until),
                outcome: None,
                attempts: 1,
                failure: None,
                hits: 0,
                created_at: now,
                updated_at: now,
                expires_at: request.expires_at(now),
            };
            records.insert(request.id.clone(), record);
            Claim::Claimed { token, lease_until }
        }))
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        Ok(self.settle(id, token, |r, now| {
            r.status = RecordStatus::Completed;
            r.outcome = Some(outcome.to_vec());
            r.lease_until = None;
            r.failure = None;
            r.expires_at = now.saturating_add(ttl);
        }))
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        Ok(self.settle(id, token, |r, now| {
            r.status = RecordStatus::Failed;
            r.failure = Some(failure.clone());
            r.lease_until = None;
            r.expires_at = now.saturating_add(ttl);
        }))
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        Ok(self.settle(id, token, |r, now| {
            let until = now.saturating_add(lease);
            r.lease_until = Some(until);
            r.expires_at = r.expires_at.max(until);
        }))
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        Ok(self.atomically(|records, now| {
            let Some(r) = records.get_mut(id) else {
                return Reclaim::Lost;
            };
            // A permanent failure is final for the request that failed (its work may have
            // acted): only a request with another fingerprint takes it over.
            let takeable = r.reclaimable_by(fingerprint, now);
            // The token the caller read must still be there: a stale read (the holder
            // completed since) never overwrites the record.
            if r.is_expired(now) || r.token != expected || !takeable {
                return Reclaim::Lost;
            }
            let lease_until = now.saturating_add(lease);
            r.status = RecordStatus::Pending;
            r.token = expected.next();
            r.fingerprint = *fingerprint;
            r.attempts = r.attempts.saturating_add(1);
            r.lease_until = Some(lease_until);
            r.outcome = None;
            r.failure = None;
            r.updated_at = now;
            r.expires_at = now.saturating_add(lease.max(ttl));
            Reclaim::Reclaimed {
                token: r.token,
                lease_until,
            }
        }))
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        Ok(self.atomically(|records, now| records.get(id).filter(|r| !r.is_expired(now)).cloned()))
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        Ok(self.atomically(|records, now| {
            let expired: Vec<RecordId> = records
                .iter()
                .filter(|(_, r)| r.is_expired(now))
                .map(|(id, _)| id.clone())
                .take(batch)
                .collect();
            for id in &expired {
                records.remove(id);
            }
            expired.len() as u64
        }))
    }
}
