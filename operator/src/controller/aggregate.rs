//! From node entries and capture outcomes to the request's phase, summary and node entries
//! (pure logic).
//!
//! The operator is the only writer of a request's status: agents report their results over
//! the `Capture` stream, and the operator records them after checking every artifact
//! against the store. So a node entry changes only when the operator's session has an
//! outcome for it; entries recorded before (e.g. by a previous leader) stay as they are.

use std::collections::BTreeMap;

use flamefleet_api::{
    CpuSummary, LatencySummary, NodePhase, NodeStatus, ProfileSummary, RequestPhase,
};
use flamefleet_proto::agent::LatencyHistogram;

use super::node_outcome::NodeOutcome;

/// The result of aggregating a request's nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct Aggregation {
    /// Every node entry, with the outcomes applied.
    pub nodes: Vec<NodeStatus>,
    /// `Running`, or the terminal phase once every node is terminal and the dispatcher settled.
    pub phase: RequestPhase,
    /// Sums over nodes; set once the phase is terminal.
    pub summary: Option<ProfileSummary>,
}

/// Combines the stored node entries with the dispatcher's outcomes. `settled` is true when
/// every node has an outcome (or the dispatcher knows it will get none), so the phase may
/// become terminal.
pub fn aggregate(
    current: &[NodeStatus],
    outcomes: &BTreeMap<String, NodeOutcome>,
    settled: bool,
) -> Aggregation {
    let nodes: Vec<NodeStatus> = current
        .iter()
        .map(|entry| {
            let base = NodeStatus {
                node: entry.node.clone(),
                pods: entry.pods.clone(),
                ..Default::default()
            };
            match outcomes.get(&entry.node) {
                Some(NodeOutcome::Done { artifacts, .. }) => NodeStatus {
                    phase: Some(NodePhase::Succeeded),
                    artifacts: artifacts.clone(),
                    ..base
                },
                Some(NodeOutcome::Failed(failure)) => NodeStatus {
                    phase: Some(NodePhase::Failed),
                    message: Some(failure.to_string()),
                    ..base
                },
                None => entry.clone(),
            }
        })
        .collect();
    let from_nodes =
        RequestPhase::from_nodes(nodes.iter().map(|n| n.phase)).unwrap_or(RequestPhase::Failed);
    let phase = if from_nodes.is_terminal() && !settled {
        RequestPhase::Running
    } else {
        from_nodes
    };
    let summary = phase.is_terminal().then(|| summarize(&nodes, outcomes));
    Aggregation {
        nodes,
        phase,
        summary,
    }
}

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
pub fn summarize(
    effective: &[NodeStatus],
    outcomes: &BTreeMap<String, NodeOutcome>,
) -> ProfileSummary {
    let artifacts: Vec<_> = effective.iter().flat_map(|n| n.artifacts.iter()).collect();
    let samples: i64 = artifacts.iter().filter_map(|a| a.samples).sum();
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
        artifacts: Some(i32::try_from(artifacts.len()).unwrap_or(i32::MAX)),
        cpu: cpu_summary(done.iter().map(|(s, _)| *s)),
        runqlat: merged_runqlat(&done).or_else(|| worst_node_runqlat(&done)),
    }
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

/// One line describing how the nodes ended, for the Completed condition and the Event.
pub fn outcome_message(effective: &[NodeStatus]) -> String {
    let total = effective.len();
    let succeeded = effective
        .iter()
        .filter(|n| n.phase == Some(NodePhase::Succeeded))
        .count();
    let failures: Vec<String> = effective
        .iter()
        .filter(|n| n.phase == Some(NodePhase::Failed))
        .map(|n| format!("{}: {}", n.node, n.message.as_deref().unwrap_or("failed")))
        .collect();
    if failures.is_empty() {
        format!("{succeeded} of {total} nodes succeeded")
    } else {
        format!(
            "{succeeded} of {total} nodes succeeded; failed: {}",
            failures.join("; ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::node_outcome::NodeFailure;
    use super::*;
    use flamefleet_api::Artifact;

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

    #[test]
    fn entries_without_an_outcome_stay_as_recorded() {
        let mut a = entry("a", Some(NodePhase::Succeeded));
        a.artifacts = vec![artifact("cpu-a.pb.gz", 10)];
        let current = [
            a.clone(),
            entry("b", None),
            entry("c", Some(NodePhase::Running)),
        ];
        let agg = aggregate(&current, &BTreeMap::new(), false);
        assert_eq!(agg.phase, RequestPhase::Running);
        assert_eq!(agg.nodes, current.to_vec());
        assert!(agg.summary.is_none());
    }

    #[test]
    fn all_succeeded_after_settling() {
        let current = [
            entry("a", Some(NodePhase::Succeeded)),
            entry("b", Some(NodePhase::Succeeded)),
        ];
        let outcomes = BTreeMap::from([
            ("a".to_string(), done(5, &[])),
            ("b".to_string(), done(7, &[])),
        ]);
        let unsettled = aggregate(&current, &outcomes, false);
        assert_eq!(unsettled.phase, RequestPhase::Running);
        let agg = aggregate(&current, &outcomes, true);
        assert_eq!(agg.phase, RequestPhase::Succeeded);
        assert_eq!(outcome_message(&agg.nodes), "2 of 2 nodes succeeded");
        assert_eq!(agg.summary.unwrap().samples, Some(12));
    }

    #[test]
    fn failure_outcomes_mark_nodes_and_give_partial_success() {
        let current = [
            entry("a", Some(NodePhase::Running)),
            entry("b", Some(NodePhase::Running)),
        ];
        let outcomes = BTreeMap::from([
            ("a".to_string(), done(5, &[])),
            (
                "b".to_string(),
                NodeOutcome::Failed(NodeFailure::CaptureFailed {
                    reason: "no cgroup".into(),
                }),
            ),
        ]);
        let agg = aggregate(&current, &outcomes, true);
        assert_eq!(agg.phase, RequestPhase::PartiallySucceeded);
        assert_eq!(agg.nodes.len(), 2);
        let b = &agg.nodes[1];
        assert_eq!(b.phase, Some(NodePhase::Failed));
        assert_eq!(
            b.message.as_deref(),
            Some("capture failed on the agent: no cgroup")
        );
        // A DONE outcome records the artifacts the agent reported.
        assert_eq!(agg.nodes[0].artifacts.len(), 1);
        let msg = outcome_message(&agg.nodes);
        assert!(
            msg.contains("1 of 2 nodes succeeded; failed: b: capture failed"),
            "{msg}"
        );
        assert_eq!(agg.summary.unwrap().samples, Some(5));
    }

    #[test]
    fn every_node_failed_is_failed_and_no_nodes_is_failed() {
        let current = [entry("a", Some(NodePhase::Failed))];
        let agg = aggregate(&current, &BTreeMap::new(), true);
        assert_eq!(agg.phase, RequestPhase::Failed);
        let none = aggregate(&[], &BTreeMap::new(), true);
        assert_eq!(none.phase, RequestPhase::Failed);
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
        let summary = aggregate(&current, &outcomes, true).summary.unwrap();
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
        let summary = aggregate(&current, &outcomes, true).summary.unwrap();
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
