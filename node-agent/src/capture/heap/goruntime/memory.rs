//! Reading another process's memory without stopping it: `process_vm_readv(2)` (no ptrace
//! attach, no signal, no stop; the kernel only checks ptrace *access*, which CAP_SYS_PTRACE
//! grants), under a byte budget so a corrupt or hostile structure cannot make the agent
//! read without end.
//!
//! Why not `/proc/<pid>/mem`: that file is mode 0600 and owned by the target's user, so on
//! top of the ptrace check the open needs the same user or CAP_DAC_OVERRIDE. The chart's
//! agent runs with only BPF, PERFMON and SYS_PTRACE, and the open failed on the real node
//! with EACCES for every non-root workload. `process_vm_readv` needs the ptrace check
//! alone, and the container runtimes' default seccomp profiles allow it exactly when the
//! container has CAP_SYS_PTRACE.
//!
//! A PID names a process only while that process lives: the [`ProcessHandle`] taken when
//! the process was found (a pidfd) tells after every read whether the process is still
//! that one (a live process keeps its PID), so a reused PID can never mix another
//! process's memory into a profile.

use std::sync::Arc;

use crate::process::handle::ProcessHandle;

/// Why a read failed.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The process's memory cannot be read (process gone, no permission).
    #[error(
        "reading the memory of process {pid}: {source}; the agent needs CAP_SYS_PTRACE (and a \
         seccomp profile that allows process_vm_readv, as the runtimes' defaults do with that \
         capability) to read a process's memory"
    )]
    Open {
        /// The process.
        pid: u32,
        /// The cause.
        source: std::io::Error,
    },
    /// An address could not be read (unmapped, or the process exited).
    #[error("reading {len} bytes at {addr:#x} of process {pid}: {reason}")]
    Read {
        /// The process.
        pid: u32,
        /// Where.
        addr: u64,
        /// How much.
        len: usize,
        /// The cause.
        reason: String,
    },
    /// The byte budget is spent.
    #[error(
        "read budget of {budget} bytes of process {pid} spent; its heap profile is larger than \
         the agent reads (raise the limit, or use the pprof endpoint)"
    )]
    Budget {
        /// The process.
        pid: u32,
        /// The budget.
        budget: u64,
    },
}

/// Read access to one process's memory, counting what it reads.
#[derive(Debug)]
pub struct ProcessMemory {
    pid: u32,
    /// The process as found.
    process: Arc<ProcessHandle>,
    budget: u64,
    /// Bytes read so far.
    pub bytes_read: u64,
}

impl ProcessMemory {
    /// Opens the memory of the process that has PID `pid` now, with at most `budget` bytes
    /// to read. Whether the agent may read it shows at the first read
    /// ([`MemoryError::Open`]).
    pub fn open(pid: u32, budget: u64) -> Result<Self, MemoryError> {
        let process =
            ProcessHandle::open(pid).map_err(|source| MemoryError::Open { pid, source })?;
        Ok(Self::of(Arc::new(process), budget))
    }

    /// The memory of `process` (found earlier), with at most `budget` bytes to read: reads
    /// fail once that process has exited, whatever its PID names then.
    pub fn of(process: Arc<ProcessHandle>, budget: u64) -> Self {
        Self {
            pid: process.pid(),
            process,
            budget,
            bytes_read: 0,
        }
    }

    /// Fills `buf` from `addr`, entirely or not at all.
    pub fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let len = buf.len();
        if self.bytes_read + len as u64 > self.budget {
            return Err(MemoryError::Budget {
                pid: self.pid,
                budget: self.budget,
            });
        }
        self.bytes_read += len as u64;
        let err = |reason: String| MemoryError::Read {
            pid: self.pid,
            addr,
            len,
            reason,
        };
        if addr == 0 || addr > i64::MAX as u64 {
            return Err(err("address out of range".into()));
        }
        let n = match vm_read(self.pid, addr, buf) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EPERM | libc::EACCES | libc::ESRCH)
                ) =>
            {
                return Err(MemoryError::Open {
                    pid: self.pid,
                    source: e,
                });
            }
            Err(e) => return Err(err(e.to_string())),
        };
        if n != len {
            return Err(err(format!("only {n} bytes are mapped there")));
        }
        if !self.same_process() {
            return Err(err("the process exited during the read".into()));
        }
        Ok(())
    }

    /// Whether the PID still names the process opened (it lives: a live process keeps its
    /// PID, so what was just read came from it).
    fn same_process(&self) -> bool {
        self.process.is_alive()
    }

    /// A little-endian u64 at `addr`.
    pub fn u64(&mut self, addr: u64) -> Result<u64, MemoryError> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// A little-endian u32 at `addr`.
    pub fn u32(&mut self, addr: u64) -> Result<u32, MemoryError> {
        let mut b = [0u8; 4];
        self.read(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// A byte at `addr`.
    pub fn u8(&mut self, addr: u64) -> Result<u8, MemoryError> {
        let mut b = [0u8; 1];
        self.read(addr, &mut b)?;
        Ok(b[0])
    }
}

/// `process_vm_readv` of `buf.len()` bytes at `addr` of `pid`; the bytes read.
fn vm_read(pid: u32, addr: u64, buf: &mut [u8]) -> std::io::Result<usize> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: `local` covers exactly `buf`, which we borrow mutably for the call; `remote`
    // is an address in the other process, checked by the kernel.
    let n = unsafe { libc::process_vm_readv(pid, &raw const local, 1, &raw const remote, 1, 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n.cast_unsigned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_memory_and_enforces_the_budget() {
        let value: u64 = 0x1122_3344_5566_7788;
        let addr = &value as *const u64 as u64;
        let mut mem = ProcessMemory::open(std::process::id(), 12).unwrap();
        assert_eq!(mem.u64(addr).unwrap(), value);
        assert_eq!(mem.bytes_read, 8);
        let e = mem.u64(addr).unwrap_err();
        assert!(matches!(e, MemoryError::Budget { .. }), "{e}");
        let mut mem = ProcessMemory::open(std::process::id(), 1 << 20).unwrap();
        assert!(matches!(mem.u64(0), Err(MemoryError::Read { .. })));
        assert!(matches!(mem.u64(8), Err(MemoryError::Read { .. })));
    }

    /// Drops the DAC override capabilities from this thread's effective set (capabilities
    /// are per thread), as the chart's agent runs without them.
    fn drop_dac_caps_of_this_thread() {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        let mut header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let mut data = [Data::default(); 2];
        // SAFETY: header and two data structs, as _LINUX_CAPABILITY_VERSION_3 expects.
        let r = unsafe { libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()) };
        assert_eq!(r, 0, "capget: {}", std::io::Error::last_os_error());
        // CAP_DAC_OVERRIDE = 1, CAP_DAC_READ_SEARCH = 2, CAP_FOWNER = 3.
        data[0].effective &= !((1 << 1) | (1 << 2) | (1 << 3));
        // SAFETY: as above.
        let r = unsafe { libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) };
        assert_eq!(r, 0, "capset: {}", std::io::Error::last_os_error());
    }

    /// The agent's real situation on a node: root with CAP_SYS_PTRACE but without
    /// CAP_DAC_OVERRIDE, reading a workload that runs as another user. `/proc/<pid>/mem`
    /// refuses the open there (mode 0600, another owner); process_vm_readv reads.
    #[test]
    fn reads_another_users_process_without_dac_override() {
        use std::os::unix::process::CommandExt as _;
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test starts a process as another user: run it as root (scripts/test.sh)"
        );
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .uid(65534)
            .gid(65534)
            .spawn()
            .expect("starting sleep as nobody");
        let pid = child.id();
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let addr = maps
            .lines()
            .find(|l| {
                l.split_whitespace()
                    .nth(1)
                    .is_some_and(|p| p.starts_with('r'))
            })
            .and_then(|l| l.split('-').next())
            .and_then(|a| u64::from_str_radix(a, 16).ok())
            .expect("a readable mapping");
        let (mem_open, read) = std::thread::spawn(move || {
            drop_dac_caps_of_this_thread();
            let mem_open = std::fs::File::open(format!("/proc/{pid}/mem")).map(drop);
            let read = ProcessMemory::open(pid, 1 << 20).and_then(|mut m| m.u32(addr));
            (mem_open, read)
        })
        .join()
        .unwrap();
        let _ = child.kill();
        let _ = child.wait();
        let e = mem_open.expect_err("/proc/<pid>/mem opens without CAP_DAC_OVERRIDE");
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        // The first bytes of the executable's first mapping: the ELF magic.
        assert_eq!(read.unwrap().to_le_bytes(), *b"\x7fELF");
    }

    #[test]
    fn a_process_that_exits_is_not_read() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut mem = ProcessMemory::open(pid, 1 << 20).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        let value: u64 = 7;
        // Any address: the process is gone, whatever the PID names now.
        let e = mem.u64(&value as *const u64 as u64).unwrap_err();
        assert!(
            matches!(e, MemoryError::Open { .. } | MemoryError::Read { .. }),
            "{e}"
        );
    }
}
