//! The crash campaign: the real `rides-api` rides service SIGKILLed at every crash point of a
//! booking (inside each phase, between phases, after the charge and before its recovery
//! point, after the completion and before the answer) and at random moments, then started
//! again on the same database, with the real payment service (a second process behind
//! `idempotency-tower`) running throughout.
//!
//! Each booking is finished once by the client's retries (the service restarted without its
//! completer) and, in a second series, by the completer alone (nobody retries until the
//! booking is done; then one request must get it replayed). For every key: one ride, exactly
//! one charge recorded by the payment service, one receipt in the outbox, and the same answer
//! to every retry.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idempotency_core::IdempotencyKey;
use idempotency_reqwest::{
    IdempotencyMiddleware, IdempotentRequestExt, IdempotentResponseExt, RetryPolicy,
};
use idempotency_sqlite::rusqlite::{self, OptionalExtension};
use rand::Rng;
use rides_api::crash::POINTS;
use rides_api::rides::BookRide;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Kills at each crash point, per series (times `RIDES_CAMPAIGN_SCALE`, default 1).
const PER_POINT: usize = 3;
/// Kills at a random moment, per series (times the scale).
const RANDOM: usize = 8;

/// `RIDES_CAMPAIGN_SCALE`: how many times the default number of kills to run.
fn scale() -> usize {
    std::env::var("RIDES_CAMPAIGN_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
}
/// Generous bounds for what normally takes milliseconds.
const PATIENCE: Duration = Duration::from_secs(60);

/// A child process of the binary, its stdout lines on a channel. Dropping it kills it.
struct Process {
    child: Child,
    url: String,
    lines: mpsc::Receiver<String>,
}

impl Process {
    fn start(what: &str, env: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rides-api"));
        cmd.arg(what)
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start rides-api");
        let stdout = child.stdout.take().unwrap();
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        let first = lines
            .recv_timeout(PATIENCE)
            .unwrap_or_else(|_| panic!("{what} did not start"));
        let url = first
            .rsplit(' ')
            .next()
            .filter(|u| u.starts_with("http://"))
            .unwrap_or_else(|| panic!("{what}: unexpected first line {first:?}"))
            .to_owned();
        Self { child, url, lines }
    }

    /// SIGKILL, and reap it.
    fn kill(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// Waits for the line `point POINT KEY`; the crash points seen before it are returned too.
    fn wait_for(&self, point: &str, key: &str) -> Vec<String> {
        let want = format!("point {point} {key}");
        let deadline = Instant::now() + PATIENCE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("never reached {point} (saw {seen:?})"));
            seen.push(line.clone());
            if line == want {
                return seen;
            }
        }
    }

    /// The crash points the dead process printed and the test has not read yet: every line
    /// up to the end of its stdout.
    fn drain(&self) -> Vec<String> {
        let mut rest = Vec::new();
        loop {
            match self.lines.recv_timeout(PATIENCE) {
                Ok(line) => rest.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => return rest,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("the dead process's stdout never ended")
                }
            }
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// (rides of `key`, charges of its ride in the payment service, receipts of `key`).
fn counts(rides: &Path, payments: &Path, key: &str) -> (i64, i64, i64) {
    let open = |p: &Path| {
        let c = rusqlite::Connection::open(p).unwrap();
        c.busy_timeout(Duration::from_secs(10)).unwrap();
        c
    };
    let (r, p) = (open(rides), open(payments));
    let count = |c: &rusqlite::Connection, sql: &str, arg: &dyn rusqlite::ToSql| -> i64 {
        c.query_row(sql, [arg], |row| row.get(0)).unwrap()
    };
    let ride: Option<i64> = r
        .query_row("SELECT id FROM rides WHERE key = ?1", [key], |row| {
            row.get(0)
        })
        .optional()
        .unwrap();
    (
        count(&r, "SELECT count(*) FROM rides WHERE key = ?1", &key),
        ride.map_or(0, |ride| {
            count(&p, "SELECT count(*) FROM charges WHERE ride = ?1", &ride)
        }),
        count(&r, "SELECT count(*) FROM outbox WHERE key = ?1", &key),
    )
}

fn total(db: &Path, table: &str) -> i64 {
    let c = rusqlite::Connection::open(db).unwrap();
    c.busy_timeout(Duration::from_secs(10)).unwrap();
    c.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
        .unwrap()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Finisher {
    ClientRetries,
    CompleterAlone,
}

#[derive(Debug, Clone, Copy)]
enum Kill {
    At(&'static str),
    After(Duration),
}

#[derive(Debug, Default)]
struct Figures {
    operations: usize,
    /// By the last crash point the killed process reached ("before any" if none).
    kills: BTreeMap<String, usize>,
    /// Killed after the ride committed and before the booking completed: resumed, not
    /// restarted.
    resumed: usize,
    /// Killed after the payment service charged and before the charge's recovery point
    /// committed: the charge asked for again, answered with the first.
    charged_before_kill: usize,
    finished_by_completer: usize,
    retries: u32,
}

struct World {
    _dir: tempfile::TempDir,
    rides_db: PathBuf,
    payments_db: PathBuf,
    payments: Process,
    client: reqwest_middleware::ClientWithMiddleware,
}

impl World {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (rides_db, payments_db) = (dir.path().join("rides.db"), dir.path().join("payments.db"));
        // A short lease: a charge whose connection a kill closed mid-claim holds its key no
        // longer than that.
        let payments = Process::start(
            "payments",
            &[
                ("PAYMENTS_DB", payments_db.display().to_string()),
                ("PAYMENTS_LEASE_MS", "500".to_owned()),
            ],
        );
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(
                IdempotencyMiddleware::new().retry_policy(
                    RetryPolicy::default()
                        .max_attempts(100)
                        .deadline(PATIENCE)
                        .backoff(Duration::from_millis(50), Duration::from_millis(500)),
                ),
            )
            .build();
        Self {
            _dir: dir,
            rides_db,
            payments_db,
            payments,
            client,
        }
    }

    fn rides(&self, pause_ms: Option<u64>, hold_at: Option<&str>, completer: bool) -> Process {
        let mut env = vec![
            ("RIDES_DB", self.rides_db.display().to_string()),
            ("PAYMENTS_URL", self.payments.url.clone()),
            ("RIDES_LEASE_MS", "500".to_owned()),
            (
                "RIDES_COMPLETER",
                if completer { "on" } else { "off" }.to_owned(),
            ),
        ];
        if let Some(ms) = pause_ms {
            env.push(("RIDES_PAUSE_MS", ms.to_string()));
        }
        if let Some(point) = hold_at {
            env.push(("RIDES_HOLD_AT", point.to_owned()));
        }
        Process::start("rides", &env)
    }

    fn counts(&self, key: &str) -> (i64, i64, i64) {
        counts(&self.rides_db, &self.payments_db, key)
    }

    /// Sends the booking with `key` through our client half until it is answered for good:
    /// (the answer's body, whether it was a replay, attempts).
    async fn book(&self, url: &str, key: &str, request: &BookRide) -> (String, bool, u32) {
        let resp = self
            .client
            .post(format!("{url}/rides"))
            .bearer_auth("rider-1")
            .json(request)
            .idempotency_key(IdempotencyKey::new(key).unwrap())
            .send()
            .await
            .unwrap_or_else(|e| panic!("{key}: the booking was not answered: {e}"));
        let outcome = resp.idempotency().unwrap().clone();
        assert_eq!(resp.status(), 201, "{key}");
        (
            resp.text().await.unwrap(),
            outcome.replayed(),
            outcome.attempts(),
        )
    }

    /// One booking: started on a rides service that is killed as `kill` says, then finished
    /// as `finisher` says; checked.
    async fn run(&self, n: usize, kill: Kill, finisher: Finisher, figures: &mut Figures) {
        let key = format!("{finisher:?}-{n}");
        let request = BookRide {
            route: format!("stop {n} to the station"),
            amount: 1000 + n as u32,
        };
        // At a crash point, the service stops there until it is killed; for a kill at a
        // random moment, it pauses briefly at each point, so kills land throughout.
        let mut doomed = match kill {
            Kill::At(point) => self.rides(Some(0), Some(point), false),
            Kill::After(_) => self.rides(Some(2), None, false),
        };
        let first = tokio::spawn({
            let (url, key, request) = (doomed.url.clone(), key.clone(), request.clone());
            async move {
                reqwest::Client::new()
                    .post(format!("{url}/rides"))
                    .bearer_auth("rider-1")
                    .header("idempotency-key", key)
                    .json(&request)
                    .send()
                    .await
                    .ok()
                    .map(|r| r.status())
            }
        });
        let mut seen = match kill {
            Kill::At(point) => doomed.wait_for(point, &key),
            Kill::After(delay) => {
                tokio::time::sleep(delay).await;
                Vec::new()
            }
        };
        doomed.kill();
        seen.extend(doomed.drain());
        let answered = first.await.unwrap();
        let last = seen
            .iter()
            .filter_map(|l| l.strip_prefix("point "))
            .filter_map(|l| l.strip_suffix(&format!(" {key}")))
            .next_back()
            .unwrap_or("before any")
            .to_owned();
        let last = match answered {
            Some(status) => format!("after the answer ({status})"),
            None => last,
        };
        *figures.kills.entry(last.clone()).or_default() += 1;
        let at_kill = self.counts(&key);
        assert!(
            at_kill.0 <= 1 && at_kill.1 <= 1 && at_kill.2 <= 1,
            "{key}: killed at {last}: {at_kill:?}"
        );
        if at_kill.0 == 1 && at_kill.2 == 0 {
            figures.resumed += 1;
        }
        if last == "charge:called" {
            figures.charged_before_kill += 1;
        }
        let ride_committed = at_kill.0 == 1;
        let service = self.rides(None, None, finisher == Finisher::CompleterAlone);
        if finisher == Finisher::CompleterAlone && ride_committed {
            // Nobody asks: the completer finishes the booking once the dead holder's lease
            // has passed.
            let started = Instant::now();
            while self.counts(&key).2 == 0 {
                assert!(
                    started.elapsed() < PATIENCE,
                    "{key}: killed at {last}, the completer did not finish it"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if at_kill.2 == 0 {
                figures.finished_by_completer += 1;
            }
        }
        let (body, replayed, attempts) = self.book(&service.url, &key, &request).await;
        figures.retries += attempts;
        if finisher == Finisher::CompleterAlone && ride_committed {
            assert!(replayed, "{key}: the completer's booking was not replayed");
        }
        let (again, replayed_again, _) = self.book(&service.url, &key, &request).await;
        assert!(replayed_again, "{key}: the second retry was not a replay");
        assert_eq!(again, body, "{key}: two retries answered differently");
        assert_eq!(
            self.counts(&key),
            (1, 1, 1),
            "{key}: killed at {last}: rides, charges, receipts"
        );
        figures.operations += 1;
        drop(service);
    }
}

async fn campaign(finisher: Finisher, points: &[&'static str]) -> Figures {
    let world = World::new();
    let mut figures = Figures::default();
    let mut kills: Vec<Kill> = points
        .iter()
        .flat_map(|p| std::iter::repeat_n(Kill::At(p), PER_POINT * scale()))
        .collect();
    // A booking takes a few tens of milliseconds with a 2 ms pause at each point.
    let mut rng = rand::thread_rng();
    kills.extend(
        (0..RANDOM * scale()).map(|_| Kill::After(Duration::from_millis(rng.gen_range(1..40)))),
    );
    for (n, kill) in kills.into_iter().enumerate() {
        world.run(n, kill, finisher, &mut figures).await;
    }
    let keys = figures.operations as i64;
    assert_eq!(total(&world.rides_db, "rides"), keys, "rides in all");
    assert_eq!(total(&world.payments_db, "charges"), keys, "charges in all");
    assert_eq!(total(&world.rides_db, "outbox"), keys, "receipts in all");
    println!("{finisher:?}: {figures:#?}");
    figures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_booking_killed_anywhere_is_finished_once_by_client_retries() {
    let figures = campaign(Finisher::ClientRetries, &POINTS).await;
    assert!(figures.resumed >= PER_POINT * 3, "{figures:?}");
    assert!(figures.charged_before_kill >= PER_POINT, "{figures:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_booking_killed_mid_way_is_finished_once_by_the_completer_alone() {
    // The points after the first phase committed and before the completion: what a
    // completer can take over.
    let figures = campaign(Finisher::CompleterAlone, &POINTS[1..5]).await;
    assert!(
        figures.finished_by_completer >= PER_POINT * 4,
        "{figures:?}"
    );
}
