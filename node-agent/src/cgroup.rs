//! Capture targets to cgroup v2 directories and cgroup IDs.
//!
//! A target is either a raw cgroup path or a Kubernetes pod (UID plus
//! container IDs). Pods are found under the kubelet's layouts for the systemd
//! driver (`kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope`)
//! and the cgroupfs driver (`kubepods/burstable/pod<uid>/<id>`), with
//! containerd, CRI-O and Docker scope names. The cgroup ID the BPF programs
//! see (`bpf_get_current_cgroup_id()`) is the inode number of the directory.

use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

/// `statfs` magic of a cgroup2 filesystem.
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
/// `statfs` magic of a cgroup v1 filesystem.
const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;

/// Errors of target resolution.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No cgroup2 mount was found.
    #[error(
        "expected a cgroup2 filesystem in /proc/mounts, found none; mount one (mount -t cgroup2 none /sys/fs/cgroup) or pass --cgroup-root"
    )]
    NoCgroup2,
    /// The given path does not exist.
    #[error("cgroup {path} does not exist; expected a directory under the cgroup2 root {root}")]
    Missing {
        /// The path that was looked up.
        path: PathBuf,
        /// The cgroup2 root in use.
        root: PathBuf,
    },
    /// The path is on a cgroup v1 hierarchy.
    #[error(
        "{0} is a cgroup v1 directory; Flamefleet needs cgroup v2 (unified) paths, e.g. under the cgroup2 mount"
    )]
    CgroupV1(PathBuf),
    /// The path is not a cgroup at all.
    #[error("{0} is not on a cgroup2 filesystem; expected a directory under the cgroup2 root")]
    NotCgroup(PathBuf),
    /// No cgroup matched the pod or container.
    #[error(
        "no cgroup found for pod {pod_uid}{container}; looked under {root} for the systemd and cgroupfs kubelet layouts (containerd, CRI-O, Docker)"
    )]
    PodNotFound {
        /// The pod UID.
        pod_uid: String,
        /// `", container <id>"` or empty.
        container: String,
        /// The cgroup2 root in use.
        root: PathBuf,
    },
    /// An I/O error on a cgroup file.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// Result of this module.
pub type Result<T, E = CgroupError> = std::result::Result<T, E>;

/// The cgroup2 mount point everything is resolved under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupRoot(PathBuf);

impl CgroupRoot {
    /// Finds the cgroup2 mount in `/proc/mounts` (`/sys/fs/cgroup` on a
    /// unified host, `/sys/fs/cgroup/unified` on a hybrid one).
    pub fn detect() -> Result<Self> {
        let mounts = fs::read_to_string("/proc/mounts").map_err(|source| CgroupError::Io {
            path: "/proc/mounts".into(),
            source,
        })?;
        Self::from_mounts(&mounts).ok_or(CgroupError::NoCgroup2)
    }

    /// Picks the first cgroup2 mount of a `/proc/mounts` text.
    pub fn from_mounts(mounts: &str) -> Option<Self> {
        mounts.lines().find_map(|line| {
            let mut fields = line.split_whitespace();
            let (_dev, dir, fstype) = (fields.next()?, fields.next()?, fields.next()?);
            (fstype == "cgroup2").then(|| Self(PathBuf::from(unescape_mount_path(dir))))
        })
    }

    /// Uses `path` as the cgroup2 root; fails when it is not a cgroup2 mount.
    pub fn new(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        check_cgroup2(&path)?;
        Ok(Self(path))
    }

    /// The cgroup2 hierarchy at or directly under `path`: `path` itself when it is cgroup2,
    /// else `path/unified` (the hybrid layout). This lets a container that mounts the host's
    /// whole `/sys/fs/cgroup` (e.g. at `/host/sys/fs/cgroup`) work on both layouts.
    ///
    /// # Errors
    /// As [`CgroupRoot::new`] for `path` when neither is cgroup2.
    pub fn at_or_under(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        match check_cgroup2(&path) {
            Ok(()) => Ok(Self(path)),
            Err(e) => {
                let unified = path.join("unified");
                if check_cgroup2(&unified).is_ok() {
                    Ok(Self(unified))
                } else {
                    Err(e)
                }
            }
        }
    }

    /// The root directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Resolves a raw cgroup path: absolute (must be on cgroup2) or relative
    /// to the root. `/sys/fs/cgroup/x` is also accepted when the root is
    /// elsewhere (e.g. `/sys/fs/cgroup/unified`) and `x` exists under the root.
    pub fn resolve_path(&self, path: &Path) -> Result<Cgroup> {
        let full = if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.0.join(path)
        };
        if !full.exists() {
            if let Ok(rest) = path.strip_prefix("/sys/fs/cgroup") {
                let alt = self.0.join(rest);
                if !rest.as_os_str().is_empty()
                    && alt.is_dir()
                    && self.0 != Path::new("/sys/fs/cgroup")
                {
                    return Cgroup::open(&alt);
                }
            }
            return Err(CgroupError::Missing {
                path: full,
                root: self.0.clone(),
            });
        }
        Cgroup::open(&full)
    }

    /// Finds the cgroup of a pod (no container) or of one of its containers,
    /// trying the systemd and cgroupfs layouts and every QoS class.
    pub fn resolve_pod(&self, pod_uid: &str, container_id: Option<&str>) -> Result<Cgroup> {
        let container_id = container_id.map(strip_runtime_scheme);
        for pod_dir in pod_dir_candidates(pod_uid) {
            let pod_path = self.0.join(&pod_dir);
            if !pod_path.is_dir() {
                continue;
            }
            let Some(id) = container_id else {
                return Cgroup::open(&pod_path);
            };
            for name in container_dir_candidates(id) {
                let path = pod_path.join(name);
                if path.is_dir() {
                    return Cgroup::open(&path);
                }
            }
        }
        Err(CgroupError::PodNotFound {
            pod_uid: pod_uid.to_owned(),
            container: container_id
                .map(|c| format!(", container {c}"))
                .unwrap_or_default(),
            root: self.0.clone(),
        })
    }
}

/// A resolved cgroup v2 directory.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Cgroup {
    /// The directory.
    pub path: PathBuf,
    /// The cgroup ID (the directory's inode number), as BPF sees it.
    pub id: u64,
}

impl Cgroup {
    /// Opens a cgroup2 directory and reads its ID.
    pub fn open(path: &Path) -> Result<Self> {
        check_cgroup2(path)?;
        let meta = fs::metadata(path).map_err(|source| CgroupError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            id: meta.ino(),
        })
    }

    /// Process IDs currently in this cgroup (not its descendants).
    pub fn procs(&self) -> Result<Vec<u32>> {
        let file = self.path.join("cgroup.procs");
        let text =
            fs::read_to_string(&file).map_err(|source| CgroupError::Io { path: file, source })?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    /// Process IDs in this cgroup and all its descendants.
    pub fn procs_recursive(&self) -> Result<Vec<u32>> {
        let mut out = self.procs()?;
        let entries = fs::read_dir(&self.path).map_err(|source| CgroupError::Io {
            path: self.path.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                let child = Cgroup {
                    path: entry.path(),
                    id: entry.metadata().map(|m| m.ino()).unwrap_or_default(),
                };
                // A child may vanish meanwhile; that is not an error.
                out.extend(child.procs_recursive().unwrap_or_default());
            }
        }
        Ok(out)
    }
}

fn check_cgroup2(path: &Path) -> Result<()> {
    let st = nix::sys::statfs::statfs(path).map_err(|errno| {
        if errno == nix::errno::Errno::ENOENT {
            CgroupError::Missing {
                path: path.to_path_buf(),
                root: PathBuf::from("(unknown)"),
            }
        } else {
            CgroupError::Io {
                path: path.to_path_buf(),
                source: errno.into(),
            }
        }
    })?;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs.
    match st.filesystem_type().0 as i64 {
        CGROUP2_SUPER_MAGIC => Ok(()),
        CGROUP_SUPER_MAGIC => Err(CgroupError::CgroupV1(path.to_path_buf())),
        _ => Err(CgroupError::NotCgroup(path.to_path_buf())),
    }
}

/// `/proc/mounts` escapes spaces and friends as octal (`\040`).
fn unescape_mount_path(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Container IDs may come as `containerd://<id>` (the pod status format).
fn strip_runtime_scheme(id: &str) -> &str {
    id.split_once("://").map_or(id, |(_, rest)| rest)
}

/// Pod directories relative to the root, for both drivers and all QoS classes.
fn pod_dir_candidates(pod_uid: &str) -> Vec<PathBuf> {
    let systemd_uid = pod_uid.replace('-', "_");
    let mut out = vec![
        PathBuf::from(format!("kubepods.slice/kubepods-pod{systemd_uid}.slice")),
        PathBuf::from(format!("kubepods/pod{pod_uid}")),
    ];
    for qos in ["burstable", "besteffort"] {
        out.push(PathBuf::from(format!(
            "kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{systemd_uid}.slice"
        )));
        out.push(PathBuf::from(format!("kubepods/{qos}/pod{pod_uid}")));
    }
    out
}

/// Container directory names of containerd, CRI-O and Docker, both drivers.
fn container_dir_candidates(id: &str) -> [String; 6] {
    [
        format!("cri-containerd-{id}.scope"),
        format!("crio-{id}.scope"),
        format!("docker-{id}.scope"),
        id.to_owned(),
        format!("crio-{id}"),
        format!("docker-{id}"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_mount_in_hybrid_and_unified_layouts() {
        let hybrid = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\ncgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(
            CgroupRoot::from_mounts(hybrid).map(|r| r.0),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n";
        assert_eq!(
            CgroupRoot::from_mounts(unified).map(|r| r.0),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(CgroupRoot::from_mounts("proc /proc proc rw 0 0\n"), None);
        assert_eq!(unescape_mount_path("/a\\040b"), "/a b");
    }

    #[test]
    fn kubelet_layouts_cover_both_drivers_and_runtimes() {
        let pods = pod_dir_candidates("1234-ab");
        assert!(pods.contains(&PathBuf::from(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_ab.slice"
        )));
        assert!(pods.contains(&PathBuf::from("kubepods/besteffort/pod1234-ab")));
        assert!(pods.contains(&PathBuf::from("kubepods/pod1234-ab")));
        let containers = container_dir_candidates("c0ffee");
        assert!(containers.contains(&"cri-containerd-c0ffee.scope".to_owned()));
        assert!(containers.contains(&"crio-c0ffee.scope".to_owned()));
        assert!(containers.contains(&"c0ffee".to_owned()));
        assert_eq!(strip_runtime_scheme("containerd://c0ffee"), "c0ffee");
    }
}
