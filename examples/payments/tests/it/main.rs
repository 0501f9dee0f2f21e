//! The payments service against the real Postgres server (127.0.0.1:5432, database `test`):
//! each test in a schema of its own, dropped at its end.
#![allow(clippy::unwrap_used)]

use idempotency::postgres::sqlx;
use idempotency::reqwest::{IdempotentRequestExt, IdempotentResponseExt};
use idempotency::IdempotencyKey;
use payments_api::{Config, NewPayment, NewRefund, Payment, Refund, Running};
use reqwest::StatusCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

struct Service {
    running: Running,
    schema: String,
}

impl Service {
    async fn start(name: &str, retention: Duration, purge_every: Duration) -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let schema = format!("payments_{name}_{}_{nanos}", std::process::id());
        let config = Config {
            postgres_url: "postgres://postgres@127.0.0.1:5432/test".into(),
            schema: schema.clone(),
            retention,
            purge_every,
            complete_every: Duration::from_millis(100),
            retry_refunds_after: Duration::from_millis(200),
        };
        let running = payments_api::start(&config, 0).await.unwrap();
        Self { running, schema }
    }

    fn url(&self) -> String {
        format!("{}/payments", self.running.url)
    }

    /// Payments made by `merchant`.
    async fn payments(&self, merchant: &str) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM \"{}\".payments WHERE merchant = $1",
            self.schema
        ))
        .bind(merchant)
        .fetch_one(self.running.store.pool())
        .await
        .unwrap()
    }

    /// How many refunds of `payment` the service wrote, how many of them are marked refunded,
    /// and how many the card provider made.
    async fn refunds(&self, payment: i64) -> (i64, i64, i64) {
        sqlx::query_as(&format!(
            "SELECT count(*), count(r.reference), \
                    (SELECT count(*) FROM \"{0}\".provider_refunds WHERE payment = $1) \
             FROM \"{0}\".payments_refunds r WHERE r.payment = $1",
            self.schema
        ))
        .bind(payment)
        .fetch_one(self.running.store.pool())
        .await
        .unwrap()
    }

    /// Pays `cents` for `merchant` under a key of its own.
    async fn pay(&self, client: &reqwest::Client, merchant: &str, cents: i64) -> Payment {
        let key = format!("pay-{merchant}-{cents}");
        let (status, _, body) = settle(client, &self.url(), merchant, &key, &eur(cents)).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    async fn stop(self) {
        self.running.task.abort();
        self.running.maintenance.shutdown().await;
        sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .execute(self.running.store.pool())
            .await
            .unwrap();
    }
}

fn eur(cents: i64) -> NewPayment {
    NewPayment {
        cents,
        currency: "EUR".into(),
    }
}

/// Sends `body` under `key` for `merchant` until the answer is not `409` (the first request
/// still running): status, replayed, body.
async fn settle(
    client: &reqwest::Client,
    url: &str,
    merchant: &str,
    key: &str,
    body: &impl serde::Serialize,
) -> (StatusCode, bool, String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let resp = client
            .post(url)
            .bearer_auth(merchant)
            .header("idempotency-key", key)
            .json(body)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        if status == StatusCode::CONFLICT {
            assert!(Instant::now() < deadline, "{key} stayed in progress");
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let replayed = resp.headers().contains_key("idempotent-replayed");
        return (status, replayed, resp.text().await.unwrap());
    }
}

/// Eight requests at once under each of twelve keys: one payment per key, one execution per
/// key, and every answer under a key is the same payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_retries_of_a_key_make_one_payment() {
    let service = Service::start("race", Duration::from_secs(3600), Duration::from_secs(60)).await;
    let client = reqwest::Client::new();
    let url = service.url();
    for k in 0..12 {
        let (key, body) = (format!("race-{k}"), eur(100 + k));
        let answers =
            futures::future::join_all((0..8).map(|_| settle(&client, &url, "shop-1", &key, &body)))
                .await;
        let executed = answers.iter().filter(|(_, replayed, _)| !replayed).count();
        assert_eq!(executed, 1, "{key}: {answers:?}");
        for (status, _, body) in &answers {
            assert_eq!(*status, StatusCode::CREATED, "{key}: {body}");
            assert_eq!(body, &answers[0].2, "{key}: two different answers");
        }
        let paid: Payment = serde_json::from_str(&answers[0].2).unwrap();
        assert_eq!(paid.cents, 100 + k);
    }
    assert_eq!(service.payments("shop-1").await, 12);
    service.stop().await;
}

/// The client half: one key per payment, kept for the retry it is told to make; the key
/// reused with another amount is refused and pays nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_half_pays_once() {
    let service =
        Service::start("client", Duration::from_secs(3600), Duration::from_secs(60)).await;
    let client = payments_api::client();
    let url = service.url();
    let key = IdempotencyKey::new("client-1").unwrap();
    let first = client
        .post(&url)
        .bearer_auth("shop-2")
        .json(&eur(700))
        .idempotency_key(key.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!first.was_replayed());
    let paid: Payment = first.json().await.unwrap();
    let again = client
        .post(&url)
        .bearer_auth("shop-2")
        .json(&eur(700))
        .idempotency_key(key.clone())
        .send()
        .await
        .unwrap();
    assert!(again.was_replayed());
    assert_eq!(again.json::<Payment>().await.unwrap(), paid);
    let fresh = client
        .post(&url)
        .bearer_auth("shop-2")
        .json(&eur(700))
        .idempotent()
        .send()
        .await
        .unwrap();
    assert_eq!(
        fresh.status(),
        StatusCode::CREATED,
        "a new key is a new payment"
    );
    let reused = settle(
        &reqwest::Client::new(),
        &url,
        "shop-2",
        key.as_str(),
        &eur(9_999),
    )
    .await;
    assert_eq!(reused.0, StatusCode::UNPROCESSABLE_ENTITY, "{}", reused.2);
    assert!(reused.2.contains("idempotency-key-reused"), "{}", reused.2);
    assert_eq!(service.payments("shop-2").await, 2);
    // The payment reads back.
    let shown: Payment = reqwest::get(format!("{url}/{}", paid.id))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(shown, paid);
    service.stop().await;
}

/// Keys are each merchant's own; a request naming no merchant is `401` and pays nothing; a
/// payment that is not valid is `422`, stored and replayed like any answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merchants_keep_their_keys_apart() {
    let service = Service::start(
        "merchants",
        Duration::from_secs(3600),
        Duration::from_secs(60),
    )
    .await;
    let client = reqwest::Client::new();
    let url = service.url();
    let a = settle(&client, &url, "shop-a", "same-key", &eur(10)).await;
    let b = settle(&client, &url, "shop-b", "same-key", &eur(10)).await;
    assert_eq!(
        (a.0, a.1, b.0, b.1),
        (StatusCode::CREATED, false, StatusCode::CREATED, false)
    );
    assert_ne!(a.2, b.2, "two merchants got one payment");
    let anonymous = client
        .post(&url)
        .header("idempotency-key", "same-key")
        .json(&eur(10))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    let invalid = settle(&client, &url, "shop-a", "bad", &eur(-5)).await;
    assert_eq!(
        (invalid.0, invalid.1),
        (StatusCode::UNPROCESSABLE_ENTITY, false)
    );
    let again = settle(&client, &url, "shop-a", "bad", &eur(-5)).await;
    assert_eq!((again.0, again.1), (StatusCode::UNPROCESSABLE_ENTITY, true));
    assert_eq!(service.payments("shop-a").await, 1);
    assert_eq!(service.payments("shop-b").await, 1);
    service.stop().await;
}

/// The service's purge deletes a key once its retention has passed; the same key then makes
/// a new payment (a new operation, as the retention promises).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_keys_are_purged() {
    let service = Service::start("purge", Duration::from_secs(1), Duration::from_millis(100)).await;
    let client = reqwest::Client::new();
    let url = service.url();
    let first = settle(&client, &url, "shop-p", "short-lived", &eur(5)).await;
    assert_eq!(first.0, StatusCode::CREATED);
    let deadline = Instant::now() + Duration::from_secs(60);
    while service.running.maintenance.purge_stats().purged() == 0 {
        assert!(
            Instant::now() < deadline,
            "the expired key was never purged"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let records: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".idempotency_records",
        service.schema
    ))
    .fetch_one(service.running.store.pool())
    .await
    .unwrap();
    assert_eq!(records, 0);
    let later = settle(&client, &url, "shop-p", "short-lived", &eur(5)).await;
    assert_eq!((later.0, later.1), (StatusCode::CREATED, false));
    assert_eq!(service.payments("shop-p").await, 2);
    service.stop().await;
}

/// `cargo run -p payments-api`, the demo, ends well: one payment for the key it retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_pays_once() {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let schema = format!("payments_demo_{}_{nanos}", std::process::id());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_payments-api"))
        .env("PAYMENTS_SCHEMA", &schema)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dropped = std::process::Command::new("psql")
        .args([
            "-q",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-d",
            "test",
            "-c",
        ])
        .arg(format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .status();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("payments made under the key: 1"),
        "{stdout}"
    );
    assert!(stdout.contains("422"), "{stdout}");
    assert!(
        dropped.is_ok_and(|s| s.success()),
        "the demo's schema was not dropped"
    );
}

/// Eight refunds at once under one key: one refund row, one call that reached the card
/// provider's refund, one answer; a refund of more than the payment has left is `422`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_retries_of_a_refund_refund_once() {
    let service =
        Service::start("refund", Duration::from_secs(3600), Duration::from_secs(60)).await;
    let client = reqwest::Client::new();
    let paid = service.pay(&client, "shop-1", 1000).await;
    let url = format!("{}/{}/refunds", service.url(), paid.id);
    let body = NewRefund { cents: 300 };
    let answers = futures::future::join_all(
        (0..8).map(|_| settle(&client, &url, "shop-1", "refund-1", &body)),
    )
    .await;
    assert_eq!(
        answers.iter().filter(|(_, replayed, _)| !replayed).count(),
        1,
        "{answers:?}"
    );
    for (status, _, text) in &answers {
        assert_eq!(*status, StatusCode::CREATED, "{text}");
        assert_eq!(text, &answers[0].2, "two different answers");
    }
    let refund: Refund = serde_json::from_str(&answers[0].2).unwrap();
    assert_eq!((refund.payment, refund.cents), (paid.id, 300));
    assert_eq!(service.refunds(paid.id).await, (1, 1, 1));

    // 700 cents are left: more is refused, and nothing is refunded.
    let (status, _, text) = settle(
        &client,
        &url,
        "shop-1",
        "refund-2",
        &NewRefund { cents: 701 },
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
    assert!(text.contains("700 cents left"), "{text}");
    // Another merchant's payment is not found.
    let (status, _, _) = settle(&client, &url, "shop-2", "refund-1", &NewRefund { cents: 1 }).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(service.refunds(paid.id).await, (1, 1, 1));
    service.stop().await;
}

/// The card provider is down when a refund is asked for: the request is answered `503`, the
/// refund row stays written, and the completer finishes the refund on its own (the provider
/// refunds once); a retry of the key is then answered with that refund.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_the_provider_failed_is_finished_by_the_completer() {
    let service = Service::start(
        "completer",
        Duration::from_secs(3600),
        Duration::from_secs(60),
    )
    .await;
    let client = reqwest::Client::new();
    let paid = service.pay(&client, "shop-1", 500).await;
    let url = format!("{}/{}/refunds", service.url(), paid.id);
    let body = NewRefund { cents: 200 };
    service
        .running
        .provider
        .outage
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let (status, _, text) = settle(&client, &url, "shop-1", "refund-1", &body).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert_eq!(
        service.refunds(paid.id).await,
        (1, 0, 0),
        "written, not refunded"
    );

    // The completer takes the failed refund up after 200 ms and runs its last two phases.
    let deadline = Instant::now() + Duration::from_secs(60);
    while service.refunds(paid.id).await != (1, 1, 1) {
        assert!(
            Instant::now() < deadline,
            "the completer did not finish the refund: {:?}",
            service.refunds(paid.id).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, replayed, text) = settle(&client, &url, "shop-1", "refund-1", &body).await;
    assert_eq!(status, StatusCode::CREATED, "{text}");
    assert!(replayed, "the retry ran the refund again");
    let refund: Refund = serde_json::from_str(&text).unwrap();
    assert_eq!((refund.payment, refund.cents), (paid.id, 200));
    assert_eq!(service.refunds(paid.id).await, (1, 1, 1));
    service.stop().await;
}
