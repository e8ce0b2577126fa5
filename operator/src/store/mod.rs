//! The artifact store: where agents upload the profiles they capture and users download them.
//!
//! The operator talks to every backend through [`ArtifactStore`]: per capture it asks for a
//! pre-signed upload URL per artifact ([`ArtifactStore::upload_target`]), checks what arrived
//! ([`ArtifactStore::verify_upload`]), signs short-lived download URLs for users'
//! ProfileDownloads ([`ArtifactStore::download_url`]), and when a ProfileRequest is
//! deleted its finalizer calls [`ArtifactStore::delete_request`].
//!
//! Backends:
//! - [`builtin::BuiltinStore`]: a directory served over HTTP, with HMAC-signed expiring
//!   URLs ([`signing`]) for every operation: the store never handles user credentials.
//! - [`remote::RemoteStore`]: the built-in store run as its own Deployment
//!   (`flamefleet-store`), which the operator reaches over HTTP with signed admin URLs.
//! - [`s3::S3Store`]: any S3-compatible object store, through the `object_store` crate.
//!
//! Keys are `<namespace>/<request-name>-<uid>/<artifact-name>` ([`key`]).

pub mod builtin;
pub mod crypto_provider;
pub mod digest;
pub mod gc;
pub mod key;
pub mod quota;
pub mod remote;
pub mod s3;
pub mod signing;

use std::{path::PathBuf, time::Duration, time::SystemTime};

use async_trait::async_trait;
use thiserror::Error;
use url::Url;

pub use crypto_provider::install_default_crypto_provider;
pub use digest::{ArtifactDigest, Sha256Digest};
pub use key::{ArtifactKey, KeyError, RequestRef};

/// Header in which an uploader may state the SHA-256 of its body, and in which the built-in
/// store reports the SHA-256 of what it serves.
pub const SHA256_HEADER: &str = "x-flamefleet-sha256";

/// Errors of the artifact store.
#[derive(Debug, Error)]
pub enum StoreError {
    /// A key or one of its parts is invalid.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// No artifact under that key.
    #[error("artifact {key} not found in the store; it was never uploaded or has been deleted")]
    NotFound {
        /// The missing key.
        key: String,
    },
    /// The artifact exceeds the size limit (it has been removed).
    #[error(
        "artifact {key} is larger than the limit of {max} bytes (found {found} bytes); it was not kept"
    )]
    TooLarge {
        /// The key.
        key: String,
        /// The limit.
        max: u64,
        /// Bytes seen (at least this many).
        found: u64,
    },
    /// The artifact's SHA-256 differs from the expected one (it has been removed).
    #[error("artifact {key} has sha256 {found}, expected {expected}; it was not kept")]
    ChecksumMismatch {
        /// The key.
        key: String,
        /// The SHA-256 that was announced or signed.
        expected: Sha256Digest,
        /// The SHA-256 of the bytes received.
        found: Sha256Digest,
    },
    /// The uploader's body ended with an error before it was complete.
    #[error("upload of {key} was interrupted: {reason}; nothing was kept, upload again")]
    Interrupted {
        /// The key.
        key: String,
        /// The cause.
        reason: String,
    },
    /// The disk under the built-in store is full.
    #[error(
        "no space left on the artifact store's volume at {path}; free space or grow the volume"
    )]
    StorageFull {
        /// Where the write failed.
        path: PathBuf,
    },
    /// A file-system operation of the built-in store failed.
    #[error("artifact store I/O on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The built-in store's metadata file for an artifact is unreadable.
    #[error("artifact metadata {path} is corrupt: {source}; delete the artifact and capture again")]
    Metadata {
        /// The metadata file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// The S3-compatible object store failed.
    #[error("object store: {0}")]
    ObjectStore(#[from] object_store::Error),
    /// The remote built-in store answered with an error.
    #[error("the artifact store at {url} answered {status}: {message}")]
    Remote {
        /// The URL called (without its signature).
        url: String,
        /// The HTTP status.
        status: u16,
        /// The store's error message.
        message: String,
    },
    /// The remote built-in store could not be reached.
    #[error(
        "cannot reach the artifact store at {url}: {reason}; check the store Deployment and its Service"
    )]
    Unreachable {
        /// The URL called (without its signature).
        url: String,
        /// The transport error.
        reason: String,
    },
    /// The store's configuration is unusable.
    #[error("invalid artifact store configuration: {0}")]
    Config(String),
}

impl StoreError {
    /// Wraps an I/O error on `path`, telling a full disk apart.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::StorageFull {
            Self::StorageFull { path }
        } else {
            Self::Io { path, source }
        }
    }
}

/// Result type of the artifact store.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Checks what was stored under `key` against its size limit and expected SHA-256.
///
/// Shared by the backends' `verify_upload`, which delete the artifact when this fails.
pub(crate) fn check_digest(
    key: &ArtifactKey,
    digest: &ArtifactDigest,
    max_bytes: u64,
    expected: Option<Sha256Digest>,
) -> Result<()> {
    if digest.size_bytes > max_bytes {
        return Err(StoreError::TooLarge {
            key: key.to_string(),
            max: max_bytes,
            found: digest.size_bytes,
        });
    }
    match expected {
        Some(expected) if expected != digest.sha256 => Err(StoreError::ChecksumMismatch {
            key: key.to_string(),
            expected,
            found: digest.sha256,
        }),
        _ => Ok(()),
    }
}

/// `url` as the base of a store's URLs: http(s), ending with `/`.
pub(crate) fn base_url(mut url: Url, what: &str) -> Result<Url> {
    if url.cannot_be_a_base() || !matches!(url.scheme(), "http" | "https") {
        return Err(StoreError::Config(format!(
            "{what} {url} is not an http(s) base URL; expected e.g. http://host:8080/"
        )));
    }
    if !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    Ok(url)
}

/// What an upload URL should allow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadLimits {
    /// Largest artifact accepted, in bytes.
    pub max_bytes: u64,
    /// The SHA-256 the artifact must have, when known in advance.
    pub sha256: Option<Sha256Digest>,
    /// How long the URL stays valid.
    pub ttl: Duration,
}

/// A pre-signed upload: PUT the artifact's bytes to `url`, sending `headers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadTarget {
    /// The pre-signed URL.
    pub url: Url,
    /// Headers the uploader must send with its PUT (bound into the signature by some backends).
    pub headers: Vec<(String, String)>,
    /// When the URL stops working.
    pub expires_at: SystemTime,
    /// Largest body the store keeps.
    pub max_bytes: u64,
}

/// One artifact found in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredArtifact {
    /// Its key.
    pub key: ArtifactKey,
    /// Its size in bytes.
    pub size_bytes: u64,
}

/// One request's artifacts in the store, summed up: what the garbage collector and the
/// per-namespace quota need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRequest {
    /// The request (from the key prefix: namespace, name and UID).
    pub request: RequestRef,
    /// Total size of its artifacts, bytes.
    pub bytes: u64,
    /// Number of artifacts.
    pub artifacts: usize,
    /// The newest modification among its artifacts (or its directory), when known.
    pub modified: Option<SystemTime>,
}

/// Sums `(key, size, modified)` objects up by request, in key order (shared by backends
/// that list objects).
pub(crate) fn group_by_request(
    objects: impl IntoIterator<Item = (ArtifactKey, u64, Option<SystemTime>)>,
) -> Vec<StoredRequest> {
    let mut by_prefix: std::collections::BTreeMap<String, StoredRequest> = Default::default();
    for (key, size, modified) in objects {
        let entry = by_prefix
            .entry(key.request().prefix())
            .or_insert_with(|| StoredRequest {
                request: key.request().clone(),
                bytes: 0,
                artifacts: 0,
                modified: None,
            });
        entry.bytes = entry.bytes.saturating_add(size);
        entry.artifacts += 1;
        entry.modified = entry.modified.max(modified);
    }
    by_prefix.into_values().collect()
}

/// The operations the operator needs from an artifact store, whatever the backend.
#[async_trait]
pub trait ArtifactStore: Send + Sync + std::fmt::Debug {
    /// A pre-signed URL through which one artifact can be uploaded with PUT, within `limits`.
    async fn upload_target(&self, key: &ArtifactKey, limits: &UploadLimits)
    -> Result<UploadTarget>;

    /// A pre-signed URL through which one artifact can be downloaded with GET for `ttl`.
    async fn download_url(&self, key: &ArtifactKey, ttl: Duration) -> Result<Url>;

    /// The size and SHA-256 of what was uploaded under `key`, checked against `max_bytes` and
    /// `expected`. An artifact that breaks either is deleted and reported as an error, so a
    /// verified artifact is always one that fits its limits.
    async fn verify_upload(
        &self,
        key: &ArtifactKey,
        max_bytes: u64,
        expected: Option<Sha256Digest>,
    ) -> Result<ArtifactDigest>;

    /// The bytes stored under `key`, with their size and SHA-256; fails with
    /// [`StoreError::TooLarge`] as soon as they exceed `max_bytes` (the export sink reads
    /// each exported artifact once, and never more than that).
    async fn read(&self, key: &ArtifactKey, max_bytes: u64) -> Result<(Vec<u8>, ArtifactDigest)>;

    /// Every artifact stored for `request`.
    async fn list(&self, request: &RequestRef) -> Result<Vec<StoredArtifact>>;

    /// Deletes every artifact of `request`; returns how many were deleted. Deleting what is
    /// already gone succeeds (the finalizer may run more than once).
    async fn delete_request(&self, request: &RequestRef) -> Result<usize>;

    /// Deletes one artifact (and its metadata); deleting what is already gone succeeds.
    async fn delete_artifact(&self, key: &ArtifactKey) -> Result<()>;

    /// Every request with artifacts in the store, of `namespace` only when given, summed
    /// up ([`StoredRequest`]), in key order. Objects that are not artifacts of a request
    /// key are left out.
    async fn stored_requests(&self, namespace: Option<&str>) -> Result<Vec<StoredRequest>>;
}
