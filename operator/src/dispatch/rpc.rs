//! The operator's calls to agents: `Capture` to start a capture (or attach to it), `Collect`
//! to follow it again near its end, `Cancel` when its request is deleted; connection
//! failures retried with jittered backoff; every call's setup bounded by the dispatch
//! permits shared by all requests.

use std::sync::Arc;
use std::time::Duration;

use flamefleet_proto::agent::{self as pb, CancelRequest, CaptureRequest, capture_progress::Stage};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::NodePlan;
use super::connector::{AgentConnector, Backoff};
use super::outcome::NodeFailure;
use crate::metrics::Metrics;
use crate::pods::agents::AgentEndpoint;

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

/// The calls to agents, and the bounds on how many are set up and open at once.
#[derive(Debug)]
pub(super) struct AgentCalls {
    connector: AgentConnector,
    metrics: Arc<Metrics>,
    /// Retries of a node whose agent cannot be reached.
    backoff: Backoff,
    /// Bounds the calls being set up (see `Dispatcher::start`).
    permits: Arc<Semaphore>,
    /// Bounds the open `Collect` streams (see [`AgentCalls::capture`]).
    collect_slots: Arc<Semaphore>,
}

/// A semaphore's size for a bound of `n` (0: unlimited).
fn bound(n: usize) -> usize {
    match n {
        0 => Semaphore::MAX_PERMITS,
        n => n.min(Semaphore::MAX_PERMITS),
    }
}

impl AgentCalls {
    /// Calls through `connector`, at most `max_setup` being set up and `max_collects`
    /// collections open at once (0: unlimited).
    pub(super) fn new(
        connector: AgentConnector,
        metrics: Arc<Metrics>,
        backoff: Backoff,
        max_setup: usize,
        max_collects: usize,
    ) -> Self {
        Self {
            connector,
            metrics,
            backoff,
            permits: Arc::new(Semaphore::new(bound(max_setup))),
            collect_slots: Arc::new(Semaphore::new(bound(max_collects))),
        }
    }

    /// The permits bounding the calls being set up (and the store checks of a node's
    /// artifacts, which a fleet's nodes also reach within the same second or so).
    pub(super) fn permits(&self) -> &Arc<Semaphore> {
        &self.permits
    }

    /// Asks `agent` to cancel the capture of `uid`, best effort (one attempt, 3 s from when
    /// a dispatch permit is held): a capture that is not cancelled ends by itself after its
    /// duration and its upload slot expires. Takes a dispatch permit, so a mass deletion
    /// does not open thousands of connections at once; the wait for it is the operator's
    /// own queue and does not count against the agent (at thousands of nodes the permits
    /// can all be verifying artifacts for longer than the 3 s). The error says why the
    /// agent was not reached.
    pub(super) async fn cancel(&self, agent: &AgentEndpoint, uid: &str) -> Result<(), String> {
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
    pub(super) async fn capture(
        &self,
        node: &NodePlan,
        request: CaptureRequest,
        window: Duration,
        permit: OwnedSemaphorePermit,
    ) -> std::result::Result<pb::CaptureProgress, NodeFailure> {
        let shutting_down = || NodeFailure::Preparation {
            error: "the dispatcher is shutting down".into(),
        };
        // The calls' futures are boxed: each exists only while it runs, so the thousands of
        // node tasks sleeping between the two calls stay small.
        let mut stream = Box::pin(self.open_stream(node, &request, Call::Start)).await?;
        // The stream is open: let the next node start.
        drop(permit);
        let collect_at = match Box::pin(self.follow(node, &mut stream, Some(window))).await? {
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
        let backoff = self.backoff;
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
                                error: super::agent_report::bounded_message(&format!(
                                    "it no longer knows the capture it accepted: {}",
                                    status.message()
                                )),
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
                        let message = super::agent_report::bounded_message(&progress.message);
                        return Err(NodeFailure::reported(&progress.reason, message));
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

/// What a failed call says, bounded: the status message is the agent's.
fn status_text(status: &tonic::Status) -> String {
    let mut text = format!("{:?}: {}", status.code(), status.message());
    if let Some(source) = std::error::Error::source(status) {
        text.push_str(": ");
        text.push_str(&super::connector::describe(source));
    }
    super::agent_report::bounded_message(&text)
}
