//! `SamplingPolicy` and `ClusterSamplingPolicy`: scheduled captures of a sampled subset of a
//! fleet. Each run is an ordinary ProfileRequest owned by its policy, as a CronJob owns Jobs.

// Each `printcolumn(...)` repeats the same keys, which clippy mistakes for duplicates.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::profile_request::ProfileRequestSpec;
use crate::trigger::{MAX_TRIGGERS, PolicyTrigger, TriggerStatus};

/// The regular expression the schema enforces on `schedule` (see [`schedule_pattern`]).
pub static SCHEDULE_PATTERN: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(schedule_pattern);

/// The CEL rule that checks `schedule` against [`SCHEDULE_PATTERN`]. A CEL rule rather than
/// the schema's `pattern`: the API server answers a failed `pattern` by quoting it, 2 KB of
/// regular expression, where this rule answers with [`SCHEDULE_FORMS`].
pub static SCHEDULE_RULE: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("self.matches(r'{}')", SCHEDULE_PATTERN.as_str()));

/// The schedules accepted, in one line: the API server's answer to any other.
pub const SCHEDULE_FORMS: &str = "schedule must be 5 cron fields (minute hour day month weekday; \"* * * * *\" is every minute), 6 with a leading seconds field, one of @hourly @daily @weekly @monthly @yearly @annually, or @continuous (always-on: every selected pod profiled in back-to-back windows, each exported)";

/// Largest `sampling.maxPods`: one run's pods are listed in `podNames` of its requests.
pub const MAX_PODS_PER_RUN: i32 = 1000;

/// Builds the schedule pattern: a `@hourly`-style macro, or five cron fields (minute hour
/// day-of-month month day-of-week) optionally preceded by a seconds field. Each field is a
/// comma list of `*`, a value or a range `a-b`, where `*` and ranges may take a `/step`;
/// values are checked against the field's range (minute 0-59, hour 0-23, day 1-31, month
/// 1-12 or JAN-DEC, weekday 0-7 or SUN-SAT, names in any case), so `99 99 99 99 99` and
/// `xyz abc def ghi jkl` never reach the controller. The operator parses with a real cron
/// library and reports anything the pattern lets through in a `ScheduleValid` condition.
pub fn schedule_pattern() -> String {
    fn any_case(name: &str) -> String {
        name.chars()
            .map(|c| format!("[{}{}]", c.to_ascii_uppercase(), c.to_ascii_lowercase()))
            .collect()
    }
    fn names(list: &[&str]) -> String {
        list.iter()
            .map(|n| any_case(n))
            .collect::<Vec<_>>()
            .join("|")
    }
    fn field(value: &str, question_mark: bool) -> String {
        let step = "/[1-9][0-9]?";
        let item = format!("(\\*({step})?|({value})(-({value})({step})?)?)");
        let list = format!("{item}(,{item})*");
        if question_mark {
            format!("(\\?|{list})")
        } else {
            format!("({list})")
        }
    }
    let sixty = "[0-5]?[0-9]";
    let hour = "[01]?[0-9]|2[0-3]";
    let day = "0?[1-9]|[12][0-9]|3[01]";
    let months = names(&[
        "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
    ]);
    let month = format!("0?[1-9]|1[0-2]|{months}");
    let weekdays = names(&["sun", "mon", "tue", "wed", "thu", "fri", "sat"]);
    let weekday = format!("[0-7]|{weekdays}");
    let macros = [
        "yearly",
        "annually",
        "monthly",
        "weekly",
        "daily",
        "hourly",
        "continuous",
    ]
    .join("|");
    format!(
        "^(@({macros})|({seconds} )?{minute} {hour} {day} {month} {weekday})$",
        seconds = field(sixty, false),
        minute = field(sixty, false),
        hour = field(hour, false),
        day = field(day, true),
        month = field(&month, false),
        weekday = field(&weekday, true),
    )
}

/// A schedule that samples pods of its own namespace and creates ProfileRequests from `template`.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "flamefleet.dev",
    version = "v1alpha1",
    kind = "SamplingPolicy",
    namespaced,
    shortname = "sp",
    category = "flamefleet",
    status = "SamplingPolicyStatus",
    derive = "PartialEq",
    doc = "Captures profiles of a sampled subset of the pods of one namespace on a schedule",
    printcolumn(name = "Schedule", type_ = "string", json_path = ".spec.schedule"),
    printcolumn(name = "Type", type_ = "string", json_path = ".spec.template.type"),
    printcolumn(name = "Suspend", type_ = "boolean", json_path = ".spec.suspend"),
    printcolumn(
        name = "Valid",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"ScheduleValid\")].status"
    ),
    printcolumn(name = "Active", type_ = "integer", json_path = ".status.activeCount"),
    printcolumn(
        name = "Coverage",
        type_ = "string",
        json_path = ".status.coverage.summary"
    ),
    printcolumn(
        name = "Skipped",
        type_ = "integer",
        json_path = ".status.skippedForBudget"
    ),
    printcolumn(
        name = "Last Schedule",
        type_ = "date",
        json_path = ".status.lastScheduleTime"
    ),
    printcolumn(
        name = "Last Success",
        type_ = "date",
        json_path = ".status.lastSuccessfulTime"
    ),
    // A string, not a date: kubectl prints a future date as `<invalid>`.
    printcolumn(name = "Next", type_ = "string", json_path = ".status.nextScheduleTime"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.schedule) || self.schedule != '@continuous' || self.template.type == 'cpu'").message("an always-on policy (schedule @continuous) profiles CPU only: template.type must be cpu"),
    validation = Rule::new("has(self.schedule) || (has(self.triggers) && size(self.triggers) > 0)").message("a policy without a schedule captures on its triggers only: set a schedule, or at least one trigger")
)]
pub struct SamplingPolicySpec {
    /// Cron schedule in the policy's `timeZone`: five fields (`*/5 * * * *`), six with a
    /// leading seconds field (`*/20 * * * * *`), or a macro such as `@hourly`; or
    /// `@continuous`: every selected pod profiled back to back in windows (the cluster's
    /// window, by default 20 s back to back), each window exported over OTLP, no
    /// ProfileRequest per window (docs/export.md, "Always-on profiling"). Optional when the
    /// policy has triggers: without a schedule it captures on its triggers only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 6, max = 256))]
    #[x_kube(validation = Rule::new(SCHEDULE_RULE.as_str()).message(SCHEDULE_FORMS))]
    pub schedule: Option<String>,
    /// IANA time zone of the schedule, e.g. `Europe/Paris` (default: UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 64),
        pattern(r"^[A-Za-z][A-Za-z0-9_+\-]*(/[A-Za-z0-9_+\-]+)*$")
    )]
    pub time_zone: Option<String>,
    /// A run whose time was missed (operator down) is still created up to this many seconds
    /// late, and skipped after (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400))]
    pub starting_deadline_seconds: Option<i64>,
    /// Stop creating new runs while true (running ones finish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend: Option<bool>,
    /// The ProfileRequest spec of every run; `selector` picks the pods to sample from, and
    /// each run targets the sampled pods by name. A cpu template without `cpu` options
    /// samples at 19 Hz.
    pub template: ProfileRequestSpec,
    /// How much of the matching fleet one run samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<SamplingLimits>,
    /// Cost budget per node, shared with every other policy and ad hoc request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<NodeBudget>,
    /// How many finished runs to keep.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<HistoryLimits>,
    /// Captures fired by a condition of a selected pod (memory near its limit, CPU
    /// throttled, pressure), watched on its node (docs/triggers.md). Each fire is a run for
    /// that pod only; `suspend` stops them too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_TRIGGERS))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub triggers: Vec<PolicyTrigger>,
}

/// Like [`SamplingPolicy`], cluster-wide: `namespaceSelector` picks the namespaces whose pods
/// are sampled, and each run is created in the namespace of the pods it samples.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "flamefleet.dev",
    version = "v1alpha1",
    kind = "ClusterSamplingPolicy",
    shortname = "csp",
    category = "flamefleet",
    status = "SamplingPolicyStatus",
    derive = "PartialEq",
    doc = "Captures profiles of a sampled subset of the pods of selected namespaces on a schedule",
    printcolumn(name = "Schedule", type_ = "string", json_path = ".spec.schedule"),
    printcolumn(name = "Type", type_ = "string", json_path = ".spec.template.type"),
    printcolumn(name = "Suspend", type_ = "boolean", json_path = ".spec.suspend"),
    printcolumn(
        name = "Valid",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"ScheduleValid\")].status"
    ),
    printcolumn(name = "Active", type_ = "integer", json_path = ".status.activeCount"),
    printcolumn(
        name = "Coverage",
        type_ = "string",
        json_path = ".status.coverage.summary"
    ),
    printcolumn(
        name = "Skipped",
        type_ = "integer",
        json_path = ".status.skippedForBudget"
    ),
    printcolumn(
        name = "Last Schedule",
        type_ = "date",
        json_path = ".status.lastScheduleTime"
    ),
    printcolumn(
        name = "Last Success",
        type_ = "date",
        json_path = ".status.lastSuccessfulTime"
    ),
    // A string, not a date: kubectl prints a future date as `<invalid>`.
    printcolumn(name = "Next", type_ = "string", json_path = ".status.nextScheduleTime"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSamplingPolicySpec {
    /// Namespaces whose pods are sampled; all namespaces when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// The schedule, template and limits, as in a SamplingPolicy.
    #[serde(flatten)]
    pub policy: SamplingPolicySpec,
}

/// How many pods and nodes one run samples. All limits apply together; without any, a run
/// takes one pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SamplingLimits {
    /// At most this many pods per run (at most 256 in one namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_PODS_PER_RUN))]
    pub max_pods: Option<i32>,
    /// At most this percentage of the matching pods per run (1 to 100, rounded up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub percent: Option<i32>,
    /// At most this many nodes per run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_nodes: Option<i32>,
}

/// Per-node cost budget. Counted over everything that captures on a node: this policy's
/// runs, other policies' runs and ad hoc ProfileRequests. Ad hoc requests are never held
/// back; scheduled runs skip a node at its budget and take another pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeBudget {
    /// At most this many captures running on one node at a time (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_concurrent_captures_per_node: Option<i32>,
    /// At most this percentage of wall time a node spends under scheduled capture of the
    /// template's profile type, over `dutyCycleWindowSeconds` (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_duty_cycle_percent: Option<i32>,
    /// The sliding window of the duty cycle, seconds (default 3600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 60, max = 86400))]
    pub duty_cycle_window_seconds: Option<i64>,
}

/// How many finished runs to keep.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HistoryLimits {
    /// Runs that succeeded (fully or partly) to keep (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub successful_runs_history_limit: Option<i32>,
    /// Failed runs to keep (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub failed_runs_history_limit: Option<i32>,
}

/// What a sampling policy has done. Written by the operator only.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SamplingPolicyStatus {
    /// The `metadata.generation` the status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The scheduled time of the last run (created or skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_schedule_time: Option<Time>,
    /// The next scheduled time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_schedule_time: Option<Time>,
    /// When the last run that succeeded (fully or partly) completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_successful_time: Option<Time>,
    /// Runs that have not finished yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub active: Vec<RunReference>,
    /// Number of runs that have not finished yet (the ACTIVE column).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_count: Option<i32>,
    /// Scheduled times missed past `startingDeadlineSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missed_runs: Option<i64>,
    /// Pods passed over because their node was at its budget, summed over all runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_for_budget: Option<i64>,
    /// What the last run passed over, and why (at most 20 entries).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub last_run_skipped: Vec<SkippedPod>,
    /// How much of the matching fleet the rotation has covered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage: Option<Coverage>,
    /// Where the rotation stands (kept in status so it survives operator restarts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation: Option<RotationState>,
    /// A run being created: written before its ProfileRequests, cleared after, so a restart
    /// in between finishes it instead of planning another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_run: Option<PendingRun>,
    /// What an always-on policy (`schedule: "@continuous"`) has profiled and exported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuous: Option<crate::continuous::ContinuousStatus>,
    /// What each trigger has done (fires, fires turned down, pods watched).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub triggers: Vec<TriggerStatus>,
    /// Standard conditions, one per type (`ScheduleValid`, `PodsMatched`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

/// A ProfileRequest created by a policy.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunReference {
    /// Namespace of the ProfileRequest.
    pub namespace: String,
    /// Name of the ProfileRequest.
    pub name: String,
}

/// A pod a run passed over.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SkippedPod {
    /// Namespace of the pod.
    pub namespace: String,
    /// Name of the pod.
    pub pod: String,
    /// Its node.
    pub node: String,
    /// Why: `ConcurrentCaptures`, `DutyCycle`, `MaxNodes` or `NamespaceFull`.
    pub reason: String,
    /// Details, e.g. the captures running on the node.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// Coverage of the rotation.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Coverage {
    /// Eligible pods matching now (Running, on a node with an agent).
    pub matching_pods: i64,
    /// Of those, how many were profiled since the start of the last full rotation.
    pub covered_pods: i64,
    /// `covered/matching (percent)`, for the COVERAGE column.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub summary: String,
    /// Number of completed rotations.
    #[serde(default)]
    pub rotations_completed: i64,
    /// When the last rotation completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rotation_completed_time: Option<Time>,
    /// Pods profiled in the last completed rotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rotation_pods: Option<i64>,
}

/// The rotation's position. Pods are walked in the order of a hash of (policy UID, pod
/// UID); everything at or before `cursor` was visited in this rotation, except new pods,
/// which wait for the next one. `ahead` lists hashes past the cursor already profiled
/// (taken out of order because earlier pods were skipped).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RotationState {
    /// Rotation number, from 1.
    pub number: i64,
    /// When this rotation started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When the previous rotation started (coverage counts pods profiled since then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_start_time: Option<Time>,
    /// Hash position (16 hex digits) of the last visited pod; absent at a rotation's start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
    /// Hash positions past the cursor already profiled in this rotation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ahead: Vec<String>,
    /// Hash positions of pods passed over because their node was at its budget: still owed,
    /// offered first in every run until profiled (carried into the next rotation if need be).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deferred: Vec<String>,
    /// Pods profiled in this rotation so far.
    #[serde(default)]
    pub profiled: i64,
}

/// A run whose ProfileRequests are being created.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PendingRun {
    /// The scheduled time of the run.
    pub scheduled_time: Time,
    /// One ProfileRequest per namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requests: Vec<PlannedRequest>,
}

/// One ProfileRequest of a run.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlannedRequest {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The sampled pods.
    pub pods: Vec<String>,
    /// Their nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
}
