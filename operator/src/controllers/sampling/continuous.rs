//! Always-on policies (`schedule: "@continuous"`), the operator's half (docs/export.md,
//! "Always-on profiling"): tell each agent which pods to profile in windows, and export the
//! windows it sends back.
//!
//! - **Sets.** The policy reconciler registers each always-on policy here. A loop computes,
//!   from the pod cache, the set of every node: each registered policy's eligible pods there
//!   (its own namespace only for a SamplingPolicy), at the template's frequency, at most
//!   `sampling.maxPods` / `sampling.percent` of them per policy and at most
//!   `--max-continuous-pods-per-node` per node. It holds one `Continuous` call per node with
//!   a non-empty set (over the agents' mTLS connection) and replaces it when the set
//!   changes. No ProfileRequest is ever created: a window is a message on that call.
//! - **Windows.** A window counts only for a pod of the set this operator sent on that very
//!   node's connection, and for the policies that set lists for it (never the ones the node
//!   names): a node, even a compromised one, can only send profiles of pods it hosts, filed
//!   under the policies that asked for them, whose resource attributes come from the
//!   operator's own records ([`crate::export::resource`]). Its profile goes to the export
//!   queue as it is (bounded by the set's size limit; the queue decodes it under its own
//!   budget); it is not kept in the artifact store (docs/export.md says why).
//! - **Status.** Per policy: pods and nodes profiled, windows received, exported, dropped,
//!   queued, the last export error, and each pod's coverage (sampled time over the time
//!   the windows should have sampled since the pod joined).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use flamefleet_api::SamplingPolicySpec;
use flamefleet_api::continuous::{ContinuousStatus, MAX_LOW_COVERAGE};
use flamefleet_api::policy_runs::PolicyKind;
use flamefleet_proto::agent as pb;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use tokio::task::JoinHandle;

use super::SamplingContext;
use super::fleet::{Scope, selector_of};
use crate::dispatch::connector::AgentConnector;
use crate::export::resource::{CaptureContext, ExportedPod};
use crate::export::{ExportItem, ExportJob, ExportTally, Exporter};
use crate::pods::agents::{AgentEndpoint, cached_agents};
use crate::pods::target::{Workload, workload_of};

/// How often the sets are recomputed without a change notification.
const RESYNC: Duration = Duration::from_secs(2);
/// How long a node whose `Continuous` call failed waits before the next attempt.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// How late a window may arrive (reading, symbolizing and encoding it, the network) before
/// its pods' coverage counts it as missing.
const GRACE: Duration = Duration::from_secs(5);
/// Coverage below this percent lists a pod in `lowCoverage`.
const LOW_COVERAGE_PERCENT: i64 = 95;
/// Most refusals kept per node.
const MAX_REFUSED: usize = 100;

/// The cluster admin's settings (operator flags `--continuous-*`).
#[derive(Debug, Clone)]
pub struct ContinuousSettings {
    /// Length of a window.
    pub window: Duration,
    /// Time from one window's start to the next.
    pub period: Duration,
    /// Largest gzipped profile of one pod's window.
    pub max_profile_bytes: u64,
    /// Most pods profiled always-on on one node (all policies).
    pub max_pods_per_node: usize,
    /// Highest frequency a policy may ask for (the tenant limit of ad hoc requests).
    pub max_cpu_frequency_hz: i32,
}

impl Default for ContinuousSettings {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(20),
            period: Duration::from_secs(20),
            max_profile_bytes: 1 << 20,
            max_pods_per_node: 100,
            max_cpu_frequency_hz: 1000,
        }
    }
}

/// An always-on policy, as its reconciler registers it.
#[derive(Debug, Clone)]
pub struct Registered {
    /// Which kind.
    pub kind: PolicyKind,
    /// Name.
    pub name: String,
    /// Namespace (a SamplingPolicy's).
    pub namespace: Option<String>,
    /// UID.
    pub uid: String,
    /// The spec (template, sampling).
    pub spec: SamplingPolicySpec,
    /// Which namespaces it samples.
    pub scope: Scope,
    /// Frequency of its windows.
    pub frequency_hz: u32,
}

impl Registered {
    /// `namespace/name`, or the name of a cluster policy (the `flamefleet.policy.name`
    /// resource attribute).
    fn display(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{ns}/{}", self.name),
            None => self.name.clone(),
        }
    }
}

/// One pod of one policy's set.
#[derive(Debug, Clone)]
struct Covered {
    namespace: String,
    name: String,
    node: String,
    joined: Instant,
    sampled: Duration,
    windows: u64,
    last: Option<Instant>,
}

/// What a policy's windows did.
#[derive(Debug, Default)]
struct PolicyCounters {
    windows: u64,
    last_window: Option<Timestamp>,
    tally: Arc<ExportTally>,
    /// Eligible pods now (the COVERAGE column's denominator).
    matching: usize,
    /// Pods left out by the node budget, with why.
    over_budget: Vec<String>,
}

struct NodeStream {
    request: pb::ContinuousRequest,
    agent: AgentEndpoint,
    task: JoinHandle<()>,
}

#[derive(Default)]
struct Inner {
    policies: BTreeMap<String, Registered>,
    counters: HashMap<String, PolicyCounters>,
    /// (policy UID, pod UID) → coverage.
    pods: HashMap<(String, String), Covered>,
    streams: BTreeMap<String, NodeStream>,
    retry: HashMap<String, Instant>,
    /// node → refusals of its last acknowledgement.
    refused: HashMap<String, Vec<String>>,
    /// Pod UID → its workload (read once per pod: the cache keeps no owners).
    workloads: HashMap<String, Option<Workload>>,
    /// (node, pod UID) → the windows it may still send now ([`admit_window`]).
    rates: HashMap<(String, String), WindowRate>,
}

/// Windows a node may send for one pod at once. A node sends one per period, and one more
/// each time its set changes (the window running then ends early), so the bucket refills
/// at [`WINDOWS_PER_PERIOD`]: a node sending faster (a compromised one, flooding the export
/// queue and the backend with its pods' profiles) has the rest dropped and counted as
/// `TooFrequent`.
const WINDOW_BURST: f64 = 3.0;
/// The windows per period one pod's bucket refills.
const WINDOWS_PER_PERIOD: f64 = 2.0;

/// A token bucket of one pod's windows on one node: [`WINDOWS_PER_PERIOD`] windows per
/// period, [`WINDOW_BURST`] at once.
#[derive(Debug, Clone, Copy)]
struct WindowRate {
    tokens: f64,
    at: Instant,
}

/// Whether a window arriving `now` fits `rate` (taking its token if so).
fn admit_window(rate: &mut WindowRate, now: Instant, period: Duration) -> bool {
    let refill = now.saturating_duration_since(rate.at).as_secs_f64() / period.as_secs_f64()
        * WINDOWS_PER_PERIOD;
    rate.tokens = (rate.tokens + refill).min(WINDOW_BURST);
    rate.at = now;
    if rate.tokens >= 1.0 {
        rate.tokens -= 1.0;
        true
    } else {
        false
    }
}

/// The operator's always-on policies: registered policies, the calls, coverage and counters.
pub struct ContinuousHub {
    connector: AgentConnector,
    settings: ContinuousSettings,
    exporter: Option<Arc<Exporter>>,
    inner: Mutex<Inner>,
    changed: tokio::sync::Notify,
}

impl std::fmt::Debug for ContinuousHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContinuousHub")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl ContinuousHub {
    /// A hub calling agents through `connector`, exporting windows to `exporter`.
    pub fn new(
        connector: AgentConnector,
        settings: ContinuousSettings,
        exporter: Option<Arc<Exporter>>,
    ) -> Self {
        Self {
            connector,
            settings,
            exporter,
            inner: Mutex::default(),
            changed: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cluster admin's settings.
    pub fn settings(&self) -> &ContinuousSettings {
        &self.settings
    }

    /// Whether windows can be exported at all (an export sink is configured).
    pub fn exports(&self) -> bool {
        self.exporter.is_some()
    }

    /// Registers (or updates) an always-on policy; `None` unregisters it (suspended, not
    /// always-on any more, over a limit).
    pub fn register(&self, uid: &str, policy: Option<Registered>) {
        let mut inner = self.lock();
        let changed = match policy {
            Some(p) => {
                inner.counters.entry(uid.to_string()).or_default();
                let before = inner.policies.insert(uid.to_string(), p.clone());
                before.is_none_or(|b| {
                    b.spec.template != p.spec.template
                        || b.spec.sampling != p.spec.sampling
                        || b.frequency_hz != p.frequency_hz
                })
            }
            None => inner.policies.remove(uid).is_some(),
        };
        drop(inner);
        if changed {
            self.changed.notify_one();
        }
    }

    /// Forgets a deleted policy and its counters.
    pub fn forget(&self, uid: &str) {
        let mut inner = self.lock();
        inner.policies.remove(uid);
        inner.counters.remove(uid);
        inner.pods.retain(|(p, _), _| p != uid);
        drop(inner);
        self.changed.notify_one();
    }

    /// The `status.continuous` of policy `uid`, and (matching, covered) pods for its
    /// `status.coverage`.
    pub fn status_of(&self, uid: &str) -> (ContinuousStatus, usize, usize) {
        let inner = self.lock();
        let now = Instant::now();
        let (window, period) = (self.settings.window, self.settings.period);
        let mut status = ContinuousStatus {
            window_seconds: i64::try_from(window.as_secs()).unwrap_or(i64::MAX),
            period_seconds: i64::try_from(period.as_secs()).unwrap_or(i64::MAX),
            ..ContinuousStatus::default()
        };
        let mut nodes = BTreeSet::new();
        let mut covered = 0;
        let mut min: Option<i64> = None;
        let mut low = Vec::new();
        for ((policy, _), pod) in &inner.pods {
            if policy != uid {
                continue;
            }
            status.pods += 1;
            nodes.insert(pod.node.clone());
            if pod.windows > 0 {
                covered += 1;
            }
            if let Some(pct) = coverage_percent(pod, now, window, period) {
                min = Some(min.map_or(pct, |m: i64| m.min(pct)));
                if pct < LOW_COVERAGE_PERCENT {
                    low.push((pct, format!("{}/{}: {pct}%", pod.namespace, pod.name)));
                }
            }
        }
        low.sort();
        status.low_coverage = low
            .into_iter()
            .take(MAX_LOW_COVERAGE)
            .map(|(_, l)| l)
            .collect();
        status.nodes = i64::try_from(nodes.len()).unwrap_or(i64::MAX);
        status.min_coverage_percent = min;
        let matching = match inner.counters.get(uid) {
            Some(c) => {
                status.windows = i64::try_from(c.windows).unwrap_or(i64::MAX);
                status.exported =
                    i64::try_from(c.tally.exported.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
                status.dropped =
                    i64::try_from(c.tally.dropped.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
                status.queued =
                    Some(i64::try_from(c.tally.queued.load(Ordering::Relaxed)).unwrap_or(i64::MAX));
                status.last_window_time = c.last_window.map(Time);
                let last = c
                    .tally
                    .last
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                status.last_export_time = last.exported_at.map(Time);
                status.last_export_error = last.error;
                status.refused = c.over_budget.clone();
                c.matching
            }
            None => 0,
        };
        // What the agents refused about pods this policy may see: a SamplingPolicy's status
        // names no pod of another namespace.
        let namespace = inner
            .policies
            .get(uid)
            .and_then(|p| p.namespace.as_ref())
            .map(|ns| format!("{ns}/"));
        status.refused.extend(
            inner
                .refused
                .values()
                .flatten()
                .filter(|l| {
                    namespace
                        .as_ref()
                        .is_none_or(|ns| l.starts_with(ns.as_str()))
                })
                .cloned(),
        );
        status.refused.truncate(MAX_LOW_COVERAGE);
        status.summary = match min {
            Some(m) => format!("{} pods, min coverage {m}%", status.pods),
            None => format!("{} pods", status.pods),
        };
        (status, matching, covered)
    }

    /// Keeps the agents' always-on sets in step with the registered policies and the fleet
    /// until `shutdown`.
    pub async fn run(
        ctx: Arc<SamplingContext>,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) {
        tokio::pin!(shutdown);
        loop {
            sync(&ctx);
            tokio::select! {
                () = ctx.continuous.changed.notified() => {}
                () = tokio::time::sleep(RESYNC) => {}
                () = &mut shutdown => break,
            }
        }
        let mut inner = ctx.continuous.lock();
        for (_, s) in std::mem::take(&mut inner.streams) {
            s.task.abort();
        }
    }
}

/// The coverage of `pod` in percent: the time its windows sampled over the time they should
/// have sampled since it joined (`window/period` of the wall time), up to the last window
/// or, when one is late, up to when the next should have arrived. `None` for a pod that
/// joined less than a period ago.
fn coverage_percent(
    pod: &Covered,
    now: Instant,
    window: Duration,
    period: Duration,
) -> Option<i64> {
    let due = now.checked_sub(period + GRACE).unwrap_or(pod.joined);
    let horizon = pod.last.map_or(due, |l| l.max(due)).max(pod.joined);
    let elapsed = horizon.duration_since(pod.joined);
    if now.duration_since(pod.joined) < period + window || elapsed.is_zero() {
        return None;
    }
    let expected = elapsed.as_secs_f64() * window.as_secs_f64() / period.as_secs_f64();
    let pct = (pod.sampled.as_secs_f64() / expected * 100.0).min(100.0);
    Some(pct.floor() as i64)
}

/// The pods of one node's set, before the node's budget: pod UID → entry.
type NodeSet = BTreeMap<(String, u32), (pb::ContinuousPod, u64)>;

/// Recomputes every node's set and (re)starts the calls whose set changed.
fn sync(ctx: &Arc<SamplingContext>) {
    let hub = &ctx.continuous;
    let policies: Vec<Registered> = hub.lock().policies.values().cloned().collect();
    let mut desired: BTreeMap<String, NodeSet> = BTreeMap::new();
    let mut matching: HashMap<String, usize> = HashMap::new();
    for p in &policies {
        let selector = match selector_of(p.spec.template.selector.as_ref()) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(policy = %p.name, "always-on policy not profiled: {e}");
                continue;
            }
        };
        let eligible = ctx.fleet.eligible(
            &p.uid,
            &p.scope,
            selector.as_ref(),
            &p.spec.template.pod_names,
        );
        matching.insert(p.uid.clone(), eligible.candidates.len());
        let cap = pod_cap(p, eligible.candidates.len());
        for c in eligible.candidates.into_iter().take(cap) {
            // The pod's running containers, each sampled under its name; the agent also
            // samples the pod's own cgroup, so a container started after this set (a
            // restart's new ID) is still profiled, under the pod, until the next set.
            let containers: Vec<pb::Container> = ctx
                .fleet
                .pods
                .get(&ObjectRef::new(&c.name).within(&c.namespace))
                .map(|pod| {
                    pod.containers
                        .iter()
                        .map(|k| pb::Container {
                            name: k.name.clone(),
                            container_id: k.id.clone(),
                        })
                        .collect()
                })
                .unwrap_or_default();
            let entry = desired
                .entry(c.node.clone())
                .or_default()
                .entry((c.uid.clone(), p.frequency_hz))
                .or_insert_with(|| {
                    (
                        pb::ContinuousPod {
                            policy_uids: Vec::new(),
                            target: Some(pb::Target {
                                pod_uid: c.uid.clone(),
                                namespace: c.namespace.clone(),
                                pod_name: c.name.clone(),
                                containers,
                                annotations: Default::default(),
                                pod_ip: String::new(),
                            }),
                            frequency_hz: p.frequency_hz,
                        },
                        c.position,
                    )
                });
            entry.0.policy_uids.push(p.uid.clone());
        }
    }
    // The node budget: at most so many pods per node, the first in rotation order.
    let max = hub.settings.max_pods_per_node.max(1);
    let mut over_budget: HashMap<String, Vec<String>> = HashMap::new();
    let mut sets: BTreeMap<String, Vec<pb::ContinuousPod>> = BTreeMap::new();
    for (node, set) in desired {
        let mut entries: Vec<(pb::ContinuousPod, u64)> = set.into_values().collect();
        entries.sort_by_key(|(_, position)| *position);
        let mut pods: BTreeSet<String> = BTreeSet::new();
        let mut kept = Vec::new();
        for (entry, _) in entries {
            let Some(t) = entry.target.as_ref() else {
                continue;
            };
            if !pods.contains(&t.pod_uid) && pods.len() >= max {
                for uid in &entry.policy_uids {
                    over_budget.entry(uid.clone()).or_default().push(format!(
                        "{}/{}: node {node} profiles {max} pods always-on already (the cluster's --max-continuous-pods-per-node)",
                        t.namespace, t.pod_name
                    ));
                }
                continue;
            }
            pods.insert(t.pod_uid.clone());
            kept.push(entry);
        }
        kept.sort_by(|a, b| {
            let key = |p: &pb::ContinuousPod| {
                (p.target.as_ref().map(|t| t.pod_uid.clone()), p.frequency_hz)
            };
            key(a).cmp(&key(b))
        });
        sets.insert(node, kept);
    }
    let agents = cached_agents(&ctx.fleet.pods, &ctx.fleet.agent_namespace);
    let now = Instant::now();
    let mut fetch = Vec::new();
    let mut inner = hub.lock();
    // Coverage entries: pods that joined start now, pods that left are forgotten.
    let mut wanted: HashMap<(String, String), (String, String, String)> = HashMap::new();
    for (node, pods) in &sets {
        for p in pods {
            let Some(t) = p.target.as_ref() else { continue };
            for uid in &p.policy_uids {
                wanted.insert(
                    (uid.clone(), t.pod_uid.clone()),
                    (t.namespace.clone(), t.pod_name.clone(), node.clone()),
                );
            }
            if !inner.workloads.contains_key(&t.pod_uid) {
                inner.workloads.insert(t.pod_uid.clone(), None);
                fetch.push((t.namespace.clone(), t.pod_name.clone(), t.pod_uid.clone()));
            }
        }
    }
    inner.pods.retain(|k, _| wanted.contains_key(k));
    for (key, (namespace, name, node)) in wanted {
        let entry = inner.pods.entry(key).or_insert_with(|| Covered {
            namespace,
            name,
            node: node.clone(),
            joined: now,
            sampled: Duration::ZERO,
            windows: 0,
            last: None,
        });
        if entry.node != node {
            // Moved: a pod UID runs on one node; start over.
            entry.node = node;
            entry.joined = now;
            entry.sampled = Duration::ZERO;
            entry.windows = 0;
            entry.last = None;
        }
    }
    let live: BTreeSet<String> = inner.pods.keys().map(|(_, p)| p.clone()).collect();
    inner.workloads.retain(|uid, _| live.contains(uid));
    for (uid, counters) in &mut inner.counters {
        counters.matching = matching.get(uid).copied().unwrap_or(0);
        counters.over_budget = over_budget.remove(uid).unwrap_or_default();
        counters.over_budget.truncate(MAX_LOW_COVERAGE);
    }
    let ended: Vec<String> = inner
        .streams
        .iter()
        .filter(|(_, s)| s.task.is_finished())
        .map(|(n, _)| n.clone())
        .collect();
    for node in ended {
        inner.streams.remove(&node);
        inner.retry.insert(node, now + RETRY_AFTER);
    }
    let stale: Vec<String> = inner
        .streams
        .keys()
        .filter(|n| sets.get(*n).is_none_or(|s| s.is_empty()))
        .cloned()
        .collect();
    for node in stale {
        if let Some(s) = inner.streams.remove(&node) {
            // Dropping the call ends the agent's set.
            s.task.abort();
        }
        inner.refused.remove(&node);
    }
    for (node, pods) in sets {
        if pods.is_empty() {
            continue;
        }
        let request = pb::ContinuousRequest {
            pods,
            window_ms: millis(hub.settings.window),
            period_ms: millis(hub.settings.period),
            max_profile_bytes: hub.settings.max_profile_bytes,
        };
        let Some(agent) = agents.get(&node).cloned() else {
            continue;
        };
        if let Some(s) = inner.streams.get(&node)
            && s.request == request
            && s.agent == agent
        {
            continue;
        }
        if inner.retry.get(&node).is_some_and(|at| *at > now) && !inner.streams.contains_key(&node)
        {
            continue;
        }
        inner.retry.remove(&node);
        // The same agent ends the previous call itself once the new one replaced its set,
        // after sending the windows it still held: aborting it first would end the set in
        // between, and the agent would drop the windows cut then.
        let replaces = match inner.streams.remove(&node) {
            Some(old) if old.agent == agent => Some(old.task.abort_handle()),
            Some(old) => {
                old.task.abort();
                None
            }
            None => None,
        };
        let task = tokio::spawn(continuous_node(
            Arc::clone(ctx),
            node.clone(),
            agent.clone(),
            request.clone(),
            replaces,
        ));
        inner.streams.insert(
            node,
            NodeStream {
                request,
                agent,
                task,
            },
        );
    }
    drop(inner);
    for (namespace, name, uid) in fetch {
        let ctx = Arc::clone(ctx);
        tokio::spawn(async move {
            let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
            match api.get_opt(&name).await {
                Ok(Some(pod)) if pod.metadata.uid.as_deref() == Some(uid.as_str()) => {
                    let workload = workload_of(&pod.metadata);
                    if let Some(slot) = ctx.continuous.lock().workloads.get_mut(&uid) {
                        *slot = workload;
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(%namespace, %name, "reading the pod's owner: {e}"),
            }
        });
    }
}

/// How many of `matching` eligible pods policy `p` profiles: all, or what its `sampling`
/// allows.
fn pod_cap(p: &Registered, matching: usize) -> usize {
    let Some(s) = p.spec.sampling.as_ref() else {
        return matching;
    };
    let mut cap = matching;
    if let Some(max) = s.max_pods.and_then(|m| usize::try_from(m).ok()) {
        cap = cap.min(max);
    }
    if let Some(pct) = s.percent.and_then(|m| usize::try_from(m).ok()) {
        cap = cap.min((matching * pct).div_ceil(100));
    }
    cap
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// How long the call a new one `replaces` may still deliver its last windows before it is
/// ended from this side (the agent ends it itself once the new set is in place).
const REPLACED_GRACE: Duration = Duration::from_secs(30);

/// A replaced call's task, ended when this is dropped: when the call replacing it cannot
/// start, or is itself ended before it could.
struct Replaced(Option<tokio::task::AbortHandle>);

impl Replaced {
    /// The new call is in place: the replaced one may deliver its last windows for
    /// [`REPLACED_GRACE`].
    fn in_place(mut self) {
        if let Some(old) = self.0.take() {
            tokio::spawn(async move {
                tokio::time::sleep(REPLACED_GRACE).await;
                old.abort();
            });
        }
    }
}

impl Drop for Replaced {
    fn drop(&mut self) {
        if let Some(old) = self.0.take() {
            old.abort();
        }
    }
}

/// One node's `Continuous` call: send the set, then take its windows until the call ends.
/// `replaces` is the node's previous call to the same agent: it is ended here when this one
/// cannot start (or this task is ended first), or [`REPLACED_GRACE`] after it did, if the
/// agent has not ended it by then.
async fn continuous_node(
    ctx: Arc<SamplingContext>,
    node: String,
    agent: AgentEndpoint,
    request: pb::ContinuousRequest,
    replaces: Option<tokio::task::AbortHandle>,
) {
    let replaced = Replaced(replaces);
    let pods = request.pods.len();
    let hub = &ctx.continuous;
    let mut client = match hub.connector.connect(&agent).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(%node, "cannot reach the agent to send its always-on set: {e}");
            return;
        }
    };
    let mut stream = match client.continuous(request.clone()).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            tracing::warn!(%node, "the agent refused its always-on set: {}", status.message());
            hub.connector.evict(&agent);
            return;
        }
    };
    replaced.in_place();
    tracing::info!(%node, pods, "sent the node's always-on set");
    loop {
        match stream.message().await {
            Ok(Some(event)) => match event.event {
                Some(pb::continuous_event::Event::Ack(ack)) => {
                    if !ack.refused.is_empty() {
                        tracing::warn!(%node, refused = ?ack.refused, "the agent cannot profile every pod always-on");
                    }
                    let mut refused: Vec<String> = ack
                        .refused
                        .iter()
                        .map(|l| crate::events::truncated(l, 300))
                        .collect();
                    refused.truncate(MAX_REFUSED);
                    hub.lock().refused.insert(node.clone(), refused);
                }
                Some(pb::continuous_event::Event::Window(window)) => {
                    handle_window(&ctx, &node, &request, window);
                }
                None => {}
            },
            Ok(None) => {
                tracing::info!(%node, "the agent ended the always-on call");
                return;
            }
            Err(status) => {
                tracing::warn!(%node, "the always-on call failed: {}", status.message());
                hub.connector.evict(&agent);
                return;
            }
        }
    }
}

/// Counts one window reported by `node` (for the set `request` sent it) and queues its
/// profile for export.
fn handle_window(
    ctx: &SamplingContext,
    node: &str,
    request: &pb::ContinuousRequest,
    window: pb::WindowProfile,
) {
    let hub = &ctx.continuous;
    // Only a pod of the set sent to this node, at the frequency asked, for the policies the
    // set names: never what the node says besides the pod UID.
    let Some((entry, target)) = request.pods.iter().find_map(|p| {
        let t = p.target.as_ref()?;
        (t.pod_uid == window.pod_uid && p.frequency_hz == window.frequency_hz).then_some((p, t))
    }) else {
        ctx.metrics.continuous_window("NotAsked");
        tracing::warn!(%node, pod_uid = %crate::events::truncated(&window.pod_uid, 64), "node sent a window of a pod it was not asked to profile; ignored");
        return;
    };
    // A window samples at most the set's window (a little more for the time it took to
    // end); a node cannot claim more coverage than that.
    let sampled = Duration::from_millis(u64::from(window.duration_ms))
        .min(hub.settings.window + Duration::from_secs(1));
    let now = Instant::now();
    let mut inner = hub.lock();
    if inner.rates.len() > 4 * inner.pods.len() + 64 {
        // Pods that left every set.
        let current: BTreeSet<String> = inner.pods.keys().map(|(_, pod)| pod.clone()).collect();
        inner.rates.retain(|(_, pod), _| current.contains(pod));
    }
    let rate = inner
        .rates
        .entry((node.to_string(), target.pod_uid.clone()))
        .or_insert(WindowRate {
            tokens: WINDOW_BURST,
            at: now,
        });
    if !admit_window(rate, now, hub.settings.period) {
        drop(inner);
        ctx.metrics.continuous_window("TooFrequent");
        tracing::warn!(%node, pod = %format!("{}/{}", target.namespace, target.pod_name), "node sends windows of a pod faster than one per period; dropped");
        return;
    }
    let mut tallies = Vec::new();
    let mut policy_names = Vec::new();
    for uid in &entry.policy_uids {
        let Some(policy) = inner.policies.get(uid) else {
            continue;
        };
        let exports = policy.spec.template.export != Some(false);
        let name = policy.display();
        if let Some(pod) = inner.pods.get_mut(&(uid.clone(), target.pod_uid.clone()))
            && pod.node == node
        {
            pod.sampled += sampled;
            pod.windows += 1;
            pod.last = Some(now);
        }
        let counters = inner.counters.entry(uid.clone()).or_default();
        counters.windows += 1;
        counters.last_window = Some(Timestamp::now());
        if exports {
            tallies.push(Arc::clone(&counters.tally));
            policy_names.push(name);
        }
    }
    let workload = inner.workloads.get(&target.pod_uid).cloned().flatten();
    drop(inner);
    if tallies.is_empty() {
        ctx.metrics.continuous_window("NotExported");
        return;
    }
    if !window.error.is_empty() {
        let message = crate::events::truncated(&window.error, 300);
        for t in &tallies {
            t.dropped_without_queue("window_error", &message);
        }
        ctx.metrics.continuous_window("AgentError");
        return;
    }
    if window.pprof.is_empty() {
        // No sample in the window (an idle pod): covered, nothing to export.
        ctx.metrics.continuous_window("Empty");
        return;
    }
    let Some(exporter) = hub.exporter.as_ref() else {
        ctx.metrics.continuous_window("NotExported");
        return;
    };
    ctx.metrics.continuous_window("Queued");
    exporter.submit(ExportJob {
        context: CaptureContext {
            namespace: target.namespace.clone(),
            request: String::new(),
            policy: policy_names.join(","),
            node: node.to_string(),
            pods: vec![ExportedPod {
                name: target.pod_name.clone(),
                uid: target.pod_uid.clone(),
                // The containers of the set sent to the node: a sample's container label
                // names one of them or none (started after the set: under the pod).
                containers: target.containers.iter().map(|c| c.name.clone()).collect(),
                workload,
            }],
        },
        artifacts: vec![ExportItem::Window {
            name: format!(
                "{}/{}@{}",
                target.namespace, target.pod_name, window.start_unix_ms
            ),
            pprof: Arc::new(window.pprof),
        }],
        tally: tallies,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(joined: Instant) -> Covered {
        Covered {
            namespace: "shop".into(),
            name: "web-0".into(),
            node: "n1".into(),
            joined,
            sampled: Duration::ZERO,
            windows: 0,
            last: None,
        }
    }

    #[test]
    fn coverage_counts_windows_against_the_time_they_should_have_sampled() {
        let (w, p) = (Duration::from_secs(19), Duration::from_secs(20));
        let t0 = Instant::now();
        let mut covered = pod(t0);
        // Too early to tell.
        assert_eq!(
            coverage_percent(&covered, t0 + Duration::from_secs(10), w, p),
            None
        );
        // Every window on time: full coverage, just after a window and just before the next.
        for k in 0..30u32 {
            covered.sampled += w;
            covered.windows += 1;
            covered.last = Some(t0 + p * k + w + Duration::from_millis(300));
        }
        let last = covered.last.unwrap();
        assert_eq!(coverage_percent(&covered, last, w, p), Some(100));
        assert_eq!(
            coverage_percent(&covered, last + p - Duration::from_millis(10), w, p),
            Some(100)
        );
        // Windows stop coming: coverage falls as time goes on.
        let later = coverage_percent(&covered, last + p * 10, w, p).unwrap();
        assert!((70..80).contains(&later), "{later}");
        // One window of 30 missing: about 96%.
        covered.sampled -= w;
        let one_missing = coverage_percent(&covered, last, w, p).unwrap();
        assert!((95..=97).contains(&one_missing), "{one_missing}");
    }

    #[test]
    fn windows_beyond_two_per_period_and_a_burst_of_three_are_dropped() {
        let p = Duration::from_secs(20);
        let t0 = Instant::now();
        let mut rate = WindowRate {
            tokens: WINDOW_BURST,
            at: t0,
        };
        // A flood: the burst passes, the rest is dropped.
        let admitted = (0..100)
            .filter(|i| admit_window(&mut rate, t0 + Duration::from_millis(*i), p))
            .count();
        assert_eq!(admitted, 3);
        // Then two per period, however many are sent.
        let mut admitted = 0;
        for k in 1..=50u32 {
            let at = t0 + p * k;
            admitted += (0..10)
                .filter(|i| admit_window(&mut rate, at + Duration::from_millis(*i), p))
                .count();
        }
        assert_eq!(admitted, 100);
        // An honest node: a window every period, an early one each time its set changes
        // (here every third window, at 1 s): every window passes.
        let mut rate = WindowRate {
            tokens: WINDOW_BURST,
            at: t0,
        };
        let mut at = t0;
        for k in 0..200u32 {
            at += if k % 3 == 1 {
                Duration::from_secs(1)
            } else {
                p - Duration::from_millis(50)
            };
            assert!(admit_window(&mut rate, at, p), "window {k}");
        }
    }

    #[test]
    fn sampling_limits_cap_the_pods_of_a_policy() {
        let spec: SamplingPolicySpec = serde_json::from_value(serde_json::json!({
            "schedule": "@continuous",
            "template": {"type": "cpu", "duration": "10s", "selector": {}},
            "sampling": {"maxPods": 7, "percent": 50},
        }))
        .unwrap();
        let p = Registered {
            kind: PolicyKind::Namespaced,
            name: "always".into(),
            namespace: Some("shop".into()),
            uid: "u".into(),
            spec,
            scope: Scope::Namespace("shop".into()),
            frequency_hz: 19,
        };
        assert_eq!(pod_cap(&p, 10), 5);
        assert_eq!(pod_cap(&p, 20), 7);
        assert_eq!(pod_cap(&p, 0), 0);
    }
}
