//! Fault injection against SQLite: a cancellation storm in both connection modes, and
//! processes killed with SIGKILL in the middle of their transactions.
//!
//! The kill tests run copies of this test binary as child processes: the test
//! `child_process_entry` does nothing unless `IDEM_RELIAB_CHILD` names a role.

use crate::runners;

use idempotency_core::protocol::decode_replay;
use idempotency_core::store::RecordStatus;
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId,
    Refusal, Scope,
};
use idempotency_reliability::soak::{soak_policy, EngineRunner, Runner};
use idempotency_reliability::storm::{
    calibrate, cancellation_storm, next_calls_succeed, storm_key, storm_keys_settle, StormSize,
};
use idempotency_sqlite::rusqlite::{self, params};
use idempotency_sqlite::{ConnectionMode, SqliteStore};
use rand::Rng;
use runners::sqlite::SqliteTransactionalRunner;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const ROLE: &str = "IDEM_RELIAB_CHILD";
const DB: &str = "IDEM_RELIAB_DB";
const KEY: &str = "IDEM_RELIAB_KEY";
const KILL_LEASE: Duration = Duration::from_millis(1500);

/// Each storm: 1,500 calls, and on until more than 100 were cut off (the verdict below needs
/// it), whatever the machine's speed.
const STORM: StormSize = StormSize {
    calls: 1_500,
    min_interrupted: 101,
};

fn scope() -> Scope {
    Scope::new("reliability|sqlite").expect("scope")
}

fn fingerprint(key: &IdempotencyKey) -> Fingerprint {
    Fingerprint::from_bytes(key.as_str().as_bytes())
}

async fn open(path: &Path, mode: ConnectionMode) -> SqliteStore {
    let store = SqliteStore::builder(path)
        .mode(mode)
        .open()
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    store
        .call(|c| {
            c.execute_batch(
                "CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY, scope TEXT NOT NULL,
                                                     key TEXT NOT NULL, value INTEGER NOT NULL)",
            )
        })
        .await
        .expect("call")
        .expect("create effects");
    store
}

async fn integrity(store: &SqliteStore) -> String {
    store
        .call(|c| c.query_row("PRAGMA integrity_check", [], |r| r.get::<_, String>(0)))
        .await
        .expect("call")
        .expect("integrity_check")
}

async fn effects(store: &SqliteStore, scope: &Scope) -> HashMap<String, Vec<u64>> {
    let scope = scope.as_str().to_owned();
    let rows: Vec<(String, i64)> = store
        .call(move |c| {
            let mut stmt =
                c.prepare("SELECT key, value FROM effects WHERE scope = ?1 ORDER BY id")?;
            let rows = stmt.query_map([scope], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })
        .await
        .expect("call")
        .expect("read effects");
    let mut map: HashMap<String, Vec<u64>> = HashMap::new();
    for (k, v) in rows {
        map.entry(k)
            .or_default()
            .push(u64::try_from(v).expect("positive"));
    }
    map
}

/// Every call under a random timeout (one in ten in an aborted task), through the
/// plain engine and through `SqliteIdempotency::run_in_transaction`. Afterwards every connection of the store is
/// outside any transaction (autocommit), the file passes `PRAGMA integrity_check`, the next
/// 1,000 calls succeed, and each key has exactly its one business row.
async fn storm(mode: ConnectionMode, connections: usize, deadline: Duration) {
    const LEASE: Duration = Duration::from_millis(300);
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(&dir.path().join("storm.db"), mode).await;
    let plain: Arc<dyn Runner> = Arc::new(EngineRunner::new(Arc::new(store.clone()), LEASE));
    let transactional: Arc<dyn Runner> = Arc::new(SqliteTransactionalRunner {
        store: store.clone(),
        engine: Idempotency::builder(store.clone())
            .policy(soak_policy(LEASE, true))
            .build()
            .expect("engine"),
    });
    let (plain_scope, tx_scope) = (
        Scope::new("storm|plain").expect("scope"),
        Scope::new("storm|tx").expect("scope"),
    );
    // Deadlines are drawn up to `deadline` or, where calls are slower, up to a few times the
    // measured median call, so the storm cuts calls at every stage whatever the disk's speed.
    let calibration = Scope::new("storm|calibration").expect("scope");
    let median = calibrate(&plain, &calibration, 30)
        .await
        .max(calibrate(&transactional, &calibration, 30).await);
    let deadline = deadline.min(median * 4).max(Duration::from_micros(200));
    let (a, b) = tokio::join!(
        cancellation_storm(plain.clone(), &plain_scope, 8, STORM, 40, deadline),
        cancellation_storm(transactional.clone(), &tx_scope, 8, STORM, 40, deadline),
    );
    eprintln!(
        "sqlite {mode:?} storm (median call {median:?}, deadlines up to {deadline:?}): plain {} calls ({} interrupted), run_in_transaction {} calls ({} interrupted)",
        a.calls, a.interrupted, b.calls, b.interrupted
    );
    assert!(a.errors.is_empty(), "{:?}", a.errors);
    assert!(b.errors.is_empty(), "{:?}", b.errors);
    assert!(
        a.interrupted > 100 && b.interrupted > 100,
        "the storm hardly interrupted anything"
    );
    tokio::time::sleep(LEASE + Duration::from_millis(200)).await;

    // Hold every connection at once (a barrier), and ask each whether it is in autocommit.
    let barrier = Arc::new(Barrier::new(connections));
    let checks: Vec<_> = (0..connections)
        .map(|_| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                store
                    .call(move |c| {
                        barrier.wait();
                        c.is_autocommit()
                    })
                    .await
                    .expect("call")
            })
        })
        .collect();
    for c in checks {
        assert!(
            c.await.expect("check"),
            "a connection was left inside a transaction"
        );
    }
    assert_eq!(integrity(&store).await, "ok");

    let failures = next_calls_succeed(
        transactional.clone(),
        &Scope::new("after|tx").expect("scope"),
        500,
        8,
    )
    .await;
    assert!(failures.is_empty(), "{failures:?}");
    let failures = next_calls_succeed(
        plain.clone(),
        &Scope::new("after|plain").expect("scope"),
        500,
        8,
    )
    .await;
    assert!(failures.is_empty(), "{failures:?}");
    assert!(storm_keys_settle(plain, &plain_scope, 40).await.is_empty());
    assert!(storm_keys_settle(transactional, &tx_scope, 40)
        .await
        .is_empty());
    let rows = effects(&store, &tx_scope).await;
    for i in 0..40 {
        let key = storm_key(i);
        let record = store
            .get(&RecordId::new(key.clone(), tx_scope.clone()))
            .await
            .expect("get")
            .expect("settled");
        let stored: Result<u64, String> = decode_replay(&record).expect("decode");
        assert_eq!(
            rows.get(key.as_str()).cloned().unwrap_or_default(),
            vec![stored.expect("ok")],
            "{key}: one business row, the stored one"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancellation_storm_dedicated_thread() {
    // One connection serves all 16 workers: calls queue on it.
    storm(
        ConnectionMode::DedicatedThread,
        1,
        Duration::from_millis(150),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancellation_storm_blocking_pool() {
    storm(
        ConnectionMode::BlockingPool { connections: 4 },
        4,
        Duration::from_millis(60),
    )
    .await;
}

// ---- processes killed with SIGKILL -------------------------------------------------------

fn child(role: &str, db: &Path, key: Option<&str>, stdout: Stdio) -> Child {
    // The test's name as the harness knows it: its module path without the crate's name.
    let entry = concat!(module_path!(), "::child_process_entry")
        .split_once("::")
        .map_or("child_process_entry", |(_, name)| name);
    let mut cmd = Command::new(std::env::current_exe().expect("current exe"));
    cmd.args(["--exact", entry, "--nocapture", "--test-threads", "1"])
        .env(ROLE, role)
        .env(DB, db)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::null());
    if let Some(key) = key {
        cmd.env(KEY, key);
    }
    cmd.spawn().expect("spawn a child process")
}

/// Not a test of its own: the body of the child processes.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let db = std::env::var(DB).expect("db path");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let store = SqliteStore::open(&db).await.expect("open");
        let engine = Idempotency::builder(store.clone())
            .policy(Policy::default().lease(KILL_LEASE).heartbeat(None))
            .build()
            .expect("engine");
        match role.as_str() {
            // Claims the key, writes its row inside BEGIN IMMEDIATE, says so and waits there
            // for the kill.
            "hold" => {
                let key = IdempotencyKey::new(std::env::var(KEY).expect("key")).expect("key");
                let k = key.to_string();
                let r = engine
                    .run_in_transaction(&key, &scope(), &fingerprint(&key), move |tx, _| {
                        let k = k.clone();
                        Box::pin(tx.run(move |tx| {
                            tx.execute(
                                "INSERT INTO effects (scope, key, value) VALUES (?1, ?2, 1)",
                                params![scope().as_str(), k],
                            )
                            .map_err(|e| e.to_string())?;
                            // Straight to the file descriptor: `println!` may be captured by
                            // the test harness.
                            let mut out = std::io::stdout().lock();
                            out.write_all(b"HOLDING\n").map_err(|e| e.to_string())?;
                            out.flush().map_err(|e| e.to_string())?;
                            std::thread::sleep(Duration::from_secs(60));
                            Ok::<u64, String>(1)
                        }))
                    })
                    .await;
                panic!("the holder was not killed: {r:?}");
            }
            // Runs keys through run_in_transaction for ever, with errors and short pauses
            // inside the transactions.
            "churn" => {
                let pid = u64::from(std::process::id());
                for n in 0u64.. {
                    let (key, fail, pause) = {
                        let mut rng = rand::thread_rng();
                        (
                            IdempotencyKey::new(format!(
                                "churn-{:02}",
                                rng.gen_range(0..CHURN_KEYS)
                            ))
                            .expect("key"),
                            rng.gen_bool(0.2),
                            Duration::from_micros(rng.gen_range(0..3_000)),
                        )
                    };
                    let value = pid * 1_000_000 + n;
                    let k = key.to_string();
                    let _ = engine
                        .run_in_transaction(&key, &scope(), &fingerprint(&key), move |tx, _| {
                            let k = k.clone();
                            Box::pin(tx.run(move |tx| {
                                tx.execute(
                                    "INSERT INTO effects (scope, key, value) VALUES (?1, ?2, ?3)",
                                    params![
                                        scope().as_str(),
                                        k,
                                        i64::try_from(value).map_err(|e| e.to_string())?
                                    ],
                                )
                                .map_err(|e| e.to_string())?;
                                std::thread::sleep(pause);
                                if fail {
                                    return Err("injected".to_owned());
                                }
                                Ok::<u64, String>(value)
                            }))
                        })
                        .await;
                }
            }
            other => panic!("unknown child role {other:?}"),
        }
    });
}

const CHURN_KEYS: usize = 30;

async fn parent_store(db: &Path) -> (SqliteStore, Idempotency<SqliteStore>) {
    let store = open(db, ConnectionMode::DedicatedThread).await;
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default().lease(KILL_LEASE).heartbeat(None))
        .build()
        .expect("engine");
    (store, engine)
}

async fn run_once(
    engine: &Idempotency<SqliteStore>,
    key: &IdempotencyKey,
    value: u64,
) -> Result<Answer<Result<u64, String>>, Error> {
    let k = key.to_string();
    engine
        .run_in_transaction(key, &scope(), &fingerprint(key), move |tx, _| {
            let k = k.clone();
            Box::pin(tx.run(move |tx| {
                tx.execute(
                    "INSERT INTO effects (scope, key, value) VALUES (?1, ?2, ?3)",
                    params![
                        scope().as_str(),
                        k,
                        i64::try_from(value).map_err(|e| e.to_string())?
                    ],
                )
                .map_err(|e| e.to_string())?;
                Ok::<u64, String>(value)
            }))
        })
        .await
}

/// A child holds `BEGIN IMMEDIATE` with its business row written when it is killed with
/// SIGKILL. The file passes `PRAGMA integrity_check`, the row is gone, the record is the
/// dead holder's Pending claim; a retry is refused while its lease lives and runs once after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_while_holding_the_write_transaction() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("kill.db");
    let (store, engine) = parent_store(&db).await;
    for i in 0..3 {
        let key = IdempotencyKey::new(format!("hold-{i}")).expect("key");
        let mut proc = child("hold", &db, Some(key.as_str()), Stdio::piped());
        let out = BufReader::new(proc.stdout.take().expect("stdout"));
        let mut holding = false;
        for line in out.lines() {
            // The harness prints `test child_process_entry ... ` before the test runs, with
            // no newline.
            if line
                .expect("read the child's output")
                .trim()
                .ends_with("HOLDING")
            {
                holding = true;
                break;
            }
        }
        assert!(holding, "the child never reported holding the transaction");
        proc.kill().expect("SIGKILL the child");
        let status = proc.wait().expect("wait");
        let killed_at = Instant::now();
        assert!(!status.success(), "the child must die: {status}");

        assert_eq!(integrity(&store).await, "ok");
        assert!(
            !effects(&store, &scope()).await.contains_key(key.as_str()),
            "the row rolled back"
        );
        let id = RecordId::new(key.clone(), scope());
        let record = store
            .get(&id)
            .await
            .expect("get")
            .expect("the claim survives");
        assert_eq!((record.status, record.attempts), (RecordStatus::Pending, 1));
        let held = record.token;
        let early = run_once(&engine, &key, 7).await;
        assert!(
            matches!(early, Ok(Answer::Refused(Refusal::InProgress { .. }))),
            "{early:?}"
        );
        tokio::time::sleep(
            KILL_LEASE.saturating_sub(killed_at.elapsed()) + Duration::from_millis(50),
        )
        .await;
        let retry = run_once(&engine, &key, 7).await.expect("the retry runs");
        assert_eq!(retry, Answer::Executed(Ok(7)));
        assert_eq!(
            effects(&store, &scope()).await.get(key.as_str()),
            Some(&vec![7])
        );
        let record = store.get(&id).await.expect("get").expect("record");
        assert_eq!(
            (record.status, record.token),
            (RecordStatus::Completed, held.next())
        );
    }
}

/// Keys the churning children must have completed before the kills stop.
const CHURN_MIN_COMPLETED: usize = 3;

/// How many of the churned keys are Completed.
async fn completed_keys(store: &SqliteStore) -> usize {
    let mut completed = 0;
    for i in 0..CHURN_KEYS {
        let key = IdempotencyKey::new(format!("churn-{i:02}")).expect("key");
        let record = store.get(&RecordId::new(key, scope())).await.expect("get");
        if record.is_some_and(|r| r.status == RecordStatus::Completed) {
            completed += 1;
        }
    }
    completed
}

/// Three processes churn through 30 keys with `SqliteIdempotency::run_in_transaction` while the test kills one at
/// random every 100–300 ms (SIGKILL) and starts another. Afterwards the file passes
/// `PRAGMA integrity_check`; every key has at most one business row, present exactly when
/// the record is Completed and equal to its outcome; and once the dead holders' leases pass,
/// every key runs (or replays) and ends with exactly one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_under_load_no_corruption_no_double_effect() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("churn.db");
    let (store, engine) = parent_store(&db).await;
    let mut children: Vec<Child> = (0..3)
        .map(|_| child("churn", &db, None, Stdio::null()))
        .collect();
    let started = Instant::now();
    let mut kills = 0;
    // At least 4 s of kills, and on until the children completed keys of their own (a child
    // that never got to work would make every check below vacuous), within a generous bound.
    while started.elapsed() < Duration::from_secs(4)
        || completed_keys(&store).await < CHURN_MIN_COMPLETED
    {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "in 120 s the children completed {} keys, fewer than {CHURN_MIN_COMPLETED}",
            completed_keys(&store).await
        );
        let pause = rand::thread_rng().gen_range(100..300);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let victim = rand::thread_rng().gen_range(0..children.len());
        let mut dead = std::mem::replace(
            &mut children[victim],
            child("churn", &db, None, Stdio::null()),
        );
        dead.kill().expect("SIGKILL");
        dead.wait().expect("wait");
        kills += 1;
    }
    for mut c in children {
        c.kill().expect("SIGKILL");
        c.wait().expect("wait");
        kills += 1;
    }
    assert_eq!(integrity(&store).await, "ok");

    let check = |settled: bool| {
        let store = store.clone();
        async move {
            let rows = effects(&store, &scope()).await;
            let mut completed = 0;
            for i in 0..CHURN_KEYS {
                let key = IdempotencyKey::new(format!("churn-{i:02}")).expect("key");
                let record = store
                    .get(&RecordId::new(key.clone(), scope()))
                    .await
                    .expect("get");
                let rows = rows.get(key.as_str()).cloned().unwrap_or_default();
                match record {
                    Some(r) if r.status == RecordStatus::Completed => {
                        completed += 1;
                        let stored: Result<u64, String> = decode_replay(&r).expect("decode");
                        assert_eq!(
                            rows,
                            vec![stored.expect("ok")],
                            "{key}: one row, the stored one"
                        );
                    }
                    other => {
                        assert!(!settled, "{key} did not settle: {other:?}");
                        assert!(
                            rows.is_empty(),
                            "{key}: rows {rows:?} without a completion ({other:?})"
                        );
                    }
                }
            }
            completed
        }
    };
    let completed_before = check(false).await;
    assert!(
        completed_before >= CHURN_MIN_COMPLETED,
        "the children completed {completed_before} keys"
    );
    tokio::time::sleep(KILL_LEASE + Duration::from_millis(50)).await;
    for i in 0..CHURN_KEYS {
        let key = IdempotencyKey::new(format!("churn-{i:02}")).expect("key");
        let r = run_once(&engine, &key, 9_000 + i as u64).await;
        assert!(
            matches!(r, Ok(Answer::Executed(Ok(_)) | Answer::Replayed(Ok(_)))),
            "{key}: {r:?}"
        );
    }
    assert_eq!(check(true).await, CHURN_KEYS);
    eprintln!(
        "sqlite kill -9 under load: {kills} processes killed, integrity ok, {completed_before} of \
         {CHURN_KEYS} keys completed with one row each, the rest reclaimed and run once"
    );
}
