//! Who may download a request's artifacts with a Kubernetes bearer token.
//!
//! The rule is the Kubernetes one: whoever may `get` the ProfileRequest may read its
//! artifacts. [`KubeAuthorizer`] asks the API server (TokenReview, then
//! SubjectAccessReview); tests plug in their own [`DownloadAuthorizer`].

use async_trait::async_trait;
use k8s_openapi::api::{
    authentication::v1::{TokenReview, TokenReviewSpec},
    authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec},
};
use kube::api::{Api, PostParams};
use thiserror::Error;

use super::key::RequestRef;

/// API group of the ProfileRequest resource.
pub const PROFILE_REQUEST_GROUP: &str = "flamefleet.dev";
/// Plural resource name of ProfileRequest.
pub const PROFILE_REQUEST_RESOURCE: &str = "profilerequests";

/// The outcome of an authorization check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The token's user may read the request's artifacts.
    Allowed,
    /// The token does not identify anyone (HTTP 401).
    Unauthenticated {
        /// Why, for the client.
        reason: String,
    },
    /// The user is known but may not `get` the request (HTTP 403).
    Denied {
        /// Why, for the client.
        reason: String,
    },
}

/// The authorizer could not reach a decision.
#[derive(Debug, Error)]
pub enum AuthorizeError {
    /// The call to the API server failed.
    #[error("{review} against the API server failed: {source}")]
    Kube {
        /// Which review failed.
        review: &'static str,
        /// The cause.
        source: kube::Error,
    },
}

/// Decides whether the holder of a bearer token may download a request's artifacts.
#[async_trait]
pub trait DownloadAuthorizer: Send + Sync + std::fmt::Debug {
    /// Checks `token` for reading the artifacts of `request`.
    async fn authorize(
        &self,
        token: &str,
        request: &RequestRef,
    ) -> Result<Decision, AuthorizeError>;
}

/// An authorizer for stores without Kubernetes: every token is refused, only signed URLs work.
#[derive(Debug, Default, Clone, Copy)]
pub struct RejectTokens;

#[async_trait]
impl DownloadAuthorizer for RejectTokens {
    async fn authorize(&self, _: &str, _: &RequestRef) -> Result<Decision, AuthorizeError> {
        Ok(Decision::Unauthenticated {
            reason: "this artifact store accepts no bearer tokens; use a signed download URL"
                .to_owned(),
        })
    }
}

/// Authorizes through the API server: TokenReview for who the token is, then
/// SubjectAccessReview for `get` on the ProfileRequest.
///
/// The operator's service account needs `create` on `tokenreviews` and
/// `subjectaccessreviews` (the `system:auth-delegator` ClusterRole).
#[derive(Clone)]
pub struct KubeAuthorizer {
    client: kube::Client,
}

impl std::fmt::Debug for KubeAuthorizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeAuthorizer")
    }
}

impl KubeAuthorizer {
    /// An authorizer that asks the API server behind `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

#[async_trait]
impl DownloadAuthorizer for KubeAuthorizer {
    async fn authorize(
        &self,
        token: &str,
        request: &RequestRef,
    ) -> Result<Decision, AuthorizeError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                ..Default::default()
            },
            ..Default::default()
        };
        let review = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|source| AuthorizeError::Kube {
                review: "TokenReview",
                source,
            })?;
        let status = review.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(user)) => user,
            _ => {
                let why = status
                    .error
                    .filter(|e| !e.is_empty())
                    .unwrap_or_else(|| "the API server does not recognise it".to_owned());
                return Ok(Decision::Unauthenticated {
                    reason: format!("bearer token rejected: {why}"),
                });
            }
        };
        let username = user.username.clone().unwrap_or_default();
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                resource_attributes: Some(ResourceAttributes {
                    group: Some(PROFILE_REQUEST_GROUP.to_owned()),
                    resource: Some(PROFILE_REQUEST_RESOURCE.to_owned()),
                    verb: Some("get".to_owned()),
                    namespace: Some(request.namespace().to_owned()),
                    name: Some(request.name().to_owned()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let access = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &access)
            .await
            .map_err(|source| AuthorizeError::Kube {
                review: "SubjectAccessReview",
                source,
            })?;
        match access.status {
            Some(s) if s.allowed => Ok(Decision::Allowed),
            other => {
                let why = other
                    .and_then(|s| s.reason)
                    .filter(|r| !r.is_empty())
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default();
                Ok(Decision::Denied {
                    reason: format!(
                        "user {username:?} may not get profilerequests.{PROFILE_REQUEST_GROUP} {:?} in namespace {:?}{why}",
                        request.name(),
                        request.namespace()
                    ),
                })
            }
        }
    }
}

/// Remembers another authorizer's decisions for a short time, so that downloading the
/// several artifacts of one request costs one TokenReview and one SubjectAccessReview.
///
/// Bounded: at most `max_entries` decisions, each kept for `ttl`. When the cache is full
/// of live entries, new decisions are simply not remembered. Errors are never cached.
/// A revoked permission can thus outlive its revocation by up to `ttl`.
#[derive(Debug)]
pub struct CachedAuthorizer<A> {
    inner: A,
    ttl: std::time::Duration,
    max_entries: usize,
    entries: std::sync::Mutex<std::collections::HashMap<[u8; 32], (std::time::Instant, Decision)>>,
}

impl<A: DownloadAuthorizer> CachedAuthorizer<A> {
    /// Caches `inner`'s decisions for `ttl`, at most `max_entries` of them.
    pub fn new(inner: A, ttl: std::time::Duration, max_entries: usize) -> Self {
        Self {
            inner,
            ttl,
            max_entries,
            entries: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// The cache key: a digest, so that tokens are not kept in memory in clear.
    fn cache_key(token: &str, request: &RequestRef) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for part in [token, request.namespace(), request.name()] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        h.finalize().into()
    }
}

#[async_trait]
impl<A: DownloadAuthorizer> DownloadAuthorizer for CachedAuthorizer<A> {
    async fn authorize(
        &self,
        token: &str,
        request: &RequestRef,
    ) -> Result<Decision, AuthorizeError> {
        let key = Self::cache_key(token, request);
        let now = std::time::Instant::now();
        {
            // A poisoned lock only means another thread panicked mid-update of a cache:
            // its content is still a valid map.
            let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((at, decision)) = entries.get(&key)
                && now.duration_since(*at) < self.ttl
            {
                return Ok(decision.clone());
            }
        }
        let decision = self.inner.authorize(token, request).await?;
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() >= self.max_entries {
            entries.retain(|_, (at, _)| now.duration_since(*at) < self.ttl);
        }
        if entries.len() < self.max_entries {
            entries.insert(key, (now, decision.clone()));
        }
        Ok(decision)
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
        time::Duration,
    };

    use super::*;

    #[derive(Debug, Default)]
    struct Counting(AtomicUsize);

    #[async_trait]
    impl DownloadAuthorizer for Counting {
        async fn authorize(&self, token: &str, _: &RequestRef) -> Result<Decision, AuthorizeError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(if token == "good" {
                Decision::Allowed
            } else {
                Decision::Denied {
                    reason: "no".into(),
                }
            })
        }
    }

    const UID: &str = "0f8fad5b-d9cb-469f-a165-70867728950e";

    #[tokio::test]
    async fn cache_answers_repeats_and_stays_bounded() {
        let cache = CachedAuthorizer::new(Counting::default(), Duration::from_secs(60), 2);
        let a = RequestRef::new("ns", "a", UID).unwrap();
        let b = RequestRef::new("ns", "b", UID).unwrap();
        let c = RequestRef::new("ns", "c", UID).unwrap();
        for _ in 0..3 {
            assert_eq!(
                cache.authorize("good", &a).await.unwrap(),
                Decision::Allowed
            );
        }
        assert_eq!(cache.inner.0.load(Ordering::Relaxed), 1);
        // Another request or token is another decision.
        assert!(matches!(
            cache.authorize("bad", &a).await.unwrap(),
            Decision::Denied { .. }
        ));
        assert_eq!(
            cache.authorize("good", &b).await.unwrap(),
            Decision::Allowed
        );
        assert_eq!(cache.inner.0.load(Ordering::Relaxed), 3);
        // Full: the next decision is made but not remembered.
        cache.authorize("good", &c).await.unwrap();
        cache.authorize("good", &c).await.unwrap();
        assert_eq!(cache.inner.0.load(Ordering::Relaxed), 5);
        assert_eq!(cache.entries.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn expired_decisions_are_asked_again() {
        let cache = CachedAuthorizer::new(Counting::default(), Duration::ZERO, 10);
        let a = RequestRef::new("ns", "a", UID).unwrap();
        cache.authorize("good", &a).await.unwrap();
        cache.authorize("good", &a).await.unwrap();
        assert_eq!(cache.inner.0.load(Ordering::Relaxed), 2);
    }
}
