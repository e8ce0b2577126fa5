//! Triggers of the sampling policies: capture a selected pod when a condition of its own
//! cgroup holds (memory near its limit, CPU throttled, pressure, run-queue latency), watched
//! on the node by the agent (docs/triggers.md). A fire becomes an ordinary ProfileRequest owned by the policy,
//! for that pod only, whose `status.trigger` says which trigger fired at what value.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ProfileType;
use crate::duration::DURATION_PATTERN;
use crate::profile_request::CAPTURE_DURATION_RULE;

/// Most triggers of one policy.
pub const MAX_TRIGGERS: usize = 8;
/// Default `cooldownSeconds` (per pod).
pub const DEFAULT_COOLDOWN_SECONDS: i64 = 600;
/// Least `cooldownSeconds` the schema accepts (the agents' floor, `--min-trigger-cooldown`).
pub const MIN_COOLDOWN_SECONDS: i64 = 60;
/// Default `policyCooldownSeconds` (all the policy's pods together).
pub const DEFAULT_POLICY_COOLDOWN_SECONDS: i64 = 60;
/// Default capture duration of a fire.
pub const DEFAULT_TRIGGER_DURATION: &str = "10s";
/// Label of a triggered run: the trigger's name.
pub const TRIGGER_LABEL: &str = "flamefleet.dev/trigger";
/// Label of a triggered run: the UID of the pod it captures.
pub const TRIGGER_POD_UID_LABEL: &str = "flamefleet.dev/trigger-pod-uid";
/// Annotation of a triggered heap run: the node's id of the fire whose heap, read on the
/// node at the fire, the run takes as its artifact (docs/triggers.md, "Memory").
pub const TRIGGER_FIRE_ANNOTATION: &str = "flamefleet.dev/trigger-fire-id";

/// The name of the run a fire of `trigger` on pod `pod_uid` creates at `second` (Unix
/// seconds, the fire's `status.trigger.firedAt`): the policy, the fire's second, and a hash
/// of the pod and trigger (a DNS label of at most 63 characters).
pub fn trigger_run_name(policy: &str, trigger: &str, pod_uid: &str, second: i64) -> String {
    use sha2::{Digest, Sha256};
    let cleaned: String = policy
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .take(32)
        .collect();
    let cleaned = cleaned.trim_matches('-');
    let prefix = if cleaned.is_empty() { "run" } else { cleaned };
    let hash = hex::encode(&Sha256::digest(format!("{pod_uid}/{trigger}").as_bytes())[..4]);
    format!("{prefix}-t{second}-{hash}")
}

/// Least `latency.windowSeconds`.
pub const MIN_LATENCY_WINDOW_SECONDS: i32 = 2;
/// Most `latency.windowSeconds`.
pub const MAX_LATENCY_WINDOW_SECONDS: i32 = 300;
/// Default `latency.windowSeconds`.
pub const DEFAULT_LATENCY_WINDOW_SECONDS: i32 = 10;

/// One trigger: exactly one condition (`memory`, `cpu`, `pressure` or `latency`), what it
/// captures and how often it may fire.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("[has(self.memory), has(self.cpu), has(self.pressure), has(self.latency)].filter(x, x).size() == 1").message("a trigger has exactly one condition: memory, cpu, pressure or latency"),
    validation = Rule::new("!has(self.policyCooldownSeconds) || !has(self.cooldownSeconds) || self.policyCooldownSeconds <= self.cooldownSeconds").message("policyCooldownSeconds must not exceed cooldownSeconds")
)]
pub struct PolicyTrigger {
    /// The trigger's name, unique in the policy (a DNS label).
    #[schemars(length(min = 1, max = 40), pattern(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
    /// A memory condition of a container's cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryTrigger>,
    /// A CPU condition of a container's cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuTrigger>,
    /// A pressure (PSI) condition of a container's cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pressure: Option<PressureTrigger>,
    /// A run-queue latency condition of a container's tasks (runqlat, measured in BPF).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<LatencyTrigger>,
    /// What a fire captures (default: a heap profile for memory triggers, a runqlat profile
    /// for latency ones, a CPU profile for cpu and pressure ones, for 10s, with the
    /// template's options of that type).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<TriggerCapture>,
    /// Least time between two fires of this trigger on one pod (default 600, at least 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = MIN_COOLDOWN_SECONDS, max = 604_800))]
    pub cooldown_seconds: Option<i64>,
    /// Least time between two fires of this trigger on any of the policy's pods (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 604_800))]
    pub policy_cooldown_seconds: Option<i64>,
}

/// A memory condition: one of `aboveLimitPercent` or `event`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.aboveLimitPercent) != has(self.event)").message("a memory trigger has exactly one of aboveLimitPercent and event")
)]
pub struct MemoryTrigger {
    /// Fires when the container's memory usage reaches this percent of its limit (a
    /// container without a limit never fires).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub above_limit_percent: Option<i32>,
    /// Fires on an increment of this `memory.events` counter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<MemoryEventName>,
}

/// A `memory.events` counter.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum MemoryEventName {
    /// Usage went over `memory.high`.
    High,
    /// Usage hit the limit and the kernel reclaimed.
    Max,
    /// The cgroup ran out of memory.
    Oom,
    /// The OOM killer killed a process of the cgroup.
    OomKill,
}

/// A CPU condition: one of `throttledPercent` or `aboveMillicores`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.throttledPercent) != has(self.aboveMillicores)").message("a cpu trigger has exactly one of throttledPercent and aboveMillicores"),
    validation = Rule::new("!has(self.forSeconds) || has(self.aboveMillicores)").message("forSeconds goes with aboveMillicores")
)]
pub struct CpuTrigger {
    /// Fires when at least this percent of the CFS periods of a second were throttled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub throttled_percent: Option<i32>,
    /// Fires when usage stays above this many millicores for `forSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub above_millicores: Option<i32>,
    /// How long usage must stay above `aboveMillicores` (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub for_seconds: Option<i32>,
}

/// A pressure condition: `some avg10` of a resource above a percent.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PressureTrigger {
    /// `cpu`, `memory` or `io`.
    pub resource: PressureResource,
    /// Fires when tasks stalled on the resource at least this percent of 10 s.
    #[schemars(range(min = 1, max = 100))]
    pub some_avg10_percent: i32,
}

/// A PSI resource.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum PressureResource {
    /// `cpu.pressure`.
    Cpu,
    /// `memory.pressure`.
    Memory,
    /// `io.pressure`.
    Io,
}

/// A run-queue latency condition: the 99th percentile of the time the container's tasks
/// waited to run (runnable, not running: CPU contention and CFS throttling) above a
/// threshold over a sliding window.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LatencyTrigger {
    /// Fires when the p99 of the run-queue waits of the window is above this many
    /// microseconds (the waits are counted in log2 buckets; the p99 is interpolated inside
    /// its bucket, as a runqlat profile's `status.latency` is).
    #[schemars(range(min = 1, max = 60_000_000))]
    pub runqlat_p99_micros: i64,
    /// The window the p99 is taken over, seconds (default 10, 2 to 300). At least 50 waits
    /// must fall in it: fewer are not judged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = MIN_LATENCY_WINDOW_SECONDS, max = MAX_LATENCY_WINDOW_SECONDS))]
    pub window_seconds: Option<i32>,
}

impl LatencyTrigger {
    /// The window, seconds.
    pub fn window_seconds(&self) -> i32 {
        self.window_seconds
            .unwrap_or(DEFAULT_LATENCY_WINDOW_SECONDS)
            .clamp(MIN_LATENCY_WINDOW_SECONDS, MAX_LATENCY_WINDOW_SECONDS)
    }
}

/// What a fire captures.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TriggerCapture {
    /// The profile type (default: heap for memory triggers, runqlat for latency ones, cpu
    /// otherwise).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub profile_type: Option<ProfileType>,
    /// How long to capture (default 10s; at least 1s, at most 10m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), pattern(DURATION_PATTERN))]
    #[x_kube(validation = Rule::new(CAPTURE_DURATION_RULE).message("duration must be at least 1s and at most 10m"))]
    pub duration: Option<String>,
}

impl PolicyTrigger {
    /// Whether its condition is about memory (a fire captures the heap by default).
    pub fn is_memory(&self) -> bool {
        self.memory.is_some()
            || self
                .pressure
                .as_ref()
                .is_some_and(|p| p.resource == PressureResource::Memory)
    }

    /// The profile type a fire captures.
    pub fn capture_type(&self) -> ProfileType {
        self.capture
            .as_ref()
            .and_then(|c| c.profile_type)
            .unwrap_or(if self.is_memory() {
                ProfileType::Heap
            } else if self.latency.is_some() {
                ProfileType::Runqlat
            } else {
                ProfileType::Cpu
            })
    }

    /// The capture duration of a fire, as the ProfileRequest spells it.
    pub fn capture_duration(&self) -> String {
        self.capture
            .as_ref()
            .and_then(|c| c.duration.clone())
            .unwrap_or_else(|| DEFAULT_TRIGGER_DURATION.to_string())
    }

    /// The per-pod cooldown, seconds (at least [`MIN_COOLDOWN_SECONDS`]).
    pub fn cooldown_seconds(&self) -> i64 {
        self.cooldown_seconds
            .unwrap_or(DEFAULT_COOLDOWN_SECONDS)
            .max(MIN_COOLDOWN_SECONDS)
    }

    /// The per-policy cooldown, seconds.
    pub fn policy_cooldown_seconds(&self) -> i64 {
        self.policy_cooldown_seconds
            .unwrap_or(DEFAULT_POLICY_COOLDOWN_SECONDS)
            .clamp(1, self.cooldown_seconds())
    }
}

/// What fired a triggered run, in its `status.trigger` (written by the operator only).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TriggerFire {
    /// The trigger's name in the policy.
    pub name: String,
    /// The condition, in words, e.g. `memory above 60% of limit`.
    pub condition: String,
    /// The measured value, in `unit`, as text (e.g. `61.3`).
    pub measured: String,
    /// The threshold it crossed, in `unit`.
    pub threshold: String,
    /// `%`, `m` (millicores), `events` or `µs`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unit: String,
    /// The raw numbers behind the value, e.g. `memory.current 190 MiB of memory.max 256 MiB`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// The pod.
    pub pod: String,
    /// The container whose cgroup fired.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub container: String,
    /// The node whose agent saw it.
    pub node: String,
    /// When the agent saw it.
    pub fired_at: Time,
    /// `name: condition (measured X, threshold Y)`: the REASON column.
    pub reason: String,
    /// A memory fire: the Go heap its node read at once, before reporting it (e.g. `read
    /// 23 ms after the fire; this run's artifact`), or why not.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub heap_at_fire: String,
}

/// What one trigger of a policy has done, in the policy's `status.triggers`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TriggerStatus {
    /// The trigger's name.
    pub name: String,
    /// Pods whose cgroups the agents watch for it now.
    #[serde(default)]
    pub watched_pods: i64,
    /// Fires that became a run.
    #[serde(default)]
    pub fires: i64,
    /// Fires turned down (cooldown, budget, tenant limits), summed.
    #[serde(default)]
    pub skipped: i64,
    /// Why the last fire turned down was.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_skip_reason: String,
    /// When the last run was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_fire_time: Option<Time>,
    /// The last run created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_run: Option<crate::RunReference>,
    /// Pods or containers the agents could not watch, and why (at most 10).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<String>,
}
