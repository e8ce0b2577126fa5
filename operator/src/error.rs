//! The operator's error type: one variant per way a reconcile can fail.

use thiserror::Error;

/// Errors of the operator's controllers.
#[derive(Debug, Error)]
pub enum Error {
    /// A call to the Kubernetes API failed.
    #[error("Kubernetes API: {action}: {source}")]
    Kube {
        /// What was being done.
        action: String,
        /// kube's error.
        source: kube::Error,
    },
    /// The ProfileRequest lacks metadata the API server always sets (name, namespace, uid).
    #[error("ProfileRequest has no {0}; expected the API server to set it")]
    MissingMetadata(&'static str),
    /// The spec's label selector cannot be turned into a Kubernetes selector.
    #[error("invalid selector: {0}; fix spec.selector (matchLabels / matchExpressions)")]
    Selector(String),
    /// A request or artifact name cannot form a store key.
    #[error(transparent)]
    Key(#[from] crate::store::KeyError),
    /// The artifact store refused or failed.
    #[error("artifact store: {0}")]
    Store(#[from] crate::store::StoreError),
    /// A helper of the API crate failed (status bodies, durations).
    #[error(transparent)]
    Api(#[from] flamefleet_api::Error),
    /// The finalizer wrapper failed (adding/removing the finalizer, or the wrapped step).
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// TLS material for talking to agents is unusable.
    #[error("agent TLS configuration: {0}")]
    Tls(String),
    /// The sampling controllers' caches failed.
    #[error("fleet sampling: {0}")]
    Sampling(String),
    /// The API server refused a field the installed CRD does not declare: the CRDs are
    /// older than this operator (Helm never upgrades a chart's CRDs).
    #[error(
        "Kubernetes API: {action}: {message}; the installed CRDs are older than this operator: \
         apply this version's CRDs with `kubectl apply --server-side -f charts/flamefleet/crds/` \
         (Helm installs a chart's CRDs only when they are absent and never upgrades them)"
    )]
    OutdatedCrd {
        /// What was being done.
        action: String,
        /// The API server's message naming the field.
        message: String,
    },
    /// Leader election failed.
    #[error("leader election on Lease {lease}: {reason}")]
    Leader {
        /// The Lease name.
        lease: String,
        /// What failed.
        reason: String,
    },
}

/// Whether an API server message refuses a field its schema does not declare (server-side
/// apply: "field not declared in schema"; strict field validation: "unknown field").
fn names_an_undeclared_field(message: &str) -> bool {
    message.contains("field not declared in schema") || message.contains("unknown field")
}

impl Error {
    /// Wraps a kube error with what was being done.
    pub fn kube(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let action = action.into();
        move |source| match source {
            kube::Error::Api(status) if names_an_undeclared_field(&status.message) => {
                Self::OutdatedCrd {
                    action,
                    message: status.message,
                }
            }
            source => Self::Kube { action, source },
        }
    }

    /// True when the API server refused a write because another manager changed the object.
    pub fn is_conflict(&self) -> bool {
        use kube::runtime::finalizer::Error as F;
        match self {
            Self::Kube {
                source: kube::Error::Api(status),
                ..
            } => status.code == 409,
            Self::Finalizer(inner) => match inner.as_ref() {
                F::ApplyFailed(e) | F::CleanupFailed(e) => e.is_conflict(),
                _ => false,
            },
            _ => false,
        }
    }

    /// A short, stable label for metrics (one per variant; a finalizer error reports the
    /// variant of the step it wraps).
    pub fn metric_label(&self) -> &'static str {
        use kube::runtime::finalizer::Error as F;
        match self {
            Self::Finalizer(inner) => match inner.as_ref() {
                F::ApplyFailed(e) | F::CleanupFailed(e) => e.metric_label(),
                _ => "finalizer",
            },
            Self::Kube { .. } => "kube",
            Self::MissingMetadata(_) => "missing_metadata",
            Self::Selector(_) => "selector",
            Self::Key(_) => "key",
            Self::Store(_) => "store",
            Self::Api(_) => "api",
            Self::Tls(_) => "tls",
            Self::Sampling(_) => "sampling",
            Self::Leader { .. } => "leader",
            Self::OutdatedCrd { .. } => "outdated_crd",
        }
    }
}

/// Result type of the operator.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            message: message.into(),
            reason: "BadRequest".into(),
            ..Default::default()
        }))
    }

    #[test]
    fn a_field_the_installed_crd_lacks_says_to_apply_the_crds() {
        // What kube-apiserver answers a server-side apply whose field the CRD's schema lacks.
        let e = Error::kube("applying the status of ProfileRequest r")(api_error(
            500,
            "failed to create typed patch object (default/r; flamefleet.dev/v1alpha1, \
             Kind=ProfileRequest): .status.summary.cpu: field not declared in schema",
        ));
        assert_eq!(e.metric_label(), "outdated_crd");
        let text = e.to_string();
        assert!(text.contains(".status.summary.cpu"), "{text}");
        assert!(
            text.contains("kubectl apply --server-side -f charts/flamefleet/crds/"),
            "{text}"
        );
        let other = Error::kube("getting r")(api_error(404, "not found"));
        assert_eq!(other.metric_label(), "kube");
    }
}
