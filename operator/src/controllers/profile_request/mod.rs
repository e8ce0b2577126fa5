//! The ProfileRequest controller: resolve targets, dispatch captures to agents, aggregate
//! their results into the request's status, clean up artifacts, expire finished requests.

pub mod admission;
pub mod aggregate;
pub mod limits;
pub mod reconcile;
pub mod resolve;
pub mod result_slices;
pub mod result_table;
pub mod status;
pub mod store_wait;
pub mod ttl;

use std::sync::Arc;

use flamefleet_api::ProfileRequest;
use futures::StreamExt;
use kube::Api;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::dispatch::Dispatcher;
use crate::metrics::Metrics;
use crate::store::ArtifactStore;

/// What every reconcile shares.
pub struct Context {
    /// Kubernetes client.
    pub client: kube::Client,
    /// The artifact store.
    pub store: Arc<dyn ArtifactStore>,
    /// Capture sessions in progress.
    pub dispatcher: Arc<Dispatcher<result_table::ResultTable>>,
    /// Event recorder.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Namespace of the agent pods.
    pub agent_namespace: String,
    /// The operator's cluster-wide pod cache (`sampling::fleet`), where agent discovery
    /// finds each node's agent without listing every agent pod per request; `None` lists.
    pub pods: Option<Store<crate::pods::slim::SlimPod>>,
    /// Per-tenant cost limits.
    pub limits: limits::TenantLimits,
    /// The operator's `--request-selector` (limits count only this shard's requests).
    pub request_selector: Option<String>,
    /// The operator's cluster-wide Namespace cache (`sampling::fleet`), where the
    /// per-namespace limit annotation is read without a GET per admission; `None` gets.
    pub namespaces: Option<Store<k8s_openapi::api::core::v1::Namespace>>,
    /// The one admission point of the concurrency limits.
    pub admission: admission::Admission,
    /// Requests waiting, Pending, for an unreachable artifact store (`--store-wait`).
    pub store_waits: store_wait::StoreWaits,
    /// The controller's cache of the requests it handles (the same selector), set by
    /// [`run`]: the concurrency limits count Running requests from it instead of listing
    /// every request from the API server at each admission, which made a burst of N
    /// requests cost N lists of up to N objects.
    pub requests: std::sync::RwLock<Option<Store<ProfileRequest>>>,
}

impl super::ControllerContext for Context {
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("agent_namespace", &self.agent_namespace)
            .finish_non_exhaustive()
    }
}

/// Runs the controller until `shutdown` resolves. `triggers` re-queues requests whose
/// captures progressed (the dispatcher's sender end). With `request_selector`, only
/// ProfileRequests carrying those labels are handled (sharding, canaries, tests sharing one
/// API server).
pub async fn run(
    context: Arc<Context>,
    triggers: UnboundedReceiver<ObjectRef<ProfileRequest>>,
    request_selector: Option<&str>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let api: Api<ProfileRequest> = Api::all(context.client.clone());
    let mut config = watcher::Config::default().any_semantic();
    if let Some(selector) = request_selector {
        config = config.labels(selector);
    }
    let controller = Controller::new(api, config);
    // Replaces the store of an earlier run (leadership lost and regained): that one's
    // reflector has stopped.
    *context
        .requests
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(controller.store());
    controller
        .reconcile_on(UnboundedReceiverStream::new(triggers))
        .graceful_shutdown_on(shutdown)
        .run(reconcile::reconcile, super::error_policy, context)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!("controller: {e}");
            }
        })
        .await;
}
