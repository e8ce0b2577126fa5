//! Unwind tables for the BPF user-stack walker (`bpf/unwind.bpf.h`).
//!
//! The [`Unwinder`] owns two kernel maps that every sampler's BPF object
//! reuses (same fds): `unwind_tables` (table ID → that binary's pages of
//! rows) and `unwind_procs` (tgid → its mappings that have a table). When a
//! sampler first sees a process of a target cgroup it hands the process's
//! map snapshot to [`Unwinder::register`]; a worker thread builds the table of
//! each binary not loaded yet ([`table`], gimli over `.eh_frame` /
//! `.debug_frame`), shares it by build ID with every other process mapping
//! that binary, and writes the process entry. Until then — and for JIT code,
//! binaries without CFI, or binaries over the memory budget — the walker
//! falls back to frame pointers.
//!
//! Memory is bounded by [`UnwindConfig::max_table_bytes`]: tables no live
//! process uses are evicted least recently used first; a binary that does not
//! fit even then is not loaded (counted in [`UnwinderStats::over_budget`]).
//! Processes that exit are dropped by a sweep once a second.

pub mod table;

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd as _, AsRawFd as _};
use std::os::unix::fs::MetadataExt as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use libbpf_rs::libbpf_sys as sys;
use libbpf_rs::{MapCore as _, MapFlags, MapHandle, MapType};

use crate::process::{Binary, ProcessMaps};
use table::{BinaryTable, Row};

/// Rows per page (`FF_UNWIND_PAGE_ROWS`).
pub const PAGE_ROWS: usize = 512;
/// Bytes per page (one inner-array element).
pub const PAGE_BYTES: usize = PAGE_ROWS * 8;
/// Mappings with a table kept per process (`FF_UNWIND_MAX_MAPPINGS`).
pub const MAX_MAPPINGS: usize = 64;
/// Size of `struct ff_unwind_mapping`.
const MAPPING_BYTES: usize = 32;
/// Size of `struct ff_unwind_proc`.
const PROC_BYTES: usize = 8 + MAX_MAPPINGS * MAPPING_BYTES;
/// Binaries remembered as having no usable CFI (not parsed again).
const MAX_FAILED: usize = 4096;
/// Process registrations queued for the worker; beyond, dropped and counted.
const QUEUE: usize = 4096;

/// Limits of the unwind tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnwindConfig {
    /// Memory for table pages in the kernel, all binaries together.
    pub max_table_bytes: u64,
    /// Distinct binaries with a table at once.
    pub max_tables: u32,
    /// Processes with an entry at once (the process map is preallocated:
    /// ~2 KiB each).
    pub max_processes: u32,
}

impl Default for UnwindConfig {
    fn default() -> Self {
        Self {
            max_table_bytes: 32 << 20,
            max_tables: 4096,
            max_processes: 4096,
        }
    }
}

/// Errors of the unwinder.
#[derive(Debug, thiserror::Error)]
pub enum UnwindError {
    /// Creating or writing a kernel map failed.
    #[error("unwind tables: {action}: {source}")]
    Map {
        /// What was being done.
        action: String,
        /// libbpf's error.
        source: libbpf_rs::Error,
    },
    /// The worker thread could not start.
    #[error("unwind tables: starting the worker thread: {0}")]
    Thread(std::io::Error),
}

fn map_err(action: &str) -> impl FnOnce(libbpf_rs::Error) -> UnwindError + '_ {
    move |source| UnwindError::Map {
        action: action.to_owned(),
        source,
    }
}

/// What the unwinder did since it started (user-space side).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnwinderStats {
    /// Tables built and loaded.
    pub tables_loaded: u64,
    /// Tables in the kernel now.
    pub tables: u64,
    /// Their pages' bytes now.
    pub table_bytes: u64,
    /// Tables evicted to stay within the budget.
    pub tables_evicted: u64,
    /// Binaries with no usable CFI (missing, corrupt, other architecture).
    pub binaries_without_cfi: u64,
    /// Malformed CFI entries skipped in binaries that otherwise loaded.
    pub cfi_entries_skipped: u64,
    /// Binaries not loaded because the budget was full of tables in use.
    pub over_budget: u64,
    /// Processes with an entry now.
    pub processes: u64,
    /// Mappings left out because a process had more than [`MAX_MAPPINGS`].
    pub mappings_dropped: u64,
    /// Registrations dropped (queue or process map full).
    pub registrations_dropped: u64,
    /// Time spent building and loading tables, in microseconds.
    pub build_micros: u64,
    /// Longest single table build + load, in microseconds.
    pub max_build_micros: u64,
}

/// Counters of the BPF walker (`enum ff_unwind_stat`), summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WalkStats {
    /// User stacks walked.
    pub stacks: u64,
    /// Frames unwound with a CFI table.
    pub frames_cfi: u64,
    /// Frames unwound by frame pointer.
    pub frames_fp: u64,
    /// Stacks of processes without tables (yet): frame pointers only.
    pub no_process: u64,
    /// Stacks stopped at a CFI rule the walker cannot evaluate.
    pub unsupported: u64,
    /// Stacks stopped at unreadable stack memory.
    pub read_failed: u64,
    /// Stacks cut at 127 frames.
    pub truncated: u64,
    /// Frames whose table had been evicted.
    pub table_missing: u64,
    /// Stacks not stored (stack map full).
    pub stack_lost: u64,
    /// Stacks stopped because the stack pointer went backwards.
    pub bad_step: u64,
    /// Stacks continued from a Go thread's scheduler stack on the goroutine that parked
    /// (off-CPU walks only).
    pub go_parked: u64,
}

impl WalkStats {
    /// Reads the per-CPU `unwind_stats` array of a BPF object.
    pub fn read(map: &impl libbpf_rs::MapCore) -> Self {
        let mut v = [0u64; 11];
        for (i, total) in v.iter_mut().enumerate() {
            *total = crate::bpf::per_cpu::<u64>(map, i as u32)
                .unwrap_or_default()
                .into_iter()
                .sum();
        }
        Self {
            stacks: v[0],
            frames_cfi: v[1],
            frames_fp: v[2],
            no_process: v[3],
            unsupported: v[4],
            read_failed: v[5],
            truncated: v[6],
            table_missing: v[7],
            stack_lost: v[8],
            bad_step: v[9],
            go_parked: v[10],
        }
    }

    /// The profile comment describing the walks.
    pub fn comment(&self) -> String {
        format!(
            "user stacks: {} walked, frames by CFI {} / by frame pointer {}; without tables (yet): {}; \
             stopped: unsupported CFI {}, unreadable stack {}, bad step {}, truncated at 127 {}, table evicted {}{}",
            self.stacks,
            self.frames_cfi,
            self.frames_fp,
            self.no_process,
            self.unsupported,
            self.read_failed,
            self.bad_step,
            self.truncated,
            self.table_missing,
            if self.go_parked > 0 {
                format!(
                    "; continued on the goroutine that parked: {}",
                    self.go_parked
                )
            } else {
                String::new()
            }
        )
    }

    /// The counts since `before`.
    pub fn since(self, before: Self) -> Self {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        Self {
            stacks: d(self.stacks, before.stacks),
            frames_cfi: d(self.frames_cfi, before.frames_cfi),
            frames_fp: d(self.frames_fp, before.frames_fp),
            no_process: d(self.no_process, before.no_process),
            unsupported: d(self.unsupported, before.unsupported),
            read_failed: d(self.read_failed, before.read_failed),
            truncated: d(self.truncated, before.truncated),
            table_missing: d(self.table_missing, before.table_missing),
            stack_lost: d(self.stack_lost, before.stack_lost),
            bad_step: d(self.bad_step, before.bad_step),
            go_parked: d(self.go_parked, before.go_parked),
        }
    }
}

struct LoadedTable {
    id: u32,
    pages: u32,
    bytes: u64,
    users: u32,
    last_used: Instant,
    segments: Vec<table::Segment>,
}

struct ProcEntry {
    snapshot: Arc<ProcessMaps>,
    tables: Vec<String>,
}

#[derive(Default)]
struct State {
    tables: HashMap<String, LoadedTable>,
    failed: HashSet<String>,
    procs: HashMap<u32, ProcEntry>,
    next_id: u32,
    stats: UnwinderStats,
}

struct Inner {
    config: UnwindConfig,
    tables: MapHandle,
    procs: MapHandle,
    state: Mutex<State>,
    /// Set when the unwinder is dropped: the worker ends, and a build under way gives up.
    stop: AtomicBool,
}

/// The node's unwind tables, shared by every sampler (see the module docs).
pub struct Unwinder {
    inner: Arc<Inner>,
    tx: Option<SyncSender<(u32, Arc<ProcessMaps>)>>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Unwinder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unwinder")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Drop for Unwinder {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        // The worker waits on the channel: disconnecting it wakes the worker now.
        drop(self.tx.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

static SHARED: Mutex<Weak<Unwinder>> = Mutex::new(Weak::new());

/// Held while a table is built (see [`Inner::table_for`]).
static BUILDING: Mutex<()> = Mutex::new(());

/// A table build that did not finish in the time it was given.
struct Overrun;

impl Unwinder {
    /// The node's unwinder: the running one, or a new one with `config`
    /// (tables are freed when the last sampler holding it stops).
    pub fn shared(config: &UnwindConfig) -> Result<Arc<Self>, UnwindError> {
        let mut slot = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(u) = slot.upgrade() {
            return Ok(u);
        }
        let u = Arc::new(Self::new(config)?);
        *slot = Arc::downgrade(&u);
        Ok(u)
    }

    /// A new unwinder with its own kernel maps and worker thread.
    pub fn new(config: &UnwindConfig) -> Result<Self, UnwindError> {
        let opts = |flags: u32, inner_fd: i32| sys::bpf_map_create_opts {
            sz: std::mem::size_of::<sys::bpf_map_create_opts>() as _,
            map_flags: flags,
            inner_map_fd: inner_fd as u32,
            ..Default::default()
        };
        let template = MapHandle::create(
            MapType::Array,
            Some("ff_uw_pages"),
            4,
            PAGE_BYTES as u32,
            1,
            &opts(sys::BPF_F_INNER_MAP, 0),
        )
        .map_err(map_err("creating the page-array template"))?;
        let tables = MapHandle::create(
            MapType::HashOfMaps,
            Some("unwind_tables"),
            4,
            4,
            config.max_tables.max(1),
            &opts(0, template.as_fd().as_raw_fd()),
        )
        .map_err(map_err("creating unwind_tables"))?;
        let procs = MapHandle::create(
            MapType::Hash,
            Some("unwind_procs"),
            4,
            PROC_BYTES as u32,
            config.max_processes.max(1),
            &opts(0, 0),
        )
        .map_err(map_err("creating unwind_procs"))?;
        let inner = Arc::new(Inner {
            config: *config,
            tables,
            procs,
            state: Mutex::new(State {
                next_id: 1,
                ..State::default()
            }),
            stop: AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::sync_channel::<(u32, Arc<ProcessMaps>)>(QUEUE);
        let w_inner = inner.clone();
        let worker = std::thread::Builder::new()
            .name("ff-unwind".into())
            .spawn(move || {
                // Wakes for registrations and once a second to sweep; `Drop` disconnects
                // the channel, which ends the wait at once.
                let mut next_sweep = Instant::now() + Duration::from_secs(1);
                while !w_inner.stop.load(Ordering::Acquire) {
                    let until_sweep = next_sweep.saturating_duration_since(Instant::now());
                    match rx.recv_timeout(until_sweep) {
                        Ok((tgid, maps)) => {
                            w_inner.register(tgid, maps, None);
                        }
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                    if Instant::now() >= next_sweep {
                        w_inner.sweep();
                        next_sweep = Instant::now() + Duration::from_secs(1);
                    }
                }
            })
            .map_err(UnwindError::Thread)?;
        Ok(Self {
            inner,
            tx: Some(tx),
            worker: Some(worker),
        })
    }

    /// Points a BPF object's `unwind_tables` and `unwind_procs` at this
    /// unwinder's maps (call before load).
    pub fn share_maps(
        &self,
        tables: &mut libbpf_rs::OpenMapMut<'_>,
        procs: &mut libbpf_rs::OpenMapMut<'_>,
    ) -> Result<(), UnwindError> {
        tables
            .reuse_fd(self.inner.tables.as_fd())
            .map_err(map_err("sharing unwind_tables"))?;
        procs
            .reuse_fd(self.inner.procs.as_fd())
            .map_err(map_err("sharing unwind_procs"))
    }

    /// Queues a process's mappings (never blocks; a full queue is counted).
    /// A process already registered with the same snapshot is skipped.
    pub fn register(&self, tgid: u32, maps: Arc<ProcessMaps>) {
        let sent = match &self.tx {
            Some(tx) => tx.try_send((tgid, maps)),
            None => Err(TrySendError::Disconnected((tgid, maps))),
        };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = sent {
            self.inner.lock().stats.registrations_dropped += 1;
        }
    }

    /// Registers processes on the caller's thread for up to `budget` (e.g.
    /// those running when a capture starts, so that their first samples have
    /// tables); the rest are queued for the worker, so a target with many new
    /// binaries does not hold the capture's start for long.
    pub fn register_now(
        &self,
        procs: impl IntoIterator<Item = (u32, Arc<ProcessMaps>)>,
        budget: Duration,
    ) {
        let deadline = Instant::now() + budget;
        for (tgid, maps) in procs {
            // A build that would overrun the budget (a binary with a huge CFI section) is
            // left to the worker, which builds it without holding the capture.
            if Instant::now() >= deadline
                || !self.inner.register(tgid, maps.clone(), Some(deadline))
            {
                self.register(tgid, maps);
            }
        }
    }

    /// Whether `tgid` has an entry (its tables are loaded).
    pub fn is_registered(&self, tgid: u32) -> bool {
        self.inner.lock().procs.contains_key(&tgid)
    }

    /// Counters and current memory.
    pub fn stats(&self) -> UnwinderStats {
        let st = self.inner.lock();
        let mut s = st.stats;
        s.tables = st.tables.len() as u64;
        s.table_bytes = st.tables.values().map(|t| t.bytes).sum();
        s.processes = st.procs.len() as u64;
        s
    }

    /// Bytes the process map reserves in the kernel (preallocated).
    pub fn process_map_bytes(&self) -> u64 {
        u64::from(self.inner.config.max_processes) * (PROC_BYTES as u64 + 4)
    }
}

/// Cache key of a binary: its build ID, or its identity on disk.
fn table_key(bin: &Binary, tgid: u32) -> Option<String> {
    if !bin.build_id.is_empty() {
        return Some(format!("build-id:{}", bin.build_id));
    }
    let meta = bin.open(tgid).ok()?.metadata().ok()?;
    Some(format!(
        "file:{}:{}:{}:{}",
        meta.dev(),
        meta.ino(),
        meta.size(),
        meta.mtime()
    ))
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a process, building the tables it needs; `false` when a build did not
    /// finish by `deadline` (the process is not registered then).
    fn register(&self, tgid: u32, maps: Arc<ProcessMaps>, deadline: Option<Instant>) -> bool {
        {
            let st = self.lock();
            if st
                .procs
                .get(&tgid)
                .is_some_and(|p| Arc::ptr_eq(&p.snapshot, &maps))
            {
                return true;
            }
        }
        let mut mappings: Vec<[u64; 4]> = Vec::new();
        let mut keys: Vec<String> = Vec::new();
        for r in &maps.ranges {
            let Some(bin) = &r.binary else { continue };
            let Some(key) = table_key(bin, tgid) else {
                continue;
            };
            let (id, pages, bias) =
                match self.table_for(&key, bin, tgid, (r.start, r.end, r.offset), deadline) {
                    Ok(Some(t)) => t,
                    Ok(None) => continue,
                    Err(Overrun) => return false,
                };
            if !keys.contains(&key) {
                keys.push(key);
            }
            mappings.push([
                r.start,
                r.end,
                bias,
                u64::from(id) | (u64::from(pages) << 32),
            ]);
        }
        mappings.sort_unstable_by_key(|m| m[0]);
        let mut st = self.lock();
        if mappings.len() > MAX_MAPPINGS {
            st.stats.mappings_dropped += (mappings.len() - MAX_MAPPINGS) as u64;
            mappings.truncate(MAX_MAPPINGS);
        }
        let mut value = vec![0u8; PROC_BYTES];
        value[..4].copy_from_slice(&(mappings.len() as u32).to_ne_bytes());
        for (i, m) in mappings.iter().enumerate() {
            let at = 8 + i * MAPPING_BYTES;
            for (j, word) in m.iter().enumerate() {
                value[at + j * 8..at + j * 8 + 8].copy_from_slice(&word.to_ne_bytes());
            }
        }
        // Hold the new tables before releasing the old entry's (an exec into
        // the same binary keeps them).
        for k in &keys {
            if let Some(t) = st.tables.get_mut(k) {
                t.users += 1;
            }
        }
        if self
            .procs
            .update(&tgid.to_ne_bytes(), &value, MapFlags::ANY)
            .is_err()
        {
            st.stats.registrations_dropped += 1;
            release(&mut st, &keys);
            return true;
        }
        if let Some(old) = st.procs.insert(
            tgid,
            ProcEntry {
                snapshot: maps,
                tables: keys,
            },
        ) {
            release(&mut st, &old.tables);
        }
        true
    }

    /// The table of `bin` (building and loading it if needed) and the load
    /// bias of its mapping at `start`/`offset`; [`Overrun`] when the build did not finish
    /// by `deadline` (nothing is remembered of it then: the worker builds it later).
    fn table_for(
        &self,
        key: &str,
        bin: &Binary,
        tgid: u32,
        (start, end, offset): (u64, u64, u64),
        deadline: Option<Instant>,
    ) -> Result<Option<(u32, u32, u64)>, Overrun> {
        {
            let mut st = self.lock();
            if st.failed.contains(key) {
                return Ok(None);
            }
            if let Some(t) = st.tables.get_mut(key) {
                t.last_used = Instant::now();
                return Ok(table::load_bias(&t.segments, start, end, offset)
                    .map(|bias| (t.id, t.pages, bias)));
            }
        }
        let began = Instant::now();
        let built = {
            // One build at a time, whichever thread asks: each may hold up to
            // table::MAX_BUILD_BYTES plus its sections while it runs. A caller with a
            // deadline does not wait for another's build: the worker builds this one later.
            let _one = match (BUILDING.try_lock(), deadline) {
                (Ok(guard), _) => guard,
                (Err(std::sync::TryLockError::Poisoned(p)), _) => p.into_inner(),
                (Err(std::sync::TryLockError::WouldBlock), Some(_)) => return Err(Overrun),
                (Err(std::sync::TryLockError::WouldBlock), None) => {
                    BUILDING.lock().unwrap_or_else(PoisonError::into_inner)
                }
            };
            bin.open(tgid)
                .map_err(|e| table::TableError::Parse(e.to_string()))
                .and_then(|f| {
                    table::build_from_file(
                        &f,
                        table::GiveUp {
                            deadline,
                            stop: Some(&self.stop),
                        },
                    )
                })
        };
        if matches!(built, Err(table::TableError::Deadline)) {
            return Err(Overrun);
        }
        Ok(self.keep_table(key, bin, (start, end, offset), built, began))
    }

    /// Loads a table just built (or remembers that `bin` has none) and returns it with the
    /// load bias of the mapping at `start`/`offset`.
    fn keep_table(
        &self,
        key: &str,
        bin: &Binary,
        (start, end, offset): (u64, u64, u64),
        built: Result<BinaryTable, table::TableError>,
        began: Instant,
    ) -> Option<(u32, u32, u64)> {
        let mut st = self.lock();
        if let Some(t) = st.tables.get(key) {
            // Loaded by another thread meanwhile.
            let bias = table::load_bias(&t.segments, start, end, offset)?;
            return Some((t.id, t.pages, bias));
        }
        let built = match built {
            Ok(t) if !t.rows.is_empty() => t,
            Ok(_) | Err(_) => {
                if st.failed.len() >= MAX_FAILED {
                    st.failed.clear();
                }
                st.failed.insert(key.to_owned());
                st.stats.binaries_without_cfi += 1;
                tracing::debug!(binary = %bin.path, "no usable CFI; frames there walk by frame pointer");
                return None;
            }
        };
        let loaded = self.load(&mut st, &built)?;
        let micros = began.elapsed().as_micros() as u64;
        st.stats.build_micros += micros;
        st.stats.max_build_micros = st.stats.max_build_micros.max(micros);
        st.stats.tables_loaded += 1;
        st.stats.cfi_entries_skipped += built.skipped;
        let bias = table::load_bias(&built.segments, start, end, offset);
        st.tables.insert(key.to_owned(), loaded);
        let t = st.tables.get(key)?;
        Some((t.id, t.pages, bias?))
    }

    /// Makes room within the budget and writes a table to the kernel.
    fn load(&self, st: &mut State, built: &BinaryTable) -> Option<LoadedTable> {
        let pages = built.rows.len().div_ceil(PAGE_ROWS);
        let bytes = (pages * PAGE_BYTES) as u64;
        let used: u64 = st.tables.values().map(|t| t.bytes).sum();
        let mut free = self.config.max_table_bytes.saturating_sub(used);
        let mut slots =
            self.config.max_tables as usize - st.tables.len().min(self.config.max_tables as usize);
        if bytes > free || slots == 0 {
            let mut idle: Vec<(Instant, String)> = st
                .tables
                .iter()
                .filter(|(_, t)| t.users == 0)
                .map(|(k, t)| (t.last_used, k.clone()))
                .collect();
            idle.sort();
            for (_, k) in idle {
                if bytes <= free && slots > 0 {
                    break;
                }
                if let Some(t) = st.tables.remove(&k) {
                    let _ = self.tables.delete(&t.id.to_ne_bytes());
                    free += t.bytes;
                    slots += 1;
                    st.stats.tables_evicted += 1;
                }
            }
        }
        if bytes > free || slots == 0 {
            st.stats.over_budget += 1;
            return None;
        }
        let id = st.next_id;
        st.next_id = st.next_id.wrapping_add(1).max(1);
        let opts = sys::bpf_map_create_opts {
            sz: std::mem::size_of::<sys::bpf_map_create_opts>() as _,
            map_flags: sys::BPF_F_INNER_MAP,
            ..Default::default()
        };
        let inner = MapHandle::create(
            MapType::Array,
            Some("ff_uw_table"),
            4,
            PAGE_BYTES as u32,
            pages as u32,
            &opts,
        )
        .ok()?;
        let pad = Row {
            pc: u32::MAX,
            cfa_off: 0,
            kind: table::kind::NONE,
            rbp_off: 0,
        };
        let mut page = vec![0u8; PAGE_BYTES];
        for p in 0..pages {
            for i in 0..PAGE_ROWS {
                let row = built.rows.get(p * PAGE_ROWS + i).copied().unwrap_or(pad);
                page[i * 8..i * 8 + 8].copy_from_slice(&row.to_bytes());
            }
            inner
                .update(&(p as u32).to_ne_bytes(), &page, MapFlags::ANY)
                .ok()?;
        }
        let fd = inner.as_fd().as_raw_fd() as u32;
        self.tables
            .update(&id.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
            .ok()?;
        Some(LoadedTable {
            id,
            pages: pages as u32,
            bytes,
            users: 0,
            last_used: Instant::now(),
            segments: built.segments.clone(),
        })
    }

    /// Drops the entries of processes that exited.
    fn sweep(&self) {
        let mut st = self.lock();
        let gone: Vec<u32> = st
            .procs
            .keys()
            .copied()
            .filter(|tgid| !std::path::Path::new(&format!("/proc/{tgid}")).exists())
            .collect();
        for tgid in gone {
            let _ = self.procs.delete(&tgid.to_ne_bytes());
            if let Some(e) = st.procs.remove(&tgid) {
                release(&mut st, &e.tables);
            }
        }
    }
}

fn release(st: &mut State, keys: &[String]) {
    let now = Instant::now();
    for k in keys {
        if let Some(t) = st.tables.get_mut(k) {
            t.users = t.users.saturating_sub(1);
            t.last_used = now;
        }
    }
}
