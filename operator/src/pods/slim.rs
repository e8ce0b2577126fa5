//! The operator's cluster-wide pod cache: a watch-fed reflector of [`SlimPod`]s, the few
//! fields of a pod that fleet sampling, always-on profiling and agent discovery read.
//!
//! A `k8s_openapi` `Pod` is large even when emptied (its `PodSpec` and `PodStatus` are
//! inline structs of dozens of fields), and a watch of `Pod`s builds every pod in full
//! (managed fields, containers, conditions) only to drop most of it. `SlimPod` is
//! deserialized straight from the API server's JSON: the fields below are kept and every
//! other one is skipped by the reader. Heap per cached pod, `cargo bench -p
//! flamefleet-operator --bench fleet_selection` (docs/benchmarks.md).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::{Metadata, NamespaceResourceScope, Resource};
use serde::{Deserialize, Deserializer};

/// What the operator caches of a pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlimPod {
    /// Name, namespace, UID, resource version, labels and deletion timestamp only.
    pub metadata: ObjectMeta,
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// `status.phase`.
    pub phase: Option<String>,
    /// `status.podIP`.
    pub ip: Option<String>,
    /// The `Ready` condition is `True`.
    pub ready: bool,
    /// The first container port named `grpc` (what an agent pod serves on).
    pub grpc_port: Option<i32>,
    /// The running containers (`status.containerStatuses` with `state.running` and an ID):
    /// what an always-on window names its samples' containers by.
    pub containers: Vec<SlimContainer>,
}

/// A running container of a [`SlimPod`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlimContainer {
    /// `name`.
    pub name: String,
    /// `containerID` (`<runtime>://<id>`).
    pub id: String,
}

impl SlimPod {
    /// The pod's namespace, or "".
    pub fn namespace(&self) -> &str {
        self.metadata.namespace.as_deref().unwrap_or_default()
    }

    /// The pod's name, or "".
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.metadata.labels.as_ref()?.get(key).map(String::as_str)
    }

    /// Running, with a pod IP, and not being deleted.
    pub fn is_running_with_ip(&self) -> bool {
        self.phase.as_deref() == Some("Running")
            && self.ip.as_deref().is_some_and(|ip| !ip.is_empty())
            && self.metadata.deletion_timestamp.is_none()
    }
}

impl Resource for SlimPod {
    const API_VERSION: &'static str = "v1";
    const GROUP: &'static str = "";
    const KIND: &'static str = "Pod";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "pods";
    type Scope = NamespaceResourceScope;
}

impl Metadata for SlimPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

// The wire shapes: only the kept fields are named; serde skips the others (including
// `managedFields`, the containers' other fields and every other condition's text).

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct WireMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    deletion_timestamp: Option<Time>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WirePort {
    name: Option<String>,
    #[serde(rename = "containerPort")]
    container_port: i32,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WireContainer {
    ports: Option<Vec<WirePort>>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct WireSpec {
    node_name: Option<String>,
    containers: Vec<WireContainer>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WireCondition {
    #[serde(rename = "type")]
    type_: String,
    status: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WireState {
    /// Only whether it is there: its `startedAt` is skipped.
    running: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct WireContainerStatus {
    name: String,
    #[serde(rename = "containerID")]
    container_id: Option<String>,
    state: Option<WireState>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct WireStatus {
    phase: Option<String>,
    #[serde(rename = "podIP")]
    pod_ip: Option<String>,
    conditions: Option<Vec<WireCondition>>,
    container_statuses: Option<Vec<WireContainerStatus>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WirePod {
    metadata: WireMeta,
    spec: Option<WireSpec>,
    status: Option<WireStatus>,
}

impl From<WirePod> for SlimPod {
    fn from(p: WirePod) -> Self {
        let m = p.metadata;
        let spec = p.spec.unwrap_or_default();
        let status = p.status.unwrap_or_default();
        let grpc_port = spec
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .find(|port| port.name.as_deref() == Some(super::GRPC_PORT_NAME))
            .map(|port| port.container_port);
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let containers = status
            .container_statuses
            .into_iter()
            .flatten()
            .filter(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            .filter_map(|c| {
                let id = c.container_id.filter(|id| !id.is_empty())?;
                Some(SlimContainer { name: c.name, id })
            })
            .collect();
        SlimPod {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                uid: m.uid,
                resource_version: m.resource_version,
                labels: m.labels,
                deletion_timestamp: m.deletion_timestamp,
                ..ObjectMeta::default()
            },
            node: spec.node_name,
            phase: status.phase,
            ip: status.pod_ip,
            ready,
            grpc_port,
            containers,
        }
    }
}

impl<'de> Deserialize<'de> for SlimPod {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        WirePod::deserialize(deserializer).map(SlimPod::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keeps_what_the_operator_reads() {
        let pod: SlimPod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "agent-x", "namespace": "flamefleet", "uid": "u1", "resourceVersion": "7",
                "labels": {"app.kubernetes.io/name": "flamefleet-agent"},
                "annotations": {"big": "x".repeat(1000)},
                "managedFields": [{"manager": "kubelet", "operation": "Update",
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}]
            },
            "spec": {"nodeName": "n1", "containers": [
                {"name": "side", "image": "i", "ports": [{"name": "metrics", "containerPort": 9}]},
                {"name": "agent", "image": "i", "ports": [{"name": "grpc", "containerPort": 7070}]}
            ]},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True", "lastTransitionTime": null}
            ], "containerStatuses": [
                {"name": "agent", "ready": true, "containerID": "containerd://a1",
                 "state": {"running": {"startedAt": "2026-11-26T00:00:00Z"}}},
                {"name": "side", "ready": false, "containerID": "containerd://b2",
                 "state": {"terminated": {"exitCode": 1}}},
                {"name": "init-less", "ready": false, "state": {"waiting": {"reason": "x"}}}
            ]}
        }))
        .unwrap();
        assert_eq!(pod.name(), "agent-x");
        assert_eq!(pod.namespace(), "flamefleet");
        assert_eq!(pod.metadata.uid.as_deref(), Some("u1"));
        assert_eq!(pod.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(
            pod.label("app.kubernetes.io/name"),
            Some("flamefleet-agent")
        );
        assert!(pod.metadata.annotations.is_none());
        assert!(pod.metadata.managed_fields.is_none());
        assert_eq!(pod.node.as_deref(), Some("n1"));
        assert_eq!(pod.grpc_port, Some(7070));
        assert!(pod.ready);
        assert!(pod.is_running_with_ip());
        // Only the running container with an ID.
        assert_eq!(
            pod.containers,
            [SlimContainer {
                name: "agent".into(),
                id: "containerd://a1".into()
            }]
        );
    }

    #[test]
    fn a_bare_pod_has_nothing_set() {
        let pod: SlimPod = serde_json::from_value(json!({"metadata": {"name": "p"}})).unwrap();
        assert_eq!(pod.name(), "p");
        assert_eq!(pod.node, None);
        assert_eq!(pod.grpc_port, None);
        assert!(pod.containers.is_empty());
        assert!(!pod.ready);
        assert!(!pod.is_running_with_ip());
        let deleting: SlimPod = serde_json::from_value(json!({
            "metadata": {"name": "p", "deletionTimestamp": "2026-11-26T00:00:00Z"},
            "status": {"phase": "Running", "podIP": "10.0.0.2"}
        }))
        .unwrap();
        assert!(!deleting.is_running_with_ip());
    }
}
