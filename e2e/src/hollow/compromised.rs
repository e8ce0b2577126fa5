//! A compromised node's service: the real agent's service, whose DONE messages are rewritten
//! on their way out when the node behaves as [`Behaviour::Oversized`]. A compromised agent
//! is not bound to run the agent's code, so what it sends is any message gRPC carries; the
//! shell underneath still captures, uploads and streams progress as a genuine node does.
//!
//! Its trigger stream can be scripted ([`WatchScript`]): the node then reports whatever
//! fires it likes, for pods, policies and triggers it was never given.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use flamefleet_agent::service::{Agent, ProgressStream};
use flamefleet_proto::agent::agent_service_server::AgentService;
use flamefleet_proto::agent::capture_progress::Stage;
use flamefleet_proto::agent::capture_summary::Kind;
use flamefleet_proto::agent::{
    CancelRequest, CancelResponse, CaptureProgress, CaptureRequest, CaptureSummary, CollectRequest,
    ContinuousRequest, HeapProcess, HeapSummary, InfoRequest, InfoResponse, TriggerFired, WatchAck,
    WatchEvent, WatchRequest, watch_event,
};
use futures::StreamExt as _;
use tonic::{Request, Response, Status};

use super::{Behaviour, BehaviourCell};

/// One hollow node's service: [`Agent`], with its reports blown up while the node is
/// [`Behaviour::Oversized`].
pub(crate) struct NodeService {
    pub(crate) agent: Agent,
    pub(crate) behaviour: Arc<BehaviourCell>,
    pub(crate) watch_script: Arc<WatchScript>,
}

/// Fires a compromised node sends on its next trigger stream, once: at once, or when the
/// test releases them ([`WatchScript::release`]).
#[derive(Debug)]
pub(crate) struct WatchScript {
    fires: Mutex<Option<Vec<TriggerFired>>>,
    /// Whether the fires wait for [`WatchScript::release`] after the acknowledgement.
    held: AtomicBool,
    release: tokio::sync::Semaphore,
    opened: AtomicBool,
    sent: AtomicBool,
}

impl Default for WatchScript {
    fn default() -> Self {
        Self {
            fires: Mutex::new(None),
            held: AtomicBool::new(false),
            release: tokio::sync::Semaphore::new(0),
            opened: AtomicBool::new(false),
            sent: AtomicBool::new(false),
        }
    }
}

impl WatchScript {
    pub(crate) fn set(&self, fires: Vec<TriggerFired>, held: bool) {
        self.sent.store(false, Ordering::SeqCst);
        self.opened.store(false, Ordering::SeqCst);
        self.held.store(held, Ordering::SeqCst);
        *self
            .fires
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(fires);
    }

    /// Lets a held script's fires go.
    pub(crate) fn release(&self) {
        self.release.add_permits(1);
    }

    /// Whether the scripted call was answered (its acknowledgement sent).
    pub(crate) fn opened(&self) -> bool {
        self.opened.load(Ordering::SeqCst)
    }

    pub(crate) fn sent(&self) -> bool {
        self.sent.load(Ordering::SeqCst)
    }

    fn take(&self) -> Option<Vec<TriggerFired>> {
        self.fires
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

impl NodeService {
    /// `stream`, rewritten if this node is compromised now.
    fn outgoing(&self, stream: ProgressStream) -> ProgressStream {
        if self.behaviour.get() != Behaviour::Oversized {
            return stream;
        }
        Box::pin(stream.map(|item| {
            item.map(|p| {
                if p.stage() == Stage::Done {
                    oversized(p)
                } else {
                    p
                }
            })
        }))
    }
}

#[tonic::async_trait]
impl AgentService for NodeService {
    type CaptureStream = ProgressStream;

    async fn capture(
        &self,
        request: Request<CaptureRequest>,
    ) -> Result<Response<Self::CaptureStream>, Status> {
        let stream = self.agent.capture(request).await?.into_inner();
        Ok(Response::new(self.outgoing(stream)))
    }

    type CollectStream = ProgressStream;

    async fn collect(
        &self,
        request: Request<CollectRequest>,
    ) -> Result<Response<Self::CollectStream>, Status> {
        let stream = self.agent.collect(request).await?.into_inner();
        Ok(Response::new(self.outgoing(stream)))
    }

    async fn cancel(
        &self,
        request: Request<CancelRequest>,
    ) -> Result<Response<CancelResponse>, Status> {
        self.agent.cancel(request).await
    }

    async fn info(&self, request: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        self.agent.info(request).await
    }

    type WatchStream = <Agent as AgentService>::WatchStream;

    async fn watch(
        &self,
        request: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let Some(fires) = self.watch_script.take() else {
            return self.agent.watch(request).await;
        };
        let watched = u32::try_from(request.get_ref().pods.len()).unwrap_or(u32::MAX);
        let ack = WatchEvent {
            event: Some(watch_event::Event::Ack(WatchAck {
                watched,
                refused: Vec::new(),
            })),
        };
        let fired = fires.into_iter().map(|f| {
            Ok(WatchEvent {
                event: Some(watch_event::Event::Fired(f)),
            })
        });
        let script = Arc::clone(&self.watch_script);
        let gate = Arc::clone(&self.watch_script);
        let done = Arc::clone(&self.watch_script);
        let stream = futures::stream::once(async move {
            script.opened.store(true, Ordering::SeqCst);
            Ok(ack)
        })
        .chain(
            futures::stream::once(async move {
                if gate.held.load(Ordering::SeqCst) {
                    // Closed only with the fleet: then the call ends anyway.
                    let _ = gate.release.acquire().await.map(|p| p.forget());
                }
                futures::stream::iter(fired)
            })
            .flatten(),
        )
        .chain(futures::stream::once(async move {
            done.sent.store(true, Ordering::SeqCst);
            futures::future::pending::<Result<WatchEvent, Status>>().await
        }));
        Ok(Response::new(Box::pin(stream)))
    }

    type ContinuousStream = <Agent as AgentService>::ContinuousStream;

    async fn continuous(
        &self,
        request: Request<ContinuousRequest>,
    ) -> Result<Response<Self::ContinuousStream>, Status> {
        self.agent.continuous(request).await
    }
}

/// `done` as a compromised agent would report it: its artifacts and summaries with every
/// free-text field blown up, the whole message under gRPC's 4 MiB default limit: a 1.5 MiB
/// sample type, a heap summary (whatever the capture's type) of 6,000 processes and 1,000
/// warnings (about 1.1 MiB), thousands of text summary entries with a 512 KiB frequency
/// note, and a 200 KiB message.
fn oversized(mut done: CaptureProgress) -> CaptureProgress {
    for artifact in &mut done.artifacts {
        artifact.sample_type = format!("cpu/{}", "n".repeat(3 << 19));
    }
    done.capture_summary = Some(Box::new(CaptureSummary {
        kind: Some(Kind::Heap(HeapSummary {
            allocations: 1,
            reason: "r".repeat(64 << 10),
            processes: (0..6_000)
                .map(|pid| HeapProcess {
                    pid,
                    comm: "c".repeat(16),
                    target: format!("ns/pod-{pid}"),
                    detail: "d".repeat(120),
                    ..Default::default()
                })
                .collect(),
            warnings: vec!["w".repeat(100); 1_000],
            ..Default::default()
        })),
        ..Default::default()
    }));
    done.summary
        .insert("frequency_note".into(), "f".repeat(512 << 10));
    for i in 0..2_000 {
        done.summary
            .insert(format!("junk-{i:05}-{}", "k".repeat(40)), "v".repeat(40));
    }
    done.message = "m".repeat(200 << 10);
    done
}
