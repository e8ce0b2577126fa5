//! Triggers of the sampling policies, the operator's half (docs/triggers.md): tell each
//! agent what to watch, and turn what fires into runs.
//!
//! - **Watch sets.** The policy reconciler registers each policy's triggers here. A loop
//!   computes, from the pod cache, the watch set of every node: each registered policy's
//!   triggers on each pod the policy may sample there (its own namespace only for a
//!   SamplingPolicy; the namespaces of its `namespaceSelector` for a ClusterSamplingPolicy).
//!   It holds one `Watch` call per node with a non-empty set (over the agents' mTLS
//!   connection) and replaces it whenever the set changes; the agent keeps unchanged entries
//!   armed.
//! - **Fires.** A fire counts only when everything the node cannot choose agrees: the policy
//!   is registered and has that trigger, the pod exists with that UID, the policy may sample
//!   it now, and it runs on the very node whose connection reported it. So a node (even a
//!   compromised one) can only fire for pods it hosts and policies that watch them, and a
//!   tenant's policy only ever watches its own namespace's pods.
//! - **Bounds.** The agent fires a trigger at most once per cooldown per pod (and at most
//!   its fire budget per minute); the operator checks the cooldown per pod again (in memory
//!   and from the runs in the cache, so a restart does not reset it), the cooldown per policy,
//!   the node's capture budget (the policy's `budget`, shared with every other capture) and
//!   the namespace's queue of waiting requests. A fire turned down is counted in the policy's
//!   `status.triggers[]` with its reason, never queued.
//! - **Runs.** A fire that passes becomes an ordinary ProfileRequest owned by the policy, for
//!   that pod only, named from the policy, the fire time and the pod (so the same fire twice
//!   is one request), with `status.trigger` saying what fired at what value, and an Event
//!   on the pod.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use flamefleet_api::policy_runs::{
    POLICY_KIND_LABEL, POLICY_NAME_LABEL, POLICY_UID_LABEL, PolicyKind, is_label_value,
};
use flamefleet_api::trigger::{
    MemoryEventName, PolicyTrigger, PressureResource, TRIGGER_FIRE_ANNOTATION, TRIGGER_LABEL,
    TRIGGER_POD_UID_LABEL, TriggerFire, TriggerStatus,
};
use flamefleet_api::{
    ClusterSamplingPolicy, ProfileRequest, ProfileType, RunReference, SamplingPolicy,
    SamplingPolicySpec,
};
use flamefleet_proto::agent as pb;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use tokio::task::JoinHandle;

use super::SamplingContext;
use super::budget::{Budget, Reservation};
use super::fleet::{Scope, selector_of};
use super::rotation::NodeGate as _;
use crate::dispatch::connector::AgentConnector;
use crate::pods::agents::{AgentEndpoint, cached_agents};

/// The field manager of `status.trigger` on triggered runs (the ProfileRequest controller
/// applies the rest of the status under its own; two managers keep each other's fields).
pub const TRIGGER_FIELD_MANAGER: &str = "flamefleet-operator.trigger";
/// Default time-to-live of a triggered run after it finished (history limits count
/// scheduled runs only).
pub const DEFAULT_TRIGGERED_TTL_SECONDS: i64 = 86_400;
/// How often the watch sets are recomputed without a change notification (new pods, pods
/// moved, agents restarted).
const RESYNC: Duration = Duration::from_secs(2);
/// How long a node whose `Watch` call failed waits before the next attempt.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// How long a replaced call is still read: the agent ends it once the new call holds the
/// set, and fires it sent on it before are handled meanwhile.
const DRAIN: Duration = Duration::from_secs(30);
/// Most refusals kept per trigger status.
const MAX_REFUSED: usize = 10;

/// A policy's triggers, as registered by its reconciler.
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
    /// Labels, copied to its runs.
    pub labels: BTreeMap<String, String>,
    /// The spec (template, budget, triggers).
    pub spec: SamplingPolicySpec,
    /// Which namespaces it samples.
    pub scope: Scope,
}

impl Registered {
    fn object_ref(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some(format!(
                "{}/{}",
                flamefleet_api::GROUP,
                flamefleet_api::VERSION
            )),
            kind: Some(self.kind.as_str().to_string()),
            name: Some(self.name.clone()),
            namespace: self.namespace.clone(),
            uid: Some(self.uid.clone()),
            ..ObjectReference::default()
        }
    }
}

#[derive(Debug, Default, Clone)]
struct Counter {
    fires: i64,
    skipped: i64,
    last_skip_reason: String,
    last_fire_time: Option<Time>,
    last_run: Option<RunReference>,
}

struct NodeStream {
    request: pb::WatchRequest,
    agent: AgentEndpoint,
    task: JoinHandle<()>,
}

#[derive(Default)]
struct Inner {
    policies: BTreeMap<String, Registered>,
    /// (policy UID, trigger) → what it did.
    counters: HashMap<(String, String), Counter>,
    /// (policy UID, trigger, pod UID) → last run created.
    pod_fires: HashMap<(String, String, String), Timestamp>,
    /// (policy UID, trigger) → last run created.
    policy_fires: HashMap<(String, String), Timestamp>,
    /// (policy UID, trigger) → pods watched.
    watched: HashMap<(String, String), i64>,
    /// node → refusals of its last acknowledgement.
    refused: HashMap<String, Vec<String>>,
    streams: BTreeMap<String, NodeStream>,
    /// Nodes whose call failed, and when they may try again.
    retry: HashMap<String, Instant>,
}

/// The operator's triggers: registered policies, the watch calls, cooldowns and counters.
pub struct TriggerHub {
    connector: AgentConnector,
    inner: Mutex<Inner>,
    changed: tokio::sync::Notify,
}

impl std::fmt::Debug for TriggerHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TriggerHub").finish_non_exhaustive()
    }
}

impl TriggerHub {
    /// A hub that calls agents through `connector`.
    pub fn new(connector: AgentConnector) -> Self {
        Self {
            connector,
            inner: Mutex::default(),
            changed: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers (or updates) `policy`'s triggers; `None` (no triggers, suspended, over the
    /// namespace's policy cap) unregisters it. `seed`: the policy's status, whose counters
    /// a fresh operator starts from.
    pub fn register(&self, uid: &str, policy: Option<Registered>, seed: &[TriggerStatus]) {
        let mut inner = self.lock();
        let changed = match policy {
            Some(p) if !p.spec.triggers.is_empty() => {
                for s in seed {
                    inner
                        .counters
                        .entry((uid.to_string(), s.name.clone()))
                        .or_insert_with(|| Counter {
                            fires: s.fires,
                            skipped: s.skipped,
                            last_skip_reason: s.last_skip_reason.clone(),
                            last_fire_time: s.last_fire_time.clone(),
                            last_run: s.last_run.clone(),
                        });
                }
                let before = inner.policies.insert(uid.to_string(), p.clone());
                before.is_none_or(|b| {
                    b.spec.triggers != p.spec.triggers
                        || b.spec.template.selector != p.spec.template.selector
                        || b.spec.template.pod_names != p.spec.template.pod_names
                        || b.labels != p.labels
                })
            }
            _ => inner.policies.remove(uid).is_some(),
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
        inner.counters.retain(|(p, _), _| p != uid);
        inner.pod_fires.retain(|(p, _, _), _| p != uid);
        inner.policy_fires.retain(|(p, _), _| p != uid);
        drop(inner);
        self.changed.notify_one();
    }

    /// The `status.triggers` of a policy with `triggers`.
    pub fn status_of(&self, uid: &str, triggers: &[PolicyTrigger]) -> Vec<TriggerStatus> {
        let inner = self.lock();
        // What the agents refused about pods this policy may see: a SamplingPolicy's status
        // names no pod of another namespace.
        let namespace = inner
            .policies
            .get(uid)
            .and_then(|p| p.namespace.as_ref())
            .map(|ns| format!("{ns}/"));
        let refused: Vec<&String> = inner
            .refused
            .values()
            .flatten()
            .filter(|line| {
                namespace
                    .as_ref()
                    .is_none_or(|ns| line.starts_with(ns.as_str()))
            })
            .collect();
        triggers
            .iter()
            .map(|t| {
                let key = (uid.to_string(), t.name.clone());
                let c = inner.counters.get(&key).cloned().unwrap_or_default();
                TriggerStatus {
                    name: t.name.clone(),
                    watched_pods: inner.watched.get(&key).copied().unwrap_or(0),
                    fires: c.fires,
                    skipped: c.skipped,
                    last_skip_reason: c.last_skip_reason,
                    last_fire_time: c.last_fire_time,
                    last_run: c.last_run,
                    refused: refused
                        .iter()
                        .filter(|l| {
                            l.contains(&format!("trigger {}:", t.name)) || !l.contains("trigger ")
                        })
                        .take(MAX_REFUSED)
                        .map(|l| (*l).clone())
                        .collect(),
                }
            })
            .collect()
    }

    /// Keeps the agents' watch sets in step with the registered policies and the fleet
    /// until `shutdown`.
    pub async fn run(
        ctx: Arc<SamplingContext>,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) {
        tokio::pin!(shutdown);
        loop {
            sync(&ctx);
            tokio::select! {
                () = ctx.triggers.changed.notified() => {}
                () = tokio::time::sleep(RESYNC) => {}
                () = &mut shutdown => break,
            }
        }
        let mut inner = ctx.triggers.lock();
        for (_, s) in std::mem::take(&mut inner.streams) {
            s.task.abort();
        }
        ctx.metrics.set_trigger_streams(0);
    }
}

/// The proto trigger of a policy trigger.
pub fn proto_trigger(t: &PolicyTrigger) -> pb::TriggerCondition {
    use pb::trigger_condition::Condition as C;
    let percent = |p: i32| u32::try_from(p).unwrap_or(0);
    let condition = if let Some(m) = &t.memory {
        match (m.above_limit_percent, m.event) {
            (Some(p), _) => Some(C::MemoryAboveLimitPercent(percent(p))),
            (None, Some(e)) => Some(C::MemoryEvent(
                match e {
                    MemoryEventName::High => pb::MemoryEventKind::High,
                    MemoryEventName::Max => pb::MemoryEventKind::Max,
                    MemoryEventName::Oom => pb::MemoryEventKind::Oom,
                    MemoryEventName::OomKill => pb::MemoryEventKind::OomKill,
                }
                .into(),
            )),
            (None, None) => None,
        }
    } else if let Some(c) = &t.cpu {
        match (c.throttled_percent, c.above_millicores) {
            (Some(p), _) => Some(C::CpuThrottledPercent(percent(p))),
            (None, Some(m)) => Some(C::CpuAbove(pb::CpuAbove {
                millicores: percent(m),
                sustained_seconds: percent(c.for_seconds.unwrap_or(60)),
            })),
            (None, None) => None,
        }
    } else if let Some(l) = &t.latency {
        Some(C::RunqlatP99(pb::RunqlatP99 {
            micros: u32::try_from(l.runqlat_p99_micros).unwrap_or(0),
            window_seconds: percent(l.window_seconds()),
        }))
    } else {
        t.pressure.as_ref().map(|p| {
            C::Pressure(pb::Pressure {
                resource: match p.resource {
                    PressureResource::Cpu => pb::PressureResource::Cpu,
                    PressureResource::Memory => pb::PressureResource::Memory,
                    PressureResource::Io => pb::PressureResource::Io,
                }
                .into(),
                percent: percent(p.some_avg10_percent),
            })
        })
    };
    pb::TriggerCondition {
        name: t.name.clone(),
        cooldown_seconds: u32::try_from(t.cooldown_seconds()).unwrap_or(u32::MAX),
        condition,
    }
}

/// Recomputes every node's watch set and (re)starts the calls whose set changed.
fn sync(ctx: &Arc<SamplingContext>) {
    let hub = &ctx.triggers;
    let policies: Vec<Registered> = hub.lock().policies.values().cloned().collect();
    let mut desired: BTreeMap<String, Vec<pb::WatchedPod>> = BTreeMap::new();
    let mut watched: HashMap<(String, String), i64> = HashMap::new();
    for p in &policies {
        let selector = match selector_of(p.spec.template.selector.as_ref()) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(policy = %p.name, "triggers not watched: {e}");
                continue;
            }
        };
        let eligible = ctx.fleet.eligible(
            &p.uid,
            &p.scope,
            selector.as_ref(),
            &p.spec.template.pod_names,
        );
        let triggers: Vec<pb::TriggerCondition> =
            p.spec.triggers.iter().map(proto_trigger).collect();
        for t in &p.spec.triggers {
            watched.insert(
                (p.uid.clone(), t.name.clone()),
                i64::try_from(eligible.candidates.len()).unwrap_or(i64::MAX),
            );
        }
        for c in eligible.candidates {
            desired
                .entry(c.node.clone())
                .or_default()
                .push(pb::WatchedPod {
                    policy_uid: p.uid.clone(),
                    target: Some(pb::Target {
                        pod_uid: c.uid.clone(),
                        namespace: c.namespace.clone(),
                        pod_name: c.name.clone(),
                        // The pod's cgroup: its limits are its containers' together.
                        containers: Vec::new(),
                        annotations: Default::default(),
                        pod_ip: String::new(),
                    }),
                    triggers: triggers.clone(),
                });
        }
    }
    let agents = cached_agents(&ctx.fleet.pods, &ctx.fleet.agent_namespace);
    let now = Instant::now();
    let mut inner = hub.lock();
    // Policies whose watched pods changed get their status now, not at their next reconcile.
    let recount: Vec<Registered> = policies
        .iter()
        .filter(|p| {
            p.spec.triggers.iter().any(|t| {
                let key = (p.uid.clone(), t.name.clone());
                inner.watched.get(&key) != watched.get(&key)
            })
        })
        .cloned()
        .collect();
    inner.watched = watched;
    // Calls that ended (agent gone, connection lost) are retried after a pause.
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
        .filter(|n| !desired.contains_key(*n))
        .cloned()
        .collect();
    for node in stale {
        if let Some(s) = inner.streams.remove(&node) {
            // Dropping the call ends the agent's watch set.
            s.task.abort();
        }
        inner.refused.remove(&node);
    }
    for (node, mut pods) in desired {
        pods.sort_by(|a, b| {
            (&a.policy_uid, a.target.as_ref().map(|t| &t.pod_uid))
                .cmp(&(&b.policy_uid, b.target.as_ref().map(|t| &t.pod_uid)))
        });
        let request = pb::WatchRequest { pods };
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
        let task = tokio::spawn(watch_node(
            Arc::clone(ctx),
            node.clone(),
            agent.clone(),
            request.clone(),
        ));
        // The new call replaces the set on the agent, which then ends the old one: until it
        // does, the old call is still read, for fires the agent sent on it before (dropping
        // it at once would lose them, and the agent would not send them again within the
        // cooldown). Bounded by DRAIN, for an agent that never ends it.
        if let Some(old) = inner.streams.insert(
            node,
            NodeStream {
                request,
                agent,
                task,
            },
        ) {
            let stop = old.task.abort_handle();
            tokio::spawn(async move {
                if tokio::time::timeout(DRAIN, old.task).await.is_err() {
                    stop.abort();
                }
            });
        }
    }
    ctx.metrics.set_trigger_streams(inner.streams.len());
    drop(inner);
    for policy in recount {
        let ctx = Arc::clone(ctx);
        tokio::spawn(async move { write_policy_status(&ctx, &policy).await });
    }
}

/// One node's `Watch` call: send the set, then handle what fires until the call ends.
async fn watch_node(
    ctx: Arc<SamplingContext>,
    node: String,
    agent: AgentEndpoint,
    request: pb::WatchRequest,
) {
    let pods = request.pods.len();
    let mut client = match ctx.triggers.connector.connect(&agent).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(%node, "cannot reach the agent to send its watch set: {e}");
            return;
        }
    };
    let mut stream = match client.watch(request).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            tracing::warn!(%node, "the agent refused its watch set: {}", status.message());
            ctx.triggers.connector.evict(&agent);
            return;
        }
    };
    tracing::info!(%node, pods, "sent the node's watch set");
    loop {
        match stream.message().await {
            Ok(Some(event)) => match event.event {
                Some(pb::watch_event::Event::Ack(ack)) => {
                    if !ack.refused.is_empty() {
                        tracing::warn!(%node, refused = ?ack.refused, "the agent could not watch every pod");
                    }
                    let mut refused = ack.refused;
                    refused.truncate(100);
                    ctx.triggers.lock().refused.insert(node.clone(), refused);
                }
                Some(pb::watch_event::Event::Fired(fired)) => {
                    handle_fire(&ctx, &node, fired).await;
                }
                None => {}
            },
            Ok(None) => {
                tracing::info!(%node, "the agent ended the watch call");
                return;
            }
            Err(status) => {
                tracing::warn!(%node, "the watch call failed: {}", status.message());
                ctx.triggers.connector.evict(&agent);
                return;
            }
        }
    }
}

/// Bounded text from a node (it may be compromised).
fn bounded(text: &str, max: usize) -> String {
    crate::events::truncated(text, max)
}

/// A fire as the run's `status.trigger`.
fn fire_status(fired: &pb::TriggerFired, node: &str, at: Timestamp) -> TriggerFire {
    let unit = bounded(&fired.unit, 16);
    let number = |v: f64| {
        if v.is_finite() {
            format!("{v:.1}")
        } else {
            "?".into()
        }
    };
    let measured = number(fired.measured);
    let threshold = number(fired.threshold);
    let name = bounded(&fired.trigger, 64);
    let condition = bounded(&fired.condition, 200);
    TriggerFire {
        reason: format!(
            "{name}: {condition} (measured {measured}{unit}, threshold {threshold}{unit})"
        ),
        name,
        condition,
        measured,
        threshold,
        unit,
        detail: bounded(&fired.detail, 300),
        pod: String::new(),
        container: bounded(&fired.container, 63),
        node: node.to_string(),
        fired_at: Time(at),
        heap_at_fire: fired
            .heap_at_fire
            .as_ref()
            .map(|h| {
                if h.kept {
                    format!(
                        "read on the node {} ms after the fire, before the run started",
                        h.took_ms
                    )
                } else {
                    bounded(
                        &format!("not read ({} ms after the fire): {}", h.took_ms, h.error),
                        300,
                    )
                }
            })
            .unwrap_or_default(),
    }
}

/// The node's id of a fire whose heap or CPU lead-up it kept, when it looks like one (32 hex
/// digits as the agent makes them; at most 64, so a node cannot write an annotation of any
/// size).
fn kept_fire_id(fired: &pb::TriggerFired) -> Option<&str> {
    let id = fired.fire_id.as_str();
    ((fired.heap_at_fire.as_ref().is_some_and(|h| h.kept)
        || fired.lead_up_at_fire.as_ref().is_some_and(|l| l.kept))
        && !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_hexdigit()))
    .then_some(id)
}

/// The name of the run a fire creates (see [`flamefleet_api::trigger::trigger_run_name`]).
pub use flamefleet_api::trigger::trigger_run_name;

/// The ProfileRequest of a fire of `trigger` on pod `pod` (in `namespace`).
pub fn triggered_request(
    policy: &Registered,
    trigger: &PolicyTrigger,
    namespace: &str,
    pod: &str,
    pod_uid: &str,
    at: Timestamp,
    fire_id: Option<&str>,
) -> ProfileRequest {
    let mut labels = policy.labels.clone();
    labels.insert(POLICY_KIND_LABEL.into(), policy.kind.as_str().to_string());
    labels.insert(POLICY_UID_LABEL.into(), policy.uid.clone());
    if is_label_value(&policy.name) {
        labels.insert(POLICY_NAME_LABEL.into(), policy.name.clone());
    } else {
        labels.remove(POLICY_NAME_LABEL);
    }
    labels.insert(TRIGGER_LABEL.into(), trigger.name.clone());
    labels.insert(TRIGGER_POD_UID_LABEL.into(), pod_uid.to_string());
    let mut spec = policy.spec.template.clone();
    let profile_type = trigger.capture_type();
    if spec.profile_type != profile_type {
        // The template's options are of its own type; the fire's type takes its defaults.
        spec.profile_type = profile_type;
        spec.cpu = None;
        spec.heap = None;
        spec.runqlat = None;
        spec.offcpu = None;
    }
    spec.selector = None;
    spec.pod_names = vec![pod.to_string()];
    spec.duration = trigger.capture_duration();
    spec.ttl_seconds_after_finished = spec
        .ttl_seconds_after_finished
        .or(Some(DEFAULT_TRIGGERED_TTL_SECONDS));
    let name = trigger_run_name(&policy.name, &trigger.name, pod_uid, at.as_second());
    let mut request = ProfileRequest::new(&name, spec);
    request.metadata.namespace = Some(namespace.to_string());
    request.metadata.labels = Some(labels);
    // A heap run takes the heap its node read at the fire, a CPU run prepends the lead-up
    // its node read from the ring (the agent checks the pod).
    if let Some(id) =
        fire_id.filter(|_| matches!(profile_type, ProfileType::Heap | ProfileType::Cpu))
    {
        request.metadata.annotations = Some(BTreeMap::from([(
            TRIGGER_FIRE_ANNOTATION.to_string(),
            id.to_string(),
        )]));
    }
    request.metadata.owner_references = Some(vec![OwnerReference {
        api_version: format!("{}/{}", flamefleet_api::GROUP, flamefleet_api::VERSION),
        kind: policy.kind.as_str().to_string(),
        name: policy.name.clone(),
        uid: policy.uid.clone(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }]);
    request
}

/// Whether `run` is a triggered run of `policy_uid`'s trigger `trigger` (and, with `pod_uid`,
/// of that pod) created after `since`. Runs are recognised by the controller
/// ownerReference; a tenant who copies one into its own requests only holds back fires on
/// its own namespace's pods.
fn recent_run(
    run: &ProfileRequest,
    policy_uid: &str,
    trigger: &str,
    pod_uid: Option<&str>,
    since: Timestamp,
) -> bool {
    let owned = run
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.uid == policy_uid);
    let labels = run.labels();
    owned
        && labels.get(TRIGGER_LABEL).map(String::as_str) == Some(trigger)
        && pod_uid.is_none_or(|p| labels.get(TRIGGER_POD_UID_LABEL).map(String::as_str) == Some(p))
        && run
            .metadata
            .creation_timestamp
            .as_ref()
            .is_some_and(|t| t.0 > since)
}

fn seconds_before(now: Timestamp, seconds: i64) -> Timestamp {
    now.checked_sub(jiff::SignedDuration::from_secs(seconds))
        .unwrap_or(now)
}

/// Turns one fire reported by `node` into a run, or counts why not.
async fn handle_fire(ctx: &Arc<SamplingContext>, node: &str, fired: pb::TriggerFired) {
    let hub = &ctx.triggers;
    let Some(policy) = hub.lock().policies.get(&fired.policy_uid).cloned() else {
        // A policy deleted or changed meanwhile, or a node making one up.
        ctx.metrics.trigger_fire("NotWatched");
        tracing::debug!(%node, policy = %fired.policy_uid, "a fire for a policy with no triggers here; ignored");
        return;
    };
    let Some(trigger) = policy
        .spec
        .triggers
        .iter()
        .find(|t| t.name == fired.trigger)
        .cloned()
    else {
        ctx.metrics.trigger_fire("NotWatched");
        return;
    };
    // The pod must be one the policy watches on this very node.
    let selector = selector_of(policy.spec.template.selector.as_ref())
        .ok()
        .flatten();
    let eligible = ctx.fleet.eligible(
        &policy.uid,
        &policy.scope,
        selector.as_ref(),
        &policy.spec.template.pod_names,
    );
    let Some(pod) = eligible
        .candidates
        .into_iter()
        .find(|c| c.uid == fired.pod_uid && c.node == node)
    else {
        ctx.metrics.trigger_fire("NotWatched");
        tracing::warn!(
            %node,
            policy = %policy.name,
            pod = %format!("{}/{}", bounded(&fired.namespace, 63), bounded(&fired.pod_name, 253)),
            "node reported a fire for a pod the policy does not watch on it; ignored"
        );
        return;
    };
    let planning = ctx.planning.lock().await;
    let now = ctx.now();
    let key = (policy.uid.clone(), trigger.name.clone());
    let pod_key = (policy.uid.clone(), trigger.name.clone(), pod.uid.clone());
    let runs = ctx.fleet.runs_of(&policy.uid);
    let cooldown = trigger.cooldown_seconds();
    let policy_cooldown = trigger.policy_cooldown_seconds();
    let skip = {
        let inner = hub.lock();
        let pod_since = seconds_before(now, cooldown);
        let policy_since = seconds_before(now, policy_cooldown);
        if inner
            .pod_fires
            .get(&pod_key)
            .is_some_and(|t| *t > pod_since)
            || runs
                .iter()
                .any(|r| recent_run(r, &policy.uid, &trigger.name, Some(&pod.uid), pod_since))
        {
            Some((
                "Cooldown",
                format!(
                    "pod {}/{} fired within its cooldown ({cooldown}s)",
                    pod.namespace, pod.name
                ),
            ))
        } else if inner
            .policy_fires
            .get(&key)
            .is_some_and(|t| *t > policy_since)
            || runs
                .iter()
                .any(|r| recent_run(r, &policy.uid, &trigger.name, None, policy_since))
        {
            Some((
                "PolicyCooldown",
                format!(
                    "the policy's trigger fired within its policyCooldownSeconds ({policy_cooldown}s)"
                ),
            ))
        } else {
            None
        }
    };
    let profile_type = trigger.capture_type();
    let skip = match skip {
        Some(s) => Some(s),
        None => budget_skip(
            ctx,
            &policy,
            &trigger,
            profile_type,
            node,
            &pod.namespace,
            now,
        ),
    };
    let mut fire = fire_status(&fired, node, now);
    fire.pod.clone_from(&pod.name);
    if let Some((reason, message)) = skip {
        drop(planning);
        ctx.metrics.trigger_fire(reason);
        tracing::info!(policy = %policy.name, trigger = %trigger.name, pod = %pod.name, reason, "trigger fire turned down: {message}");
        {
            let mut inner = hub.lock();
            let c = inner.counters.entry(key).or_default();
            c.skipped += 1;
            c.last_skip_reason = format!("{reason}: {message}");
        }
        if reason != "Cooldown" && reason != "PolicyCooldown" {
            publish(
                ctx,
                &policy,
                None,
                EventType::Warning,
                "TriggerSkipped",
                format!(
                    "{} on pod {}/{}: {reason}: {message}",
                    fire.reason, pod.namespace, pod.name
                ),
            )
            .await;
        }
        write_policy_status(ctx, &policy).await;
        return;
    }
    let request = triggered_request(
        &policy,
        &trigger,
        &pod.namespace,
        &pod.name,
        &pod.uid,
        now,
        kept_fire_id(&fired),
    );
    let name = request.name_any();
    let api: Api<ProfileRequest> = Api::namespaced(ctx.client.clone(), &pod.namespace);
    let created = match api.create(&PostParams::default(), &request).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            // The same fire handled twice, or a request of that name someone else made (a
            // tenant can guess the name): only the policy's own run counts.
            match api.get_opt(&name).await {
                Ok(Some(existing))
                    if existing
                        .owner_references()
                        .iter()
                        .any(|o| o.controller == Some(true) && o.uid == policy.uid) =>
                {
                    Ok(())
                }
                Ok(_) => Err((
                    "RunNameTaken",
                    format!(
                        "ProfileRequest {}/{name} exists and is not a run of this policy",
                        pod.namespace
                    ),
                )),
                Err(e) => Err(("Failed", format!("getting ProfileRequest {name}: {e}"))),
            }
        }
        Err(e) => Err(("Failed", format!("creating ProfileRequest {name}: {e}"))),
    };
    if let Err((outcome, why)) = created {
        ctx.metrics.trigger_fire(outcome);
        tracing::warn!(policy = %policy.name, request = %name, "triggered run not created: {why}");
        {
            let mut inner = hub.lock();
            let c = inner.counters.entry(key).or_default();
            c.skipped += 1;
            c.last_skip_reason = format!("{outcome}: {why}");
        }
        drop(planning);
        write_policy_status(ctx, &policy).await;
        return;
    }
    {
        let mut inner = hub.lock();
        inner.pod_fires.insert(pod_key, now);
        inner.policy_fires.insert(key.clone(), now);
        let c = inner.counters.entry(key).or_default();
        c.fires += 1;
        c.last_fire_time = Some(Time(now));
        c.last_run = Some(RunReference {
            namespace: pod.namespace.clone(),
            name: name.clone(),
        });
    }
    if let Ok(duration) =
        flamefleet_api::duration::parse_capture_duration(&trigger.capture_duration())
    {
        ctx.ledger.reserve(Reservation {
            request: format!("{}/{name}", pod.namespace),
            profile_type,
            nodes: vec![node.to_string()],
            start: now.as_second(),
            duration: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        });
    }
    drop(planning);
    ctx.metrics.trigger_fire("Created");
    tracing::info!(policy = %policy.name, request = %name, pod = %pod.name, reason = %fire.reason, "trigger fired: created a run");
    // What fired, in the run's status (a field of its own manager).
    let body = serde_json::json!({
        "apiVersion": format!("{}/{}", flamefleet_api::GROUP, flamefleet_api::VERSION),
        "kind": "ProfileRequest",
        "metadata": {"name": name},
        "status": {"trigger": fire},
    });
    if let Err(e) = api
        .patch_status(
            &name,
            &PatchParams::apply(TRIGGER_FIELD_MANAGER).force(),
            &Patch::Apply(body),
        )
        .await
    {
        tracing::warn!(request = %name, "writing status.trigger: {e}");
    }
    // An Event on the pod: its owner sees why a profile of it was taken.
    let pod_ref = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod.name.clone()),
        namespace: Some(pod.namespace.clone()),
        uid: Some(pod.uid.clone()),
        ..ObjectReference::default()
    };
    let run_ref = ObjectReference {
        api_version: Some(format!(
            "{}/{}",
            flamefleet_api::GROUP,
            flamefleet_api::VERSION
        )),
        kind: Some("ProfileRequest".into()),
        name: Some(name.clone()),
        namespace: Some(pod.namespace.clone()),
        ..ObjectReference::default()
    };
    crate::events::publish_related(
        &ctx.recorder,
        &pod_ref,
        Some(run_ref.clone()),
        EventType::Normal,
        "Trigger",
        "ProfileTriggered",
        &format!(
            "{} of {} {}: capturing {} for {} as ProfileRequest {name}; {}",
            trigger.name,
            policy.kind.as_str(),
            policy.name,
            profile_type,
            trigger.capture_duration(),
            fire.reason
        ),
    )
    .await;
    publish(
        ctx,
        &policy,
        Some(run_ref),
        EventType::Normal,
        "RunTriggered",
        format!(
            "{} on pod {}/{}: created {name}",
            fire.reason, pod.namespace, pod.name
        ),
    )
    .await;
    write_policy_status(ctx, &policy).await;
}

/// Why the node or namespace cannot take the fire's capture now, if so.
fn budget_skip(
    ctx: &SamplingContext,
    policy: &Registered,
    trigger: &PolicyTrigger,
    profile_type: ProfileType,
    node: &str,
    namespace: &str,
    now: Timestamp,
) -> Option<(&'static str, String)> {
    if policy.spec.suspend == Some(true) {
        return Some(("Suspended", "the policy is suspended".into()));
    }
    let duration =
        flamefleet_api::duration::parse_capture_duration(&trigger.capture_duration()).ok()?;
    let load = ctx.ledger.load(
        &ctx.fleet.requests.state(),
        &ctx.fleet.results.state(),
        &ctx.fleet.pods.state(),
        now,
    );
    let mut gate = load.gate(
        Budget::from_spec(policy.spec.budget.as_ref()),
        profile_type,
        duration,
        now,
    );
    if let Err((reason, message)) = gate.admit(node) {
        return Some((reason.as_str(), message));
    }
    let cap = ctx.limits.max_queued_per_namespace;
    if cap > 0 {
        let waiting = ctx
            .fleet
            .queued_by_namespace()
            .get(namespace)
            .copied()
            .unwrap_or(0);
        if waiting >= cap {
            return Some((
                "QueueFull",
                format!(
                    "namespace {namespace} holds {waiting} requests waiting to start (limit {cap}, --max-queued-runs-per-namespace)"
                ),
            ));
        }
    }
    None
}

/// Records an Event on the policy (a cluster-scoped policy's names no namespace or pod).
async fn publish(
    ctx: &SamplingContext,
    policy: &Registered,
    related: Option<ObjectReference>,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let (note, related) = match policy.namespace {
        Some(_) => (note, related),
        None => (
            super::policy::cluster_scoped_note(reason, &policy.name),
            None,
        ),
    };
    crate::events::publish_related(
        &ctx.recorder,
        &policy.object_ref(),
        related,
        type_,
        "Trigger",
        reason,
        &note,
    )
    .await;
}

/// Writes the policy's `status.triggers` from the hub (a merge patch of that field alone;
/// the reconciler writes the same from the same counters).
async fn write_policy_status(ctx: &SamplingContext, policy: &Registered) {
    let status = ctx.triggers.status_of(&policy.uid, &policy.spec.triggers);
    let patch = Patch::Merge(serde_json::json!({"status": {"triggers": status}}));
    let params = PatchParams::default();
    let result = match &policy.namespace {
        Some(ns) => {
            let api: Api<SamplingPolicy> = Api::namespaced(ctx.client.clone(), ns);
            api.patch_status(&policy.name, &params, &patch)
                .await
                .map(|_| ())
        }
        None => {
            let api: Api<ClusterSamplingPolicy> = Api::all(ctx.client.clone());
            api.patch_status(&policy.name, &params, &patch)
                .await
                .map(|_| ())
        }
    };
    if let Err(e) = result {
        tracing::debug!(policy = %policy.name, "writing status.triggers: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_api::trigger::MemoryTrigger;

    fn trigger() -> PolicyTrigger {
        serde_json::from_value(serde_json::json!({
            "name": "near-limit",
            "memory": {"aboveLimitPercent": 60},
            "cooldownSeconds": 120,
        }))
        .unwrap()
    }

    #[test]
    fn run_names_are_dns_labels_unique_per_pod_trigger_and_second() {
        let a = trigger_run_name("Checkout.OOM", "near-limit", "uid-1", 1_767_607_230);
        assert!(
            a.len() <= 63 && a.starts_with("checkout-oom-t1767607230-"),
            "{a}"
        );
        assert_ne!(
            a,
            trigger_run_name("Checkout.OOM", "near-limit", "uid-2", 1_767_607_230)
        );
        assert_ne!(
            a,
            trigger_run_name("Checkout.OOM", "other", "uid-1", 1_767_607_230)
        );
        assert_eq!(
            a,
            trigger_run_name("Checkout.OOM", "near-limit", "uid-1", 1_767_607_230)
        );
        let long = trigger_run_name(&"x".repeat(253), "t", "u", 1_767_607_230);
        assert!(long.len() <= 63, "{long}");
    }

    #[test]
    fn memory_triggers_capture_the_heap_and_keep_the_node_floor() {
        let t = trigger();
        assert_eq!(t.capture_type(), ProfileType::Heap);
        let p = proto_trigger(&t);
        assert_eq!(p.cooldown_seconds, 120);
        assert_eq!(
            p.condition,
            Some(pb::trigger_condition::Condition::MemoryAboveLimitPercent(
                60
            ))
        );
        let event = PolicyTrigger {
            memory: Some(MemoryTrigger {
                above_limit_percent: None,
                event: Some(MemoryEventName::OomKill),
            }),
            ..t
        };
        assert_eq!(
            proto_trigger(&event).condition,
            Some(pb::trigger_condition::Condition::MemoryEvent(
                pb::MemoryEventKind::OomKill.into()
            ))
        );
    }

    #[test]
    fn a_fire_becomes_a_run_of_that_pod_only_with_its_type() {
        let spec: SamplingPolicySpec = serde_json::from_value(serde_json::json!({
            "schedule": "@yearly",
            "template": {"type": "cpu", "selector": {"matchLabels": {"app": "web"}},
                         "duration": "30s", "cpu": {"frequencyHz": 49}},
            "triggers": [{"name": "near-limit", "memory": {"aboveLimitPercent": 60}}],
        }))
        .unwrap();
        let policy = Registered {
            kind: PolicyKind::Namespaced,
            name: "web".into(),
            namespace: Some("shop".into()),
            uid: "p-uid".into(),
            labels: BTreeMap::from([("team".into(), "a".into())]),
            scope: Scope::Namespace("shop".into()),
            spec,
        };
        let t = policy.spec.triggers[0].clone();
        let at = Timestamp::from_second(1_767_607_230).unwrap();
        let r = triggered_request(&policy, &t, "shop", "web-1", "pod-uid", at, Some("00ff"));
        assert_eq!(r.spec.profile_type, ProfileType::Heap);
        assert_eq!(r.spec.cpu, None);
        assert_eq!(r.spec.selector, None);
        assert_eq!(r.spec.pod_names, ["web-1"]);
        assert_eq!(r.spec.duration, "10s");
        assert_eq!(r.spec.ttl_seconds_after_finished, Some(86_400));
        let labels = r.labels();
        assert_eq!(labels[TRIGGER_LABEL], "near-limit");
        assert_eq!(labels[TRIGGER_POD_UID_LABEL], "pod-uid");
        assert_eq!(labels[POLICY_UID_LABEL], "p-uid");
        assert_eq!(labels["team"], "a");
        assert_eq!(r.annotations()[TRIGGER_FIRE_ANNOTATION], "00ff");
        let cpu = PolicyTrigger {
            capture: Some(serde_json::from_value(serde_json::json!({"type": "cpu"})).unwrap()),
            ..t.clone()
        };
        let r2 = triggered_request(&policy, &cpu, "shop", "web-1", "pod-uid", at, Some("00ff"));
        assert_eq!(
            r2.annotations()[TRIGGER_FIRE_ANNOTATION],
            "00ff",
            "a CPU run prepends the fire's lead-up"
        );
        let runqlat = PolicyTrigger {
            capture: Some(serde_json::from_value(serde_json::json!({"type": "runqlat"})).unwrap()),
            ..t.clone()
        };
        let r3 = triggered_request(
            &policy,
            &runqlat,
            "shop",
            "web-1",
            "pod-uid",
            at,
            Some("00ff"),
        );
        assert!(
            !r3.annotations().contains_key(TRIGGER_FIRE_ANNOTATION),
            "a runqlat run takes nothing the node read at the fire"
        );
        let owner = &r.owner_references()[0];
        assert_eq!(
            (owner.uid.as_str(), owner.controller),
            ("p-uid", Some(true))
        );
        let mut created = r.clone();
        created.metadata.creation_timestamp = Some(Time(at));
        let before = seconds_before(at, 10);
        assert!(recent_run(
            &created,
            "p-uid",
            "near-limit",
            Some("pod-uid"),
            before
        ));
        assert!(recent_run(&created, "p-uid", "near-limit", None, before));
        assert!(!recent_run(
            &created,
            "p-uid",
            "near-limit",
            Some("other"),
            before
        ));
        assert!(!recent_run(
            &created,
            "other-policy",
            "near-limit",
            None,
            before
        ));
        assert!(!recent_run(&created, "p-uid", "near-limit", None, at));
    }

    #[test]
    fn latency_triggers_capture_runqlat_over_their_window() {
        let t: PolicyTrigger = serde_json::from_value(serde_json::json!({
            "name": "slow-runq",
            "latency": {"runqlatP99Micros": 5000},
        }))
        .unwrap();
        assert_eq!(t.capture_type(), ProfileType::Runqlat);
        assert_eq!(
            proto_trigger(&t).condition,
            Some(pb::trigger_condition::Condition::RunqlatP99(
                pb::RunqlatP99 {
                    micros: 5000,
                    window_seconds: 10,
                }
            ))
        );
        let cpu: PolicyTrigger = serde_json::from_value(serde_json::json!({
            "name": "slow-runq-cpu",
            "latency": {"runqlatP99Micros": 5000, "windowSeconds": 30},
            "capture": {"type": "cpu"},
        }))
        .unwrap();
        assert_eq!(cpu.capture_type(), ProfileType::Cpu);
        assert_eq!(
            proto_trigger(&cpu).condition,
            Some(pb::trigger_condition::Condition::RunqlatP99(
                pb::RunqlatP99 {
                    micros: 5000,
                    window_seconds: 30,
                }
            ))
        );
    }
}
