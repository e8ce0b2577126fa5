//! End to end, triggered captures: a SamplingPolicy's memory trigger on the real control
//! plane, with real agents watching real cgroups with real memory limits. A process that
//! grows its memory past the trigger's share of its pod's limit makes the agent fire; the
//! operator creates a heap ProfileRequest for that pod only, with the trigger's reason and
//! measured value in its status and an Event on the pod; the profile downloads and names the
//! growing function. The condition keeps crossing (the process frees and grows again every
//! second): the agent's cooldown holds it to one run, and when the agent restarts (its
//! cooldowns lost) the operator's own cooldown turns the next fire down. A pod of another namespace that grows past
//! the same share (and matches the policy's selector and podNames) is never watched and
//! never captured.
//!
//! A Go program leaking from one function until its pod's memory limit OOM-kills it: the
//! agent reads its heap at the fire, and that heap (not one read when the run starts) is the
//! run's artifact.

mod pipeline_support;

use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use flamefleet_api::trigger::{TRIGGER_FIRE_ANNOTATION, TRIGGER_LABEL, TRIGGER_POD_UID_LABEL};
use flamefleet_api::{ProfileRequest, RequestPhase, SamplingPolicy};
use flamefleet_e2e::TestNamespace;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use pipeline_support::{
    Pipeline, PipelineOptions, artifacts_of, kubectl_profile, metrics_at, serial,
};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(120);
const MIB: u64 = 1024 * 1024;
/// The pods' memory limit, and how far the workload grows (69% of it) every second.
const LIMIT: u64 = 64 * MIB;
const GROW_MIB: &str = "44";

/// The value of an unlabelled metric in a /metrics text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The requests of policy `uid` in `ns`.
async fn runs(ns: &TestNamespace, uid: &str) -> Vec<ProfileRequest> {
    let api: Api<ProfileRequest> = ns.api();
    api.list(&ListParams::default().labels(&format!("flamefleet.dev/policy-uid={uid}")))
        .await
        .expect("listing runs")
        .items
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_trigger_captures_the_growing_pod_once_per_cooldown_and_only_its_own_namespace() {
    let started = Instant::now();
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        // The workload is nearly all allocator calls while it grows: the cluster admin lifts
        // the heap overhead guard's ceiling, the template turns the guard off.
        operator_args: vec!["--max-heap-overhead-percent=0".into()],
        ..PipelineOptions::default()
    })
    .await;
    let tenant = TestNamespace::create("ff-trig-a").await.unwrap();
    let other = TestNamespace::create("ff-trig-b").await.unwrap();
    let leaky = pipeline
        .memory_limited_pod(
            &tenant,
            "leaky",
            0,
            &[("app", "leaky")],
            LIMIT,
            &["grow", GROW_MIB],
        )
        .await;
    // Another namespace's pod: same labels, the name the policy lists, the same growth.
    let victim = pipeline
        .memory_limited_pod(
            &other,
            "victim",
            0,
            &[("app", "leaky")],
            LIMIT,
            &["grow", GROW_MIB],
        )
        .await;

    let api: Api<SamplingPolicy> = tenant.api();
    let policy = api
        .create(
            &PostParams::default(),
            &pipeline.policy(
                "oom-watch",
                json!({
                    // No scheduled run in the test's lifetime: only the trigger captures.
                    "schedule": "@yearly",
                    "template": {
                        "type": "heap",
                        "selector": {"matchLabels": {"app": "leaky"}},
                        "podNames": ["victim"],
                        "duration": "3s",
                        "heap": {"source": "ebpf", "maxOverheadPercent": 0},
                    },
                    "budget": {"maxConcurrentCapturesPerNode": 4},
                    "triggers": [{
                        "name": "near-limit",
                        "memory": {"aboveLimitPercent": 50},
                        "capture": {"duration": "3s"},
                        "cooldownSeconds": 600,
                    }],
                }),
            ),
        )
        .await
        .expect("creating the SamplingPolicy");
    let uid = policy.uid().unwrap();
    let ready = started.elapsed();

    // The fire becomes a heap run of the growing pod, with what fired in its status.
    let fired: ProfileRequest = pipeline
        .wait_for("a triggered run with status.trigger", TIMEOUT, || {
            let (tenant, uid) = (&tenant, uid.clone());
            async move {
                runs(tenant, &uid)
                    .await
                    .into_iter()
                    .find(|r| r.status.as_ref().is_some_and(|s| s.trigger.is_some()))
            }
        })
        .await;
    let fire_seen = started.elapsed();
    let trigger = fired.status.clone().unwrap().trigger.unwrap();
    assert_eq!(trigger.name, "near-limit");
    assert_eq!(trigger.pod, "leaky");
    assert_eq!(trigger.node, pipeline.nodes[0]);
    assert_eq!(trigger.unit, "%");
    assert_eq!(trigger.threshold, "50.0");
    let measured: f64 = trigger.measured.parse().expect("a measured number");
    assert!(
        (50.0..=100.0).contains(&measured),
        "measured {measured}% of the limit, expected at least the 50% threshold: {trigger:#?}"
    );
    assert!(
        trigger
            .reason
            .starts_with("near-limit: memory above 50% of limit (measured "),
        "{}",
        trigger.reason
    );
    assert_eq!(fired.spec.profile_type, flamefleet_api::ProfileType::Heap);
    assert_eq!(fired.spec.pod_names, ["leaky"]);
    assert_eq!(fired.spec.selector, None);
    let labels = fired.labels();
    assert_eq!(labels[TRIGGER_LABEL], "near-limit");
    assert_eq!(labels[TRIGGER_POD_UID_LABEL], leaky.uid().unwrap());
    let owner = &fired.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("SamplingPolicy", uid.as_str(), Some(true))
    );

    // It is captured like any request, and its profile names the growing function.
    let name = fired.name_any();
    let done: ProfileRequest = pipeline
        .wait_for("the triggered run to finish", TIMEOUT, || {
            let api: Api<ProfileRequest> = tenant.api();
            let name = name.clone();
            async move {
                let r = api.get(&name).await.ok()?;
                let phase = r.status.as_ref()?.phase?;
                phase.is_terminal().then_some(r)
            }
        })
        .await;
    let captured_at = started.elapsed();
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Succeeded),
        "{status:#?}\n{}\n{}",
        pipeline.operator_logs(),
        pipeline.agent_logs()
    );
    assert_eq!(
        status.trigger.as_ref().map(|t| t.measured.as_str()),
        Some(trigger.measured.as_str()),
        "status.trigger survives the capture's status writes"
    );
    let artifacts = artifacts_of(&pipeline.client, &done).await;
    assert_eq!(artifacts.len(), 1, "{artifacts:#?}");
    let file = pipeline.download(&done, &artifacts[0]).await;
    let out = std::process::Command::new("go")
        .args(["tool", "pprof", "-top", "-sample_index=alloc_space"])
        .arg(&file)
        .output()
        .expect("running `go tool pprof` (install Go)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let top = String::from_utf8_lossy(&out.stdout);
    assert!(top.contains("grow_memory"), "{top}");

    // An Event on the pod says why it was profiled.
    let events: Api<Event> = tenant.api();
    let event = pipeline
        .wait_for("the ProfileTriggered Event on the pod", TIMEOUT, || {
            let events = events.clone();
            async move {
                events
                    .list(&Default::default())
                    .await
                    .ok()?
                    .items
                    .into_iter()
                    .find(|e| {
                        e.reason.as_deref() == Some("ProfileTriggered")
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("leaky")
                    })
            }
        })
        .await;
    let note = event.note.unwrap_or_default();
    assert!(
        note.contains(&name) && note.contains("near-limit"),
        "{note}"
    );

    // Cooldown: the usage keeps crossing the threshold every second; the agent holds the
    // crossings back (its counter says it saw them), and nothing more is created.
    let probe_port = pipeline.agent_probe_ports[0];
    let metrics = pipeline
        .wait_for(
            "the agent to hold back a crossing in the cooldown",
            TIMEOUT,
            || async move {
                let text = metrics_at(probe_port).await;
                (metric(&text, "flamefleet_agent_trigger_held_back_total")? >= 2.0).then_some(text)
            },
        )
        .await;
    assert_eq!(
        metric(&metrics, "flamefleet_agent_trigger_fires_total"),
        Some(1.0),
        "{metrics}"
    );
    // Only the tenant's pod is watched: the other namespace's pod is no target, whatever
    // the policy's selector and podNames say.
    assert_eq!(
        metric(&metrics, "flamefleet_agent_trigger_watched_cgroups"),
        Some(1.0),
        "{metrics}"
    );
    let held_at = started.elapsed();
    let all = runs(&tenant, &uid).await;
    assert_eq!(
        all.iter().map(|r| r.name_any()).collect::<Vec<_>>(),
        std::slice::from_ref(&name),
        "one run per cooldown"
    );
    let status = pipeline
        .wait_for("status.triggers to count the fire", TIMEOUT, || {
            let api = api.clone();
            async move {
                let s = api.get("oom-watch").await.ok()?.status?;
                let t = s.triggers.into_iter().find(|t| t.name == "near-limit")?;
                (t.fires == 1 && t.watched_pods == 1).then_some(t)
            }
        })
        .await;
    assert_eq!(
        status.last_run.as_ref().map(|r| r.name.as_str()),
        Some(name.as_str())
    );

    // The agent restarts, its cooldowns with it (as a compromised or crashing node would):
    // the next crossing fires again, and the operator's own cooldown turns it down.
    pipeline.restart_agent(0);
    let held = pipeline
        .wait_for(
            "the operator to turn down a fire within the cooldown",
            TIMEOUT,
            || {
                let api = api.clone();
                async move {
                    let s = api.get("oom-watch").await.ok()?.status?;
                    let t = s.triggers.into_iter().find(|t| t.name == "near-limit")?;
                    (t.skipped >= 1).then_some(t)
                }
            },
        )
        .await;
    let operator_held_at = started.elapsed();
    assert!(
        held.last_skip_reason.starts_with("Cooldown: pod ") && held.fires == 1,
        "{held:#?}"
    );
    let metrics = pipeline.operator_metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("flamefleet_operator_trigger_fires_total{outcome=\"Cooldown\"}")),
        "{metrics}"
    );
    assert_eq!(runs(&tenant, &uid).await.len(), 1, "one run per cooldown");

    // The other namespace's pod did cross the threshold (its kernel counter), and nothing
    // captured it.
    let victim_uid = victim.uid().unwrap();
    let max_usage = max_memory_usage(&pipeline, &victim_uid);
    assert!(
        max_usage > LIMIT / 2,
        "the other namespace's pod peaked at {max_usage} bytes, below the threshold"
    );
    let other_requests: Api<ProfileRequest> = other.api();
    let captured = other_requests
        .list(&Default::default())
        .await
        .unwrap()
        .items;
    assert!(captured.is_empty(), "{captured:#?}");
    assert!(
        runs(&tenant, &uid)
            .await
            .iter()
            .all(|r| r.labels().get(TRIGGER_POD_UID_LABEL) != Some(&victim_uid)),
        "a run of the other namespace's pod"
    );
    eprintln!(
        "triggers e2e: policy created at {:.1}s (fixture start, binaries built), fire seen \
         {:.1}s later, run finished at +{:.1}s, crossings held back by the agent at +{:.1}s, \
         by the operator after the agent's restart at +{:.1}s, test took {:.1}s",
        ready.as_secs_f64(),
        (fire_seen - ready).as_secs_f64(),
        (captured_at - ready).as_secs_f64(),
        (held_at - ready).as_secs_f64(),
        (operator_held_at - ready).as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}

/// The highest memory usage the kernel recorded for a pod's cgroup of the fixture (v1
/// `memory.max_usage_in_bytes` on a hybrid host, v2 `memory.peak`).
fn max_memory_usage(pipeline: &Pipeline, pod_uid: &str) -> u64 {
    let rel = format!("kubepods/burstable/pod{pod_uid}");
    let v2 = pipeline.cgroup_root.join(&rel).join("memory.peak");
    let file = if v2.exists() {
        v2
    } else {
        pipeline
            .v1_memory_root()
            .join(&rel)
            .join("memory.max_usage_in_bytes")
    };
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// The Go leak of the agent's trigger tests (node-agent/tests/heap_workloads/gooom): 1 MiB
/// more kept alive by `main.hoardOrders` every PAUSE until the OOM kill.
fn go_leak() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let src =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../node-agent/tests/heap_workloads/gooom");
        let dir = std::env::temp_dir().join(format!("flamefleet-e2e-gooom-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("creating the Go leak's directory");
        let bin = dir.join("gooom");
        let out = Command::new("go")
            .args(["build", "-o"])
            .arg(&bin)
            .arg(".")
            .current_dir(&src)
            .env("CGO_ENABLED", "0")
            .env("GOFLAGS", "-mod=mod")
            .env("GOTOOLCHAIN", "local")
            .output()
            .expect("running `go build` (install Go)");
        assert!(
            out.status.success(),
            "go build of {}: {}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        bin
    })
}

/// The share of `inuse_space` under `function`, by `go tool pprof -top -cum`.
fn inuse_cum_percent(file: &Path, function: &str) -> (f64, String) {
    let out = Command::new("go")
        .args(["tool", "pprof", "-top", "-cum", "-sample_index=inuse_space"])
        .arg(file)
        .output()
        .expect("running `go tool pprof` (install Go)");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_fire_hands_the_heap_it_read_to_its_run_even_after_the_oom_kill() {
    let started = Instant::now();
    let _serial = serial().await;
    let leak = go_leak().clone();
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        ..PipelineOptions::default()
    })
    .await;
    let ns = TestNamespace::create("ff-trig-go").await.unwrap();
    // The policy first: the leak grows from its start.
    let api: Api<SamplingPolicy> = ns.api();
    let policy = api
        .create(
            &PostParams::default(),
            &pipeline.policy(
                "go-oom",
                json!({
                    "schedule": "@yearly",
                    "template": {
                        "type": "heap",
                        "selector": {"matchLabels": {"app": "hoarder"}},
                        "duration": "3s",
                        "heap": {"source": "goruntime"},
                    },
                    "triggers": [{"name": "near-limit", "memory": {"aboveLimitPercent": 60}}],
                }),
            ),
        )
        .await
        .expect("creating the SamplingPolicy");
    let uid = policy.uid().unwrap();
    // 1 MiB every 100 ms into 128 MiB: the trigger's 60% after ~7 s (the watch set reaches
    // the agent within ~2 s of the pod), the OOM kill ~5 s later.
    let pod = pipeline
        .memory_limited_pod_running(
            &ns,
            "hoarder",
            0,
            &[("app", "hoarder")],
            128 * MIB,
            &leak,
            &["100ms"],
        )
        .await;
    let pod_uid = pod.uid().unwrap();
    let ready = started.elapsed();

    let fired: ProfileRequest = pipeline
        .wait_for("a triggered run with status.trigger", TIMEOUT, || {
            let (ns, uid) = (&ns, uid.clone());
            async move {
                runs(ns, &uid)
                    .await
                    .into_iter()
                    .find(|r| r.status.as_ref().is_some_and(|s| s.trigger.is_some()))
            }
        })
        .await;
    let fire_seen = started.elapsed();
    let trigger = fired.status.clone().unwrap().trigger.unwrap();
    assert!(
        trigger.heap_at_fire.starts_with("read on the node "),
        "the agent read the heap at the fire: {trigger:#?}\n{}",
        pipeline.agent_logs()
    );
    let fire_id = fired.annotations().get(TRIGGER_FIRE_ANNOTATION).cloned();
    assert!(
        fire_id.as_ref().is_some_and(|id| id.len() == 32),
        "the run names the fire: {:?}",
        fired.annotations()
    );

    // The leak dies by the OOM killer (SIGKILL), whenever the run captures.
    let deadline = Instant::now() + TIMEOUT;
    let exit = loop {
        if let Some(exit) = pipeline.workload_exit(&pod_uid) {
            break exit;
        }
        assert!(
            Instant::now() < deadline,
            "the leak still runs after {TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let killed_at = started.elapsed();
    assert_eq!(
        exit.signal(),
        Some(libc::SIGKILL),
        "the OOM killer ends the leak: {exit:?}"
    );
    let name = fired.name_any();
    let done: ProfileRequest = pipeline
        .wait_for("the triggered run to finish", TIMEOUT, || {
            let api: Api<ProfileRequest> = ns.api();
            let name = name.clone();
            async move {
                let r = api.get(&name).await.ok()?;
                let phase = r.status.as_ref()?.phase?;
                phase.is_terminal().then_some(r)
            }
        })
        .await;
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Succeeded),
        "{status:#?}\n{}\n{}",
        pipeline.operator_logs(),
        pipeline.agent_logs()
    );
    let notes = status
        .summary
        .as_ref()
        .map(|s| s.notes.clone())
        .unwrap_or_default();
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("heap read on the node at the trigger's fire")),
        "the run's heap is the one read at the fire: {notes:?}"
    );
    let artifacts = artifacts_of(&pipeline.client, &done).await;
    assert_eq!(artifacts.len(), 1, "{artifacts:#?}");
    let file = pipeline.download(&done, &artifacts[0]).await;
    let (share, top) = inuse_cum_percent(&file, "main.hoardOrders");
    assert!(
        share >= 80.0,
        "main.hoardOrders holds {share}% of inuse_space:\n{top}"
    );

    // The policy's fleet views know the triggered run: listed with its reason, merged by
    // its fire's time.
    let (ok, text) = kubectl_profile(&pipeline.kubeconfig, ns.name(), &["list", "sp/go-oom"]);
    assert!(ok, "{text}");
    assert!(
        text.lines().next().is_some_and(|h| h.ends_with("TRIGGER"))
            && text.contains(&name)
            && text.contains(&trigger.reason),
        "{text}"
    );
    let fleet = tempfile::tempdir().unwrap();
    let (ok, text) = kubectl_profile(
        &pipeline.kubeconfig,
        ns.name(),
        &[
            "get",
            "sp/go-oom",
            "--since",
            "1h",
            "--format",
            "pprof",
            "-o",
            fleet.path().to_str().unwrap(),
        ],
    );
    assert!(ok, "{text}");
    let (merged_share, top) =
        inuse_cum_percent(&fleet.path().join("go-oom-heap.pb.gz"), "main.hoardOrders");
    assert!(
        merged_share >= 80.0,
        "the fleet view of sp/go-oom: {text}\n{top}"
    );
    eprintln!(
        "triggers e2e (Go OOM): pod started at {:.1}s, fire seen {:.1}s later ({}), OOM kill \
         seen at +{:.1}s, run finished at +{:.1}s; main.hoardOrders {share}% of inuse_space; \
         test took {:.1}s",
        ready.as_secs_f64(),
        (fire_seen - ready).as_secs_f64(),
        trigger.heap_at_fire,
        (killed_at - ready).as_secs_f64(),
        (started.elapsed() - ready).as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}

/// The lead-up end to end: a C workload whose load grows into its pod's CPU limit of 0.2
/// cores (10 s of bursts at 15% of a core, then all the time) under a policy whose trigger
/// fires on throttling. The agent's ring holds the pod's samples from the moment the watch
/// set reaches it; the fire snapshots them, the operator annotates the CPU run with the fire,
/// and the run's profile starts with them: it names the workload's hot function and covers
/// at least 5 s before the fire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_fires_profile_covers_the_seconds_before_the_fire() {
    let started = Instant::now();
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        ..PipelineOptions::default()
    })
    .await;
    let ns = TestNamespace::create("ff-trig-cpu").await.unwrap();
    // The policy first: the ring keeps the pod's samples once the watch set reaches the
    // agent (within ~2 s of the pod), and the workload's calm phase runs 10 s.
    let api: Api<SamplingPolicy> = ns.api();
    let policy = api
        .create(
            &PostParams::default(),
            &pipeline.policy(
                "cpu-watch",
                json!({
                    "schedule": "@yearly",
                    "template": {
                        "type": "cpu",
                        "selector": {"matchLabels": {"app": "ramp"}},
                        "duration": "2s",
                    },
                    "triggers": [{
                        "name": "throttled",
                        "cpu": {"throttledPercent": 50},
                        "capture": {"duration": "2s"},
                    }],
                }),
            ),
        )
        .await
        .expect("creating the SamplingPolicy");
    let uid = policy.uid().unwrap();
    pipeline
        .cpu_limited_pod(&ns, "ramp", 0, &[("app", "ramp")], 200, 1, &["ramp", "10"])
        .await;
    let ready = started.elapsed();

    let fired: ProfileRequest = pipeline
        .wait_for("a triggered run with status.trigger", TIMEOUT, || {
            let (ns, uid) = (&ns, uid.clone());
            async move {
                runs(ns, &uid)
                    .await
                    .into_iter()
                    .find(|r| r.status.as_ref().is_some_and(|s| s.trigger.is_some()))
            }
        })
        .await;
    let fire_seen = started.elapsed();
    let trigger = fired.status.clone().unwrap().trigger.unwrap();
    assert_eq!(fired.spec.profile_type, flamefleet_api::ProfileType::Cpu);
    assert!(
        fired
            .annotations()
            .get(TRIGGER_FIRE_ANNOTATION)
            .is_some_and(|id| id.len() == 32),
        "the CPU run names the fire whose lead-up the node kept: {:?}\n{}",
        fired.annotations(),
        pipeline.agent_logs()
    );
    let name = fired.name_any();
    let done: ProfileRequest = pipeline
        .wait_for("the triggered run to finish", TIMEOUT, || {
            let api: Api<ProfileRequest> = ns.api();
            let name = name.clone();
            async move {
                let r = api.get(&name).await.ok()?;
                let phase = r.status.as_ref()?.phase?;
                phase.is_terminal().then_some(r)
            }
        })
        .await;
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Succeeded),
        "{status:#?}\n{}\n{}",
        pipeline.operator_logs(),
        pipeline.agent_logs()
    );
    let notes = status
        .summary
        .as_ref()
        .map(|s| s.notes.clone())
        .unwrap_or_default();
    assert!(
        notes.iter().any(|n| n.starts_with("lead-up: ")),
        "the run says it starts with the lead-up: {notes:?}\n{}",
        pipeline.agent_logs()
    );
    let artifacts = artifacts_of(&pipeline.client, &done).await;
    assert_eq!(artifacts.len(), 1, "{artifacts:#?}");
    let file = pipeline.download(&done, &artifacts[0]).await;
    let f = flamefleet_e2e::lead_up::figures(&file, "burn_cpu");
    let share = f.share();
    eprintln!(
        "triggers e2e (CPU lead-up): pod started at {:.1}s, fire seen {:.1}s later ({}); \
         lead-up {} samples reaching {:.1}s before the fire, burn_cpu on {share:.1}% of them \
         ({:.1}% their leaf); {} samples after the fire; {notes:?}; test took {:.1}s",
        ready.as_secs_f64(),
        (fire_seen - ready).as_secs_f64(),
        trigger.reason,
        f.lead_up,
        f.oldest_ms as f64 / 1e3,
        f.leaf_share(),
        f.after_fire,
        started.elapsed().as_secs_f64()
    );
    assert_eq!(f.unlabelled, 0, "every sample says its phase: {f:?}");
    assert!(
        f.oldest_ms >= 5_000,
        "the profile covers at least 5 s before the fire: {f:?}"
    );
    assert!(share >= 80.0, "the lead-up names burn_cpu: {f:?}");
    assert!(f.after_fire > 0, "the capture's own samples follow: {f:?}");
}

/// A pod whose tasks outnumber its CPU quota (four spinning processes under a limit of 200
/// millicores on the pod's cgroup, as the kubelet sets it): the agent's latency trigger
/// (the runqlat sampler's BPF histogram of the pod's waits, p99 over a 2 s window) fires,
/// the operator creates a runqlat run of that pod with the measured p99 in
/// `status.trigger`, and the run's own capture measures a p99 above the threshold too. The
/// policy has no schedule (triggers only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_crowding_its_cpu_quota_fires_the_runqlat_p99_trigger() {
    const THRESHOLD_US: i64 = 20_000;
    let started = Instant::now();
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        ..PipelineOptions::default()
    })
    .await;
    let tenant = TestNamespace::create("ff-trig-lat").await.unwrap();
    let crowd = pipeline
        .cpu_limited_pod(&tenant, "crowd", 0, &[("app", "crowd")], 200, 4, &["spin"])
        .await;
    let api: Api<SamplingPolicy> = tenant.api();
    let policy = api
        .create(
            &PostParams::default(),
            &pipeline.policy(
                "runq-watch",
                json!({
                    // No schedule: the policy captures on its trigger only.
                    "template": {
                        "type": "runqlat",
                        "selector": {"matchLabels": {"app": "crowd"}},
                        "duration": "3s",
                    },
                    "triggers": [{
                        "name": "waiting-to-run",
                        "latency": {"runqlatP99Micros": THRESHOLD_US, "windowSeconds": 2},
                        "capture": {"duration": "3s"},
                    }],
                }),
            ),
        )
        .await
        .expect("creating the SamplingPolicy");
    let uid = policy.uid().unwrap();
    let ready = started.elapsed();
    let fired: ProfileRequest = pipeline
        .wait_for(
            "a triggered runqlat run with status.trigger",
            TIMEOUT,
            || {
                let (tenant, uid) = (&tenant, uid.clone());
                async move {
                    runs(tenant, &uid)
                        .await
                        .into_iter()
                        .find(|r| r.status.as_ref().is_some_and(|s| s.trigger.is_some()))
                }
            },
        )
        .await;
    let fire_seen = started.elapsed();
    let trigger = fired.status.clone().unwrap().trigger.unwrap();
    eprintln!("status.trigger: {trigger:#?}");
    assert_eq!(trigger.name, "waiting-to-run");
    assert_eq!(trigger.pod, "crowd");
    assert_eq!(trigger.unit, "µs");
    assert_eq!(trigger.threshold, format!("{THRESHOLD_US}.0"));
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
    assert!(
        trigger.detail.contains("run-queue waits"),
        "{}",
        trigger.detail
    );
    assert_eq!(
        fired.spec.profile_type,
        flamefleet_api::ProfileType::Runqlat
    );
    assert_eq!(fired.spec.pod_names, ["crowd"]);
    assert_eq!(fired.labels()[TRIGGER_POD_UID_LABEL], crowd.uid().unwrap());

    let name = fired.name_any();
    let done: ProfileRequest = pipeline
        .wait_for("the triggered runqlat run to finish", TIMEOUT, || {
            let api: Api<ProfileRequest> = tenant.api();
            let name = name.clone();
            async move {
                let r = api.get(&name).await.ok()?;
                let phase = r.status.as_ref()?.phase?;
                phase.is_terminal().then_some(r)
            }
        })
        .await;
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Succeeded),
        "{status:#?}\n{}\n{}",
        pipeline.operator_logs(),
        pipeline.agent_logs()
    );
    let latency = status
        .summary
        .and_then(|s| s.runqlat)
        .expect("runqlat percentiles in the run's summary");
    eprintln!("the run's capture: {latency:?}");
    assert!(
        latency.p99_us > THRESHOLD_US,
        "the capture's p99 {} µs is not above the trigger's {THRESHOLD_US} µs: {latency:?}",
        latency.p99_us
    );
    let metrics = pipeline.agent_metrics(0).await;
    assert_eq!(
        metric(&metrics, "flamefleet_agent_trigger_watched_cgroups"),
        Some(1.0),
        "{metrics}"
    );
    // A trigger-only policy: no schedule, no next time, only the triggered run.
    let status = api
        .get("runq-watch")
        .await
        .unwrap()
        .status
        .unwrap_or_default();
    let valid = status
        .conditions
        .iter()
        .find(|c| c.type_ == "ScheduleValid")
        .expect("a ScheduleValid condition");
    assert_eq!(
        (valid.status.as_str(), valid.reason.as_str()),
        ("True", "TriggersOnly"),
        "{status:#?}"
    );
    assert_eq!(status.next_schedule_time, None, "{status:#?}");
    assert_eq!(runs(&tenant, &uid).await.len(), 1, "only the triggered run");
    eprintln!(
        "latency trigger e2e: policy created at {:.1}s, fire seen {:.1}s later, run finished \
         at +{:.1}s; test took {:.1}s",
        ready.as_secs_f64(),
        (fire_seen - ready).as_secs_f64(),
        (started.elapsed() - ready).as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}
