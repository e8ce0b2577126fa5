//! End to end, on the real control plane with real captures: cpu, runqlat and heap requests
//! go Pending → Running → Succeeded on two nodes; every artifact downloads (through a
//! ProfileDownload the operator answers), matches its sha256, and `go tool pprof` reads it;
//! unsigned or forged downloads are refused; a request never profiles pods of another
//! namespace.

mod pipeline_support;

use std::time::Duration;

use flamefleet_api::{NodePhase, ProfileRequest, RequestPhase};
use flamefleet_e2e::TestNamespace;
use kube::api::Api;
use pipeline_support::{Pipeline, PipelineOptions, check_digest, nodes_of, pprof_top, serial};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs one request of `profile_type` over pods on both nodes and checks every artifact.
async fn profile_two_nodes(
    profile_type: &str,
    mode: &str,
    extra: serde_json::Value,
) -> (Pipeline, ProfileRequest) {
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create(&format!("ff-{profile_type}"))
        .await
        .unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], mode, 1)
        .await;
    pipeline
        .pod(&ns, "web-2", 1, &[("app", "web")], mode, 1)
        .await;
    pipeline
        .pod(&ns, "db-1", 1, &[("app", "db")], mode, 1)
        .await;
    let mut spec = json!({"type": profile_type, "selector": {"matchLabels": {"app": "web"}}, "duration": "2s"});
    if let (Some(obj), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        obj.extend(extra.clone());
    }
    let request = pipeline.request(&format!("{profile_type}-req"), spec);
    let (done, phases) = pipeline.run(&ns, &request, TIMEOUT).await;
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Succeeded),
        "status: {status:#?}\n{}\n{}",
        pipeline.operator_logs(),
        pipeline.agent_logs()
    );
    assert_eq!(
        phases,
        [
            RequestPhase::Pending,
            RequestPhase::Running,
            RequestPhase::Succeeded
        ],
        "phases seen"
    );
    assert_eq!((status.pod_count, status.node_count), (Some(2), Some(2)));
    assert!(status.start_time.is_some() && status.completion_time.is_some());
    let nodes = nodes_of(&done);
    assert_eq!(nodes.len(), 2);
    assert_eq!(nodes[&pipeline.nodes[0]].pods, ["web-1"]);
    assert_eq!(
        nodes[&pipeline.nodes[1]].pods,
        ["web-2"],
        "db-1 is not selected"
    );
    for (node, entry) in &nodes {
        assert_eq!(entry.phase, Some(NodePhase::Succeeded), "{node}: {entry:?}");
        assert!(!entry.artifacts.is_empty(), "{node} has no artifacts");
        for artifact in &entry.artifacts {
            let file = pipeline.download(&done, artifact).await;
            if artifact.name.ends_with(".pb.gz") {
                let top = pprof_top(&file);
                assert!(
                    !top.trim().is_empty(),
                    "empty pprof output for {}",
                    artifact.name
                );
            }
        }
    }
    let completed = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Completed")
        .expect("a Completed condition");
    assert_eq!(
        (completed.status.as_str(), completed.reason.as_str()),
        ("True", "Succeeded")
    );
    (pipeline, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_request_succeeds_on_two_nodes_with_readable_profiles() {
    let _serial = serial().await;
    let (pipeline, done) =
        profile_two_nodes("cpu", "spin", json!({"cpu": {"frequencyHz": 199}})).await;
    let summary = done.status.unwrap().summary.expect("a summary");
    assert!(
        summary.samples.unwrap_or(0) > 0,
        "no cpu samples: {summary:?}"
    );
    assert_eq!(summary.artifacts, Some(2));
    let metrics = pipeline.operator_metrics().await;
    assert!(
        metrics.contains("flamefleet_operator_requests_finished_total{phase=\"Succeeded\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("flamefleet_operator_captures_dispatched_total 2"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runqlat_request_succeeds_with_percentiles_in_the_summary() {
    let _serial = serial().await;
    let (_pipeline, done) = profile_two_nodes("runqlat", "wake", json!({})).await;
    let status = done.status.unwrap();
    let names: Vec<String> = status
        .nodes
        .iter()
        .flat_map(|n| n.artifacts.iter().map(|a| a.name.clone()))
        .collect();
    assert_eq!(
        names.iter().filter(|n| n.ends_with(".txt")).count(),
        2,
        "{names:?}"
    );
    let latency = status
        .summary
        .and_then(|s| s.runqlat)
        .expect("runqlat percentiles in the summary");
    assert!(latency.p99_us >= latency.p50_us, "{latency:?}");
    assert!(latency.events > 0, "{latency:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heap_request_succeeds_with_ebpf_allocation_profiles() {
    let _serial = serial().await;
    let (_pipeline, done) = profile_two_nodes(
        "heap",
        "alloc",
        // The alloc workload is nearly all allocator calls: the overhead guard would refuse it.
        json!({"heap": {"source": "ebpf", "maxOverheadPercent": 0}}),
    )
    .await;
    let samples = done
        .status
        .unwrap()
        .summary
        .and_then(|s| s.samples)
        .unwrap_or(0);
    assert!(samples > 0, "no heap samples");
}

/// Namespace isolation and download permissions in one pipeline: a request in A that names
/// B's pods (by selector and by name) profiles A's pod only; B's pod is never a target. Then
/// the artifacts: a token that may get the request downloads, others are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_stay_in_their_namespace_and_downloads_need_permission() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let a = TestNamespace::create("ff-tenant-a").await.unwrap();
    let b = TestNamespace::create("ff-tenant-b").await.unwrap();
    pipeline
        .pod(&a, "web-a", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&b, "web-b", 1, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&b, "only-in-b", 1, &[("app", "secret")], "spin", 1)
        .await;

    // Selector matches pods in both namespaces; podNames names B's pods.
    let request = pipeline.request(
        "cross",
        json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "podNames": ["web-b", "only-in-b"], "duration": "1s"}),
    );
    let (done, _) = pipeline.run(&a, &request, TIMEOUT).await;
    let status = done.status.clone().unwrap();
    assert_eq!(status.phase, Some(RequestPhase::Succeeded), "{status:#?}");
    let nodes = nodes_of(&done);
    assert_eq!(
        nodes.keys().collect::<Vec<_>>(),
        [&pipeline.nodes[0]],
        "only A's node: {nodes:#?}"
    );
    assert_eq!(nodes[&pipeline.nodes[0]].pods, ["web-a"]);
    let resolved = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Resolved")
        .unwrap();
    assert!(
        resolved.message.contains("web-b: no such pod"),
        "{}",
        resolved.message
    );

    // Only B's pods named: nothing to profile in A.
    let only_b = pipeline.request(
        "only-b",
        json!({"type": "cpu", "podNames": ["only-in-b"], "duration": "1s"}),
    );
    let (failed, _) = pipeline.run(&a, &only_b, TIMEOUT).await;
    let status = failed.status.unwrap();
    assert_eq!(status.phase, Some(RequestPhase::Failed));
    assert!(status.nodes.is_empty(), "{status:#?}");
    let resolved = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Resolved")
        .unwrap();
    assert_eq!(
        (resolved.status.as_str(), resolved.reason.as_str()),
        ("False", "NoPodsMatched")
    );
    assert!(
        resolved
            .message
            .contains("only-in-b: no such pod in namespace"),
        "{}",
        resolved.message
    );

    // Downloads: a URL the operator signs on request works; unsigned or forged ones do not.
    let artifact = nodes[&pipeline.nodes[0]].artifacts[0].clone();
    assert!(artifact.url.is_none(), "no URL is ever kept in the status");
    let signed = url::Url::parse(&pipeline.download_url(&done, &artifact.name).await).unwrap();
    let http = reqwest::Client::new();
    let ok = http.get(signed.clone()).send().await.unwrap();
    assert_eq!(ok.status(), 200);
    check_digest(&artifact, &ok.bytes().await.unwrap());
    let mut plain = signed.clone();
    plain.set_query(None);
    let anonymous = http.get(plain.clone()).send().await.unwrap();
    assert_eq!(anonymous.status(), 401, "no signature");
    let mut tampered = signed.clone();
    let query: Vec<(String, String)> = signed
        .query_pairs()
        .map(|(k, v)| {
            let v = if k == "sig" {
                "0".repeat(64)
            } else {
                v.into_owned()
            };
            (k.into_owned(), v)
        })
        .collect();
    tampered.query_pairs_mut().clear().extend_pairs(query);
    assert_eq!(
        http.get(tampered).send().await.unwrap().status(),
        403,
        "a forged signature"
    );

    // Deleting the request deletes its artifacts (finalizer).
    let api: Api<ProfileRequest> = a.api();
    api.delete("cross", &Default::default()).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while api.get_opt("cross").await.unwrap().is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "the finalizer did not complete\n{}",
            pipeline.operator_logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        reqwest::get(signed).await.unwrap().status(),
        404,
        "artifact still served after deletion"
    );
}
