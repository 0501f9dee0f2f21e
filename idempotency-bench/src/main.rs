//! `cargo run --release -p idempotency-bench -- --backend memory|sqlite|postgres|redis|all`
//!
//! Prints, per backend, ops/s and p50/p99 latency of the new-key cycle and the replay through
//! the engine at 1 and 16 clients, each beside the raw baseline measured in the same run, the
//! round trips per operation, the same-key race, and the cost at 10³…10⁶ live keys.

mod harness;
mod memory;
mod profile;
mod sqlite;
mod stats;

use harness::{Backend, Budget};
use idempotency_core::{BoxError, IdempotencyStore, RecordId};
use idempotency_sqlite::ConnectionMode;
use stats::{fmt_latency, Summary};
use std::sync::Arc;
use std::time::Duration;

struct Args {
    backends: Vec<String>,
    clients: Vec<usize>,
    ops: usize,
    duration: Duration,
    sizes: Vec<usize>,
    profile: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        backends: vec!["memory".into()],
        clients: vec![1, 16],
        ops: 20_000,
        duration: Duration::from_secs(5),
        sizes: vec![1_000, 10_000, 100_000, 1_000_000],
        profile: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => {
                let v = value()?;
                args.backends = if v == "all" {
                    ["memory", "sqlite", "postgres", "redis"]
                        .map(String::from)
                        .to_vec()
                } else {
                    v.split(',').map(String::from).collect()
                };
            }
            "--clients" => args.clients = parse_list(&value()?)?,
            "--ops" => args.ops = value()?.parse().map_err(|e| format!("--ops: {e}"))?,
            "--duration" => {
                let secs: f64 = value()?.parse().map_err(|e| format!("--duration: {e}"))?;
                args.duration = Duration::from_secs_f64(secs);
            }
            "--sizes" => args.sizes = parse_list(&value()?)?,
            "--profile" => args.profile = Some(value()?),
            "--help" | "-h" => {
                println!(
                    "usage: idempotency-bench [--backend memory|sqlite|postgres|redis|all|a,b] \
                     [--clients 1,16] [--ops N] [--duration SECS] [--sizes 1000,10000,...]\n       \
                     idempotency-bench --profile store-cycle|store-replay|engine-cycle|\
                     engine-replay|raw-cycle|raw-replay [--ops N]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    Ok(args)
}

fn parse_list(s: &str) -> Result<Vec<usize>, String> {
    s.split(',')
        .map(|p| {
            p.trim()
                .replace('_', "")
                .parse::<usize>()
                .map_err(|e| format!("{p:?}: {e}"))
        })
        .collect()
}

/// A backend to measure, with whatever must live as long as it (a temp dir, a schema).
type Prepared = (Backend, Box<dyn std::any::Any>);

async fn make_backends(name: &str) -> Result<Vec<Prepared>, BoxError> {
    match name {
        "memory" => Ok(vec![(memory::backend(), Box::new(()))]),
        "sqlite" => {
            let (thread, d1) =
                sqlite::backend("sqlite (dedicated thread)", ConnectionMode::DedicatedThread)
                    .await?;
            let (pool, d2) = sqlite::backend(
                "sqlite (spawn_blocking pool of 4)",
                ConnectionMode::BlockingPool { connections: 4 },
            )
            .await?;
            Ok(vec![(thread, Box::new(d1)), (pool, Box::new(d2))])
        }
        other => Err(format!("backend {other:?} is not in the harness yet").into()),
    }
}

fn row(workload: &str, clients: usize, ours: &Summary, raw: Option<&Summary>) {
    let (raw_ops, raw_p50, ratio) = match raw {
        Some(r) => (
            format!("{:.0}", r.ops_per_sec()),
            fmt_latency(r.p50),
            format!("{:.2}×", ours.ops_per_sec() / r.ops_per_sec()),
        ),
        None => ("–".into(), "–".into(), "–".into()),
    };
    println!(
        "| {workload} | {clients} | {:.0} | {} | {} | {raw_ops} | {raw_p50} | {ratio} |",
        ours.ops_per_sec(),
        fmt_latency(ours.p50),
        fmt_latency(ours.p99),
    );
}

async fn bench_backend(b: &Backend, args: &Args) -> Result<(), BoxError> {
    let budget = Budget {
        ops: args.ops,
        duration: args.duration,
    };
    let run = format!("{}-{}", b.name, std::process::id());
    let engine = harness::engine(b.store.clone())?;
    println!("\n## {}\n", b.name);
    println!("| workload | clients | ops/s | p50 | p99 | raw ops/s | raw p50 | ours/raw |");
    println!("|---|---|---|---|---|---|---|---|");
    for &clients in &args.clients {
        let tag = format!("{run}-nk{clients}");
        let (e, s) = (engine.clone(), harness::scope());
        let t = tag.clone();
        let ours = harness::measure(clients, budget, move |c, i| {
            let (e, s, k) = (e.clone(), s.clone(), harness::key(&t, c, i));
            async move { harness::engine_cycle(&e, &s, &k).await }
        })
        .await?;
        let raw = b.raw.clone();
        let t = format!("{tag}-raw");
        let base = harness::measure(clients, budget, move |c, i| {
            let (raw, k) = (raw.clone(), harness::key(&t, c, i));
            async move {
                raw.new_key_cycle(k.as_str(), harness::OUTCOME.as_bytes())
                    .await
            }
        })
        .await?;
        row("new-key cycle", clients, &ours, Some(&base));
    }
    // Replay: a pool of completed keys, read round-robin.
    let pool = 1_000usize;
    let tag = format!("{run}-rp");
    for i in 0..pool {
        harness::engine_cycle(&engine, &harness::scope(), &harness::key(&tag, 0, i)).await?;
        b.raw
            .new_key_cycle(&format!("{tag}-raw-{i}"), harness::OUTCOME.as_bytes())
            .await?;
    }
    for &clients in &args.clients {
        let (e, s, t) = (engine.clone(), harness::scope(), tag.clone());
        let ours = harness::measure(clients, budget, move |c, i| {
            let (e, s, k) = (
                e.clone(),
                s.clone(),
                harness::key(&t, 0, (c * 7919 + i) % pool),
            );
            async move { harness::engine_replay(&e, &s, &k).await }
        })
        .await?;
        let (raw, t) = (b.raw.clone(), tag.clone());
        let base = harness::measure(clients, budget, move |c, i| {
            let (raw, k) = (raw.clone(), format!("{t}-raw-{}", (c * 7919 + i) % pool));
            async move {
                raw.replay(&k).await?.ok_or("raw replay found nothing")?;
                Ok(())
            }
        })
        .await?;
        row("replay", clients, &ours, Some(&base));
    }
    for &clients in &args.clients {
        let (store, t) = (b.store.clone(), format!("{run}-st{clients}"));
        let ours = harness::measure(clients, budget, move |c, i| {
            let store = store.clone();
            let id = RecordId::new(harness::scope(), harness::key(&t, c, i));
            async move { harness::store_cycle(store.as_ref(), id).await }
        })
        .await?;
        row("new-key cycle, store API only", clients, &ours, None);
    }

    if let Some(counter) = &b.round_trips {
        round_trips(b, counter.as_ref(), &run).await?;
    }

    let race = harness::same_key_race(&engine, &run).await;
    println!(
        "\nsame-key race, 64 callers released together: executions = {} (must be 1); answers: \
         {} fresh, {} replayed, {} in progress (409), {} other errors",
        race.executions, race.fresh, race.replayed, race.in_progress, race.other_errors
    );
    Ok(())
}

async fn round_trips(
    b: &Backend,
    counter: &dyn harness::RoundTripCounter,
    run: &str,
) -> Result<(), BoxError> {
    const N: usize = 200;
    let store = b.store.as_ref();
    let ids: Vec<RecordId> = (0..N)
        .map(|i| RecordId::new(harness::scope(), harness::key(&format!("{run}-rt"), 0, i)))
        .collect();
    let mut tokens = Vec::new();
    let c0 = counter.count().await?;
    for id in &ids {
        let req = idempotency_core::ClaimRequest {
            id: id.clone(),
            fingerprint: harness::fingerprint(),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        };
        match store.claim(&req).await? {
            idempotency_core::Claim::Claimed { token, .. } => tokens.push(token),
            _ => return Err("round-trip claim found an existing key".into()),
        }
    }
    let c1 = counter.count().await?;
    for (id, token) in ids.iter().zip(&tokens) {
        store
            .complete(
                id,
                *token,
                harness::OUTCOME.as_bytes(),
                Duration::from_secs(3600),
            )
            .await?;
    }
    let c2 = counter.count().await?;
    for id in &ids {
        let req = idempotency_core::ClaimRequest {
            id: id.clone(),
            fingerprint: harness::fingerprint(),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        };
        store.claim(&req).await?;
    }
    let c3 = counter.count().await?;
    // Each count() call may itself be a round trip; it is subtracted.
    let per = |a: u64, b: u64| (b.saturating_sub(a).saturating_sub(1)) as f64 / N as f64;
    println!(
        "\nround trips per operation (counted over {N} ops each): claim {:.2}, complete {:.2}, replay {:.2}",
        per(c0, c1),
        per(c1, c2),
        per(c2, c3)
    );
    Ok(())
}

/// Resident set size of this process, in bytes.
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Cost per operation as the number of live keys grows: replay of a random live key and a
/// new-key cycle, one client. For the memory store also the resident memory per record.
async fn scaling(kind: &str, args: &Args) -> Result<(), BoxError> {
    println!("\n## {kind} at scale\n");
    println!("| live keys | RSS per record | replay ops/s (1 client) | replay p50 | new-key cycle ops/s | new-key p50 |");
    println!("|---|---|---|---|---|---|");
    let budget = Budget {
        ops: args.ops.min(20_000),
        duration: args.duration,
    };
    for &n in &args.sizes {
        let before = rss_bytes().unwrap_or(0);
        let mut _guard: Option<tempfile::TempDir> = None;
        let store: Arc<dyn IdempotencyStore> = match kind {
            "memory" => {
                let store = Arc::new(idempotency_memory::MemoryStore::new());
                for i in 0..n {
                    let id = RecordId::new(harness::scope(), harness::key("fill", 0, i));
                    harness::store_cycle(store.as_ref(), id).await?;
                }
                store
            }
            _ => {
                let (store, dir) = sqlite::open(ConnectionMode::DedicatedThread).await?;
                sqlite::fill(&store, n, harness::engine_outcome()).await?;
                _guard = Some(dir);
                Arc::new(store)
            }
        };
        let per_record = match kind {
            "memory" => format!(
                "{:.0} B",
                rss_bytes().unwrap_or(0).saturating_sub(before) as f64 / n as f64
            ),
            _ => "–".to_owned(),
        };
        let engine = harness::engine(store.clone())?;
        let e = engine.clone();
        let replay = harness::measure(1, budget, move |_, i| {
            let (e, k) = (e.clone(), harness::key("fill", 0, (i * 7919) % n));
            async move { harness::engine_replay(&e, &harness::scope(), &k).await }
        })
        .await?;
        let e = engine.clone();
        let fresh = harness::measure(1, budget, move |_, i| {
            let (e, k) = (e.clone(), harness::key("new", 0, i));
            async move { harness::engine_cycle(&e, &harness::scope(), &k).await }
        })
        .await?;
        println!(
            "| {n} | {per_record} | {:.0} | {} | {:.0} | {} |",
            replay.ops_per_sec(),
            fmt_latency(replay.p50),
            fresh.ops_per_sec(),
            fmt_latency(fresh.p50)
        );
    }
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Some(workload) = &args.profile {
        if let Err(e) = profile::run(workload, args.ops) {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result: Result<(), BoxError> = rt.block_on(async {
        println!(
            "# idempotency-bench: {} ops or {:?} per measurement, clients {:?}, {} cores",
            args.ops,
            args.duration,
            args.clients,
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        );
        for name in &args.backends {
            for (backend, _guard) in make_backends(name).await? {
                bench_backend(&backend, &args).await?;
            }
            if name == "memory" || name == "sqlite" {
                scaling(name, &args).await?;
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
