//! The in-memory table of one request's per-node results, and which `ProfileResultSlice`s
//! must be written again (pure logic).
//!
//! Aggregation is incremental: each outcome updates one entry, the counts and the failure
//! list, and marks the entry's slice dirty; a progress reconcile then applies only the dirty
//! slices (at most 100 entries each) and the small request status. Nothing re-reads every
//! node's result per event, so a 5,000-node request costs O(changed slices) writes per
//! round, not O(nodes).
//!
//! Slice assignment is stable: nodes are placed in node-name order, 100 per slice, when the
//! request starts, and a node never moves. A table rebuilt from the slices after an operator
//! restart keeps the placement it finds.

use std::collections::{BTreeMap, BTreeSet};

use flamefleet_api::result_slice::{MAX_NODES_PER_SLICE, slice_index};
use flamefleet_api::{
    NodeCounts, NodeFailureEntry, NodePhase, NodeStatus, ProfileResultSlice, RequestPhase,
};

use super::aggregate::Measures;
use crate::dispatch::outcome::NodeOutcome;
use crate::events::truncated;

/// Longest failure message copied into the request's status (the slice keeps more).
const STATUS_MESSAGE_BYTES: usize = 1024;
/// Longest failure message a node's slice entry keeps. Failure messages carry text an
/// agent sent (a gRPC status or progress message, up to 4 MiB): unbounded, one
/// compromised node could make its slice too large to store and lose the results of the
/// 99 other nodes it holds. 100 entries of this size stay far below the object limit.
const SLICE_MESSAGE_BYTES: usize = 8 * 1024;

/// One node's entry and the slice it lives in.
#[derive(Debug, Clone, PartialEq)]
struct Placed {
    slice: usize,
    entry: NodeStatus,
}

/// One request's per-node results, their slices, and what is not written yet.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResultTable {
    nodes: BTreeMap<String, Placed>,
    /// Nodes of each slice, by index.
    slices: Vec<BTreeSet<String>>,
    dirty: BTreeSet<usize>,
    counts: NodeCounts,
    /// Every failed node's status line, by node (the status shows the first few).
    failures: BTreeMap<String, NodeFailureEntry>,
    /// Failures recorded since the last [`ResultTable::take_announcements`], for Events.
    announce: Vec<NodeFailureEntry>,
    /// How many failures were ever queued for an Event (bounded like the status list).
    announced: usize,
    /// What the succeeded nodes measured, folded as their outcomes were recorded.
    measures: Measures,
}

/// The most per-node failure Events one request publishes; later failures are counted in
/// the final Event's message and listed in the slices.
pub const MAX_FAILURE_EVENTS: usize = flamefleet_api::profile_request::MAX_STATUS_FAILURES;

fn failure_entry(entry: &NodeStatus) -> NodeFailureEntry {
    NodeFailureEntry {
        node: entry.node.clone(),
        reason: entry
            .reason
            .clone()
            .unwrap_or_else(|| "NodeFailed".to_string()),
        message: truncated(
            entry.message.as_deref().unwrap_or("failed"),
            STATUS_MESSAGE_BYTES,
        ),
    }
}

impl ResultTable {
    /// A new request's table: `entries` placed in node-name order, 100 per slice, every
    /// slice dirty (none is written yet).
    pub fn new(entries: Vec<NodeStatus>) -> Self {
        let mut sorted = entries;
        sorted.sort_by(|a, b| a.node.cmp(&b.node));
        sorted.dedup_by(|a, b| a.node == b.node);
        let mut table = Self::default();
        for (i, entry) in sorted.into_iter().enumerate() {
            table.insert(i / MAX_NODES_PER_SLICE, entry);
        }
        table.dirty = (0..table.slices.len()).collect();
        table
    }

    /// The table of a request whose slices are already written (an operator restart):
    /// each node stays in the slice it was found in; nothing is dirty. Slices of other
    /// requests and names that are no slice name of `uid` are ignored.
    pub fn from_slices<'a>(
        uid: &str,
        slices: impl IntoIterator<Item = &'a ProfileResultSlice>,
    ) -> Self {
        let mut table = Self::default();
        for slice in slices {
            let Some(index) = slice
                .metadata
                .name
                .as_deref()
                .and_then(|n| slice_index(uid, n))
            else {
                continue;
            };
            if slice.spec.request.uid != uid {
                continue;
            }
            for entry in &slice.spec.nodes {
                if !table.nodes.contains_key(&entry.node) {
                    table.insert(index, entry.clone());
                }
            }
        }
        // Failures found in the slices were announced by the previous operator.
        table.announce.clear();
        table.announced = table.failures.len();
        table
    }

    fn insert(&mut self, slice: usize, entry: NodeStatus) {
        if self.slices.len() <= slice {
            self.slices.resize_with(slice + 1, BTreeSet::new);
        }
        self.slices[slice].insert(entry.node.clone());
        self.counts.add(entry.phase, 1);
        if entry.phase == Some(NodePhase::Failed) {
            self.failures
                .insert(entry.node.clone(), failure_entry(&entry));
        }
        self.nodes
            .insert(entry.node.clone(), Placed { slice, entry });
    }

    /// Records `outcome` for `node`; marks its slice dirty when the entry changed. Returns
    /// false for a node the table does not hold, or an entry already recorded as is.
    pub fn apply(&mut self, node: &str, outcome: &NodeOutcome) -> bool {
        let Some(placed) = self.nodes.get_mut(node) else {
            return false;
        };
        let base = NodeStatus {
            node: placed.entry.node.clone(),
            pods: placed.entry.pods.clone(),
            ..Default::default()
        };
        let updated = match outcome {
            NodeOutcome::Done { artifacts, .. } => NodeStatus {
                phase: Some(NodePhase::Succeeded),
                artifacts: artifacts.clone(),
                ..base
            },
            NodeOutcome::Failed(failure) => NodeStatus {
                phase: Some(NodePhase::Failed),
                reason: Some(failure.reason().to_string()),
                message: Some(truncated(&failure.to_string(), SLICE_MESSAGE_BYTES)),
                ..base
            },
        };
        if updated == placed.entry {
            return false;
        }
        self.counts.add(placed.entry.phase, -1);
        self.counts.add(updated.phase, 1);
        self.failures.remove(node);
        if updated.phase == Some(NodePhase::Failed) {
            let failure = failure_entry(&updated);
            if self.announced < MAX_FAILURE_EVENTS {
                self.announced += 1;
                self.announce.push(failure.clone());
            }
            self.failures.insert(node.to_string(), failure);
        }
        if let NodeOutcome::Done {
            summary,
            runqlat_histogram,
            ..
        } = outcome
        {
            self.measures
                .add(summary.as_deref(), runqlat_histogram.as_ref());
        }
        self.dirty.insert(placed.slice);
        placed.entry = updated;
        true
    }

    /// The request's summary: totals over the entries, and what the nodes whose outcome
    /// this table recorded measured (see [`Measures`]).
    pub fn summary(&self) -> flamefleet_api::ProfileSummary {
        self.measures.summary(self.entries())
    }

    /// The entries of every dirty slice, by index, in node order.
    pub fn dirty_slices(&self) -> Vec<(usize, Vec<NodeStatus>)> {
        self.dirty
            .iter()
            .map(|&i| (i, self.slice_entries(i)))
            .collect()
    }

    /// The entries of slice `index`, in node order.
    pub fn slice_entries(&self, index: usize) -> Vec<NodeStatus> {
        self.slices
            .get(index)
            .into_iter()
            .flatten()
            .filter_map(|n| self.nodes.get(n).map(|p| p.entry.clone()))
            .collect()
    }

    /// Slice `index` is written as it is now.
    pub fn mark_clean(&mut self, index: usize) {
        self.dirty.remove(&index);
    }

    /// True when some slice is not written as it is now.
    pub fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Number of slices.
    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// Nodes by phase.
    pub fn counts(&self) -> NodeCounts {
        self.counts
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when the table holds no node.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The entry of `node`.
    pub fn entry(&self, node: &str) -> Option<&NodeStatus> {
        self.nodes.get(node).map(|p| &p.entry)
    }

    /// Every entry, in node order.
    pub fn entries(&self) -> impl Iterator<Item = &NodeStatus> {
        self.nodes.values().map(|p| &p.entry)
    }

    /// The first `limit` failures in node order, and how many were left out.
    pub fn failures(&self, limit: usize) -> (Vec<NodeFailureEntry>, usize) {
        let shown: Vec<NodeFailureEntry> = self.failures.values().take(limit).cloned().collect();
        let omitted = self.failures.len() - shown.len();
        (shown, omitted)
    }

    /// Failures to publish as Events (at most [`MAX_FAILURE_EVENTS`] over the request's
    /// life); empties the queue.
    pub fn take_announcements(&mut self) -> Vec<NodeFailureEntry> {
        std::mem::take(&mut self.announce)
    }

    /// `Running` while a node has no terminal entry or the dispatcher may still report
    /// (`settled` false); then `Succeeded`, `Failed` or `PartiallySucceeded`. No node at all
    /// is `Failed`.
    pub fn phase(&self, settled: bool) -> RequestPhase {
        let c = self.counts;
        if c.total == 0 {
            return RequestPhase::Failed;
        }
        if c.unfinished() > 0 || !settled {
            return RequestPhase::Running;
        }
        if c.succeeded == c.total {
            RequestPhase::Succeeded
        } else if c.failed == c.total {
            RequestPhase::Failed
        } else {
            RequestPhase::PartiallySucceeded
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::outcome::NodeFailure;
    use flamefleet_api::{Artifact, ProfileRequest};

    fn pending(node: &str) -> NodeStatus {
        NodeStatus {
            node: node.into(),
            pods: vec![format!("pod-{node}")],
            ..Default::default()
        }
    }

    fn node_name(i: usize) -> String {
        format!("node-{i:04}")
    }

    fn done() -> NodeOutcome {
        NodeOutcome::Done {
            artifacts: vec![Artifact {
                name: "cpu.pb.gz".into(),
                samples: Some(3),
                ..Default::default()
            }],
            summary: None,
            runqlat_histogram: None,
        }
    }

    fn failed(reason: &str) -> NodeOutcome {
        NodeOutcome::Failed(NodeFailure::CaptureFailed {
            reason: reason.into(),
        })
    }

    #[test]
    fn nodes_are_placed_in_name_order_100_per_slice_whatever_the_input_order() {
        let mut names: Vec<String> = (0..250).map(node_name).collect();
        names.reverse();
        let table = ResultTable::new(names.iter().map(|n| pending(n)).collect());
        assert_eq!(table.slice_count(), 3);
        assert_eq!(table.len(), 250);
        let first = table.slice_entries(0);
        assert_eq!(first.len(), 100);
        assert_eq!(first[0].node, node_name(0));
        assert_eq!(first[99].node, node_name(99));
        assert_eq!(table.slice_entries(2).len(), 50);
        assert_eq!(
            table.dirty_slices().len(),
            3,
            "a new table writes every slice"
        );
        // The same nodes in another order land in the same slices.
        let again = ResultTable::new((0..250).map(|i| pending(&node_name(i))).collect());
        assert_eq!(again, table);
    }

    #[test]
    fn only_the_slices_of_changed_nodes_are_dirty() {
        let mut table = ResultTable::new((0..300).map(|i| pending(&node_name(i))).collect());
        for i in 0..table.slice_count() {
            table.mark_clean(i);
        }
        assert!(!table.has_dirty());
        assert!(table.apply(&node_name(150), &done()));
        assert!(table.apply(&node_name(160), &failed("no cgroup")));
        let dirty = table.dirty_slices();
        assert_eq!(dirty.len(), 1);
        assert_eq!(dirty[0].0, 1);
        assert_eq!(dirty[0].1.len(), 100);
        let entry = table.entry(&node_name(150)).unwrap();
        assert_eq!(entry.phase, Some(NodePhase::Succeeded));
        assert_eq!(entry.pods, [format!("pod-{}", node_name(150))]);
        table.mark_clean(1);
        // The same outcome again changes nothing; unknown nodes are ignored.
        assert!(!table.apply(&node_name(150), &done()));
        assert!(!table.apply("elsewhere", &done()));
        assert!(!table.has_dirty());
        let c = table.counts();
        assert_eq!(
            (c.total, c.pending, c.succeeded, c.failed),
            (300, 298, 1, 1)
        );
        assert_eq!(table.phase(false), RequestPhase::Running);
    }

    #[test]
    fn failures_are_bounded_in_node_order_with_the_left_out_count() {
        let mut table = ResultTable::new((0..60).map(|i| pending(&node_name(i))).collect());
        for i in (0..60).rev() {
            table.apply(&node_name(i), &failed(&"x".repeat(5000)));
        }
        let (shown, omitted) = table.failures(20);
        assert_eq!(shown.len(), 20);
        assert_eq!(omitted, 40);
        assert_eq!(shown[0].node, node_name(0));
        assert_eq!(shown[19].node, node_name(19));
        assert_eq!(shown[0].reason, "CaptureFailed");
        assert!(shown[0].message.len() <= STATUS_MESSAGE_BYTES + 3);
        // Longer messages stay in the slice entries, up to their own bound.
        let in_slice = |table: &ResultTable, i| {
            table
                .entry(&node_name(i))
                .and_then(|e| e.message.clone())
                .map_or(0, |m| m.len())
        };
        assert!(in_slice(&table, 0) > 5000);
        // Events: at most MAX_FAILURE_EVENTS over the request's life.
        assert_eq!(table.take_announcements().len(), MAX_FAILURE_EVENTS);
        assert!(table.take_announcements().is_empty());
        // What an agent sends (here 1 MiB) is cut at the slice's bound.
        table.apply(&node_name(0), &failed(&"y".repeat(1 << 20)));
        let len = in_slice(&table, 0);
        assert!(
            (SLICE_MESSAGE_BYTES..=SLICE_MESSAGE_BYTES + 3).contains(&len),
            "{len}"
        );
        assert_eq!(table.phase(true), RequestPhase::Failed);
    }

    #[test]
    fn phase_once_settled() {
        let mut table = ResultTable::new(vec![pending("a"), pending("b")]);
        table.apply("a", &done());
        assert_eq!(table.phase(true), RequestPhase::Running);
        table.apply("b", &done());
        assert_eq!(table.phase(false), RequestPhase::Running);
        assert_eq!(table.phase(true), RequestPhase::Succeeded);
        table.apply("b", &failed("gone"));
        assert_eq!(table.phase(true), RequestPhase::PartiallySucceeded);
        assert_eq!(
            ResultTable::new(Vec::new()).phase(true),
            RequestPhase::Failed
        );
    }

    #[test]
    fn rebuilt_from_slices_keeps_placement_counts_and_failures() {
        let request: ProfileRequest = serde_json::from_value(serde_json::json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": "r", "namespace": "ns", "uid": "u1"},
            "spec": {"type": "cpu", "podNames": ["p"], "duration": "1s"},
        }))
        .unwrap();
        let mut table = ResultTable::new((0..150).map(|i| pending(&node_name(i))).collect());
        table.apply(&node_name(3), &done());
        table.apply(&node_name(120), &failed("boom"));
        let slices: Vec<ProfileResultSlice> = (0..table.slice_count())
            .map(|i| ProfileResultSlice::for_request(&request, i, table.slice_entries(i)).unwrap())
            .collect();
        let rebuilt = ResultTable::from_slices("u1", slices.iter().rev());
        assert_eq!(rebuilt.counts(), table.counts());
        assert_eq!(rebuilt.slice_count(), 2);
        assert_eq!(rebuilt.slice_entries(1), table.slice_entries(1));
        assert_eq!(rebuilt.failures(20), table.failures(20));
        assert!(!rebuilt.has_dirty());
        assert!(rebuilt.clone().take_announcements().is_empty());
        // Another request's UID finds nothing.
        assert!(ResultTable::from_slices("u2", &slices).is_empty());
    }
}
