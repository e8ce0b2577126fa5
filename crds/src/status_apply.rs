//! Server-side-apply bodies and field-manager names for status writes.
//!
//! Every writer of `ProfileRequest` status applies only the fields it owns, with its own
//! field manager, through the status subresource. `status.nodes` is a list-map keyed by
//! `node`, so agents applying different node entries never overwrite each other:
//!
//! ```text
//! let body = node_status_apply_body("checkout-cpu", entry)?;
//! api.patch_status("checkout-cpu", &PatchParams::apply(&agent_field_manager(node)), &Patch::Apply(body)).await?;
//! ```
//!
//! Ownership rules that keep applies conflict-free (checked by `e2e/tests/api.rs`):
//! - An apply owns exactly the fields it sends; sending a field with the same value as
//!   another manager shares it, a different value conflicts (HTTP 409) unless forced.
//! - The operator may create each node's entry with `node` and `pods`; the agent of that node
//!   then sends `node`, `pods` (same values), `phase`, `message` and `artifacts`. The operator
//!   must not send a node entry's `phase` once the agent owns it.
//! - An apply that omits an entry it sent before releases only its own fields of that entry;
//!   the entry disappears when no manager owns any of its fields.
//! - Use `force()` only for fields a writer alone owns (e.g. the operator's `phase`).

use kube::Resource;
use serde_json::{Value, json};

use crate::profile_request::{NodeStatus, ProfileRequest, ProfileRequestStatus};
use crate::{Error, Result};

/// Field manager of the operator.
pub const OPERATOR_FIELD_MANAGER: &str = "flamefleet-operator";

/// Field manager of the agent on `node`: `flamefleet-agent.<node>`.
pub fn agent_field_manager(node: &str) -> String {
    format!("flamefleet-agent.{node}")
}

/// An apply body for `ProfileRequest` `name` holding only `status` (with apiVersion and kind,
/// as server-side apply requires). Send it to the status subresource.
///
/// # Errors
/// [`Error::Json`] if the status cannot be serialized (it always can in practice).
pub fn status_apply_body(name: &str, status: &ProfileRequestStatus) -> Result<Value> {
    let status = serde_json::to_value(status).map_err(|source| Error::Json {
        what: format!("status of ProfileRequest {name}"),
        source,
    })?;
    Ok(json!({
        "apiVersion": ProfileRequest::api_version(&()),
        "kind": ProfileRequest::kind(&()),
        "metadata": {"name": name},
        "status": status,
    }))
}

/// An apply body setting only the `status.nodes[]` entry of `entry.node`, for an agent.
///
/// # Errors
/// As [`status_apply_body`].
pub fn node_status_apply_body(name: &str, entry: NodeStatus) -> Result<Value> {
    status_apply_body(
        name,
        &ProfileRequestStatus {
            nodes: vec![entry],
            ..Default::default()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::phase::NodePhase;

    #[test]
    fn node_body_carries_type_meta_and_only_the_node_entry() {
        let body = node_status_apply_body(
            "req",
            NodeStatus {
                node: "worker-1".into(),
                phase: Some(NodePhase::Succeeded),
                pods: vec!["p".into()],
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            body,
            json!({
                "apiVersion": "flamefleet.dev/v1alpha1",
                "kind": "ProfileRequest",
                "metadata": {"name": "req"},
                "status": {"nodes": [{"node": "worker-1", "phase": "Succeeded", "pods": ["p"]}]},
            })
        );
        assert_eq!(agent_field_manager("worker-1"), "flamefleet-agent.worker-1");
    }
}
