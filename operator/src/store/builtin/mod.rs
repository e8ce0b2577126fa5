//! The built-in artifact store: a directory (a PersistentVolume in a cluster) that the
//! operator serves over HTTP ([`http`]) with HMAC-signed, expiring URLs.
//!
//! Layout under the root directory:
//! - `<namespace>/<request-name>-<uid>/<artifact>`: the artifact's bytes;
//! - `<namespace>/<request-name>-<uid>/.meta/<artifact>.json`: its size and SHA-256,
//!   computed while it was received;
//! - `.tmp/`: uploads in progress. They are renamed into place only once complete, within
//!   the limit and with the right checksum, so a failed upload leaves nothing behind and a
//!   reader never sees half an artifact.
//!
//! Validated names never start with a dot, so `.meta` and `.tmp` cannot collide with them.

pub mod http;
pub mod server;
pub mod tls;

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use async_trait::async_trait;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use url::Url;

use super::{
    ArtifactDigest, ArtifactKey, ArtifactStore, RequestRef, Result, Sha256Digest, StoreError,
    StoredArtifact, StoredRequest, UploadLimits, UploadTarget, check_digest,
    digest::BoundedDigest,
    signing::{Grant, UrlSigner},
};

/// Directory of uploads in progress, under the root.
const TMP_DIR: &str = ".tmp";
/// An upload in `.tmp/` not written to for this long belongs to a store that died while
/// receiving it (a live upload writes far more often; the longest capture deadline is
/// shorter): [`BuiltinStore::open`] deletes it.
pub const STALE_UPLOAD: Duration = Duration::from_secs(3600);
/// Directory of per-artifact metadata, under each request directory.
const META_DIR: &str = ".meta";
/// Path of the artifact API on the HTTP server.
pub const ARTIFACTS_PATH: &str = "v1/artifacts/";
/// Path of the per-request listing on the HTTP server.
pub const REQUESTS_PATH: &str = "v1/requests/";
/// Path of the per-namespace usage listing on the HTTP server.
pub const USAGE_PATH: &str = "v1/usage/";

/// Configuration of the built-in store.
#[derive(Clone)]
pub struct BuiltinConfig {
    /// Directory holding the artifacts; created if missing.
    pub root: PathBuf,
    /// Base URL at which agents and users reach the store's HTTP server, e.g.
    /// `http://flamefleet-artifacts.flamefleet-system.svc:8080/`.
    pub public_url: Url,
    /// HMAC secret for URL signatures, at least 32 bytes; shared by all operator replicas.
    pub secret: Vec<u8>,
    /// Hard cap on any upload, whatever a URL allows.
    pub max_upload_bytes: u64,
}

impl std::fmt::Debug for BuiltinConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuiltinConfig")
            .field("root", &self.root)
            .field("public_url", &self.public_url.as_str())
            .field("secret", &"<redacted>")
            .field("max_upload_bytes", &self.max_upload_bytes)
            .finish()
    }
}

/// The built-in store: the file-system side, and the signer of its URLs.
#[derive(Debug)]
pub struct BuiltinStore {
    root: PathBuf,
    base: Url,
    signer: UrlSigner,
    max_upload_bytes: u64,
    /// Held while an artifact and its metadata are renamed into place, and while they are
    /// read together, so that concurrent uploads of one key never pair one upload's bytes
    /// with another's metadata. Renames are quick; streaming happens outside the lock.
    commit_lock: tokio::sync::Mutex<()>,
}

impl BuiltinStore {
    /// Opens (creating if needed) the store in `config.root`.
    pub async fn open(config: BuiltinConfig) -> Result<Self> {
        let signer =
            UrlSigner::new(config.secret).map_err(|e| StoreError::Config(e.to_string()))?;
        let base = super::base_url(config.public_url, "public URL")?;
        let tmp = config.root.join(TMP_DIR);
        tokio::fs::create_dir_all(&tmp)
            .await
            .map_err(|e| StoreError::io(&tmp, e))?;
        sweep_stale_uploads(&tmp, STALE_UPLOAD).await;
        Ok(Self {
            root: config.root,
            base,
            signer,
            max_upload_bytes: config.max_upload_bytes,
            commit_lock: tokio::sync::Mutex::new(()),
        })
    }

    /// The signer of this store's URLs.
    pub fn signer(&self) -> &UrlSigner {
        &self.signer
    }

    /// The hard cap on any upload.
    pub fn max_upload_bytes(&self) -> u64 {
        self.max_upload_bytes
    }

    fn request_dir(&self, request: &RequestRef) -> PathBuf {
        self.root.join(request.namespace()).join(request.dir_name())
    }

    fn object_path(&self, key: &ArtifactKey) -> PathBuf {
        self.request_dir(key.request()).join(key.artifact())
    }

    fn meta_path(&self, key: &ArtifactKey) -> PathBuf {
        self.request_dir(key.request())
            .join(META_DIR)
            .join(format!("{}.json", key.artifact()))
    }

    /// The URL of `grant` (whose key is an artifact key or, for DELETE, a request prefix).
    pub fn signed_url(&self, grant: &Grant) -> Result<Url> {
        self.signer
            .signed_url(&self.base, ARTIFACTS_PATH, grant)
            .map_err(|e| StoreError::Config(format!("cannot build a URL for {}: {e}", grant.key)))
    }

    /// A signed URL that deletes every artifact of `request` with HTTP DELETE.
    pub fn delete_url(&self, request: &RequestRef, ttl: Duration) -> Result<Url> {
        self.signed_url(&Grant::new("DELETE", request.prefix(), ttl))
    }

    /// Receives an artifact: streams `body` to a temporary file while hashing it, and moves
    /// it into place only if it stays within `max_bytes` and matches every digest in
    /// `expected`. Re-uploading a key replaces it atomically.
    pub async fn write_artifact<S, E>(
        &self,
        key: &ArtifactKey,
        body: S,
        max_bytes: u64,
        expected: &[Sha256Digest],
    ) -> Result<ArtifactDigest>
    where
        S: Stream<Item = std::result::Result<Bytes, E>>,
        E: std::fmt::Display,
    {
        let tmp_dir = self.root.join(TMP_DIR);
        // The temporary file is deleted when `tmp_path` drops, on every early return.
        let (file, tmp_path) = tempfile::Builder::new()
            .prefix("upload-")
            .tempfile_in(&tmp_dir)
            .map_err(|e| StoreError::io(&tmp_dir, e))?
            .into_parts();
        let mut file = tokio::fs::File::from_std(file);
        let mut digest = BoundedDigest::new(key, max_bytes);
        let mut body = std::pin::pin!(body);
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| StoreError::Interrupted {
                key: key.to_string(),
                reason: e.to_string(),
            })?;
            digest.update(&chunk)?;
            file.write_all(&chunk)
                .await
                .map_err(|e| StoreError::io(&*tmp_path, e))?;
        }
        // tokio's File writes in the background: `flush` returns that write's error (e.g.
        // ENOSPC), which `sync_all` would keep to itself, leaving a short file behind a
        // digest of the whole body.
        file.flush()
            .await
            .map_err(|e| StoreError::io(&*tmp_path, e))?;
        file.sync_all()
            .await
            .map_err(|e| StoreError::io(&*tmp_path, e))?;
        drop(file);
        let digest = digest.finish();
        if let Some(want) = expected.iter().find(|want| **want != digest.sha256) {
            return Err(StoreError::ChecksumMismatch {
                key: key.to_string(),
                expected: *want,
                found: digest.sha256,
            });
        }
        let meta_path = self.meta_path(key);
        let meta_dir = meta_path.parent().unwrap_or(&self.root).to_path_buf();
        tokio::fs::create_dir_all(&meta_dir)
            .await
            .map_err(|e| StoreError::io(&meta_dir, e))?;
        let meta_tmp = self.write_tmp_meta(&digest).await?;
        let dest = self.object_path(key);
        let _commit = self.commit_lock.lock().await;
        tmp_path
            .persist(&dest)
            .map_err(|e| StoreError::io(&dest, e.error))?;
        meta_tmp
            .persist(&meta_path)
            .map_err(|e| StoreError::io(&meta_path, e.error))?;
        Ok(digest)
    }

    async fn write_tmp_meta(&self, digest: &ArtifactDigest) -> Result<tempfile::TempPath> {
        let tmp_dir = self.root.join(TMP_DIR);
        let (file, path) = tempfile::Builder::new()
            .prefix("meta-")
            .tempfile_in(&tmp_dir)
            .map_err(|e| StoreError::io(&tmp_dir, e))?
            .into_parts();
        let mut file = tokio::fs::File::from_std(file);
        let json = serde_json::to_vec(digest).map_err(|source| StoreError::Metadata {
            path: path.to_path_buf(),
            source,
        })?;
        file.write_all(&json)
            .await
            .map_err(|e| StoreError::io(&*path, e))?;
        // See `write_artifact`: the background write's error comes from `flush` only.
        file.flush().await.map_err(|e| StoreError::io(&*path, e))?;
        file.sync_all()
            .await
            .map_err(|e| StoreError::io(&*path, e))?;
        Ok(path)
    }

    /// Opens a stored artifact for reading, with its recorded size and SHA-256.
    pub async fn open_artifact(
        &self,
        key: &ArtifactKey,
    ) -> Result<(tokio::fs::File, ArtifactDigest)> {
        let path = self.object_path(key);
        let _commit = self.commit_lock.lock().await;
        let file = tokio::fs::File::open(&path)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => StoreError::NotFound {
                    key: key.to_string(),
                },
                _ => StoreError::io(&path, e),
            })?;
        let digest = self.read_digest(key, &path).await?;
        Ok((file, digest))
    }

    /// The recorded digest of an artifact, or one computed from its bytes when the record
    /// is missing (e.g. the operator stopped between the two renames of an upload).
    async fn read_digest(&self, key: &ArtifactKey, path: &Path) -> Result<ArtifactDigest> {
        let meta_path = self.meta_path(key);
        match tokio::fs::read(&meta_path).await {
            Ok(raw) => serde_json::from_slice(&raw).map_err(|source| StoreError::Metadata {
                path: meta_path,
                source,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => hash_file(key, path).await,
            Err(e) => Err(StoreError::io(&meta_path, e)),
        }
    }

    async fn remove_artifact(&self, key: &ArtifactKey) -> Result<()> {
        for path in [self.object_path(key), self.meta_path(key)] {
            match tokio::fs::remove_file(&path).await {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(StoreError::io(&path, e)),
            }
        }
        Ok(())
    }
}

/// Names of the directories in `dir` that do not start with a dot; none when `dir` is
/// missing.
async fn subdirectories(dir: &Path) -> Result<Vec<String>> {
    let mut entries = match tokio::fs::read_dir(dir).await {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StoreError::io(dir, e)),
    };
    let mut out = Vec::new();
    while let Some(entry) = entries
        .next_entry()
        .await
        .map_err(|e| StoreError::io(dir, e))?
    {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let is_dir = entry.file_type().await.is_ok_and(|t| t.is_dir());
        if is_dir && !name.starts_with('.') {
            out.push(name);
        }
    }
    out.sort();
    Ok(out)
}

async fn hash_file(key: &ArtifactKey, path: &Path) -> Result<ArtifactDigest> {
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => StoreError::NotFound {
                key: key.to_string(),
            },
            _ => StoreError::io(path, e),
        })?;
    let mut digest = BoundedDigest::new(key, u64::MAX);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = file
            .read(&mut buf)
            .await
            .map_err(|e| StoreError::io(path, e))?;
        if n == 0 {
            return Ok(digest.finish());
        }
        digest.update(&buf[..n])?;
    }
}

#[async_trait]
impl ArtifactStore for BuiltinStore {
    async fn upload_target(
        &self,
        key: &ArtifactKey,
        limits: &UploadLimits,
    ) -> Result<UploadTarget> {
        let max_bytes = limits.max_bytes.min(self.max_upload_bytes);
        let grant = Grant::new("PUT", key.to_string(), limits.ttl)
            .with_max_bytes(max_bytes)
            .with_sha256(limits.sha256);
        Ok(UploadTarget {
            url: self.signed_url(&grant)?,
            headers: Vec::new(),
            expires_at: grant.expires_at(),
            max_bytes,
        })
    }

    async fn download_url(&self, key: &ArtifactKey, ttl: Duration) -> Result<Url> {
        self.signed_url(&Grant::new("GET", key.to_string(), ttl))
    }

    async fn verify_upload(
        &self,
        key: &ArtifactKey,
        max_bytes: u64,
        expected: Option<Sha256Digest>,
    ) -> Result<ArtifactDigest> {
        let _commit = self.commit_lock.lock().await;
        let digest = self.read_digest(key, &self.object_path(key)).await?;
        if let Err(e) = check_digest(key, &digest, max_bytes, expected) {
            self.remove_artifact(key).await?;
            return Err(e);
        }
        Ok(digest)
    }

    async fn read(&self, key: &ArtifactKey, max_bytes: u64) -> Result<(Vec<u8>, ArtifactDigest)> {
        let (file, _) = self.open_artifact(key).await?;
        let path = self.object_path(key);
        // One byte past the limit tells an oversized artifact apart without reading it all.
        let mut limited = file.take(max_bytes.saturating_add(1));
        let mut body = Vec::new();
        limited
            .read_to_end(&mut body)
            .await
            .map_err(|e| StoreError::io(&path, e))?;
        let mut digest = BoundedDigest::new(key, max_bytes);
        digest.update(&body)?;
        Ok((body, digest.finish()))
    }

    async fn list(&self, request: &RequestRef) -> Result<Vec<StoredArtifact>> {
        let dir = self.request_dir(request);
        let mut entries = match tokio::fs::read_dir(&dir).await {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::io(&dir, e)),
        };
        let mut out = Vec::new();
        while let Some(entry) = entries
            .next_entry()
            .await
            .map_err(|e| StoreError::io(&dir, e))?
        {
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            // Skips `.meta` and anything that is not a valid artifact name.
            let Ok(key) = request.artifact(name) else {
                continue;
            };
            let meta = entry
                .metadata()
                .await
                .map_err(|e| StoreError::io(entry.path(), e))?;
            if meta.is_file() {
                out.push(StoredArtifact {
                    key,
                    size_bytes: meta.len(),
                });
            }
        }
        out.sort_by(|a, b| a.key.artifact().cmp(b.key.artifact()));
        Ok(out)
    }

    async fn delete_artifact(&self, key: &ArtifactKey) -> Result<()> {
        let _commit = self.commit_lock.lock().await;
        self.remove_artifact(key).await
    }

    async fn stored_requests(&self, namespace: Option<&str>) -> Result<Vec<StoredRequest>> {
        let namespaces = match namespace {
            Some(ns) => vec![ns.to_owned()],
            None => subdirectories(&self.root).await?,
        };
        let mut out = Vec::new();
        for ns in namespaces {
            let ns_dir = self.root.join(&ns);
            for dir in subdirectories(&ns_dir).await? {
                // Skips `.tmp` and anything that is not `<name>-<uid>` of a valid namespace.
                let Ok(request) = RequestRef::parse_prefix(&format!("{ns}/{dir}")) else {
                    continue;
                };
                let path = ns_dir.join(&dir);
                let mut modified = tokio::fs::metadata(&path)
                    .await
                    .ok()
                    .and_then(|m| m.modified().ok());
                let artifacts = self.list(&request).await?;
                let mut bytes = 0u64;
                for artifact in &artifacts {
                    bytes = bytes.saturating_add(artifact.size_bytes);
                    let file = self.object_path(&artifact.key);
                    let m = tokio::fs::metadata(&file)
                        .await
                        .ok()
                        .and_then(|m| m.modified().ok());
                    modified = modified.max(m);
                }
                out.push(StoredRequest {
                    request,
                    bytes,
                    artifacts: artifacts.len(),
                    modified,
                });
            }
        }
        out.sort_by_key(|r| r.request.prefix());
        Ok(out)
    }

    async fn delete_request(&self, request: &RequestRef) -> Result<usize> {
        let count = self.list(request).await?.len();
        let dir = self.request_dir(request);
        match tokio::fs::remove_dir_all(&dir).await {
            Ok(()) => Ok(count),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(StoreError::io(&dir, e)),
        }
    }
}

/// Deletes the uploads in `tmp` not modified for `stale`: left by a store killed (OOM, node
/// failure) mid-upload, they would otherwise stay on the volume for good, since nothing
/// names them. Failures are logged, never fatal: the store works without the space.
async fn sweep_stale_uploads(tmp: &Path, stale: Duration) {
    let Ok(mut dir) = tokio::fs::read_dir(tmp).await else {
        return;
    };
    let (mut removed, mut bytes) = (0u64, 0u64);
    while let Ok(Some(entry)) = dir.next_entry().await {
        let Ok(meta) = entry.metadata().await else {
            continue;
        };
        let idle = meta
            .modified()
            .ok()
            .and_then(|m| m.elapsed().ok())
            .unwrap_or_default();
        if !meta.is_file() || idle < stale {
            continue;
        }
        match tokio::fs::remove_file(entry.path()).await {
            Ok(()) => {
                removed += 1;
                bytes += meta.len();
            }
            Err(e) => {
                tracing::warn!(path = %entry.path().display(), error = %e, "cannot delete a stale upload")
            }
        }
    }
    if removed > 0 {
        tracing::info!(
            removed,
            bytes,
            dir = %tmp.display(),
            "deleted uploads left by a store that stopped while receiving them"
        );
    }
}
