//! The agent writes its own `status.nodes[]` entry of a ProfileRequest in a
//! real kube-apiserver with server-side apply, as `flamefleet-agent.<node>`;
//! another agent's entry survives. Uses runqlat, so the text histogram
//! artifact is uploaded too.

mod service_support;

use flamefleet_api::status_apply::{agent_field_manager, node_status_apply_body};
use flamefleet_api::{NodePhase, NodeStatus, ProfileRequest};
use flamefleet_e2e::TestNamespace;
use flamefleet_proto::agent::capture_progress::Stage;
use flamefleet_proto::agent::{CaptureRequest, ProfileType, RunqlatOptions};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use service_support::*;

async fn create_request(api: &Api<ProfileRequest>, name: &str) -> String {
    let pr: ProfileRequest = serde_json::from_value(serde_json::json!({
        "apiVersion": "flamefleet.dev/v1alpha1",
        "kind": "ProfileRequest",
        "metadata": {"name": name},
        "spec": {"type": "runqlat", "podNames": ["checkout-1"], "duration": "2s"},
    }))
    .expect("ProfileRequest fixture");
    let created = api
        .create(&PostParams::default(), &pr)
        .await
        .expect("create ProfileRequest");
    created.metadata.uid.expect("uid")
}

fn runqlat_request(
    uid: &str,
    ns: &str,
    name: &str,
    node: &str,
    tree: &PodTree,
    upload: &UploadServer,
) -> CaptureRequest {
    CaptureRequest {
        request_uid: uid.into(),
        request_namespace: ns.into(),
        request_name: name.into(),
        r#type: ProfileType::Runqlat as i32,
        duration_ms: 2000,
        cpu: None,
        heap: None,
        runqlat: Some(RunqlatOptions {
            per_process: false,
            unit: "us".into(),
        }),
        targets: vec![tree.target(ns, "checkout-1", "app")],
        uploads: upload.slots(
            uid,
            &[
                format!("runqlat-{node}.pb.gz"),
                format!("runqlat-{node}.txt"),
            ],
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_applies_its_own_node_entry_and_keeps_the_others() {
    require_root();
    let ns = TestNamespace::create("agent-status")
        .await
        .expect("a real kube-apiserver (run scripts/setup.sh to build it)");
    let api: Api<ProfileRequest> = ns.api();
    let name = "checkout-runqlat";
    let uid = create_request(&api, name).await;

    // Another agent (node-other) wrote its entry first.
    let other = NodeStatus {
        node: "node-other".into(),
        phase: Some(NodePhase::Succeeded),
        pods: vec!["checkout-2".into()],
        ..Default::default()
    };
    api.patch_status(
        name,
        &PatchParams::apply(&agent_field_manager("node-other")),
        &Patch::Apply(node_status_apply_body(name, other.clone()).expect("body")),
    )
    .await
    .expect("the other agent's apply");

    let pki = TestPki::new("ca");
    let mut tree = PodTree::new();
    // Three burners on two cores: they wait in the run queue.
    for _ in 0..3 {
        tree.start_burner();
    }
    let upload = UploadServer::start(None).await;
    let node = "node-status-a";
    let kubeconfig = ns.control_plane().kubeconfig().to_path_buf();
    let agent = AgentProcess::start(node, &pki, &tree.root, Some(&kubeconfig));
    let mut client = operator_client(&pki, &agent).await;

    let progress = collect(
        &mut client,
        runqlat_request(&uid, ns.name(), name, node, &tree, &upload),
    )
    .await;
    let last = progress.last().expect("a message");
    assert_eq!(
        last.stage(),
        Stage::Done,
        "{}\n{}",
        last.message,
        agent.log()
    );
    assert!(
        !last.summary.contains_key("status_error"),
        "{:?}",
        last.summary
    );
    assert!(last.summary.contains_key("p50_us"), "{:?}", last.summary);
    assert!(last.summary.contains_key("p99_us"), "{:?}", last.summary);
    assert_eq!(last.artifacts[0].sample_type, "count/count");
    assert!(last.artifacts[0].samples > 0, "{:?}", last.artifacts[0]);
    let names: Vec<&str> = last.artifacts.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(
        names,
        [
            format!("runqlat-{node}.pb.gz"),
            format!("runqlat-{node}.txt")
        ]
    );
    let text = upload
        .body(&uid, &format!("runqlat-{node}.txt"))
        .expect("text histogram uploaded");
    let text = String::from_utf8(text).expect("utf-8");
    assert!(text.contains("usecs") && text.contains("p99"), "{text}");
    let pb = upload
        .body(&uid, &format!("runqlat-{node}.pb.gz"))
        .expect("pprof uploaded");
    pprof_top(&pb);

    // The status holds this node's entry, as sent in DONE, and the other one.
    let pr = api.get(name).await.expect("get ProfileRequest");
    let status = pr.status.clone().expect("status");
    let mine = status.node(node).expect("this node's entry");
    assert_eq!(mine.phase, Some(NodePhase::Succeeded));
    assert_eq!(mine.pods, vec!["checkout-1".to_owned()]);
    assert_eq!(mine.artifacts.len(), 2);
    for (s, a) in mine.artifacts.iter().zip(&last.artifacts) {
        assert_eq!(s.name, a.name);
        assert_eq!(s.sha256.as_deref(), Some(a.sha256.as_str()));
        assert_eq!(s.url.as_deref(), Some(a.url.as_str()));
        assert_eq!(s.size_bytes, Some(a.size_bytes as i64));
    }
    assert_eq!(status.node("node-other"), Some(&other));
    let managers: Vec<(String, Option<String>)> = pr
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .map(|m| (m.manager.unwrap_or_default(), m.subresource))
        .collect();
    assert!(
        managers.contains(&(format!("flamefleet-agent.{node}"), Some("status".into()))),
        "{managers:?}"
    );

    // A failed capture writes a Failed entry with the reason.
    let failing = "checkout-runqlat-fails";
    let uid2 = create_request(&api, failing).await;
    let mut req = runqlat_request(&uid2, ns.name(), failing, node, &tree, &upload);
    req.targets[0].containers[0].container_id = format!("containerd://{}", "cd".repeat(32));
    let last = collect(&mut client, req).await.pop().expect("a message");
    assert_eq!(last.stage(), Stage::Failed);
    let pr = api.get(failing).await.expect("get ProfileRequest");
    let entry = pr
        .status
        .as_ref()
        .and_then(|s| s.node(node))
        .expect("this node's entry")
        .clone();
    assert_eq!(entry.phase, Some(NodePhase::Failed));
    assert!(
        entry
            .message
            .as_deref()
            .is_some_and(|m| m.contains("no cgroup found for pod")),
        "{entry:?}"
    );
}
