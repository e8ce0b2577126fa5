//! Writing the operator's part of a ProfileRequest's status with server-side apply, and
//! telling which node entries an agent has written.

use std::collections::BTreeSet;

use flamefleet_api::ProfileRequest;
use flamefleet_api::ProfileRequestStatus;
use flamefleet_api::status_apply::{OPERATOR_FIELD_MANAGER, status_apply_body};
use kube::api::{Api, Patch, PatchParams};

use crate::{Error, Result};

/// Prefix of the agents' field managers (`flamefleet-agent.<node>`).
const AGENT_MANAGER_PREFIX: &str = "flamefleet-agent.";

/// Nodes whose agent has applied its own status entry (from `metadata.managedFields`).
pub fn agent_written_nodes(request: &ProfileRequest) -> BTreeSet<String> {
    request
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| m.subresource.as_deref() == Some("status"))
        .filter_map(|m| m.manager.as_deref()?.strip_prefix(AGENT_MANAGER_PREFIX))
        .map(str::to_string)
        .collect()
}

/// Applies `status` as the complete set of status fields the operator owns.
///
/// Normally not forced: if an agent wrote a node entry since `status` was computed, the API
/// server answers 409 Conflict and the reconcile is retried with fresh data, so the operator
/// never overwrites an agent's result. `force` is only for marking Failed a node whose agent
/// wrote a non-terminal phase and then died or timed out.
pub async fn apply(
    api: &Api<ProfileRequest>,
    name: &str,
    status: &ProfileRequestStatus,
    force: bool,
) -> Result<ProfileRequest> {
    let body = status_apply_body(name, status)?;
    let mut params = PatchParams::apply(OPERATOR_FIELD_MANAGER);
    if force {
        params = params.force();
    }
    api.patch_status(name, &params, &Patch::Apply(body))
        .await
        .map_err(Error::kube(format!(
            "applying the status of ProfileRequest {name}"
        )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finds_agent_managers_of_the_status_subresource_only() {
        let request: ProfileRequest = serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": "r", "managedFields": [
                {"manager": "flamefleet-operator", "operation": "Apply", "subresource": "status"},
                {"manager": "flamefleet-agent.n1", "operation": "Apply", "subresource": "status"},
                {"manager": "flamefleet-agent.n2", "operation": "Update"},
            ]},
            "spec": {"type": "cpu", "podNames": ["p"], "duration": "1s"}
        }))
        .unwrap();
        assert_eq!(
            agent_written_nodes(&request),
            BTreeSet::from(["n1".to_string()])
        );
    }
}
