//! Always-on profiling of a policy (`schedule: "@continuous"`): every selected pod is
//! profiled in back-to-back windows on its node's agent and each window is exported, with
//! no ProfileRequest per window (docs/export.md, "Always-on profiling"). What the policy's
//! status says about it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The schedule that makes a policy always-on.
pub const CONTINUOUS_SCHEDULE: &str = "@continuous";

/// Most pods listed in [`ContinuousStatus::low_coverage`].
pub const MAX_LOW_COVERAGE: usize = 10;

/// Whether `schedule` is the always-on one.
pub fn is_continuous(schedule: &str) -> bool {
    schedule.trim() == CONTINUOUS_SCHEDULE
}

/// What an always-on policy has profiled and exported. Written by the operator only.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContinuousStatus {
    /// Pods profiled now (sent to their nodes' agents).
    pub pods: i64,
    /// Nodes they run on.
    pub nodes: i64,
    /// Length of a window and time between two windows' starts, seconds (the cluster's).
    pub window_seconds: i64,
    /// See `windowSeconds`.
    pub period_seconds: i64,
    /// Windows received from the agents (one per pod per window), since the operator
    /// started leading.
    pub windows: i64,
    /// Of those, exported to the OpenTelemetry endpoint.
    pub exported: i64,
    /// Not exported: the queue was full, the endpoint refused them or stayed down past
    /// the retry time, the profile was too large or invalid.
    pub dropped: i64,
    /// Windows waiting in the export queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued: Option<i64>,
    /// The lowest coverage of a pod profiled for at least two periods: the share, in
    /// percent, of the pod's windows' time that was sampled (100 means
    /// `windowSeconds/periodSeconds` of the wall time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_coverage_percent: Option<i64>,
    /// `N pods, min coverage P%`, for the COVERAGE column's neighbour in `kubectl get -o wide`
    /// and `kubectl profile` views.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub summary: String,
    /// When the last window arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_window_time: Option<Time>,
    /// When the last window was exported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_export_time: Option<Time>,
    /// Why the last window that was not exported was dropped.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_export_error: String,
    /// Pods below 95% coverage (at most 10), as `namespace/pod: P%`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub low_coverage: Vec<String>,
    /// What the agents could not profile, one line per pod (at most 10).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_macro_is_continuous() {
        assert!(is_continuous("@continuous"));
        assert!(is_continuous(" @continuous "));
        assert!(!is_continuous("@hourly"));
        assert!(!is_continuous("*/20 * * * * *"));
    }
}
