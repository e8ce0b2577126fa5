//! `ProfileDownload`: a user's request for short-lived download URLs of finished
//! ProfileRequests' artifacts.
//!
//! Why an object instead of URLs in the ProfileRequest status: the API server authorizes
//! the download at the moment it is asked for. Creating a `ProfileDownload` needs RBAC
//! `create` on `profiledownloads` in the namespace, and the `flamefleet-profile-download`
//! ValidatingAdmissionPolicy (`crds/policies/`) additionally requires `get` on the named
//! ProfileRequests (on all of the namespace's to name several at once, on the one named
//! otherwise), so revoking a user's access revokes their next download. The operator
//! answers in the status with URLs the store signed for a few minutes, sealed to the key
//! the client put in `spec.recipientKey` ([`crate::download_seal`]): other readers of the
//! object (anyone with `list` or `watch` on profiledownloads) see only ciphertext. No user
//! credential is ever sent to the store, and no long-lived URL is kept anywhere.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Most ProfileRequests one download may name.
pub const MAX_DOWNLOAD_REQUESTS: usize = 100;
/// Most nodes one download may name.
pub const MAX_DOWNLOAD_NODES: usize = 100;
/// Most URLs one answer holds: a larger answer is refused (name nodes, in batches), so the
/// status of a download stays far below the API server's object size limit.
pub const MAX_DOWNLOAD_URLS: usize = 500;

/// The ProfileRequests (of this namespace) whose artifacts to download.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "flamefleet.dev",
    version = "v1alpha1",
    kind = "ProfileDownload",
    namespaced,
    shortname = "pdl",
    category = "flamefleet",
    status = "ProfileDownloadStatus",
    derive = "PartialEq",
    doc = "A request for short-lived download URLs of ProfileRequests' artifacts, authorized by the API server when created",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    // A string, not a date: kubectl prints a future date as `<invalid>`.
    printcolumn(name = "Expires", type_ = "string", json_path = ".status.expiresAt"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.spec == oldSelf.spec").message("spec is immutable: create a new ProfileDownload")
)]
#[serde(rename_all = "camelCase")]
pub struct ProfileDownloadSpec {
    /// Names of ProfileRequests in this namespace.
    #[schemars(length(min = 1, max = 100), inner(length(min = 1, max = 253)))]
    #[x_kube(validation = Rule::new("self.all(n, n.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$'))").message("each entry must be a ProfileRequest name"))]
    pub requests: Vec<String>,
    /// Only the artifacts of these nodes (at most 100); every node's when empty. A request
    /// with more than 500 artifacts must be downloaded in batches of nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100), inner(length(min = 1, max = 253)))]
    pub nodes: Vec<String>,
    /// The asking client's one-use X25519 public key (base64): the operator seals the
    /// download URLs to it, so that only the process that created this object can read
    /// them ([`crate::download_seal`]).
    #[schemars(length(min = 44, max = 44), pattern(r"^[A-Za-z0-9+/]{43}=$"))]
    pub recipient_key: String,
}

/// Where the answer stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DownloadPhase {
    /// URLs are in the status until `expiresAt`.
    Ready,
    /// Nothing can be downloaded (see `message`).
    Failed,
    /// The URLs expired; the object is deleted soon.
    Expired,
}

/// The operator's answer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProfileDownloadStatus {
    /// Ready, Failed or Expired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<DownloadPhase>,
    /// When the URLs stop working.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
    /// PEM CA certificate(s) of the store's TLS certificate when it is not publicly trusted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<String>,
    /// The URLs (a JSON [`SealedUrls`]), sealed to `spec.recipientKey`: base64 of the
    /// operator's ephemeral public key, the ciphertext and its tag
    /// ([`crate::download_seal`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed_urls: Option<String>,
    /// How many URLs the sealed answer holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_count: Option<i32>,
    /// Named requests that have nothing to download, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedRequest>,
    /// Why the download failed, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// `Ready` (true once answered).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// What `status.sealedUrls` opens to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SealedUrls {
    /// One URL per artifact of the named requests.
    pub artifacts: Vec<DownloadUrl>,
}

/// A signed URL of one artifact.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DownloadUrl {
    /// The ProfileRequest.
    pub request: String,
    /// The artifact's name (as in the request's status).
    pub name: String,
    /// Where to GET it until `expiresAt`.
    pub url: String,
}

/// A named request without artifacts to download.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SkippedRequest {
    /// The ProfileRequest.
    pub request: String,
    /// Why (not found, not finished, no artifacts).
    pub reason: String,
}
