//! HMAC-SHA256 signatures for the built-in store's expiring URLs.
//!
//! A signature covers everything that limits what its URL allows: the HTTP method, the
//! object key (or request prefix, for DELETE), the expiry, the size limit and the expected
//! SHA-256. Changing any of them in the URL invalidates it. The signed values travel in the
//! query string (`expires`, `max`, `sha256`, `sig`), so the server needs no state to check
//! a URL, only the shared secret.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::Sha256;
use thiserror::Error;

use super::digest::Sha256Digest;

/// Shortest secret accepted: as long as the HMAC-SHA256 output.
pub const MIN_SECRET_LEN: usize = 32;

/// Domain-separation tag and version of the string that gets signed.
const CANONICAL_VERSION: &str = "flamefleet-artifact-v1";

/// A secret that cannot sign.
#[derive(Debug, Error)]
#[error(
    "the URL signing secret is {found} bytes long; expected at least {MIN_SECRET_LEN} random bytes (e.g. `head -c 32 /dev/urandom`)"
)]
pub struct SecretTooShort {
    /// Length of the refused secret.
    pub found: usize,
}

/// Why a signed URL was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SignatureError {
    /// The URL lacks a parameter every signed URL carries.
    #[error(
        "the URL is not signed: query parameter `{0}` is missing; ask the operator for a fresh URL"
    )]
    Missing(&'static str),
    /// A parameter has the wrong format.
    #[error("query parameter `{name}` is malformed: expected {expected}, found {found:?}")]
    Malformed {
        /// The parameter.
        name: &'static str,
        /// What it should look like.
        expected: &'static str,
        /// What it was.
        found: String,
    },
    /// The URL's expiry has passed.
    #[error(
        "the signed URL expired at {expires} (unix seconds), {ago}s ago; ask the operator for a fresh URL"
    )]
    Expired {
        /// Expiry in unix seconds.
        expires: u64,
        /// How many seconds ago that was.
        ago: u64,
    },
    /// The signature does not match the request (other method, key or parameters).
    #[error(
        "the signature does not match this {method} of {key}: the URL was signed for another method, key, size limit, checksum or expiry, or with another secret"
    )]
    Mismatch {
        /// Method of the refused request.
        method: String,
        /// Key of the refused request.
        key: String,
    },
    /// An upload URL without a size limit.
    #[error("the signed upload URL carries no size limit (`max`); upload URLs must be bounded")]
    UnboundedUpload,
}

/// What one signed URL allows: one method on one key, until an expiry, within limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// HTTP method, upper case (`GET`, `PUT`, `DELETE`).
    pub method: String,
    /// The object key, or the request prefix for DELETE.
    pub key: String,
    /// Expiry, in seconds since the Unix epoch.
    pub expires: u64,
    /// Largest body accepted (uploads).
    pub max_bytes: Option<u64>,
    /// SHA-256 the body must have (uploads).
    pub sha256: Option<Sha256Digest>,
}

impl Grant {
    /// A grant for `method` on `key`, valid for `ttl` from now.
    pub fn new(method: &str, key: impl Into<String>, ttl: Duration) -> Self {
        let expires = SystemTime::now()
            .checked_add(ttl)
            .unwrap_or(SystemTime::now())
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Self {
            method: method.to_ascii_uppercase(),
            key: key.into(),
            expires,
            max_bytes: None,
            sha256: None,
        }
    }

    /// Sets the size limit.
    pub fn with_max_bytes(mut self, max: u64) -> Self {
        self.max_bytes = Some(max);
        self
    }

    /// Sets the expected SHA-256.
    pub fn with_sha256(mut self, sha256: Option<Sha256Digest>) -> Self {
        self.sha256 = sha256;
        self
    }

    /// When the grant expires.
    pub fn expires_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(self.expires)
    }

    fn canonical(&self) -> String {
        format!(
            "{CANONICAL_VERSION}\n{}\n{}\n{}\n{}\n{}",
            self.method,
            self.key,
            self.expires,
            self.max_bytes.map(|m| m.to_string()).unwrap_or_default(),
            self.sha256.map(|d| d.to_string()).unwrap_or_default(),
        )
    }
}

/// The signature-related query parameters of a request, as received.
#[derive(Debug, Default, Clone, Deserialize)]
pub struct SignedQuery {
    /// Expiry in unix seconds.
    pub expires: Option<String>,
    /// Size limit in bytes.
    pub max: Option<String>,
    /// Expected SHA-256, hex.
    pub sha256: Option<String>,
    /// The signature, hex.
    pub sig: Option<String>,
}

impl SignedQuery {
    /// Whether the request carries a signature at all (as opposed to, say, a bearer token).
    pub fn is_signed(&self) -> bool {
        self.sig.is_some()
    }
}

/// Signs and checks grants with a shared secret.
#[derive(Clone)]
pub struct UrlSigner {
    secret: Vec<u8>,
}

impl std::fmt::Debug for UrlSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UrlSigner { secret: <redacted> }")
    }
}

impl UrlSigner {
    /// A signer with `secret`, which must be at least [`MIN_SECRET_LEN`] bytes.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, SecretTooShort> {
        let secret = secret.into();
        if secret.len() < MIN_SECRET_LEN {
            return Err(SecretTooShort {
                found: secret.len(),
            });
        }
        Ok(Self { secret })
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes keys of any length, so this cannot fail.
        <Hmac<Sha256> as Mac>::new_from_slice(&self.secret)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"))
    }

    /// The query parameters that carry `grant` and its signature.
    pub fn query_pairs(&self, grant: &Grant) -> Vec<(&'static str, String)> {
        let mut mac = self.mac();
        mac.update(grant.canonical().as_bytes());
        let sig = hex::encode(mac.finalize().into_bytes());
        let mut pairs = vec![("expires", grant.expires.to_string())];
        if let Some(max) = grant.max_bytes {
            pairs.push(("max", max.to_string()));
        }
        if let Some(sha) = grant.sha256 {
            pairs.push(("sha256", sha.to_string()));
        }
        pairs.push(("sig", sig));
        pairs
    }

    /// The URL `<base><path><grant.key>` carrying `grant` and its signature.
    ///
    /// # Errors
    /// When the key cannot be joined onto the base URL.
    pub fn signed_url(
        &self,
        base: &url::Url,
        path: &str,
        grant: &Grant,
    ) -> Result<url::Url, url::ParseError> {
        let mut url = base.join(path)?.join(&grant.key)?;
        url.query_pairs_mut().extend_pairs(self.query_pairs(grant));
        Ok(url)
    }

    /// Checks that `query` signs `method` on `key` and has not expired at `now`.
    ///
    /// Returns the verified grant; an upload grant always has a size limit.
    pub fn verify(
        &self,
        method: &str,
        key: &str,
        query: &SignedQuery,
        now: SystemTime,
    ) -> Result<Grant, SignatureError> {
        let sig_hex = query.sig.as_deref().ok_or(SignatureError::Missing("sig"))?;
        let expires_raw = query
            .expires
            .as_deref()
            .ok_or(SignatureError::Missing("expires"))?;
        let expires = expires_raw
            .parse::<u64>()
            .map_err(|_| SignatureError::Malformed {
                name: "expires",
                expected: "unix seconds",
                found: expires_raw.to_owned(),
            })?;
        let max_bytes = query
            .max
            .as_deref()
            .map(|m| {
                m.parse::<u64>().map_err(|_| SignatureError::Malformed {
                    name: "max",
                    expected: "a byte count",
                    found: m.to_owned(),
                })
            })
            .transpose()?;
        let sha256 = query
            .sha256
            .as_deref()
            .map(|s| {
                s.parse::<Sha256Digest>()
                    .map_err(|_| SignatureError::Malformed {
                        name: "sha256",
                        expected: "64 hexadecimal characters",
                        found: s.to_owned(),
                    })
            })
            .transpose()?;
        let sig = hex::decode(sig_hex).map_err(|_| SignatureError::Malformed {
            name: "sig",
            expected: "hexadecimal",
            found: sig_hex.to_owned(),
        })?;
        let grant = Grant {
            method: method.to_ascii_uppercase(),
            key: key.to_owned(),
            expires,
            max_bytes,
            sha256,
        };
        let mut mac = self.mac();
        mac.update(grant.canonical().as_bytes());
        // Constant-time comparison; checked before expiry so a forged URL never learns more.
        mac.verify_slice(&sig)
            .map_err(|_| SignatureError::Mismatch {
                method: grant.method.clone(),
                key: grant.key.clone(),
            })?;
        let now_secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if now_secs >= expires {
            return Err(SignatureError::Expired {
                expires,
                ago: now_secs - expires,
            });
        }
        if grant.method == "PUT" && grant.max_bytes.is_none() {
            return Err(SignatureError::UnboundedUpload);
        }
        Ok(grant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer() -> UrlSigner {
        UrlSigner::new(vec![7u8; 32]).unwrap()
    }

    fn query_of(pairs: Vec<(&'static str, String)>) -> SignedQuery {
        let mut q = SignedQuery::default();
        for (k, v) in pairs {
            match k {
                "expires" => q.expires = Some(v),
                "max" => q.max = Some(v),
                "sha256" => q.sha256 = Some(v),
                "sig" => q.sig = Some(v),
                _ => unreachable!(),
            }
        }
        q
    }

    #[test]
    fn signature_covers_method_key_limits_and_expiry() {
        let s = signer();
        let sha = Sha256Digest::of(b"x");
        let grant = Grant::new("PUT", "ns/k", Duration::from_secs(60))
            .with_max_bytes(10)
            .with_sha256(Some(sha));
        let q = query_of(s.query_pairs(&grant));
        let now = SystemTime::now();
        assert_eq!(s.verify("PUT", "ns/k", &q, now).unwrap(), grant);
        assert!(matches!(
            s.verify("GET", "ns/k", &q, now),
            Err(SignatureError::Mismatch { .. })
        ));
        assert!(matches!(
            s.verify("PUT", "ns/l", &q, now),
            Err(SignatureError::Mismatch { .. })
        ));
        for tamper in [
            SignedQuery {
                max: Some("11".into()),
                ..q.clone()
            },
            SignedQuery {
                sha256: None,
                ..q.clone()
            },
            SignedQuery {
                expires: Some((grant.expires + 1).to_string()),
                ..q.clone()
            },
        ] {
            assert!(matches!(
                s.verify("PUT", "ns/k", &tamper, now),
                Err(SignatureError::Mismatch { .. })
            ));
        }
        let other = UrlSigner::new(vec![8u8; 32]).unwrap();
        assert!(other.verify("PUT", "ns/k", &q, now).is_err());
        let later = now + Duration::from_secs(120);
        assert!(matches!(
            s.verify("PUT", "ns/k", &q, later),
            Err(SignatureError::Expired { .. })
        ));
    }

    #[test]
    fn uploads_must_be_bounded_and_secrets_long() {
        let s = signer();
        let q = query_of(s.query_pairs(&Grant::new("PUT", "k", Duration::from_secs(60))));
        assert_eq!(
            s.verify("PUT", "k", &q, SystemTime::now()),
            Err(SignatureError::UnboundedUpload)
        );
        assert!(UrlSigner::new(vec![0u8; 31]).is_err());
        assert_eq!(
            s.verify("GET", "k", &SignedQuery::default(), SystemTime::now()),
            Err(SignatureError::Missing("sig"))
        );
    }
}
