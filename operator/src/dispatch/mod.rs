//! Running one request's captures: a `Capture` call per node, all concurrent, each bounded
//! by the capture duration plus a grace period; outcomes are collected in a [`Session`] and
//! the request is re-queued as each node ends.
//!
//! `Capture` is idempotent per (request UID, node), so a session started again for the same
//! request (after an operator restart, or by a new leader) attaches to the running capture
//! instead of starting a second one.
//!
//! The parts: [`session`] (one request's state, behind one lock), `rpc` (the calls to
//! agents and their bounds), [`wire`] (the contract's messages), [`connector`] (the mTLS
//! channels), [`uploads`] (the signed upload slots) and [`outcome`] (how a node ended).

pub mod agent_report;
pub mod agent_restarts;
pub mod connector;
pub mod outcome;
mod rpc;
pub mod session;
pub mod tls_sessions;
pub mod uploads;
pub mod wire;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flamefleet_api::{ProfileRequest, ProfileRequestSpec};
use flamefleet_proto::agent as pb;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc::UnboundedSender;

use crate::controllers::profile_request::limits::overhead_percent;
use crate::export::{ExportJob, Exporter};
use crate::metrics::Metrics;
use crate::pods::agents::AgentEndpoint;
use crate::pods::target::TargetPod;
use crate::store::quota::QuotaLedger;
use crate::store::{ArtifactStore, RequestRef, Sha256Digest};
use connector::{AgentConnector, Backoff};
use outcome::{NodeFailure, NodeOutcome};
pub use session::Session;
use uploads::{UrlPolicy, upload_slots};

/// How long a deleted request's cancellations may take in all (each call has 3 s once it
/// holds a dispatch permit); captures not cancelled by then end after their duration.
const CANCEL_ON_DELETE: Duration = Duration::from_secs(15);

/// What one node should capture.
#[derive(Debug, Clone)]
pub struct NodePlan {
    /// Node name.
    pub node: String,
    /// Its agent.
    pub agent: AgentEndpoint,
    /// The pods of the request on that node.
    pub targets: Vec<TargetPod>,
}

/// Everything needed to run a request's captures.
#[derive(Debug, Clone)]
pub struct CapturePlan {
    /// The request (store key prefix, and namespace/name/uid for the agent).
    pub request: RequestRef,
    /// The request's spec.
    pub spec: ProfileRequestSpec,
    /// Capture duration.
    pub duration: Duration,
    /// Nodes to dispatch to.
    pub nodes: Vec<NodePlan>,
    /// Nodes that already have an outcome (e.g. no agent, pods vanished). Nodes whose
    /// outcome the status already records are in neither list.
    pub settled: BTreeMap<String, NodeOutcome>,
    /// The namespace's artifact storage quota, bytes (0: unlimited; see `store::quota`).
    pub artifact_quota: u64,
    /// A triggered heap run: the node's id of the fire whose heap, read at the fire, the
    /// run takes (`flamefleet.dev/trigger-fire-id`); empty otherwise.
    pub trigger_fire_id: String,
}

/// Tunables of dispatching.
#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// Added to the capture duration before a node is declared timed out.
    pub grace: Duration,
    /// Artifact URL policy.
    pub urls: UrlPolicy,
    /// Capture calls being set up at once, over all requests (0: unlimited). See
    /// [`Dispatcher::start`] for what the bound covers.
    pub max_concurrent_dispatch: usize,
    /// Result collections open at once, over all requests (0: unlimited): a `Collect`
    /// stream holds its connection until the agent's DONE, so this bounds the connections
    /// open while a fleet's agents finish.
    pub max_concurrent_collects: usize,
    /// Retries of a node whose agent cannot be reached.
    pub backoff: Backoff,
    /// The cluster admin's ceiling of `heap.maxOverheadPercent` (0: none), sent to agents
    /// whatever the request says (see `limits::overhead_percent`).
    pub max_heap_overhead_percent: u32,
    /// The same for `offcpu.maxOverheadPercent`.
    pub max_offcpu_overhead_percent: u32,
}

/// Starts and tracks sessions, one per request UID. `R` is the reconciler's record of a
/// request's results, kept with its session (see [`Session`]).
#[derive(Debug)]
pub struct Dispatcher<R> {
    sessions: Mutex<HashMap<String, Arc<Session<R>>>>,
    calls: rpc::AgentCalls,
    store: Arc<dyn ArtifactStore>,
    trigger: UnboundedSender<ObjectRef<ProfileRequest>>,
    grace: Duration,
    urls: UrlPolicy,
    metrics: Arc<Metrics>,
    /// See [`DispatchSettings::max_heap_overhead_percent`].
    max_heap_overhead_percent: u32,
    /// See [`DispatchSettings::max_offcpu_overhead_percent`].
    max_offcpu_overhead_percent: u32,
    /// What each namespace stores, against its quota; `None`: no quota at all.
    quota: Option<Arc<QuotaLedger>>,
    /// Where to read why an agent went away mid-capture; `None`: not read.
    agent_pods: Option<agent_restarts::AgentPods>,
    /// The export sink finished captures are offered to; `None`: no export configured.
    exporter: Option<Arc<Exporter>>,
}

impl<R: Send + 'static> Dispatcher<R> {
    /// A dispatcher that re-queues requests through `trigger`.
    pub fn new(
        connector: AgentConnector,
        store: Arc<dyn ArtifactStore>,
        trigger: UnboundedSender<ObjectRef<ProfileRequest>>,
        settings: DispatchSettings,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            sessions: Mutex::new(HashMap::new()),
            calls: rpc::AgentCalls::new(
                connector,
                metrics.clone(),
                settings.backoff,
                settings.max_concurrent_dispatch,
                settings.max_concurrent_collects,
            ),
            store,
            trigger,
            grace: settings.grace,
            urls: settings.urls,
            metrics,
            max_heap_overhead_percent: settings.max_heap_overhead_percent,
            max_offcpu_overhead_percent: settings.max_offcpu_overhead_percent,
            quota: None,
            agent_pods: None,
            exporter: None,
        }
    }

    /// Offers every node's finished capture to `exporter` (unless its request says
    /// `export: false`).
    #[must_use]
    pub fn with_exporter(mut self, exporter: Arc<Exporter>) -> Self {
        self.exporter = Some(exporter);
        self
    }

    /// Names the kubelet's `OOMKilled` in the message of a node whose agent went away
    /// mid-capture, reading the agent's pod from `pods`.
    #[must_use]
    pub fn with_agent_pods(mut self, pods: agent_restarts::AgentPods) -> Self {
        self.agent_pods = Some(pods);
        self
    }

    /// Accounts every namespace's artifacts in `ledger` and enforces their quotas.
    #[must_use]
    pub fn with_quota(mut self, ledger: Arc<QuotaLedger>) -> Self {
        self.quota = Some(ledger);
        self
    }

    /// The quota ledger, when quotas are enforced.
    pub fn quota(&self) -> Option<&Arc<QuotaLedger>> {
        self.quota.as_ref()
    }

    /// The session of request `uid`, if this process runs one.
    pub fn get(&self, uid: &str) -> Option<Arc<Session<R>>> {
        self.lock().get(uid).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session<R>>>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of sessions in progress.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no session is in progress.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts the captures of `plan` with `results` as the reconciler's record, or returns
    /// the session already running for it (which keeps its own record; `results` is
    /// dropped).
    ///
    /// One task per node. What is bounded (`max_concurrent_dispatch` permits, shared by every
    /// request) is a node's *calls being set up*: connecting (TCP, TLS handshake) or picking
    /// the cached channel, and starting the `Capture` call until the agent's response
    /// headers; then the permit is released. Bounding the whole capture instead would run a
    /// 5,000-node request in waves of one capture duration each. Once the agent has
    /// accepted, the operator hangs up for the rest of the window unless it is short, and
    /// collects the result with `Collect` near its end, with a permit again (see `rpc`):
    /// what the fleet's size costs between the two is a sleeping task per node, not a
    /// connection. Connections left idle are kept up to the connector's capacity. Verifying
    /// a node's artifacts against the store takes a permit again, as does a `Cancel`.
    pub fn start(self: &Arc<Self>, plan: CapturePlan, results: R) -> Arc<Session<R>> {
        let uid = plan.request.uid().to_string();
        let mut sessions = self.lock();
        if let Some(existing) = sessions.get(&uid) {
            return existing.clone();
        }
        let dispatched = plan
            .nodes
            .iter()
            .map(|n| (n.node.clone(), n.agent.clone()))
            .collect();
        let session = Arc::new(Session::new(dispatched, plan.settled.clone(), results));
        sessions.insert(uid, session.clone());
        drop(sessions);
        self.metrics.set_sessions(self.len());
        let object_ref =
            ObjectRef::<ProfileRequest>::new(plan.request.name()).within(plan.request.namespace());
        let plan = Arc::new(plan);
        let mut handles = Vec::new();
        for node in plan.nodes.iter().cloned() {
            let this = self.clone();
            let session = session.clone();
            let plan = plan.clone();
            let object_ref = object_ref.clone();
            let task = tokio::spawn(async move {
                let outcome = this.run_node(&plan, &node).await;
                if let NodeOutcome::Failed(failure) = &outcome {
                    tracing::warn!(request = %plan.request.prefix(), node = %node.node, reason = failure.reason(), "{failure}");
                    this.metrics.node_failed(failure.reason());
                } else {
                    this.metrics.node_succeeded();
                }
                let export = match (&outcome, &this.exporter) {
                    (NodeOutcome::Done { artifacts, .. }, Some(exporter))
                        if plan.spec.export != Some(false) =>
                    {
                        ExportJob::of(&plan.request, &node.node, &node.targets, artifacts)
                            .map(|job| (exporter.clone(), job))
                    }
                    _ => None,
                };
                session.record(&node.node, outcome);
                let _ = this.trigger.send(object_ref);
                // After the result is recorded, and without waiting: the export never delays
                // the status.
                if let Some((exporter, job)) = export {
                    exporter.submit(job);
                }
            });
            handles.push(task.abort_handle());
        }
        session.set_tasks(handles);
        if session.settled() {
            let _ = self.trigger.send(object_ref);
        }
        session
    }

    /// Forgets the session of `uid` (the request is terminal in the cache).
    pub fn finish(&self, uid: &str) {
        self.lock().remove(uid);
        self.metrics.set_sessions(self.len());
    }

    /// Stops the session of `uid` (the request is being deleted): aborts its calls and asks
    /// the agents of unfinished nodes to cancel (at most `max_concurrent_dispatch` at once,
    /// like the captures' setup, and for at most [`CANCEL_ON_DELETE`] in all).
    pub async fn cancel(&self, uid: &str) {
        let Some(session) = self.lock().remove(uid) else {
            return;
        };
        self.metrics.set_sessions(self.len());
        let unfinished = session.stop();
        let all = futures::StreamExt::for_each_concurrent(
            futures::stream::iter(unfinished.iter()),
            None,
            |agent| async move {
                // Best effort: the failure is logged, and the request is going away.
                let _ = self.calls.cancel(agent, uid).await;
            },
        );
        // The deletion waits for this: bounded as a whole, since each call's 3 s start only
        // once it holds a permit.
        if tokio::time::timeout(CANCEL_ON_DELETE, all).await.is_err() {
            tracing::info!(
                uid,
                "stopped asking agents to cancel after {}s; their captures end by themselves after their duration",
                CANCEL_ON_DELETE.as_secs()
            );
        }
    }

    async fn run_node(&self, plan: &CapturePlan, node: &NodePlan) -> NodeOutcome {
        let deadline = plan.duration + self.grace;
        let upload_ttl = deadline + Duration::from_secs(600);
        if let Some(ledger) = &self.quota {
            // A namespace already at its quota captures nothing. One with room left gets
            // the usual upload limit: what its artifacts take past the quota is refused
            // and deleted once verified, with a message naming the quota (a smaller
            // upload limit would fail as "too large" instead).
            match ledger
                .room(plan.request.namespace(), plan.artifact_quota)
                .await
            {
                Ok(Ok(_)) => {}
                Ok(Err(exceeded)) => {
                    return NodeOutcome::Failed(NodeFailure::QuotaExceeded(exceeded));
                }
                Err(e) => {
                    return NodeOutcome::Failed(NodeFailure::Preparation {
                        error: e.to_string(),
                    });
                }
            }
        }
        let slots = match upload_slots(
            self.store.as_ref(),
            &plan.request,
            plan.spec.profile_type,
            &node.node,
            &self.urls,
            upload_ttl,
        )
        .await
        {
            Ok(slots) => slots,
            Err(e) => {
                return NodeOutcome::Failed(NodeFailure::Preparation {
                    error: e.to_string(),
                });
            }
        };
        let mut request = wire::capture_request(plan, node, slots.clone());
        // The agent retries failed uploads until shortly before this deadline: a store down
        // for a while delays the result instead of failing the node.
        request.deadline_ms = u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX);
        // The cluster admin's ceilings: sent when the request names no guard, and never
        // exceeded whatever it names (check_spec already failed those above them).
        if let Some(heap) = request.heap.as_mut() {
            heap.max_overhead_percent =
                overhead_percent(heap.max_overhead_percent, self.max_heap_overhead_percent);
        }
        if let Some(offcpu) = request.offcpu.as_mut() {
            offcpu.max_overhead_percent = overhead_percent(
                offcpu.max_overhead_percent,
                self.max_offcpu_overhead_percent,
            );
        }
        // The deadline starts once a permit is held: time queued behind other nodes' setup
        // is the operator's, not the agent's, and the agent's capture starts only then.
        let waiting = std::time::Instant::now();
        let Ok(permit) = self.calls.permits().clone().acquire_owned().await else {
            return NodeOutcome::Failed(NodeFailure::Preparation {
                error: "the dispatcher is shutting down".into(),
            });
        };
        self.metrics.dispatch_waited(waiting.elapsed());
        self.metrics.capture_dispatched();
        let dispatched_at = jiff::Timestamp::now();
        let capture = self.calls.capture(node, request, plan.duration, permit);
        let outcome = match tokio::time::timeout(deadline, capture).await {
            Ok(outcome) => outcome,
            Err(_) => {
                let cancel = self.calls.cancel(&node.agent, plan.request.uid()).await;
                return NodeOutcome::Failed(NodeFailure::TimedOut {
                    after: deadline,
                    cancel_error: cancel.err(),
                });
            }
        };
        match outcome {
            Ok(done) => {
                // Verification reads the artifact back from the store: bounded like the
                // setup, since a fleet's nodes all finish within the same second or so.
                let _permit = self.calls.permits().acquire().await;
                self.verify(plan, &slots, done).await
            }
            Err(failure) => NodeOutcome::Failed(match &self.agent_pods {
                Some(pods) => pods.explain(failure, &node.agent.pod, dispatched_at).await,
                None => failure,
            }),
        }
    }

    /// Checks every artifact the agent reported against the store (size, sha256), and
    /// builds the status artifacts from what the store holds. Every other field the agent
    /// sent is bounded ([`agent_report`]) before it is kept.
    async fn verify(
        &self,
        plan: &CapturePlan,
        slots: &[pb::UploadSlot],
        done: pb::CaptureProgress,
    ) -> NodeOutcome {
        let mut artifacts: Vec<flamefleet_api::Artifact> = Vec::new();
        for reported in &done.artifacts {
            let rejected = |error: String| {
                NodeOutcome::Failed(NodeFailure::UploadRejected {
                    artifact: agent_report::bounded_message(&reported.name),
                    error,
                })
            };
            let Some(slot) = slots.iter().find(|s| s.artifact_name == reported.name) else {
                return rejected("the agent reported an artifact the operator never signed".into());
            };
            if artifacts.iter().any(|a| a.name == reported.name) {
                return NodeOutcome::Failed(NodeFailure::ReportRefused {
                    reason: format!("it reported artifact {} twice", reported.name),
                });
            }
            if let Err(reason) = agent_report::check_sample_type(&reported.sample_type) {
                return NodeOutcome::Failed(NodeFailure::ReportRefused { reason });
            }
            let expected = match reported.sha256.parse::<Sha256Digest>() {
                Ok(d) => Some(d),
                Err(e) => return rejected(e.to_string()),
            };
            let key = match plan.request.artifact(reported.name.clone()) {
                Ok(k) => k,
                Err(e) => return rejected(e.to_string()),
            };
            let digest = match self
                .store
                .verify_upload(&key, slot.max_bytes, expected)
                .await
            {
                Ok(d) => d,
                Err(e) => return rejected(e.to_string()),
            };
            if let Some(ledger) = &self.quota {
                let refused = match ledger
                    .admit(&key, digest.size_bytes, plan.artifact_quota)
                    .await
                {
                    Ok(Ok(())) => None,
                    Ok(Err(exceeded)) => Some(NodeFailure::QuotaExceeded(exceeded)),
                    Err(e) => Some(NodeFailure::UploadRejected {
                        artifact: reported.name.clone(),
                        error: format!("cannot account it against the namespace's quota: {e}"),
                    }),
                };
                if let Some(failure) = refused {
                    // The node fails as a whole: none of its artifacts is kept.
                    let names = artifacts.iter().map(|a| a.name.clone());
                    for name in std::iter::once(reported.name.clone()).chain(names) {
                        let Ok(key) = plan.request.artifact(name) else {
                            continue;
                        };
                        if let Err(e) = self.store.delete_artifact(&key).await {
                            tracing::warn!(%key, "deleting an artifact refused by the quota: {e}");
                        }
                    }
                    return NodeOutcome::Failed(failure);
                }
            }
            artifacts.push(wire::artifact(
                reported,
                digest.size_bytes,
                digest.sha256.to_string(),
            ));
        }
        if artifacts.is_empty() {
            return NodeOutcome::Failed(NodeFailure::CaptureFailed {
                reason: agent_report::bounded_message(&format!(
                    "the agent reported DONE without artifacts ({})",
                    done.message
                )),
            });
        }
        wire::done_outcome(artifacts, done)
    }
}
