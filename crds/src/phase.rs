//! Lifecycle phases of a ProfileRequest and of each node's share of it.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The phase of a whole ProfileRequest (`status.phase`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum RequestPhase {
    /// Accepted, targets not resolved yet.
    Pending,
    /// Agents are capturing.
    Running,
    /// Every node succeeded.
    Succeeded,
    /// Some nodes succeeded, some failed.
    PartiallySucceeded,
    /// Nothing was captured.
    Failed,
}

impl RequestPhase {
    /// True once the request will not change phase again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::PartiallySucceeded | Self::Failed
        )
    }

    /// The wire name, as in the schema.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::PartiallySucceeded => "PartiallySucceeded",
            Self::Failed => "Failed",
        }
    }

    /// The request phase implied by its nodes' phases.
    ///
    /// `None` when there are no nodes (the caller decides: usually Failed with a message
    /// such as "no running pods matched"); `Running` while any node is not terminal;
    /// otherwise `Succeeded`, `Failed` or `PartiallySucceeded`. A node without a phase
    /// counts as `Pending`.
    pub fn from_nodes<I>(node_phases: I) -> Option<Self>
    where
        I: IntoIterator<Item = Option<NodePhase>>,
    {
        let (mut total, mut succeeded, mut failed) = (0usize, 0usize, 0usize);
        for phase in node_phases {
            total += 1;
            match phase.unwrap_or(NodePhase::Pending) {
                NodePhase::Succeeded => succeeded += 1,
                NodePhase::Failed => failed += 1,
                NodePhase::Pending | NodePhase::Running => {}
            }
        }
        Some(match (total, succeeded, failed) {
            (0, _, _) => return None,
            (t, s, f) if s + f < t => Self::Running,
            (t, s, _) if s == t => Self::Succeeded,
            (t, _, f) if f == t => Self::Failed,
            _ => Self::PartiallySucceeded,
        })
    }
}

impl fmt::Display for RequestPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The phase of one node's share of a request (`nodes[].phase` of a `ProfileResultSlice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum NodePhase {
    /// The operator has not reached the agent yet.
    Pending,
    /// The agent is capturing.
    Running,
    /// Artifacts were uploaded.
    Succeeded,
    /// The capture failed; `message` says why.
    Failed,
}

impl NodePhase {
    /// True once the node's entry will not change phase again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }

    /// The wire name, as in the schema.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
        }
    }
}

impl fmt::Display for NodePhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use NodePhase::*;

    #[test]
    fn terminal_phases() {
        assert!(!RequestPhase::Pending.is_terminal());
        assert!(!RequestPhase::Running.is_terminal());
        assert!(RequestPhase::Succeeded.is_terminal());
        assert!(RequestPhase::PartiallySucceeded.is_terminal());
        assert!(RequestPhase::Failed.is_terminal());
        assert!(!Pending.is_terminal() && !Running.is_terminal());
        assert!(Succeeded.is_terminal() && Failed.is_terminal());
    }

    #[test]
    fn request_phase_from_nodes() {
        assert_eq!(RequestPhase::from_nodes([]), None);
        assert_eq!(
            RequestPhase::from_nodes([Some(Succeeded), None]),
            Some(RequestPhase::Running)
        );
        assert_eq!(
            RequestPhase::from_nodes([Some(Succeeded), Some(Running)]),
            Some(RequestPhase::Running)
        );
        assert_eq!(
            RequestPhase::from_nodes([Some(Succeeded), Some(Succeeded)]),
            Some(RequestPhase::Succeeded)
        );
        assert_eq!(
            RequestPhase::from_nodes([Some(Failed), Some(Failed)]),
            Some(RequestPhase::Failed)
        );
        assert_eq!(
            RequestPhase::from_nodes([Some(Succeeded), Some(Failed)]),
            Some(RequestPhase::PartiallySucceeded)
        );
    }

    #[test]
    fn wire_names_match_serde() {
        for phase in [
            RequestPhase::Pending,
            RequestPhase::Running,
            RequestPhase::Succeeded,
            RequestPhase::PartiallySucceeded,
            RequestPhase::Failed,
        ] {
            assert_eq!(
                serde_json::to_value(phase).unwrap(),
                serde_json::json!(phase.as_str())
            );
        }
        for phase in [Pending, Running, Succeeded, Failed] {
            assert_eq!(
                serde_json::to_value(phase).unwrap(),
                serde_json::json!(phase.to_string())
            );
        }
    }
}
