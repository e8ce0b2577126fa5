//! Following a request: progress on stderr counted from the capture's start
//! (`status.startTime`), `Queued (Reason)` while a concurrency limit holds it, `--timeout`
//! counted from the capture's start, Ctrl-C saying what keeps running, and suggested
//! commands that name the namespace. The test plays the operator on the status subresource.

mod support;

use std::time::Duration;

use flamefleet_api::{NodePhase, ProfileRequest};
use kube::api::Api;
use serde_json::json;
use support::{Store, cpu_profile, first_request, namespace, node, patch_status, write_status};

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_waits_its_turn_then_counts_down_from_its_start() {
    let ns = namespace("cli-queue").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    let out = tempfile::tempdir().unwrap();
    let mut run = support::cli_live(
        &kc,
        ns.name(),
        &[
            "cpu",
            "web-0",
            "--duration",
            "5s",
            "--timeout",
            "3s",
            "-o",
            out.path().to_str().unwrap(),
            "--format",
            "pprof",
        ],
    );
    let req = first_request(&ns).await;
    let name = req.metadata.name.clone().unwrap();
    patch_status(
        &ns,
        &name,
        json!({"phase": "Pending", "conditions": [{
            "type": "Queued", "status": "True", "reason": "ConcurrencyLimit",
            "message": format!("namespace {} has 1 capture running, its limit", ns.name()),
            "lastTransitionTime": now_rfc3339()
        }]}),
    )
    .await;
    let queued = run
        .wait_for_line("Queued (ConcurrencyLimit)", Duration::from_secs(30))
        .await;
    assert!(queued.contains("its limit"), "{queued}");
    // Queued for longer than --timeout: the timeout has not started, so the CLI waits on.
    // (Time passing is what this checks, not a synchronization.)
    tokio::time::sleep(Duration::from_secs(4)).await;

    patch_status(&ns, &name, json!({"startTime": now_rfc3339()})).await;
    write_status(
        &ns,
        &name,
        flamefleet_api::RequestPhase::Running,
        vec![node("node-a", NodePhase::Running, None, vec![])],
    )
    .await;
    let running = run.wait_for_line("s left)", Duration::from_secs(30)).await;
    // Counted from startTime (just now), not from the creation 4+ s ago.
    let left: u64 = running
        .split("Running (")
        .nth(1)
        .and_then(|r| r.split('s').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no seconds left in {running:?}"));
    assert!((3..=5).contains(&left), "{running}");

    let artifact = store
        .upload(&req, "cpu-node-a.pb.gz", &cpu_profile("queued_fn"))
        .await;
    write_status(
        &ns,
        &name,
        flamefleet_api::RequestPhase::Succeeded,
        vec![node("node-a", NodePhase::Succeeded, None, vec![artifact])],
    )
    .await;
    let r = run.finish().await;
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stderr.contains("Queued (ConcurrencyLimit)"),
        "{}",
        r.stderr
    );
    assert!(
        !r.stdout.contains("Queued"),
        "progress is on stderr: {}",
        r.stdout
    );
    assert!(
        r.stdout.contains(&format!(
            "wrote {}",
            out.path().join(format!("{name}-node-a.pb.gz")).display()
        )),
        "{}",
        r.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_timeout_counts_from_the_capture_start_and_names_the_namespace() {
    let ns = namespace("cli-deadline").await;
    let kc = support::admin_kubeconfig(&ns);
    let mut run = support::cli_live(
        &kc,
        ns.name(),
        &["runqlat", "web-0", "--duration", "1s", "--timeout", "2s"],
    );
    let req = first_request(&ns).await;
    let name = req.metadata.name.clone().unwrap();
    patch_status(&ns, &name, json!({"startTime": now_rfc3339()})).await;
    write_status(
        &ns,
        &name,
        flamefleet_api::RequestPhase::Running,
        vec![node("node-a", NodePhase::Running, None, vec![])],
    )
    .await;
    run.wait_for_line(" Running (", Duration::from_secs(30))
        .await;
    let r = run.finish().await;
    assert_eq!(r.code, 10, "{r:?}");
    let message = r.stderr.lines().last().unwrap_or_default();
    assert!(
        message.contains("timed out after 2s")
            && message.contains("to finish (phase Running)")
            && message.contains(&format!("kubectl profile get {name} -n {}", ns.name())),
        "{}",
        r.stderr
    );
    // The window ended: the progress says the results are being collected, not "0s left".
    assert!(
        r.stderr.contains("Running (collecting results)") && !r.stderr.contains("(0s left)"),
        "{}",
        r.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_says_the_request_keeps_running_and_how_to_follow_it() {
    let ns = namespace("cli-ctrlc").await;
    let kc = support::admin_kubeconfig(&ns);
    let mut run = support::cli_live(&kc, ns.name(), &["cpu", "web-0", "--duration", "30s"]);
    let req = first_request(&ns).await;
    let name = req.metadata.name.clone().unwrap();
    patch_status(&ns, &name, json!({"startTime": now_rfc3339()})).await;
    write_status(
        &ns,
        &name,
        flamefleet_api::RequestPhase::Running,
        vec![node("node-a", NodePhase::Running, None, vec![])],
    )
    .await;
    run.wait_for_line("s left)", Duration::from_secs(30)).await;
    run.interrupt();
    let r = run.finish().await;
    assert_eq!(r.code, 130, "{r:?}");
    let n = ns.name();
    assert!(
        r.stderr.contains(&format!(
            "interrupted: profilerequest \"{name}\" keeps running"
        )) && r
            .stderr
            .contains(&format!("kubectl get preq {name} -n {n} -w"))
            && r.stderr
                .contains(&format!("kubectl profile get {name} -n {n}"))
            && r.stderr
                .contains(&format!("kubectl profile delete {name} -n {n}")),
        "{}",
        r.stderr
    );
    let api: Api<ProfileRequest> = ns.api();
    assert!(
        api.get_opt(&name).await.unwrap().is_some(),
        "it keeps running"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nobody_answers_so_the_wait_says_no_operator_picked_it_up() {
    let ns = namespace("cli-nobody").await;
    let kc = support::admin_kubeconfig(&ns);
    let r = support::cli(
        &kc,
        ns.name(),
        &["heap", "web-0", "--duration", "1s", "--timeout", "2s"],
    )
    .await;
    assert_eq!(r.code, 10, "{r:?}");
    assert!(
        r.stderr.contains("to be accepted (phase Pending)")
            && r.stderr.contains("no Flamefleet operator has picked it up")
            && r.stderr.contains(&format!("-n {}", ns.name())),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("Pending (waiting for the operator)"),
        "{}",
        r.stderr
    );
}
