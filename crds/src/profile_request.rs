//! `ProfileRequest`: one capture of one profile type for selected pods of one namespace.

// Each `printcolumn(...)` repeats the same keys, which clippy mistakes for duplicates.
#![allow(clippy::duplicated_attributes)]

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::duration::{DURATION_PATTERN, parse_capture_duration};
use crate::phase::{NodePhase, RequestPhase};

/// Default sampling frequency of a CPU profile, in Hz (off the 100 Hz tick to avoid lockstep).
pub const DEFAULT_FREQUENCY_HZ: i32 = 99;
/// Default path of a pod's heap-profile endpoint (Go's net/http/pprof).
pub const DEFAULT_HEAP_PATH: &str = "/debug/pprof/heap";
/// Lowest `cpu.frequencyHz` the schema accepts.
pub const MIN_FREQUENCY_HZ: i32 = 1;
/// Highest `cpu.frequencyHz` the schema accepts.
pub const MAX_FREQUENCY_HZ: i32 = 1000;
/// Lowest `heap.sampleBytes` the schema accepts.
pub const MIN_SAMPLE_BYTES: i64 = 1;
/// Highest `heap.sampleBytes` the schema accepts (1 GiB).
pub const MAX_SAMPLE_BYTES: i64 = 1 << 30;
/// The CEL rule bounding `duration`. It judges only what matches [`DURATION_PATTERN`]: the
/// pattern already refuses anything else with its own message, and CEL's `duration()` would
/// add a second, confusing one (a type conversion error) for the same value.
pub const CAPTURE_DURATION_RULE: &str = r"!self.matches(r'^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$') || (duration(self) >= duration('1s') && duration(self) <= duration('10m'))";
/// Lowest `offcpu.minBlockMicros` the schema accepts.
pub const MIN_BLOCK_MICROS: i32 = 1;
/// Highest `offcpu.minBlockMicros` the schema accepts (10 s).
pub const MAX_BLOCK_MICROS: i32 = 10_000_000;
/// Most kernel functions `status.summary.offcpu.topBlocking` lists.
pub const MAX_TOP_BLOCKING: usize = 5;
/// Most `podNames` of one request.
pub const MAX_POD_NAMES: usize = 256;

/// What a user asks for: profile `type` for the pods picked by `selector` and/or `podNames`,
/// for `duration`. The spec is immutable once created.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "flamefleet.dev",
    version = "v1alpha1",
    kind = "ProfileRequest",
    namespaced,
    shortname = "preq",
    category = "flamefleet",
    status = "ProfileRequestStatus",
    derive = "PartialEq",
    doc = "A request to capture a CPU profile, a heap profile, an off-CPU profile or a run-queue latency histogram of selected pods",
    printcolumn(name = "Type", type_ = "string", json_path = ".spec.type"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Pods", type_ = "integer", json_path = ".status.podCount"),
    printcolumn(name = "Nodes", type_ = "integer", json_path = ".status.nodeCount"),
    printcolumn(name = "Succeeded", type_ = "integer", json_path = ".status.nodeCounts.succeeded"),
    printcolumn(name = "Failed", type_ = "integer", json_path = ".status.nodeCounts.failed"),
    printcolumn(name = "Reason", type_ = "string", json_path = ".status.reason"),
    printcolumn(name = "Duration", type_ = "string", json_path = ".spec.duration"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.spec == oldSelf.spec").message("spec is immutable: delete the ProfileRequest and create a new one")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.selector) || (has(self.podNames) && size(self.podNames) > 0)").message("either selector or podNames must be set"),
    validation = Rule::new("!has(self.cpu) || self.type == 'cpu' || (self.type == 'offcpu' && has(self.offcpu) && has(self.offcpu.withOnCpu) && self.offcpu.withOnCpu)").message("cpu options are only allowed when type is cpu, or offcpu with offcpu.withOnCpu (the on-CPU samples' frequency)"),
    validation = Rule::new("!has(self.heap) || self.type == 'heap'").message("heap options are only allowed when type is heap"),
    validation = Rule::new("!has(self.runqlat) || self.type == 'runqlat'").message("runqlat options are only allowed when type is runqlat"),
    validation = Rule::new("!has(self.offcpu) || self.type == 'offcpu'").message("offcpu options are only allowed when type is offcpu")
)]
pub struct ProfileRequestSpec {
    /// The profile to capture: cpu, heap, runqlat or offcpu.
    #[serde(rename = "type")]
    pub profile_type: ProfileType,
    /// Pods of the request's namespace to profile, by label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    /// Pods of the request's namespace to profile, by name (added to those of `selector`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_POD_NAMES), inner(length(min = 1, max = 253)))]
    pub pod_names: Vec<String>,
    /// How long to capture, e.g. `30s`, `2m`, `1m30s`; at least 1s, at most 10m.
    #[schemars(length(max = 32), pattern(DURATION_PATTERN))]
    #[x_kube(validation = Rule::new(CAPTURE_DURATION_RULE).message("duration must be at least 1s and at most 10m"))]
    pub duration: String,
    /// Options of a cpu profile; only with `type: cpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuOptions>,
    /// Options of a heap profile; only with `type: heap`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap: Option<HeapOptions>,
    /// Options of a runqlat histogram; only with `type: runqlat`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runqlat: Option<RunqlatOptions>,
    /// Options of an off-CPU profile; only with `type: offcpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offcpu: Option<OffcpuOptions>,
    /// Delete the request this many seconds after it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i64>,
    /// Also send this capture's profiles to the cluster's OpenTelemetry export sink, when
    /// the cluster admin configured one (default true). `false` keeps them in Flamefleet's
    /// store only; a policy's `template.export: false` opts all its runs out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<bool>,
}

impl ProfileRequestSpec {
    /// The capture duration, parsed and checked against the 1s..=10m bounds.
    ///
    /// # Errors
    /// When `duration` is malformed or out of bounds (the API server rejects both, so this
    /// only fails for specs that did not come through it).
    pub fn capture_duration(&self) -> crate::Result<Duration> {
        parse_capture_duration(&self.duration)
    }

    /// The cpu sampling frequency: `cpu.frequencyHz` or the 99 Hz default.
    pub fn frequency_hz(&self) -> i32 {
        self.cpu
            .as_ref()
            .map_or(DEFAULT_FREQUENCY_HZ, |cpu| cpu.frequency_hz)
    }

    /// The heap options, defaults filled in when absent.
    pub fn heap_options(&self) -> HeapOptions {
        self.heap.clone().unwrap_or_default()
    }

    /// The runqlat options, defaults filled in when absent.
    pub fn runqlat_options(&self) -> RunqlatOptions {
        self.runqlat.clone().unwrap_or_default()
    }

    /// The off-CPU options, defaults filled in when absent.
    pub fn offcpu_options(&self) -> OffcpuOptions {
        self.offcpu.clone().unwrap_or_default()
    }
}

/// The kind of profile to capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProfileType {
    /// On-CPU stacks sampled by perf events.
    Cpu,
    /// Heap allocations, from the pod's pprof endpoint or eBPF uprobes.
    Heap,
    /// Run-queue latency histogram from scheduler tracepoints.
    Runqlat,
    /// Where threads block (off CPU, not runnable), by stack, from `sched_switch`.
    Offcpu,
}

impl ProfileType {
    /// The wire name (`cpu`, `heap`, `runqlat`, `offcpu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Heap => "heap",
            Self::Runqlat => "runqlat",
            Self::Offcpu => "offcpu",
        }
    }
}

impl std::fmt::Display for ProfileType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Options of a cpu profile.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuOptions {
    /// Samples per second per CPU, 1 to 1000.
    #[serde(default = "default_frequency_hz")]
    #[schemars(range(min = MIN_FREQUENCY_HZ, max = MAX_FREQUENCY_HZ))]
    pub frequency_hz: i32,
}

impl Default for CpuOptions {
    fn default() -> Self {
        Self {
            frequency_hz: DEFAULT_FREQUENCY_HZ,
        }
    }
}

fn default_frequency_hz() -> i32 {
    DEFAULT_FREQUENCY_HZ
}

/// Options of a heap profile.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeapOptions {
    /// Where the heap profile comes from.
    #[serde(default)]
    pub source: HeapSource,
    /// The pod's pprof endpoint; found from pod annotations when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<HeapEndpoint>,
    /// Mean bytes allocated between two samples of the eBPF allocator sampler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = MIN_SAMPLE_BYTES, max = MAX_SAMPLE_BYTES))]
    pub sample_bytes: Option<i64>,
    /// eBPF: refuse the capture when a short first window projects more
    /// uprobe overhead than this percent of the targets' CPU time (default 3;
    /// 0 turns the guard off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100))]
    pub max_overhead_percent: Option<i32>,
}

/// Where a heap profile comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum HeapSource {
    /// The endpoint when the pod declares one; else, per process, the Go
    /// runtime's own heap profile for Go programs and eBPF for the others.
    #[default]
    Auto,
    /// The pod's own pprof endpoint.
    Endpoint,
    /// eBPF uprobes on the allocator.
    Ebpf,
    /// The heap profile Go programs keep in their own memory, read by the
    /// agent without an endpoint or a code change (Go processes only).
    Goruntime,
}

/// A pod's heap-profile HTTP endpoint.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeapEndpoint {
    /// Container port serving the profile.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// HTTP path of the profile.
    #[serde(default = "default_heap_path")]
    #[schemars(length(min = 1, max = 1024), pattern(r"^/"))]
    pub path: String,
}

fn default_heap_path() -> String {
    DEFAULT_HEAP_PATH.to_string()
}

/// Options of a runqlat histogram.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunqlatOptions {
    /// One histogram per process instead of one per target container.
    #[serde(default)]
    pub per_process: bool,
    /// Unit of the histogram buckets.
    #[serde(default)]
    pub unit: RunqlatUnit,
}

/// Options of an off-CPU profile (docs/offcpu.md).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OffcpuOptions {
    /// Blocks shorter than this many microseconds are counted and timed, never attributed
    /// to a stack (default 1000: 1 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = MIN_BLOCK_MICROS, max = MAX_BLOCK_MICROS))]
    pub min_block_micros: Option<i32>,
    /// Refuse the capture when a short first window projects more overhead (the targets'
    /// blocks times the cost of walking their stacks) than this percent of the targets'
    /// CPU time (default 3; 0 turns the guard off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100))]
    pub max_overhead_percent: Option<i32>,
    /// The wall-clock view: the targets' on-CPU samples too (at `cpu.frequencyHz`), in the
    /// same profile, whose default sample type is then `wall/nanoseconds` (on-CPU plus
    /// off-CPU time per stack; run-queue waits stay out). Default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub with_on_cpu: Option<bool>,
}

/// Unit of runqlat histogram buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RunqlatUnit {
    /// Microseconds.
    #[default]
    Us,
    /// Milliseconds.
    Ms,
}

/// Most entries of `status.failures`.
pub const MAX_STATUS_FAILURES: usize = 20;

/// What happened to a ProfileRequest. Written only through the status subresource, only by
/// the operator (field manager `flamefleet-operator`).
///
/// Bounded whatever the number of nodes: the per-node results live in the request's
/// `ProfileResultSlice`s (label `flamefleet.dev/request-uid=<uid>`, see
/// [`crate::result_slice`]); the status holds counts, at most 20 failures and the summary.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProfileRequestStatus {
    /// Overall phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<RequestPhase>,
    /// Standard conditions, one per type.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` the status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// When the operator started the capture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// Why the request did not fully succeed (the REASON column), set with a terminal phase
    /// other than Succeeded: the request's own reason when it failed as a whole (e.g.
    /// `NoPodsMatched`), else its nodes' commonest failure reason (e.g. `TimedOut`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub reason: Option<String>,
    /// When the request reached a terminal phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Number of pods targeted (the PODS column).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_count: Option<i32>,
    /// Number of nodes targeted (the NODES column).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_count: Option<i32>,
    /// The targeted nodes by phase of their capture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_counts: Option<NodeCounts>,
    /// Number of `ProfileResultSlice`s holding the per-node results.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub result_slices: Option<i32>,
    /// Failed nodes and why: the first 20 in node-name order; `failuresOmitted` counts the
    /// others (every failure is in the result slices).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["node".into()]))]
    pub failures: Vec<NodeFailureEntry>,
    /// Failed nodes left out of `failures`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub failures_omitted: Option<i32>,
    /// Results summed over nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<ProfileSummary>,
    /// The trigger that fired this run (runs of a policy's `triggers` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<crate::trigger::TriggerFire>,
}

/// Nodes by the phase of their capture.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeCounts {
    /// Every node.
    #[serde(default)]
    pub total: i32,
    /// Nodes whose agent has not reported yet (dispatched or about to be).
    #[serde(default)]
    pub pending: i32,
    /// Nodes an agent reported as capturing.
    #[serde(default)]
    pub running: i32,
    /// Nodes whose artifacts were uploaded and verified.
    #[serde(default)]
    pub succeeded: i32,
    /// Nodes whose capture failed.
    #[serde(default)]
    pub failed: i32,
}

/// One failed node, in the request's status.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeFailureEntry {
    /// Node name (the list-map key).
    pub node: String,
    /// A short machine-readable reason, e.g. `AgentUnreachable`, `TimedOut`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// What happened (at most 1 KiB; the node's slice entry has the whole message).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// One node's share of a request: its pods, its phase and the artifacts its agent uploaded.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// Node name (the list-map key).
    #[schemars(length(min = 1, max = 253))]
    pub node: String,
    /// Phase of this node's capture; absent means Pending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<NodePhase>,
    /// Names of the targeted pods on this node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
    /// A short machine-readable reason of a failure, e.g. `AgentUnreachable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Human-readable detail, e.g. why the capture failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Uploaded artifacts, keyed by `name`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub artifacts: Vec<Artifact>,
}

/// One uploaded profile file.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Artifact {
    /// File name, e.g. `cpu-worker-1.pb.gz`.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Where to download it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub size_bytes: Option<i64>,
    /// Hex sha256 of the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^[0-9a-f]{64}$"))]
    pub sha256: Option<String>,
    /// Number of samples in the profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub samples: Option<i64>,
    /// pprof sample type, e.g. `cpu/nanoseconds`, `inuse_space/bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_type: Option<String>,
}

/// Results over all nodes. Each field means one thing per profile type; docs/capture.md
/// ("Capture summary") has the table.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProfileSummary {
    /// What the profiles counted, summed over nodes: CPU samples taken in the targets
    /// (cpu), run-queue waits measured (runqlat), allocations the heap profiles account
    /// for, i.e. their `alloc_objects` total (heap; `inuse_objects` where a profile has
    /// no alloc types).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<i64>,
    /// Number of artifacts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifacts: Option<i32>,
    /// Sampling frequency (cpu only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuSummary>,
    /// Run-queue latency percentiles (runqlat only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runqlat: Option<LatencySummary>,
    /// Time blocked and where (offcpu only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offcpu: Option<OffcpuSummary>,
    /// What a reader of the figures must know about how nodes measured them, each once:
    /// an unstable scheduler clock (runqlat, offcpu), kernel frames left unnamed and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_SUMMARY_NOTES))]
    pub notes: Vec<String>,
}

/// Most entries of `status.summary.notes`.
pub const MAX_SUMMARY_NOTES: usize = 5;

/// What the targets' threads waited for, over all nodes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OffcpuSummary {
    /// Time the threads spent blocked (off CPU, not runnable), milliseconds.
    pub off_cpu_millis: i64,
    /// Time the woken threads then waited for a CPU (run-queue time, not counted as
    /// off-CPU), milliseconds.
    pub runnable_millis: i64,
    /// Blocks counted.
    pub blocks: i64,
    /// With `offcpu.withOnCpu`: the threads' on-CPU time (CPU samples times the sampling
    /// period), milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_cpu_millis: Option<i64>,
    /// The kernel functions the threads blocked in, most blocked time first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_TOP_BLOCKING))]
    pub top_blocking: Vec<BlockingFunction>,
}

/// A kernel function threads blocked in, and for how long over all nodes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BlockingFunction {
    /// The kernel function (the first frame below the scheduler's).
    #[schemars(length(max = 256))]
    pub function: String,
    /// Time blocked in it, milliseconds.
    pub millis: i64,
}

/// The frequency CPU samples were really taken at.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuSummary {
    /// Effective frequency in Hz: a capture that joins a node's running sampler gets that
    /// sampler's frequency. The lowest over nodes when they differ.
    pub frequency_hz: i64,
    /// The frequency the request asked for, present only when some node sampled at
    /// another one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_frequency_hz: Option<i64>,
    /// Why the frequencies differ, present only when they do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Latency percentiles in microseconds, over all waits of all nodes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LatencySummary {
    /// Number of run-queue waits measured.
    pub events: i64,
    /// Median, microseconds.
    pub p50_us: i64,
    /// 90th percentile, microseconds.
    pub p90_us: i64,
    /// 99th percentile, microseconds.
    pub p99_us: i64,
    /// Upper bound of the highest non-empty log2 bucket, microseconds: no wait was longer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_us: Option<i64>,
    /// True when the percentiles come from the nodes' histograms merged bucket by bucket
    /// (exact up to the log2 buckets); false when some node reported no histogram (or
    /// another unit) and the percentiles are the worst node's, an upper bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_from(json: serde_json::Value) -> ProfileRequestSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn the_duration_rule_judges_only_what_the_pattern_admits() {
        let guard = format!("!self.matches(r'{}')", crate::duration::DURATION_PATTERN);
        assert!(
            CAPTURE_DURATION_RULE.starts_with(&guard),
            "{CAPTURE_DURATION_RULE}"
        );
    }

    #[test]
    fn defaults_and_accessors() {
        let spec = spec_from(serde_json::json!({
            "type": "cpu", "podNames": ["a"], "duration": "1m30s", "cpu": {}
        }));
        assert_eq!(spec.frequency_hz(), 99);
        assert_eq!(spec.capture_duration().unwrap(), Duration::from_secs(90));
        let heap = spec_from(serde_json::json!({
            "type": "heap", "podNames": ["a"], "duration": "5s",
            "heap": {"source": "endpoint", "endpoint": {"port": 6060}}
        }));
        let opts = heap.heap_options();
        assert_eq!(opts.source, HeapSource::Endpoint);
        assert_eq!(opts.endpoint.unwrap().path, DEFAULT_HEAP_PATH);
        assert_eq!(heap.runqlat_options().unit, RunqlatUnit::Us);
    }

    #[test]
    fn optional_fields_are_not_serialized_so_apply_never_claims_them() {
        let status = ProfileRequestStatus {
            phase: Some(RequestPhase::Running),
            failures: vec![NodeFailureEntry {
                node: "n1".into(),
                reason: "TimedOut".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&status).unwrap(),
            serde_json::json!({"phase": "Running", "failures": [{"node": "n1", "reason": "TimedOut"}]})
        );
    }

    #[test]
    fn node_counts_add_and_remove() {
        let mut counts = NodeCounts::default();
        counts.add(None, 2);
        counts.add(Some(NodePhase::Failed), 1);
        counts.add(None, -1);
        counts.add(Some(NodePhase::Succeeded), 1);
        assert_eq!(
            counts,
            NodeCounts {
                total: 3,
                pending: 1,
                running: 0,
                succeeded: 1,
                failed: 1
            }
        );
        assert_eq!(counts.unfinished(), 1);
    }
}
