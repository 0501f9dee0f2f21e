//! A queue consumer that applies each transfer of a NATS JetStream stream to a Postgres
//! ledger exactly once, through redeliveries, producer retries and crashes.
//!
//! Each delivered message's id is its idempotency key. Its effect (a row in `effects`, a
//! balance moved in `balances`) and the completion of its key commit in one Postgres
//! transaction ([`PostgresIdempotency::run_in_transaction`]), and the batch is acknowledged
//! only after every message of it is stored. A consumer killed anywhere leaves either both
//! the effect and the completion (the redelivery is answered from the stored outcome and
//! acknowledged) or neither (the redelivery runs it, once the dead holder's lease has passed).
//!
//! The consumer prints one JSON line per batch on stdout (`batch_begin`, then `batch_end`
//! with what became of its messages), which the crash test reads.

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::{FutureExt, StreamExt};
use idempotency_core::{Answer, Fingerprint, Idempotency, IdempotencyKey, Refusal, Scope};
use idempotency_postgres::sqlx::{self, PgConnection};
use idempotency_postgres::{PostgresIdempotency, PostgresStore};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Any error of the example's setup.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The durable consumer's name on the stream.
pub const CONSUMER: &str = "ledger";

/// Where the consumer reads and writes, and how it runs; every field has an environment
/// variable (see [`Config::from_env`]).
#[derive(Clone, Debug)]
pub struct Config {
    /// `LEDGER_NATS_URL` (default `127.0.0.1:4222`).
    pub nats_url: String,
    /// `LEDGER_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
    pub postgres_url: String,
    /// `LEDGER_STREAM`: the JetStream stream (default `LEDGER`); its subject is
    /// `<stream in lower case>.transfers`.
    pub stream: String,
    /// `LEDGER_SCHEMA`: the Postgres schema of the ledger's tables and its idempotency keys
    /// (default `ledger`).
    pub schema: String,
    /// `LEDGER_BATCH`: the most messages fetched at once (default 50).
    pub batch: usize,
    /// `LEDGER_CONCURRENCY`: how many messages of a batch are applied at once (default 8).
    pub concurrency: usize,
    /// `LEDGER_LEASE_MS`: the lease on a message's key while it is applied (default 5000):
    /// how long a redelivery waits after a consumer died holding it.
    pub lease: Duration,
    /// `LEDGER_ACK_WAIT_MS`: how long JetStream waits for an acknowledgement before it
    /// delivers a message again (default 10000).
    pub ack_wait: Duration,
    /// `LEDGER_WORK_DELAY_MS`: a pause inside each transfer's transaction, between its two
    /// writes (default 0): a slow effect, so that a crash lands inside one.
    pub work_delay: Duration,
}

impl Config {
    /// The configuration from the environment, with the defaults above.
    pub fn from_env() -> Result<Self, BoxError> {
        fn var(name: &str, default: &str) -> String {
            std::env::var(name).unwrap_or_else(|_| default.to_owned())
        }
        fn number(name: &str, default: u64) -> Result<u64, BoxError> {
            match std::env::var(name) {
                Ok(v) => v
                    .parse()
                    .map_err(|e| format!("{name}={v} is not a number: {e}").into()),
                Err(_) => Ok(default),
            }
        }
        Ok(Self {
            nats_url: var("LEDGER_NATS_URL", "127.0.0.1:4222"),
            postgres_url: var(
                "LEDGER_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            stream: var("LEDGER_STREAM", "LEDGER"),
            schema: var("LEDGER_SCHEMA", "ledger"),
            batch: usize::try_from(number("LEDGER_BATCH", 50)?)?.max(1),
            concurrency: usize::try_from(number("LEDGER_CONCURRENCY", 8)?)?.max(1),
            lease: Duration::from_millis(number("LEDGER_LEASE_MS", 5000)?),
            ack_wait: Duration::from_millis(number("LEDGER_ACK_WAIT_MS", 10_000)?),
            work_delay: Duration::from_millis(number("LEDGER_WORK_DELAY_MS", 0)?),
        })
    }

    /// The subject transfers are published on.
    pub fn subject(&self) -> String {
        format!("{}.transfers", self.stream.to_lowercase())
    }
}

/// One message: move `amount_cents` into `account`. `id` is the producer's id for it, the
/// same on every publish of the same transfer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    /// The transfer's id: the idempotency key.
    pub id: String,
    /// The account credited (debited when negative).
    pub account: String,
    /// The amount, in cents.
    pub amount_cents: i64,
}

/// What a transfer's first application answered, and every redelivery replays.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    /// The account's balance right after this transfer.
    pub balance_after: i64,
}

/// What a batch did, as printed in its `batch_end` line.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BatchStats {
    /// Messages in the batch.
    pub messages: usize,
    /// Of those, deliveries after the first (JetStream's delivery count above 1).
    pub redelivered: usize,
    /// Transfers applied in this batch (effect and completion committed).
    pub applied: usize,
    /// Messages answered from a stored outcome: nothing was applied again.
    pub duplicates_suppressed: usize,
    /// Of those, redeliveries: a message applied and committed by a consumer that died
    /// before it acknowledged it (without the key, applied twice).
    pub redelivered_replayed: usize,
    /// Messages whose key another consumer held (or a dead one, until its lease passes):
    /// handed back for a later delivery.
    pub in_progress: usize,
    /// Messages handed back after an error (the transaction rolled back).
    pub retried: usize,
    /// Messages that can never apply (not a transfer, or an id reused for another
    /// payload): terminated.
    pub rejected: usize,
}

/// `n` transfers of run `run` over 20 accounts, each `duplicate_every`-th published twice
/// (the second publish is a producer's retry: the same id and payload); `0` publishes each
/// once. Amounts vary with the index, so a transfer applied twice shows in the balances.
pub fn transfers(run: &str, n: usize, duplicate_every: usize) -> Vec<Transfer> {
    let mut out = Vec::with_capacity(n + n / duplicate_every.max(1));
    for i in 0..n {
        let t = Transfer {
            id: format!("{run}-{i}"),
            account: format!("acct-{}", i % 20),
            amount_cents: i64::try_from(i % 97).unwrap_or(0) + 1,
        };
        if duplicate_every > 0 && i % duplicate_every == 0 {
            out.push(t.clone());
        }
        out.push(t);
    }
    out
}

/// The ledger's figures, from its tables.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Rows in `effects`: one per application of a transfer.
    pub effects: i64,
    /// Distinct transfer ids among them.
    pub transfers: i64,
    /// Transfer ids with more than one effect row (applied twice): must be empty.
    pub applied_twice: Vec<String>,
    /// The sum of every balance.
    pub balance_total: i64,
    /// The sum of the amounts in `effects`.
    pub effects_total: i64,
}

impl std::ops::AddAssign for BatchStats {
    fn add_assign(&mut self, o: Self) {
        self.messages += o.messages;
        self.redelivered += o.redelivered;
        self.applied += o.applied;
        self.duplicates_suppressed += o.duplicates_suppressed;
        self.redelivered_replayed += o.redelivered_replayed;
        self.in_progress += o.in_progress;
        self.retried += o.retried;
        self.rejected += o.rejected;
    }
}

/// The ledger's tables, its idempotency store and the stream: connected and created.
#[derive(Debug)]
pub struct Ledger {
    config: Config,
    idempotency: PostgresIdempotency,
    scope: Scope,
    jetstream: jetstream::Context,
}

impl Ledger {
    /// Connects to NATS and Postgres, and creates what is missing: the schema, its tables
    /// (`effects`, `balances` and the idempotency keys), the stream and its durable consumer.
    pub async fn prepare(config: Config) -> Result<Self, BoxError> {
        let client = async_nats::connect(&config.nats_url).await?;
        let jetstream = jetstream::new(client);
        let stream = jetstream
            .get_or_create_stream(jetstream::stream::Config {
                name: config.stream.clone(),
                subjects: vec![config.subject()],
                storage: jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await?;
        stream
            .get_or_create_consumer(
                CONSUMER,
                pull::Config {
                    durable_name: Some(CONSUMER.to_owned()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    max_ack_pending: 10_000,
                    ..Default::default()
                },
            )
            .await?;

        let store = PostgresStore::builder()
            .schema(&config.schema)
            .table("idempotency_keys")
            .connect(&config.postgres_url)
            .await?;
        let schema = &config.schema;
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
             CREATE TABLE IF NOT EXISTS \"{schema}\".effects (seq bigserial PRIMARY KEY,
                 message_id text NOT NULL, account text NOT NULL, amount_cents bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS \"{schema}\".balances (account text PRIMARY KEY,
                 cents bigint NOT NULL);"
        ))
        .execute(store.pool())
        .await?;
        store.migrate().await?;
        Ok(Self {
            idempotency: Idempotency::builder(store)
                .lease(config.lease)
                .retention(Duration::from_secs(7 * 24 * 3600))
                .build()?,
            scope: Scope::new("ledger-transfers")?,
            config,
            jetstream,
        })
    }

    /// The Postgres store's pool (for reports).
    pub fn pool(&self) -> &sqlx::PgPool {
        self.idempotency.store().pool()
    }

    /// The ledger's figures (see [`Report`]).
    pub async fn report(&self) -> Result<Report, BoxError> {
        let schema = &self.config.schema;
        let pool = self.pool();
        let (effects, transfers, effects_total): (i64, i64, Option<i64>) =
            sqlx::query_as(&format!(
                "SELECT count(*), count(DISTINCT message_id), sum(amount_cents)::bigint
                 FROM \"{schema}\".effects"
            ))
            .fetch_one(pool)
            .await?;
        let applied_twice: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT message_id FROM \"{schema}\".effects
             GROUP BY message_id HAVING count(*) > 1 ORDER BY message_id"
        ))
        .fetch_all(pool)
        .await?;
        let balance_total: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT sum(cents)::bigint FROM \"{schema}\".balances"
        ))
        .fetch_one(pool)
        .await?;
        Ok(Report {
            effects,
            transfers,
            applied_twice,
            balance_total: balance_total.unwrap_or(0),
            effects_total: effects_total.unwrap_or(0),
        })
    }

    /// Publishes `transfers` (each as one message, in order) and waits for the stream to
    /// store them.
    pub async fn publish(&self, transfers: &[Transfer]) -> Result<(), BoxError> {
        let subject = self.config.subject();
        let mut acks = Vec::with_capacity(transfers.len());
        for t in transfers {
            let body = serde_json::to_vec(t)?;
            acks.push(self.jetstream.publish(subject.clone(), body.into()).await?);
        }
        for ack in acks {
            ack.await?;
        }
        Ok(())
    }

    /// Messages the durable consumer has not had acknowledged yet: waiting for a first
    /// delivery, and delivered but not acknowledged.
    pub async fn unacknowledged(&self) -> Result<u64, BoxError> {
        let mut consumer: jetstream::consumer::PullConsumer = self
            .jetstream
            .get_consumer_from_stream(CONSUMER, &self.config.stream)
            .await?;
        let info = consumer.info().await?;
        Ok(info.num_pending + u64::try_from(info.num_ack_pending)?)
    }

    /// Deletes the stream (with its consumer) and drops the schema: what a test leaves.
    pub async fn remove(self) -> Result<(), BoxError> {
        self.jetstream.delete_stream(&self.config.stream).await?;
        sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.config.schema
        ))
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Fetches and applies batches until `stop` resolves, printing a `batch_begin` and a
    /// `batch_end` line per batch.
    pub async fn consume(
        &self,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<(), BoxError> {
        let consumer: jetstream::consumer::PullConsumer = self
            .jetstream
            .get_consumer_from_stream(CONSUMER, &self.config.stream)
            .await?;
        // Expired keys are purged in the background for as long as the consumer runs.
        let maintenance = self.idempotency.maintain().spawn();
        let consumed = self.consume_until(&consumer, stop).await;
        maintenance.shutdown().await;
        consumed
    }

    async fn consume_until(
        &self,
        consumer: &jetstream::consumer::PullConsumer,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<(), BoxError> {
        let mut stop = std::pin::pin!(stop);
        loop {
            let fetch = consumer
                .fetch()
                .max_messages(self.config.batch)
                .expires(Duration::from_millis(500))
                .messages();
            let mut messages = tokio::select! {
                _ = &mut stop => return Ok(()),
                m = fetch => m?,
            };
            let mut batch = Vec::new();
            while let Some(message) = messages.next().await {
                batch.push(message?);
            }
            if batch.is_empty() {
                continue;
            }
            println!(
                "{}",
                serde_json::json!({"event": "batch_begin", "messages": batch.len()})
            );
            let stats = self.apply_batch(batch).await?;
            println!(
                "{}",
                serde_json::json!({"event": "batch_end", "stats": stats})
            );
        }
    }

    /// Applies a batch's messages, `concurrency` at a time, then acknowledges (or hands back)
    /// each of them.
    async fn apply_batch(&self, batch: Vec<jetstream::Message>) -> Result<BatchStats, BoxError> {
        let mut stats = BatchStats {
            messages: batch.len(),
            ..BatchStats::default()
        };
        let handled: Vec<(jetstream::Message, Handled)> = futures::stream::iter(batch)
            .map(|message| async move {
                let handled = self.handle(&message).await;
                (message, handled)
            })
            .buffered(self.config.concurrency)
            .collect()
            .await;
        for (message, handled) in handled {
            let redelivered = message.info().map(|i| i.delivered > 1).unwrap_or(false);
            stats.redelivered += usize::from(redelivered);
            let ack = match handled {
                Handled::Applied => {
                    stats.applied += 1;
                    AckKind::Ack
                }
                Handled::Replayed => {
                    stats.duplicates_suppressed += 1;
                    stats.redelivered_replayed += usize::from(redelivered);
                    AckKind::Ack
                }
                Handled::InProgress(after) => {
                    stats.in_progress += 1;
                    AckKind::Nak(Some(after))
                }
                Handled::Retry => {
                    stats.retried += 1;
                    AckKind::Nak(Some(Duration::from_millis(200)))
                }
                Handled::Rejected(why) => {
                    stats.rejected += 1;
                    tracing::warn!(%why, "message terminated");
                    AckKind::Term
                }
            };
            message.ack_with(ack).await?;
        }
        Ok(stats)
    }

    /// Applies one message's transfer, once per id.
    async fn handle(&self, message: &jetstream::Message) -> Handled {
        let transfer: Transfer = match serde_json::from_slice(&message.payload) {
            Ok(t) => t,
            Err(e) => return Handled::Rejected(format!("not a transfer: {e}")),
        };
        // The same key for the transfer's id in every process, whatever the id looks like.
        let key = IdempotencyKey::derive("ledger-transfers", &transfer.id);
        let fingerprint = Fingerprint::from_bytes(&message.payload);
        let schema = self.config.schema.clone();
        let delay = self.config.work_delay;
        let run = self
            .idempotency
            .run_in_transaction(&key, &self.scope, &fingerprint, |conn, _ctx| {
                // A transfer is never refused: its only errors are the database's, after
                // which its transaction runs again (a conflict) or the key is released.
                let applied = apply(conn, schema.clone(), transfer.clone(), delay);
                applied.map(|applied| applied.map(Ok::<_, String>)).boxed()
            })
            .await;
        match run {
            Ok(Answer::Executed(Ok(_))) => Handled::Applied,
            Ok(Answer::Replayed(Ok(_))) => Handled::Replayed,
            Ok(Answer::Executed(Err(e)) | Answer::Replayed(Err(e))) => {
                tracing::warn!(error = %e, id = %transfer.id, "transfer rolled back");
                Handled::Retry
            }
            Ok(Answer::Refused(Refusal::InProgress { retry_after })) => {
                Handled::InProgress(retry_after)
            }
            // A key reused, failed for good, or its outcome lost: never applied again.
            Ok(Answer::Refused(refusal)) => Handled::Rejected(refusal.to_string()),
            Err(e) => {
                tracing::warn!(error = %e, id = %transfer.id, "transfer not applied");
                Handled::Retry
            }
        }
    }
}

/// What became of one message.
enum Handled {
    Applied,
    Replayed,
    InProgress(Duration),
    Retry,
    Rejected(String),
}

/// The transfer's effect, inside the transaction its completion commits in.
async fn apply(
    conn: &mut PgConnection,
    schema: String,
    t: Transfer,
    delay: Duration,
) -> Result<Applied, sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO \"{schema}\".effects (message_id, account, amount_cents) VALUES ($1, $2, $3)"
    ))
    .bind(&t.id)
    .bind(&t.account)
    .bind(t.amount_cents)
    .execute(&mut *conn)
    .await?;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let balance_after: i64 = sqlx::query_scalar(&format!(
        "INSERT INTO \"{schema}\".balances (account, cents) VALUES ($1, $2)
         ON CONFLICT (account) DO UPDATE SET cents = balances.cents + EXCLUDED.cents
         RETURNING cents"
    ))
    .bind(&t.account)
    .bind(t.amount_cents)
    .fetch_one(&mut *conn)
    .await?;
    Ok(Applied { balance_after })
}
