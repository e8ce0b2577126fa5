//! Uploads an artifact to its pre-signed URL: one HTTP PUT with the body's
//! sha256 in `x-flamefleet-sha256` (the store refuses a body that does not
//! match), a timeout on every attempt, and retries with exponential backoff
//! for what may be transient (connection errors, timeouts, 408, 429, 5xx).
//! A refusal (other 4xx) is final and reported with the store's status code
//! and body.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable as _};
use sha2::{Digest as _, Sha256};

/// Header carrying the hex sha256 of the uploaded body.
pub const SHA256_HEADER: &str = "x-flamefleet-sha256";

/// How much of a refusal's body goes into the error (stores answer with a
/// short text; anything longer is cut so a status message stays readable).
const MAX_ERROR_BODY: usize = 512;

/// Why an upload failed.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// The store answered with a non-success status.
    #[error("upload of {artifact} refused by the store: HTTP {status}: {body}")]
    Refused {
        /// Artifact name.
        artifact: String,
        /// HTTP status code.
        status: u16,
        /// Start of the response body.
        body: String,
    },
    /// The request could not be sent or timed out.
    #[error("upload of {artifact} to {host} failed after {attempts} attempts: {source}")]
    Transport {
        /// Artifact name.
        artifact: String,
        /// Host of the URL (the query string holds the signature: never logged).
        host: String,
        /// Attempts made.
        attempts: usize,
        /// The last error.
        source: reqwest::Error,
    },
    /// The artifact is larger than the slot allows.
    #[error(
        "artifact {artifact} is {size} bytes, the upload slot allows at most {max}; capture less (shorter duration, fewer targets) or raise the store's limit"
    )]
    TooLarge {
        /// Artifact name.
        artifact: String,
        /// Its size.
        size: u64,
        /// The slot's limit.
        max: u64,
    },
    /// The URL is not an http(s) URL.
    #[error("upload URL of {artifact} is not a valid http(s) URL: {reason}")]
    BadUrl {
        /// Artifact name.
        artifact: String,
        /// What is wrong.
        reason: String,
    },
    /// The HTTP client could not be built.
    #[error("building the HTTP client: {0}")]
    Client(reqwest::Error),
}

/// Retry and timeout settings of the uploader.
#[derive(Debug, Clone)]
pub struct UploadPolicy {
    /// Timeout of one attempt (connect, send, answer).
    pub attempt_timeout: Duration,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Retries after the first attempt.
    pub retries: usize,
    /// First backoff delay (doubled each retry, with jitter).
    pub first_backoff: Duration,
    /// Idle connections kept per store host (`None`: the HTTP client's default, no bound).
    pub idle_connections_per_host: Option<usize>,
}

impl Default for UploadPolicy {
    fn default() -> Self {
        Self {
            attempt_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            retries: 4,
            first_backoff: Duration::from_millis(200),
            idle_connections_per_host: None,
        }
    }
}

/// Hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// An HTTP uploader (one connection pool for the agent).
#[derive(Debug, Clone)]
pub struct Uploader {
    client: reqwest::Client,
    policy: UploadPolicy,
}

/// Outcome of one attempt: retry or give up.
enum Attempt {
    Retry(UploadError),
    Final(UploadError),
}

impl Uploader {
    /// Builds the client.
    ///
    /// # Errors
    /// [`UploadError::Client`] when the TLS backend cannot be initialised.
    pub fn new(policy: UploadPolicy) -> Result<Self, UploadError> {
        Self::trusting(policy, None)
    }

    /// Builds the client trusting `ca_pem` (the operator's CA, which issues the built-in
    /// store's HTTPS certificate) besides the system roots.
    ///
    /// # Errors
    /// [`UploadError::Client`] when the TLS backend cannot be initialised or the CA does
    /// not parse.
    pub fn trusting(policy: UploadPolicy, ca_pem: Option<&[u8]>) -> Result<Self, UploadError> {
        let mut builder = reqwest::Client::builder()
            .timeout(policy.attempt_timeout)
            .connect_timeout(policy.connect_timeout)
            .user_agent(concat!("flamefleet-agent/", env!("CARGO_PKG_VERSION")));
        if let Some(idle) = policy.idle_connections_per_host {
            builder = builder.pool_max_idle_per_host(idle);
        }
        if let Some(pem) = ca_pem {
            for root in reqwest::Certificate::from_pem_bundle(pem).map_err(UploadError::Client)? {
                builder = builder.add_root_certificate(root);
            }
        }
        let client = builder.build().map_err(UploadError::Client)?;
        Ok(Self { client, policy })
    }

    /// PUTs `body` to `url` with its sha256, retrying transient failures.
    ///
    /// # Errors
    /// [`UploadError::Refused`] for a final refusal, [`UploadError::Transport`]
    /// when every attempt failed to get an answer, [`UploadError::TooLarge`]
    /// before sending when `max_bytes` (0: no limit) is exceeded.
    pub async fn put(
        &self,
        artifact: &str,
        url: &str,
        body: &[u8],
        max_bytes: u64,
    ) -> Result<(), UploadError> {
        let size = body.len() as u64;
        if max_bytes != 0 && size > max_bytes {
            return Err(UploadError::TooLarge {
                artifact: artifact.into(),
                size,
                max: max_bytes,
            });
        }
        let parsed = reqwest::Url::parse(url).map_err(|e| UploadError::BadUrl {
            artifact: artifact.into(),
            reason: e.to_string(),
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(UploadError::BadUrl {
                artifact: artifact.into(),
                reason: format!("expected scheme http or https, found {}", parsed.scheme()),
            });
        }
        let host = parsed.host_str().unwrap_or("").to_owned();
        let digest = sha256_hex(body);
        let body = bytes::Bytes::copy_from_slice(body);
        let attempts = std::sync::atomic::AtomicUsize::new(0);
        let once = || async {
            attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let sent = self
                .client
                .put(parsed.clone())
                .header(SHA256_HEADER, &digest)
                .body(body.clone())
                .send()
                .await;
            let response = match sent {
                Ok(r) => r,
                Err(source) => {
                    return Err(Attempt::Retry(UploadError::Transport {
                        artifact: artifact.into(),
                        host: host.clone(),
                        attempts: attempts.load(std::sync::atomic::Ordering::Relaxed),
                        source,
                    }));
                }
            };
            let status = response.status();
            if status.is_success() {
                return Ok(());
            }
            let text = response.text().await.unwrap_or_default();
            let err = UploadError::Refused {
                artifact: artifact.into(),
                status: status.as_u16(),
                body: flamefleet_api::text::truncated(text.trim(), MAX_ERROR_BODY),
            };
            let transient = status.is_server_error()
                || status == reqwest::StatusCode::REQUEST_TIMEOUT
                || status == reqwest::StatusCode::TOO_MANY_REQUESTS;
            Err(if transient {
                Attempt::Retry(err)
            } else {
                Attempt::Final(err)
            })
        };
        let backoff = ExponentialBuilder::default()
            .with_min_delay(self.policy.first_backoff)
            .with_max_times(self.policy.retries)
            .with_jitter();
        once.retry(backoff)
            .when(|e| matches!(e, Attempt::Retry(_)))
            .notify(|e, delay| {
                let (Attempt::Retry(e) | Attempt::Final(e)) = e;
                tracing::warn!(artifact, error = %e, ?delay, "upload failed, retrying");
            })
            .await
            .map_err(|a| match a {
                Attempt::Retry(e) | Attempt::Final(e) => e,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_known_input() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
