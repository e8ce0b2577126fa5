//! The typed capture summary (`CaptureProgress.capture_summary`) as the text map
//! `CaptureProgress.summary` carries for display: the one place the display keys of
//! docs/capture.md ("Capture summary") are written.

use std::collections::HashMap;

use crate::agent::capture_summary::Kind;
use crate::agent::{
    CaptureSummary, CpuSummary, HeapEbpfStats, HeapSource, HeapSourceUsed, HeapSummary,
    LatencyUnit, OffcpuSummary, RunqlatSummary,
};

impl HeapSourceUsed {
    /// How the source is named in summaries and profile labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::Endpoint => "endpoint",
            Self::Ebpf => "ebpf",
            Self::Goruntime => "goruntime",
            Self::Mixed => "goruntime+ebpf",
            Self::Unspecified => "unspecified",
        }
    }
}

impl HeapSource {
    /// The source a request's `HeapOptions` asks for: `source_kind` when set, else the
    /// text `source` of older clients (`""` is auto). `None` for unknown text.
    pub fn requested(kind: i32, text: &str) -> Option<Self> {
        if kind != 0 {
            return Self::try_from(kind).ok();
        }
        Some(match text {
            "" | "auto" => Self::Auto,
            "endpoint" => Self::Endpoint,
            "ebpf" => Self::Ebpf,
            "goruntime" | "go" => Self::Goruntime,
            _ => return None,
        })
    }
}

impl LatencyUnit {
    /// The unit a request's `RunqlatOptions` asks for: `latency_unit` when set, else the
    /// text `unit` of older clients (`""` is microseconds). `None` for unknown text.
    pub fn requested(kind: i32, text: &str) -> Option<Self> {
        if kind != 0 {
            return Self::try_from(kind).ok();
        }
        Some(match text {
            "" | "us" => Self::Microseconds,
            "ms" => Self::Milliseconds,
            _ => return None,
        })
    }
}

impl CaptureSummary {
    /// Samples the capture counted (CPU samples, run-queue waits, allocations), as the
    /// profile artifact's `samples`.
    pub fn samples(&self) -> u64 {
        match &self.kind {
            Some(Kind::Cpu(c)) => c.samples,
            Some(Kind::Runqlat(r)) => r.waits,
            Some(Kind::Heap(h)) => h.allocations,
            Some(Kind::Offcpu(o)) => o.blocks,
            None => 0,
        }
    }

    /// Samples lost during the window (0 for heap, whose losses are in its eBPF counters).
    pub fn dropped_samples(&self) -> u64 {
        match &self.kind {
            Some(Kind::Cpu(c)) => c.dropped_samples,
            Some(Kind::Runqlat(r)) => r.dropped_samples,
            Some(Kind::Offcpu(o)) => o.dropped_blocks,
            Some(Kind::Heap(_)) | None => 0,
        }
    }

    /// The summary as text, keyed as docs/capture.md lists ("Capture summary").
    pub fn display(&self) -> HashMap<String, String> {
        let mut out = match &self.kind {
            Some(Kind::Cpu(c)) => cpu_display(c),
            Some(Kind::Runqlat(r)) => runqlat_display(r),
            Some(Kind::Heap(h)) => heap_display(h),
            Some(Kind::Offcpu(o)) => offcpu_display(o),
            None => HashMap::new(),
        };
        if !self.notes.is_empty() {
            out.insert("notes".into(), self.notes.join(" | "));
        }
        out
    }
}

fn cpu_display(c: &CpuSummary) -> HashMap<String, String> {
    let mut out = HashMap::from([
        ("samples".to_owned(), c.samples.to_string()),
        (
            "unsymbolized_frames_pct".to_owned(),
            format!("{:.2}", c.unsymbolized_frames_pct),
        ),
        ("dropped_samples".to_owned(), c.dropped_samples.to_string()),
        ("frequency_hz".to_owned(), c.frequency_hz.to_string()),
    ]);
    if !c.runtimes.is_empty() {
        out.insert("runtimes".into(), c.runtimes.join("; "));
    }
    if c.requested_frequency_hz != c.frequency_hz {
        out.insert(
            "requested_frequency_hz".into(),
            c.requested_frequency_hz.to_string(),
        );
        out.insert(
            "frequency_note".into(),
            format!(
                "joined a sampler already running at {} Hz; {} Hz was requested",
                c.frequency_hz, c.requested_frequency_hz
            ),
        );
    }
    out
}

fn offcpu_display(o: &OffcpuSummary) -> HashMap<String, String> {
    let mut out = HashMap::from([
        ("samples".to_owned(), o.blocks.to_string()),
        ("blocks".to_owned(), o.blocks.to_string()),
        (
            "off_cpu_seconds".to_owned(),
            format!("{:.3}", o.blocked_ns as f64 / 1e9),
        ),
        (
            "runnable_seconds".to_owned(),
            format!("{:.3}", o.runnable_ns as f64 / 1e9),
        ),
        ("dropped_samples".to_owned(), o.dropped_blocks.to_string()),
        (
            "unsymbolized_frames_pct".to_owned(),
            format!("{:.2}", o.unsymbolized_frames_pct),
        ),
        (
            "min_block_micros".to_owned(),
            o.min_block_micros.to_string(),
        ),
    ]);
    if o.on_cpu_samples > 0 {
        out.insert(
            "on_cpu_seconds".into(),
            format!("{:.3}", o.on_cpu_ns as f64 / 1e9),
        );
        out.insert("on_cpu_samples".into(), o.on_cpu_samples.to_string());
    }
    if !o.top_blocking.is_empty() {
        let top: Vec<String> = o
            .top_blocking
            .iter()
            .map(|b| format!("{} {:.3}s", b.function, b.blocked_ns as f64 / 1e9))
            .collect();
        out.insert("top_blocking".into(), top.join(", "));
    }
    if !o.runtimes.is_empty() {
        out.insert("runtimes".into(), o.runtimes.join("; "));
    }
    out
}

fn runqlat_display(r: &RunqlatSummary) -> HashMap<String, String> {
    let mut out = HashMap::from([
        ("samples".to_owned(), r.waits.to_string()),
        ("events".to_owned(), r.waits.to_string()),
        ("dropped_samples".to_owned(), r.dropped_samples.to_string()),
    ]);
    for (key, value) in [
        ("p50_us", r.p50_us),
        ("p90_us", r.p90_us),
        ("p99_us", r.p99_us),
    ] {
        if let Some(v) = value {
            out.insert(key.into(), format!("{v:.1}"));
        }
    }
    if let Some(max) = r.max_us {
        out.insert("max_us".into(), format!("{max:.0}"));
    }
    out
}

fn heap_display(h: &HeapSummary) -> HashMap<String, String> {
    let mut out = HashMap::from([
        ("samples".to_owned(), h.allocations.to_string()),
        ("heap_source".to_owned(), h.source().name().to_owned()),
        ("heap_reason".to_owned(), h.reason.clone()),
    ]);
    if let Some(stats) = &h.ebpf {
        out.insert("heap_ebpf".into(), ebpf_display(stats));
    }
    if !h.processes.is_empty() {
        let per_process: Vec<String> = h
            .processes
            .iter()
            .map(|n| {
                let source = match n.source() {
                    HeapSourceUsed::Unspecified => "not seen",
                    s => s.name(),
                };
                format!("pid {} ({}): {source}: {}", n.pid, n.comm, n.detail)
            })
            .collect();
        out.insert("heap_processes".into(), per_process.join("; "));
    }
    if !h.warnings.is_empty() {
        out.insert("warnings".into(), h.warnings.join("; "));
    }
    out
}

/// The eBPF heap sampler's counters on one line: what was sampled, what was lost and why,
/// what was probed.
fn ebpf_display(s: &HeapEbpfStats) -> String {
    let mut out = format!(
        "sample_bytes {}, shared_with {}, calls {}, sampled {}, freed {}, dropped: \
         live_full {}, rows_full {}, stacks {}, thread_state {}, notifications {}; probes {}",
        s.sample_bytes,
        s.shared_with,
        s.calls,
        s.sampled,
        s.freed,
        s.dropped_live_full,
        s.dropped_rows_full,
        s.dropped_stacks,
        s.dropped_thread_state,
        s.dropped_notifications,
        s.probes,
    );
    if s.session_uprobes {
        out.push_str(" (session uprobes)");
    }
    if !s.allocators.is_empty() {
        out.push_str(" on ");
        out.push_str(&s.allocators.join(", "));
    }
    if let Some(bp) = s.projected_overhead_basis_points {
        out.push_str(&format!(
            "; projected overhead {}.{:02}%",
            bp / 100,
            bp % 100
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_summary_reads_as_the_keys_of_the_docs() {
        let joined = CaptureSummary {
            kind: Some(Kind::Cpu(CpuSummary {
                samples: 42,
                dropped_samples: 1,
                unsymbolized_frames_pct: 12.345,
                frequency_hz: 99,
                requested_frequency_hz: 49,
                runtimes: vec![
                    "python 3.12 (pid 4): Python frames read".into(),
                    "python 3.7 (pid 5): native frames only: not supported".into(),
                ],
            })),
            ..Default::default()
        };
        let text = joined.display();
        assert_eq!(
            text["runtimes"],
            "python 3.12 (pid 4): Python frames read; python 3.7 (pid 5): native frames only: \
             not supported"
        );
        assert_eq!(text["samples"], "42");
        assert_eq!(text["unsymbolized_frames_pct"], "12.35");
        assert_eq!(text["frequency_hz"], "99");
        assert_eq!(text["requested_frequency_hz"], "49");
        assert!(text["frequency_note"].contains("99 Hz; 49 Hz was requested"));
        assert_eq!(joined.samples(), 42);
        assert_eq!(joined.dropped_samples(), 1);
        let own = CaptureSummary {
            kind: Some(Kind::Cpu(CpuSummary {
                requested_frequency_hz: 99,
                frequency_hz: 99,
                ..Default::default()
            })),
            ..Default::default()
        };
        assert!(!own.display().contains_key("frequency_note"));
    }

    #[test]
    fn an_offcpu_summary_names_its_runtimes_as_the_cpu_one() {
        let with = CaptureSummary {
            kind: Some(Kind::Offcpu(OffcpuSummary {
                blocks: 3,
                runtimes: vec![
                    "python 3.12 (pid 4): Python frames read".into(),
                    "java 17.0.15 (pid 6): Java frames unnamed: not attached".into(),
                ],
                ..Default::default()
            })),
            ..Default::default()
        };
        assert_eq!(
            with.display()["runtimes"],
            "python 3.12 (pid 4): Python frames read; java 17.0.15 (pid 6): Java frames \
             unnamed: not attached"
        );
        let without = CaptureSummary {
            kind: Some(Kind::Offcpu(OffcpuSummary::default())),
            ..Default::default()
        };
        assert!(!without.display().contains_key("runtimes"));
    }

    #[test]
    fn runqlat_and_heap_summaries_read_as_the_keys_of_the_docs() {
        let r = CaptureSummary {
            kind: Some(Kind::Runqlat(RunqlatSummary {
                waits: 7,
                dropped_samples: 0,
                p50_us: Some(3.04),
                p90_us: None,
                p99_us: Some(40.0),
                max_us: Some(63.6),
            })),
            ..Default::default()
        };
        let text = r.display();
        assert_eq!(
            (text["samples"].as_str(), text["events"].as_str()),
            ("7", "7")
        );
        assert_eq!(text["p50_us"], "3.0");
        assert!(!text.contains_key("p90_us"));
        assert_eq!(text["max_us"], "64");
        let h = CaptureSummary {
            kind: Some(Kind::Heap(HeapSummary {
                allocations: 5,
                source: HeapSourceUsed::Mixed as i32,
                reason: "auto".into(),
                processes: vec![crate::agent::HeapProcess {
                    pid: 9,
                    comm: "sh".into(),
                    target: "ns/pod".into(),
                    source: HeapSourceUsed::Unspecified as i32,
                    detail: "stripped".into(),
                }],
                ..Default::default()
            })),
            ..Default::default()
        };
        let text = h.display();
        assert_eq!(text["heap_source"], "goruntime+ebpf");
        assert_eq!(text["heap_processes"], "pid 9 (sh): not seen: stripped");
        assert!(!text.contains_key("heap_ebpf"));
    }

    #[test]
    fn options_read_the_enum_and_fall_back_to_the_text_of_older_clients() {
        assert_eq!(
            HeapSource::requested(HeapSource::Ebpf as i32, "endpoint"),
            Some(HeapSource::Ebpf)
        );
        assert_eq!(HeapSource::requested(0, ""), Some(HeapSource::Auto));
        assert_eq!(HeapSource::requested(0, "go"), Some(HeapSource::Goruntime));
        assert_eq!(HeapSource::requested(0, "malloc"), None);
        assert_eq!(HeapSource::requested(42, ""), None);
        assert_eq!(
            LatencyUnit::requested(0, "ms"),
            Some(LatencyUnit::Milliseconds)
        );
        assert_eq!(
            LatencyUnit::requested(LatencyUnit::Microseconds as i32, "ms"),
            Some(LatencyUnit::Microseconds)
        );
        assert_eq!(LatencyUnit::requested(0, "s"), None);
    }

    #[test]
    fn heap_ebpf_counters_read_as_one_line_of_names_and_numbers() {
        let h = CaptureSummary {
            kind: Some(Kind::Heap(HeapSummary {
                source: HeapSourceUsed::Ebpf as i32,
                ebpf: Some(HeapEbpfStats {
                    sample_bytes: 524_288,
                    calls: 1000,
                    sampled: 12,
                    dropped_stacks: 2,
                    probes: 4,
                    allocators: vec!["/lib/libc.so.6".into()],
                    projected_overhead_basis_points: Some(107),
                    ..Default::default()
                }),
                ..Default::default()
            })),
            ..Default::default()
        };
        let line = &h.display()["heap_ebpf"];
        assert_eq!(
            line,
            "sample_bytes 524288, shared_with 0, calls 1000, sampled 12, freed 0, dropped: \
             live_full 0, rows_full 0, stacks 2, thread_state 0, notifications 0; probes 4 \
             on /lib/libc.so.6; projected overhead 1.07%"
        );
    }
}
