//! The export sink: every finished capture's pprof artifacts also go, as OTLP profiles over
//! gRPC, to the OpenTelemetry endpoint the cluster admin configured (flags
//! `--export-otlp-*`, chart values `export.otlp.*`; docs/export.md).
//!
//! **Who sends: the operator.** It already holds everything an export needs and nothing a
//! node should: the endpoint and its credentials stay in one Deployment (an agent on every
//! node would put them on every node, within reach of a compromised one); the Kubernetes
//! attributes come from the pods the operator resolved, not from what an agent says; and one
//! queue for the cluster can be shared fairly between namespaces. The cost is one read of
//! each exported artifact back from the store and one conversion, off the capture's path.
//!
//! **Never in the way.** A node's result is recorded first; the export job is then offered
//! to a bounded [`FairQueue`](queue::FairQueue) without waiting (refused jobs are counted as
//! drops). One worker sends them, oldest first per namespace and namespaces in turn, so a
//! tenant that floods captures fills only its own share of the queue. A transient failure
//! puts the capture back at the end of its namespace's queue, to be tried again after a
//! capped exponential backoff with full jitter, for at most `--export-max-retry-time`, then
//! it is dropped and counted: a capture whose export keeps failing takes turns with the
//! others instead of holding the worker, which meanwhile sends the next job that is not
//! waiting (RESOURCE_EXHAUSTED with the endpoint's RetryInfo is transient too, retried no
//! sooner than it asks). Drops, retries and exports are
//! in `/metrics` (`flamefleet_operator_export_*`). Nothing is persisted: jobs queued when the
//! operator stops are lost (the artifacts stay in the store).
//!
//! **Tenants** choose only whether their captures are exported (`spec.export: false`, or a
//! policy's `template.export: false`), never where to, nor what the resource says they are.

pub mod queue;
pub mod resource;
pub mod sink;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flamefleet_api::Artifact;
use flamefleet_pprof::DecodeLimits;
use flamefleet_pprof::otlp::{self, Options};
use tokio::sync::Notify;

use crate::dispatch::connector::Backoff;
use crate::metrics::Metrics;
use crate::store::{ArtifactKey, ArtifactStore, RequestRef, Sha256Digest, StoreError};
use queue::FairQueue;
use resource::CaptureContext;
use sink::{SendError, Sink};
pub use sink::{SinkConfig, read_headers};

/// What decoding one artifact may inflate to and keep (real profiles are a few MiB at most;
/// the chart gives the operator 256 MiB).
const DECODE_BUDGET: u64 = 32 << 20;

/// The cluster admin's export settings.
#[derive(Debug, Clone)]
pub struct ExportSettings {
    /// The endpoint and how to reach it.
    pub sink: SinkConfig,
    /// Captures waiting to be exported, in all.
    pub queue_capacity: usize,
    /// Captures of one namespace waiting to be exported.
    pub queue_per_namespace: usize,
    /// How long a capture's export is retried before it is dropped.
    pub max_retry_time: Duration,
    /// Longest wait between two attempts (the first waits up to 1 s, each next one up to
    /// twice as long, with full jitter).
    pub max_retry_delay: Duration,
    /// Largest artifact read back from the store (the store's own upload limit).
    pub max_artifact_bytes: u64,
    /// Largest OTLP request: a profile whose request would be larger is sent in parts
    /// ([`otlp::to_otlp_requests`]).
    pub max_message_bytes: usize,
}

/// One profile of an export job.
#[derive(Debug, Clone)]
pub enum ExportItem {
    /// A verified artifact in the store (key, SHA-256 recorded when verified), read back
    /// when its turn comes.
    Stored(ArtifactKey, Sha256Digest),
    /// An always-on window's gzipped pprof, held in memory (it is in no store): `name`
    /// for logs.
    Window {
        /// e.g. `shop/web-0@1764390000000`.
        name: String,
        /// The gzipped pprof, as the agent sent it (at most its set's limit).
        pprof: Arc<Vec<u8>>,
    },
}

impl std::fmt::Display for ExportItem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stored(key, _) => key.fmt(f),
            Self::Window { name, .. } => write!(f, "window {name}"),
        }
    }
}

/// What became of the exports of one source (an always-on policy's windows), for its
/// status: counted as the worker gets to them.
#[derive(Debug, Default)]
pub struct ExportTally {
    /// Profiles exported.
    pub exported: std::sync::atomic::AtomicU64,
    /// Profiles dropped (refused by the queue, rejected, retries exhausted, invalid).
    pub dropped: std::sync::atomic::AtomicU64,
    /// Profiles waiting in the queue.
    pub queued: std::sync::atomic::AtomicU64,
    /// The last drop's reason, and when the last export succeeded.
    pub last: Mutex<TallyTimes>,
}

/// See [`ExportTally::last`].
#[derive(Debug, Default, Clone)]
pub struct TallyTimes {
    /// Why the last dropped profile was dropped.
    pub error: String,
    /// When the last profile was exported.
    pub exported_at: Option<jiff::Timestamp>,
}

impl ExportTally {
    fn exported(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.exported.fetch_add(1, Relaxed);
        self.lock().exported_at = Some(jiff::Timestamp::now());
    }

    fn dropped(&self, n: u64, reason: &str, message: &str) {
        use std::sync::atomic::Ordering::Relaxed;
        self.dropped.fetch_add(n, Relaxed);
        self.lock().error = crate::events::truncated(&format!("{reason}: {message}"), 300);
    }

    /// Counts a profile dropped before it reached the queue (e.g. too large at its source).
    pub fn dropped_without_queue(&self, reason: &str, message: &str) {
        self.dropped(1, reason, message);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TallyTimes> {
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One node's finished capture (or one pod's always-on window), to be exported.
#[derive(Debug, Clone)]
pub struct ExportJob {
    /// Who and where, for the resource attributes.
    pub context: CaptureContext,
    /// The pprof profiles.
    pub artifacts: Vec<ExportItem>,
    /// Where what becomes of them is counted, besides `/metrics`.
    pub tally: Vec<Arc<ExportTally>>,
}

impl ExportJob {
    /// The job of a node's verified `artifacts` (only pprof ones: those with a sample
    /// type), or `None` when there is nothing to export.
    pub fn of(
        request: &RequestRef,
        node: &str,
        pods: &[crate::pods::target::TargetPod],
        artifacts: &[Artifact],
    ) -> Option<Self> {
        let artifacts: Vec<ExportItem> = artifacts
            .iter()
            .filter(|a| a.sample_type.is_some())
            .filter_map(|a| {
                let key = request.artifact(a.name.clone()).ok()?;
                let sha = a.sha256.as_deref()?.parse().ok()?;
                Some(ExportItem::Stored(key, sha))
            })
            .collect();
        (!artifacts.is_empty()).then(|| Self {
            context: CaptureContext {
                namespace: request.namespace().to_owned(),
                request: request.name().to_owned(),
                policy: String::new(),
                node: node.to_owned(),
                pods: pods.iter().map(resource::ExportedPod::from).collect(),
            },
            artifacts,
            tally: Vec::new(),
        })
    }
}

/// The OTLP profile ID of a window: the first 16 bytes of its SHA-256.
fn window_id(pprof: &[u8]) -> [u8; 16] {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(pprof);
    let mut id = [0u8; 16];
    id.copy_from_slice(&digest[..16]);
    id
}

/// A job in the queue, with how far its export got.
#[derive(Debug)]
struct Pending {
    job: ExportJob,
    /// Artifacts of the job already exported or dropped.
    done: usize,
    /// Requests of the current artifact already sent (a profile over the request size
    /// limit is sent in parts; a retry sends only the parts not yet sent).
    parts_sent: usize,
    /// Failed attempts at the current artifact.
    attempt: u32,
    /// When the current artifact first failed.
    first_failure: Option<Instant>,
    /// Not to be tried again before this.
    retry_at: Option<Instant>,
}

/// Why one attempt at an artifact did not export it.
enum Failure {
    /// Trying again may help (the endpoint or the store is unavailable), not before the
    /// delay the endpoint asked for, if it did.
    Transient(String, Option<Duration>),
    /// It never will: dropped, with the reason label.
    Drop(&'static str, String),
}

/// The export sink: a queue and the worker that empties it.
#[derive(Debug)]
pub struct Exporter {
    queue: Mutex<FairQueue<Pending>>,
    wake: Notify,
    metrics: Arc<Metrics>,
}

impl Exporter {
    /// Checks `settings` and starts the worker (on the current Tokio runtime).
    ///
    /// # Errors
    /// A malformed endpoint, CA or header.
    pub fn start(
        settings: ExportSettings,
        store: Arc<dyn ArtifactStore>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Self>, String> {
        let sink = Sink::new(&settings.sink)?;
        let exporter = Arc::new(Self {
            queue: Mutex::new(FairQueue::new(
                settings.queue_capacity,
                settings.queue_per_namespace,
            )),
            wake: Notify::new(),
            metrics,
        });
        tokio::spawn(exporter.clone().work(sink, store, settings));
        Ok(exporter)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FairQueue<Pending>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Offers `job` to the queue; never waits. A refused job's artifacts are counted as
    /// dropped.
    pub fn submit(&self, job: ExportJob) {
        let namespace = job.context.namespace.clone();
        let artifacts = job.artifacts.len() as u64;
        let tally = job.tally.clone();
        let pending = Pending {
            job,
            done: 0,
            parts_sent: 0,
            attempt: 0,
            first_failure: None,
            retry_at: None,
        };
        let pushed = {
            let mut queue = self.lock();
            let pushed = queue.push(&namespace, pending);
            self.metrics.export_queued(queue.len());
            pushed
        };
        match pushed {
            Ok(()) => {
                for t in &tally {
                    t.queued
                        .fetch_add(artifacts, std::sync::atomic::Ordering::Relaxed);
                }
                self.wake.notify_one();
            }
            Err(refused) => {
                for t in &tally {
                    t.dropped(
                        artifacts,
                        refused.reason(),
                        "the export queue was full for this namespace or the cluster",
                    );
                }
                tracing::warn!(
                    %namespace,
                    reason = refused.reason(),
                    "export queue refused a capture; its profiles are not exported"
                );
                self.metrics.export_dropped(refused.reason(), artifacts);
            }
        }
    }

    /// Empties the queue when the operator stops leading (`reason`: `leader_lost` or
    /// `shutdown`): nothing is persisted, so what is still queued is never exported by this
    /// process, and the new leader does not know of it. Counts those profiles as dropped
    /// (`/metrics`, the policies' tallies) and logs how many. Returns that number.
    pub fn abandon(&self, reason: &'static str) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        let drained: Vec<(String, Pending)> = {
            let mut queue = self.lock();
            let drained = std::iter::from_fn(|| queue.pop()).collect();
            self.metrics.export_queued(0);
            drained
        };
        let mut total = 0;
        for (_, pending) in &drained {
            let left = pending.job.artifacts.len().saturating_sub(pending.done) as u64;
            for t in &pending.job.tally {
                let _ = t
                    .queued
                    .fetch_update(Relaxed, Relaxed, |q| Some(q.saturating_sub(left)));
                t.dropped(left, reason, "the operator stopped leading with it queued");
            }
            total += left;
        }
        if total > 0 {
            self.metrics.export_dropped(reason, total);
            tracing::warn!(
                profiles = total,
                captures = drained.len(),
                reason,
                "the operator stops leading with profiles in the export queue: they are not exported (nothing is persisted; the new leader does not know of them)"
            );
        }
        total
    }

    /// The one worker. A transient failure puts the job back at the end of its namespace's
    /// queue with a time before which it is not tried again, so that a capture whose export
    /// keeps failing (an endpoint down, or a payload it times out on) takes its turn with
    /// the other namespaces' instead of holding the worker.
    async fn work(
        self: Arc<Self>,
        sink: Sink,
        store: Arc<dyn ArtifactStore>,
        settings: ExportSettings,
    ) {
        let mut rng = fastrand::Rng::new();
        let backoff = Backoff {
            base: Duration::from_secs(1).min(settings.max_retry_delay),
            cap: settings.max_retry_delay,
            attempts: u32::MAX,
        };
        loop {
            // The first job in turn that is not waiting for a retry: a job backing off
            // never holds up the others, which are sent meanwhile.
            let now = Instant::now();
            let (next, earliest) = {
                let mut queue = self.lock();
                let next = queue.pop_first(|p| p.retry_at.is_none_or(|at| at <= now));
                let earliest = match next {
                    Some(_) => None,
                    None => queue.fronts().filter_map(|p| p.retry_at).min(),
                };
                self.metrics.export_queued(queue.len());
                (next, earliest)
            };
            let Some((namespace, mut pending)) = next else {
                match earliest {
                    Some(at) => {
                        tokio::select! {
                            () = tokio::time::sleep_until(at.into()) => {}
                            () = self.wake.notified() => {}
                        }
                    }
                    None => self.wake.notified().await,
                }
                continue;
            };
            pending.retry_at = None;
            while let Some(key) = pending.job.artifacts.get(pending.done).cloned() {
                let outcome = self
                    .export_artifact(
                        &sink,
                        store.as_ref(),
                        &settings,
                        &pending.job.context,
                        &key,
                        &mut pending.parts_sent,
                    )
                    .await;
                let (reason, message) = match outcome {
                    Ok(()) => {
                        tracing::debug!(%key, "exported");
                        self.metrics.export_exported();
                        for t in &pending.job.tally {
                            t.queued.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                            t.exported();
                        }
                        pending.done += 1;
                        pending.parts_sent = 0;
                        pending.attempt = 0;
                        pending.first_failure = None;
                        continue;
                    }
                    Err(Failure::Drop(reason, message)) => (reason, message),
                    Err(Failure::Transient(message, asked)) => {
                        let first = *pending.first_failure.get_or_insert_with(Instant::now);
                        let delay = backoff
                            .delay(pending.attempt, &mut rng)
                            .max(asked.unwrap_or_default());
                        if first.elapsed() + delay > settings.max_retry_time {
                            ("retries_exhausted", message)
                        } else {
                            pending.attempt += 1;
                            tracing::info!(%key, attempt = pending.attempt, "export failed ({message}); retrying in {delay:?}");
                            self.metrics.export_retried();
                            pending.retry_at = Some(Instant::now() + delay);
                            // Admitted once already: back in line whatever the bounds say
                            // (the one worker holds at most one job outside the queue).
                            self.lock().requeue(&namespace, pending);
                            break;
                        }
                    }
                };
                tracing::warn!(%key, reason, "export dropped: {message}");
                self.metrics.export_dropped(reason, 1);
                for t in &pending.job.tally {
                    t.queued.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                    t.dropped(1, reason, &message);
                }
                pending.done += 1;
                pending.parts_sent = 0;
                pending.attempt = 0;
                pending.first_failure = None;
            }
        }
    }

    /// One attempt at reading, converting and sending one artifact.
    async fn export_artifact(
        &self,
        sink: &Sink,
        store: &dyn ArtifactStore,
        settings: &ExportSettings,
        context: &CaptureContext,
        item: &ExportItem,
        parts_sent: &mut usize,
    ) -> Result<(), Failure> {
        let (key, sha256) = match item {
            ExportItem::Stored(key, sha256) => (key, *sha256),
            ExportItem::Window { pprof, .. } => {
                return self
                    .export_bytes(sink, settings, context, pprof, window_id(pprof), parts_sent)
                    .await;
            }
        };
        let body = match store.read(key, settings.max_artifact_bytes).await {
            Ok((body, digest)) if digest.sha256 == sha256 => body,
            Ok(_) => {
                return Err(Failure::Drop(
                    "artifact_changed",
                    "the stored artifact no longer has the SHA-256 verified at capture".into(),
                ));
            }
            Err(StoreError::NotFound { .. }) => {
                return Err(Failure::Drop(
                    "artifact_gone",
                    "the artifact was deleted before its export".into(),
                ));
            }
            Err(e @ StoreError::TooLarge { .. }) => {
                return Err(Failure::Drop("invalid_profile", e.to_string()));
            }
            Err(e) => return Err(Failure::Transient(e.to_string(), None)),
        };
        let mut profile_id = [0u8; 16];
        profile_id.copy_from_slice(&sha256.as_bytes()[..16]);
        self.export_bytes(sink, settings, context, &body, profile_id, parts_sent)
            .await
    }

    /// Converts and sends one gzipped (or plain) pprof: one request, or, when that would be
    /// over `settings.max_message_bytes`, its parts in order, from the first not yet sent
    /// (`parts_sent`, counted up as each is sent: the conversion is deterministic, so a
    /// retry makes the same parts and sends none twice).
    async fn export_bytes(
        &self,
        sink: &Sink,
        settings: &ExportSettings,
        context: &CaptureContext,
        body: &[u8],
        profile_id: [u8; 16],
        parts_sent: &mut usize,
    ) -> Result<(), Failure> {
        let limits = DecodeLimits {
            max_decompressed_bytes: DECODE_BUDGET,
            max_kept_bytes: DECODE_BUDGET,
        };
        let invalid = |e: flamefleet_pprof::Error| Failure::Drop("invalid_profile", e.to_string());
        let profile = flamefleet_pprof::decode_with(body, &limits).map_err(invalid)?;
        let options = Options {
            scope_name: "flamefleet".into(),
            scope_version: env!("CARGO_PKG_VERSION").into(),
            profile_id,
        };
        let requests = otlp::to_otlp_requests(
            &profile,
            |owner| resource::attributes(context, owner),
            &options,
            settings.max_message_bytes,
        )
        .map_err(invalid)?;
        drop(profile);
        let parts = requests.len();
        if parts > 1 && *parts_sent == 0 {
            tracing::debug!(request = %context.request, policy = %context.policy, parts, "a profile over the export's request size limit is sent in parts");
            self.metrics.export_split(parts as u64);
        }
        for request in requests.into_iter().skip(*parts_sent) {
            match sink.send(request).await {
                Ok(None) => {}
                Ok(Some((rejected, message))) => {
                    tracing::warn!(request = %context.request, policy = %context.policy, rejected, "the export endpoint rejected part of the profiles: {message}");
                }
                Err(SendError::Permanent(e)) => return Err(Failure::Drop("rejected", e)),
                Err(SendError::Retryable(e, delay)) => return Err(Failure::Transient(e, delay)),
            }
            *parts_sent += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;

    fn window(namespace: &str, tally: &Arc<ExportTally>) -> ExportJob {
        ExportJob {
            context: CaptureContext {
                namespace: namespace.into(),
                request: String::new(),
                policy: format!("{namespace}/always"),
                node: "n1".into(),
                pods: Vec::new(),
            },
            artifacts: vec![ExportItem::Window {
                name: format!("{namespace}/web-0@1"),
                pprof: Arc::new(vec![1, 2, 3]),
            }],
            tally: vec![Arc::clone(tally)],
        }
    }

    #[test]
    fn what_is_queued_when_leadership_ends_is_counted_as_dropped() {
        let metrics = Arc::new(Metrics::new());
        // No worker: the jobs stay queued, as when the endpoint is down.
        let exporter = Exporter {
            queue: Mutex::new(FairQueue::new(8, 8)),
            wake: Notify::new(),
            metrics: Arc::clone(&metrics),
        };
        let tally = Arc::new(ExportTally::default());
        exporter.submit(window("shop", &tally));
        exporter.submit(window("shop", &tally));
        exporter.submit(window("bank", &tally));
        assert_eq!(tally.queued.load(Relaxed), 3);

        assert_eq!(exporter.abandon("leader_lost"), 3);
        assert_eq!(tally.queued.load(Relaxed), 0);
        assert_eq!(tally.dropped.load(Relaxed), 3);
        assert!(tally.lock().error.starts_with("leader_lost: "));
        let text = metrics.encode();
        assert!(
            text.lines()
                .any(|l| l.contains("reason=\"leader_lost\"") && l.ends_with(" 3")),
            "{text}"
        );
        assert!(exporter.lock().is_empty());
        // Nothing left to abandon.
        assert_eq!(exporter.abandon("shutdown"), 0);
    }
}
