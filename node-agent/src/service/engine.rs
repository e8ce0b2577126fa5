//! The service's seam to what captures: a [`CaptureEngine`] turns a `CaptureRequest` into
//! a running capture ([`EngineCapture`], the capture lifecycle: window, then finish). The
//! node's engine ([`NodeEngine`]) resolves the request's pods to cgroups and runs the
//! node's samplers; a load generator (the e2e crate's hollow agents) plugs its own engine
//! into the same service shell (captures table, progress, upload, TLS).

use std::sync::Arc;
use std::time::{Duration, Instant};

use flamefleet_proto::agent::{self as pb, CaptureRequest, InfoResponse, ProfileType};

use super::error::PipelineError;
use super::targets;
use crate::capture::cpu::CpuOptions;
use crate::capture::heap::{self, HeapSource};
use crate::capture::lifecycle::{self, CaptureSpec, EngineError, Finished, Running};
use crate::capture::offcpu::{OffcpuGuard, OffcpuOptions, overhead};
use crate::capture::runqlat::{LatencyUnit, RunqlatOptions};
use crate::capture::window::Window;
use crate::capture::{CaptureTarget, Samplers};
use crate::cgroup::CgroupRoot;
use crate::trigger::fire_heaps::FireHeaps;
use crate::trigger::fire_lead_ups::{FireLeadUps, LeadUp};

/// Starts captures for the service.
pub trait CaptureEngine: Send + Sync + 'static {
    /// Starts the capture of `request` (of `profile_type`, for `duration`; both checked).
    /// Blocking (BPF loads, `/proc` walks): the service calls it on a thread of its own.
    ///
    /// # Errors
    /// What the FAILED stage reports.
    fn start(
        &self,
        request: &CaptureRequest,
        profile_type: ProfileType,
        duration: Duration,
    ) -> Result<Box<dyn EngineCapture>, PipelineError>;

    /// What happens to a new capture before it starts; every capture runs on the node's
    /// engine.
    fn admit(&self, _request: &CaptureRequest) -> Admission {
        Admission::Run
    }

    /// What this agent is and can do (the `Info` call).
    fn info(&self, node: &str) -> InfoResponse {
        super::info::info(node)
    }
}

/// What the service does with a new capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Accept it and run it.
    Run,
    /// Never answer, not even ACCEPTED, until it is cancelled: what a hung agent does
    /// (load generators simulate it).
    Hang,
    /// Accept it, then lose it after this long without a result, as an agent that
    /// restarted would (load generators simulate it).
    Forget(Duration),
}

/// A running capture, as the service drives it (see [`crate::capture::lifecycle`]): the
/// service waits for its window asynchronously and runs each of its works, and its finish,
/// on a thread.
pub trait EngineCapture: Window<Error = PipelineError> + Send {
    /// The node sampler it runs on, for logs; `None` when there is none to name.
    fn sampler(&self) -> Option<usize>;

    /// Reads the capture out.
    ///
    /// # Errors
    /// What the FAILED stage reports.
    fn finish(self: Box<Self>) -> Result<Finished, PipelineError>;
}

impl From<EngineError> for PipelineError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Capture(e) => Self::Capture(e),
            EngineError::Heap(e) => Self::Heap(e),
        }
    }
}

/// The node's captures, as the service sees them.
struct NodeCapture(Running);

impl Window for NodeCapture {
    type Error = PipelineError;

    fn deadline(&self) -> Option<Instant> {
        self.0.deadline()
    }

    fn next_work(&self) -> Option<Instant> {
        self.0.next_work()
    }

    fn work(&mut self) -> Result<(), PipelineError> {
        Ok(self.0.work()?)
    }
}

impl EngineCapture for NodeCapture {
    fn sampler(&self) -> Option<usize> {
        self.0.sampler()
    }

    fn finish(self: Box<Self>) -> Result<Finished, PipelineError> {
        Ok(self.0.finish()?)
    }
}

/// The node's engine: the request's pods resolved under the node's cgroup root, captured
/// by the node's samplers.
#[derive(Debug)]
pub struct NodeEngine {
    /// Where pod cgroups are looked up.
    pub cgroup_root: CgroupRoot,
    /// The node's samplers.
    pub samplers: Arc<Samplers>,
    /// The heaps memory fires read on this node (a triggered heap run's artifact); `None`:
    /// every heap capture reads now.
    pub fire_heaps: Option<Arc<FireHeaps>>,
    /// The lead-ups CPU and pressure fires read from the ring on this node (prepended to a
    /// triggered CPU run's profile); `None`: no lead-ups.
    pub fire_lead_ups: Option<Arc<FireLeadUps>>,
}

/// A triggered heap run served by the heap its fire read on this node: no window.
struct FireHeapCapture(Finished);

impl Window for FireHeapCapture {
    type Error = PipelineError;

    fn deadline(&self) -> Option<Instant> {
        None
    }

    fn next_work(&self) -> Option<Instant> {
        None
    }

    fn work(&mut self) -> Result<(), PipelineError> {
        Ok(())
    }
}

impl EngineCapture for FireHeapCapture {
    fn sampler(&self) -> Option<usize> {
        None
    }

    fn finish(self: Box<Self>) -> Result<Finished, PipelineError> {
        Ok(self.0)
    }
}

impl NodeEngine {
    /// The heap fire `request.trigger_fire_id` read on this node, as the capture's outputs,
    /// when it is kept and belongs to one of the request's pods; why not otherwise.
    fn fire_heap(&self, request: &CaptureRequest) -> Result<Finished, String> {
        let id = request.trigger_fire_id.as_str();
        let spool = self
            .fire_heaps
            .as_ref()
            .ok_or_else(|| "this agent keeps no heaps of fires".to_string())?;
        let pods: Vec<&str> = request.targets.iter().map(|t| t.pod_uid.as_str()).collect();
        let kept = spool.get(id, &pods).map_err(|e| e.to_string())?;
        let note = format!(
            "heap read on the node at the trigger's fire ({} ms after it), before this run \
             started",
            kept.took.as_millis()
        );
        let mut heap = kept.heap;
        heap.reason = format!("{note}; {}", heap.reason);
        let mut finished = lifecycle::finished_heap(heap);
        finished.summary.notes.push(note);
        Ok(finished)
    }
}

impl NodeEngine {
    /// The lead-up fire `request.trigger_fire_id` read on this node, when it is kept and
    /// belongs to one of the request's pods; why not otherwise.
    fn fire_lead_up(&self, request: &CaptureRequest) -> Result<LeadUp, String> {
        let spool = self
            .fire_lead_ups
            .as_ref()
            .ok_or_else(|| "this agent keeps no lead-ups of fires".to_string())?;
        let pods: Vec<&str> = request.targets.iter().map(|t| t.pod_uid.as_str()).collect();
        spool.get(&request.trigger_fire_id, &pods)
    }
}

impl CaptureEngine for NodeEngine {
    fn start(
        &self,
        request: &CaptureRequest,
        profile_type: ProfileType,
        duration: Duration,
    ) -> Result<Box<dyn EngineCapture>, PipelineError> {
        if profile_type == ProfileType::Heap && !request.trigger_fire_id.is_empty() {
            // Before resolving: the pod may be dead by now (OOM-killed), its heap read
            // before.
            match self.fire_heap(request) {
                Ok(finished) => {
                    tracing::info!(
                        uid = %request.request_uid, fire = %request.trigger_fire_id,
                        "heap capture served by the heap read at its fire"
                    );
                    return Ok(Box::new(FireHeapCapture(finished)));
                }
                Err(why) => tracing::info!(
                    uid = %request.request_uid, "reading the heap now: {why}"
                ),
            }
        }
        let resolved = targets::resolve(&self.cgroup_root, &request.targets)
            .map_err(PipelineError::Targets)?;
        tracing::info!(
            uid = %request.request_uid, ?profile_type, ?duration, cgroups = resolved.len(),
            "capture starting"
        );
        let node = &self.samplers.config().node;
        let spec = spec(request, profile_type, duration, &resolved, node)?;
        let mut running = lifecycle::start(&self.samplers, spec)?;
        if profile_type == ProfileType::Cpu && !request.trigger_fire_id.is_empty() {
            match self.fire_lead_up(request) {
                Ok(lead_up) => {
                    tracing::info!(
                        uid = %request.request_uid, fire = %request.trigger_fire_id,
                        samples = lead_up.snapshot.samples.len(),
                        "the fire's lead-up is prepended to the CPU profile"
                    );
                    running.prepend_lead_up(lead_up);
                }
                Err(why) => tracing::info!(
                    uid = %request.request_uid, "a CPU run of a fire without its lead-up: {why}"
                ),
            }
        }
        Ok(Box::new(NodeCapture(running)))
    }
}

/// The CPU sampling frequency `request` asks for (unset: the agent's default).
pub fn requested_frequency(request: &CaptureRequest) -> u64 {
    match request.cpu.as_ref().map_or(0, |c| c.frequency_hz) {
        0 => CpuOptions::default().frequency,
        hz => u64::from(hz),
    }
}

/// The capture `request` asks for, on the `resolved` targets.
fn spec(
    request: &CaptureRequest,
    profile_type: ProfileType,
    duration: Duration,
    resolved: &[targets::ResolvedTarget],
    node: &str,
) -> Result<CaptureSpec, PipelineError> {
    let targets: Vec<CaptureTarget> = resolved.iter().map(|t| t.capture.clone()).collect();
    match profile_type {
        ProfileType::Cpu => Ok(CaptureSpec::Cpu {
            targets,
            options: CpuOptions {
                frequency: requested_frequency(request),
                ..CpuOptions::default()
            },
            duration,
        }),
        ProfileType::Runqlat => {
            let opts = request.runqlat.clone().unwrap_or_default();
            let unit = match pb::LatencyUnit::requested(opts.latency_unit, &opts.unit) {
                Some(pb::LatencyUnit::Milliseconds) => LatencyUnit::Millis,
                Some(_) => LatencyUnit::Micros,
                None => {
                    return Err(PipelineError::Invalid(format!(
                        "runqlat unit must be \"us\" or \"ms\", found {:?} (latency_unit {})",
                        opts.unit, opts.latency_unit
                    )));
                }
            };
            Ok(CaptureSpec::Runqlat {
                targets,
                options: RunqlatOptions {
                    per_process: opts.per_process,
                    unit,
                },
                duration,
            })
        }
        ProfileType::Heap => {
            let opts = request.heap.clone().unwrap_or_default();
            let source = pb::HeapSource::requested(opts.source_kind, &opts.source)
                .map(HeapSource::from)
                .ok_or_else(|| {
                    PipelineError::Invalid(format!(
                        "heap source must be auto, endpoint, ebpf or goruntime, found {:?} \
                         (source_kind {})",
                        opts.source, opts.source_kind
                    ))
                })?;
            let mut heap_request = heap::cli_request(
                source,
                &[],
                Vec::new(),
                duration,
                match opts.sample_bytes {
                    0 => heap::sampling::DEFAULT_SAMPLE_BYTES,
                    n => n,
                },
                0,
                node,
            )?;
            heap_request.targets =
                targets::heap_targets(resolved, opts.endpoint_port, &opts.endpoint_path);
            if let Some(max) = opts.max_overhead_percent {
                heap_request.ebpf.max_overhead_percent = f64::from(max);
            }
            Ok(CaptureSpec::Heap(heap_request))
        }
        ProfileType::Offcpu => {
            let opts = request.offcpu.unwrap_or_default();
            Ok(CaptureSpec::Offcpu {
                targets,
                options: OffcpuOptions {
                    min_block: opts
                        .min_block_micros
                        .map_or(OffcpuOptions::default().min_block, |us| {
                            Duration::from_micros(u64::from(us))
                        }),
                    ..OffcpuOptions::default()
                },
                guard: OffcpuGuard {
                    max_overhead_percent: opts
                        .max_overhead_percent
                        .map_or(overhead::DEFAULT_MAX_OVERHEAD_PERCENT, f64::from),
                    force: false,
                },
                on_cpu: opts.with_on_cpu.then(|| CpuOptions {
                    frequency: requested_frequency(request),
                    ..CpuOptions::default()
                }),
                duration,
            })
        }
        ProfileType::Unspecified => Err(PipelineError::Invalid("profile type missing".into())),
    }
}
