//! The operator's views of pods: the cluster-wide cache's [`slim`] pods, [`lean`] pod lists,
//! and the [`agents`] serving each node.

pub mod agents;
pub mod lean;
pub mod slim;
