//! One capture from start to report: resolve the targets, run the engine
//! through the node's shared samplers while publishing progress, build the
//! artifacts, upload them, and write this node's status entry.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flamefleet_proto::agent::capture_progress::Stage;
use flamefleet_proto::agent::capture_summary::Kind;
use flamefleet_proto::agent::{
    self as pb, Artifact, CaptureProgress, CaptureRequest, CaptureSummary, LatencyHistogram,
    ProfileType, UploadSlot, artifact_names,
};
use flamefleet_proto::pprof::Profile;

use super::captures::CaptureHandle;
use super::metrics::Outcome;
use super::targets::{self, ResolvedTarget};
use super::upload::{UploadError, Uploader, sha256_hex};
use crate::capture::cpu::CpuOptions;
use crate::capture::heap::{self, HeapError, HeapRequest, HeapSource};
use crate::capture::runqlat::{LatencyUnit, RunqlatOptions, RunqlatResult};
use crate::capture::{CaptureError, CaptureTarget, Samplers};
use crate::cgroup::CgroupRoot;
use crate::pprof;
use crate::symbolize::StackSymbolizer;

/// Longest capture accepted (the CRD allows at most this much too).
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
/// How often RUNNING progress is published.
pub const PROGRESS_PERIOD: Duration = Duration::from_secs(1);

/// What every capture of this agent shares.
#[derive(Debug)]
pub struct Context {
    /// This node's name (labels, artifact names).
    pub node: String,
    /// Where pod cgroups are looked up.
    pub cgroup_root: CgroupRoot,
    /// The node's shared samplers.
    pub samplers: Arc<Samplers>,
    /// The uploader.
    pub uploader: Uploader,
    /// Counters for `/metrics`.
    pub metrics: Arc<super::metrics::AgentMetrics>,
}

/// Why a capture failed; the Display text is the FAILED reason.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The request itself is wrong.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Targets did not resolve to cgroups.
    #[error("target resolution failed: {0}")]
    Targets(String),
    /// A CPU or runqlat engine failed.
    #[error("capture failed: {0}")]
    Capture(#[from] CaptureError),
    /// The heap engine failed.
    #[error("heap capture failed: {0}")]
    Heap(#[from] HeapError),
    /// An upload failed.
    #[error(transparent)]
    Upload(#[from] UploadError),
    /// `Cancel` was called.
    #[error("cancelled by the client")]
    Cancelled,
    /// Something that should not happen (a worker thread died).
    #[error("internal error: {0}")]
    Internal(String),
}

/// An artifact ready to upload.
struct Built {
    name: String,
    bytes: Vec<u8>,
    samples: u64,
    sample_type: String,
}

/// What an engine produced.
struct Output {
    artifacts: Vec<Built>,
    summary: CaptureSummary,
    runqlat_histogram: Option<LatencyHistogram>,
}

/// Every wait of the capture's targets in one histogram (per-process histograms add up to
/// their target's, so nothing is counted twice).
fn node_histogram(result: &RunqlatResult) -> LatencyHistogram {
    let mut all = LatencyHistogram {
        unit_ns: result.unit.nanos(),
        buckets: Vec::new(),
    };
    for h in &result.histograms {
        let part = LatencyHistogram {
            unit_ns: all.unit_ns,
            buckets: h.slots.clone(),
        };
        // Same unit by construction.
        let _ = all.merge(&part);
    }
    all
}

/// The summary of a runqlat capture: the waits measured (the histogram's total, the sum
/// of the pprof's `count/count`); percentiles and `max_us` come from the histogram the
/// operator merges too.
fn runqlat_summary(histogram: &LatencyHistogram, dropped: u64) -> pb::RunqlatSummary {
    pb::RunqlatSummary {
        waits: histogram.count(),
        dropped_samples: dropped,
        p50_us: histogram.quantile_us(0.50),
        p90_us: histogram.quantile_us(0.90),
        p99_us: histogram.quantile_us(0.99),
        max_us: histogram.max_us(),
    }
}

/// The `type` label of a profile type in the agent's metrics.
fn type_label(ty: ProfileType) -> &'static str {
    match ty {
        ProfileType::Cpu => "cpu",
        ProfileType::Heap => "heap",
        ProfileType::Runqlat => "runqlat",
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

/// The window of a CPU capture: `duration` long. Half-way through it, the frames
/// sampled so far that no capture has symbolized yet are symbolized into the
/// symbolizer's caches (each binary's frames by file offset, kept per binary, and the
/// kernel's), building no profile; frames already cached cost a lookup. The
/// symbolization after the window, which the request waits for, then finds most
/// frames cached: the first capture of a binary pays for its parsing during its
/// window instead of after it. A pass still running when the window ends is waited
/// for.
///
/// Only a capture that opens a busy spell of the sampler (found it idle) makes the
/// pass. Captures that join running ones, as the back-to-back windows of a continuous
/// profile do, skip it: the captures before them keep the caches warm, and in the
/// continuous bench the pass cost more (a second parse of a binary when new frames
/// show up in both halves of a window) than it saved.
async fn symbolize_during_window(
    running: Arc<crate::capture::cpu::CpuCapture>,
    catalog: crate::process::ProcessCatalog,
    metrics: Arc<super::metrics::AgentMetrics>,
    duration: Duration,
) {
    let end = tokio::time::Instant::now() + duration;
    if !running.opened_busy_spell() {
        tokio::time::sleep_until(end).await;
        return;
    }
    tokio::time::sleep(duration / 2).await;
    let _ = blocking("cpu-symbols", move || {
        let began = Instant::now();
        if let Ok(samples) = running.peek() {
            samples.warm_symbols(&mut StackSymbolizer::new(catalog));
        }
        metrics.symbolized_during_window("cpu", began.elapsed());
    })
    .await;
    tokio::time::sleep_until(end).await;
}

/// Awaits `work` while publishing RUNNING progress every second; `Err(Cancelled)`
/// as soon as the capture is cancelled.
async fn run_with_progress<T>(
    handle: &CaptureHandle,
    started: Instant,
    duration: Duration,
    work: impl Future<Output = T>,
) -> Result<T, PipelineError> {
    tokio::pin!(work);
    let mut tick = tokio::time::interval(PROGRESS_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            out = &mut work => return Ok(out),
            () = handle.cancelled() => return Err(PipelineError::Cancelled),
            _ = tick.tick() => {
                let elapsed = started.elapsed();
                handle.progress(CaptureProgress {
                    stage: Stage::Running as i32,
                    message: "capturing".into(),
                    elapsed_ms: millis(elapsed),
                    remaining_ms: millis(duration.saturating_sub(elapsed)),
                    ..Default::default()
                });
            }
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

/// Runs the engine of `ty` for `duration` over `targets`.
async fn capture(
    ctx: &Context,
    handle: &CaptureHandle,
    req: &CaptureRequest,
    ty: ProfileType,
    duration: Duration,
    resolved: &[ResolvedTarget],
) -> Result<Output, PipelineError> {
    let node = ctx.node.clone();
    let names = artifact_names(ty, &node);
    let targets: Vec<CaptureTarget> = resolved.iter().map(|t| t.capture.clone()).collect();
    let started = Instant::now();
    let samplers = Arc::clone(&ctx.samplers);
    match ty {
        ProfileType::Cpu => {
            let options = CpuOptions {
                frequency: match req.cpu.as_ref().map_or(0, |c| c.frequency_hz) {
                    0 => CpuOptions::default().frequency,
                    hz => u64::from(hz),
                },
                ..CpuOptions::default()
            };
            let s = Arc::clone(&samplers);
            let running = blocking("cpu", move || s.start_cpu(&targets, &options)).await??;
            // Concurrent captures share one sampler: its address tells them apart in the log.
            tracing::info!(uid = %handle.uid(), sampler = ?Arc::as_ptr(running.sampler()), "cpu sampler attached");
            handle.progress(progress(Stage::Running, "sampler attached"));
            let running = Arc::new(running);
            let window = symbolize_during_window(
                Arc::clone(&running),
                samplers.catalog().clone(),
                Arc::clone(&ctx.metrics),
                duration,
            );
            let waited = run_with_progress(handle, started, duration, window).await;
            if let Err(e) = waited {
                // Detaching the targets blocks briefly (map updates).
                let _ = blocking("cpu", move || drop(running)).await;
                return Err(e);
            }
            // The window's symbolization pass is over: this is the last reference.
            let running = Arc::into_inner(running).ok_or_else(|| {
                PipelineError::Internal("the CPU capture is still shared after its window".into())
            })?;
            let requested = options.frequency;
            let metrics = Arc::clone(&ctx.metrics);
            let (bytes, total, drops, sample_type, unsymbolized, effective) =
                blocking("cpu", move || {
                    let after_window = Instant::now();
                    let result = running.finish()?;
                    let mut symbolizer = StackSymbolizer::new(samplers.catalog().clone());
                    let profile = result.to_profile(&mut symbolizer, &node);
                    metrics.symbolized("cpu", after_window.elapsed());
                    let st = sample_type_of(&profile);
                    let unsymbolized = symbolizer.stats.unsymbolized_pct();
                    Ok::<_, PipelineError>((
                        gzip(&profile)?,
                        result.total(),
                        result.drops.total(),
                        st,
                        unsymbolized,
                        result.options.frequency,
                    ))
                })
                .await??;
            // `frequency_hz` is the frequency the samples were really taken at: a capture
            // that joins a running sampler gets the sampler's.
            let summary = CaptureSummary {
                kind: Some(Kind::Cpu(pb::CpuSummary {
                    samples: total,
                    dropped_samples: drops,
                    unsymbolized_frames_pct: unsymbolized,
                    frequency_hz: effective,
                    requested_frequency_hz: requested,
                })),
            };
            Ok(Output {
                artifacts: vec![Built {
                    name: names[0].clone(),
                    bytes,
                    samples: total,
                    sample_type,
                }],
                summary,
                runqlat_histogram: None,
            })
        }
        ProfileType::Runqlat => {
            let opts = req.runqlat.clone().unwrap_or_default();
            let options = RunqlatOptions {
                per_process: opts.per_process,
                unit: match pb::LatencyUnit::requested(opts.latency_unit, &opts.unit) {
                    Some(pb::LatencyUnit::Milliseconds) => LatencyUnit::Millis,
                    Some(_) => LatencyUnit::Micros,
                    None => {
                        return Err(PipelineError::Invalid(format!(
                            "runqlat unit must be \"us\" or \"ms\", found {:?} (latency_unit {})",
                            opts.unit, opts.latency_unit
                        )));
                    }
                },
            };
            let s = Arc::clone(&samplers);
            let running =
                blocking("runqlat", move || s.start_runqlat(&targets, &options)).await??;
            tracing::info!(uid = %handle.uid(), sampler = ?Arc::as_ptr(running.sampler()), "runqlat sampler attached");
            handle.progress(progress(Stage::Running, "sampler attached"));
            let waited =
                run_with_progress(handle, started, duration, tokio::time::sleep(duration)).await;
            if let Err(e) = waited {
                let _ = blocking("runqlat", move || drop(running)).await;
                return Err(e);
            }
            let result = blocking("runqlat", move || running.finish()).await??;
            let profile = result.to_profile(&node);
            let histogram = node_histogram(&result);
            let waits = histogram.count();
            let summary = CaptureSummary {
                kind: Some(Kind::Runqlat(runqlat_summary(
                    &histogram,
                    result.drops.hists_full + result.drops.start_full,
                ))),
            };
            Ok(Output {
                artifacts: vec![
                    Built {
                        name: names[0].clone(),
                        bytes: gzip(&profile)?,
                        samples: waits,
                        sample_type: sample_type_of(&profile),
                    },
                    // The text rendering is not a profile: it counts no samples of its own
                    // (the pprof artifact carries them), so the request's total is not doubled.
                    Built {
                        name: names[1].clone(),
                        bytes: result.text().into_bytes(),
                        samples: 0,
                        sample_type: String::new(),
                    },
                ],
                summary,
                runqlat_histogram: Some(histogram),
            })
        }
        ProfileType::Heap => {
            let opts = req.heap.clone().unwrap_or_default();
            let source = pb::HeapSource::requested(opts.source_kind, &opts.source)
                .map(HeapSource::from)
                .ok_or_else(|| {
                    PipelineError::Invalid(format!(
                        "heap source must be auto, endpoint, ebpf or goruntime, found {:?} \
                         (source_kind {})",
                        opts.source, opts.source_kind
                    ))
                })?;
            let mut request: HeapRequest = heap::cli_request(
                source,
                &[],
                None,
                duration,
                match opts.sample_bytes {
                    0 => heap::sampling::DEFAULT_SAMPLE_BYTES,
                    n => n,
                },
                0,
                &node,
            )?;
            request.targets =
                targets::heap_targets(resolved, opts.endpoint_port, &opts.endpoint_path);
            if let Some(max) = opts.max_overhead_percent {
                request.ebpf.max_overhead_percent = f64::from(max);
            }
            // The heap engine runs its whole window in one blocking call: on
            // Cancel the caller is answered at once and the engine's thread
            // finishes its window (at most the requested duration) unobserved.
            let work = blocking("heap", move || heap::capture(&request));
            let result = run_with_progress(handle, started, duration, work).await???;
            let summary = CaptureSummary {
                kind: Some(Kind::Heap(result.summary())),
            };
            let samples = summary.samples();
            Ok(Output {
                artifacts: vec![Built {
                    name: names[0].clone(),
                    bytes: gzip(&result.profile)?,
                    samples,
                    sample_type: sample_type_of(&result.profile),
                }],
                summary,
                runqlat_histogram: None,
            })
        }
        ProfileType::Unspecified => Err(PipelineError::Invalid("profile type missing".into())),
    }
}

/// Uploads every artifact to its slot.
async fn upload(
    ctx: &Context,
    output: &Output,
    slots: &[UploadSlot],
) -> Result<Vec<Artifact>, PipelineError> {
    let mut done = Vec::new();
    for built in &output.artifacts {
        let Some(slot) = slots.iter().find(|s| s.artifact_name == built.name) else {
            return Err(PipelineError::Internal(format!(
                "no slot for {} after validation",
                built.name
            )));
        };
        ctx.uploader
            .put(&built.name, &slot.put_url, &built.bytes, slot.max_bytes)
            .await?;
        ctx.metrics.uploaded(built.bytes.len());
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

/// The whole pipeline up to (not including) the status write.
async fn execute(
    ctx: &Context,
    handle: &CaptureHandle,
    req: &CaptureRequest,
) -> Result<(Vec<Artifact>, Output), PipelineError> {
    let (ty, duration, slots) = validate(req, &ctx.node)?;
    if !req.request_name.is_empty() && req.request_namespace.is_empty() {
        return Err(PipelineError::Invalid(format!(
            "request_namespace is empty for ProfileRequest {}; expected its namespace",
            req.request_name
        )));
    }
    let root = ctx.cgroup_root.clone();
    let wanted = req.targets.clone();
    let resolved = blocking("resolve", move || targets::resolve(&root, &wanted))
        .await?
        .map_err(PipelineError::Targets)?;
    tracing::info!(
        uid = %req.request_uid, ?ty, ?duration, cgroups = resolved.len(), "capture starting"
    );
    let output = capture(ctx, handle, req, ty, duration, &resolved).await?;
    if handle.is_cancelled() {
        return Err(PipelineError::Cancelled);
    }
    handle.progress(progress(Stage::Uploading, "uploading artifacts"));
    let artifacts = tokio::select! {
        a = upload(ctx, &output, &slots) => a?,
        () = handle.cancelled() => return Err(PipelineError::Cancelled),
    };
    Ok((artifacts, output))
}

/// Runs the capture of `req` to its end and publishes the final message.
pub async fn run(ctx: Arc<Context>, handle: CaptureHandle, req: CaptureRequest) {
    let started = Instant::now();
    let outcome = execute(&ctx, &handle, &req).await;
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
            elapsed_ms: millis(started.elapsed()),
            ..Default::default()
        },
    };
    match &outcome {
        Ok(_) => tracing::info!(uid = %req.request_uid, "capture done"),
        Err(e) => tracing::warn!(uid = %req.request_uid, error = %e, "capture failed"),
    }
    let ty = type_label(req.r#type());
    if let Ok((_, output)) = &outcome
        && matches!(output.summary.kind, Some(Kind::Cpu(_) | Kind::Runqlat(_)))
    {
        ctx.metrics.dropped(ty, output.summary.dropped_samples());
    }
    ctx.metrics.capture_finished(
        ty,
        match &outcome {
            Ok(_) => Outcome::Succeeded,
            Err(PipelineError::Cancelled) => Outcome::Cancelled,
            Err(_) => Outcome::Failed,
        },
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
