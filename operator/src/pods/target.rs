//! A pod as a capture targets it: the fields the agent needs to find its processes (UID,
//! node, running containers with their runtime IDs, IP and annotations for heap endpoints),
//! and the workload that owns it (for the export sink's resource attributes).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The controller that owns a pod, named as OpenTelemetry's Kubernetes semantic conventions
/// name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// The attribute that names it: `k8s.deployment.name`, `k8s.replicaset.name`,
    /// `k8s.statefulset.name`, `k8s.daemonset.name` or `k8s.job.name`.
    pub attribute: &'static str,
    /// Its name.
    pub name: String,
    /// The ReplicaSet between a Deployment and its pods.
    pub replica_set: Option<String>,
}

/// The label the Deployment controller puts on its ReplicaSets' pods: the ReplicaSet is
/// named `<deployment>-<hash>`.
const POD_TEMPLATE_HASH: &str = "pod-template-hash";

/// The pod's controlling owner as a [`Workload`] (`None`: no controller, or one of a kind
/// the conventions do not name). A Deployment is recognised the way the Collector's
/// `k8sattributes` processor does: a ReplicaSet owner named `<name>-<pod-template-hash>`.
pub fn workload_of(meta: &ObjectMeta) -> Option<Workload> {
    let owner = meta
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true))?;
    let group = owner.api_version.split('/').next().unwrap_or_default();
    let attribute = match (group, owner.kind.as_str()) {
        ("apps", "ReplicaSet") => {
            let hash = meta
                .labels
                .as_ref()
                .and_then(|l| l.get(POD_TEMPLATE_HASH))
                .filter(|h| !h.is_empty());
            let deployment = hash.and_then(|h| {
                owner
                    .name
                    .strip_suffix(h.as_str())
                    .and_then(|n| n.strip_suffix('-'))
                    .filter(|n| !n.is_empty())
            });
            return Some(match deployment {
                Some(d) => Workload {
                    attribute: "k8s.deployment.name",
                    name: d.to_owned(),
                    replica_set: Some(owner.name.clone()),
                },
                None => Workload {
                    attribute: "k8s.replicaset.name",
                    name: owner.name.clone(),
                    replica_set: None,
                },
            });
        }
        ("apps", "StatefulSet") => "k8s.statefulset.name",
        ("apps", "DaemonSet") => "k8s.daemonset.name",
        ("batch", "Job") => "k8s.job.name",
        _ => return None,
    };
    Some(Workload {
        attribute,
        name: owner.name.clone(),
        replica_set: None,
    })
}

/// One container of a target pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetContainer {
    /// Container name.
    pub name: String,
    /// Runtime ID as the kubelet reports it, e.g. `containerd://<id>`.
    pub container_id: String,
}

/// A pod to profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetPod {
    /// Pod name.
    pub name: String,
    /// Pod namespace (always the request's).
    pub namespace: String,
    /// Pod UID.
    pub uid: String,
    /// `spec.nodeName`.
    pub node: String,
    /// Pod IP, if any.
    pub pod_ip: Option<String>,
    /// Running containers with their IDs.
    pub containers: Vec<TargetContainer>,
    /// Pod annotations (heap endpoints are found from them).
    pub annotations: BTreeMap<String, String>,
    /// The workload that owns the pod, when it has one the conventions name.
    pub workload: Option<Workload>,
}

/// Turns a pod into a target, or says why it cannot be one.
pub fn target_of(pod: &Pod, namespace: &str) -> Result<TargetPod, String> {
    let meta = &pod.metadata;
    if meta.namespace.as_deref() != Some(namespace) {
        return Err(format!(
            "in namespace {}, not the request's namespace {namespace}",
            meta.namespace.as_deref().unwrap_or("<none>")
        ));
    }
    if meta.deletion_timestamp.is_some() {
        return Err("being deleted".into());
    }
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Unknown");
    if phase != "Running" {
        return Err(format!("phase is {phase}, expected Running"));
    }
    let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
        return Err("not scheduled on a node (spec.nodeName is empty)".into());
    };
    let containers: Vec<TargetContainer> = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| c.state.as_ref().is_some_and(|st| st.running.is_some()))
        .filter_map(|c| {
            c.container_id.as_ref().map(|id| TargetContainer {
                name: c.name.clone(),
                container_id: id.clone(),
            })
        })
        .collect();
    if containers.is_empty() {
        return Err("no running container with a container ID".into());
    }
    Ok(TargetPod {
        name: meta.name.clone().unwrap_or_default(),
        namespace: namespace.to_string(),
        uid: meta.uid.clone().unwrap_or_default(),
        node,
        pod_ip: status.and_then(|s| s.pod_ip.clone()),
        containers,
        annotations: meta.annotations.clone().unwrap_or_default(),
        workload: workload_of(meta),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(kind: &str, api_version: &str, owner: &str, hash: Option<&str>) -> ObjectMeta {
        serde_json::from_value(serde_json::json!({
            "name": "p",
            "labels": hash.map(|h| serde_json::json!({POD_TEMPLATE_HASH: h})),
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": "not-a-controller", "uid": "0"},
                {"apiVersion": api_version, "kind": kind, "name": owner, "uid": "1", "controller": true},
            ],
        }))
        .unwrap()
    }

    #[test]
    fn deployments_are_named_from_their_replica_sets() {
        let w = workload_of(&meta("ReplicaSet", "apps/v1", "web-7d9f8b", Some("7d9f8b"))).unwrap();
        assert_eq!(
            (w.attribute, w.name.as_str(), w.replica_set.as_deref()),
            ("k8s.deployment.name", "web", Some("web-7d9f8b"))
        );
        // A bare ReplicaSet (no hash label, or a name without it) stays a ReplicaSet.
        for hash in [None, Some("other")] {
            let w = workload_of(&meta("ReplicaSet", "apps/v1", "web-7d9f8b", hash)).unwrap();
            assert_eq!(
                (w.attribute, w.name.as_str()),
                ("k8s.replicaset.name", "web-7d9f8b")
            );
        }
        let w = workload_of(&meta("ReplicaSet", "apps/v1", "7d9f8b", Some("7d9f8b"))).unwrap();
        assert_eq!(w.attribute, "k8s.replicaset.name");
    }

    #[test]
    fn other_controllers_by_kind_and_group() {
        let name = |kind, api| workload_of(&meta(kind, api, "w", None)).map(|w| w.attribute);
        assert_eq!(name("StatefulSet", "apps/v1"), Some("k8s.statefulset.name"));
        assert_eq!(name("DaemonSet", "apps/v1"), Some("k8s.daemonset.name"));
        assert_eq!(name("Job", "batch/v1"), Some("k8s.job.name"));
        // Same kind in another group: not Kubernetes' workload.
        assert_eq!(name("StatefulSet", "example.com/v1"), None);
        assert_eq!(name("Rollout", "argoproj.io/v1alpha1"), None);
        assert_eq!(workload_of(&ObjectMeta::default()), None);
    }
}
