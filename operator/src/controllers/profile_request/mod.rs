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

/// The API client and Event recorder of one kind of request.
pub struct Lane {
    /// Kubernetes client.
    pub client: kube::Client,
    /// Event recorder (on `client`).
    pub recorder: Recorder,
}

/// What every reconcile shares.
pub struct Context {
    /// Kubernetes client of ad hoc requests (and of what is not one request's).
    pub client: kube::Client,
    /// The policies' runs' client and recorder: a run's calls never wait behind ad hoc
    /// requests' (a new leader resumes every Running request at once; 1,000 measured). A
    /// run sits in its node's budget from its creation until it ends, so a run kept waiting
    /// made the policies' later runs skip the node (docs/failure-modes.md). Chosen by the
    /// run's policy-UID label: a tenant forging that label onto its own requests only puts
    /// them beside the runs, it gains no permission.
    pub runs: Lane,
    /// Ad hoc requests reconciled at once (`--max-concurrent-reconciles`); runs take none.
    pub adhoc_slots: ReconcileSlots,
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

/// A bound on the reconciles in progress at once, waited for in order. Unbounded, a new
/// leader's resumption of 1,000 requests started 1,000 reconciles whose API calls each waited
/// behind the others', so that no request went far before all had (none started in 3
/// minutes, measured); bounded, each runs its calls through and the next one starts.
#[derive(Debug)]
pub struct ReconcileSlots(Option<tokio::sync::Semaphore>);

impl ReconcileSlots {
    /// At most `max` at once (0: unbounded).
    pub fn new(max: usize) -> Self {
        Self(
            (max > 0)
                .then(|| tokio::sync::Semaphore::new(max.min(tokio::sync::Semaphore::MAX_PERMITS))),
        )
    }

    /// Waits for a slot, held until the returned guard is dropped (`None`: unbounded).
    pub async fn acquire(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        // The semaphore is never closed.
        self.0.as_ref()?.acquire().await.ok()
    }
}

impl Context {
    /// The client of `request`'s calls (see [`Context::runs`]).
    pub fn client_for(&self, request: &ProfileRequest) -> &kube::Client {
        if is_run(request) {
            &self.runs.client
        } else {
            &self.client
        }
    }

    /// The recorder of `request`'s Events (see [`Context::runs`]).
    pub fn recorder_for(&self, request: &ProfileRequest) -> &Recorder {
        if is_run(request) {
            &self.runs.recorder
        } else {
            &self.recorder
        }
    }
}

/// Whether `request` says it is a policy's run (its policy-UID label).
pub fn is_run(request: &ProfileRequest) -> bool {
    request
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(flamefleet_api::policy_runs::POLICY_UID_LABEL))
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
