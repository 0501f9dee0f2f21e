//! `cargo run -p payments-api`: the demo. It starts the payments service on Postgres, pays
//! once through the client half, then retries one key five times at once and reuses it with
//! another amount, and shows that one payment was made.
//!
//! `cargo run -p payments-api -- serve` only serves (`PAYMENTS_PORT`, default any free port).

use idempotency::reqwest::{IdempotentRequestExt, IdempotentResponseExt};
use idempotency::IdempotencyKey;
use payments_api::{BoxError, Config, NewPayment, Payment};
use std::time::{SystemTime, UNIX_EPOCH};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let port = match std::env::var("PAYMENTS_PORT") {
        Ok(p) => p.parse().map_err(|e| format!("PAYMENTS_PORT={p}: {e}"))?,
        Err(_) => 0,
    };
    let config = Config::from_env();
    let running = payments_api::start(&config, port).await?;
    if std::env::args().nth(1).as_deref() == Some("serve") {
        println!("payments listening on {}", running.url);
        running.task.await??;
        return Ok(());
    }
    println!("payments service: {}", running.url);
    let url = format!("{}/payments", running.url);
    let client = payments_api::client();
    let twelve_fifty = NewPayment {
        cents: 1250,
        currency: "EUR".into(),
    };

    // 1. One payment through the client half: it mints the key and keeps it across retries.
    let resp = client
        .post(&url)
        .bearer_auth("shop-1")
        .json(&twelve_fifty)
        .idempotent()
        .send()
        .await?;
    let replayed = resp.was_replayed();
    let paid: Payment = resp.json().await?;
    println!(
        "1. paid {} cents: payment {} (replayed: {replayed})",
        paid.cents, paid.id
    );

    // 2. The same key five times at once, as a client that timed out and retried would send
    //    it: one payment, and every answer is it (or 409 while the first runs).
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let key = IdempotencyKey::new(format!("demo-{nanos}"))?;
    let plain = reqwest::Client::new();
    let send = |body: &NewPayment| {
        plain
            .post(&url)
            .bearer_auth("shop-1")
            .header("idempotency-key", key.as_str())
            .json(body)
            .send()
    };
    let mut answers = Vec::new();
    for resp in futures::future::join_all((0..5).map(|_| send(&twelve_fifty))).await {
        answers.push(resp?.status().as_u16());
    }
    println!("2. five at once under {}: {answers:?}", key.as_str());
    let again = send(&twelve_fifty).await?;
    let replayed = again.headers().contains_key("idempotent-replayed");
    let payment: Payment = again.json().await?;
    println!(
        "   a later retry: payment {} (replayed: {replayed})",
        payment.id
    );

    // 3. The key reused with another amount: refused, nothing paid.
    let reused = send(&NewPayment {
        cents: 9999,
        currency: "EUR".into(),
    })
    .await?;
    println!("3. the key reused for 9999 cents: {}", reused.status());

    let rows: i64 = idempotency::postgres::sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".payments WHERE cents = 1250 AND id >= $1",
        config.schema
    ))
    .bind(payment.id)
    .fetch_one(running.store.pool())
    .await?;
    println!("   payments made under the key: {rows}");
    running.maintenance.shutdown().await;
    if rows != 1 {
        return Err(format!("{rows} payments for one key").into());
    }
    Ok(())
}
