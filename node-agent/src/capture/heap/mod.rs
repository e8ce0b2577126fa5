//! Heap profiles, from three sources:
//!
//! - [`endpoint`]: the pod's own pprof HTTP endpoint (Go's
//!   `/debug/pprof/heap`, a jemalloc `/profile/heap`), fetched under strict
//!   limits and [`merge`]d across targets with their labels;
//! - [`goruntime`]: the heap profile a Go program keeps in its own memory,
//!   read from outside without stopping it;
//! - [`ebpf`]: uprobes on the targets' [`allocators`] with byte-based
//!   [`sampling`], for processes that serve no profile themselves.
//!
//! `auto` picks the endpoint when every target declares one (annotations or
//! an explicit URL); otherwise it chooses [`by_process`]: the Go runtime
//! source for Go programs, eBPF for the rest. The result says which source
//! served which process, and why a process was not seen.

pub mod allocators;
pub mod by_process;
pub mod ebpf;
pub mod endpoint;
pub mod goruntime;
pub mod merge;
pub mod overhead;
pub mod sampling;

use std::fmt;
use std::time::Duration;

use flamefleet_proto::agent as pb;
use flamefleet_proto::pprof::Profile;

use self::ebpf::{EbpfHeapOptions, EbpfHeapStats};
use self::endpoint::{EndpointError, FetchLimits, ResolvedEndpoint};
use self::merge::{LabelledProfile, MergeError};
use crate::capture::window::{self, Stop, Window};
use crate::capture::{CaptureError, CaptureTarget, Samplers, TargetLabels};
use crate::cgroup::Cgroup;
use crate::pprof::Label;

/// Which source the caller asks for (`heap.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum HeapSource {
    /// Endpoint when every target declares one, eBPF otherwise.
    #[default]
    Auto,
    /// The pods' pprof HTTP endpoints.
    Endpoint,
    /// eBPF allocation sampling.
    Ebpf,
    /// The heap profile Go programs keep in their own memory (Go processes only).
    #[value(name = "goruntime", alias = "go")]
    GoRuntime,
}

impl HeapSource {
    /// Parses the API's text `heap.source` (`""` is `auto`).
    pub fn parse(text: &str) -> Option<Self> {
        pb::HeapSource::requested(0, text).map(Self::from)
    }
}

impl From<pb::HeapSource> for HeapSource {
    fn from(source: pb::HeapSource) -> Self {
        match source {
            pb::HeapSource::Unspecified | pb::HeapSource::Auto => Self::Auto,
            pb::HeapSource::Endpoint => Self::Endpoint,
            pb::HeapSource::Ebpf => Self::Ebpf,
            pb::HeapSource::Goruntime => Self::GoRuntime,
        }
    }
}

/// The source a capture actually used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeapSourceUsed {
    /// The pods' pprof HTTP endpoints.
    Endpoint,
    /// eBPF allocation sampling.
    Ebpf,
    /// The Go runtime's own heap profile, read from the process's memory.
    GoRuntime,
    /// The Go runtime source for Go programs and eBPF for the others.
    Mixed,
}

impl From<HeapSourceUsed> for pb::HeapSourceUsed {
    fn from(source: HeapSourceUsed) -> Self {
        match source {
            HeapSourceUsed::Endpoint => Self::Endpoint,
            HeapSourceUsed::Ebpf => Self::Ebpf,
            HeapSourceUsed::GoRuntime => Self::Goruntime,
            HeapSourceUsed::Mixed => Self::Mixed,
        }
    }
}

impl fmt::Display for HeapSourceUsed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(pb::HeapSourceUsed::from(*self).name())
    }
}

/// What happened to one process of the targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessNote {
    /// Process ID.
    pub pid: u32,
    /// Its command name.
    pub comm: String,
    /// The target (pod or cgroup) it belongs to.
    pub target: String,
    /// The source that served it; `None` when no source could see it.
    pub source: Option<HeapSourceUsed>,
    /// Details, or why it was not seen.
    pub detail: String,
}

/// Errors of a heap capture.
#[derive(Debug, thiserror::Error)]
pub enum HeapError {
    /// The request cannot be served as asked.
    #[error("invalid heap request: {0}")]
    Invalid(String),
    /// An endpoint is malformed.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// Every endpoint failed (the messages of each, one per line).
    #[error("no heap profile could be fetched:\n{}", .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Endpoints(Vec<EndpointError>),
    /// The fetched profiles could not be merged.
    #[error(transparent)]
    Merge(#[from] MergeError),
    /// The eBPF capture failed.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// No source could see any target process (one line per process).
    #[error("no heap source can see the target processes:\n{}", .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Unseen(Vec<String>),
}

/// One thing to profile: its labels, its cgroup (for eBPF) and its endpoint.
#[derive(Debug, Clone)]
pub struct HeapTarget {
    /// Kubernetes identity for the labels.
    pub labels: TargetLabels,
    /// The cgroup, when eBPF may be used.
    pub cgroup: Option<Cgroup>,
    /// The endpoint (see [`endpoint::resolve_endpoint`]), when one may be used.
    pub endpoint: Option<ResolvedEndpoint>,
}

/// A heap capture request.
#[derive(Debug, Clone)]
pub struct HeapRequest {
    /// Requested source.
    pub source: HeapSource,
    /// What to profile.
    pub targets: Vec<HeapTarget>,
    /// eBPF settings (duration, sample bytes, map sizes, node).
    pub ebpf: EbpfHeapOptions,
    /// Endpoint limits.
    pub fetch: FetchLimits,
    /// Endpoint: ask for Go's delta profile over this many seconds (0: the
    /// current heap, which is what jemalloc endpoints serve).
    pub delta_seconds: u64,
}

/// A heap profile and how it was obtained.
#[derive(Debug, Clone)]
pub struct HeapProfile {
    /// The profile (Go heap layout for eBPF; whatever the endpoint serves otherwise).
    pub profile: Profile,
    /// The source used.
    pub source: HeapSourceUsed,
    /// Why that source was used.
    pub reason: String,
    /// eBPF counters, for the eBPF source.
    pub ebpf_stats: Option<EbpfHeapStats>,
    /// Endpoints that failed while others succeeded; why nothing was seen.
    pub warnings: Vec<String>,
    /// Per process: the source that served it, or why none could.
    pub processes: Vec<ProcessNote>,
}

/// Builds the request of `flamefleet-agent capture --type heap`: one target
/// per cgroup, or one target per explicit endpoint (each with the cgroup given in the
/// same place, if any, so that `--heap-source ebpf` can still use it).
pub fn cli_request(
    source: HeapSource,
    cgroups: &[CaptureTarget],
    endpoints: Vec<endpoint::HeapEndpoint>,
    duration: Duration,
    sample_bytes: u64,
    delta_seconds: u64,
    node: &str,
) -> Result<HeapRequest, HeapError> {
    let targets = if endpoints.is_empty() {
        cgroups
            .iter()
            .map(|t| HeapTarget {
                labels: t.labels.clone(),
                cgroup: Some(t.cgroup.clone()),
                endpoint: None,
            })
            .collect()
    } else {
        if !cgroups.is_empty() && cgroups.len() != endpoints.len() {
            return Err(HeapError::Invalid(format!(
                "an endpoint profiles one process: expected no --cgroup or one per --endpoint \
                 (in the same order), found {} for {} endpoint(s)",
                cgroups.len(),
                endpoints.len()
            )));
        }
        endpoints
            .into_iter()
            .enumerate()
            .map(|(i, ep)| HeapTarget {
                labels: cgroups.get(i).map(|t| t.labels.clone()).unwrap_or_default(),
                cgroup: cgroups.get(i).map(|t| t.cgroup.clone()),
                endpoint: Some(ResolvedEndpoint {
                    endpoint: ep,
                    origin: endpoint::EndpointOrigin::Explicit,
                }),
            })
            .collect()
    };
    Ok(HeapRequest {
        source,
        targets,
        ebpf: EbpfHeapOptions {
            duration,
            sample_bytes,
            node: node.to_owned(),
            ..EbpfHeapOptions::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds,
    })
}

impl HeapProfile {
    /// The capture summary: allocations the profile accounts for, the source and why, the
    /// eBPF counters and what happened to each process.
    pub fn summary(&self) -> pb::HeapSummary {
        pb::HeapSummary {
            allocations: crate::pprof::allocation_count(&self.profile),
            source: pb::HeapSourceUsed::from(self.source) as i32,
            reason: self.reason.clone(),
            ebpf: self.ebpf_stats.as_ref().map(EbpfHeapStats::summary),
            processes: self
                .processes
                .iter()
                .map(|n| pb::HeapProcess {
                    pid: n.pid,
                    comm: n.comm.clone(),
                    target: n.target.clone(),
                    source: n.source.map_or(pb::HeapSourceUsed::Unspecified, From::from) as i32,
                    detail: n.detail.clone(),
                })
                .collect(),
            warnings: self.warnings.clone(),
        }
    }

    /// A short report: source and why, totals per sample type, eBPF counters.
    pub fn text(&self) -> String {
        let p = &self.profile;
        let name = |i: i64| p.string_table.get(i as usize).map_or("?", String::as_str);
        let mut out = format!("heap profile from {} ({})\n", self.source, self.reason);
        for (i, vt) in p.sample_type.iter().enumerate() {
            let total: i64 = p.sample.iter().filter_map(|s| s.value.get(i)).sum();
            out.push_str(&format!(
                "  {:<14} {total} {}\n",
                name(vt.r#type),
                name(vt.unit)
            ));
        }
        if let Some(st) = &self.ebpf_stats {
            out.push_str(&format!(
                "  allocation calls {}, sampled {}, freed {}; drops: live map {}, rows {}, \
                 stacks {}, thread state {}, notifications {}; allocators: {}; session \
                 uprobes: {}\n",
                st.calls,
                st.sampled,
                st.freed,
                st.dropped_live_full,
                st.dropped_rows_full,
                st.dropped_stacks,
                st.dropped_thread_state,
                st.dropped_notifications,
                st.allocators.join(", "),
                st.session_uprobes
            ));
            if let Some(bp) = st.projected_overhead_basis_points {
                out.push_str(&format!(
                    "  projected uprobe overhead {:.2}% of the targets' CPU time\n",
                    bp as f64 / 100.0
                ));
            }
        }
        for n in &self.processes {
            out.push_str(&format!(
                "  pid {} ({}) in {}: {}: {}\n",
                n.pid,
                n.comm,
                n.target,
                n.source.map_or("not seen".to_owned(), |s| s.to_string()),
                n.detail
            ));
        }
        for w in &self.warnings {
            out.push_str(&format!("  warning: {w}\n"));
        }
        out
    }
}

/// Decides the source for `targets`, or says why the request cannot be served.
pub fn choose_source(
    requested: HeapSource,
    targets: &[HeapTarget],
) -> Result<(HeapSourceUsed, String), HeapError> {
    if targets.is_empty() {
        return Err(HeapError::Invalid("no target given".into()));
    }
    let name = |t: &HeapTarget| {
        if t.labels.pod.is_empty() {
            t.cgroup.as_ref().map_or_else(
                || "(unnamed target)".to_owned(),
                |c| c.path.display().to_string(),
            )
        } else {
            format!("{}/{}", t.labels.namespace, t.labels.pod)
        }
    };
    let without_cgroup = targets.iter().find(|t| t.cgroup.is_none());
    let without_endpoint = targets.iter().find(|t| t.endpoint.is_none());
    let undeclared = targets
        .iter()
        .find(|t| !t.endpoint.as_ref().is_some_and(|e| e.origin.is_declared()));
    match requested {
        HeapSource::Endpoint => match without_endpoint {
            Some(t) => Err(HeapError::Invalid(format!(
                "source endpoint: expected an endpoint for every target, found none for {}; \
                 give one or annotate the pod with {}",
                name(t),
                endpoint::ANNOTATION_PORT
            ))),
            None => Ok((HeapSourceUsed::Endpoint, "requested: endpoint".into())),
        },
        HeapSource::Ebpf => match without_cgroup {
            Some(t) => Err(HeapError::Invalid(format!(
                "source ebpf: expected a cgroup for every target, found none for {}",
                name(t)
            ))),
            None => Ok((HeapSourceUsed::Ebpf, "requested: ebpf".into())),
        },
        HeapSource::GoRuntime => match without_cgroup {
            Some(t) => Err(HeapError::Invalid(format!(
                "source goruntime: expected a cgroup (the processes to read) for every target, \
                 found none for {}",
                name(t)
            ))),
            None => Ok((HeapSourceUsed::GoRuntime, "requested: goruntime".into())),
        },
        HeapSource::Auto => match (undeclared, without_cgroup) {
            (None, _) => Ok((
                HeapSourceUsed::Endpoint,
                "auto: every target declares a pprof endpoint".into(),
            )),
            (Some(t), None) => Ok((
                HeapSourceUsed::Mixed,
                format!(
                    "auto: {} declares no pprof endpoint, so the Go runtime source for Go \
                     programs and eBPF sampling for the others",
                    name(t)
                ),
            )),
            (Some(t), Some(c)) => Err(HeapError::Invalid(format!(
                "auto: {} declares no endpoint and {} has no cgroup, so neither source covers \
                 every target",
                name(t),
                name(c)
            ))),
        },
    }
}

/// Runs a heap capture for its whole window. Blocking: call it from a thread that may
/// block (the endpoint source runs its own small async runtime).
pub fn capture(samplers: &Samplers, req: &HeapRequest) -> Result<HeapProfile, HeapError> {
    let mut running = start(samplers, req)?;
    window::run(&mut running, &Stop::new())?;
    running.finish()
}

/// A running heap capture: the source chosen, and what it holds until it is read.
#[derive(Debug)]
pub struct HeapCapture {
    req: HeapRequest,
    source: HeapSourceUsed,
    reason: String,
    /// `None` for the endpoint source, fetched when the capture finishes.
    by_process: Option<by_process::ByProcess>,
}

/// Chooses the source of `req` and starts it: per-process sources look at every process
/// of the targets and start eBPF sampling where they need it; endpoints are fetched when
/// the capture finishes.
pub fn start(samplers: &Samplers, req: &HeapRequest) -> Result<HeapCapture, HeapError> {
    let (source, reason) = choose_source(req.source, &req.targets)?;
    let allowed = match source {
        HeapSourceUsed::Endpoint => {
            return Ok(HeapCapture {
                req: req.clone(),
                source,
                reason,
                by_process: None,
            });
        }
        HeapSourceUsed::Ebpf => by_process::Allowed {
            go: false,
            ebpf: true,
        },
        HeapSourceUsed::GoRuntime => by_process::Allowed {
            go: true,
            ebpf: false,
        },
        HeapSourceUsed::Mixed => by_process::Allowed {
            go: true,
            ebpf: true,
        },
    };
    let targets: Vec<CaptureTarget> = req
        .targets
        .iter()
        .filter_map(|t| {
            t.cgroup.clone().map(|cgroup| CaptureTarget {
                cgroup,
                labels: t.labels.clone(),
            })
        })
        .collect();
    let running = by_process::start(samplers, req, &targets, allowed, reason.clone())?;
    Ok(HeapCapture {
        req: req.clone(),
        source,
        reason,
        by_process: Some(running),
    })
}

impl HeapCapture {
    /// Reads the sources (fetches the endpoints) and builds the profile.
    pub fn finish(self) -> Result<HeapProfile, HeapError> {
        match self.by_process {
            Some(running) => running.finish(&self.req),
            None => {
                let (profile, warnings) = fetch_all(&self.req)?;
                Ok(HeapProfile {
                    profile,
                    source: self.source,
                    reason: self.reason,
                    ebpf_stats: None,
                    warnings,
                    processes: Vec::new(),
                })
            }
        }
    }
}

/// Endpoint bodies fetched and decoded at once by the whole agent, whatever the number of
/// captures running. Each may take up to [`FetchLimits::max_body_bytes`] as received and
/// [`FetchLimits::max_kept_bytes`] decoded, and every one of them is the pod's to choose:
/// neither a capture of many containers nor several captures at once may hold all their
/// worst cases at the same moment.
pub const MAX_CONCURRENT_FETCHES: usize = 2;

/// The agent's fetch slots ([`MAX_CONCURRENT_FETCHES`]), shared by every capture's runtime
/// (a tokio semaphore belongs to no runtime).
static FETCH_SLOTS: tokio::sync::Semaphore =
    tokio::sync::Semaphore::const_new(MAX_CONCURRENT_FETCHES);

/// The eBPF window when allocations are sampled; none for sources read at once (endpoints,
/// Go heaps), whose capture can finish as soon as it started.
impl Window for HeapCapture {
    type Error = HeapError;

    fn deadline(&self) -> Option<std::time::Instant> {
        self.by_process.as_ref().and_then(Window::deadline)
    }

    fn next_work(&self) -> Option<std::time::Instant> {
        self.by_process.as_ref().and_then(Window::next_work)
    }

    fn work(&mut self) -> Result<(), HeapError> {
        match &mut self.by_process {
            Some(running) => running.work(),
            None => Ok(()),
        }
    }
}

/// Fetches every target's endpoint in the agent's fetch slots ([`MAX_CONCURRENT_FETCHES`]
/// at a time across captures), keeps the successes and merges them; fails only when none
/// succeeded.
fn fetch_all(req: &HeapRequest) -> Result<(Profile, Vec<String>), HeapError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            HeapError::Capture(CaptureError::Io {
                action: "starting the HTTP client runtime".into(),
                source: e,
            })
        })?;
    let mut limits = req.fetch.clone();
    limits.total_timeout += Duration::from_secs(req.delta_seconds);
    let jobs: Vec<(TargetLabels, endpoint::HeapEndpoint)> = req
        .targets
        .iter()
        .filter_map(|t| {
            t.endpoint.as_ref().map(|e| {
                (
                    t.labels.clone(),
                    e.endpoint.clone().with_delta_seconds(req.delta_seconds),
                )
            })
        })
        .collect();
    let results = runtime.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for (i, (_, ep)) in jobs.iter().enumerate() {
            let (ep, limits) = (ep.clone(), limits.clone());
            set.spawn(async move {
                // Held until the body is decoded (or the fetch failed); never closed.
                let _slot = FETCH_SLOTS.acquire().await;
                (i, endpoint::fetch_profile(&ep, &limits).await)
            });
        }
        let mut out = Vec::new();
        while let Some(joined) = set.join_next().await {
            if let Ok(r) = joined {
                out.push(r);
            }
        }
        out.sort_by_key(|(i, _)| *i);
        out
    });
    let mut parts = Vec::new();
    let mut errors = Vec::new();
    for (i, result) in results {
        match result {
            Ok(profile) => {
                let l = &jobs[i].0;
                parts.push(LabelledProfile {
                    profile,
                    labels: vec![
                        Label::Str("namespace".into(), l.namespace.clone()),
                        Label::Str("pod".into(), l.pod.clone()),
                        Label::Str("container".into(), l.container.clone()),
                        Label::Str("node".into(), req.ebpf.node.clone()),
                    ],
                });
            }
            Err(e) => errors.push(e),
        }
    }
    if parts.is_empty() {
        return Err(HeapError::Endpoints(errors));
    }
    let profile = merge::merge(&parts)?;
    Ok((profile, errors.iter().map(ToString::to_string).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use endpoint::{EndpointOrigin, HeapEndpoint};

    fn target(cgroup: bool, origin: Option<EndpointOrigin>) -> HeapTarget {
        HeapTarget {
            labels: TargetLabels {
                namespace: "shop".into(),
                pod: "web-1".into(),
                container: String::new(),
            },
            cgroup: cgroup.then(|| Cgroup {
                path: "/sys/fs/cgroup/x".into(),
                id: 7,
            }),
            endpoint: origin.map(|origin| ResolvedEndpoint {
                endpoint: HeapEndpoint::parse_url("http://10.0.0.1:6060/debug/pprof/heap").unwrap(),
                origin,
            }),
        }
    }

    #[test]
    fn auto_prefers_declared_endpoints_and_falls_back_to_ebpf() {
        let declared = target(true, Some(EndpointOrigin::Annotations));
        let undeclared = target(true, Some(EndpointOrigin::Defaults));
        let (s, why) = choose_source(HeapSource::Auto, std::slice::from_ref(&declared)).unwrap();
        assert_eq!(s, HeapSourceUsed::Endpoint, "{why}");
        let (s, why) =
            choose_source(HeapSource::Auto, &[declared.clone(), undeclared.clone()]).unwrap();
        assert_eq!(s, HeapSourceUsed::Mixed);
        assert!(
            why.contains("shop/web-1 declares no pprof endpoint"),
            "{why}"
        );
        let (s, _) = choose_source(HeapSource::Auto, &[target(true, None)]).unwrap();
        assert_eq!(s, HeapSourceUsed::Mixed);
        let e = choose_source(HeapSource::Auto, &[target(false, None)]).unwrap_err();
        assert!(e.to_string().contains("neither source"), "{e}");
    }

    #[test]
    fn explicit_sources_need_what_they_use() {
        let (s, _) = choose_source(
            HeapSource::Endpoint,
            &[target(false, Some(EndpointOrigin::Defaults))],
        )
        .unwrap();
        assert_eq!(s, HeapSourceUsed::Endpoint);
        let e = choose_source(HeapSource::Endpoint, &[target(true, None)]).unwrap_err();
        assert!(e.to_string().contains(endpoint::ANNOTATION_PORT), "{e}");
        let (s, _) = choose_source(
            HeapSource::Ebpf,
            &[target(true, Some(EndpointOrigin::Explicit))],
        )
        .unwrap();
        assert_eq!(s, HeapSourceUsed::Ebpf);
        assert!(choose_source(HeapSource::Ebpf, &[target(false, None)]).is_err());
        let (s, _) = choose_source(HeapSource::GoRuntime, &[target(true, None)]).unwrap();
        assert_eq!(s, HeapSourceUsed::GoRuntime);
        let e = choose_source(HeapSource::GoRuntime, &[target(false, None)]).unwrap_err();
        assert!(e.to_string().contains("goruntime"), "{e}");
        assert_eq!(HeapSource::parse("go"), Some(HeapSource::GoRuntime));
        assert_eq!(HeapSource::parse(""), Some(HeapSource::Auto));
        assert_eq!(HeapSource::parse("malloc"), None);
        assert!(choose_source(HeapSource::Auto, &[]).is_err());
    }
}
