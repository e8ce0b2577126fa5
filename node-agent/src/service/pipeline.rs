//! One capture from start to report: start it on the service's engine, run its window
//! while publishing progress (a Cancel stops it at once), build the artifacts, upload
//! them, and report the result on the capture's stream.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flamefleet_proto::agent::capture_progress::Stage;
use flamefleet_proto::agent::{
    Artifact, CaptureProgress, CaptureRequest, CaptureSummary, LatencyHistogram, ProfileType,
    UploadSlot, artifact_names,
};
use flamefleet_proto::pprof::Profile;
use tokio_util::sync::CancellationToken;

use super::captures::CaptureHandle;
use super::engine::{Admission, CaptureEngine, EngineCapture};
pub use super::error::PipelineError;
use super::reporter::{Outcome, Reporter};
use super::upload::{Uploader, sha256_hex};
use crate::capture::lifecycle::Finished;

use crate::pprof;

/// Longest capture accepted (the CRD allows at most this much too).
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
/// How often RUNNING progress is published.
pub const PROGRESS_PERIOD: Duration = Duration::from_secs(1);

/// What every capture of a service shares: what captures, and what the service does with
/// the results (see [`super::Agent::with_engine`]).
pub struct Context {
    /// This node's name (artifact names, messages).
    pub node: String,
    /// What captures.
    pub engine: Arc<dyn CaptureEngine>,
    /// The uploader (cheap to clone: one connection pool).
    pub uploader: Uploader,
    /// Uploads in flight at once, when bounded (one process serving many nodes).
    pub upload_permits: Option<Arc<tokio::sync::Semaphore>>,
    /// Where calls and captures are reported (`/metrics`).
    pub reporter: Arc<dyn Reporter>,
    /// How often RUNNING progress is published.
    pub progress_period: Duration,
    /// Cancelled when the service shuts down: captures that wait for nothing else end.
    pub shutdown: CancellationToken,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// An artifact ready to upload.
struct Built {
    name: String,
    bytes: Vec<u8>,
    samples: u64,
    sample_type: String,
}

/// What a capture produced, ready to upload.
struct Output {
    artifacts: Vec<Built>,
    summary: CaptureSummary,
    runqlat_histogram: Option<LatencyHistogram>,
}

/// The `type` label of a profile type in the agent's metrics.
fn type_label(ty: ProfileType) -> &'static str {
    match ty {
        ProfileType::Cpu => "cpu",
        ProfileType::Heap => "heap",
        ProfileType::Runqlat => "runqlat",
        ProfileType::Offcpu => "offcpu",
        ProfileType::Unspecified => "unspecified",
    }
}

/// A progress message of `stage`.
pub fn progress(stage: Stage, message: impl Into<String>) -> CaptureProgress {
    CaptureProgress {
        stage: stage as i32,
        message: message.into(),
        ..Default::default()
    }
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// Checks what can be checked before capturing.
fn validate(
    req: &CaptureRequest,
    node: &str,
) -> Result<(ProfileType, Duration, Vec<UploadSlot>), PipelineError> {
    let ty = ProfileType::try_from(req.r#type).unwrap_or(ProfileType::Unspecified);
    if ty == ProfileType::Unspecified {
        return Err(PipelineError::Invalid(format!(
            "profile type {} is not one of cpu (1), heap (2), runqlat (3)",
            req.r#type
        )));
    }
    let duration = Duration::from_millis(u64::from(req.duration_ms));
    if duration.is_zero() || duration > MAX_DURATION {
        return Err(PipelineError::Invalid(format!(
            "duration_ms must be between 1 and {}, found {}",
            MAX_DURATION.as_millis(),
            req.duration_ms
        )));
    }
    let mut slots = Vec::new();
    for name in artifact_names(ty, node) {
        match req.uploads.iter().find(|s| s.artifact_name == name) {
            Some(s) => slots.push(s.clone()),
            None => {
                let offered: Vec<&str> = req
                    .uploads
                    .iter()
                    .map(|s| s.artifact_name.as_str())
                    .collect();
                return Err(PipelineError::Invalid(format!(
                    "no upload slot for artifact {name}; the request offers {offered:?}"
                )));
            }
        }
    }
    Ok((ty, duration, slots))
}

/// Runs `f` on a thread of its own (the engines block: BPF loading, map
/// reads, symbolization, the heap engine's own runtime) and awaits it.
async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, PipelineError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("capture-{what}"))
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| PipelineError::Internal(format!("spawning the {what} thread: {e}")))?;
    rx.await
        .map_err(|_| PipelineError::Internal(format!("the {what} thread panicked")))
}

/// Publishes RUNNING progress of a capture started at `started` for `duration`.
///
/// Only a capture with a window publishes: the operator takes a RUNNING with time left as its
/// cue to hang up and come back at the window's end, while a capture without one (a snapshot
/// read: a pprof endpoint, a Go heap) is done as soon as it is read.
struct Ticker {
    tick: tokio::time::Interval,
    started: Instant,
    duration: Duration,
    windowed: bool,
}

impl Ticker {
    fn new(period: Duration, started: Instant, duration: Duration, windowed: bool) -> Self {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self {
            tick,
            started,
            duration,
            windowed,
        }
    }

    /// Resolves at the next tick (the first at once).
    async fn next(&mut self) {
        self.tick.tick().await;
    }

    fn publish(&self, handle: &CaptureHandle) {
        if !self.windowed {
            return;
        }
        let elapsed = self.started.elapsed();
        handle.progress(CaptureProgress {
            stage: Stage::Running as i32,
            message: "capturing".into(),
            elapsed_ms: millis(elapsed),
            remaining_ms: millis(self.duration.saturating_sub(elapsed)),
            ..Default::default()
        });
    }
}

/// Waits out the capture's window (if it has one), publishing progress and running its
/// works on a thread when they are due; on Cancel, gives the capture up at once (on a
/// thread: giving targets back updates maps, detaching probes waits for RCU).
async fn run_window(
    handle: &CaptureHandle,
    ticker: &mut Ticker,
    mut running: Box<dyn EngineCapture>,
) -> Result<Box<dyn EngineCapture>, PipelineError> {
    let Some(deadline) = running.deadline() else {
        return Ok(running);
    };
    loop {
        let wake = running.next_work().map_or(deadline, |t| t.min(deadline));
        tokio::select! {
            () = tokio::time::sleep_until(wake.into()) => {}
            () = handle.cancelled() => {
                let _ = blocking("capture", move || drop(running)).await;
                return Err(PipelineError::Cancelled);
            }
            () = ticker.next() => {
                ticker.publish(handle);
                continue;
            }
        }
        if Instant::now() >= deadline {
            return Ok(running);
        }
        running = blocking("capture", move || running.work().map(|()| running)).await??;
    }
}

/// Awaits `work` (the capture's finish), publishing progress; `Err(Cancelled)` at once on
/// Cancel (the thread finishes in the background and drops what it built).
async fn with_progress<T>(
    handle: &CaptureHandle,
    ticker: &mut Ticker,
    work: impl Future<Output = T>,
) -> Result<T, PipelineError> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => return Ok(out),
            () = handle.cancelled() => return Err(PipelineError::Cancelled),
            () = ticker.next() => ticker.publish(handle),
        }
    }
}

fn sample_type_of(p: &Profile) -> String {
    let idx = p
        .sample_type
        .iter()
        .position(|st| st.r#type == p.default_sample_type && p.default_sample_type != 0)
        .or_else(|| p.sample_type.len().checked_sub(1));
    idx.and_then(|i| p.sample_type.get(i))
        .map(|st| {
            let s = |i: i64| {
                usize::try_from(i)
                    .ok()
                    .and_then(|i| p.string_table.get(i))
                    .cloned()
                    .unwrap_or_default()
            };
            format!("{}/{}", s(st.r#type), s(st.unit))
        })
        .unwrap_or_default()
}

fn gzip(profile: &Profile) -> Result<Vec<u8>, PipelineError> {
    pprof::encode_gzip(profile)
        .map_err(|e| PipelineError::Internal(format!("encoding the profile: {e}")))
}

/// The artifacts of `finished`, under the names of `ty` on `node`: the profile, and
/// runqlat's text histograms (which count no samples of their own: the pprof artifact
/// carries them, so the request's total is not doubled).
fn build(finished: Finished, ty: ProfileType, node: &str) -> Result<Output, PipelineError> {
    let names = artifact_names(ty, node);
    let mut artifacts = Vec::with_capacity(names.len());
    let mut names = names.into_iter();
    let name = names
        .next()
        .ok_or_else(|| PipelineError::Internal(format!("no artifact name for {ty:?}")))?;
    artifacts.push(Built {
        name,
        bytes: gzip(&finished.profile)?,
        samples: finished.summary.samples(),
        sample_type: sample_type_of(&finished.profile),
    });
    if let (Some(text), Some(name)) = (finished.histogram_text, names.next()) {
        artifacts.push(Built {
            name,
            bytes: text.into_bytes(),
            samples: 0,
            sample_type: String::new(),
        });
    }
    Ok(Output {
        artifacts,
        summary: finished.summary,
        runqlat_histogram: finished.runqlat_histogram,
    })
}

/// Starts the capture on the engine, runs its window and reads it out.
async fn capture(
    ctx: &Context,
    handle: &CaptureHandle,
    req: &CaptureRequest,
    ty: ProfileType,
    duration: Duration,
) -> Result<Output, PipelineError> {
    let started = Instant::now();
    let engine = Arc::clone(&ctx.engine);
    let request = req.clone();
    let start = blocking("start", move || engine.start(&request, ty, duration));
    let running: Box<dyn EngineCapture> = tokio::select! {
        r = start => r??,
        () = handle.cancelled() => return Err(PipelineError::Cancelled),
    };
    if let Some(sampler) = running.sampler() {
        // Concurrent captures share one sampler: its address tells them apart in the log.
        let sampler = format_args!("{sampler:#x}");
        match ty {
            ProfileType::Cpu => {
                tracing::info!(uid = %handle.uid(), sampler, "cpu sampler attached")
            }
            ProfileType::Runqlat => {
                tracing::info!(uid = %handle.uid(), sampler, "runqlat sampler attached");
            }
            _ => tracing::info!(uid = %handle.uid(), sampler, ?ty, "sampler attached"),
        }
        handle.progress(progress(Stage::Running, "sampler attached"));
    }
    let windowed = running.deadline().is_some();
    let mut ticker = Ticker::new(ctx.progress_period, started, duration, windowed);
    let running = run_window(handle, &mut ticker, running).await?;
    let node = ctx.node.clone();
    let reporter = Arc::clone(&ctx.reporter);
    let work = blocking("capture", move || {
        let finished = running.finish()?;
        reporter.symbolized(type_label(ty), finished.symbolized);
        build(finished, ty, &node)
    });
    with_progress(handle, &mut ticker, work).await??
}

/// Time kept, before the operator's deadline, to report an upload that failed: the
/// node's message then names the store's error rather than a timeout.
const REPORT_MARGIN: Duration = Duration::from_secs(3);

/// Until when uploads of `req`, received at `received`, are retried: the operator's
/// deadline less [`REPORT_MARGIN`]; `None` when the operator sent none.
fn upload_deadline(req: &CaptureRequest, received: Instant) -> Option<Instant> {
    Duration::from_millis(u64::from(req.deadline_ms))
        .checked_sub(REPORT_MARGIN)
        .filter(|d| !d.is_zero())
        .map(|d| received + d)
}

/// Time past the operator's deadline after which a capture that has not ended is stopped
/// ([`abandon_at`]): long enough that the operator's own timeout, and the `Cancel` it sends
/// then, come first when it is alive.
pub const ABANDON_MARGIN: Duration = Duration::from_secs(5);
/// The deadline assumed for a request that carries none (operators that predate
/// `deadline_ms`): its duration plus the operator's default `--capture-grace`.
const DEFAULT_GRACE: Duration = Duration::from_secs(60);

/// When the capture of `req`, received at `received`, is stopped if it has not ended by
/// then: the operator's deadline (`deadline_ms`, at most the duration plus an hour; none
/// sent: the duration plus [`DEFAULT_GRACE`]) plus [`ABANDON_MARGIN`].
///
/// The operator hangs up once a capture is accepted and comes back near its end, so an
/// agent cannot tell a dead operator from a patient one while the window runs: a new
/// leader collects the captures its predecessor started. Past the deadline nobody waits:
/// the operator that asked has failed the node as timed out (and sent a `Cancel` that may
/// never have arrived), and no other replica collects a node after its deadline. The
/// capture's eBPF state goes at the end of its window anyway (its duration); this bound
/// covers what may outlast the window (a finish or an upload that hangs, a capture that
/// never answered), so that nothing runs on for nobody.
pub fn abandon_at(req: &CaptureRequest, received: Instant) -> Instant {
    let duration = Duration::from_millis(u64::from(req.duration_ms)).min(MAX_DURATION);
    let deadline = match req.deadline_ms {
        0 => duration + DEFAULT_GRACE,
        ms => Duration::from_millis(u64::from(ms)).min(duration + MAX_DURATION),
    };
    received + deadline + ABANDON_MARGIN
}

/// Awaits `work` (a capture from its start to its final result); if it has not ended by
/// `at`, stops it as `Cancel` does, and reports it [`PipelineError::Abandoned`].
async fn unless_abandoned<T>(
    handle: &CaptureHandle,
    at: Instant,
    received: Instant,
    work: impl Future<Output = Result<T, PipelineError>>,
) -> Result<T, PipelineError> {
    tokio::pin!(work);
    tokio::select! {
        out = &mut work => return out,
        () = tokio::time::sleep_until(at.into()) => {}
    }
    tracing::warn!(
        uid = %handle.uid(),
        after_s = received.elapsed().as_secs(),
        "capture abandoned: not ended by the operator's deadline plus {}s; stopping it",
        ABANDON_MARGIN.as_secs()
    );
    handle.stop();
    // Every stage gives up at once on a stop (a finish thread ends in the background and
    // drops what it built).
    match work.await {
        Err(PipelineError::Cancelled) => Err(PipelineError::Abandoned {
            after: received.elapsed(),
            margin: ABANDON_MARGIN,
        }),
        other => other,
    }
}

/// Uploads every artifact to its slot, retrying failures until `deadline`.
async fn upload(
    ctx: &Context,
    output: &Output,
    slots: &[UploadSlot],
    deadline: Option<Instant>,
) -> Result<Vec<Artifact>, PipelineError> {
    let mut done = Vec::new();
    for built in &output.artifacts {
        let Some(slot) = slots.iter().find(|s| s.artifact_name == built.name) else {
            return Err(PipelineError::Internal(format!(
                "no slot for {} after validation",
                built.name
            )));
        };
        let _permit = match &ctx.upload_permits {
            Some(permits) => Some(
                permits
                    .acquire()
                    .await
                    .map_err(|e| PipelineError::Internal(format!("upload permits: {e}")))?,
            ),
            None => None,
        };
        if let Err(e) = ctx
            .uploader
            .put_before(
                &built.name,
                &slot.put_url,
                &built.bytes,
                slot.max_bytes,
                deadline,
            )
            .await
        {
            ctx.reporter.upload_failed();
            return Err(e.into());
        }
        ctx.reporter.uploaded(built.bytes.len());
        tracing::info!(artifact = %built.name, bytes = built.bytes.len(), "uploaded");
        done.push(Artifact {
            name: built.name.clone(),
            url: String::new(),
            size_bytes: built.bytes.len() as u64,
            sha256: sha256_hex(&built.bytes),
            samples: built.samples,
            sample_type: built.sample_type.clone(),
        });
    }
    Ok(done)
}

/// The whole pipeline up to (not including) the final message.
async fn execute(
    ctx: &Context,
    handle: &CaptureHandle,
    req: &CaptureRequest,
    received: Instant,
) -> Result<(Vec<Artifact>, Output), PipelineError> {
    let (ty, duration, slots) = validate(req, &ctx.node)?;
    if !req.request_name.is_empty() && req.request_namespace.is_empty() {
        return Err(PipelineError::Invalid(format!(
            "request_namespace is empty for ProfileRequest {}; expected its namespace",
            req.request_name
        )));
    }
    let output = capture(ctx, handle, req, ty, duration).await?;
    if handle.is_cancelled() {
        return Err(PipelineError::Cancelled);
    }
    handle.progress(progress(Stage::Uploading, "uploading artifacts"));
    let artifacts = tokio::select! {
        a = upload(ctx, &output, &slots, upload_deadline(req, received)) => a?,
        () = handle.cancelled() => return Err(PipelineError::Cancelled),
    };
    Ok((artifacts, output))
}

/// Runs the capture of `req` as `admission` says, to its end, and publishes the final
/// message.
pub async fn run(
    ctx: Arc<Context>,
    handle: CaptureHandle,
    req: CaptureRequest,
    admission: Admission,
) {
    let started = Instant::now();
    let abandon = abandon_at(&req, started);
    let outcome = match admission {
        Admission::Run => {
            unless_abandoned(
                &handle,
                abandon,
                started,
                execute(&ctx, &handle, &req, started),
            )
            .await
        }
        Admission::Hang => {
            let hang = async {
                tokio::select! {
                    () = handle.cancelled() => {}
                    () = ctx.shutdown.cancelled() => {}
                }
                Err::<(Vec<Artifact>, Output), _>(PipelineError::Cancelled)
            };
            unless_abandoned(&handle, abandon, started, hang).await
        }
        Admission::Forget(after) => {
            tokio::select! {
                () = tokio::time::sleep(after) => {}
                () = handle.cancelled() => {}
                () = ctx.shutdown.cancelled() => {}
            }
            tracing::info!(uid = %req.request_uid, "capture forgotten without a result");
            ctx.reporter.capture_forgotten();
            handle.forget();
            return;
        }
    };
    let last = match &outcome {
        Ok((artifacts, output)) => CaptureProgress {
            stage: Stage::Done as i32,
            message: format!("uploaded {} artifact(s)", artifacts.len()),
            elapsed_ms: millis(started.elapsed()),
            artifacts: artifacts.clone(),
            summary: output.summary.display(),
            runqlat_histogram: output.runqlat_histogram.clone(),
            capture_summary: Some(Box::new(output.summary.clone())),
            ..Default::default()
        },
        Err(e) => CaptureProgress {
            stage: Stage::Failed as i32,
            message: e.to_string(),
            reason: e.reason().unwrap_or_default().to_owned(),
            elapsed_ms: millis(started.elapsed()),
            ..Default::default()
        },
    };
    match &outcome {
        Ok(_) => tracing::info!(uid = %req.request_uid, "capture done"),
        Err(e) => tracing::warn!(uid = %req.request_uid, error = %e, "capture failed"),
    }
    ctx.reporter.capture_finished(
        type_label(req.r#type()),
        match &outcome {
            Ok(_) => Outcome::Succeeded,
            Err(PipelineError::Cancelled) => Outcome::Cancelled,
            Err(PipelineError::Abandoned { .. }) => Outcome::Abandoned,
            Err(_) => Outcome::Failed,
        },
        outcome.as_ref().ok().map(|(_, output)| &output.summary),
    );
    handle.finish(last);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(ty: ProfileType, duration_ms: u32, slots: &[&str]) -> CaptureRequest {
        CaptureRequest {
            request_uid: "u".into(),
            r#type: ty as i32,
            duration_ms,
            uploads: slots
                .iter()
                .map(|n| UploadSlot {
                    artifact_name: (*n).into(),
                    put_url: format!("http://store/{n}"),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn validation_names_what_is_wrong() {
        let ok = validate(
            &request(
                ProfileType::Runqlat,
                2000,
                &["runqlat-n1.pb.gz", "runqlat-n1.txt", "extra"],
            ),
            "n1",
        )
        .unwrap();
        assert_eq!(ok.0, ProfileType::Runqlat);
        assert_eq!(ok.1, Duration::from_secs(2));
        assert_eq!(ok.2.len(), 2);

        let err = validate(
            &request(ProfileType::Runqlat, 2000, &["runqlat-n1.pb.gz"]),
            "n1",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("no upload slot for artifact runqlat-n1.txt"),
            "{err}"
        );
        let err = validate(&request(ProfileType::Unspecified, 2000, &[]), "n1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("profile type 0"), "{err}");
        let mut bad = request(ProfileType::Cpu, 1000, &["cpu-n1.pb.gz"]);
        bad.r#type = 42;
        assert!(validate(&bad, "n1").is_err());
        let err = validate(&request(ProfileType::Cpu, 0, &["cpu-n1.pb.gz"]), "n1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("duration_ms must be between 1 and"), "{err}");
    }

    #[test]
    fn a_capture_is_abandoned_past_the_operators_deadline_and_never_unbounded() {
        let at = Instant::now();
        let mut req = request(ProfileType::Cpu, 10_000, &["cpu-n1.pb.gz"]);
        req.deadline_ms = 70_000;
        assert_eq!(abandon_at(&req, at) - at, Duration::from_secs(75));
        req.deadline_ms = 0;
        assert_eq!(abandon_at(&req, at) - at, Duration::from_secs(75));
        req.deadline_ms = u32::MAX;
        assert_eq!(
            abandon_at(&req, at) - at,
            Duration::from_secs(10) + MAX_DURATION + ABANDON_MARGIN
        );
    }

    #[test]
    fn sample_type_is_the_default_or_the_last() {
        let types = [("samples", "count"), ("cpu", "nanoseconds")];
        let plain = pprof::ProfileBuilder::new(&types).build();
        assert_eq!(sample_type_of(&plain), "cpu/nanoseconds");
        let mut b = pprof::ProfileBuilder::new(&types);
        b.default_sample_type("samples");
        assert_eq!(sample_type_of(&b.build()), "samples/count");
        assert_eq!(sample_type_of(&Profile::default()), "");
    }
}
