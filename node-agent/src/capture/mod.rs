//! Capture engines, one module per profile type, and what they share: the
//! error type, capture targets and their labels, privilege/feature checks,
//! the per-node sampler registry ([`Samplers`]), the process tracker that feeds
//! symbolization, and the one lifecycle every engine follows ([`lifecycle`]:
//! start, window, finish).
//!
//! Every engine follows the same shape: a long-lived *sampler* owns the
//! loaded BPF object and its attachments (one per node and type, whatever the
//! number of targets or concurrent captures); a *capture* adds its cgroups
//! to the sampler's target map, and when finished reads back only its own
//! counts (the difference since it started) and removes its cgroups.

pub mod cpu;
pub mod heap;
pub mod kernel;
pub mod lifecycle;
pub mod offcpu;
pub(crate) mod perf_event;
mod process_tracker;
mod registry;
pub mod runqlat;
mod sampler_thread;
pub mod sched_clock;
mod stack_maps;
mod target_table;
pub mod window;

use std::path::PathBuf;

pub use registry::Samplers;

use crate::cgroup::{Cgroup, CgroupError};

/// Errors of the capture engines.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// Not allowed to load BPF programs or open perf events.
    #[error(
        "permission denied while {action}: expected CAP_BPF and CAP_PERFMON (or root), found {found}; run as root or grant the capabilities"
    )]
    Privilege {
        /// What was being done.
        action: String,
        /// What the kernel said.
        found: String,
    },
    /// The kernel lacks something the engine needs.
    #[error("kernel feature missing: {feature}: {detail}")]
    KernelFeature {
        /// The feature, e.g. "BTF" or "perf event cpu-clock".
        feature: String,
        /// What was found and what to do.
        detail: String,
    },
    /// The kernel refused a BPF object the agent holds the privileges to load: the
    /// verifier or a missing map type or helper.
    #[error(
        "{action}: the kernel refused it ({error:#}){}; last lines of the verifier's log: {}",
        lacking.as_ref().map(|(what, since)| format!(": this kernel lacks {what}, which {since} and later have")).unwrap_or_default(),
        if verifier.is_empty() { "(none)".to_owned() } else { verifier.join(" | ") }
    )]
    KernelRefused {
        /// What was being done.
        action: String,
        /// What the kernel lacks and since when mainline has it, when recognised.
        lacking: Option<(String, &'static str)>,
        /// The verifier's last lines (more of them are in the agent's log).
        verifier: Vec<String>,
        /// The libbpf error, shown whole (with the kernel's errno) in the message.
        error: libbpf_rs::Error,
    },
    /// Options out of range.
    #[error("invalid option: {0}")]
    InvalidOptions(String),
    /// Resolving a target failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// A target map is full.
    #[error(
        "too many target cgroups: the target map holds {capacity}, {wanted} are wanted; raise the map size in the sampler config"
    )]
    TooManyTargets {
        /// Map capacity.
        capacity: u32,
        /// Cgroups that would be in the map.
        wanted: usize,
    },
    /// A libbpf operation failed.
    #[error("{action}: {error:#}")]
    Bpf {
        /// What was being done.
        action: String,
        /// The libbpf error, shown whole in the message: libbpf's own context ("failed to
        /// attach uprobe") and below it the kernel's errno, which says why.
        error: libbpf_rs::Error,
    },
    /// The sampler handed out all its target indices; the registry starts a
    /// fresh sampler when it sees this.
    #[error(
        "the sampler has {left} target indices left, {wanted} are wanted; a fresh sampler is needed"
    )]
    IndicesExhausted {
        /// Indices left.
        left: u32,
        /// New entries wanted.
        wanted: usize,
    },
    /// An idle sampler kept loaded was loaded with other options than a new capture
    /// asks for; the registry starts a fresh sampler when it sees this.
    #[error("the idle sampler runs with other options; a fresh sampler is needed")]
    IdleSamplerOptions,
    /// The unwind tables could not be set up.
    #[error(transparent)]
    Unwind(crate::unwind::UnwindError),
    /// The sampler's thread stopped unexpectedly.
    #[error("the {0} sampler stopped unexpectedly; see the agent log")]
    SamplerGone(&'static str),
    /// Another I/O error.
    #[error("{action}: {source}")]
    Io {
        /// What was being done.
        action: String,
        /// The error.
        source: std::io::Error,
    },
}

impl From<crate::unwind::UnwindError> for CaptureError {
    fn from(e: crate::unwind::UnwindError) -> Self {
        match e {
            crate::unwind::UnwindError::Map { action, source } => Self::bpf(action, source),
            other => Self::Unwind(other),
        }
    }
}

/// Result of the capture engines.
pub type Result<T, E = CaptureError> = std::result::Result<T, E>;

impl CaptureError {
    /// Wraps a libbpf error, recognising permission problems: a permission error only when
    /// the process lacks the privileges; with them, on a kernel that charges BPF memory to
    /// RLIMIT_MEMLOCK, the limit that refused it.
    /// A handle of its own on a loaded map `what` (the samplers keep maps past the skeleton's
    /// borrow).
    pub(crate) fn map_handle(
        map: &libbpf_rs::MapMut<'_>,
        what: &str,
    ) -> Result<libbpf_rs::MapHandle, Self> {
        libbpf_rs::MapHandle::try_from(map)
            .map_err(|e| Self::bpf(format!("duplicating map {what}"), e))
    }

    pub(crate) fn bpf(action: impl Into<String>, source: libbpf_rs::Error) -> Self {
        let action = action.into();
        if source.kind() == libbpf_rs::ErrorKind::PermissionDenied {
            if !kernel::has_bpf_privileges() {
                return Self::Privilege {
                    action,
                    found: format!("{source:#}"),
                };
            }
            if let Some(lacking) = Self::memlock_refusal() {
                return Self::KernelRefused {
                    action,
                    lacking: Some(lacking),
                    verifier: Vec::new(),
                    error: source,
                };
            }
        }
        Self::Bpf {
            action,
            error: source,
        }
    }

    /// What a permission error means to a process holding the privileges on a kernel that
    /// charges BPF memory to RLIMIT_MEMLOCK (before 5.11); `None` on later kernels.
    fn memlock_refusal() -> Option<(String, &'static str)> {
        if kernel::KernelFeatures::get().memcg_accounting.found {
            return None;
        }
        let limits = kernel::memlock_limits().map_or_else(String::new, |(soft, hard)| {
            format!(
                ", soft {}, hard {}",
                kernel::limit_text(soft),
                kernel::limit_text(hard)
            )
        });
        Some((
            format!(
                "BPF memory charged to the memory cgroup (here maps count against RLIMIT_MEMLOCK{limits}, which the agent could not raise further: raise the hard limit the container runtime gives containers, e.g. LimitMEMLOCK=infinity in containerd's systemd unit, or grant the agent CAP_SYS_RESOURCE: SYS_RESOURCE in the chart's agent.capabilities)"
            ),
            "Linux 5.11",
        ))
    }

    /// Loads a BPF object with `load`, translating a failure: a permission error when the
    /// process lacks the privileges, else what the kernel refused, with the verifier's last
    /// lines (also logged, with more of them).
    pub(crate) fn load<T>(
        action: &str,
        load: impl FnOnce() -> std::result::Result<T, libbpf_rs::Error>,
    ) -> Result<T> {
        let (result, lines) = kernel::LoadLog::capture(load);
        result.map_err(|source| {
            let denied = matches!(source.kind(), libbpf_rs::ErrorKind::PermissionDenied);
            if denied && !kernel::has_bpf_privileges() {
                return Self::Privilege {
                    action: action.to_owned(),
                    found: format!("{source:#}"),
                };
            }
            let lacking = if denied {
                Self::memlock_refusal().or_else(|| kernel::lacking(&lines))
            } else {
                kernel::lacking(&lines)
            };
            let tail = kernel::verifier_tail(&lines, 40);
            tracing::warn!(
                action,
                error = format!("{source:#}"),
                kernel = %kernel::KernelFeatures::get().release,
                "the kernel refused a BPF object; the verifier's last lines:\n{}",
                tail.join("\n")
            );
            Self::KernelRefused {
                action: action.to_owned(),
                lacking,
                verifier: kernel::verifier_tail(&lines, 3),
                error: source,
            }
        })
    }
}

/// Kubernetes identity of a target, supplied by the caller and copied into
/// every sample's labels. Empty strings are left out of the profile.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct TargetLabels {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
}

/// The `container` label of a pod-level target: samples of a container that started during
/// the capture (a restart, a new sidecar), caught through the pod's cgroup.
pub const STARTED_DURING_CAPTURE: &str = "(started during capture)";

/// One cgroup to capture and how to label its samples.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CaptureTarget {
    /// The resolved cgroup v2 directory.
    pub cgroup: Cgroup,
    /// Labels for its samples.
    pub labels: TargetLabels,
}

impl CaptureTarget {
    /// A target with no Kubernetes labels (e.g. from `--cgroup`).
    pub fn raw(cgroup: Cgroup) -> Self {
        Self {
            cgroup,
            labels: TargetLabels::default(),
        }
    }
}

/// Settings shared by all samplers of a node.
#[derive(Debug, Clone)]
pub struct SamplerConfig {
    /// Capacity of the target map (cgroups captured at once, all captures).
    pub max_targets: u32,
    /// Target indices one sampler hands out over its life (each new target
    /// entry takes one; runqlat keeps a per-CPU histogram per index). When
    /// they run out the registry starts a fresh sampler.
    pub max_target_indices: u32,
    /// Walk the cgroup ancestry on every event instead of caching the result
    /// in cgroup-local storage (what kernels before 6.2 get; tests use it).
    pub no_target_cache: bool,
    /// Capacity of the CPU sampler's count map (distinct stacks × processes).
    pub max_cpu_entries: u32,
    /// Capacity of the stack map (distinct stacks).
    pub max_stacks: u32,
    /// Capacity of runqlat's histogram map (targets × processes).
    pub max_histograms: u32,
    /// Capacity of runqlat's start map when task storage is unavailable.
    pub max_start_entries: u32,
    /// Capacity of the eBPF heap sampler's live map (sampled allocations not freed yet; 64 Ki
    /// stand for 32 GiB of live heap at the default 512 KiB per sample).
    pub max_heap_live: u32,
    /// Capacity of the eBPF heap sampler's aggregation map (targets × processes × stacks ×
    /// size classes).
    pub max_heap_rows: u32,
    /// Capacity of the eBPF heap sampler's stack map (distinct allocation stacks).
    pub max_heap_stacks: u32,
    /// Force runqlat's hash-map fallback even where task storage exists.
    pub force_start_hash: bool,
    /// Load the CPU sampler's programs for kernels without `bpf_loop` (bounded loops,
    /// probe reads) even where the kernel has it: to compare the two.
    pub force_bounded_walk: bool,
    /// Read Python frames in CPU samples of CPython processes (`crate::python`); off, the
    /// program skips even the per-sample process lookup (to price it).
    pub python_frames: bool,
    /// Where runqlat's timestamps come from.
    pub runqlat_clock: RunqlatClock,
    /// The node name put in the `node` label.
    pub node: String,
    /// Limits of the CFI unwind tables (shared by the CPU and heap samplers).
    pub unwind: crate::unwind::UnwindConfig,
    /// How long the CPU sampler stays loaded (its perf events closed, nothing sampled)
    /// after its last capture ended, so that the next capture with the same options
    /// skips loading it; zero unloads it at once.
    pub cpu_sampler_linger: std::time::Duration,
    /// Ask HotSpot JVMs to write their perf map (through their attach listener, starting
    /// it with SIGQUIT where that is safe) when a profile of their samples is built, so
    /// that their compiled Java frames are named (`crate::java`).
    pub java_attach: bool,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            max_targets: 1024,
            max_target_indices: 1024,
            no_target_cache: false,
            max_cpu_entries: 16384,
            max_stacks: 16384,
            max_histograms: 10240,
            max_start_entries: 16384,
            max_heap_live: 65536,
            max_heap_rows: 16384,
            max_heap_stacks: 16384,
            force_start_hash: false,
            force_bounded_walk: false,
            python_frames: true,
            runqlat_clock: RunqlatClock::default(),
            node: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_default(),
            unwind: crate::unwind::UnwindConfig::default(),
            cpu_sampler_linger: std::time::Duration::from_secs(30),
            java_attach: true,
        }
    }
}

/// The BPF map sizes `serve` lets an operator set (`--max-…`); each bounds kernel memory
/// for the sampler's whole life, however many captures run on it.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct MapSizes {
    /// Target cgroups captured at once, over all captures (target map entries).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub max_targets: Option<u32>,
    /// Distinct (cgroup, thread, stacks) entries the CPU sampler counts at once.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4_194_304))]
    pub max_cpu_entries: Option<u32>,
    /// Distinct stacks the CPU sampler keeps at once (stack map entries); stacks no count
    /// refers to any more are removed when a capture ends.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4_194_304))]
    pub max_stacks: Option<u32>,
    /// runqlat's per-process histograms at once.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub max_histograms: Option<u32>,
    /// runqlat's start timestamps at once where task storage is missing (hash-map fallback).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4_194_304))]
    pub max_start_entries: Option<u32>,
    /// eBPF heap: sampled allocations tracked until freed, at once (beyond: counted as
    /// drops, their frees unseen).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4_194_304))]
    pub max_heap_live: Option<u32>,
    /// eBPF heap: distinct (target, process, stack, size class) rows at once.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4_194_304))]
    pub max_heap_rows: Option<u32>,
    /// eBPF heap: distinct allocation stacks at once.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4_194_304))]
    pub max_heap_stacks: Option<u32>,
    /// Where runqlat's timestamps come from. `hybrid` (default): the scheduler's own queue
    /// stamps (`sched_info`, the run_delay of /proc/PID/schedstat), one BPF program on
    /// sched_switch, reading the clock only where the scheduler's run-queue clock is stale
    /// (after a wakeup preemption), so waits read as long as libbpf-tools' runqlat reads
    /// them; on a CPU that was idle it takes the end of the wait from the kernel's PSI
    /// stamp of that switch instead of the clock, where PSI is on. `hybrid-no-psi`: the
    /// same, always reading the clock there. `scheduler`: never reads the clock, cheaper still, but a wait that ends in a
    /// wakeup preemption reads a few microseconds short. `own`: reads the clock when a task
    /// becomes runnable and when it runs, as libbpf-tools' runqlat does, three programs
    /// (docs/capture.md).
    #[arg(long, value_enum)]
    pub runqlat_clock: Option<RunqlatClock>,
    /// How long the CPU sampler stays loaded after its last capture ended (default 30s):
    /// its perf events are closed at once, so nothing is sampled, but its programs stay
    /// verified and its maps (about 46 MiB of kernel memory at the default sizes) stay
    /// allocated, and the next CPU capture with the same options starts without the
    /// load. `0s` unloads it when the last capture ends.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub cpu_sampler_linger: Option<std::time::Duration>,
    /// Ask the HotSpot JVMs profiled for their perf map (default true), through their
    /// attach listener: the agent starts it the way `jcmd` does (a trigger file in the
    /// JVM's /tmp, then SIGQUIT), only in a JVM that handles SIGQUIT (docs/capture.md,
    /// "Java frames"). `false`: JIT frames are named only from perf maps already there.
    #[arg(long, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub java_attach: Option<bool>,
}

/// See [`MapSizes::runqlat_clock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum RunqlatClock {
    /// The scheduler's `sched_info` stamps, with the clock read where the run-queue clock
    /// is stale.
    #[default]
    Hybrid,
    /// As `Hybrid`, but never taking the end of a wait from PSI's switch stamp.
    HybridNoPsi,
    /// The scheduler's `sched_info` timestamps only.
    Scheduler,
    /// Our own clock reads at wakeup, preemption and switch.
    Own,
}

impl MapSizes {
    /// Overrides `config`'s sizes with the ones set here.
    pub fn apply(&self, config: &mut SamplerConfig) {
        let set = |dst: &mut u32, v: Option<u32>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut config.max_targets, self.max_targets);
        set(&mut config.max_cpu_entries, self.max_cpu_entries);
        set(&mut config.max_stacks, self.max_stacks);
        set(&mut config.max_histograms, self.max_histograms);
        set(&mut config.max_start_entries, self.max_start_entries);
        set(&mut config.max_heap_live, self.max_heap_live);
        set(&mut config.max_heap_rows, self.max_heap_rows);
        set(&mut config.max_heap_stacks, self.max_heap_stacks);
        if let Some(clock) = self.runqlat_clock {
            config.runqlat_clock = clock;
        }
        if let Some(linger) = self.cpu_sampler_linger {
            config.cpu_sampler_linger = linger;
        }
        if let Some(attach) = self.java_attach {
            config.java_attach = attach;
        }
    }
}

/// Whether the kernel has cgroup-local storage (6.2+), which the samplers
/// use to cache target lookups.
pub(crate) fn target_cache_supported() -> bool {
    use libbpf_rs::libbpf_sys as sys;
    // SAFETY: probing takes no pointers besides the (null) options.
    unsafe { sys::libbpf_probe_bpf_map_type(sys::BPF_MAP_TYPE_CGRP_STORAGE, std::ptr::null()) == 1 }
}

/// Whether the samplers cache target lookups: the kernel can and the config
/// does not turn it off.
pub(crate) fn target_cache_enabled(config: &SamplerConfig) -> bool {
    !config.no_target_cache && target_cache_supported()
}

/// Fails early, with advice, when the kernel has no BTF (CO-RE needs it).
pub fn check_btf() -> Result<()> {
    let btf = PathBuf::from("/sys/kernel/btf/vmlinux");
    if btf.exists() {
        // Every sampler checks this before its first map: the place to lift a memlock
        // limit the kernel would charge its maps to (probing the features does too).
        kernel::raise_memlock_soft_limit();
        Ok(())
    } else {
        Err(CaptureError::KernelFeature {
            feature: "BTF".into(),
            detail: format!(
                "expected {} (CONFIG_DEBUG_INFO_BTF=y), found nothing; use a kernel built with BTF",
                btf.display()
            ),
        })
    }
}

/// A NUL-terminated `comm` array from BPF as a string.
pub(crate) fn comm_string(raw: &[i8]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The labels of one thread's sample: its target's ([`target_labels`]), then `pid`,
/// `thread` and `comm`.
pub(crate) fn thread_labels(
    target: Option<&CaptureTarget>,
    node: &str,
    tgid: u32,
    pid: u32,
    comm: &str,
) -> Vec<crate::pprof::Label> {
    use crate::pprof::Label;
    let mut labels = target_labels(target, node);
    labels.push(Label::Num("pid".into(), i64::from(tgid), String::new()));
    labels.push(Label::Num("thread".into(), i64::from(pid), String::new()));
    labels.push(Label::Str("comm".into(), comm.to_owned()));
    labels
}

/// The caller-supplied Kubernetes labels of a target plus `node`.
pub(crate) fn target_labels(
    target: Option<&CaptureTarget>,
    node: &str,
) -> Vec<crate::pprof::Label> {
    use crate::pprof::Label;
    let mut labels = Vec::new();
    if let Some(t) = target {
        for (k, v) in [
            ("namespace", &t.labels.namespace),
            ("pod", &t.labels.pod),
            ("container", &t.labels.container),
        ] {
            if !v.is_empty() {
                labels.push(Label::Str(k.into(), v.clone()));
            }
        }
        labels.push(Label::Str(
            "cgroup".into(),
            t.cgroup.path.display().to_string(),
        ));
    }
    if !node.is_empty() {
        labels.push(Label::Str("node".into(), node.into()));
    }
    labels
}

/// Sends libbpf's own messages to `tracing` (target `libbpf`, debug level)
/// instead of stderr: our errors already say what failed; set
/// `RUST_LOG=libbpf=debug` to see libbpf's detail (e.g. the verifier log).
/// Idempotent; loads call it too, so that a failure can quote the verifier.
pub fn route_libbpf_logs() {
    fn forward(level: libbpf_rs::PrintLevel, msg: String) {
        kernel::LoadLog::record(&msg);
        tracing::debug!(target: "libbpf", ?level, "{}", msg.trim_end());
    }
    static ROUTED: std::sync::Once = std::sync::Once::new();
    ROUTED.call_once(|| {
        libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, forward)));
    });
}

#[cfg(test)]
mod tests {
    use libbpf_rs::ErrorExt as _;

    use super::CaptureError;

    #[test]
    fn a_libbpf_failure_keeps_the_kernels_errno() {
        // As libbpf-rs reports a failed attach: its own context over the kernel's errno.
        let failed: Result<(), libbpf_rs::Error> =
            Err(std::io::Error::from_raw_os_error(libc::EBUSY).into());
        let source = failed.context("failed to attach uprobe").unwrap_err();
        let msg =
            CaptureError::bpf("attaching a uprobe to malloc in libc.so.6", source).to_string();
        assert!(
            msg.starts_with("attaching a uprobe to malloc in libc.so.6: failed to attach uprobe: ")
                && msg.contains(&std::io::Error::from_raw_os_error(libc::EBUSY).to_string()),
            "{msg}"
        );
    }
}
