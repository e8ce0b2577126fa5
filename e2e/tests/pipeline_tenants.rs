//! End to end, hostile tenants against the operator: each test performs the attack for real,
//! as a user holding only what the chart's aggregated `edit` role grants in one namespace,
//! against the real control plane, the real operator and real agents capturing real
//! workloads.
//!
//! - Forged runs: ten finished ProfileRequests carrying a ClusterSamplingPolicy's UID
//!   (label and controller ownerReference) with far-future scheduled times, in one of the
//!   policy's namespaces, must not make the operator delete the other namespace's run or its
//!   artifacts, never count in the policy's history or status, and stay out of the CLI's
//!   fleet view of the policy.
//! - A burst: fifty requests created at once in a namespace limited to two concurrent
//!   captures; a watch of their phases never sees more than two Running, and all fifty
//!   succeed.
//! - Drowning: policies firing every second at a 100% duty cycle, past the namespace's cap
//!   of policies, into a namespace whose queue is full: the policy over the cap is refused
//!   (status and Event), the others pass the full namespace over and plan their next run a
//!   minute later at the earliest; no run is added to the queue.

mod pipeline_support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flamefleet_api::{ClusterSamplingPolicy, ProfileRequest, RequestPhase, SamplingPolicy};
use flamefleet_e2e::TestNamespace;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use pipeline_support::{
    Pipeline, PipelineOptions, RUN_LABEL, is_terminal, kubectl_profile, runs_of, serial,
};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(180);

/// A client for user `user`, bound to the edit rules in `ns` only.
async fn tenant(ns: &TestNamespace, user: &str) -> kube::Client {
    ns.tenant_client(user)
        .await
        .expect("a client holding the edit role in the namespace")
}

fn phase(r: &ProfileRequest) -> Option<RequestPhase> {
    r.status.as_ref().and_then(|s| s.phase)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_runs_of_a_cluster_policy_delete_nothing_and_never_count() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let a = TestNamespace::create("ff-forge-a").await.unwrap();
    let b = TestNamespace::create("ff-forge-b").await.unwrap();
    let team = format!("team-{}", pipeline.id);
    let namespaces: Api<Namespace> = Api::all(a.client());
    for ns in [&a, &b] {
        namespaces
            .patch(
                ns.name(),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"flamefleet-test-team": team}}})),
            )
            .await
            .unwrap();
    }
    pipeline
        .pod(&a, "web-a", 1, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&b, "web-b", 0, &[("app", "web")], "spin", 1)
        .await;
    let name = a.unique("fleet-web");
    let policies: Api<ClusterSamplingPolicy> = Api::all(a.client());
    let policy = policies
        .create(
            &PostParams::default(),
            &pipeline.cluster_policy(
                &name,
                json!({
                    "namespaceSelector": {"matchLabels": {"flamefleet-test-team": team}},
                    "schedule": "*/2 * * * * *",
                    "template": {"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"},
                    "sampling": {"maxPods": 4},
                    "budget": {"maxConcurrentCapturesPerNode": 4, "maxDutyCyclePercent": 100},
                }),
            ),
        )
        .await
        .unwrap();
    let uid = policy.uid().unwrap();
    let client = a.client();

    // B's genuine run succeeds; then the policy is suspended, so that no later genuine run
    // can push it out of the history.
    let genuine = pipeline
        .wait_for("a succeeded run in b", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            let b = b.name().to_string();
            async move {
                runs_of(&client, &uid).await.into_iter().find(|r| {
                    r.namespace().as_deref() == Some(b.as_str())
                        && phase(r) == Some(RequestPhase::Succeeded)
                })
            }
        })
        .await;
    policies
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": true}})),
        )
        .await
        .unwrap();
    // Every genuine run ends (some may still have been running when suspended).
    let genuine_runs = pipeline
        .wait_for("the genuine runs to finish", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move {
                let runs = runs_of(&client, &uid).await;
                runs.iter().all(is_terminal).then_some(runs)
            }
        })
        .await;
    let last_genuine_success = genuine_runs
        .iter()
        .filter(|r| phase(r) == Some(RequestPhase::Succeeded))
        .filter_map(|r| r.status.as_ref()?.completion_time.clone())
        .map(|t| t.0)
        .max()
        .expect("the genuine runs succeeded");
    let artifacts = pipeline_support::artifacts_of(&client, &genuine).await;
    let artifact = artifacts.first().expect("the genuine run has artifacts");
    let stored = pipeline.stored_artifact(&genuine, &artifact.name);
    assert!(stored.exists(), "{}", stored.display());

    // The tenant of `a` forges ten runs: the policy's UID as label and as controller
    // ownerReference, far-future scheduled times, the policy's naming; the operator
    // captures them like any request of `a` and they finish.
    let mallory = tenant(&a, "mallory").await;
    let forged_api: Api<ProfileRequest> = Api::namespaced(mallory, a.name());
    let far_future = 4_000_000_000i64;
    let mut forged = Vec::new();
    for i in 0..10 {
        let t = far_future + i;
        let forged_name = format!("{name}-c{t}");
        let request: ProfileRequest = serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {
                "name": forged_name,
                "labels": {
                    RUN_LABEL: pipeline.id,
                    "flamefleet.dev/policy": name,
                    "flamefleet.dev/policy-uid": uid,
                    "flamefleet.dev/policy-kind": "ClusterSamplingPolicy",
                    "flamefleet.dev/scheduled-time": t.to_string(),
                },
                "annotations": {"flamefleet.dev/planned-nodes": pipeline.nodes.join(",")},
                "ownerReferences": [{
                    "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ClusterSamplingPolicy",
                    "name": name, "uid": uid, "controller": true,
                }],
            },
            "spec": {"type": "cpu", "podNames": ["web-a"], "duration": "1s"},
        }))
        .unwrap();
        forged_api
            .create(&PostParams::default(), &request)
            .await
            .expect("the tenant may create requests in its namespace");
        forged.push(forged_name);
    }
    pipeline
        .wait_for("the ten forged runs to finish", TIMEOUT, || {
            let api = forged_api.clone();
            let forged = forged.clone();
            async move {
                let mut done = Vec::new();
                for n in &forged {
                    let r = api.get(n).await.ok()?;
                    if !is_terminal(&r) {
                        return None;
                    }
                    done.push(r);
                }
                Some(done)
            }
        })
        .await;
    // Make the operator reconcile the policy once more after all that, and wait for it: a
    // spec change it acknowledges in status.observedGeneration (history is applied before
    // the status is written).
    let bumped = policies
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"history": {"failedRunsHistoryLimit": 4}}})),
        )
        .await
        .unwrap();
    let generation = bumped.metadata.generation;
    let status = pipeline
        .wait_for("the policy's status to catch up", TIMEOUT, || {
            let policies = policies.clone();
            let name = name.clone();
            async move {
                let p = policies.get(&name).await.ok()?;
                let status = p.status?;
                (status.observed_generation == generation).then_some(status)
            }
        })
        .await;

    let b_api: Api<ProfileRequest> = b.api();
    let still = b_api
        .get_opt(&genuine.name_any())
        .await
        .unwrap()
        .unwrap_or_else(|| {
            panic!(
                "b's genuine run {} was deleted\n{}",
                genuine.name_any(),
                pipeline.operator_logs()
            )
        });
    assert!(
        still.metadata.deletion_timestamp.is_none(),
        "b's genuine run is being deleted"
    );
    assert!(
        stored.exists(),
        "b's artifact is gone: {}",
        stored.display()
    );
    // The forged runs are not the policy's: none was deleted by its history, none is in
    // its status.
    for n in &forged {
        let r = forged_api.get(n).await.unwrap();
        assert!(r.metadata.deletion_timestamp.is_none(), "{n}");
    }
    assert!(
        status.active.iter().all(|r| !forged.contains(&r.name)),
        "{status:#?}"
    );
    let last_success = status
        .last_successful_time
        .as_ref()
        .map(|t| t.0)
        .expect("the genuine runs succeeded");
    assert!(
        last_success <= last_genuine_success,
        "lastSuccessfulTime {last_success} comes from a forged run (the last genuine run succeeded at {last_genuine_success})"
    );
    // The CLI's fleet view of the policy recognises runs as the operator does: b's run is
    // listed, no forged one, and the forgeries are counted as left out.
    let (ok, text) = kubectl_profile(
        &pipeline.kubeconfig,
        a.name(),
        &["list", &format!("csp/{name}")],
    );
    assert!(ok, "{text}");
    assert!(text.contains(&genuine.name_any()), "{text}");
    for n in &forged {
        assert!(
            !text.contains(n.as_str()),
            "the fleet view lists the forged {n}:\n{text}"
        );
    }
    assert!(
        text.contains(&format!("ignored {} ProfileRequests", forged.len())),
        "{text}"
    );
    policies.delete(&name, &Default::default()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_requests_at_once_never_run_past_the_namespace_limit() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        operator_args: vec!["--max-concurrent-captures-per-namespace".into(), "2".into()],
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-burst").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    let mallory = tenant(&ns, "mallory").await;
    let api: Api<ProfileRequest> = Api::namespaced(mallory, ns.name());

    // Every phase every request goes through, in the API server's order: one watch over the
    // namespace, listed before anything is created.
    let watched: Api<ProfileRequest> = ns.api();
    let seen: Arc<Mutex<Phases>> = Arc::default();
    let (listed_tx, listed) = tokio::sync::oneshot::channel::<()>();
    let watch = {
        let seen = seen.clone();
        tokio::spawn(async move {
            let mut listed_tx = Some(listed_tx);
            let stream = watcher::watcher(watched, watcher::Config::default());
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = listed_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(watcher::Event::Apply(r) | watcher::Event::InitApply(r)) => {
                        seen.lock().unwrap().apply(&r);
                    }
                    _ => {}
                }
            }
        })
    };
    tokio::time::timeout(Duration::from_secs(30), listed)
        .await
        .expect("the watch listed within 30 s")
        .expect("the watch ended before listing");

    let names: Vec<String> = (0..50).map(|i| format!("burst-{i}")).collect();
    let creates = names.iter().map(|name| {
        let request = pipeline.request(
            name,
            json!({"type": "cpu", "podNames": ["web-1"], "duration": "1s"}),
        );
        let api = api.clone();
        async move { api.create(&PostParams::default(), &request).await }
    });
    for created in futures::future::join_all(creates).await {
        created.expect("the tenant may create requests in its namespace");
    }
    let total = names.len();
    let finished = pipeline
        .wait_for(
            "all 50 requests to finish",
            Duration::from_secs(600),
            || {
                let seen = seen.clone();
                async move {
                    let seen = seen.lock().unwrap();
                    (seen.terminal() == total).then(|| seen.clone())
                }
            },
        )
        .await;
    watch.abort();
    assert!(
        finished.max_running <= 2,
        "the watch saw {} requests Running at once (namespace limit 2): {:?}",
        finished.max_running,
        finished.at_max
    );
    assert_eq!(
        finished.max_running, 2,
        "the limit is used, not only respected"
    );
    for name in &names {
        assert_eq!(
            finished.phases.get(name).copied().flatten(),
            Some(RequestPhase::Succeeded),
            "{name}"
        );
    }
}

/// Phases of a namespace's requests as a watch reports them, and the most seen Running at
/// once.
#[derive(Debug, Default, Clone)]
struct Phases {
    phases: BTreeMap<String, Option<RequestPhase>>,
    max_running: usize,
    at_max: Vec<String>,
}

impl Phases {
    fn apply(&mut self, r: &ProfileRequest) {
        self.phases.insert(r.name_any(), phase(r));
        let running: Vec<String> = self
            .phases
            .iter()
            .filter(|(_, p)| **p == Some(RequestPhase::Running))
            .map(|(n, _)| n.clone())
            .collect();
        if running.len() > self.max_running {
            self.max_running = running.len();
            self.at_max = running;
        }
    }

    fn terminal(&self) -> usize {
        self.phases
            .values()
            .filter(|p| p.is_some_and(RequestPhase::is_terminal))
            .count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_cannot_drown_the_operator_in_policies_and_queued_runs() {
    let _serial = serial().await;
    // The cluster's defaults for the minimum interval (a minute); small caps so the test
    // reaches them.
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        min_run_interval: None,
        operator_args: [
            "--max-concurrent-captures-per-namespace=1",
            "--max-policies-per-namespace=2",
            "--max-queued-runs-per-namespace=3",
        ]
        .map(String::from)
        .to_vec(),
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-drown").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    let mallory = tenant(&ns, "mallory").await;
    let requests: Api<ProfileRequest> = Api::namespaced(mallory.clone(), ns.name());
    let policies: Api<SamplingPolicy> = Api::namespaced(mallory, ns.name());

    // One long capture holds the namespace's only slot; three more queue behind it.
    let spec = |d: &str| json!({"type": "cpu", "podNames": ["web-1"], "duration": d});
    requests
        .create(
            &PostParams::default(),
            &pipeline.request("hog", spec("300s")),
        )
        .await
        .unwrap();
    pipeline
        .wait_for("the long capture to run", TIMEOUT, || {
            let api = requests.clone();
            async move {
                (phase(&api.get("hog").await.ok()?) == Some(RequestPhase::Running)).then_some(())
            }
        })
        .await;
    for i in 0..3 {
        requests
            .create(
                &PostParams::default(),
                &pipeline.request(&format!("queued-{i}"), spec("1s")),
            )
            .await
            .unwrap();
    }
    pipeline
        .wait_for("three queued requests", TIMEOUT, || {
            let api = requests.clone();
            async move {
                for i in 0..3 {
                    let r = api.get(&format!("queued-{i}")).await.ok()?;
                    let queued = r
                        .status
                        .as_ref()?
                        .conditions
                        .iter()
                        .any(|c| c.type_ == "Queued" && c.status == "True");
                    if !queued {
                        return None;
                    }
                }
                Some(())
            }
        })
        .await;

    // Three policies firing every second at a 100% duty cycle.
    let mut uids = Vec::new();
    for i in 0..3 {
        let policy = policies
            .create(
                &PostParams::default(),
                &pipeline.policy(
                    &format!("p-{i}"),
                    json!({
                        "schedule": "* * * * * *",
                        "template": {"type": "cpu", "podNames": ["web-1"], "duration": "1s"},
                        "budget": {"maxConcurrentCapturesPerNode": 100, "maxDutyCyclePercent": 100},
                    }),
                ),
            )
            .await
            .unwrap();
        uids.push(policy.uid().unwrap());
    }

    // The third is refused, in its status and with an Event.
    let refused = pipeline
        .wait_for("the third policy to be refused", TIMEOUT, || {
            let api = policies.clone();
            async move {
                let status = api.get("p-2").await.ok()?.status?;
                status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "Admitted" && c.status == "False")
                    .cloned()
            }
        })
        .await;
    assert_eq!(refused.reason, "TooManyPolicies");
    assert!(
        refused.message.contains("--max-policies-per-namespace")
            && refused.message.contains("oldest 2"),
        "{}",
        refused.message
    );
    let events: Api<Event> = ns.api();
    pipeline
        .wait_for("a TooManyPolicies event on p-2", TIMEOUT, || {
            let events = events.clone();
            async move {
                let list = events.list(&Default::default()).await.ok()?;
                list.items
                    .iter()
                    .any(|e| {
                        e.reason.as_deref() == Some("TooManyPolicies")
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("p-2")
                    })
                    .then_some(())
            }
        })
        .await;

    // The admitted ones pass over the full namespace, say why, and plan their next time
    // a minute after the last whatever the schedule says.
    for name in ["p-0", "p-1"] {
        let status = pipeline
            .wait_for("a run passed over for the full queue", TIMEOUT, || {
                let api = policies.clone();
                async move {
                    let status = api.get(name).await.ok()?.status?;
                    status
                        .last_run_skipped
                        .iter()
                        .any(|s| s.reason == "QueueFull")
                        .then_some(status)
                }
            })
            .await;
        let skipped = &status.last_run_skipped[0];
        assert!(
            skipped.message.contains("--max-queued-runs-per-namespace"),
            "{skipped:?}"
        );
        let last = status
            .last_schedule_time
            .as_ref()
            .expect("lastScheduleTime")
            .0;
        let next = status
            .next_schedule_time
            .as_ref()
            .expect("nextScheduleTime")
            .0;
        assert!(
            next.duration_since(last) >= k8s_openapi::jiff::SignedDuration::from_secs(60),
            "{name}: next {next} less than a minute after {last}"
        );
        let valid = status
            .conditions
            .iter()
            .find(|c| c.type_ == "ScheduleValid")
            .expect("ScheduleValid");
        assert!(
            valid.message.contains("--min-run-interval"),
            "{}",
            valid.message
        );
    }
    // No policy added to the queue.
    let all: Api<ProfileRequest> = ns.api();
    for uid in &uids {
        let runs = all
            .list(
                &kube::api::ListParams::default()
                    .labels(&format!("flamefleet.dev/policy-uid={uid}")),
            )
            .await
            .unwrap();
        assert!(
            runs.items.is_empty(),
            "{:?}",
            runs.items.iter().map(|r| r.name_any()).collect::<Vec<_>>()
        );
    }
    requests.delete("hog", &Default::default()).await.unwrap();
}
