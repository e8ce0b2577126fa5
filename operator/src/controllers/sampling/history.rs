//! A policy's runs over time: which are active, when one last succeeded, and which finished
//! runs the history limits delete (the ProfileRequest finalizer then deletes their artifacts).

use std::collections::BTreeMap;
use std::sync::Arc;

use flamefleet_api::{HistoryLimits, ProfileRequest, RequestPhase, RunReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use super::run_name::SCHEDULED_TIME_LABEL;

/// Default `successfulRunsHistoryLimit`.
pub const DEFAULT_SUCCESSFUL: usize = 10;
/// Default `failedRunsHistoryLimit`.
pub const DEFAULT_FAILED: usize = 3;

/// The scheduled time (Unix seconds) of a run, from its label.
pub fn scheduled_second(run: &ProfileRequest) -> Option<i64> {
    run.labels().get(SCHEDULED_TIME_LABEL)?.parse().ok()
}

fn phase(run: &ProfileRequest) -> Option<RequestPhase> {
    run.status.as_ref().and_then(|s| s.phase)
}

fn succeeded(p: RequestPhase) -> bool {
    matches!(
        p,
        RequestPhase::Succeeded | RequestPhase::PartiallySucceeded
    )
}

/// The runs not finished yet.
pub fn active(runs: &[Arc<ProfileRequest>]) -> Vec<RunReference> {
    let mut out: Vec<RunReference> = runs
        .iter()
        .filter(|r| !phase(r).is_some_and(RequestPhase::is_terminal))
        .filter(|r| r.metadata.deletion_timestamp.is_none())
        .map(|r| RunReference {
            namespace: r.namespace().unwrap_or_default(),
            name: r.name_any(),
        })
        .collect();
    out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    out
}

/// The latest completion time of a run that succeeded (fully or partly).
pub fn last_success(runs: &[Arc<ProfileRequest>]) -> Option<Time> {
    runs.iter()
        .filter(|r| phase(r).is_some_and(succeeded))
        .filter_map(|r| r.status.as_ref()?.completion_time.clone())
        .max_by_key(|t| t.0)
}

/// The runs to delete: a scheduled time's requests (one per namespace) form one run, which
/// is finished when all its requests are, and counts as successful when any succeeded;
/// the newest `successfulRunsHistoryLimit` successful and `failedRunsHistoryLimit` failed
/// runs are kept.
pub fn expired(
    runs: &[Arc<ProfileRequest>],
    limits: Option<&HistoryLimits>,
) -> Vec<Arc<ProfileRequest>> {
    let limits = limits.cloned().unwrap_or_default();
    let keep =
        |v: Option<i32>, default: usize| v.and_then(|v| usize::try_from(v).ok()).unwrap_or(default);
    let keep_ok = keep(limits.successful_runs_history_limit, DEFAULT_SUCCESSFUL);
    let keep_failed = keep(limits.failed_runs_history_limit, DEFAULT_FAILED);
    let mut by_time: BTreeMap<i64, Vec<&Arc<ProfileRequest>>> = BTreeMap::new();
    for r in runs {
        if r.metadata.deletion_timestamp.is_some() {
            continue;
        }
        if let Some(t) = scheduled_second(r) {
            by_time.entry(t).or_default().push(r);
        }
    }
    let (mut ok, mut failed) = (0usize, 0usize);
    let mut out = Vec::new();
    for group in by_time.values().rev() {
        let phases: Vec<Option<RequestPhase>> = group.iter().map(|r| phase(r)).collect();
        if !phases
            .iter()
            .all(|p| p.is_some_and(RequestPhase::is_terminal))
        {
            continue;
        }
        let kept = if phases.iter().any(|p| p.is_some_and(succeeded)) {
            ok += 1;
            ok <= keep_ok
        } else {
            failed += 1;
            failed <= keep_failed
        };
        if !kept {
            out.extend(group.iter().map(|r| Arc::clone(r)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(t: i64, phase: Option<&str>) -> Arc<ProfileRequest> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
                "metadata": {"name": format!("p-{t}"), "namespace": "ns",
                    "labels": {SCHEDULED_TIME_LABEL: t.to_string()}},
                "spec": {"type": "cpu", "podNames": ["a"], "duration": "1s"},
                "status": {"phase": phase, "completionTime": phase.map(|_| format!("2026-01-05T10:00:{:02}Z", t % 60))},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn keeps_the_newest_finished_runs_and_never_active_ones() {
        let runs = vec![
            run(1, Some("Succeeded")),
            run(2, Some("Failed")),
            run(3, Some("Succeeded")),
            run(4, Some("PartiallySucceeded")),
            run(5, Some("Failed")),
            run(6, None),
        ];
        let limits = HistoryLimits {
            successful_runs_history_limit: Some(2),
            failed_runs_history_limit: Some(1),
        };
        let mut gone: Vec<String> = expired(&runs, Some(&limits))
            .iter()
            .map(|r| r.name_any())
            .collect();
        gone.sort();
        assert_eq!(gone, ["p-1", "p-2"]);
        assert_eq!(active(&runs).len(), 1);
        assert_eq!(last_success(&runs).unwrap().0.as_second() % 60, 4);
    }
}
