//! Several OS processes on one database file.
//!
//! This test binary is its own child: run normally it is the parent, and it starts copies of
//! itself with `IDEMPOTENCY_SQLITE_CHILD` set to a role.
//!
//! - `race`: 4 processes × 8 tasks each call every one of 64 keys (in shuffled orders, half
//!   through `SqliteIdempotency::run_in_transaction`, half through `Idempotency::run` with a separate business
//!   write). Each key's work must run exactly once, counted in an `executions` table; every
//!   caller must get that run's outcome (fresh or replayed); no `SQLITE_BUSY` may reach any
//!   caller.
//! - `crash`: a process claims a key, writes an order in its transaction and aborts before
//!   committing. The retry is refused while the lease lives, then runs: one order.
#![allow(clippy::unwrap_used)]

use idempotency_core::store::RecordStatus;
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, InFlight, Policy,
    RecordId, Refusal, Scope,
};
use idempotency_sqlite::rusqlite::{params, TransactionBehavior};
use idempotency_sqlite::{ConnectionMode, SqliteStore};
use idempotency_testing::sqlite::is_busy_error;
use rand::seq::SliceRandom;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PROCESSES: usize = 4;
const TASKS: usize = 8;
const KEYS: usize = 64;
const ROLE: &str = "IDEMPOTENCY_SQLITE_CHILD";
const DB: &str = "IDEMPOTENCY_SQLITE_DB";

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("multiprocess: test");
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    match std::env::var(ROLE).as_deref() {
        Ok("race") => runtime.block_on(child_race()),
        Ok("crash") => runtime.block_on(child_crash()),
        Ok(other) => panic!("unknown child role {other:?}"),
        Err(_) => {
            // Three rounds: the children use the dedicated connection thread, then a pool of
            // four connections each, then the thread again.
            for pool in [0, 4, 0] {
                runtime.block_on(parent_race(pool));
            }
            runtime.block_on(parent_crash());
            println!("test multiprocess ... ok");
        }
    }
}

fn scope() -> Scope {
    Scope::from_parts(["multiprocess", "work"]).unwrap()
}

fn key(i: usize) -> IdempotencyKey {
    IdempotencyKey::new(format!("key-{i:03}")).unwrap()
}

fn child(role: &str, db: &Path) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(ROLE, role)
        .env(DB, db)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_bytes(b"the same work")
}

// ---- race ----------------------------------------------------------------------------------

#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Report {
    fresh: usize,
    replayed: usize,
    busy_errors: usize,
    other_errors: Vec<String>,
    /// Every outcome each key was answered with, in this process.
    seen: BTreeMap<String, BTreeSet<String>>,
}

async fn parent_race(pool: usize) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("race.db");
    let store = SqliteStore::open(&db).await.unwrap();
    store.migrate().await.unwrap();
    store
        .call(|c| {
            c.execute_batch(
                "CREATE TABLE executions (key TEXT NOT NULL, pid INTEGER NOT NULL,
                                          task INTEGER NOT NULL, via TEXT NOT NULL)",
            )
        })
        .await
        .unwrap()
        .unwrap();
    let go = dir.path().join("go");
    let started = Instant::now();
    let mut children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            let mut c = child("race", &db);
            c.env("IDEMPOTENCY_SQLITE_GO", &go)
                .env("IDEMPOTENCY_SQLITE_POOL", pool.to_string());
            c.spawn().unwrap()
        })
        .collect();
    // Wait until every child has opened its store, then start them together.
    let mut readers: Vec<_> = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().unwrap()))
        .collect();
    for r in &mut readers {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "a child failed to start");
    }
    std::fs::write(&go, b"go").unwrap();
    let mut total = Report::default();
    for (mut c, mut r) in children.into_iter().zip(readers) {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let status = c.wait().unwrap();
        assert!(status.success(), "a child failed: {status}");
        let report: Report = serde_json::from_str(&line).expect("child report");
        total.fresh += report.fresh;
        total.replayed += report.replayed;
        total.busy_errors += report.busy_errors;
        total.other_errors.extend(report.other_errors);
        for (k, v) in report.seen {
            total.seen.entry(k).or_default().extend(v);
        }
    }
    let elapsed = started.elapsed();

    let executions: Vec<(String, i64, i64, String)> = store
        .call(|c| {
            let mut s = c.prepare("SELECT key, pid, task, via FROM executions ORDER BY key")?;
            let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
            rows.collect::<Result<Vec<_>, _>>()
        })
        .await
        .unwrap()
        .unwrap();
    let calls = PROCESSES * TASKS * KEYS;
    let mode = match pool {
        0 => "dedicated thread".to_string(),
        n => format!("pool of {n}"),
    };
    println!(
        "multiprocess race ({mode}): {PROCESSES} processes x {TASKS} tasks on {KEYS} keys = \
         {calls} calls in {elapsed:.2?}: executions counted {}, fresh {}, replayed {}, busy errors {}, other \
         errors {}",
        executions.len(),
        total.fresh,
        total.replayed,
        total.busy_errors,
        total.other_errors.len()
    );
    assert_eq!(total.busy_errors, 0, "SQLITE_BUSY reached a caller");
    assert!(total.other_errors.is_empty(), "{:?}", total.other_errors);
    assert_eq!(
        total.fresh + total.replayed,
        calls,
        "every call gets an outcome"
    );
    assert_eq!(
        total.fresh, KEYS,
        "each key's work runs in exactly one call"
    );
    assert_eq!(
        executions.len(),
        KEYS,
        "each key's work is counted once: {executions:?}"
    );
    let distinct: BTreeSet<&String> = executions.iter().map(|e| &e.0).collect();
    assert_eq!(distinct.len(), KEYS);
    let pids: BTreeSet<i64> = executions.iter().map(|e| e.1).collect();
    println!(
        "multiprocess race ({mode}): the work ran in {} distinct processes",
        pids.len()
    );
    for (key, pid, task, _) in &executions {
        // Every caller, in every process, got the outcome of the one execution.
        let expected = BTreeSet::from([format!("{pid}:{task}")]);
        assert_eq!(total.seen.get(key), Some(&expected), "key {key}");
        let rec = store
            .get(&RecordId::new(
                IdempotencyKey::new(key.clone()).unwrap(),
                scope(),
            ))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(rec.status, RecordStatus::Completed);
        assert_eq!(rec.attempts, 1, "key {key}: never reclaimed");
        // Every other call observed it at least once (waiters observe again after waiting).
        assert!(
            rec.hits as usize >= PROCESSES * TASKS - 1,
            "key {key}: hits {}",
            rec.hits
        );
    }
}

async fn child_race() {
    let db = PathBuf::from(std::env::var(DB).unwrap());
    let go = PathBuf::from(std::env::var("IDEMPOTENCY_SQLITE_GO").unwrap());
    let mode = match std::env::var("IDEMPOTENCY_SQLITE_POOL")
        .unwrap()
        .parse()
        .unwrap()
    {
        0 => ConnectionMode::DedicatedThread,
        connections => ConnectionMode::BlockingPool { connections },
    };
    let store = SqliteStore::builder(&db).mode(mode).open().await.unwrap();
    // Every process runs the (already applied) migrations at start-up, as services do.
    store.migrate().await.unwrap();
    // Hits are counted: the parent checks that every caller observed the one execution.
    let policy = Policy::default()
        .lease(Duration::from_secs(30))
        .count_hits(true)
        .in_flight(InFlight::wait(Duration::from_secs(60)));
    let engine = Idempotency::builder(store.clone())
        .policy(policy)
        .build()
        .unwrap();
    println!("ready");
    std::io::stdout().flush().unwrap();
    while !go.exists() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let pid = i64::from(std::process::id());
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (store, engine) = (store.clone(), engine.clone());
            tokio::spawn(async move {
                let mut order: Vec<usize> = (0..KEYS).collect();
                order.shuffle(&mut rand::thread_rng());
                let mut report = Report::default();
                for i in order {
                    let k = key(i);
                    let result = if i % 2 == 0 {
                        let name = k.to_string();
                        engine
                            .run_in_transaction(&k, &scope(), &fingerprint(), move |tx, _| {
                                let name = name.clone();
                                Box::pin(tx.run(move |tx| {
                                    tx.execute(
                                    "INSERT INTO executions VALUES (?1, ?2, ?3, 'exactly_once')",
                                    params![name, pid, task as i64],
                                )
                                .map_err(|e| e.to_string())?;
                                    Ok::<_, String>(format!("{pid}:{task}"))
                                }))
                            })
                            .await
                    } else {
                        let (store, name) = (store.clone(), k.to_string());
                        engine
                            .run(&k, &scope(), &fingerprint(), |_| async move {
                                store
                                    .call(move |c| {
                                        let tx = c.transaction_with_behavior(
                                            TransactionBehavior::Immediate,
                                        )?;
                                        tx.execute(
                                            "INSERT INTO executions VALUES (?1, ?2, ?3, 'run')",
                                            params![name, pid, task as i64],
                                        )?;
                                        tx.commit()
                                    })
                                    .await
                                    .map_err(|e| e.to_string())?
                                    .map_err(|e| e.to_string())?;
                                Ok::<_, String>(format!("{pid}:{task}"))
                            })
                            .await
                    };
                    record(&mut report, &k, result);
                }
                report
            })
        })
        .collect();
    let mut report = Report::default();
    for t in tasks {
        let r = t.await.unwrap();
        report.fresh += r.fresh;
        report.replayed += r.replayed;
        report.busy_errors += r.busy_errors;
        report.other_errors.extend(r.other_errors);
        for (k, v) in r.seen {
            report.seen.entry(k).or_default().extend(v);
        }
    }
    println!("{}", serde_json::to_string(&report).unwrap());
}

fn record(
    report: &mut Report,
    key: &IdempotencyKey,
    result: Result<Answer<Result<String, String>>, Error>,
) {
    match result {
        Ok(outcome) => {
            if outcome.is_replayed() {
                report.replayed += 1;
            } else {
                report.fresh += 1;
            }
            match outcome.into_result().unwrap() {
                Ok(v) => {
                    report.seen.entry(key.to_string()).or_default().insert(v);
                }
                Err(e) => report.other_errors.push(format!("{key}: work failed: {e}")),
            }
        }
        Err(e) if is_busy_error(&e) => report.busy_errors += 1,
        Err(e) => report.other_errors.push(format!("{key}: {e}")),
    }
}

// ---- crash ---------------------------------------------------------------------------------

const CRASH_LEASE: Duration = Duration::from_millis(1500);

fn crash_policy() -> Policy {
    Policy::default().lease(CRASH_LEASE).heartbeat(None)
}

async fn parent_crash() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("crash.db");
    let store = SqliteStore::open(&db).await.unwrap();
    store.migrate().await.unwrap();
    store
        .call(|c| {
            c.execute_batch(
                "CREATE TABLE orders (id INTEGER PRIMARY KEY, order_key TEXT NOT NULL,
                                      placed_by TEXT NOT NULL)",
            )
        })
        .await
        .unwrap()
        .unwrap();
    let engine = Idempotency::builder(store.clone())
        .policy(crash_policy())
        .build()
        .unwrap();
    let count = |k: String| {
        let store = store.clone();
        async move {
            store
                .call(move |c| {
                    c.query_row(
                        "SELECT count(*) FROM orders WHERE order_key = ?1",
                        [k],
                        |r| r.get::<_, i64>(0),
                    )
                })
                .await
                .unwrap()
                .unwrap()
        }
    };
    const CRASHES: usize = 3;
    for i in 0..CRASHES {
        let k = key(i);
        let mut c = child("crash", &db);
        c.env("IDEMPOTENCY_SQLITE_KEY", k.as_str());
        let mut proc = c.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(proc.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let status = proc.wait().unwrap();
        let crashed_at = Instant::now();
        assert_eq!(line.trim(), "wrote the order, aborting before commit");
        assert!(!status.success(), "the child must die: {status}");

        assert_eq!(
            count(k.to_string()).await,
            0,
            "the uncommitted order is gone"
        );
        let early = engine
            .run_in_transaction(&k, &scope(), &fingerprint(), move |tx, _| {
                Box::pin(tx.run(move |_| -> Result<i64, String> {
                    panic!("the crashed holder's lease is still live")
                }))
            })
            .await;
        assert!(
            matches!(early, Ok(Answer::Refused(Refusal::InProgress { .. }))),
            "{early:?}"
        );

        tokio::time::sleep(
            CRASH_LEASE.saturating_sub(crashed_at.elapsed()) + Duration::from_millis(50),
        )
        .await;
        let crashed = store
            .get(&RecordId::new(k.clone(), scope()))
            .await
            .unwrap()
            .expect("the crashed claim's record");
        let name = k.to_string();
        let retry = engine
            .run_in_transaction(&k, &scope(), &fingerprint(), move |tx, ctx| {
                let name = name.clone();
                Box::pin(tx.run(move |tx| {
                    assert_eq!(
                        ctx.token,
                        crashed.token.next(),
                        "the retry reclaims the crashed claim"
                    );
                    tx.execute(
                        "INSERT INTO orders (order_key, placed_by) VALUES (?1, 'retry')",
                        [name],
                    )
                    .map_err(|e| e.to_string())?;
                    Ok::<_, String>(tx.last_insert_rowid())
                }))
            })
            .await
            .unwrap();
        assert!(matches!(retry, Answer::Executed(Ok(_))), "{retry:?}");
        let again = engine
            .run_in_transaction(&k, &scope(), &fingerprint(), move |tx, _| {
                Box::pin(
                    tx.run(move |_| -> Result<i64, String> { panic!("completed: must replay") }),
                )
            })
            .await
            .unwrap();
        assert_eq!(again, Answer::Replayed(retry.into_result().unwrap()));
        assert_eq!(count(k.to_string()).await, 1, "exactly one order");
    }
    println!(
        "multiprocess crash: {CRASHES} holder processes aborted after their business write; \
         each retry ran once; orders per key: 1"
    );
}

async fn child_crash() {
    let db = PathBuf::from(std::env::var(DB).unwrap());
    let k = IdempotencyKey::new(std::env::var("IDEMPOTENCY_SQLITE_KEY").unwrap()).unwrap();
    let store = SqliteStore::open(&db).await.unwrap();
    let engine = Idempotency::builder(store.clone())
        .policy(crash_policy())
        .build()
        .unwrap();
    let id = RecordId::new(k.clone(), scope());
    let idempotency_core::protocol::Begin::Execute(_lease) =
        engine.begin(&id, &fingerprint()).await.unwrap()
    else {
        panic!("the key is fresh");
    };
    let name = k.to_string();
    store
        .call(move |c| {
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .unwrap();
            tx.execute(
                "INSERT INTO orders (order_key, placed_by) VALUES (?1, 'crashed holder')",
                [name],
            )
            .unwrap();
            println!("wrote the order, aborting before commit");
            std::io::stdout().flush().unwrap();
            // The process dies with the transaction open: no commit, no unwinding, no release.
            std::process::abort();
        })
        .await
        .unwrap();
}
