//! The request's summary and completion message from its per-node results (pure logic).
//!
//! The operator is the only writer of results: agents report over the `Capture` stream, and
//! the operator records them after checking every artifact against the store. The per-node
//! table itself (entries, counts, failures, dirty slices) is [`super::result_table`]; this
//! module sums up what the nodes measured, one outcome at a time as they arrive, so the
//! table keeps no per-node summary.

use std::collections::BTreeMap;

use flamefleet_api::profile_request::{
    BlockingFunction, MAX_SUMMARY_NOTES, MAX_TOP_BLOCKING, OffcpuSummary,
};
use flamefleet_api::{
    CpuSummary, LatencySummary, NodeCounts, NodeFailureEntry, NodeStatus, ProfileSummary,
};
use flamefleet_proto::agent::capture_summary::Kind;
use flamefleet_proto::agent::{
    CaptureSummary, LatencyHistogram, OffcpuSummary as OffcpuMeasure, RunqlatSummary,
};

use crate::events::truncated;

/// Most failed nodes the completion message names.
const MESSAGE_FAILURES: usize = 3;
/// Longest failure message the completion message quotes per node.
const MESSAGE_FAILURE_BYTES: usize = 200;

/// What the nodes measured, folded as their outcomes arrive; docs/capture.md ("Capture
/// summary") defines each field of the result.
///
/// Run-queue latency percentiles come from the nodes' log2 histograms merged bucket by
/// bucket, which is exact up to the buckets; only when some node reported percentiles
/// without a histogram (an older agent) or another unit do they fall back to the worst
/// node's percentiles, an upper bound, and `merged` says false.
#[derive(Debug, Clone, PartialEq)]
pub struct Measures {
    /// The effective CPU frequency (the lowest over nodes) and why it differs.
    cpu: Option<CpuSummary>,
    /// Every node's run-queue waits in one histogram, while they can be merged.
    waits: Option<LatencyHistogram>,
    /// False once some node's waits cannot be merged into `waits`.
    mergeable: bool,
    /// The worst node's percentiles.
    worst: Option<LatencySummary>,
    /// Off-CPU totals over nodes, and time per blocking kernel function.
    offcpu: Option<OffcpuFold>,
    /// The nodes' notes on how they measured, each once, at most [`MAX_SUMMARY_NOTES`].
    notes: Vec<String>,
}

/// Most kernel functions kept while folding nodes' off-CPU summaries (each node names at
/// most [`MAX_TOP_BLOCKING`]; nodes may name different ones).
const MAX_BLOCKING_FOLDED: usize = 64;

/// The nodes' off-CPU summaries, summed.
#[derive(Debug, Clone, PartialEq, Default)]
struct OffcpuFold {
    blocked_ns: u64,
    runnable_ns: u64,
    blocks: u64,
    /// Wall-clock view: on-CPU time, and whether any node measured it.
    on_cpu_ns: u64,
    on_cpu: bool,
    by_function: BTreeMap<String, u64>,
}

impl Default for Measures {
    fn default() -> Self {
        Self {
            cpu: None,
            waits: None,
            mergeable: true,
            worst: None,
            offcpu: None,
            notes: Vec::new(),
        }
    }
}

fn rounded(v: f64) -> i64 {
    v.round() as i64
}

impl Measures {
    /// Folds in one node's summary and run-queue histogram.
    pub fn add(&mut self, summary: Option<&CaptureSummary>, histogram: Option<&LatencyHistogram>) {
        for note in summary.iter().flat_map(|s| s.notes.iter()) {
            if self.notes.len() < MAX_SUMMARY_NOTES && !self.notes.contains(note) {
                self.notes.push(note.clone());
            }
        }
        match summary.and_then(|s| s.kind.as_ref()) {
            Some(Kind::Cpu(cpu)) => {
                self.add_cpu(summary, cpu.frequency_hz, cpu.requested_frequency_hz)
            }
            Some(Kind::Runqlat(runqlat)) => self.add_worst(runqlat),
            Some(Kind::Offcpu(offcpu)) => self.add_offcpu(offcpu),
            Some(Kind::Heap(_)) | None => {}
        }
        let has_percentiles = matches!(
            summary.and_then(|s| s.kind.as_ref()),
            Some(Kind::Runqlat(r)) if r.p50_us.is_some()
        );
        match histogram {
            Some(h) if self.mergeable => {
                let merged = match &mut self.waits {
                    Some(all) => all.merge(h).is_ok(),
                    None => {
                        self.waits = Some(h.clone());
                        true
                    }
                };
                self.mergeable = merged;
            }
            Some(_) => {}
            // A node with runqlat numbers but no histogram: cannot merge exactly.
            None if has_percentiles => self.mergeable = false,
            None => {}
        }
    }

    fn add_cpu(&mut self, summary: Option<&CaptureSummary>, hz: u64, requested: u64) {
        if hz == 0 {
            return;
        }
        let hz = i64::try_from(hz).unwrap_or(i64::MAX);
        let c = self.cpu.get_or_insert_with(|| CpuSummary {
            frequency_hz: hz,
            ..Default::default()
        });
        c.frequency_hz = c.frequency_hz.min(hz);
        let requested = i64::try_from(requested).unwrap_or(i64::MAX);
        if requested != 0 && requested != hz {
            c.requested_frequency_hz = Some(requested);
            if c.message.is_none() {
                c.message = summary.and_then(|s| s.display().remove("frequency_note"));
            }
        }
    }

    fn add_worst(&mut self, summary: &RunqlatSummary) {
        let (Some(p50), Some(p99)) = (summary.p50_us, summary.p99_us) else {
            return;
        };
        let r = self.worst.get_or_insert_with(|| LatencySummary {
            merged: Some(false),
            ..Default::default()
        });
        r.events += i64::try_from(summary.waits).unwrap_or(i64::MAX);
        r.p50_us = r.p50_us.max(rounded(p50));
        r.p90_us = r.p90_us.max(rounded(summary.p90_us.unwrap_or(p99)));
        r.p99_us = r.p99_us.max(rounded(p99));
        if let Some(max) = summary.max_us {
            r.max_us = Some(r.max_us.unwrap_or(0).max(rounded(max)));
        }
    }

    fn add_offcpu(&mut self, m: &OffcpuMeasure) {
        let f = self.offcpu.get_or_insert_with(OffcpuFold::default);
        f.blocked_ns = f.blocked_ns.saturating_add(m.blocked_ns);
        f.runnable_ns = f.runnable_ns.saturating_add(m.runnable_ns);
        f.blocks = f.blocks.saturating_add(m.blocks);
        f.on_cpu_ns = f.on_cpu_ns.saturating_add(m.on_cpu_ns);
        f.on_cpu |= m.on_cpu_samples > 0;
        for b in m.top_blocking.iter().take(MAX_TOP_BLOCKING) {
            if f.by_function.len() < MAX_BLOCKING_FOLDED || f.by_function.contains_key(&b.function)
            {
                let t = f.by_function.entry(b.function.clone()).or_default();
                *t = t.saturating_add(b.blocked_ns);
            }
        }
    }

    fn offcpu(&self) -> Option<OffcpuSummary> {
        let f = self.offcpu.as_ref()?;
        let millis = |ns: u64| i64::try_from(ns / 1_000_000).unwrap_or(i64::MAX);
        let mut top: Vec<(&String, &u64)> = f.by_function.iter().collect();
        top.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        Some(OffcpuSummary {
            off_cpu_millis: millis(f.blocked_ns),
            runnable_millis: millis(f.runnable_ns),
            blocks: i64::try_from(f.blocks).unwrap_or(i64::MAX),
            on_cpu_millis: f.on_cpu.then(|| millis(f.on_cpu_ns)),
            top_blocking: top
                .into_iter()
                .take(MAX_TOP_BLOCKING)
                .map(|(function, ns)| BlockingFunction {
                    function: function.clone(),
                    millis: millis(*ns),
                })
                .collect(),
        })
    }

    /// Percentiles of every node's waits together, when every node with a runqlat result
    /// sent its histogram in one unit; else the worst node's.
    fn runqlat(&self) -> Option<LatencySummary> {
        let merged = self.waits.as_ref().filter(|_| self.mergeable).map(|all| {
            latency_summary(all, true).unwrap_or(LatencySummary {
                merged: Some(true),
                ..Default::default()
            })
        });
        merged.or_else(|| self.worst.clone())
    }

    /// The request's summary: totals over `entries` (the nodes' recorded results) and what
    /// the nodes measured. `samples` sums the profile artifacts' sample counts (an artifact
    /// without a sample type, runqlat's text, counts none).
    pub fn summary<'a>(&self, entries: impl IntoIterator<Item = &'a NodeStatus>) -> ProfileSummary {
        let (mut count, mut samples) = (0usize, 0i64);
        for artifact in entries.into_iter().flat_map(|n| n.artifacts.iter()) {
            count += 1;
            samples += artifact.samples.unwrap_or(0);
        }
        ProfileSummary {
            samples: Some(samples),
            artifacts: Some(i32::try_from(count).unwrap_or(i32::MAX)),
            cpu: self.cpu.clone(),
            runqlat: self.runqlat(),
            offcpu: self.offcpu(),
            notes: self.notes.clone(),
        }
    }
}

fn latency_summary(h: &LatencyHistogram, merged: bool) -> Option<LatencySummary> {
    let us = |q: f64| h.quantile_us(q).map(rounded);
    Some(LatencySummary {
        events: i64::try_from(h.count()).unwrap_or(i64::MAX),
        p50_us: us(0.50)?,
        p90_us: us(0.90)?,
        p99_us: us(0.99)?,
        max_us: h.max_us().map(rounded),
        merged: Some(merged),
    })
}

/// Why a request's nodes failed, in one word for the REASON column and the `Succeeded`
/// condition: the commonest failure reason among `entries` (ties to the first by name), or
/// `None` when no node failed with a reason.
pub fn failure_reason<'a>(entries: impl IntoIterator<Item = &'a NodeStatus>) -> Option<String> {
    let mut counts: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for reason in entries.into_iter().filter_map(|n| n.reason.as_deref()) {
        *counts.entry(reason).or_default() += 1;
    }
    counts
        .into_iter()
        .fold(None::<(&str, usize)>, |best, (r, n)| match best {
            Some((_, m)) if m >= n => best,
            _ => Some((r, n)),
        })
        .map(|(r, _)| r.to_owned())
}

/// One line describing how the nodes ended, for the Completed condition and the Event:
/// the counts and the first few failures (bounded whatever the number of nodes).
pub fn outcome_message(counts: NodeCounts, failures: &[NodeFailureEntry]) -> String {
    let head = format!("{} of {} nodes succeeded", counts.succeeded, counts.total);
    if counts.failed == 0 {
        return head;
    }
    let named: Vec<String> = failures
        .iter()
        .take(MESSAGE_FAILURES)
        .map(|f| {
            let message = truncated(&f.message, MESSAGE_FAILURE_BYTES);
            format!("{}: {message}", f.node)
        })
        .collect();
    let more = usize::try_from(counts.failed)
        .unwrap_or(0)
        .saturating_sub(named.len());
    let mut text = format!("{head}; {} failed: {}", counts.failed, named.join("; "));
    if more > 0 {
        text.push_str(&format!(
            "; and {more} more (status.failures and the ProfileResultSlices list them)"
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::result_table::ResultTable;
    use super::*;
    use crate::dispatch::outcome::{NodeFailure, NodeOutcome};
    use flamefleet_api::Artifact;
    use flamefleet_api::{NodePhase, RequestPhase};
    use flamefleet_proto::agent::CpuSummary as CpuMeasure;

    #[test]
    fn the_failure_reason_is_the_commonest() {
        let node = |name: &str, reason: Option<&str>| NodeStatus {
            node: name.into(),
            reason: reason.map(str::to_owned),
            ..NodeStatus::default()
        };
        let nodes = [
            node("a", Some("TimedOut")),
            node("b", Some("CaptureFailed")),
            node("c", Some("CaptureFailed")),
            node("d", None),
            node("e", Some("AgentInterrupted")),
        ];
        assert_eq!(failure_reason(&nodes).as_deref(), Some("CaptureFailed"));
        assert_eq!(
            failure_reason(&nodes[..2]).as_deref(),
            Some("CaptureFailed"),
            "a tie goes to the first by name"
        );
        assert_eq!(failure_reason(&nodes[3..4]), None);
    }

    fn entry(node: &str, phase: Option<NodePhase>) -> NodeStatus {
        NodeStatus {
            node: node.into(),
            phase,
            pods: vec![format!("pod-{node}")],
            ..Default::default()
        }
    }

    fn artifact(name: &str, samples: i64) -> Artifact {
        Artifact {
            name: name.into(),
            samples: Some(samples),
            ..Default::default()
        }
    }

    fn done(samples: i64, summary: Option<Kind>) -> NodeOutcome {
        NodeOutcome::Done {
            artifacts: vec![artifact("cpu.pb.gz", samples)],
            summary: summary.map(|kind| {
                Box::new(CaptureSummary {
                    kind: Some(kind),
                    ..Default::default()
                })
            }),
            runqlat_histogram: None,
        }
    }

    /// A runqlat summary: waits, p50, p90, p99, max (microseconds).
    fn waits(events: u64, p50: f64, p90: Option<f64>, p99: f64, max: Option<f64>) -> Option<Kind> {
        Some(Kind::Runqlat(RunqlatSummary {
            waits: events,
            p50_us: Some(p50),
            p90_us: p90,
            p99_us: Some(p99),
            max_us: max,
            ..Default::default()
        }))
    }

    fn cpu(frequency_hz: u64, requested_frequency_hz: u64) -> Option<Kind> {
        Some(Kind::Cpu(CpuMeasure {
            frequency_hz,
            requested_frequency_hz,
            ..Default::default()
        }))
    }

    fn with_histogram(outcome: NodeOutcome, pairs: &[(usize, u64)]) -> NodeOutcome {
        let NodeOutcome::Done {
            artifacts, summary, ..
        } = outcome
        else {
            return outcome;
        };
        let mut buckets = vec![0; 27];
        for &(i, n) in pairs {
            buckets[i] = n;
        }
        NodeOutcome::Done {
            artifacts,
            summary,
            runqlat_histogram: Some(LatencyHistogram {
                unit_ns: 1000,
                buckets,
            }),
        }
    }

    /// The table after `outcomes`, as the reconciler keeps it.
    fn table(current: &[NodeStatus], outcomes: &BTreeMap<String, NodeOutcome>) -> ResultTable {
        let mut table = ResultTable::new(current.to_vec());
        for (node, outcome) in outcomes {
            table.apply(node, outcome);
        }
        table
    }

    fn summary_of(
        current: &[NodeStatus],
        outcomes: &BTreeMap<String, NodeOutcome>,
    ) -> ProfileSummary {
        table(current, outcomes).summary()
    }

    #[test]
    fn all_succeeded_after_settling() {
        let current = [entry("a", None), entry("b", None)];
        let outcomes = BTreeMap::from([
            ("a".to_string(), done(5, None)),
            ("b".to_string(), done(7, None)),
        ]);
        let t = table(&current, &outcomes);
        assert_eq!(t.phase(false), RequestPhase::Running);
        assert_eq!(t.phase(true), RequestPhase::Succeeded);
        assert_eq!(
            outcome_message(t.counts(), &t.failures(20).0),
            "2 of 2 nodes succeeded"
        );
        assert_eq!(summary_of(&current, &outcomes).samples, Some(12));
    }

    #[test]
    fn failure_outcomes_mark_nodes_and_give_partial_success() {
        let current = [entry("a", None), entry("b", None)];
        let outcomes = BTreeMap::from([
            ("a".to_string(), done(5, None)),
            (
                "b".to_string(),
                NodeOutcome::Failed(NodeFailure::CaptureFailed {
                    reason: "no cgroup".into(),
                }),
            ),
        ]);
        let t = table(&current, &outcomes);
        assert_eq!(t.phase(true), RequestPhase::PartiallySucceeded);
        let b = t.entry("b").unwrap();
        assert_eq!(b.phase, Some(NodePhase::Failed));
        assert_eq!(b.reason.as_deref(), Some("CaptureFailed"));
        assert_eq!(
            b.message.as_deref(),
            Some("capture failed on the agent: no cgroup")
        );
        // A DONE outcome records the artifacts the agent reported.
        assert_eq!(t.entry("a").unwrap().artifacts.len(), 1);
        let msg = outcome_message(t.counts(), &t.failures(20).0);
        assert!(
            msg.contains("1 of 2 nodes succeeded; 1 failed: b: capture failed"),
            "{msg}"
        );
        assert_eq!(summary_of(&current, &outcomes).samples, Some(5));
    }

    #[test]
    fn the_message_names_a_few_failures_and_counts_the_rest() {
        let current: Vec<NodeStatus> = (0..50).map(|i| entry(&format!("n{i:02}"), None)).collect();
        let outcomes: BTreeMap<String, NodeOutcome> = (0..50)
            .map(|i| {
                (
                    format!("n{i:02}"),
                    NodeOutcome::Failed(NodeFailure::CaptureFailed {
                        reason: "y".repeat(1000),
                    }),
                )
            })
            .collect();
        let t = table(&current, &outcomes);
        let msg = outcome_message(t.counts(), &t.failures(20).0);
        assert!(
            msg.starts_with("0 of 50 nodes succeeded; 50 failed: n00: "),
            "{msg}"
        );
        assert!(msg.contains("and 47 more"), "{msg}");
        assert!(msg.len() < 1000, "{}", msg.len());
    }

    #[test]
    fn runqlat_summary_takes_the_worst_node_and_sums_events() {
        let current = [
            entry("a", Some(NodePhase::Succeeded)),
            entry("b", Some(NodePhase::Succeeded)),
        ];
        let outcomes = BTreeMap::from([
            (
                "a".to_string(),
                done(1, waits(100, 3.0, Some(9.0), 40.0, None)),
            ),
            (
                "b".to_string(),
                done(1, waits(50, 5.0, None, 20.4, Some(64.0))),
            ),
        ]);
        let summary = summary_of(&current, &outcomes);
        let r = summary.runqlat.unwrap();
        assert_eq!((r.p50_us, r.p90_us, r.p99_us, r.events), (5, 20, 40, 150));
        assert_eq!(r.max_us, Some(64));
        assert_eq!(r.merged, Some(false));
    }

    #[test]
    fn runqlat_summary_merges_the_node_histograms() {
        let current = [
            entry("a", Some(NodePhase::Succeeded)),
            entry("b", Some(NodePhase::Succeeded)),
        ];
        // Node a: 90 waits in [2, 4) us; node b: 10 in [1024, 2048) us. The worst node's
        // median would be 1.5 ms; the cluster's median is a few microseconds.
        let a = with_histogram(done(90, waits(90, 3.0, None, 4.0, None)), &[(1, 90)]);
        let b = with_histogram(done(10, waits(10, 1536.0, None, 2038.0, None)), &[(10, 10)]);
        let outcomes = BTreeMap::from([("a".to_string(), a), ("b".to_string(), b)]);
        let summary = summary_of(&current, &outcomes);
        assert_eq!(summary.samples, Some(100));
        let r = summary.runqlat.unwrap();
        assert_eq!(r.events, 100);
        assert_eq!(r.merged, Some(true));
        assert!(r.p50_us <= 4, "{r:?}");
        assert!((1024..2048).contains(&r.p99_us), "{r:?}");
        assert_eq!(r.max_us, Some(2048));

        // A node without a histogram (an older agent): the worst node's numbers.
        let c = done(1, waits(1, 7.0, None, 9.0, None));
        let mut outcomes = outcomes;
        outcomes.insert("c".into(), c);
        let mut current = current.to_vec();
        current.push(entry("c", Some(NodePhase::Succeeded)));
        let r = summary_of(&current, &outcomes).runqlat.unwrap();
        assert_eq!(r.merged, Some(false));
        assert_eq!(r.p50_us, 1536);
    }

    #[test]
    fn cpu_summary_reports_the_effective_frequency() {
        let current = [
            entry("a", Some(NodePhase::Succeeded)),
            entry("b", Some(NodePhase::Succeeded)),
        ];
        let same = BTreeMap::from([
            ("a".to_string(), done(5, cpu(99, 99))),
            ("b".to_string(), done(5, cpu(99, 99))),
        ]);
        let cpu = summary_of(&current, &same).cpu.unwrap();
        assert_eq!(cpu.frequency_hz, 99);
        assert_eq!((cpu.requested_frequency_hz, cpu.message), (None, None));
        let joined = BTreeMap::from([
            ("a".to_string(), done(5, self::cpu(99, 99))),
            ("b".to_string(), done(5, self::cpu(19, 99))),
        ]);
        let cpu = summary_of(&current, &joined).cpu.unwrap();
        assert_eq!(cpu.frequency_hz, 19);
        assert_eq!(cpu.requested_frequency_hz, Some(99));
        assert!(cpu.message.unwrap().contains("19 Hz"));
    }

    #[test]
    fn off_cpu_summaries_add_up_over_nodes_with_the_top_blocking_functions() {
        let node = |blocked: u64, top: &[(&str, u64)]| CaptureSummary {
            kind: Some(Kind::Offcpu(OffcpuMeasure {
                blocked_ns: blocked,
                runnable_ns: 1_000_000,
                blocks: 10,
                top_blocking: top
                    .iter()
                    .map(|(f, ns)| flamefleet_proto::agent::BlockingFunction {
                        function: (*f).to_owned(),
                        blocked_ns: *ns,
                    })
                    .collect(),
                ..Default::default()
            })),
            ..Default::default()
        };
        let mut m = Measures::default();
        m.add(
            Some(&node(
                3_000_000_000,
                &[
                    ("futex_wait_queue", 2_000_000_000),
                    ("pipe_read", 1_000_000_000),
                ],
            )),
            None,
        );
        m.add(
            Some(&node(
                2_000_000_000,
                &[("pipe_read", 1_500_000_000), ("do_epoll_wait", 500_000_000)],
            )),
            None,
        );
        let s = m
            .summary(std::iter::empty())
            .offcpu
            .expect("an off-CPU summary");
        assert_eq!(s.off_cpu_millis, 5000);
        assert_eq!(s.runnable_millis, 2);
        assert_eq!(s.blocks, 20);
        let top: Vec<(&str, i64)> = s
            .top_blocking
            .iter()
            .map(|b| (b.function.as_str(), b.millis))
            .collect();
        assert_eq!(
            top,
            [
                ("pipe_read", 2500),
                ("futex_wait_queue", 2000),
                ("do_epoll_wait", 500)
            ]
        );
    }
}
