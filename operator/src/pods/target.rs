//! A pod as a capture targets it: the fields the agent needs to find its processes (UID,
//! node, running containers with their runtime IDs, IP and annotations for heap endpoints).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

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
    })
}
