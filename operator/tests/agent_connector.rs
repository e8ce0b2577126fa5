//! The operator's agent connector against agents serving real mutual TLS (hollow agents,
//! each with its node's certificate from the operator's CA): the node the operator expects
//! answers, and an agent whose certificate names another node is refused, whatever address
//! it listens on. Every channel shares one client configuration.

use std::net::Ipv4Addr;
use std::time::Duration;

use flamefleet_e2e::agent_pki::AgentPki;
use flamefleet_e2e::hollow::{HollowConfig, HollowFleet};
use flamefleet_operator::dispatch::connector::AgentConnector;
use flamefleet_operator::pods::agents::AgentEndpoint;
use flamefleet_proto::agent::InfoRequest;

fn endpoint(node: &str, address: String) -> AgentEndpoint {
    AgentEndpoint {
        node: node.to_owned(),
        pod: format!("agent-{node}"),
        address,
    }
}

/// Connects to `node`'s agent at `address` and checks that it says it serves `node`.
async fn answers_for_its_node(connector: &AgentConnector, node: &str, address: String) {
    let mut client = connector
        .connect(&endpoint(node, address))
        .await
        .unwrap_or_else(|e| panic!("connecting to {node}: {e}"));
    let info = client
        .info(InfoRequest {})
        .await
        .expect("Info over the operator's channel")
        .into_inner();
    assert_eq!(info.node_name, node);
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
        answers_for_its_node(&connector, &node.name, node.address.to_string()).await;
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

/// The line of `metric` in the operator's /metrics text, as a number.
fn metric(metrics: &flamefleet_operator::metrics::Metrics, series: &str) -> f64 {
    metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_connection_to_an_agent_resumes_the_first_session() {
    flamefleet_operator::store::crypto_provider::install_default_crypto_provider();
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = AgentPki::generate(dir.path(), "flamefleet-operator-ca").expect("PKI");
    // More agents than rustls' own cache held for the operator's setting (1,024).
    let nodes = 1100;
    let fleet = HollowFleet::start(
        &pki,
        HollowConfig {
            nodes,
            node_prefix: "resume".into(),
            first_address: Ipv4Addr::new(127, 67, 0, 1),
            port: 17172,
            ..HollowConfig::default()
        },
    )
    .await
    .expect("hollow agents");
    let metrics = std::sync::Arc::new(flamefleet_operator::metrics::Metrics::new());
    // One idle connection kept (the least there is): every other call connects, as a
    // collection outside the cache does.
    let connector = AgentConnector::from_files(
        &pki.files.ca_cert,
        &pki.files.operator_cert,
        &pki.files.operator_key,
        Duration::from_secs(10),
    )
    .expect("connector from the PKI's files")
    .with_metrics(metrics.clone())
    .with_channel_capacity(0);
    let full = r#"flamefleet_operator_agent_tls_handshakes_total{kind="full"}"#;
    let resumed = r#"flamefleet_operator_agent_tls_handshakes_total{kind="resumed"}"#;
    // Start every node, then collect every node in the same order, as a request does.
    for _ in 0..2 {
        for node in fleet.nodes() {
            answers_for_its_node(&connector, &node.name, node.address.to_string()).await;
        }
    }
    assert_eq!(metric(&metrics, full), nodes as f64);
    // The last node's connection stayed in the cache and served its second call.
    assert_eq!(metric(&metrics, resumed), (nodes - 1) as f64);
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
