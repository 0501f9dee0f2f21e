use idempotency_core::{Idempotency, IdempotencyKey, Scope};
use idempotency_core::store::{Begun, CommitError};
use idempotency_core::protocol::Lease;
use idempotency_core::{Answer, TransactionalStore};
use std::sync::Arc;

/// The toy store with a "business table" beside it: a ledger of lines.
#[derive(Debug, Default)]
pub struct ToyBank {
    records: Arc<ToyStore>,
    ledger: Mutex<Vec<String>>,
}

/// A toy transaction buffers the work's writes and the completion, and applies both under
/// the locks at the commit, or neither (a database does this for you).
#[derive(Debug, Default)]
pub struct ToyTransaction {
    /// The work writes here.
    pub writes: Vec<String>,
    completion: Option<(RecordId, FencingToken, Vec<u8>, Duration)>,
}

#[async_trait]
impl TransactionalStore for ToyBank {
    type Transaction = ToyTransaction;
    // The work writes into the transaction itself, and its writes cannot fail.
    type Connection = ToyTransaction;
    type WorkError = Error;

    fn connection(tx: &mut ToyTransaction) -> &mut ToyTransaction {
        tx
    }


    fn connection_ref(tx: &ToyTransaction) -> &ToyTransaction {

        tx

    }

    fn work_error(error: Error) -> Error {
        error
    }

    async fn begin(&self, _lease: &Lease) -> Result<Begun<ToyTransaction>, Error> {
        // Nothing holds the record meanwhile: the heartbeat keeps the lease.
        Ok(Begun::Open(ToyTransaction::default()))
    }

    async fn complete_in(
        &self,
        tx: &mut ToyTransaction,
        lease: &Lease,
        outcome: &[u8],
    ) -> Result<(), Error> {
        // A real store runs the compare-and-swap as a statement in the transaction; the toy
        // checks it now and again at the commit, atomically with the writes.
        let token = lease.token();
        match self.records.get(lease.id()).await? {
            Some(r) if r.status == RecordStatus::Pending && r.token == token => {}
            _ => return Err(Error::LeaseLost { token }),
        }
        tx.completion = Some((lease.id().clone(), token, outcome.to_vec(), lease.retention()));
        Ok(())
    }

    async fn commit(&self, tx: ToyTransaction) -> Result<(), CommitError> {
        let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((id, token, outcome, ttl)) = tx.completion {
            let cas = self.records.settle(&id, token, |r, now| {
                r.status = RecordStatus::Completed;
                r.outcome = Some(outcome);
                r.lease_until = None;
                r.expires_at = now.saturating_add(ttl);
            });
            if cas == Cas::Fenced {
                let lost = Error::LeaseLost { token };
                return Err(CommitError::NotCommitted(lost));
            }
        }
        ledger.extend(tx.writes);
        Ok(())
    }

    async fn rollback(&self, _tx: ToyTransaction) {}
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let bank = ToyBank::default();
    // A database store is one value with both sides; the toy keeps its records in a
    // `ToyStore` beside its ledger, and hands the engine both.
    let engine = Idempotency::builder(bank.records.clone())
        .build()?
        .with_transactions(bank);
    let (key, scope) = (IdempotencyKey::new("pay-1")?, Scope::new("payments")?);
    let fp = Fingerprint::from_bytes(b"10 EUR to Ada");
    for _ in 0..2 {
        let outcome = engine
            .run_in_transaction(&key, &scope, &fp, |tx, _ctx| {
                Box::pin(async move {
                    tx.writes.push("10 EUR to Ada".to_owned());
                    Ok(Ok::<usize, String>(tx.writes.len()))
                })
            })
            .await?;
        assert!(matches!(outcome, Answer::Executed(Ok(1)) | Answer::Replayed(Ok(1))));
    }
    // Two calls, one write: the second replayed the first's outcome.
    assert_eq!(engine.store().ledger.lock().unwrap_or_else(|e| e.into_inner()).len(), 1);
    Ok(())
}
