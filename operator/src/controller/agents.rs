//! Finding the Flamefleet agent that serves each node: agent pods (by label, in the agent
//! namespace) that are Running on the node; endpoint = pod IP and the container port named
//! `grpc` (7070 when none is named).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;

use crate::{Error, Result};

/// Label carried by every agent pod.
pub const AGENT_LABEL: &str = "app.kubernetes.io/name=flamefleet-agent";
/// Name of the agent's gRPC container port.
pub const GRPC_PORT_NAME: &str = "grpc";
/// Port used when the agent pod names none.
pub const DEFAULT_GRPC_PORT: i32 = 7070;

/// Where to reach the agent of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentEndpoint {
    /// The node the agent serves (its certificate must name it).
    pub node: String,
    /// The agent pod's name.
    pub pod: String,
    /// `host:port` to connect to.
    pub address: String,
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The endpoint of an agent pod, if it is Running with an IP on a node (pure).
pub fn endpoint_of(pod: &Pod) -> Option<(String, AgentEndpoint)> {
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let ip = status.pod_ip.clone().filter(|ip| !ip.is_empty())?;
    let spec = pod.spec.as_ref()?;
    let node = spec.node_name.clone()?;
    let port = spec
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(GRPC_PORT_NAME))
        .map_or(DEFAULT_GRPC_PORT, |p| p.container_port);
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip
    };
    Some((
        node.clone(),
        AgentEndpoint {
            node,
            pod: pod.metadata.name.clone().unwrap_or_default(),
            address: format!("{host}:{port}"),
        },
    ))
}

/// An agent pod's endpoint and readiness, if it is Running with an IP on a node (pure).
fn candidate(pod: &Pod) -> Option<(String, AgentEndpoint, bool)> {
    endpoint_of(pod).map(|(node, endpoint)| (node, endpoint, is_ready(pod)))
}

/// One agent per node among `pods` (pure); a Ready pod wins over one that is not.
pub fn agents_by_node(pods: &[Pod]) -> BTreeMap<String, AgentEndpoint> {
    pick(pods.iter().filter_map(candidate))
}

/// One agent per node among the candidates; a Ready one wins over one that is not.
fn pick(
    candidates: impl IntoIterator<Item = (String, AgentEndpoint, bool)>,
) -> BTreeMap<String, AgentEndpoint> {
    let mut out: BTreeMap<String, (bool, AgentEndpoint)> = BTreeMap::new();
    for (node, endpoint, ready) in candidates {
        match out.get(&node) {
            Some((true, _)) => {}
            Some((false, _)) if !ready => {}
            _ => {
                out.insert(node, (ready, endpoint));
            }
        }
    }
    out.into_iter().map(|(n, (_, e))| (n, e)).collect()
}

/// Lists the agent pods of `agent_namespace` and maps them by node.
pub async fn discover(
    client: &kube::Client,
    agent_namespace: &str,
) -> Result<BTreeMap<String, AgentEndpoint>> {
    // One pod per node of the cluster, whatever the request's size: listed in pages without
    // their managed fields (`lean_pods`), each page reduced to endpoints as it comes.
    let candidates = super::lean_pods::list_map(
        client,
        agent_namespace,
        &ListParams::default().labels(AGENT_LABEL),
        |pod| candidate(&pod),
    )
    .await
    .map_err(Error::kube(format!(
        "listing agent pods ({AGENT_LABEL}) in {agent_namespace}"
    )))?;
    Ok(pick(candidates))
}

/// The status message of a node that has no agent.
pub fn no_agent_message(node: &str, agent_namespace: &str) -> String {
    format!(
        "no Flamefleet agent runs on node {node}: expected a Running pod labelled {AGENT_LABEL} with a pod IP in namespace {agent_namespace}; check the agent DaemonSet"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn agent(name: &str, node: &str, ip: &str, port: Option<i32>, ready: bool) -> Pod {
        let ports = port.map_or(json!([]), |p| json!([{"name": "grpc", "containerPort": p}]));
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": "agent", "ports": ports}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [
                {"type": "Ready", "status": if ready {"True"} else {"False"}}
            ]}
        }))
        .unwrap()
    }

    #[test]
    fn endpoint_uses_the_grpc_port_or_the_default() {
        let found = agents_by_node(&[
            agent("a1", "n1", "127.0.0.1", Some(17001), true),
            agent("a2", "n2", "10.1.2.3", None, true),
            agent("a3", "n3", "fd00::1", Some(9), true),
        ]);
        assert_eq!(found["n1"].address, "127.0.0.1:17001");
        assert_eq!(found["n2"].address, "10.1.2.3:7070");
        assert_eq!(found["n3"].address, "[fd00::1]:9");
    }

    #[test]
    fn ready_agent_wins_and_pods_without_ip_are_ignored() {
        let found = agents_by_node(&[
            agent("old", "n1", "10.0.0.1", None, false),
            agent("new", "n1", "10.0.0.2", None, true),
            agent("noip", "n2", "", None, true),
        ]);
        assert_eq!(found["n1"].pod, "new");
        assert!(!found.contains_key("n2"));
        assert!(
            no_agent_message("n2", "flamefleet").contains("no Flamefleet agent runs on node n2")
        );
    }
}
