//! Whether the kernel's scheduler clock is stable on this node.
//!
//! runqlat's waits and off-CPU blocks are stamped on the run-queue clock (the scheduler's
//! `sched_info` stamps, `rq->clock`). While the kernel's scheduler clock is stable (a TSC it
//! trusts, kvm-clock with a stable TSC under it, any clock on architectures whose
//! scheduler clock is always stable) that clock is one clock across CPUs. Where the kernel
//! has marked it unstable (on x86, a TSC found unstable at boot, by `tsc=unstable` or by
//! the clocksource watchdog), each CPU's run-queue clock is its own, held within a tick of
//! the last timer tick: a wait or a block that starts on one CPU and ends on another can be
//! off by up to a tick, more after a CPU went without ticks (a descheduled virtual CPU),
//! and a negative difference counts as 0. docs/offcpu.md and docs/capture.md say what that
//! means for the figures.
//!
//! The kernel says so in its log, and only there: the flag itself (`__sched_clock_stable`)
//! is not exported, not even to kallsyms on kernels without `CONFIG_KALLSYMS_ALL`.
//! [`state`] reads the log when the agent may (`/dev/kmsg` needs `CAP_SYSLOG` where
//! `kernel.dmesg_restrict` is 1) and its boot lines are still in it; otherwise it judges
//! from the clocksource: on x86 a clocksource other than the TSC or a paravirtual clock
//! (`hpet`, `acpi_pm`, jiffies) means the kernel does not trust its TSC, which makes a
//! TSC-based scheduler clock unstable.

use std::io::Read as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the agent found about the scheduler clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchedClock {
    /// Stable, or nothing says otherwise.
    Stable,
    /// Unstable; the evidence (the kernel's line, or the clocksource).
    Unstable(String),
}

impl SchedClock {
    /// The capture summary's note for runqlat and off-CPU captures, when unstable.
    pub fn note(&self) -> Option<String> {
        match self {
            Self::Stable => None,
            Self::Unstable(evidence) => Some(format!(
                "the scheduler clock is unstable on this node ({evidence}): waits and blocks \
                 are stamped on per-CPU run-queue clocks that can disagree by a tick or more \
                 across CPUs, so those shorter than a few milliseconds are approximate \
                 (docs/offcpu.md, \"An unstable scheduler clock\")"
            )),
        }
    }
}

/// How long a stable verdict is kept before the log is read again (the watchdog can mark
/// the TSC unstable at any time; an unstable clock never becomes stable again).
const RECHECK: Duration = Duration::from_secs(300);

/// Most kernel log records read (the log is a bounded ring; this bounds a log that keeps
/// growing while it is read).
const MAX_RECORDS: usize = 200_000;

static CACHE: Mutex<Option<(Instant, SchedClock)>> = Mutex::new(None);

/// The scheduler clock's state, judged at most every [`RECHECK`] (reading the kernel log
/// takes a few milliseconds).
pub fn state() -> SchedClock {
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((at, clock)) = cache.as_ref()
        && (matches!(clock, SchedClock::Unstable(_)) || at.elapsed() < RECHECK)
    {
        return clock.clone();
    }
    let clock = detect(kernel_log().as_ref(), current_clocksource().as_deref());
    *cache = Some((Instant::now(), clock.clone()));
    clock
}

/// The kernel log's lines about the clocks, and whether the log still holds its first
/// record (the boot's).
#[derive(Debug, Default)]
struct KernelLog {
    lines: Vec<String>,
    from_boot: bool,
}

/// What the kernel's log and clocksource say (each `None` when unreadable).
fn detect(log: Option<&KernelLog>, clocksource: Option<&str>) -> SchedClock {
    // Only x86 (of the architectures the agent runs on) has an unstable scheduler clock.
    if !cfg!(target_arch = "x86_64") {
        return SchedClock::Stable;
    }
    if let Some(verdict) = log.and_then(from_log) {
        return verdict;
    }
    match clocksource {
        Some(cs @ ("hpet" | "acpi_pm" | "jiffies" | "refined-jiffies" | "pit")) => {
            SchedClock::Unstable(format!(
                "clocksource {cs}, not the TSC: the kernel does not trust this node's TSC"
            ))
        }
        _ => SchedClock::Stable,
    }
}

/// The verdict of the kernel's log: `sched_clock: Marking unstable` when the clock was
/// found unstable after boot; `tsc: Marking TSC unstable` without a later `sched_clock:
/// Marking stable` when the TSC was found unstable before the scheduler clock was
/// judged (a TSC marked unstable on a node whose scheduler clock is paravirtual, and was
/// marked stable, leaves it stable); `sched_clock: Marking stable` alone: stable; a log
/// that holds the whole boot without it: unstable from the start (a paravirtual clock the
/// hypervisor does not call stable). `None` when the log cannot say (its boot lines
/// rotated out).
fn from_log(log: &KernelLog) -> Option<SchedClock> {
    let mut tsc_unstable: Option<&str> = None;
    let mut marked_stable = false;
    for line in &log.lines {
        let line = line.trim();
        if line.starts_with("sched_clock: Marking unstable") {
            return Some(SchedClock::Unstable(format!("the kernel: \"{line}\"")));
        }
        if line.starts_with("sched_clock: Marking stable") {
            marked_stable = true;
            tsc_unstable = None;
        } else if line.starts_with("tsc: Marking TSC unstable") && !marked_stable {
            tsc_unstable = Some(line);
        }
    }
    match (tsc_unstable, marked_stable) {
        (Some(line), _) => Some(SchedClock::Unstable(format!("the kernel: \"{line}\""))),
        (None, true) => Some(SchedClock::Stable),
        (None, false) if log.from_boot => Some(SchedClock::Unstable(
            "the kernel never marked it stable: no \"sched_clock: Marking stable\" in its log \
             since boot"
                .to_owned(),
        )),
        (None, false) => None,
    }
}

/// The clocksource timekeeping uses.
fn current_clocksource() -> Option<String> {
    std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
        .ok()
        .map(|s| s.trim().to_owned())
}

/// The kernel log's lines about the clocks, from `/dev/kmsg` (one record per read,
/// `prio,seq,time,flags;message`); `None` when the agent may not read it.
fn kernel_log() -> Option<KernelLog> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut kmsg = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
        .ok()?;
    let mut log = KernelLog::default();
    let mut record = vec![0u8; 8192];
    for i in 0..MAX_RECORDS {
        match kmsg.read(&mut record) {
            Ok(0) => break,
            Ok(n) => {
                let text = String::from_utf8_lossy(&record[..n]);
                let Some((header, msg)) = text.split_once(';') else {
                    continue;
                };
                if i == 0 {
                    log.from_boot = header.split(',').nth(1) == Some("0");
                }
                if msg.starts_with("sched_clock:") || msg.starts_with("tsc: Marking") {
                    log.lines
                        .push(msg.lines().next().unwrap_or_default().to_owned());
                }
            }
            // EPIPE: a record was overwritten while we read; the next read goes on.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
            // EAGAIN at the end; EPERM and others: not readable.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(_) => return None,
        }
    }
    Some(log)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log that lost its boot records (`from_boot: false`).
    fn lines(l: &[&str]) -> KernelLog {
        KernelLog {
            lines: l.iter().map(|s| (*s).to_owned()).collect(),
            from_boot: false,
        }
    }

    #[test]
    fn the_kernels_lines_decide_and_the_clocksource_judges_without_them() {
        if !cfg!(target_arch = "x86_64") {
            assert_eq!(detect(None, Some("hpet")), SchedClock::Stable);
            return;
        }
        let stable =
            lines(&["sched_clock: Marking stable (444012343, 1453621)->(472143190, -26677226)"]);
        assert_eq!(detect(Some(&stable), Some("tsc")), SchedClock::Stable);
        // The log's verdict over the clocksource's.
        assert_eq!(detect(Some(&stable), Some("hpet")), SchedClock::Stable);
        let after_boot = lines(&[
            "sched_clock: Marking stable (1, 2)->(3, 4)",
            "tsc: Marking TSC unstable due to clocksource watchdog",
            "sched_clock: Marking unstable (5, 6)<-(7, 8)",
        ]);
        let SchedClock::Unstable(why) = detect(Some(&after_boot), Some("hpet")) else {
            panic!("unstable after boot");
        };
        assert!(why.contains("sched_clock: Marking unstable"), "{why}");
        // Found unstable before the scheduler clock was judged: no sched_clock line.
        let at_boot = lines(&["tsc: Marking TSC unstable due to 'tsc=unstable'"]);
        assert!(matches!(
            detect(Some(&at_boot), Some("kvm-clock")),
            SchedClock::Unstable(_)
        ));
        // A TSC marked unstable on a node whose (paravirtual) scheduler clock was marked
        // stable leaves it stable.
        let pv = lines(&[
            "sched_clock: Marking stable (1, 2)->(3, 4)",
            "tsc: Marking TSC unstable due to clocksource watchdog",
        ]);
        assert_eq!(detect(Some(&pv), Some("kvm-clock")), SchedClock::Stable);
        // The whole boot in the log, and never marked stable: a paravirtual clock the
        // hypervisor does not call stable.
        let whole = KernelLog {
            lines: Vec::new(),
            from_boot: true,
        };
        assert!(matches!(
            detect(Some(&whole), Some("kvm-clock")),
            SchedClock::Unstable(_)
        ));
        // The boot lines rotated out, or no CAP_SYSLOG: the clocksource judges.
        assert_eq!(detect(Some(&lines(&[])), Some("tsc")), SchedClock::Stable);
        assert_eq!(detect(None, Some("kvm-clock")), SchedClock::Stable);
        let SchedClock::Unstable(why) = detect(None, Some("hpet")) else {
            panic!("hpet means an untrusted TSC");
        };
        assert!(why.contains("hpet"), "{why}");
        assert!(
            SchedClock::Unstable(why)
                .note()
                .is_some_and(|n| n.contains("docs/offcpu.md"))
        );
    }
}
