//! The operator's views of pods: the cluster-wide cache's [`slim`] pods, [`lean`] pod lists,
//! a capture's [`target`] pods, and the [`agents`] serving each node.

pub mod agents;
pub mod lean;
pub mod slim;
pub mod target;

/// Label carried by every agent pod.
pub const AGENT_LABEL: &str = "app.kubernetes.io/name=flamefleet-agent";
/// Name of the agent's gRPC container port.
pub const GRPC_PORT_NAME: &str = "grpc";
/// Port used when the agent pod names none.
pub const DEFAULT_GRPC_PORT: i32 = 7070;
