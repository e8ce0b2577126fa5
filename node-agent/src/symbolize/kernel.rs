//! Kernel frames: the kernel's text symbols from kallsyms, kept between captures, and the
//! frames of kernel addresses already resolved.

use std::collections::HashMap;
use std::fs;
use std::sync::{Arc, Mutex, PoisonError};

use crate::pprof::{Frame, FrameLine};

/// Most kernel addresses whose frames the agent remembers (kernel text is a few
/// thousand hot functions; an entry is one or two names).
pub const MAX_CACHED_KERNEL_ADDRESSES: usize = 32_768;

/// Kernel frames by address, shared by every capture of this agent.
pub(super) static KERNEL_LINES: std::sync::LazyLock<Mutex<HashMap<u64, Arc<[FrameLine]>>>> =
    std::sync::LazyLock::new(|| Mutex::new(HashMap::new()));

/// The kernel's text symbols from `/proc/kallsyms`, parsed once and kept between
/// captures: a fresh blazesym symbolizer per capture would parse the whole file (120,000+
/// lines) again, 20-60 ms of agent CPU per capture, the largest share of a continuous
/// profile's cost. blazesym's symbolizer
/// cannot be kept across the captures' threads (it is not `Send`), and for the kernel it
/// only reads kallsyms (no vmlinux, so names without lines), which this does in a few
/// lines; kept, the table costs a few MiB. It is read again when it cannot name an
/// address and is older than [`KERNEL_SYMBOLS_REFRESH`] (a module loaded since).
pub(super) struct KernelSymbols {
    /// Sorted text-symbol addresses, and their names.
    addrs: Vec<u64>,
    names: Vec<Arc<str>>,
    loaded: std::time::Instant,
    /// kallsyms listed symbols, all with address 0: the kernel hides their addresses from
    /// this process (see [`hidden_symbols`]).
    hidden: bool,
}

/// Farthest past the last kernel symbol an address is still named after it.
pub(super) const KERNEL_LAST_SYMBOL_REACH: u64 = 1 << 16;

impl KernelSymbols {
    pub(super) fn load() -> Self {
        let text = fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        let listed = text.lines().next().is_some();
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
            hidden: listed && symbols.is_empty(),
            addrs: symbols.iter().map(|&(a, _)| a).collect(),
            names: symbols.iter().map(|&(_, n)| Arc::from(n)).collect(),
            loaded: std::time::Instant::now(),
        }
    }

    /// The symbol `addr` falls in: the last one at or below it.
    pub(super) fn name(&self, addr: u64) -> Option<&Arc<str>> {
        let i = self.addrs.partition_point(|&a| a <= addr).checked_sub(1)?;
        if i + 1 == self.addrs.len() && addr - self.addrs[i] > KERNEL_LAST_SYMBOL_REACH {
            return None;
        }
        self.names.get(i)
    }
}

pub(super) static KERNEL_SYMBOLS: Mutex<Option<KernelSymbols>> = Mutex::new(None);

/// Why the kept kernel symbols have no addresses, when kallsyms hid them from the agent:
/// the kernel shows `/proc/kallsyms` addresses only to `CAP_SYSLOG` (with
/// `kernel.kptr_restrict` 0 also to anyone while `kernel.perf_event_paranoid` is at most
/// 1; with `kptr_restrict` 2 to no one).
pub(super) fn hidden_symbols() -> Option<String> {
    let kept = KERNEL_SYMBOLS
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if !kept.as_ref().is_some_and(|k| k.hidden) {
        return None;
    }
    let sysctl = |name: &str| {
        fs::read_to_string(format!("/proc/sys/kernel/{name}"))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|_| "?".into())
    };
    let kptr = sysctl("kptr_restrict");
    Some(if kptr == "2" {
        "/proc/kallsyms shows no process its addresses (kernel.kptr_restrict=2 on this node)"
            .to_owned()
    } else {
        format!(
            "/proc/kallsyms shows the agent no addresses: it lacks CAP_SYSLOG \
             (kernel.kptr_restrict={kptr}, kernel.perf_event_paranoid={})",
            sysctl("perf_event_paranoid")
        )
    })
}

/// See [`KernelSymbols`].
pub(super) const KERNEL_SYMBOLS_REFRESH: std::time::Duration = std::time::Duration::from_secs(60);

/// The frame lines of each kernel address in `addrs`, from the kept kernel symbols.
pub(super) fn kernel_lines(addrs: &[u64]) -> Vec<Arc<[FrameLine]>> {
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

/// The frame of a kernel function.
pub(super) fn kernel_frame_lines(name: &str) -> Arc<[FrameLine]> {
    Arc::from([FrameLine {
        function: name.to_string(),
        file: "[kernel]".into(),
        line: 0,
    }])
}

/// [`super::StackSymbolizer::kernel_frames`] once the kernel cache is full: cached frames from the
/// cache, the others from `found` (the lines of `missing`, in order).
pub(super) fn kernel_frames_uncached(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_address_is_named_after_the_symbol_it_falls_in() {
        let k = KernelSymbols {
            addrs: vec![0x1000, 0x2000],
            names: vec![Arc::from("first"), Arc::from("second")],
            loaded: std::time::Instant::now(),
            hidden: false,
        };
        assert_eq!(k.name(0xfff), None);
        assert_eq!(k.name(0x1000).map(|n| &**n), Some("first"));
        assert_eq!(k.name(0x1fff).map(|n| &**n), Some("first"));
        assert_eq!(k.name(0x2010).map(|n| &**n), Some("second"));
        // Far past the last symbol: not named after it.
        assert_eq!(k.name(0x2000 + KERNEL_LAST_SYMBOL_REACH + 1), None);
    }
}
