//! Surviving a workload that truncates a file the agent has mapped.
//!
//! blazesym — symbolization, allocator discovery, build IDs — reads ELF files by mapping
//! them. The files are the workloads' own: a workload that truncates its library while
//! the agent reads the mapping makes the next access past the new end of the file fault
//! with `SIGBUS`, whose default action kills the agent and every capture of the node. The
//! unwinder and the Go runtime reader read with `pread` instead, but blazesym offers no
//! way to symbolize from memory we read, and copying whole binaries (often hundreds of
//! MiB with their debug info) into the agent's memory would trade the crash for an
//! out-of-memory kill. So the fault is handled: [`install`] puts a handler in place that
//! answers a fault *past the end of a mapped file* (`BUS_ADRERR`) by mapping a zero page
//! over the faulting page and returning. The access then reads zeros — what a truncated
//! file holds there anyway — and the parser sees a malformed file, which it reports as
//! such; the frames of that file stay unnamed. The page is mapped read-only, so a write or
//! an instruction fetch there still faults (`SIGSEGV`) as it would have.
//!
//! Every other `SIGBUS` (misaligned access, hardware memory error) goes to the handler that
//! was installed before (the Rust runtime's, which reports stack overflows), or, if none,
//! kills the process as before.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

/// Faults answered with a zero page since the process started.
static FAULTS: AtomicU64 = AtomicU64::new(0);
static PAGE: AtomicUsize = AtomicUsize::new(4096);
static INSTALL: Once = Once::new();
/// The action replaced, called for faults this handler does not answer. Set before the
/// handler is installed (reading it is one atomic load: async-signal-safe).
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Installs the handler (once per process; later calls do nothing).
pub fn install() {
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if let Ok(page) = usize::try_from(page)
            && page.is_power_of_two()
        {
            PAGE.store(page, Ordering::Relaxed);
        }
        // SAFETY: sigaction structs are plain data; all-zero is a valid empty action.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = handler as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
        // SAFETY: reads the current action into `old` without changing it.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &raw mut old) } != 0 {
            return;
        }
        let _ = PREVIOUS.set(old);
        // SAFETY: installs a handler that only makes async-signal-safe calls.
        let installed =
            unsafe { libc::sigaction(libc::SIGBUS, &raw const action, std::ptr::null_mut()) };
        if installed != 0 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "could not install the SIGBUS handler: a workload truncating a file the agent \
                 reads would kill the agent"
            );
        }
    });
}

/// Faults on truncated mapped files answered with zeros since the process started.
pub fn faults() -> u64 {
    FAULTS.load(Ordering::Relaxed)
}

extern "C" fn handler(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code == libc::BUS_ADRERR && addr != 0 {
        let page = PAGE.load(Ordering::Relaxed);
        let start = addr & !(page - 1);
        // SAFETY: replaces exactly the faulting page, which belongs to a file mapping whose
        // file no longer reaches it; mmap is async-signal-safe.
        let mapped = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            FAULTS.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    match PREVIOUS.get().copied() {
        Some(prev) if prev.sa_sigaction == libc::SIG_IGN => {}
        Some(prev)
            if prev.sa_sigaction != libc::SIG_DFL && prev.sa_flags & libc::SA_SIGINFO != 0 =>
        {
            // SAFETY: the previous SA_SIGINFO handler, called as the kernel would.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(prev.sa_sigaction) };
            f(signal, info, context);
        }
        Some(prev) if prev.sa_sigaction != libc::SIG_DFL => {
            // SAFETY: the previous plain handler, called as the kernel would.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(prev.sa_sigaction) };
            f(signal);
        }
        _ => {
            // Back to the default action; returning re-executes the access, which then
            // kills the process as it would have without this handler.
            // SAFETY: sigaction structs are plain data; signal() is async-signal-safe.
            unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::os::fd::AsRawFd as _;

    #[test]
    fn a_read_past_the_end_of_a_truncated_mapped_file_reads_zeros() {
        install();
        let page = PAGE.load(Ordering::Relaxed);
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&vec![0xabu8; 4 * page]).unwrap();
        // SAFETY: a private read-only mapping of our own file, unmapped below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4 * page,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        let bytes = map.cast::<u8>();
        // SAFETY: within the mapping.
        assert_eq!(unsafe { bytes.add(3 * page).read_volatile() }, 0xab);
        file.set_len(page as u64).unwrap();
        let before = faults();
        // SAFETY: within the mapping; the file no longer reaches this page, so the read
        // faults and the handler maps zeros there.
        assert_eq!(unsafe { bytes.add(3 * page).read_volatile() }, 0);
        assert_eq!(unsafe { bytes.read_volatile() }, 0xab);
        assert!(faults() > before);
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(map, 4 * page) };
    }
}
