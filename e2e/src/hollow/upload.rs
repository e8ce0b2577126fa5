//! Uploads as the real agent does them (node-agent `service/upload.rs`): one HTTP PUT to
//! the pre-signed URL with the body's hex sha256 in `x-flamefleet-sha256`, the store's CA
//! trusted besides the system roots, the slot's size limit checked first, and transient
//! failures (transport errors, 408, 429, 5xx) retried with exponential backoff and jitter.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable as _};
use sha2::{Digest as _, Sha256};

use super::HollowError;

/// Header carrying the hex sha256 of the uploaded body (the store checks it).
pub const SHA256_HEADER: &str = "x-flamefleet-sha256";

/// Hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// One HTTP client for a whole hollow fleet (one connection pool, like one agent's).
#[derive(Debug, Clone)]
pub struct Uploader {
    client: reqwest::Client,
}

enum Attempt {
    Retry(String),
    Final(String),
}

impl Uploader {
    /// A client trusting `ca_pem` (the store's CA) besides the system roots.
    ///
    /// # Errors
    /// [`HollowError::Client`] when the client cannot be built or the CA does not parse.
    pub fn new(ca_pem: Option<&[u8]>, pool_per_host: usize) -> Result<Self, HollowError> {
        let mut builder = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .connect_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(pool_per_host)
            .user_agent(concat!(
                "flamefleet-hollow-agent/",
                env!("CARGO_PKG_VERSION")
            ));
        if let Some(pem) = ca_pem {
            for root in reqwest::Certificate::from_pem_bundle(pem).map_err(HollowError::Client)? {
                builder = builder.add_root_certificate(root);
            }
        }
        Ok(Self {
            client: builder.build().map_err(HollowError::Client)?,
        })
    }

    /// PUTs `body` to `url`; the error is the text a FAILED stage carries.
    pub async fn put(
        &self,
        artifact: &str,
        url: &str,
        body: Vec<u8>,
        max_bytes: u64,
    ) -> Result<(), String> {
        let size = body.len() as u64;
        if max_bytes != 0 && size > max_bytes {
            return Err(format!(
                "artifact {artifact} is {size} bytes, the upload slot allows at most {max_bytes}"
            ));
        }
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| format!("upload URL of {artifact} is not a valid URL: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(format!(
                "upload URL of {artifact}: expected scheme http or https, found {}",
                parsed.scheme()
            ));
        }
        let digest = sha256_hex(&body);
        let body = bytes::Bytes::from(body);
        let once = || async {
            let response = self
                .client
                .put(parsed.clone())
                .header(SHA256_HEADER, &digest)
                .body(body.clone())
                .send()
                .await
                .map_err(|e| Attempt::Retry(format!("upload of {artifact} failed: {e}")))?;
            let status = response.status();
            if status.is_success() {
                return Ok(());
            }
            let text = response.text().await.unwrap_or_default();
            let err = format!(
                "upload of {artifact} refused by the store: HTTP {}: {}",
                status.as_u16(),
                text.trim().chars().take(512).collect::<String>()
            );
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
            .with_min_delay(Duration::from_millis(200))
            .with_max_times(4)
            .with_jitter();
        once.retry(backoff)
            .when(|e| matches!(e, Attempt::Retry(_)))
            .await
            .map_err(|(Attempt::Retry(e) | Attempt::Final(e))| e)
    }
}
