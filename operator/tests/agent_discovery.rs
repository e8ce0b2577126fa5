//! Agent discovery against a real kube-apiserver: agents come from the operator's pod cache
//! when it has them, a node the cache lacks is looked up by node, and without a ready cache
//! every agent pod is listed.

use flamefleet_e2e::TestNamespace;
use flamefleet_e2e::pods::PodFixture;
use flamefleet_operator::pods::AGENT_LABEL;
use flamefleet_operator::pods::agents::discover;
use flamefleet_operator::pods::slim::SlimPod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;

fn agent_fixture(name: &str, node: &str) -> PodFixture {
    let (key, value) = AGENT_LABEL.split_once('=').unwrap();
    PodFixture::new(name, node, &format!("containerd://{:064x}", name.len())).label(key, value)
}

/// A ready cache holding `pods` (as its watch would have listed them).
fn cache_of(pods: Vec<SlimPod>) -> Store<SlimPod> {
    let (store, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Init);
    for pod in pods {
        writer.apply_watcher_event(&watcher::Event::InitApply(pod));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    store
}

#[tokio::test]
async fn agents_come_from_the_cache_and_nodes_it_lacks_are_looked_up() {
    let ns = TestNamespace::create("discovery").await.unwrap();
    let client = ns.client();
    let suffix = ns.name().to_string();
    let (node_a, node_b, node_c) = (
        format!("{suffix}-a"),
        format!("{suffix}-b"),
        format!("{suffix}-c"),
    );
    ns.running_pod(&agent_fixture("agent-a", &node_a))
        .await
        .unwrap();
    ns.running_pod(&agent_fixture("agent-b", &node_b))
        .await
        .unwrap();
    // A pod without the agent label on node c is no agent.
    ns.running_pod(&PodFixture::new("web-c", &node_c, "containerd://c"))
        .await
        .unwrap();

    // The cache has node a's agent only, at an address the API server does not know: the
    // answer for node a must come from the cache (no request), node b's from a lookup.
    let cached: SlimPod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "agent-a", "namespace": ns.name(),
            "labels": {"app.kubernetes.io/name": "flamefleet-agent"}},
        "spec": {"nodeName": node_a, "containers": [{"name": "agent",
            "ports": [{"name": "grpc", "containerPort": 17001}]}]},
        "status": {"phase": "Running", "podIP": "10.9.9.9",
            "conditions": [{"type": "Ready", "status": "True"}]}
    }))
    .unwrap();
    let cache = cache_of(vec![cached]);
    let found = discover(
        &client,
        ns.name(),
        Some(&cache),
        [node_a.as_str(), node_b.as_str(), node_c.as_str()],
    )
    .await
    .unwrap();
    assert_eq!(found[&node_a].address, "10.9.9.9:17001", "{found:?}");
    assert_eq!(found[&node_b].pod, "agent-b");
    assert_eq!(found[&node_b].address, "127.0.0.1:7070");
    assert!(!found.contains_key(&node_c), "{found:?}");

    // A cache that has not finished its first list is not trusted: every agent is listed.
    let (pending, _writer) = reflector::store::<SlimPod>();
    let found = discover(&client, ns.name(), Some(&pending), [node_a.as_str()])
        .await
        .unwrap();
    assert_eq!(found[&node_a].address, "127.0.0.1:7070");
    assert_eq!(found[&node_b].pod, "agent-b");

    // Nor is a missing one; and a namespace without agents finds none, with no error.
    let found = discover(&client, ns.name(), None, []).await.unwrap();
    assert_eq!(found.len(), 2, "{found:?}");
    let found = discover(&client, "default", Some(&cache), [node_a.as_str()])
        .await
        .unwrap();
    assert!(found.is_empty(), "{found:?}");
}
