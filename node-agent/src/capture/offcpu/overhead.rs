//! The overhead guard of off-CPU profiles: every block of a target thread costs a user
//! stack walk when it starts (and a kernel stack walk and a map update when it ends, if it
//! lasted the minimum block time), paid by the thread itself on its way off the CPU. Before
//! the capture proper the agent counts the targets' blocks in a short first window,
//! projects what they cost against the CPU time the targets used, and refuses when that is
//! above the limit (unless forced), as the eBPF heap source does for its uprobes.

use std::time::Duration;

use crate::capture::CaptureTarget;

/// Cost of one target block (user walk at the switch-out, kernel walk and count update at
/// the switch-in): 1.5-2.4 µs per traced switch with the 1 ms minimum, measured with
/// `kernel.bpf_stats_enabled` by the `offcpu_overhead` benchmark on a 2-vCPU VM
/// (docs/benchmarks.md, "Off-CPU profiles against offcputime").
pub const BLOCK_COST: Duration = Duration::from_nanos(2000);

/// Default `offcpu.maxOverheadPercent`.
pub const DEFAULT_MAX_OVERHEAD_PERCENT: f64 = 3.0;

/// How long the first window lasts (at most half the capture).
pub const GUARD_WINDOW: Duration = Duration::from_secs(1);

/// Below this many blocks in the window the projection is not trusted and never refuses (a
/// nearly idle process has a tiny, noisy CPU time).
pub const MIN_BLOCKS: u64 = 1000;

/// What the first window measured and what it projects.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Projection {
    /// Blocks of the targets per second.
    pub blocks_per_second: f64,
    /// CPU time the targets used per second of the window (CPUs).
    pub target_cpus: f64,
    /// Projected slowdown of the targets' CPU work, in percent.
    pub overhead_percent: f64,
    /// Blocks counted in the window.
    pub blocks: u64,
}

/// Projects the overhead of `blocks` blocks in `window` while the targets used
/// `target_cpu` of CPU time (which includes the program's own time: taken out before
/// dividing).
pub fn project(blocks: u64, window: Duration, target_cpu: Duration) -> Projection {
    let secs = window.as_secs_f64().max(1e-6);
    let cost = blocks as f64 * BLOCK_COST.as_secs_f64();
    let work = (target_cpu.as_secs_f64() - cost).max(1e-6);
    Projection {
        blocks_per_second: blocks as f64 / secs,
        target_cpus: target_cpu.as_secs_f64() / secs,
        overhead_percent: cost / work * 100.0,
        blocks,
    }
}

impl Projection {
    /// Whether a capture with this projection must be refused at `max_percent` (0: never).
    pub fn refuses(&self, max_percent: f64) -> bool {
        max_percent > 0.0 && self.blocks >= MIN_BLOCKS && self.overhead_percent > max_percent
    }

    /// The refusal message: the projection, the limit, and what to do.
    pub fn refusal(&self, max_percent: f64) -> String {
        format!(
            "off-CPU profile refused: the targets block {:.0} times/s on {:.2} CPUs, so the stack \
             walks (~{} ns a block) would add a projected {:.1}% to their CPU time, above \
             maxOverheadPercent {max_percent}%; raise offcpu.maxOverheadPercent (0 turns the guard \
             off; --max-overhead-percent or --force on the agent CLI)",
            self.blocks_per_second,
            self.target_cpus,
            BLOCK_COST.as_nanos(),
            self.overhead_percent
        )
    }
}

/// CPU time the targets' cgroups (with their descendants) have used so far.
pub fn targets_cpu(targets: &[CaptureTarget]) -> Duration {
    let usec: u64 = targets
        .iter()
        .filter_map(|t| std::fs::read_to_string(t.cgroup.path.join("cpu.stat")).ok())
        .filter_map(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum();
    Duration::from_micros(usec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_blocks_on_little_cpu_are_refused_and_the_message_says_what_to_do() {
        // 100k blocks/s on 0.1 CPU: 200 ms of walks a second against 100 ms of work.
        let p = project(100_000, Duration::from_secs(1), Duration::from_millis(300));
        assert!(p.refuses(3.0), "{p:?}");
        let msg = p.refusal(3.0);
        assert!(msg.contains("offcpu.maxOverheadPercent"), "{msg}");
        assert!(!p.refuses(0.0), "0 turns the guard off");
    }

    #[test]
    fn few_blocks_never_refuse() {
        let p = project(10, Duration::from_secs(1), Duration::from_micros(1));
        assert!(!p.refuses(3.0), "{p:?}");
        let busy = project(2000, Duration::from_secs(1), Duration::from_secs(1));
        assert!(!busy.refuses(3.0), "{busy:?}");
    }
}
