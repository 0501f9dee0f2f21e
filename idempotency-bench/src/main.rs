#![doc = include_str!("../README.md")]

mod dynamodb;
mod harness;
mod http;
mod kinds;
mod memory;
mod mysql;
mod phases;
mod postgres;
mod profile;
mod redis;
mod sqlite;
mod stats;

use harness::{Backend, Budget, Counted};
use idempotency_core::store::BoxError;
use idempotency_core::RecordId;
use stats::{fmt_latency, Summary};
use std::time::Duration;

struct Args {
    backends: Vec<String>,
    clients: Vec<usize>,
    ops: usize,
    duration: Duration,
    sizes: Vec<usize>,
    profile: Option<String>,
    phases: bool,
}

const USAGE: &str = "usage: idempotency-bench [--backend NAME|all|a,b] [--clients 1,16] [--ops N] [--duration SECS] [--sizes 1000,10000,100000,1000000]
       idempotency-bench --phases --backend sqlite,postgres,mysql [--ops N]
       idempotency-bench --profile store-cycle|store-replay|engine-cycle|engine-replay|raw-cycle|raw-replay|fingerprint-1k|http-plain|http-first|http-replay|http-first-raw|http-replay-raw [--ops N]

--phases measures a multi-step operation's phases against the one-shot exactly-once path.
--ops and --duration bound every measurement (whichever ends first). --sizes are the live-key
counts of the scaling tables (each backend takes the sizes up to its own bound).
Servers: IDEMPOTENCY_BENCH_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/test),
IDEMPOTENCY_BENCH_MYSQL_URL (default mysql://root@127.0.0.1:3306/test),
IDEMPOTENCY_BENCH_REDIS_URL (default redis://127.0.0.1:6379),
IDEMPOTENCY_BENCH_DYNAMODB_URL (default the local stand-in, http://127.0.0.1:8000).";

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        backends: vec!["memory".into()],
        clients: vec![1, 16],
        ops: 20_000,
        duration: Duration::from_secs(5),
        sizes: vec![1_000, 10_000, 100_000, 1_000_000],
        profile: None,
        phases: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => {
                let v = value()?;
                args.backends = if v == "all" {
                    kinds::KINDS.iter().map(|k| k.name.to_owned()).collect()
                } else {
                    v.split(',').map(|s| s.trim().to_owned()).collect()
                };
                if let Some(bad) = args.backends.iter().find(|b| kinds::find(b).is_none()) {
                    return Err(format!(
                        "unknown backend {bad:?} ({} or all)",
                        kinds::names()
                    ));
                }
            }
            "--clients" => args.clients = parse_list(&value()?)?,
            "--ops" => args.ops = value()?.parse().map_err(|e| format!("--ops: {e}"))?,
            "--duration" => {
                let secs: f64 = value()?.parse().map_err(|e| format!("--duration: {e}"))?;
                if !(secs.is_finite() && secs > 0.0) {
                    return Err("--duration must be a positive number of seconds".into());
                }
                args.duration = Duration::from_secs_f64(secs);
            }
            "--sizes" => args.sizes = parse_list(&value()?)?,
            "--profile" => args.profile = Some(value()?),
            "--phases" => args.phases = true,
            "--help" | "-h" => {
                println!("{USAGE}\nBackends: {}.", kinds::names());
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if args.clients.contains(&0) || args.ops == 0 || args.sizes.contains(&0) {
        return Err("--clients, --ops and --sizes take positive numbers".into());
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

/// The speed targets, judged as the run goes and printed at the end.
#[derive(Default)]
struct Targets(Vec<(String, String, bool)>);

impl Targets {
    fn check(&mut self, target: impl Into<String>, measured: impl Into<String>, met: bool) {
        self.0.push((target.into(), measured.into(), met));
    }

    fn print(&self) {
        if self.0.is_empty() {
            return;
        }
        println!("\n## Targets\n");
        println!("| target | measured | |");
        println!("|---|---|---|");
        for (t, m, met) in &self.0 {
            println!("| {t} | {m} | {} |", if *met { "met" } else { "MISSED" });
        }
    }
}

/// Our figures beside the server's own benchmark client running the same statements; each
/// must reach 0.8× of it.
async fn physical_limit(
    backend: &str,
    limit: &dyn harness::PhysicalLimit,
    ours: &[(harness::LimitWorkload, usize, f64)],
    args: &Args,
    targets: &mut Targets,
) -> Result<(), BoxError> {
    println!("\nthe physical limit: {}\n", limit.method());
    println!("| workload | clients | ours ops/s | limit ops/s | ours/limit |");
    println!("|---|---|---|---|---|");
    for &(workload, clients, ours) in ours {
        let max = limit.ops_per_sec(workload, clients, args.duration).await?;
        let name = match workload {
            harness::LimitWorkload::NewKey => "new-key cycle",
            harness::LimitWorkload::UncountedReplay => "replay",
        };
        let r = ours / max;
        println!("| {name} | {clients} | {ours:.0} | {max:.0} | {r:.2}× |");
        targets.check(
            format!("{backend}: {name} ≥ 0.8× pgbench at {clients} clients"),
            format!("{r:.2}× ({ours:.0} vs {max:.0} ops/s)"),
            r >= 0.8,
        );
    }
    Ok(())
}

fn row(workload: &str, clients: usize, ours: &Summary, raw: Option<&Summary>) -> Option<f64> {
    let (raw_ops, raw_p50, ratio) = match raw {
        Some(r) => {
            let ratio = ours.ops_per_sec() / r.ops_per_sec();
            (
                format!("{:.0}", r.ops_per_sec()),
                fmt_latency(r.p50),
                Some(ratio),
            )
        }
        None => ("–".into(), "–".into(), None),
    };
    println!(
        "| {workload} | {clients} | {:.0} | {} | {} | {raw_ops} | {raw_p50} | {} |",
        ours.ops_per_sec(),
        fmt_latency(ours.p50),
        fmt_latency(ours.p99),
        ratio.map_or("–".into(), |r| format!("{r:.2}×")),
    );
    ratio
}

/// The least ratio to the raw baseline each backend must reach, per workload and client
/// count; `None` where no target is set.
fn ratio_target(backend: &str, workload: &str, clients: usize) -> Option<f64> {
    match (backend, workload, clients) {
        ("redis", "new-key cycle", 16) => Some(0.6),
        ("redis", "replay, hits counted", 16) => Some(0.5),
        ("redis", "replay", _) => Some(0.7),
        ("sqlite (dedicated thread)", "new-key cycle", 16) => Some(1.0),
        ("sqlite (dedicated thread)", "replay, hits counted", 1) => Some(0.5),
        ("sqlite (dedicated thread)", "replay", _) => Some(0.8),
        ("postgres", "new-key cycle", _) => Some(0.9),
        ("postgres", "replay", _) => Some(0.9),
        ("mysql", "new-key cycle", _) => Some(0.8),
        ("mysql", "replay", _) => Some(0.9),
        _ => None,
    }
}

/// Checks `ratio` against the workload's target, if it has one.
fn check_ratio(
    targets: &mut Targets,
    backend: &str,
    workload: &str,
    clients: usize,
    ratio: Option<f64>,
    ours: &Summary,
    raw: &Summary,
) {
    if let (Some(min), Some(r)) = (ratio_target(backend, workload, clients), ratio) {
        targets.check(
            format!("{backend}: {workload} ≥ {min}× raw at {clients} clients"),
            format!(
                "{r:.2}× ({:.0} vs {:.0} ops/s)",
                ours.ops_per_sec(),
                raw.ops_per_sec()
            ),
            r >= min,
        );
    }
}

async fn bench_backend(b: &Backend, args: &Args, targets: &mut Targets) -> Result<(), BoxError> {
    let budget = Budget {
        ops: args.ops,
        duration: args.duration,
    };
    let run = format!(
        "{}-{}",
        b.name.split(' ').next().unwrap_or("b"),
        std::process::id()
    );
    let engine = harness::engine(b.store.clone())?;
    println!("\n## {}\n", b.name);
    println!("| workload | clients | ops/s | p50 | p99 | raw ops/s | raw p50 | ours/raw |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut engine_p50 = Vec::new();
    // Our ops/s per (limit workload, clients), to set beside the physical limit.
    let mut against_limit: Vec<(harness::LimitWorkload, usize, f64)> = Vec::new();
    for &clients in &args.clients {
        let tag = format!("{run}-nk{clients}");
        let e = engine.clone();
        let ours = harness::measure(
            clients,
            budget,
            |c, i| harness::key(&tag, c, i),
            move |k| {
                let e = e.clone();
                async move { harness::engine_cycle(&e, &harness::scope(), &k).await }
            },
        )
        .await?;
        let raw = b.raw.clone();
        let t = format!("{tag}-raw");
        let base = harness::measure(
            clients,
            budget,
            |c, i| harness::key(&t, c, i).into_inner(),
            move |k| {
                let raw = raw.clone();
                async move { raw.new_key_cycle(&k, harness::OUTCOME.as_bytes()).await }
            },
        )
        .await?;
        let ratio = row("new-key cycle", clients, &ours, Some(&base));
        engine_p50.push(("new-key", clients, ours.p50));
        check_ratio(
            targets,
            b.name,
            "new-key cycle",
            clients,
            ratio,
            &ours,
            &base,
        );
        against_limit.push((harness::LimitWorkload::NewKey, clients, ours.ops_per_sec()));
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
    let replay_key = move |c: usize, i: usize| (c * 7919 + i) % pool;
    let counted = harness::counted_engine(b.store.clone())?;
    for (&clients, (workload, engine)) in args.clients.iter().flat_map(|c| {
        [
            (c, ("replay", &engine)),
            (c, ("replay, hits counted", &counted)),
        ]
    }) {
        let e = engine.clone();
        let ours = harness::measure(
            clients,
            budget,
            |c, i| harness::key(&tag, 0, replay_key(c, i)),
            move |k| {
                let e = e.clone();
                async move { harness::engine_replay(&e, &harness::scope(), &k).await }
            },
        )
        .await?;
        let raw = b.raw.clone();
        let base = harness::measure(
            clients,
            budget,
            |c, i| format!("{tag}-raw-{}", replay_key(c, i)),
            move |k| {
                let raw = raw.clone();
                async move {
                    raw.replay(&k).await?.ok_or("raw replay found nothing")?;
                    Ok(())
                }
            },
        )
        .await?;
        let ratio = row(workload, clients, &ours, Some(&base));
        if workload == "replay" {
            engine_p50.push(("replay", clients, ours.p50));
            against_limit.push((
                harness::LimitWorkload::UncountedReplay,
                clients,
                ours.ops_per_sec(),
            ));
        }
        check_ratio(targets, b.name, workload, clients, ratio, &ours, &base);
    }
    if let Some(limit) = &b.limit {
        physical_limit(b.name, limit.as_ref(), &against_limit, args, targets).await?;
    }
    for &clients in &args.clients {
        let store = b.store.clone();
        let t = format!("{run}-st{clients}");
        let ours = harness::measure(
            clients,
            budget,
            |c, i| RecordId::new(harness::key(&t, c, i), harness::scope()),
            move |id| {
                let store = store.clone();
                async move { harness::store_cycle(store.as_ref(), id).await }
            },
        )
        .await?;
        row("new-key cycle, store API only", clients, &ours, None);
        if b.name == "memory" && clients == 1 {
            targets.check(
                "memory: ≥ 1,000,000 new-key cycles/s through the store API, one core",
                format!(
                    "{:.0} cycles/s (p50 {})",
                    ours.ops_per_sec(),
                    fmt_latency(ours.p50)
                ),
                ours.ops_per_sec() >= 1e6,
            );
        }
        overhead(b, targets, &engine_p50, "new-key", clients, &ours);
    }
    for &clients in &args.clients {
        let store = b.store.clone();
        let ours = harness::measure(
            clients,
            budget,
            |c, i| RecordId::new(harness::key(&tag, 0, replay_key(c, i)), harness::scope()),
            move |id| {
                let store = store.clone();
                async move { harness::store_replay(store.as_ref(), id).await }
            },
        )
        .await?;
        row("replay, store API only", clients, &ours, None);
        overhead(b, targets, &engine_p50, "replay", clients, &ours);
    }

    if let Some(counted) = &b.round_trips {
        round_trips(b.name, counted, &run, targets).await?;
    }
    if b.name == "postgres" {
        postgres::wal_syncs(args.ops.min(500), targets).await?;
    }
    if b.name == "mysql" {
        mysql::log_syncs(args.ops.min(500), targets).await?;
    }

    cached_replays(b, args, targets, &tag, pool, replay_key).await?;

    let race = harness::same_key_race(&engine, &run).await;
    println!(
        "\nsame-key race, 64 callers released together: executions = {} (must be 1); answers: \
         {} fresh, {} replayed, {} in progress (409), {} other errors",
        race.executions, race.fresh, race.replayed, race.in_progress, race.other_errors
    );
    targets.check(
        format!("{}: same-key race runs the work once", b.name),
        format!("{} executions", race.executions),
        race.executions == 1 && race.other_errors == 0,
    );

    batches(b, &run, targets).await?;

    let h = http::measure(b.store.clone(), &format!("{run}-http")).await?;
    println!(
        "\nHTTP through axum, the way peers publish it: one client sending one request at a \
         time over a keep-alive loopback connection, {} requests per scenario after {} to warm \
         up, a 1 KiB JSON body\n",
        http::REQUESTS,
        http::REQUESTS / 10
    );
    println!("| scenario | p50 | p99 | p50 added to no middleware |");
    println!("|---|---|---|---|");
    for (name, s) in [
        ("no middleware", &h.plain),
        ("fresh key", &h.fresh),
        ("repeat key", &h.repeat),
    ] {
        let added = s.p50.as_secs_f64() - h.plain.p50.as_secs_f64();
        println!(
            "| {name} | {} | {} | {:+.3} ms |",
            http::ms(s.p50),
            http::ms(s.p99),
            added * 1e3
        );
    }
    Ok(())
}

/// Replays through the engine with a replay cache in front of the store, beside replays
/// through the engine on the memory store (no cache) in the same run: answered from memory,
/// a cached replay must reach 0.8× of the memory store's on every backend. Both read the
/// same `pool` completed keys round-robin (`tag`'s, already completed on the store), every
/// key replayed once first so the cache holds it. At a million calls a second the harness's
/// budget is over in milliseconds, so each side is measured with ten times the operations,
/// three times in turn, and its median run kept.
async fn cached_replays(
    b: &Backend,
    args: &Args,
    targets: &mut Targets,
    tag: &str,
    pool: usize,
    replay_key: impl Fn(usize, usize) -> usize + Copy + Send + Sync + 'static,
) -> Result<(), BoxError> {
    let budget = Budget {
        ops: args.ops.saturating_mul(10),
        duration: args.duration,
    };
    let cached = harness::engine(std::sync::Arc::new(idempotency_cache::ReplayCache::new(
        b.store.clone(),
    )))?;
    let memory = harness::engine(std::sync::Arc::new(idempotency_memory::MemoryStore::new()))?;
    for i in 0..pool {
        let key = harness::key(tag, 0, i);
        harness::engine_replay(&cached, &harness::scope(), &key).await?;
        harness::engine_cycle(&memory, &harness::scope(), &key).await?;
    }
    println!("\nreplays answered by the replay cache, beside the memory store's (no cache):\n");
    println!(
        "| workload | clients | ops/s | p50 | p99 | memory ops/s | memory p50 | cached/memory |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &clients in &args.clients {
        let (mut cached_runs, mut memory_runs) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            for (engine, runs) in [(&cached, &mut cached_runs), (&memory, &mut memory_runs)] {
                let e = engine.clone();
                let tag = tag.to_owned();
                runs.push(
                    harness::measure(
                        clients,
                        budget,
                        move |c, i| harness::key(&tag, 0, replay_key(c, i)),
                        move |k| {
                            let e = e.clone();
                            async move { harness::engine_replay(&e, &harness::scope(), &k).await }
                        },
                    )
                    .await?,
                );
            }
        }
        let median = |runs: &mut Vec<Summary>| {
            runs.sort_by(|a, b| a.ops_per_sec().total_cmp(&b.ops_per_sec()));
            runs.swap_remove(1)
        };
        let measured = [median(&mut cached_runs), median(&mut memory_runs)];
        let (ours, mem) = (&measured[0], &measured[1]);
        let r = row("replay, cached", clients, ours, Some(mem)).unwrap_or(0.0);
        targets.check(
            format!(
                "{}: cached replay ≥ 0.8× the memory store's replay at {clients} clients",
                b.name
            ),
            format!(
                "{r:.2}× ({:.0} vs {:.0} ops/s)",
                ours.ops_per_sec(),
                mem.ops_per_sec()
            ),
            r >= 0.8,
        );
    }
    Ok(())
}

/// The engine's overhead over the store API: the p50 difference, printed for every backend
/// and judged for the memory store at one client.
fn overhead(
    b: &Backend,
    targets: &mut Targets,
    engine_p50: &[(&str, usize, Duration)],
    workload: &str,
    clients: usize,
    store: &Summary,
) {
    let Some(&(_, _, engine)) = engine_p50
        .iter()
        .find(|(w, c, _)| *w == workload && *c == clients)
    else {
        return;
    };
    let extra = engine.as_nanos() as i128 - store.p50.as_nanos() as i128;
    println!("|   engine overhead, {workload} ({clients} clients) | | p50 {extra} ns | | | | |");
    if b.name == "memory" && clients == 1 {
        targets.check(
            format!("memory: engine overhead ≤ 2 µs per call ({workload})"),
            format!("{extra} ns (p50 engine − p50 store API)"),
            extra <= 2_000,
        );
    }
}

async fn round_trips(
    backend: &str,
    counted: &Counted,
    run: &str,
    targets: &mut Targets,
) -> Result<(), BoxError> {
    const N: usize = 1_000;
    let store = counted.store.as_ref();
    let raw = counted.raw.as_ref();
    let new_id = |tag: &str, i: usize| {
        RecordId::new(
            harness::key(&format!("{run}-{tag}"), 0, i),
            harness::scope(),
        )
    };
    // Warm-up: each statement prepared (Postgres) and each script cached (Redis) once, as in
    // a running service.
    harness::store_cycle(store, new_id("rt-warm", 0)).await?;
    harness::store_replay(store, new_id("rt-warm", 0)).await?;
    raw.new_key_cycle(&format!("{run}-rt-warm"), b"{}").await?;
    raw.replay(&format!("{run}-rt-warm")).await?;

    let ids: Vec<RecordId> = (0..N).map(|i| new_id("rt", i)).collect();
    let counter = counted.counter.as_ref();
    let mut phases = store_phases(store, counter, &ids).await?;
    let mut mark = Snapshot::take(counter).await?;
    for i in 0..N {
        raw.new_key_cycle(&format!("{run}-rt-{i}"), harness::OUTCOME.as_bytes())
            .await?;
    }
    let now = Snapshot::take(counter).await?;
    phases.push(now.since("raw new-key cycle (insert + update)", &mark));
    mark = now;
    for i in 0..N {
        raw.replay(&format!("{run}-rt-{i}")).await?;
    }
    let now = Snapshot::take(counter).await?;
    phases.push(now.since("raw replay (read)", &mark));

    println!(
        "\nround trips per operation, counted over {N} operations each: {}\n",
        counted.method
    );
    println!("| operation | round trips per op | also seen (per op) |");
    println!("|---|---|---|");
    for (name, trips, detail) in &phases {
        let per = *trips as f64 / N as f64;
        let also: Vec<String> = detail
            .iter()
            .map(|(k, v)| format!("{k} {:.2}", *v as f64 / N as f64))
            .collect();
        println!("| {name} | {per:.2} | {} |", also.join(", "));
        if !name.starts_with("raw") {
            targets.check(
                format!("{backend}: {name} is exactly 1 round trip"),
                format!("{per:.2}"),
                *trips == N as u64,
            );
            // Redis runs scripts on its one thread: their server time bounds throughput.
            let of = |label: &str| detail.iter().find(|(k, _)| k == label).map(|(_, v)| *v);
            if let (Some(usec), Some(calls)) = (of("evalsha server µs"), of("evalsha")) {
                let per_call = usec as f64 / calls.max(1) as f64;
                targets.check(
                    format!("{backend}: {name}, server time per script call ≤ 6 µs"),
                    format!("{per_call:.1} µs (INFO commandstats, idle private server)"),
                    per_call <= 6.0,
                );
            }
        }
    }
    if let Some(floor) = &counted.floor {
        script_floor(backend, counted, floor.as_ref(), &new_id, targets).await?;
    }
    Ok(())
}

/// The store's scripts against the floor scripts, on the same private server in the same
/// run, in turns (the store's three phases, then the floors). Each call's server time comes
/// from the server's slow log; a script's figure is the mean of its fastest 90% of calls
/// over all turns, so a call the OS preempted midway (a 2-core machine running the bench
/// beside the server) does not decide it.
async fn script_floor(
    backend: &str,
    counted: &Counted,
    floor: &dyn harness::ScriptFloor,
    new_id: &dyn Fn(&str, usize) -> RecordId,
    targets: &mut Targets,
) -> Result<(), BoxError> {
    const N: usize = 2_000;
    const TURNS: usize = 5;
    // Calls in flight at once, so the server is kept busy as under load.
    const CONCURRENCY: usize = 16;
    let store = counted.store.as_ref();
    let mut seen: Vec<(String, Vec<u64>)> = Vec::new();
    let mut add = |name: &str, us: Vec<u64>| match seen.iter_mut().find(|(n, _)| n == name) {
        Some((_, all)) => all.extend(us),
        None => seen.push((name.to_owned(), us)),
    };
    let mut record_len = 0;
    for turn in 0..TURNS {
        let ids: Vec<RecordId> = (0..N).map(|i| new_id(&format!("floor{turn}"), i)).collect();
        floor.record().await?;
        let claimed = claim_all(store, &ids, CONCURRENCY).await?;
        add("claim (new key)", floor.recorded().await?);
        floor.record().await?;
        complete_all(store, &claimed, CONCURRENCY).await?;
        add("complete", floor.recorded().await?);
        floor.record().await?;
        replay_all(store, &ids, CONCURRENCY).await?;
        add("replay (claim of a completed key)", floor.recorded().await?);
        let f = floor.measure(N, CONCURRENCY, &ids[0]).await?;
        record_len = f.record_len;
        add("read floor (EVALSHA)", f.read);
        add("write floor (EVALSHA)", f.write);
        for (name, us) in f.other {
            add(&name, us);
        }
    }
    let mut figures = Vec::new();
    for (name, all) in &seen {
        if all.len() != N * TURNS {
            return Err(format!("{name}: {} calls recorded, not {}", all.len(), N * TURNS).into());
        }
        figures.push((
            name.as_str(),
            stats::fastest_mean(all, 0.9),
            stats::median_u64(all),
        ));
    }
    let of = |name: &str| -> Result<f64, BoxError> {
        figures
            .iter()
            .find(|(n, _, _)| n.starts_with(name))
            .map(|(_, us, _)| *us)
            .ok_or_else(|| format!("no figure for {name}").into())
    };
    let (read, write) = (of("read floor (EVALSHA)")?, of("write floor (EVALSHA)")?);
    println!(
        "\nserver time per script call against the floor (the server's slow log, every call \
         recorded; {TURNS} turns of {N} calls per script, {CONCURRENCY} in flight, on the same \
         private server; mean of the fastest 90% of calls, and the median; records of \
         {record_len} bytes): the read floor is `TIME` then `GET` of the record, the write \
         floor `TIME`, `GET` and `SET … PXAT`\n"
    );
    println!("| script | server µs per call | median | against |");
    println!("|---|---|---|---|");
    for (name, us, median) in &figures {
        let against = if name.contains("floor (EVALSHA)") {
            String::new()
        } else if name.contains("through FCALL") {
            let base = if name.starts_with("read") {
                read
            } else {
                write
            };
            format!("{:.2}× the EVALSHA floor", us / base)
        } else if name.starts_with("replay") {
            format!("{:.2}× the read floor", us / read)
        } else {
            format!("{:.2}× the write floor", us / write)
        };
        println!("| {name} | {us:.2} | {median:.0} | {against} |");
    }
    let (claim, complete, replay) = (of("claim")?, of("complete")?, of("replay")?);
    let cycle = (claim + complete) / (2.0 * write);
    println!(
        "| claim + complete | {:.2} | | {cycle:.2}× twice the write floor |",
        claim + complete
    );
    targets.check(
        format!("{backend}: replay script ≤ 1.5× the read floor (server time, same run)"),
        format!("{:.2}× ({replay:.2} vs {read:.2} µs)", replay / read),
        replay / read <= 1.5,
    );
    targets.check(
        format!("{backend}: claim + complete scripts ≤ 1.5× twice the write floor"),
        format!("{cycle:.2}× ({:.2} vs 2 × {write:.2} µs)", claim + complete),
        cycle <= 1.5,
    );
    Ok(())
}

/// A queue consumer's batch of 100 message keys: claimed and settled with `claim_many` and
/// `settle_many`, against the same keys claimed and completed one call at a time, by one
/// consumer, in turns; the target is 5× on Postgres and Redis.
async fn batches(b: &Backend, run: &str, targets: &mut Targets) -> Result<(), BoxError> {
    const BATCH: usize = 100;
    const TURNS: usize = 10;
    let store = b.store.as_ref();
    let ttl = Duration::from_secs(3600);
    let (mut batched, mut single) = (Duration::ZERO, Duration::ZERO);
    for turn in 0..TURNS + 1 {
        let ids = |tag: &str| -> Vec<RecordId> {
            (0..BATCH)
                .map(|i| {
                    RecordId::new(
                        harness::key(&format!("{run}-{tag}{turn}"), 0, i),
                        harness::scope(),
                    )
                })
                .collect()
        };
        let requests = |ids: &[RecordId]| -> Vec<idempotency_core::store::ClaimRequest> {
            ids.iter()
                .map(|id| {
                    idempotency_core::store::ClaimRequest::new(
                        id.clone(),
                        harness::fingerprint(),
                        Duration::from_secs(30),
                        ttl,
                    )
                })
                .collect()
        };
        let (many, one) = (ids("batch"), ids("single"));
        let started = std::time::Instant::now();
        let mut settlements = Vec::with_capacity(BATCH);
        for (id, answer) in many.iter().zip(store.claim_many(&requests(&many)).await) {
            match answer? {
                idempotency_core::store::Claim::Claimed { token, .. } => {
                    settlements.push(idempotency_core::store::Settlement::complete(
                        id.clone(),
                        token,
                        harness::engine_outcome().to_vec(),
                        ttl,
                    ))
                }
                _ => return Err("a new key of a batch was not claimed".into()),
            }
        }
        for answer in store.settle_many(&settlements).await {
            if answer? != idempotency_core::store::Cas::Applied {
                return Err("a settlement of a batch was fenced".into());
            }
        }
        let took_batched = started.elapsed();
        let started = std::time::Instant::now();
        for req in requests(&one) {
            match store.claim(&req).await? {
                idempotency_core::store::Claim::Claimed { token, .. } => {
                    let cas = store
                        .complete(&req.id, token, harness::engine_outcome(), ttl)
                        .await?;
                    if cas != idempotency_core::store::Cas::Applied {
                        return Err("a single completion was fenced".into());
                    }
                }
                _ => return Err("a new key was not claimed".into()),
            }
        }
        let took_single = started.elapsed();
        // The first turn warms up (statements prepared, scripts cached).
        if turn > 0 {
            batched += took_batched;
            single += took_single;
        }
    }
    let rate = |d: Duration| (TURNS * BATCH) as f64 / d.as_secs_f64().max(1e-9);
    let ratio = rate(batched) / rate(single);
    println!(
        "\na batch of {BATCH} new message keys, claimed and completed by one consumer \
         ({TURNS} turns each, in turn):\n"
    );
    println!("| how | keys/s | batch/single |");
    println!("|---|---|---|");
    println!(
        "| claim_many + settle_many | {:.0} | {ratio:.2}× |",
        rate(batched)
    );
    println!(
        "| claim + complete, one key at a time | {:.0} | |",
        rate(single)
    );
    if ["postgres", "redis"].contains(&b.name) {
        targets.check(
            format!(
                "{}: a batch of {BATCH} keys ≥ 5× {BATCH} single claims",
                b.name
            ),
            format!(
                "{ratio:.2}× ({:.0} vs {:.0} keys/s)",
                rate(batched),
                rate(single)
            ),
            ratio >= 5.0,
        );
    }
    Ok(())
}

/// Claims each of `ids` (new keys), `concurrency` calls at a time: the tokens.
async fn claim_all<'i>(
    store: &dyn idempotency_core::IdempotencyStore,
    ids: &'i [RecordId],
    concurrency: usize,
) -> Result<Vec<(&'i RecordId, idempotency_core::FencingToken)>, BoxError> {
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(ids)
        .map(|id| async move {
            let req = idempotency_core::store::ClaimRequest::new(
                id.clone(),
                harness::fingerprint(),
                Duration::from_secs(30),
                Duration::from_secs(3600),
            )
            .with_count_hit(false);
            match store.claim(&req).await? {
                idempotency_core::store::Claim::Claimed { token, .. } => Ok((id, token)),
                _ => Err::<_, BoxError>("round-trip claim found an existing key".into()),
            }
        })
        .buffer_unordered(concurrency)
        .try_collect()
        .await
}

/// Completes each claimed key with the bench's outcome, `concurrency` calls at a time.
async fn complete_all(
    store: &dyn idempotency_core::IdempotencyStore,
    claimed: &[(&RecordId, idempotency_core::FencingToken)],
    concurrency: usize,
) -> Result<(), BoxError> {
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(claimed)
        .map(|(id, token)| async move {
            let outcome = harness::engine_outcome();
            match store
                .complete(id, *token, outcome, Duration::from_secs(3600))
                .await?
            {
                idempotency_core::store::Cas::Applied => Ok(()),
                other => Err::<_, BoxError>(format!("completion answered {other:?}").into()),
            }
        })
        .buffer_unordered(concurrency)
        .try_collect()
        .await
}

/// Replays each of `ids` (completed keys), `concurrency` calls at a time.
async fn replay_all(
    store: &dyn idempotency_core::IdempotencyStore,
    ids: &[RecordId],
    concurrency: usize,
) -> Result<(), BoxError> {
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(ids)
        .map(|id| harness::store_replay(store, id.clone()))
        .buffer_unordered(concurrency)
        .try_collect()
        .await
}

/// Claims, claims again (a conflict: the key is in progress), completes and replays each of
/// `ids` (new keys) through the counted store, one call at a time: what the counter saw in
/// each of the four phases.
async fn store_phases<'a>(
    store: &dyn idempotency_core::IdempotencyStore,
    counter: &dyn harness::RoundTripCounter,
    ids: &[RecordId],
) -> Result<Vec<Phase<'a>>, BoxError> {
    let mut phases: Vec<Phase<'_>> = Vec::new();
    let mut mark = Snapshot::take(counter).await?;
    let claimed = claim_all(store, ids, 1).await?;
    let now = Snapshot::take(counter).await?;
    phases.push(now.since("claim (new key)", &mark));
    mark = now;
    replay_all(store, ids, 1).await?;
    let now = Snapshot::take(counter).await?;
    phases.push(now.since("conflict (claim of a key in progress)", &mark));
    mark = now;
    complete_all(store, &claimed, 1).await?;
    let now = Snapshot::take(counter).await?;
    phases.push(now.since("complete", &mark));
    mark = now;
    replay_all(store, ids, 1).await?;
    let now = Snapshot::take(counter).await?;
    phases.push(now.since("replay (claim of a completed key)", &mark));
    Ok(phases)
}

/// A named phase: round trips and the other counts' deltas.
type Phase<'a> = (&'a str, u64, Vec<(String, u64)>);

/// A counter reading: round trips and details.
struct Snapshot(u64, Vec<(String, u64)>);

impl Snapshot {
    async fn take(counter: &dyn harness::RoundTripCounter) -> Result<Self, BoxError> {
        Ok(Self(counter.count().await?, counter.detail().await?))
    }

    /// What happened between `before` and this reading, as a named phase.
    fn since<'a>(&self, name: &'a str, before: &Snapshot) -> Phase<'a> {
        let detail = self
            .1
            .iter()
            .map(|(k, v)| {
                let was = before
                    .1
                    .iter()
                    .find(|(k0, _)| k0 == k)
                    .map_or(0, |(_, v0)| *v0);
                (k.clone(), v.saturating_sub(was))
            })
            .filter(|(_, d)| *d > 0)
            .collect();
        (name, self.0.saturating_sub(before.0), detail)
    }
}

/// Resident set size of this process, in bytes.
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Cost per operation as the number of live keys grows: replay of a random live key and a
/// new-key cycle, one client. For the memory store also the resident memory per record.
async fn scaling(
    kind: &str,
    scale: &harness::Scaling,
    args: &Args,
    targets: &mut Targets,
) -> Result<(), BoxError> {
    let sizes: Vec<usize> = args
        .sizes
        .iter()
        .copied()
        .filter(|&n| n <= scale.max_keys)
        .collect();
    if sizes.is_empty() {
        return Ok(());
    }
    println!("\n## {kind} at scale (one client, through the engine)\n");
    println!(
        "| live keys | fill time | RSS per record | replay ops/s | replay p50 | new-key cycle ops/s | new-key p50 |"
    );
    println!("|---|---|---|---|---|---|---|");
    let budget = Budget {
        ops: args.ops.min(20_000),
        duration: args.duration,
    };
    let mut p50s = Vec::new();
    for &n in &sizes {
        let before = rss_bytes().unwrap_or(0);
        let filling = std::time::Instant::now();
        let (store, _guard) = (scale.filled)(n).await?;
        let fill_time = filling.elapsed();
        let per_record = match scale.in_process_memory {
            true => format!(
                "{:.0} B",
                rss_bytes().unwrap_or(0).saturating_sub(before) as f64 / n as f64
            ),
            false => "–".to_owned(),
        };
        let engine = harness::engine(store.clone())?;
        let e = engine.clone();
        let replay = harness::measure(
            1,
            budget,
            |_, i| harness::key("fill", 0, (i * 7919) % n),
            move |k| {
                let e = e.clone();
                async move { harness::engine_replay(&e, &harness::scope(), &k).await }
            },
        )
        .await?;
        let e = engine.clone();
        let fresh = harness::measure(
            1,
            budget,
            |_, i| harness::key("new", 0, i),
            move |k| {
                let e = e.clone();
                async move { harness::engine_cycle(&e, &harness::scope(), &k).await }
            },
        )
        .await?;
        println!(
            "| {n} | {:.1} s | {per_record} | {:.0} | {} | {:.0} | {} |",
            fill_time.as_secs_f64(),
            replay.ops_per_sec(),
            fmt_latency(replay.p50),
            fresh.ops_per_sec(),
            fmt_latency(fresh.p50)
        );
        p50s.push((n, replay.p50, fresh.p50));
    }
    if p50s.len() > 1 {
        for (what, pick) in [
            (
                "replay",
                (|r: &(usize, Duration, Duration)| r.1) as fn(&_) -> Duration,
            ),
            ("new-key cycle", |r| r.2),
        ] {
            let ps: Vec<Duration> = p50s.iter().map(pick).collect();
            let (lo, hi) = (
                ps.iter().min().copied().unwrap_or_default(),
                ps.iter().max().copied().unwrap_or_default(),
            );
            let spread = hi.as_secs_f64() / lo.as_secs_f64().max(1e-12);
            targets.check(
                format!(
                    "{kind}: {what} p50 flat within 1.5× from {} to {} live keys",
                    sizes[0],
                    sizes[sizes.len() - 1]
                ),
                format!("{spread:.2}× ({} … {})", fmt_latency(lo), fmt_latency(hi)),
                spread <= 1.5,
            );
        }
    }
    Ok(())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    format!("{cores} cores, {cpu}, load average {load}")
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
            "# idempotency-bench: {} ops or {:?} per measurement, clients {:?}\n\nmachine: {}",
            args.ops,
            args.duration,
            args.clients,
            machine()
        );
        if args.phases {
            return phases::run(&args.backends, args.ops).await;
        }
        let mut targets = Targets::default();
        let max_clients = args.clients.iter().copied().max().unwrap_or(1);
        for name in &args.backends {
            let kind = kinds::find(name).ok_or_else(|| format!("unknown backend {name:?}"))?;
            for (backend, _guard) in (kind.make)(max_clients).await? {
                bench_backend(&backend, &args, &mut targets).await?;
            }
            if let Some(scale) = &kind.scaling {
                scaling(kind.name, scale, &args, &mut targets).await?;
            }
        }
        targets.print();
        println!("\nload average at the end: {}", machine());
        Ok(())
    });
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
