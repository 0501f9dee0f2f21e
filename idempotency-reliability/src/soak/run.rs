//! The run: workers calling the runner on hot keys while faults are injected, every call
//! recorded with its invocation and response times.

use super::check::{analyse, check_rig};
use super::*;
use idempotency_core::Refusal;

fn install_panic_filter() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let injected = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|s| s.starts_with(PANIC_MARKER));
            if !injected {
                default(info);
            }
        }));
    });
}

/// Maps the engine's answer to the model's response; `Err` holds a note for an unknown or
/// unexpected answer.
fn classify(result: RunResult) -> (Response, Option<String>, bool) {
    match result {
        Ok(Answer::Executed(Ok(v))) => (Response::Fresh(v), None, false),
        Ok(Answer::Replayed(Ok(v))) => (Response::Replayed(v), None, false),
        Ok(Answer::Executed(Err(e))) => (Response::Released, Some(e), false),
        Ok(Answer::Replayed(Err(e))) => (
            Response::Unknown,
            Some(format!("UNEXPECTED: a released error was replayed: {e}")),
            false,
        ),
        Ok(Answer::Refused(Refusal::InProgress { .. })) => (Response::InProgress, None, false),
        Err(Error::LeaseLost { .. }) => (Response::LeaseLost, None, false),
        // The key closed by a work whose outcome could not be stored (the model's name).
        Ok(Answer::Refused(Refusal::OutcomeLost { .. })) => {
            (Response::FailedPermanently, None, false)
        }
        Ok(Answer::Refused(refusal)) => (
            Response::Unknown,
            Some(format!("UNEXPECTED: refused: {refusal:?}")),
            false,
        ),
        Err(e @ (Error::Backend { .. } | Error::OutcomeUnknown { .. })) => {
            (Response::Unknown, Some(e.to_string()), true)
        }
        Err(e) => (Response::Unknown, Some(format!("UNEXPECTED: {e:?}")), false),
    }
}

/// What a read found, and the token of a Completed record.
struct Read {
    output: Response,
    note: Option<String>,
    backend: bool,
    token: Option<u64>,
}

async fn read(store: &Arc<dyn IdempotencyStore>, id: &RecordId, space: Space) -> Read {
    let (output, note, backend, token) = match store.get(id).await {
        Ok(Some(record)) if record.status == RecordStatus::Completed => {
            let decoded = if space == Space::Http {
                match record.outcome.as_deref().map(StoredResponse::decode) {
                    Some(Ok(stored)) => String::from_utf8_lossy(&stored.body)
                        .parse::<u64>()
                        .map(Ok)
                        .map_err(|e| format!("a stored body that is not a value: {e}")),
                    Some(Err(e)) => Err(format!("an undecodable stored response: {e}")),
                    None => Err("a Completed record without an outcome".to_owned()),
                }
            } else {
                match decode_replay::<Result<u64, String>>(&record) {
                    Ok(Ok(v)) => Ok(Ok(v)),
                    Ok(Err(e)) => Ok(Err(e)),
                    Err(e) => Err(format!("undecodable outcome: {e}")),
                }
                .and_then(|r| r.map(Ok).map_err(|e| format!("a stored error: {e}")))
            };
            match decoded {
                Ok(Ok(v)) => (
                    Response::ReadCompleted(v),
                    None,
                    false,
                    Some(record.token.0),
                ),
                Ok(Err(e)) | Err(e) => (
                    Response::Unknown,
                    Some(format!("UNEXPECTED: {e}")),
                    false,
                    None,
                ),
            }
        }
        Ok(Some(record))
            if record.status == RecordStatus::Failed
                && record.failure.as_ref().is_some_and(|f| !f.retryable) =>
        {
            (Response::ReadFailed, None, false, None)
        }
        Ok(_) => (Response::ReadOpen, None, false, None),
        Err(e) => (Response::Unknown, Some(e.to_string()), true, None),
    };
    Read {
        output,
        note,
        backend,
        token,
    }
}

struct Shared {
    runner: Arc<dyn Runner>,
    store: Arc<dyn IdempotencyStore>,
    slots: Vec<Slot>,
    /// Where each space's keys start in `slots`, and how many it has.
    spaces: HashMap<Space, (usize, usize)>,
    http: Option<HttpPath>,
    rig: Option<Arc<FaultRig>>,
    config: SoakConfig,
    origin: Instant,
    counters: Arc<Counters>,
}

impl Shared {
    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn fingerprint(&self, key: usize) -> Fingerprint {
        Fingerprint::from_bytes(self.slots[key].key.as_str().as_bytes())
    }
}

/// A key of a space of `n` keys: mostly one of `hot` consecutive keys that move through the
/// space as the run goes on, sometimes any key met so far.
fn sweep(rng: &mut StdRng, seq: usize, ops: usize, n: usize, hot: usize) -> usize {
    let hot = hot.clamp(1, n);
    let base = seq * (n - hot + 1) / ops.max(1);
    if rng.gen_bool(0.2) {
        rng.gen_range(0..base + hot)
    } else {
        base + rng.gen_range(0..hot)
    }
}

async fn worker(shared: Arc<Shared>, seed: u64) -> Vec<Event> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut events = Vec::new();
    let c = &shared.config;
    loop {
        let Some(seq) = c.ending.next(c.ops) else {
            return events;
        };
        let space = pick(&c.mix.spaces, &mut rng, Space::Engine);
        let (first, n) = shared
            .spaces
            .get(&space)
            .copied()
            .unwrap_or(shared.spaces[&Space::Engine]);
        let space = if shared.spaces.contains_key(&space) {
            space
        } else {
            Space::Engine
        };
        // Mostly the hot keys; sometimes any key met so far, so that records are revisited
        // long after (stalled holders' passed leases are taken over, completions replayed).
        // Short-retention keys are all hot: they open again as they expire.
        let key = first
            + match space {
                Space::Short => rng.gen_range(0..n),
                _ => sweep(&mut rng, seq, c.ops, n, c.hot_keys),
            };
        let mode = match space {
            Space::Http => CallMode::Http,
            _ => pick(&c.mix.calls, &mut rng, CallMode::Run),
        };
        let fault = match space {
            Space::Http => pick(&c.mix.http_work, &mut rng, WorkFault::None),
            _ => pick(&c.mix.work, &mut rng, WorkFault::None),
        };
        let lease = if space == Space::Http {
            c.http_lease
        } else {
            c.lease
        };
        let value = seq as u64 + 1;
        let duration = match fault {
            WorkFault::Stall => c.lease + Duration::from_millis(rng.gen_range(50..250)),
            WorkFault::Long => lease.mul_f64(rng.gen_range(2.0..4.0)),
            _ if rng.gen_bool(0.2) => Duration::ZERO,
            _ => Duration::from_micros(rng.gen_range(0..8_000)),
        };
        let doom = shared.rig.as_ref().and_then(|rig| {
            rng.gen_bool(rig.faults().doomed).then(|| {
                if rng.gen_bool(0.5) {
                    Fault::Refused
                } else {
                    Fault::AckLost
                }
            })
        });
        let work = Work {
            value,
            fault,
            duration,
            counters: shared.counters.clone(),
            probe: shared.rig.as_ref().map(|rig| Probe {
                rig: rig.clone(),
                doom,
                short: space == Space::Short,
            }),
        };
        // Half the deadlines are tight enough to interrupt even a replay.
        let deadline = Duration::from_micros(if rng.gen_bool(0.5) {
            rng.gen_range(0..500)
        } else {
            rng.gen_range(0..15_000)
        });
        let call = shared.now();
        let slot = &shared.slots[key];
        let run = || {
            shared.runner.run(
                slot.key.clone(),
                slot.id.scope.clone(),
                shared.fingerprint(key),
                work.clone(),
            )
        };
        let mut seen_token = None;
        let (output, note, backend) = match mode {
            CallMode::Read => {
                let r = read(&shared.store, &slot.id, space).await;
                seen_token = r.token;
                (r.output, r.note, r.backend)
            }
            CallMode::Http => {
                let http = shared.http.as_ref().expect("HTTP keys come with the layer");
                http.call(&slot.key, value, fault, duration, doom).await
            }
            CallMode::Timeout => {
                // The timeout runs inside the task, so the call's future is dropped when it
                // fires; the task keeps an injected panic away from the worker.
                let call = run();
                match tokio::spawn(async move { tokio::time::timeout(deadline, call).await }).await
                {
                    Ok(Ok(result)) => classify(result),
                    Ok(Err(_)) => (Response::Unknown, Some("timed out".into()), false),
                    Err(e) if e.is_panic() && fault == WorkFault::Panic => {
                        (Response::Panicked, None, false)
                    }
                    Err(e) => (
                        Response::Unknown,
                        Some(format!("UNEXPECTED: the call panicked: {e}")),
                        false,
                    ),
                }
            }
            CallMode::Cancel => {
                let task = tokio::spawn(run());
                tokio::time::sleep(deadline).await;
                task.abort();
                match task.await {
                    Ok(result) => classify(result),
                    Err(e) if e.is_cancelled() => {
                        (Response::Unknown, Some("cancelled".into()), false)
                    }
                    Err(e) if e.is_panic() && fault == WorkFault::Panic => {
                        (Response::Panicked, None, false)
                    }
                    Err(e) => (
                        Response::Unknown,
                        Some(format!("UNEXPECTED: the call panicked: {e}")),
                        false,
                    ),
                }
            }
            CallMode::Run => match tokio::spawn(run()).await {
                Ok(result) => classify(result),
                Err(e) if e.is_panic() && fault == WorkFault::Panic => {
                    (Response::Panicked, None, false)
                }
                Err(e) => (
                    Response::Unknown,
                    Some(format!(
                        "UNEXPECTED: the call panicked or was cancelled: {e}"
                    )),
                    false,
                ),
            },
        };
        let ended = shared.now();
        let ret = (output != Response::Unknown).then_some(ended);
        let input = if mode == CallMode::Read {
            Call::Read
        } else {
            Call::Run { value }
        };
        // An error released by the engine must come from an injected error.
        let note = match (output, fault, note) {
            (Response::Released, f, Some(n))
                if f != WorkFault::Error
                    && !(c.business_writes_may_fail && n.starts_with(BUSINESS_WRITE_FAILED)) =>
            {
                Some(format!(
                    "UNEXPECTED: the work failed without an injected error: {n}"
                ))
            }
            (_, _, n) => n,
        };
        events.push(Event {
            key,
            space,
            mode,
            work: fault,
            op: Operation {
                call,
                ret,
                input,
                output,
            },
            note,
            is_final: false,
            ended,
            seen_token,
        });
        if backend {
            // A client backs off when the store fails.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Runs a soak with `runner` and checks it. The caller asserts on the report
/// ([`Report::assert_clean`]).
///
/// With a runner built over a [`FaultRig`] ([`EngineRunner::with_faults`]) the soak also
/// injects store faults, sends some calls through the HTTP layer and some to keys with a
/// short retention while a purger runs, and checks the rig's ledger.
pub async fn soak(runner: Arc<dyn Runner>, config: SoakConfig) -> Report {
    assert_eq!(
        config.ending.started(),
        0,
        "a SoakConfig's Ending serves one soak: give each run a config of its own, or a new \
         Ending"
    );
    install_panic_filter();
    let run_id: u64 = rand::thread_rng().gen();
    let run = format!("{run_id:016x}");
    let scope = Scope::from_parts(["soak", &config.label, &run]).expect("valid scope");
    let rig = runner.rig();
    let http = match (&rig, runner.http_engine()) {
        (Some(rig), Some(engine)) if config.http_keys > 0 => Some(HttpPath::new(
            engine,
            rig.clone(),
            &format!("soak-{}-{run}", config.label),
        )),
        _ => None,
    };
    let short_scope = Scope::from_parts(["soak", &config.label, &run, "short"]).expect("scope");
    let mut slots = Vec::new();
    let mut spaces = HashMap::new();
    let mut add = |space: Space, scope: &Scope, n: usize| {
        spaces.insert(space, (slots.len(), n));
        for local in 0..n {
            let key = IdempotencyKey::new(format!("key-{local:03}")).expect("valid key");
            slots.push(Slot {
                space,
                local,
                id: RecordId::new(key.clone(), scope.clone()),
                key,
            });
        }
    };
    add(Space::Engine, &scope, config.keys);
    if let Some(http) = &http {
        add(Space::Http, http.scope(), config.http_keys);
    }
    if rig.is_some() && config.short_keys > 0 {
        add(Space::Short, &short_scope, config.short_keys);
    }
    let store = runner.store();
    let origin = rig
        .as_ref()
        .map_or_else(Instant::now, |r| r.ledger().origin());
    let shared = Arc::new(Shared {
        runner,
        store,
        slots,
        spaces,
        http,
        rig: rig.clone(),
        config: config.clone(),
        origin,
        counters: Arc::new(Counters::default()),
    });
    // The purger: deletes expired records while the short-retention keys are claimed.
    let purging = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let purger = match &rig {
        Some(rig) if shared.spaces.contains_key(&Space::Short) => {
            let (store, purging, every) = (rig.recorded(), purging.clone(), config.purge_every);
            Some(tokio::spawn(async move {
                // (failed for good, failed retryably)
                let mut errors = (0u64, 0u64);
                while purging.load(Ordering::Relaxed) {
                    match store.purge_expired(100).await {
                        Ok(_) => {}
                        Err(e) if e.is_retryable() => errors.1 += 1,
                        Err(_) => errors.0 += 1,
                    }
                    tokio::time::sleep(every).await;
                }
                errors
            }))
        }
        _ => None,
    };
    let started = Instant::now();
    let workers: Vec<_> = (0..config.workers)
        .map(|w| tokio::spawn(worker(shared.clone(), config.seed.wrapping_add(w as u64))))
        .collect();
    let mut events = Vec::with_capacity(config.ops + shared.slots.len());
    for w in workers {
        events.extend(w.await.expect("a worker panicked"));
    }
    let run_time = started.elapsed();
    config.calls_over.store(true, Ordering::Relaxed);
    purging.store(false, Ordering::Relaxed);
    let (purge_errors, purges_failed_retryably) = match purger {
        Some(p) => p.await.expect("the purger panicked"),
        None => (0, 0),
    };
    // Let abandoned leases be released (or pass) and cancelled writes land.
    tokio::time::sleep(config.lease + Duration::from_millis(300)).await;
    let mut finals = HashMap::new();
    for (key, slot) in shared.slots.iter().enumerate() {
        let call = shared.now();
        let mut r = read(&shared.store, &slot.id, slot.space).await;
        // A final read the store failed (a connection a fault left dead, a slow answer) is
        // made again: an unanswered final read would leave the key's end unknown.
        for _ in 0..20 {
            if !r.backend {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            r = read(&shared.store, &slot.id, slot.space).await;
        }
        let ended = shared.now();
        finals.insert(key, r.output);
        events.push(Event {
            key,
            space: slot.space,
            mode: CallMode::Read,
            work: WorkFault::None,
            op: Operation {
                call,
                ret: (r.output != Response::Unknown).then_some(ended),
                input: Call::Read,
                output: r.output,
            },
            note: r.note,
            is_final: true,
            ended,
            seen_token: r.token,
        });
    }
    let effects = shared.runner.effects(&scope).await;
    let check_started = Instant::now();
    let mut report = analyse(&config, &shared.slots, &events, &finals, effects.as_ref());
    if let Some(rig) = &rig {
        check_rig(&mut report, rig, &shared.slots, &events, config.short_ttl);
        if let Some(x) = report.faults.as_mut() {
            x.purges_failed_retryably = purges_failed_retryably;
        }
        if purge_errors > 0 {
            report
                .unexpected
                .push(format!("{purge_errors} purge_expired calls failed"));
        }
    }
    report.check_time = check_started.elapsed();
    report.origin = Some(shared.origin);
    report.events = events;
    report.run_time = run_time;
    report.executions = shared.counters.succeeded.load(Ordering::Relaxed);
    for f in WORK_FAULTS {
        report.executions_by_fault.insert(
            format!("{f:?}"),
            shared.counters.started[work_index(f)].load(Ordering::Relaxed),
        );
    }
    report
}
