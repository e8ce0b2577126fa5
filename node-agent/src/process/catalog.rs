//! Process snapshots for symbolization: the [`ProcessCatalog`] snapshots
//! `/proc/<pid>/maps` while a process lives (the samplers announce each new process and
//! each exec over a ring buffer) and keeps every mapped executable open, so a process that
//! exited before the capture ended — or whose binary was deleted — is still symbolized
//! from its ELF/DWARF symbols, by file offset.

use std::collections::{HashMap, VecDeque};
use std::fs::{self, File};
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use crate::pprof::FrameLine;

/// How many process snapshots the catalog keeps. A snapshot is a few KiB; the
/// oldest is evicted first, which only matters for processes that exited
/// long before the capture that sampled them was symbolized.
pub const MAX_PROCESSES: usize = 8192;
/// How many executables the catalog keeps open (one fd each). Binaries are
/// shared by every process mapping them, so this is rarely reached; beyond it
/// new binaries are symbolized by path only (fine unless they are deleted).
pub const MAX_OPEN_BINARIES: usize = 512;

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

    /// A path that opens this very file now, even if the original was deleted.
    pub fn open_path(&self, tgid: u32) -> PathBuf {
        match &self.file {
            Some(f) => PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd())),
            None => PathBuf::from(format!("/proc/{tgid}/root{}", self.path)),
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
}

impl ProcessMaps {
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
    pub fn snapshot(&self, tgid: u32) -> bool {
        let Ok(text) = fs::read_to_string(format!("/proc/{tgid}/maps")) else {
            return false;
        };
        let mut ranges = Vec::new();
        for line in text.lines() {
            let Some(r) = self.parse_line(tgid, line) else {
                continue;
            };
            ranges.push(r);
        }
        ranges.sort_by_key(|r| r.start);
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st
            .procs
            .insert(tgid, Arc::new(ProcessMaps { ranges }))
            .is_none()
        {
            st.order.push_back(tgid);
        }
        while st.order.len() > MAX_PROCESSES {
            if let Some(old) = st.order.pop_front() {
                st.procs.remove(&old);
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

    fn parse_line(&self, tgid: u32, line: &str) -> Option<MappedRange> {
        // start-end perms offset dev inode [path]
        let mut f = line.split_whitespace();
        let (range, perms, offset) = (f.next()?, f.next()?, f.next()?);
        let (_dev, inode) = (f.next()?, f.next()?);
        let name = f.collect::<Vec<_>>().join(" ");
        if !perms.contains('x') {
            return None;
        }
        let (start, end) = range.split_once('-')?;
        let start = u64::from_str_radix(start, 16).ok()?;
        let end = u64::from_str_radix(end, 16).ok()?;
        let offset = u64::from_str_radix(offset, 16).ok()?;
        let binary = (inode != "0" && name.starts_with('/'))
            .then(|| self.binary(tgid, range, &name))
            .flatten();
        Some(MappedRange {
            start,
            end,
            offset,
            name: if name.is_empty() {
                "[anon]".into()
            } else {
                name
            },
            binary,
        })
    }

    fn binary(&self, tgid: u32, range: &str, name: &str) -> Option<Arc<Binary>> {
        // map_files reaches the very inode mapped, across mount namespaces and
        // after deletion; the root/ path is the fallback without CAP_SYS_ADMIN.
        let path = name.trim_end_matches(" (deleted)");
        let file = File::open(format!("/proc/{tgid}/map_files/{range}"))
            .or_else(|_| File::open(format!("/proc/{tgid}/root{path}")))
            .ok()?;
        let meta = file.metadata().ok()?;
        let key = (meta.dev(), meta.ino());
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(b) = st.binaries.get(&key) {
            return Some(b.clone());
        }
        let fd_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let build_id = blazesym::helper::read_elf_build_id(&fd_path)
            .ok()
            .flatten()
            .map(|id| id.iter().map(|b| format!("{b:02x}")).collect())
            .unwrap_or_default();
        let keep = st.binaries.len() < MAX_OPEN_BINARIES;
        let b = Arc::new(Binary {
            path: path.to_owned(),
            build_id,
            file: keep.then_some(file),
            lines: Mutex::new(HashMap::new()),
        });
        if keep {
            st.binaries.insert(key, b.clone());
        }
        Some(b)
    }
}
