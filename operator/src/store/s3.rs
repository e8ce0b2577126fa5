//! The S3-compatible backend, through the `object_store` crate.
//!
//! Upload and download URLs are SigV4 pre-signed URLs from `object_store`'s [`Signer`].
//! When the SHA-256 is known in advance, the upload URL binds an `x-amz-checksum-sha256`
//! header into its signature, so the server refuses a different body. A pre-signed PUT
//! cannot carry a size limit, and a SHA-256 is not always known in advance, so both are
//! also enforced by [`ArtifactStore::verify_upload`], which the operator calls once an agent
//! reports an upload: it reads the object back, and deletes it when it is too large or its
//! SHA-256 is wrong.

use std::{sync::Arc, time::Duration, time::SystemTime};

use async_trait::async_trait;
use base64::{Engine, engine::general_purpose::STANDARD as BASE64};
use futures::{StreamExt, TryStreamExt};
use object_store::{
    ObjectStore, ObjectStoreExt,
    aws::{AmazonS3, AmazonS3Builder},
    path::Path,
    signer::{HeaderName, HeaderValue, Method, SignedUrlOptions, Signer},
};
use url::Url;

use super::{
    ArtifactDigest, ArtifactKey, ArtifactStore, RequestRef, Result, Sha256Digest, StoreError,
    StoredArtifact, StoredRequest, UploadLimits, UploadTarget, check_digest, digest::BoundedDigest,
    group_by_request,
};

/// Configuration of an S3-compatible bucket.
#[derive(Clone)]
pub struct S3Config {
    /// Endpoint URL, e.g. `https://s3.eu-west-1.amazonaws.com` or `http://minio:9000`.
    pub endpoint: String,
    /// Bucket name; the bucket must exist.
    pub bucket: String,
    /// Region (any value for most non-AWS servers).
    pub region: String,
    /// Access key ID.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
    /// Allow a plain-HTTP endpoint.
    pub allow_http: bool,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field("allow_http", &self.allow_http)
            .finish()
    }
}

/// Artifacts in an S3-compatible bucket.
#[derive(Debug, Clone)]
pub struct S3Store {
    s3: Arc<AmazonS3>,
}

/// The S3 header carrying the body's SHA-256, base64-encoded.
const CHECKSUM_SHA256_HEADER: &str = "x-amz-checksum-sha256";

fn object_path(key: &ArtifactKey) -> Path {
    Path::from(key.to_string())
}

impl S3Store {
    /// Connects to the bucket described by `config` (path-style requests).
    pub fn new(config: S3Config) -> Result<Self> {
        let s3 = AmazonS3Builder::new()
            .with_endpoint(&config.endpoint)
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_allow_http(config.allow_http)
            .with_virtual_hosted_style_request(false)
            .build()
            .map_err(|e| StoreError::Config(format!("S3 bucket {}: {e}", config.bucket)))?;
        Ok(Self { s3: Arc::new(s3) })
    }

    /// The underlying object store, for callers that need more than [`ArtifactStore`].
    pub fn object_store(&self) -> Arc<AmazonS3> {
        self.s3.clone()
    }

    async fn delete_object(&self, key: &ArtifactKey) -> Result<()> {
        match self.s3.delete(&object_path(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads the object back, hashing it, stopping as soon as it exceeds `max_bytes`.
    async fn digest_of(&self, key: &ArtifactKey, max_bytes: u64) -> Result<ArtifactDigest> {
        let not_found = |e: object_store::Error| match e {
            object_store::Error::NotFound { .. } => StoreError::NotFound {
                key: key.to_string(),
            },
            other => other.into(),
        };
        let object = self.s3.get(&object_path(key)).await.map_err(not_found)?;
        let mut stream = object.into_stream();
        let mut digest = BoundedDigest::new(key, max_bytes);
        while let Some(chunk) = stream.next().await {
            digest.update(&chunk.map_err(not_found)?)?;
        }
        Ok(digest.finish())
    }
}

#[async_trait]
impl ArtifactStore for S3Store {
    async fn upload_target(
        &self,
        key: &ArtifactKey,
        limits: &UploadLimits,
    ) -> Result<UploadTarget> {
        let mut options = SignedUrlOptions::new();
        let mut headers = Vec::new();
        if let Some(sha) = limits.sha256 {
            // S3 checks this header against the body and refuses a mismatch (BadDigest);
            // signing it makes the uploader send exactly this value.
            let value = BASE64.encode(sha.as_bytes());
            let header_value = HeaderValue::from_str(&value)
                .map_err(|e| StoreError::Config(format!("checksum header value: {e}")))?;
            options = options.with_signed_header(
                HeaderName::from_static(CHECKSUM_SHA256_HEADER),
                header_value,
            );
            headers.push((CHECKSUM_SHA256_HEADER.to_owned(), value));
        }
        let url = self
            .s3
            .signed_url_opts(Method::PUT, &object_path(key), limits.ttl, &options)
            .await?;
        Ok(UploadTarget {
            url,
            headers,
            expires_at: SystemTime::now() + limits.ttl,
            max_bytes: limits.max_bytes,
        })
    }

    async fn download_url(&self, key: &ArtifactKey, ttl: Duration) -> Result<Url> {
        Ok(self
            .s3
            .signed_url(Method::GET, &object_path(key), ttl)
            .await?)
    }

    async fn verify_upload(
        &self,
        key: &ArtifactKey,
        max_bytes: u64,
        expected: Option<Sha256Digest>,
    ) -> Result<ArtifactDigest> {
        let checked = self
            .digest_of(key, max_bytes)
            .await
            .and_then(|digest| check_digest(key, &digest, max_bytes, expected).map(|()| digest));
        match checked {
            Err(e @ (StoreError::TooLarge { .. } | StoreError::ChecksumMismatch { .. })) => {
                self.delete_object(key).await?;
                Err(e)
            }
            other => other,
        }
    }

    async fn read(&self, key: &ArtifactKey, max_bytes: u64) -> Result<(Vec<u8>, ArtifactDigest)> {
        let not_found = |e: object_store::Error| match e {
            object_store::Error::NotFound { .. } => StoreError::NotFound {
                key: key.to_string(),
            },
            other => other.into(),
        };
        let object = self.s3.get(&object_path(key)).await.map_err(not_found)?;
        let mut stream = object.into_stream();
        let mut digest = BoundedDigest::new(key, max_bytes);
        let mut body = Vec::new();
        while let Some(chunk) = stream.next().await {
            digest.keep(&mut body, &chunk.map_err(not_found)?)?;
        }
        Ok((body, digest.finish()))
    }

    async fn list(&self, request: &RequestRef) -> Result<Vec<StoredArtifact>> {
        let prefix = Path::from(request.prefix());
        let objects: Vec<_> = self.s3.list(Some(&prefix)).try_collect().await?;
        let mut out: Vec<StoredArtifact> = objects
            .into_iter()
            .filter_map(|meta| {
                let name = meta.location.filename()?;
                let key = request.artifact(name).ok()?;
                // Only direct children: deeper paths are not artifacts of ours.
                (object_path(&key) == meta.location).then_some(StoredArtifact {
                    key,
                    size_bytes: meta.size,
                })
            })
            .collect();
        out.sort_by(|a, b| a.key.artifact().cmp(b.key.artifact()));
        Ok(out)
    }

    async fn delete_artifact(&self, key: &ArtifactKey) -> Result<()> {
        self.delete_object(key).await
    }

    async fn stored_requests(&self, namespace: Option<&str>) -> Result<Vec<StoredRequest>> {
        let prefix = namespace.map(Path::from);
        let objects: Vec<_> = self.s3.list(prefix.as_ref()).try_collect().await?;
        Ok(group_by_request(objects.into_iter().filter_map(|meta| {
            let key = ArtifactKey::parse(meta.location.as_ref()).ok()?;
            // Only keys that name themselves exactly (no deeper or odd paths).
            (object_path(&key) == meta.location).then_some((
                key,
                meta.size,
                Some(SystemTime::from(meta.last_modified)),
            ))
        })))
    }

    async fn delete_request(&self, request: &RequestRef) -> Result<usize> {
        let prefix = Path::from(request.prefix());
        // Everything under the prefix goes, valid artifact name or not.
        let locations = self
            .s3
            .list(Some(&prefix))
            .map_ok(|meta| meta.location)
            .boxed();
        let results: Vec<_> = self.s3.delete_stream(locations).collect().await;
        let mut deleted = 0;
        for result in results {
            match result {
                Ok(_) => deleted += 1,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(deleted)
    }
}
