//! The agent serves mutual TLS with one identity per node and one client: the operator.
//! A client without a certificate, with one from another CA, or with one from the right
//! CA that does not name the operator is refused; a client expecting another node's
//! agent refuses this one; the operator's certificate gets answers.

mod service_support;

use flamefleet_proto::agent::{InfoRequest, ProfileType};
use service_support::*;

/// How long a refused client may wait for its answer. Under TLS 1.3 the client finishes
/// its handshake before the server checks its certificate, so a refused client learns of
/// the refusal only from the closed connection; tonic's client sometimes never wakes for
/// that close (seen about once in 150 runs), and no answer at all is also "not served".
const REFUSAL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Calls Info with `tls`; Ok when served, the error text when refused at any step or not
/// answered within [`REFUSAL_WAIT`].
async fn info_refusal(
    agent: &AgentProcess,
    tls: tonic::transport::ClientTlsConfig,
) -> Result<(), String> {
    let call = async {
        match connect(agent, tls).await {
            Err(e) => Err(e),
            Ok(mut c) => match c.info(InfoRequest {}).await {
                Ok(_) => Ok(()),
                Err(status) => Err(format!("{status:?}")),
            },
        }
    };
    tokio::time::timeout(REFUSAL_WAIT, call)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {REFUSAL_WAIT:?}")))
}

/// Info with the operator's certificate, bounded so that a stuck call fails the test
/// instead of holding the whole suite.
async fn operator_info(
    pki: &TestPki,
    agent: &AgentProcess,
) -> flamefleet_proto::agent::InfoResponse {
    let call = async {
        let mut client = operator_client(pki, agent).await;
        client.info(InfoRequest {}).await
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), call)
        .await
        .expect("Info with the operator's certificate answered within 30 s")
        .expect("Info with the operator's certificate")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operator_is_served_and_only_as_this_node() {
    require_root();
    let pki = TestPki::new("flamefleet-operator-ca");
    let other = TestPki::new("some-other-ca");
    let tree = PodTree::new();
    let agent = AgentProcess::start("node-tls-a", &pki, &tree.root, None);

    // The operator's certificate: Info answers.
    let info = operator_info(&pki, &agent).await;
    assert_eq!(info.node_name, "node-tls-a");
    assert_eq!(info.api_version, "flamefleet.agent.v1");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(info.kernel_release, release.trim());
    assert!(!info.agent_version.is_empty());
    // This machine has BTF and perf events: every type, nothing missing.
    let mut types = info.supported_types.clone();
    types.sort();
    assert_eq!(
        types,
        vec![
            ProfileType::Cpu as i32,
            ProfileType::Heap as i32,
            ProfileType::Runqlat as i32,
            ProfileType::Offcpu as i32
        ]
    );
    assert!(
        info.missing_features.is_empty(),
        "{:?}",
        info.missing_features
    );

    let f = &pki.pki.files;
    let operator = Some((f.operator_cert.as_path(), f.operator_key.as_path()));

    // No client certificate: refused.
    let refused = info_refusal(&agent, tls("node-tls-a", &f.ca_cert, None)).await;
    assert!(
        refused.is_err(),
        "a client without a certificate was served"
    );

    // A certificate from another CA (trusting the right server CA): refused.
    let o = &other.pki.files;
    let refused = info_refusal(
        &agent,
        tls(
            "node-tls-a",
            &f.ca_cert,
            Some((&o.operator_cert, &o.operator_key)),
        ),
    )
    .await;
    assert!(refused.is_err(), "another CA's certificate was served");

    // A client certificate of the right CA that does not name the operator: refused.
    let (mallory_cert, mallory_key) = pki.pki.issue_client("mallory").expect("client cert");
    let refused = info_refusal(
        &agent,
        tls(
            "node-tls-a",
            &f.ca_cert,
            Some((&mallory_cert, &mallory_key)),
        ),
    )
    .await;
    assert!(
        refused.is_err(),
        "a same-CA client without the operator's name was served"
    );
    if let Err(log) = agent
        .wait_for_log("only the Flamefleet operator may call agents")
        .await
    {
        panic!("the agent says why it refused; log:\n{log}");
    }

    // Another node's agent certificate used as a client: refused (server auth only).
    let (b_cert, b_key) = pki.pki.issue_agent("node-tls-b").expect("agent cert");
    let refused = info_refusal(
        &agent,
        tls("node-tls-a", &f.ca_cert, Some((&b_cert, &b_key))),
    )
    .await;
    assert!(
        refused.is_err(),
        "an agent certificate was accepted as a client"
    );

    // The operator expecting node B reaches this agent (node A): the operator refuses it,
    // so node A's key cannot answer for node B's captures.
    let refused = info_refusal(&agent, tls("node-tls-b", &f.ca_cert, operator)).await;
    let err = refused.expect_err("node A's agent passed for node B");
    assert!(
        err.contains("certificate") || err.contains("NotValidForName"),
        "{err}"
    );

    // The refused handshakes did not hurt the server.
    operator_info(&pki, &agent).await;
}

#[test]
fn bad_tls_files_and_node_names_fail_with_clear_messages() {
    let pki = TestPki::new("ca");
    let f = &pki.pki.files;
    let (agent_cert, agent_key) = pki.pki.issue_agent("node-x").expect("agent cert");
    let run = |node: &str, key: &std::path::Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"))
            .args(["serve", "--node-name", node, "--listen", "127.0.0.1:0"])
            .arg("--tls-ca")
            .arg(&f.ca_cert)
            .arg("--tls-cert")
            .arg(&agent_cert)
            .arg("--tls-key")
            .arg(key)
            .output()
            .expect("run agent");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let missing = pki.dir.path().join("missing.key");
    let err = run("node-x", &missing);
    assert!(
        err.contains("--tls-key") && err.contains("missing.key"),
        "{err}"
    );
    let err = run("Bad_Name", &agent_key);
    assert!(err.contains("invalid node name"), "{err}");
    // A key that does not belong to the certificate.
    let (_, other_key) = pki.pki.issue_agent("node-y").expect("agent cert");
    let err = run("node-x", &other_key);
    assert!(err.contains("does not match"), "{err}");
}
