//! Process snapshots for symbolization: the [`ProcessCatalog`] snapshots
//! `/proc/<pid>/maps` while a process lives (the samplers announce each new process and
//! each exec over a ring buffer) and keeps every mapped executable open, so a process that
//! exited before the capture ended — or whose binary was deleted — is still symbolized
//! from its ELF/DWARF symbols, by file offset.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use super::files::{self, TargetFileError};
use super::maps::{self, Mapping};
use crate::cgroup::Cgroup;
use crate::pprof::FrameLine;
use crate::symbolize::elf_check;

/// How many process snapshots the catalog keeps. A snapshot is a few KiB; the
/// oldest is evicted first, which only matters for processes that exited
/// long before the capture that sampled them was symbolized.
pub const MAX_PROCESSES: usize = 8192;
/// Memory the snapshots may hold together (paths, mostly). A workload decides how many
/// mappings its processes have and how long their paths are, so the count alone bounds
/// nothing; beyond this the oldest snapshots are evicted.
pub const MAX_SNAPSHOT_BYTES: usize = 64 << 20;
/// How many executables the catalog keeps open (one fd each). Binaries are
/// shared by every process mapping them, so this is rarely reached; beyond it
/// new binaries are opened again, inside their process's root, each time they are read.
pub const MAX_OPEN_BINARIES: usize = 512;
/// Notes kept per snapshot (files that could not be read, and why).
const MAX_NOTES: usize = 8;

/// Most symbolized file offsets one binary remembers (see [`Binary::cached_lines`]).
pub const MAX_CACHED_OFFSETS_PER_BINARY: usize = 16_384;
/// Most symbolized file offsets the whole agent remembers. An entry is a few
/// hundred bytes (function and file names of the frame and its inlined callers),
/// so the cache stays under ~20 MiB however many binaries are profiled.
pub const MAX_CACHED_OFFSETS: usize = 65_536;

/// Entries in every binary's offset cache, for [`MAX_CACHED_OFFSETS`].
static CACHED_OFFSETS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// An executable file kept reachable for symbolization.
#[derive(Debug)]
pub struct Binary {
    /// Path as the process saw it (inside its mount namespace).
    pub path: String,
    /// GNU build ID, hex, or empty.
    pub build_id: String,
    /// What [`elf_check::check`] found: whether blazesym may read its DWARF, and what
    /// holding it costs.
    pub elf: elf_check::ElfCheck,
    /// Open file keeping the inode alive; `None` when the open-file cap was hit.
    file: Option<File>,
    /// Frames already symbolized in this file, by file offset, shared by every
    /// capture: a daemon profiling the same workloads capture after capture resolves
    /// each hot address once instead of re-reading DWARF after every window. The
    /// file is pinned open (same inode, and a running executable cannot be written),
    /// so an entry never goes stale; it goes when the catalog forgets the binary.
    lines: Mutex<HashMap<u64, Arc<[FrameLine]>>>,
}

impl Drop for Binary {
    fn drop(&mut self) {
        let n = self.lines.get_mut().map_or(0, |m| m.len());
        CACHED_OFFSETS.fetch_sub(n, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Binary {
    /// The frames cached for `file_offset`, if this binary symbolized it before.
    pub fn cached_lines(&self, file_offset: u64) -> Option<Arc<[FrameLine]>> {
        self.lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&file_offset)
            .cloned()
    }

    /// Remembers the frames of `file_offset` (an empty list too: an address without a
    /// symbol stays without one), unless a cache bound is reached.
    pub(crate) fn remember(&self, file_offset: u64, lines: Arc<[FrameLine]>) {
        use std::sync::atomic::Ordering;
        let mut map = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        if map.len() >= MAX_CACHED_OFFSETS_PER_BINARY || map.contains_key(&file_offset) {
            return;
        }
        let reserved = CACHED_OFFSETS
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < MAX_CACHED_OFFSETS).then_some(n + 1)
            })
            .is_ok();
        if reserved {
            map.insert(file_offset, lines);
        }
    }

    /// Calls `f` with a path that reaches this very file: the one kept open
    /// ([`files::fd_path`]: the same path every time, so parsers can cache by it), or, past
    /// the open-file cap, the file opened again inside the root of `tgid` for the call.
    pub fn with_path<R>(
        &self,
        tgid: u32,
        f: impl FnOnce(&Path) -> R,
    ) -> Result<R, TargetFileError> {
        match &self.file {
            Some(file) => Ok(f(&files::fd_path(file))),
            None => {
                let opened = files::open_in_root(tgid, &self.path)?;
                Ok(f(&files::fd_path(&opened.file)))
            }
        }
    }

    /// This file, opened again (the kept one duplicated, or opened inside the root of
    /// `tgid`).
    pub fn open(&self, tgid: u32) -> Result<File, TargetFileError> {
        match &self.file {
            Some(file) => file.try_clone().map_err(|source| TargetFileError::Open {
                pid: tgid,
                path: self.path.clone(),
                source,
            }),
            None => files::open_in_root(tgid, &self.path).map(|f| f.file),
        }
    }
}

/// One executable mapping of a process.
#[derive(Debug, Clone)]
pub struct MappedRange {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    /// Path or pseudo-name (`[vdso]`, `[anon]`).
    pub name: String,
    /// The file, when it is a regular file we could open.
    pub binary: Option<Arc<Binary>>,
}

/// The executable mappings of a process at snapshot time.
#[derive(Debug, Clone, Default)]
pub struct ProcessMaps {
    /// Executable mappings, sorted by address.
    pub ranges: Vec<MappedRange>,
    /// The process's start time ([`super::handle::start_time`]): with its PID, who it was.
    pub start_time: Option<u64>,
    /// What could not be read, and why (files refused, maps cut), for the profile.
    pub notes: Vec<String>,
}

impl ProcessMaps {
    /// Bytes the snapshot holds, roughly.
    fn bytes(&self) -> usize {
        self.ranges
            .iter()
            .map(|r| std::mem::size_of::<MappedRange>() + r.name.len())
            .sum::<usize>()
            + self.notes.iter().map(String::len).sum::<usize>()
    }

    /// The mapping containing `addr`.
    pub fn find(&self, addr: u64) -> Option<&MappedRange> {
        let i = self.ranges.partition_point(|r| r.start <= addr);
        self.ranges[..i].last().filter(|r| addr < r.end)
    }
}

#[derive(Debug, Default)]
struct CatalogState {
    procs: HashMap<u32, Arc<ProcessMaps>>,
    order: VecDeque<u32>,
    /// [`ProcessMaps::bytes`] of `procs`, together.
    bytes: usize,
    binaries: HashMap<(u64, u64), Arc<Binary>>,
}

/// Process map snapshots shared by the samplers (writers) and the
/// symbolizer (reader). Cheap to clone; thread-safe.
#[derive(Debug, Clone, Default)]
pub struct ProcessCatalog {
    state: Arc<Mutex<CatalogState>>,
}

impl ProcessCatalog {
    /// An empty catalog.
    pub fn new() -> Self {
        Self::default()
    }

    /// Snapshots `/proc/<tgid>/maps` now, replacing an older snapshot (an
    /// exec changes the maps). Returns false when the process is already gone.
    ///
    /// Everything is read by PID, so the snapshot is kept only if the process has the same
    /// start time after the reads as before: a PID reused meanwhile is not mixed in.
    pub fn snapshot(&self, tgid: u32) -> bool {
        let Ok(started) = super::handle::start_time(tgid) else {
            return false;
        };
        let Ok(mapped) = maps::executable_mappings(tgid) else {
            return false;
        };
        let mut notes = Vec::new();
        if mapped.truncated {
            notes.push(format!(
                "/proc/{tgid}/maps holds more than {} executable mappings or {} bytes: \
                 mappings past those are not symbolized",
                maps::MAX_EXECUTABLE_MAPPINGS,
                maps::MAX_READ_BYTES
            ));
        }
        let mut ranges: Vec<MappedRange> = mapped
            .mappings
            .into_iter()
            .map(|m| self.range(tgid, m, &mut notes))
            .collect();
        if super::handle::start_time(tgid).ok() != Some(started) {
            return false;
        }
        ranges.sort_by_key(|r| r.start);
        let snapshot = Arc::new(ProcessMaps {
            ranges,
            start_time: Some(started),
            notes,
        });
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.bytes += snapshot.bytes();
        match st.procs.insert(tgid, snapshot) {
            Some(old) => st.bytes -= old.bytes(),
            None => st.order.push_back(tgid),
        }
        while st.order.len() > MAX_PROCESSES
            || (st.bytes > MAX_SNAPSHOT_BYTES && st.order.len() > 1)
        {
            if let Some(old) = st.order.pop_front()
                && let Some(gone) = st.procs.remove(&old)
            {
                st.bytes -= gone.bytes();
            }
        }
        true
    }

    /// The latest snapshot of `tgid`, taking one now if there is none.
    pub fn get(&self, tgid: u32) -> Option<Arc<ProcessMaps>> {
        if let Some(p) = self.lookup(tgid) {
            return Some(p);
        }
        self.snapshot(tgid);
        self.lookup(tgid)
    }

    /// Like [`Self::get`], but a snapshot taken now only of a process in one of `cgroups`
    /// (or below): `tgid` was sampled in one of them, but may have exited and its PID gone
    /// to another process since, whose binaries must not name its frames.
    pub fn get_in(&self, tgid: u32, cgroups: &[Cgroup]) -> Option<Arc<ProcessMaps>> {
        if let Some(p) = self.lookup(tgid) {
            return Some(p);
        }
        let Ok(handle) = super::handle::ProcessHandle::open(tgid) else {
            return None;
        };
        if !cgroups.iter().any(|c| handle.in_cgroup(c)) {
            return None;
        }
        self.snapshot(tgid);
        self.lookup(tgid)
            .filter(|p| p.start_time == Some(handle.start_time()))
    }

    /// The latest snapshot of `tgid`, if any (never reads /proc).
    pub fn lookup(&self, tgid: u32) -> Option<Arc<ProcessMaps>> {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.procs.get(&tgid).cloned()
    }

    /// Number of process snapshots held.
    pub fn len(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .procs
            .len()
    }

    /// Whether no snapshot is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The range of mapping `m`, with its binary when it is a file the agent may read
    /// (otherwise a note says why not).
    fn range(&self, tgid: u32, m: Mapping, notes: &mut Vec<String>) -> MappedRange {
        let binary = if m.is_file() {
            match self.binary(tgid, &m) {
                Ok(b) => Some(b),
                Err(why) => {
                    if notes.len() < MAX_NOTES {
                        notes.push(why);
                    }
                    None
                }
            }
        } else {
            None
        };
        MappedRange {
            start: m.start,
            end: m.end,
            offset: m.offset,
            name: if m.name.is_empty() {
                "[anon]".into()
            } else {
                m.name
            },
            binary,
        }
    }

    /// The binary mapped at `m`, opened with [`files::open_mapping`] (never a path the
    /// workload could have redirected) and checked with [`elf_check::check`].
    fn binary(&self, tgid: u32, m: &Mapping) -> Result<Arc<Binary>, String> {
        let path = m.name.trim_end_matches(" (deleted)");
        let opened = files::open_mapping(tgid, &m.range, &m.name).map_err(|e| e.to_string())?;
        let meta = opened
            .file
            .metadata()
            .map_err(|e| format!("{path} of process {tgid}: {e}"))?;
        let key = (meta.dev(), meta.ino());
        if let Some(b) = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .binaries
            .get(&key)
        {
            return Ok(b.clone());
        }
        let elf =
            elf_check::check(&opened.file).map_err(|e| format!("{path} of process {tgid}: {e}"))?;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(b) = st.binaries.get(&key) {
            return Ok(b.clone());
        }
        let keep = st.binaries.len() < MAX_OPEN_BINARIES;
        let b = Arc::new(Binary {
            path: path.to_owned(),
            build_id: elf.build_id.clone(),
            elf,
            file: keep.then_some(opened.file),
            lines: Mutex::new(HashMap::new()),
        });
        if keep {
            st.binaries.insert(key, b.clone());
        }
        Ok(b)
    }
}
