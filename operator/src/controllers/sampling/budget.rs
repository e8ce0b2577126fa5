//! The per-node cost budget of scheduled runs, counted over everything that captures on a
//! node: every policy's runs and every ad hoc ProfileRequest.
//!
//! What runs on each node is derived from the API (the cached ProfileRequests and their
//! cached ProfileResultSlices), not from this process's dispatcher: the API is the one
//! record that survives an operator restart, a leader hand-over, and sharding
//! (`--request-selector`), where another operator dispatches captures to the same nodes. A
//! request occupies a node while it is Pending (on the nodes its pods run on) or Running (on
//! its nodes whose slice entry is not terminal). Runs created by this process but not yet in
//! the cache are reserved in memory until the cache shows them. Nothing is read from a
//! request's annotations: whoever creates a request writes them, and a tenant could claim
//! every node of the cluster to hold back everyone's scheduled runs.
//!
//! Two limits, per policy, checked against the node's total:
//! - `maxConcurrentCapturesPerNode`: captures running on the node at once (one request on
//!   one node is one capture, whatever its number of pods there);
//! - `maxDutyCyclePercent`: the share of a sliding window the node spends under *scheduled*
//!   capture of the policy's profile type. Ad hoc requests never count here and are never
//!   held back: scheduled runs yield to them.
//!
//! Per-tenant limits on ad hoc requests are a separate concern, admitted in
//! `controllers/profile_request/limits.rs`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use flamefleet_api::{
    NodeBudget, NodePhase, NodeStatus, ProfileRequest, ProfileResultSlice, ProfileType,
    RequestPhase,
};
use jiff::Timestamp;
use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};

use super::rotation::{NodeGate, SkipReason};
use crate::pods::slim::SlimPod;

/// Default `maxConcurrentCapturesPerNode`: one capture at a time per node.
pub const DEFAULT_MAX_CONCURRENT: usize = 1;
/// Default `maxDutyCyclePercent`. Google-Wide Profiling runs a few seconds every few
/// minutes (a few percent of the time) to stay within a 1-2% fleet overhead; at the 19 Hz
/// default of a policy's CPU captures (about 0.1% of a CPU while running, docs/benchmarks.md
/// "Continuous profiling"), 5%
/// of the time costs a node about 0.005% on average, and a heap capture (~3% slower
/// allocations while running) about 0.15%.
pub const DEFAULT_DUTY_PERCENT: u32 = 5;
/// Default duty-cycle window.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(3600);
/// Longest window the ledger remembers runs for.
const LEDGER_RETENTION: Duration = Duration::from_secs(86_400);
/// How long a reservation waits for the cache to show its request.
const RESERVATION_TTL: Duration = Duration::from_secs(120);

/// A policy's budget with defaults filled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Most captures at once on a node.
    pub max_concurrent: usize,
    /// Most percent of the window under scheduled capture of one type.
    pub max_duty_percent: u32,
    /// The duty-cycle window.
    pub window: Duration,
}

impl Budget {
    /// The budget of a policy spec.
    pub fn from_spec(budget: Option<&NodeBudget>) -> Self {
        let b = budget.cloned().unwrap_or_default();
        Self {
            max_concurrent: b
                .max_concurrent_captures_per_node
                .and_then(|v| usize::try_from(v).ok())
                .unwrap_or(DEFAULT_MAX_CONCURRENT)
                .max(1),
            max_duty_percent: b
                .max_duty_cycle_percent
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(DEFAULT_DUTY_PERCENT)
                .clamp(1, 100),
            window: b
                .duty_cycle_window_seconds
                .and_then(|v| u64::try_from(v).ok())
                .map_or(DEFAULT_WINDOW, Duration::from_secs),
        }
    }
}

/// One capture occupying a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capture {
    /// `namespace/name` of the request.
    pub request: String,
    /// True for a policy's run.
    pub scheduled: bool,
    /// Its profile type.
    pub profile_type: ProfileType,
}

/// A scheduled capture's time on some nodes, for the duty cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DutyEntry {
    /// Profile type.
    pub profile_type: ProfileType,
    /// Nodes.
    pub nodes: Vec<String>,
    /// Start, Unix seconds.
    pub start: i64,
    /// End, Unix seconds.
    pub end: i64,
}

/// What occupies each node now, and the scheduled capture time per (node, type).
#[derive(Debug, Default, Clone)]
pub struct NodeLoad {
    running: HashMap<String, Vec<Capture>>,
    duty: HashMap<(String, ProfileType), Vec<(i64, i64)>>,
}

impl NodeLoad {
    /// Records a capture running on `node`.
    pub fn add_capture(&mut self, node: &str, capture: Capture) {
        self.running
            .entry(node.to_string())
            .or_default()
            .push(capture);
    }

    /// Records scheduled capture time.
    pub fn add_duty(&mut self, entry: &DutyEntry) {
        for node in &entry.nodes {
            self.duty
                .entry((node.clone(), entry.profile_type))
                .or_default()
                .push((entry.start, entry.end));
        }
    }

    /// Captures running on `node`.
    pub fn captures(&self, node: &str) -> &[Capture] {
        self.running.get(node).map_or(&[], Vec::as_slice)
    }

    /// Seconds of scheduled `profile_type` capture on `node` within `[from, to]`.
    pub fn duty_seconds(&self, node: &str, profile_type: ProfileType, from: i64, to: i64) -> i64 {
        self.duty
            .get(&(node.to_string(), profile_type))
            .into_iter()
            .flatten()
            .map(|&(s, e)| (e.min(to) - s.max(from)).max(0))
            .sum()
    }

    /// The gate a run of `profile_type` lasting `duration` passes under `budget` at `now`.
    pub fn gate(
        &self,
        budget: Budget,
        profile_type: ProfileType,
        duration: Duration,
        now: Timestamp,
    ) -> BudgetGate<'_> {
        BudgetGate {
            load: self,
            budget,
            profile_type,
            duration: i64::try_from(duration.as_secs().max(1)).unwrap_or(i64::MAX),
            now: now.as_second(),
        }
    }
}

/// Admits nodes under a budget (see [`NodeGate`]).
#[derive(Debug)]
pub struct BudgetGate<'a> {
    load: &'a NodeLoad,
    budget: Budget,
    profile_type: ProfileType,
    duration: i64,
    now: i64,
}

fn describe(captures: &[Capture]) -> String {
    let mut parts: Vec<String> = captures
        .iter()
        .take(3)
        .map(|c| {
            format!(
                "{} ({} {})",
                c.request,
                if c.scheduled { "scheduled" } else { "ad hoc" },
                c.profile_type
            )
        })
        .collect();
    if captures.len() > 3 {
        parts.push(format!("and {} more", captures.len() - 3));
    }
    parts.join(", ")
}

impl NodeGate for BudgetGate<'_> {
    fn admit(&mut self, node: &str) -> Result<(), (SkipReason, String)> {
        let running = self.load.captures(node);
        if running.len() >= self.budget.max_concurrent {
            return Err((
                SkipReason::ConcurrentCaptures,
                format!(
                    "node {node} runs {} capture(s), the budget allows {}: {}",
                    running.len(),
                    self.budget.max_concurrent,
                    describe(running)
                ),
            ));
        }
        let window = i64::try_from(self.budget.window.as_secs()).unwrap_or(i64::MAX);
        let end = self.now + self.duration;
        let used = self
            .load
            .duty_seconds(node, self.profile_type, end - window, end);
        let allowed = window * i64::from(self.budget.max_duty_percent) / 100;
        if used + self.duration > allowed {
            return Err((
                SkipReason::DutyCycle,
                format!(
                    "node {node} spent {used}s of the last {window}s under scheduled {} capture; {}s more would exceed {}% ({allowed}s)",
                    self.profile_type, self.duration, self.budget.max_duty_percent
                ),
            ));
        }
        Ok(())
    }
}

/// A run created but perhaps not yet in the cache.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// `namespace/name`.
    pub request: String,
    /// Profile type.
    pub profile_type: ProfileType,
    /// Planned nodes.
    pub nodes: Vec<String>,
    /// Start, Unix seconds.
    pub start: i64,
    /// Capture duration, seconds.
    pub duration: i64,
}

/// Memory of scheduled capture time across run deletions (history limits delete runs within
/// the duty window), of runs created but not yet cached, and of which requests are genuine
/// runs. Lost on restart: after one, the duty cycle counts the runs that still exist, as
/// each policy's first reconcile recognises them.
#[derive(Debug, Default)]
pub struct Ledger {
    inner: Mutex<LedgerInner>,
}

#[derive(Debug, Default)]
struct LedgerInner {
    duty: HashMap<String, DutyEntry>,
    reservations: Vec<Reservation>,
    /// UIDs of the requests each policy (by UID) recognised as its runs.
    runs_by_policy: HashMap<String, HashSet<String>>,
    /// The same, by request UID: the policy whose run it is.
    runs: HashMap<String, String>,
}

impl Ledger {
    /// Records `runs` as the genuine runs of the policy `policy_uid`, in place of what it
    /// recognised before. A request's labels say nothing the budget trusts: a tenant could
    /// label its ad hoc requests as runs and spend every policy's duty cycle on its nodes.
    pub fn recognise(&self, policy_uid: &str, runs: &[std::sync::Arc<ProfileRequest>]) {
        let uids: HashSet<String> = runs.iter().filter_map(|r| r.metadata.uid.clone()).collect();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &mut *inner;
        if let Some(before) = inner.runs_by_policy.get(policy_uid) {
            for uid in before.difference(&uids) {
                inner.runs.remove(uid);
            }
        }
        for uid in &uids {
            inner.runs.insert(uid.clone(), policy_uid.to_string());
        }
        inner.runs_by_policy.insert(policy_uid.to_string(), uids);
    }

    /// Forgets the runs of a deleted policy.
    pub fn forget_policy(&self, policy_uid: &str) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(before) = inner.runs_by_policy.remove(policy_uid) {
            for uid in before {
                inner.runs.remove(&uid);
            }
        }
    }

    /// Reserves a just-created run.
    pub fn reserve(&self, reservation: Reservation) {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reservations
            .push(reservation);
    }

    /// The node load now, from `requests` and `slices` (the caches), `pods` (to place
    /// pending ad hoc requests) and this ledger.
    pub fn load(
        &self,
        requests: &[std::sync::Arc<ProfileRequest>],
        slices: &[std::sync::Arc<ProfileResultSlice>],
        pods: &[std::sync::Arc<SlimPod>],
        now: Timestamp,
    ) -> NodeLoad {
        let now_s = now.as_second();
        let mut load = NodeLoad::default();
        let mut placer = PodPlacer::new(pods);
        let mut results: HashMap<&str, Vec<&NodeStatus>> = HashMap::new();
        for slice in slices {
            results
                .entry(slice.spec.request.uid.as_str())
                .or_default()
                .extend(slice.spec.nodes.iter());
        }
        let mut seen = BTreeSet::new();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for request in requests {
            let key = format!(
                "{}/{}",
                request.namespace().unwrap_or_default(),
                request.name_any()
            );
            seen.insert(key.clone());
            let nodes = request
                .metadata
                .uid
                .as_deref()
                .and_then(|uid| results.get(uid))
                .map_or(&[][..], Vec::as_slice);
            let scheduled = request
                .metadata
                .uid
                .as_deref()
                .is_some_and(|uid| inner.runs.contains_key(uid));
            let occupancy = occupancy(request, nodes, &mut placer);
            let profile_type = request.spec.profile_type;
            for node in &occupancy.running {
                load.add_capture(
                    node,
                    Capture {
                        request: key.clone(),
                        scheduled,
                        profile_type,
                    },
                );
            }
            if scheduled
                && let Some(entry) = occupancy.duty
                && let Some(uid) = request.metadata.uid.clone()
            {
                inner.duty.insert(uid, entry);
            }
        }
        let retention = i64::try_from(LEDGER_RETENTION.as_secs()).unwrap_or(i64::MAX);
        inner.duty.retain(|_, e| e.end >= now_s - retention);
        for entry in inner.duty.values() {
            load.add_duty(entry);
        }
        let ttl = i64::try_from(RESERVATION_TTL.as_secs()).unwrap_or(i64::MAX);
        inner
            .reservations
            .retain(|r| !seen.contains(&r.request) && r.start + ttl >= now_s);
        for r in &inner.reservations {
            for node in &r.nodes {
                load.add_capture(
                    node,
                    Capture {
                        request: r.request.clone(),
                        scheduled: true,
                        profile_type: r.profile_type,
                    },
                );
            }
            load.add_duty(&DutyEntry {
                profile_type: r.profile_type,
                nodes: r.nodes.clone(),
                start: r.start,
                end: r.start + r.duration,
            });
        }
        load
    }
}

/// What one request occupies.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Occupancy {
    /// Nodes it captures on now.
    pub running: Vec<String>,
    /// Its capture time (for scheduled runs' duty cycle).
    pub duty: Option<DutyEntry>,
}

/// Finds the nodes of pods (for Pending ad hoc requests, which list no nodes yet).
struct PodPlacer<'a> {
    by_namespace: Option<HashMap<&'a str, Vec<&'a SlimPod>>>,
    pods: &'a [std::sync::Arc<SlimPod>],
}

impl<'a> PodPlacer<'a> {
    fn new(pods: &'a [std::sync::Arc<SlimPod>]) -> Self {
        Self {
            by_namespace: None,
            pods,
        }
    }

    fn nodes(&mut self, request: &ProfileRequest) -> Vec<String> {
        let pods = self.pods;
        let index = self.by_namespace.get_or_insert_with(|| {
            let mut m: HashMap<&str, Vec<&SlimPod>> = HashMap::new();
            for p in pods {
                if let Some(ns) = p.metadata.namespace.as_deref() {
                    m.entry(ns).or_default().push(p);
                }
            }
            m
        });
        let ns = request.namespace().unwrap_or_default();
        let selector = request
            .spec
            .selector
            .clone()
            .and_then(|s| Selector::try_from(s).ok());
        let mut nodes = BTreeSet::new();
        for pod in index.get(ns.as_str()).into_iter().flatten() {
            let name = pod.metadata.name.as_deref().unwrap_or_default();
            let labels = pod.metadata.labels.clone().unwrap_or_default();
            let picked = selector.as_ref().is_some_and(|s| s.matches(&labels))
                || request.spec.pod_names.iter().any(|n| n == name);
            let running = pod.phase.as_deref() == Some("Running");
            if picked
                && running
                && let Some(node) = pod.node.clone()
            {
                nodes.insert(node);
            }
        }
        nodes.into_iter().collect()
    }
}

fn occupancy(
    request: &ProfileRequest,
    results: &[&NodeStatus],
    placer: &mut PodPlacer<'_>,
) -> Occupancy {
    let phase = request.status.as_ref().and_then(|s| s.phase);
    let duration = request
        .spec
        .capture_duration()
        .map_or(1, |d| i64::try_from(d.as_secs().max(1)).unwrap_or(i64::MAX));
    // Before its slices exist a request occupies the nodes its pods run on (the pods'
    // nodes come from the scheduler, never from the request's creator).
    let running_nodes = || -> Vec<String> {
        results
            .iter()
            .filter(|n| !n.phase.is_some_and(NodePhase::is_terminal))
            .map(|n| n.node.clone())
            .collect()
    };
    let all_nodes: Vec<String> = if results.is_empty() {
        match phase {
            Some(p) if p.is_terminal() => Vec::new(),
            _ => placer.nodes(request),
        }
    } else {
        results.iter().map(|n| n.node.clone()).collect()
    };
    let running = match phase {
        Some(p) if p.is_terminal() => Vec::new(),
        Some(RequestPhase::Running) => running_nodes(),
        _ if results.is_empty() => all_nodes.clone(),
        _ => running_nodes(),
    };
    let start = request
        .status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .or(request.metadata.creation_timestamp.as_ref())
        .map(|t| t.0.as_second());
    let end = request
        .status
        .as_ref()
        .and_then(|s| s.completion_time.as_ref())
        .map(|t| t.0.as_second());
    let duty = start.map(|start| DutyEntry {
        profile_type: request.spec.profile_type,
        nodes: all_nodes,
        start,
        end: end.map_or(start + duration, |e| e.min(start + duration).max(start)),
    });
    Occupancy { running, duty }
}

/// Groups captures by node for display (tests, messages).
pub fn busy_nodes(load: &NodeLoad) -> BTreeMap<String, usize> {
    load.running
        .iter()
        .map(|(n, c)| (n.clone(), c.len()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_api::policy_runs::POLICY_UID_LABEL;
    use serde_json::json;
    use std::sync::Arc;

    /// The cached slice of request `name` holding `nodes`.
    fn slice(name: &str, nodes: serde_json::Value) -> Arc<ProfileResultSlice> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileResultSlice",
                "metadata": {"name": format!("uid-{name}-0"), "namespace": "ns"},
                "request": {"name": name, "uid": format!("uid-{name}")},
                "nodes": nodes,
            }))
            .unwrap(),
        )
    }

    fn request(
        name: &str,
        labels: serde_json::Value,
        status: serde_json::Value,
    ) -> Arc<ProfileRequest> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
                "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                    "labels": labels, "creationTimestamp": "2026-01-05T10:00:00Z"},
                "spec": {"type": "cpu", "podNames": ["p1"], "duration": "20s"},
                "status": status,
            }))
            .unwrap(),
        )
    }

    fn now() -> Timestamp {
        "2026-01-05T10:00:10Z".parse().unwrap()
    }

    #[test]
    fn an_ad_hoc_capture_fills_a_node_with_a_budget_of_one() {
        let adhoc = request(
            "adhoc",
            json!({}),
            json!({"phase": "Running", "startTime": "2026-01-05T10:00:00Z", "nodeCount": 2}),
        );
        let slices = [slice(
            "adhoc",
            json!([{"node": "n1"}, {"node": "n2", "phase": "Succeeded"}]),
        )];
        let ledger = Ledger::default();
        let load = ledger.load(&[adhoc], &slices, &[], now());
        let budget = Budget::from_spec(None);
        let mut gate = load.gate(budget, ProfileType::Cpu, Duration::from_secs(10), now());
        let (reason, message) = gate.admit("n1").unwrap_err();
        assert_eq!(reason, SkipReason::ConcurrentCaptures);
        assert!(message.contains("ns/adhoc (ad hoc cpu)"), "{message}");
        // n2 finished its part; n3 has nothing.
        gate.admit("n2").unwrap();
        gate.admit("n3").unwrap();
        // A budget of two admits n1.
        let two = Budget {
            max_concurrent: 2,
            ..budget
        };
        load.gate(two, ProfileType::Cpu, Duration::from_secs(10), now())
            .admit("n1")
            .unwrap();
    }

    #[test]
    fn duty_cycle_counts_scheduled_time_per_type_even_after_deletion() {
        let run = request(
            "run",
            json!({POLICY_UID_LABEL: "p"}),
            json!({"phase": "Succeeded", "startTime": "2026-01-05T09:59:00Z",
                   "completionTime": "2026-01-05T09:59:20Z", "nodeCount": 1}),
        );
        let slices = [slice("run", json!([{"node": "n1", "phase": "Succeeded"}]))];
        let ledger = Ledger::default();
        ledger.recognise("p", std::slice::from_ref(&run));
        let budget = Budget {
            max_concurrent: 5,
            max_duty_percent: 10,
            window: Duration::from_secs(300),
        };
        // 20s used of a 300s window at 10% (30s): another 10s fits, 20s does not.
        let load = ledger.load(&[run], &slices, &[], now());
        assert_eq!(load.duty_seconds("n1", ProfileType::Cpu, 0, i64::MAX), 20);
        load.gate(budget, ProfileType::Cpu, Duration::from_secs(10), now())
            .admit("n1")
            .unwrap();
        let (reason, _) = load
            .gate(budget, ProfileType::Cpu, Duration::from_secs(20), now())
            .admit("n1")
            .unwrap_err();
        assert_eq!(reason, SkipReason::DutyCycle);
        // Another type has its own budget.
        load.gate(budget, ProfileType::Heap, Duration::from_secs(20), now())
            .admit("n1")
            .unwrap();
        // The run was deleted (history limit): the ledger still remembers its time.
        let load = ledger.load(&[], &[], &[], now());
        assert_eq!(load.duty_seconds("n1", ProfileType::Cpu, 0, i64::MAX), 20);
    }

    #[test]
    fn pending_requests_occupy_their_pods_nodes_or_planned_nodes() {
        let pod: Arc<SlimPod> = Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": "p1", "namespace": "ns"},
                "spec": {"nodeName": "n7", "containers": []},
                "status": {"phase": "Running"}
            }))
            .unwrap(),
        );
        let pending = request("pending", json!({}), json!(null));
        let ledger = Ledger::default();
        let load = ledger.load(&[pending], &[], &[pod], now());
        assert_eq!(load.captures("n7").len(), 1);
        ledger.reserve(Reservation {
            request: "ns/new-run".into(),
            profile_type: ProfileType::Cpu,
            nodes: vec!["n8".into()],
            start: now().as_second(),
            duration: 10,
        });
        let load = ledger.load(&[], &[], &[], now());
        assert_eq!(load.captures("n8").len(), 1);
        assert!(load.captures("n8")[0].scheduled);
    }

    #[test]
    fn a_pending_request_cannot_claim_nodes_its_pods_are_not_on() {
        let pod: Arc<SlimPod> = Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": "p1", "namespace": "ns"},
                "spec": {"nodeName": "n7", "containers": []},
                "status": {"phase": "Running"}
            }))
            .unwrap(),
        );
        let mut forged = (*request("forged", json!({POLICY_UID_LABEL: "p"}), json!(null))).clone();
        forged.metadata.annotations = Some(std::collections::BTreeMap::from([(
            "flamefleet.dev/planned-nodes".to_string(),
            "n1,n2,n3".to_string(),
        )]));
        let load = Ledger::default().load(&[Arc::new(forged)], &[], &[pod], now());
        assert_eq!(busy_nodes(&load), BTreeMap::from([("n7".to_string(), 1)]));
    }

    #[test]
    fn only_recognised_runs_count_as_scheduled_time() {
        let labelled = request(
            "labelled",
            json!({POLICY_UID_LABEL: "p"}),
            json!({"phase": "Running", "startTime": "2026-01-05T10:00:00Z", "nodeCount": 1}),
        );
        let slices = [slice(
            "labelled",
            json!([{"node": "n1", "phase": "Running"}]),
        )];
        let ledger = Ledger::default();
        // The policy's runs do not include it: its label alone makes it an ad hoc request.
        ledger.recognise("p", &[]);
        let load = ledger.load(std::slice::from_ref(&labelled), &slices, &[], now());
        assert!(!load.captures("n1")[0].scheduled);
        assert_eq!(load.duty_seconds("n1", ProfileType::Cpu, 0, i64::MAX), 0);
        // Recognised, it is scheduled capture time; forgotten with its policy, it runs on as
        // an ad hoc request.
        ledger.recognise("p", std::slice::from_ref(&labelled));
        let load = ledger.load(std::slice::from_ref(&labelled), &slices, &[], now());
        assert!(load.captures("n1")[0].scheduled);
        assert_eq!(load.duty_seconds("n1", ProfileType::Cpu, 0, i64::MAX), 20);
        ledger.forget_policy("p");
        let load = ledger.load(&[labelled], &slices, &[], now());
        assert!(!load.captures("n1")[0].scheduled);
    }
}
