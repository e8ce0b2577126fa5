//! Pods and Nodes as a kubelet would report them; there is no kubelet, so tests write the
//! status themselves.

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::{Error, Result, kube_err};

/// A container of a [`PodFixture`].
#[derive(Debug, Clone)]
pub struct ContainerFixture {
    /// Container name.
    pub name: String,
    /// Runtime container ID as the kubelet reports it, e.g. `containerd://<64 hex>`.
    pub container_id: String,
}

/// A pod to create in the Running phase on a given node.
#[derive(Debug, Clone, Default)]
pub struct PodFixture {
    /// Pod name.
    pub name: String,
    /// `spec.nodeName`.
    pub node: String,
    /// Pod labels.
    pub labels: Vec<(String, String)>,
    /// Containers with their runtime IDs.
    pub containers: Vec<ContainerFixture>,
}

impl PodFixture {
    /// A pod `name` on `node` with one container `app` whose ID is `container_id`.
    pub fn new(name: &str, node: &str, container_id: &str) -> Self {
        Self {
            name: name.into(),
            node: node.into(),
            labels: Vec::new(),
            containers: vec![ContainerFixture {
                name: "app".into(),
                container_id: container_id.into(),
            }],
        }
    }

    /// Adds a label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.push((key.into(), value.into()));
        self
    }
}

/// Creates the pod bound to its node and patches its status to Running with ready containers
/// carrying the given container IDs. Returns the pod as stored.
pub async fn create_running_pod(api: &Api<Pod>, fixture: &PodFixture) -> Result<Pod> {
    let labels: serde_json::Map<String, serde_json::Value> = fixture
        .labels
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    let containers: Vec<_> = fixture
        .containers
        .iter()
        .map(|c| json!({"name": c.name, "image": "registry.invalid/flamefleet-fixture:none"}))
        .collect();
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": fixture.name, "labels": labels},
        "spec": {"nodeName": fixture.node, "containers": containers},
    }))
    .map_err(|source| Error::Json {
        what: "the pod fixture",
        source,
    })?;
    api.create(&PostParams::default(), &pod)
        .await
        .map_err(kube_err(format!("creating pod {}", fixture.name)))?;

    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let statuses: Vec<_> = fixture
        .containers
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "image": "registry.invalid/flamefleet-fixture:none",
                "imageID": "",
                "containerID": c.container_id,
                "ready": true,
                "started": true,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            })
        })
        .collect();
    let status = json!({"status": {
        "phase": "Running",
        "hostIP": "127.0.0.1",
        "podIP": "127.0.0.1",
        "startTime": now,
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        "containerStatuses": statuses,
    }});
    api.patch_status(
        &fixture.name,
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await
    .map_err(kube_err(format!(
        "setting the status of pod {}",
        fixture.name
    )))
}

/// Creates Node `name` if it does not exist, Ready. Nodes are cluster-scoped: use names
/// unique to the test when the test cares about which pods a node has.
pub async fn ensure_node(api: &Api<Node>, name: &str) -> Result<Node> {
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
    }))
    .map_err(|source| Error::Json {
        what: "the node fixture",
        source,
    })?;
    match api.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(e) => return Err(kube_err(format!("creating node {name}"))(e)),
    }
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({"status": {"conditions": [{
        "type": "Ready", "status": "True", "reason": "FixtureReady",
        "lastHeartbeatTime": now, "lastTransitionTime": now,
    }]}});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(kube_err(format!("setting the status of node {name}")))
}
