//! The process's CPU sampler: `SIGPROF` at the requested frequency, the interrupted thread's
//! stack unwound in the signal handler into a fixed, preallocated buffer, aggregated by a
//! separate thread.
//!
//! Why not pprof-rs, which this replaced: its sampler keeps a 16,384-entry table of
//! 128-frame stacks, allocated when a profile starts and allocated again when it stops,
//! and never released (a process-wide static). Measured with
//! `cargo bench -p flamefleet-selfprof --bench dump_cost`: one 1 s profile left the process
//! 150 MiB larger, a second one 220 MiB. For a daemon with a memory limit a diagnostic must
//! not cost that. This sampler holds two buffers of [`WORDS`] words (4 MiB in all,
//! allocated once, on the first profile) and aggregates into a map the size of the
//! distinct stacks seen.
//!
//! The handler reads the interrupted program counter and does not unwind when that is
//! inside libgcc (the unwinder itself, whose locks the interrupted code may hold), the
//! dynamic loader (which holds its own while it maps objects) or the vDSO (whose CFI some
//! kernels get wrong); such a sample keeps its one frame. Unlike pprof-rs, it unwinds
//! from inside libc: that is where an I/O-bound process spends its CPU (`open`, `write`,
//! `fsync`), and skipping libc hid who called them. The loader lock libc's
//! `dl_iterate_phdr` holds is recursive, so the handler's unwinder, on the same thread,
//! cannot deadlock on it. Otherwise it unwinds with
//! `backtrace::trace_unsynchronized`, and appends the frames to the active buffer with a
//! compare-and-swap reservation; no allocation, no lock.
//!
//! `ITIMER_PROF` fires at most once per kernel tick: asked for 499 Hz on a kernel with
//! `CONFIG_HZ=250`, it delivers about 250 signals per CPU-second. So a sample does not stand
//! for `1/frequency` of CPU: the profile's CPU time is the process's measured CPU time
//! (`CLOCK_PROCESS_CPUTIME_ID`) over the window, shared among the samples.
//!
//! Buffers are swapped, not shared with the reader: the reader flips the active index,
//! waits until no handler still writes into the old buffer (each handler counts itself in
//! and re-checks the index after counting), reads it and empties it. A buffer that fills
//! up between two reads drops samples and counts them.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant, SystemTime};

use crate::{Error, Result};

/// Words per buffer (2 MiB each).
pub const WORDS: usize = 1 << 18;
/// Deepest stack recorded (frames beyond are cut, root side).
pub const MAX_FRAMES: usize = 128;
/// How often the reader empties the buffers.
const DRAIN_EVERY: Duration = Duration::from_millis(100);

struct Buffer {
    words: Box<[AtomicU64]>,
    /// End of the last reserved record.
    cursor: AtomicUsize,
    /// Handlers writing into this buffer right now.
    writers: AtomicUsize,
}

impl Buffer {
    fn new() -> Self {
        Self {
            words: (0..WORDS).map(|_| AtomicU64::new(0)).collect(),
            cursor: AtomicUsize::new(0),
            writers: AtomicUsize::new(0),
        }
    }
}

struct Shared {
    buffers: [Buffer; 2],
    active: AtomicUsize,
    /// Code ranges where a sample is skipped (see the module documentation).
    blocklist: Vec<(u64, u64)>,
    dropped: AtomicU64,
    skipped: AtomicU64,
}

static SHARED: OnceLock<Shared> = OnceLock::new();
/// Whether the handler records (the handler is installed only while a profile runs, but a
/// signal already pending when it ends must find nothing to do).
static ENABLED: AtomicBool = AtomicBool::new(false);

/// What one profile saw.
#[derive(Debug)]
pub struct Samples {
    /// Sample count per (thread ID, stack leaf first). The leaf is the interrupted
    /// instruction's address plus one and the others return addresses, so every address is
    /// "one past" the instruction it stands for.
    pub stacks: HashMap<(u32, Vec<u64>), i64>,
    /// Thread names by ID, read when the profile ended (threads that exited keep their ID).
    pub thread_names: HashMap<u32, String>,
    /// Samples per second requested.
    pub frequency: u32,
    /// When sampling started.
    pub start: SystemTime,
    /// How long it sampled.
    pub duration: Duration,
    /// CPU time the whole process used while it sampled (`CLOCK_PROCESS_CPUTIME_ID`).
    pub cpu_time: Duration,
    /// Samples lost because a buffer was full.
    pub dropped: u64,
    /// Samples taken inside the blocklisted libraries, recorded with their one frame.
    pub skipped: u64,
}

impl Samples {
    /// The thread's name, or its ID.
    pub fn thread(&self, tid: u32) -> String {
        self.thread_names
            .get(&tid)
            .cloned()
            .unwrap_or_else(|| tid.to_string())
    }
}

/// Executable ranges of the libraries the handler must not unwind from.
fn blocklist() -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    maps.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let range = fields.next()?;
            let perms = fields.next()?;
            let path = fields.nth(3).unwrap_or("");
            let name = path.rsplit('/').next().unwrap_or("");
            let blocked =
                ["libgcc", "ld-linux"].iter().any(|p| name.starts_with(p)) || path == "[vdso]";
            if !perms.contains('x') || !blocked {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            Some((
                u64::from_str_radix(start, 16).ok()?,
                u64::from_str_radix(end, 16).ok()?,
            ))
        })
        .collect()
}

/// The interrupted program counter.
///
/// # Safety
/// `ucontext` is the third argument of an `SA_SIGINFO` handler.
unsafe fn interrupted_pc(ucontext: *mut libc::c_void) -> Option<u64> {
    if ucontext.is_null() {
        return None;
    }
    let uc = ucontext.cast::<libc::ucontext_t>();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the kernel passed a valid ucontext_t (caller's contract).
    let pc = unsafe { (*uc).uc_mcontext.gregs[libc::REG_RIP as usize] as u64 };
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as above.
    let pc = unsafe { (*uc).uc_mcontext.pc };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let pc = {
        let _ = uc;
        return None;
    };
    Some(pc)
}

extern "C" fn on_sigprof(_: libc::c_int, _: *mut libc::siginfo_t, ucontext: *mut libc::c_void) {
    // SAFETY: errno is thread-local; the handler must leave it as it found it.
    let errno = unsafe { *libc::__errno_location() };
    record(ucontext);
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

fn record(ucontext: *mut libc::c_void) {
    if !ENABLED.load(SeqCst) {
        return;
    }
    let Some(shared) = SHARED.get() else {
        return;
    };
    // SAFETY: called from the SA_SIGINFO handler with its ucontext.
    let pc = unsafe { interrupted_pc(ucontext) };
    let mut frames = [0u64; MAX_FRAMES];
    let mut n = 0;
    if let Some(pc) = pc
        && shared.blocklist.iter().any(|&(s, e)| s <= pc && pc < e)
    {
        // Not unwound, but not lost either: the time shows under the library function
        // that used it, as a one-frame stack.
        shared.skipped.fetch_add(1, SeqCst);
        frames[0] = pc.wrapping_add(1);
        append(shared, &frames[..1]);
        return;
    }
    // The first frames are the handler's own and the kernel's signal trampoline; the
    // interrupted code starts at the frame whose address is the interrupted PC.
    let mut found = pc.is_none();
    // SAFETY: no other unwinding is synchronized with; this is the documented use from a
    // signal handler (and pprof-rs'). It does not allocate.
    unsafe {
        backtrace::trace_unsynchronized(|frame| {
            let ip = frame.ip() as u64;
            if ip == 0 {
                return false;
            }
            if !found {
                if Some(ip) != pc {
                    return true;
                }
                found = true;
                // One past, as the return addresses that follow (see `Samples::stacks`).
                frames[n] = ip.wrapping_add(1);
            } else {
                frames[n] = ip;
            }
            n += 1;
            n < MAX_FRAMES
        });
    }
    if n == 0 {
        shared.dropped.fetch_add(1, SeqCst);
        return;
    }
    append(shared, &frames[..n]);
}

/// Appends one stack to the active buffer (from the signal handler).
fn append(shared: &Shared, frames: &[u64]) {
    let n = frames.len();
    // SAFETY: gettid is async-signal-safe.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u64;
    let index = shared.active.load(SeqCst);
    let buffer = &shared.buffers[index];
    buffer.writers.fetch_add(1, SeqCst);
    if shared.active.load(SeqCst) == index {
        let need = n + 2;
        let mut start = buffer.cursor.load(SeqCst);
        let reserved = loop {
            if start + need > WORDS {
                break false;
            }
            match buffer
                .cursor
                .compare_exchange(start, start + need, SeqCst, SeqCst)
            {
                Ok(_) => break true,
                Err(now) => start = now,
            }
        };
        if reserved {
            buffer.words[start].store(n as u64, SeqCst);
            buffer.words[start + 1].store(tid, SeqCst);
            for (i, &ip) in frames.iter().enumerate() {
                buffer.words[start + 2 + i].store(ip, SeqCst);
            }
        } else {
            shared.dropped.fetch_add(1, SeqCst);
        }
    } else {
        // The reader swapped buffers in between: this one is being read.
        shared.dropped.fetch_add(1, SeqCst);
    }
    buffer.writers.fetch_sub(1, SeqCst);
}

/// Moves the records of the buffer that is not active into `stacks`, then empties it.
fn drain(shared: &Shared, stacks: &mut HashMap<(u32, Vec<u64>), i64>) {
    let old = shared.active.load(SeqCst);
    shared.active.store(1 - old, SeqCst);
    let buffer = &shared.buffers[old];
    while buffer.writers.load(SeqCst) != 0 {
        std::thread::yield_now();
    }
    let end = buffer.cursor.load(SeqCst).min(WORDS);
    let mut at = 0;
    while at + 2 <= end {
        let n = buffer.words[at].load(SeqCst) as usize;
        let tid = buffer.words[at + 1].load(SeqCst) as u32;
        if n == 0 || at + 2 + n > end {
            break;
        }
        let stack = buffer.words[at + 2..at + 2 + n]
            .iter()
            .map(|w| w.load(SeqCst))
            .collect();
        *stacks.entry((tid, stack)).or_default() += 1;
        at += 2 + n;
    }
    buffer.cursor.store(0, SeqCst);
}

/// CPU time used by the whole process so far.
fn process_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a plain syscall writing into `ts`.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &raw mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

fn set_timer(frequency: u32) -> Result<()> {
    let micros = if frequency == 0 {
        0
    } else {
        (1_000_000 / i64::from(frequency)).max(1)
    };
    let interval = libc::timeval {
        tv_sec: 0,
        tv_usec: micros as libc::suseconds_t,
    };
    let timer = libc::itimerval {
        it_interval: interval,
        it_value: interval,
    };
    // SAFETY: a plain syscall on valid structs.
    if unsafe { libc::setitimer(libc::ITIMER_PROF, &raw const timer, std::ptr::null_mut()) } != 0 {
        return Err(Error::Profiler(format!(
            "setitimer(ITIMER_PROF): {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

fn set_handler(handler: libc::sighandler_t, flags: libc::c_int) -> Result<()> {
    // SAFETY: installing a handler for SIGPROF with a zeroed, then filled, sigaction.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler;
        action.sa_flags = flags;
        libc::sigemptyset(&raw mut action.sa_mask);
        if libc::sigaction(libc::SIGPROF, &raw const action, std::ptr::null_mut()) != 0 {
            return Err(Error::Profiler(format!(
                "sigaction(SIGPROF): {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

/// Samples the whole process at `frequency` Hz for `duration`, or until `stop` says so
/// (a forced request), calling `on_start` once sampling runs. One at a time per process
/// (the caller serializes).
///
/// # Errors
/// [`Error::Profiler`] when the timer or the handler cannot be set.
pub fn sample(
    frequency: u32,
    duration: Duration,
    stop: &std::sync::mpsc::Receiver<()>,
    on_start: impl FnOnce(),
) -> Result<Samples> {
    let shared = SHARED.get_or_init(|| Shared {
        buffers: [Buffer::new(), Buffer::new()],
        active: AtomicUsize::new(0),
        blocklist: blocklist(),
        dropped: AtomicU64::new(0),
        skipped: AtomicU64::new(0),
    });
    for buffer in &shared.buffers {
        buffer.cursor.store(0, SeqCst);
    }
    let dropped_before = shared.dropped.load(SeqCst);
    let skipped_before = shared.skipped.load(SeqCst);
    let handler = on_sigprof as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void)
        as libc::sighandler_t;
    set_handler(handler, libc::SA_SIGINFO | libc::SA_RESTART)?;
    ENABLED.store(true, SeqCst);
    let started = Instant::now();
    let start = SystemTime::now();
    let cpu_start = process_cpu_time();
    if let Err(e) = set_timer(frequency) {
        ENABLED.store(false, SeqCst);
        let _ = set_handler(libc::SIG_IGN, 0);
        return Err(e);
    }
    on_start();
    let mut stacks = HashMap::new();
    loop {
        let left = duration.saturating_sub(started.elapsed());
        if left.is_zero() {
            break;
        }
        match stop.recv_timeout(left.min(DRAIN_EVERY)) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => drain(shared, &mut stacks),
            _ => break,
        }
    }
    let sampled = started.elapsed();
    let cpu_time = process_cpu_time().saturating_sub(cpu_start);
    let _ = set_timer(0);
    ENABLED.store(false, SeqCst);
    // A SIGPROF still pending would kill the process under the default action.
    let _ = set_handler(libc::SIG_IGN, 0);
    drain(shared, &mut stacks);
    drain(shared, &mut stacks);
    let thread_names = stacks
        .keys()
        .map(|&(tid, _)| tid)
        .collect::<std::collections::HashSet<_>>()
        .into_iter()
        .filter_map(|tid| {
            let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
            Some((tid, comm.trim_end().to_owned()))
        })
        .collect();
    Ok(Samples {
        stacks,
        thread_names,
        frequency,
        start,
        duration: sampled,
        cpu_time,
        dropped: shared.dropped.load(SeqCst) - dropped_before,
        skipped: shared.skipped.load(SeqCst) - skipped_before,
    })
}
