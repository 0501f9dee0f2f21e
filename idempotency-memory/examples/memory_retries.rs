//! Fires concurrent retries of one payment and shows that the work runs once.

use idempotency_core::{Answer, Error, Fingerprint, Idempotency, IdempotencyKey, Policy, Scope};
use idempotency_memory::MemoryStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let engine = Idempotency::new(Arc::new(MemoryStore::new()), Policy::default())?;
    let key = IdempotencyKey::random();
    let scope = Scope::from_parts(["customer-42", "POST /payments"])?;
    let fingerprint =
        Fingerprint::from_json(&serde_json::json!({"amount": 1999, "currency": "EUR"}));
    let executions = Arc::new(AtomicUsize::new(0));

    println!("key {key}: 8 concurrent attempts, then 2 late retries");
    let attempt = |n: usize| {
        let (engine, key, scope, executions) = (
            engine.clone(),
            key.clone(),
            scope.clone(),
            executions.clone(),
        );
        async move {
            let result = engine
                .run(&key, &scope, &fingerprint, |_ctx| async move {
                    executions.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await; // the payment provider
                    Ok::<_, String>(format!("payment-{}", 1000 + n))
                })
                .await;
            match result {
                Ok(Answer::Replayed(result)) => println!("attempt {n}: replayed {result:?}"),
                Ok(Answer::Executed(result)) => println!("attempt {n}: ran the work -> {result:?}"),
                Ok(Answer::Refused(refusal)) => println!("attempt {n}: refused: {refusal}"),
                Err(e) => println!("attempt {n}: {e} (retryable: {})", e.is_retryable()),
            }
        }
    };
    let concurrent: Vec<_> = (1..=8).map(|n| tokio::spawn(attempt(n))).collect();
    for task in concurrent {
        task.await.expect("attempt task");
    }
    for n in 9..=10 {
        attempt(n).await;
    }
    println!("the work ran {} time(s)", executions.load(Ordering::SeqCst));
    Ok(())
}
