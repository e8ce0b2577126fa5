//! Symbolization of captured stacks with blazesym.
//!
//! User frames are resolved in the binaries the [`ProcessCatalog`] keeps reachable, by
//! file offset; kernel frames come from kallsyms (`kernel.rs`).

pub mod elf_check;
mod go;
mod kernel;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};

pub use self::kernel::MAX_CACHED_KERNEL_ADDRESSES;
use self::kernel::{
    KERNEL_LINES, KERNEL_SYMBOLS, KernelSymbols, kernel_frame_lines, kernel_frames_uncached,
    kernel_lines,
};
use crate::cgroup::Cgroup;
use crate::perf_map::{PerfMap, PerfMapBudget};
use crate::pprof::{Frame, FrameLine, MappingInfo, ProfileBuilder};
use crate::process::{Binary, MappedRange, ProcessCatalog, ProcessMaps};

/// Memory blazesym may hold for parsed binaries, all symbolizers of the agent together
/// (estimated by [`elf_check::ElfCheck::cost`]). Binaries are the workloads' and
/// symbolizers run side by side (one per capture being built), so without a total a few
/// large binaries in a few captures would exhaust the agent. Past it a binary is
/// symbolized from its symbol tables alone, and past that not at all (and the profile
/// says so).
pub const MAX_PARSE_BYTES: u64 = 192 << 20;
/// What the live symbolizers hold of [`MAX_PARSE_BYTES`].
static PARSE_BYTES: AtomicU64 = AtomicU64::new(0);
/// Notes one profile carries at most.
const MAX_NOTES: usize = 64;

/// How a symbolizer reads a binary, decided once per symbolizer within [`MAX_PARSE_BYTES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parse {
    /// Symbols and DWARF (lines, inlined functions).
    Full,
    /// Symbol tables only.
    SymbolsOnly,
    /// Not at all (the budget is spent).
    Refused,
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
    /// Kernel frames left without a name.
    pub kernel_unnamed: u64,
    /// Reads of workload files that were truncated while mapped, answered with zeros
    /// ([`crate::sigbus`]) while this symbolizer lived.
    pub truncated_file_faults: u64,
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
    jit: HashMap<u32, Option<Arc<PerfMap>>>,
    jit_budget: PerfMapBudget,
    /// The HotSpot JVMs among the processes whose JIT frames were looked up.
    jvms: HashMap<u32, crate::java::JvmStatus>,
    /// Whether JVMs may be asked for their perf map ([`crate::java::prepare`]).
    java_attach: bool,
    /// Where the samples come from: a process sampled there but without a snapshot is
    /// snapshotted now only if it is (still) there (see [`ProcessCatalog::get_in`]).
    confined_to: Option<Vec<Cgroup>>,
    /// How each binary is parsed, by address of its [`Binary`] (kept alive here).
    parse: HashMap<usize, (Arc<Binary>, Parse)>,
    /// Bytes of [`PARSE_BYTES`] this symbolizer holds.
    parse_bytes: u64,
    /// [`crate::sigbus::faults`] when it was made.
    faults_at_start: u64,
    /// Processes whose notes were taken, and the notes (what could not be read, and why).
    noted: std::collections::HashSet<u32>,
    notes: Vec<String>,
    /// Go function tables of binaries without DWARF, by address of their [`Binary`] ([`go`]).
    go_tables: HashMap<usize, (Arc<Binary>, Option<Arc<crate::gopclntab::GoTable>>)>,
    /// Running totals.
    pub stats: SymbolizeStats,
}

impl Drop for StackSymbolizer {
    fn drop(&mut self) {
        PARSE_BYTES.fetch_sub(self.parse_bytes, Ordering::Relaxed);
    }
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
        // blazesym maps the binaries it reads: see crate::sigbus.
        crate::sigbus::install();
        Self {
            catalog,
            blaze: Symbolizer::builder()
                .enable_code_info(true)
                .enable_inlined_fns(true)
                .build(),
            kernel_mapping: None,
            missing: Default::default(),
            jit: HashMap::new(),
            jit_budget: PerfMapBudget::default(),
            jvms: HashMap::new(),
            java_attach: false,
            confined_to: None,
            parse: HashMap::new(),
            parse_bytes: 0,
            faults_at_start: crate::sigbus::faults(),
            noted: Default::default(),
            notes: Vec::new(),
            go_tables: HashMap::new(),
            stats: SymbolizeStats::default(),
        }
    }

    /// Whether a HotSpot JVM whose JIT frames are looked up is asked to write its perf map
    /// first ([`crate::java`]). Off by default: the CPU and off-CPU engines switch it on as
    /// the node's [`crate::capture::SamplerConfig::java_attach`] says.
    pub fn java_attach(&mut self, on: bool) {
        self.java_attach = on;
    }

    /// The HotSpot JVMs met, by PID, with what their frames got.
    pub fn jvms(&self) -> Vec<crate::java::JvmStatus> {
        let mut out: Vec<_> = self.jvms.values().cloned().collect();
        out.sort_by_key(|j| j.tgid);
        out
    }

    /// Confines the processes snapshotted on demand to those in `cgroups` (the targets the
    /// samples come from): see [`ProcessCatalog::get_in`].
    pub fn confine_to(&mut self, cgroups: impl IntoIterator<Item = Cgroup>) {
        self.confined_to = Some(cgroups.into_iter().collect());
    }

    /// The snapshot of `tgid` (taken now if needed, within the confinement), its notes
    /// taken into the profile's.
    fn maps_of(&mut self, tgid: u32) -> Option<Arc<ProcessMaps>> {
        let maps = match &self.confined_to {
            Some(cgroups) => self.catalog.get_in(tgid, cgroups),
            None => self.catalog.get(tgid),
        };
        if let Some(m) = &maps
            && !m.notes.is_empty()
            && self.noted.insert(tgid)
        {
            for n in &m.notes {
                self.note(format!("pid {tgid}: {n}"));
            }
        }
        maps
    }

    fn note(&mut self, note: String) {
        if self.notes.len() < MAX_NOTES && !self.notes.contains(&note) {
            self.notes.push(note);
        }
    }

    /// The profile comments on symbolization: its quality ([`SymbolizeStats::quality_comment`],
    /// `weight` naming what [`Self::account`] was given), truncated files read, and what could
    /// not be read, per process.
    pub fn comments(&mut self, weight: &str) -> Vec<String> {
        self.stats.truncated_file_faults =
            crate::sigbus::faults().saturating_sub(self.faults_at_start);
        let mut out = vec![self.stats.quality_comment(weight)];
        if self.stats.truncated_file_faults > 0 {
            out.push(format!(
                "symbolization: {} reads of workload files truncated while mapped were answered \
                 with zeros (their frames may be unnamed)",
                self.stats.truncated_file_faults
            ));
        }
        if self.jit_budget.cut > 0 {
            out.push(format!(
                "symbolization: {} perf maps cut short: the perf maps of one profile keep at most \
                 {} bytes",
                self.jit_budget.cut,
                crate::perf_map::DEFAULT_BUDGET
            ));
        }
        out.extend(self.notes.iter().map(|n| format!("not symbolized: {n}")));
        out.extend(self.kernel_note().map(|n| format!("symbolization: {n}")));
        out.extend(self.jvms().iter().map(ToString::to_string));
        out
    }

    /// How this symbolizer parses `bin`: decided at first use, within [`MAX_PARSE_BYTES`].
    fn parse_of(&mut self, bin: &Arc<Binary>, tgid: u32) -> Parse {
        let key = Arc::as_ptr(bin) as usize;
        if let Some((_, p)) = self.parse.get(&key) {
            return *p;
        }
        let reserve = |bytes: u64| {
            PARSE_BYTES
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                    (used.saturating_add(bytes) <= MAX_PARSE_BYTES).then_some(used + bytes)
                })
                .is_ok()
        };
        let elf = &bin.elf;
        let parse = if elf.debug_syms && reserve(elf.cost) {
            self.parse_bytes += elf.cost;
            Parse::Full
        } else if reserve(elf.symbols_cost) {
            self.parse_bytes += elf.symbols_cost;
            if let Some(why) = &elf.no_debug_reason {
                self.note(format!("pid {tgid}: {}: {why}", bin.path));
            } else if elf.debug_syms {
                self.note(format!(
                    "pid {tgid}: {}: symbols only: the agent's symbolization memory \
                     ({MAX_PARSE_BYTES} bytes, all captures) is taken",
                    bin.path
                ));
            }
            Parse::SymbolsOnly
        } else {
            self.note(format!(
                "pid {tgid}: {}: the agent's symbolization memory ({MAX_PARSE_BYTES} bytes, all \
                 captures) is taken",
                bin.path
            ));
            Parse::Refused
        };
        self.parse.insert(key, (bin.clone(), parse));
        parse
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
        let maps = self.maps_of(tgid);
        if maps.is_none() && self.missing.insert(tgid) {
            self.stats.processes_without_maps += 1;
        }
        // Who the process was: its perf map is read by PID, and counts only while the PID
        // still names that process.
        let started = maps.as_ref().and_then(|m| m.start_time);
        let mut frames = Vec::with_capacity(stack.len());
        for (depth, &addr) in stack.iter().enumerate() {
            let range = maps.as_ref().and_then(|m| m.find(addr));
            // Code outside any file (JIT): named by the process's perf map.
            if range.is_none_or(|r| r.binary.is_none())
                && let Some(maps) = &maps
                && started.is_some()
                && let Some(name) = self.jit_name(tgid, maps, addr)
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
        let Some(maps) = self.maps_of(tgid) else {
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

    /// Symbolizes the frames of threads' stacks — `(tgid, user stack, kernel stack)`, leaf
    /// first, from processes in `cgroups` — that no capture has symbolized yet and keeps
    /// them in the caches, building no profile ([`Self::warm_user`], [`Self::warm_kernel`]
    /// once per distinct kernel stack). Returns the frames it symbolized.
    pub fn warm_threads<'a>(
        &mut self,
        cgroups: impl IntoIterator<Item = Cgroup>,
        threads: impl IntoIterator<Item = (u32, &'a [u64], &'a [u64])>,
    ) -> usize {
        self.confine_to(cgroups);
        let mut kernel: HashSet<&[u64]> = HashSet::new();
        let mut done = 0;
        for (tgid, user, kernel_stack) in threads {
            done += self.warm_user(tgid, user);
            if !kernel_stack.is_empty() && kernel.insert(kernel_stack) {
                done += self.warm_kernel(kernel_stack);
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

    /// The JIT symbol of `addr` from the perf map of `tgid`, read once per symbolizer
    /// (within its perf-map budget), and only while `tgid` is still the process sampled
    /// (the start time of its snapshot `maps`). A HotSpot JVM is first asked to write its
    /// perf map, and its names are cut to `package.Class.method`.
    fn jit_name(&mut self, tgid: u32, maps: &ProcessMaps, addr: u64) -> Option<String> {
        if !self.jit.contains_key(&tgid) {
            let jvm = crate::java::prepare(tgid, maps, self.java_attach);
            let map = PerfMap::read(tgid, maps.start_time, &mut self.jit_budget).map(Arc::new);
            if let Some(mut jvm) = jvm {
                jvm.perf_map_entries = map.as_ref().map_or(0, |m| m.len());
                self.jvms.insert(tgid, jvm);
            }
            self.jit.insert(tgid, map);
        }
        let name = self.jit.get(&tgid)?.as_ref()?.lookup(addr)?;
        Some(if self.jvms.contains_key(&tgid) {
            crate::java::method_name(name).to_owned()
        } else {
            name.to_owned()
        })
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
                    let frames = kernel_frames_uncached(mapping, stack, &missing, &found);
                    self.count_unnamed_kernel(&frames);
                    return frames;
                }
            }
        }
        let frames: Vec<Frame> = stack
            .iter()
            .map(|&addr| Frame {
                address: addr,
                mapping: Some(mapping),
                lines: cache.get(&addr).map(|l| l.to_vec()).unwrap_or_default(),
            })
            .collect();
        drop(cache);
        self.count_unnamed_kernel(&frames);
        frames
    }

    fn count_unnamed_kernel(&mut self, frames: &[Frame]) {
        self.stats.kernel_unnamed += frames.iter().filter(|f| f.lines.is_empty()).count() as u64;
    }

    /// Why this symbolizer's kernel frames are unnamed, when they are because the kernel
    /// hides its symbols' addresses from the agent (no `CAP_SYSLOG`): for the capture
    /// summary and the profile's comments.
    pub fn kernel_note(&self) -> Option<String> {
        if self.stats.kernel_unnamed == 0 {
            return None;
        }
        kernel::hidden_symbols().map(|why| {
            format!(
                "kernel frames are unnamed: {why}; the chart grants CAP_SYSLOG with \
                 agent.kernelSymbols: true (docs/security.md)"
            )
        })
    }

    /// The frames of `file_offset` in `bin`: from the binary's cache, or symbolized now
    /// and cached.
    fn binary_lines(&mut self, bin: &Arc<Binary>, tgid: u32, file_offset: u64) -> Vec<FrameLine> {
        if let Some(lines) = bin.cached_lines(file_offset) {
            self.stats.cache_hits += 1;
            return lines.to_vec();
        }
        if bin.elf.go_pclntab.is_some() {
            return self.go_lines(bin, tgid, file_offset);
        }
        let parse = self.parse_of(bin, tgid);
        if parse == Parse::Refused {
            return Vec::new();
        }
        let blaze = &self.blaze;
        let debug_file = bin
            .elf
            .debug_file
            .as_deref()
            .filter(|_| parse == Parse::Full);
        let looked_up = match (debug_file, bin.elf.virtual_address(file_offset)) {
            // DWARF from the separate debug file (the agent's own), by virtual address.
            (Some(debug), Some(vaddr)) => Ok(debug_file_lines(blaze, debug, vaddr)),
            _ => bin.with_path(tgid, |path| elf_lines(blaze, path, parse, file_offset)),
        };
        let lines = match looked_up {
            Ok(lines) => lines,
            Err(e) => {
                self.note(format!("pid {tgid}: {e}"));
                return Vec::new();
            }
        };
        // Answers are kept for later captures when no budget made them poorer than the
        // binary allows (a later capture may have the memory for its DWARF).
        if parse == Parse::Full || !bin.elf.debug_syms {
            bin.remember(file_offset, Arc::from(lines.as_slice()));
        }
        lines
    }
}

/// The frames of virtual address `vaddr` from the separate debug file at `path`.
fn debug_file_lines(blaze: &Symbolizer, path: &std::path::Path, vaddr: u64) -> Vec<FrameLine> {
    match blaze.symbolize_single(&Source::Elf(Elf::new(path)), Input::VirtOffset(vaddr)) {
        Ok(s) => to_lines(&s, ""),
        Err(_) => Vec::new(),
    }
}

/// The frames of `file_offset` in the ELF file at `path`, read as `parse` says.
fn elf_lines(
    blaze: &Symbolizer,
    path: &std::path::Path,
    parse: Parse,
    file_offset: u64,
) -> Vec<FrameLine> {
    let mut elf = Elf::new(path);
    elf.debug_syms = parse == Parse::Full;
    match blaze.symbolize_single(&Source::Elf(elf), Input::FileOffset(file_offset)) {
        Ok(s) => to_lines(&s, ""),
        Err(_) => Vec::new(),
    }
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
