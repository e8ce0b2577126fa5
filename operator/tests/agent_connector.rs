//! The operator's agent connector against agents serving real mutual TLS (hollow agents,
//! each with its node's certificate from the operator's CA): the node the operator expects
//! answers, and an agent whose certificate names another node is refused, whatever address
//! it listens on. Every channel shares one client configuration.

use std::net::Ipv4Addr;
use std::time::Duration;

use flamefleet_e2e::agent_pki::AgentPki;
use flamefleet_e2e::hollow::{HollowConfig, HollowFleet};
use flamefleet_operator::controller::agent_client::AgentConnector;
use flamefleet_operator::controller::agents::AgentEndpoint;
use flamefleet_proto::agent::InfoRequest;

fn endpoint(node: &str, address: String) -> AgentEndpoint {
    AgentEndpoint {
        node: node.to_owned(),
        pod: format!("agent-{node}"),
        address,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_answer_only_for_the_node_their_certificate_names() {
    flamefleet_operator::store::crypto_provider::install_default_crypto_provider();
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = AgentPki::generate(dir.path(), "flamefleet-operator-ca").expect("PKI");
    let fleet = HollowFleet::start(
        &pki,
        HollowConfig {
            nodes: 2,
            node_prefix: "conn".into(),
            first_address: Ipv4Addr::new(127, 66, 0, 1),
            port: 17171,
            ..HollowConfig::default()
        },
    )
    .await
    .expect("hollow agents");
    let nodes = fleet.nodes();
    let connector = AgentConnector::from_files(
        &pki.files.ca_cert,
        &pki.files.operator_cert,
        &pki.files.operator_key,
        Duration::from_secs(5),
    )
    .expect("connector from the PKI's files");

    // Each node's own agent answers, and says which node it serves.
    for node in &nodes {
        let mut client = connector
            .connect(&endpoint(&node.name, node.address.to_string()))
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", node.name));
        let info = client
            .info(InfoRequest {})
            .await
            .expect("Info over the operator's channel")
            .into_inner();
        assert_eq!(info.node_name, node.name);
    }
    assert_eq!(connector.channels().len(), 2);

    // Node 1's agent listening where node 0 is expected (a stale address, or a node
    // impersonating another): its certificate names node 1, so the handshake fails.
    let err = connector
        .connect(&endpoint(&nodes[0].name, nodes[1].address.to_string()))
        .await
        .expect_err("an agent with another node's certificate must be refused");
    assert!(
        err.contains("certificate") || err.contains("NotValidForName"),
        "the refusal should name the certificate: {err}"
    );
    // The refused connection was not cached in place of node 0's good channel... and the
    // good one stays usable.
    let mut client = connector
        .connect(&endpoint(&nodes[0].name, nodes[0].address.to_string()))
        .await
        .expect("node 0 again at its own address");
    client.info(InfoRequest {}).await.expect("Info again");

    // Nothing listens there: a clear connection error, not a hang.
    let err = connector
        .connect(&endpoint("conn-nobody", "127.66.0.250:17171".into()))
        .await
        .expect_err("no agent at that address");
    assert!(!err.is_empty());
}

#[test]
fn unusable_pem_files_fail_with_the_file_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = AgentPki::generate(dir.path(), "flamefleet-operator-ca").expect("PKI");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").expect("write");
    let missing = dir.path().join("missing.pem");
    let err = AgentConnector::from_files(
        &missing,
        &pki.files.operator_cert,
        &pki.files.operator_key,
        Duration::from_secs(1),
    )
    .expect_err("a missing CA file");
    assert!(err.to_string().contains("missing.pem"), "{err}");
    let err = AgentConnector::from_files(
        &garbage,
        &pki.files.operator_cert,
        &pki.files.operator_key,
        Duration::from_secs(1),
    )
    .expect_err("a CA file without a certificate");
    assert!(err.to_string().contains("CA"), "{err}");
    let err = AgentConnector::from_files(
        &pki.files.ca_cert,
        &pki.files.operator_cert,
        &garbage,
        Duration::from_secs(1),
    )
    .expect_err("a key file without a key");
    assert!(err.to_string().contains("key"), "{err}");
}
