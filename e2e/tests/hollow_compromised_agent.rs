//! A compromised node cannot lose its neighbours' results: one hollow agent of a fleet
//! reports DONE with every free-text field as large as a gRPC message carries (a 1.5 MiB
//! sample type, a typed summary of thousands of processes, a 512 KiB frequency note among
//! thousands of text summary entries, a 200 KiB message).
//! Its neighbours share its result slice; their results must still be written, the request
//! must end, and nothing the compromised node sent may make any object large.
//!
//! Real operator, real store process, real API server; the agents are hollow (the real
//! gRPC service and mTLS without BPF), since a real agent never sends such fields.

#[path = "pipeline_support/mod.rs"]
mod pipeline_support;

use std::time::Duration;

use flamefleet_api::result_slice::ProfileResultSlice;
use flamefleet_api::{NodePhase, ProfileRequest};
use flamefleet_e2e::hollow::Behaviour;
use flamefleet_e2e::hollow::cluster::{ClusterOptions, HollowCluster};
use kube::api::{Api, ListParams, PostParams};

const NODES: usize = 12;
const COMPROMISED: usize = 5;
/// A slice of 100 nodes with every field at its bound stays far below this; a request's
/// status holds counts, a summary and at most 20 failures.
const MAX_SLICE_BYTES: usize = 1 << 20;
const MAX_REQUEST_BYTES: usize = 64 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compromised_node_cannot_lose_its_neighbours_results() {
    let mut cluster = HollowCluster::create(
        &pipeline_support::bins().operator,
        ClusterOptions {
            nodes: NODES,
            progress_every: 0,
            ..Default::default()
        },
    )
    .await
    .expect("a hollow fleet");
    assert!(
        cluster
            .fleet
            .set_behaviour(COMPROMISED, Behaviour::Oversized)
    );
    cluster.start_operator().expect("the operator");
    let api: Api<ProfileRequest> = cluster.target_ns.api();
    let request = cluster
        .request("compromised", Duration::from_secs(1))
        .unwrap();
    api.create(&PostParams::default(), &request).await.unwrap();

    let done = cluster
        .wait_terminal(
            "compromised",
            Duration::from_secs(90),
            "one compromised node kept the request from ending",
        )
        .await;
    let status = done.status.clone().unwrap();
    let request_bytes = serde_json::to_vec(&done).unwrap().len();
    assert!(
        request_bytes < MAX_REQUEST_BYTES,
        "the request grew to {request_bytes} bytes"
    );
    if let Some(cpu) = status.summary.as_ref().and_then(|s| s.cpu.as_ref()) {
        let note = cpu.message.as_deref().unwrap_or_default();
        assert!(note.len() <= 1024, "a {}-byte frequency note", note.len());
    }

    let results = flamefleet_api::results::fetch(&cluster.agent_ns.client(), &done)
        .await
        .unwrap();
    assert!(!results.incomplete(), "{:?}", results.missing_slices);
    let bad_node = cluster.fleet.nodes()[COMPROMISED].name.clone();
    for (node, entry) in &results.nodes {
        if *node == bad_node {
            continue;
        }
        assert_eq!(entry.phase, Some(NodePhase::Succeeded), "{node}: {entry:?}");
        assert_eq!(entry.artifacts.len(), 1, "{node}: {entry:?}");
        assert_eq!(
            entry.artifacts[0].sample_type.as_deref(),
            Some("cpu/nanoseconds"),
            "{node}"
        );
    }
    assert_eq!(results.nodes.len(), NODES);
    let bad = &results.nodes[&bad_node];
    for artifact in &bad.artifacts {
        let len = artifact.sample_type.as_deref().map_or(0, str::len);
        assert!(
            len <= 128,
            "the compromised node's sample type kept {len} bytes"
        );
    }
    assert!(
        bad.message.as_deref().map_or(0, str::len) <= 8 * 1024 + 3,
        "{:?}",
        bad.message.as_deref().map(str::len)
    );

    let slices: Api<ProfileResultSlice> = cluster.target_ns.api();
    for slice in slices.list(&ListParams::default()).await.unwrap() {
        let bytes = serde_json::to_vec(&slice).unwrap().len();
        assert!(bytes < MAX_SLICE_BYTES, "a slice of {bytes} bytes");
    }
}
