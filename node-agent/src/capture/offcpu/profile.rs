//! What an off-CPU capture produced: blocked time per thread and stack, symbolized into a
//! pprof profile, a text report, and the summary's top blocking kernel functions.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use flamefleet_proto::pprof::Profile;

use super::{OffcpuOptions, OffcpuStats};
use crate::capture::CaptureTarget;
use crate::capture::cpu::CpuSamples;
use crate::pprof::{Frame, FrameLine, Label, ProfileBuilder};
use crate::python::{self, PyFrame, PyProcessStatus, PyStats};
use crate::symbolize::StackSymbolizer;
use crate::unwind::{UnwinderStats, WalkStats};

/// One thread's blocks under one pair of stacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffcpuSample {
    /// Index into [`OffcpuSamples::targets`].
    pub target: usize,
    /// Process ID.
    pub tgid: u32,
    /// Thread ID.
    pub pid: u32,
    /// Thread name when it ran again.
    pub comm: String,
    /// User stack when it blocked, leaf first (empty for kernel threads).
    pub user_stack: Vec<u64>,
    /// Kernel stack when it blocked, leaf first (empty when not captured).
    pub kernel_stack: Vec<u64>,
    /// Python frames when it blocked (leaf first) of a CPython process's thread; empty
    /// otherwise.
    pub python: Vec<PyFrame>,
    /// Time blocked, from switching out to being woken.
    pub blocked_ns: u64,
    /// Number of blocks.
    pub blocks: u64,
    /// Time then spent runnable, waiting for a CPU (runqlat's; not off-CPU time here).
    pub queued_ns: u64,
}

/// A target's blocks below the minimum block time: counted, never walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShortBlocks {
    /// Index into [`OffcpuSamples::targets`].
    pub target: usize,
    /// Time blocked.
    pub blocked_ns: u64,
    /// Number of blocks.
    pub blocks: u64,
    /// Time then spent runnable, waiting for a CPU.
    pub queued_ns: u64,
}

/// The result of an off-CPU capture, before symbolization.
#[derive(Debug, Clone)]
pub struct OffcpuSamples {
    /// The capture's targets.
    pub targets: Vec<CaptureTarget>,
    /// Blocks at or above the minimum, per thread and stacks.
    pub samples: Vec<OffcpuSample>,
    /// Blocks below the minimum, per target.
    pub short: Vec<ShortBlocks>,
    /// The sampler's counters over the window (all targets of the node).
    pub stats: OffcpuStats,
    /// Blocks whose user stack was removed from the stack map before they ended (a block
    /// that spanned two other captures' ends on a shared sampler).
    pub expired_user_stacks: u64,
    /// How user stacks were walked during the window (all targets of the node).
    pub walk: WalkStats,
    /// The Python processes that blocked, and whether their frames were read.
    pub python: Vec<PyProcessStatus>,
    /// How Python frames were read at switch-outs during the window (all targets of the
    /// node).
    pub py_stats: PyStats,
    /// The unwind tables' state at the end (`None` without CFI unwinding).
    pub unwinder: Option<UnwinderStats>,
    /// The sampler's effective options.
    pub options: OffcpuOptions,
    /// Wall-clock start.
    pub started: SystemTime,
    /// Capture length.
    pub duration: Duration,
}

/// The name of the frame standing for the blocks below the minimum.
pub fn short_blocks_frame(min_block: Duration) -> String {
    format!(
        "[blocks under {}, not walked]",
        humantime::format_duration(min_block)
    )
}

/// Kernel functions that only hand the CPU over: the frame below them says why a thread
/// blocked.
fn is_scheduler_frame(name: &str) -> bool {
    const PREFIXES: [&str; 6] = [
        "__schedule",
        "schedule",
        "io_schedule",
        "preempt_schedule",
        "__cond_resched",
        "__switch_to",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Why a thread blocked: the first kernel frame, leaf first, that is not the scheduler's.
pub fn blocking_function(kernel: &[Frame]) -> Option<&str> {
    kernel
        .iter()
        .filter_map(|f| f.lines.last().map(|l| l.function.as_str()))
        .find(|name| !is_scheduler_frame(name))
}

impl OffcpuSamples {
    /// The summary's `runtimes` lines, as the CPU summary's: one per Python process that
    /// blocked, and one when Python frame chains were cut or unreadable.
    pub fn runtimes(&self) -> Vec<String> {
        let mut lines: Vec<String> = self.python.iter().map(ToString::to_string).collect();
        lines.extend(self.py_stats.damage());
        lines
    }

    /// Total time blocked, walked and short blocks together.
    pub fn blocked_ns(&self) -> u64 {
        self.samples.iter().map(|s| s.blocked_ns).sum::<u64>()
            + self.short.iter().map(|s| s.blocked_ns).sum::<u64>()
    }

    /// Total number of blocks, walked and short together.
    pub fn blocks(&self) -> u64 {
        self.samples.iter().map(|s| s.blocks).sum::<u64>()
            + self.short.iter().map(|s| s.blocks).sum::<u64>()
    }

    /// Total time the woken threads then waited for a CPU.
    pub fn queued_ns(&self) -> u64 {
        self.samples.iter().map(|s| s.queued_ns).sum::<u64>()
            + self.short.iter().map(|s| s.queued_ns).sum::<u64>()
    }

    /// Symbolizes the frames no capture has symbolized yet (see
    /// `CpuSamples::warm_symbols`).
    pub fn warm_symbols(&self, symbolizer: &mut StackSymbolizer) -> usize {
        symbolizer.warm_threads(
            self.targets.iter().map(|t| t.cgroup.clone()),
            self.samples
                .iter()
                .map(|s| (s.tgid, &s.user_stack[..], &s.kernel_stack[..])),
        )
    }

    /// Symbolizes and builds the pprof profile: sample types `off_cpu/nanoseconds` and
    /// `blocks/count`, labels as CPU profiles (namespace, pod, container, node, cgroup, pid,
    /// thread, comm), and the blocks below the minimum under one frame per target.
    /// Also returns the top blocking kernel functions by time blocked.
    pub fn to_profile(&self, symbolizer: &mut StackSymbolizer, node: &str) -> OffcpuProfile {
        self.build(symbolizer, node, None)
    }

    /// The wall-clock view (docs/offcpu.md, "`wall`"): these blocks and `on_cpu`'s samples
    /// (a CPU capture of the same targets over the same window) in one profile, whose sample
    /// types are `wall/nanoseconds` (the default: on-CPU plus off-CPU time),
    /// `on_cpu/nanoseconds` (samples times the sampling period), `off_cpu/nanoseconds`,
    /// `blocks/count` and `samples/count`; label `state` says which a sample is
    /// (`on_cpu`, `off_cpu`). The run-queue time stays out, as in off-CPU profiles.
    pub fn to_wall_profile(
        &self,
        on_cpu: &CpuSamples,
        symbolizer: &mut StackSymbolizer,
        node: &str,
    ) -> OffcpuProfile {
        self.build(symbolizer, node, Some(on_cpu))
    }

    fn build(
        &self,
        symbolizer: &mut StackSymbolizer,
        node: &str,
        on_cpu: Option<&CpuSamples>,
    ) -> OffcpuProfile {
        let mut b = match on_cpu {
            None => ProfileBuilder::new(&[("off_cpu", "nanoseconds"), ("blocks", "count")]),
            Some(_) => ProfileBuilder::new(&[
                ("wall", "nanoseconds"),
                ("on_cpu", "nanoseconds"),
                ("off_cpu", "nanoseconds"),
                ("blocks", "count"),
                ("samples", "count"),
            ]),
        };
        // Values in the order of the sample types above, from (off-CPU ns, blocks).
        let off_values = |blocked_ns: u64, blocks: u64| match on_cpu {
            None => vec![ns(blocked_ns), ns(blocks)],
            Some(_) => vec![ns(blocked_ns), 0, ns(blocked_ns), ns(blocks), 0],
        };
        let state = |labels: &mut Vec<Label>, value: &str| {
            if on_cpu.is_some() {
                labels.push(Label::Str("state".to_owned(), value.to_owned()));
            }
        };
        match on_cpu {
            None => {
                b.period("off_cpu", "nanoseconds", 1);
                b.default_sample_type("off_cpu");
            }
            Some(_) => {
                b.period("wall", "nanoseconds", 1);
                b.default_sample_type("wall");
            }
        }
        b.window(self.started, self.duration);
        // The samples come from the targets: a process without a snapshot is read now only
        // if it is still there (its PID may have gone to another process).
        symbolizer.confine_to(self.targets.iter().map(|t| t.cgroup.clone()));
        let s = &self.stats;
        b.comment(&format!(
            "off-CPU: blocked {:.3} s in {} blocks, then {:.3} s runnable waiting for a CPU \
             (run-queue time, not counted as off-CPU); blocks under {} counted, not walked: {}",
            self.blocked_ns() as f64 / 1e9,
            self.blocks(),
            self.queued_ns() as f64 / 1e9,
            humantime::format_duration(self.options.min_block),
            self.short.iter().map(|s| s.blocks).sum::<u64>(),
        ));
        b.comment(&format!(
            "drops: counts_full={} stamp_full={} kernel_stack={} notify={} expired_user_stack={}; \
             stale={}",
            s.counts_full,
            s.stamp_full,
            s.kernel_stack,
            s.notify,
            self.expired_user_stacks,
            s.stale
        ));
        let mut blocking: HashMap<String, u64> = HashMap::new();
        for s in &self.samples {
            let user = python::splice(
                symbolizer.user_frames(&mut b, s.tgid, &s.user_stack),
                &s.python,
            );
            let mut frames = symbolizer.kernel_frames(&mut b, &s.kernel_stack);
            if let Some(name) = blocking_function(&frames) {
                *blocking.entry(name.to_owned()).or_default() += s.blocked_ns;
            }
            frames.extend(user);
            let target = self.targets.get(s.target);
            let mut labels = crate::capture::thread_labels(target, node, s.tgid, s.pid, &s.comm);
            state(&mut labels, "off_cpu");
            symbolizer.account(&frames, s.blocks);
            b.add_sample(&frames, &off_values(s.blocked_ns, s.blocks), &labels);
        }
        let name = short_blocks_frame(self.options.min_block);
        for s in &self.short {
            let frame = Frame {
                address: 0,
                mapping: None,
                lines: vec![FrameLine {
                    function: name.clone(),
                    file: String::new(),
                    line: 0,
                }],
            };
            let mut labels = crate::capture::target_labels(self.targets.get(s.target), node);
            state(&mut labels, "off_cpu");
            b.add_sample(&[frame], &off_values(s.blocked_ns, s.blocks), &labels);
        }
        if let Some(cpu) = on_cpu {
            let period = crate::pprof::nanos_per_sample(cpu.options.frequency);
            b.comment(&format!(
                "on-CPU: {} samples at {} Hz ({}), {:.3} s at {period} ns a sample; drops: {}",
                cpu.total(),
                cpu.options.frequency,
                cpu.options.event.name(),
                cpu.total() as f64 * period as f64 / 1e9,
                cpu.drops.total()
            ));
            for s in &cpu.samples {
                let frames = s.frames(symbolizer, &mut b);
                let target = cpu.targets.get(s.target);
                let mut labels =
                    crate::capture::thread_labels(target, node, s.tgid, s.pid, &s.comm);
                state(&mut labels, "on_cpu");
                let n = ns(s.count);
                let on = n.saturating_mul(period);
                symbolizer.account(&frames, s.count);
                b.add_sample(&frames, &[on, on, 0, 0, n], &labels);
            }
        }
        for c in symbolizer.comments("blocks") {
            b.comment(&c);
        }
        b.comment(&self.walk.comment());
        if self.py_stats.samples > 0 || !self.python.is_empty() {
            b.comment(&self.py_stats.comment_of("blocks"));
        }
        for p in &self.python {
            b.comment(&p.to_string());
        }
        let mut top: Vec<(String, u64)> = blocking.into_iter().collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        OffcpuProfile {
            profile: b.build(),
            top_blocking: top,
            on_cpu_ns: on_cpu.map_or(0, |c| {
                c.total()
                    .saturating_mul(crate::pprof::nanos_per_sample(c.options.frequency) as u64)
            }),
        }
    }
}

/// A u64 total as a pprof value (saturating).
fn ns(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// An off-CPU profile and what its summary needs.
#[derive(Debug, Clone)]
pub struct OffcpuProfile {
    /// The pprof profile.
    pub profile: Profile,
    /// Kernel functions the targets blocked in (the first frame below the scheduler's),
    /// by time blocked, most first.
    pub top_blocking: Vec<(String, u64)>,
    /// The wall-clock view's on-CPU time (its `on_cpu/nanoseconds` total); 0 in an off-CPU
    /// profile.
    pub on_cpu_ns: u64,
}

impl OffcpuProfile {
    /// A text report: totals, the top blocking kernel functions and the top stacks.
    pub fn text(&self, samples: &OffcpuSamples, top: usize) -> String {
        // A wall-clock profile's first sample type is wall time: on-CPU plus blocked.
        let total = (samples.blocked_ns() + self.on_cpu_ns).max(1) as f64;
        let mut out = String::new();
        if self.on_cpu_ns > 0 {
            let _ = writeln!(
                out,
                "wall: {:.3} s on CPU ({:.2}%) and {:.3} s blocked ({:.2}%)",
                self.on_cpu_ns as f64 / 1e9,
                self.on_cpu_ns as f64 * 100.0 / total,
                samples.blocked_ns() as f64 / 1e9,
                samples.blocked_ns() as f64 * 100.0 / total
            );
        }
        let _ = writeln!(
            out,
            "off-CPU: {:.3} s blocked in {} blocks over {:.1?} ({} walked, {} under {} only \
             counted); then {:.3} s waiting for a CPU; lost {}",
            samples.blocked_ns() as f64 / 1e9,
            samples.blocks(),
            samples.duration,
            samples.samples.iter().map(|s| s.blocks).sum::<u64>(),
            samples.short.iter().map(|s| s.blocks).sum::<u64>(),
            humantime::format_duration(samples.options.min_block),
            samples.queued_ns() as f64 / 1e9,
            samples.stats.lost(),
        );
        out.push_str("top blocking kernel functions:\n");
        for (name, ns) in self.top_blocking.iter().take(top) {
            let _ = writeln!(
                out,
                "{:>12.3} ms {:>6.2}%  {name}",
                *ns as f64 / 1e6,
                *ns as f64 * 100.0 / total
            );
        }
        out.push_str(if self.on_cpu_ns > 0 {
            "top stacks by wall time (root first; user frames, then kernel):\n"
        } else {
            "top blocking stacks (root first; user frames, then kernel):\n"
        });
        let frames = crate::pprof::read::Frames::new(&self.profile);
        let mut stacks: HashMap<Vec<String>, i64> = HashMap::new();
        for s in &self.profile.sample {
            *stacks
                .entry(frames.root_to_leaf(&s.location_id))
                .or_default() += s.value.first().copied().unwrap_or(0);
        }
        let mut rows: Vec<_> = stacks.into_iter().collect();
        rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        for (stack, ns) in rows.into_iter().take(top) {
            let _ = writeln!(
                out,
                "{:>12.3} ms {:>6.2}%  {}",
                ns as f64 / 1e6,
                ns as f64 * 100.0 / total,
                stack.join(";")
            );
        }
        out
    }
}
