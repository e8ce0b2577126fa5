//! Writing a ProfileRequest's status with server-side apply.

use flamefleet_api::ProfileRequest;
use flamefleet_api::ProfileRequestStatus;
use flamefleet_api::status_apply::{OPERATOR_FIELD_MANAGER, status_apply_body};
use kube::api::{Api, Patch, PatchParams};

use crate::{Error, Result};

/// Applies `status` as the complete status of the request.
///
/// Forced: the operator is the only writer of ProfileRequest status (agents report over the
/// `Capture` stream and have no access to ProfileRequests), so any other manager's field is
/// stale — e.g. a node entry an agent of an older version wrote.
pub async fn apply(
    api: &Api<ProfileRequest>,
    name: &str,
    status: &ProfileRequestStatus,
) -> Result<ProfileRequest> {
    let body = status_apply_body(name, status)?;
    let params = PatchParams::apply(OPERATOR_FIELD_MANAGER).force();
    api.patch_status(name, &params, &Patch::Apply(body))
        .await
        .map_err(Error::kube(format!(
            "applying the status of ProfileRequest {name}"
        )))
}
