//! Server-side-apply bodies and the field-manager name for status writes.
//!
//! The operator is the only writer of `ProfileRequest` status and of `ProfileResultSlice`s:
//! agents report their results over the gRPC `Capture` stream and have no access to either,
//! so a node cannot forge another node's entry (the API server's RBAC enforces it). The operator applies the
//! whole status, with its field manager, through the status subresource.

use kube::Resource;
use serde_json::{Value, json};

use crate::profile_request::{ProfileRequest, ProfileRequestStatus};
use crate::{Error, Result};

/// Field manager of the operator.
pub const OPERATOR_FIELD_MANAGER: &str = "flamefleet-operator";

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::phase::RequestPhase;

    #[test]
    fn body_carries_type_meta_and_the_status() {
        let status = ProfileRequestStatus {
            phase: Some(RequestPhase::Running),
            node_count: Some(1),
            ..Default::default()
        };
        let body = status_apply_body("req", &status).unwrap();
        assert_eq!(
            body,
            json!({
                "apiVersion": "flamefleet.dev/v1alpha1",
                "kind": "ProfileRequest",
                "metadata": {"name": "req"},
                "status": {"phase": "Running", "nodeCount": 1},
            })
        );
    }
}
