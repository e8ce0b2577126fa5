//! Operator benchmark: prints figures, asserts nothing.
//!
//! - apply → Succeeded minus the capture duration, p50/p99 over 50 cpu requests on 2 nodes;
//!   peer: a bare create + status write round trip on the same API server;
//! - reconciles per second while 1,000 requests are applied at once (they match no pods,
//!   so each finishes Failed after a full reconcile: finalizer, Pending, resolve, Failed);
//! - operator RSS with the 1,050 finished ProfileRequests in its cache.
//!
//! Run (as root): `cargo bench -p flamefleet-e2e --bench operator_pipeline --profile dev`
//! (`--profile release` measures optimized binaries; the harness builds the agent and
//! operator in the same profile).

#[path = "../tests/pipeline_support/mod.rs"]
mod pipeline_support;

use std::time::{Duration, Instant};

use flamefleet_api::{ProfileRequest, RequestPhase};
use flamefleet_e2e::TestNamespace;
use kube::api::{Api, Patch, PatchParams, PostParams};
use pipeline_support::{Pipeline, PipelineOptions};
use serde_json::json;

const CAPTURE: Duration = Duration::from_secs(1);

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

fn reconciles(metrics: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("flamefleet_operator_reconciles_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Times of the request's milestones, as seen by polling every 10 ms.
struct Milestones {
    running: Instant,
    nodes_done: Instant,
    succeeded: Instant,
}

async fn wait_succeeded(api: &Api<ProfileRequest>, name: &str) -> Milestones {
    let mut running = None;
    let mut nodes_done = None;
    loop {
        let r = api.get(name).await.unwrap();
        let status = r.status.unwrap_or_default();
        let now = Instant::now();
        if status.phase.is_some() && status.phase != Some(RequestPhase::Pending) {
            running.get_or_insert(now);
        }
        if status
            .node_counts
            .is_some_and(|c| c.total > 0 && c.succeeded == c.total)
        {
            nodes_done.get_or_insert(now);
        }
        match status.phase {
            Some(RequestPhase::Succeeded) => {
                return Milestones {
                    running: running.unwrap_or(now),
                    nodes_done: nodes_done.unwrap_or(now),
                    succeeded: now,
                };
            }
            Some(p) if p.is_terminal() => panic!("{name} ended {p}"),
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-bench").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&ns, "web-2", 1, &[("app", "web")], "spin", 1)
        .await;
    let api: Api<ProfileRequest> = ns.api();

    // Peer: create + status apply + get on the same API server (no operator involved).
    let mut peer = Vec::new();
    for i in 0..50 {
        let name = format!("peer-{i}");
        let mut request = pipeline.request(
            &name,
            json!({"type": "cpu", "podNames": ["none"], "duration": "1s"}),
        );
        request.metadata.labels = None; // not for the operator
        let start = Instant::now();
        api.create(&PostParams::default(), &request).await.unwrap();
        let body = json!({"apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest", "status": {"phase": "Succeeded"}});
        api.patch_status(
            &name,
            &PatchParams::apply("bench-peer"),
            &Patch::Apply(body),
        )
        .await
        .unwrap();
        api.get(&name).await.unwrap();
        peer.push(start.elapsed().as_secs_f64() * 1000.0);
    }
    peer.sort_by(f64::total_cmp);

    let mut overhead = Vec::new();
    let mut operator_part = Vec::new();
    for i in 0..50 {
        let name = format!("lat-{i}");
        let request = pipeline.request(
            &name,
            json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"}),
        );
        let start = Instant::now();
        api.create(&PostParams::default(), &request).await.unwrap();
        let m = wait_succeeded(&api, &name).await;
        overhead.push((m.succeeded - start).saturating_sub(CAPTURE).as_secs_f64() * 1000.0);
        // The operator's own share: apply -> Running (dispatch) plus every node entry
        // Succeeded -> request Succeeded (aggregation; often the same write now that the
        // operator records the nodes' results); the rest is the agents' capture,
        // symbolization and upload, and the operator's check of the uploads.
        let ours = (m.running - start) + (m.succeeded - m.nodes_done);
        operator_part.push(ours.as_secs_f64() * 1000.0);
    }
    // The first request finds the agents' CPU samplers unloaded and pays their load; the
    // later ones find them kept loaded between captures (--cpu-sampler-linger).
    let first = overhead[0];
    let mut warm = overhead[1..].to_vec();
    warm.sort_by(f64::total_cmp);
    overhead.sort_by(f64::total_cmp);
    operator_part.sort_by(f64::total_cmp);
    let (p50, p99) = (percentile(&overhead, 0.5), percentile(&overhead, 0.99));
    let (peer50, peer99) = (percentile(&peer, 0.5), percentile(&peer, 0.99));
    println!(
        "apply -> Succeeded minus capture duration (50 cpu requests, 1s, 2 nodes): p50 {p50:.0} ms, p99 {p99:.0} ms"
    );
    println!(
        "  the first request (samplers loaded by it): {first:.0} ms; the {} after it (samplers kept loaded): p50 {:.0} ms, p99 {:.0} ms",
        warm.len(),
        percentile(&warm, 0.5),
        percentile(&warm, 0.99)
    );
    println!(
        "  of which the operator (apply -> Running, last node entry -> Succeeded): p50 {:.0} ms, p99 {:.0} ms",
        percentile(&operator_part, 0.5),
        percentile(&operator_part, 0.99)
    );
    println!(
        "peer: create + status apply + get round trip: p50 {peer50:.1} ms, p99 {peer99:.1} ms; ratio p50 {:.1}x, p99 {:.1}x",
        p50 / peer50,
        p99 / peer99
    );

    let before = reconciles(&pipeline.operator_metrics().await);
    let start = Instant::now();
    let creates = (0..1000).map(|i| {
        let request = pipeline.request(
            &format!("bulk-{i}"),
            json!({"type": "cpu", "podNames": ["absent"], "duration": "1s"}),
        );
        let api = api.clone();
        async move {
            api.create(&PostParams::default(), &request)
                .await
                .map(|_| ())
        }
    });
    let mut pending: Vec<_> = creates.collect();
    while !pending.is_empty() {
        let batch: Vec<_> = pending.drain(..pending.len().min(50)).collect();
        for r in futures::future::join_all(batch).await {
            r.unwrap();
        }
    }
    loop {
        let metrics = pipeline.operator_metrics().await;
        let failed = metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix("flamefleet_operator_requests_finished_total{phase=\"Failed\"} ")
            })
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if failed >= 1000 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(600),
            "bulk requests did not finish: {failed}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let after = reconciles(&pipeline.operator_metrics().await);
    println!(
        "1,000 requests applied at once: all finished in {elapsed:.1} s; {:.0} reconciles in that time = {:.0} reconciles/s ({:.0} requests/s)",
        after - before,
        (after - before) / elapsed,
        1000.0 / elapsed
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = pipeline.operator.as_ref().and_then(|p| p.pid()).unwrap();
    println!(
        "operator RSS with 1,050 finished ProfileRequests cached: {:.1} MiB (pid {pid})",
        rss_mib(pid)
    );
}
