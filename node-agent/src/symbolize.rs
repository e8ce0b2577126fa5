//! Symbolization of captured stacks with blazesym.
//!
//! User frames: the [`ProcessCatalog`] snapshots `/proc/<pid>/maps` while a
//! process lives (the samplers announce each new process and each exec over a
//! ring buffer) and keeps every mapped executable open, so a process that
//! exited before the capture ended — or whose binary was deleted — is still
//! symbolized from its ELF/DWARF symbols, by file offset. Kernel frames come
//! from kallsyms.

use std::collections::{HashMap, VecDeque};
use std::fs::{self, File};
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};

use crate::pprof::{Frame, FrameLine, MappingInfo, ProfileBuilder};

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

/// Most kernel addresses whose frames the agent remembers (kernel text is a few
/// thousand hot functions; an entry is one or two names).
pub const MAX_CACHED_KERNEL_ADDRESSES: usize = 32_768;

/// Kernel frames by address, shared by every capture of this agent.
static KERNEL_LINES: std::sync::LazyLock<Mutex<HashMap<u64, Arc<[FrameLine]>>>> =
    std::sync::LazyLock::new(|| Mutex::new(HashMap::new()));

/// The kernel's text symbols from `/proc/kallsyms`, parsed once and kept between
/// captures. Each capture used to hand new kernel addresses to a fresh blazesym
/// symbolizer, which parsed the whole file (120,000+ lines) again: 20-60 ms of agent CPU
/// per capture, the largest share of a continuous profile's cost. blazesym's symbolizer
/// cannot be kept across the captures' threads (it is not `Send`), and for the kernel it
/// only reads kallsyms (no vmlinux, so names without lines), which this does in a few
/// lines; kept, the table costs a few MiB. It is read again when it cannot name an
/// address and is older than [`KERNEL_SYMBOLS_REFRESH`] (a module loaded since).
struct KernelSymbols {
    /// Sorted text-symbol addresses, and their names.
    addrs: Vec<u64>,
    names: Vec<Arc<str>>,
    loaded: std::time::Instant,
}

/// Farthest past the last kernel symbol an address is still named after it.
const KERNEL_LAST_SYMBOL_REACH: u64 = 1 << 16;

impl KernelSymbols {
    fn load() -> Self {
        let text = fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        let mut symbols: Vec<(u64, &str)> = text
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let addr = u64::from_str_radix(fields.next()?, 16).ok()?;
                let kind = fields.next()?;
                let name = fields.next()?;
                // Text symbols only; zero addresses are hidden ones (kptr_restrict).
                (addr != 0 && matches!(kind, "t" | "T" | "w" | "W")).then_some((addr, name))
            })
            .collect();
        symbols.sort_unstable_by_key(|&(addr, _)| addr);
        Self {
            addrs: symbols.iter().map(|&(a, _)| a).collect(),
            names: symbols.iter().map(|&(_, n)| Arc::from(n)).collect(),
            loaded: std::time::Instant::now(),
        }
    }

    /// The symbol `addr` falls in: the last one at or below it.
    fn name(&self, addr: u64) -> Option<&Arc<str>> {
        let i = self.addrs.partition_point(|&a| a <= addr).checked_sub(1)?;
        if i + 1 == self.addrs.len() && addr - self.addrs[i] > KERNEL_LAST_SYMBOL_REACH {
            return None;
        }
        self.names.get(i)
    }
}

static KERNEL_SYMBOLS: Mutex<Option<KernelSymbols>> = Mutex::new(None);

/// See [`KernelSymbols`].
const KERNEL_SYMBOLS_REFRESH: std::time::Duration = std::time::Duration::from_secs(60);

/// The frame lines of each kernel address in `addrs`, from the kept kernel symbols.
fn kernel_lines(addrs: &[u64]) -> Vec<Arc<[FrameLine]>> {
    let mut kept = KERNEL_SYMBOLS
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let stale = kept.as_ref().is_some_and(|k| {
        k.loaded.elapsed() >= KERNEL_SYMBOLS_REFRESH && addrs.iter().any(|&a| k.name(a).is_none())
    });
    if stale {
        *kept = None;
    }
    let symbols = kept.get_or_insert_with(KernelSymbols::load);
    addrs
        .iter()
        .map(|&addr| match symbols.name(addr) {
            Some(name) => kernel_frame_lines(name),
            None => Arc::from([]),
        })
        .collect()
}

/// The file offset to symbolize the frame at `depth` (0: the leaf) of a stack at, in
/// `range`: return addresses point after their call, so the call itself is looked up
/// (the leaf too when `leaf_is_return_address`). `None` below the range's start.
fn lookup_offset(
    range: &MappedRange,
    addr: u64,
    depth: usize,
    leaf_is_return_address: bool,
) -> Option<u64> {
    let lookup = if depth == 0 && !leaf_is_return_address {
        addr
    } else {
        addr.saturating_sub(1)
    };
    lookup
        .checked_sub(range.start)
        .map(|o| o.wrapping_add(range.offset))
}

/// The frame of a kernel function.
fn kernel_frame_lines(name: &str) -> Arc<[FrameLine]> {
    Arc::from([FrameLine {
        function: name.to_string(),
        file: "[kernel]".into(),
        line: 0,
    }])
}

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
    fn remember(&self, file_offset: u64, lines: Arc<[FrameLine]>) {
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

/// Counts of symbolized and unsymbolized user frames, for reports and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SymbolizeStats {
    /// User frames resolved to a function.
    pub user_symbolized: u64,
    /// User frames left as bare addresses.
    pub user_unsymbolized: u64,
    /// Processes sampled for which no maps snapshot existed.
    pub processes_without_maps: u64,
    /// Frames of the profile's samples, each counted once per sample
    /// (user and kernel).
    pub sampled_frames: u64,
    /// Of those, frames without a function name.
    pub sampled_unsymbolized: u64,
    /// User frames answered from a binary's offset cache, without blazesym.
    pub cache_hits: u64,
    /// Kernel frames answered from the kernel cache, without kallsyms.
    pub kernel_cache_hits: u64,
}

impl SymbolizeStats {
    /// Share of sampled frames left without a function name, in percent.
    pub fn unsymbolized_pct(&self) -> f64 {
        if self.sampled_frames == 0 {
            return 0.0;
        }
        100.0 * self.sampled_unsymbolized as f64 / self.sampled_frames as f64
    }

    /// The profile comment stating symbolization quality; `weight` names
    /// what [`StackSymbolizer::account`] was given (e.g. "samples").
    pub fn quality_comment(&self, weight: &str) -> String {
        format!(
            "symbolization: {:.2}% of sampled frames unsymbolized ({} of {}, weighted by {weight})",
            self.unsymbolized_pct(),
            self.sampled_unsymbolized,
            self.sampled_frames
        )
    }
}

/// Turns raw addresses into pprof frames. One per profile being built:
/// blazesym caches parsed ELF files for the duration of the batch.
pub struct StackSymbolizer {
    catalog: ProcessCatalog,
    blaze: Symbolizer,
    kernel_mapping: Option<u64>,
    missing: std::collections::HashSet<u32>,
    jit: HashMap<u32, Option<Arc<crate::perf_map::PerfMap>>>,
    /// Running totals.
    pub stats: SymbolizeStats,
}

impl std::fmt::Debug for StackSymbolizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StackSymbolizer")
            .field("stats", &self.stats)
            .finish()
    }
}

/// Name of the pseudo-mapping kernel frames belong to (as in `perf`).
pub const KERNEL_MAPPING: &str = "[kernel.kallsyms]";

impl StackSymbolizer {
    /// A symbolizer reading process snapshots from `catalog`.
    pub fn new(catalog: ProcessCatalog) -> Self {
        Self {
            catalog,
            blaze: Symbolizer::builder()
                .enable_code_info(true)
                .enable_inlined_fns(true)
                .build(),
            kernel_mapping: None,
            missing: Default::default(),
            jit: HashMap::new(),
            stats: SymbolizeStats::default(),
        }
    }

    /// Symbolizes a user stack of process `tgid` (leaf first) into frames,
    /// registering mappings in `out`.
    pub fn user_frames(
        &mut self,
        out: &mut ProfileBuilder,
        tgid: u32,
        stack: &[u64],
    ) -> Vec<Frame> {
        self.frames(out, tgid, stack, false)
    }

    /// Like [`Self::user_frames`] for stacks whose every entry, the leaf
    /// included, is a return address (Go's profile buckets record `callers`
    /// output): each is looked up at `pc - 1`, inside the call.
    pub fn return_address_frames(
        &mut self,
        out: &mut ProfileBuilder,
        tgid: u32,
        stack: &[u64],
    ) -> Vec<Frame> {
        self.frames(out, tgid, stack, true)
    }

    fn frames(
        &mut self,
        out: &mut ProfileBuilder,
        tgid: u32,
        stack: &[u64],
        leaf_is_return_address: bool,
    ) -> Vec<Frame> {
        let maps = self.catalog.get(tgid);
        if maps.is_none() && self.missing.insert(tgid) {
            self.stats.processes_without_maps += 1;
        }
        let mut frames = Vec::with_capacity(stack.len());
        for (depth, &addr) in stack.iter().enumerate() {
            let range = maps.as_ref().and_then(|m| m.find(addr));
            // Code outside any file (JIT): named by the process's perf map.
            if range.is_none_or(|r| r.binary.is_none())
                && let Some(name) = self.jit_name(tgid, addr)
            {
                self.stats.user_symbolized += 1;
                frames.push(Frame {
                    address: addr,
                    mapping: range.map(|r| {
                        out.add_mapping(&MappingInfo {
                            start: r.start,
                            limit: r.end,
                            file_offset: r.offset,
                            file: r.name.clone(),
                            build_id: String::new(),
                            has_functions: true,
                        })
                    }),
                    lines: vec![FrameLine {
                        function: name,
                        file: String::new(),
                        line: 0,
                    }],
                });
                continue;
            }
            let Some(range) = range else {
                self.stats.user_unsymbolized += 1;
                frames.push(Frame {
                    address: addr,
                    mapping: None,
                    lines: Vec::new(),
                });
                continue;
            };
            let lines = match (
                &range.binary,
                lookup_offset(range, addr, depth, leaf_is_return_address),
            ) {
                (Some(bin), Some(offset)) => self.binary_lines(bin, tgid, offset),
                _ => Vec::new(),
            };
            if lines.is_empty() {
                self.stats.user_unsymbolized += 1;
            } else {
                self.stats.user_symbolized += 1;
            }
            let mapping = out.add_mapping(&MappingInfo {
                start: range.start,
                limit: range.end,
                file_offset: range.offset,
                file: range
                    .binary
                    .as_ref()
                    .map_or(range.name.clone(), |b| b.path.clone()),
                build_id: range
                    .binary
                    .as_ref()
                    .map(|b| b.build_id.clone())
                    .unwrap_or_default(),
                has_functions: range.binary.is_some(),
            });
            frames.push(Frame {
                address: addr,
                mapping: Some(mapping),
                lines,
            });
        }
        frames
    }

    /// Symbolizes the frames of a user stack of `tgid` (leaf first) that are not
    /// cached yet and caches them, building nothing: a cached frame costs a lookup.
    /// Frames outside any file (JIT) are left to [`Self::user_frames`]. Returns the
    /// frames symbolized.
    pub fn warm_user(&mut self, tgid: u32, stack: &[u64]) -> usize {
        let Some(maps) = self.catalog.get(tgid) else {
            return 0;
        };
        let mut done = 0;
        for (depth, &addr) in stack.iter().enumerate() {
            let Some(range) = maps.find(addr) else {
                continue;
            };
            let Some(bin) = &range.binary else {
                continue;
            };
            let Some(offset) = lookup_offset(range, addr, depth, false) else {
                continue;
            };
            if bin.cached_lines(offset).is_none() {
                self.binary_lines(bin, tgid, offset);
                done += 1;
            }
        }
        done
    }

    /// Like [`Self::warm_user`] for a kernel stack: caches the addresses not cached yet
    /// that the kept kernel symbols name (loading them the first time). It never
    /// reloads them: an address they do not name is left to [`Self::kernel_frames`],
    /// which reloads stale symbols. Returns the frames it cached.
    pub fn warm_kernel(&mut self, stack: &[u64]) -> usize {
        let mut cache = KERNEL_LINES.lock().unwrap_or_else(PoisonError::into_inner);
        let missing: Vec<u64> = stack
            .iter()
            .copied()
            .filter(|a| !cache.contains_key(a))
            .collect();
        if missing.is_empty() {
            return 0;
        }
        let mut kept = KERNEL_SYMBOLS
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let symbols = kept.get_or_insert_with(KernelSymbols::load);
        let mut done = 0;
        for addr in missing {
            if cache.len() >= MAX_CACHED_KERNEL_ADDRESSES {
                break;
            }
            if let Some(name) = symbols.name(addr) {
                cache.insert(addr, kernel_frame_lines(name));
                done += 1;
            }
        }
        done
    }

    /// The JIT symbol of `addr` from the perf map of `tgid`, read once per
    /// symbolizer.
    fn jit_name(&mut self, tgid: u32, addr: u64) -> Option<String> {
        self.jit
            .entry(tgid)
            .or_insert_with(|| {
                crate::perf_map::PerfMap::read(tgid, None, &mut Default::default()).map(Arc::new)
            })
            .as_ref()?
            .lookup(addr)
            .map(str::to_owned)
    }

    /// Counts a sample's frames (`weight` samples) for [`SymbolizeStats::unsymbolized_pct`].
    pub fn account(&mut self, frames: &[Frame], weight: u64) {
        let missing = frames.iter().filter(|f| f.lines.is_empty()).count() as u64;
        self.stats.sampled_frames += frames.len() as u64 * weight;
        self.stats.sampled_unsymbolized += missing * weight;
    }

    /// Symbolizes a kernel stack (leaf first) from kallsyms.
    pub fn kernel_frames(&mut self, out: &mut ProfileBuilder, stack: &[u64]) -> Vec<Frame> {
        let mapping = *self.kernel_mapping.get_or_insert_with(|| {
            out.add_mapping(&MappingInfo {
                start: 0,
                limit: u64::MAX,
                file_offset: 0,
                file: KERNEL_MAPPING.into(),
                build_id: String::new(),
                has_functions: true,
            })
        });
        // Kernel text does not move while the agent runs, so frames resolved once are
        // kept (bounded) and only new addresses go to kallsyms.
        let mut cache = KERNEL_LINES.lock().unwrap_or_else(PoisonError::into_inner);
        let mut missing: Vec<u64> = stack
            .iter()
            .copied()
            .filter(|a| !cache.contains_key(a))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        self.stats.kernel_cache_hits += (stack.len() - missing.len()) as u64;
        if !missing.is_empty() {
            let found = kernel_lines(&missing);
            for (i, &addr) in missing.iter().enumerate() {
                let lines = found.get(i).cloned().unwrap_or_else(|| Arc::from([]));
                if cache.len() < MAX_CACHED_KERNEL_ADDRESSES {
                    cache.insert(addr, lines);
                } else {
                    // Full: answer this stack without keeping the new address.
                    drop(cache);
                    return kernel_frames_uncached(mapping, stack, &missing, &found);
                }
            }
        }
        stack
            .iter()
            .map(|&addr| Frame {
                address: addr,
                mapping: Some(mapping),
                lines: cache.get(&addr).map(|l| l.to_vec()).unwrap_or_default(),
            })
            .collect()
    }

    /// The frames of `file_offset` in `bin`: from the binary's cache, or symbolized now
    /// and cached.
    fn binary_lines(&mut self, bin: &Binary, tgid: u32, file_offset: u64) -> Vec<FrameLine> {
        if let Some(lines) = bin.cached_lines(file_offset) {
            self.stats.cache_hits += 1;
            return lines.to_vec();
        }
        let lines = self.elf_lines(&bin.open_path(tgid), file_offset);
        bin.remember(file_offset, Arc::from(lines.as_slice()));
        lines
    }

    fn elf_lines(&mut self, path: &std::path::Path, file_offset: u64) -> Vec<FrameLine> {
        let src = Source::Elf(Elf::new(path));
        match self
            .blaze
            .symbolize_single(&src, Input::FileOffset(file_offset))
        {
            Ok(s) => to_lines(&s, ""),
            Err(_) => Vec::new(),
        }
    }
}

/// [`StackSymbolizer::kernel_frames`] once the kernel cache is full: cached frames from the
/// cache, the others from `found` (the lines of `missing`, in order).
fn kernel_frames_uncached(
    mapping: u64,
    stack: &[u64],
    missing: &[u64],
    found: &[Arc<[FrameLine]>],
) -> Vec<Frame> {
    let cache = KERNEL_LINES.lock().unwrap_or_else(PoisonError::into_inner);
    stack
        .iter()
        .map(|&addr| {
            let lines = match cache.get(&addr) {
                Some(l) => l.to_vec(),
                None => missing
                    .binary_search(&addr)
                    .ok()
                    .and_then(|i| found.get(i))
                    .map(|l| l.to_vec())
                    .unwrap_or_default(),
            };
            Frame {
                address: addr,
                mapping: Some(mapping),
                lines,
            }
        })
        .collect()
}

/// Innermost inlined function first, the containing function last.
fn to_lines(s: &Symbolized<'_>, default_file: &str) -> Vec<FrameLine> {
    let Some(sym) = s.as_sym() else {
        return Vec::new();
    };
    let file_of = |ci: Option<&blazesym::symbolize::CodeInfo<'_>>| {
        ci.map_or(default_file.to_owned(), |c| {
            c.to_path().display().to_string()
        })
    };
    let mut lines: Vec<FrameLine> = sym
        .inlined
        .iter()
        .rev()
        .map(|f| FrameLine {
            function: f.name.to_string(),
            file: file_of(f.code_info.as_ref()),
            line: f
                .code_info
                .as_ref()
                .and_then(|c| c.line)
                .map_or(0, i64::from),
        })
        .collect();
    lines.push(FrameLine {
        function: sym.name.to_string(),
        file: file_of(sym.code_info.as_deref()),
        line: sym
            .code_info
            .as_ref()
            .and_then(|c| c.line)
            .map_or(0, i64::from),
    });
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_own_process_and_symbolizes_a_function_of_this_binary() {
        let catalog = ProcessCatalog::new();
        let me = std::process::id();
        assert!(catalog.snapshot(me));
        let maps = catalog.lookup(me).unwrap();
        let addr =
            snapshots_own_process_and_symbolizes_a_function_of_this_binary as fn() as usize as u64;
        let range = maps.find(addr).expect("own code is mapped");
        assert!(range.binary.is_some());
        let mut out = ProfileBuilder::new(&[("samples", "count")]);
        let mut s = StackSymbolizer::new(catalog);
        let frames = s.user_frames(&mut out, me, &[addr]);
        let name = &frames[0].lines.last().unwrap().function;
        assert!(
            name.contains("snapshots_own_process_and_symbolizes"),
            "got {name}"
        );
        assert_eq!(s.stats.user_symbolized, 1);
    }

    #[test]
    fn a_later_capture_reuses_the_frames_an_earlier_one_symbolized() {
        let catalog = ProcessCatalog::new();
        let me = std::process::id();
        assert!(catalog.snapshot(me));
        let addr =
            a_later_capture_reuses_the_frames_an_earlier_one_symbolized as fn() as usize as u64;
        let mut out = ProfileBuilder::new(&[("samples", "count")]);
        let mut first = StackSymbolizer::new(catalog.clone());
        let cold = first.user_frames(&mut out, me, &[addr]);
        assert_eq!(first.stats.cache_hits, 0);
        // A new symbolizer, as the next capture makes: the frame comes from the cache.
        let mut second = StackSymbolizer::new(catalog);
        let warm = second.user_frames(&mut out, me, &[addr]);
        assert_eq!(second.stats.cache_hits, 1);
        assert_eq!(warm[0].lines, cold[0].lines);
        assert!(
            warm[0]
                .lines
                .last()
                .unwrap()
                .function
                .contains("reuses_the_frames"),
            "got {:?}",
            warm[0].lines
        );
    }

    #[test]
    fn frames_warmed_during_a_window_are_cached_for_the_symbolization_after_it() {
        let catalog = ProcessCatalog::new();
        let me = std::process::id();
        assert!(catalog.snapshot(me));
        let addr = frames_warmed_during_a_window_are_cached_for_the_symbolization_after_it as fn()
            as usize as u64;
        // The pass during the window symbolizes the frame once; a second pass finds it.
        let mut during = StackSymbolizer::new(catalog.clone());
        assert_eq!(during.warm_user(me, &[addr]), 1);
        assert_eq!(during.warm_user(me, &[addr]), 0);
        // A process the catalog does not know, or an address outside any file: nothing.
        assert_eq!(during.warm_user(u32::MAX, &[addr]), 0);
        assert_eq!(during.warm_user(me, &[8]), 0);
        // The symbolization after the window takes the frame from the cache.
        let mut out = ProfileBuilder::new(&[("samples", "count")]);
        let mut after = StackSymbolizer::new(catalog);
        let frames = after.user_frames(&mut out, me, &[addr]);
        assert_eq!(after.stats.cache_hits, 1);
        let name = &frames[0].lines.last().expect("symbolized").function;
        assert!(name.contains("frames_warmed_during_a_window"), "got {name}");
    }

    #[test]
    fn a_kernel_address_is_named_after_the_symbol_it_falls_in() {
        let k = KernelSymbols {
            addrs: vec![0x1000, 0x2000],
            names: vec![Arc::from("first"), Arc::from("second")],
            loaded: std::time::Instant::now(),
        };
        assert_eq!(k.name(0xfff), None);
        assert_eq!(k.name(0x1000).map(|n| &**n), Some("first"));
        assert_eq!(k.name(0x1fff).map(|n| &**n), Some("first"));
        assert_eq!(k.name(0x2010).map(|n| &**n), Some("second"));
        // Far past the last symbol: not named after it.
        assert_eq!(k.name(0x2000 + KERNEL_LAST_SYMBOL_REACH + 1), None);
    }

    #[test]
    fn kernel_frames_resolved_once_are_reused() {
        // Needs kallsyms addresses (root); the address of `schedule` stands for a stack.
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap();
        let addr = kallsyms
            .lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                let (a, _, name) = (f.next()?, f.next()?, f.next()?);
                (name == "schedule").then(|| u64::from_str_radix(a, 16).ok())?
            })
            .expect("schedule in /proc/kallsyms");
        assert_ne!(addr, 0, "kallsyms addresses are hidden: run as root");
        let mut out = ProfileBuilder::new(&[("samples", "count")]);
        let mut first = StackSymbolizer::new(ProcessCatalog::new());
        let cold = first.kernel_frames(&mut out, &[addr]);
        let mut second = StackSymbolizer::new(ProcessCatalog::new());
        let warm = second.kernel_frames(&mut out, &[addr, addr]);
        assert_eq!(second.stats.kernel_cache_hits, 2);
        assert_eq!(warm[0].lines, cold[0].lines);
        assert_eq!(
            warm[0].lines.last().map(|l| l.function.as_str()),
            Some("schedule")
        );
    }
}
