//! A policy's runs over time: which requests are its runs, which are active, when one last
//! succeeded, and which finished runs the history limits delete (the ProfileRequest
//! finalizer then deletes their artifacts).
//!
//! Labels, annotations and ownerReferences of a ProfileRequest are written by whoever
//! creates it: a tenant with `edit` in a namespace can copy a policy's UID into requests of
//! its own. So a request counts as a run of a policy only when everything a tenant cannot
//! choose agrees ([`RunIdentity::recognises`]): the controller ownerReference names the
//! policy with its UID, the namespace is one the policy samples now, the name is the one
//! the policy gives its run of that scheduled time, the scheduled time is one the policy has
//! reached (its own status, which tenants cannot write), and the API server's
//! `creationTimestamp` falls between that time and its starting deadline. And history is
//! counted per namespace, ordered by `creationTimestamp`: whatever a tenant creates in its
//! namespace, no run of another namespace is deleted to make room for it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use flamefleet_api::{HistoryLimits, ProfileRequest, RequestPhase, RunReference};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use super::run_name::{PolicyKind, SCHEDULED_TIME_LABEL, run_name};

/// Default `successfulRunsHistoryLimit`.
pub const DEFAULT_SUCCESSFUL: usize = 10;
/// Default `failedRunsHistoryLimit`.
pub const DEFAULT_FAILED: usize = 3;

/// The scheduled time (Unix seconds) of a run, from its label.
pub fn scheduled_second(run: &ProfileRequest) -> Option<i64> {
    run.labels().get(SCHEDULED_TIME_LABEL)?.parse().ok()
}

/// How far the API server's clock may be behind the operator's: a run created right at
/// its scheduled time may carry a `creationTimestamp` this much earlier.
const CLOCK_SKEW_SECONDS: i64 = 5;
/// How long after its starting deadline a late run may still be created (the reconcile
/// that creates several late runs takes a few API round trips per run).
const CREATION_SLACK_SECONDS: i64 = 60;

/// What identifies the runs of one policy (see the module documentation).
#[derive(Debug, Clone)]
pub struct RunIdentity {
    /// `apiVersion` of the policy's kind.
    pub api_version: String,
    /// Kind of the policy.
    pub kind: PolicyKind,
    /// The policy's name.
    pub name: String,
    /// The policy's UID.
    pub uid: String,
    /// The namespaces the policy samples now (`None`: every namespace).
    pub namespaces: Option<BTreeSet<String>>,
    /// The latest scheduled time the policy has handled or planned (Unix seconds), from
    /// its status; `None` before its first.
    pub reached: Option<i64>,
    /// The policy's starting deadline, seconds.
    pub deadline_seconds: i64,
}

impl RunIdentity {
    /// Whether `request` is one of the policy's runs.
    pub fn recognises(&self, request: &ProfileRequest) -> bool {
        self.why_not(request).is_none()
    }

    /// Why `request` is not one of the policy's runs (`None`: it is).
    pub fn why_not(&self, request: &ProfileRequest) -> Option<&'static str> {
        let owned = request.owner_references().iter().any(|o| {
            o.controller == Some(true)
                && o.uid == self.uid
                && o.kind == self.kind.as_str()
                && o.api_version == self.api_version
        });
        if !owned {
            return Some("no controller ownerReference to the policy");
        }
        let namespace = request.namespace().unwrap_or_default();
        if self
            .namespaces
            .as_ref()
            .is_some_and(|set| !set.contains(&namespace))
        {
            return Some("not in a namespace the policy samples");
        }
        let Some(t) = scheduled_second(request) else {
            return Some("no scheduled-time label");
        };
        if self.reached.is_none_or(|reached| t > reached) {
            return Some("scheduled after the last time the policy handled");
        }
        let expected = Timestamp::from_second(t)
            .ok()
            .map(|at| run_name(&self.name, self.kind, at));
        if expected.as_deref() != Some(request.name_any().as_str()) {
            return Some("not the name of the policy's run at its scheduled time");
        }
        let Some(created) = request.metadata.creation_timestamp.as_ref() else {
            return Some("no creationTimestamp");
        };
        let created = created.0.as_second();
        if created < t - CLOCK_SKEW_SECONDS {
            return Some("created before its scheduled time");
        }
        if created > t + self.deadline_seconds + CREATION_SLACK_SECONDS {
            return Some("created after its starting deadline");
        }
        None
    }
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

    fn identity() -> RunIdentity {
        RunIdentity {
            api_version: "flamefleet.dev/v1alpha1".into(),
            kind: PolicyKind::Cluster,
            name: "fleet".into(),
            uid: "u-1".into(),
            namespaces: Some(BTreeSet::from(["a".to_string(), "b".to_string()])),
            reached: Some(2_000_000_000),
            deadline_seconds: 300,
        }
    }

    fn claimed(ns: &str, t: i64, created: i64, name: Option<String>) -> ProfileRequest {
        serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {
                "name": name.unwrap_or_else(|| format!("fleet-c{t}")), "namespace": ns,
                "creationTimestamp": Timestamp::from_second(created).unwrap().to_string(),
                "labels": {SCHEDULED_TIME_LABEL: t.to_string()},
                "ownerReferences": [{"apiVersion": "flamefleet.dev/v1alpha1",
                    "kind": "ClusterSamplingPolicy", "name": "fleet", "uid": "u-1",
                    "controller": true}],
            },
            "spec": {"type": "cpu", "podNames": ["a"], "duration": "1s"},
        }))
        .unwrap()
    }

    #[test]
    fn only_what_a_tenant_cannot_choose_makes_a_run() {
        let id = identity();
        let t = 1_900_000_000;
        assert_eq!(id.why_not(&claimed("b", t, t + 1, None)), None);
        let far_future = 4_000_000_000;
        assert_eq!(
            id.why_not(&claimed("a", far_future, t, None)),
            Some("scheduled after the last time the policy handled")
        );
        assert_eq!(
            id.why_not(&claimed("a", t - 3_600, t, None)),
            Some("created after its starting deadline")
        );
        assert_eq!(
            id.why_not(&claimed("a", t, t - 60, None)),
            Some("created before its scheduled time")
        );
        assert_eq!(
            id.why_not(&claimed("c", t, t, None)),
            Some("not in a namespace the policy samples")
        );
        assert_eq!(
            id.why_not(&claimed("a", t, t, Some("mine".into()))),
            Some("not the name of the policy's run at its scheduled time")
        );
        let mut label_only = claimed("a", t, t, None);
        label_only.metadata.owner_references = None;
        assert_eq!(
            id.why_not(&label_only),
            Some("no controller ownerReference to the policy")
        );
        let mut not_controller = claimed("a", t, t, None);
        if let Some(o) = not_controller.metadata.owner_references.as_mut() {
            o[0].controller = None;
        }
        assert!(!id.recognises(&not_controller));
    }
}
