//! Pre-signed upload slots: one per artifact the agent of a node produces for a profile type.

use std::time::Duration;

use flamefleet_api::ProfileType;
use flamefleet_proto::agent::{UploadSlot, artifact_names};

use crate::Result;
use crate::store::{ArtifactStore, RequestRef, UploadLimits};

/// Limits of upload URLs. (Download URLs are never recorded in a status: users ask for
/// short-lived ones with a ProfileDownload.)
#[derive(Debug, Clone)]
pub struct UrlPolicy {
    /// Largest artifact accepted, bytes.
    pub max_bytes: u64,
}

/// Signs one upload slot per artifact of `node`; the PUT URLs live for `upload_ttl` (the
/// capture's deadline plus a margin, so an agent finishing late can still upload).
pub async fn upload_slots(
    store: &dyn ArtifactStore,
    request: &RequestRef,
    profile_type: ProfileType,
    node: &str,
    policy: &UrlPolicy,
    upload_ttl: Duration,
) -> Result<Vec<UploadSlot>> {
    let mut slots = Vec::new();
    for name in artifact_names(super::wire::proto_type(profile_type), node) {
        let key = request.artifact(name.clone())?;
        let limits = UploadLimits {
            max_bytes: policy.max_bytes,
            sha256: None,
            ttl: upload_ttl,
        };
        let target = store.upload_target(&key, &limits).await?;
        slots.push(UploadSlot {
            artifact_name: name,
            put_url: target.url.to_string(),
            download_url: String::new(),
            max_bytes: target.max_bytes,
        });
    }
    Ok(slots)
}
