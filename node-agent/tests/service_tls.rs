//! The agent serves mutual TLS: a client without a certificate, or with one
//! from another CA, is refused; the operator's certificate gets answers.

mod service_support;

use flamefleet_proto::agent::{InfoRequest, ProfileType};
use service_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_clients_of_the_configured_ca_are_served() {
    require_root();
    let pki = TestPki::new("flamefleet-operator-ca");
    let other = TestPki::new("some-other-ca");
    let tree = PodTree::new();
    let agent = AgentProcess::start("node-tls-a", &pki, &tree.root, None);

    // The operator's certificate: Info answers.
    let mut client = operator_client(&pki, &agent).await;
    let info = client
        .info(InfoRequest {})
        .await
        .expect("Info with the operator's certificate")
        .into_inner();
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
            ProfileType::Runqlat as i32
        ]
    );
    assert!(
        info.missing_features.is_empty(),
        "{:?}",
        info.missing_features
    );

    // No client certificate: the handshake (or the first call) fails.
    let f = &pki.pki.files;
    let refused = match connect(&agent, tls(&f.ca_cert, None)).await {
        Err(e) => e,
        Ok(mut c) => match c.info(InfoRequest {}).await {
            Ok(_) => panic!("a client without a certificate was served"),
            Err(status) => format!("{status:?}"),
        },
    };
    assert!(!refused.is_empty());

    // A certificate from another CA (trusting the right server CA): refused.
    let o = &other.pki.files;
    let refused = match connect(
        &agent,
        tls(&f.ca_cert, Some((&o.operator_cert, &o.operator_key))),
    )
    .await
    {
        Err(e) => e,
        Ok(mut c) => match c.info(InfoRequest {}).await {
            Ok(_) => panic!("a client with another CA's certificate was served"),
            Err(status) => format!("{status:?}"),
        },
    };
    assert!(!refused.is_empty());

    // The refused handshakes did not hurt the server.
    let mut again = operator_client(&pki, &agent).await;
    again
        .info(InfoRequest {})
        .await
        .expect("Info after refusals");
}

#[test]
fn bad_tls_files_and_node_names_fail_with_clear_messages() {
    let pki = TestPki::new("ca");
    let f = &pki.pki.files;
    let run = |node: &str, key: &std::path::Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"))
            .args(["serve", "--node-name", node, "--listen", "127.0.0.1:0"])
            .arg("--tls-ca")
            .arg(&f.ca_cert)
            .arg("--tls-cert")
            .arg(&f.agent_cert)
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
    let err = run("Bad_Name", &f.agent_key);
    assert!(err.contains("invalid node name"), "{err}");
}
