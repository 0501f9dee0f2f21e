//! `cargo run -p rides-api`: the demo. It starts the payment service and the rides service as
//! two processes, makes the rides service crash after the charge, restarts it, and shows the
//! booking resumed (by the client's retry, then, for a second booking, by the completer
//! alone), never charged twice.
//!
//! `rides-api payments` and `rides-api rides` run one service each (see the crate README for
//! their variables).

use idempotency_core::IdempotencyKey;
use idempotency_reqwest::{IdempotencyMiddleware, IdempotentRequestExt, IdempotentResponseExt};
use idempotency_sqlite::rusqlite;
use rides_api::rides::{BookRide, Booking};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The rider the demo books for (`Authorization: Bearer`); the rides service keeps each
/// rider's keys apart.
const RIDER: &str = "rider-1";

type Failure = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), Failure> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let port = |name: &str| -> Result<u16, Failure> {
        match std::env::var(name) {
            Ok(p) => Ok(p.parse().map_err(|e| format!("{name}={p}: {e}"))?),
            Err(_) => Ok(0),
        }
    };
    match std::env::args().nth(1).as_deref() {
        Some("payments") => {
            let db = std::env::var("PAYMENTS_DB").map_err(|_| "PAYMENTS_DB is not set")?;
            let lease = match std::env::var("PAYMENTS_LEASE_MS") {
                Ok(ms) => Duration::from_millis(
                    ms.parse()
                        .map_err(|e| format!("PAYMENTS_LEASE_MS={ms} is not milliseconds: {e}"))?,
                ),
                Err(_) => Duration::from_secs(30),
            };
            let running =
                rides_api::payments::start(Path::new(&db), port("PAYMENTS_PORT")?, lease).await?;
            println!("payments listening on {}", running.url);
            running.task.await??;
            Ok(())
        }
        Some("rides") => {
            let config = rides_api::rides::Config::from_env()?;
            let running = rides_api::rides::start(&config, port("RIDES_PORT")?).await?;
            println!("rides listening on {}", running.url);
            running.task.await??;
            Ok(())
        }
        None | Some("demo") => demo().await,
        Some(other) => Err(format!("unknown command {other:?}: payments, rides or demo").into()),
    }
}

/// A child service process, killed when dropped.
struct Service {
    child: Child,
    url: String,
}

impl Service {
    fn start(what: &str, env: &[(&str, String)]) -> Result<Self, Failure> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg(what)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or("no stdout")?;
        BufReader::new(stdout).read_line(&mut line)?;
        let url = line
            .trim()
            .rsplit(' ')
            .next()
            .filter(|u| u.starts_with("http://"))
            .ok_or_else(|| format!("{what} did not start: {line:?}"))?
            .to_owned();
        Ok(Self { child, url })
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Rows: (rides of `key`, charges of its ride, outbox messages of `key`).
fn counts(rides: &Path, payments: &Path, key: &str) -> Result<(i64, i64, i64), Failure> {
    let r = rusqlite::Connection::open(rides)?;
    let p = rusqlite::Connection::open(payments)?;
    // The services write meanwhile.
    r.busy_timeout(Duration::from_secs(10))?;
    p.busy_timeout(Duration::from_secs(10))?;
    let ride: Option<i64> = r
        .query_row("SELECT id FROM rides WHERE key = ?1", [key], |row| {
            row.get(0)
        })
        .ok();
    let rides: i64 = r.query_row("SELECT count(*) FROM rides WHERE key = ?1", [key], |row| {
        row.get(0)
    })?;
    let charges: i64 = match ride {
        Some(ride) => p.query_row(
            "SELECT count(*) FROM charges WHERE ride = ?1",
            [ride],
            |row| row.get(0),
        )?,
        None => 0,
    };
    let receipts: i64 =
        r.query_row("SELECT count(*) FROM outbox WHERE key = ?1", [key], |row| {
            row.get(0)
        })?;
    Ok((rides, charges, receipts))
}

fn check(what: &str, ok: bool) -> Result<(), Failure> {
    if ok {
        println!("   ok: {what}");
        Ok(())
    } else {
        Err(format!("FAILED: {what}").into())
    }
}

/// A booking's answer through our client half.
struct Booked {
    status: reqwest::StatusCode,
    attempts: u32,
    replayed: bool,
    booking: Booking,
}

/// Books `request` under `key` on the rides service at `url` through `client`, retrying as
/// the client half does.
async fn book(
    client: &reqwest_middleware::ClientWithMiddleware,
    url: &str,
    key: &str,
    request: &BookRide,
) -> Result<Booked, Failure> {
    let answer = client
        .post(format!("{url}/rides"))
        .bearer_auth(RIDER)
        .json(request)
        .idempotency_key(IdempotencyKey::new(key)?)
        .send()
        .await?;
    let (attempts, replayed) = answer
        .idempotency()
        .map_or((0, false), |o| (o.attempts(), o.replayed()));
    let status = answer.status();
    Ok(Booked {
        status,
        attempts,
        replayed,
        booking: answer.json().await?,
    })
}

/// Sends `request` under `key`, once, to a rides service started with `env` that aborts
/// right after the charge; says what the client saw.
async fn book_and_crash(
    env: &[(&str, String)],
    key: &str,
    request: &BookRide,
) -> Result<String, Failure> {
    let crashing = Service::start("rides", env)?;
    let sent = reqwest::Client::new()
        .post(format!("{}/rides", crashing.url))
        .bearer_auth(RIDER)
        .header("idempotency-key", key)
        .json(request)
        .send()
        .await;
    Ok(match sent {
        Ok(r) => format!("answered {}", r.status()),
        Err(_) => "no answer: the rides service died".to_owned(),
    })
}

async fn demo() -> Result<(), Failure> {
    let dir = tempfile::tempdir()?;
    let (rides_db, payments_db) = (dir.path().join("rides.db"), dir.path().join("payments.db"));
    let payments = Service::start("payments", &[("PAYMENTS_DB", path(&payments_db))])?;
    println!("payment service: {}", payments.url);
    let rides_env = |extra: &[(&'static str, &str)]| {
        let mut env = vec![
            ("RIDES_DB", path(&rides_db)),
            ("PAYMENTS_URL", payments.url.clone()),
            ("RIDES_LEASE_MS", "1000".to_owned()),
        ];
        env.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
        env
    };
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyMiddleware::new())
        .build();
    let request = BookRide {
        route: "Old Town to the airport".to_owned(),
        amount: 4200,
    };

    let crash_after_charge = rides_env(&[
        ("RIDES_CRASH_AT", "charge:called"),
        ("RIDES_COMPLETER", "off"),
    ]);

    println!("\n1. A booking whose process dies after the charge, resumed by the client's retry");
    let key = "demo-ride-1";
    let seen = book_and_crash(&crash_after_charge, key, &request).await?;
    println!("   POST /rides (key {key}): {seen}");
    let after_crash = counts(&rides_db, &payments_db, key)?;
    println!("   after the crash: rides, charges, receipts = {after_crash:?}");
    check(
        "the ride committed and the card was charged once",
        after_crash == (1, 1, 0),
    )?;
    let rides = Service::start("rides", &rides_env(&[("RIDES_COMPLETER", "off")]))?;
    println!("   the rides service restarted: {}", rides.url);
    let retry = book(&client, &rides.url, key, &request).await?;
    println!(
        "   the retry: {} after {} attempt(s) (409 while the dead holder's lease ran): {:?}",
        retry.status, retry.attempts, retry.booking
    );
    check(
        "resumed at the charge: one ride, one charge, one receipt",
        counts(&rides_db, &payments_db, key)? == (1, 1, 1),
    )?;
    let again = book(&client, &rides.url, key, &request).await?;
    check(
        "a later retry replays the same booking",
        again.replayed && again.booking == retry.booking,
    )?;
    drop(rides);

    println!(
        "\n2. Another booking dies after the charge; nobody retries; the completer finishes it"
    );
    let key = "demo-ride-2";
    book_and_crash(&crash_after_charge, key, &request).await?;
    println!(
        "   after the crash: rides, charges, receipts = {:?}",
        counts(&rides_db, &payments_db, key)?
    );
    let rides = Service::start("rides", &rides_env(&[("RIDES_COMPLETER", "on")]))?;
    println!(
        "   the rides service restarted with its completer: {}",
        rides.url
    );
    let started = Instant::now();
    while counts(&rides_db, &payments_db, key)?.2 == 0 {
        if started.elapsed() > Duration::from_secs(60) {
            return Err("the completer did not finish the booking within a minute".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "   the completer finished it after {:.1} s (the dead holder's lease passed first)",
        started.elapsed().as_secs_f64()
    );
    check(
        "one ride, one charge, one receipt",
        counts(&rides_db, &payments_db, key)? == (1, 1, 1),
    )?;
    let late = book(&client, &rides.url, key, &request).await?;
    check(
        &format!(
            "the client's late retry gets the completed booking: {:?}",
            late.booking
        ),
        late.replayed,
    )?;
    println!("\nEvery booking ran each of its phases once; the charge was asked for twice and made once.");
    Ok(())
}

fn path(p: &Path) -> String {
    p.display().to_string()
}
