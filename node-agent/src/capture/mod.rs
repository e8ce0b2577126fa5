//! Capture engines, one module per profile type, and what they share: the
//! error type, capture targets and their labels, privilege/feature checks and
//! the per-node sampler registry ([`Samplers`]).
//!
//! Every engine follows the same shape: a long-lived *sampler* owns the
//! loaded BPF object and its attachments (one per node and type, whatever the
//! number of targets or concurrent captures); a *capture* adds its cgroups
//! to the sampler's target map, and when finished reads back only its own
//! counts (the difference since it started) and removes its cgroups.

pub mod cpu;
pub mod heap;
mod perf_event;
mod registry;
pub mod runqlat;
mod sampler_thread;
mod target_table;

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
    #[error("{action}: {source}")]
    Bpf {
        /// What was being done.
        action: String,
        /// The libbpf error.
        source: libbpf_rs::Error,
    },
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
    /// Wraps a libbpf error, recognising permission problems.
    pub(crate) fn bpf(action: impl Into<String>, source: libbpf_rs::Error) -> Self {
        let action = action.into();
        if source.kind() == libbpf_rs::ErrorKind::PermissionDenied {
            return Self::Privilege {
                action,
                found: source.to_string(),
            };
        }
        Self::Bpf { action, source }
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
    /// Capacity of the CPU sampler's count map (distinct stacks × processes).
    pub max_cpu_entries: u32,
    /// Capacity of the stack map (distinct stacks).
    pub max_stacks: u32,
    /// Capacity of runqlat's histogram map (targets × processes).
    pub max_histograms: u32,
    /// Capacity of runqlat's start map when task storage is unavailable.
    pub max_start_entries: u32,
    /// Force runqlat's hash-map fallback even where task storage exists.
    pub force_start_hash: bool,
    /// The node name put in the `node` label.
    pub node: String,
    /// Limits of the CFI unwind tables (shared by the CPU and heap samplers).
    pub unwind: crate::unwind::UnwindConfig,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            max_targets: 1024,
            max_cpu_entries: 16384,
            max_stacks: 16384,
            max_histograms: 10240,
            max_start_entries: 16384,
            force_start_hash: false,
            node: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_default(),
            unwind: crate::unwind::UnwindConfig::default(),
        }
    }
}

/// Fails early, with advice, when the kernel has no BTF (CO-RE needs it).
pub fn check_btf() -> Result<()> {
    let btf = PathBuf::from("/sys/kernel/btf/vmlinux");
    if btf.exists() {
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

/// The cgroup IDs a capture puts in the target map (each target's cgroup
/// and its descendants existing now, without repeats) and, for each, the
/// index of the target it belongs to.
pub(crate) fn expand_targets(targets: &[CaptureTarget]) -> (Vec<u64>, Vec<usize>) {
    let mut cgroup_ids = Vec::new();
    let mut owner_of = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        for id in subtree_ids(&t.cgroup) {
            if !cgroup_ids.contains(&id) {
                cgroup_ids.push(id);
                owner_of.push(i);
            }
        }
    }
    (cgroup_ids, owner_of)
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

/// IDs of a cgroup and of its descendants existing now.
pub(crate) fn subtree_ids(cgroup: &Cgroup) -> Vec<u64> {
    let mut out = vec![cgroup.id];
    let mut stack = vec![cgroup.path.clone()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                if let Ok(meta) = entry.metadata() {
                    out.push(std::os::unix::fs::MetadataExt::ino(&meta));
                }
                stack.push(entry.path());
            }
        }
    }
    out
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
pub fn route_libbpf_logs() {
    fn forward(level: libbpf_rs::PrintLevel, msg: String) {
        tracing::debug!(target: "libbpf", ?level, "{}", msg.trim_end());
    }
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, forward)));
}
