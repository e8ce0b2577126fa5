//! Fleet scale benchmark: prints figures, asserts nothing.
//!
//! One hollow fleet (`flamefleet_e2e::hollow`) of the largest size with its agent and target
//! pods on the local control plane, one operator; then for 500, 2,000 and 5,000 nodes
//! (the first N target pods, by label) a few cpu requests one after the other, each:
//! - apply → Succeeded minus the capture duration (p50 / p99 over the requests);
//! - operator CPU seconds (/proc/PID/stat) and peak RSS (VmHWM, so far), and the same for
//!   the artifact store, which runs in its own process as the chart runs it;
//! - API server requests by verb and resource (`apiserver_request_total` before / after,
//!   apply to Succeeded; the benchmark's own watch and GETs included), and per node;
//! - the largest object written (request, result slices), as JSON from the API server.
//!
//! Run: `cargo bench -p flamefleet-e2e --bench fleet_scale -- [SIZES..]` (default 500 2000
//! 5000; release, and the harness builds the operator in the same profile; `--profile dev`
//! for a quick look). FLAMEFLEET_BENCH_REQUESTS sets the requests per
//! size (default 5). FLAMEFLEET_BENCH_CAPTURE_SECS sets the capture (default 2), and
//! FLAMEFLEET_BENCH_OPERATOR_ARGS adds operator flags (space-separated), e.g.
//! `--debug-listen 127.0.0.1:6061` to pull the operator's heap profile
//! (`/debug/pprof/heap`) while a request's streams are open. FLAMEFLEET_BENCH_STORE_DIR
//! puts the artifact store's files in a fresh directory under that path (e.g. a tmpfs,
//! /dev/shm) instead of the cluster's working directory under $TMPDIR.

#[path = "../tests/pipeline_support/mod.rs"]
mod pipeline_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use flamefleet_api::result_slice::ProfileResultSlice;
use flamefleet_api::{ProfileRequest, RequestPhase};
use flamefleet_e2e::hollow::cluster::{
    ClusterOptions, HollowCluster, apiserver_requests, request_delta,
};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::ApiResource;
use kube::runtime::wait::{await_condition, conditions};

fn capture_duration() -> Duration {
    let secs = std::env::var("FLAMEFLEET_BENCH_CAPTURE_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    Duration::from_secs(secs)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

async fn largest(client: &kube::Client, ns: &str, name: &str, uid: &str) -> (usize, usize) {
    let size = |o: &DynamicObject| serde_json::to_vec(o).map_or(0, |v| v.len());
    let requests: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::erase::<ProfileRequest>(&()),
    );
    let slices: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::erase::<ProfileResultSlice>(&()),
    );
    let request = requests.get(name).await.map(|o| size(&o)).unwrap_or(0);
    let slice = slices
        .list(&ListParams::default().labels(&flamefleet_api::result_slice::selector_for(uid)))
        .await
        .map(|l| l.items.iter().map(size).max().unwrap_or(0))
        .unwrap_or(0);
    (request, slice)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if sizes.is_empty() {
        sizes = vec![500, 2000, 5000];
    }
    let rounds: usize = std::env::var("FLAMEFLEET_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let largest_fleet = sizes.iter().copied().max().unwrap_or(500);
    let capture = capture_duration();
    let operator_args: Vec<String> = std::env::var("FLAMEFLEET_BENCH_OPERATOR_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let store_dir = match std::env::var_os("FLAMEFLEET_BENCH_STORE_DIR") {
        Some(parent) => Some(
            tempfile::Builder::new()
                .prefix("ff-store-")
                .tempdir_in(parent)?,
        ),
        None => None,
    };
    if let Some(dir) = &store_dir {
        println!("artifact store files in {}", dir.path().display());
    }
    let bins = pipeline_support::bins();
    let setup = Instant::now();
    let mut cluster = HollowCluster::create(
        &bins.operator,
        ClusterOptions {
            nodes: largest_fleet,
            capture_grace: Duration::from_secs(30),
            subsets: sizes.clone(),
            operator_args,
            store_dir: store_dir.as_ref().map(|d| d.path().to_path_buf()),
            ..ClusterOptions::default()
        },
    )
    .await?;
    cluster.start_operator()?;
    println!(
        "setup: {largest_fleet} hollow nodes, {} pods, operator leading, in {:.1?}",
        largest_fleet * 2,
        setup.elapsed()
    );
    let client = cluster.target_ns.client();
    let ns = cluster.target_ns.name().to_string();
    let api: Api<ProfileRequest> = cluster.target_ns.api();
    let pid = cluster.operator.as_ref().map_or(0, |o| o.pid());
    // The artifact store runs in its own process, as the chart runs it.
    let store_pid = cluster.store.as_ref().map_or(0, |s| s.process.pid());
    println!(
        "operator at rest: RSS {:.1} MiB",
        flamefleet_e2e::hollow::cluster::process_usage(pid).rss_bytes as f64 / 1048576.0
    );
    for &n in &sizes {
        let mut beyond = Vec::new();
        let mut cpu = Vec::new();
        let mut store_cpu = Vec::new();
        let mut requests_total: BTreeMap<(String, String), f64> = BTreeMap::new();
        let mut biggest = (0, 0);
        for round in 0..rounds {
            let name = format!("n{n}-{round}");
            let request = cluster.request_first(&name, capture, n)?;
            let before = apiserver_requests(&client).await?;
            let cpu_before = flamefleet_e2e::hollow::cluster::process_usage(pid).cpu_seconds;
            let store_before =
                flamefleet_e2e::hollow::cluster::process_usage(store_pid).cpu_seconds;
            let started = Instant::now();
            api.create(&PostParams::default(), &request).await?;
            let terminal = |r: Option<&ProfileRequest>| {
                r.and_then(|r| r.status.as_ref())
                    .and_then(|s| s.phase)
                    .is_some_and(RequestPhase::is_terminal)
            };
            tokio::time::timeout(
                Duration::from_secs(600),
                await_condition(api.clone(), &name, terminal),
            )
            .await??;
            let took = started.elapsed();
            let cpu_after = flamefleet_e2e::hollow::cluster::process_usage(pid).cpu_seconds;
            store_cpu.push(
                flamefleet_e2e::hollow::cluster::process_usage(store_pid).cpu_seconds
                    - store_before,
            );
            let after = apiserver_requests(&client).await?;
            let done = api.get(&name).await?;
            let phase = done.status.as_ref().and_then(|s| s.phase);
            if phase != Some(RequestPhase::Succeeded) {
                println!(
                    "  {name}: ended {phase:?}, not Succeeded: {:?}",
                    done.status
                );
            }
            beyond.push(took.saturating_sub(capture).as_secs_f64());
            cpu.push(cpu_after - cpu_before);
            for (k, v) in request_delta(&before, &after) {
                *requests_total.entry(k).or_insert(0.0) += v;
            }
            let uid = done.metadata.uid.clone().unwrap_or_default();
            let sizes = largest(&client, &ns, &name, &uid).await;
            biggest = (biggest.0.max(sizes.0), biggest.1.max(sizes.1));
            api.delete(&name, &DeleteParams::default()).await?;
            tokio::time::timeout(
                Duration::from_secs(300),
                await_condition(api.clone(), &name, conditions::is_deleted(&uid)),
            )
            .await??;
        }
        beyond.sort_by(f64::total_cmp);
        let usage = flamefleet_e2e::hollow::cluster::process_usage(pid);
        let per_request: f64 = requests_total.values().sum::<f64>() / rounds as f64;
        println!(
            "\n{n} nodes, {rounds} requests, capture {capture:?}: apply -> Succeeded minus capture p50 {:.2} s, p99 {:.2} s",
            percentile(&beyond, 0.5),
            percentile(&beyond, 0.99)
        );
        println!(
            "  operator CPU per request {:.2} s (mean), peak RSS so far {:.1} MiB, RSS now {:.1} MiB",
            cpu.iter().sum::<f64>() / cpu.len().max(1) as f64,
            usage.peak_rss_bytes as f64 / 1048576.0,
            usage.rss_bytes as f64 / 1048576.0
        );
        let store = flamefleet_e2e::hollow::cluster::process_usage(store_pid);
        println!(
            "  artifact store (own process, as the chart runs it): CPU per request {:.2} s (mean), peak RSS so far {:.1} MiB",
            store_cpu.iter().sum::<f64>() / store_cpu.len().max(1) as f64,
            store.peak_rss_bytes as f64 / 1048576.0
        );
        println!(
            "  API server requests per request: {per_request:.0} ({:.2} per node); largest objects: request {} B, slice {} B",
            per_request / n as f64,
            biggest.0,
            biggest.1
        );
        let mut rows: Vec<_> = requests_total.into_iter().collect();
        rows.sort_by(|a, b| b.1.total_cmp(&a.1));
        for ((verb, resource), count) in rows.into_iter().take(12) {
            println!(
                "    {verb:<7} {resource:<40} {:>9.1} per request {:>7.3} per node",
                count / rounds as f64,
                count / rounds as f64 / n as f64
            );
        }
    }
    let stats = cluster.fleet.stats();
    println!("\nhollow fleet: {stats:?}");
    Ok(())
}
