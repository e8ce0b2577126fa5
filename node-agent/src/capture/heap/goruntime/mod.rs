//! The Go runtime heap source: reads the heap profile a Go program keeps in
//! its own memory (the runtime samples allocations every `MemProfileRate`
//! bytes into `runtime.mbuckets`) — no endpoint, no code change, no
//! uprobes, and the process is never stopped.
//!
//! - [`binary`]: is the process a Go program, which version, where are the
//!   runtime globals (symbol table; build info for the version);
//! - [`locate`]: the runtime globals of a binary without a symbol table, from the code of
//!   the runtime functions that use them;
//! - [`layout`]: the verified record layout per Go version (others refused);
//! - [`memory`]: bounded `process_vm_readv` reads of the target's memory;
//! - [`buckets`]: the validated, cycle-consistent walk of the bucket list;
//! - [`profile`]: the pprof profile, as `runtime/pprof` writes it.
//!
//! What it reports is what `/debug/pprof/heap` would: the heap as of the last
//! completed GC cycle.

pub mod binary;
pub mod buckets;
pub mod layout;
pub mod locate;
pub mod memory;
pub mod profile;

use std::path::PathBuf;
use std::sync::Arc;

use self::binary::{BinaryError, GoBinary};
use self::buckets::{Globals, HeldBudget, Walk, WalkError, WalkLimits};
use self::layout::{Layout, LayoutError};
use self::memory::{MemoryError, ProcessMemory};
use crate::cgroup::Cgroup;
use crate::process::files::{self, TargetFile, TargetFileError};
use crate::process::handle::ProcessHandle;

/// Default byte budget of one process's read (headers, stacks and records
/// of ~100k buckets).
pub const DEFAULT_READ_BUDGET: u64 = 256 << 20;

/// Why a Go process's heap cannot be read. Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum GoHeapError {
    /// The executable could not be found or parsed.
    #[error(transparent)]
    Binary(#[from] BinaryError),
    /// Its Go version is not in the layout table.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// No symbol table, and the globals were not found from the code either.
    #[error(
        "{version} binary {path} has no symbol table (-ldflags=-s) and the runtime's heap \
         profile could not be located from its code: {why}; build without -s, serve \
         net/http/pprof, or use the eBPF source for its C allocations"
    )]
    Stripped {
        /// Go version.
        version: String,
        /// The binary.
        path: PathBuf,
        /// What the search of the code found instead.
        why: String,
    },
    /// The linker disabled memory profiling.
    #[error(
        "{version} program keeps no heap samples: nothing in it can call runtime.MemProfile (no \
         reachable use of runtime/pprof's heap profile or net/http/pprof; a blank import of \
         runtime/pprof is not enough), so the linker set runtime.disableMemoryProfiling and the \
         runtime set MemProfileRate=0 at start; serve net/http/pprof (`import _ \
         \"net/http/pprof\"` with an HTTP server) or write a heap profile somewhere in the \
         program to profile its heap"
    )]
    ProfilingDisabled {
        /// Go version.
        version: String,
    },
    /// The program turned sampling off.
    #[error(
        "{version} program keeps no heap samples: runtime.MemProfileRate is 0 (set by the \
         program or GODEBUG=memprofilerate=0)"
    )]
    RateZero {
        /// Go version.
        version: String,
    },
    /// A value read makes no sense.
    #[error("{0}")]
    Invalid(String),
    /// Reading memory failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The bucket walk failed.
    #[error(transparent)]
    Walk(#[from] WalkError),
    /// The process found at the start exited before it was read.
    #[error(
        "process {pid} exited before its heap was read (its PID may name another process \
         now, which is not read in its place)"
    )]
    Exited {
        /// The PID it had.
        pid: u32,
    },
    /// The process moved out of the target.
    #[error("process {pid} left {} before its heap was read: not attributed to it", cgroup.display())]
    LeftTarget {
        /// The process.
        pid: u32,
        /// The target's cgroup.
        cgroup: PathBuf,
    },
}

/// A Go process found readable, with what is needed to read it.
#[derive(Debug, Clone)]
pub struct GoProcess {
    /// Process ID.
    pub pid: u32,
    /// The process as found: reads fail once it has exited, whatever its PID names then.
    pub process: Arc<ProcessHandle>,
    /// The binary.
    pub binary: GoBinary,
    /// The record layout of its version.
    pub layout: &'static Layout,
    /// Globals in its address space.
    pub globals: Globals,
    /// `runtime.MemProfileRate` when probed.
    pub rate: i64,
}

/// The executable of `pid`: the file it runs (`/proc/<pid>/exe`, see
/// [`files::open_exe`]), named by its path inside the process's mount namespace.
fn executable(pid: u32) -> Result<TargetFile, BinaryError> {
    let mut file = files::open_exe(pid).map_err(|e| match e {
        TargetFileError::Open { path, source, .. } => BinaryError::Open {
            path: path.into(),
            source,
        },
        other => BinaryError::Elf {
            path: format!("/proc/{pid}/exe").into(),
            reason: other.to_string(),
        },
    })?;
    if let Ok(target) = std::fs::read_link(format!("/proc/{pid}/exe")) {
        file.path = target.display().to_string();
    }
    Ok(file)
}

/// The Go version of `pid`'s executable, when it is a Go program.
pub fn go_version(pid: u32) -> Option<String> {
    let exe = executable(pid).ok()?;
    binary::inspect(&exe).ok()?.map(|b| b.version)
}

/// Looks at `pid`: `Ok(None)` when it is not a Go program; the process when
/// its heap profile can be read; otherwise why not. The process is held from here on
/// ([`GoProcess::process`]).
pub fn probe(pid: u32) -> Result<Option<GoProcess>, GoHeapError> {
    let process =
        Arc::new(ProcessHandle::open(pid).map_err(|source| MemoryError::Open { pid, source })?);
    let exe = executable(pid)?;
    let Some(bin) = binary::inspect(&exe)? else {
        return Ok(None);
    };
    let (_, layout) = layout::layout_for(&bin.version)?;
    let syms = match &bin.symbols {
        Ok(syms) => *syms,
        Err(why) => {
            return Err(GoHeapError::Stripped {
                version: bin.version.clone(),
                path: bin.path.clone(),
                why: why.clone(),
            });
        }
    };
    let bias = binary::load_bias(pid, &bin).ok_or_else(|| {
        GoHeapError::Invalid(format!(
            "{} is position-independent but its first page is not in /proc/{pid}/maps",
            bin.path.display()
        ))
    })?;
    let mut mem = ProcessMemory::of(process.clone(), 64);
    let rate = mem.u64(syms.mem_profile_rate + bias)? as i64;
    let flag = mem.u8(syms.disable_memory_profiling + bias)?;
    let disabled = flag != 0;
    if rate == 0 {
        return Err(if disabled {
            GoHeapError::ProfilingDisabled {
                version: bin.version.clone(),
            }
        } else {
            GoHeapError::RateZero {
                version: bin.version.clone(),
            }
        });
    }
    if rate < 0 {
        return Err(GoHeapError::Invalid(format!(
            "runtime.MemProfileRate of process {pid} is {rate}; expected a positive rate"
        )));
    }
    // Found from the code: the flag the linker sets is a bool, and a program that can read
    // its heap profile has the runtime functions the buckets were found in.
    if bin.from_code && flag > 1 {
        return Err(GoHeapError::Invalid(format!(
            "runtime.disableMemoryProfiling of process {pid}, found from the code of {}, is \
             not a bool: the globals found are not the runtime's",
            bin.path.display()
        )));
    }
    if syms.mbuckets == 0 || syms.mprof_cycle == 0 {
        return Err(GoHeapError::Stripped {
            version: bin.version.clone(),
            path: bin.path.clone(),
            why: format!(
                "MemProfileRate is {rate} but runtime.memProfileInternal, where the profile \
                 buckets are found, is not in the binary"
            ),
        });
    }
    // The executable, the maps and the globals were found by PID: they are this process's
    // only if it still lives.
    if !process.is_alive() {
        return Err(GoHeapError::Exited { pid });
    }
    Ok(Some(GoProcess {
        pid,
        process,
        globals: Globals {
            mbuckets: syms.mbuckets + bias,
            mprof_cycle: syms.mprof_cycle + bias,
        },
        binary: bin,
        layout,
        rate,
    }))
}

impl GoProcess {
    /// Reads the heap profile buckets, never stopping the process; returns them and the
    /// bytes read. The buckets kept count against `held`, shared by every Go process of a
    /// capture. Fails when the process found by [`probe`] has exited (its PID may name
    /// another process now).
    pub fn read(
        &self,
        budget: u64,
        limits: WalkLimits,
        held: &mut HeldBudget,
    ) -> Result<(Walk, u64), GoHeapError> {
        if !self.process.is_alive() {
            return Err(GoHeapError::Exited { pid: self.pid });
        }
        let mut mem = ProcessMemory::of(self.process.clone(), budget);
        let walk = buckets::walk(&mut mem, self.layout, self.globals, limits, held)?;
        Ok((walk, mem.bytes_read))
    }

    /// Why what was read of this process must not be attributed to the target of
    /// `cgroup`: it exited (its PID may name another process now) or left the cgroup.
    pub fn unattributable(&self, cgroup: &Cgroup) -> Option<GoHeapError> {
        if self.process.in_cgroup(cgroup) {
            return None;
        }
        Some(if self.process.is_alive() {
            GoHeapError::LeftTarget {
                pid: self.pid,
                cgroup: cgroup.path.clone(),
            }
        } else {
            GoHeapError::Exited { pid: self.pid }
        })
    }
}
