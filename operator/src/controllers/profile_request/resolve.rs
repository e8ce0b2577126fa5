//! Which pods a ProfileRequest targets: pods of the request's own namespace, picked by
//! `spec.selector` and/or `spec.podNames`, that are Running on a node; grouped by node.

use std::collections::{BTreeMap, BTreeSet};

use flamefleet_api::ProfileRequestSpec;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::core::{Selector, SelectorExt};

use crate::pods::target::{TargetPod, target_of};
use crate::{Error, Result};

/// The outcome of resolving a request's targets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolution {
    /// Target pods by node name.
    pub by_node: BTreeMap<String, Vec<TargetPod>>,
    /// Pods that matched but cannot be profiled, with the reason (not Running, no node,
    /// no running container, or listed in `podNames` but absent).
    pub skipped: Vec<(String, String)>,
}

impl Resolution {
    /// Number of target pods.
    pub fn pod_count(&self) -> usize {
        self.by_node.values().map(Vec::len).sum()
    }

    /// A one-line explanation of why nothing matched, for the status.
    pub fn no_match_message(&self, namespace: &str) -> String {
        if self.skipped.is_empty() {
            format!(
                "no pods in namespace {namespace} match spec.selector / spec.podNames; check the labels and names (a request only profiles pods of its own namespace)"
            )
        } else {
            let details: Vec<String> = self
                .skipped
                .iter()
                .take(10)
                .map(|(pod, why)| format!("{pod}: {why}"))
                .collect();
            format!(
                "no running pods in namespace {namespace} to profile: {}",
                details.join("; ")
            )
        }
    }
}

/// Picks the targets among `pods` (pure): pods of `namespace` matching `selector` or named in
/// `pod_names`, Running on a node. Names in `pod_names` that are absent are reported.
pub fn select_targets(
    namespace: &str,
    selector: Option<&Selector>,
    pod_names: &[String],
    pods: &[Pod],
) -> Resolution {
    let wanted: BTreeSet<&str> = pod_names.iter().map(String::as_str).collect();
    let mut resolution = Resolution::default();
    let mut seen = BTreeSet::new();
    for pod in pods {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        let by_selector = selector.is_some_and(|s| s.matches(&labels));
        if !(by_selector || wanted.contains(name)) || !seen.insert(name.to_string()) {
            continue;
        }
        match target_of(pod, namespace) {
            Ok(target) => resolution
                .by_node
                .entry(target.node.clone())
                .or_default()
                .push(target),
            Err(why) => resolution.skipped.push((name.to_string(), why)),
        }
    }
    for name in wanted {
        if !seen.contains(name) {
            resolution.skipped.push((
                name.to_string(),
                format!("no such pod in namespace {namespace}"),
            ));
        }
    }
    for targets in resolution.by_node.values_mut() {
        targets.sort_by(|a, b| a.name.cmp(&b.name));
    }
    resolution
}

/// Lists the pods of the request's namespace and resolves the targets.
///
/// Only `Api::namespaced(namespace)` is queried, so a request can never reach pods of
/// another namespace whatever its selector or pod names say.
pub async fn resolve(
    client: &kube::Client,
    namespace: &str,
    spec: &ProfileRequestSpec,
) -> Result<Resolution> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let selector = spec
        .selector
        .clone()
        .map(Selector::try_from)
        .transpose()
        .map_err(|e| Error::Selector(e.to_string()))?;
    let mut pods = Vec::new();
    if let Some(selector) = &selector {
        let list = crate::pods::lean::list(
            client,
            namespace,
            &ListParams::default().labels_from(selector),
        )
        .await
        .map_err(Error::kube(format!("listing pods in {namespace}")))?;
        pods.extend(list);
    }
    for name in &spec.pod_names {
        if pods
            .iter()
            .any(|p| p.metadata.name.as_deref() == Some(name))
        {
            continue;
        }
        // A name that is not a valid object name cannot exist; the API server answers 404.
        if let Some(pod) = api
            .get_opt(name)
            .await
            .map_err(Error::kube(format!("getting pod {namespace}/{name}")))?
        {
            pods.push(pod);
        }
    }
    Ok(select_targets(
        namespace,
        selector.as_ref(),
        &spec.pod_names,
        &pods,
    ))
}

/// Fetches the current state of the named pods on `node` (for a capture dispatched after an
/// operator restart); pods that vanished or moved are reported as skipped.
pub async fn refresh_targets(
    client: &kube::Client,
    namespace: &str,
    node: &str,
    pod_names: &[String],
) -> Result<(Vec<TargetPod>, Vec<(String, String)>)> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let mut targets = Vec::new();
    let mut vanished = Vec::new();
    for name in pod_names {
        match api
            .get_opt(name)
            .await
            .map_err(Error::kube(format!("getting pod {namespace}/{name}")))?
        {
            None => vanished.push((name.clone(), "deleted".to_string())),
            Some(pod) => match target_of(&pod, namespace) {
                Ok(t) if t.node == node => targets.push(t),
                Ok(t) => vanished.push((name.clone(), format!("now on node {}", t.node))),
                Err(why) => vanished.push((name.clone(), why)),
            },
        }
    }
    Ok((targets, vanished))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(ns: &str, name: &str, app: &str, node: Option<&str>, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"), "labels": {"app": app}},
            "spec": {"nodeName": node, "containers": [{"name": "c"}]},
            "status": {"phase": phase, "podIP": "10.0.0.1", "containerStatuses": [{
                "name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                "containerID": format!("containerd://{name}"), "state": {"running": {}}
            }]}
        }))
        .unwrap()
    }

    fn app_selector(app: &str) -> Selector {
        Selector::from_iter([("app".to_string(), app.to_string())])
    }

    #[test]
    fn groups_running_selected_pods_by_node() {
        let pods = [
            pod("a", "web-2", "web", Some("n2"), "Running"),
            pod("a", "web-1", "web", Some("n1"), "Running"),
            pod("a", "web-3", "web", Some("n1"), "Running"),
            pod("a", "db-1", "db", Some("n1"), "Running"),
        ];
        let r = select_targets("a", Some(&app_selector("web")), &[], &pods);
        assert_eq!(r.pod_count(), 3);
        let n1: Vec<_> = r.by_node["n1"].iter().map(|t| t.name.as_str()).collect();
        assert_eq!(n1, ["web-1", "web-3"]);
        assert_eq!(
            r.by_node["n2"][0].containers[0].container_id,
            "containerd://web-2"
        );
        assert!(r.skipped.is_empty());
    }

    #[test]
    fn skips_pods_not_running_or_unscheduled_and_says_why() {
        let pods = [
            pod("a", "pending", "web", Some("n1"), "Pending"),
            pod("a", "nowhere", "web", None, "Running"),
        ];
        let r = select_targets("a", Some(&app_selector("web")), &["ghost".into()], &pods);
        assert_eq!(r.pod_count(), 0);
        let msg = r.no_match_message("a");
        assert!(
            msg.contains("pending: phase is Pending, expected Running"),
            "{msg}"
        );
        assert!(msg.contains("nowhere: not scheduled"), "{msg}");
        assert!(msg.contains("ghost: no such pod in namespace a"), "{msg}");
    }

    #[test]
    fn never_targets_pods_of_another_namespace() {
        let pods = [pod("b", "web-1", "web", Some("n1"), "Running")];
        let r = select_targets("a", Some(&app_selector("web")), &["web-1".into()], &pods);
        assert_eq!(r.pod_count(), 0);
        assert!(r.skipped[0].1.contains("not the request's namespace a"));
    }

    #[test]
    fn pod_names_add_to_the_selector_without_duplicates() {
        let pods = [
            pod("a", "web-1", "web", Some("n1"), "Running"),
            pod("a", "db-1", "db", Some("n1"), "Running"),
        ];
        let r = select_targets(
            "a",
            Some(&app_selector("web")),
            &["db-1".into(), "web-1".into()],
            &pods,
        );
        assert_eq!(r.pod_count(), 2);
        let empty = select_targets("a", None, &[], &pods);
        assert_eq!(empty.pod_count(), 0);
        assert!(
            empty
                .no_match_message("a")
                .contains("no pods in namespace a match")
        );
    }
}
