//! Reading a ProfileRequest's per-node results: the one place that knows where they live.
//!
//! Today the results are the `status.nodes[]` entries. Everything that reads a request's
//! nodes or artifacts (the operator's sampling budget, the CLI's get/merge/list and fleet
//! views) goes through these functions, so that moving results into objects of their own
//! changes this module and its callers' one call, nothing else.

use crate::profile_request::{Artifact, NodeStatus, ProfileRequest};

/// The per-node results of `request` (empty before the operator resolved its nodes).
pub fn node_results(request: &ProfileRequest) -> &[NodeStatus] {
    request
        .status
        .as_ref()
        .map_or(&[][..], |s| s.nodes.as_slice())
}

/// Every artifact of `request`, node by node.
pub fn artifacts(request: &ProfileRequest) -> impl Iterator<Item = &Artifact> {
    node_results(request)
        .iter()
        .flat_map(|n| n.artifacts.iter())
}
