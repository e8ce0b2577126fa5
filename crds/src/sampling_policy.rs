//! `SamplingPolicy` and `ClusterSamplingPolicy`: scheduled captures of a sampled subset of a
//! fleet. Each run is an ordinary ProfileRequest owned by its policy, as a CronJob owns Jobs.

// Each `printcolumn(...)` repeats the same keys, which clippy mistakes for duplicates.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::profile_request::ProfileRequestSpec;

/// The regular expression the schema enforces on `schedule`: five space-separated cron fields
/// (minute hour day-of-month month day-of-week), each a comma list of `*`, `?`, numbers or
/// three-letter names, optional `-` ranges and `/` steps.
pub const CRON_PATTERN: &str = r"^(\*|\?|[0-9]{1,2}|[A-Za-z]{3})(-([0-9]{1,2}|[A-Za-z]{3}))?(/[0-9]{1,2})?(,(\*|\?|[0-9]{1,2}|[A-Za-z]{3})(-([0-9]{1,2}|[A-Za-z]{3}))?(/[0-9]{1,2})?)*( (\*|\?|[0-9]{1,2}|[A-Za-z]{3})(-([0-9]{1,2}|[A-Za-z]{3}))?(/[0-9]{1,2})?(,(\*|\?|[0-9]{1,2}|[A-Za-z]{3})(-([0-9]{1,2}|[A-Za-z]{3}))?(/[0-9]{1,2})?)*){4}$";

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
        name = "Last Schedule",
        type_ = "date",
        json_path = ".status.lastScheduleTime"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct SamplingPolicySpec {
    /// Five-field cron schedule, e.g. `*/5 * * * *`.
    #[schemars(length(min = 9, max = 128), pattern(CRON_PATTERN))]
    pub schedule: String,
    /// Stop creating new runs while true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend: Option<bool>,
    /// The ProfileRequest spec of every run.
    pub template: ProfileRequestSpec,
    /// How much of the matching fleet one run samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<SamplingLimits>,
    /// Cost budget per node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<NodeBudget>,
    /// How many finished runs to keep.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<HistoryLimits>,
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
        name = "Last Schedule",
        type_ = "date",
        json_path = ".status.lastScheduleTime"
    ),
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

/// How many pods and nodes one run samples. All limits apply together.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SamplingLimits {
    /// At most this many pods per run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_pods: Option<i32>,
    /// At most this percentage of the matching pods per run (1 to 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub percent: Option<i32>,
    /// At most this many nodes per run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_nodes: Option<i32>,
}

/// Per-node cost budget.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeBudget {
    /// At most this many captures running on one node at a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_concurrent_captures_per_node: Option<i32>,
}

/// How many finished runs to keep.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HistoryLimits {
    /// Succeeded runs to keep (default decided by the controller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub successful_runs_history_limit: Option<i32>,
    /// Failed runs to keep (default decided by the controller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub failed_runs_history_limit: Option<i32>,
}

/// What a sampling policy has done.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SamplingPolicyStatus {
    /// When the last run was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_schedule_time: Option<Time>,
    /// When the last run succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_successful_time: Option<Time>,
    /// Runs that have not finished yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub active: Vec<RunReference>,
    /// Standard conditions, one per type.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

/// A ProfileRequest created by a policy.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunReference {
    /// Namespace of the ProfileRequest.
    pub namespace: String,
    /// Name of the ProfileRequest.
    pub name: String,
}
