//! A policy's runs over time: which are active, when one last succeeded, and which
//! finished runs the history limits delete (the ProfileRequest finalizer then deletes their
//! artifacts).
//!
//! Only requests [`RunIdentity`](flamefleet_api::policy_runs::RunIdentity) recognises reach
//! this module. History is counted per namespace, ordered by `creationTimestamp`: whatever a
//! tenant creates in its namespace, no run of another namespace is deleted to make room for
//! it.

use std::collections::BTreeMap;
use std::sync::Arc;

use flamefleet_api::policy_runs::scheduled_second;
use flamefleet_api::{HistoryLimits, ProfileRequest, RequestPhase, RunReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

/// Default `successfulRunsHistoryLimit`.
pub const DEFAULT_SUCCESSFUL: usize = 10;
/// Default `failedRunsHistoryLimit`.
pub const DEFAULT_FAILED: usize = 3;

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

/// The runs to delete: in each namespace, the newest `successfulRunsHistoryLimit` finished
/// runs that succeeded (fully or partly) and `failedRunsHistoryLimit` that failed are kept,
/// newest by `creationTimestamp` (then scheduled time). Counting per namespace means a
/// namespace's runs only ever make room for newer runs of the same namespace.
pub fn expired(
    runs: &[Arc<ProfileRequest>],
    limits: Option<&HistoryLimits>,
) -> Vec<Arc<ProfileRequest>> {
    let limits = limits.cloned().unwrap_or_default();
    let keep =
        |v: Option<i32>, default: usize| v.and_then(|v| usize::try_from(v).ok()).unwrap_or(default);
    let keep_ok = keep(limits.successful_runs_history_limit, DEFAULT_SUCCESSFUL);
    let keep_failed = keep(limits.failed_runs_history_limit, DEFAULT_FAILED);
    let mut by_namespace: BTreeMap<String, Vec<&Arc<ProfileRequest>>> = BTreeMap::new();
    for r in runs {
        if r.metadata.deletion_timestamp.is_some()
            || !phase(r).is_some_and(RequestPhase::is_terminal)
        {
            continue;
        }
        by_namespace
            .entry(r.namespace().unwrap_or_default())
            .or_default()
            .push(r);
    }
    let mut out = Vec::new();
    for finished in by_namespace.values_mut() {
        finished.sort_by_key(|r| {
            std::cmp::Reverse((
                r.metadata.creation_timestamp.as_ref().map(|t| t.0),
                scheduled_second(r),
            ))
        });
        let (mut ok, mut failed) = (0usize, 0usize);
        for r in finished.iter() {
            let kept = if phase(r).is_some_and(succeeded) {
                ok += 1;
                ok <= keep_ok
            } else {
                failed += 1;
                failed <= keep_failed
            };
            if !kept {
                out.push(Arc::clone(r));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_api::policy_runs::SCHEDULED_TIME_LABEL;
    use jiff::Timestamp;
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

    fn run_in(ns: &str, t: i64, phase: &str) -> Arc<ProfileRequest> {
        let mut r = (*run(t, Some(phase))).clone();
        r.metadata.namespace = Some(ns.into());
        r.metadata.name = Some(format!("{ns}-{t}"));
        r.metadata.creation_timestamp = Some(Time(Timestamp::from_second(1_000 + t).unwrap()));
        Arc::new(r)
    }

    #[test]
    fn newer_runs_of_one_namespace_never_push_out_another_namespaces() {
        let mut runs = vec![run_in("b", 1, "Succeeded")];
        runs.extend((10..20).map(|t| run_in("a", t, "Succeeded")));
        let limits = HistoryLimits {
            successful_runs_history_limit: Some(3),
            failed_runs_history_limit: None,
        };
        let mut gone: Vec<String> = expired(&runs, Some(&limits))
            .iter()
            .map(|r| r.name_any())
            .collect();
        gone.sort();
        assert_eq!(gone.len(), 7, "{gone:?}");
        assert!(gone.iter().all(|n| n.starts_with("a-")), "{gone:?}");
        assert!(!gone.contains(&"a-19".to_string()));
    }
}
