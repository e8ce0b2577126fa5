//! Which pods a run takes: a rotation over the matching pods without blind spots.
//!
//! Pods are ordered by a hash of (policy UID, pod UID): a stable order that mixes nodes and
//! namespaces, the same after an operator restart and unaffected by other pods coming and
//! going. The state kept in the policy's status is a cursor (the last position visited in
//! this rotation), the positions past the cursor already profiled (taken out of order when
//! earlier pods had to be passed over), and the deferred positions: pods passed over because
//! their node was at its budget. A run first offers the deferred pods, then takes, in order,
//! the pods after the cursor that are not yet profiled, so that every pod is profiled once
//! before any pod is profiled twice; a pod that appears behind the cursor waits for the
//! next rotation.
//!
//! A pod on a node at its budget does not hold the cursor: it is deferred (owed) and the
//! cursor passes it, so that a busy part of the fleet never stops the rotation from reaching
//! the rest. A pod passed over because the run already spans `maxNodes` nodes, or because
//! its namespace's request is full, stays ahead of the cursor for the next run. The rotation
//! completes when the cursor has passed every pod and every deferred pod was either profiled
//! or refused by its node's budget in this run; deferred pods left then are carried into
//! the next rotation, still first in line, and the coverage in the status shows the gap.
//! The owed list is bounded ([`MAX_DEFERRED`]); a pod on a busy node past that bound is
//! passed all the same and simply misses this rotation.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use flamefleet_api::RotationState;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use sha2::{Digest, Sha256};

/// Most pods one ProfileRequest lists (`spec.podNames` is capped at 256 by the schema).
pub const MAX_PODS_PER_REQUEST: usize = 256;
/// Most positions kept in `rotation.ahead`; a run takes no pod out of order past this.
pub const MAX_AHEAD: usize = 2048;
/// Most positions kept in `rotation.deferred`; past this a pod on a node at its budget is
/// passed without being owed: it misses this rotation (the coverage shows it) and is
/// visited again in the next one.
pub const MAX_DEFERRED: usize = 2048;

/// A pod that may be sampled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Position in the rotation order.
    pub position: u64,
    /// Pod UID.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Node name.
    pub node: String,
}

/// The position of a pod in a policy's rotation.
pub fn position(policy_uid: &str, pod_uid: &str) -> u64 {
    let digest = Sha256::new()
        .chain_update(policy_uid.as_bytes())
        .chain_update(b"/")
        .chain_update(pod_uid.as_bytes())
        .finalize();
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(bytes)
}

/// Sorts candidates into rotation order.
pub fn sort(candidates: &mut [Candidate]) {
    candidates.sort_by(|a, b| (a.position, &a.uid).cmp(&(b.position, &b.uid)));
}

fn format_position(p: u64) -> String {
    format!("{p:016x}")
}

fn parse_position(s: &str) -> Option<u64> {
    u64::from_str_radix(s, 16).ok()
}

/// Why a pod was passed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SkipReason {
    /// The node runs `maxConcurrentCapturesPerNode` captures already.
    ConcurrentCaptures,
    /// The node used up its duty cycle for the profile type.
    DutyCycle,
    /// The run already spans `maxNodes` nodes.
    MaxNodes,
    /// The run's request in this namespace lists the most pods a request may.
    NamespaceFull,
}

impl SkipReason {
    /// The name recorded in the status.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConcurrentCaptures => "ConcurrentCaptures",
            Self::DutyCycle => "DutyCycle",
            Self::MaxNodes => "MaxNodes",
            Self::NamespaceFull => "NamespaceFull",
        }
    }

    /// True for the reasons of the node budget.
    pub fn is_budget(self) -> bool {
        matches!(self, Self::ConcurrentCaptures | Self::DutyCycle)
    }
}

/// Decides whether a run may add a capture on a node (the node budget).
pub trait NodeGate {
    /// `Ok` when one more capture fits on `node`, else the reason and a message.
    fn admit(&mut self, node: &str) -> Result<(), (SkipReason, String)>;
}

/// A gate that admits everything (no budget).
#[derive(Debug, Default)]
pub struct Open;

impl NodeGate for Open {
    fn admit(&mut self, _node: &str) -> Result<(), (SkipReason, String)> {
        Ok(())
    }
}

/// What a run takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Indexes (into the candidates) of the pods taken, in rotation order.
    pub taken: Vec<usize>,
    /// Pods passed over, with why.
    pub skipped: Vec<(usize, SkipReason, String)>,
    /// The rotation state after the run.
    pub state: RotationState,
    /// Rotations completed by this run (0 or 1), with the number of pods profiled in it.
    pub completed: Option<i64>,
}

/// The limits of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most pods.
    pub pods: usize,
    /// Most distinct nodes.
    pub nodes: usize,
}

impl Limits {
    /// The limits from the policy's `sampling` for `matching` eligible pods: `maxPods`,
    /// `percent` (rounded up, at least one pod) and `maxNodes` together; one pod when none
    /// is set.
    pub fn from_spec(sampling: Option<&flamefleet_api::SamplingLimits>, matching: usize) -> Self {
        let sampling = sampling.cloned().unwrap_or_default();
        let as_usize = |v: i32| usize::try_from(v.max(1)).unwrap_or(1);
        let mut pods = match (sampling.max_pods, sampling.percent) {
            (None, None) => 1,
            (max, percent) => {
                let by_max = max.map_or(usize::MAX, as_usize);
                let by_percent = percent.map_or(usize::MAX, |p| {
                    (matching * as_usize(p)).div_ceil(100).max(1)
                });
                by_max.min(by_percent)
            }
        };
        pods = pods.min(matching.max(1));
        Self {
            pods,
            nodes: sampling.max_nodes.map_or(usize::MAX, as_usize),
        }
    }
}

struct Walk<'a, G> {
    candidates: &'a [Candidate],
    gate: &'a mut G,
    limits: Limits,
    taken: Vec<usize>,
    taken_uids: HashSet<&'a str>,
    skipped: Vec<(usize, SkipReason, String)>,
    nodes: BTreeSet<&'a str>,
    per_namespace: BTreeMap<&'a str, usize>,
    /// Verdicts per node, so a node is asked once per run.
    admitted: BTreeMap<&'a str, Result<(), (SkipReason, String)>>,
}

impl<'a, G: NodeGate> Walk<'a, G> {
    fn full(&self) -> bool {
        self.taken.len() >= self.limits.pods
    }

    /// Tries to take candidate `i`; true when taken.
    fn offer(&mut self, i: usize) -> bool {
        let c = &self.candidates[i];
        if self.taken_uids.contains(c.uid.as_str()) {
            return false;
        }
        if self
            .per_namespace
            .get(c.namespace.as_str())
            .copied()
            .unwrap_or(0)
            >= MAX_PODS_PER_REQUEST
        {
            self.skipped.push((
                i,
                SkipReason::NamespaceFull,
                format!(
                    "the run's request in {} lists {MAX_PODS_PER_REQUEST} pods already",
                    c.namespace
                ),
            ));
            return false;
        }
        if !self.nodes.contains(c.node.as_str()) {
            if self.nodes.len() >= self.limits.nodes {
                self.skipped.push((
                    i,
                    SkipReason::MaxNodes,
                    format!(
                        "the run spans {} nodes already (maxNodes)",
                        self.nodes.len()
                    ),
                ));
                return false;
            }
            let verdict = match self.admitted.get(c.node.as_str()) {
                Some(v) => v.clone(),
                None => {
                    let v = self.gate.admit(&c.node);
                    self.admitted.insert(c.node.as_str(), v.clone());
                    v
                }
            };
            if let Err((reason, message)) = verdict {
                self.skipped.push((i, reason, message));
                return false;
            }
            self.nodes.insert(c.node.as_str());
        }
        *self.per_namespace.entry(c.namespace.as_str()).or_default() += 1;
        self.taken.push(i);
        self.taken_uids.insert(c.uid.as_str());
        true
    }
}

/// Offers candidate `i` to the run: `Some(true)` when taken, `None` when refused by its
/// node's budget (recorded in `budget_refused`), `Some(false)` otherwise.
fn offer<G: NodeGate>(
    walk: &mut Walk<'_, G>,
    i: usize,
    budget_refused: &mut HashSet<u64>,
) -> Option<bool> {
    let skips = walk.skipped.len();
    if walk.offer(i) {
        return Some(true);
    }
    let budget = walk
        .skipped
        .get(skips)
        .is_some_and(|(_, reason, _)| reason.is_budget());
    if budget {
        budget_refused.insert(walk.candidates[i].position);
        return None;
    }
    Some(false)
}

/// Picks the pods of one run among `candidates` (in rotation order, see [`sort`]) from the
/// rotation `state`, admitting nodes through `gate`; `now` stamps a rotation that starts.
pub fn select<G: NodeGate>(
    candidates: &[Candidate],
    state: &RotationState,
    limits: Limits,
    gate: &mut G,
    now: Timestamp,
) -> Selection {
    let mut state = normalized(state, candidates, now);
    let mut walk = Walk {
        candidates,
        gate,
        limits,
        taken: Vec::new(),
        taken_uids: HashSet::new(),
        skipped: Vec::new(),
        nodes: BTreeSet::new(),
        per_namespace: BTreeMap::new(),
        admitted: BTreeMap::new(),
    };
    let mut completed = None;
    // The state just before this run's first completion: a run that takes no pod at all
    // goes back to it (see below).
    let mut before_completion: Option<RotationState> = None;
    // Positions refused by their node's budget in this run.
    let mut budget_refused: HashSet<u64> = HashSet::new();
    // At most two passes: the rest of this rotation, then (if it completes) the next one.
    for pass in 0..2 {
        let cursor = state.cursor.as_deref().and_then(parse_position);
        let mut ahead: BTreeSet<u64> = state
            .ahead
            .iter()
            .filter_map(|s| parse_position(s))
            .collect();
        let mut deferred: BTreeSet<u64> = state
            .deferred
            .iter()
            .filter_map(|s| parse_position(s))
            .collect();
        let before = walk.taken.len();
        let skipped_before = walk.skipped.len();
        // The deferred pods first, in rotation order.
        for (i, c) in candidates.iter().enumerate() {
            // Owed pods refused earlier in this run (before a rotation completed) are not
            // asked about again.
            if !deferred.contains(&c.position) || budget_refused.contains(&c.position) {
                continue;
            }
            if walk.full() {
                break;
            }
            if offer(&mut walk, i, &mut budget_refused) == Some(true) {
                deferred.remove(&c.position);
            }
        }
        // Then the pods after the cursor. `missed`: refused by their node's budget when the
        // owed list is full; the cursor passes them and they wait for the next rotation.
        let mut open_ahead = false;
        let mut missed: HashSet<u64> = HashSet::new();
        for (i, c) in candidates.iter().enumerate() {
            if cursor.is_some_and(|cur| c.position <= cur)
                || ahead.contains(&c.position)
                || deferred.contains(&c.position)
            {
                continue;
            }
            if walk.full() {
                break;
            }
            if open_ahead && ahead.len() >= MAX_AHEAD {
                break;
            }
            match offer(&mut walk, i, &mut budget_refused) {
                Some(true) => {}
                // On a node at its budget: owed; the cursor may pass it.
                None if deferred.len() < MAX_DEFERRED => {
                    deferred.insert(c.position);
                }
                None => {
                    missed.insert(c.position);
                }
                Some(false) => open_ahead = true,
            }
        }
        let took = walk.taken.len() - before;
        let taken_positions: BTreeSet<u64> = walk.taken[before..]
            .iter()
            .map(|&i| candidates[i].position)
            .collect();
        // Advance the cursor over the contiguous run of pods profiled or owed.
        let mut new_cursor = cursor;
        for c in candidates {
            if cursor.is_some_and(|cur| c.position <= cur) {
                continue;
            }
            if taken_positions.contains(&c.position)
                || ahead.contains(&c.position)
                || deferred.contains(&c.position)
                || missed.contains(&c.position)
            {
                new_cursor = Some(c.position);
                ahead.remove(&c.position);
            } else {
                break;
            }
        }
        // Pods taken past the new cursor are ahead of it.
        ahead.extend(
            taken_positions
                .iter()
                .filter(|&&p| new_cursor.is_none_or(|cur| p > cur)),
        );
        state.profiled += i64::try_from(took).unwrap_or(0);
        state.cursor = new_cursor.map(format_position);
        state.ahead = ahead.iter().map(|p| format_position(*p)).collect();
        state.deferred = deferred.iter().map(|p| format_position(*p)).collect();
        let remaining = candidates.iter().any(|c| {
            new_cursor.is_none_or(|cur| c.position > cur)
                && !ahead.contains(&c.position)
                && !deferred.contains(&c.position)
        });
        // Every owed pod was refused by its node's budget in this run.
        let deferred_settled = deferred.iter().all(|p| budget_refused.contains(p));
        // Only pods on nodes at their budget are left, and none could be taken (the owed
        // list is full): the rotation completes without them rather than stall.
        let only_budget_blocked = took == 0
            && walk.skipped[skipped_before..]
                .iter()
                .all(|(_, r, _)| r.is_budget())
            && walk.skipped.len() > skipped_before;
        if !(only_budget_blocked || (!remaining && deferred_settled)) {
            break;
        }
        if candidates.is_empty() {
            break;
        }
        // The next rotation, begun in this run, completes only by profiling a pod: one that
        // took none has visited nothing, and completing it would count a rotation that
        // covered no pod (and start the next one at the same instant).
        if pass > 0 && took == 0 {
            break;
        }
        before_completion.get_or_insert_with(|| state.clone());
        completed = Some(state.profiled);
        state = RotationState {
            number: state.number + 1,
            previous_start_time: state.start_time.clone(),
            start_time: Some(Time(now)),
            cursor: None,
            ahead: Vec::new(),
            deferred: state.deferred,
            profiled: 0,
        };
        if walk.full() {
            break;
        }
    }
    // A run that takes no pod (every node it could use is at its budget) completes no
    // rotation: the owed pods stay owed and the cursor where it passed them, but the
    // rotation's number, start and coverage stay as they were, so that a skipped run never
    // looks like a rotation lost. The rotation completes in the run that can take a pod.
    if walk.taken.is_empty()
        && let Some(before) = before_completion
    {
        state = before;
        completed = None;
    }
    Selection {
        taken: walk.taken,
        skipped: walk.skipped,
        state,
        completed,
    }
}

/// The state with a rotation number and start time, and without `ahead` positions of pods
/// that are gone.
fn normalized(state: &RotationState, candidates: &[Candidate], now: Timestamp) -> RotationState {
    let mut state = state.clone();
    if state.number == 0 {
        state.number = 1;
    }
    if state.start_time.is_none() {
        state.start_time = Some(Time(now));
    }
    let present: HashSet<u64> = candidates.iter().map(|c| c.position).collect();
    state
        .ahead
        .retain(|p| parse_position(p).is_some_and(|p| present.contains(&p)));
    state
        .deferred
        .retain(|p| parse_position(p).is_some_and(|p| present.contains(&p)));
    state
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn pods(n: usize, nodes: usize) -> Vec<Candidate> {
        let mut v: Vec<Candidate> = (0..n)
            .map(|i| {
                let uid = format!("uid-{i}");
                Candidate {
                    position: position("policy", &uid),
                    uid,
                    namespace: "ns".into(),
                    name: format!("pod-{i}"),
                    node: format!("node-{}", i % nodes),
                }
            })
            .collect();
        sort(&mut v);
        v
    }

    fn limits(pods: usize) -> Limits {
        Limits {
            pods,
            nodes: usize::MAX,
        }
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_767_600_000 + s).unwrap()
    }

    /// Runs `runs` selections, returning how often each pod was taken.
    fn run_many(
        candidates: &[Candidate],
        state: &mut RotationState,
        l: Limits,
        runs: usize,
    ) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for r in 0..runs {
            let s = select(candidates, state, l, &mut Open, t(r as i64));
            for i in s.taken {
                *counts.entry(candidates[i].name.clone()).or_default() += 1;
            }
            *state = s.state;
        }
        counts
    }

    #[test]
    fn twelve_pods_four_per_run_each_profiled_once_in_three_runs() {
        let c = pods(12, 3);
        let mut state = RotationState::default();
        let counts = run_many(&c, &mut state, limits(4), 3);
        assert_eq!(counts.len(), 12);
        assert!(counts.values().all(|&n| n == 1), "{counts:?}");
        assert_eq!(state.number, 2, "the rotation completed");
        // The next three runs cover everyone once more.
        let counts = run_many(&c, &mut state, limits(4), 3);
        assert!(
            counts.len() == 12 && counts.values().all(|&n| n == 1),
            "{counts:?}"
        );
    }

    #[test]
    fn a_pod_added_mid_rotation_is_covered_by_the_end_of_the_next() {
        let mut c = pods(12, 3);
        let mut state = RotationState::default();
        run_many(&c, &mut state, limits(4), 1);
        let uid = "uid-new".to_string();
        c.push(Candidate {
            position: position("policy", &uid),
            uid,
            namespace: "ns".into(),
            name: "pod-new".into(),
            node: "node-0".into(),
        });
        sort(&mut c);
        // Two rotations' worth of runs (13 pods / 4 per run): everyone at least once and
        // nobody more than twice before the newcomer had its first.
        let counts = run_many(&c, &mut state, limits(4), 7);
        assert!(
            counts.get("pod-new").copied().unwrap_or(0) >= 1,
            "{counts:?}"
        );
        assert_eq!(counts.len(), 13);
    }

    #[test]
    fn the_cursor_survives_a_round_trip_through_the_status() {
        let c = pods(10, 2);
        let first = select(&c, &RotationState::default(), limits(3), &mut Open, t(0));
        let json = serde_json::to_value(&first.state).unwrap();
        let restored: RotationState = serde_json::from_value(json).unwrap();
        let a = select(&c, &restored, limits(3), &mut Open, t(1));
        let b = select(&c, &first.state, limits(3), &mut Open, t(1));
        assert_eq!(a.taken, b.taken);
        assert!(a.taken.iter().all(|i| !first.taken.contains(i)));
    }

    struct Busy(String);
    impl NodeGate for Busy {
        fn admit(&mut self, node: &str) -> Result<(), (SkipReason, String)> {
            if node == self.0 {
                Err((SkipReason::ConcurrentCaptures, format!("{node} busy")))
            } else {
                Ok(())
            }
        }
    }

    #[test]
    fn a_busy_node_is_skipped_and_its_pods_are_owed() {
        let c = pods(12, 3);
        // The node of the first pod in rotation order is busy.
        let busy = c[0].node.clone();
        let s = select(
            &c,
            &RotationState::default(),
            limits(4),
            &mut Busy(busy.clone()),
            t(0),
        );
        assert_eq!(s.taken.len(), 4);
        assert!(s.taken.iter().all(|&i| c[i].node != busy));
        assert!(
            s.skipped
                .iter()
                .all(|(i, r, _)| c[*i].node == busy && *r == SkipReason::ConcurrentCaptures)
        );
        assert!(!s.skipped.is_empty());
        // Once the node is free, its pods are taken before any pod is profiled twice.
        let mut state = s.state;
        let mut counts: BTreeMap<String, usize> =
            s.taken.iter().map(|&i| (c[i].name.clone(), 1)).collect();
        for r in 1..3 {
            let s = select(&c, &state, limits(4), &mut Open, t(r));
            for i in s.taken {
                *counts.entry(c[i].name.clone()).or_default() += 1;
            }
            state = s.state;
        }
        assert_eq!(counts.len(), 12);
        assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    }

    #[test]
    fn only_budget_blocked_pods_left_completes_the_rotation() {
        let c = pods(4, 2);
        // node-0 is busy: the run takes node-1's pods and owes node-0's, and as nothing else
        // is left the rotation completes without them.
        let s = select(
            &c,
            &RotationState::default(),
            limits(4),
            &mut Busy("node-0".into()),
            t(0),
        );
        assert_eq!(s.taken.len(), 2);
        assert!(s.taken.iter().all(|&i| c[i].node == "node-1"));
        assert_eq!(s.completed, Some(2));
        assert_eq!(s.state.deferred.len(), 2, "{:?}", s.state);
        // node-0 is free again: its owed pods go first, then the new rotation goes on.
        let s2 = select(&c, &s.state, limits(2), &mut Open, t(1));
        assert_eq!(s2.taken.len(), 2);
        assert!(s2.taken.iter().all(|&i| c[i].node == "node-0"));
        assert!(s2.state.deferred.is_empty());
        // They are not taken again in this rotation: node-1's pods come next.
        let s3 = select(&c, &s2.state, limits(2), &mut Open, t(2));
        assert!(s3.taken.iter().all(|&i| c[i].node == "node-1"), "{s3:?}");
        assert_eq!(s3.completed, Some(4));
    }

    /// A one-pod policy whose node is at its budget for a run: the skipped run completes no
    /// rotation (its number, start and previous start stay), the pod stays owed, and the
    /// next run that can take it completes the rotation it was owed in.
    #[test]
    fn a_run_that_takes_nothing_completes_no_rotation() {
        let c = pods(1, 1);
        let first = select(&c, &RotationState::default(), limits(1), &mut Open, t(0));
        assert_eq!(first.taken.len(), 1);
        assert_eq!(first.completed, Some(1));
        let after_first = first.state.clone();
        assert_eq!(after_first.number, 2);

        let skipped = select(
            &c,
            &after_first,
            limits(1),
            &mut Busy(c[0].node.clone()),
            t(60),
        );
        assert!(skipped.taken.is_empty());
        assert_eq!(skipped.completed, None, "{skipped:?}");
        assert_eq!(skipped.skipped.len(), 1);
        assert_eq!(skipped.state.number, after_first.number);
        assert_eq!(skipped.state.start_time, after_first.start_time);
        assert_eq!(
            skipped.state.previous_start_time,
            after_first.previous_start_time
        );
        assert_eq!(skipped.state.deferred.len(), 1, "the pod is owed");

        // Skipped again: still nothing moves.
        let again = select(
            &c,
            &skipped.state,
            limits(1),
            &mut Busy(c[0].node.clone()),
            t(120),
        );
        assert_eq!(again.completed, None);
        assert_eq!(again.state.number, after_first.number);

        let free = select(&c, &again.state, limits(1), &mut Open, t(180));
        assert_eq!(free.taken.len(), 1);
        assert_eq!(
            free.completed,
            Some(1),
            "the owed pod completes its rotation"
        );
        assert_eq!(free.state.number, after_first.number + 1);
        assert_eq!(free.state.previous_start_time, after_first.start_time);
        assert!(free.state.deferred.is_empty());
    }

    /// Runs rotations over `pods` pods on `nodes` nodes of which the first `busy` stay at
    /// their budget, 100 pods and 30 nodes a run, until the first rotation completes; returns
    /// (pods of free nodes, times each pod was taken, the completing run's count, the state,
    /// runs).
    fn rotate_with_busy_nodes(
        pods_n: usize,
        nodes: usize,
        busy: usize,
    ) -> (
        usize,
        BTreeMap<String, usize>,
        Option<i64>,
        RotationState,
        i64,
    ) {
        struct FirstBusy(usize);
        impl NodeGate for FirstBusy {
            fn admit(&mut self, node: &str) -> Result<(), (SkipReason, String)> {
                let n: usize = node.trim_start_matches("node-").parse().unwrap();
                if n < self.0 {
                    Err((SkipReason::DutyCycle, format!("{node} busy")))
                } else {
                    Ok(())
                }
            }
        }
        let c = pods(pods_n, nodes);
        let node_of =
            |i: usize| -> usize { c[i].node.trim_start_matches("node-").parse().unwrap() };
        let free = (0..c.len()).filter(|&i| node_of(i) >= busy).count();
        let mut state = RotationState::default();
        let l = Limits {
            pods: 100,
            nodes: 30,
        };
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        let mut runs = 0;
        let mut completed = None;
        while state.number < 2 && runs < 500 {
            let s = select(&c, &state, l, &mut FirstBusy(busy), t(runs));
            completed = s.completed;
            for i in s.taken {
                assert!(node_of(i) >= busy, "a pod of busy {} was taken", c[i].node);
                *counts.entry(c[i].name.clone()).or_default() += 1;
            }
            state = s.state;
            runs += 1;
        }
        assert_eq!(state.number, 2, "the rotation completed within {runs} runs");
        (free, counts, completed, state, runs)
    }

    /// A quarter of the nodes stay at their budget, with more free pods than the status keeps
    /// out-of-order positions for: the rotation still reaches every pod of the other nodes,
    /// each exactly once, completes, and owes the busy nodes' pods.
    #[test]
    fn a_busy_part_of_the_fleet_does_not_hide_the_rest() {
        let (free, counts, completed, state, runs) = rotate_with_busy_nodes(6000, 60, 15);
        assert_eq!(free, 4500);
        assert!(free > MAX_AHEAD && 6000 - free < MAX_DEFERRED);
        assert_eq!(counts.len(), free, "every pod of the free nodes");
        assert_eq!(completed, Some(4500), "each profiled once in the rotation");
        // The completing run may go on into the next rotation with the rest of its room.
        assert!(counts.values().filter(|&&n| n > 1).count() < 100);
        assert_eq!(
            state.deferred.len(),
            6000 - free,
            "the busy nodes' pods are owed"
        );
        assert!(runs <= 50, "45 full runs, a few more for maxNodes: {runs}");
    }

    /// More pods sit on busy nodes than the owed list holds: those past its bound miss the
    /// rotation, but every pod of a free node is still profiled, once.
    #[test]
    fn more_busy_pods_than_can_be_owed_still_leave_no_free_pod_behind() {
        let (free, counts, completed, state, runs) = rotate_with_busy_nodes(10_000, 100, 35);
        assert_eq!(free, 6500);
        assert!(10_000 - free > MAX_DEFERRED);
        assert_eq!(counts.len(), free, "every pod of the free nodes");
        assert_eq!(completed, Some(6500), "each profiled once in the rotation");
        assert_eq!(state.deferred.len(), MAX_DEFERRED, "the owed list is full");
        assert!(runs <= 75, "65 full runs, a few more for maxNodes: {runs}");
    }

    #[test]
    fn max_nodes_limits_the_nodes_of_a_run_without_blind_spots() {
        let c = pods(12, 6);
        let mut state = RotationState::default();
        let l = Limits { pods: 4, nodes: 2 };
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for r in 0..6 {
            let s = select(&c, &state, l, &mut Open, t(r));
            let nodes: BTreeSet<&str> = s.taken.iter().map(|&i| c[i].node.as_str()).collect();
            assert!(nodes.len() <= 2);
            for i in s.taken {
                *counts.entry(c[i].name.clone()).or_default() += 1;
            }
            state = s.state;
            if state.number == 2 {
                break;
            }
        }
        assert_eq!(counts.len(), 12, "{counts:?}");
        assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    }

    #[test]
    fn limits_combine_max_pods_percent_and_nodes() {
        let s = |max_pods, percent, max_nodes| flamefleet_api::SamplingLimits {
            max_pods,
            percent,
            max_nodes,
        };
        assert_eq!(Limits::from_spec(None, 50).pods, 1);
        assert_eq!(
            Limits::from_spec(Some(&s(Some(10), None, None)), 50).pods,
            10
        );
        assert_eq!(
            Limits::from_spec(Some(&s(Some(10), Some(10), None)), 50).pods,
            5
        );
        assert_eq!(Limits::from_spec(Some(&s(None, Some(1), None)), 50).pods, 1);
        assert_eq!(Limits::from_spec(Some(&s(Some(10), None, None)), 3).pods, 3);
        assert_eq!(Limits::from_spec(Some(&s(None, None, Some(2))), 3).nodes, 2);
    }

    #[test]
    fn vanished_pods_leave_the_state() {
        let c = pods(12, 3);
        let busy = c[0].node.clone();
        let s = select(
            &c,
            &RotationState::default(),
            limits(4),
            &mut Busy(busy.clone()),
            t(0),
        );
        assert!(!s.state.deferred.is_empty());
        let fewer: Vec<Candidate> = c.iter().filter(|p| p.node == busy).cloned().collect();
        let s2 = select(&fewer, &s.state, limits(4), &mut Open, t(1));
        assert_eq!(s2.taken.len(), 4);
        let gone: Vec<Candidate> = c.iter().filter(|p| p.node != busy).cloned().collect();
        let s3 = select(&gone, &s.state, limits(4), &mut Open, t(1));
        assert!(s3.state.deferred.is_empty(), "{:?}", s3.state);
    }
}
