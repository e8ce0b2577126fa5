//! What a CPU capture produced: aggregated samples, symbolized into a pprof profile.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use flamefleet_proto::pprof::Profile;

use super::{CpuDrops, CpuOptions};
use crate::capture::CaptureTarget;
use crate::pprof::{Frame, Label, ProfileBuilder};
use crate::python::{self, PyFrame, PyProcessStatus, PyStats};
use crate::symbolize::StackSymbolizer;
use crate::trigger::fire_lead_ups::LeadUp;
use crate::unwind::{UnwinderStats, WalkStats};

/// One aggregated CPU sample: a thread, its stacks, and how often it was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuSample {
    /// Index into [`CpuSamples::targets`].
    pub target: usize,
    /// Process ID.
    pub tgid: u32,
    /// Thread ID.
    pub pid: u32,
    /// Thread name at sampling time.
    pub comm: String,
    /// User stack, leaf first (empty for kernel threads).
    pub user_stack: Vec<u64>,
    /// Kernel stack, leaf first (empty when not captured).
    pub kernel_stack: Vec<u64>,
    /// Python frames (leaf first) of a CPython process's thread; empty otherwise.
    pub python: Vec<PyFrame>,
    /// Number of samples.
    pub count: u64,
}

impl CpuSample {
    /// The sample's frames, leaf first: kernel, then user with the Python frames spliced
    /// in, symbolized, their mappings registered in `b`.
    pub fn frames(&self, symbolizer: &mut StackSymbolizer, b: &mut ProfileBuilder) -> Vec<Frame> {
        // User frames first: pprof takes mapping 1 as the main binary.
        let user = python::splice(
            symbolizer.user_frames(b, self.tgid, &self.user_stack),
            &self.python,
        );
        let mut frames = symbolizer.kernel_frames(b, &self.kernel_stack);
        frames.extend(user);
        frames
    }
}

/// The result of a CPU capture, before symbolization.
#[derive(Debug, Clone)]
pub struct CpuSamples {
    /// The capture's targets.
    pub targets: Vec<CaptureTarget>,
    /// Aggregated samples.
    pub samples: Vec<CpuSample>,
    /// Losses during the capture window.
    pub drops: CpuDrops,
    /// How user stacks were walked during the window (all targets of the node).
    pub walk: WalkStats,
    /// The Python processes sampled, and whether their frames were read.
    pub python: Vec<PyProcessStatus>,
    /// How Python frames were read during the window (all targets of the node).
    pub py_stats: PyStats,
    /// The unwind tables' state at the end (`None` without CFI unwinding).
    pub unwinder: Option<UnwinderStats>,
    /// The sampler's effective options (frequency, event).
    pub options: CpuOptions,
    /// Wall-clock start.
    pub started: SystemTime,
    /// Capture length.
    pub duration: Duration,
}

impl CpuSamples {
    /// The summary's `runtimes` lines: one per Python process sampled, and one when
    /// Python frame chains were cut or unreadable.
    pub fn runtimes(&self) -> Vec<String> {
        let mut lines: Vec<String> = self.python.iter().map(ToString::to_string).collect();
        lines.extend(self.py_stats.damage());
        lines
    }

    /// Total number of samples.
    pub fn total(&self) -> u64 {
        self.samples.iter().map(|s| s.count).sum()
    }

    /// Symbolizes the frames of these samples that no capture has symbolized yet and
    /// keeps them in the symbolizer's caches, building no profile; a frame already
    /// cached costs a lookup. Returns the frames it symbolized. Run during a capture's
    /// window on [`super::CpuCapture::peek`]'s samples, so that [`Self::to_profile`] after the
    /// window finds them cached.
    pub fn warm_symbols(&self, symbolizer: &mut StackSymbolizer) -> usize {
        symbolizer.warm_threads(
            self.targets.iter().map(|t| t.cgroup.clone()),
            self.samples
                .iter()
                .map(|s| (s.tgid, &s.user_stack[..], &s.kernel_stack[..])),
        )
    }

    /// Symbolizes and builds the pprof profile: sample types `samples/count`
    /// and `cpu/nanoseconds`, labels namespace/pod/container/node/pid/comm/thread.
    pub fn to_profile(&self, symbolizer: &mut StackSymbolizer, node: &str) -> Profile {
        self.to_profile_with_lead_up(symbolizer, node, None)
    }

    /// [`Self::to_profile`], with the samples a trigger's ring kept before its fire
    /// prepended (docs/triggers.md, "The lead-up"): symbolized the same way, each its own
    /// sample of `1/frequency` s of CPU at the ring's frequency, labelled
    /// `trigger_phase=lead-up` and `ms_before_fire`; this capture's own samples are
    /// labelled `trigger_phase=after-fire`. Lead-up samples of a cgroup that is none of the
    /// targets' (or below one) are left out.
    pub fn to_profile_with_lead_up(
        &self,
        symbolizer: &mut StackSymbolizer,
        node: &str,
        lead_up: Option<&LeadUp>,
    ) -> Profile {
        let period = crate::pprof::nanos_per_sample(self.options.frequency);
        let mut b = ProfileBuilder::new(&[("samples", "count"), ("cpu", "nanoseconds")]);
        b.cpu_period(self.options.frequency);
        b.default_sample_type("cpu");
        b.window(self.started, self.duration);
        // The samples come from the targets: a process without a snapshot is read now only
        // if it is still there (its PID may have gone to another process).
        symbolizer.confine_to(self.targets.iter().map(|t| t.cgroup.clone()));
        b.comment(&format!(
            "event {} at {} Hz; drops: counts_full={} user_stack={} kernel_stack={} notify={}",
            self.options.event.name(),
            self.options.frequency,
            self.drops.counts_full,
            self.drops.user_stack,
            self.drops.kernel_stack,
            self.drops.notify
        ));
        if let Some(lead_up) = lead_up {
            self.add_lead_up(symbolizer, &mut b, node, lead_up);
        }
        for s in &self.samples {
            let frames = s.frames(symbolizer, &mut b);
            let target = self.targets.get(s.target);
            let mut labels = crate::capture::thread_labels(target, node, s.tgid, s.pid, &s.comm);
            if lead_up.is_some() {
                labels.push(Label::Str("trigger_phase".into(), "after-fire".into()));
            }
            let n = s.count as i64;
            symbolizer.account(&frames, s.count);
            b.add_sample(&frames, &[n, n * period], &labels);
        }
        for c in symbolizer.comments("samples") {
            b.comment(&c);
        }
        b.comment(&self.walk.comment());
        if self.py_stats.samples > 0 || !self.python.is_empty() {
            b.comment(&self.py_stats.comment());
        }
        for p in &self.python {
            b.comment(&p.to_string());
        }
        if let Some(u) = &self.unwinder {
            b.comment(&format!(
                "unwind tables: {} binaries, {} KiB; build+load {:.1} ms per binary (max {:.1} ms); \
                 {} without usable CFI; {} over budget; {} evicted",
                u.tables,
                u.table_bytes / 1024,
                u.build_micros as f64 / 1e3 / u.tables_loaded.max(1) as f64,
                u.max_build_micros as f64 / 1e3,
                u.binaries_without_cfi,
                u.over_budget,
                u.tables_evicted
            ));
        }
        b.build()
    }

    fn add_lead_up(
        &self,
        symbolizer: &mut StackSymbolizer,
        b: &mut ProfileBuilder,
        node: &str,
        lead_up: &LeadUp,
    ) {
        let Some(target) = self
            .targets
            .iter()
            .find(|t| lead_up.cgroup.starts_with(&t.cgroup.path))
        else {
            b.comment(&format!(
                "lead-up left out: its cgroup {} is none of the targets'",
                lead_up.cgroup.display()
            ));
            return;
        };
        b.comment(&lead_up.describe());
        let period = crate::pprof::nanos_per_sample(lead_up.frequency);
        for r in &lead_up.snapshot.samples {
            let sample = CpuSample {
                target: 0,
                tgid: r.tgid,
                pid: r.pid,
                comm: r.comm.clone(),
                user_stack: r.user_stack.clone(),
                kernel_stack: r.kernel_stack.clone(),
                python: Vec::new(),
                count: 1,
            };
            let frames = sample.frames(symbolizer, b);
            let mut labels =
                crate::capture::thread_labels(Some(target), node, r.tgid, r.pid, &r.comm);
            labels.push(Label::Str("trigger_phase".into(), "lead-up".into()));
            labels.push(Label::Num(
                "ms_before_fire".into(),
                r.before_fire_ns / 1_000_000,
                "milliseconds".into(),
            ));
            symbolizer.account(&frames, 1);
            b.add_sample(&frames, &[1, period], &labels);
        }
    }

    /// A short "top" of `profile` (built from these samples) by leaf function, for
    /// `flamefleet-agent capture --text`.
    pub fn top_text(&self, profile: &Profile) -> String {
        let name_of_location: HashMap<u64, String> = profile
            .location
            .iter()
            .map(|l| {
                let name = l
                    .line
                    .first()
                    .and_then(|line| profile.function.iter().find(|f| f.id == line.function_id))
                    .and_then(|f| profile.string_table.get(f.name as usize).cloned())
                    .unwrap_or_else(|| format!("{:#x}", l.address));
                (l.id, name)
            })
            .collect();
        let mut flat: HashMap<&str, i64> = HashMap::new();
        for s in &profile.sample {
            let leaf = s
                .location_id
                .first()
                .and_then(|id| name_of_location.get(id));
            *flat
                .entry(leaf.map_or("[unknown]", String::as_str))
                .or_default() += s.value[0];
        }
        let mut rows: Vec<_> = flat.into_iter().collect();
        rows.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        // The profile's samples: with a lead-up, more than this capture's own.
        let total = profile
            .sample
            .iter()
            .map(|s| s.value.first().copied().unwrap_or(0))
            .sum::<i64>()
            .max(1) as f64;
        let mut out = format!(
            "{} samples at {} Hz ({}) in {:.1?}; drops: {}\n",
            self.total(),
            self.options.frequency,
            self.options.event.name(),
            self.duration,
            self.drops.total()
        );
        for (name, n) in rows.into_iter().take(20) {
            let _ = writeln!(out, "{:>8} {:>6.2}%  {name}", n, n as f64 * 100.0 / total);
        }
        out
    }
}
