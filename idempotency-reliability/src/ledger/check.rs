//! The checks on a soak's ledger: what the store and the work did, held against the
//! promise (see the module above).

use super::*;

/// A Completed record seen by a read: the value it holds and its token.
#[derive(Clone, Debug)]
pub struct SeenCompleted {
    /// The record.
    pub id: RecordId,
    /// The value it holds.
    pub value: u64,
    /// Its token.
    pub token: u64,
}

/// What [`check`] found.
#[derive(Debug, Default)]
pub struct Findings {
    /// Broken rules other than double effects, each with the record's ledger.
    pub violations: Vec<String>,
    /// Double effects: two executions that acted while one of them held the key, or two
    /// completions of a record that never expires.
    pub double_effects: Vec<String>,
    /// Store operations checked.
    pub ops: usize,
    /// Executions checked.
    pub executions: usize,
    /// Leases granted by a claim on a key that had had a record before (it expired, and was
    /// purged or replaced).
    pub claims_after_expiry: usize,
    /// Completions, failures and extensions of a token that a newer lease had replaced, all
    /// fenced.
    pub stale_writes_fenced: usize,
    /// Completions that applied.
    pub completions_applied: usize,
    /// Extensions that applied.
    pub extensions_applied: usize,
}

/// One record's operations, executions and Completed reads.
type RecordLedger<'a> = (Vec<&'a StoreOp>, Vec<&'a Execution>, Vec<&'a SeenCompleted>);

/// Checks the ledger (see the module docs). `expiring` holds the records whose retention is
/// short enough to pass during the run, with that retention; `epsilon` is the clock skew
/// allowed, in nanoseconds.
pub fn check(
    ops: &[StoreOp],
    executions: &[Execution],
    seen: &[SeenCompleted],
    expiring: &HashMap<RecordId, Duration>,
    epsilon: u64,
) -> Findings {
    let mut findings = Findings {
        ops: ops.len(),
        executions: executions.len(),
        ..Findings::default()
    };
    let mut by_id: BTreeMap<String, RecordLedger<'_>> = BTreeMap::new();
    let mut ids: HashMap<String, &RecordId> = HashMap::new();
    for op in ops {
        let name = op.id.to_string();
        ids.entry(name.clone()).or_insert(&op.id);
        by_id.entry(name).or_default().0.push(op);
    }
    for e in executions {
        let name = e.id.to_string();
        ids.entry(name.clone()).or_insert(&e.id);
        by_id.entry(name).or_default().1.push(e);
    }
    for s in seen {
        let name = s.id.to_string();
        ids.entry(name.clone()).or_insert(&s.id);
        by_id.entry(name).or_default().2.push(s);
    }
    for (name, (ops, execs, seen)) in &by_id {
        let retention = expiring.get(ids[name]).copied();
        check_record(&mut findings, name, ops, execs, seen, retention, epsilon);
    }
    findings
}

fn check_record(
    findings: &mut Findings,
    name: &str,
    ops: &[&StoreOp],
    execs: &[&Execution],
    seen: &[&SeenCompleted],
    retention: Option<Duration>,
    epsilon: u64,
) {
    let mut problems: Vec<String> = Vec::new();
    let mut doubles: Vec<String> = Vec::new();
    let mut grants: Vec<&StoreOp> = ops
        .iter()
        .copied()
        .filter(|o| matches!(o.kind, OpKind::Claim | OpKind::Reclaim) && o.applied == Applied::Yes)
        .collect();
    grants.sort_by_key(|o| o.invoked);
    findings.claims_after_expiry += grants
        .iter()
        .skip(1)
        .filter(|g| g.kind == OpKind::Claim)
        .count();

    // Tokens never repeat, and a lease granted after another was answered has a greater one.
    let mut tokens = HashSet::new();
    for g in &grants {
        if !tokens.insert(g.token) {
            problems.push(format!("token {} was granted twice", g.token));
        }
    }
    for a in &grants {
        for b in &grants {
            if a.returned < b.invoked && a.token >= b.token {
                problems.push(format!(
                    "token {} was granted after token {} had been, yet is not greater",
                    b.token, a.token
                ));
            }
        }
    }

    // A holder whose token a newer lease replaced never writes.
    for op in ops {
        if !matches!(
            op.kind,
            OpKind::Extend | OpKind::Complete | OpKind::Fail | OpKind::FailPermanently
        ) {
            continue;
        }
        let replaced = grants
            .iter()
            .find(|g| g.token > op.token && g.returned < op.invoked);
        match (replaced, op.applied) {
            (Some(g), Applied::Yes) => problems.push(format!(
                "{:?} of token {} applied after token {} was granted",
                op.kind, op.token, g.token
            )),
            (Some(_), Applied::No) => findings.stale_writes_fenced += 1,
            _ => {}
        }
        if op.applied == Applied::Yes {
            match op.kind {
                OpKind::Complete => findings.completions_applied += 1,
                OpKind::Extend => findings.extensions_applied += 1,
                _ => {}
            }
        }
    }

    // Every execution holds a granted token, and no failure releases a key whose work acted
    // (a permanent failure closes it instead).
    for e in execs {
        if !tokens.contains(&e.token) {
            problems.push(format!(
                "execution of call {} ran with token {}, which was never granted",
                e.value, e.token
            ));
        }
        if e.end.acted() {
            if let Some(f) = ops
                .iter()
                .find(|o| o.kind == OpKind::Fail && o.token == e.token && o.applied == Applied::Yes)
            {
                problems.push(format!(
                    "call {}'s work ended {:?} (it acted), yet a failure released token {} at {}",
                    e.value,
                    e.end,
                    e.token,
                    f.invoked / 1000
                ));
            }
        }
    }

    // How long each token's holder certainly held the key: until the last lease it was
    // granted passed or, once its completion applied, for the record's retention (the
    // completion ends the lease).
    let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    let mut leased_until: HashMap<u64, u64> = HashMap::new();
    let mut retained_until: HashMap<u64, u64> = HashMap::new();
    for op in ops.iter().filter(|o| o.applied == Applied::Yes) {
        let until = op.invoked.saturating_add(nanos(op.duration));
        let map = match op.kind {
            OpKind::Claim | OpKind::Reclaim | OpKind::Extend => &mut leased_until,
            // A permanent failure closes the key for the retention, as a completion does.
            OpKind::Complete | OpKind::FailPermanently => &mut retained_until,
            OpKind::Fail => continue,
        };
        let entry = map.entry(op.token).or_insert(0);
        *entry = (*entry).max(until);
    }
    for a in execs.iter().filter(|e| e.end.acted()) {
        let Some(&leased) = leased_until.get(&a.token) else {
            continue;
        };
        let until = match (retained_until.get(&a.token), retention) {
            (Some(&retained), _) => retained,
            // A completion may have applied unseen (its answer was an error, or the call was
            // dropped while it was in flight): it came after the work ended, and a short
            // retention may end the hold before the lease would have.
            (None, Some(ttl)) if a.end == ExecEnd::Ok => {
                leased.min(a.ended.saturating_add(nanos(ttl)))
            }
            (None, _) => leased,
        };
        for b in execs.iter().filter(|b| b.token > a.token) {
            if b.started.saturating_add(epsilon) < until {
                let line = format!(
                    "call {} (token {}) started at {} while call {} (token {}, ended {:?}) held \
                     the key until {}",
                    b.value,
                    b.token,
                    b.started / 1000,
                    a.value,
                    a.token,
                    a.end,
                    until / 1000
                );
                if b.end.acted() {
                    doubles.push(line);
                } else {
                    problems.push(format!("two holders at once: {line}"));
                }
            }
        }
    }
    if retention.is_none() {
        let applied: Vec<u64> = ops
            .iter()
            .filter(|o| o.kind == OpKind::Complete && o.applied == Applied::Yes)
            .map(|o| o.token)
            .collect();
        if applied.len() > 1 {
            doubles.push(format!(
                "{} completions applied on a record that never expires (tokens {applied:?})",
                applied.len()
            ));
        }
    }

    // A Completed record holds the value of the execution of its own token.
    let token_of: HashMap<u64, u64> = execs.iter().map(|e| (e.value, e.token)).collect();
    for s in seen {
        match token_of.get(&s.value) {
            Some(&t) if t == s.token => {}
            Some(&t) => problems.push(format!(
                "a read saw call {}'s value under token {}, but that call ran with token {t}",
                s.value, s.token
            )),
            None => problems.push(format!(
                "a read saw call {}'s value, but no execution of that call was recorded",
                s.value
            )),
        }
    }

    if problems.is_empty() && doubles.is_empty() {
        return;
    }
    let dump = dump(ops, execs);
    for p in problems {
        findings
            .violations
            .push(format!("{name}: {p}\n  ledger:\n{dump}"));
    }
    for d in doubles {
        findings
            .double_effects
            .push(format!("{name}: {d}\n  ledger:\n{dump}"));
    }
}

/// The record's ledger in time order (µs), for a report.
fn dump(ops: &[&StoreOp], execs: &[&Execution]) -> String {
    let mut lines: Vec<(u64, String)> = ops
        .iter()
        .map(|o| {
            (
                o.invoked,
                format!(
                    "    [{:>10} .. {:>10}] store {:?} token {} -> {:?} ({} ms)",
                    o.invoked / 1000,
                    o.returned / 1000,
                    o.kind,
                    o.token,
                    o.applied,
                    o.duration.as_millis()
                ),
            )
        })
        .chain(execs.iter().map(|e| {
            (
                e.started,
                format!(
                    "    [{:>10} .. {:>10}] work of call {} with token {} -> {:?}{}",
                    e.started / 1000,
                    e.ended / 1000,
                    e.value,
                    e.token,
                    e.end,
                    if e.long { " (long)" } else { "" }
                ),
            )
        }))
        .collect();
    lines.sort_by_key(|(t, _)| *t);
    lines
        .into_iter()
        .take(60)
        .map(|(_, l)| l)
        .collect::<Vec<_>>()
        .join("\n")
}
