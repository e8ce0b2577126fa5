//! Which pods a run takes: a rotation over the matching pods without blind spots.
//!
//! Pods are ordered by a hash of (policy UID, pod UID): a stable order that mixes nodes and
//! namespaces, the same after an operator restart and unaffected by other pods coming and
//! going. The state kept in the policy's status is a cursor (the last position visited in
//! this rotation) plus the positions past the cursor already profiled (taken out of order
//! when earlier pods had to be passed over). A run takes, in order, the pods after the
//! cursor that are not yet profiled, so that every pod is profiled once before any pod is
//! profiled twice; a pod that appears behind the cursor waits for the next rotation.
//!
//! A pod is passed over (and stays unprofiled, ahead of the cursor) when its node is at its
//! budget, when the run already spans `maxNodes` nodes, or when its namespace's request is
//! full. When the only pods left in a rotation are on nodes at their budget, the rotation
//! completes without them, so that one busy node never stalls the fleet's profiling; the
//! coverage in the status shows the gap.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use flamefleet_api::RotationState;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use sha2::{Digest, Sha256};

/// Most pods one ProfileRequest lists (`spec.podNames` is capped at 256 by the schema).
pub const MAX_PODS_PER_REQUEST: usize = 256;
/// Most positions kept in `rotation.ahead`; a run takes no pod out of order past this.
pub const MAX_AHEAD: usize = 2048;

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
    // At most two passes: the rest of this rotation, then (if it completes) the next one.
    for _pass in 0..2 {
        let cursor = state.cursor.as_deref().and_then(parse_position);
        let mut ahead: BTreeSet<u64> = state
            .ahead
            .iter()
            .filter_map(|s| parse_position(s))
            .collect();
        let before = walk.taken.len();
        let skipped_before = walk.skipped.len();
        let mut open_ahead = false;
        for (i, c) in candidates.iter().enumerate() {
            if cursor.is_some_and(|cur| c.position <= cur) || ahead.contains(&c.position) {
                continue;
            }
            if walk.full() {
                break;
            }
            let out_of_order = open_ahead;
            if out_of_order && ahead.len() >= MAX_AHEAD {
                break;
            }
            if walk.offer(i) {
                if out_of_order {
                    ahead.insert(c.position);
                }
            } else {
                open_ahead = true;
            }
        }
        let took = walk.taken.len() - before;
        let newly_taken: Vec<usize> = walk.taken[before..].to_vec();
        // Advance the cursor over the contiguous prefix of profiled pods.
        let taken_positions: BTreeSet<u64> = newly_taken
            .iter()
            .map(|&i| candidates[i].position)
            .collect();
        let mut new_cursor = cursor;
        for c in candidates {
            if cursor.is_some_and(|cur| c.position <= cur) {
                continue;
            }
            if taken_positions.contains(&c.position) || ahead.contains(&c.position) {
                new_cursor = Some(c.position);
                ahead.remove(&c.position);
            } else {
                break;
            }
        }
        state.profiled += i64::try_from(took).unwrap_or(0);
        state.cursor = new_cursor.map(format_position);
        state.ahead = ahead.iter().map(|p| format_position(*p)).collect();
        let remaining = candidates
            .iter()
            .any(|c| new_cursor.is_none_or(|cur| c.position > cur) && !ahead.contains(&c.position));
        // Only pods on nodes at their budget are left, and none could be taken: the rotation
        // completes without them rather than stall.
        let only_budget_blocked = took == 0
            && walk.skipped[skipped_before..]
                .iter()
                .all(|(_, r, _)| r.is_budget())
            && walk.skipped.len() > skipped_before;
        if remaining && !only_budget_blocked {
            break;
        }
        if candidates.is_empty() {
            break;
        }
        completed = Some(state.profiled);
        state = RotationState {
            number: state.number + 1,
            previous_start_time: state.start_time.clone(),
            start_time: Some(Time(now)),
            cursor: None,
            ahead: Vec::new(),
            profiled: 0,
        };
        if walk.full() {
            break;
        }
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
    fn a_busy_node_is_skipped_and_its_pods_wait_ahead_of_the_cursor() {
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
        // First run takes the node-1 pods, node-0 is busy.
        let s = select(
            &c,
            &RotationState::default(),
            limits(4),
            &mut Busy("node-0".into()),
            t(0),
        );
        assert_eq!(s.taken.len(), 2);
        assert!(s.completed.is_none());
        // Still busy: the rotation completes without node-0's pods; the new rotation starts
        // with node-1's pods again.
        let s2 = select(&c, &s.state, limits(4), &mut Busy("node-0".into()), t(1));
        assert_eq!(s2.completed, Some(2));
        assert_eq!(s2.taken.len(), 2);
        assert!(s2.taken.iter().all(|&i| c[i].node == "node-1"));
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
        assert!(!s.state.ahead.is_empty());
        let fewer: Vec<Candidate> = c.iter().filter(|p| p.node == busy).cloned().collect();
        let s2 = select(&fewer, &s.state, limits(4), &mut Open, t(1));
        assert_eq!(s2.taken.len(), 4);
    }
}
