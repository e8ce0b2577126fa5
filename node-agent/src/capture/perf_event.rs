//! Opening one sampling perf event per online CPU for a BPF program.

use std::fs;
use std::os::fd::{FromRawFd as _, OwnedFd};

use libbpf_rs::libbpf_sys as sys;

use super::{CaptureError, Result};

/// `PERF_FLAG_FD_CLOEXEC` of linux/perf_event.h (libc does not export it).
pub(crate) const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;

/// Which perf event drives the CPU sampler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PerfEventKind {
    /// Software `cpu-clock` (always available, also in VMs).
    #[default]
    CpuClock,
    /// Hardware CPU cycles (needs a PMU).
    Cycles,
}

impl PerfEventKind {
    /// Name as `perf` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::CpuClock => "cpu-clock",
            Self::Cycles => "cycles",
        }
    }
}

/// The online CPUs, from `/sys/devices/system/cpu/online` (e.g. `0-3,6`).
pub fn online_cpus() -> Result<Vec<u32>> {
    let path = "/sys/devices/system/cpu/online";
    let text = fs::read_to_string(path).map_err(|source| CaptureError::Io {
        action: format!("reading {path}"),
        source,
    })?;
    parse_cpu_list(&text).ok_or_else(|| CaptureError::KernelFeature {
        feature: "CPU list".into(),
        detail: format!("expected a list like 0-3 in {path}, found {text:?}"),
    })
}

fn parse_cpu_list(text: &str) -> Option<Vec<u32>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<u32>().ok()?..=b.parse::<u32>().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// Opens a system-wide sampling event on `cpu` at `frequency` Hz.
pub fn open(kind: PerfEventKind, cpu: u32, frequency: u64) -> Result<OwnedFd> {
    // SAFETY: an all-zero perf_event_attr is the documented starting point.
    let mut attr: sys::perf_event_attr = unsafe { std::mem::zeroed() };
    attr.size = std::mem::size_of::<sys::perf_event_attr>() as u32;
    (attr.type_, attr.config) = match kind {
        PerfEventKind::CpuClock => (
            sys::PERF_TYPE_SOFTWARE,
            u64::from(sys::PERF_COUNT_SW_CPU_CLOCK),
        ),
        PerfEventKind::Cycles => (
            sys::PERF_TYPE_HARDWARE,
            u64::from(sys::PERF_COUNT_HW_CPU_CYCLES),
        ),
    };
    attr.__bindgen_anon_1.sample_freq = frequency;
    attr.set_freq(1);
    // SAFETY: valid attr pointer; pid -1 + cpu = all tasks on that CPU.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const sys::perf_event_attr,
            -1i32,
            cpu as i32,
            -1i32,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::EACCES | libc::EPERM) => CaptureError::Privilege {
                action: format!("opening perf event {} on CPU {cpu}", kind.name()),
                found: format!("{err} (kernel.perf_event_paranoid may also forbid it)"),
            },
            Some(libc::ENOENT | libc::EOPNOTSUPP | libc::ENODEV) => CaptureError::KernelFeature {
                feature: format!("perf event {}", kind.name()),
                detail: format!(
                    "the kernel or CPU has no such event ({err}); use --event cpu-clock"
                ),
            },
            Some(libc::EINVAL) => CaptureError::InvalidOptions(format!(
                "the kernel refused a {} event at {frequency} Hz ({err}); check kernel.perf_event_max_sample_rate",
                kind.name()
            )),
            _ => CaptureError::Io {
                action: format!("perf_event_open({}, cpu {cpu})", kind.name()),
                source: err,
            },
        });
    }
    // SAFETY: the syscall returned a fresh descriptor we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_cpu_lists() {
        assert_eq!(super::parse_cpu_list("0-3,6\n"), Some(vec![0, 1, 2, 3, 6]));
        assert_eq!(super::parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(super::parse_cpu_list("x"), None);
    }
}
