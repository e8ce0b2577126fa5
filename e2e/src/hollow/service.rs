//! One hollow node's `AgentService`: the real agent's contract (node-agent `service/`)
//! without a capture. `Capture` is idempotent per request UID (start, attach to the running
//! capture, or replay the final message) and streams the stages the real agent streams:
//! ACCEPTED, RUNNING ("sampler attached", then "capturing" every progress period with
//! elapsed and remaining time), UPLOADING, then DONE with the uploaded artifacts and the
//! summary, or FAILED with a reason. `Cancel` ends a running capture with FAILED
//! ("cancelled by the client") and uploads nothing.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flamefleet_proto::agent::agent_service_server::AgentService;
use flamefleet_proto::agent::capture_progress::Stage;
use flamefleet_proto::agent::{
    Artifact, CancelRequest, CancelResponse, CaptureProgress, CaptureRequest, CollectRequest,
    InfoRequest, InfoResponse, ProfileType, artifact_names,
};
use futures::Stream;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::{Behaviour, BehaviourCell, Shared, profile};

/// Longest capture accepted (as the real agent).
const MAX_DURATION: Duration = Duration::from_secs(3600);

/// What a capture's followers read: every message so far, in order (a handful).
type Log = Vec<CaptureProgress>;

enum Entry {
    Running {
        log: watch::Receiver<Log>,
        cancel: CancellationToken,
    },
    Finished(CaptureProgress),
}

/// One hollow node.
#[derive(Clone)]
pub struct HollowAgent {
    node: Arc<str>,
    behaviour: Arc<BehaviourCell>,
    captures: Arc<Mutex<HashMap<String, Entry>>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for HollowAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HollowAgent")
            .field("node", &self.node)
            .field("behaviour", &self.behaviour)
            .finish_non_exhaustive()
    }
}

fn progress(stage: Stage, message: impl Into<String>) -> CaptureProgress {
    CaptureProgress {
        stage: stage as i32,
        message: message.into(),
        ..Default::default()
    }
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

fn is_terminal(p: &CaptureProgress) -> bool {
    matches!(p.stage(), Stage::Done | Stage::Failed)
}

/// Follows `log` from message `seen` until (and including) a terminal message.
fn follow(log: watch::Receiver<Log>, seen: usize) -> impl Stream<Item = CaptureProgress> {
    futures::StreamExt::flat_map(
        futures::stream::unfold(
            (log, seen, false, true),
            |(mut log, seen, done, first)| async move {
                if done {
                    return None;
                }
                if !first && log.changed().await.is_err() {
                    return None;
                }
                let batch: Vec<CaptureProgress> =
                    log.borrow_and_update().iter().skip(seen).cloned().collect();
                let done = batch.iter().any(is_terminal);
                let seen = seen + batch.len();
                Some((batch, (log, seen, done, false)))
            },
        ),
        futures::stream::iter,
    )
}

impl HollowAgent {
    pub(super) fn new(node: &str, behaviour: Arc<BehaviourCell>, shared: Arc<Shared>) -> Self {
        Self {
            node: node.into(),
            behaviour,
            captures: Arc::default(),
            shared,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.captures.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The stream of a call for a capture this node knows: its progress from the newest
    /// message while it runs, else its final message (`Capture` and `Collect` alike).
    fn rejoin(&self, entry: &Entry) -> ProgressStream {
        use futures::StreamExt as _;
        match entry {
            Entry::Running { log, .. } => {
                self.shared.stats.attached.fetch_add(1, Ordering::Relaxed);
                let seen = log.borrow().len().saturating_sub(1);
                Box::pin(follow(log.clone(), seen).map(Ok))
            }
            Entry::Finished(last) => {
                self.shared.stats.replayed.fetch_add(1, Ordering::Relaxed);
                Box::pin(futures::stream::iter([Ok(last.clone())]))
            }
        }
    }

    fn finish(&self, uid: &str, tx: &watch::Sender<Log>, last: CaptureProgress) {
        match last.stage() {
            Stage::Done => self.shared.stats.done.fetch_add(1, Ordering::Relaxed),
            _ => self.shared.stats.failed.fetch_add(1, Ordering::Relaxed),
        };
        // Table first, then publish: a caller arriving in between replays the final message.
        self.lock()
            .insert(uid.to_owned(), Entry::Finished(last.clone()));
        tx.send_modify(|log| log.push(last));
    }

    /// Runs one capture to its final message.
    async fn run(
        self,
        req: CaptureRequest,
        behaviour: Behaviour,
        tx: watch::Sender<Log>,
        cancel: CancellationToken,
    ) {
        let uid = req.request_uid.trim().to_owned();
        let started = Instant::now();
        let last = match behaviour {
            Behaviour::Silent => {
                // Never answers: the stream stays open, without a message, until Cancel (or
                // the fleet stops).
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = self.shared.shutdown.cancelled() => {}
                }
                self.shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                progress(Stage::Failed, "cancelled by the client")
            }
            Behaviour::Fail => progress(
                Stage::Failed,
                format!(
                    "target resolution failed: hollow agent {}: injected failure",
                    self.node
                ),
            ),
            Behaviour::Forget => {
                let half = Duration::from_millis(u64::from(req.duration_ms) / 2);
                tokio::select! {
                    () = tokio::time::sleep(half) => {}
                    () = cancel.cancelled() => {}
                    () = self.shared.shutdown.cancelled() => {}
                }
                // Gone from the table without a final message: the stream of a caller still
                // following ends (the sender is dropped), and `Collect` finds nothing.
                self.lock().remove(&uid);
                self.shared.stats.forgotten.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Behaviour::Succeed => match self.capture(&req, &tx, &cancel, started).await {
                Ok(done) => done,
                Err(reason) => progress(Stage::Failed, reason),
            },
        };
        let last = CaptureProgress {
            elapsed_ms: millis(started.elapsed()),
            ..last
        };
        self.finish(&uid, &tx, last);
    }

    async fn capture(
        &self,
        req: &CaptureRequest,
        tx: &watch::Sender<Log>,
        cancel: &CancellationToken,
        started: Instant,
    ) -> Result<CaptureProgress, String> {
        let ty = ProfileType::try_from(req.r#type).unwrap_or(ProfileType::Unspecified);
        if ty == ProfileType::Unspecified {
            return Err(format!(
                "invalid request: profile type {} is not one of cpu (1), heap (2), runqlat (3)",
                req.r#type
            ));
        }
        let duration = Duration::from_millis(u64::from(req.duration_ms));
        if duration.is_zero() || duration > MAX_DURATION {
            return Err(format!(
                "invalid request: duration_ms must be between 1 and {}, found {}",
                MAX_DURATION.as_millis(),
                req.duration_ms
            ));
        }
        let names = artifact_names(ty, &self.node);
        let mut slots = Vec::new();
        for name in &names {
            match req.uploads.iter().find(|s| &s.artifact_name == name) {
                Some(s) => slots.push(s.clone()),
                None => {
                    return Err(format!(
                        "invalid request: no upload slot for artifact {name}"
                    ));
                }
            }
        }
        tx.send_modify(|log| log.push(progress(Stage::Running, "sampler attached")));
        let period = self.shared.progress_period;
        let end = tokio::time::Instant::now() + duration;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(end) => break,
                () = cancel.cancelled() => {
                    self.shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                    return Err("cancelled by the client".into());
                }
                _ = tick.tick() => {
                    let elapsed = started.elapsed();
                    tx.send_modify(|log| log.push(CaptureProgress {
                        stage: Stage::Running as i32,
                        message: "capturing".into(),
                        elapsed_ms: millis(elapsed),
                        remaining_ms: millis(duration.saturating_sub(elapsed)),
                        ..Default::default()
                    }));
                }
            }
        }
        let pods: Vec<(String, String)> = req
            .targets
            .iter()
            .map(|t| (t.namespace.clone(), t.pod_name.clone()))
            .collect();
        let frequency = req.cpu.as_ref().map_or(99, |c| match c.frequency_hz {
            0 => 99,
            hz => u64::from(hz),
        });
        let built = profile::build(ty, &self.node, &pods, duration, frequency, &names)
            .map_err(|e| format!("internal error: encoding the profile: {e}"))?;
        tx.send_modify(|log| log.push(progress(Stage::Uploading, "uploading artifacts")));
        let mut artifacts = Vec::new();
        for (artifact, slot) in built.artifacts.into_iter().zip(&slots) {
            let size = artifact.bytes.len() as u64;
            let sha256 = super::upload::sha256_hex(&artifact.bytes);
            let put = async {
                let _permit = self
                    .shared
                    .uploads
                    .acquire()
                    .await
                    .map_err(|e| e.to_string())?;
                self.shared
                    .uploader
                    .put(
                        &artifact.name,
                        &slot.put_url,
                        artifact.bytes,
                        slot.max_bytes,
                    )
                    .await
            };
            let put = tokio::select! {
                r = put => r,
                () = cancel.cancelled() => {
                    self.shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                    return Err("cancelled by the client".into());
                }
            };
            if let Err(e) = put {
                self.shared
                    .stats
                    .upload_errors
                    .fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
            self.shared.stats.uploads.fetch_add(1, Ordering::Relaxed);
            artifacts.push(Artifact {
                name: artifact.name,
                url: String::new(),
                size_bytes: size,
                sha256,
                samples: artifact.samples,
                sample_type: artifact.sample_type,
            });
        }
        Ok(CaptureProgress {
            stage: Stage::Done as i32,
            message: format!("uploaded {} artifact(s)", artifacts.len()),
            artifacts,
            summary: built.summary.display(),
            runqlat_histogram: built.runqlat_histogram,
            capture_summary: Some(Box::new(built.summary)),
            ..Default::default()
        })
    }
}

/// The stream type of `Capture`.
pub type ProgressStream = Pin<Box<dyn Stream<Item = Result<CaptureProgress, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for HollowAgent {
    type CaptureStream = ProgressStream;

    async fn capture(
        &self,
        request: Request<CaptureRequest>,
    ) -> Result<Response<Self::CaptureStream>, Status> {
        use futures::StreamExt as _;
        let req = request.into_inner();
        let uid = req.request_uid.trim().to_owned();
        if uid.is_empty() {
            return Err(Status::invalid_argument(
                "request_uid is empty; expected the ProfileRequest's metadata.uid",
            ));
        }
        let mut captures = self.lock();
        let stream = match captures.get(&uid) {
            Some(entry) => self.rejoin(entry),
            None => {
                self.shared.stats.captures.fetch_add(1, Ordering::Relaxed);
                let behaviour = self.behaviour.get();
                let first = match behaviour {
                    // A hung agent: not even ACCEPTED.
                    Behaviour::Silent => Vec::new(),
                    _ => vec![progress(
                        Stage::Accepted,
                        format!("accepted by node {}", self.node),
                    )],
                };
                let (tx, rx) = watch::channel(first);
                let cancel = CancellationToken::new();
                captures.insert(
                    uid,
                    Entry::Running {
                        log: rx.clone(),
                        cancel: cancel.clone(),
                    },
                );
                tokio::spawn(self.clone().run(req, behaviour, tx, cancel));
                Box::pin(follow(rx, 0).map(Ok)) as ProgressStream
            }
        };
        Ok(Response::new(stream))
    }

    type CollectStream = ProgressStream;

    async fn collect(
        &self,
        request: Request<CollectRequest>,
    ) -> Result<Response<Self::CollectStream>, Status> {
        let uid = request.into_inner().request_uid.trim().to_owned();
        self.shared.stats.collects.fetch_add(1, Ordering::Relaxed);
        let stream = match self.lock().get(&uid) {
            Some(entry) => self.rejoin(entry),
            None => {
                self.shared
                    .stats
                    .collects_unknown
                    .fetch_add(1, Ordering::Relaxed);
                return Err(Status::not_found(format!(
                    "node {} has no capture for request {uid}",
                    self.node
                )));
            }
        };
        Ok(Response::new(stream))
    }

    async fn cancel(
        &self,
        request: Request<CancelRequest>,
    ) -> Result<Response<CancelResponse>, Status> {
        let uid = request.into_inner().request_uid;
        let found = match self.lock().get(uid.trim()) {
            Some(Entry::Running { cancel, .. }) => {
                cancel.cancel();
                true
            }
            _ => false,
        };
        self.shared
            .stats
            .cancel_calls
            .fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(CancelResponse { found }))
    }

    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        Ok(Response::new(InfoResponse {
            node_name: self.node.to_string(),
            kernel_release: "hollow".into(),
            supported_types: vec![
                ProfileType::Cpu as i32,
                ProfileType::Heap as i32,
                ProfileType::Runqlat as i32,
            ],
            agent_version: concat!("hollow-", env!("CARGO_PKG_VERSION")).into(),
            api_version: "flamefleet.agent.v1".into(),
            missing_features: Vec::new(),
        }))
    }
}
