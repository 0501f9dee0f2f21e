//! Fires concurrent retries of one payment against an SQLite file and shows that the work
//! runs once, that the payment row is written once, and that the outcome survives a restart.
//!
//! `cargo run -p idempotency-sqlite --example retries` (the database lives in a temp dir).

use idempotency_core::{Error, Fingerprint, Idempotency, IdempotencyKey, InFlight, Policy, Scope};
use idempotency_sqlite::rusqlite::{self, params};
use idempotency_sqlite::SqliteStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("demo.db");
    let store = SqliteStore::open(&path).await?;
    store.migrate().await?;
    store
        .call(|c| {
            c.execute_batch(
                "CREATE TABLE payments (id INTEGER PRIMARY KEY, payment_key TEXT NOT NULL,
                                        amount INTEGER NOT NULL)",
            )
        })
        .await??;
    println!("database: {} (WAL, synchronous=FULL)", path.display());

    // 1. Concurrent retries while the first attempt is still running.
    let engine = Idempotency::builder(store.clone()).build()?;
    let key = IdempotencyKey::random();
    let scope = Scope::from_parts(["customer-42", "POST /payments"])?;
    let fingerprint =
        Fingerprint::from_json(&serde_json::json!({"amount": 1999, "currency": "EUR"}));
    let executions = Arc::new(AtomicUsize::new(0));
    println!("\nkey {key}: 8 concurrent attempts, then 2 late retries");
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
            report(n, result);
        }
    };
    let concurrent: Vec<_> = (1..=8).map(|n| tokio::spawn(attempt(n))).collect();
    for task in concurrent {
        task.await?;
    }
    for n in 9..=10 {
        attempt(n).await;
    }
    println!("the work ran {} time(s)", executions.load(Ordering::SeqCst));

    // 2. Exactly-once: the payment row and the completion commit in one transaction.
    let engine = Idempotency::builder(store.clone())
        .in_flight(InFlight::wait(Duration::from_secs(5)))
        .build()?;
    let key = IdempotencyKey::random();
    println!("\nkey {key}: 6 concurrent attempts writing a payments row in their transaction");
    let tasks: Vec<_> = (1..=6)
        .map(|n| {
            let (engine, key, scope) = (engine.clone(), key.clone(), scope.clone());
            tokio::spawn(async move {
                let result = engine
                    .run_in_transaction(&key, &scope, &fingerprint, |tx, _ctx| {
                        let k = key.to_string();
                        Box::pin(tx.run(move |tx| {
                            tx.execute(
                                "INSERT INTO payments (payment_key, amount) VALUES (?1, 1999)",
                                params![k],
                            )?;
                            Ok::<_, rusqlite::Error>(format!(
                                "payment row {}",
                                tx.last_insert_rowid()
                            ))
                        }))
                    })
                    .await;
                report(n, result);
            })
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    let k = key.to_string();
    let rows: i64 = store
        .call(move |c| {
            c.query_row(
                "SELECT count(*) FROM payments WHERE payment_key = ?1",
                [k],
                |r| r.get(0),
            )
        })
        .await??;
    println!("payments rows for this key: {rows}");

    // 3. The outcome is on disk: a new store on the same file (a restarted process) replays.
    drop((store, engine));
    let reopened = SqliteStore::open(&path).await?;
    let engine = Idempotency::new(Arc::new(reopened), Policy::default())?;
    let result = engine
        .run(&key, &scope, &fingerprint, |_ctx| async {
            Ok::<_, String>("must not run".to_string())
        })
        .await;
    print!("after reopening the database, ");
    report(7, result);
    Ok(())
}

fn report<E: std::fmt::Debug>(
    n: usize,
    result: Result<idempotency_core::Answer<Result<String, E>>, Error>,
) {
    match result {
        Ok(idempotency_core::Answer::Replayed(result)) => {
            println!("attempt {n}: replayed {result:?}")
        }
        Ok(idempotency_core::Answer::Executed(result)) => {
            println!("attempt {n}: ran the work -> {result:?}")
        }
        Ok(idempotency_core::Answer::Refused(refusal)) => {
            println!("attempt {n}: refused: {refusal}")
        }
        Err(e) => println!("attempt {n}: {e} (retryable: {})", e.is_retryable()),
    }
}
