//! After the run: each key's history checked against the model, the committed effects
//! counted, and the fault rig's figures checked.

use super::*;

pub(super) fn analyse(
    config: &SoakConfig,
    slots: &[Slot],
    events: &[Event],
    finals: &HashMap<usize, Response>,
    effects: Option<&HashMap<String, Vec<u64>>>,
) -> Report {
    let mut report = Report {
        label: config.label.clone(),
        seed: config.seed,
        keys: slots.len(),
        ..Report::default()
    };
    let mut per_key: BTreeMap<usize, Vec<Event>> = BTreeMap::new();
    for e in events {
        per_key.entry(e.key).or_default().push(e.clone());
    }
    let expiring = ExpiringOnceRegister {
        ttl: u64::try_from(config.short_ttl.as_nanos())
            .unwrap_or(u64::MAX)
            .saturating_sub(CLOCK_SKEW),
    };
    // Keys not decided yet: every key at first, searched below.
    let mut undecided: Vec<(String, Space, &Vec<Event>)> = Vec::new();
    for (&key, history) in &per_key {
        let slot = &slots[key];
        let name = format!("{:?} key {}", slot.space, slot.local);
        report.checked_ops += history.len();
        report.max_history = report.max_history.max(history.len());
        for e in history {
            if !e.is_final {
                report.ops += 1;
                *report.calls.entry(format!("{:?}", e.mode)).or_default() += 1;
            }
            *report
                .responses
                .entry(response_kind(e.op.output).to_owned())
                .or_default() += 1;
            if let Some(note) = &e.note {
                if note.starts_with("UNEXPECTED") {
                    report.unexpected.push(format!("{name}: {note}"));
                } else if matches!(note.as_str(), "timed out" | "cancelled") {
                    report.interrupted += 1;
                } else if e.op.output == Response::Unknown {
                    report.backend_errors += 1;
                }
            }
        }
        undecided.push((name.clone(), slot.space, history));
        if slot.space == Space::Short {
            count_short_effects(&mut report, &name, history, config.short_ttl);
        } else {
            count_effects(&mut report, key, &name, history, finals.get(&key), effects);
        }
    }
    // Every key is searched with a small budget first, then the keys left undecided with
    // larger ones, but only while the run still looks clean: once a violation or a double
    // effect is found, the run is known to have lost something, and what an undecided key
    // would add is one more count (a loss scenario's search of a long history of unknown
    // answers can take minutes).
    for budget in BUDGETS {
        if undecided.is_empty()
            || (budget != BUDGETS[0]
                && !(report.violations.is_empty() && report.double_effects.is_empty()))
        {
            break;
        }
        for (name, space, history) in std::mem::take(&mut undecided) {
            match search(space, history, &expiring, budget) {
                Verdict::Linearizable => {}
                Verdict::Violation { deepest } => {
                    report.violations.push(violation(&name, &deepest, history))
                }
                Verdict::Undecided { .. } => undecided.push((name, space, history)),
            }
        }
    }
    let steps = BUDGETS.iter().sum::<u64>();
    for (name, _, history) in undecided {
        report.undecided.push(format!(
            "{name}: undecided within {steps} search steps\n{}",
            dump(history)
        ));
    }
    if let Some(effects) = effects {
        report.effect_rows = Some(effects.values().map(Vec::len).sum());
    }
    report
}

/// The search budgets of a key's history, tried in turn while it stays undecided: most are
/// decided in far fewer than the first; a long history with many overlapping calls (an
/// open-ended unknown answer among hundreds of "in progress") may need the last.
const BUDGETS: [u64; 3] = [200_000, 5_000_000, 50_000_000];

/// Searches one key's history for a linearization within `budget` steps.
fn search(
    space: Space,
    history: &[Event],
    expiring: &ExpiringOnceRegister,
    budget: u64,
) -> Verdict {
    if space == Space::Short {
        let ops: Vec<_> = history
            .iter()
            .map(|e| Operation {
                call: e.op.call,
                ret: e.op.ret,
                input: Timed {
                    call: e.op.input,
                    at: e.op.call,
                    by: e.op.ret.unwrap_or(u64::MAX),
                },
                output: e.op.output,
            })
            .collect();
        check(expiring, &ops, budget)
    } else {
        let ops: Vec<_> = history.iter().map(|e| e.op.clone()).collect();
        check(&OnceRegister, &ops, budget)
    }
}

fn violation(name: &str, deepest: &[usize], history: &[Event]) -> String {
    format!(
        "{name}: not linearizable (deepest linearized prefix: {} of {} ops)\n{}",
        deepest.len(),
        history.len(),
        dump(history)
    )
}

/// Double effects of one key:
/// - two calls answered `Executed(Ok)` (two executions committed);
/// - an `Executed(Ok(v))` while the record ends holding something other than `v` (the committed
///   effect was lost or overwritten);
/// - a replay of a value other than the one the record ends with;
/// - with a business table: more than one row, a row without a Completed record, a Completed
///   record without its row, or a row whose value is not the stored one.
fn count_effects(
    report: &mut Report,
    key: usize,
    name: &str,
    history: &[Event],
    last: Option<&Response>,
    effects: Option<&HashMap<String, Vec<u64>>>,
) {
    let held = match last {
        Some(Response::ReadCompleted(v)) => Some(*v),
        _ => None,
    };
    if held.is_some() {
        report.committed_effects += 1;
    }
    let fresh: Vec<u64> = history
        .iter()
        .filter_map(|e| match e.op.output {
            Response::Fresh(v) => Some(v),
            _ => None,
        })
        .collect();
    if fresh.len() > 1 {
        report.double_effects.push(format!(
            "{name}: {} calls committed: {fresh:?}",
            fresh.len()
        ));
    }
    if let Some(v) = fresh.first() {
        if held != Some(*v) {
            report.double_effects.push(format!(
                "{name}: call {v} committed but the record ends with {held:?}"
            ));
        }
    }
    for e in history {
        if let Response::Replayed(v) | Response::ReadCompleted(v) = e.op.output {
            if held != Some(v) {
                report.double_effects.push(format!(
                    "{name}: a call saw {v} but the record ends with {held:?}"
                ));
            }
        }
    }
    if let Some(effects) = effects {
        let name_in_table = format!("key-{key:03}");
        let rows = effects.get(&name_in_table).cloned().unwrap_or_default();
        let expected: Vec<u64> = held.into_iter().collect();
        if rows != expected {
            report.double_effects.push(format!(
                "{name}: business rows {rows:?}, but the record ends with {held:?}"
            ));
        }
    }
}

/// Double effects of a short-retention key: two commits that cannot have been a retention
/// apart, in either order (each commit lies between its call and its answer).
fn count_short_effects(report: &mut Report, name: &str, history: &[Event], ttl: Duration) {
    let ttl = u64::try_from(ttl.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_sub(CLOCK_SKEW);
    let fresh: Vec<&Event> = history
        .iter()
        .filter(|e| matches!(e.op.output, Response::Fresh(_)))
        .collect();
    // Their commits are counted apart (`FaultFigures::short_commits`): a key commits once
    // per life, not once.
    for (i, a) in fresh.iter().enumerate() {
        for b in &fresh[i + 1..] {
            if b.ended < a.op.call.saturating_add(ttl) && a.ended < b.op.call.saturating_add(ttl) {
                report.double_effects.push(format!(
                    "{name}: calls {:?} and {:?} both committed within one retention",
                    a.op.input, b.op.input
                ));
            }
        }
    }
}

/// The ledger's checks, and the figures of the faults, the HTTP layer and the purger.
pub(super) fn check_rig(
    report: &mut Report,
    rig: &FaultRig,
    slots: &[Slot],
    events: &[Event],
    short_ttl: Duration,
) {
    let ops = rig.ledger().ops();
    let executions = rig.ledger().executions();
    let seen: Vec<SeenCompleted> = events
        .iter()
        .filter_map(|e| match (e.op.output, e.seen_token) {
            (Response::ReadCompleted(value), Some(token)) => Some(SeenCompleted {
                id: slots[e.key].id.clone(),
                value,
                token,
            }),
            _ => None,
        })
        .collect();
    let expiring: HashMap<RecordId, Duration> = slots
        .iter()
        .filter(|s| s.space == Space::Short)
        .map(|s| (s.id.clone(), short_ttl))
        .collect();
    let findings = ledger::check(&ops, &executions, &seen, &expiring, CLOCK_SKEW);
    report.violations.extend(findings.violations);
    report.double_effects.extend(findings.double_effects);
    report.checked_ops += findings.ops + findings.executions;

    let http_ids: HashSet<&RecordId> = slots
        .iter()
        .filter(|s| s.space == Space::Http)
        .map(|s| &s.id)
        .collect();
    let handlers: Vec<&Execution> = executions
        .iter()
        .filter(|e| http_ids.contains(&e.id))
        .collect();
    let mut long_by_id: HashMap<&RecordId, Vec<&Execution>> = HashMap::new();
    for e in handlers.iter().filter(|e| e.long) {
        long_by_id.entry(&e.id).or_default().push(e);
    }
    let http_events: Vec<&Event> = events
        .iter()
        .filter(|e| e.space == Space::Http && !e.is_final)
        .collect();
    let conflicts: Vec<&&Event> = http_events
        .iter()
        .filter(|e| e.op.output == Response::InProgress)
        .collect();
    let during_long = conflicts
        .iter()
        .filter(|e| {
            long_by_id.get(&slots[e.key].id).is_some_and(|longs| {
                longs
                    .iter()
                    .any(|l| l.started <= e.op.call && e.ended <= l.ended)
            })
        })
        .count();
    let (purge_calls, purged) = rig.ledger().purges();
    report.faults = Some(FaultFigures {
        injected: rig.injected(),
        outcome_unknown: events
            .iter()
            .filter(|e| {
                e.note
                    .as_deref()
                    .is_some_and(|n| n.starts_with("outcome unknown"))
            })
            .count(),
        store_ops: findings.ops,
        executions: findings.executions,
        completions_applied: findings.completions_applied,
        extensions_applied: findings.extensions_applied,
        long_works: executions
            .iter()
            .filter(|e| e.long && !http_ids.contains(&e.id))
            .count(),
        http_calls: http_events.len(),
        handlers: handlers.len(),
        long_handlers: handlers.iter().filter(|e| e.long).count(),
        http_conflicts: conflicts.len(),
        conflicts_during_long: during_long,
        short_calls: events
            .iter()
            .filter(|e| e.space == Space::Short && !e.is_final)
            .count(),
        short_commits: events
            .iter()
            .filter(|e| e.space == Space::Short && matches!(e.op.output, Response::Fresh(_)))
            .count(),
        purge_calls,
        purged,
        purges_failed_retryably: 0,
        claims_after_expiry: findings.claims_after_expiry,
        stale_writes_fenced: findings.stale_writes_fenced,
    });
}

fn response_kind(r: Response) -> &'static str {
    match r {
        Response::Fresh(_) => "fresh",
        Response::Replayed(_) => "replayed",
        Response::Released => "released",
        Response::Panicked => "panicked",
        Response::InProgress => "in_progress",
        Response::LeaseLost => "lease_lost",
        Response::Executed(_) => "executed",
        Response::ReadCompleted(_) => "read_completed",
        Response::ReadOpen => "read_open",
        Response::Unknown => "unknown",
        Response::FailedPermanently => "failed_permanently",
        Response::ReadFailed => "read_failed",
    }
}

fn dump(history: &[Event]) -> String {
    let mut sorted: Vec<&Event> = history.iter().collect();
    sorted.sort_by_key(|e| e.op.call);
    sorted
        .iter()
        .take(80)
        .map(|e| {
            format!(
                "  [{:>12} .. {:>12}] {:?}/{:?} {:?} -> {:?}{}",
                e.op.call / 1000,
                e.op.ret.map_or("?".to_owned(), |r| (r / 1000).to_string()),
                e.mode,
                e.work,
                e.op.input,
                e.op.output,
                e.note
                    .as_deref()
                    .map_or(String::new(), |n| format!(" ({n})"))
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
