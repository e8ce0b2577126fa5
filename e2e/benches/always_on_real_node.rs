//! Always-on profiling on the real node (prints figures, asserts nothing; docs/benchmarks.md,
//! "Always-on profiling on the real node"): the chart installed on the one-node cluster of
//! `scripts/cluster.sh` (real kubelet, containerd + runc) with its default windows (19 Hz,
//! contiguous windows of 20 s), exporting to a real OpenTelemetry Collector on the host
//! (scripts/otelcol.sh); `--pods` pods of the checkout demo, each held to `--cpu-limit`; an
//! always-on SamplingPolicy over them for `--seconds`. Prints:
//!
//! - every minute: the agent pod's CPU (its cgroup's `cpu.stat`, every thread of the agent:
//!   windows, samplers, symbolization, splitting, the gRPC stream) in percent of one core and
//!   per profiled pod, its RSS, the policy's `status.continuous`, the load;
//! - the same agent's CPU over `--idle-seconds` with the pods running and no policy (the
//!   peer: what the agent costs anyway);
//! - per pod, from what the Collector received: windows, the sampled share of the wall time
//!   since the policy was created (at most window/period: 100% with the default contiguous
//!   windows), the steady state (the
//!   windows after the first, over their periods), the first window's start;
//! - the policy's coverage (`minCoveragePercent`, `lowCoverage`), the agent's always-on
//!   counters, ProfileRequests in the cluster before and after;
//! - the operator pod's CPU over the run.
//!
//! ```text
//! # root; takes the node for --seconds plus ~3 minutes (images, install, the idle minute)
//! cargo bench -p flamefleet-e2e --bench always_on_real_node --profile dev -- [--pods 10] [--seconds 600] [--idle-seconds 60] [--cpu-limit 50m] [--frequency 19] [--tag always-on-bench] [--no-build]
//! ```
//!
//! The images are built (release) from this checkout with `--tag` and imported (with
//! `--no-build`, the images of `--tag` already in the node's containerd are used); the release
//! `flamefleet` in `flamefleet-system` is replaced, and uninstalled at the end.

#[path = "../tests/pipeline_support/mod.rs"]
mod pipeline_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result, bail};
use flamefleet_api::continuous::ContinuousStatus;
use flamefleet_api::{ProfileRequest, SamplingPolicy};
use flamefleet_e2e::Cluster;
use flamefleet_e2e::pod_usage::{PodUsage, pod_usage};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use pipeline_support::otelcol::{Collector, resource_attributes};
use serde_json::json;

const RELEASE: &str = "flamefleet";
const NAMESPACE: &str = "flamefleet-system";
const STORE_NODE_PORT: u16 = 30808;
const TIMEOUT: Duration = Duration::from_secs(300);

fn flag<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The UID and IP of the one pod labelled `label` in the release's namespace.
async fn release_pod(client: &kube::Client, label: &str) -> Result<(String, String)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let list = pods.list(&ListParams::default().labels(label)).await?;
    let pod = list
        .items
        .into_iter()
        .find(|p| p.metadata.deletion_timestamp.is_none())
        .with_context(|| format!("no pod {label} in {NAMESPACE}"))?;
    Ok((
        pod.metadata.uid.unwrap_or_default(),
        pod.status.and_then(|s| s.pod_ip).unwrap_or_default(),
    ))
}

/// The agent's `flamefleet_agent_continuous_*` series, from its probe port.
async fn agent_continuous_metrics(ip: &str) -> BTreeMap<String, f64> {
    let Ok(r) = reqwest::get(format!("http://{ip}:9091/metrics")).await else {
        return BTreeMap::new();
    };
    r.text()
        .await
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("flamefleet_agent_continuous_"))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((
                k.trim_start_matches("flamefleet_agent_continuous_")
                    .to_owned(),
                v.parse().ok()?,
            ))
        })
        .collect()
}

async fn continuous_status(api: &Api<SamplingPolicy>) -> Option<ContinuousStatus> {
    api.get("always").await.ok()?.status?.continuous
}

fn percent_of_core(cpu: Duration, wall: Duration) -> f64 {
    cpu.as_secs_f64() / wall.as_secs_f64().max(1e-9) * 100.0
}

/// One exported window of one pod: (start, length) in ms since the epoch, samples.
struct Exported {
    start_ms: i64,
    length_ms: i64,
    samples: u64,
}

/// The windows the Collector holds of policy `policy` (`namespace/name`), by pod name.
fn exported_windows(collector: &Collector, policy: &str) -> BTreeMap<String, Vec<Exported>> {
    let mut out: BTreeMap<String, Vec<Exported>> = BTreeMap::new();
    for data in collector.received() {
        let Some(rp) = data.resource_profiles.first() else {
            continue;
        };
        let attrs = resource_attributes(rp);
        if attrs.get("flamefleet.policy.name").map(String::as_str) != Some(policy) {
            continue;
        }
        let Some(profile) = rp.scope_profiles.first().and_then(|s| s.profiles.first()) else {
            continue;
        };
        let samples = data
            .dictionary
            .as_ref()
            .and_then(|d| flamefleet_pprof::otlp::to_pprof(&data.resource_profiles, d).ok())
            .and_then(|p| flamefleet_pprof::value_total(&p, "samples", "count"))
            .unwrap_or(0);
        out.entry(attrs.get("k8s.pod.name").cloned().unwrap_or_default())
            .or_default()
            .push(Exported {
                start_ms: i64::try_from(profile.time_unix_nano / 1_000_000).unwrap_or(0),
                length_ms: i64::try_from(profile.duration_nano / 1_000_000).unwrap_or(0),
                samples,
            });
    }
    for windows in out.values_mut() {
        windows.sort_by_key(|w| w.start_ms);
    }
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    let pods: u32 = flag(&argv, "--pods").unwrap_or(10);
    let seconds: u64 = flag(&argv, "--seconds").unwrap_or(600);
    let idle_seconds: u64 = flag(&argv, "--idle-seconds").unwrap_or(60);
    let cpu_limit: String = flag(&argv, "--cpu-limit").unwrap_or_else(|| "50m".into());
    let frequency: u32 = flag(&argv, "--frequency").unwrap_or(19);
    let tag: String = flag(&argv, "--tag").unwrap_or_else(|| "always-on-bench".into());
    if !nix::unistd::geteuid().is_root() {
        bail!("run as root: the bench runs the one-node cluster (kubelet, containerd)");
    }
    let cluster = Cluster::shared().context("the one-node cluster (scripts/cluster.sh up)")?;
    let client = cluster.client().await?;

    let tag = if argv.iter().any(|a| a == "--no-build") {
        // Images of this tag already imported (e.g. by the real-node test).
        tag
    } else {
        eprintln!("building and importing the images (tag {tag}) ...");
        cluster
            .build_images(Some(&tag), None)
            .context("building the images")?
    };
    let dir = tempfile::tempdir()?;
    let port = flamefleet_e2e::workload::free_port()?;
    let collector = Collector::start_on(dir.path(), &cluster.node_ip, port);
    cluster
        .uninstall_flamefleet(RELEASE, NAMESPACE, true)
        .map_err(anyhow::Error::msg)?;
    let mut values = cluster.local_values(&tag, STORE_NODE_PORT);
    values.push(format!(
        "export.otlp.endpoint=http://{}:{port}",
        cluster.node_ip
    ));
    eprintln!("helm install (chart defaults: continuous.window 20s, continuous.period 20s) ...");
    cluster
        .install_flamefleet(RELEASE, NAMESPACE, &values)
        .map_err(anyhow::Error::msg)?;

    let namespace = format!("always-bench-{}", std::process::id());
    cluster
        .kubectl(&["create", "namespace", &namespace])
        .map_err(anyhow::Error::msg)?;
    let result = run(
        cluster,
        &client,
        &collector,
        &namespace,
        &tag,
        Settings {
            pods,
            seconds,
            idle_seconds,
            cpu_limit,
            frequency,
        },
    )
    .await;
    let _ = cluster.kubectl(&["delete", "namespace", &namespace, "--wait=false"]);
    let _ = cluster.uninstall_flamefleet(RELEASE, NAMESPACE, true);
    result
}

struct Settings {
    pods: u32,
    seconds: u64,
    idle_seconds: u64,
    cpu_limit: String,
    frequency: u32,
}

async fn run(
    cluster: &Cluster,
    client: &kube::Client,
    collector: &Collector,
    namespace: &str,
    tag: &str,
    s: Settings,
) -> Result<()> {
    // One worker thread each (the demo's argument), held to the CPU limit.
    cluster
        .apply(&flamefleet_e2e::cluster::demo_deployment(
            namespace,
            "web",
            &format!("flamefleet.local/checkout-demo:{tag}"),
            s.pods,
            ["10m", &s.cpu_limit],
            &["1"],
        ))
        .map_err(anyhow::Error::msg)?;
    cluster
        .kubectl(&[
            "-n",
            namespace,
            "rollout",
            "status",
            "deploy/web",
            "--timeout=300s",
        ])
        .map_err(anyhow::Error::msg)?;
    let (agent_uid, agent_ip) =
        release_pod(client, "app.kubernetes.io/name=flamefleet-agent").await?;
    let (operator_uid, _) =
        release_pod(client, "app.kubernetes.io/name=flamefleet-operator").await?;
    let usage = |uid: &str| pod_usage(uid).map_err(anyhow::Error::from);
    let first = usage(&agent_uid)?;
    println!(
        "agent pod {agent_uid}: CPU from {}, processes {:?}",
        first.cpu_source.display(),
        first
            .processes
            .iter()
            .map(|p| format!("{} {}", p.pid, p.comm))
            .collect::<Vec<_>>()
    );

    // The peer: the agent with the pods running and no policy.
    let idle = Duration::from_secs(s.idle_seconds);
    let (idle0, idle_at) = (usage(&agent_uid)?, Instant::now());
    tokio::time::sleep(idle).await;
    let idle1 = usage(&agent_uid)?;
    let idle_percent = percent_of_core(idle1.cpu - idle0.cpu, idle_at.elapsed());

    let requests: Api<ProfileRequest> = Api::all(client.clone());
    let requests_before = requests.list(&ListParams::default()).await?.items.len();
    let policies: Api<SamplingPolicy> = Api::namespaced(client.clone(), namespace);
    let policy: SamplingPolicy = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "SamplingPolicy",
        "metadata": {"name": "always"},
        "spec": {
            "schedule": "@continuous",
            "template": {
                "type": "cpu",
                "selector": {"matchLabels": {"app": "web"}},
                "duration": "20s",
                "cpu": {"frequencyHz": s.frequency},
            },
        },
    }))?;
    println!(
        "\nalways-on on the real node: {} pods of the checkout demo (one worker, CPU limit {}), {} Hz, the chart's windows, for {} s; agent idle with the pods running: {idle_percent:.4}% of one core over {} s; load {}",
        s.pods,
        s.cpu_limit,
        s.frequency,
        s.seconds,
        s.idle_seconds,
        loadavg()
    );
    let operator0 = usage(&operator_uid)?;
    let start0 = usage(&agent_uid)?;
    let (t0, t0_ms) = (Instant::now(), unix_ms());
    policies.create(&PostParams::default(), &policy).await?;
    let deadline = t0 + Duration::from_secs(s.seconds);
    println!(
        "\n{:>6} {:>10} {:>12} {:>8} {:>8} {:>9} {:>9} {:>7} {:>9}  load",
        "minute",
        "agent CPU%",
        "per pod %",
        "RSS MiB",
        "windows",
        "exported",
        "dropped",
        "min cov",
        "ProfReqs"
    );
    let mut last: (PodUsage, Instant) = (start0.clone(), t0);
    let mut rss = Vec::new();
    while Instant::now() < deadline {
        tokio::time::sleep(
            Duration::from_secs(60).min(deadline.saturating_duration_since(Instant::now())),
        )
        .await;
        let (now, at) = (usage(&agent_uid)?, Instant::now());
        let share = percent_of_core(now.cpu - last.0.cpu, at - last.1);
        let mib = now.rss_kib_of("flamefleet-agen") as f64 / 1024.0;
        rss.push(mib);
        let st = continuous_status(&policies).await.unwrap_or_default();
        let reqs = requests.list(&ListParams::default()).await?.items.len();
        println!(
            "{:>6.1} {:>10.4} {:>12.5} {:>8.1} {:>8} {:>9} {:>9} {:>6}% {:>9}  {}",
            (at - t0).as_secs_f64() / 60.0,
            share,
            share / f64::from(s.pods),
            mib,
            st.windows,
            st.exported,
            st.dropped,
            st.min_coverage_percent
                .map_or_else(|| "-".into(), |c| c.to_string()),
            reqs,
            loadavg()
        );
        last = (now, at);
    }
    let wall = t0.elapsed();
    let end_ms = t0_ms + i64::try_from(wall.as_millis()).unwrap_or(i64::MAX);
    let end = usage(&agent_uid)?;
    let operator1 = usage(&operator_uid)?;
    let status = continuous_status(&policies).await.unwrap_or_default();
    let requests_after = requests.list(&ListParams::default()).await?.items.len();
    let metrics = agent_continuous_metrics(&agent_ip).await;

    // Per pod, from what the Collector received.
    let windows = exported_windows(collector, &format!("{namespace}/always"));
    // The cluster's windows, as the policy's status says them.
    let (window_s, period_s) = (status.window_seconds, status.period_seconds.max(1));
    let period_ms = period_s * 1000;
    let ceiling = 100.0 * window_s as f64 / period_s as f64;
    println!(
        "\n{:>28} {:>8} {:>15} {:>15} {:>20} {:>9}",
        "pod (exported windows)",
        "windows",
        "sampled % wall",
        "steady state %",
        "first window at, ms",
        "samples"
    );
    let (mut min_wall, mut min_steady) = (f64::MAX, f64::MAX);
    let mut firsts = Vec::new();
    for (pod, ws) in &windows {
        let inside: i64 = ws
            .iter()
            .map(|w| (w.start_ms + w.length_ms).min(end_ms) - w.start_ms.max(t0_ms))
            .filter(|d| *d > 0)
            .sum();
        let share = inside as f64 / (end_ms - t0_ms) as f64 * 100.0;
        let steady: Vec<&Exported> = ws
            .iter()
            .skip(1)
            .filter(|w| w.start_ms + w.length_ms <= end_ms)
            .collect();
        let steady_share = steady.iter().map(|w| w.length_ms).sum::<i64>() as f64
            / (steady.len() as f64 * period_ms as f64).max(1.0)
            * 100.0;
        let first_at = ws.first().map_or(0, |w| w.start_ms - t0_ms);
        firsts.push((first_at, ws.first().map_or(0, |w| w.length_ms)));
        min_wall = min_wall.min(share);
        min_steady = min_steady.min(steady_share);
        println!(
            "{pod:>28} {:>8} {:>14.2}% {:>14.2}% {:>20} {:>9}",
            ws.len(),
            share,
            steady_share,
            first_at,
            ws.iter().map(|w| w.samples).sum::<u64>()
        );
    }
    println!(
        "\npods with exported windows: {} of {}; lowest sampled share of the wall time since the policy was created {:.2}%, lowest steady state {:.2}% ({window_s} s of every {period_s} s is {ceiling:.1}%); first windows started {}..{} ms after the policy was created and sampled {}..{} ms",
        windows.len(),
        s.pods,
        min_wall,
        min_steady,
        firsts.iter().map(|f| f.0).min().unwrap_or(0),
        firsts.iter().map(|f| f.0).max().unwrap_or(0),
        firsts.iter().map(|f| f.1).min().unwrap_or(0),
        firsts.iter().map(|f| f.1).max().unwrap_or(0),
    );
    println!(
        "status.continuous: pods {} nodes {} windows {} exported {} dropped {} queued {:?}; minCoveragePercent {:?} (every pod's coverage is at least this; 100% is {window_s} s of every {period_s} s since it joined), lowCoverage {:?}, lastExportError {:?}",
        status.pods,
        status.nodes,
        status.windows,
        status.exported,
        status.dropped,
        status.queued,
        status.min_coverage_percent,
        status.low_coverage,
        status.last_export_error
    );
    println!("agent always-on counters: {metrics:?}");
    println!("ProfileRequests in the cluster: {requests_before} before, {requests_after} after");
    let run_cpu = end.cpu - start0.cpu;
    let total = percent_of_core(run_cpu, wall);
    println!(
        "agent CPU (its pod's cgroup): {:.3} s over {:.0} s = {total:.4}% of one core, {:.5}% per profiled pod ({:.5}% per pod above the idle agent's {idle_percent:.4}%); ratio to idle {:.1}x",
        run_cpu.as_secs_f64(),
        wall.as_secs_f64(),
        total / f64::from(s.pods),
        (total - idle_percent) / f64::from(s.pods),
        total / idle_percent.max(1e-9)
    );
    println!(
        "operator CPU (its pod's cgroup): {:.4}% of one core over the run",
        percent_of_core(operator1.cpu - operator0.cpu, wall)
    );
    let steady_rss = if rss.len() > 1 { &rss[1..] } else { &rss[..] };
    println!(
        "agent RSS: {:.1} MiB before the policy, {:.1}..{:.1} MiB from minute 2 on, {:.1} MiB at the end; load {}",
        start0.rss_kib_of("flamefleet-agen") as f64 / 1024.0,
        steady_rss.iter().copied().reduce(f64::min).unwrap_or(0.0),
        steady_rss.iter().copied().reduce(f64::max).unwrap_or(0.0),
        end.rss_kib_of("flamefleet-agen") as f64 / 1024.0,
        loadavg()
    );
    policies.delete("always", &DeleteParams::default()).await?;
    cluster
        .wait_for("the agent to stop its always-on windows", TIMEOUT, || {
            let ip = agent_ip.clone();
            async move {
                let m = agent_continuous_metrics(&ip).await;
                (m.get("pods") == Some(&0.0)).then_some(())
            }
        })
        .await?;
    Ok(())
}
