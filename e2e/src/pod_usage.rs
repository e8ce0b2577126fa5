//! What a pod of the real node (`scripts/cluster.sh`) costs, read from the node itself: the
//! CPU time of its cgroup as the kernel accounts it (cgroup v2 `cpu.stat`'s `usage_usec`, or
//! cgroup v1 `cpuacct.usage` where the pod has no v2 directory) and the resident memory of its
//! processes (`VmRSS`), for the benchmarks that measure Flamefleet's agent on the node.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{Error, Result, io_err};

/// One process of a pod.
#[derive(Debug, Clone)]
pub struct PodProcess {
    /// Its PID on the node.
    pub pid: u32,
    /// `/proc/PID/comm`.
    pub comm: String,
    /// `VmRSS` in KiB.
    pub rss_kib: u64,
}

/// A pod's usage at one moment.
#[derive(Debug, Clone)]
pub struct PodUsage {
    /// CPU time of the pod's cgroup (every container, user + system) since it was created.
    pub cpu: Duration,
    /// Which file `cpu` was read from.
    pub cpu_source: PathBuf,
    /// The pod's processes (the sandbox's `pause` too).
    pub processes: Vec<PodProcess>,
}

impl PodUsage {
    /// The RSS of the processes whose `comm` starts with `prefix`, in KiB.
    pub fn rss_kib_of(&self, prefix: &str) -> u64 {
        self.processes
            .iter()
            .filter(|p| p.comm.starts_with(prefix))
            .map(|p| p.rss_kib)
            .sum()
    }
}

/// The usage of the pod with UID `pod_uid` on this node.
///
/// # Errors
/// When the pod's cgroup is not on this node, or its CPU accounting cannot be read.
pub fn pod_usage(pod_uid: &str) -> Result<PodUsage> {
    let (cpu, cpu_source) = pod_cpu(pod_uid)?;
    Ok(PodUsage {
        cpu,
        cpu_source,
        processes: pod_processes(pod_uid),
    })
}

/// The names the kubelet gives a pod's cgroup: `pod<UID>` (cgroupfs driver) or
/// `…-pod<UID with underscores>.slice` (systemd driver).
fn is_pod_dir(name: &str, pod_uid: &str) -> bool {
    let underscored = pod_uid.replace('-', "_");
    name == format!("pod{pod_uid}") || name.ends_with(&format!("-pod{underscored}.slice"))
}

/// The pod's cgroup directory under `root` (at most four levels down: kubepods, its QoS
/// class, the pod).
fn find_pod_dir(root: &Path, pod_uid: &str, depth: usize) -> Option<PathBuf> {
    let entries = std::fs::read_dir(root).ok()?;
    let mut dirs = Vec::new();
    for e in entries.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if is_pod_dir(&e.file_name().to_string_lossy(), pod_uid) {
            return Some(e.path());
        }
        dirs.push(e.path());
    }
    if depth == 0 {
        return None;
    }
    dirs.iter()
        .find_map(|d| find_pod_dir(d, pod_uid, depth - 1))
}

fn pod_cpu(pod_uid: &str) -> Result<(Duration, PathBuf)> {
    let not_found = |what: String| Error::Io {
        action: what,
        source: std::io::Error::from(std::io::ErrorKind::NotFound),
    };
    if let Ok(v2) = crate::workload::cgroup2_mount()
        && let Some(dir) = find_pod_dir(&v2, pod_uid, 4)
    {
        let file = dir.join("cpu.stat");
        let text = std::fs::read_to_string(&file)
            .map_err(io_err(format!("reading {}", file.display())))?;
        let usec = text
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| not_found(format!("usage_usec in {}", file.display())))?;
        return Ok((Duration::from_micros(usec), file));
    }
    for v1 in ["/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup/cpu,cpuacct"] {
        if let Some(dir) = find_pod_dir(Path::new(v1), pod_uid, 4) {
            let file = dir.join("cpuacct.usage");
            let text = std::fs::read_to_string(&file)
                .map_err(io_err(format!("reading {}", file.display())))?;
            let ns = text
                .trim()
                .parse::<u64>()
                .map_err(|e| not_found(format!("{}: {e}", file.display())))?;
            return Ok((Duration::from_nanos(ns), file));
        }
    }
    Err(not_found(format!(
        "finding the cgroup of pod {pod_uid} on this node (cgroup v2 or v1 cpuacct)"
    )))
}

/// The processes whose cgroup path names the pod.
fn pod_processes(pod_uid: &str) -> Vec<PodProcess> {
    let (dashed, underscored) = (pod_uid.to_owned(), pod_uid.replace('-', "_"));
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cgroups) = std::fs::read_to_string(e.path().join("cgroup")) else {
            continue;
        };
        if !cgroups.contains(&dashed) && !cgroups.contains(&underscored) {
            continue;
        }
        let comm = std::fs::read_to_string(e.path().join("comm"))
            .unwrap_or_default()
            .trim()
            .to_owned();
        let rss_kib = std::fs::read_to_string(e.path().join("status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .unwrap_or(0);
        out.push(PodProcess { pid, comm, rss_kib });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kubelets_pod_directories_are_recognised() {
        let uid = "0d5c8c4e-1111-4222-8333-444455556666";
        assert!(is_pod_dir(&format!("pod{uid}"), uid));
        assert!(is_pod_dir(
            "kubepods-burstable-pod0d5c8c4e_1111_4222_8333_444455556666.slice",
            uid
        ));
        assert!(!is_pod_dir("pod0d5c8c4e", uid));
        assert!(!is_pod_dir(&format!("pod{uid}x"), uid));
    }
}
