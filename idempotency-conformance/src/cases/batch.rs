//! Batches: `claim_many` and `settle_many` answer exactly as the same calls made one by one,
//! duplicates inside a batch included, and overlapping concurrent batches give each key one
//! winner.

use super::{fp, must_claim, present, request, unique_id};
use crate::TestStore;
use idempotency_core::store::{
    Cas, Claim, ClaimRequest, Failure, Record, RecordStatus, Settlement,
};
use idempotency_core::{FencingToken, RecordId};
use std::collections::HashMap;
use std::sync::Arc;

/// What an answer says, without what legitimately differs between two keys (tokens and
/// times): whether it claimed, and the state of the record it found.
#[derive(Debug, PartialEq, Eq)]
enum Shape {
    Claimed,
    Existing {
        status: RecordStatus,
        hits: u64,
        attempts: u32,
        outcome: Option<Vec<u8>>,
        failure: Option<Failure>,
        fingerprint: idempotency_core::Fingerprint,
        /// Which claim of the sequence holds the record: its position in the batch, or the
        /// setup's token.
        holder: Holder,
    },
}

#[derive(Debug, PartialEq, Eq)]
enum Holder {
    /// The claim at this position of the batch.
    Batch(usize),
    /// The token the setup claimed the key with.
    Setup,
}

/// The keys a batch of the case runs over: three set up beforehand (Pending, Completed,
/// Failed), two new ones, and one new key named three times.
struct Keys {
    pending: RecordId,
    done: RecordId,
    failed: RecordId,
    new1: RecordId,
    new2: RecordId,
    dup: RecordId,
}

impl Keys {
    fn new(label: &str) -> Self {
        Self {
            pending: unique_id(&format!("{label}-pending")),
            done: unique_id(&format!("{label}-done")),
            failed: unique_id(&format!("{label}-failed")),
            new1: unique_id(&format!("{label}-new1")),
            new2: unique_id(&format!("{label}-new2")),
            dup: unique_id(&format!("{label}-dup")),
        }
    }

    /// Claims `pending`, `done` and `failed`, and settles the last two: their setup tokens.
    async fn set_up(&self, t: &TestStore) -> HashMap<RecordId, FencingToken> {
        let mut tokens = HashMap::new();
        for id in [&self.pending, &self.done, &self.failed] {
            let token = must_claim(t, &request(id, fp("setup"), t.long(), t.long())).await;
            tokens.insert(id.clone(), token);
        }
        let cas = t
            .store
            .complete(&self.done, tokens[&self.done], b"done \x00\xff", t.long())
            .await
            .expect("complete");
        assert_eq!(cas, Cas::Applied);
        let cas = t
            .store
            .fail(
                &self.failed,
                tokens[&self.failed],
                &Failure::retryable("setup failure"),
                t.long(),
            )
            .await
            .expect("fail");
        assert_eq!(cas, Cas::Applied);
        tokens
    }

    /// The batch: new keys, live records of every status, and `dup` three times (claimed,
    /// then observed with a hit counted, then observed without).
    fn requests(&self, t: &TestStore) -> Vec<ClaimRequest> {
        let r = |id: &RecordId, label: &str| request(id, fp(label), t.long(), t.long());
        vec![
            r(&self.new1, "new1"),
            r(&self.pending, "retry of pending"),
            r(&self.dup, "dup"),
            r(&self.done, "retry of done"),
            r(&self.dup, "dup again").with_count_hit(true),
            r(&self.new2, "new2").with_count_hit(false),
            r(&self.failed, "retry of failed"),
            r(&self.dup, "dup a third time").with_count_hit(false),
        ]
    }
}

/// The shape of each answer, with the holder told by token.
fn shapes(
    requests: &[ClaimRequest],
    answers: Vec<Claim>,
    setup: &HashMap<RecordId, FencingToken>,
) -> Vec<Shape> {
    // By key and token: tokens are per key, so two keys may be given the same one.
    let mut claimed_at: HashMap<(&RecordId, FencingToken), usize> = HashMap::new();
    let mut out = Vec::new();
    for (i, (req, answer)) in requests.iter().zip(answers).enumerate() {
        out.push(match answer {
            Claim::Claimed { token, .. } => {
                claimed_at.insert((&req.id, token), i);
                Shape::Claimed
            }
            Claim::Existing { record, .. } => {
                let holder = match claimed_at.get(&(&req.id, record.token)) {
                    Some(&at) => Holder::Batch(at),
                    None => {
                        assert_eq!(
                            setup.get(&req.id),
                            Some(&record.token),
                            "answer {i}: the record of {} holds a token no claim was given",
                            req.id
                        );
                        Holder::Setup
                    }
                };
                let Record {
                    status,
                    hits,
                    attempts,
                    outcome,
                    failure,
                    fingerprint,
                    ..
                } = record;
                Shape::Existing {
                    status,
                    hits,
                    attempts,
                    outcome,
                    failure,
                    fingerprint,
                    holder,
                }
            }
        });
    }
    out
}

/// A batch of claims answers exactly as the same claims made one by one in the batch's
/// order: new keys are claimed, live records of each status are observed (hits counted or
/// not as each request asks), and a key named three times is claimed by its first request
/// and observed by the other two. The tokens a batch hands out are real: they settle their
/// keys. An empty batch has no answers.
pub async fn batch_claims_answer_as_single_claims(t: TestStore) {
    assert!(t.store.claim_many(&[]).await.is_empty(), "an empty batch");

    // One by one, on keys of their own.
    let single = Keys::new("batch-single");
    let single_setup = single.set_up(&t).await;
    let single_requests = single.requests(&t);
    let mut single_answers = Vec::new();
    for req in &single_requests {
        single_answers.push(t.store.claim(req).await.expect("claim"));
    }
    let expected = shapes(&single_requests, single_answers, &single_setup);

    // As one batch.
    let batch = Keys::new("batch-many");
    let batch_setup = batch.set_up(&t).await;
    let requests = batch.requests(&t);
    let answers: Vec<Claim> = t
        .store
        .claim_many(&requests)
        .await
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.unwrap_or_else(|e| panic!("answer {i} of the batch: {e}")))
        .collect();
    assert_eq!(answers.len(), requests.len(), "one answer per request");
    let tokens: Vec<Option<FencingToken>> = answers
        .iter()
        .map(|a| match a {
            Claim::Claimed { token, .. } => Some(*token),
            Claim::Existing { .. } => None,
        })
        .collect();
    let got = shapes(&requests, answers, &batch_setup);
    for (i, (got, want)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(
            got, want,
            "answer {i} of the batch ({}) differs from the same claim made alone",
            requests[i].id
        );
    }

    // The records the batch wrote are what the single claims wrote.
    for (b, s) in [
        (&batch.new1, &single.new1),
        (&batch.new2, &single.new2),
        (&batch.dup, &single.dup),
        (&batch.pending, &single.pending),
    ] {
        let (rb, rs) = (present(&t, b).await, present(&t, s).await);
        assert_eq!(
            (rb.status, rb.hits, rb.attempts, rb.fingerprint),
            (rs.status, rs.hits, rs.attempts, rs.fingerprint),
            "the record of {b} after the batch differs from the one the single claims left"
        );
    }
    // Each claim the batch won holds its key: its token completes it.
    for (i, token) in tokens.iter().enumerate() {
        if let Some(token) = token {
            let id = &requests[i].id;
            let cas = t
                .store
                .complete(id, *token, b"batch", t.long())
                .await
                .expect("complete");
            assert_eq!(
                cas,
                Cas::Applied,
                "the token batch answer {i} gave for {id}"
            );
        }
    }
}

/// Batches that share keys, released together, each in its own task and each naming its
/// keys in another order (some twice): every key has exactly one winner across all of them,
/// and every other answer for that key shows the winner's record.
pub async fn overlapping_batches_one_winner_per_key(t: TestStore) {
    const KEYS: usize = 8;
    const BATCHES: usize = 6;
    for round in 0..5 {
        let ids: Vec<RecordId> = (0..KEYS)
            .map(|k| unique_id(&format!("overlap-{round}-{k}")))
            .collect();
        let barrier = Arc::new(tokio::sync::Barrier::new(BATCHES));
        let tasks: Vec<_> = (0..BATCHES)
            .map(|b| {
                // Batch b names keys b, b+1, … (every key in some batches), the first twice.
                let order: Vec<usize> = (0..KEYS / 2 + 1)
                    .map(|j| (b + j * (round + 1)) % KEYS)
                    .chain(std::iter::once(b % KEYS))
                    .collect();
                let requests: Vec<ClaimRequest> = order
                    .iter()
                    .map(|&k| request(&ids[k], fp("same payload"), t.long(), t.long()))
                    .collect();
                let (store, barrier) = (t.store.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let answers = store.claim_many(&requests).await;
                    (order, answers)
                })
            })
            .collect();
        let mut winners: HashMap<usize, Vec<FencingToken>> = HashMap::new();
        let mut seen: Vec<(usize, FencingToken)> = Vec::new();
        for task in tasks {
            let (order, answers) = task.await.expect("task");
            assert_eq!(answers.len(), order.len(), "one answer per request");
            for (k, answer) in order.into_iter().zip(answers) {
                match answer.expect("claim in a batch") {
                    Claim::Claimed { token, .. } => winners.entry(k).or_default().push(token),
                    Claim::Existing { record, .. } => seen.push((k, record.token)),
                }
            }
        }
        for (k, tokens) in &winners {
            assert_eq!(
                tokens.len(),
                1,
                "round {round}: key {k} was claimed {} times by overlapping batches",
                tokens.len()
            );
        }
        for (k, token) in seen {
            let winner = winners
                .get(&k)
                .unwrap_or_else(|| panic!("round {round}: key {k} was observed but never claimed"));
            assert_eq!(
                winner[0], token,
                "round {round}: an observation of key {k} shows a token its winner was not given"
            );
        }
    }
}

/// A batch of settlements answers exactly as the same completions and failures made one by
/// one: the holder's settle, a stale token, a second settlement of one key and an unknown key
/// are fenced, and each record ends as its single settlement would leave it.
pub async fn batch_settlements_answer_as_single_settlements(t: TestStore) {
    assert!(t.store.settle_many(&[]).await.is_empty(), "an empty batch");
    let ids: Vec<RecordId> = (0..4)
        .map(|i| unique_id(&format!("settle-many-{i}")))
        .collect();
    let mut tokens = Vec::new();
    for id in &ids {
        tokens.push(must_claim(&t, &request(id, fp("settle"), t.long(), t.long())).await);
    }
    let unknown = unique_id("settle-many-unknown");
    let outcome = b"outcome \x00\xff".to_vec();
    let retryable = Failure::retryable("upstream timed out");
    let permanent = Failure::permanent("card declined");
    let long = t.long();
    let settlements = vec![
        Settlement::complete(ids[0].clone(), tokens[0], outcome.clone(), long),
        Settlement::fail(ids[1].clone(), tokens[1], retryable.clone(), long),
        Settlement::complete(ids[2].clone(), FencingToken(tokens[2].0 + 1), vec![1], long),
        Settlement::complete(ids[0].clone(), tokens[0], b"second".to_vec(), long),
        Settlement::complete(unknown.clone(), FencingToken(1), vec![2], long),
        Settlement::fail(ids[3].clone(), tokens[3], permanent.clone(), long),
    ];
    let answers: Vec<Cas> = t
        .store
        .settle_many(&settlements)
        .await
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.unwrap_or_else(|e| panic!("settlement {i}: {e}")))
        .collect();
    assert_eq!(
        answers,
        vec![
            Cas::Applied,
            Cas::Applied,
            Cas::Fenced,
            Cas::Fenced,
            Cas::Fenced,
            Cas::Applied
        ],
        "completion, failure, stale token, second settlement, unknown key, failure"
    );
    let done = present(&t, &ids[0]).await;
    assert_eq!(
        (done.status, done.outcome.as_deref()),
        (RecordStatus::Completed, Some(&outcome[..])),
        "the first completion is stored, the second fenced"
    );
    let failed = present(&t, &ids[1]).await;
    assert_eq!(
        (failed.status, failed.failure),
        (RecordStatus::Failed, Some(retryable))
    );
    let untouched = present(&t, &ids[2]).await;
    assert_eq!(
        (untouched.status, untouched.token),
        (RecordStatus::Pending, tokens[2]),
        "a stale token changes nothing"
    );
    let refused = present(&t, &ids[3]).await;
    assert_eq!(
        (refused.status, refused.failure),
        (RecordStatus::Failed, Some(permanent))
    );
    assert!(
        t.store.get(&unknown).await.expect("get").is_none(),
        "settling an unknown key creates nothing"
    );
}
