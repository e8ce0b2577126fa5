//! Reading a ProfileRequest's per-node results: the one place that knows where they live.
//!
//! The results are the entries of the request's `ProfileResultSlice`s (see
//! [`crate::result_slice`]), found by the label `flamefleet.dev/request-uid=<uid>`.
//! Everything that reads a request's nodes or artifacts (the operator's sampling budget and
//! downloads, the CLI's get/merge/fleet views, the tests) goes through this module.

use std::collections::BTreeMap;

use kube::api::{Api, ListParams};

use crate::profile_request::{Artifact, NodeStatus, ProfileRequest};
use crate::result_slice::{ProfileResultSlice, selector_for, slice_index};

/// The per-node results of one request, by node name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestResults {
    /// Every node entry, by node.
    pub nodes: BTreeMap<String, NodeStatus>,
    /// How many slices were found.
    pub slices: usize,
    /// Slice indexes the request's status announces (`status.resultSlices`) but that were
    /// not found: the results of their nodes are missing.
    pub missing_slices: Vec<usize>,
}

impl RequestResults {
    /// The results held by `slices` (any order) of the request with UID `uid`; `expected`
    /// is the request's `status.resultSlices`, to tell which are missing.
    pub fn from_slices<'a>(
        uid: &str,
        slices: impl IntoIterator<Item = &'a ProfileResultSlice>,
        expected: Option<i32>,
    ) -> Self {
        let mut nodes = BTreeMap::new();
        let mut found = std::collections::BTreeSet::new();
        for slice in slices {
            if slice.spec.request.uid != uid {
                continue;
            }
            if let Some(i) = slice
                .metadata
                .name
                .as_deref()
                .and_then(|n| slice_index(uid, n))
            {
                found.insert(i);
            }
            for n in &slice.spec.nodes {
                nodes.insert(n.node.clone(), n.clone());
            }
        }
        let expected = expected.and_then(|e| usize::try_from(e).ok()).unwrap_or(0);
        Self {
            nodes,
            slices: found.len(),
            missing_slices: (0..expected).filter(|i| !found.contains(i)).collect(),
        }
    }

    /// Every artifact, node by node (node-name order).
    pub fn artifacts(&self) -> impl Iterator<Item = (&NodeStatus, &Artifact)> {
        self.nodes
            .values()
            .flat_map(|n| n.artifacts.iter().map(move |a| (n, a)))
    }

    /// True when the request announces slices that were not found.
    pub fn incomplete(&self) -> bool {
        !self.missing_slices.is_empty()
    }
}

/// Lists the slices of the request with UID `uid` in `namespace`.
///
/// # Errors
/// The API server's error (RBAC needs `list` on `profileresultslices`).
pub async fn list_slices(
    client: &kube::Client,
    namespace: &str,
    uid: &str,
) -> Result<Vec<ProfileResultSlice>, kube::Error> {
    let api: Api<ProfileResultSlice> = Api::namespaced(client.clone(), namespace);
    Ok(api
        .list(&ListParams::default().labels(&selector_for(uid)))
        .await?
        .items)
}

/// Reads the per-node results of `request` (one label-selected list of its slices).
///
/// A request without a UID or namespace (not read from the API server) has none.
///
/// # Errors
/// The API server's error.
pub async fn fetch(
    client: &kube::Client,
    request: &ProfileRequest,
) -> Result<RequestResults, kube::Error> {
    let (Some(namespace), Some(uid)) = (
        request.metadata.namespace.as_deref(),
        request.metadata.uid.as_deref(),
    ) else {
        return Ok(RequestResults::default());
    };
    let slices = list_slices(client, namespace, uid).await?;
    Ok(RequestResults::from_slices(
        uid,
        &slices,
        request.status.as_ref().and_then(|s| s.result_slices),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::phase::NodePhase;

    fn request() -> ProfileRequest {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": "r", "namespace": "ns", "uid": "u1"},
            "spec": {"type": "cpu", "podNames": ["p"], "duration": "1s"},
        }))
        .unwrap()
    }

    fn node(name: &str, artifacts: &[&str]) -> NodeStatus {
        NodeStatus {
            node: name.into(),
            phase: Some(NodePhase::Succeeded),
            artifacts: artifacts
                .iter()
                .map(|a| Artifact {
                    name: a.to_string(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn merges_slices_and_reports_the_missing_ones() {
        let r = request();
        let s0 = ProfileResultSlice::for_request(&r, 0, vec![node("b", &["b.pb.gz"])]).unwrap();
        let s2 = ProfileResultSlice::for_request(&r, 2, vec![node("a", &["a1", "a2"])]).unwrap();
        let results = RequestResults::from_slices("u1", [&s2, &s0], Some(3));
        assert_eq!(results.nodes.keys().collect::<Vec<_>>(), ["a", "b"]);
        let names: Vec<_> = results.artifacts().map(|(_, a)| a.name.as_str()).collect();
        assert_eq!(names, ["a1", "a2", "b.pb.gz"]);
        assert_eq!(results.slices, 2);
        assert_eq!(results.missing_slices, [1]);
        assert!(results.incomplete());
        // Another request's slice is ignored.
        let other = RequestResults::from_slices("u2", [&s0], None);
        assert!(other.nodes.is_empty() && !other.incomplete());
    }
}
