//! One request's captures in progress: the nodes dispatched to, the outcomes recorded since
//! the reconciler last looked, and the reconciler's own record of the results (`R`, which
//! the dispatcher carries but never reads), all behind one lock.
//!
//! Each node's outcome is held in one place at a time: from [`Session::record`] until the
//! reconciler takes it with [`Session::absorb`], then in the reconciler's results.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use tokio::task::AbortHandle;

use super::outcome::NodeOutcome;
use crate::pods::agents::AgentEndpoint;

/// The captures of one request in progress.
#[derive(Debug)]
pub struct Session<R> {
    /// Every node of the request that this session waits for: dispatched or already settled.
    expected: BTreeSet<String>,
    /// The agents of the dispatched nodes (asked to cancel when the request is deleted).
    agents: BTreeMap<String, AgentEndpoint>,
    state: Mutex<State<R>>,
}

#[derive(Debug)]
struct State<R> {
    /// The reconciler's record of the results, installed when the session starts.
    results: R,
    /// Outcomes recorded and not yet absorbed into `results`, in arrival order.
    arrived: Vec<(String, NodeOutcome)>,
    /// Nodes with an outcome (absorbed or not).
    ended: BTreeSet<String>,
    /// The node tasks, aborted when the request is deleted.
    tasks: Vec<AbortHandle>,
    /// Set once the terminal status is written; the session is forgotten when a reconcile
    /// sees the terminal phase (until then the cache may still show Running).
    completed: bool,
}

impl<R> Session<R> {
    /// A session waiting for `dispatched` nodes, with `settled` ones already decided.
    pub(super) fn new(
        dispatched: BTreeMap<String, AgentEndpoint>,
        settled: BTreeMap<String, NodeOutcome>,
        results: R,
    ) -> Self {
        let expected = dispatched.keys().chain(settled.keys()).cloned().collect();
        Self {
            expected,
            agents: dispatched,
            state: Mutex::new(State {
                results,
                ended: settled.keys().cloned().collect(),
                arrived: settled.into_iter().collect(),
                tasks: Vec::new(),
                completed: false,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<R>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True when every expected node has an outcome.
    pub fn settled(&self) -> bool {
        let state = self.lock();
        self.expected.iter().all(|n| state.ended.contains(n))
    }

    /// True once the request's terminal status was written.
    pub fn completed(&self) -> bool {
        self.lock().completed
    }

    /// Marks the terminal status written.
    pub fn mark_completed(&self) {
        self.lock().completed = true;
    }

    /// Records the outcome of `node` (once per node: its task ends with it).
    pub(super) fn record(&self, node: &str, outcome: NodeOutcome) {
        let mut state = self.lock();
        state.ended.insert(node.to_string());
        state.arrived.push((node.to_string(), outcome));
    }

    /// Keeps the node tasks' handles, for [`Session::stop`].
    pub(super) fn set_tasks(&self, tasks: Vec<AbortHandle>) {
        self.lock().tasks = tasks;
    }

    /// Aborts the node tasks; returns the agents of the nodes without an outcome.
    pub(super) fn stop(&self) -> Vec<AgentEndpoint> {
        let state = self.lock();
        for task in &state.tasks {
            task.abort();
        }
        self.agents
            .iter()
            .filter(|(node, _)| !state.ended.contains(*node))
            .map(|(_, agent)| agent.clone())
            .collect()
    }

    /// Hands the outcomes recorded since the last call to `apply`, each once, with the
    /// results (O(new outcomes), not O(nodes)). Returns how many there were.
    ///
    /// Called once at the start of a progress reconcile, so that the slices it writes and
    /// the status it computes see the same outcomes; later ones wait for the next reconcile
    /// (each recorded outcome triggers one).
    pub fn absorb(&self, mut apply: impl FnMut(&mut R, &str, NodeOutcome)) -> usize {
        let mut state = self.lock();
        let arrived = std::mem::take(&mut state.arrived);
        let count = arrived.len();
        for (node, outcome) in arrived {
            apply(&mut state.results, &node, outcome);
        }
        count
    }

    /// Runs `f` on the results.
    pub fn with_results<T>(&self, f: impl FnOnce(&mut R) -> T) -> T {
        f(&mut self.lock().results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::outcome::NodeFailure;

    fn agent(node: &str) -> AgentEndpoint {
        AgentEndpoint {
            node: node.into(),
            pod: format!("agent-{node}"),
            address: "127.0.0.1:7070".into(),
        }
    }

    fn failed() -> NodeOutcome {
        NodeOutcome::Failed(NodeFailure::CaptureFailed { reason: "x".into() })
    }

    #[test]
    fn each_outcome_reaches_the_results_once_and_settles_its_node() {
        let dispatched = BTreeMap::from([("a".to_string(), agent("a")), ("b".into(), agent("b"))]);
        let settled = BTreeMap::from([("c".to_string(), failed())]);
        let session = Session::new(dispatched, settled, Vec::<String>::new());
        assert!(!session.settled());
        let take = |s: &Session<Vec<String>>| s.absorb(|r, node, _| r.push(node.to_string()));
        assert_eq!(take(&session), 1, "the settled node's outcome");
        session.record("a", failed());
        assert_eq!(session.stop().len(), 1, "b has no outcome yet");
        session.record("b", failed());
        assert!(session.settled());
        assert_eq!(take(&session), 2);
        assert_eq!(take(&session), 0, "each outcome once");
        assert_eq!(session.with_results(|r| r.clone()), ["c", "a", "b"]);
        assert!(!session.completed());
        session.mark_completed();
        assert!(session.completed());
    }
}
