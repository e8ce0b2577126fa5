//! The overhead guard of the eBPF allocator source: every allocator call of
//! a probed process pays a uprobe trap while a capture runs, so before the
//! capture proper the agent counts the targets' allocator calls in a short
//! first window, projects what the traps cost against the CPU time the
//! targets used, and refuses when that is above the limit (unless forced).

use std::time::Duration;

/// Cost of one uprobe trap per allocator call, measured on the reference VM
/// (docs/heap.md "Cost": ~0.6 µs with session uprobes).
pub const UPROBE_CALL_COST: Duration = Duration::from_nanos(600);

/// Default `maxOverheadPercent`.
pub const DEFAULT_MAX_OVERHEAD_PERCENT: f64 = 3.0;

/// Below this many calls in the window the projection is not trusted and
/// never refuses (a nearly idle process has a tiny, noisy CPU time).
pub const MIN_CALLS: u64 = 1000;

/// What the first window measured and what it projects.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Projection {
    /// Allocator calls of the targets per second.
    pub calls_per_second: f64,
    /// CPU time the targets used per second of the window (CPUs).
    pub target_cpus: f64,
    /// Projected slowdown of the targets' CPU work, in percent.
    pub overhead_percent: f64,
    /// Calls counted in the window.
    pub calls: u64,
}

/// Projects the overhead of `calls` allocator calls made in `window` while
/// the targets used `target_cpu` of CPU time (which already includes the
/// traps of the window: they are taken out before dividing).
pub fn project(
    calls: u64,
    window: Duration,
    target_cpu: Duration,
    per_call: Duration,
) -> Projection {
    let secs = window.as_secs_f64().max(1e-6);
    let traps = calls as f64 * per_call.as_secs_f64();
    let work = (target_cpu.as_secs_f64() - traps).max(1e-6);
    Projection {
        calls_per_second: calls as f64 / secs,
        target_cpus: target_cpu.as_secs_f64() / secs,
        overhead_percent: traps / work * 100.0,
        calls,
    }
}

impl Projection {
    /// Whether a capture with this projection must be refused at `max_percent`.
    pub fn refuses(&self, max_percent: f64) -> bool {
        self.calls >= MIN_CALLS && self.overhead_percent > max_percent
    }

    /// The refusal message: the projection, the limit, and what to do.
    pub fn refusal(&self, max_percent: f64) -> String {
        format!(
            "eBPF heap sampling refused: the targets make {:.0} allocator calls/s on {:.2} CPUs, \
             so uprobe traps (~{} ns each) would add a projected {:.1}% to their CPU time, above \
             maxOverheadPercent {max_percent}%; raise heap.maxOverheadPercent (0 turns the guard \
             off; --max-overhead-percent or --force on the agent CLI), or use a source that costs \
             nothing per call (endpoint, goruntime)",
            self.calls_per_second,
            self.target_cpus,
            UPROBE_CALL_COST.as_nanos(),
            self.overhead_percent
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn projects_trap_cost_against_the_targets_cpu_time() {
        // 1 M calls/s on one busy CPU: 0.6 s of traps per 1 s, 0.4 s of work.
        let p = project(
            300_000,
            Duration::from_millis(300),
            Duration::from_millis(300),
            UPROBE_CALL_COST,
        );
        assert!((p.calls_per_second - 1e6).abs() < 1.0);
        assert!((p.overhead_percent - 150.0).abs() < 0.01, "{p:?}");
        assert!(p.refuses(3.0));
        let msg = p.refusal(3.0);
        assert!(
            msg.contains("150.0%") && msg.contains("maxOverheadPercent 3%"),
            "{msg}"
        );
        // 18 k calls per CPU-second (a typical service): ~1%.
        let p = project(
            5_400,
            Duration::from_millis(300),
            Duration::from_millis(300),
            UPROBE_CALL_COST,
        );
        assert!((p.overhead_percent - 1.09).abs() < 0.01, "{p:?}");
        assert!(!p.refuses(3.0));
        // Too few calls to judge: never refused.
        let p = project(
            10,
            Duration::from_millis(300),
            Duration::from_micros(10),
            UPROBE_CALL_COST,
        );
        assert!(!p.refuses(3.0), "{p:?}");
    }
}
