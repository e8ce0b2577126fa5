//! `ProfileResultSlice`: up to [`MAX_NODES_PER_SLICE`] nodes' results of one ProfileRequest.
//!
//! A request's per-node results live in slices, the way a Service's endpoints live in
//! EndpointSlices: the request's status stays small whatever the fleet size (counts, a
//! bounded list of failures, the summary), and a result changes one slice of at most 100
//! entries instead of one status holding thousands (docs/results.md has the measurements).
//!
//! Slices have no spec/status split: like an EndpointSlice they are a record, written only
//! by the operator (field manager `flamefleet-operator`), never by users or agents. Agents
//! report over the mTLS `Capture` stream, whose certificate names their node, and the
//! operator records a node's outcome only from that node's connection.
//!
//! Naming and labels are deterministic so that a restarted operator, the CLI and tests find
//! a request's slices with one label-selected list:
//! - name `<request uid>-<index>` (index from 0; unique across requests, whatever their
//!   names, since UIDs are);
//! - label [`REQUEST_UID_LABEL`] `=<uid>` always, [`REQUEST_LABEL`] `=<name>` when the name is
//!   a valid label value (at most 63 characters);
//! - an ownerReference to the request (`controller: true`, `blockOwnerDeletion: true`) so
//!   the garbage collector deletes them with it; the operator's finalizer also deletes them.

// Each `printcolumn(...)` repeats the same keys, which clippy mistakes for duplicates.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{CustomResource, KubeSchema, Resource};
use serde::{Deserialize, Serialize};

use crate::phase::NodePhase;
use crate::profile_request::{NodeCounts, NodeStatus, ProfileRequest};

/// Most node entries one slice holds (the schema's `maxItems`).
///
/// 100 entries of a few artifacts each stay far below the API server's object size limit
/// (about 40 KiB measured with 3 artifacts per node, docs/results.md), so a slice never
/// approaches the 1.5 MiB etcd limit, and a 5,000-node request needs 50 slices.
pub const MAX_NODES_PER_SLICE: usize = 100;

/// Label naming the ProfileRequest a slice belongs to (omitted for names over 63 chars).
pub const REQUEST_LABEL: &str = "flamefleet.dev/request";
/// Label holding the UID of the ProfileRequest a slice belongs to.
pub const REQUEST_UID_LABEL: &str = "flamefleet.dev/request-uid";

/// Up to 100 nodes' results of one ProfileRequest. Written only by the operator.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "flamefleet.dev",
    version = "v1alpha1",
    kind = "ProfileResultSlice",
    namespaced,
    no_spec,
    shortname = "prslice",
    category = "flamefleet",
    derive = "PartialEq",
    doc = "Up to 100 nodes' results (phase, pods, message, artifacts) of one ProfileRequest; written only by the operator",
    printcolumn(name = "Request", type_ = "string", json_path = ".request.name"),
    printcolumn(name = "Nodes", type_ = "integer", json_path = ".nodeCounts.total"),
    printcolumn(
        name = "Succeeded",
        type_ = "integer",
        json_path = ".nodeCounts.succeeded"
    ),
    printcolumn(name = "Failed", type_ = "integer", json_path = ".nodeCounts.failed"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ProfileResultSliceFields {
    /// The ProfileRequest these results belong to.
    pub request: RequestReference,
    /// Counts of `nodes` by phase (the printer columns).
    #[serde(default)]
    pub node_counts: NodeCounts,
    /// One entry per node, keyed by `node`; at most 100.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["node".into()]))]
    pub nodes: Vec<NodeStatus>,
}

/// Name and UID of a ProfileRequest.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RequestReference {
    /// The request's name (same namespace as the slice).
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The request's UID.
    #[schemars(length(min = 1, max = 64))]
    pub uid: String,
}

/// The name of slice `index` of the request with UID `uid`.
pub fn slice_name(uid: &str, index: usize) -> String {
    format!("{uid}-{index}")
}

/// The index a slice's name carries, if it is a slice name of `uid`.
pub fn slice_index(uid: &str, name: &str) -> Option<usize> {
    name.strip_prefix(uid)?.strip_prefix('-')?.parse().ok()
}

/// The label selector of every slice of the request with UID `uid`.
pub fn selector_for(uid: &str) -> String {
    format!("{REQUEST_UID_LABEL}={uid}")
}

/// True when `value` may be a label value: at most 63 characters, alphanumerics with `-`,
/// `_` and `.` inside.
pub fn is_label_value(value: &str) -> bool {
    let bytes = value.as_bytes();
    let edge = |b: &u8| b.is_ascii_alphanumeric();
    value.len() <= 63
        && (bytes.is_empty()
            || (bytes.first().is_some_and(edge)
                && bytes.last().is_some_and(edge)
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))))
}

impl NodeCounts {
    /// Counts `nodes` by phase (no phase counts as pending).
    pub fn of<'a>(nodes: impl IntoIterator<Item = &'a NodeStatus>) -> Self {
        let mut counts = Self::default();
        for n in nodes {
            counts.add(n.phase, 1);
        }
        counts
    }

    /// Adds `by` (negative to remove) nodes of `phase`.
    pub fn add(&mut self, phase: Option<NodePhase>, by: i32) {
        self.total += by;
        match phase.unwrap_or(NodePhase::Pending) {
            NodePhase::Pending => self.pending += by,
            NodePhase::Running => self.running += by,
            NodePhase::Succeeded => self.succeeded += by,
            NodePhase::Failed => self.failed += by,
        }
    }

    /// Nodes without a terminal phase.
    pub fn unfinished(&self) -> i32 {
        self.pending + self.running
    }
}

impl ProfileResultSlice {
    /// Slice `index` of `request` holding `nodes`, with its labels and ownerReference.
    ///
    /// # Errors
    /// [`crate::Error::MissingMetadata`] when the request has no name, namespace or UID (it
    /// was not read from the API server).
    pub fn for_request(
        request: &ProfileRequest,
        index: usize,
        nodes: Vec<NodeStatus>,
    ) -> crate::Result<Self> {
        let meta = &request.metadata;
        let name = meta
            .name
            .clone()
            .ok_or(crate::Error::MissingMetadata("name"))?;
        let uid = meta
            .uid
            .clone()
            .ok_or(crate::Error::MissingMetadata("uid"))?;
        let namespace = meta
            .namespace
            .clone()
            .ok_or(crate::Error::MissingMetadata("namespace"))?;
        let mut labels = BTreeMap::from([(REQUEST_UID_LABEL.to_string(), uid.clone())]);
        if is_label_value(&name) {
            labels.insert(REQUEST_LABEL.to_string(), name.clone());
        }
        let owner = OwnerReference {
            api_version: ProfileRequest::api_version(&()).into_owned(),
            kind: ProfileRequest::kind(&()).into_owned(),
            name: name.clone(),
            uid: uid.clone(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        };
        Ok(Self {
            metadata: ObjectMeta {
                name: Some(slice_name(&uid, index)),
                namespace: Some(namespace),
                labels: Some(labels),
                owner_references: Some(vec![owner]),
                ..Default::default()
            },
            spec: ProfileResultSliceFields {
                request: RequestReference { name, uid },
                node_counts: NodeCounts::of(&nodes),
                nodes,
            },
        })
    }

    /// The server-side-apply body of this slice: apiVersion, kind, metadata (name, labels,
    /// ownerReferences) and the fields.
    ///
    /// # Errors
    /// [`crate::Error::Json`] if it cannot be serialized (it always can in practice).
    pub fn apply_body(&self) -> crate::Result<serde_json::Value> {
        let mut body = serde_json::to_value(self).map_err(|source| crate::Error::Json {
            what: format!(
                "ProfileResultSlice {}",
                self.metadata.name.as_deref().unwrap_or("")
            ),
            source,
        })?;
        if let Some(meta) = body.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            // The namespace comes from the URL; everything else an apply may claim.
            meta.remove("namespace");
        }
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    fn request(name: &str) -> ProfileRequest {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": name, "namespace": "shop", "uid": "0c7e3a40-0000-4000-8000-000000000001"},
            "spec": {"type": "cpu", "podNames": ["p"], "duration": "1s"},
        }))
        .unwrap()
    }

    #[test]
    fn slice_carries_labels_owner_and_counts_at_the_top_level() {
        let nodes = vec![
            NodeStatus {
                node: "a".into(),
                phase: Some(NodePhase::Succeeded),
                ..Default::default()
            },
            NodeStatus {
                node: "b".into(),
                ..Default::default()
            },
        ];
        let slice = ProfileResultSlice::for_request(&request("web"), 3, nodes).unwrap();
        let body = slice.apply_body().unwrap();
        assert_eq!(body["apiVersion"], "flamefleet.dev/v1alpha1");
        assert_eq!(body["kind"], "ProfileResultSlice");
        assert_eq!(
            body["metadata"]["name"],
            "0c7e3a40-0000-4000-8000-000000000001-3"
        );
        assert!(body["metadata"].get("namespace").is_none());
        assert_eq!(body["metadata"]["labels"][REQUEST_LABEL], "web");
        let owner = &body["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "ProfileRequest");
        assert_eq!(owner["controller"], true);
        assert_eq!(owner["blockOwnerDeletion"], true);
        assert_eq!(body["request"]["name"], "web");
        assert!(body.get("spec").is_none(), "{body}");
        assert_eq!(
            body["nodeCounts"],
            serde_json::json!({"total": 2, "pending": 1, "running": 0, "succeeded": 1, "failed": 0})
        );
        assert_eq!(body["nodes"][1], serde_json::json!({"node": "b"}));
    }

    #[test]
    fn long_request_names_get_no_name_label() {
        let long = "r".repeat(64);
        let slice = ProfileResultSlice::for_request(&request(&long), 0, Vec::new()).unwrap();
        let labels = slice.metadata.labels.unwrap();
        assert!(!labels.contains_key(REQUEST_LABEL));
        assert!(labels.contains_key(REQUEST_UID_LABEL));
        assert!(is_label_value("web-1.a_b"));
        assert!(!is_label_value("-web"));
    }

    #[test]
    fn names_round_trip_to_indexes() {
        let uid = "0c7e3a40-0000-4000-8000-000000000001";
        assert_eq!(slice_index(uid, &slice_name(uid, 12)), Some(12));
        assert_eq!(slice_index(uid, "other-1"), None);
        assert_eq!(slice_index(uid, &format!("{uid}-x")), None);
    }

    #[test]
    fn a_full_slice_stays_far_below_the_object_size_limit() {
        use crate::profile_request::Artifact;
        let nodes: Vec<NodeStatus> = (0..MAX_NODES_PER_SLICE)
            .map(|i| {
                let node = format!(
                    "ip-10-20-{}-{}.eu-west-1.compute.internal",
                    i / 256,
                    i % 256
                );
                NodeStatus {
                    node: node.clone(),
                    phase: Some(NodePhase::Succeeded),
                    pods: (0..4)
                        .map(|p| format!("checkout-7d9f8c6b5-{p:05}"))
                        .collect(),
                    artifacts: ["cpu", "heap", "runqlat"]
                        .iter()
                        .map(|t| Artifact {
                            name: format!("{t}-{node}.pb.gz"),
                            size_bytes: Some(48_213),
                            sha256: Some("ab".repeat(32)),
                            samples: Some(2950),
                            sample_type: Some("cpu/nanoseconds".into()),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                }
            })
            .collect();
        let slice = ProfileResultSlice::for_request(&request("checkout-cpu"), 0, nodes).unwrap();
        let bytes = serde_json::to_vec(&slice).unwrap().len();
        // 100 nodes, 4 pods and 3 artifacts each: about 100 KB, under the 256 KiB we aim
        // for and far under etcd's 1.5 MiB (docs/results.md).
        assert!(bytes < 256 * 1024, "{bytes} bytes");
        eprintln!("a full slice: {bytes} bytes");
    }

    #[test]
    fn schema_bounds_nodes_and_has_no_spec() {
        let crd = ProfileResultSlice::crd();
        let schema = serde_json::to_value(
            crd.spec.versions[0]
                .schema
                .as_ref()
                .unwrap()
                .open_api_v3_schema
                .as_ref()
                .unwrap(),
        )
        .unwrap();
        let props = &schema["properties"];
        assert!(props.get("spec").is_none(), "{props}");
        assert_eq!(props["nodes"]["maxItems"], 100);
        assert_eq!(props["nodes"]["x-kubernetes-list-type"], "map");
        assert!(crd.spec.versions[0].subresources.is_none());
    }
}
