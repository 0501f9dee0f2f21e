//! The consumer is SIGKILLed in the middle of batches, again and again, and restarted; at the
//! end every transfer has exactly one effect, and the balances agree with the effects.
//!
//! Runs against the NATS JetStream server on 127.0.0.1:4222 and the Postgres server on
//! 127.0.0.1:5432 (`bash .ci/services` starts both), on a stream and a schema of its own.

use ledger_consumer::{transfers, BatchStats, Config, Ledger};
use rand::Rng;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// Transfers published (each tenth twice).
const TRANSFERS: usize = 3000;
/// Kills that must land inside a batch (after it began, before it was acknowledged).
const MID_BATCH_KILLS: usize = 5;
/// The bound on the whole test; it ends as soon as its conditions have happened.
const DEADLINE: Duration = Duration::from_secs(300);

fn config(suffix: &str) -> Config {
    Config {
        nats_url: "127.0.0.1:4222".to_owned(),
        postgres_url: std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        stream: format!("LEDGERTEST_{suffix}"),
        schema: format!("ledger_test_{suffix}"),
        batch: 50,
        concurrency: 8,
        lease: Duration::from_millis(1000),
        ack_wait: Duration::from_millis(2000),
        work_delay: Duration::from_millis(2),
    }
}

enum Line {
    Begin,
    End(BatchStats),
}

struct Consumer {
    child: Child,
    lines: mpsc::UnboundedReceiver<Line>,
}

fn spawn(config: &Config) -> Consumer {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ledger-consumer"))
        .arg("consume")
        .env("LEDGER_NATS_URL", &config.nats_url)
        .env("LEDGER_POSTGRES_URL", &config.postgres_url)
        .env("LEDGER_STREAM", &config.stream)
        .env("LEDGER_SCHEMA", &config.schema)
        .env("LEDGER_BATCH", config.batch.to_string())
        .env("LEDGER_CONCURRENCY", config.concurrency.to_string())
        .env("LEDGER_LEASE_MS", config.lease.as_millis().to_string())
        .env(
            "LEDGER_ACK_WAIT_MS",
            config.ack_wait.as_millis().to_string(),
        )
        .env(
            "LEDGER_WORK_DELAY_MS",
            config.work_delay.as_millis().to_string(),
        )
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("the consumer starts");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, lines) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut reader = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = reader.next_line().await {
            let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
            let parsed = match v["event"].as_str() {
                Some("batch_begin") => Line::Begin,
                Some("batch_end") => {
                    Line::End(serde_json::from_value(v["stats"].clone()).expect("batch stats"))
                }
                other => panic!("unexpected line {other:?}: {line}"),
            };
            if tx.send(parsed).is_err() {
                return;
            }
        }
    });
    Consumer { child, lines }
}

impl Consumer {
    /// SIGKILLs the consumer, then reads what it printed before it died: the stats of the
    /// batches it finished, and whether it died inside a batch.
    async fn kill(mut self, totals: &mut BatchStats, mut in_batch: bool) -> bool {
        self.child.start_kill().expect("SIGKILL");
        self.child.wait().await.expect("the consumer is reaped");
        while let Some(line) = self.lines.recv().await {
            match line {
                Line::Begin => in_batch = true,
                Line::End(stats) => {
                    *totals += stats;
                    in_batch = false;
                }
            }
        }
        in_batch
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transfer_applies_once_through_kills_mid_batch() {
    let suffix = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let config = config(&suffix);
    let ledger = Ledger::prepare(config.clone()).await.expect(
        "NATS JetStream on 127.0.0.1:4222 and Postgres on 127.0.0.1:5432 (bash .ci/services)",
    );
    let published = transfers(&suffix, TRANSFERS, 10);
    ledger.publish(&published).await.expect("published");
    let mut seen = std::collections::HashSet::new();
    let expected_total: i64 = published
        .iter()
        .filter(|t| seen.insert(t.id.clone()))
        .map(|t| t.amount_cents)
        .sum();

    let started = Instant::now();
    let mut rng = rand::thread_rng();
    let mut totals = BatchStats::default();
    let (mut kills, mut mid_batch_kills) = (0usize, 0usize);
    // Kill, restart, kill again until enough kills landed inside a batch and a restarted
    // consumer has met a message that a killed one had applied but not acknowledged.
    while mid_batch_kills < MID_BATCH_KILLS || totals.redelivered_replayed == 0 {
        assert!(
            started.elapsed() < DEADLINE,
            "after {kills} kills ({mid_batch_kills} inside a batch) and {totals:?}, the \
             conditions still have not happened"
        );
        assert!(
            ledger.unacknowledged().await.expect("consumer info") > 0,
            "the stream ran dry before the kills were done: publish more"
        );
        let mut consumer = spawn(&config);
        let batches_first = rng.gen_range(0..3);
        let mut ended = 0;
        loop {
            let line = tokio::time::timeout(Duration::from_secs(60), consumer.lines.recv())
                .await
                .expect("the consumer prints a line within a minute")
                .expect("the consumer is running");
            match line {
                Line::Begin if ended >= batches_first => break,
                Line::Begin => {}
                Line::End(stats) => {
                    totals += stats;
                    ended += 1;
                }
            }
        }
        // Inside a batch: let some of its transfers commit, then kill.
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..40))).await;
        kills += 1;
        if consumer.kill(&mut totals, true).await {
            mid_batch_kills += 1;
        }
    }

    // A last consumer drains the stream.
    let mut consumer = spawn(&config);
    loop {
        assert!(
            started.elapsed() < DEADLINE,
            "the last consumer did not drain the stream: {totals:?}"
        );
        while let Ok(line) = consumer.lines.try_recv() {
            if let Line::End(stats) = line {
                totals += stats;
            }
        }
        let report = ledger.report().await.expect("report");
        if ledger.unacknowledged().await.expect("consumer info") == 0
            && report.transfers == TRANSFERS as i64
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    consumer.kill(&mut totals, false).await;

    let report = ledger.report().await.expect("report");
    eprintln!(
        "ledger consumer: {} messages published ({TRANSFERS} transfers), {kills} kills \
         ({mid_batch_kills} inside a batch); deliveries seen in finished batches: {} \
         ({} redelivered), duplicates suppressed: {} ({} redelivered after a kill), \
         handed back in progress: {}, retried: {}; effects: {}",
        published.len(),
        totals.messages,
        totals.redelivered,
        totals.duplicates_suppressed,
        totals.redelivered_replayed,
        totals.in_progress,
        totals.retried,
        report.effects,
    );
    assert!(
        report.applied_twice.is_empty(),
        "transfers applied twice: {:?}",
        report.applied_twice
    );
    assert_eq!(report.effects, TRANSFERS as i64, "one effect per transfer");
    assert_eq!(report.transfers, TRANSFERS as i64);
    assert_eq!(report.effects_total, expected_total);
    assert_eq!(report.balance_total, expected_total, "balances agree");
    assert_eq!(totals.rejected, 0, "no message was terminated");
    assert!(
        totals.duplicates_suppressed > 0,
        "producer retries and redeliveries were answered from stored outcomes: {totals:?}"
    );
    ledger.remove().await.expect("clean up");
}
