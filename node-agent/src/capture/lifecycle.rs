//! One lifecycle for every capture engine, used by the gRPC service and the
//! `flamefleet-agent capture` command alike:
//!
//! 1. [`start`] a [`CaptureSpec`] on the node's [`Samplers`]: the engine joins (or loads)
//!    its sampler and puts its targets in it;
//! 2. its window ([`Window`]: a deadline, and the work the engine does during it, the heap
//!    source's rescans, the CPU engine's early symbolization), run by the front door: on
//!    its own thread ([`Running::run_window`], which a [`Stop`] ends at once), or waited
//!    for asynchronously with each work on a thread (the service). An engine that reads a
//!    snapshot (a pprof endpoint, the Go runtime's own heap profile) has no window: it
//!    finishes as soon as it started;
//! 3. [`Running::finish`] into a [`Finished`]: the profile, runqlat's text histograms, a
//!    report for the command line, and the typed summary. A capture dropped instead of
//!    finished (cancelled, failed) gives its targets back all the same.

use std::time::{Duration, Instant};

use flamefleet_proto::agent::capture_summary::Kind;
use flamefleet_proto::agent::{self as pb, CaptureSummary, LatencyHistogram};
use flamefleet_proto::pprof::Profile;

use super::cpu::{CpuCapture, CpuOptions};
use super::heap::{self, HeapCapture, HeapError, HeapRequest};
use super::offcpu::{OffcpuCapture, OffcpuGuard, OffcpuOptions, overhead};
use super::runqlat::{RunqlatCapture, RunqlatOptions};
use super::sched_clock;
use super::window::{self, Stop, Window, WindowEnd};
use super::{CaptureError, CaptureTarget, Samplers};
use crate::process::ProcessCatalog;
use crate::symbolize::StackSymbolizer;
use crate::trigger::fire_lead_ups::LeadUp;

/// What to capture, per profile type.
#[derive(Debug, Clone)]
pub enum CaptureSpec {
    /// On-CPU stacks of `targets`, sampled for `duration`.
    Cpu {
        /// The cgroups and their labels.
        targets: Vec<CaptureTarget>,
        /// Frequency, event, stack walk.
        options: CpuOptions,
        /// The window.
        duration: Duration,
    },
    /// Run-queue latency of `targets` over `duration`.
    Runqlat {
        /// The cgroups and their labels.
        targets: Vec<CaptureTarget>,
        /// Per-process histograms, unit.
        options: RunqlatOptions,
        /// The window.
        duration: Duration,
    },
    /// A heap profile (its targets carry their endpoints; its eBPF options the window).
    Heap(HeapRequest),
    /// Off-CPU time of `targets` over `duration`.
    Offcpu {
        /// The cgroups and their labels.
        targets: Vec<CaptureTarget>,
        /// Minimum block time, kernel stacks, stack walk.
        options: OffcpuOptions,
        /// The overhead guard of the first window.
        guard: OffcpuGuard,
        /// The wall-clock view: on-CPU samples of the same targets over the same window,
        /// taken with these options, in the same profile (docs/offcpu.md, "`wall`").
        on_cpu: Option<CpuOptions>,
        /// The window.
        duration: Duration,
    },
}

/// Why a capture could not start, run or finish.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The CPU or runqlat engine failed.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// The heap engine failed.
    #[error(transparent)]
    Heap(#[from] HeapError),
}

/// A started capture (see the module documentation).
#[derive(Debug)]
pub struct Running {
    engine: Engine,
}

// One per running capture: the size of its largest variant costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Engine {
    Cpu {
        capture: CpuCapture,
        requested_hz: u64,
        catalog: ProcessCatalog,
        /// Whether JVMs are asked for their perf map ([`crate::capture::SamplerConfig::java_attach`]).
        java_attach: bool,
        node: String,
        started: Instant,
        duration: Duration,
        /// Time the early symbolization pass took (see the [`Window`] of [`Running`]).
        warmed: Option<Duration>,
        /// A trigger's lead-up, prepended to the profile.
        lead_up: Option<LeadUp>,
    },
    Runqlat {
        capture: RunqlatCapture,
        node: String,
        deadline: Instant,
    },
    Heap(HeapCapture),
    Offcpu {
        capture: OffcpuCapture,
        /// The wall-clock view's CPU capture of the same targets.
        on_cpu: Option<CpuCapture>,
        targets: Vec<CaptureTarget>,
        catalog: ProcessCatalog,
        java_attach: bool,
        node: String,
        started: Instant,
        duration: Duration,
        guard: OffcpuGuard,
        /// The targets' CPU time at the start, for the guard.
        cpu_at_start: Duration,
        /// Whether the guard's window was judged.
        guarded: bool,
    },
}

/// What a finished capture produced.
#[derive(Debug, Clone)]
pub struct Finished {
    /// The profile (pprof).
    pub profile: Profile,
    /// runqlat's classic text histograms, its second artifact.
    pub histogram_text: Option<String>,
    /// The text report `flamefleet-agent capture --text` prints.
    pub report: String,
    /// What the capture measured.
    pub summary: CaptureSummary,
    /// runqlat: every wait of the targets in one histogram (the operator merges nodes').
    pub runqlat_histogram: Option<LatencyHistogram>,
    /// How long symbolization took, during the window and after it (CPU).
    pub symbolized: Symbolized,
}

/// Time spent symbolizing, for the agent's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Symbolized {
    /// The pass during the window, when one ran.
    pub during_window: Option<Duration>,
    /// Symbolization and profile building after the window.
    pub after_window: Option<Duration>,
}

/// The outputs of a heap profile (a capture's, or one read earlier: a memory fire's).
pub fn finished_heap(result: heap::HeapProfile) -> Finished {
    Finished {
        report: result.text(),
        summary: CaptureSummary {
            kind: Some(Kind::Heap(result.summary())),
            ..Default::default()
        },
        profile: result.profile,
        histogram_text: None,
        runqlat_histogram: None,
        symbolized: Symbolized::default(),
    }
}

/// Starts `spec` on the node's samplers (blocking: BPF loads, `/proc` walks).
///
/// # Errors
/// The engine's: options out of range, privileges, kernel features, targets.
pub fn start(samplers: &Samplers, spec: CaptureSpec) -> Result<Running, EngineError> {
    let node = samplers.config().node.clone();
    let java_attach = samplers.config().java_attach;
    let engine = match spec {
        CaptureSpec::Cpu {
            targets,
            options,
            duration,
        } => Engine::Cpu {
            capture: samplers.start_cpu(&targets, &options)?,
            requested_hz: options.frequency,
            catalog: samplers.catalog().clone(),
            java_attach,
            node,
            started: Instant::now(),
            duration,
            warmed: None,
            lead_up: None,
        },
        CaptureSpec::Runqlat {
            targets,
            options,
            duration,
        } => Engine::Runqlat {
            capture: samplers.start_runqlat(&targets, &options)?,
            node,
            deadline: Instant::now() + duration,
        },
        CaptureSpec::Heap(request) => Engine::Heap(heap::start(samplers, &request)?),
        CaptureSpec::Offcpu {
            targets,
            options,
            guard,
            on_cpu,
            duration,
        } => {
            // The wall-clock view's on-CPU half starts first and restarts its window once
            // the off-CPU capture has started: each start may load a sampler (the
            // verifier's second or more), which neither window may include.
            let mut cpu = on_cpu
                .map(|o| samplers.start_cpu(&targets, &o))
                .transpose()?;
            let capture = samplers.start_offcpu(&targets, &options)?;
            if let Some(cpu) = cpu.as_mut() {
                cpu.restart_window()?;
            }
            Engine::Offcpu {
                capture,
                on_cpu: cpu,
                cpu_at_start: overhead::targets_cpu(&targets),
                targets,
                catalog: samplers.catalog().clone(),
                java_attach,
                node,
                started: Instant::now(),
                duration,
                guard,
                guarded: false,
            }
        }
    };
    Ok(Running { engine })
}

impl Running {
    /// The node sampler the capture runs on, for logs (concurrent captures share one);
    /// `None` for engines whose sampler, if any, is their own business (heap).
    pub fn sampler(&self) -> Option<usize> {
        match &self.engine {
            Engine::Cpu { capture, .. } => Some(std::sync::Arc::as_ptr(capture.sampler()) as usize),
            Engine::Runqlat { capture, .. } => {
                Some(std::sync::Arc::as_ptr(capture.sampler()) as usize)
            }
            Engine::Offcpu { capture, .. } => {
                Some(std::sync::Arc::as_ptr(capture.sampler()) as usize)
            }
            Engine::Heap(_) => None,
        }
    }

    /// Prepends `lead_up` (the samples a trigger's ring kept before its fire) to a CPU
    /// capture's profile; ignored by the other engines.
    pub fn prepend_lead_up(&mut self, lead_up: LeadUp) {
        if let Engine::Cpu { lead_up: slot, .. } = &mut self.engine {
            *slot = Some(lead_up);
        }
    }

    /// Runs the window on this thread until it ends, or until `stop`.
    ///
    /// # Errors
    /// See [`Window::work`].
    pub fn run_window(&mut self, stop: &Stop) -> Result<WindowEnd, EngineError> {
        window::run(self, stop)
    }

    /// Reads the capture out, gives its targets back and builds its outputs.
    ///
    /// # Errors
    /// Reading the sampler's maps; the heap sources' reads.
    pub fn finish(self) -> Result<Finished, EngineError> {
        match self.engine {
            Engine::Cpu {
                capture,
                requested_hz,
                catalog,
                java_attach,
                node,
                warmed,
                lead_up,
                ..
            } => {
                let after_window = Instant::now();
                let result = capture.finish()?;
                Ok(cpu_finished(
                    &result,
                    catalog,
                    CpuFinish {
                        requested_hz,
                        java_attach,
                        node: &node,
                        warmed,
                        lead_up: lead_up.as_ref(),
                        after_window,
                    },
                ))
            }
            Engine::Runqlat { capture, node, .. } => {
                let result = capture.finish()?;
                let histogram = result.node_histogram();
                let summary = CaptureSummary {
                    kind: Some(Kind::Runqlat(pb::RunqlatSummary {
                        waits: histogram.count(),
                        dropped_samples: result.drops.hists_full + result.drops.start_full,
                        p50_us: histogram.quantile_us(0.50),
                        p90_us: histogram.quantile_us(0.90),
                        p99_us: histogram.quantile_us(0.99),
                        max_us: histogram.max_us(),
                    })),
                    notes: sched_clock::state().note().into_iter().collect(),
                };
                let text = result.text();
                Ok(Finished {
                    profile: result.to_profile(&node),
                    histogram_text: Some(text.clone()),
                    report: with_notes(text, &summary),
                    summary,
                    runqlat_histogram: Some(histogram),
                    symbolized: Symbolized::default(),
                })
            }
            Engine::Offcpu {
                capture,
                on_cpu,
                node,
                catalog,
                java_attach,
                ..
            } => {
                let after_window = Instant::now();
                let result = capture.finish()?;
                let on_cpu = on_cpu.map(CpuCapture::finish).transpose()?;
                let mut symbolizer = StackSymbolizer::new(catalog);
                symbolizer.java_attach(java_attach);
                let built = match &on_cpu {
                    Some(cpu) => result.to_wall_profile(cpu, &mut symbolizer, &node),
                    None => result.to_profile(&mut symbolizer, &node),
                };
                let summary = CaptureSummary {
                    kind: Some(Kind::Offcpu(pb::OffcpuSummary {
                        blocked_ns: result.blocked_ns(),
                        blocks: result.blocks(),
                        runnable_ns: result.queued_ns(),
                        dropped_blocks: result.stats.lost(),
                        unsymbolized_frames_pct: symbolizer.stats.unsymbolized_pct(),
                        min_block_micros: u32::try_from(result.options.min_block.as_micros())
                            .unwrap_or(u32::MAX),
                        top_blocking: built
                            .top_blocking
                            .iter()
                            .take(5)
                            .map(|(function, ns)| pb::BlockingFunction {
                                function: function.clone(),
                                blocked_ns: *ns,
                            })
                            .collect(),
                        on_cpu_ns: built.on_cpu_ns,
                        on_cpu_samples: on_cpu.as_ref().map_or(0, |c| c.total()),
                        runtimes: offcpu_runtimes(&result, on_cpu.as_ref(), &symbolizer),
                    })),
                    notes: sched_clock::state()
                        .note()
                        .into_iter()
                        .chain(symbolizer.kernel_note())
                        .collect(),
                };
                Ok(Finished {
                    report: with_notes(built.text(&result, 20), &summary),
                    profile: built.profile,
                    histogram_text: None,
                    summary,
                    runqlat_histogram: None,
                    symbolized: Symbolized {
                        during_window: None,
                        after_window: Some(after_window.elapsed()),
                    },
                })
            }
            Engine::Heap(h) => Ok(finished_heap(h.finish()?)),
        }
    }
}

impl Running {
    /// Ends a CPU capture's window now and starts its next one at the same instant, the
    /// capture going on ([`CpuCapture::cut`]): the always-on windows' way from one window to
    /// the next, whose start costs nothing (no sampler to join, no process to walk). Only
    /// the maps are read here; building the window's outputs ([`WindowCut::finish`]) is left
    /// to the caller, on any thread, while the next window samples.
    ///
    /// # Errors
    /// Not a CPU capture; reading the sampler's maps.
    pub fn cut(&mut self) -> Result<WindowCut, EngineError> {
        let Engine::Cpu {
            capture,
            requested_hz,
            catalog,
            java_attach,
            node,
            ..
        } = &mut self.engine
        else {
            return Err(not_cpu("cut"));
        };
        let samples = capture.cut()?;
        Ok(WindowCut {
            samples,
            tracker: capture.tracker().clone(),
            catalog: catalog.clone(),
            requested_hz: *requested_hz,
            java_attach: *java_attach,
            node: node.clone(),
        })
    }

    /// Pauses a CPU capture's sampling ([`CpuCapture::pause`]); its window's span ends here.
    ///
    /// # Errors
    /// Not a CPU capture; another capture shares the sampler; the kernel's.
    pub fn pause(&mut self) -> Result<(), EngineError> {
        match &mut self.engine {
            Engine::Cpu { capture, .. } => Ok(capture.pause()?),
            _ => Err(not_cpu("pause")),
        }
    }

    /// Resumes a paused CPU capture ([`CpuCapture::resume`]); its next window starts here.
    ///
    /// # Errors
    /// Not a CPU capture; the kernel's.
    pub fn resume(&mut self) -> Result<(), EngineError> {
        match &mut self.engine {
            Engine::Cpu { capture, .. } => Ok(capture.resume()?),
            _ => Err(not_cpu("resume")),
        }
    }
}

/// A window cut from a held CPU capture ([`Running::cut`]): its samples, read from the
/// maps, and what building its outputs needs.
#[derive(Debug)]
pub struct WindowCut {
    samples: crate::capture::cpu::CpuSamples,
    tracker: crate::capture::process_tracker::ProcessTracker,
    catalog: ProcessCatalog,
    requested_hz: u64,
    java_attach: bool,
    node: String,
}

impl WindowCut {
    /// Builds the window's outputs, as [`Running::finish`] would: its targets' processes
    /// are snapshot again first (their mappings now, a library loaded since the capture
    /// started; a process that exited keeps its last snapshot), their tables queued.
    pub fn finish(self) -> Finished {
        let after_window = Instant::now();
        self.tracker.track_running(
            &self.samples.targets,
            &mut std::collections::HashSet::new(),
            false,
        );
        cpu_finished(
            &self.samples,
            self.catalog,
            CpuFinish {
                requested_hz: self.requested_hz,
                java_attach: self.java_attach,
                node: &self.node,
                warmed: None,
                lead_up: None,
                after_window,
            },
        )
    }
}

fn not_cpu(what: &str) -> EngineError {
    CaptureError::InvalidOptions(format!("only a CPU capture can {what} its window")).into()
}

/// What building a CPU capture's outputs needs besides its samples.
struct CpuFinish<'a> {
    requested_hz: u64,
    java_attach: bool,
    node: &'a str,
    warmed: Option<Duration>,
    lead_up: Option<&'a LeadUp>,
    after_window: Instant,
}

/// The outputs of a CPU capture's samples.
fn cpu_finished(
    result: &crate::capture::cpu::CpuSamples,
    catalog: ProcessCatalog,
    f: CpuFinish<'_>,
) -> Finished {
    let mut symbolizer = StackSymbolizer::new(catalog);
    symbolizer.java_attach(f.java_attach);
    let profile = result.to_profile_with_lead_up(&mut symbolizer, f.node, f.lead_up);
    let symbolized = Symbolized {
        during_window: f.warmed,
        after_window: Some(f.after_window.elapsed()),
    };
    // `frequency_hz` is the frequency the samples were really taken at: a capture that joins
    // a running sampler gets the sampler's.
    let summary = CaptureSummary {
        kind: Some(Kind::Cpu(pb::CpuSummary {
            samples: result.total(),
            dropped_samples: result.drops.total(),
            unsymbolized_frames_pct: symbolizer.stats.unsymbolized_pct(),
            frequency_hz: result.options.frequency,
            requested_frequency_hz: f.requested_hz,
            runtimes: result
                .runtimes()
                .into_iter()
                .chain(symbolizer.jvms().iter().map(ToString::to_string))
                .collect(),
        })),
        notes: f
            .lead_up
            .map(LeadUp::describe)
            .into_iter()
            .chain(symbolizer.kernel_note())
            .collect(),
    };
    Finished {
        report: with_notes(result.top_text(&profile), &summary),
        profile,
        histogram_text: None,
        summary,
        runqlat_histogram: None,
        symbolized,
    }
}

/// The window of each engine. The CPU engine, when its capture found the sampler idle (the
/// first of a busy spell), symbolizes half-way through the frames sampled so far that no
/// capture has symbolized yet, into the symbolizer's caches, building no profile: the
/// symbolization after the window then finds most frames cached, and the first capture of
/// a binary pays for its parsing during its window instead of after it. Captures that join
/// running ones (the back-to-back windows of a continuous profile) skip the pass: the
/// captures before them keep the caches warm, and there the pass cost more (a second parse
/// of a binary when new frames show up in both halves of a window) than it saved.
impl Window for Running {
    type Error = EngineError;

    fn deadline(&self) -> Option<Instant> {
        match &self.engine {
            Engine::Cpu {
                started, duration, ..
            } => Some(*started + *duration),
            Engine::Runqlat { deadline, .. } => Some(*deadline),
            Engine::Heap(h) => h.deadline(),
            Engine::Offcpu {
                started, duration, ..
            } => Some(*started + *duration),
        }
    }

    fn next_work(&self) -> Option<Instant> {
        match &self.engine {
            Engine::Cpu {
                capture,
                started,
                duration,
                warmed,
                ..
            } => {
                (capture.opened_busy_spell() && warmed.is_none()).then(|| *started + *duration / 2)
            }
            Engine::Runqlat { .. } => None,
            Engine::Heap(h) => h.next_work(),
            Engine::Offcpu {
                started,
                duration,
                guard,
                guarded,
                ..
            } => (guard.active() && !*guarded)
                .then(|| *started + overhead::GUARD_WINDOW.min(*duration / 2)),
        }
    }

    fn work(&mut self) -> Result<(), EngineError> {
        match &mut self.engine {
            Engine::Cpu {
                capture,
                catalog,
                warmed,
                ..
            } => {
                let began = Instant::now();
                if let Ok(samples) = capture.peek() {
                    samples.warm_symbols(&mut StackSymbolizer::new(catalog.clone()));
                }
                *warmed = Some(began.elapsed());
                Ok(())
            }
            Engine::Runqlat { .. } => Ok(()),
            Engine::Heap(h) => Ok(h.work()?),
            Engine::Offcpu {
                capture,
                targets,
                started,
                guard,
                cpu_at_start,
                guarded,
                ..
            } => {
                *guarded = true;
                let blocks = capture.stats().blocks;
                let cpu = overhead::targets_cpu(targets).saturating_sub(*cpu_at_start);
                let projection = overhead::project(blocks, started.elapsed(), cpu);
                tracing::info!(?projection, "off-CPU overhead guard");
                if projection.refuses(guard.max_overhead_percent) && !guard.force {
                    return Err(CaptureError::InvalidOptions(
                        projection.refusal(guard.max_overhead_percent),
                    )
                    .into());
                }
                Ok(())
            }
        }
    }
}

/// `report` and the summary's notes after it, one line each.
fn with_notes(mut report: String, summary: &CaptureSummary) -> String {
    for note in &summary.notes {
        if !report.ends_with('\n') {
            report.push('\n');
        }
        report.push_str("note: ");
        report.push_str(note);
        report.push('\n');
    }
    report
}

/// Runs `spec` from start to finish on this thread, for its whole window.
///
/// # Errors
/// See [`start`], [`Running::run_window`], [`Running::finish`].
pub fn capture(samplers: &Samplers, spec: CaptureSpec) -> Result<Finished, EngineError> {
    let mut running = start(samplers, spec)?;
    running.run_window(&Stop::new())?;
    running.finish()
}

/// The off-CPU summary's `runtimes`: the off-CPU window's Python lines, those of its
/// on-CPU samples (`with_on_cpu`) not already said, then one line per JVM.
fn offcpu_runtimes(
    result: &crate::capture::offcpu::OffcpuSamples,
    on_cpu: Option<&crate::capture::cpu::CpuSamples>,
    symbolizer: &StackSymbolizer,
) -> Vec<String> {
    let mut lines = result.runtimes();
    for line in on_cpu
        .map(crate::capture::cpu::CpuSamples::runtimes)
        .unwrap_or_default()
    {
        if !lines.contains(&line) {
            lines.push(line);
        }
    }
    lines.extend(symbolizer.jvms().iter().map(ToString::to_string));
    lines
}
