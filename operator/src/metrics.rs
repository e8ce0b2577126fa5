//! Prometheus metrics of the operator (prometheus-client), exposed on `/metrics`.

use std::sync::Mutex;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label of an error count.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// The error variant (see `Error::metric_label`).
    pub error: String,
}

/// Label of a per-node outcome count.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `Succeeded`, or the failure reason (e.g. `AgentUnreachable`, `TimedOut`).
    pub outcome: String,
}

/// Label of a finished-request count.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// The terminal phase.
    pub phase: String,
}

/// Label of an agent connection attempt.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    /// `ok` or `error`.
    pub result: String,
}

/// Label of a trigger fire reported by an agent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TriggerLabels {
    /// `Created` (a run), or why not: `Cooldown`, `PolicyCooldown`, `ConcurrentCaptures`,
    /// `DutyCycle`, `QueueFull`, `Suspended`, `NotWatched` (a node reported a pod or policy
    /// it was not told to watch), `RunNameTaken` (a request of the run's name exists and is
    /// not the policy's), `Failed`.
    pub outcome: String,
}

/// Label of a TLS handshake with an agent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    /// `full` or `resumed`.
    pub kind: &'static str,
}

/// Label of a dropped export.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabels {
    /// Why: `queue_full`, `namespace_full`, `retries_exhausted`, `rejected`,
    /// `artifact_gone`, `artifact_changed` or `invalid_profile`.
    pub reason: &'static str,
}

/// The operator's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    reconciles: Counter,
    errors: Family<ErrorLabels, Counter>,
    duration: Histogram,
    captures: Counter,
    node_outcomes: Family<OutcomeLabels, Counter>,
    finished: Family<PhaseLabels, Counter>,
    sessions: Gauge,
    leader: Gauge,
    dispatch_wait: Histogram,
    dispatch_retries: Counter,
    capture_collects: Counter,
    agent_handshakes: Family<HandshakeLabels, Counter>,
    agent_connections: Family<ConnectionLabels, Counter>,
    agent_channels: Gauge,
    policy_runs: Counter,
    budget_skips: Counter,
    slice_writes: Counter,
    exported: Counter,
    export_drops: Family<DropLabels, Counter>,
    export_retries: Counter,
    export_split: Counter,
    export_queue: Gauge,
    trigger_fires: Family<TriggerLabels, Counter>,
    trigger_streams: Gauge,
    continuous_windows: Family<TriggerLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `flamefleet_operator` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("flamefleet_operator");
        let reconciles = Counter::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 14));
        let captures = Counter::default();
        let node_outcomes = Family::<OutcomeLabels, Counter>::default();
        let finished = Family::<PhaseLabels, Counter>::default();
        let sessions = Gauge::default();
        let leader = Gauge::default();
        // 1 ms .. ~33 s: a node's wait for a dispatch permit behind a large fleet's setup.
        let dispatch_wait = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let dispatch_retries = Counter::default();
        let capture_collects = Counter::default();
        let agent_handshakes = Family::<HandshakeLabels, Counter>::default();
        let agent_connections = Family::<ConnectionLabels, Counter>::default();
        let agent_channels = Gauge::default();
        registry.register(
            "dispatch_wait_seconds",
            "Time a node's capture waited for a dispatch permit (--max-concurrent-dispatch)",
            dispatch_wait.clone(),
        );
        registry.register(
            "dispatch_retries",
            "Capture calls retried after the agent could not be reached",
            dispatch_retries.clone(),
        );
        registry.register(
            "capture_collects",
            "Captures whose result was collected by a second call (Collect), the operator having hung up once the agent accepted",
            capture_collects.clone(),
        );
        registry.register(
            "agent_tls_handshakes",
            "TLS handshakes with agents, by kind: full, or resumed from an earlier session",
            agent_handshakes.clone(),
        );
        registry.register(
            "agent_connections",
            "New connections to agents (cached channels are reused), by result",
            agent_connections.clone(),
        );
        registry.register(
            "agent_channels",
            "Open agent channels in the connection cache",
            agent_channels.clone(),
        );
        let policy_runs = Counter::default();
        let budget_skips = Counter::default();
        let slice_writes = Counter::default();
        let trigger_fires = Family::<TriggerLabels, Counter>::default();
        let trigger_streams = Gauge::default();
        let continuous_windows = Family::<TriggerLabels, Counter>::default();
        registry.register(
            "continuous_windows",
            "Always-on windows (one pod's) sent by agents, by what became of them",
            continuous_windows.clone(),
        );
        registry.register(
            "trigger_fires",
            "Trigger fires reported by agents, by what became of them",
            trigger_fires.clone(),
        );
        registry.register(
            "trigger_watch_streams",
            "Agents holding a watch set of policy triggers now",
            trigger_streams.clone(),
        );
        registry.register(
            "result_slice_writes",
            "ProfileResultSlices applied (each holds up to 100 nodes' results)",
            slice_writes.clone(),
        );
        registry.register(
            "policy_runs",
            "Runs created by sampling policies",
            policy_runs.clone(),
        );
        registry.register(
            "budget_skips",
            "Pods a scheduled run passed over because their node was at its budget",
            budget_skips.clone(),
        );
        registry.register(
            "reconciles",
            "Reconciles of every controller (ProfileRequests, sampling policies, downloads)",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles by error",
            errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of one reconcile",
            duration.clone(),
        );
        registry.register(
            "captures_dispatched",
            "Capture calls sent to agents",
            captures.clone(),
        );
        registry.register(
            "node_outcomes",
            "Per-node capture outcomes",
            node_outcomes.clone(),
        );
        registry.register(
            "requests_finished",
            "Requests that reached a terminal phase",
            finished.clone(),
        );
        registry.register(
            "capture_sessions",
            "Requests whose captures are in progress",
            sessions.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease",
            leader.clone(),
        );
        let exported = Counter::default();
        let export_drops = Family::<DropLabels, Counter>::default();
        let export_retries = Counter::default();
        let export_split = Counter::default();
        let export_queue = Gauge::default();
        registry.register(
            "export_artifacts",
            "Capture artifacts sent to the OTLP export endpoint",
            exported.clone(),
        );
        registry.register(
            "export_dropped_artifacts",
            "Capture artifacts not exported, by reason",
            export_drops.clone(),
        );
        registry.register(
            "export_retries",
            "Export attempts retried (the endpoint or the store was unavailable)",
            export_retries.clone(),
        );
        registry.register(
            "export_split_requests",
            "OTLP requests made by splitting profiles over the request size limit into parts",
            export_split.clone(),
        );
        registry.register(
            "export_queued",
            "Captures waiting in the export queue",
            export_queue.clone(),
        );
        Self {
            registry: Mutex::new(registry),
            reconciles,
            errors,
            duration,
            captures,
            node_outcomes,
            finished,
            sessions,
            leader,
            dispatch_wait,
            dispatch_retries,
            capture_collects,
            agent_handshakes,
            agent_connections,
            agent_channels,
            policy_runs,
            budget_skips,
            slice_writes,
            exported,
            export_drops,
            export_retries,
            export_split,
            export_queue,
            trigger_fires,
            trigger_streams,
            continuous_windows,
        }
    }

    /// Counts an always-on window by what became of it (`Queued`, `Empty`, `NotAsked`,
    /// `TooFrequent`, ...).
    pub fn continuous_window(&self, outcome: &str) {
        self.continuous_windows
            .get_or_create(&TriggerLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts an artifact exported.
    pub fn export_exported(&self) {
        self.exported.inc();
    }

    /// Counts `n` artifacts not exported, for `reason` (see [`DropLabels`]).
    pub fn export_dropped(&self, reason: &'static str, n: u64) {
        self.export_drops
            .get_or_create(&DropLabels { reason })
            .inc_by(n);
    }

    /// Counts a retried export attempt.
    pub fn export_retried(&self) {
        self.export_retries.inc();
    }

    /// Counts the `parts` requests of a profile sent in parts.
    pub fn export_split(&self, parts: u64) {
        self.export_split.inc_by(parts);
    }

    /// Sets the number of captures in the export queue.
    pub fn export_queued(&self, n: usize) {
        self.export_queue.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts a trigger fire by what became of it.
    pub fn trigger_fire(&self, outcome: &str) {
        self.trigger_fires
            .get_or_create(&TriggerLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Sets the number of agents holding a watch set.
    pub fn set_trigger_streams(&self, n: usize) {
        self.trigger_streams
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts a reconcile and times it until the returned guard drops.
    pub fn reconcile(&self) -> ReconcileTimer<'_> {
        self.reconciles.inc();
        ReconcileTimer {
            start: Instant::now(),
            histogram: &self.duration,
        }
    }

    /// Counts a failed reconcile.
    pub fn reconcile_failed(&self, error: &crate::Error) {
        self.errors
            .get_or_create(&ErrorLabels {
                error: error.metric_label().to_string(),
            })
            .inc();
    }

    /// Counts a Capture call.
    pub fn capture_dispatched(&self) {
        self.captures.inc();
    }

    /// Counts a node that succeeded.
    pub fn node_succeeded(&self) {
        self.node_outcome("Succeeded");
    }

    /// Counts a node that failed, by reason.
    pub fn node_failed(&self, reason: &str) {
        self.node_outcome(reason);
    }

    fn node_outcome(&self, outcome: &str) {
        self.node_outcomes
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts a request that reached `phase`.
    pub fn request_finished(&self, phase: &str) {
        self.finished
            .get_or_create(&PhaseLabels {
                phase: phase.to_string(),
            })
            .inc();
    }

    /// Sets the number of sessions in progress.
    pub fn set_sessions(&self, n: usize) {
        self.sessions.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Records how long a node waited for a dispatch permit.
    pub fn dispatch_waited(&self, waited: std::time::Duration) {
        self.dispatch_wait.observe(waited.as_secs_f64());
    }

    /// Counts a capture call retried after a connection failure.
    pub fn dispatch_retried(&self) {
        self.dispatch_retries.inc();
    }

    /// Counts a capture collected by a second call.
    pub fn capture_collected(&self) {
        self.capture_collects.inc();
    }

    /// Counts a completed TLS handshake with an agent.
    pub fn agent_handshake(&self, resumed: bool) {
        self.agent_handshakes
            .get_or_create(&HandshakeLabels {
                kind: if resumed { "resumed" } else { "full" },
            })
            .inc();
    }

    /// Counts a new agent connection, established or not.
    pub fn agent_connection(&self, ok: bool) {
        self.agent_connections
            .get_or_create(&ConnectionLabels {
                result: if ok { "ok" } else { "error" }.to_string(),
            })
            .inc();
    }

    /// Sets the number of cached agent channels.
    pub fn set_agent_channels(&self, n: usize) {
        self.agent_channels
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Records whether this replica leads.
    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// Counts a run created by a sampling policy.
    pub fn policy_run_created(&self) {
        self.policy_runs.inc();
    }

    /// Counts pods a scheduled run passed over for the node budget.
    pub fn budget_skips(&self, n: usize) {
        self.budget_skips
            .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }

    /// Counts result slices written.
    pub fn result_slices_written(&self, n: usize) {
        self.slice_writes
            .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }

    /// Result slices written so far.
    pub fn result_slice_writes(&self) -> u64 {
        self.slice_writes.get()
    }

    /// Total reconciles so far.
    pub fn reconcile_count(&self) -> u64 {
        self.reconciles.get()
    }

    /// The metrics in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

/// Observes a reconcile's duration when dropped, whichever way the reconcile returns.
#[derive(Debug)]
pub struct ReconcileTimer<'a> {
    start: Instant,
    histogram: &'a Histogram,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_counts_errors_and_durations() {
        let m = Metrics::new();
        {
            let _t = m.reconcile();
        }
        m.reconcile_failed(&crate::Error::MissingMetadata("uid"));
        m.node_failed("TimedOut");
        m.request_finished("Succeeded");
        m.set_leader(true);
        m.agent_connection(true);
        m.set_agent_channels(3);
        m.dispatch_waited(std::time::Duration::from_millis(5));
        let text = m.encode();
        assert!(
            text.contains("flamefleet_operator_reconciles_total 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "flamefleet_operator_reconcile_errors_total{error=\"missing_metadata\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("flamefleet_operator_reconcile_duration_seconds_count 1"),
            "{text}"
        );
        assert!(
            text.contains("flamefleet_operator_node_outcomes_total{outcome=\"TimedOut\"} 1"),
            "{text}"
        );
        assert!(text.contains("flamefleet_operator_leader 1"), "{text}");
        assert!(
            text.contains("flamefleet_operator_agent_connections_total{result=\"ok\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("flamefleet_operator_agent_channels 3"),
            "{text}"
        );
        assert!(
            text.contains("flamefleet_operator_dispatch_wait_seconds_count 1"),
            "{text}"
        );
        assert_eq!(m.reconcile_count(), 1);
    }
}
