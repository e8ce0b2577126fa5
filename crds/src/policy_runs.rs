//! Which ProfileRequests are a policy's runs: the names and labels the policy gives them,
//! and the one check of whether a request is a genuine run ([`RunIdentity`]). The operator
//! (history, status, budget) and the CLI (fleet views) both decide with it.
//!
//! A run's name is derived from the policy and the scheduled time alone, so creating it twice
//! (an operator restarted between creating it and recording it, or two leaders in a
//! hand-over) hits `AlreadyExists` instead of making a duplicate: exactly one request per
//! policy, namespace and scheduled time.
//!
//! Labels, annotations and ownerReferences of a ProfileRequest are written by whoever
//! creates it: a tenant with `edit` in a namespace can copy a policy's UID into requests of
//! its own. So a request counts as a run of a policy only when everything a tenant cannot
//! choose agrees ([`RunIdentity::why_not`]): the controller ownerReference names the policy
//! with its UID, the namespace is one the policy samples now, the name is the one the policy
//! gives its run of that scheduled time, the scheduled time is one the policy has reached
//! (its own status, which tenants cannot write), and the API server's `creationTimestamp`
//! falls between that time and its starting deadline.

use std::borrow::Borrow;
use std::collections::BTreeSet;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use sha2::{Digest, Sha256};

use crate::{ProfileRequest, SamplingPolicySpec, SamplingPolicyStatus};

/// Label: the kind of the owning policy (`SamplingPolicy` or `ClusterSamplingPolicy`).
pub const POLICY_KIND_LABEL: &str = "flamefleet.dev/policy-kind";
/// Label: the owning policy's name (omitted when it is not a valid label value).
pub const POLICY_NAME_LABEL: &str = "flamefleet.dev/policy";
/// Label: the owning policy's UID.
pub const POLICY_UID_LABEL: &str = "flamefleet.dev/policy-uid";
/// Label: the scheduled time of the run, in Unix seconds.
pub const SCHEDULED_TIME_LABEL: &str = "flamefleet.dev/scheduled-time";
/// Annotation: the scheduled time of the run, RFC 3339.
pub const SCHEDULED_AT_ANNOTATION: &str = "flamefleet.dev/scheduled-at";

/// The longest DNS label.
const MAX_LABEL: usize = 63;

/// Which kind of policy, for names and labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// A namespaced `SamplingPolicy`.
    Namespaced,
    /// A `ClusterSamplingPolicy`.
    Cluster,
}

impl PolicyKind {
    /// The kind's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Namespaced => "SamplingPolicy",
            Self::Cluster => "ClusterSamplingPolicy",
        }
    }
}

/// The name of the run of `policy` at `scheduled`: `<policy>-<unix seconds>` for a
/// SamplingPolicy and `<policy>-c<unix seconds>` for a ClusterSamplingPolicy (so the runs
/// of a namespaced and a cluster policy of the same name never collide). Always a valid DNS
/// label: dots become dashes, and a name too long is cut and given a hash of the full name.
pub fn run_name(policy: &str, kind: PolicyKind, scheduled: Timestamp) -> String {
    let suffix = match kind {
        PolicyKind::Namespaced => format!("-{}", scheduled.as_second()),
        PolicyKind::Cluster => format!("-c{}", scheduled.as_second()),
    };
    let cleaned: String = policy
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .collect();
    let room = MAX_LABEL - suffix.len();
    let prefix = if cleaned == policy && cleaned.len() <= room {
        cleaned
    } else {
        let hash = hex::encode(&Sha256::digest(policy.as_bytes())[..4]);
        let keep = room - hash.len() - 1;
        let cut: String = cleaned.chars().take(keep).collect();
        format!("{}-{hash}", cut.trim_end_matches('-'))
    };
    let prefix = prefix.trim_start_matches('-');
    let prefix = if prefix.is_empty() { "run" } else { prefix };
    format!("{prefix}{suffix}")
}

/// True when `value` is a valid label value (at most 63 characters of `[A-Za-z0-9._-]`,
/// starting and ending alphanumeric).
pub fn is_label_value(value: &str) -> bool {
    value.len() <= MAX_LABEL
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && value
            .chars()
            .next()
            .is_none_or(|c| c.is_ascii_alphanumeric())
        && value
            .chars()
            .last()
            .is_none_or(|c| c.is_ascii_alphanumeric())
}

/// Default `startingDeadlineSeconds`: how late after its scheduled time a run may start.
pub const DEFAULT_STARTING_DEADLINE_SECONDS: i64 = 300;

/// The time (Unix seconds) a run belongs to: its scheduled time, or a triggered run's fire
/// (`status.trigger.firedAt`).
pub fn run_second(run: &ProfileRequest) -> Option<i64> {
    scheduled_second(run).or_else(|| {
        run.status
            .as_ref()?
            .trigger
            .as_ref()
            .map(|t| t.fired_at.0.as_second())
    })
}

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
    /// The names of the policy's triggers (their runs: [`Self::why_not_triggered`]).
    pub triggers: Vec<String>,
}

impl RunIdentity {
    /// The identity of the runs of the policy `name` (`uid`) of `kind`, from its spec, its
    /// status (only what the operator wrote there) and the namespaces it samples now.
    pub fn of_policy(
        kind: PolicyKind,
        name: &str,
        uid: &str,
        spec: &SamplingPolicySpec,
        status: Option<&SamplingPolicyStatus>,
        namespaces: Option<BTreeSet<String>>,
    ) -> Self {
        let reached = status.and_then(|s| {
            s.last_schedule_time
                .iter()
                .chain(s.pending_run.iter().map(|p| &p.scheduled_time))
                .map(|t| t.0.as_second())
                .max()
        });
        Self {
            kind,
            name: name.to_string(),
            uid: uid.to_string(),
            namespaces,
            reached,
            deadline_seconds: spec
                .starting_deadline_seconds
                .filter(|s| *s >= 0)
                .unwrap_or(DEFAULT_STARTING_DEADLINE_SECONDS),
            triggers: spec.triggers.iter().map(|t| t.name.clone()).collect(),
        }
    }

    /// Whether `request` is one of the policy's runs.
    pub fn recognises(&self, request: &ProfileRequest) -> bool {
        self.why_not(request).is_none()
    }

    /// Splits `requests` into the policy's runs and the others (which claim to be, e.g. by
    /// the UID label, but are not).
    pub fn partition<R: Borrow<ProfileRequest>>(&self, requests: Vec<R>) -> (Vec<R>, Vec<R>) {
        requests
            .into_iter()
            .partition(|r| self.recognises(r.borrow()))
    }

    /// Splits `requests` into the policy's scheduled and triggered runs and the others.
    pub fn partition_all<R: Borrow<ProfileRequest>>(&self, requests: Vec<R>) -> (Vec<R>, Vec<R>) {
        requests.into_iter().partition(|r| {
            let r = r.borrow();
            self.recognises(r) || self.why_not_triggered(r).is_none()
        })
    }

    /// Why `request` is not owned by the policy in a namespace it samples (`None`: it is).
    fn why_not_owned(&self, request: &ProfileRequest) -> Option<&'static str> {
        let owned = request.owner_references().iter().any(|o| {
            o.controller == Some(true)
                && o.uid == self.uid
                && o.kind == self.kind.as_str()
                && o.api_version.split_once('/') == Some((crate::GROUP, crate::VERSION))
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
        None
    }

    /// Why `request` is not a run one of the policy's triggers created (`None`: it is). A
    /// triggered run has no scheduled time; what a tenant cannot choose is its
    /// `status.trigger` (the operator alone writes a request's status): it must name one of
    /// the policy's triggers, the run's name must be the one the operator gives the run of
    /// that fire (policy, fire second, pod and trigger), and the API server's
    /// `creationTimestamp` must fall near the fire.
    pub fn why_not_triggered(&self, request: &ProfileRequest) -> Option<&'static str> {
        if let Some(why) = self.why_not_owned(request) {
            return Some(why);
        }
        let labels = request.labels();
        let Some(trigger) = labels.get(crate::trigger::TRIGGER_LABEL) else {
            return Some("no trigger label");
        };
        if !self.triggers.contains(trigger) {
            return Some("not a trigger of the policy");
        }
        let Some(fire) = request.status.as_ref().and_then(|s| s.trigger.as_ref()) else {
            return Some("no status.trigger");
        };
        if &fire.name != trigger {
            return Some("status.trigger names another trigger");
        }
        let Some(pod_uid) = labels.get(crate::trigger::TRIGGER_POD_UID_LABEL) else {
            return Some("no trigger pod label");
        };
        let fired = fire.fired_at.0.as_second();
        if crate::trigger::trigger_run_name(&self.name, trigger, pod_uid, fired)
            != request.name_any()
        {
            return Some("not the name of the policy's run of that fire");
        }
        let Some(created) = request.metadata.creation_timestamp.as_ref() else {
            return Some("no creationTimestamp");
        };
        let created = created.0.as_second();
        if created < fired - CLOCK_SKEW_SECONDS || created > fired + CREATION_SLACK_SECONDS {
            return Some("created far from its fire");
        }
        None
    }

    /// Why `request` is not one of the policy's scheduled runs (`None`: it is).
    pub fn why_not(&self, request: &ProfileRequest) -> Option<&'static str> {
        if let Some(why) = self.why_not_owned(request) {
            return Some(why);
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
        if created
            > t.saturating_add(self.deadline_seconds)
                .saturating_add(CREATION_SLACK_SECONDS)
        {
            return Some("created after its starting deadline");
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn is_dns_label(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    }

    #[test]
    fn names_are_unique_per_time_and_kind_and_valid_labels() {
        let t = Timestamp::from_second(1_767_607_230).unwrap();
        assert_eq!(run_name("web", PolicyKind::Namespaced, t), "web-1767607230");
        assert_eq!(run_name("web", PolicyKind::Cluster, t), "web-c1767607230");
        let t2 = Timestamp::from_second(1_767_607_240).unwrap();
        assert_ne!(
            run_name("web", PolicyKind::Namespaced, t),
            run_name("web", PolicyKind::Namespaced, t2)
        );
        let long = "a".repeat(253);
        let dotted = "checkout.payments.example";
        for name in [long.as_str(), dotted, "x", "a-b.c-d"] {
            for kind in [PolicyKind::Namespaced, PolicyKind::Cluster] {
                let run = run_name(name, kind, t);
                assert!(is_dns_label(&run), "{run}");
            }
        }
        // Two long names that share a prefix still differ.
        let a = format!("{}-one", "p".repeat(80));
        let b = format!("{}-two", "p".repeat(80));
        assert_ne!(
            run_name(&a, PolicyKind::Namespaced, t),
            run_name(&b, PolicyKind::Namespaced, t)
        );
        assert_ne!(
            run_name("a.b", PolicyKind::Namespaced, t),
            run_name("a-b", PolicyKind::Namespaced, t)
        );
    }

    #[test]
    fn label_values() {
        assert!(is_label_value("checkout-continuous"));
        assert!(is_label_value("a.b_c"));
        assert!(!is_label_value(&"a".repeat(64)));
        assert!(!is_label_value("-a"));
    }

    fn identity() -> RunIdentity {
        RunIdentity {
            kind: PolicyKind::Cluster,
            name: "fleet".into(),
            uid: "u-1".into(),
            namespaces: Some(BTreeSet::from(["a".to_string(), "b".to_string()])),
            reached: Some(2_000_000_000),
            deadline_seconds: 300,
            triggers: vec!["near-limit".into()],
        }
    }

    /// A triggered run of the `fleet` policy's `trigger` on pod `pod`, fired at `fired`.
    fn triggered(
        trigger: &str,
        pod: &str,
        fired: i64,
        created: i64,
        status: bool,
    ) -> ProfileRequest {
        let mut r = claimed("a", fired, created, None);
        r.metadata.name = Some(crate::trigger::trigger_run_name(
            "fleet", trigger, pod, fired,
        ));
        r.metadata.labels = Some(
            [
                (
                    crate::trigger::TRIGGER_LABEL.to_string(),
                    trigger.to_string(),
                ),
                (
                    crate::trigger::TRIGGER_POD_UID_LABEL.to_string(),
                    pod.to_string(),
                ),
            ]
            .into(),
        );
        if status {
            r.status = Some(
                serde_json::from_value(json!({"trigger": {
                    "name": trigger, "condition": "memory above 60% of limit",
                    "measured": "61.0", "threshold": "60.0", "pod": "p", "node": "n",
                    "firedAt": Timestamp::from_second(fired).unwrap().to_string(),
                    "reason": "near-limit: memory above 60% of limit",
                }}))
                .unwrap(),
            );
        }
        r
    }

    #[test]
    fn a_triggered_run_is_recognised_by_its_status_trigger_and_name() {
        let id = identity();
        let t = 1_900_000_000;
        let run = triggered("near-limit", "pod-1", t, t + 1, true);
        assert_eq!(id.why_not_triggered(&run), None);
        assert_eq!(run_second(&run), Some(t));
        assert_eq!(
            id.why_not(&run),
            Some("no scheduled-time label"),
            "not a scheduled run"
        );
        // Labels and names are a tenant's to write; the status is the operator's.
        assert_eq!(
            id.why_not_triggered(&triggered("near-limit", "pod-1", t, t + 1, false)),
            Some("no status.trigger")
        );
        assert_eq!(
            id.why_not_triggered(&triggered("other", "pod-1", t, t + 1, true)),
            Some("not a trigger of the policy")
        );
        let mut renamed = run.clone();
        renamed.metadata.name = Some("fleet-t1-abcdef01".into());
        assert_eq!(
            id.why_not_triggered(&renamed),
            Some("not the name of the policy's run of that fire")
        );
        assert_eq!(
            id.why_not_triggered(&triggered("near-limit", "pod-1", t, t + 3_600, true)),
            Some("created far from its fire")
        );
        let scheduled = claimed("b", t, t + 1, None);
        let (runs, others) = id.partition_all(vec![run, scheduled, renamed]);
        assert_eq!((runs.len(), others.len()), (2, 1));
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
