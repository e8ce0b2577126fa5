//! End to end: 20 requests applied at once (cpu and runqlat, over two nodes) all complete.

mod pipeline_support;

use std::time::Duration;

use flamefleet_api::{ProfileRequest, RequestPhase};
use flamefleet_e2e::TestNamespace;
use kube::api::{Api, PostParams};
use pipeline_support::{Pipeline, PipelineOptions, serial};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_requests_all_complete() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-concurrent").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&ns, "web-2", 1, &[("app", "web")], "wake", 1)
        .await;
    let api: Api<ProfileRequest> = ns.api();
    let names: Vec<String> = (0..20).map(|i| format!("burst-{i}")).collect();
    let creates = names.iter().enumerate().map(|(i, name)| {
        let kind = if i % 2 == 0 { "cpu" } else { "runqlat" };
        let request = pipeline.request(
            name,
            json!({"type": kind, "selector": {"matchLabels": {"app": "web"}}, "duration": "2s"}),
        );
        let api = api.clone();
        async move { api.create(&PostParams::default(), &request).await }
    });
    for created in futures::future::join_all(creates).await {
        created.expect("creating a request");
    }
    for name in &names {
        let phases = pipeline.watch_phases(&api, name).await;
        let (done, _) = pipeline
            .wait_terminal(&api, name, Duration::from_secs(120), phases)
            .await;
        let status = done.status.clone().unwrap();
        assert_eq!(
            status.phase,
            Some(RequestPhase::Succeeded),
            "{name}: {status:#?}\n--- operator:\n{}\n--- agents:\n{}",
            pipeline.operator_logs(),
            pipeline.agent_logs()
        );
        let nodes = pipeline_support::node_results(&pipeline.client, &done).await;
        assert_eq!(nodes.len(), 2, "{name}");
        assert!(
            nodes.values().all(|n| !n.artifacts.is_empty()),
            "{name}: {nodes:#?}"
        );
        assert_eq!(status.node_counts.map(|c| c.succeeded), Some(2), "{name}");
        assert_eq!(status.result_slices, Some(1), "{name}");
    }
    let metrics = pipeline.operator_metrics().await;
    assert!(
        metrics.contains("flamefleet_operator_requests_finished_total{phase=\"Succeeded\"} 20"),
        "{metrics}"
    );
}
