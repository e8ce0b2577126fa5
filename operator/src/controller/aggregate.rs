//! From node entries and capture outcomes to the request's phase, summary and node entries
//! (pure logic).
//!
//! The operator is the only writer of a request's status: agents report their results over
//! the `Capture` stream, and the operator records them after checking every artifact
//! against the store. So a node entry changes only when the operator's session has an
//! outcome for it; entries recorded before (e.g. by a previous leader) stay as they are.

use std::collections::BTreeMap;

use flamefleet_api::{LatencySummary, NodePhase, NodeStatus, ProfileSummary, RequestPhase};

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

/// Totals over nodes. Run-queue latency percentiles cannot be merged exactly from per-node
/// percentiles, so the summary reports the worst node's (max), which is exact with one node
/// and an upper bound otherwise; each node's histogram artifact has the full detail.
pub fn summarize(
    effective: &[NodeStatus],
    outcomes: &BTreeMap<String, NodeOutcome>,
) -> ProfileSummary {
    let artifacts: Vec<_> = effective.iter().flat_map(|n| n.artifacts.iter()).collect();
    let samples: i64 = artifacts.iter().filter_map(|a| a.samples).sum();
    let mut runqlat: Option<LatencySummary> = None;
    for outcome in outcomes.values() {
        let NodeOutcome::Done { summary, .. } = outcome else {
            continue;
        };
        let (Some(p50), Some(p99)) = (
            summary_value(summary, "p50_us"),
            summary_value(summary, "p99_us"),
        ) else {
            continue;
        };
        let r = runqlat.get_or_insert_with(LatencySummary::default);
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
    ProfileSummary {
        samples: Some(samples),
        artifacts: Some(i32::try_from(artifacts.len()).unwrap_or(i32::MAX)),
        runqlat,
    }
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
    }
}
