//! Per-tenant limits, end to end with the real operator and agents: a namespace at its limit
//! of concurrent captures queues its next request (Pending, `Queued` saying why) while
//! another namespace is unaffected, and the queued request starts once a slot frees; a
//! request below the minimum heap sampling interval, or one that would switch the heap or
//! off-CPU overhead guard off or raise it past the cluster admin's ceiling, fails with the
//! limit and who sets it.

mod pipeline_support;

use std::time::Duration;

use flamefleet_api::{ProfileRequest, RequestPhase};
use flamefleet_e2e::TestNamespace;
use kube::api::{Api, PostParams};
use pipeline_support::{Pipeline, PipelineOptions, serial};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(90);

fn phase(r: &ProfileRequest) -> Option<RequestPhase> {
    r.status.as_ref().and_then(|s| s.phase)
}

fn condition<'r>(
    r: &'r ProfileRequest,
    kind: &str,
) -> Option<&'r k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    r.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == kind))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_at_its_limit_queues_while_others_run() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        operator_args: vec!["--max-concurrent-captures-per-namespace".into(), "1".into()],
        ..Default::default()
    })
    .await;
    let a = TestNamespace::create("ff-limit-a").await.unwrap();
    let b = TestNamespace::create("ff-limit-b").await.unwrap();
    pipeline
        .pod(&a, "web-a", 0, &[("app", "web")], "spin", 1)
        .await;
    pipeline
        .pod(&b, "web-b", 0, &[("app", "web")], "spin", 1)
        .await;
    let spec = |secs: u32| json!({"type": "cpu", "podNames": [], "duration": format!("{secs}s")});
    let mut long = spec(6);
    long["podNames"] = json!(["web-a"]);
    let mut short = spec(1);
    short["podNames"] = json!(["web-a"]);
    let mut other = spec(1);
    other["podNames"] = json!(["web-b"]);

    let api_a: Api<ProfileRequest> = a.api();
    api_a
        .create(&PostParams::default(), &pipeline.request("first", long))
        .await
        .unwrap();
    pipeline
        .wait_for("the first request to run", TIMEOUT, || {
            let api = api_a.clone();
            async move {
                (phase(&api.get("first").await.unwrap()) == Some(RequestPhase::Running))
                    .then_some(())
            }
        })
        .await;
    api_a
        .create(&PostParams::default(), &pipeline.request("second", short))
        .await
        .unwrap();
    let queued = pipeline
        .wait_for("the second request to be queued", TIMEOUT, || {
            let api = api_a.clone();
            async move {
                let r = api.get("second").await.unwrap();
                condition(&r, "Queued")
                    .filter(|c| c.status == "True")
                    .map(|c| (phase(&r), c.message.clone()))
            }
        })
        .await;
    assert_eq!(queued.0, Some(RequestPhase::Pending));
    assert!(
        queued.1.contains(&format!(
            "namespace {} already has 1 captures running (limit 1)",
            a.name()
        )),
        "{}",
        queued.1
    );

    // Namespace B is not held up by A's limit: it runs to the end while A's first capture
    // is still running.
    let (done_b, _) = pipeline
        .run(&b, &pipeline.request("other", other), TIMEOUT)
        .await;
    assert_eq!(phase(&done_b), Some(RequestPhase::Succeeded));
    let first = api_a.get("first").await.unwrap();
    assert_eq!(
        phase(&first),
        Some(RequestPhase::Running),
        "B finished while A's first capture still ran"
    );

    // Once the first finishes, the queued one starts and succeeds.
    let phases = pipeline.watch_phases(&api_a, "second").await;
    let (second, _) = pipeline
        .wait_terminal(&api_a, "second", TIMEOUT, phases)
        .await;
    assert_eq!(phase(&second), Some(RequestPhase::Succeeded));
    let queued = condition(&second, "Queued").unwrap();
    assert_eq!(
        (queued.status.as_str(), queued.reason.as_str()),
        ("False", "Started")
    );
    assert_eq!(
        phase(&api_a.get("first").await.unwrap()),
        Some(RequestPhase::Succeeded)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_outside_the_spec_limits_fails_saying_which() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        operator_args: vec!["--max-cpu-frequency-hz".into(), "200".into()],
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-limit-spec").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "alloc", 1)
        .await;
    let cases = [
        (
            "tiny-sample",
            json!({"type": "heap", "podNames": ["web-1"], "duration": "1s", "heap": {"source": "ebpf", "sampleBytes": 1}}),
            "heap.sampleBytes 1 is below this cluster's minimum of 65536 bytes",
        ),
        (
            "too-fast",
            json!({"type": "cpu", "podNames": ["web-1"], "duration": "1s", "cpu": {"frequencyHz": 999}}),
            "cpu.frequencyHz 999 is above this cluster's limit of 200 Hz",
        ),
        // The heap probes slow every process mapping the allocator, other tenants' too:
        // a tenant may not switch the overhead guard off, nor raise it past the ceiling.
        (
            "guard-off",
            json!({"type": "heap", "podNames": ["web-1"], "duration": "1s", "heap": {"source": "ebpf", "maxOverheadPercent": 0}}),
            "heap.maxOverheadPercent 0 (the overhead guard turned off) is above this cluster's ceiling of 3%",
        ),
        (
            "guard-raised",
            json!({"type": "heap", "podNames": ["web-1"], "duration": "1s", "heap": {"source": "ebpf", "maxOverheadPercent": 50}}),
            "heap.maxOverheadPercent 50 is above this cluster's ceiling of 3%",
        ),
        // The off-CPU walks run inside context switches billed to other pods too, into
        // maps all captures on the node share: the same ceiling, set apart.
        (
            "offcpu-guard-off",
            json!({"type": "offcpu", "podNames": ["web-1"], "duration": "1s", "offcpu": {"maxOverheadPercent": 0}}),
            "offcpu.maxOverheadPercent 0 (the overhead guard turned off) is above this cluster's ceiling of 3% (set by the cluster admin with the operator's --max-offcpu-overhead-percent)",
        ),
        (
            "offcpu-guard-raised",
            json!({"type": "offcpu", "podNames": ["web-1"], "duration": "1s", "offcpu": {"maxOverheadPercent": 20}}),
            "offcpu.maxOverheadPercent 20 is above this cluster's ceiling of 3%",
        ),
    ];
    for (name, spec, message) in cases {
        let (done, _) = pipeline
            .run(&ns, &pipeline.request(name, spec), TIMEOUT)
            .await;
        assert_eq!(phase(&done), Some(RequestPhase::Failed), "{name}");
        let resolved = condition(&done, "Resolved").unwrap();
        assert_eq!(resolved.reason, "OutsideLimits", "{name}");
        assert!(
            resolved.message.contains(message),
            "{name}: {}",
            resolved.message
        );
    }
}
