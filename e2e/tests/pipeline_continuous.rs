//! Always-on profiling, end to end: a SamplingPolicy with `schedule: "@continuous"` on the
//! real control plane, real agents sampling real cgroups with real eBPF, windows exported
//! by the operator to a real OpenTelemetry Collector (v0.165, profiles behind its
//! `service.profilesSupport` gate, scripts/otelcol.sh):
//!
//! - every selected pod's windows reach the Collector, one profile per pod and window, with
//!   the pod's samples only and the Kubernetes attributes from the operator's records; a pod
//!   of another namespace with the same labels is never profiled;
//! - no ProfileRequest is created, ever;
//! - the policy's status shows the pods, the windows received and exported, and coverage;
//! - with the Collector down, windows keep arriving (nothing waits for the endpoint), the
//!   ones past the retry time are dropped and counted in the policy's status; once it is up,
//!   exports resume;
//! - deleting the policy stops the windows on the nodes.
//!
//! The cluster's windows are shortened for the test (2 s every 3 s instead of the default 20 s
//! windows back to back: the gap between windows is exercised too); the real-node benchmark (`e2e/benches/always_on_real_node.rs`) runs the defaults.

mod pipeline_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use flamefleet_api::continuous::ContinuousStatus;
use flamefleet_api::{ProfileRequest, SamplingPolicy};
use flamefleet_e2e::TestNamespace;
use flamefleet_pprof::otlp::messages::ProfilesData;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use pipeline_support::otelcol::{Collector, resource_attributes};
use pipeline_support::{Pipeline, PipelineOptions, metrics_at, serial};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(90);

/// The windows the Collector holds, by pod name (`k8s.pod.name`), of policy `policy`
/// (`namespace/name`); also every other pod name seen with no policy attribute.
fn windows_by_pod(collector: &Collector, policy: &str) -> BTreeMap<String, Vec<ProfilesData>> {
    let mut out: BTreeMap<String, Vec<ProfilesData>> = BTreeMap::new();
    for data in collector.received() {
        let attrs = data
            .resource_profiles
            .first()
            .map(resource_attributes)
            .unwrap_or_default();
        if attrs.get("flamefleet.policy.name").map(String::as_str) == Some(policy) {
            let pod = attrs.get("k8s.pod.name").cloned().unwrap_or_default();
            out.entry(pod).or_default().push(data);
        }
    }
    out
}

async fn continuous_status(api: &Api<SamplingPolicy>, name: &str) -> Option<ContinuousStatus> {
    api.get(name).await.ok()?.status?.continuous
}

/// The sum of the lines of `metrics` starting with `prefix`.
fn metric(metrics: &str, prefix: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_always_on_policy_exports_every_pods_windows_without_profile_requests() {
    let started = Instant::now();
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let port = flamefleet_e2e::workload::free_port().expect("a free port");
    let collector = Collector::start(dir.path(), port);
    let mut pipeline = Pipeline::start(PipelineOptions {
        operator_args: [
            "--export-otlp-endpoint",
            &format!("http://127.0.0.1:{port}"),
            "--continuous-window=2s",
            "--continuous-period=3s",
            "--export-max-retry-time=3s",
            "--export-max-retry-delay=1s",
        ]
        .map(String::from)
        .to_vec(),
        ..Default::default()
    })
    .await;
    let tenant = TestNamespace::create("ff-always").await.unwrap();
    let other = TestNamespace::create("ff-always-other").await.unwrap();
    let pods = ["web-0", "web-1", "web-2"];
    let mut created = Vec::new();
    for (i, name) in pods.iter().enumerate() {
        created.push(
            pipeline
                .pod(&tenant, name, i % 2, &[("app", "web")], "spin", 1)
                .await,
        );
    }
    // Same labels, another namespace: a SamplingPolicy never sees it.
    pipeline
        .pod(&other, "web-x", 1, &[("app", "web")], "spin", 1)
        .await;

    let api: Api<SamplingPolicy> = tenant.api();
    api.create(
        &PostParams::default(),
        &pipeline.policy(
            "always",
            json!({
                "schedule": "@continuous",
                "template": {
                    "type": "cpu",
                    "selector": {"matchLabels": {"app": "web"}},
                    "duration": "10s",
                    "cpu": {"frequencyHz": 49},
                },
            }),
        ),
    )
    .await
    .expect("creating the always-on SamplingPolicy");
    let policy = format!("{}/always", tenant.name());
    let ready = started.elapsed();

    // Three windows of each pod reach the Collector, each with that pod's samples only.
    let first = Instant::now();
    let exported = pipeline
        .wait_for(
            "three windows of each pod at the Collector",
            TIMEOUT,
            || {
                let (collector, policy) = (&collector, policy.clone());
                async move {
                    let windows = windows_by_pod(collector, &policy);
                    pods.iter()
                        .all(|p| windows.get(*p).is_some_and(|w| w.len() >= 3))
                        .then_some(windows)
                }
            },
        )
        .await;
    let windows_after = first.elapsed();
    assert_eq!(
        exported.keys().map(String::as_str).collect::<Vec<_>>(),
        pods,
        "only the tenant's pods"
    );
    for (pod, windows) in &exported {
        for data in windows {
            assert_eq!(data.resource_profiles.len(), 1, "{pod}: one pod per window");
            let rp = &data.resource_profiles[0];
            let attrs = resource_attributes(rp);
            assert_eq!(attrs["k8s.namespace.name"], tenant.name());
            assert_eq!(attrs["k8s.pod.name"], *pod);
            // The set names each pod's running container: its samples carry its name.
            assert_eq!(
                attrs.get("k8s.container.name").map(String::as_str),
                Some("app"),
                "{attrs:?}"
            );
            assert!(!attrs.contains_key("flamefleet.request.name"), "{attrs:?}");
            let dictionary = data.dictionary.as_ref().expect("a dictionary");
            let back = flamefleet_pprof::otlp::to_pprof(&data.resource_profiles, dictionary)
                .expect("a window reads back as pprof");
            let samples = flamefleet_pprof::value_total(&back, "samples", "count").unwrap_or(0);
            assert!(samples > 0, "{pod}: a spinning pod's window has samples");
            // 49 Hz over a 2 s window: the period says the frequency.
            assert_eq!(back.period, 1_000_000_000 / 49, "{pod}");
            for s in &back.sample {
                let pod_label = s
                    .label
                    .iter()
                    .find(|l| back.string_table[l.key as usize] == "pod")
                    .map(|l| back.string_table[l.str as usize].as_str());
                assert_eq!(
                    pod_label,
                    Some(pod.as_str()),
                    "{pod}: a sample of another pod"
                );
            }
        }
    }
    for data in collector.received() {
        let attrs = resource_attributes(&data.resource_profiles[0]);
        assert_ne!(
            attrs.get("k8s.namespace.name").map(String::as_str),
            Some(other.name()),
            "the other namespace's pod was profiled"
        );
    }

    // The status: pods, nodes, windows, exports and coverage. A pod's first window loses
    // the time its node's sampler takes to load (about a second here, under load), a
    // large share of a 2 s window and a small one of the next windows': coverage rises
    // above 85% within a few windows.
    let status = pipeline
        .wait_for("the policy's status to show 85% coverage", TIMEOUT, || {
            let api = api.clone();
            async move {
                continuous_status(&api, "always")
                    .await
                    .filter(|s| s.exported >= 9 && s.min_coverage_percent.is_some_and(|c| c >= 85))
            }
        })
        .await;
    println!(
        "status {:?} after the first windows arrived ({windows_after:?} for three of each pod): {status:#?}",
        first.elapsed()
    );
    assert_eq!((status.pods, status.nodes), (3, 2), "{status:#?}");
    assert_eq!((status.window_seconds, status.period_seconds), (2, 3));
    assert!(status.windows >= status.exported, "{status:#?}");
    assert_eq!(status.dropped, 0, "{status:#?}");
    let policy_object = api.get("always").await.unwrap();
    let conditions = policy_object.status.clone().unwrap_or_default().conditions;
    let continuous = conditions
        .iter()
        .find(|c| c.type_ == "Continuous")
        .expect("a Continuous condition");
    assert_eq!(continuous.status, "True", "{continuous:?}");
    let coverage_column = policy_object
        .status
        .as_ref()
        .and_then(|s| s.coverage.as_ref())
        .map(|c| c.summary.clone());
    assert_eq!(coverage_column.as_deref(), Some("3/3 (100%)"));

    // Not one ProfileRequest, anywhere.
    let requests: Api<ProfileRequest> = Api::all(pipeline.client.clone());
    let all = requests.list(&ListParams::default()).await.unwrap();
    assert!(
        all.items.is_empty(),
        "always-on created ProfileRequests: {:?}",
        all.items.iter().map(|r| r.name_any()).collect::<Vec<_>>()
    );

    // web-0's container restarts under a new ID the API server does not know yet: its
    // windows keep coming, sampled under the pod (no container name), also from a capture
    // started after that (web-3 joins the node's set: the agent resolves every pod again,
    // and web-0's listed container cgroup is gone); once the pod's status names the new
    // container, its windows name it again.
    let web0_uid = created[0].uid().unwrap();
    let new_id = pipeline.restart_container(&web0_uid);
    pipeline
        .pod(&tenant, "web-3", 0, &[("app", "web")], "spin", 1)
        .await;
    let web3_seen = pipeline
        .wait_for("web-3's first window", TIMEOUT, || {
            let (collector, policy) = (&collector, policy.clone());
            async move {
                windows_by_pod(collector, &policy)
                    .get("web-3")
                    .is_some_and(|w| !w.is_empty())
                    .then(|| windows_by_pod(collector, &policy)["web-0"].len())
            }
        })
        .await;
    let unnamed = pipeline
        .wait_for(
            "two windows of web-0 after web-3 joined, sampled under the pod",
            TIMEOUT,
            || {
                let (collector, policy) = (&collector, policy.clone());
                async move {
                    let after: Vec<ProfilesData> = windows_by_pod(collector, &policy)["web-0"]
                        .iter()
                        .skip(web3_seen)
                        .cloned()
                        .collect();
                    (after.len() >= 2).then_some(after)
                }
            },
        )
        .await;
    for window in &unnamed {
        let attrs = resource_attributes(&window.resource_profiles[0]);
        assert!(!attrs.contains_key("k8s.container.name"), "{attrs:?}");
        let dictionary = window.dictionary.as_ref().expect("a dictionary");
        let back = flamefleet_pprof::otlp::to_pprof(&window.resource_profiles, dictionary)
            .expect("a window reads back as pprof");
        assert!(
            flamefleet_pprof::value_total(&back, "samples", "count").unwrap_or(0) > 0,
            "the restarted container is still sampled"
        );
    }
    let pods_api: Api<Pod> = tenant.api();
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    pods_api
        .patch_status(
            "web-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"containerStatuses": [{
                "name": "app", "image": "registry.invalid/flamefleet-fixture:none",
                "imageID": "", "containerID": new_id, "ready": true, "started": true,
                "restartCount": 1, "state": {"running": {"startedAt": now}},
            }]}})),
        )
        .await
        .expect("reporting the restarted container");
    let reported = windows_by_pod(&collector, &policy)["web-0"].len();
    pipeline
        .wait_for(
            "a window of web-0 naming its restarted container",
            TIMEOUT,
            || {
                let (collector, policy) = (&collector, policy.clone());
                async move {
                    windows_by_pod(collector, &policy)["web-0"]
                        .iter()
                        .skip(reported)
                        .any(|d| {
                            resource_attributes(&d.resource_profiles[0])
                                .get("k8s.container.name")
                                .is_some_and(|c| c == "app")
                        })
                        .then_some(())
                }
            },
        )
        .await;
    println!(
        "web-0's container restarted: sampled under the pod (also by a capture started after the restart) until its status named the new ID, then as app again"
    );

    // The Collector goes down: windows keep coming to the operator, exports past the retry
    // time are dropped and counted, nothing waits.
    let mut collector = collector;
    collector.proc.kill();
    let down = Instant::now();
    let before = status.windows;
    let during = pipeline
        .wait_for(
            "windows counted and exports dropped while the Collector is down",
            TIMEOUT,
            || {
                let api = api.clone();
                async move {
                    continuous_status(&api, "always")
                        .await
                        .filter(|s| s.dropped > 0 && s.windows >= before + 6)
                }
            },
        )
        .await;
    println!(
        "Collector down {:?}: windows {} (+{}), dropped {}, last error {:?}",
        down.elapsed(),
        during.windows,
        during.windows - before,
        during.dropped,
        during.last_export_error
    );
    assert!(
        !during.last_export_error.is_empty(),
        "the status says why: {during:#?}"
    );

    // Up again (writing a file of its own: the killed one may have left half a message):
    // exports resume.
    let again = dir.path().join("again");
    std::fs::create_dir_all(&again).unwrap();
    let collector = Collector::start(&again, port);
    let exported_before = during.exported;
    pipeline
        .wait_for("exports after the Collector is back", TIMEOUT, || {
            let (api, collector, policy) = (api.clone(), &collector, policy.clone());
            async move {
                let s = continuous_status(&api, "always").await?;
                (s.exported >= exported_before + 3
                    && !windows_by_pod(collector, &policy).is_empty())
                .then_some(())
            }
        })
        .await;
    let m = pipeline.operator_metrics().await;
    assert_eq!(
        metric(
            &m,
            "flamefleet_operator_continuous_windows_total{outcome=\"NotAsked\"}"
        ),
        0,
        "{m}"
    );
    for port in pipeline.agent_probe_ports.clone() {
        let m = metrics_at(port).await;
        assert_eq!(
            metric(&m, "flamefleet_agent_continuous_profiles_dropped_total"),
            0,
            "the agents dropped windows: {m}"
        );
    }

    // Deleted: the nodes stop.
    api.delete("always", &DeleteParams::default())
        .await
        .unwrap();
    let ports = pipeline.agent_probe_ports.clone();
    pipeline
        .wait_for("the agents to stop profiling", TIMEOUT, || {
            let ports = ports.clone();
            async move {
                for port in ports {
                    let m = metrics_at(port).await;
                    if metric(&m, "flamefleet_agent_continuous_pods ") != 0 {
                        return None;
                    }
                }
                Some(())
            }
        })
        .await;
    println!(
        "pipeline_continuous: ready {ready:?}, total {:?}",
        started.elapsed()
    );
}
