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
