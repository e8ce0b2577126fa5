//! What an agent reports, bounded before it reaches an object or the operator's memory.
//!
//! An agent is trusted for its own node's profiles and nothing more: a compromised node
//! can put anything a gRPC message carries (4 MiB) into each field of its DONE or FAILED
//! message. Every field the operator keeps is bounded here, where the message arrives, so
//! that one node can never make its result slice (shared with 99 other nodes), the
//! request's status or the operator's memory large. Each bound is far above what a genuine
//! agent sends.

use flamefleet_api::text::truncated;
use flamefleet_proto::agent::capture_summary::Kind;
use flamefleet_proto::agent::{CaptureSummary, LatencyHistogram};

/// Longest sample type kept (`cpu/nanoseconds`, `inuse_space/bytes`, ...).
pub const MAX_SAMPLE_TYPE_BYTES: usize = 128;
/// Longest text kept of a summary's free-text fields (a heap summary's reason, warnings,
/// process details).
pub const MAX_SUMMARY_TEXT_BYTES: usize = 1024;
/// Longest short text kept (a process's command or target, an allocator's path).
pub const MAX_SUMMARY_NAME_BYTES: usize = 256;
/// Most entries kept of each list in a heap summary (processes, warnings, allocators).
pub const MAX_SUMMARY_LIST: usize = 64;
/// Longest agent message kept (a failure's reason); the slice entry has the same bound.
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024;
/// Most buckets of a run-queue latency histogram (log2 buckets of a 64-bit value).
pub const MAX_HISTOGRAM_BUCKETS: usize = 64;

/// Checks a reported sample type: `<type>/<unit>` of a safe charset, at most
/// [`MAX_SAMPLE_TYPE_BYTES`]. The error says what was found.
pub fn check_sample_type(sample_type: &str) -> Result<(), String> {
    if sample_type.len() > MAX_SAMPLE_TYPE_BYTES {
        return Err(format!(
            "the agent reported a sample type of {} bytes; expected at most {MAX_SAMPLE_TYPE_BYTES} (e.g. cpu/nanoseconds)",
            sample_type.len()
        ));
    }
    let ok = sample_type
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'/' | b'_' | b'-' | b'.'));
    if !ok {
        return Err(format!(
            "the agent reported the sample type {sample_type:?}; expected letters, digits and / _ - . only"
        ));
    }
    Ok(())
}

/// A node's typed summary as the operator keeps it (until its numbers are folded into the
/// request's summary): CPU and run-queue summaries are numbers only; a heap summary's
/// lists keep at most [`MAX_SUMMARY_LIST`] entries and its texts are cut; an off-CPU
/// summary keeps its first [`flamefleet_api::profile_request::MAX_TOP_BLOCKING`] kernel
/// functions, their names cut; every summary keeps its first
/// [`flamefleet_api::profile_request::MAX_SUMMARY_NOTES`] notes, each cut.
pub fn bounded_summary(summary: Option<Box<CaptureSummary>>) -> Option<Box<CaptureSummary>> {
    let mut summary = summary?;
    summary
        .notes
        .truncate(flamefleet_api::profile_request::MAX_SUMMARY_NOTES);
    for n in &mut summary.notes {
        *n = truncated(n, MAX_SUMMARY_TEXT_BYTES);
    }
    if let Some(Kind::Heap(heap)) = summary.kind.as_mut() {
        heap.reason = truncated(&heap.reason, MAX_SUMMARY_TEXT_BYTES);
        heap.processes.truncate(MAX_SUMMARY_LIST);
        for p in &mut heap.processes {
            p.comm = truncated(&p.comm, MAX_SUMMARY_NAME_BYTES);
            p.target = truncated(&p.target, MAX_SUMMARY_NAME_BYTES);
            p.detail = truncated(&p.detail, MAX_SUMMARY_TEXT_BYTES);
        }
        heap.warnings.truncate(MAX_SUMMARY_LIST);
        for w in &mut heap.warnings {
            *w = truncated(w, MAX_SUMMARY_TEXT_BYTES);
        }
        if let Some(ebpf) = heap.ebpf.as_mut() {
            ebpf.allocators.truncate(MAX_SUMMARY_LIST);
            for a in &mut ebpf.allocators {
                *a = truncated(a, MAX_SUMMARY_NAME_BYTES);
            }
        }
    }
    if let Some(Kind::Offcpu(offcpu)) = summary.kind.as_mut() {
        offcpu
            .top_blocking
            .truncate(flamefleet_api::profile_request::MAX_TOP_BLOCKING);
        for b in &mut offcpu.top_blocking {
            b.function = truncated(&b.function, MAX_SUMMARY_NAME_BYTES);
        }
    }
    Some(summary)
}

/// A reported histogram, or `None` when it has more buckets than any latency can fill.
pub fn bounded_histogram(histogram: Option<LatencyHistogram>) -> Option<LatencyHistogram> {
    histogram.filter(|h| h.buckets.len() <= MAX_HISTOGRAM_BUCKETS)
}

/// An agent's message (a failure's reason), cut to [`MAX_MESSAGE_BYTES`].
pub fn bounded_message(message: &str) -> String {
    truncated(message, MAX_MESSAGE_BYTES)
}

#[cfg(test)]
mod tests {
    use flamefleet_proto::agent::{HeapEbpfStats, HeapProcess, HeapSummary};

    use super::*;

    #[test]
    fn notes_are_few_and_short() {
        let kept = bounded_summary(Some(Box::new(CaptureSummary {
            notes: vec!["n".repeat(1 << 20); 1000],
            ..Default::default()
        })))
        .unwrap();
        assert_eq!(
            kept.notes.len(),
            flamefleet_api::profile_request::MAX_SUMMARY_NOTES
        );
        // Cut, with the three bytes of the ellipsis that says so.
        assert!(
            kept.notes
                .iter()
                .all(|n| n.len() <= MAX_SUMMARY_TEXT_BYTES + 3)
        );
    }

    #[test]
    fn sample_types_are_short_and_plain() {
        for good in [
            "cpu/nanoseconds",
            "inuse_space/bytes",
            "samples/count",
            "a.b-c",
        ] {
            check_sample_type(good).unwrap();
        }
        let long = check_sample_type(&"n".repeat(2 << 20)).unwrap_err();
        assert!(long.contains("2097152 bytes"), "{long}");
        assert!(long.len() < 200, "{long}");
        assert!(check_sample_type("cpu/\"x\" <b>").is_err());
    }

    #[test]
    fn summaries_keep_short_lists_of_short_texts() {
        let heap = HeapSummary {
            allocations: 7,
            reason: "r".repeat(1 << 20),
            processes: (0..10_000)
                .map(|pid| HeapProcess {
                    pid,
                    comm: "c".repeat(4096),
                    target: "t".repeat(4096),
                    detail: "d".repeat(4096),
                    ..Default::default()
                })
                .collect(),
            warnings: vec!["w".repeat(4096); 10_000],
            ebpf: Some(HeapEbpfStats {
                allocators: vec!["a".repeat(4096); 10_000],
                ..Default::default()
            }),
            ..Default::default()
        };
        let kept = bounded_summary(Some(Box::new(CaptureSummary {
            kind: Some(Kind::Heap(heap)),
            ..Default::default()
        })))
        .unwrap();
        let Some(Kind::Heap(heap)) = kept.kind else {
            panic!("a heap summary stays one")
        };
        let text: usize = heap.reason.len()
            + heap
                .processes
                .iter()
                .map(|p| p.comm.len() + p.target.len() + p.detail.len())
                .sum::<usize>()
            + heap.warnings.iter().map(String::len).sum::<usize>()
            + heap
                .ebpf
                .as_ref()
                .map_or(0, |e| e.allocators.iter().map(String::len).sum());
        assert!(text < 256 * 1024, "{text} bytes of text kept");
        assert_eq!(heap.allocations, 7);
        assert_eq!(heap.processes.len(), MAX_SUMMARY_LIST);
        assert!(heap.reason.len() <= MAX_SUMMARY_TEXT_BYTES + 3);
        assert_eq!(bounded_summary(None), None);
    }

    #[test]
    fn histograms_and_messages_are_bounded() {
        let fine = LatencyHistogram {
            unit_ns: 1000,
            buckets: vec![1; 27],
        };
        assert_eq!(bounded_histogram(Some(fine.clone())), Some(fine));
        let huge = LatencyHistogram {
            unit_ns: 1000,
            buckets: vec![1; 100_000],
        };
        assert_eq!(bounded_histogram(Some(huge)), None);
        assert!(bounded_message(&"m".repeat(1 << 22)).len() <= MAX_MESSAGE_BYTES + 3);
    }
}
