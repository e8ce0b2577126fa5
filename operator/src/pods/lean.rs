//! Listing pods without what the operator never reads: `metadata.managedFields` (and the
//! rest of the metadata besides name, namespace, uid, labels, annotations, owners and the
//! deletion timestamp).
//!
//! Every request lists its target pods (agents come from the pod cache, `pods::slim`).
//! Full `Pod`s would cost most of the operator's CPU per request in a 5,000-node fleet
//! (in a perf profile, `ManagedFieldsEntry`/`FieldsV1` and their timestamps alone ~20%,
//! pods ~35% with a dev build) and hold every pod's managed fields in memory while a
//! request starts. Here the unknown fields are skipped by the JSON reader instead of being
//! built and dropped. Spec and status stay the full `k8s_openapi` types, so the
//! callers keep working on `Pod`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::Resource as _;
use kube::api::ListParams;
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
    owner_references: Option<Vec<OwnerReference>>,
    deletion_timestamp: Option<Time>,
}

#[derive(Debug, Deserialize)]
struct LeanPod {
    #[serde(default)]
    metadata: LeanMeta,
    spec: Option<PodSpec>,
    status: Option<PodStatus>,
}

#[derive(Debug, Default, Deserialize)]
struct LeanListMeta {
    #[serde(rename = "continue")]
    continue_token: Option<String>,
}

#[derive(Debug, Deserialize)]
struct LeanList {
    #[serde(default)]
    metadata: LeanListMeta,
    #[serde(default)]
    items: Vec<LeanPod>,
}

/// Pods per LIST page (target pods here, agent pods in `agents` when the cache cannot
/// answer). At 5,000 pods one unpaged LIST held the whole response and all its pods at
/// once, tens of MiB for a moment that set the operator's peak memory. Pages are read one
/// after the other (one consistent snapshot, through the continue token).
pub const PAGE_SIZE: u32 = 500;

impl From<LeanPod> for Pod {
    fn from(p: LeanPod) -> Self {
        let m = p.metadata;
        Pod {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                uid: m.uid,
                resource_version: m.resource_version,
                labels: m.labels,
                annotations: m.annotations,
                owner_references: m.owner_references,
                deletion_timestamp: m.deletion_timestamp,
                ..ObjectMeta::default()
            },
            spec: p.spec,
            status: p.status,
        }
    }
}

/// Lists the pods of `namespace` matching `params`, without their managed fields (see the
/// module comment), in pages of [`PAGE_SIZE`] unless `params` sets a limit.
///
/// # Errors
/// The API server's or the transport's error, as `Api::list` would return it.
pub async fn list(
    client: &kube::Client,
    namespace: &str,
    params: &ListParams,
) -> Result<Vec<Pod>, kube::Error> {
    let mut params = params.clone();
    params.limit = params.limit.or(Some(PAGE_SIZE));
    let mut out = Vec::new();
    loop {
        let request = kube::core::Request::new(Pod::url_path(&(), Some(namespace)))
            .list(&params)
            .map_err(kube::Error::BuildRequest)?;
        let page: LeanList = client.request(request).await?;
        out.extend(page.items.into_iter().map(Pod::from));
        match page.metadata.continue_token.filter(|c| !c.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => return Ok(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keeps_what_the_operator_reads_and_drops_managed_fields() {
        let list: LeanList = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "9"},
            "items": [{
                "metadata": {
                    "name": "p", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                    "labels": {"app": "a"}, "annotations": {"k": "v"},
                    "deletionTimestamp": "2026-11-25T10:00:00Z",
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "o"}],
                    "managedFields": [{"manager": "kubelet", "operation": "Update",
                        "time": "2026-11-25T10:00:00Z", "fieldsType": "FieldsV1",
                        "fieldsV1": {"f:status": {"f:podIP": {}}}}]
                },
                "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [{"name": "grpc", "containerPort": 7070}]}]},
                "status": {"phase": "Running", "podIP": "10.0.0.1"}
            }]
        }))
        .unwrap();
        let pods: Vec<Pod> = list.items.into_iter().map(Pod::from).collect();
        assert_eq!(pods.len(), 1);
        let p = &pods[0];
        assert_eq!(p.metadata.name.as_deref(), Some("p"));
        assert_eq!(p.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(p.metadata.uid.as_deref(), Some("u"));
        assert_eq!(p.metadata.labels.as_ref().unwrap()["app"], "a");
        assert_eq!(p.metadata.annotations.as_ref().unwrap()["k"], "v");
        assert!(p.metadata.deletion_timestamp.is_some());
        assert_eq!(
            p.metadata.owner_references.as_ref().unwrap()[0].kind,
            "DaemonSet"
        );
        assert!(p.metadata.managed_fields.is_none());
        assert_eq!(p.spec.as_ref().unwrap().node_name.as_deref(), Some("n1"));
        assert_eq!(
            p.status.as_ref().unwrap().pod_ip.as_deref(),
            Some("10.0.0.1")
        );
    }
}
