//! Fleet sampling: the `SamplingPolicy` and `ClusterSamplingPolicy` controllers.
//!
//! Each scheduled time of a policy becomes a *run*: ordinary ProfileRequests (one per
//! sampled namespace) owned by the policy, which the ProfileRequest controller then
//! captures like any other. The modules, in the order a run is made:
//! - [`schedule`]: cron patterns and time zones, what is due now;
//! - [`fleet`]: the cached pods, namespaces and requests, and which pods are eligible;
//! - [`rotation`]: which pods this run takes so the whole fleet is covered in turn;
//! - [`budget`]: which nodes can take another capture;
//! - [`flamefleet_api::policy_runs`]: names and labels that make runs exactly-once, and
//!   which requests are genuine runs;
//! - [`history`]: active runs, last success, and the history limits;
//! - [`policy`]: the reconciler tying them together, with the run's coverage and status.

pub mod budget;
pub mod continuous;
pub mod fleet;
pub mod history;
pub mod policy;
pub mod rotation;
pub mod schedule;
pub mod triggers;

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use flamefleet_api::{
    ClusterSamplingPolicy, ProfileRequest, SamplingPolicy, SamplingPolicySpec, SamplingPolicyStatus,
};
use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::Resource;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, WatchStreamExt, watcher};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::metrics::Metrics;
use flamefleet_api::policy_runs::{POLICY_UID_LABEL, PolicyKind};
use fleet::Fleet;

/// What the cluster admin bounds about every namespace's policies (operator flags): without
/// them one namespace with `edit` could create any number of policies firing every second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplingLimits {
    /// Least time between two runs of one policy, whatever its schedule says.
    pub min_run_interval: std::time::Duration,
    /// SamplingPolicies of one namespace that run (the oldest); 0: unlimited.
    pub max_policies_per_namespace: usize,
    /// Pending requests a namespace may hold before scheduled runs pass it over; 0:
    /// unlimited.
    pub max_queued_per_namespace: usize,
}

impl Default for SamplingLimits {
    fn default() -> Self {
        Self {
            min_run_interval: std::time::Duration::from_secs(60),
            max_policies_per_namespace: 20,
            max_queued_per_namespace: 10,
        }
    }
}

/// What the policy controllers share.
pub struct SamplingContext {
    /// The cluster admin's bounds on policies.
    pub limits: SamplingLimits,
    /// Kubernetes client.
    pub client: kube::Client,
    /// The cached fleet.
    pub fleet: Fleet,
    /// Scheduled capture time and fresh reservations, for the budget.
    pub ledger: budget::Ledger,
    /// Serializes planning across policies so two runs never book the same last slot.
    pub planning: tokio::sync::Mutex<()>,
    /// When each pod (`namespace/name`) was last profiled, per policy UID (coverage).
    pub profiled: Mutex<HashMap<String, HashMap<String, i64>>>,
    /// Event recorder.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The policies' triggers: the agents' watch sets, cooldowns and counters.
    pub triggers: triggers::TriggerHub,
    /// The always-on policies: the agents' always-on sets, coverage and export counters.
    pub continuous: continuous::ContinuousHub,
}

impl super::ControllerContext for SamplingContext {
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

impl Debug for SamplingContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SamplingContext")
            .field("fleet", &self.fleet)
            .finish_non_exhaustive()
    }
}

impl SamplingContext {
    /// The current time (one place, so that every decision of a reconcile uses one clock).
    pub fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// The two policy kinds, as the reconciler sees them.
pub trait Policy:
    Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Serialize + Send + Sync + 'static
{
    /// Which kind.
    const KIND: PolicyKind;
    /// The schedule, template and limits.
    fn policy_spec(&self) -> &SamplingPolicySpec;
    /// The status, if any.
    fn policy_status(&self) -> Option<&SamplingPolicyStatus>;
    /// The API of this kind for `policy` (its namespace, or cluster-wide).
    fn api_for(client: &kube::Client, policy: &Self) -> Api<Self>;
    /// Namespaces to sample, for a cluster policy.
    fn namespace_selector(&self) -> Option<&LabelSelector> {
        None
    }
}

impl Policy for SamplingPolicy {
    const KIND: PolicyKind = PolicyKind::Namespaced;
    fn policy_spec(&self) -> &SamplingPolicySpec {
        &self.spec
    }
    fn policy_status(&self) -> Option<&SamplingPolicyStatus> {
        self.status.as_ref()
    }
    fn api_for(client: &kube::Client, policy: &Self) -> Api<Self> {
        match policy.metadata.namespace.as_deref() {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::default_namespaced(client.clone()),
        }
    }
}

impl Policy for ClusterSamplingPolicy {
    const KIND: PolicyKind = PolicyKind::Cluster;
    fn policy_spec(&self) -> &SamplingPolicySpec {
        &self.spec.policy
    }
    fn policy_status(&self) -> Option<&SamplingPolicyStatus> {
        self.status.as_ref()
    }
    fn namespace_selector(&self) -> Option<&LabelSelector> {
        self.spec.namespace_selector.as_ref()
    }
    fn api_for(client: &kube::Client, _policy: &Self) -> Api<Self> {
        Api::all(client.clone())
    }
}

/// Maps a ProfileRequest (its metadata) to the policy of kind `P` that owns it.
fn owner_of<P: Policy>(request: PartialObjectMeta<ProfileRequest>) -> Option<ObjectRef<P>> {
    let kind = P::kind(&());
    let owner = request
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == kind && o.api_version == P::api_version(&()))?;
    let r = ObjectRef::<P>::new(&owner.name);
    Some(match P::KIND {
        PolicyKind::Namespaced => r.within(request.metadata.namespace.as_deref()?),
        PolicyKind::Cluster => r,
    })
}

async fn run_kind<P: Policy>(
    context: Arc<SamplingContext>,
    selector: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let api: Api<P> = Api::all(context.client.clone());
    let mut config = watcher::Config::default().any_semantic();
    if let Some(selector) = &selector {
        config = config.labels(selector);
    }
    // Only the runs (the requests carrying a policy's UID label), and only their metadata:
    // the owner reference is all the mapping reads. Ad hoc requests (a new leader resumes
    // up to thousands, each written several times) never reach this controller.
    let runs_selector = match &selector {
        Some(selector) => format!("{selector},{POLICY_UID_LABEL}"),
        None => POLICY_UID_LABEL.to_string(),
    };
    let runs = watcher(
        Api::<PartialObjectMeta<ProfileRequest>>::all(context.client.clone()),
        watcher::Config::default()
            .any_semantic()
            .labels(&runs_selector),
    )
    .default_backoff()
    .touched_objects();
    Controller::new(api, config)
        .watches_stream(runs, owner_of::<P>)
        .graceful_shutdown_on(shutdown)
        .run(policy::reconcile::<P>, super::error_policy, context)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!("sampling controller: {e}");
            }
        })
        .await;
}

/// Runs both policy controllers until `shutdown` resolves. With `selector`, only policies
/// carrying those labels are handled (their runs carry the policy's labels, so the same
/// operator's ProfileRequest controller captures them).
pub async fn run(
    context: Arc<SamplingContext>,
    selector: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    // Tasks of their own: a policy's schedule is evaluated on time whatever the trigger and
    // always-on hubs (and the other kind's policies) are busy with.
    let tasks = [
        tokio::spawn(run_kind::<SamplingPolicy>(
            context.clone(),
            selector.clone(),
            shutdown.clone(),
        )),
        tokio::spawn(run_kind::<ClusterSamplingPolicy>(
            context.clone(),
            selector,
            shutdown.clone(),
        )),
        tokio::spawn(triggers::TriggerHub::run(context.clone(), shutdown.clone())),
        tokio::spawn(continuous::ContinuousHub::run(context, shutdown)),
    ];
    for task in tasks {
        if let Err(e) = task.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}
