//! End to end, fleet sampling: SamplingPolicies on the real control plane with real agents
//! capturing real workloads. Schedules use the seconds field (`*/3 * * * * *`) so a test
//! drives many runs in seconds, through the same code path as minute schedules.

mod pipeline_support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use flamefleet_api::conditions::find_condition;
use flamefleet_api::{ProfileRequest, RequestPhase, SamplingPolicy};
use flamefleet_e2e::TestNamespace;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use pipeline_support::{
    Pipeline, PipelineOptions, is_terminal, kubectl_profile, runs_of, scheduled_second, serial,
};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(120);

async fn create_policy(ns: &TestNamespace, policy: &SamplingPolicy) -> SamplingPolicy {
    let api: Api<SamplingPolicy> = ns.api();
    api.create(&PostParams::default(), policy)
        .await
        .expect("creating the SamplingPolicy")
}

async fn suspend(ns: &TestNamespace, name: &str) {
    let api: Api<SamplingPolicy> = ns.api();
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"suspend": true}})),
    )
    .await
    .expect("suspending the policy");
}

async fn policy_now(ns: &TestNamespace, name: &str) -> SamplingPolicy {
    let api: Api<SamplingPolicy> = ns.api();
    api.get(name).await.expect("getting the policy")
}

/// The Events (events.k8s.io) about policy `policy` with reason `reason` (any when empty).
async fn policy_events(ns: &TestNamespace, policy: &str, reason: &str) -> Vec<Event> {
    let api: Api<Event> = ns.api();
    api.list(&Default::default())
        .await
        .expect("listing events")
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(policy)
                && (reason.is_empty() || e.reason.as_deref() == Some(reason))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_runs_repeatedly_and_history_limits_delete_old_runs_and_artifacts() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-sp-runs").await.unwrap();
    for (i, node) in [0, 1, 0].into_iter().enumerate() {
        pipeline
            .pod(&ns, &format!("web-{i}"), node, &[("app", "web")], "spin", 1)
            .await;
    }
    let policy = create_policy(
        &ns,
        &pipeline.policy(
            "web-cpu",
            json!({
                "schedule": "*/3 * * * * *",
                "template": {"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"},
                "sampling": {"maxPods": 2},
                "budget": {"maxConcurrentCapturesPerNode": 4},
                "history": {"successfulRunsHistoryLimit": 2, "failedRunsHistoryLimit": 1},
            }),
        ),
    )
    .await;
    let uid = policy.uid().unwrap();
    let client = ns.client();

    // Three runs succeed, each a ProfileRequest owned by the policy, with artifacts. Each
    // succeeded run's artifacts are read from its slices when it is first seen: the history
    // limit deletes the oldest run (and its slices) as soon as the third succeeds.
    type Seen = BTreeMap<String, (ProfileRequest, Vec<flamefleet_api::Artifact>)>;
    let cache: std::sync::Arc<tokio::sync::Mutex<Seen>> = Default::default();
    let seen: Seen = pipeline
        .wait_for("three succeeded runs", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            let cache = cache.clone();
            async move {
                let mut cache = cache.lock().await;
                for run in runs_of(&client, &uid).await {
                    let succeeded =
                        run.status.as_ref().and_then(|s| s.phase) == Some(RequestPhase::Succeeded);
                    if !succeeded || cache.contains_key(&run.name_any()) {
                        continue;
                    }
                    let results = flamefleet_api::results::fetch(&client, &run)
                        .await
                        .expect("listing result slices");
                    if results.incomplete() {
                        continue; // deleted meanwhile
                    }
                    let artifacts = results.artifacts().map(|(_, a)| a.clone()).collect();
                    cache.insert(run.name_any(), (run, artifacts));
                }
                (cache.len() >= 3).then(|| cache.clone())
            }
        })
        .await;
    for (run, artifacts) in seen.values() {
        let owner = &run.owner_references()[0];
        assert_eq!(owner.kind, "SamplingPolicy");
        assert_eq!(owner.uid, uid);
        assert_eq!(owner.controller, Some(true));
        assert_eq!(run.labels()["flamefleet.dev/policy"], "web-cpu");
        assert_eq!(run.spec.pod_names.len(), 2, "maxPods: 2");
        assert!(run.spec.selector.is_none());
        assert_eq!(run.spec.cpu.as_ref().map(|c| c.frequency_hz), Some(19));
        assert!(!artifacts.is_empty(), "{:#?}", run.status);
        assert_eq!(
            run.name_any(),
            format!("web-cpu-{}", scheduled_second(run)),
            "run names derive from the scheduled time"
        );
    }

    // History limits: the oldest succeeded run goes, and its artifacts with it.
    let (oldest, oldest_artifacts) = seen
        .values()
        .min_by_key(|(r, _)| scheduled_second(r))
        .cloned()
        .unwrap();
    let artifact = oldest_artifacts.into_iter().next().unwrap();
    let oldest_name = oldest.name_any();
    let stored = pipeline.stored_artifact(&oldest, &artifact.name);
    let api: Api<ProfileRequest> = ns.api();
    pipeline
        .wait_for("the oldest run to be deleted", TIMEOUT, || {
            let api = api.clone();
            let name = oldest_name.clone();
            async move { api.get_opt(&name).await.unwrap().is_none().then_some(()) }
        })
        .await;
    assert!(
        !stored.exists(),
        "the deleted run's artifact is gone from the store: {}",
        stored.display()
    );
    suspend(&ns, "web-cpu").await;
    // Once idle, at most 2 succeeded runs are kept (plus none failed).
    pipeline
        .wait_for("history within the limits", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move {
                let runs = runs_of(&client, &uid).await;
                let all_done = runs.iter().all(is_terminal);
                let ok = runs
                    .iter()
                    .filter(|r| {
                        r.status.as_ref().and_then(|s| s.phase) == Some(RequestPhase::Succeeded)
                    })
                    .count();
                (all_done && ok <= 2 && !runs.is_empty()).then_some(())
            }
        })
        .await;
    // One RunCreated Event per run, each naming its own run (not one series whose note
    // names the first run forever).
    let created = policy_events(&ns, "web-cpu", "RunCreated").await;
    let named: BTreeSet<String> = created
        .iter()
        .filter_map(|e| e.related.as_ref().and_then(|r| r.name.clone()))
        .collect();
    assert_eq!(
        named.len(),
        created.len(),
        "one Event per run: {created:#?}"
    );
    for run in seen.keys() {
        let event = created
            .iter()
            .find(|e| e.related.as_ref().and_then(|r| r.name.as_deref()) == Some(run.as_str()))
            .unwrap_or_else(|| panic!("no RunCreated Event for {run}: {created:#?}"));
        let note = event.note.as_deref().unwrap_or_default();
        assert!(note.contains(run.as_str()), "{note}");
    }
    let status = policy_now(&ns, "web-cpu").await.status.unwrap();
    assert!(status.last_successful_time.is_some(), "{status:#?}");
    assert!(status.last_schedule_time.is_some(), "{status:#?}");
    assert!(
        find_condition(&status.conditions, "ScheduleValid").is_some_and(|c| c.status == "True"),
        "{status:#?}"
    );
    let metrics = pipeline.operator_metrics().await;
    assert!(
        metrics.contains("flamefleet_operator_policy_runs_total"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_profiles_every_pod_once_before_any_twice_and_covers_newcomers() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 3,
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-sp-rotation").await.unwrap();
    for i in 0..12 {
        pipeline
            .pod(
                &ns,
                &format!("svc-{i:02}"),
                i % 3,
                &[("app", "svc")],
                "wake",
                1,
            )
            .await;
    }
    let policy = create_policy(
        &ns,
        &pipeline.policy(
            "svc-rotation",
            json!({
                "schedule": "*/3 * * * * *",
                "template": {"type": "cpu", "selector": {"matchLabels": {"app": "svc"}}, "duration": "1s"},
                "sampling": {"maxPods": 4},
                "budget": {"maxConcurrentCapturesPerNode": 10},
            }),
        ),
    )
    .await;
    let uid = policy.uid().unwrap();
    let client = ns.client();
    let first_three = pipeline
        .wait_for("three runs", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move {
                let runs = runs_of(&client, &uid).await;
                (runs.len() >= 3).then(|| runs[..3].to_vec())
            }
        })
        .await;
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for run in &first_three {
        assert_eq!(run.spec.pod_names.len(), 4, "{}", run.name_any());
        for pod in &run.spec.pod_names {
            *counts.entry(pod.clone()).or_default() += 1;
        }
    }
    assert_eq!(counts.len(), 12, "every pod once in three runs: {counts:?}");
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");

    // The status shows the completed rotation and full coverage.
    pipeline
        .wait_for("coverage 12/12 in the status", TIMEOUT, || {
            let ns = ns.clone();
            async move {
                let status = policy_now(&ns, "svc-rotation").await.status?;
                let c = status.coverage?;
                (c.rotations_completed >= 1
                    && c.covered_pods == 12
                    && c.matching_pods == 12
                    && c.last_rotation_pods == Some(12))
                .then_some(())
            }
        })
        .await;

    // A pod added now (mid-rotation) is profiled within the next rotation.
    let runs_before = runs_of(&client, &uid).await.len();
    pipeline
        .pod(&ns, "svc-new", 0, &[("app", "svc")], "wake", 1)
        .await;
    let runs = pipeline
        .wait_for("the new pod in a run", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move {
                let runs = runs_of(&client, &uid).await;
                runs.iter()
                    .any(|r| r.spec.pod_names.iter().any(|p| p == "svc-new"))
                    .then_some(runs)
            }
        })
        .await;
    // 13 pods, 4 per run: the rest of this rotation plus the next one is at most 7 runs.
    let position = runs
        .iter()
        .position(|r| r.spec.pod_names.iter().any(|p| p == "svc-new"))
        .unwrap();
    assert!(
        position < runs_before + 7,
        "svc-new first profiled in run {position}, {runs_before} runs existed when it appeared"
    );
    suspend(&ns, "svc-rotation").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_run_yields_a_node_busy_with_an_ad_hoc_capture_and_says_why() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-sp-budget").await.unwrap();
    pipeline
        .pod(&ns, "busy", 0, &[("app", "db")], "spin", 1)
        .await;
    pipeline
        .pod(&ns, "idle", 1, &[("app", "db")], "spin", 1)
        .await;
    // An ad hoc capture of 30s on node 0.
    let requests: Api<ProfileRequest> = ns.api();
    let adhoc = pipeline.request(
        "adhoc",
        json!({"type": "cpu", "podNames": ["busy"], "duration": "30s"}),
    );
    requests
        .create(&PostParams::default(), &adhoc)
        .await
        .unwrap();
    pipeline
        .wait_for("the ad hoc request Running", TIMEOUT, || {
            let requests = requests.clone();
            async move {
                let r = requests.get("adhoc").await.ok()?;
                (r.status?.phase == Some(RequestPhase::Running)).then_some(())
            }
        })
        .await;
    let policy = create_policy(
        &ns,
        &pipeline.policy(
            "db-cpu",
            json!({
                "schedule": "*/2 * * * * *",
                "template": {"type": "cpu", "selector": {"matchLabels": {"app": "db"}}, "duration": "1s"},
                "sampling": {"maxPods": 2},
                "budget": {"maxConcurrentCapturesPerNode": 1},
            }),
        ),
    )
    .await;
    let uid = policy.uid().unwrap();
    let client = ns.client();
    let first = pipeline
        .wait_for("the first run", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move { runs_of(&client, &uid).await.into_iter().next() }
        })
        .await;
    assert_eq!(first.spec.pod_names, ["idle"], "the busy node was skipped");
    let status = policy_now(&ns, "db-cpu").await.status.unwrap();
    assert!(status.skipped_for_budget.unwrap_or(0) >= 1, "{status:#?}");
    let skipped = status
        .last_run_skipped
        .iter()
        .find(|s| s.pod == "busy")
        .unwrap_or_else(|| panic!("busy not recorded as skipped: {status:#?}"));
    assert_eq!(skipped.reason, "ConcurrentCaptures");
    assert!(
        skipped
            .message
            .contains(&format!("{}/adhoc (ad hoc cpu)", ns.name())),
        "{}",
        skipped.message
    );
    assert_eq!(skipped.node, pipeline.nodes[0]);
    suspend(&ns, "db-cpu").await;

    // A policy whose only pod is on the busy node: each run is skipped, and a skipped run
    // profiled nobody, so it completes no rotation and leaves the coverage alone.
    pipeline
        .pod(&ns, "solo", 0, &[("app", "solo")], "spin", 1)
        .await;
    create_policy(
        &ns,
        &pipeline.policy(
            "solo-cpu",
            json!({
                "schedule": "*/2 * * * * *",
                "template": {"type": "cpu", "selector": {"matchLabels": {"app": "solo"}}, "duration": "1s"},
                "budget": {"maxConcurrentCapturesPerNode": 1},
            }),
        ),
    )
    .await;
    pipeline
        .wait_for("two skipped runs of solo-cpu", TIMEOUT, || {
            let ns = &ns;
            async move {
                let skipped = policy_events(ns, "solo-cpu", "RunSkipped").await;
                skipped
                    .iter()
                    .any(|e| e.series.as_ref().is_some_and(|s| s.count >= 2))
                    .then_some(())
            }
        })
        .await;
    let status = policy_now(&ns, "solo-cpu").await.status.unwrap();
    let adhoc_phase = requests
        .get("adhoc")
        .await
        .unwrap()
        .status
        .and_then(|s| s.phase);
    assert_eq!(
        adhoc_phase,
        Some(RequestPhase::Running),
        "the ad hoc capture must outlast the skipped runs for this check to mean anything"
    );
    let rotation = status.rotation.clone().unwrap_or_default();
    let coverage = status.coverage.clone().unwrap_or_default();
    assert_eq!(coverage.rotations_completed, 0, "{status:#?}");
    assert_eq!(rotation.number, 1, "{status:#?}");
    assert_eq!(rotation.deferred.len(), 1, "the pod is owed: {status:#?}");
    // The ad hoc request was never held back.
    let phases = pipeline.watch_phases(&requests, "adhoc").await;
    let (done, _) = pipeline
        .wait_terminal(&requests, "adhoc", TIMEOUT, phases)
        .await;
    assert_eq!(done.status.unwrap().phase, Some(RequestPhase::Succeeded));
    // The node is free: the owed pod is profiled and its rotation completes.
    let status = pipeline
        .wait_for("solo-cpu's rotation to complete", TIMEOUT, || {
            let ns = &ns;
            async move {
                let status = policy_now(ns, "solo-cpu").await.status?;
                (status.coverage.as_ref()?.rotations_completed >= 1).then_some(status)
            }
        })
        .await;
    suspend(&ns, "solo-cpu").await;
    let coverage = status.coverage.clone().unwrap_or_default();
    assert_eq!(coverage.summary, "1/1 (100%)", "{status:#?}");
    assert_eq!(coverage.last_rotation_pods, Some(1), "{coverage:#?}");
    let metrics = pipeline.operator_metrics().await;
    assert!(
        metrics.contains("flamefleet_operator_budget_skips_total"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_between_scheduled_times_creates_no_duplicate_and_misses_no_run() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-sp-restart").await.unwrap();
    pipeline
        .pod(&ns, "api-0", 0, &[("app", "api")], "wake", 1)
        .await;
    pipeline
        .pod(&ns, "api-1", 1, &[("app", "api")], "wake", 1)
        .await;
    let policy = create_policy(
        &ns,
        &pipeline.policy(
            "api-cpu",
            json!({
                "schedule": "*/5 * * * * *",
                "startingDeadlineSeconds": 60,
                "template": {"type": "cpu", "selector": {"matchLabels": {"app": "api"}}, "duration": "1s"},
                "sampling": {"maxPods": 1},
                "budget": {"maxConcurrentCapturesPerNode": 10},
            }),
        ),
    )
    .await;
    let uid = policy.uid().unwrap();
    let client = ns.client();
    let first = pipeline
        .wait_for("a first run", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move { runs_of(&client, &uid).await.into_iter().next() }
        })
        .await;
    let t0 = scheduled_second(&first);
    pipeline.kill_operator();
    // Stay down across two scheduled times (t0+5, t0+10), then restart.
    let until = t0 + 12;
    while k8s_openapi::jiff::Timestamp::now().as_second() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    pipeline.start_operator();
    let runs = pipeline
        .wait_for("runs through t0+15", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move {
                let runs = runs_of(&client, &uid).await;
                runs.iter()
                    .any(|r| scheduled_second(r) >= t0 + 15)
                    .then_some(runs)
            }
        })
        .await;
    let times: Vec<i64> = runs.iter().map(scheduled_second).collect();
    let distinct: BTreeSet<i64> = times.iter().copied().collect();
    let status = policy_now(&ns, "api-cpu").await.status.unwrap();
    let events: Vec<String> = policy_events(&ns, "api-cpu", "")
        .await
        .into_iter()
        .map(|e| {
            format!(
                "{}: {}",
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default()
            )
        })
        .collect();
    assert_eq!(
        distinct.len(),
        times.len(),
        "a duplicate run: {times:?}; {status:#?}; {events:#?}"
    );
    for t in [t0, t0 + 5, t0 + 10, t0 + 15] {
        assert!(
            distinct.contains(&t),
            "no run at {t} (t0 = {t0}): {times:?}; {status:#?}; {events:#?}"
        );
    }
    assert_eq!(status.missed_runs.unwrap_or(0), 0, "{status:#?}");
    suspend(&ns, "api-cpu").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_past_the_schema_and_empty_selectors_are_reported_in_conditions() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-sp-conditions").await.unwrap();
    let template =
        json!({"type": "cpu", "selector": {"matchLabels": {"app": "nothing"}}, "duration": "1s"});
    let cases = [
        (
            "feb-30",
            json!({"schedule": "0 0 30 2 *", "template": template}),
            "ScheduleValid",
            "ScheduleNeverMatches",
        ),
        (
            "mars",
            json!({"schedule": "* * * * *", "timeZone": "Mars/Olympus", "template": template}),
            "ScheduleValid",
            "UnknownTimeZone",
        ),
        (
            "nothing",
            json!({"schedule": "* * * * * *", "template": template}),
            "PodsMatched",
            "NoEligiblePods",
        ),
    ];
    for (name, spec, _, _) in &cases {
        create_policy(&ns, &pipeline.policy(name, spec.clone())).await;
    }
    for (name, _, condition, reason) in cases.clone() {
        let ns2 = ns.clone();
        let status = pipeline
            .wait_for(&format!("{condition}=False on {name}"), TIMEOUT, || {
                let ns = ns2.clone();
                async move {
                    let status = policy_now(&ns, name).await.status?;
                    find_condition(&status.conditions, condition)
                        .is_some_and(|c| c.status == "False")
                        .then_some(status)
                }
            })
            .await;
        let c = find_condition(&status.conditions, condition).unwrap();
        assert_eq!(c.reason, reason, "{name}: {c:?}");
        assert!(!c.message.is_empty());
        let uid = policy_now(&ns, name).await.uid().unwrap();
        assert!(
            runs_of(&ns.client(), &uid).await.is_empty(),
            "{name} created runs"
        );
    }
    // "nothing" would otherwise be reconciled every second by the operators of the tests
    // after this one (the control plane is the test process's).
    for (name, ..) in &cases {
        suspend(&ns, name).await;
    }
}

/// The total of the first sample value of a gzipped pprof file.
fn sample_total(file: &std::path::Path) -> i64 {
    use std::io::Read as _;
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(file).unwrap())
        .read_to_end(&mut raw)
        .unwrap();
    let profile = <flamefleet_proto::pprof::Profile as prost::Message>::decode(raw.as_slice())
        .expect("a pprof profile");
    profile.sample.iter().map(|s| s.value[0]).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_view_merges_every_run_of_the_window_into_one_profile() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let ns = TestNamespace::create("ff-sp-view").await.unwrap();
    for (i, node) in [0, 1].into_iter().enumerate() {
        pipeline
            .pod(&ns, &format!("web-{i}"), node, &[("app", "web")], "spin", 1)
            .await;
    }
    let policy = create_policy(
        &ns,
        &pipeline.policy(
            "web-view",
            json!({
                "schedule": "*/3 * * * * *",
                "template": {"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"},
                "sampling": {"maxPods": 1},
                "budget": {"maxConcurrentCapturesPerNode": 4},
                "history": {"successfulRunsHistoryLimit": 20},
            }),
        ),
    )
    .await;
    let uid = policy.uid().unwrap();
    let client = ns.client();
    pipeline
        .wait_for("three succeeded runs", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move {
                let runs = runs_of(&client, &uid).await;
                let ok = runs
                    .iter()
                    .filter(|r| {
                        r.status.as_ref().and_then(|s| s.phase) == Some(RequestPhase::Succeeded)
                    })
                    .count();
                (ok >= 3).then_some(())
            }
        })
        .await;
    suspend(&ns, "web-view").await;
    let runs = pipeline
        .wait_for("every run to finish", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move {
                let runs = runs_of(&client, &uid).await;
                runs.iter().all(is_terminal).then_some(runs)
            }
        })
        .await;
    let succeeded: Vec<&ProfileRequest> = runs
        .iter()
        .filter(|r| r.status.as_ref().and_then(|s| s.phase) == Some(RequestPhase::Succeeded))
        .collect();
    assert!(succeeded.len() >= 3);

    // `list sp/NAME`: every run, one line each.
    let (ok, text) = kubectl_profile(&pipeline.kubeconfig, ns.name(), &["list", "sp/web-view"]);
    assert!(ok, "{text}");
    for run in &runs {
        assert!(
            text.contains(&run.name_any()),
            "{} missing:\n{text}",
            run.name_any()
        );
    }

    // `get sp/NAME --since 1h`: one merged profile whose total is the runs' totals.
    let dir = tempfile::tempdir().unwrap();
    let (ok, text) = kubectl_profile(
        &pipeline.kubeconfig,
        ns.name(),
        &[
            "get",
            "sp/web-view",
            "--since",
            "1h",
            "-o",
            dir.path().to_str().unwrap(),
        ],
    );
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("{} finished runs", succeeded.len())),
        "{text}"
    );
    let merged = dir.path().join("web-view-cpu.pb.gz");
    assert!(merged.exists(), "{text}");
    let top = pipeline_support::pprof_top(&merged);
    assert!(!top.trim().is_empty());
    let mut expected = 0;
    for run in &succeeded {
        for a in pipeline_support::artifacts_of(&pipeline.client, run).await {
            let file = pipeline.download(run, &a).await;
            expected += sample_total(&file);
        }
    }
    assert_eq!(
        sample_total(&merged),
        expected,
        "the merged total is the sum of the runs' totals"
    );
    // Each sample remembers its run.
    let tags = std::process::Command::new("go")
        .args(["tool", "pprof", "-tags"])
        .arg(&merged)
        .output()
        .unwrap();
    let tags = String::from_utf8_lossy(&tags.stdout);
    for run in &succeeded {
        assert!(
            tags.contains(&run.name_any()),
            "run label of {}:\n{tags}",
            run.name_any()
        );
    }
    // A window with nothing in it says so.
    let (ok, text) = kubectl_profile(
        &pipeline.kubeconfig,
        ns.name(),
        &[
            "get",
            "csp/no-such-policy",
            "--since",
            "1h",
            "-o",
            dir.path().to_str().unwrap(),
        ],
    );
    assert!(
        !ok && text.contains("csp/no-such-policy not found"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_policy_samples_only_the_namespaces_it_selects() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions::default()).await;
    let chosen = TestNamespace::create("ff-csp-in").await.unwrap();
    let other = TestNamespace::create("ff-csp-out").await.unwrap();
    let team = format!("team-{}", pipeline.id);
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(chosen.client());
    namespaces
        .patch(
            chosen.name(),
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"flamefleet-test-team": team}}})),
        )
        .await
        .unwrap();
    pipeline
        .pod(&chosen, "web-in", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&other, "web-out", 1, &[("app", "web")], "spin", 1)
        .await;
    let name = chosen.unique("fleet-web");
    let policies: Api<flamefleet_api::ClusterSamplingPolicy> = Api::all(chosen.client());
    let policy = policies
        .create(
            &PostParams::default(),
            &pipeline.cluster_policy(
                &name,
                json!({
                    "namespaceSelector": {"matchLabels": {"flamefleet-test-team": team}},
                    "schedule": "*/3 * * * * *",
                    "template": {"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "1s"},
                    "sampling": {"maxPods": 4},
                    "budget": {"maxConcurrentCapturesPerNode": 4},
                }),
            ),
        )
        .await
        .unwrap();
    let uid = policy.uid().unwrap();
    let client = chosen.client();
    let runs = pipeline
        .wait_for("two succeeded runs", TIMEOUT, || {
            let client = client.clone();
            let uid = uid.clone();
            async move {
                let runs = runs_of(&client, &uid).await;
                let ok = runs
                    .iter()
                    .filter(|r| {
                        r.status.as_ref().and_then(|s| s.phase) == Some(RequestPhase::Succeeded)
                    })
                    .count();
                (ok >= 2).then_some(runs)
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
    for run in &runs {
        assert_eq!(
            run.namespace().as_deref(),
            Some(chosen.name()),
            "a run outside the selected namespaces: {}",
            run.name_any()
        );
        let owner = &run.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("ClusterSamplingPolicy", uid.as_str())
        );
        assert_eq!(run.spec.pod_names, ["web-in"]);
    }
    let in_other: Api<ProfileRequest> = other.api();
    assert!(
        in_other
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    // Events about the cluster-scoped policy land in `default`, where any tenant may read
    // events: they name none of the selected namespaces or pods.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(chosen.client(), "default");
    let about: Vec<_> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str()))
        .collect();
    assert!(
        about
            .iter()
            .any(|e| e.reason.as_deref() == Some("RunCreated")),
        "no RunCreated event about {name} in default: {about:#?}"
    );
    for event in &about {
        let note = event.note.clone().unwrap_or_default();
        for secret in [chosen.name(), other.name(), "web-in", "web-out"] {
            assert!(
                !note.contains(secret),
                "an event in the default namespace names {secret}: {note}"
            );
        }
        assert!(
            event.related.is_none(),
            "an event in the default namespace points at {:?}",
            event.related
        );
    }
    // The cluster fleet view downloads across the runs' namespaces.
    let dir = tempfile::tempdir().unwrap();
    let (ok, text) = kubectl_profile(
        &pipeline.kubeconfig,
        chosen.name(),
        &[
            "get",
            &format!("csp/{name}"),
            "--since",
            "1h",
            "-o",
            dir.path().to_str().unwrap(),
        ],
    );
    assert!(ok, "{text}");
    assert!(
        dir.path().join(format!("{name}-cpu.pb.gz")).exists(),
        "{text}"
    );
    policies.delete(&name, &Default::default()).await.unwrap();
}
