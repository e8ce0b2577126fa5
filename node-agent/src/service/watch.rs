//! The `Watch` call: the operator's watch set of this node (policies' triggers on the pods
//! here) becomes targets of the node's trigger [`Watcher`], and what fires goes back on
//! the call's stream (docs/triggers.md).
//!
//! One watch set per node: a new call replaces the set whole and ends the previous call's
//! stream. Entries present in both sets stay watched as they were (their cooldowns and
//! armed notifications carry over), so the operator can resend the set on every change of
//! the fleet without resetting anything. When the current call's stream ends (the operator
//! hung up or lost the connection), the node stops watching until the next call: a set
//! never outlives the operator that sent it.
//!
//! Bounds: the watcher's own (cgroups watched, fires per minute, cooldown floor, a queue
//! that drops); the stream to the operator holds at most [`STREAM_QUEUE`] fires and drops
//! (and counts) beyond.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, UNIX_EPOCH};

use flamefleet_proto::agent::{
    HeapAtFire, LeadUpAtFire, MemoryEventKind, PressureResource, TriggerFired, WatchAck,
    WatchEvent, WatchRequest, trigger_condition, watch_event,
};
use futures::Stream;
use tonic::Status;

use crate::capture::{Samplers, TargetLabels};
use crate::cgroup::{Cgroup, CgroupRoot};
use crate::trigger::cpu_ring::{CpuRing, RingConfig};
use crate::trigger::files::Hierarchies;
use crate::trigger::fire_heaps::{FireHeap, FireHeaps};
use crate::trigger::fire_lead_ups::{FireLeadUps, LeadUp};
use crate::trigger::heap_now;
use crate::trigger::{
    Condition, Fire, MemoryEvent, PsiResource, TriggerSpec, WatchId, WatchTarget, Watcher,
    WatcherConfig,
};

/// Fires queued for the operator's stream before new ones are dropped.
pub const STREAM_QUEUE: usize = 64;
/// Most refusals listed in an acknowledgement.
const MAX_REFUSED: usize = 50;

/// What a watched entry fires for.
#[derive(Debug, Clone)]
struct Entry {
    id: Option<WatchId>,
    policy_uid: String,
    pod_uid: String,
    namespace: String,
    pod_name: String,
    container: String,
    /// The watched cgroup (a memory fire reads the heap of its processes).
    cgroup: Cgroup,
    /// Whether the lead-up ring keeps its samples (it has a CPU or pressure trigger).
    in_ring: bool,
}

/// What a memory fire reads at once, and where it keeps it for the fire's run.
#[derive(Debug, Clone)]
pub struct HeapAtFireReader {
    /// The node's samplers (the Go runtime heap source reads through them; latency
    /// triggers count run-queue waits with their runqlat sampler).
    pub samplers: Arc<Samplers>,
    /// Where the heaps are kept.
    pub spool: Arc<FireHeaps>,
}

/// What a CPU or pressure fire reads at once: the lead-up in the ring, kept for the fire's
/// CPU run.
#[derive(Debug, Clone)]
pub struct LeadUpAtFireReader {
    /// How the ring samples (started on the first watched CPU or pressure trigger).
    pub config: RingConfig,
    /// Where the lead-ups are kept.
    pub spool: Arc<FireLeadUps>,
}

/// The lead-up ring, started on first use.
#[derive(Default)]
struct Ring {
    ring: Option<Arc<CpuRing>>,
}

#[derive(Default)]
struct State {
    /// The current call's number (0: none yet).
    session: u64,
    /// Where fires go: the current call's stream.
    sender: Option<tokio::sync::mpsc::Sender<WatchEvent>>,
    /// Signature of a watched (policy, pod, container, triggers) → its entry; the watcher's
    /// key is the signature.
    entries: HashMap<String, Entry>,
}

/// The node's triggers: the watcher (started on the first non-empty set) and the current
/// watch set.
pub struct NodeWatch {
    root: CgroupRoot,
    hierarchies: Hierarchies,
    config: WatcherConfig,
    watcher: Mutex<Option<Arc<Watcher>>>,
    state: Arc<Mutex<State>>,
    heaps: Option<HeapAtFireReader>,
    lead_up: Option<LeadUpAtFireReader>,
    ring: Arc<Mutex<Ring>>,
    /// Fires sent to the operator.
    sent: Arc<AtomicU64>,
    /// Fires dropped: no stream, or its queue full.
    dropped: Arc<AtomicU64>,
}

impl std::fmt::Debug for NodeWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeWatch")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl NodeWatch {
    /// Watches pods' cgroups under `root` with `config`'s bounds. The v1 hierarchies of a
    /// hybrid host are found from the cgroup2 mount that holds `root`.
    pub fn new(root: CgroupRoot, config: WatcherConfig) -> Self {
        let mount = CgroupRoot::detect()
            .ok()
            .filter(|m| root.path().starts_with(m.path()))
            .unwrap_or_else(|| root.clone());
        Self {
            hierarchies: Hierarchies::detect(&mount),
            root,
            config,
            watcher: Mutex::new(None),
            state: Arc::default(),
            heaps: None,
            lead_up: None,
            ring: Arc::default(),
            sent: Arc::default(),
            dropped: Arc::default(),
        }
    }

    /// Memory fires read the Go heap of the cgroup that fired at once and keep it in
    /// `reader.spool` for the fire's run (docs/triggers.md, "Memory").
    #[must_use]
    pub fn with_heap_at_fire(mut self, reader: HeapAtFireReader) -> Self {
        self.heaps = Some(reader);
        self
    }

    /// CPU and pressure fires read the lead-up of the cgroup that fired from an in-kernel
    /// ring of recent CPU samples and keep it in `reader.spool` for the fire's CPU run
    /// (docs/triggers.md, "The lead-up").
    #[must_use]
    pub fn with_lead_up_at_fire(mut self, reader: LeadUpAtFireReader) -> Self {
        self.lead_up = Some(reader);
        self
    }

    /// The lead-up ring, started now if it is not yet.
    fn ring(&self, reader: &LeadUpAtFireReader) -> Result<Arc<CpuRing>, String> {
        let mut slot = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = slot.ring.as_ref() {
            return Ok(Arc::clone(r));
        }
        let config = RingConfig {
            max_cgroups: u32::try_from(self.config.max_watched).unwrap_or(u32::MAX),
            ..reader.config
        };
        let ring = Arc::new(CpuRing::start(config).map_err(|e| e.to_string())?);
        slot.ring = Some(Arc::clone(&ring));
        Ok(ring)
    }

    fn unring(&self, entries: &[Entry]) {
        let ring = self
            .ring
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ring
            .clone();
        if let Some(ring) = ring {
            for e in entries.iter().filter(|e| e.in_ring) {
                ring.unwatch(e.cgroup.id);
            }
        }
    }

    fn watcher(&self) -> Result<Arc<Watcher>, String> {
        let mut slot = self.watcher.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = slot.as_ref() {
            return Ok(Arc::clone(w));
        }
        let (watcher, fires) = Watcher::start_with_samplers(
            self.hierarchies.clone(),
            self.config.clone(),
            self.heaps.as_ref().map(|h| Arc::clone(&h.samplers)),
        )
        .map_err(|e| e.to_string())?;
        let state = Arc::clone(&self.state);
        let (sent, dropped) = (Arc::clone(&self.sent), Arc::clone(&self.dropped));
        let heaps = self.heaps.clone();
        let lead = self.lead_up.clone();
        let ring = Arc::clone(&self.ring);
        std::thread::Builder::new()
            .name("trigger-fires".into())
            .spawn(move || {
                // Ends when the watcher (the fires' sender) is dropped.
                for fire in fires {
                    let entry = state
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .entries
                        .get(&fire.target)
                        .cloned();
                    let fire_id = heaps
                        .as_ref()
                        .map(|h| h.spool.new_id())
                        .or_else(|| lead.as_ref().map(|l| l.spool.new_id()))
                        .unwrap_or_default();
                    // The heap first: the OOM killer does not wait for the report.
                    let heap = match (&heaps, &entry) {
                        (Some(reader), Some(entry)) if fire.condition.is_memory() => {
                            Some(read_heap(reader, entry, &fire, &fire_id))
                        }
                        _ => None,
                    };
                    let ring = ring
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .ring
                        .clone();
                    let lead_up = match (&lead, &entry, ring) {
                        (Some(reader), Some(entry), Some(ring))
                            if entry.in_ring && !fire.condition.is_memory() =>
                        {
                            Some(read_lead_up(reader, &ring, entry, &fire, &fire_id))
                        }
                        _ => None,
                    };
                    forward(&state, &fire, fire_id, heap, lead_up, &sent, &dropped);
                }
            })
            .map_err(|e| format!("spawning the fire forwarder: {e}"))?;
        let watcher = Arc::new(watcher);
        *slot = Some(Arc::clone(&watcher));
        Ok(watcher)
    }

    /// Replaces the watch set with `request` (blocking: the watcher opens files and arms
    /// notifications). Returns the call's number, its acknowledgement and where its fires
    /// arrive.
    pub fn replace(
        &self,
        request: &WatchRequest,
    ) -> (u64, WatchEvent, tokio::sync::mpsc::Receiver<WatchEvent>) {
        let mut refused = Vec::new();
        let mut wanted: BTreeMap<String, (WatchTarget, Entry)> = BTreeMap::new();
        for pod in &request.pods {
            let Some(target) = pod.target.as_ref() else {
                refused.push("a watched pod without a target".to_string());
                continue;
            };
            let name = format!("{}/{}", target.namespace, target.pod_name);
            if pod.policy_uid.trim().is_empty() || target.pod_uid.trim().is_empty() {
                refused.push(format!("{name}: empty policy or pod UID"));
                continue;
            }
            let mut triggers = Vec::new();
            for t in &pod.triggers {
                match trigger_spec(t, self.config.min_cooldown) {
                    Ok(spec) => triggers.push(spec),
                    Err(why) => refused.push(format!("{name}: trigger {}: {why}", t.name)),
                }
            }
            if triggers.is_empty() {
                continue;
            }
            let containers: Vec<(String, Option<String>)> = if target.containers.is_empty() {
                vec![(String::new(), None)]
            } else {
                target
                    .containers
                    .iter()
                    .map(|c| {
                        let id = c.container_id.trim();
                        (c.name.clone(), (!id.is_empty()).then(|| id.to_string()))
                    })
                    .collect()
            };
            for (container, id) in containers {
                if id.is_none() && !container.is_empty() {
                    refused.push(format!(
                        "{name}/{container}: no container ID (not started?)"
                    ));
                    continue;
                }
                let cgroup = match self.root.resolve_pod(&target.pod_uid, id.as_deref()) {
                    Ok(c) => c,
                    Err(e) => {
                        refused.push(format!("{name}/{container}: {e}"));
                        continue;
                    }
                };
                // The watcher's key (what its fires carry): the pod and container, and a hash
                // of everything that makes the entry, so an unchanged entry keeps its key.
                let signature = format!("{} {} {triggers:?}", pod.policy_uid, cgroup.id);
                let mut hasher = std::hash::DefaultHasher::new();
                std::hash::Hash::hash(&signature, &mut hasher);
                let key = format!(
                    "{name}/{container}#{:016x}",
                    std::hash::Hasher::finish(&hasher)
                );
                wanted.insert(
                    key.clone(),
                    (
                        WatchTarget {
                            key,
                            cgroup: cgroup.clone(),
                            triggers: triggers.clone(),
                        },
                        Entry {
                            id: None,
                            policy_uid: pod.policy_uid.clone(),
                            pod_uid: target.pod_uid.clone(),
                            namespace: target.namespace.clone(),
                            pod_name: target.pod_name.clone(),
                            container: container.clone(),
                            cgroup: cgroup.clone(),
                            in_ring: false,
                        },
                    ),
                );
            }
        }
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_QUEUE);
        // The previous set's entries that are not wanted any more.
        let (session, stale) = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.session += 1;
            state.sender = Some(tx);
            let stale: Vec<(String, Entry)> = state
                .entries
                .iter()
                .filter(|(k, _)| !wanted.contains_key(*k))
                .map(|(k, e)| (k.clone(), e.clone()))
                .collect();
            for (k, _) in &stale {
                state.entries.remove(k);
            }
            wanted.retain(|k, _| !state.entries.contains_key(k));
            (state.session, stale)
        };
        let watcher = if wanted.is_empty() && stale.is_empty() {
            self.watcher
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        } else {
            match self.watcher() {
                Ok(w) => Some(w),
                Err(e) => {
                    refused.push(format!("the trigger watcher cannot start: {e}"));
                    None
                }
            }
        };
        let stale_entries: Vec<Entry> = stale.iter().map(|(_, e)| e.clone()).collect();
        self.unring(&stale_entries);
        if let Some(watcher) = &watcher {
            for id in stale.iter().filter_map(|(_, e)| e.id) {
                watcher.unwatch(id);
            }
            for (key, (target, mut entry)) in wanted {
                let what = format!("{}/{}/{}", entry.namespace, entry.pod_name, entry.container);
                let wants_ring = target.triggers.iter().any(|t| !t.condition.is_memory());
                match watcher.watch(target) {
                    Ok(id) => {
                        entry.id = Some(id);
                        if let (true, Some(reader)) = (wants_ring, self.lead_up.as_ref()) {
                            match self
                                .ring(reader)
                                .and_then(|r| r.watch(entry.cgroup.id).map_err(|e| e.to_string()))
                            {
                                Ok(()) => entry.in_ring = true,
                                // The trigger still fires; its CPU run has no lead-up.
                                Err(e) => refused.push(format!(
                                    "{what}: watched without the lead-up of its CPU profiles: {e}"
                                )),
                            }
                        }
                        self.state
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .entries
                            .insert(key, entry);
                    }
                    Err(e) => refused.push(format!("{what}: {e}")),
                }
            }
        }
        let watched = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
            .len();
        refused.truncate(MAX_REFUSED);
        let ack = WatchEvent {
            event: Some(watch_event::Event::Ack(WatchAck {
                watched: u32::try_from(watched).unwrap_or(u32::MAX),
                refused,
            })),
        };
        (session, ack, rx)
    }

    /// Call `session`'s stream ended: when it is still the current one, watch nothing.
    pub fn end(&self, session: u64) {
        let stale: Vec<Entry> = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if state.session != session {
                return;
            }
            state.sender = None;
            state.entries.drain().map(|(_, e)| e).collect()
        };
        self.unring(&stale);
        if let Some(w) = self
            .watcher
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            for id in stale.into_iter().filter_map(|e| e.id) {
                w.unwatch(id);
            }
        }
    }

    /// The triggers' counters in the Prometheus text format (`/metrics`).
    pub fn render_metrics(&self) -> String {
        let stats = self
            .watcher
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|w| w.stats())
            .unwrap_or_default();
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
            out.push_str(&format!(
                "# HELP flamefleet_agent_trigger_{name} {help}\n# TYPE flamefleet_agent_trigger_{name} {kind}\nflamefleet_agent_trigger_{name} {value}\n"
            ));
        };
        metric(
            "watched_cgroups",
            "gauge",
            "Cgroups the trigger watcher watches.",
            stats.watched,
        );
        metric(
            "fires_total",
            "counter",
            "Triggers fired (after cooldowns and the node's fire budget).",
            stats.fires,
        );
        metric(
            "held_back_total",
            "counter",
            "Times a condition held inside its cooldown and did not fire.",
            stats.held_back,
        );
        metric(
            "refused_total",
            "counter",
            "Fires refused for the node's fire budget.",
            stats.refused,
        );
        metric(
            "sent_total",
            "counter",
            "Fires sent to the operator.",
            self.sent.load(Ordering::Relaxed),
        );
        metric(
            "dropped_total",
            "counter",
            "Fires dropped: the watcher's or the operator stream's queue was full, or no operator watched.",
            stats.dropped + self.dropped.load(Ordering::Relaxed),
        );
        metric(
            "wakeups_total",
            "counter",
            "Event-source wakeups of the watcher.",
            stats.wakeups,
        );
        metric(
            "notify_fallbacks_total",
            "counter",
            "Kernel notifications that could not be armed (a PSI trigger refused, a read-only v1 cgroup.event_control): read on the tick or polled instead.",
            stats.psi_fallbacks + stats.v1_notify_fallbacks,
        );
        out
    }
}

/// Reads the Go heap of the cgroup that fired and keeps it under `fire_id`.
fn read_heap(reader: &HeapAtFireReader, entry: &Entry, fire: &Fire, fire_id: &str) -> HeapAtFire {
    let labels = TargetLabels {
        namespace: entry.namespace.clone(),
        pod: entry.pod_name.clone(),
        container: entry.container.clone(),
    };
    let node = reader.samplers.config().node.clone();
    let result = heap_now::capture_go_heap(&reader.samplers, &entry.cgroup, labels, &node);
    let took = fire.at.elapsed().unwrap_or_default();
    let took_ms = u32::try_from(took.as_millis()).unwrap_or(u32::MAX);
    let kept = result.map_err(|e| e.to_string()).and_then(|now| {
        reader.spool.keep(
            fire_id,
            FireHeap {
                pod_uid: entry.pod_uid.clone(),
                fired_at: fire.at,
                took,
                heap: now.profile,
            },
        )
    });
    match kept {
        Ok(()) => {
            tracing::info!(%fire, fire_id, took_ms, "heap read at the fire, kept for its run");
            HeapAtFire {
                kept: true,
                took_ms,
                error: String::new(),
            }
        }
        Err(error) => {
            tracing::info!(%fire, fire_id, took_ms, %error, "no heap read at the fire");
            HeapAtFire {
                kept: false,
                took_ms,
                error,
            }
        }
    }
}

/// Reads the lead-up of the cgroup that fired from the ring and keeps it under `fire_id`.
fn read_lead_up(
    reader: &LeadUpAtFireReader,
    ring: &CpuRing,
    entry: &Entry,
    fire: &Fire,
    fire_id: &str,
) -> LeadUpAtFire {
    let config = ring.config();
    let snapshot = ring.snapshot(
        entry.cgroup.id,
        fire.at.elapsed().unwrap_or_default(),
        config.lookback,
    );
    let samples = u32::try_from(snapshot.samples.len()).unwrap_or(u32::MAX);
    let covered_ms = u32::try_from(snapshot.covered().as_millis()).unwrap_or(u32::MAX);
    let kept = reader.spool.keep(
        fire_id,
        LeadUp {
            pod_uid: entry.pod_uid.clone(),
            cgroup: entry.cgroup.path.clone(),
            fired_at: fire.at,
            frequency: config.frequency,
            lookback: config.lookback,
            snapshot,
        },
    );
    match kept {
        Ok(()) => {
            tracing::info!(%fire, fire_id, samples, covered_ms, "lead-up read at the fire, kept for its run");
            LeadUpAtFire {
                kept: true,
                samples,
                covered_ms,
                error: String::new(),
            }
        }
        Err(error) => {
            tracing::info!(%fire, fire_id, %error, "no lead-up kept at the fire");
            LeadUpAtFire {
                kept: false,
                samples,
                covered_ms,
                error,
            }
        }
    }
}

/// Sends `fire` to the current stream (never blocks the watcher's consumer).
fn forward(
    state: &Mutex<State>,
    fire: &Fire,
    fire_id: String,
    heap_at_fire: Option<HeapAtFire>,
    lead_up_at_fire: Option<LeadUpAtFire>,
    sent: &AtomicU64,
    dropped: &AtomicU64,
) {
    let state = state.lock().unwrap_or_else(PoisonError::into_inner);
    let (Some(entry), Some(sender)) = (state.entries.get(&fire.target), state.sender.as_ref())
    else {
        dropped.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%fire, "a trigger fired with no operator watching it; dropped");
        return;
    };
    let m = &fire.measurement;
    let event = WatchEvent {
        event: Some(watch_event::Event::Fired(TriggerFired {
            policy_uid: entry.policy_uid.clone(),
            pod_uid: entry.pod_uid.clone(),
            namespace: entry.namespace.clone(),
            pod_name: entry.pod_name.clone(),
            container: entry.container.clone(),
            trigger: fire.trigger.clone(),
            condition: fire.condition.to_string(),
            measured: m.value,
            threshold: m.threshold,
            unit: m.unit.to_string(),
            detail: m.detail.clone(),
            fired_at_unix_ms: fire
                .at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            fire_id,
            heap_at_fire,
            lead_up_at_fire,
        })),
    };
    tracing::info!(%fire, "trigger fired");
    if sender.try_send(event).is_ok() {
        sent.fetch_add(1, Ordering::Relaxed);
    } else {
        dropped.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("the operator's watch stream is full; a fire was dropped");
    }
}

/// The watcher's trigger of a proto trigger; the cooldown raised to the node's floor.
fn trigger_spec(
    t: &flamefleet_proto::agent::TriggerCondition,
    min_cooldown: Duration,
) -> Result<TriggerSpec, String> {
    use trigger_condition::Condition as C;
    let percent = |p: u32| -> Result<u8, String> {
        u8::try_from(p)
            .ok()
            .filter(|p| (1..=100).contains(p))
            .ok_or_else(|| format!("expected a percentage of 1 to 100, found {p}"))
    };
    let condition = match t.condition.as_ref() {
        None => return Err("no condition".into()),
        Some(C::MemoryAboveLimitPercent(p)) => Condition::MemoryAboveLimit {
            percent: percent(*p)?,
        },
        Some(C::MemoryEvent(e)) => Condition::MemoryEvent(
            match MemoryEventKind::try_from(*e).unwrap_or(MemoryEventKind::Unspecified) {
                MemoryEventKind::High => MemoryEvent::High,
                MemoryEventKind::Max => MemoryEvent::Max,
                MemoryEventKind::Oom => MemoryEvent::Oom,
                MemoryEventKind::OomKill => MemoryEvent::OomKill,
                MemoryEventKind::Unspecified => return Err("unknown memory event".into()),
            },
        ),
        Some(C::CpuThrottledPercent(p)) => Condition::CpuThrottled {
            percent: percent(*p)?,
        },
        Some(C::CpuAbove(c)) => Condition::CpuAbove {
            millicores: c.millicores,
            sustained: Duration::from_secs(u64::from(c.sustained_seconds.max(1))),
        },
        Some(C::Pressure(p)) => Condition::Pressure {
            resource: match PressureResource::try_from(p.resource)
                .unwrap_or(PressureResource::Unspecified)
            {
                PressureResource::Cpu => PsiResource::Cpu,
                PressureResource::Memory => PsiResource::Memory,
                PressureResource::Io => PsiResource::Io,
                PressureResource::Unspecified => {
                    return Err("unknown pressure resource".into());
                }
            },
            percent: percent(p.percent)?,
        },
        Some(C::RunqlatP99(r)) => Condition::RunqlatP99 {
            micros: Some(r.micros)
                .filter(|m| (1..=60_000_000).contains(m))
                .ok_or_else(|| {
                    format!(
                        "expected a runqlat p99 threshold of 1 to 60000000 µs, found {}",
                        r.micros
                    )
                })?,
            window: Duration::from_secs(u64::from(
                Some(r.window_seconds)
                    .filter(|w| (2..=300).contains(w))
                    .ok_or_else(|| {
                        format!(
                            "expected a runqlat window of 2 to 300 s, found {}",
                            r.window_seconds
                        )
                    })?,
            )),
        },
    };
    if t.name.is_empty() || t.name.len() > 63 {
        return Err("expected a name of 1 to 63 characters".into());
    }
    Ok(TriggerSpec {
        name: t.name.clone(),
        condition,
        cooldown: Duration::from_secs(u64::from(t.cooldown_seconds)).max(min_cooldown),
    })
}

/// The `Watch` stream: the acknowledgement, then the fires; ends the call's watch set when
/// dropped.
pub struct WatchStream {
    ack: Option<WatchEvent>,
    rx: tokio::sync::mpsc::Receiver<WatchEvent>,
    watch: Arc<NodeWatch>,
    session: u64,
}

impl WatchStream {
    /// The stream of call `session`.
    pub fn new(
        watch: Arc<NodeWatch>,
        session: u64,
        ack: WatchEvent,
        rx: tokio::sync::mpsc::Receiver<WatchEvent>,
    ) -> Self {
        Self {
            ack: Some(ack),
            rx,
            watch,
            session,
        }
    }
}

impl Stream for WatchStream {
    type Item = Result<WatchEvent, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        if let Some(ack) = self.ack.take() {
            return Poll::Ready(Some(Ok(ack)));
        }
        self.rx.poll_recv(cx).map(|e| e.map(Ok))
    }
}

impl Drop for WatchStream {
    fn drop(&mut self) {
        let (watch, session) = (Arc::clone(&self.watch), self.session);
        // Unwatching talks to the watcher's thread: off the runtime.
        std::thread::spawn(move || watch.end(session));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_proto::agent::{CpuAbove, TriggerCondition};

    #[test]
    fn proto_triggers_become_watcher_triggers_with_the_node_floor() {
        let floor = Duration::from_secs(60);
        let t = TriggerCondition {
            name: "near".into(),
            cooldown_seconds: 5,
            condition: Some(trigger_condition::Condition::MemoryAboveLimitPercent(90)),
        };
        let spec = trigger_spec(&t, floor).unwrap();
        assert_eq!(spec.condition, Condition::MemoryAboveLimit { percent: 90 });
        assert_eq!(spec.cooldown, floor);
        let bad = TriggerCondition {
            condition: Some(trigger_condition::Condition::CpuThrottledPercent(250)),
            ..t.clone()
        };
        assert!(trigger_spec(&bad, floor).unwrap_err().contains("1 to 100"));
        let none = TriggerCondition {
            condition: None,
            ..t.clone()
        };
        assert!(trigger_spec(&none, floor).is_err());
        let cpu = TriggerCondition {
            cooldown_seconds: 600,
            condition: Some(trigger_condition::Condition::CpuAbove(CpuAbove {
                millicores: 1500,
                sustained_seconds: 30,
            })),
            ..t.clone()
        };
        let spec = trigger_spec(&cpu, floor).unwrap();
        assert_eq!(spec.cooldown, Duration::from_secs(600));
        assert_eq!(
            spec.condition,
            Condition::CpuAbove {
                millicores: 1500,
                sustained: Duration::from_secs(30)
            }
        );
        let latency = |micros, window_seconds| TriggerCondition {
            condition: Some(trigger_condition::Condition::RunqlatP99(
                flamefleet_proto::agent::RunqlatP99 {
                    micros,
                    window_seconds,
                },
            )),
            ..t.clone()
        };
        assert_eq!(
            trigger_spec(&latency(20_000, 10), floor).unwrap().condition,
            Condition::RunqlatP99 {
                micros: 20_000,
                window: Duration::from_secs(10)
            }
        );
        assert!(
            trigger_spec(&latency(0, 10), floor)
                .unwrap_err()
                .contains("1 to 60000000 µs")
        );
        assert!(
            trigger_spec(&latency(20_000, 3600), floor)
                .unwrap_err()
                .contains("2 to 300 s")
        );
    }
}
