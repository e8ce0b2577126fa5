//! What a triggered CPU profile says of its lead-up (docs/triggers.md, "The lead-up"): the
//! samples the agent's ring kept before the fire, labelled `trigger_phase=lead-up` and
//! `ms_before_fire`, and the capture's own, labelled `trigger_phase=after-fire`.

use std::collections::{HashMap, HashSet};
use std::path::Path;

/// Figures of one profile.
#[derive(Debug, Default)]
pub struct Figures {
    /// Samples labelled `trigger_phase=lead-up`.
    pub lead_up: usize,
    /// Of them, those with the function on their stack.
    pub with_function: usize,
    /// Of them, those whose leaf (innermost frame) is the function.
    pub leaf_function: usize,
    /// The lead-up's most frequent leaf function.
    pub top_leaf: Option<String>,
    /// The oldest lead-up sample's `ms_before_fire`.
    pub oldest_ms: i64,
    /// Samples (`samples/count`) labelled `trigger_phase=after-fire`.
    pub after_fire: i64,
    /// Samples without a phase label.
    pub unlabelled: usize,
}

impl Figures {
    /// Percent of the lead-up's samples with the function on their stack.
    pub fn share(&self) -> f64 {
        self.with_function as f64 * 100.0 / self.lead_up.max(1) as f64
    }

    /// Percent of the lead-up's samples whose leaf is the function.
    pub fn leaf_share(&self) -> f64 {
        self.leaf_function as f64 * 100.0 / self.lead_up.max(1) as f64
    }
}

/// Reads the pprof at `file` (gzipped or not) and counts its lead-up and its samples under
/// `function`.
///
/// # Panics
/// When the file is not a readable pprof profile.
pub fn figures(file: &Path, function: &str) -> Figures {
    let bytes = std::fs::read(file).expect("reading the profile");
    let p = flamefleet_pprof::decode(&bytes).expect("a pprof profile");
    let s = |i: i64| {
        usize::try_from(i)
            .ok()
            .and_then(|i| p.string_table.get(i))
            .map_or("", String::as_str)
    };
    let names: HashMap<u64, &str> = p.function.iter().map(|f| (f.id, s(f.name))).collect();
    // Location → its innermost function's name.
    let leaf_of: HashMap<u64, &str> = p
        .location
        .iter()
        .filter_map(|l| Some((l.id, *names.get(&l.line.first()?.function_id)?)))
        .collect();
    let named: HashSet<u64> = p
        .location
        .iter()
        .filter(|l| {
            l.line
                .iter()
                .any(|line| names.get(&line.function_id) == Some(&function))
        })
        .map(|l| l.id)
        .collect();
    let mut out = Figures::default();
    let mut leaves: HashMap<&str, usize> = HashMap::new();
    for sample in &p.sample {
        let label = |key: &str| sample.label.iter().find(|l| s(l.key) == key);
        match label("trigger_phase").map(|l| s(l.str)) {
            Some("lead-up") => {
                out.lead_up += 1;
                if sample.location_id.iter().any(|id| named.contains(id)) {
                    out.with_function += 1;
                }
                let leaf = sample
                    .location_id
                    .first()
                    .and_then(|id| leaf_of.get(id))
                    .copied()
                    .unwrap_or("");
                if leaf == function {
                    out.leaf_function += 1;
                }
                *leaves.entry(leaf).or_default() += 1;
                out.oldest_ms = out
                    .oldest_ms
                    .max(label("ms_before_fire").map_or(0, |l| l.num));
            }
            Some("after-fire") => out.after_fire += sample.value.first().copied().unwrap_or(0),
            _ => out.unlabelled += 1,
        }
    }
    out.top_leaf = leaves
        .into_iter()
        .max_by_key(|(name, n)| (*n, std::cmp::Reverse(*name)))
        .map(|(name, _)| name.to_string());
    out
}
