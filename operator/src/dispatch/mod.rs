//! Running one request's captures: a `Capture` call per node, all concurrent, each bounded
//! by the capture duration plus a grace period; outcomes are collected in a [`Session`] and
//! the request is re-queued as each node ends.
//!
//! `Capture` is idempotent per (request UID, node), so a session started again for the same
//! request (after an operator restart, or by a new leader) attaches to the running capture
//! instead of starting a second one.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flamefleet_api::{Artifact, HeapSource, ProfileRequestSpec, ProfileType, RunqlatUnit};
use flamefleet_proto::agent::{self as pb, CancelRequest, CaptureRequest, capture_progress::Stage};
use kube::runtime::reflector::ObjectRef;
use tokio::sync::Semaphore;
use tokio::sync::mpsc::UnboundedSender;
use tokio::task::AbortHandle;

pub mod connector;
pub mod outcome;
pub mod tls_sessions;
pub mod uploads;

use crate::controllers::profile_request::resolve::TargetPod;
use crate::controllers::profile_request::result_table::ResultTable;
use crate::metrics::Metrics;
use crate::pods::agents::AgentEndpoint;
use crate::store::{ArtifactStore, RequestRef, Sha256Digest};
use connector::{AgentConnector, Backoff};
use flamefleet_api::ProfileRequest;
use outcome::{NodeFailure, NodeOutcome};
use uploads::{UrlPolicy, upload_slots};

/// How long an agent may take to answer a `Capture` call with its response headers (the
/// agent answers at once and streams progress after): a hung agent must not keep a dispatch
/// permit for the whole capture deadline.
const CALL_START_TIMEOUT: Duration = Duration::from_secs(10);

/// How long before a capture's window ends the operator calls `Collect`. The agent then
/// still reads, symbolizes and uploads, so a collection that starts a little early waits
/// on an open stream instead of arriving late.
const COLLECT_LEAD: Duration = Duration::from_millis(500);
/// The operator hangs up on a started capture (and collects it later) only when that frees
/// its connection for at least this long; a shorter window is followed on the first stream.
const MIN_DETACH: Duration = Duration::from_millis(500);
/// How long a deleted request's cancellations may take in all (each call has 3 s once it
/// holds a dispatch permit); captures not cancelled by then end after their duration.
const CANCEL_ON_DELETE: Duration = Duration::from_secs(15);

/// Which call opens a progress stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    /// `Capture`: starts the capture (or attaches to it).
    Start,
    /// `Collect`: attaches to the capture or replays its result, never starts it.
    Collect,
}

/// Where reading a progress stream stopped.
enum Followed {
    /// The terminal DONE message.
    Ended(pb::CaptureProgress),
    /// The capture runs; collect it at this instant.
    Detach { collect_at: tokio::time::Instant },
}

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
}

/// The captures of one request in progress.
#[derive(Debug)]
pub struct Session {
    expected: BTreeSet<String>,
    outcomes: Mutex<BTreeMap<String, NodeOutcome>>,
    tasks: Mutex<Vec<AbortHandle>>,
    agents: BTreeMap<String, AgentEndpoint>,
    /// Set once the terminal status is written; the session is forgotten when a reconcile
    /// sees the terminal phase (until then the cache may still show Running).
    completed: std::sync::atomic::AtomicBool,
    /// The request's per-node results and the slices still to write; installed by the
    /// reconciler right after [`Dispatcher::start`].
    results: Mutex<Option<ResultTable>>,
    /// Nodes whose outcome was recorded but is not in `results` yet (drained by
    /// [`Session::absorb_news`], so each outcome is looked at once).
    news: Mutex<Vec<String>>,
}

impl Session {
    /// The outcomes so far, by node.
    pub fn outcomes(&self) -> BTreeMap<String, NodeOutcome> {
        self.outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// True when every dispatched node has an outcome.
    pub fn settled(&self) -> bool {
        let outcomes = self.outcomes.lock().unwrap_or_else(|e| e.into_inner());
        self.expected.iter().all(|n| outcomes.contains_key(n))
    }

    /// True once the request's terminal status was written.
    pub fn completed(&self) -> bool {
        self.completed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks the terminal status written.
    pub fn mark_completed(&self) {
        self.completed
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn record(&self, node: &str, outcome: NodeOutcome) {
        self.outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(node.to_string(), outcome);
        self.news
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(node.to_string());
    }

    /// Installs the result table, unless one is installed already (a session returned by
    /// [`Dispatcher::start`] for a request it was running keeps its own). Returns whether
    /// `table` was installed.
    pub fn install_results(&self, table: ResultTable) -> bool {
        let mut results = self.results.lock().unwrap_or_else(|e| e.into_inner());
        if results.is_some() {
            return false;
        }
        *results = Some(table);
        true
    }

    /// Moves the outcomes recorded since the last call into the result table, each outcome
    /// once (O(new outcomes), not O(nodes)). Returns how many were moved; none while no table
    /// is installed (they wait for it).
    ///
    /// Called once at the start of a progress reconcile, so that the slices it writes and
    /// the status it computes see the same outcomes; later ones wait for the next reconcile
    /// (each recorded outcome triggers one).
    pub fn absorb_news(&self) -> usize {
        let mut results = self.results.lock().unwrap_or_else(|e| e.into_inner());
        let Some(table) = results.as_mut() else {
            return 0;
        };
        let news = std::mem::take(&mut *self.news.lock().unwrap_or_else(|e| e.into_inner()));
        let outcomes = self.outcomes.lock().unwrap_or_else(|e| e.into_inner());
        for node in &news {
            if let Some(outcome) = outcomes.get(node) {
                table.apply(node, outcome);
            }
        }
        news.len()
    }

    /// Runs `f` on the result table; `None` when no table is installed.
    pub fn with_results<R>(&self, f: impl FnOnce(&mut ResultTable) -> R) -> Option<R> {
        let mut results = self.results.lock().unwrap_or_else(|e| e.into_inner());
        results.as_mut().map(f)
    }
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
    /// open while a fleet's agents finish. See [`Dispatcher::call_capture`].
    pub max_concurrent_collects: usize,
    /// Retries of a node whose agent cannot be reached.
    pub backoff: Backoff,
}

/// Starts and tracks sessions, one per request UID.
#[derive(Debug)]
pub struct Dispatcher {
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    connector: AgentConnector,
    store: Arc<dyn ArtifactStore>,
    trigger: UnboundedSender<ObjectRef<ProfileRequest>>,
    settings: DispatchSettings,
    metrics: Arc<Metrics>,
    /// Bounds the calls being set up (see [`Dispatcher::start`]).
    permits: Arc<Semaphore>,
    /// Bounds the open `Collect` streams (see [`Dispatcher::call_capture`]).
    collect_slots: Arc<Semaphore>,
}

impl Dispatcher {
    /// A dispatcher that re-queues requests through `trigger`.
    pub fn new(
        connector: AgentConnector,
        store: Arc<dyn ArtifactStore>,
        trigger: UnboundedSender<ObjectRef<ProfileRequest>>,
        settings: DispatchSettings,
        metrics: Arc<Metrics>,
    ) -> Self {
        let bound = |n: usize| match n {
            0 => Semaphore::MAX_PERMITS,
            n => n.min(Semaphore::MAX_PERMITS),
        };
        let permits = bound(settings.max_concurrent_dispatch);
        let collect_slots = bound(settings.max_concurrent_collects);
        Self {
            sessions: Mutex::new(HashMap::new()),
            connector,
            store,
            trigger,
            settings,
            metrics,
            permits: Arc::new(Semaphore::new(permits)),
            collect_slots: Arc::new(Semaphore::new(collect_slots)),
        }
    }

    /// The session of request `uid`, if this process runs one.
    pub fn get(&self, uid: &str) -> Option<Arc<Session>> {
        self.lock().get(uid).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
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

    /// Starts the captures of `plan` (or returns the session already running for it).
    ///
    /// One task per node. What is bounded (`max_concurrent_dispatch` permits, shared by every
    /// request) is a node's *calls being set up*: connecting (TCP, TLS handshake) or picking
    /// the cached channel, and starting the `Capture` call until the agent's response
    /// headers; then the permit is released. Bounding the whole capture instead would run a
    /// 5,000-node request in waves of one capture duration each. Once the agent has
    /// accepted, the operator hangs up for the rest of the window unless it is short, and
    /// collects the result with `Collect` near its end, with a permit again (see
    /// [`Self::call_capture`]): what the fleet's size costs between the two is a sleeping
    /// task per node, not a connection. Connections left idle are kept up to the
    /// connector's capacity. Verifying a node's artifacts against the store takes a permit
    /// again, as does a `Cancel`.
    pub fn start(self: &Arc<Self>, plan: CapturePlan) -> Arc<Session> {
        let uid = plan.request.uid().to_string();
        let mut sessions = self.lock();
        if let Some(existing) = sessions.get(&uid) {
            return existing.clone();
        }
        let expected: BTreeSet<String> = plan
            .nodes
            .iter()
            .map(|n| n.node.clone())
            .chain(plan.settled.keys().cloned())
            .collect();
        let session = Arc::new(Session {
            expected,
            outcomes: Mutex::new(plan.settled.clone()),
            tasks: Mutex::new(Vec::new()),
            agents: plan
                .nodes
                .iter()
                .map(|n| (n.node.clone(), n.agent.clone()))
                .collect(),
            completed: std::sync::atomic::AtomicBool::new(false),
            results: Mutex::new(None),
            news: Mutex::new(plan.settled.keys().cloned().collect()),
        });
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
                session.record(&node.node, outcome);
                let _ = this.trigger.send(object_ref);
            });
            handles.push(task.abort_handle());
        }
        *session.tasks.lock().unwrap_or_else(|e| e.into_inner()) = handles;
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
        for task in session
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            task.abort();
        }
        let outcomes = session.outcomes();
        let unfinished = session
            .agents
            .iter()
            .filter(|(node, _)| !outcomes.contains_key(*node));
        let all = futures::StreamExt::for_each_concurrent(
            futures::stream::iter(unfinished),
            None,
            |(_, agent)| async move {
                // Best effort: the failure is logged, and the request is going away.
                let _ = self.cancel_on(agent, uid).await;
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

    /// Asks `agent` to cancel the capture of `uid`, best effort (one attempt, 3 s from when
    /// a dispatch permit is held): a capture that is not cancelled ends by itself after its
    /// duration and its upload slot expires. Takes a dispatch permit, so a mass deletion
    /// does not open thousands of connections at once; the wait for it is the operator's
    /// own queue and does not count against the agent (at thousands of nodes the permits
    /// can all be verifying artifacts for longer than the 3 s). The error says why the
    /// agent was not reached.
    async fn cancel_on(&self, agent: &AgentEndpoint, uid: &str) -> Result<(), String> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| "the dispatcher is shutting down".to_string())?;
        let call = async {
            let mut client = self.connector.connect(agent).await?;
            client
                .cancel(CancelRequest {
                    request_uid: uid.to_string(),
                })
                .await
                .map(|_| ())
                .map_err(|s| {
                    if is_connection_error(&s) {
                        self.connector.evict(agent);
                    }
                    s.message().to_string()
                })
        };
        let result = tokio::time::timeout(Duration::from_secs(3), call)
            .await
            .unwrap_or_else(|_| Err("no answer within 3 s".into()));
        if let Err(e) = &result {
            tracing::info!(agent = %agent.pod, uid, "cancel on agent failed: {e}");
        }
        result
    }

    async fn run_node(&self, plan: &CapturePlan, node: &NodePlan) -> NodeOutcome {
        let deadline = plan.duration + self.settings.grace;
        let upload_ttl = deadline + Duration::from_secs(600);
        let slots = match upload_slots(
            self.store.as_ref(),
            &plan.request,
            plan.spec.profile_type,
            &node.node,
            &self.settings.urls,
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
        let request = capture_request(plan, node, slots.clone());
        // The deadline starts once a permit is held: time queued behind other nodes' setup
        // is the operator's, not the agent's, and the agent's capture starts only then.
        let waiting = std::time::Instant::now();
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            return NodeOutcome::Failed(NodeFailure::Preparation {
                error: "the dispatcher is shutting down".into(),
            });
        };
        self.metrics.dispatch_waited(waiting.elapsed());
        self.metrics.capture_dispatched();
        let outcome =
            match tokio::time::timeout(deadline, self.call_capture(plan, node, request, permit))
                .await
            {
                Ok(outcome) => outcome,
                Err(_) => {
                    let cancel = self.cancel_on(&node.agent, plan.request.uid()).await;
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
                let _permit = self.permits.acquire().await;
                self.verify(plan, &slots, done).await
            }
            Err(failure) => NodeOutcome::Failed(failure),
        }
    }

    /// Runs one node's capture: starts it on the agent (releasing `permit` once the call is
    /// open), and, when the window has long to run, hangs up once the agent has accepted and
    /// collects the result near the window's end with `Collect` (a permit again), so that the
    /// node holds no connection, stream or buffers in between: an open HTTP/2 connection costs
    /// the operator 60-90 KiB whatever is sent on it, which a fleet of thousands of nodes
    /// would otherwise hold for the whole capture. A short window is followed on the first
    /// stream.
    ///
    /// A collection holds a collect slot until its stream ends (`max_concurrent_collects`):
    /// the stream stays open until the agent has finished, uploaded and answered DONE,
    /// and when a fleet's agents finish late (a loaded store, slow symbolization) thousands
    /// of them would otherwise wait at once, each on its own connection. Measured at 5,000
    /// hollow nodes: about 4,000 connections open at the peak, 300 MiB. A collection that
    /// waits for a slot loses nothing: the agent finishes its capture regardless and
    /// replays the result when asked, so a later `Collect` returns at once.
    async fn call_capture(
        &self,
        plan: &CapturePlan,
        node: &NodePlan,
        request: CaptureRequest,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> std::result::Result<pb::CaptureProgress, NodeFailure> {
        let shutting_down = || NodeFailure::Preparation {
            error: "the dispatcher is shutting down".into(),
        };
        // The calls' futures are boxed: each exists only while it runs, so the thousands of
        // node tasks sleeping between the two calls stay small.
        let mut stream = Box::pin(self.open_stream(node, &request, Call::Start)).await?;
        // The stream is open: let the next node start.
        drop(permit);
        let collect_at = match Box::pin(self.follow(node, &mut stream, Some(plan.duration))).await?
        {
            Followed::Ended(done) => return Ok(done),
            Followed::Detach { collect_at } => collect_at,
        };
        drop(stream);
        tokio::time::sleep_until(collect_at).await;
        let Ok(_collect_slot) = self.collect_slots.acquire().await else {
            return Err(shutting_down());
        };
        let Ok(permit) = self.permits.acquire().await else {
            return Err(shutting_down());
        };
        let collected = Box::pin(self.open_stream(node, &request, Call::Collect)).await;
        drop(permit);
        let mut stream = match collected {
            Ok(stream) => stream,
            // It accepted the capture and is gone now: killed, or its node went down.
            Err(NodeFailure::Unreachable { error, .. }) => {
                return Err(NodeFailure::Interrupted {
                    agent: node.agent.pod.clone(),
                    error: format!("it cannot be reached to collect the result: {error}"),
                });
            }
            Err(failure) => return Err(failure),
        };
        self.metrics.capture_collected();
        match Box::pin(self.follow(node, &mut stream, None)).await? {
            Followed::Ended(done) => Ok(done),
            // `follow` without a window never detaches.
            Followed::Detach { .. } => Err(NodeFailure::Interrupted {
                agent: node.agent.pod.clone(),
                error: "the collected stream ended without a result".into(),
            }),
        }
    }

    /// Opens a progress stream on the agent: `Capture` (start, or attach to the capture of
    /// the same UID) or `Collect` (attach or replay only), retrying connection failures with
    /// jittered backoff, on a cached channel when there is one.
    async fn open_stream(
        &self,
        node: &NodePlan,
        request: &CaptureRequest,
        call: Call,
    ) -> std::result::Result<tonic::Streaming<pb::CaptureProgress>, NodeFailure> {
        let unreachable = |error: String| NodeFailure::Unreachable {
            agent: node.agent.pod.clone(),
            address: node.agent.address.clone(),
            error,
        };
        let backoff = self.settings.backoff;
        // Seeded per call: thousands of nodes failing together draw different delays.
        let mut rng = fastrand::Rng::new();
        let mut attempt = 0u32;
        loop {
            let error = match self.connector.connect(&node.agent).await {
                // `Capture` is idempotent per (request UID, node): calling again after a
                // failed start attaches to the capture if the first call did reach the agent.
                Ok(mut client) => {
                    let started = tokio::time::timeout(CALL_START_TIMEOUT, async {
                        match call {
                            Call::Start => client.capture(request.clone()).await,
                            Call::Collect => {
                                let collect = pb::CollectRequest {
                                    request_uid: request.request_uid.clone(),
                                };
                                match client.collect(collect).await {
                                    // An agent older than `Collect`: the idempotent `Capture`
                                    // attaches to the capture or replays its result.
                                    Err(status) if status.code() == tonic::Code::Unimplemented => {
                                        client.capture(request.clone()).await
                                    }
                                    other => other,
                                }
                            }
                        }
                    })
                    .await;
                    match started {
                        Ok(Ok(response)) => return Ok(response.into_inner()),
                        Ok(Err(status)) if is_connection_error(&status) => {
                            self.connector.evict(&node.agent);
                            status_text(&status)
                        }
                        Ok(Err(status))
                            if call == Call::Collect && status.code() == tonic::Code::NotFound =>
                        {
                            return Err(NodeFailure::Interrupted {
                                agent: node.agent.pod.clone(),
                                error: format!(
                                    "it no longer knows the capture it accepted: {}",
                                    status.message()
                                ),
                            });
                        }
                        Ok(Err(status)) => {
                            return Err(NodeFailure::CaptureFailed {
                                reason: status_text(&status),
                            });
                        }
                        Err(_) => {
                            self.connector.evict(&node.agent);
                            format!(
                                "the agent did not answer the {call:?} call within {CALL_START_TIMEOUT:?}"
                            )
                        }
                    }
                }
                Err(e) => e,
            };
            attempt += 1;
            if attempt >= backoff.attempts.max(1) {
                return Err(unreachable(error));
            }
            self.metrics.dispatch_retried();
            let delay = backoff.delay(attempt - 1, &mut rng);
            tracing::debug!(node = %node.node, attempt, ?delay, ?call, "agent unreachable, retrying: {error}");
            tokio::time::sleep(delay).await;
        }
    }

    /// Reads `stream` to its terminal message. With `window` (the capture's duration, on
    /// the stream that started it), returns at the first ACCEPTED or RUNNING message after
    /// which the operator can hang up for at least [`MIN_DETACH`] and collect
    /// [`COLLECT_LEAD`] before the window ends (the message's `remaining_ms`, else the whole
    /// window from now).
    async fn follow(
        &self,
        node: &NodePlan,
        stream: &mut tonic::Streaming<pb::CaptureProgress>,
        window: Option<Duration>,
    ) -> std::result::Result<Followed, NodeFailure> {
        loop {
            match stream.message().await {
                Ok(Some(progress)) => match progress.stage() {
                    Stage::Done => return Ok(Followed::Ended(progress)),
                    Stage::Failed => {
                        return Err(NodeFailure::CaptureFailed {
                            reason: progress.message,
                        });
                    }
                    stage => {
                        tracing::debug!(node = %node.node, ?stage, elapsed_ms = progress.elapsed_ms, "capture progress");
                        // Only while the window runs: a stream attached to a capture that
                        // is already uploading (an operator restarted late) is followed.
                        // Not on ACCEPTED, which the agent sends before it knows what the
                        // capture reads: one that reads a snapshot (a pprof endpoint, a Go
                        // heap) has no window and ends right after, on this stream; one that
                        // samples says RUNNING as its window starts.
                        if let Some(window) = window
                            && stage == Stage::Running
                        {
                            // Never later than the window allows, whatever the agent says.
                            let remaining = match progress.remaining_ms {
                                0 => window,
                                ms => Duration::from_millis(u64::from(ms)).min(window),
                            };
                            if let Some(hung_up) = remaining.checked_sub(COLLECT_LEAD)
                                && hung_up >= MIN_DETACH
                            {
                                return Ok(Followed::Detach {
                                    collect_at: tokio::time::Instant::now() + hung_up,
                                });
                            }
                        }
                    }
                },
                Ok(None) => {
                    return Err(NodeFailure::Interrupted {
                        agent: node.agent.pod.clone(),
                        error: "the stream ended without a result".into(),
                    });
                }
                Err(status) => {
                    if is_connection_error(&status) {
                        self.connector.evict(&node.agent);
                    }
                    return Err(NodeFailure::Interrupted {
                        agent: node.agent.pod.clone(),
                        error: status_text(&status),
                    });
                }
            }
        }
    }

    /// Checks every artifact the agent reported against the store (size, sha256), and
    /// builds the status artifacts from what the store holds.
    async fn verify(
        &self,
        plan: &CapturePlan,
        slots: &[pb::UploadSlot],
        done: pb::CaptureProgress,
    ) -> NodeOutcome {
        let mut artifacts = Vec::new();
        for reported in &done.artifacts {
            let rejected = |error: String| {
                NodeOutcome::Failed(NodeFailure::UploadRejected {
                    artifact: reported.name.clone(),
                    error,
                })
            };
            let Some(slot) = slots.iter().find(|s| s.artifact_name == reported.name) else {
                return rejected("the agent reported an artifact the operator never signed".into());
            };
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
            artifacts.push(Artifact {
                name: reported.name.clone(),
                url: None,
                size_bytes: i64::try_from(digest.size_bytes).ok(),
                sha256: Some(digest.sha256.to_string()),
                // An artifact without a sample type (runqlat's text) is not a profile and
                // counts no samples.
                samples: i64::try_from(reported.samples)
                    .ok()
                    .filter(|_| !reported.sample_type.is_empty()),
                sample_type: Some(reported.sample_type.clone()).filter(|s| !s.is_empty()),
            });
        }
        if artifacts.is_empty() {
            return NodeOutcome::Failed(NodeFailure::CaptureFailed {
                reason: format!(
                    "the agent reported DONE without artifacts ({})",
                    done.message
                ),
            });
        }
        NodeOutcome::Done {
            artifacts,
            summary: done.summary.into_iter().collect(),
            runqlat_histogram: done.runqlat_histogram,
        }
    }
}

/// True when `status` says the connection failed (refused, reset, TLS, HTTP/2 GOAWAY), not
/// that the agent answered: the cached channel is dropped and the call may be retried.
fn is_connection_error(status: &tonic::Status) -> bool {
    match status.code() {
        tonic::Code::Unavailable => true,
        // A transport error below an unknown status (a reset stream, a broken connection).
        tonic::Code::Unknown => std::error::Error::source(status).is_some(),
        _ => false,
    }
}

fn status_text(status: &tonic::Status) -> String {
    let mut text = format!("{:?}: {}", status.code(), status.message());
    if let Some(source) = std::error::Error::source(status) {
        text.push_str(": ");
        text.push_str(&connector::describe(source));
    }
    text
}

/// The CaptureRequest of one node (pure).
pub fn capture_request(
    plan: &CapturePlan,
    node: &NodePlan,
    uploads: Vec<pb::UploadSlot>,
) -> CaptureRequest {
    let spec = &plan.spec;
    let profile_type = match spec.profile_type {
        ProfileType::Cpu => pb::ProfileType::Cpu,
        ProfileType::Heap => pb::ProfileType::Heap,
        ProfileType::Runqlat => pb::ProfileType::Runqlat,
    };
    let heap = (spec.profile_type == ProfileType::Heap).then(|| {
        let options = spec.heap_options();
        pb::HeapOptions {
            source: match options.source {
                HeapSource::Auto => "auto",
                HeapSource::Endpoint => "endpoint",
                HeapSource::Ebpf => "ebpf",
                HeapSource::Goruntime => "goruntime",
            }
            .into(),
            endpoint_port: options
                .endpoint
                .as_ref()
                .and_then(|e| u32::try_from(e.port).ok())
                .unwrap_or(0),
            endpoint_path: options.endpoint.map(|e| e.path).unwrap_or_default(),
            sample_bytes: options
                .sample_bytes
                .and_then(|b| u64::try_from(b).ok())
                .unwrap_or(0),
            max_overhead_percent: options
                .max_overhead_percent
                .and_then(|p| u32::try_from(p).ok()),
            ..Default::default()
        }
    });
    let runqlat = (spec.profile_type == ProfileType::Runqlat).then(|| {
        let options = spec.runqlat_options();
        pb::RunqlatOptions {
            per_process: options.per_process,
            unit: match options.unit {
                RunqlatUnit::Us => "us",
                RunqlatUnit::Ms => "ms",
            }
            .into(),
            ..Default::default()
        }
    });
    let cpu = (spec.profile_type == ProfileType::Cpu).then(|| pb::CpuOptions {
        frequency_hz: u32::try_from(spec.frequency_hz()).unwrap_or(99),
    });
    let mut request = CaptureRequest {
        request_uid: plan.request.uid().to_string(),
        request_namespace: plan.request.namespace().to_string(),
        request_name: plan.request.name().to_string(),
        r#type: 0,
        duration_ms: u32::try_from(plan.duration.as_millis()).unwrap_or(u32::MAX),
        cpu,
        heap,
        runqlat,
        targets: node
            .targets
            .iter()
            .map(|t| pb::Target {
                pod_uid: t.uid.clone(),
                namespace: t.namespace.clone(),
                pod_name: t.name.clone(),
                containers: t
                    .containers
                    .iter()
                    .map(|c| pb::Container {
                        name: c.name.clone(),
                        container_id: c.container_id.clone(),
                    })
                    .collect(),
                annotations: t.annotations.clone().into_iter().collect(),
                pod_ip: t.pod_ip.clone().unwrap_or_default(),
            })
            .collect(),
        uploads,
    };
    request.set_type(profile_type);
    request
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controllers::profile_request::resolve::TargetContainer;

    #[test]
    fn capture_request_carries_targets_options_and_slots() {
        let spec: ProfileRequestSpec = serde_json::from_value(serde_json::json!({
            "type": "runqlat", "podNames": ["web-1"], "duration": "2500ms",
            "runqlat": {"perProcess": true, "unit": "ms"}
        }))
        .unwrap();
        let plan = CapturePlan {
            request: RequestRef::new("shop", "req", "0c7e3a40-0000-4000-8000-000000000001")
                .unwrap(),
            duration: spec.capture_duration().unwrap(),
            spec,
            nodes: Vec::new(),
            settled: BTreeMap::new(),
        };
        let node = NodePlan {
            node: "n1".into(),
            agent: AgentEndpoint {
                node: "n1".into(),
                pod: "agent-n1".into(),
                address: "127.0.0.1:7070".into(),
            },
            targets: vec![TargetPod {
                name: "web-1".into(),
                namespace: "shop".into(),
                uid: "pod-uid".into(),
                node: "n1".into(),
                pod_ip: None,
                containers: vec![TargetContainer {
                    name: "app".into(),
                    container_id: "containerd://abc".into(),
                }],
                annotations: BTreeMap::new(),
            }],
        };
        let request = capture_request(&plan, &node, Vec::new());
        assert_eq!(request.r#type(), pb::ProfileType::Runqlat);
        assert_eq!(request.duration_ms, 2500);
        assert_eq!(request.request_namespace, "shop");
        let runqlat = request.runqlat.unwrap();
        assert!(runqlat.per_process);
        assert_eq!(runqlat.unit, "ms");
        assert!(request.cpu.is_none() && request.heap.is_none());
        assert_eq!(
            request.targets[0].containers[0].container_id,
            "containerd://abc"
        );
    }
}
