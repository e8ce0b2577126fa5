//! Sampling-controller cost at fleet size: what one policy's run costs the operator when
//! the cluster is large (10,000 pods, 1,310 runs). Prints figures, asserts nothing.
//!
//! The fleet: 10,000 Running pods in 20 namespaces on 500 nodes, each node with a Running
//! agent pod, and 100 hourly policies with their history (10 succeeded and 3 failed runs each,
//! the default history limits, plus a run capturing now for one policy in ten: 1,310 runs
//! whose result slices list their nodes, pods and artifacts) and 50 ad hoc requests capturing now.
//! Everything lives in the same reflector stores the operator reads (`sampling::fleet::Fleet`),
//! filled in memory.
//!
//! Per run, the figures time what the policy controller does to pick the run's pods
//! (`sampling::policy::run_at`): eligibility of the policy's pods (selector, phase, node has
//! an agent, rotation order), the node load from every request and the ledger, then the
//! rotation walk under the node budget. Policies of 100 pods on at most 50 nodes, with one
//! capture per node at a time, walk the rotation run after run.
//!
//! Memory: live heap bytes (a counting allocator) held by the caches before and after the
//! fleet is loaded, and the process's RSS.
//!
//! Run: `cargo bench -p flamefleet-operator --bench fleet_selection` (add `-- --runs N`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flamefleet_api::policy_runs::{POLICY_KIND_LABEL, POLICY_NAME_LABEL, POLICY_UID_LABEL};
use flamefleet_api::{ProfileRequest, ProfileResultSlice, RotationState, SamplingLimits};
use flamefleet_operator::controllers::sampling::budget::{Budget, Ledger};
use flamefleet_operator::controllers::sampling::fleet::{Fleet, PodIndex, Scope, slim_slice};
use flamefleet_operator::controllers::sampling::rotation::{self, Limits};
use flamefleet_operator::pods::AGENT_LABEL;
use flamefleet_operator::pods::slim::SlimPod;
use k8s_openapi::api::core::v1::Namespace;
use kube::core::Selector;
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher;
use serde_json::json;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator and only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const PODS: usize = 10_000;
const NODES: usize = 500;
const NAMESPACES: usize = 20;
const POLICIES: usize = 100;
const SUCCEEDED_RUNS: usize = 10;
const FAILED_RUNS: usize = 3;
const AD_HOC: usize = 50;
const AGENT_NS: &str = "flamefleet";

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn fill<K>(writer: &mut Writer<K>, objects: Vec<K>)
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    writer.apply_watcher_event(&watcher::Event::Init);
    for o in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(o));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
}

/// A pod read from the JSON the API server returns (a realistic object), as the cache
/// keeps it.
fn pod(ns: &str, name: &str, node: &str, labels: serde_json::Value, ip: &str) -> SlimPod {
    serde_json::from_value(json!({
        "metadata": {
            "name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}"),
            "labels": labels,
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-20T10:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": "shop-5d9f", "uid": "rs-uid", "controller": true}],
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "app", "image": "flamefleet.local/checkout-demo:0.1.0",
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}],
        },
        "status": {
            "phase": "Running", "podIP": ip, "hostIP": "10.0.0.1",
            "containerStatuses": [{"name": "app", "ready": true, "restartCount": 0,
                "image": "flamefleet.local/checkout-demo:0.1.0", "imageID": "sha256:abc",
                "containerID": format!("containerd://{:064x}", name.len()),
                "state": {"running": {"startedAt": "2026-11-20T10:00:00Z"}}}],
        },
    }))
    .expect("pod JSON")
}

fn node_name(i: usize) -> String {
    format!("node-{:03}", i % NODES)
}

/// The result slice of `request` holding `nodes` (as the slice cache keeps it, slimmed).
fn slice_of(request: &ProfileRequest, nodes: Vec<serde_json::Value>) -> ProfileResultSlice {
    let mut slice: ProfileResultSlice = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileResultSlice",
        "metadata": {"name": format!("{}-0", request.metadata.uid.clone().unwrap_or_default()),
            "namespace": request.metadata.namespace.clone()},
        "request": {"name": request.metadata.name.clone(), "uid": request.metadata.uid.clone()},
        "nodes": nodes,
    }))
    .expect("slice JSON");
    slim_slice(&mut slice);
    slice
}

/// One run of policy `p` (run `k`): `nodes` node entries of 4 pods and one artifact each,
/// in one result slice.
fn run(
    p: usize,
    k: usize,
    phase: &str,
    start: i64,
    nodes: usize,
) -> (ProfileRequest, ProfileResultSlice) {
    let ns = format!("shop-{:02}", p % NAMESPACES);
    let start_t = jiff::Timestamp::from_second(start).expect("time");
    let end_t = jiff::Timestamp::from_second(start + 30).expect("time");
    let node_entries: Vec<serde_json::Value> = (0..nodes)
        .map(|n| {
            let node = node_name(p * 7 + k * 13 + n);
            let node_phase = if phase == "Running" { "Running" } else { phase };
            json!({
                "node": node, "phase": node_phase,
                "pods": (0..4).map(|i| format!("{ns}/shop-{p}-{k}-{n}-{i}")).collect::<Vec<_>>(),
                "artifacts": if phase == "Succeeded" { json!([{
                    "name": format!("{node}.cpu.pb.gz"), "sizeBytes": 48213,
                    "sha256": format!("{:064x}", p * 1000 + k * 10 + n),
                    "samples": 2310, "sampleType": "samples/count"}]) } else { json!([]) },
                "message": if phase == "Failed" { json!("agent unreachable: connection refused") } else { json!(null) },
            })
        })
        .collect();
    let mut status = json!({
        "phase": phase, "startTime": start_t.to_string(),
        "podCount": nodes * 4, "nodeCount": nodes, "resultSlices": 1,
        "observedGeneration": 1,
        "conditions": [{"type": "Ready", "status": "True", "reason": phase,
            "message": format!("{nodes} of {nodes} nodes {phase}"),
            "lastTransitionTime": start_t.to_string()}],
    });
    if phase != "Running" {
        status["completionTime"] = json!(end_t.to_string());
    }
    let request: ProfileRequest = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
        "metadata": {
            "name": format!("policy-{p}-{k}"), "namespace": ns, "uid": format!("run-{p}-{k}"),
            "creationTimestamp": start_t.to_string(),
            "labels": {POLICY_UID_LABEL: format!("policy-uid-{p}"),
                POLICY_NAME_LABEL: format!("policy-{p}"), POLICY_KIND_LABEL: "SamplingPolicy"},
        },
        "spec": {"type": "cpu", "duration": "30s", "frequencyHz": 19,
            "podNames": (0..nodes * 4).map(|i| format!("shop-{p}-{k}-{i}")).collect::<Vec<_>>()},
        "status": status,
    }))
    .expect("request JSON");
    let slice = slice_of(&request, node_entries);
    (request, slice)
}

fn ad_hoc(i: usize, now: i64) -> (ProfileRequest, ProfileResultSlice) {
    let start_t = jiff::Timestamp::from_second(now - 5).expect("time");
    let request: ProfileRequest = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
        "metadata": {"name": format!("debug-{i}"), "namespace": format!("shop-{:02}", i % NAMESPACES),
            "uid": format!("adhoc-{i}"), "creationTimestamp": start_t.to_string()},
        "spec": {"type": "cpu", "duration": "60s", "selector": {"matchLabels": {"app": format!("app-{i}")}}},
        "status": {"phase": "Running", "startTime": start_t.to_string(), "nodeCount": 1,
            "resultSlices": 1},
    }))
    .expect("request JSON");
    let slice = slice_of(
        &request,
        vec![json!({"node": node_name(i * 11), "phase": "Running"})],
    );
    (request, slice)
}

fn main() {
    let runs: usize = std::env::args()
        .skip_while(|a| a != "--runs")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let now = jiff::Timestamp::now();
    let now_s = now.as_second();

    let heap0 = LIVE.load(Ordering::Relaxed);
    let rss0 = rss_mib();
    let (pods, mut pods_w) = reflector::store::<SlimPod>();
    let (namespaces, mut ns_w) = reflector::store::<Namespace>();
    let (requests, mut requests_w) = reflector::store::<ProfileRequest>();
    let (results, mut results_w) = reflector::store::<ProfileResultSlice>();

    let mut all_pods = Vec::with_capacity(PODS + NODES);
    for i in 0..PODS {
        let ns = format!("shop-{:02}", i % NAMESPACES);
        let labels = json!({"app": "shop", "tier": if i % 2 == 0 { "web" } else { "api" },
            "pod-template-hash": "5d9f"});
        all_pods.push(pod(
            &ns,
            &format!("shop-{i:05}"),
            &node_name(i),
            labels,
            &format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256),
        ));
    }
    for n in 0..NODES {
        let (k, v) = AGENT_LABEL.split_once('=').expect("label");
        all_pods.push(pod(
            AGENT_NS,
            &format!("flamefleet-agent-{n:03}"),
            &node_name(n),
            json!({k: v}),
            &format!("10.200.{}.{}", n / 256, n % 256),
        ));
    }
    let pod_index = PodIndex::default();
    pod_index.apply(&watcher::Event::Init);
    for p in &all_pods {
        pod_index.apply(&watcher::Event::InitApply(p.clone()));
    }
    pod_index.apply(&watcher::Event::InitDone);
    fill(&mut pods_w, all_pods);
    let all_ns = (0..NAMESPACES)
        .map(|i| {
            serde_json::from_value(json!({"metadata": {"name": format!("shop-{i:02}"),
                "labels": {"team": if i % 2 == 0 { "checkout" } else { "search" }}}}))
            .expect("namespace JSON")
        })
        .chain(std::iter::once(
            serde_json::from_value(json!({"metadata": {"name": AGENT_NS}})).expect("ns"),
        ))
        .collect();
    fill(&mut ns_w, all_ns);
    let heap_pods = LIVE.load(Ordering::Relaxed);

    // History: every policy runs hourly, its runs take 25 nodes (100 pods) for 30 s, and
    // the policies' schedules are spread over the hour; one policy in ten is running now.
    let mut all_requests = Vec::new();
    for p in 0..POLICIES {
        let offset = (p as i64 * 36) % 3600;
        let mut k = 0;
        for _ in 0..SUCCEEDED_RUNS {
            let start = now_s - offset - 3600 * k as i64 - 60;
            all_requests.push(run(p, k, "Succeeded", start, 25));
            k += 1;
        }
        for _ in 0..FAILED_RUNS {
            let start = now_s - offset - 3600 * k as i64 - 60;
            all_requests.push(run(p, k, "Failed", start, 25));
            k += 1;
        }
        if p % 10 == 0 {
            all_requests.push(run(p, k, "Running", now_s - 10, 25));
        }
    }
    for i in 0..AD_HOC {
        all_requests.push(ad_hoc(i, now_s));
    }
    let request_count = all_requests.len();
    let (all_requests, all_slices): (Vec<_>, Vec<_>) = all_requests.into_iter().unzip();
    fill(&mut requests_w, all_requests);
    fill(&mut results_w, all_slices);
    let heap_all = LIVE.load(Ordering::Relaxed);

    let (policies, mut policies_w) = reflector::store();
    fill(&mut policies_w, Vec::new());
    let fleet = Fleet {
        pods,
        pod_index,
        policies,
        namespaces,
        requests,
        results,
        agent_namespace: AGENT_NS.into(),
    };
    let ledger = Ledger::default();
    let selector: Selector = Selector::try_from(
        serde_json::from_value::<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>(
            json!({"matchLabels": {"app": "shop"}}),
        )
        .expect("selector"),
    )
    .expect("selector");
    let sampling: SamplingLimits =
        serde_json::from_value(json!({"maxPods": 100, "percent": 5, "maxNodes": 50}))
            .expect("limits");
    let budget = Budget::from_spec(
        serde_json::from_value(json!({"maxConcurrentCapturesPerNode": 1}))
            .ok()
            .as_ref(),
    );
    let duration = Duration::from_secs(30);

    // Which nodes the budget admits (the load is the same for every run here).
    let load = ledger.load(
        &fleet.requests.state(),
        &fleet.results.state(),
        &fleet.pods.state(),
        now,
    );
    let mut gate = load.gate(budget, flamefleet_api::ProfileType::Cpu, duration, now);
    let admitted: std::collections::BTreeSet<String> = (0..NODES)
        .map(node_name)
        .filter(|n| rotation::NodeGate::admit(&mut gate, n).is_ok())
        .collect();
    let pods_on_admitted = (0..PODS)
        .filter(|&i| admitted.contains(&node_name(i)))
        .count();
    let mut rotation_sizes = Vec::new();

    let mut state = RotationState::default();
    let (mut t_eligible, mut t_load, mut t_select, mut t_total) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut taken = 0usize;
    let mut skipped_budget = 0usize;
    let mut rotations = 0usize;
    let mut eligible_pods = 0usize;
    let mut eligible_nodes = 0usize;
    for r in 0..runs {
        let t = now + jiff::SignedDuration::from_secs(600 * r as i64);
        let t0 = Instant::now();
        let eligibility = fleet.eligible(
            "policy-uid-bench",
            &Scope::Cluster(None),
            Some(&selector),
            &[],
        );
        let t1 = Instant::now();
        let load = ledger.load(
            &fleet.requests.state(),
            &fleet.results.state(),
            &fleet.pods.state(),
            now,
        );
        let t2 = Instant::now();
        let mut gate = load.gate(budget, flamefleet_api::ProfileType::Cpu, duration, now);
        let limits = Limits::from_spec(Some(&sampling), eligibility.candidates.len());
        let selection = rotation::select(&eligibility.candidates, &state, limits, &mut gate, t);
        let t3 = Instant::now();
        t_eligible.push(t1 - t0);
        t_load.push(t2 - t1);
        t_select.push(t3 - t2);
        t_total.push(t3 - t0);
        taken += selection.taken.len();
        skipped_budget += selection
            .skipped
            .iter()
            .filter(|(_, reason, _)| reason.is_budget())
            .count();
        rotations += usize::from(selection.completed.is_some());
        rotation_sizes.extend(selection.completed);
        eligible_pods = eligibility.candidates.len();
        eligible_nodes = eligibility.node_count();
        state = selection.state;
    }
    for v in [&mut t_eligible, &mut t_load, &mut t_select, &mut t_total] {
        v.sort();
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "fleet: {PODS} pods in {NAMESPACES} namespaces on {NODES} nodes (each with an agent),"
    );
    println!(
        "       {request_count} ProfileRequests ({POLICIES} hourly policies x {} finished runs of 25 nodes, {} running, {AD_HOC} ad hoc running)",
        SUCCEEDED_RUNS + FAILED_RUNS,
        POLICIES / 10
    );
    println!(
        "policy: selector app=shop cluster-wide, maxPods 100, percent 5, maxNodes 50, 1 capture per node"
    );
    println!(
        "eligible: {eligible_pods} pods on {eligible_nodes} nodes; {runs} runs took {taken} pods ({:.1}/run), {skipped_budget} budget skips, {rotations} rotations completed",
        taken as f64 / runs as f64
    );
    println!(
        "budget: {} of {NODES} nodes admit a capture ({pods_on_admitted} pods on them); pods profiled per completed rotation: {rotation_sizes:?}",
        admitted.len()
    );
    println!();
    println!("time to pick one run's pods (ms)      p50      p99      max");
    let mut rows = BTreeMap::new();
    rows.insert(1, ("eligibility (10,000 pods)", &t_eligible));
    rows.insert(2, ("node load (every request)", &t_load));
    rows.insert(3, ("rotation walk under budget", &t_select));
    rows.insert(4, ("total", &t_total));
    for (name, v) in rows.values() {
        println!(
            "  {name:<34} {:>7.2}  {:>7.2}  {:>7.2}",
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.99)),
            ms(*v.last().expect("runs"))
        );
    }
    println!();
    println!("memory (live heap bytes of the caches)");
    println!(
        "  pods + namespaces (slimmed, 10,500 pods)  {:>7.1} MiB",
        mib(heap_pods - heap0)
    );
    println!(
        "  ProfileRequests ({request_count})             {:>7.1} MiB",
        mib(heap_all - heap_pods)
    );
    println!(
        "  (a cached SlimPod is a {}-byte struct before its strings and labels)",
        std::mem::size_of::<SlimPod>()
    );
    println!(
        "  process RSS before/after loading          {:>7.1} / {:.1} MiB",
        rss0,
        rss_mib()
    );
}
