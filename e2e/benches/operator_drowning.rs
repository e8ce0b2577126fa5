//! Operator benchmark (prints figures, asserts nothing): one namespace trying to drown the
//! operator. 100 SamplingPolicies with the schedule `* * * * * *` (every second), a 100%
//! duty cycle and 100 captures per node, in one namespace with one pod on one node (a real
//! agent), run against each operator build in turn on the same API server:
//!
//! - API requests per second served by the API server (`apiserver_request_total`): the
//!   operator is its main client during the window (the agent and this harness add a few);
//! - operator CPU (user + system, from `/proc/<pid>/stat`) per second of wall time;
//! - reconciles per second (the operator's `flamefleet_operator_reconciles_total`);
//! - ProfileRequests in the namespace at the end, and how many wait to start (Pending).
//!
//! Each build gets a fresh fixture (agent, operator, namespace) and `WARMUP` before a
//! `WINDOW` of measurement; the fixture's objects are removed before the next build starts.
//! The operators run with their defaults (no `--min-run-interval` flag is passed).
//!
//! Run (as root): `cargo bench -p flamefleet-e2e --bench operator_drowning --profile dev`;
//! `FLAMEFLEET_PEER_OPERATOR=<path>` adds an older `flamefleet-operator` build, measured
//! first in the same run.

#[path = "../tests/pipeline_support/mod.rs"]
mod pipeline_support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use flamefleet_api::{ProfileRequest, RequestPhase, SamplingPolicy};
use flamefleet_e2e::TestNamespace;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use pipeline_support::{Pipeline, PipelineOptions};
use serde_json::json;

const POLICIES: usize = 100;
const WARMUP: Duration = Duration::from_secs(20);
const WINDOW: Duration = Duration::from_secs(60);

/// Sum of `apiserver_request_total` over every label set.
async fn api_requests(client: &kube::Client) -> f64 {
    let request = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("a GET request");
    let text = client
        .request_text(request)
        .await
        .expect("the API server's /metrics");
    text.lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// User + system CPU seconds of `pid`.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at the state, field 3.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15: indexes 11 and 12 after the name.
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) + ticks(12)) / hz
}

fn reconciles(metrics: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("flamefleet_operator_reconciles_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

struct Figures {
    label: String,
    api_per_s: f64,
    cpu_percent: f64,
    reconciles_per_s: f64,
    requests: usize,
    pending: usize,
}

async fn measure(label: &str, operator: Option<PathBuf>) -> Figures {
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        min_run_interval: None,
        operator_bin: operator,
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-drown-bench").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    let policies: Api<SamplingPolicy> = ns.api();
    for i in 0..POLICIES {
        let policy = pipeline.policy(
            &format!("every-second-{i:03}"),
            json!({
                "schedule": "* * * * * *",
                "template": {"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"},
                "budget": {"maxConcurrentCapturesPerNode": 100, "maxDutyCyclePercent": 100},
            }),
        );
        policies
            .create(&PostParams::default(), &policy)
            .await
            .expect("creating a policy");
    }
    let client = ns.client();
    let pid = pipeline
        .operator
        .as_ref()
        .and_then(pipeline_support::Proc::pid)
        .expect("the operator runs");
    tokio::time::sleep(WARMUP).await;
    let (api0, cpu0, rec0) = (
        api_requests(&client).await,
        cpu_seconds(pid),
        reconciles(&pipeline.operator_metrics().await),
    );
    let t0 = Instant::now();
    tokio::time::sleep(WINDOW).await;
    let (api1, cpu1, rec1) = (
        api_requests(&client).await,
        cpu_seconds(pid),
        reconciles(&pipeline.operator_metrics().await),
    );
    let secs = t0.elapsed().as_secs_f64();
    let requests: Api<ProfileRequest> = ns.api();
    let all = requests.list(&Default::default()).await.unwrap().items;
    let pending = all
        .iter()
        .filter(|r| {
            matches!(
                r.status.as_ref().and_then(|s| s.phase),
                None | Some(RequestPhase::Pending)
            )
        })
        .count();
    let figures = Figures {
        label: label.to_string(),
        api_per_s: (api1 - api0) / secs,
        cpu_percent: 100.0 * (cpu1 - cpu0) / secs,
        reconciles_per_s: (rec1 - rec0) / secs,
        requests: all.len(),
        pending,
    };
    // Remove what this build left (its operator stops with the fixture): finalizers first,
    // so the next build's caches start from an empty namespace.
    drop(pipeline);
    let unfinalize = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    for p in policies.list(&Default::default()).await.unwrap().items {
        let name = p.metadata.name.unwrap_or_default();
        let _ = policies
            .patch(&name, &PatchParams::default(), &unfinalize)
            .await;
        let _ = policies.delete(&name, &DeleteParams::default()).await;
    }
    for r in all {
        let name = r.metadata.name.unwrap_or_default();
        let _ = requests
            .patch(&name, &PatchParams::default(), &unfinalize)
            .await;
        let _ = requests.delete(&name, &DeleteParams::default()).await;
    }
    figures
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut rows = Vec::new();
    if let Some(peer) = std::env::var_os("FLAMEFLEET_PEER_OPERATOR") {
        rows.push(measure("peer (FLAMEFLEET_PEER_OPERATOR)", Some(peer.into())).await);
    }
    rows.push(measure("this build", None).await);
    println!(
        "\n{POLICIES} SamplingPolicies `* * * * * *`, 100% duty, one namespace; {}s window after {}s warm-up",
        WINDOW.as_secs(),
        WARMUP.as_secs()
    );
    println!(
        "{:<34} {:>12} {:>14} {:>14} {:>10} {:>9}",
        "operator", "API req/s", "operator CPU %", "reconciles/s", "requests", "pending"
    );
    for f in rows {
        println!(
            "{:<34} {:>12.1} {:>14.1} {:>14.1} {:>10} {:>9}",
            f.label, f.api_per_s, f.cpu_percent, f.reconciles_per_s, f.requests, f.pending
        );
    }
}
