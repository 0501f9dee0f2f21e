//! A batch of claims or settlements in one statement over arrays (`sql::claim_batch`,
//! `sql::observe_batch`, `sql::settle_batch`).
//!
//! One statement may name a key once (ON CONFLICT DO UPDATE cannot touch a row twice), so a
//! batch is sent in rounds: the first round holds each key's first request, the next round
//! each key's second, and so on. Rounds run in order, so a key named twice is answered as if
//! its requests came one after another, as the contract wants; a batch without repeated keys
//! (the usual one) is one round, one statement per kind of request, one round trip.

use crate::decode::{decode_record, get};
use crate::error::Effect;
use crate::store::{All, OnLoss};
use crate::PostgresStore;
use idempotency_core::store::{
    claim_retention, duration_millis, Cas, Claim, ClaimRequest, Settle, Settlement, Timestamp,
};
use idempotency_core::{Error, FencingToken, RecordId};
use sqlx::postgres::PgRow;
use std::collections::HashMap;

/// The indices of `ids` in rounds of distinct keys: round `n` holds every key's `n`-th
/// occurrence, in the batch's order.
fn rounds<'a>(ids: impl Iterator<Item = &'a RecordId>) -> Vec<Vec<usize>> {
    let mut seen: HashMap<(&str, &str), usize> = HashMap::new();
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (i, id) in ids.enumerate() {
        let n = seen
            .entry((id.scope.as_str(), id.key.as_str()))
            .or_insert(0);
        if rounds.len() <= *n {
            rounds.push(Vec::new());
        }
        rounds[*n].push(i);
        *n += 1;
    }
    rounds
}

/// The key a batch statement's row names.
fn named(row: &PgRow, table: &str) -> Result<(String, String), Error> {
    Ok((get(row, "b_scope", table)?, get(row, "b_key", table)?))
}

impl PostgresStore {
    pub(crate) async fn claim_batch(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
        let mut out: Vec<Option<Result<Claim, Error>>> = requests.iter().map(|_| None).collect();
        for round in rounds(requests.iter().map(|r| &r.id)) {
            for count_hit in [true, false] {
                let group: Vec<usize> = round
                    .iter()
                    .copied()
                    .filter(|&i| requests[i].count_hit == count_hit)
                    .collect();
                if group.is_empty() {
                    continue;
                }
                let answers = self.claim_group(requests, &group, count_hit).await;
                for (i, answer) in group.into_iter().zip(answers) {
                    out[i] = Some(answer);
                }
            }
        }
        out.into_iter()
            .map(|a| a.unwrap_or_else(|| Err(Error::backend(false, "a claim got no answer"))))
            .collect()
    }

    /// One statement for the requests at `group` (distinct keys, all counting hits or none).
    async fn claim_group(
        &self,
        requests: &[ClaimRequest],
        group: &[usize],
        count_hit: bool,
    ) -> Vec<Result<Claim, Error>> {
        let mine = || group.iter().map(|&i| &requests[i]);
        let scopes: Vec<&str> = mine().map(|r| r.id.scope.as_str()).collect();
        let keys: Vec<&str> = mine().map(|r| r.id.key.as_str()).collect();
        let fingerprints: Vec<&[u8]> = mine().map(|r| &r.fingerprint.as_bytes()[..]).collect();
        let leases: Vec<i64> = mine().map(|r| duration_millis(r.lease)).collect();
        let holds: Vec<i64> = mine()
            .map(|r| duration_millis(claim_retention(r.lease, r.ttl)))
            .collect();
        let sql = match count_hit {
            true => &self.sql.claim_batch,
            false => &self.sql.observe_batch,
        };
        // Sent again on a lost connection, like a single claim: a repeat observes what an
        // applied one wrote.
        let rows = self
            .run(Effect::Write, OnLoss::Resend, All, || {
                sqlx::query(sql)
                    .bind(&scopes[..])
                    .bind(&keys[..])
                    .bind(&fingerprints[..])
                    .bind(&leases[..])
                    .bind(&holds[..])
            })
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => return e.for_each_of(group.len()).into_iter().map(Err).collect(),
        };
        let table = &*self.qualified;
        let mut by_key = HashMap::with_capacity(rows.len());
        for row in rows {
            match named(&row, table) {
                Ok(key) => {
                    by_key.insert(key, row);
                }
                // Nothing says which request the row answers: every request hears of it.
                Err(e) => return e.for_each_of(group.len()).into_iter().map(Err).collect(),
            }
        }
        mine()
            .map(|r| {
                match by_key.get(&(r.id.scope.as_str().to_owned(), r.id.key.as_str().to_owned())) {
                    Some(row) => claim_answer(row, r, table),
                    None => Err(Error::backend(
                        false,
                        format!("the batch claim returned no row for {}", r.id),
                    )),
                }
            })
            .collect()
    }

    pub(crate) async fn settle_batch(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
        let mut out: Vec<Option<Result<Cas, Error>>> = settlements.iter().map(|_| None).collect();
        for round in rounds(settlements.iter().map(|s| &s.id)) {
            // No stored record can hold a token above i64::MAX.
            let (sent, fenced): (Vec<usize>, Vec<usize>) = round
                .into_iter()
                .partition(|&i| i64::try_from(settlements[i].token.0).is_ok());
            for i in fenced {
                out[i] = Some(Ok(Cas::Fenced));
            }
            if sent.is_empty() {
                continue;
            }
            let answers = self.settle_group(settlements, &sent).await;
            for (i, answer) in sent.into_iter().zip(answers) {
                out[i] = Some(answer);
            }
        }
        out.into_iter()
            .map(|a| a.unwrap_or_else(|| Err(Error::backend(false, "a settlement got no answer"))))
            .collect()
    }

    /// One statement for the settlements at `group` (distinct keys, tokens that fit an int8).
    async fn settle_group(
        &self,
        settlements: &[Settlement],
        group: &[usize],
    ) -> Vec<Result<Cas, Error>> {
        let mine = || group.iter().map(|&i| &settlements[i]);
        let scopes: Vec<&str> = mine().map(|s| s.id.scope.as_str()).collect();
        let keys: Vec<&str> = mine().map(|s| s.id.key.as_str()).collect();
        let tokens: Vec<i64> = mine()
            .map(|s| i64::try_from(s.token.0).unwrap_or(i64::MAX))
            .collect();
        let completes: Vec<bool> = mine()
            .map(|s| matches!(s.settle, Settle::Complete(_)))
            .collect();
        let outcomes: Vec<Option<&[u8]>> = mine()
            .map(|s| match &s.settle {
                Settle::Complete(outcome) => Some(&outcome[..]),
                Settle::Fail(_) => None,
            })
            .collect();
        let retryable: Vec<Option<bool>> = mine()
            .map(|s| match &s.settle {
                Settle::Complete(_) => None,
                Settle::Fail(f) => Some(f.retryable),
            })
            .collect();
        let messages: Vec<Option<&str>> = mine()
            .map(|s| match &s.settle {
                Settle::Complete(_) => None,
                Settle::Fail(f) => Some(f.message.as_str()),
            })
            .collect();
        let ttls: Vec<i64> = mine().map(|s| duration_millis(s.ttl)).collect();
        // A holder's compare-and-swaps: a lost connection is reported (the outcome unknown),
        // as for a single completion, whose caller reads the record back.
        let rows = self
            .run(Effect::Write, OnLoss::Report, All, || {
                sqlx::query(&self.sql.settle_batch)
                    .bind(&scopes[..])
                    .bind(&keys[..])
                    .bind(&tokens[..])
                    .bind(&completes[..])
                    .bind(&outcomes[..])
                    .bind(&retryable[..])
                    .bind(&messages[..])
                    .bind(&ttls[..])
            })
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => return e.for_each_of(group.len()).into_iter().map(Err).collect(),
        };
        let table = &*self.qualified;
        let mut applied = std::collections::HashSet::with_capacity(rows.len());
        for row in rows {
            match named(&row, table) {
                Ok(key) => {
                    applied.insert(key);
                }
                // The statement committed, but which keys it settled is not known.
                Err(e) => {
                    return Error::OutcomeUnknown {
                        source: Box::new(e),
                    }
                    .for_each_of(group.len())
                    .into_iter()
                    .map(Err)
                    .collect()
                }
            }
        }
        mine()
            .map(|s| {
                let key = (s.id.scope.as_str().to_owned(), s.id.key.as_str().to_owned());
                Ok(match applied.contains(&key) {
                    true => Cas::Applied,
                    false => Cas::Fenced,
                })
            })
            .collect()
    }
}

/// A claim's answer from its row: claimed or existing (see `IdempotencyStore::claim`).
pub(crate) fn claim_answer(
    row: &PgRow,
    request: &ClaimRequest,
    table: &str,
) -> Result<Claim, Error> {
    let hits: i64 = get(row, "hits", table)?;
    let created_ms: i64 = get(row, "created_ms", table)?;
    let now_ms: i64 = get(row, "now_ms", table)?;
    let written: bool = get(row, "written", table)?;
    // A claim leaves hits = 0 and created_at = this statement's now; an observation adds
    // one to the stored hits, so even a corrupt negative count is not taken for a claim
    // unless the record was also created in this very millisecond.
    // A row the statement only read (`written` false) is always an observation.
    if written && hits == 0 && created_ms == now_ms {
        // Claimed: a fresh record, or an expired one replaced.
        let token: i64 = get(row, "token", table)?;
        let lease_until: Option<i64> = get(row, "lease_until_ms", table)?;
        let (Ok(token), Some(lease_until)) = (u64::try_from(token), lease_until) else {
            return Err(Error::corrupt(format!(
                "claimed record {} came back without a valid token or lease",
                request.id
            )));
        };
        return Ok(Claim::Claimed {
            token: FencingToken(token),
            lease_until: Timestamp::from_millis(lease_until),
        });
    }
    let record = decode_record(row, &request.id, table)?;
    Ok(Claim::Existing {
        record,
        now: Timestamp::from_millis(now_ms),
    })
}

#[cfg(test)]
mod tests {
    use super::rounds;
    use idempotency_core::{IdempotencyKey, RecordId, Scope};

    #[test]
    fn rounds_hold_each_key_once_in_order() {
        let id = |k: &str| RecordId::new(IdempotencyKey::new(k).unwrap(), Scope::new("s").unwrap());
        let ids = [id("a"), id("b"), id("a"), id("c"), id("a"), id("b")];
        assert_eq!(rounds(ids.iter()), vec![vec![0, 1, 3], vec![2, 5], vec![4]]);
        assert!(rounds([].iter()).is_empty());
    }
}
