//! End to end, failures: each failing node gets a clear message in the status; some nodes
//! failing gives PartiallySucceeded; an agent killed mid-capture fails only its node; an
//! operator killed mid-capture and restarted finishes the request with one capture per node.

mod pipeline_support;

use std::time::{Duration, Instant};

use flamefleet_api::{NodePhase, ProfileRequest, RequestPhase};
use flamefleet_e2e::TestNamespace;
use flamefleet_e2e::pods::PodFixture;
use kube::api::Api;
use pipeline_support::{Pipeline, PipelineOptions, node_results, serial};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);

async fn wait_phase(
    pipeline: &Pipeline,
    api: &Api<ProfileRequest>,
    name: &str,
    phase: RequestPhase,
) -> ProfileRequest {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let r = api.get(name).await.unwrap();
        if r.status.as_ref().and_then(|s| s.phase) == Some(phase) {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "{name} never reached {phase}: {:#?}\n--- operator ---\n{}\n{}",
            r.status,
            pipeline.operator_logs(),
            pipeline.agent_logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until each of `agents` logs that it attached a CPU sampler (the capture's window
/// runs from then on).
async fn wait_sampler_attached(pipeline: &Pipeline, agents: &[usize]) {
    let deadline = Instant::now() + TIMEOUT;
    while !agents.iter().all(|&i| {
        pipeline.agents[i]
            .log_text()
            .contains("cpu sampler attached")
    }) {
        assert!(
            Instant::now() < deadline,
            "agents {agents:?} never attached a sampler\n{}",
            pipeline.agent_logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_capture_fails_its_node_only() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-agent-killed").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&ns, "web-2", 1, &[("app", "web")], "spin", 1)
        .await;
    let api: Api<ProfileRequest> = ns.api();
    let request = pipeline.request(
        "killed",
        json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "4s"}),
    );
    let phases = pipeline.watch_phases(&api, "killed").await;
    api.create(&Default::default(), &request).await.unwrap();
    wait_phase(&pipeline, &api, "killed", RequestPhase::Running).await;
    // Mid-capture: the agent has attached its sampler for this request.
    wait_sampler_attached(&pipeline, &[1]).await;
    pipeline.kill_agent(1);
    let (done, _) = pipeline
        .wait_terminal(&api, "killed", TIMEOUT, phases)
        .await;
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::PartiallySucceeded),
        "{status:#?}\n{}",
        pipeline.operator_logs()
    );
    let nodes = node_results(&pipeline.client, &done).await;
    let ok = &nodes[&pipeline.nodes[0]];
    assert_eq!(ok.phase, Some(NodePhase::Succeeded), "{ok:?}");
    assert!(!ok.artifacts.is_empty());
    let failed = &nodes[&pipeline.nodes[1]];
    assert_eq!(failed.phase, Some(NodePhase::Failed), "{failed:?}");
    let message = failed.message.as_deref().unwrap_or_default();
    assert!(
        message.contains("stopped responding mid-capture"),
        "{message}"
    );
    let degraded = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")
        .unwrap();
    assert_eq!(degraded.status, "True");
    let succeeded = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Succeeded")
        .unwrap_or_else(|| panic!("no Succeeded condition: {status:#?}"));
    assert_eq!(
        (succeeded.status.as_str(), succeeded.reason.as_str()),
        ("False", "AgentInterrupted"),
        "{status:#?}"
    );
    assert_eq!(status.reason.as_deref(), Some("AgentInterrupted"));
    assert!(
        degraded.message.contains("1 of 2 nodes succeeded"),
        "{}",
        degraded.message
    );
}

/// One request whose every node fails differently: the agent cannot find the pod's cgroup
/// (capture failed, with the agent's reason), the agent process is gone (unreachable), and
/// a node has no agent at all. The request is Failed and each node says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_failing_node_says_why() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-failures").await.unwrap();
    // A pod on node 0 whose container has no cgroup on this machine.
    let no_cgroup = PodFixture::new(
        "no-cgroup",
        &pipeline.nodes[0],
        &format!("containerd://{}", "ab".repeat(32)),
    )
    .label("app", "web");
    ns.running_pod(&no_cgroup).await.unwrap();
    // A pod on node 1 whose agent is dead (its pod object still says Running).
    pipeline
        .pod(&ns, "orphan", 1, &[("app", "web")], "spin", 1)
        .await;
    pipeline.kill_agent(1);
    // A pod on a node without any agent.
    let ghost_node = format!("{}-ghost", pipeline.id);
    let ghost = PodFixture::new(
        "ghost",
        &ghost_node,
        &format!("containerd://{}", "cd".repeat(32)),
    )
    .label("app", "web");
    ns.running_pod(&ghost).await.unwrap();

    let request = pipeline.request(
        "failing",
        json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"}),
    );
    let (done, _) = pipeline.run(&ns, &request, TIMEOUT).await;
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Failed),
        "{status:#?}\n{}",
        pipeline.operator_logs()
    );
    let nodes = node_results(&pipeline.client, &done).await;
    let message = |node: &str| nodes[node].message.clone().unwrap_or_default();
    for node in nodes.values() {
        assert_eq!(node.phase, Some(NodePhase::Failed), "{node:?}");
    }
    let m0 = message(&pipeline.nodes[0]);
    // The agent wrote this entry itself, with its reason.
    assert!(m0.contains("no cgroup found for pod"), "{m0}");
    let m1 = message(&pipeline.nodes[1]);
    assert!(m1.contains("is unreachable"), "{m1}");
    let m2 = message(&ghost_node);
    assert!(
        m2.contains(&format!("no Flamefleet agent runs on node {ghost_node}")),
        "{m2}"
    );
    let completed = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Completed")
        .unwrap();
    assert_eq!(completed.reason, "Failed");
    assert!(
        completed.message.contains("0 of 3 nodes succeeded"),
        "{}",
        completed.message
    );
    // `Succeeded` tells failure from success; the reason is the nodes' commonest (one node
    // each: the first by name), and the REASON column shows it.
    let succeeded = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Succeeded")
        .unwrap_or_else(|| panic!("no Succeeded condition: {status:#?}"));
    assert_eq!(
        (succeeded.status.as_str(), succeeded.reason.as_str()),
        ("False", "AgentUnreachable"),
        "{status:#?}"
    );
    assert_eq!(status.reason.as_deref(), Some("AgentUnreachable"));
    let kubeconfig = ns.control_plane().kubeconfig();
    let out =
        flamefleet_e2e::kubectl::kubectl(kubeconfig, &["get", "preq", "failing", "-n", ns.name()])
            .unwrap();
    let (header, row) = (out.lines().next().unwrap(), out.lines().nth(1).unwrap());
    let at = header.find("REASON").expect("a REASON column");
    assert!(row[at..].starts_with("AgentUnreachable"), "{out}");
    // The `kubectl wait` line docs/cli.md gives: Completed, then Succeeded, which fails.
    let target = "preq/failing";
    let wait = |condition: &str| {
        flamefleet_e2e::kubectl::kubectl(
            kubeconfig,
            &[
                "wait",
                "-n",
                ns.name(),
                &format!("--for=condition={condition}"),
                "--timeout=0s",
                target,
            ],
        )
    };
    assert!(wait("Completed").is_ok());
    assert!(
        wait("Succeeded").is_err(),
        "a failed request is not Succeeded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_restarted_mid_capture_completes_the_request_once() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-restart").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&ns, "web-2", 1, &[("app", "web")], "spin", 1)
        .await;
    let api: Api<ProfileRequest> = ns.api();
    let request = pipeline.request(
        "restart",
        json!({"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "6s"}),
    );
    let phases = pipeline.watch_phases(&api, "restart").await;
    api.create(&Default::default(), &request).await.unwrap();
    let running = wait_phase(&pipeline, &api, "restart", RequestPhase::Running).await;
    let uid = running.metadata.uid.clone().unwrap();
    let started = running.status.unwrap().start_time;
    // Mid-capture: both agents sample for this request.
    wait_sampler_attached(&pipeline, &[0, 1]).await;
    pipeline.kill_operator();
    pipeline.start_operator();
    let (done, seen) = pipeline
        .wait_terminal(&api, "restart", TIMEOUT, phases)
        .await;
    let status = done.status.clone().unwrap();
    assert_eq!(
        status.phase,
        Some(RequestPhase::Succeeded),
        "{status:#?}\n{}",
        pipeline.operator_logs()
    );
    assert_eq!(
        seen,
        [
            RequestPhase::Pending,
            RequestPhase::Running,
            RequestPhase::Succeeded
        ]
    );
    assert_eq!(
        status.start_time, started,
        "the restarted operator started the request again"
    );
    // Each agent started exactly one capture for the request; the new operator attached to it
    // (or got its replayed result).
    for agent in &pipeline.agents {
        let log = agent.log_text();
        let new = log
            .lines()
            .filter(|l| l.contains("new capture") && l.contains(&uid))
            .count();
        let rejoined = log
            .lines()
            .filter(|l| {
                (l.contains("attaching to running capture")
                    || l.contains("replaying finished capture"))
                    && l.contains(&uid)
            })
            .count();
        assert_eq!(
            new,
            1,
            "{}: captures started for {uid}:\n{}",
            agent.name,
            agent.log_tail()
        );
        assert!(
            rejoined >= 1,
            "{}: the restarted operator did not re-attach:\n{}",
            agent.name,
            agent.log_tail()
        );
    }
    assert!(
        pipeline
            .operator_logs()
            .contains("resuming the captures of a Running request")
    );
}

/// Two replicas share one Lease: only one leads and acts; when it is killed, the standby
/// takes over and finishes the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_never_both_act() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-leader").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    // Let the first replica win the Lease before the second starts.
    let first = pipeline_support::metrics_at(pipeline.metrics_port).await;
    let deadline = Instant::now() + TIMEOUT;
    let mut first_leads = pipeline_support::is_leader(&first);
    while !first_leads {
        assert!(Instant::now() < deadline, "the first replica never led");
        tokio::time::sleep(Duration::from_millis(200)).await;
        first_leads = pipeline_support::is_leader(&pipeline.operator_metrics().await);
    }
    let (mut standby, standby_port) = pipeline.start_replica();
    let request = pipeline.request(
        "led",
        json!({"type": "cpu", "podNames": ["web-1"], "duration": "1s"}),
    );
    let (done, _) = pipeline.run(&ns, &request, TIMEOUT).await;
    assert_eq!(done.status.unwrap().phase, Some(RequestPhase::Succeeded));
    let standby_metrics = pipeline_support::metrics_at(standby_port).await;
    assert!(
        !pipeline_support::is_leader(&standby_metrics),
        "both replicas lead:\n{standby_metrics}"
    );
    assert!(
        standby_metrics.contains("flamefleet_operator_reconciles_total 0"),
        "the standby reconciled:\n{standby_metrics}"
    );
    assert!(
        pipeline
            .operator_metrics()
            .await
            .contains("flamefleet_operator_captures_dispatched_total 1")
    );

    // The leader dies; the standby takes over once the Lease expires.
    pipeline.kill_operator();
    let request = pipeline.request(
        "after-failover",
        json!({"type": "cpu", "podNames": ["web-1"], "duration": "1s"}),
    );
    let (done, _) = pipeline.run(&ns, &request, TIMEOUT).await;
    assert_eq!(done.status.unwrap().phase, Some(RequestPhase::Succeeded));
    let standby_metrics = pipeline_support::metrics_at(standby_port).await;
    assert!(
        pipeline_support::is_leader(&standby_metrics),
        "{standby_metrics}"
    );
    standby.kill();
}

/// `ttlSecondsAfterFinished` deletes a finished request, and the finalizer its artifacts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_deletes_finished_requests_and_their_artifacts() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-ttl").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    let request = pipeline.request(
        "short-lived",
        json!({"type": "cpu", "podNames": ["web-1"], "duration": "1s", "ttlSecondsAfterFinished": 2}),
    );
    let (done, _) = pipeline.run(&ns, &request, TIMEOUT).await;
    assert_eq!(
        done.status.clone().unwrap().phase,
        Some(RequestPhase::Succeeded)
    );
    let artifact = node_results(&pipeline.client, &done).await[&pipeline.nodes[0]].artifacts[0]
        .name
        .clone();
    let stored = pipeline.stored_artifact(&done, &artifact);
    assert!(stored.exists(), "{} was stored", stored.display());
    let api: Api<ProfileRequest> = ns.api();
    let deadline = Instant::now() + Duration::from_secs(30);
    while api.get_opt("short-lived").await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "not deleted after its TTL\n{}",
            pipeline.operator_logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !stored.exists(),
        "artifact kept after the TTL deletion: {}",
        stored.display()
    );
    // The finalizer deleted the result slices too (this control plane has no garbage
    // collector to follow their ownerReference).
    let uid = done.metadata.uid.clone().unwrap();
    let slices = flamefleet_api::results::list_slices(&pipeline.client, ns.name(), &uid)
        .await
        .unwrap();
    assert!(slices.is_empty(), "slices kept after deletion: {slices:#?}");
}
