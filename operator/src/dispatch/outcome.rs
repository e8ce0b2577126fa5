//! How one node's capture ended, as the dispatcher saw it, with the message the status shows.

use std::time::Duration;

use flamefleet_api::Artifact;
use flamefleet_proto::agent::{CaptureSummary, LatencyHistogram};

/// The end of one node's capture.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeOutcome {
    /// The agent reported DONE; its artifacts passed the store's checks.
    Done {
        /// The uploaded artifacts.
        artifacts: Vec<Artifact>,
        /// What the capture measured (e.g. the CPU frequency, run-queue percentiles, the
        /// heap source); `None` from an agent that sends no typed summary. Boxed as the
        /// message carries it (a heap summary lists processes).
        summary: Option<Box<CaptureSummary>>,
        /// A runqlat capture's log2 histogram of every wait on the node, merged over nodes
        /// for the request's percentiles.
        runqlat_histogram: Option<LatencyHistogram>,
    },
    /// The node's capture failed.
    Failed(NodeFailure),
}

/// Why a node's capture failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeFailure {
    /// No agent pod serves the node.
    NoAgent {
        /// The node.
        node: String,
        /// Where agents were looked for.
        agent_namespace: String,
    },
    /// The agent could not be reached.
    Unreachable {
        /// Agent pod.
        agent: String,
        /// `host:port`.
        address: String,
        /// The transport error.
        error: String,
    },
    /// Every target pod of the node vanished before the capture started.
    PodsVanished {
        /// Pod names and what happened to them.
        pods: Vec<(String, String)>,
    },
    /// The agent reported FAILED.
    CaptureFailed {
        /// The agent's reason.
        reason: String,
    },
    /// The agent's upload was refused because the artifact store's volume is full.
    StorageFull {
        /// The agent's message (the store's answer).
        message: String,
    },
    /// The agent stopped the capture itself: it had not ended by the operator's deadline
    /// plus the agent's margin, so nobody was waiting for it (an operator killed or
    /// restarted before it collected the result; see `docs/failure-modes.md`).
    Abandoned {
        /// The agent's message.
        message: String,
    },
    /// The agent's stream broke before a result (agent killed or restarted mid-capture).
    Interrupted {
        /// Agent pod.
        agent: String,
        /// The stream error.
        error: String,
    },
    /// No result within duration + grace.
    TimedOut {
        /// How long the operator waited.
        after: Duration,
        /// Why asking the agent to cancel the capture failed; `None` when it was cancelled.
        cancel_error: Option<String>,
    },
    /// An uploaded artifact failed the store's checks (size, sha256) or is missing.
    UploadRejected {
        /// The artifact.
        artifact: String,
        /// The store's error.
        error: String,
    },
    /// The operator could not prepare the capture (e.g. the store could not sign URLs).
    Preparation {
        /// What failed.
        error: String,
    },
    /// The agent's report breaks what an agent may send (see `agent_report`).
    ReportRefused {
        /// What was wrong.
        reason: String,
    },
    /// The request's namespace has no room left in the artifact store.
    QuotaExceeded(crate::store::quota::QuotaExceeded),
}

impl NodeFailure {
    /// The failure of a FAILED report: its `reason` when it is one the operator knows (the
    /// field is the agent's to fill, and a reason is a label users select on), else
    /// `CaptureFailed` with the agent's `message`.
    pub fn reported(reason: &str, message: String) -> Self {
        match reason {
            "StorageFull" => Self::StorageFull { message },
            "Abandoned" => Self::Abandoned { message },
            _ => Self::CaptureFailed { reason: message },
        }
    }

    /// A short, stable label for metrics and event reasons.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoAgent { .. } => "NoAgent",
            Self::Unreachable { .. } => "AgentUnreachable",
            Self::PodsVanished { .. } => "PodsVanished",
            Self::CaptureFailed { .. } => "CaptureFailed",
            Self::StorageFull { .. } => "StorageFull",
            Self::Abandoned { .. } => "Abandoned",
            Self::Interrupted { .. } => "AgentInterrupted",
            Self::TimedOut { .. } => "TimedOut",
            Self::UploadRejected { .. } => "UploadRejected",
            Self::Preparation { .. } => "PreparationFailed",
            Self::ReportRefused { .. } => "ReportRefused",
            Self::QuotaExceeded(_) => "QuotaExceeded",
        }
    }
}

impl std::fmt::Display for NodeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoAgent {
                node,
                agent_namespace,
            } => f.write_str(&crate::pods::agents::no_agent_message(
                node,
                agent_namespace,
            )),
            Self::Unreachable {
                agent,
                address,
                error,
            } => write!(
                f,
                "agent {agent} at {address} is unreachable: {error}; check that the agent pod runs and that its TLS certificate chains to the operator's CA"
            ),
            Self::PodsVanished { pods } => {
                let list: Vec<String> =
                    pods.iter().map(|(p, why)| format!("{p} ({why})")).collect();
                write!(
                    f,
                    "pod vanished before the capture started: {}",
                    list.join(", ")
                )
            }
            Self::CaptureFailed { reason } => write!(f, "capture failed on the agent: {reason}"),
            Self::StorageFull { message } => write!(
                f,
                "the artifact store is full, nothing of this node was kept: {message}"
            ),
            Self::Abandoned { message } => write!(
                f,
                "the agent stopped the capture, nothing of this node was kept: {message}"
            ),
            Self::Interrupted { agent, error } => write!(
                f,
                "agent {agent} stopped responding mid-capture ({error}); it was killed or restarted, nothing was uploaded"
            ),
            Self::TimedOut {
                after,
                cancel_error: None,
            } => write!(
                f,
                "timed out: no result from the agent after {}s (capture duration plus grace); the capture was cancelled",
                after.as_secs()
            ),
            Self::TimedOut {
                after,
                cancel_error: Some(error),
            } => write!(
                f,
                "timed out: no result from the agent after {}s (capture duration plus grace); asking it to cancel failed ({error}), so the capture ends by itself after its duration",
                after.as_secs()
            ),
            Self::UploadRejected { artifact, error } => {
                write!(f, "artifact {artifact} was rejected by the store: {error}")
            }
            Self::Preparation { error } => {
                write!(f, "the operator could not prepare the capture: {error}")
            }
            Self::ReportRefused { reason } => write!(
                f,
                "the agent's report was refused: {reason}; the node's results are not kept (is its agent outdated, or compromised?)"
            ),
            Self::QuotaExceeded(e) => write!(f, "{e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_happened_and_what_to_do() {
        let msg = NodeFailure::Unreachable {
            agent: "agent-x".into(),
            address: "10.0.0.1:7070".into(),
            error: "connection refused".into(),
        }
        .to_string();
        assert!(msg.contains("agent agent-x at 10.0.0.1:7070 is unreachable: connection refused"));
        let msg = NodeFailure::TimedOut {
            after: Duration::from_secs(62),
            cancel_error: None,
        }
        .to_string();
        assert!(msg.starts_with("timed out"), "{msg}");
        assert!(msg.contains("62s"), "{msg}");
        assert!(msg.ends_with("the capture was cancelled"), "{msg}");
        let msg = NodeFailure::TimedOut {
            after: Duration::from_secs(62),
            cancel_error: Some("no answer within 3 s".into()),
        }
        .to_string();
        assert!(
            msg.contains("asking it to cancel failed (no answer within 3 s)"),
            "{msg}"
        );
        assert!(!msg.contains("was cancelled"), "{msg}");
        // The agent's machine-readable reasons the operator knows become the node's.
        let abandoned = NodeFailure::reported("Abandoned", "abandoned: not ended 75s after".into());
        assert_eq!(abandoned.reason(), "Abandoned");
        assert!(
            abandoned
                .to_string()
                .contains("abandoned: not ended 75s after")
        );
        assert_eq!(
            NodeFailure::reported("StorageFull", "refused".into()).reason(),
            "StorageFull"
        );
        // Any other is the agent's word only: its message, under the generic reason.
        let other = NodeFailure::reported("Anything", "it broke".into());
        assert_eq!(
            other,
            NodeFailure::CaptureFailed {
                reason: "it broke".into()
            }
        );
        let msg = NodeFailure::PodsVanished {
            pods: vec![("web-1".into(), "deleted".into())],
        }
        .to_string();
        assert!(msg.contains("web-1 (deleted)"), "{msg}");
    }
}
