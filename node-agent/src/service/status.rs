//! Writes this node's entry of a ProfileRequest's `status.nodes[]` with
//! server-side apply on the status subresource, as field manager
//! `flamefleet-agent.<node>`. The list is keyed by `node`, so agents of other
//! nodes keep their entries; the patch carries only this node's entry.
//!
//! The apply is forced: the operator may have written the first Pending or
//! Running version of this entry, and from the agent's report on the agent is
//! the sole owner of it (the operator never writes it again).

use std::time::Duration;

use flamefleet_api::status_apply::{agent_field_manager, node_status_apply_body};
use flamefleet_api::{Artifact, NodePhase, NodeStatus, ProfileRequest};
use kube::Api;
use kube::api::{Patch, PatchParams};

/// Timeout of one status write.
const WRITE_TIMEOUT: Duration = Duration::from_secs(15);

/// Why the status could not be written.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// The apply body could not be built.
    #[error(transparent)]
    Body(#[from] flamefleet_api::Error),
    /// The API server refused or could not be reached.
    #[error(
        "server-side apply of status.nodes[{node}] on ProfileRequest {namespace}/{name}: {source}"
    )]
    Apply {
        /// Request namespace.
        namespace: String,
        /// Request name.
        name: String,
        /// This node.
        node: String,
        /// kube's error (boxed: it is large and this is the rare path).
        source: Box<kube::Error>,
    },
    /// The API server did not answer in time.
    #[error(
        "server-side apply of status.nodes[{node}] on ProfileRequest {namespace}/{name} timed out after {WRITE_TIMEOUT:?}"
    )]
    Timeout {
        /// Request namespace.
        namespace: String,
        /// Request name.
        name: String,
        /// This node.
        node: String,
    },
}

/// The final report of one node, as written to the status.
#[derive(Debug, Clone)]
pub struct NodeReport {
    /// Succeeded or Failed.
    pub phase: NodePhase,
    /// Names of the pods captured.
    pub pods: Vec<String>,
    /// Empty on success; the reason on failure.
    pub message: String,
    /// What was uploaded.
    pub artifacts: Vec<Artifact>,
}

/// Writes status entries for one node.
#[derive(Clone)]
pub struct StatusWriter {
    client: kube::Client,
    node: String,
}

impl std::fmt::Debug for StatusWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusWriter")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl StatusWriter {
    /// A writer for `node` using `client`.
    pub fn new(client: kube::Client, node: impl Into<String>) -> Self {
        Self {
            client,
            node: node.into(),
        }
    }

    /// The body applied for `report` (exposed for logging and tests).
    ///
    /// # Errors
    /// [`StatusError::Body`] if it cannot be serialized.
    pub fn body(&self, name: &str, report: &NodeReport) -> Result<serde_json::Value, StatusError> {
        let entry = NodeStatus {
            node: self.node.clone(),
            phase: Some(report.phase),
            pods: report.pods.clone(),
            message: Some(report.message.clone()).filter(|m| !m.is_empty()),
            artifacts: report.artifacts.clone(),
        };
        Ok(node_status_apply_body(name, entry)?)
    }

    /// Applies `report` as this node's entry of `namespace/name`.
    ///
    /// # Errors
    /// [`StatusError::Apply`] when the API server refuses (e.g. the request was
    /// deleted) and [`StatusError::Timeout`] when it does not answer in time.
    pub async fn write(
        &self,
        namespace: &str,
        name: &str,
        report: &NodeReport,
    ) -> Result<(), StatusError> {
        let body = self.body(name, report)?;
        let api: Api<ProfileRequest> = Api::namespaced(self.client.clone(), namespace);
        let params = PatchParams::apply(&agent_field_manager(&self.node)).force();
        let patch = Patch::Apply(body);
        let write = api.patch_status(name, &params, &patch);
        match tokio::time::timeout(WRITE_TIMEOUT, write).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(source)) => Err(StatusError::Apply {
                namespace: namespace.into(),
                name: name.into(),
                node: self.node.clone(),
                source: Box::new(source),
            }),
            Err(_) => Err(StatusError::Timeout {
                namespace: namespace.into(),
                name: name.into(),
                node: self.node.clone(),
            }),
        }
    }
}
