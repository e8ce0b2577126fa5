//! The request's summary and completion message from its per-node results (pure logic).
//!
//! The operator is the only writer of results: agents report over the `Capture` stream, and
//! the operator records them after checking every artifact against the store. The per-node
//! table itself (entries, counts, failures, dirty slices) is [`super::result_table`]; this
//! module sums it up once the request is terminal.

use std::collections::BTreeMap;

use flamefleet_api::{
    CpuSummary, LatencySummary, NodeCounts, NodeFailureEntry, NodeStatus, ProfileSummary,
};
use flamefleet_proto::agent::LatencyHistogram;

use crate::dispatch::outcome::NodeOutcome;
use crate::events::truncated;

/// Most failed nodes the completion message names.
const MESSAGE_FAILURES: usize = 3;
/// Longest failure message the completion message quotes per node.
const MESSAGE_FAILURE_BYTES: usize = 200;

fn summary_value(summary: &BTreeMap<String, String>, key: &str) -> Option<i64> {
    summary
        .get(key)
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v.round() as i64)
}

/// Totals over nodes; docs/capture.md ("Capture summary") defines each field.
///
/// `samples` sums the profile artifacts' sample counts (an artifact without a sample type,
/// runqlat's text, counts none). Run-queue latency percentiles come from the nodes' log2
/// histograms merged bucket by bucket, which is exact up to the buckets; only when some
/// node reported no histogram (an older agent) or another unit do they fall back to the
/// worst node's percentiles, an upper bound, and `merged` says false.
pub fn summarize<'a>(
    effective: impl IntoIterator<Item = &'a NodeStatus>,
    outcomes: &BTreeMap<String, NodeOutcome>,
) -> ProfileSummary {
    let (mut count, mut samples) = (0usize, 0i64);
    for artifact in effective.into_iter().flat_map(|n| n.artifacts.iter()) {
        count += 1;
        samples += artifact.samples.unwrap_or(0);
    }
    let done: Vec<(&BTreeMap<String, String>, Option<&LatencyHistogram>)> = outcomes
        .values()
        .filter_map(|outcome| match outcome {
            NodeOutcome::Done {
                summary,
                runqlat_histogram,
                ..
            } => Some((summary, runqlat_histogram.as_ref())),
            NodeOutcome::Failed(_) => None,
        })
        .collect();
    ProfileSummary {
        samples: Some(samples),
        artifacts: Some(i32::try_from(count).unwrap_or(i32::MAX)),
        cpu: cpu_summary(done.iter().map(|(s, _)| *s)),
        runqlat: merged_runqlat(&done).or_else(|| worst_node_runqlat(&done)),
    }
}

/// Why a request's nodes failed, in one word for the REASON column and the `Succeeded`
/// condition: the commonest failure reason among `entries` (ties to the first by name), or
/// `None` when no node failed with a reason.
pub fn failure_reason<'a>(entries: impl IntoIterator<Item = &'a NodeStatus>) -> Option<String> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
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

/// The effective CPU frequency (the lowest over nodes) and, when some node sampled at
/// another frequency than requested, the requested one and why.
fn cpu_summary<'a>(
    summaries: impl Iterator<Item = &'a BTreeMap<String, String>>,
) -> Option<CpuSummary> {
    let mut cpu: Option<CpuSummary> = None;
    for summary in summaries {
        let Some(hz) = summary_value(summary, "frequency_hz") else {
            continue;
        };
        let c = cpu.get_or_insert_with(|| CpuSummary {
            frequency_hz: hz,
            ..Default::default()
        });
        c.frequency_hz = c.frequency_hz.min(hz);
        if let Some(requested) = summary_value(summary, "requested_frequency_hz") {
            c.requested_frequency_hz = Some(requested);
            if c.message.is_none() {
                c.message = summary.get("frequency_note").cloned();
            }
        }
    }
    cpu
}

fn latency_summary(h: &LatencyHistogram, merged: bool) -> Option<LatencySummary> {
    let us = |q: f64| h.quantile_us(q).map(|v| v.round() as i64);
    Some(LatencySummary {
        events: i64::try_from(h.count()).unwrap_or(i64::MAX),
        p50_us: us(0.50)?,
        p90_us: us(0.90)?,
        p99_us: us(0.99)?,
        max_us: h.max_us().map(|v| v.round() as i64),
        merged: Some(merged),
    })
}

/// Percentiles of every node's waits together, when every node with a runqlat result sent
/// its histogram in one unit.
fn merged_runqlat(
    done: &[(&BTreeMap<String, String>, Option<&LatencyHistogram>)],
) -> Option<LatencySummary> {
    let mut all = LatencyHistogram::default();
    let mut any = false;
    for (summary, histogram) in done {
        match histogram {
            Some(h) => {
                all.merge(h).ok()?;
                any = true;
            }
            // A node with runqlat numbers but no histogram: cannot merge exactly.
            None if summary.contains_key("p50_us") => return None,
            None => {}
        }
    }
    if !any {
        return None;
    }
    latency_summary(&all, true).or(Some(LatencySummary {
        merged: Some(true),
        ..Default::default()
    }))
}

/// The worst node's percentiles (exact with one node, an upper bound otherwise).
fn worst_node_runqlat(
    done: &[(&BTreeMap<String, String>, Option<&LatencyHistogram>)],
) -> Option<LatencySummary> {
    let mut runqlat: Option<LatencySummary> = None;
    for (summary, _) in done {
        let (Some(p50), Some(p99)) = (
            summary_value(summary, "p50_us"),
            summary_value(summary, "p99_us"),
        ) else {
            continue;
        };
        let r = runqlat.get_or_insert_with(|| LatencySummary {
            merged: Some(false),
            ..Default::default()
        });
        r.events += summary_value(summary, "events").unwrap_or(0);
        r.p50_us = r.p50_us.max(p50);
        r.p90_us = r
            .p90_us
            .max(summary_value(summary, "p90_us").unwrap_or(p99));
        r.p99_us = r.p99_us.max(p99);
        if let Some(max) = summary_value(summary, "max_us") {
            r.max_us = Some(r.max_us.unwrap_or(0).max(max));
        }
    }
    runqlat
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
    use super::super::result_table::ResultTable;
    use super::*;
    use crate::dispatch::outcome::NodeFailure;
    use flamefleet_api::Artifact;
    use flamefleet_api::{NodePhase, RequestPhase};

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

    fn done(samples: i64, summary: &[(&str, &str)]) -> NodeOutcome {
        NodeOutcome::Done {
            artifacts: vec![artifact("cpu.pb.gz", samples)],
            summary: summary
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            runqlat_histogram: None,
        }
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
        summarize(table(current, outcomes).entries(), outcomes)
    }

    #[test]
    fn all_succeeded_after_settling() {
        let current = [entry("a", None), entry("b", None)];
        let outcomes = BTreeMap::from([
            ("a".to_string(), done(5, &[])),
            ("b".to_string(), done(7, &[])),
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
            ("a".to_string(), done(5, &[])),
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
                done(
                    1,
                    &[
                        ("p50_us", "3"),
                        ("p90_us", "9"),
                        ("p99_us", "40"),
                        ("events", "100"),
                    ],
                ),
            ),
            (
                "b".to_string(),
                done(
                    1,
                    &[
                        ("p50_us", "5"),
                        ("p99_us", "20.4"),
                        ("events", "50"),
                        ("max_us", "64"),
                    ],
                ),
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
        let a = with_histogram(
            done(90, &[("p50_us", "3"), ("p99_us", "4"), ("events", "90")]),
            &[(1, 90)],
        );
        let b = with_histogram(
            done(
                10,
                &[("p50_us", "1536"), ("p99_us", "2038"), ("events", "10")],
            ),
            &[(10, 10)],
        );
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
        let c = done(1, &[("p50_us", "7"), ("p99_us", "9"), ("events", "1")]);
        let mut outcomes = outcomes;
        outcomes.insert("c".into(), c);
        let r = summarize(&current, &outcomes).runqlat.unwrap();
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
            ("a".to_string(), done(5, &[("frequency_hz", "99")])),
            ("b".to_string(), done(5, &[("frequency_hz", "99")])),
        ]);
        let cpu = summarize(&current, &same).cpu.unwrap();
        assert_eq!(cpu.frequency_hz, 99);
        assert_eq!((cpu.requested_frequency_hz, cpu.message), (None, None));
        let joined = BTreeMap::from([
            ("a".to_string(), done(5, &[("frequency_hz", "99")])),
            (
                "b".to_string(),
                done(
                    5,
                    &[
                        ("frequency_hz", "19"),
                        ("requested_frequency_hz", "99"),
                        (
                            "frequency_note",
                            "joined a sampler already running at 19 Hz",
                        ),
                    ],
                ),
            ),
        ]);
        let cpu = summarize(&current, &joined).cpu.unwrap();
        assert_eq!(cpu.frequency_hz, 19);
        assert_eq!(cpu.requested_frequency_hz, Some(99));
        assert!(cpu.message.unwrap().contains("19 Hz"));
    }
}
