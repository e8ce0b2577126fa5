//! Uploads an artifact to its pre-signed URL: one HTTP PUT with the body's
//! sha256 in `x-flamefleet-sha256` (the store refuses a body that does not
//! match), a timeout on every attempt, and retries with exponential backoff
//! for what may be transient (connection errors, timeouts, 408, 429, 5xx).
//! A refusal (other 4xx) is final and reported with the store's status code
//! and body. Given a deadline (the operator's, less a margin to report), retries
//! go on until then, each delay at most [`MAX_DEADLINE_BACKOFF`], so a store that
//! is down for a while (its pod rescheduled, an S3 endpoint refusing) delays the
//! result instead of failing it.
//!
//! The upload URL is a bearer credential until it expires (its query string
//! holds the signature), so no error of this module carries it: transport
//! errors drop their URL (`reqwest::Error`'s text includes it), and a store's
//! answer is cleaned of every query value of the URL and of anything shaped
//! like a signature parameter before it reaches a log line, a node message or
//! a status ([`redact_signatures`]).

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable as _};
use sha2::{Digest as _, Sha256};

/// Header carrying the hex sha256 of the uploaded body.
pub const SHA256_HEADER: &str = "x-flamefleet-sha256";

/// How much of a refusal's body goes into the error (stores answer with a
/// short text; anything longer is cut so a status message stays readable).
const MAX_ERROR_BODY: usize = 512;

/// Longest wait between two attempts when retrying until a deadline: a store back
/// from an outage is used within this.
pub const MAX_DEADLINE_BACKOFF: Duration = Duration::from_secs(4);

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
    /// The store's volume is full (HTTP 507): final, since space rarely returns within a
    /// capture's deadline; the next capture uploads once it has.
    #[error(
        "upload of {artifact} refused: the artifact store is full (StorageFull, HTTP 507): {body}; uploads work again once space is freed on the store's volume"
    )]
    StorageFull {
        /// Artifact name.
        artifact: String,
        /// Start of the response body.
        body: String,
    },
    /// The request could not be sent or timed out.
    #[error("upload of {artifact} to {host} failed after {attempts} attempts: {detail}")]
    Transport {
        /// Artifact name.
        artifact: String,
        /// Host of the URL (the query string holds the signature: never logged).
        host: String,
        /// Attempts made.
        attempts: usize,
        /// The last error and its causes, without the URL.
        detail: String,
        /// The last error, without its URL.
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

    /// PUTs `body` to `url` with its sha256, retrying transient failures the
    /// policy's number of times.
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
        self.put_before(artifact, url, body, max_bytes, None).await
    }

    /// [`Uploader::put`], but with `deadline`, transient failures are retried
    /// until it passes, each delay at most [`MAX_DEADLINE_BACKOFF`]; after it,
    /// no attempt starts beyond the policy's number.
    ///
    /// # Errors
    /// As [`Uploader::put`]; [`UploadError::Transport`] and a transient
    /// [`UploadError::Refused`] come from the last attempt before the deadline.
    pub async fn put_before(
        &self,
        artifact: &str,
        url: &str,
        body: &[u8],
        max_bytes: u64,
        deadline: Option<std::time::Instant>,
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
                    // Its text would name the URL, signature included.
                    let source = source.without_url();
                    return Err(Attempt::Retry(UploadError::Transport {
                        artifact: artifact.into(),
                        host: host.clone(),
                        attempts: attempts.load(std::sync::atomic::Ordering::Relaxed),
                        detail: redact_signatures(&error_chain(&source), &parsed),
                        source,
                    }));
                }
            };
            let status = response.status();
            if status.is_success() {
                return Ok(());
            }
            let text = read_error_body(response).await;
            let body = flamefleet_api::text::truncated(
                redact_signatures(text.trim(), &parsed).trim(),
                MAX_ERROR_BODY,
            );
            if status == reqwest::StatusCode::INSUFFICIENT_STORAGE {
                return Err(Attempt::Final(UploadError::StorageFull {
                    artifact: artifact.into(),
                    body,
                }));
            }
            let err = UploadError::Refused {
                artifact: artifact.into(),
                status: status.as_u16(),
                body,
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
        let mut backoff = ExponentialBuilder::default()
            .with_min_delay(self.policy.first_backoff)
            .with_max_times(self.policy.retries)
            .with_jitter();
        let remaining = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        if let Some(remaining) = remaining.filter(|r| !r.is_zero()) {
            // The delays alone stay within the deadline; `when` below stops an attempt
            // that would start after it (attempts take time too).
            backoff = backoff
                .without_max_times()
                .with_max_delay(MAX_DEADLINE_BACKOFF)
                .with_total_delay(Some(remaining));
        }
        let before_deadline = || {
            let tried = attempts.load(std::sync::atomic::Ordering::Relaxed);
            deadline.is_none_or(|d| std::time::Instant::now() < d) || tried <= self.policy.retries
        };
        once.retry(backoff)
            .when(|e| matches!(e, Attempt::Retry(_)) && before_deadline())
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

/// `error` and its causes, `: `-separated (`reqwest::Error`'s own text names none of them).
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

/// Most of a refusal's body read: enough for any store's error text, and a store that
/// answers with an endless body cannot make the agent buffer it.
const MAX_ERROR_BODY_READ: usize = 16 * 1024;

/// The start of a refusal's body, lossily decoded.
async fn read_error_body(mut response: reqwest::Response) -> String {
    let mut body = Vec::new();
    while body.len() < MAX_ERROR_BODY_READ {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    body.truncate(MAX_ERROR_BODY_READ);
    String::from_utf8_lossy(&body).into_owned()
}

/// Query parameters that carry a signature or credential in the URLs of the stores
/// Flamefleet signs for (the built-in store's `sig`; SigV4's `X-Amz-*`), and the XML
/// elements in which S3-compatible servers echo a refused signature.
const SIGNATURE_PARAMS: [&str; 4] = [
    "sig",
    "x-amz-signature",
    "x-amz-credential",
    "x-amz-security-token",
];
const SIGNATURE_ELEMENTS: [&str; 3] = ["SignatureProvided", "StringToSign", "CanonicalRequest"];

/// `text` (a store's answer) without what would let a reader reuse `url`: the URL's
/// query string, every signature parameter with its value (`sig=...`,
/// `X-Amz-Signature=...`: not even the name stays, so logs can be searched for it), every
/// other query value of `url` longer than a few characters, and the content of the XML
/// elements in which S3-compatible servers echo the signature they refused.
pub fn redact_signatures(text: &str, url: &reqwest::Url) -> String {
    const REDACTED: &str = "<redacted>";
    let mut out = text.to_owned();
    if let Some(query) = url.query()
        && !query.is_empty()
    {
        out = out.replace(query, "<redacted query>");
    }
    let lower = out.to_ascii_lowercase();
    let bytes = out.as_bytes();
    let mut cleaned = String::with_capacity(out.len());
    let mut i = 0;
    'scan: while i < out.len() {
        let at_boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'-');
        if at_boundary {
            for param in SIGNATURE_PARAMS {
                let key = format!("{param}=");
                if lower[i..].starts_with(&key) {
                    cleaned.push_str("<redacted signature>");
                    i += key.len();
                    while i < out.len()
                        && !matches!(bytes[i], b'&' | b'"' | b'\'' | b'<' | b' ' | b'\n')
                    {
                        i += 1;
                    }
                    continue 'scan;
                }
            }
        }
        let ch = out[i..].chars().next().unwrap_or(' ');
        cleaned.push(ch);
        i += ch.len_utf8();
    }
    let mut out = cleaned;
    for (_, value) in url.query_pairs() {
        if value.len() >= 8 {
            out = out.replace(value.as_ref(), REDACTED);
        }
    }
    for element in SIGNATURE_ELEMENTS {
        let (open, close) = (format!("<{element}>"), format!("</{element}>"));
        let mut from = 0;
        while let Some(start) = out[from..].find(&open).map(|i| from + i + open.len()) {
            let end = out[start..].find(&close).map_or(out.len(), |i| start + i);
            out.replace_range(start..end, REDACTED);
            from = start + REDACTED.len();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_answers_lose_every_signature() {
        let url = reqwest::Url::parse(
            "https://store.example/v1/artifacts/ns/r/a?expires=1700000000&max=64&sig=0123456789abcdef",
        )
        .unwrap();
        let body = "bad request for /v1/artifacts/ns/r/a?expires=1700000000&max=64&sig=0123456789abcdef: Sig=ffffeeeeddddcccc&x=1 <SignatureProvided>abcdef0123</SignatureProvided> X-Amz-Signature=deadbeefdeadbeef \u{e9}";
        let clean = redact_signatures(body, &url);
        assert!(!clean.contains("0123456789abcdef"), "{clean}");
        assert!(!clean.contains("ffffeeeeddddcccc"), "{clean}");
        assert!(!clean.contains("abcdef0123"), "{clean}");
        assert!(!clean.contains("deadbeef"), "{clean}");
        assert!(
            clean.contains("bad request for /v1/artifacts/ns/r/a?"),
            "{clean}"
        );
        assert!(clean.ends_with('\u{e9}'), "{clean}");
    }

    /// A store that refuses connections for `outage`, then answers every PUT with 200;
    /// returns its URL.
    async fn store_back_after(outage: Duration) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        tokio::spawn(async move {
            tokio::time::sleep(outage).await;
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .expect("binding the store's port again");
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    // Read the request head and its 5-byte body, then answer.
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !seen.ends_with(b"\r\n\r\nhello") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = conn
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        .await;
                });
            }
        });
        format!("http://127.0.0.1:{port}/artifact?sig=0123456789abcdef")
    }

    #[tokio::test]
    async fn uploads_outlast_a_store_outage_until_the_deadline() {
        let outage = Duration::from_secs(2);
        let policy = UploadPolicy {
            retries: 1,
            first_backoff: Duration::from_millis(50),
            ..UploadPolicy::default()
        };
        let uploader = Uploader::new(policy).unwrap();
        // Without a deadline, the policy's two attempts fall within the outage.
        let url = store_back_after(outage).await;
        let err = uploader
            .put("cpu.pb.gz", &url, b"hello", 0)
            .await
            .expect_err("the store is down");
        let text = err.to_string();
        assert!(text.contains("failed after 2 attempts"), "{text}");
        assert!(!text.contains("0123456789abcdef"), "{text}");
        // With one, attempts go on past the outage and the upload lands.
        let url = store_back_after(outage).await;
        let started = std::time::Instant::now();
        uploader
            .put_before(
                "cpu.pb.gz",
                &url,
                b"hello",
                0,
                Some(started + Duration::from_secs(30)),
            )
            .await
            .expect("uploaded once the store is back");
        assert!(started.elapsed() >= outage);
        // A deadline inside the outage fails at it, with the store's error.
        let url = store_back_after(Duration::from_secs(3600)).await;
        let started = std::time::Instant::now();
        let err = uploader
            .put_before(
                "cpu.pb.gz",
                &url,
                b"hello",
                0,
                Some(started + Duration::from_millis(1500)),
            )
            .await
            .expect_err("the store stays down past the deadline");
        assert!(started.elapsed() < Duration::from_secs(6));
        assert!(
            err.to_string().contains("Connection refused")
                || err.to_string().contains("connection refused")
                || err.to_string().contains("tcp connect error"),
            "{err}"
        );
    }

    #[test]
    fn sha256_of_known_input() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
