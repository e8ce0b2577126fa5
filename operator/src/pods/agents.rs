//! Finding the Flamefleet agent that serves each node: agent pods (by label, in the agent
//! namespace) that are Running on the node; endpoint = pod IP and the container port named
//! `grpc` (7070 when none is named).

use std::collections::{BTreeMap, BTreeSet};

use futures::FutureExt;
use kube::Api;
use kube::api::ListParams;
use kube::runtime::reflector::Store;

use super::lean::PAGE_SIZE;
use super::slim::SlimPod;
use super::{AGENT_LABEL, DEFAULT_GRPC_PORT};
use crate::{Error, Result};

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

/// The endpoint of an agent pod, if it is Running with an IP on a node (pure).
pub fn endpoint_of(pod: &SlimPod) -> Option<(String, AgentEndpoint)> {
    if !pod.is_running_with_ip() {
        return None;
    }
    let ip = pod.ip.as_deref()?;
    let node = pod.node.clone()?;
    let port = pod.grpc_port.unwrap_or(DEFAULT_GRPC_PORT);
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    Some((
        node.clone(),
        AgentEndpoint {
            node,
            pod: pod.name().to_string(),
            address: format!("{host}:{port}"),
        },
    ))
}

/// An agent pod's endpoint and readiness, if it is Running with an IP on a node (pure).
fn candidate(pod: &SlimPod) -> Option<(String, AgentEndpoint, bool)> {
    endpoint_of(pod).map(|(node, endpoint)| (node, endpoint, pod.ready))
}

/// One agent per node among `pods` (pure); a Ready pod wins over one that is not.
pub fn agents_by_node<'a>(
    pods: impl IntoIterator<Item = &'a SlimPod>,
) -> BTreeMap<String, AgentEndpoint> {
    pick(pods.into_iter().filter_map(candidate))
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

/// The agents the pod cache knows of in `agent_namespace`, mapped by node (pure).
pub fn cached_agents(
    cache: &Store<SlimPod>,
    agent_namespace: &str,
) -> BTreeMap<String, AgentEndpoint> {
    let (key, value) = AGENT_LABEL.split_once('=').unwrap_or((AGENT_LABEL, ""));
    agents_by_node(
        cache
            .state()
            .iter()
            .map(AsRef::as_ref)
            .filter(|p| p.namespace() == agent_namespace && p.label(key) == Some(value)),
    )
}

/// Nodes missing from the cache that are looked up one by one; with more, one LIST of every
/// agent pod is cheaper.
const MAX_NODE_LOOKUPS: usize = 16;

/// The agents serving `nodes` (the request's nodes), mapped by node.
///
/// With `cache` (the operator's watch-fed pod cache, `pods::slim`) holding its first full
/// list, the agents come from memory: no request to the API server. A node the cache has
/// no agent for (an agent pod created moments ago, whose watch event has not arrived) is
/// looked up with a LIST of that node's agent pods (`spec.nodeName` field selector), or,
/// past [`MAX_NODE_LOOKUPS`] such nodes, with one paged LIST of all agent pods. Without a
/// ready cache every agent pod is listed, in pages.
///
/// # Errors
/// The API server's error for a LIST, with what was being listed.
pub async fn discover<'a>(
    client: &kube::Client,
    agent_namespace: &str,
    cache: Option<&Store<SlimPod>>,
    nodes: impl IntoIterator<Item = &'a str>,
) -> Result<BTreeMap<String, AgentEndpoint>> {
    let ready = cache.filter(|c| matches!(c.wait_until_ready().now_or_never(), Some(Ok(()))));
    let Some(cache) = ready else {
        return list_agents(client, agent_namespace, &ListParams::default()).await;
    };
    let mut found = cached_agents(cache, agent_namespace);
    let missing: BTreeSet<&str> = nodes
        .into_iter()
        .filter(|n| !found.contains_key(*n))
        .collect();
    if missing.len() > MAX_NODE_LOOKUPS {
        return list_agents(client, agent_namespace, &ListParams::default()).await;
    }
    for node in missing {
        let params = ListParams::default().fields(&format!("spec.nodeName={node}"));
        found.extend(list_agents(client, agent_namespace, &params).await?);
    }
    Ok(found)
}

/// Lists the agent pods of `agent_namespace` matching `params` (plus the agent label) in
/// pages, each page reduced to endpoints as it comes, and maps them by node.
async fn list_agents(
    client: &kube::Client,
    agent_namespace: &str,
    params: &ListParams,
) -> Result<BTreeMap<String, AgentEndpoint>> {
    let api: Api<SlimPod> = Api::namespaced(client.clone(), agent_namespace);
    let mut params = params.clone().labels(AGENT_LABEL).limit(PAGE_SIZE);
    let mut candidates = Vec::new();
    loop {
        let page = api.list(&params).await.map_err(Error::kube(format!(
            "listing agent pods ({AGENT_LABEL}) in {agent_namespace}"
        )))?;
        candidates.extend(page.items.iter().filter_map(candidate));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(pick(candidates)),
        }
    }
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

    fn agent(name: &str, node: &str, ip: &str, port: Option<i32>, ready: bool) -> SlimPod {
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
