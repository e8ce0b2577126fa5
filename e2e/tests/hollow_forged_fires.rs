//! A compromised node cannot make the operator profile what it does not run: one node of a
//! hollow fleet answers the operator's trigger stream with fires it makes up, for a pod the
//! policy watches on another node, for a pod the policy does not select, for a policy and a
//! trigger that do not exist, and for its own watched pod under another pod's name. Only
//! the fire for its own watched pod becomes a run, of that pod (by UID, whatever name the
//! node claimed), and a replay of it within the cooldown is turned down. A genuine fire
//! for a policy whose node budget is spent is turned down too, and says why in the
//! policy's status and an Event. The fires arrive on a call the operator has already
//! replaced (a policy added meanwhile changed the node's set): they are handled all the same.
//!
//! Real operator, real store process, real API server; the agents are hollow (the real
//! gRPC service and mTLS without BPF): a compromised node is not bound to run the agent's
//! code, so its stream is scripted.

#[path = "pipeline_support/mod.rs"]
mod pipeline_support;

use std::time::{Duration, Instant};

use flamefleet_api::trigger::{TRIGGER_LABEL, TRIGGER_POD_UID_LABEL, TriggerStatus};
use flamefleet_api::{ProfileRequest, SamplingPolicy};
use flamefleet_e2e::hollow::cluster::{ClusterOptions, HollowCluster, RUN_LABEL, subset_label};
use flamefleet_proto::agent::TriggerFired;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

const NODES: usize = 4;
/// The policy selects the pods of the first two nodes; node 0 is compromised.
const SELECTED: usize = 2;
const TIMEOUT: Duration = Duration::from_secs(90);

/// `flamefleet_operator_trigger_fires_total{outcome="..."}`, 0 when absent.
fn fires(metrics: &str, outcome: &str) -> f64 {
    let prefix = format!("flamefleet_operator_trigger_fires_total{{outcome=\"{outcome}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn operator_metrics(cluster: &HollowCluster) -> String {
    let port = cluster
        .operator
        .as_ref()
        .expect("the operator")
        .metrics_port;
    pipeline_support::metrics_at(port).await
}

/// Polls `check` every 200 ms until it gives a value; fails saying `what` was awaited
/// once [`TIMEOUT`] has passed.
async fn until<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    flamefleet_e2e::cluster::wait_for(what, TIMEOUT, Duration::from_millis(200), check)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The status of trigger `hot` of policy `name`, once written.
async fn hot_status(policies: &Api<SamplingPolicy>, name: &str) -> Option<TriggerStatus> {
    policies
        .get(name)
        .await
        .ok()?
        .status?
        .triggers
        .into_iter()
        .find(|t| t.name == "hot")
}

/// Creates SamplingPolicy `name` of the fleet's run: a CPU trigger `hot` (throttled in
/// `throttled_percent`% of periods, the default cooldown unless `cooldown_seconds`) on the
/// selected pods, with `extra` merged into its spec. Returns its UID.
async fn hot_policy(
    policies: &Api<SamplingPolicy>,
    run: &str,
    name: &str,
    (throttled_percent, cooldown_seconds): (u32, Option<u32>),
    extra: serde_json::Value,
) -> String {
    let mut spec = json!({
        "template": {
            "type": "cpu",
            "selector": {"matchLabels": {subset_label(SELECTED): "true"}},
            "duration": "1s",
        },
        "triggers": [{
            "name": "hot",
            "cpu": {"throttledPercent": throttled_percent},
            "capture": {"duration": "1s"},
        }],
    });
    if let Some(cooldown) = cooldown_seconds {
        spec["triggers"][0]["cooldownSeconds"] = json!(cooldown);
    }
    for (key, value) in extra.as_object().into_iter().flatten() {
        spec[key] = value.clone();
    }
    let policy: SamplingPolicy = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "SamplingPolicy",
        "metadata": {"name": name, "labels": {RUN_LABEL: run}},
        "spec": spec,
    }))
    .expect("a valid SamplingPolicy");
    policies
        .create(&PostParams::default(), &policy)
        .await
        .unwrap_or_else(|e| panic!("creating SamplingPolicy {name}: {e}"))
        .uid()
        .expect("a policy UID")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_fires_are_refused_and_a_fire_names_the_pod_by_uid() {
    let started = Instant::now();
    let mut cluster = HollowCluster::create(
        &pipeline_support::bins().operator,
        ClusterOptions {
            nodes: NODES,
            progress_every: 0,
            subsets: vec![SELECTED],
            ..Default::default()
        },
    )
    .await
    .expect("a hollow fleet");
    let ns = cluster.target_ns.name().to_string();
    let pods: Api<Pod> = cluster.target_ns.api();
    let uid_of = |i: usize| {
        let pods = pods.clone();
        async move {
            pods.get(&format!("w-{i:05}"))
                .await
                .expect("a target pod")
                .uid()
                .expect("a pod UID")
        }
    };
    let (own, neighbour, unselected) = (uid_of(0).await, uid_of(1).await, uid_of(3).await);

    let policies: Api<SamplingPolicy> = cluster.target_ns.api();
    // No scheduled run in the test's lifetime: only fires create runs.
    let policy_uid = hot_policy(
        &policies,
        &cluster.id,
        "hot-watch",
        (20, Some(600)),
        json!({"schedule": "@yearly"}),
    )
    .await;
    // The same pods and trigger under a budget no capture fits: a duty cycle of 1% of 60 s
    // allows 0 s of capture, so a fire of its own pod is turned down by the budget.
    let spent_uid = hot_policy(
        &policies,
        &cluster.id,
        "spent-watch",
        (20, None),
        json!({"budget": {"maxDutyCyclePercent": 1, "dutyCycleWindowSeconds": 60}}),
    )
    .await;

    let fire = |pod_uid: &str, pod_name: &str, policy_uid: &str, trigger: &str| TriggerFired {
        policy_uid: policy_uid.to_string(),
        pod_uid: pod_uid.to_string(),
        namespace: ns.clone(),
        pod_name: pod_name.to_string(),
        trigger: trigger.to_string(),
        condition: "CPU throttled in at least 20% of periods".into(),
        measured: 97.0,
        threshold: 20.0,
        unit: "%".into(),
        detail: "made up".into(),
        fired_at_unix_ms: i64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis(),
        )
        .unwrap_or(0),
        ..Default::default()
    };
    let forged = vec![
        // A pod the policy watches, on another node.
        fire(&neighbour, "w-00001", &policy_uid, "hot"),
        // A pod the policy does not select (on another node too).
        fire(&unselected, "w-00003", &policy_uid, "hot"),
        // Its own pod, for a policy that does not exist and for a trigger the policy lacks.
        fire(
            &own,
            "w-00000",
            "00000000-0000-0000-0000-000000000000",
            "hot",
        ),
        fire(&own, "w-00000", &policy_uid, "not-a-trigger"),
        // Its own watched pod, claiming another pod's name: this one counts, for w-00000.
        fire(&own, "kube-apiserver", &policy_uid, "hot"),
        // The same again: within the cooldown.
        fire(&own, "w-00000", &policy_uid, "hot"),
    ];
    // First, while nothing captures on node 0 (so that the duty cycle, not the node's one
    // concurrent capture, is what turns it down): its own watched pod for the policy whose
    // budget no capture fits.
    let forged: Vec<_> = std::iter::once(fire(&own, "w-00000", &spent_uid, "hot"))
        .chain(forged)
        .collect();
    // The script goes to the first watch call made once both policies are watched (the
    // operator registers them one after the other; node 0's hollow agent refuses the calls
    // before it, and the operator calls again after a pause). Its fires wait until a third
    // policy has changed node 0's set, so that they arrive on a call the operator has
    // already replaced: the agent ends a replaced call itself, and what it sent there
    // before must still be handled.
    cluster.start_operator().expect("the operator");
    let watched = |name: &'static str| {
        let policies = policies.clone();
        until(name, move || {
            let policies = policies.clone();
            async move {
                hot_status(&policies, name)
                    .await
                    .filter(|t| t.watched_pods == SELECTED as i64)
                    .map(|_| ())
            }
        })
    };
    watched("hot-watch").await;
    watched("spent-watch").await;
    assert!(cluster.fleet.script_watch_held(0, forged));
    until(
        "a watch call to node 0 after the script was set",
        || async { cluster.fleet.watch_script_opened(0).then_some(()) },
    )
    .await;
    hot_policy(&policies, &cluster.id, "late-watch", (90, None), json!({})).await;
    // Its pods are counted in the same pass that replaced node 0's call.
    watched("late-watch").await;
    assert!(cluster.fleet.release_watch_script(0));

    // Every scripted fire reached the operator and was counted.
    let deadline = Instant::now() + TIMEOUT;
    let metrics = loop {
        let metrics = operator_metrics(&cluster).await;
        let counted = ["NotWatched", "Created", "Cooldown", "DutyCycle"]
            .iter()
            .map(|o| fires(&metrics, o))
            .sum::<f64>();
        if cluster.fleet.watch_script_sent(0) && counted >= 7.0 {
            break metrics;
        }
        assert!(
            Instant::now() < deadline,
            "the operator did not count the 7 fires of node 0 (sent: {}):\n{}\n--- operator ---\n{}",
            cluster.fleet.watch_script_sent(0),
            metrics
                .lines()
                .filter(|l| l.contains("trigger"))
                .collect::<Vec<_>>()
                .join("\n"),
            cluster
                .operator
                .as_ref()
                .map(|o| o.log_tail(40))
                .unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(fires(&metrics, "NotWatched"), 4.0, "{metrics}");
    assert_eq!(fires(&metrics, "Created"), 1.0, "{metrics}");
    assert_eq!(fires(&metrics, "Cooldown"), 1.0, "{metrics}");
    assert_eq!(fires(&metrics, "DutyCycle"), 1.0, "{metrics}");

    // One run, of node 0's own pod, named by its UID and not by what the node claimed.
    let requests: Api<ProfileRequest> = cluster.target_ns.api();
    let runs = requests
        .list(&ListParams::default().labels(&format!("flamefleet.dev/policy-uid={policy_uid}")))
        .await
        .expect("listing runs")
        .items;
    assert_eq!(runs.len(), 1, "{runs:#?}");
    let run = &runs[0];
    assert_eq!(run.spec.pod_names, ["w-00000"], "{run:#?}");
    assert_eq!(run.labels()[TRIGGER_LABEL], "hot");
    assert_eq!(run.labels()[TRIGGER_POD_UID_LABEL], own);
    let trigger = run
        .status
        .as_ref()
        .and_then(|s| s.trigger.clone())
        .expect("status.trigger on the run");
    assert_eq!(
        (trigger.pod.as_str(), trigger.node.as_str()),
        ("w-00000", cluster.fleet.nodes()[0].name.as_str()),
        "{trigger:#?}"
    );
    // Nothing of the other nodes' pods, and nothing outside the policy's namespace.
    let everywhere: Api<ProfileRequest> = Api::all(cluster.target_ns.client());
    let all_runs: Vec<_> = everywhere
        .list(&ListParams::default().labels(&format!("{RUN_LABEL}={}", cluster.id)))
        .await
        .expect("listing every request of this cluster")
        .items
        .into_iter()
        .map(|r| format!("{}/{}", r.namespace().unwrap_or_default(), r.name_any()))
        .collect();
    assert_eq!(
        all_runs,
        [format!("{ns}/{}", run.name_any())],
        "runs of this fleet"
    );

    // The policy's status counts one fire and one skip, with the reason.
    let status = until(
        "status.triggers of hot-watch to count 1 fire and 1 skip",
        || async {
            hot_status(&policies, "hot-watch")
                .await
                .filter(|t| t.fires == 1 && t.skipped == 1)
        },
    )
    .await;
    assert!(
        status.last_skip_reason.starts_with("Cooldown: "),
        "{status:#?}"
    );

    // The budget-bound policy: no run, one skip, the budget's reason in its status and a
    // Warning Event on it.
    let node0 = cluster.fleet.nodes()[0].name.clone();
    let spent_status = until(
        "status.triggers of spent-watch to count its skip",
        || async {
            hot_status(&policies, "spent-watch")
                .await
                .filter(|t| t.skipped == 1)
        },
    )
    .await;
    assert_eq!(spent_status.fires, 0, "{spent_status:#?}");
    assert!(
        spent_status
            .last_skip_reason
            .starts_with(&format!("DutyCycle: node {node0} ")),
        "{spent_status:#?}"
    );
    let spent_runs = requests
        .list(&ListParams::default().labels(&format!("flamefleet.dev/policy-uid={spent_uid}")))
        .await
        .expect("listing runs")
        .items;
    assert!(spent_runs.is_empty(), "{spent_runs:#?}");
    let events: Api<Event> = cluster.target_ns.api();
    let event = until("a TriggerSkipped Event on spent-watch", || async {
        events
            .list(
                &ListParams::default()
                    .fields("involvedObject.name=spent-watch,reason=TriggerSkipped"),
            )
            .await
            .expect("listing Events")
            .items
            .into_iter()
            .next()
    })
    .await;
    assert_eq!(event.type_.as_deref(), Some("Warning"), "{event:#?}");
    let note = event.message.unwrap_or_default();
    assert!(
        note.contains("w-00000") && note.contains("DutyCycle"),
        "{note}"
    );
    eprintln!(
        "forged fires: 4 refused, 1 run, 1 cooldown, 1 over budget; test took {:.1}s",
        started.elapsed().as_secs_f64()
    );
}
