//! Triggered heap profiles before the OOM kill, on a real Kubernetes node: the one-node
//! cluster of `scripts/cluster.sh` (kubelet, containerd + runc), the images built in this run,
//! the chart installed with `helm`, as `real_node.rs` does.
//!
//! A Go Deployment (examples/demo-workload/orders, five replicas) whose heap grows from one
//! function, `main.hoardOrders`, 1 MiB every 20 ms once asked to, until its container's
//! 128 MiB memory limit gets it OOM-killed. A trigger-only SamplingPolicy fires at 60% of the
//! limit; the agent reads the Go heap at the fire and the run the operator creates takes that
//! heap as its artifact. Five times, one pod after the other: each run's status says which
//! trigger fired at what value, the kubelet reports the container OOMKilled, and the profile
//! names `main.hoardOrders` with ≥ 80% of `inuse_space` when the heap was read before the
//! kill. The test prints in how many of the five the heap was read before the process died
//! (and fails below 4 of 5).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use flamefleet_api::policy_runs::POLICY_UID_LABEL;
use flamefleet_api::trigger::{TRIGGER_FIRE_ANNOTATION, TRIGGER_POD_UID_LABEL};
use flamefleet_api::{ProfileRequest, RequestPhase, SamplingPolicy};
use flamefleet_e2e::Cluster;
use flamefleet_e2e::cluster::kubectl_profile_binary;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

const RELEASE: &str = "flamefleet";
const NAMESPACE: &str = "flamefleet-system";
const STORE_NODE_PORT: u16 = 30808;
const TIMEOUT: Duration = Duration::from_secs(180);
const REPLICAS: usize = 5;
/// Label of the namespaces this test creates (an interrupted run's are deleted first).
const E2E_LABEL: &str = "flamefleet.dev/e2e";

fn step(what: &str) {
    eprintln!("\n=== {what}");
}

/// Deletes the test's namespace (without waiting) when the test ends, passing or failing.
struct DeleteOnDrop<'a> {
    cluster: &'a Cluster,
    namespace: String,
}

impl Drop for DeleteOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self
            .cluster
            .kubectl(&["delete", "namespace", &self.namespace, "--wait=false"]);
    }
}

/// `kubectl profile get NAME -n NS -o DIR --format pprof`: the one pprof it writes.
fn download(cluster: &Cluster, ns: &str, name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(kubectl_profile_binary().expect("building kubectl-profile"))
        .args(["get", name, "-n", ns, "--format", "pprof", "-o"])
        .arg(dir.path())
        .env("KUBECONFIG", &cluster.kubeconfig)
        .output()
        .expect("running kubectl-profile");
    assert!(
        out.status.success(),
        "kubectl profile get {name}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let files: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".pb.gz"))
        .collect();
    assert_eq!(files.len(), 1, "one pprof: {files:?}");
    let file = files[0].clone();
    (dir, file)
}

/// The `cum%` of `function` in `go tool pprof -top -cum -sample_index=inuse_space`.
fn inuse_cum_percent(file: &Path, function: &str) -> (f64, String) {
    let out = Command::new("go")
        .args(["tool", "pprof", "-top", "-cum", "-sample_index=inuse_space"])
        .arg(file)
        .output()
        .expect("running go tool pprof (install Go)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let top = String::from_utf8_lossy(&out.stdout).into_owned();
    let share = top
        .lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() >= 6 && cols[5..].join(" ") == function).then(|| cols[4])
        })
        .find_map(|c| c.trim_end_matches('%').parse().ok())
        .unwrap_or(0.0);
    (share, top)
}

/// The reason the kubelet gives for the container's last termination, if any.
fn last_termination(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .last_state
        .as_ref()?
        .terminated
        .as_ref()?
        .reason
        .clone()
}

/// One pod's round: what fired, how the heap went, what the profile shows.
struct Round {
    pod: String,
    run: String,
    reason: String,
    heap_at_fire: String,
    share: f64,
    read_before_kill: bool,
    took: Duration,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_trigger_reads_the_go_heap_before_the_oom_kill_on_a_real_node() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the real-node tests run a kubelet and containerd: run as root (scripts/test.sh)"
    );
    let started = Instant::now();
    let cluster = Cluster::shared().expect("the one-node cluster (scripts/cluster.sh up)");
    let client = cluster.client().await.unwrap();

    step("build the images and install the chart");
    let _ = cluster.kubectl(&[
        "delete",
        "namespace",
        "-l",
        &format!("{E2E_LABEL}=real-node-triggers"),
        "--wait=false",
    ]);
    cluster
        .uninstall_flamefleet(RELEASE, NAMESPACE, true)
        .expect("helm uninstall of a leftover release");
    let tag = cluster
        .build_images(None, None)
        .expect("building the images");
    cluster
        .install_flamefleet(
            RELEASE,
            NAMESPACE,
            &cluster.local_values(&tag, STORE_NODE_PORT),
        )
        .expect("helm install");
    let installed = started.elapsed();

    step("a trigger-only policy and a Go Deployment that grows until its limit");
    let ns = format!("oom-{}", std::process::id());
    cluster.kubectl(&["create", "namespace", &ns]).unwrap();
    let _guard = DeleteOnDrop {
        cluster,
        namespace: ns.clone(),
    };
    cluster
        .kubectl(&[
            "label",
            "namespace",
            &ns,
            &format!("{E2E_LABEL}=real-node-triggers"),
        ])
        .unwrap();
    let policies: Api<SamplingPolicy> = Api::namespaced(client.clone(), &ns);
    let policy: SamplingPolicy = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "SamplingPolicy",
        "metadata": {"name": "orders-oom"},
        "spec": {
            "schedule": "@yearly",
            "template": {
                "type": "heap",
                "selector": {"matchLabels": {"app": "orders"}},
                "duration": "5s",
                "heap": {"source": "goruntime"},
            },
            // Five runs within a minute: the policy's own pace, not the node's budget.
            "budget": {"maxConcurrentCapturesPerNode": 4},
            "triggers": [{
                "name": "near-limit",
                "memory": {"aboveLimitPercent": 60},
                "cooldownSeconds": 600,
                "policyCooldownSeconds": 1,
            }],
        },
    }))
    .unwrap();
    let policy = policies
        .create(&PostParams::default(), &policy)
        .await
        .expect("creating the SamplingPolicy");
    let policy_uid = policy.uid().unwrap();
    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "orders", "namespace": ns},
        "spec": {
            "replicas": REPLICAS,
            "selector": {"matchLabels": {"app": "orders"}},
            "template": {
                "metadata": {"labels": {"app": "orders"}},
                "spec": {"containers": [{
                    "name": "orders",
                    "image": format!("flamefleet.local/orders-demo:{tag}"),
                    "imagePullPolicy": "Never",
                    "readinessProbe": {
                        "httpGet": {"path": "/healthz", "port": 8080},
                        "periodSeconds": 1,
                    },
                    "resources": {
                        "requests": {"cpu": "50m", "memory": "32Mi"},
                        "limits": {"cpu": "500m", "memory": "128Mi"},
                    },
                }]},
            },
        },
    });
    let file = std::env::temp_dir().join(format!("{ns}-orders.json"));
    std::fs::write(&file, deployment.to_string()).unwrap();
    cluster
        .kubectl(&["apply", "-f", file.to_str().unwrap()])
        .unwrap();
    cluster
        .kubectl(&[
            "-n",
            &ns,
            "rollout",
            "status",
            "deploy/orders",
            "--timeout=120s",
        ])
        .unwrap();
    // The agent watches every replica before any grows.
    cluster
        .wait_for("the agent to watch the five pods", TIMEOUT, || {
            let policies = policies.clone();
            async move {
                let t = policies.get("orders-oom").await.ok()?.status?.triggers;
                t.first()
                    .is_some_and(|t| t.watched_pods == REPLICAS as i64)
                    .then_some(())
            }
        })
        .await
        .unwrap();
    let watching = started.elapsed();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let list = pods
        .list(&ListParams::default().labels("app=orders"))
        .await
        .unwrap()
        .items;
    assert_eq!(list.len(), REPLICAS);

    let requests: Api<ProfileRequest> = Api::namespaced(client.clone(), &ns);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut rounds = Vec::new();
    for pod in &list {
        let round_started = Instant::now();
        let name = pod.name_any();
        let uid = pod.uid().unwrap();
        step(&format!("{name}: grow until the OOM kill"));
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .expect("a pod IP");
        let answer = http
            .post(format!("http://{ip}:8080/leak?pause=20ms"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .unwrap_or_else(|e| panic!("POST /leak to {name} at {ip}: {e}"));
        eprintln!("{name}: {}", answer.text().await.unwrap_or_default().trim());
        // The run of this pod's fire, finished.
        let run = ended_triggered_run(
            cluster,
            &requests,
            &format!("{TRIGGER_POD_UID_LABEL}={uid}"),
            &format!("the triggered run of {name}"),
        )
        .await;
        let owner = &run.owner_references()[0];
        assert_eq!(owner.uid, policy_uid, "the run is the policy's");
        // The kubelet reports the container OOM-killed.
        cluster
            .wait_for(&format!("{name} to be OOM-killed"), TIMEOUT, || {
                let (pods, name) = (pods.clone(), name.clone());
                async move {
                    let pod = pods.get(&name).await.ok()?;
                    (last_termination(&pod).as_deref() == Some("OOMKilled")).then_some(())
                }
            })
            .await
            .unwrap();
        let status = run.status.clone().unwrap();
        let trigger = status.trigger.clone().unwrap();
        assert_eq!(trigger.name, "near-limit");
        assert_eq!(trigger.pod, name);
        assert_eq!(trigger.node, cluster.node);
        assert_eq!(
            (trigger.threshold.as_str(), trigger.unit.as_str()),
            ("60.0", "%")
        );
        let measured: f64 = trigger.measured.parse().expect("a measured number");
        assert!((60.0..=100.0).contains(&measured), "{trigger:#?}");
        assert_eq!(status.phase, Some(RequestPhase::Succeeded), "{status:#?}");
        let from_fire = status.summary.as_ref().is_some_and(|s| {
            s.notes
                .iter()
                .any(|n| n.starts_with("heap read on the node at the trigger's fire"))
        });
        let read_before_kill = trigger.heap_at_fire.starts_with("read on the node ")
            && run.annotations().contains_key(TRIGGER_FIRE_ANNOTATION)
            && from_fire;
        let (_dir, file) = download(cluster, &ns, &run.name_any());
        let (share, top) = inuse_cum_percent(&file, "main.hoardOrders");
        if read_before_kill {
            assert!(
                share >= 80.0,
                "{name}: main.hoardOrders holds {share}% of inuse_space in the heap read at the \
                 fire, expected ≥ 80%:\n{top}"
            );
        }
        let round = Round {
            pod: name,
            run: run.name_any(),
            reason: trigger.reason.clone(),
            heap_at_fire: trigger.heap_at_fire.clone(),
            share,
            read_before_kill,
            took: round_started.elapsed(),
        };
        eprintln!(
            "{}: run {} ({}); heap at fire: {}; main.hoardOrders {:.1}% of inuse_space; round \
             {:.1} s",
            round.pod,
            round.run,
            round.reason,
            round.heap_at_fire,
            round.share,
            round.took.as_secs_f64()
        );
        rounds.push(round);
    }
    let wins = rounds.iter().filter(|r| r.read_before_kill).count();
    eprintln!(
        "real node: the Go heap was read before the OOM kill in {wins} of {REPLICAS} pods \
         (main.hoardOrders {} % of inuse_space); chart installed at {:.1} s, the five watched \
         at {:.1} s, test took {:.1} s",
        rounds
            .iter()
            .map(|r| format!("{:.1}", r.share))
            .collect::<Vec<_>>()
            .join("/"),
        installed.as_secs_f64(),
        watching.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        wins * 5 >= REPLICAS * 4,
        "the heap was read before the OOM kill in only {wins} of {REPLICAS} pods"
    );

    step("a C workload throttled by a CPU limit of 0.2 cores: its CPU fire's lead-up");
    let lead_up_started = Instant::now();
    cpu_fire_with_its_lead_up(cluster, &client, &ns, &tag).await;
    eprintln!(
        "real node: the CPU lead-up case took {:.1} s; test took {:.1} s",
        lead_up_started.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    step("the same pod's threads outnumber its CPU quota: the runqlat p99 trigger");
    let runqlat_started = Instant::now();
    runqlat_fire(cluster, &client, &ns).await;
    eprintln!(
        "real node: the runqlat case took {:.1} s; test took {:.1} s",
        runqlat_started.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    cluster
        .uninstall_flamefleet(RELEASE, NAMESPACE, false)
        .expect("helm uninstall");
}

/// The latency trigger on the real node: the checkout pod of the lead-up case runs more
/// threads than this machine has CPUs under a limit of 200 millicores, so its threads wait
/// on the run queue while its cgroup is throttled. A trigger-only policy whose trigger fires
/// when the pod's runqlat p99 stays above 20 ms over 2 s: the run it creates says the
/// measured p99 in `status.trigger`, and the run's own runqlat capture measures a p99 above
/// the threshold too.
async fn runqlat_fire(cluster: &Cluster, client: &kube::Client, ns: &str) {
    const THRESHOLD_US: i64 = 20_000;
    let policies: Api<SamplingPolicy> = Api::namespaced(client.clone(), ns);
    let policy: SamplingPolicy = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "SamplingPolicy",
        "metadata": {"name": "checkout-runq"},
        "spec": {
            "template": {
                "type": "runqlat",
                "selector": {"matchLabels": {"app": "checkout"}},
                "duration": "3s",
            },
            "triggers": [{
                "name": "waiting-to-run",
                "latency": {"runqlatP99Micros": THRESHOLD_US, "windowSeconds": 2},
                "capture": {"duration": "3s"},
                "cooldownSeconds": 600,
            }],
        },
    }))
    .unwrap();
    let policy = policies
        .create(&PostParams::default(), &policy)
        .await
        .expect("creating the SamplingPolicy");
    let policy_uid = policy.uid().unwrap();
    let requests: Api<ProfileRequest> = Api::namespaced(client.clone(), ns);
    let run = ended_triggered_run(
        cluster,
        &requests,
        &format!("{POLICY_UID_LABEL}={policy_uid}"),
        "the runqlat fire's run",
    )
    .await;
    let status = run.status.clone().unwrap();
    let trigger = status.trigger.clone().unwrap();
    eprintln!("status.trigger: {trigger:#?}");
    assert_eq!(trigger.name, "waiting-to-run");
    assert_eq!(trigger.unit, "µs");
    let measured: f64 = trigger.measured.parse().expect("a measured number");
    assert!(
        measured > THRESHOLD_US as f64,
        "measured p99 {measured} µs, expected above {THRESHOLD_US}: {trigger:#?}"
    );
    assert!(
        trigger.reason.starts_with(&format!(
            "waiting-to-run: runqlat p99 above {THRESHOLD_US}µs over 2s (measured "
        )),
        "{}",
        trigger.reason
    );
    assert_eq!(run.spec.profile_type, flamefleet_api::ProfileType::Runqlat);
    assert_eq!(status.phase, Some(RequestPhase::Succeeded), "{status:#?}");
    let latency = status
        .summary
        .as_ref()
        .and_then(|s| s.runqlat.clone())
        .expect("runqlat percentiles in the run's summary");
    eprintln!(
        "real node, runqlat trigger: run {} ({}); its capture: {latency:?}",
        run.name_any(),
        trigger.reason
    );
    assert!(
        latency.p99_us > THRESHOLD_US,
        "the capture's p99 {} µs is not above the trigger's {THRESHOLD_US} µs: {latency:?}",
        latency.p99_us
    );
    let runs = requests
        .list(&ListParams::default().labels(&format!("{POLICY_UID_LABEL}={policy_uid}")))
        .await
        .expect("listing the policy's runs")
        .items;
    assert_eq!(runs.len(), 1, "one fire, one run, within the cooldown");
}

/// The lead-up on the real node (docs/triggers.md, "The lead-up"): the demo's C checkout
/// service (examples/demo-workload/checkout.c, `price_basket()` its hot function) under a
/// CPU limit of 0.2 cores, throttled all the time, and a policy whose trigger fires when its
/// usage stays above 150m for 8 s. The agent's ring keeps the pod's samples from the moment
/// it is watched; the CPU run the fire starts prepends those before the fire: the profile
/// names `price_basket` and covers at least 5 s before the fire.
async fn cpu_fire_with_its_lead_up(cluster: &Cluster, client: &kube::Client, ns: &str, tag: &str) {
    let policies: Api<SamplingPolicy> = Api::namespaced(client.clone(), ns);
    let policy: SamplingPolicy = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "SamplingPolicy",
        "metadata": {"name": "checkout-cpu"},
        "spec": {
            "template": {
                "type": "cpu",
                "selector": {"matchLabels": {"app": "checkout"}},
                "duration": "3s",
            },
            "triggers": [{
                "name": "busy",
                "cpu": {"aboveMillicores": 150, "forSeconds": 8},
                "capture": {"duration": "3s"},
                "cooldownSeconds": 600,
            }],
        },
    }))
    .unwrap();
    let policy = policies
        .create(&PostParams::default(), &policy)
        .await
        .expect("creating the SamplingPolicy");
    let policy_uid = policy.uid().unwrap();
    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "checkout", "namespace": ns},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "checkout"}},
            "template": {
                "metadata": {"labels": {"app": "checkout"}},
                "spec": {"containers": [{
                    "name": "checkout",
                    "image": format!("flamefleet.local/checkout-demo:{tag}"),
                    "imagePullPolicy": "Never",
                    "resources": {
                        "requests": {"cpu": "200m", "memory": "96Mi"},
                        "limits": {"cpu": "200m", "memory": "256Mi"},
                    },
                }]},
            },
        },
    });
    let file = std::env::temp_dir().join(format!("{ns}-checkout.json"));
    std::fs::write(&file, deployment.to_string()).unwrap();
    cluster
        .kubectl(&["apply", "-f", file.to_str().unwrap()])
        .unwrap();
    let requests: Api<ProfileRequest> = Api::namespaced(client.clone(), ns);
    let run = ended_triggered_run(
        cluster,
        &requests,
        &format!("{POLICY_UID_LABEL}={policy_uid}"),
        "the CPU fire's run",
    )
    .await;
    let status = run.status.clone().unwrap();
    let trigger = status.trigger.clone().unwrap();
    assert_eq!(trigger.name, "busy");
    assert_eq!(status.phase, Some(RequestPhase::Succeeded), "{status:#?}");
    assert_eq!(run.spec.profile_type, flamefleet_api::ProfileType::Cpu);
    assert!(
        run.annotations().contains_key(TRIGGER_FIRE_ANNOTATION),
        "the CPU run names the fire whose lead-up the node kept: {:?}",
        run.annotations()
    );
    let notes = status
        .summary
        .as_ref()
        .map(|s| s.notes.clone())
        .unwrap_or_default();
    assert!(
        notes.iter().any(|n| n.starts_with("lead-up: ")),
        "the run starts with the lead-up: {notes:?}"
    );
    let (_dir, file) = download(cluster, ns, &run.name_any());
    let f = flamefleet_e2e::lead_up::figures(&file, "price_basket");
    eprintln!(
        "real node, CPU lead-up: run {} ({}); lead-up {} samples reaching {:.1} s before the \
         fire, price_basket on {:.1}% of them ({:.1}% their leaf); {} samples after the fire; \
         {notes:?}",
        run.name_any(),
        trigger.reason,
        f.lead_up,
        f.oldest_ms as f64 / 1e3,
        f.share(),
        f.leaf_share(),
        f.after_fire
    );
    assert_eq!(f.unlabelled, 0, "every sample says its phase: {f:?}");
    assert!(
        f.oldest_ms >= 5_000,
        "the profile covers at least 5 s before the fire: {f:?}"
    );
    assert_eq!(
        f.top_leaf.as_deref(),
        Some("price_basket"),
        "the lead-up's hottest function: {f:?}"
    );
    assert!(f.after_fire > 0, "the capture's own samples follow: {f:?}");
}

/// The first run `selector` (labels) selects with `status.trigger`, once it has ended.
async fn ended_triggered_run(
    cluster: &Cluster,
    requests: &Api<ProfileRequest>,
    selector: &str,
    what: &str,
) -> ProfileRequest {
    cluster
        .wait_for(&format!("{what} to finish"), TIMEOUT, || {
            let (requests, selector) = (requests.clone(), selector.to_owned());
            async move {
                requests
                    .list(&ListParams::default().labels(&selector))
                    .await
                    .ok()?
                    .items
                    .into_iter()
                    .find(|r| {
                        r.status.as_ref().is_some_and(|s| {
                            s.trigger.is_some() && s.phase.is_some_and(|p| p.is_terminal())
                        })
                    })
            }
        })
        .await
        .unwrap()
}
