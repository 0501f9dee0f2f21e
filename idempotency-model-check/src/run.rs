//! Running the checker on a world and reporting what it found.

use crate::model::{Action, ProtocolModel, State};
use crate::world::World;
use stateright::{Checker, HasDiscoveries, Model};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

/// What one exhaustive check found.
#[derive(Debug)]
pub struct Report {
    /// The world that was explored.
    pub world: World,
    /// Distinct states explored.
    pub unique_states: usize,
    /// States generated, duplicates included.
    pub generated_states: usize,
    /// The longest path explored, in steps.
    pub max_depth: usize,
    /// How long the check took.
    pub elapsed: Duration,
    /// Whether every state was explored (no early stop).
    pub complete: bool,
    /// For each property with a discovery (a counterexample for `always`, an example for
    /// `sometimes`): the path, one step per line.
    pub discoveries: BTreeMap<&'static str, String>,
}

impl Report {
    /// The counterexample or example found for `property`, if any.
    pub fn discovery(&self, property: &str) -> Option<&str> {
        self.discoveries.get(property).map(String::as_str)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} world, {:?}, {} clients: {} unique states ({} generated, depth {}) in {:.2?}{}",
            self.world.mode,
            self.world.variant,
            self.world.clients.len(),
            self.unique_states,
            self.generated_states,
            self.max_depth,
            self.elapsed,
            if self.complete {
                ""
            } else {
                " (stopped at the first counterexample)"
            },
        )
    }
}

fn trace(model: &ProtocolModel, path: Vec<(State, Option<Action>)>) -> String {
    let mut out = String::new();
    let mut step = 0;
    let mut pending: Option<Action> = None;
    for (state, action) in path {
        match pending.take() {
            None => out.push_str(&format!("  start  {}\n", model.describe(&state))),
            Some(a) => {
                step += 1;
                out.push_str(&format!(
                    "  {step:>3}. {}\n       {}\n",
                    model.format_action(&a),
                    model.describe(&state)
                ));
            }
        }
        pending = action;
    }
    out
}

/// Explores every state of `world` breadth-first (so counterexamples are shortest), checking
/// every property. With `stop_at`, the check stops as soon as that property has a
/// discovery.
pub fn check(world: World, stop_at: Option<&'static str>) -> Report {
    let model = ProtocolModel::new(world.clone());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(2));
    let started = Instant::now();
    let mut builder = model.clone().checker().threads(threads);
    if let Some(name) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])));
    }
    let checker = builder.spawn_bfs().join();
    let elapsed = started.elapsed();
    let discoveries = checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| (name, trace(&model, path.into_vec())))
        .collect::<BTreeMap<_, _>>();
    let complete = stop_at.is_none_or(|name| !discoveries.contains_key(name));
    Report {
        world,
        unique_states: checker.unique_state_count(),
        generated_states: checker.state_count(),
        max_depth: checker.max_depth(),
        elapsed,
        complete,
        discoveries,
    }
}
