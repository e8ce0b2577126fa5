//! The Flamefleet API against a real kube-apiserver: installation, round trips, validation,
//! the status subresource and printer columns.

use std::time::Instant;

use flamefleet_api::{
    ClusterSamplingPolicy, ProfileDownload, ProfileRequest, ProfileRequestStatus, RequestPhase,
    SamplingPolicy, crd_yaml,
};
use flamefleet_e2e::kubectl::kubectl;
use flamefleet_e2e::pods::PodFixture;
use flamefleet_e2e::{ControlPlane, TestNamespace};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, Resource};
use serde_json::{Value, json};

fn examples_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn example(file: &str) -> String {
    std::fs::read_to_string(examples_dir().join(file)).unwrap()
}

fn valid_preq(name: &str) -> Value {
    json!({
        "apiVersion": "flamefleet.dev/v1alpha1",
        "kind": "ProfileRequest",
        "metadata": {"name": name},
        "spec": {"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "30s"},
    })
}

fn valid_policy(kind: &str, name: &str) -> Value {
    json!({
        "apiVersion": "flamefleet.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": {
            "schedule": "*/5 * * * *",
            "template": {"type": "cpu", "selector": {"matchLabels": {"app": "web"}}, "duration": "10s"},
        },
    })
}

fn dynamic_api<K: Resource<DynamicType = ()>>(
    client: &Client,
    namespace: Option<&str>,
) -> Api<DynamicObject> {
    let resource = ApiResource::erase::<K>(&());
    match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

async fn create_raw(
    api: &Api<DynamicObject>,
    object: &Value,
) -> Result<DynamicObject, kube::Error> {
    let object: DynamicObject = serde_json::from_value(object.clone()).unwrap();
    api.create(&PostParams::default(), &object).await
}

#[tokio::test]
async fn crds_install_and_become_established() {
    let started = Instant::now();
    let ns = TestNamespace::create("established").await.unwrap();
    eprintln!(
        "control plane start {:.1}s (zero when reused); first namespace ready after {:.1}s",
        ns.control_plane().startup_time().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let api: Api<CustomResourceDefinition> = Api::all(ns.client());
    for crd in crd_yaml::crds() {
        let name = crd.metadata.name.clone().unwrap();
        let stored = api.get(&name).await.unwrap();
        let conditions = stored.status.unwrap().conditions.unwrap_or_default();
        for wanted in ["Established", "NamesAccepted"] {
            assert!(
                conditions
                    .iter()
                    .any(|c| c.type_ == wanted && c.status == "True"),
                "{name}: {wanted} is not True in {conditions:?}"
            );
        }
    }
}

#[tokio::test]
async fn valid_examples_are_accepted_and_round_trip_through_the_rust_types() {
    let ns = TestNamespace::create("roundtrip").await.unwrap();
    let pp = PostParams::default();

    let requests: Api<ProfileRequest> = ns.api();
    for file in [
        "profilerequest-cpu.yaml",
        "profilerequest-heap.yaml",
        "profilerequest-runqlat.yaml",
        "profilerequest-wall.yaml",
    ] {
        let local: ProfileRequest = serde_yaml::from_str(&example(file)).unwrap();
        let created = requests
            .create(&pp, &local)
            .await
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let fetched = requests
            .get(&local.metadata.name.clone().unwrap())
            .await
            .unwrap();
        assert_eq!(fetched.spec, local.spec, "{file}");
        assert_eq!(created.spec, local.spec, "{file}");
        assert_eq!(fetched.metadata.namespace.as_deref(), Some(ns.name()));
    }

    let policies: Api<SamplingPolicy> = ns.api();
    let local: SamplingPolicy = serde_yaml::from_str(&example("samplingpolicy.yaml")).unwrap();
    policies.create(&pp, &local).await.unwrap();
    let fetched = policies
        .get(&local.metadata.name.clone().unwrap())
        .await
        .unwrap();
    assert_eq!(fetched.spec, local.spec);

    // Cluster-scoped: give it a name unique to this test.
    let cluster: Api<ClusterSamplingPolicy> = Api::all(ns.client());
    let mut local: ClusterSamplingPolicy =
        serde_yaml::from_str(&example("clustersamplingpolicy.yaml")).unwrap();
    let name = ns.unique("fleet-runqlat");
    local.metadata.name = Some(name.clone());
    cluster.create(&pp, &local).await.unwrap();
    let fetched = cluster.get(&name).await.unwrap();
    assert_eq!(fetched.spec, local.spec);
    assert_eq!(
        fetched.spec.policy.template.profile_type.as_str(),
        "runqlat"
    );

    let downloads: Api<ProfileDownload> = ns.api();
    let local: ProfileDownload = serde_yaml::from_str(&example("profiledownload.yaml")).unwrap();
    let created = downloads.create(&pp, &local).await.unwrap();
    assert_eq!(created.spec, local.spec);
}

#[tokio::test]
async fn the_api_server_fills_in_schema_defaults() {
    let ns = TestNamespace::create("defaults").await.unwrap();
    let mut object = valid_preq("defaults");
    object["spec"]["cpu"] = json!({});
    let api = dynamic_api::<ProfileRequest>(&ns.client(), Some(ns.name()));
    create_raw(&api, &object).await.unwrap();
    let typed: Api<ProfileRequest> = ns.api();
    let stored = typed.get("defaults").await.unwrap();
    assert_eq!(stored.spec.cpu.unwrap().frequency_hz, 99);
}

/// One invalid object: a JSON pointer into a valid object, the value to put there (None
/// removes it), and a fragment the API server's message must contain.
struct Invalid {
    kind: &'static str,
    pointer: &'static str,
    value: Option<Value>,
    message: &'static str,
}

fn set_pointer(object: &mut Value, pointer: &str, value: Option<Value>) {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    let parent = object
        .pointer_mut(parent)
        .unwrap_or_else(|| panic!("no {parent}"));
    let map = parent.as_object_mut().unwrap();
    match value {
        Some(v) => map.insert(key.to_string(), v),
        None => map.remove(key),
    };
}

#[tokio::test]
async fn invalid_objects_are_rejected_with_a_clear_message() {
    let ns = TestNamespace::create("invalid").await.unwrap();
    let client = ns.client();
    let pattern = "should match";
    let schedule_forms = flamefleet_api::sampling_policy::SCHEDULE_FORMS;
    let cases = [
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/type",
            value: Some(json!("gpu")),
            message: r#"spec.type: Unsupported value: "gpu""#,
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/duration",
            value: Some(json!("0s")),
            message: "spec.duration: Invalid value: \"string\": duration must be at least 1s and at most 10m",
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/duration",
            value: Some(json!("-5s")),
            message: pattern,
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/duration",
            value: Some(json!("soon")),
            message: pattern,
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/duration",
            value: Some(json!("5 seconds")),
            message: pattern,
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/duration",
            value: Some(json!("11m")),
            message: "duration must be at least 1s and at most 10m",
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/duration",
            value: Some(json!("500ms")),
            message: "duration must be at least 1s and at most 10m",
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/cpu",
            value: Some(json!({"frequencyHz": 0})),
            message: "spec.cpu.frequencyHz: Invalid value: 0: spec.cpu.frequencyHz in body should be greater than or equal to 1",
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/cpu",
            value: Some(json!({"frequencyHz": 1001})),
            message: "should be less than or equal to 1000",
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/selector",
            value: None,
            message: "either selector or podNames must be set",
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/heap",
            value: Some(json!({"source": "auto"})),
            message: "heap options are only allowed when type is heap",
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/runqlat",
            value: Some(json!({"perProcess": true})),
            message: "runqlat options are only allowed when type is runqlat",
        },
        Invalid {
            kind: "ProfileRequest",
            pointer: "/spec/heap",
            value: Some(json!({"source": "magic"})),
            message: r#"Unsupported value: "magic""#,
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/schedule",
            value: Some(json!("every 5 minutes")),
            message: "spec.schedule: Invalid value",
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/schedule",
            value: Some(json!("@every 1m")),
            message: schedule_forms,
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/schedule",
            value: Some(json!("@minutely")),
            message: schedule_forms,
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/schedule",
            value: Some(json!("*/5 * * *")),
            message: schedule_forms,
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/schedule",
            value: Some(json!("99 99 99 99 99")),
            message: schedule_forms,
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/schedule",
            value: Some(json!("xyz abc def ghi jkl")),
            message: schedule_forms,
        },
        Invalid {
            kind: "ClusterSamplingPolicy",
            pointer: "/spec/schedule",
            value: Some(json!("0 24 * * *")),
            message: schedule_forms,
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/schedule",
            value: Some(json!("*/5 * * * * * *")),
            message: schedule_forms,
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/timeZone",
            value: Some(json!("../../etc/passwd")),
            message: pattern,
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/budget",
            value: Some(json!({"maxDutyCyclePercent": 0})),
            message: "should be greater than or equal to 1",
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/sampling",
            value: Some(json!({"maxPods": 1001})),
            message: "should be less than or equal to 1000",
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/sampling",
            value: Some(json!({"percent": 101})),
            message: "spec.sampling.percent: Invalid value: 101: spec.sampling.percent in body should be less than or equal to 100",
        },
        Invalid {
            kind: "SamplingPolicy",
            pointer: "/spec/template/cpu",
            value: Some(json!({"frequencyHz": 5000})),
            message: "spec.template.cpu.frequencyHz",
        },
        Invalid {
            kind: "ClusterSamplingPolicy",
            pointer: "/spec/template/type",
            value: Some(json!("heap")),
            message: "cpu options are only allowed when type is cpu",
        },
        Invalid {
            kind: "ClusterSamplingPolicy",
            pointer: "/spec/budget",
            value: Some(json!({"maxConcurrentCapturesPerNode": 0})),
            message: "should be greater than or equal to 1",
        },
    ];
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let name = format!("invalid-{i}");
        let (mut object, api) = match case.kind {
            "ProfileRequest" => (
                valid_preq(&name),
                dynamic_api::<ProfileRequest>(&client, Some(ns.name())),
            ),
            "SamplingPolicy" => (
                valid_policy(case.kind, &name),
                dynamic_api::<SamplingPolicy>(&client, Some(ns.name())),
            ),
            _ => {
                let mut object = valid_policy(case.kind, &ns.unique("invalid"));
                // Give this case the cpu options that the heap type then contradicts.
                object["spec"]["template"]["cpu"] = json!({"frequencyHz": 99});
                (object, dynamic_api::<ClusterSamplingPolicy>(&client, None))
            }
        };
        set_pointer(&mut object, case.pointer, case.value.clone());
        match create_raw(&api, &object).await {
            Ok(_) => failures.push(format!(
                "case {i} ({} {} = {:?}) was accepted",
                case.kind, case.pointer, case.value
            )),
            Err(kube::Error::Api(status)) => {
                if status.code != 422 || !status.message.contains(case.message) {
                    failures.push(format!(
                        "case {i} ({} {}): expected 422 containing {:?}, got {}: {}",
                        case.kind, case.pointer, case.message, status.code, status.message
                    ));
                }
                // One clear reason per bad value: no second error from a CEL rule that
                // could not parse what the pattern already refused, no 2 KB regex quoted.
                if status.message.contains("type conversion") || status.message.len() > 400 {
                    failures.push(format!(
                        "case {i} ({} {}): a confusing answer ({} bytes): {}",
                        case.kind,
                        case.pointer,
                        status.message.len(),
                        status.message
                    ));
                }
            }
            Err(e) => failures.push(format!("case {i}: unexpected error {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn profile_request_spec_is_immutable_but_metadata_is_not() {
    let ns = TestNamespace::create("immutable").await.unwrap();
    let api = dynamic_api::<ProfileRequest>(&ns.client(), Some(ns.name()));
    create_raw(&api, &valid_preq("frozen")).await.unwrap();

    let change_spec = json!({"spec": {"duration": "45s"}});
    let err = api
        .patch(
            "frozen",
            &PatchParams::default(),
            &Patch::Merge(&change_spec),
        )
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 422, "{status:?}");
            assert!(
                status.message.contains("spec is immutable"),
                "{}",
                status.message
            );
        }
        other => panic!("expected a 422, got {other}"),
    }

    let label = json!({"metadata": {"labels": {"team": "checkout"}}});
    api.patch("frozen", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();
    let typed: Api<ProfileRequest> = ns.api();
    assert_eq!(typed.get("frozen").await.unwrap().spec.duration, "30s");

    // A SamplingPolicy template, unlike a request, may change.
    let policies = dynamic_api::<SamplingPolicy>(&ns.client(), Some(ns.name()));
    create_raw(&policies, &valid_policy("SamplingPolicy", "editable"))
        .await
        .unwrap();
    let change_template = json!({"spec": {"template": {"duration": "20s"}}});
    policies
        .patch(
            "editable",
            &PatchParams::default(),
            &Patch::Merge(&change_template),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn status_is_written_only_through_the_status_subresource() {
    let ns = TestNamespace::create("subresource").await.unwrap();
    let api: Api<ProfileRequest> = ns.api();
    let local: ProfileRequest = serde_yaml::from_str(&example("profilerequest-cpu.yaml")).unwrap();
    let mut with_status = local.clone();
    with_status.status = Some(ProfileRequestStatus {
        phase: Some(RequestPhase::Succeeded),
        ..Default::default()
    });
    // Status sent with the main resource is dropped on create...
    let created = api
        .create(&PostParams::default(), &with_status)
        .await
        .unwrap();
    assert_eq!(created.status, None);

    // ...and on update.
    let status_patch = json!({"status": {"phase": "Failed"}});
    let patched = api
        .patch(
            "checkout-cpu",
            &PatchParams::default(),
            &Patch::Merge(&status_patch),
        )
        .await
        .unwrap();
    assert_eq!(patched.status, None);

    // Through the subresource it sticks, and spec changes sent there are ignored.
    let both = json!({"spec": {"duration": "5s"}, "status": {"phase": "Running", "podCount": 2, "nodeCount": 1}});
    let patched = api
        .patch_status(
            "checkout-cpu",
            &PatchParams::default(),
            &Patch::Merge(&both),
        )
        .await
        .unwrap();
    let status = patched.status.unwrap();
    assert_eq!(status.phase, Some(RequestPhase::Running));
    assert_eq!(status.pod_count, Some(2));
    assert_eq!(patched.spec.duration, "30s");

    // The status schema is enforced too.
    let bad = json!({"status": {"phase": "Exploded"}});
    let err = api
        .patch_status("checkout-cpu", &PatchParams::default(), &Patch::Merge(&bad))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(r#"Unsupported value: "Exploded""#),
        "{err}"
    );
}

#[tokio::test]
async fn kubectl_get_preq_shows_the_printer_columns() {
    let ns = TestNamespace::create("kubectl").await.unwrap();
    let api: Api<ProfileRequest> = ns.api();
    let local: ProfileRequest = serde_yaml::from_str(&example("profilerequest-cpu.yaml")).unwrap();
    api.create(&PostParams::default(), &local).await.unwrap();
    let status = json!({"status": {"phase": "Running", "podCount": 3, "nodeCount": 2,
        "nodeCounts": {"total": 2, "pending": 1, "succeeded": 1}}});
    api.patch_status(
        "checkout-cpu",
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await
    .unwrap();

    let kubeconfig = ns.control_plane().kubeconfig();
    let out = kubectl(kubeconfig, &["get", "preq", "-n", ns.name()]).unwrap();
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME",
            "TYPE",
            "PHASE",
            "PODS",
            "NODES",
            "SUCCEEDED",
            "FAILED",
            "REASON",
            "DURATION",
            "AGE"
        ],
        "{out}"
    );
    // REASON is empty while the request runs (and when it succeeds).
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        &row[..8],
        ["checkout-cpu", "cpu", "Running", "3", "2", "1", "0", "30s"],
        "{out}"
    );
    // A failed request says why.
    let mut failed = local.clone();
    failed.metadata.name = Some("failed-cpu".into());
    api.create(&PostParams::default(), &failed).await.unwrap();
    let status = json!({"status": {"phase": "Failed", "podCount": 0, "nodeCount": 0,
        "reason": "NoPodsMatched"}});
    api.patch_status(
        "failed-cpu",
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await
    .unwrap();
    let out = kubectl(kubeconfig, &["get", "preq", "failed-cpu", "-n", ns.name()]).unwrap();
    let row: Vec<&str> = out.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(
        &row[..6],
        ["failed-cpu", "cpu", "Failed", "0", "0", "NoPodsMatched"],
        "{out}"
    );

    // Future times print as times: a `date` column would print `<invalid>`.
    let in_ten_minutes = (k8s_openapi::jiff::Timestamp::now()
        + k8s_openapi::jiff::SignedDuration::from_secs(600))
    .strftime("%Y-%m-%dT%H:%M:%SZ")
    .to_string();
    let downloads: Api<ProfileDownload> = ns.api();
    let pdl: ProfileDownload = serde_yaml::from_str(&example("profiledownload.yaml")).unwrap();
    let pdl = downloads
        .create(&PostParams::default(), &pdl)
        .await
        .unwrap();
    downloads
        .patch_status(
            pdl.metadata.name.as_deref().unwrap(),
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"phase": "Ready", "expiresAt": in_ten_minutes}})),
        )
        .await
        .unwrap();
    let out = kubectl(kubeconfig, &["get", "pdl", "-n", ns.name()]).unwrap();
    assert!(
        out.lines().next().unwrap().contains("EXPIRES")
            && out.contains(&in_ten_minutes)
            && !out.contains("<invalid>"),
        "{out}"
    );
    let policies: Api<SamplingPolicy> = ns.api();
    let sp: SamplingPolicy = serde_yaml::from_str(&example("samplingpolicy.yaml")).unwrap();
    let sp = policies.create(&PostParams::default(), &sp).await.unwrap();
    policies
        .patch_status(
            sp.metadata.name.as_deref().unwrap(),
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {
                "nextScheduleTime": in_ten_minutes,
                "conditions": [{"type": "ScheduleValid", "status": "False",
                    "reason": "ScheduleNeverMatches", "message": "February 30",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]
            }})),
        )
        .await
        .unwrap();
    let out = kubectl(kubeconfig, &["get", "sp", "-n", ns.name()]).unwrap();
    // Columns by their offset in the header: the schedule holds spaces.
    let (header, row) = (out.lines().next().unwrap(), out.lines().nth(1).unwrap());
    let cell = |column: &str| {
        let at = header
            .find(column)
            .unwrap_or_else(|| panic!("no {column} column: {out}"));
        row[at..].split_whitespace().next().unwrap_or_default()
    };
    assert_eq!(cell("VALID"), "False", "{out}");
    assert_eq!(cell("NEXT"), in_ten_minutes, "{out}");
    assert!(!out.contains("<invalid>"), "{out}");

    // The category lists every Flamefleet kind.
    let out = kubectl(kubeconfig, &["get", "flamefleet", "-n", ns.name()]).unwrap();
    assert!(
        out.contains("profilerequest.flamefleet.dev/checkout-cpu"),
        "{out}"
    );
}

/// A slice of request `request` named `name` with `nodes` entries.
fn slice_json(name: &str, request: &ProfileRequest, nodes: usize) -> Value {
    let entries: Vec<Value> = (0..nodes)
        .map(|i| json!({"node": format!("node-{i:03}"), "phase": "Succeeded", "pods": ["web-0"]}))
        .collect();
    json!({
        "apiVersion": "flamefleet.dev/v1alpha1",
        "kind": "ProfileResultSlice",
        "metadata": {"name": name},
        "request": {"name": request.metadata.name, "uid": request.metadata.uid},
        "nodeCounts": {"total": nodes, "succeeded": nodes},
        "nodes": entries,
    })
}

#[tokio::test]
async fn result_slices_hold_at_most_100_nodes_and_show_their_counts() {
    let ns = TestNamespace::create("slices").await.unwrap();
    let requests: Api<ProfileRequest> = ns.api();
    let local: ProfileRequest = serde_yaml::from_str(&example("profilerequest-cpu.yaml")).unwrap();
    let request = requests
        .create(&PostParams::default(), &local)
        .await
        .unwrap();
    let api = dynamic_api::<flamefleet_api::ProfileResultSlice>(&ns.client(), Some(ns.name()));

    let err = create_raw(&api, &slice_json("too-big", &request, 101))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("must have at most 100 items"),
        "{err}"
    );
    let created = create_raw(&api, &slice_json("full", &request, 100))
        .await
        .unwrap();
    let slice: flamefleet_api::ProfileResultSlice =
        serde_json::from_value(serde_json::to_value(created).unwrap()).unwrap();
    assert_eq!(slice.spec.nodes.len(), 100);
    assert_eq!(slice.spec.request.name, "checkout-cpu");

    // Entries are keyed by node: a duplicate is refused.
    let mut dup = slice_json("dup", &request, 2);
    dup["nodes"][1]["node"] = json!("node-000");
    let err = create_raw(&api, &dup).await.unwrap_err();
    assert!(err.to_string().contains("Duplicate value"), "{err}");

    let out = kubectl(
        ns.control_plane().kubeconfig(),
        &["get", "prslice", "-n", ns.name()],
    )
    .unwrap();
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "REQUEST", "NODES", "SUCCEEDED", "FAILED", "AGE"],
        "{out}"
    );
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        &row[..5],
        ["full", "checkout-cpu", "100", "100", "0"],
        "{out}"
    );

    // The failure list of a request's status is bounded too.
    let failures: Vec<Value> = (0..21)
        .map(|i| json!({"node": format!("n{i}"), "reason": "TimedOut"}))
        .collect();
    let err = requests
        .patch_status(
            "checkout-cpu",
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"failures": failures}})),
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("must have at most 20 items"),
        "{err}"
    );
}

#[tokio::test]
async fn rbac_is_enforced_for_users_without_roles() {
    let ns = TestNamespace::create("rbac").await.unwrap();
    let kubeconfig = ns
        .control_plane()
        .kubeconfig_for_user("nobody", &[])
        .unwrap();
    let client = flamefleet_e2e::control_plane::client_from_kubeconfig(&kubeconfig)
        .await
        .unwrap();
    let api: Api<ProfileRequest> = Api::namespaced(client, ns.name());
    match api.list(&Default::default()).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403, "{status:?}");
            assert!(
                status
                    .message
                    .contains(r#"User "nobody" cannot list resource "profilerequests""#),
                "{}",
                status.message
            );
        }
        other => panic!("expected 403 Forbidden, got {other:?}"),
    }
}

#[tokio::test]
async fn running_pod_fixture_looks_like_a_kubelet_reported_it() {
    let ns = TestNamespace::create("pods").await.unwrap();
    let id = format!("containerd://{}", "0123456789abcdef".repeat(4));
    let fixture = PodFixture::new("web-1", "worker-a", &id).label("app", "web");
    ns.running_pod(&fixture).await.unwrap();
    let pod = ns.api::<Pod>().get("web-1").await.unwrap();
    assert_eq!(pod.spec.unwrap().node_name.as_deref(), Some("worker-a"));
    let status = pod.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Running"));
    let containers = status.container_statuses.unwrap();
    assert_eq!(containers[0].container_id.as_deref(), Some(id.as_str()));
    assert!(containers[0].ready);
    assert_eq!(pod.metadata.labels.unwrap()["app"], "web");
}

#[test]
fn shared_control_plane_reports_where_it_runs() {
    let cp = ControlPlane::shared().unwrap();
    assert!(cp.kubeconfig().is_file(), "{}", cp.kubeconfig().display());
}

#[tokio::test]
async fn well_formed_schedules_are_accepted() {
    let ns = TestNamespace::create("schedules").await.unwrap();
    let api = dynamic_api::<SamplingPolicy>(&ns.client(), Some(ns.name()));
    let schedules = [
        "*/5 * * * *",
        "0 9-17/2 * * MON-FRI",
        "30 2 1,15 jan,Jul *",
        "0 0 ? * sun",
        "*/20 * * * * *",
        "5 */2 * * * 0-6",
        "@hourly",
        "@daily",
    ];
    for (i, schedule) in schedules.iter().enumerate() {
        let mut object = valid_policy("SamplingPolicy", &format!("valid-{i}"));
        object["spec"]["schedule"] = json!(schedule);
        object["spec"]["timeZone"] = json!("America/New_York");
        create_raw(&api, &object)
            .await
            .unwrap_or_else(|e| panic!("{schedule:?} was refused: {e}"));
    }
}

fn policy_with_triggers(kind: &str, name: &str, triggers: Value) -> Value {
    let mut policy = valid_policy(kind, name);
    policy["spec"]["triggers"] = triggers;
    policy
}

#[tokio::test]
async fn policy_triggers_are_validated_by_the_api_server() {
    let ns = TestNamespace::create("triggers").await.unwrap();
    let client = ns.client();
    let sp = dynamic_api::<SamplingPolicy>(&client, Some(ns.name()));
    let good = json!([
        {"name": "near-limit", "memory": {"aboveLimitPercent": 90}, "cooldownSeconds": 600},
        {"name": "killed", "memory": {"event": "oomKill"}},
        {"name": "throttled", "cpu": {"throttledPercent": 50}, "capture": {"type": "cpu", "duration": "30s"}},
        {"name": "busy", "cpu": {"aboveMillicores": 1500, "forSeconds": 60}, "policyCooldownSeconds": 120},
        {"name": "stalled", "pressure": {"resource": "memory", "someAvg10Percent": 40}},
        {"name": "waiting", "latency": {"runqlatP99Micros": 20000, "windowSeconds": 30}},
    ]);
    create_raw(&sp, &policy_with_triggers("SamplingPolicy", "good", good))
        .await
        .expect("a policy with one trigger of each condition");
    let typed: Api<SamplingPolicy> = ns.api();
    let back = typed.get("good").await.unwrap();
    assert_eq!(back.spec.triggers.len(), 6);
    assert_eq!(
        back.spec.triggers[0].capture_type(),
        flamefleet_api::ProfileType::Heap
    );
    assert_eq!(
        back.spec.triggers[3].capture_type(),
        flamefleet_api::ProfileType::Cpu
    );
    assert_eq!(
        back.spec.triggers[5].capture_type(),
        flamefleet_api::ProfileType::Runqlat
    );
    let csp = dynamic_api::<ClusterSamplingPolicy>(&client, None);
    let cluster_name = format!("{}-good", ns.name());
    create_raw(
        &csp,
        &policy_with_triggers(
            "ClusterSamplingPolicy",
            &cluster_name,
            json!([{"name": "near-limit", "memory": {"aboveLimitPercent": 80}}]),
        ),
    )
    .await
    .expect("a cluster policy with a trigger");
    let _ = csp.delete(&cluster_name, &Default::default()).await;

    // Triggers only: no schedule. Without triggers a policy needs one.
    let mut trigger_only = policy_with_triggers(
        "SamplingPolicy",
        "trigger-only",
        json!([{"name": "near-limit", "memory": {"aboveLimitPercent": 90}}]),
    );
    trigger_only["spec"]
        .as_object_mut()
        .expect("a spec")
        .remove("schedule");
    create_raw(&sp, &trigger_only)
        .await
        .expect("a policy with triggers and no schedule");
    assert_eq!(typed.get("trigger-only").await.unwrap().spec.schedule, None);
    let mut neither = valid_policy("SamplingPolicy", "neither");
    neither["spec"]
        .as_object_mut()
        .expect("a spec")
        .remove("schedule");
    let err = create_raw(&sp, &neither)
        .await
        .expect_err("a policy with neither schedule nor triggers");
    assert!(
        err.to_string()
            .contains("a policy without a schedule captures on its triggers only"),
        "{err}"
    );

    let cases = [
        (
            json!([{"name": "two", "memory": {"aboveLimitPercent": 90}, "cpu": {"throttledPercent": 50}}]),
            "a trigger has exactly one condition: memory, cpu, pressure or latency",
        ),
        (
            json!([{"name": "none"}]),
            "a trigger has exactly one condition: memory, cpu, pressure or latency",
        ),
        (
            json!([{"name": "both", "memory": {"aboveLimitPercent": 90, "event": "oom"}}]),
            "a memory trigger has exactly one of aboveLimitPercent and event",
        ),
        (
            json!([{"name": "cpu", "cpu": {"throttledPercent": 50, "forSeconds": 10}}]),
            "forSeconds goes with aboveMillicores",
        ),
        (
            json!([{"name": "fast", "memory": {"aboveLimitPercent": 90}, "cooldownSeconds": 5}]),
            "should be greater than or equal to 60",
        ),
        (
            json!([{"name": "zero", "memory": {"aboveLimitPercent": 0}}]),
            "should be greater than or equal to 1",
        ),
        (
            json!([{"name": "over", "memory": {"aboveLimitPercent": 101}}]),
            "should be less than or equal to 100",
        ),
        (
            json!([{"name": "Bad_Name", "memory": {"aboveLimitPercent": 90}}]),
            "should match",
        ),
        (
            json!([{"name": "long", "memory": {"aboveLimitPercent": 90}, "capture": {"duration": "11m"}}]),
            "duration must be at least 1s and at most 10m",
        ),
        (
            json!([{"name": "lat", "latency": {"runqlatP99Micros": 0}}]),
            "should be greater than or equal to 1",
        ),
        (
            json!([{"name": "lat", "latency": {"runqlatP99Micros": 1000, "windowSeconds": 1}}]),
            "should be greater than or equal to 2",
        ),
        (
            json!([{"name": "lat", "latency": {"runqlatP99Micros": 1000, "windowSeconds": 301}}]),
            "should be less than or equal to 300",
        ),
        (
            json!([{"name": "lat", "latency": {"windowSeconds": 10}}]),
            "runqlatP99Micros: Required value",
        ),
        (
            json!([{"name": "psi", "pressure": {"resource": "disk", "someAvg10Percent": 40}}]),
            r#"Unsupported value: "disk""#,
        ),
        (
            json!([
                {"name": "same", "memory": {"aboveLimitPercent": 90}},
                {"name": "same", "cpu": {"throttledPercent": 50}},
            ]),
            "Duplicate value",
        ),
        (
            json!([{"name": "cool", "memory": {"aboveLimitPercent": 90}, "cooldownSeconds": 60, "policyCooldownSeconds": 120}]),
            "policyCooldownSeconds must not exceed cooldownSeconds",
        ),
        (
            Value::Array(
                (0..9)
                    .map(|i| json!({"name": format!("t{i}"), "memory": {"aboveLimitPercent": 90}}))
                    .collect(),
            ),
            "must have at most 8 items",
        ),
    ];
    for (i, (triggers, message)) in cases.into_iter().enumerate() {
        let err = create_raw(
            &sp,
            &policy_with_triggers("SamplingPolicy", &format!("bad-{i}"), triggers.clone()),
        )
        .await
        .expect_err(&format!("triggers {triggers} must be refused"));
        assert!(
            err.to_string().contains(message),
            "triggers {triggers}: expected {message:?}, got {err}"
        );
    }
}

#[tokio::test]
async fn a_triggered_runs_status_trigger_outlives_the_controllers_status_writes() {
    use flamefleet_api::status_apply::{OPERATOR_FIELD_MANAGER, status_apply_body};
    let ns = TestNamespace::create("trigger-status").await.unwrap();
    let api: Api<ProfileRequest> = ns.api();
    let request: ProfileRequest = serde_json::from_value(valid_preq("fired")).unwrap();
    api.create(&PostParams::default(), &request).await.unwrap();
    // The hub writes what fired under its own field manager...
    let fire = json!({
        "name": "near-limit", "condition": "memory above 60% of limit", "measured": "61.3",
        "threshold": "60.0", "unit": "%", "pod": "leaky", "node": "n1",
        "firedAt": "2026-11-29T03:00:00Z",
        "reason": "near-limit: memory above 60% of limit (measured 61.3%, threshold 60.0%)",
    });
    api.patch_status(
        "fired",
        &PatchParams::apply("flamefleet-operator.trigger").force(),
        &Patch::Apply(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": "fired"}, "status": {"trigger": fire},
        })),
    )
    .await
    .unwrap();
    // ...and the ProfileRequest controller's applies of a status without it keep it.
    for phase in [RequestPhase::Pending, RequestPhase::Running] {
        let status = ProfileRequestStatus {
            phase: Some(phase),
            ..Default::default()
        };
        api.patch_status(
            "fired",
            &PatchParams::apply(OPERATOR_FIELD_MANAGER).force(),
            &Patch::Apply(status_apply_body("fired", &status).unwrap()),
        )
        .await
        .unwrap();
    }
    let status = api.get("fired").await.unwrap().status.unwrap();
    assert_eq!(status.phase, Some(RequestPhase::Running));
    let trigger = status.trigger.expect("status.trigger kept");
    assert_eq!(trigger.measured, "61.3");
    assert_eq!(trigger.pod, "leaky");
    assert!(trigger.reason.starts_with("near-limit: memory above 60%"));
}
