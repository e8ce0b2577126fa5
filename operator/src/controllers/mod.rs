//! The operator's controllers: [`profile_request`] (captures), [`sampling`] (the policies'
//! scheduled runs) and [`download`] (signed URLs for finished requests). Each is a
//! kube-runtime `Controller` whose reconcile is idempotent, and all retry failures through
//! the one [`error_policy`].

pub mod download;
pub mod profile_request;
pub mod sampling;

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};

use crate::Error;
use crate::metrics::Metrics;

/// Retry after a write conflict: another writer changed the object since it was read, and
/// the next attempt reads it again.
const CONFLICT_RETRY: Duration = Duration::from_millis(200);
/// Retry after any other failure (an API server or store error, which takes time to pass).
const ERROR_RETRY: Duration = Duration::from_secs(5);

/// What every controller's context gives the shared [`error_policy`].
pub trait ControllerContext {
    /// The operator's metrics, where failed reconciles are counted.
    fn metrics(&self) -> &Metrics;
}

/// The error policy of every controller: counts the failure by error kind, and retries
/// quickly after a write conflict, otherwise after a few seconds.
pub fn error_policy<K, C>(object: Arc<K>, error: &Error, ctx: Arc<C>) -> Action
where
    K: Resource<DynamicType = ()>,
    C: ControllerContext,
{
    ctx.metrics().reconcile_failed(error);
    let kind = K::kind(&());
    if error.is_conflict() {
        tracing::debug!(%kind, name = %object.name_any(), "changed meanwhile; retrying");
        Action::requeue(CONFLICT_RETRY)
    } else {
        tracing::warn!(%kind, name = %object.name_any(), "reconcile failed: {error}");
        Action::requeue(ERROR_RETRY)
    }
}
