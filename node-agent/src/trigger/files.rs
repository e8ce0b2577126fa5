//! Where a watched cgroup's memory, CPU and pressure counters live, and their parsers.
//!
//! On a unified host every file is in the cgroup's v2 directory. On a hybrid host
//! (`/sys/fs/cgroup/unified` is cgroup2, the controllers are v1 hierarchies) the kubelet
//! runs on v1: the memory limit and the CFS quota of a pod are in
//! `/sys/fs/cgroup/memory/<same path>` and `/sys/fs/cgroup/cpu/<same path>`, while the
//! cgroup the BPF programs see, the CPU usage and the pressure files stay in the v2
//! directory. The relative path is the same in every hierarchy for both kubelet drivers, so
//! a v2 cgroup maps to its v1 directories by that path.
//!
//! Every file is opened once, when the cgroup is watched, and read with `pread` at offset
//! 0 into a fixed buffer: a read costs one syscall, a renamed or replaced directory cannot
//! redirect it, and nothing a pod does makes a read bigger than the buffer.

use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use super::TriggerError;
use crate::cgroup::{Cgroup, CgroupRoot};

/// Largest counter file read (memory.events is ~100 bytes, cpu.stat ~300, memory.stat is
/// never read).
const READ_BUF: usize = 4096;

/// `statfs` magic of a cgroup v1 filesystem.
const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;

/// A v1 `memory.limit_in_bytes` at or above this means "no limit" (the kernel reports
/// `PAGE_COUNTER_MAX` pages, rounded down to the page size).
const V1_UNLIMITED: u64 = 1 << 62;

/// The hierarchies of this node: the cgroup2 root, and the v1 memory and cpu
/// hierarchies of a hybrid host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchies {
    /// The cgroup2 root.
    pub v2: PathBuf,
    /// The v1 memory hierarchy, when memory is a v1 controller.
    pub v1_memory: Option<PathBuf>,
    /// The v1 cpu hierarchy (CFS quota and throttling), when cpu is a v1 controller.
    pub v1_cpu: Option<PathBuf>,
}

impl Hierarchies {
    /// The hierarchies of `root`: v1 controllers from `/proc/mounts`, else siblings of a
    /// hybrid root's `unified` directory (an agent that mounts the host's
    /// `/sys/fs/cgroup` elsewhere sees no host mount lines for them).
    pub fn detect(root: &CgroupRoot) -> Self {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        Self::from_mounts(root, &mounts, is_cgroup_v1)
    }

    /// As [`Hierarchies::detect`], with the mounts text and the v1 check given.
    pub fn from_mounts(root: &CgroupRoot, mounts: &str, is_v1: impl Fn(&Path) -> bool) -> Self {
        let v2 = root.path().to_path_buf();
        let find = |controller: &str| -> Option<PathBuf> {
            let mounted = mounts.lines().find_map(|line| {
                let mut f = line.split_whitespace();
                let (_dev, dir, fstype, opts) = (f.next()?, f.next()?, f.next()?, f.next()?);
                (fstype == "cgroup" && opts.split(',').any(|o| o == controller))
                    .then(|| PathBuf::from(dir))
            });
            // The mount lines name the host's paths; under a re-mounted host tree only the
            // siblings of the unified directory are reachable.
            let sibling = || {
                let parent = v2.parent().filter(|_| v2.ends_with("unified"))?;
                [controller.to_owned(), format!("{controller},cpuacct")]
                    .into_iter()
                    .map(|name| parent.join(name))
                    .find(|p| is_v1(p))
            };
            match mounted {
                Some(dir) if dir.starts_with(v2.parent().unwrap_or(Path::new("/"))) => {
                    Some(dir).filter(|d| is_v1(d)).or_else(sibling)
                }
                _ => sibling(),
            }
        };
        Self {
            v1_memory: find("memory"),
            v1_cpu: find("cpu"),
            v2,
        }
    }

    /// Where the counters of `cgroup` (a v2 directory under [`Hierarchies::v2`]) are.
    pub fn files(&self, cgroup: &Cgroup) -> ControllerPaths {
        let rel = cgroup.path.strip_prefix(&self.v2).ok();
        let v1 = |root: &Option<PathBuf>, probe: &str| {
            let dir = root.as_ref()?.join(rel?);
            dir.join(probe).is_file().then_some(dir)
        };
        let memory = if cgroup.path.join("memory.current").is_file() {
            Some(Controller::V2(cgroup.path.clone()))
        } else {
            v1(&self.v1_memory, "memory.usage_in_bytes").map(Controller::V1)
        };
        let cpu = if cgroup.path.join("cpu.max").is_file() {
            Some(Controller::V2(cgroup.path.clone()))
        } else {
            v1(&self.v1_cpu, "cpu.cfs_quota_us").map(Controller::V1)
        };
        ControllerPaths {
            v2: cgroup.path.clone(),
            memory,
            cpu,
        }
    }
}

fn is_cgroup_v1(path: &Path) -> bool {
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs.
    nix::sys::statfs::statfs(path)
        .is_ok_and(|st| st.filesystem_type().0 as i64 == CGROUP_SUPER_MAGIC)
}

/// A controller's directory for one cgroup, in the hierarchy that has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Controller {
    /// The cgroup v2 directory (unified host).
    V2(PathBuf),
    /// The v1 controller's directory (hybrid host).
    V1(PathBuf),
}

/// The directories of one watched cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerPaths {
    /// The v2 directory: CPU usage and pressure files.
    pub v2: PathBuf,
    /// The memory controller, when the cgroup has one.
    pub memory: Option<Controller>,
    /// The cpu controller (quota, throttling), when the cgroup has one.
    pub cpu: Option<Controller>,
}

/// A counter file opened once and re-read in place.
#[derive(Debug)]
pub struct CounterFile {
    /// The path, for messages.
    pub path: PathBuf,
    /// The open file.
    pub file: File,
}

impl CounterFile {
    /// Opens `path` read-only and non-blocking.
    pub fn open(path: PathBuf) -> Result<Self, TriggerError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|source| TriggerError::Open {
                path: path.clone(),
                source,
            })?;
        Ok(Self { path, file })
    }

    /// The file's whole text (at most [`READ_BUF`] bytes).
    pub fn read(&self, buf: &mut [u8; READ_BUF]) -> Result<usize, TriggerError> {
        self.file
            .read_at(buf, 0)
            .map_err(|source| TriggerError::Read {
                path: self.path.clone(),
                source,
            })
    }

    /// Reads and parses with `parse`; a text `parse` refuses is an error naming the file.
    pub fn parse<T>(&self, parse: impl FnOnce(&str) -> Option<T>) -> Result<T, TriggerError> {
        let mut buf = [0u8; READ_BUF];
        let n = self.read(&mut buf)?;
        let text = std::str::from_utf8(&buf[..n]).unwrap_or("");
        parse(text).ok_or_else(|| TriggerError::Parse {
            path: self.path.clone(),
            found: text.chars().take(200).collect(),
        })
    }
}

/// The value of `key` in a flat-keyed file (`key value` per line).
pub fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// A single number (`memory.current`, `memory.usage_in_bytes`); `max` is `u64::MAX`.
pub fn single(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        Some(u64::MAX)
    } else {
        t.parse().ok()
    }
}

/// A memory limit: `None` when unlimited (v2 `max`, v1 `PAGE_COUNTER_MAX`).
pub fn limit(text: &str) -> Option<Option<u64>> {
    single(text).map(|v| (v < V1_UNLIMITED).then_some(v))
}

/// The counters of `memory.events` (v2) or their v1 stand-ins.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryEvents {
    /// Usage went over `memory.high` (v2 only).
    pub high: u64,
    /// Usage was about to go over the limit (v2 `max`; v1 `memory.failcnt`).
    pub max: u64,
    /// The cgroup went out of memory (v2 `oom`; v1 counts the OOM notifications).
    pub oom: u64,
    /// Processes of the cgroup killed by the OOM killer.
    pub oom_kill: u64,
}

impl MemoryEvents {
    /// Parses v2 `memory.events`.
    pub fn parse_v2(text: &str) -> Option<Self> {
        Some(Self {
            high: keyed(text, "high")?,
            max: keyed(text, "max")?,
            oom: keyed(text, "oom")?,
            oom_kill: keyed(text, "oom_kill")?,
        })
    }

    /// Parses v1 `memory.oom_control` (`oom_kill` since Linux 4.13; `under_oom` counts as
    /// an OOM while it is set).
    pub fn parse_v1_oom_control(text: &str) -> Option<Self> {
        Some(Self {
            oom_kill: keyed(text, "oom_kill").unwrap_or(0),
            oom: keyed(text, "under_oom")?,
            ..Self::default()
        })
    }
}

/// CFS bandwidth counters of `cpu.stat`, in v2 units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Throttling {
    /// Enforcement periods that had runnable tasks.
    pub nr_periods: u64,
    /// Of those, periods in which the quota ran out.
    pub nr_throttled: u64,
    /// Time the cgroup's tasks spent throttled, summed over CPUs, in µs.
    pub throttled_usec: u64,
}

impl Throttling {
    /// Parses `cpu.stat`: v2 `throttled_usec` or v1 `throttled_time` (ns).
    pub fn parse(text: &str) -> Option<Self> {
        Some(Self {
            nr_periods: keyed(text, "nr_periods")?,
            nr_throttled: keyed(text, "nr_throttled")?,
            throttled_usec: keyed(text, "throttled_usec")
                .or_else(|| keyed(text, "throttled_time").map(|ns| ns / 1000))?,
        })
    }
}

/// The `some` line of a pressure file: `avg10` in percent and the `total` stall in µs.
pub fn pressure_some(text: &str) -> Option<(f64, u64)> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    let mut avg10 = None;
    let mut total = None;
    for field in line.split_whitespace().skip(1) {
        match field.split_once('=') {
            Some(("avg10", v)) => avg10 = v.parse().ok(),
            Some(("total", v)) => total = v.parse().ok(),
            _ => {}
        }
    }
    Some((avg10?, total?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_counter_files_of_both_versions() {
        let v2 = "low 0\nhigh 3\nmax 17\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(
            MemoryEvents::parse_v2(v2),
            Some(MemoryEvents {
                high: 3,
                max: 17,
                oom: 2,
                oom_kill: 1
            })
        );
        assert_eq!(MemoryEvents::parse_v2("low 0\n"), None);
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n";
        assert_eq!(
            MemoryEvents::parse_v1_oom_control(v1).map(|e| e.oom_kill),
            Some(4)
        );
        let stat2 = "usage_usec 10\nuser_usec 5\nsystem_usec 5\nnr_periods 50\nnr_throttled 40\nthrottled_usec 3000000\nnr_bursts 0\nburst_usec 0\n";
        assert_eq!(
            Throttling::parse(stat2),
            Some(Throttling {
                nr_periods: 50,
                nr_throttled: 40,
                throttled_usec: 3_000_000
            })
        );
        let stat1 =
            "nr_periods 7\nnr_throttled 6\nthrottled_time 5000000\nnr_bursts 0\nburst_time 0\n";
        assert_eq!(
            Throttling::parse(stat1).map(|t| t.throttled_usec),
            Some(5000)
        );
        // A v2 cpu.stat without the cpu controller has no bandwidth counters.
        assert_eq!(Throttling::parse("usage_usec 10\n"), None);
        assert_eq!(limit("max\n"), Some(None));
        assert_eq!(limit("9223372036854771712\n"), Some(None));
        assert_eq!(limit("268435456\n"), Some(Some(268_435_456)));
        assert_eq!(
            pressure_some(
                "some avg10=12.50 avg60=1.00 avg300=0.00 total=123456\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
            ),
            Some((12.5, 123_456))
        );
    }

    #[test]
    fn finds_v1_controllers_of_a_hybrid_host() {
        let root = CgroupRoot::from_mounts("cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n")
            .expect("root");
        let mounts = "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n\
                      cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        let h = Hierarchies::from_mounts(&root, mounts, |_| true);
        assert_eq!(
            h.v1_memory.as_deref(),
            Some(Path::new("/sys/fs/cgroup/memory"))
        );
        assert_eq!(h.v1_cpu.as_deref(), Some(Path::new("/sys/fs/cgroup/cpu")));
        // The host's tree mounted elsewhere: the siblings of `unified`.
        let root =
            CgroupRoot::from_mounts("cgroup2 /host/cg/unified cgroup2 rw 0 0\n").expect("root");
        let h = Hierarchies::from_mounts(&root, mounts, |p| {
            p == Path::new("/host/cg/memory") || p == Path::new("/host/cg/cpu,cpuacct")
        });
        assert_eq!(h.v1_memory.as_deref(), Some(Path::new("/host/cg/memory")));
        assert_eq!(h.v1_cpu.as_deref(), Some(Path::new("/host/cg/cpu,cpuacct")));
        // A unified host has none.
        let root =
            CgroupRoot::from_mounts("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n").expect("root");
        let h =
            Hierarchies::from_mounts(&root, "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n", |_| false);
        assert_eq!((h.v1_memory, h.v1_cpu), (None, None));
    }
}
