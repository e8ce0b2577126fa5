//! What the service tells about its calls and captures as they happen: the agent counts
//! them for `/metrics` ([`super::metrics::AgentMetrics`]); a load generator counts them for
//! its own report. Every method has a default that ignores the event.

use flamefleet_proto::agent::CaptureSummary;

use crate::capture::lifecycle::Symbolized;

/// How a capture ended, as the `outcome` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Artifacts uploaded, DONE sent.
    Succeeded,
    /// FAILED sent.
    Failed,
    /// Cancelled by the operator.
    Cancelled,
    /// Stopped by the agent: not ended by the operator's deadline (nobody was waiting).
    Abandoned,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Abandoned => "abandoned",
        }
    }
}

/// Which call asked for a capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    /// `Capture`: starts, attaches or replays.
    Capture,
    /// `Collect`: attaches or replays, never starts.
    Collect,
}

/// What a `Capture` or `Collect` call found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// No capture of that UID: one was started.
    Started,
    /// The capture runs: the call follows it.
    Attached,
    /// The capture finished: its final message was replayed.
    Replayed,
    /// `Collect` for a UID the agent does not know (NOT_FOUND).
    Unknown,
}

/// Receives the service's events.
pub trait Reporter: Send + Sync + 'static {
    /// A `Capture` or `Collect` call was answered.
    fn call(&self, _rpc: Rpc, _outcome: CallOutcome) {}

    /// A `Cancel` call; `found`: a running capture had that UID.
    fn cancel_called(&self, _found: bool) {}

    /// An artifact of `bytes` was uploaded.
    fn uploaded(&self, _bytes: usize) {}

    /// An upload failed for good.
    fn upload_failed(&self) {}

    /// A capture of `profile_type` symbolized its stacks.
    fn symbolized(&self, _profile_type: &'static str, _symbolized: Symbolized) {}

    /// A capture of `profile_type` ended with `outcome` (and, when it succeeded, what it
    /// measured).
    fn capture_finished(
        &self,
        _profile_type: &'static str,
        _outcome: Outcome,
        _summary: Option<&CaptureSummary>,
    ) {
    }

    /// A capture was lost without a result ([`super::engine::Admission::Forget`]).
    fn capture_forgotten(&self) {}
}
