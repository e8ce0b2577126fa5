//! The built-in store run apart from the operator (the `flamefleet-store` Deployment of the
//! chart): the operator keeps signing URLs with the shared secret, and calls the store's
//! signed admin endpoints for what needs the files (verify, list, delete).
//!
//! Why apart: the operator runs two replicas for availability, but artifacts are state on
//! one volume. A single store pod owns the volume; operator replicas come and go without
//! moving it.

use std::time::Duration;

use async_trait::async_trait;
use url::Url;

use super::builtin::{ARTIFACTS_PATH, REQUESTS_PATH, USAGE_PATH, http::usage_key};
use super::signing::{Grant, UrlSigner};
use super::{
    ArtifactDigest, ArtifactKey, ArtifactStore, RequestRef, Result, Sha256Digest, StoreError,
    StoredArtifact, StoredRequest, UploadLimits, UploadTarget, base_url, digest::BoundedDigest,
};

/// Lifetime of the operator's own admin URLs (verify, list, delete): used at once.
const ADMIN_URL_TTL: Duration = Duration::from_secs(60);
/// Timeout of one admin call.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Configuration of [`RemoteStore`].
#[derive(Clone)]
pub struct RemoteConfig {
    /// Where the operator and the agents reach the store (e.g. its Service's DNS name).
    pub internal_url: Url,
    /// Where users download from (default: `internal_url`).
    pub public_url: Option<Url>,
    /// The HMAC secret shared with the store, at least 32 bytes.
    pub secret: Vec<u8>,
    /// Largest artifact accepted.
    pub max_upload_bytes: u64,
    /// PEM CA certificate(s) to trust for an `https` store besides the system roots (the
    /// operator's CA, which issues the built-in store's certificate).
    pub ca_pem: Option<String>,
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("internal_url", &self.internal_url.as_str())
            .field("public_url", &self.public_url.as_ref().map(Url::as_str))
            .field("secret", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// A built-in store served by another process.
#[derive(Debug)]
pub struct RemoteStore {
    internal: Url,
    public: Url,
    signer: UrlSigner,
    max_upload_bytes: u64,
    http: reqwest::Client,
}

/// The store's URL without its query (signatures never go into messages or logs).
fn shown(url: &Url) -> String {
    let mut u = url.clone();
    u.set_query(None);
    u.to_string()
}

/// A transport error with its causes (`error sending request` alone says nothing; the
/// refused connection or the failed name lookup below it does), without the URL (signed).
fn transport_error(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

impl RemoteStore {
    /// A client of the store at `config.internal_url`.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a bad URL or a short secret.
    pub fn new(config: RemoteConfig) -> Result<Self> {
        let internal = base_url(config.internal_url, "store URL")?;
        let public = match config.public_url {
            Some(u) => base_url(u, "public store URL")?,
            None => internal.clone(),
        };
        let signer =
            UrlSigner::new(config.secret).map_err(|e| StoreError::Config(e.to_string()))?;
        let mut http = reqwest::Client::builder().timeout(ADMIN_TIMEOUT);
        if let Some(pem) = &config.ca_pem {
            let roots = reqwest::Certificate::from_pem_bundle(pem.as_bytes())
                .map_err(|e| StoreError::Config(format!("the store's CA does not parse: {e}")))?;
            for root in roots {
                http = http.add_root_certificate(root);
            }
        }
        let http = http
            .build()
            .map_err(|e| StoreError::Config(format!("building the HTTP client: {e}")))?;
        Ok(Self {
            internal,
            public,
            signer,
            max_upload_bytes: config.max_upload_bytes,
            http,
        })
    }

    fn url(&self, base: &Url, path: &str, grant: &Grant) -> Result<Url> {
        self.signer
            .signed_url(base, path, grant)
            .map_err(|e| StoreError::Config(format!("cannot build a URL for {}: {e}", grant.key)))
    }

    /// Sends `request` and returns the JSON body of a 2xx answer; maps 404 to `not_found`.
    async fn call(
        &self,
        request: reqwest::RequestBuilder,
        url: &Url,
        not_found: impl FnOnce() -> StoreError,
    ) -> Result<serde_json::Value> {
        let unreachable = |e| StoreError::Unreachable {
            url: shown(url),
            reason: transport_error(e),
        };
        // Every call here is idempotent (a verification, a list, a delete). A pooled
        // connection that the store closed as the call went out on it fails at once
        // ("connection closed before message completed": seen under load, failing a node's
        // verified upload); one more try goes out on a fresh connection. A timeout is not
        // tried again (it took its time already).
        let again = request.try_clone();
        let response = match (request.send().await, again) {
            (Ok(response), _) => response,
            (Err(e), Some(again)) if !e.is_timeout() => {
                tracing::debug!(url = %shown(url), "the store call failed, trying once more: {}", transport_error(e));
                again.send().await.map_err(unreachable)?
            }
            (Err(e), _) => return Err(unreachable(e)),
        };
        let status = response.status();
        let body: serde_json::Value = response.json().await.unwrap_or_default();
        if status.is_success() {
            return Ok(body);
        }
        if status == reqwest::StatusCode::NOT_FOUND {
            return Err(not_found());
        }
        Err(StoreError::Remote {
            url: shown(url),
            status: status.as_u16(),
            message: body
                .get("error")
                .and_then(|m| m.as_str())
                .unwrap_or("no error message")
                .to_owned(),
        })
    }
}

#[async_trait]
impl ArtifactStore for RemoteStore {
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
            url: self.url(&self.internal, ARTIFACTS_PATH, &grant)?,
            headers: Vec::new(),
            expires_at: grant.expires_at(),
            max_bytes,
        })
    }

    async fn download_url(&self, key: &ArtifactKey, ttl: Duration) -> Result<Url> {
        self.url(
            &self.public,
            ARTIFACTS_PATH,
            &Grant::new("GET", key.to_string(), ttl),
        )
    }

    async fn verify_upload(
        &self,
        key: &ArtifactKey,
        max_bytes: u64,
        expected: Option<Sha256Digest>,
    ) -> Result<ArtifactDigest> {
        let grant = Grant::new("VERIFY", key.to_string(), ADMIN_URL_TTL)
            .with_max_bytes(max_bytes)
            .with_sha256(expected);
        let url = self.url(&self.internal, ARTIFACTS_PATH, &grant)?;
        let body = self
            .call(self.http.post(url.clone()), &url, || StoreError::NotFound {
                key: key.to_string(),
            })
            .await?;
        let size_bytes = body.get("sizeBytes").and_then(serde_json::Value::as_u64);
        let sha256 = body
            .get("sha256")
            .and_then(|v| v.as_str())
            .and_then(|s| s.parse::<Sha256Digest>().ok());
        match (size_bytes, sha256) {
            (Some(size_bytes), Some(sha256)) => Ok(ArtifactDigest { size_bytes, sha256 }),
            _ => Err(StoreError::Remote {
                url: shown(&url),
                status: 200,
                message: format!("unexpected answer {body}; expected sizeBytes and sha256"),
            }),
        }
    }

    async fn read(&self, key: &ArtifactKey, max_bytes: u64) -> Result<(Vec<u8>, ArtifactDigest)> {
        let grant = Grant::new("GET", key.to_string(), ADMIN_URL_TTL);
        let url = self.url(&self.internal, ARTIFACTS_PATH, &grant)?;
        let unreachable = |e: reqwest::Error| StoreError::Unreachable {
            url: shown(&url),
            reason: transport_error(e),
        };
        let mut response = self
            .http
            .get(url.clone())
            .send()
            .await
            .map_err(unreachable)?;
        let status = response.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Err(StoreError::NotFound {
                key: key.to_string(),
            });
        }
        if !status.is_success() {
            return Err(StoreError::Remote {
                url: shown(&url),
                status: status.as_u16(),
                message: "reading the artifact failed".into(),
            });
        }
        let mut digest = BoundedDigest::new(key, max_bytes);
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(unreachable)? {
            digest.keep(&mut body, &chunk)?;
        }
        Ok((body, digest.finish()))
    }

    async fn list(&self, request: &RequestRef) -> Result<Vec<StoredArtifact>> {
        let grant = Grant::new("LIST", request.prefix(), ADMIN_URL_TTL);
        let url = self.url(&self.internal, REQUESTS_PATH, &grant)?;
        let body = self
            .call(self.http.get(url.clone()), &url, || StoreError::NotFound {
                key: request.prefix(),
            })
            .await?;
        let mut out = Vec::new();
        for entry in body
            .get("artifacts")
            .and_then(|a| a.as_array())
            .into_iter()
            .flatten()
        {
            let (Some(name), Some(size_bytes)) = (
                entry.get("artifact").and_then(|v| v.as_str()),
                entry.get("sizeBytes").and_then(serde_json::Value::as_u64),
            ) else {
                continue;
            };
            // A name the store should never have kept is skipped, not trusted.
            if let Ok(key) = request.artifact(name.to_owned()) {
                out.push(StoredArtifact { key, size_bytes });
            }
        }
        Ok(out)
    }

    async fn delete_artifact(&self, key: &ArtifactKey) -> Result<()> {
        let grant = Grant::new("DELETE", key.to_string(), ADMIN_URL_TTL);
        let url = self.url(&self.internal, ARTIFACTS_PATH, &grant)?;
        match self
            .call(self.http.delete(url.clone()), &url, || {
                StoreError::NotFound {
                    key: key.to_string(),
                }
            })
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn stored_requests(&self, namespace: Option<&str>) -> Result<Vec<StoredRequest>> {
        let grant = Grant::new("USAGE", usage_key(namespace), ADMIN_URL_TTL);
        let path = format!("{USAGE_PATH}{}", namespace.unwrap_or_default());
        let mut url = self.url(&self.internal, USAGE_PATH, &grant)?;
        url.set_path(&format!("{}{path}", self.internal.path()));
        let body = self
            .call(self.http.get(url.clone()), &url, || StoreError::NotFound {
                key: path.clone(),
            })
            .await?;
        let mut out = Vec::new();
        for entry in body
            .get("requests")
            .and_then(|a| a.as_array())
            .into_iter()
            .flatten()
        {
            let (Some(prefix), Some(bytes)) = (
                entry.get("request").and_then(|v| v.as_str()),
                entry.get("bytes").and_then(serde_json::Value::as_u64),
            ) else {
                continue;
            };
            // A prefix the store should never have kept is skipped, not trusted.
            let Ok(request) = RequestRef::parse_prefix(prefix) else {
                continue;
            };
            out.push(StoredRequest {
                request,
                bytes,
                artifacts: entry
                    .get("artifacts")
                    .and_then(serde_json::Value::as_u64)
                    .and_then(|n| usize::try_from(n).ok())
                    .unwrap_or(0),
                modified: entry
                    .get("modified")
                    .and_then(serde_json::Value::as_u64)
                    .map(|s| std::time::UNIX_EPOCH + Duration::from_secs(s)),
            });
        }
        Ok(out)
    }

    async fn delete_request(&self, request: &RequestRef) -> Result<usize> {
        let grant = Grant::new("DELETE", request.prefix(), ADMIN_URL_TTL);
        let url = self.url(&self.internal, ARTIFACTS_PATH, &grant)?;
        let body = self
            .call(self.http.delete(url.clone()), &url, || {
                StoreError::NotFound {
                    key: request.prefix(),
                }
            })
            .await?;
        Ok(body
            .get("deleted")
            .and_then(serde_json::Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(0))
    }
}
