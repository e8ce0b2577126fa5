//! Reading another process's memory without stopping it: positioned reads of
//! `/proc/<pid>/mem` (no ptrace attach, no signal, no stop; the kernel only
//! checks ptrace *access*), under a byte budget so a corrupt or hostile
//! structure cannot make the agent read without end.

use std::fs::File;
use std::os::unix::fs::FileExt as _;

/// Why a read failed.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// `/proc/<pid>/mem` could not be opened (process gone, no permission).
    #[error(
        "opening /proc/{pid}/mem: {source}; the agent needs CAP_SYS_PTRACE (or root) to read a \
         process's memory"
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
    file: File,
    budget: u64,
    /// Bytes read so far.
    pub bytes_read: u64,
}

impl ProcessMemory {
    /// Opens `pid`'s memory with at most `budget` bytes to read.
    pub fn open(pid: u32, budget: u64) -> Result<Self, MemoryError> {
        let file = File::open(format!("/proc/{pid}/mem"))
            .map_err(|source| MemoryError::Open { pid, source })?;
        Ok(Self {
            pid,
            file,
            budget,
            bytes_read: 0,
        })
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
        self.file
            .read_exact_at(buf, addr)
            .map_err(|e| err(e.to_string()))
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
}
