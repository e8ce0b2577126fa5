//! `kubectl profile cpu|heap|runqlat`: the request it creates (pod, deploy/NAME, -l), and
//! create → wait → download, with the test playing operator and agent on the status
//! subresource while the CLI waits.

mod support;

use flamefleet_api::{NodePhase, ProfileRequest, ProfileType, RequestPhase};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, PostParams};
use support::{Store, cli, cpu_profile, files, namespace, node, write_status};

fn created_name(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("profilerequest.flamefleet.dev/"))
        .and_then(|l| l.strip_suffix(" created"))
        .unwrap_or_else(|| panic!("no created line in {stdout:?}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_wait_creates_the_request_for_pod_deployment_and_selector() {
    let ns = namespace("cli-create").await;
    let kc = support::admin_kubeconfig(&ns);
    let api: Api<ProfileRequest> = ns.api();

    let r = cli(
        &kc,
        ns.name(),
        &[
            "cpu",
            "web-0",
            "--duration",
            "5s",
            "--frequency",
            "49",
            "--no-wait",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{r:?}");
    let req = api.get(&created_name(&r.stdout)).await.unwrap();
    assert_eq!(req.spec.profile_type, ProfileType::Cpu);
    assert_eq!(req.spec.pod_names, ["web-0"]);
    assert_eq!(req.spec.duration, "5s");
    assert_eq!(req.spec.frequency_hz(), 49);

    let deploy: Deployment = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {
            "selector": {"matchLabels": {"app": "web", "tier": "front"}},
            "template": {
                "metadata": {"labels": {"app": "web", "tier": "front"}},
                "spec": {"containers": [{"name": "web", "image": "example.invalid/web:1"}]}
            }
        }
    }))
    .unwrap();
    Api::<Deployment>::namespaced(ns.client(), ns.name())
        .create(&PostParams::default(), &deploy)
        .await
        .unwrap();
    let r = cli(&kc, ns.name(), &["heap", "deploy/web", "--no-wait"]).await;
    assert_eq!(r.code, 0, "{r:?}");
    let req = api.get(&created_name(&r.stdout)).await.unwrap();
    assert_eq!(req.spec.profile_type, ProfileType::Heap);
    let labels = req.spec.selector.unwrap().match_labels.unwrap();
    assert_eq!(labels.get("tier").map(String::as_str), Some("front"));

    let r = cli(&kc, ns.name(), &["runqlat", "-l", "app=db", "--no-wait"]).await;
    assert_eq!(r.code, 0, "{r:?}");
    let req = api.get(&created_name(&r.stdout)).await.unwrap();
    assert_eq!(req.spec.profile_type, ProfileType::Runqlat);
    assert_eq!(
        req.spec
            .selector
            .unwrap()
            .match_labels
            .unwrap()
            .get("app")
            .map(String::as_str),
        Some("db")
    );

    // Usage errors exit 2 and create nothing.
    let before = api.list(&Default::default()).await.unwrap().items.len();
    let r = cli(&kc, ns.name(), &["cpu", "sts/missing", "--no-wait"]).await;
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("statefulset \"missing\" not found"),
        "{}",
        r.stderr
    );
    let r = cli(
        &kc,
        ns.name(),
        &["heap", "web-0", "--frequency", "10", "--no-wait"],
    )
    .await;
    assert_eq!(r.code, 2, "{r:?}");
    assert_eq!(
        api.list(&Default::default()).await.unwrap().items.len(),
        before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_waits_shows_progress_and_downloads() {
    let ns = namespace("cli-wait").await;
    let kc = support::admin_kubeconfig(&ns);
    let store = Store::start_for(&ns).await;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap().to_string();
    let mut cli_run = support::cli_live(
        &kc,
        ns.name(),
        &[
            "cpu",
            "web-0",
            "--duration",
            "2s",
            "-o",
            &dir,
            "--format",
            "text",
        ],
    );

    // Play the operator and the agent: find the request, mark it Running, then Succeeded.
    let api: Api<ProfileRequest> = ns.api();
    let req = loop {
        if let Some(r) = api.list(&Default::default()).await.unwrap().items.pop() {
            break r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    let name = req.metadata.name.clone().unwrap();
    let running = node("node-a", NodePhase::Running, None, vec![]);
    write_status(&ns, &name, RequestPhase::Running, vec![running]).await;
    // Succeeded only once the CLI has shown Running.
    cli_run
        .wait_for_line(" Running ", std::time::Duration::from_secs(60))
        .await;
    let artifact = store
        .upload(&req, "cpu-node-a.pb.gz", &cpu_profile("sha256_block"))
        .await;
    write_status(
        &ns,
        &name,
        RequestPhase::Succeeded,
        vec![node("node-a", NodePhase::Succeeded, None, vec![artifact])],
    )
    .await;

    let r = cli_run.finish().await;
    assert_eq!(r.code, 0, "{r:?}");
    // Progress goes to stderr (stdout keeps what was written); not a terminal: one plain
    // line per state change.
    assert!(
        r.stderr.contains(" Running ") && r.stderr.contains("1 nodes, 1 capturing"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains(" Succeeded ") && r.stderr.contains("1 nodes, 1 succeeded"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains('\r'), "{}", r.stderr);
    assert!(!r.stdout.contains(" Running "), "{}", r.stdout);
    let first_row = r
        .stdout
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .nth(1)
        .unwrap_or_default();
    assert!(first_row.ends_with("sha256_block"), "{}", r.stdout);
    // Named after the request and the node.
    assert_eq!(files(out.path()), [format!("{name}-node-a.pb.gz")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nobody_answers_so_the_wait_times_out_with_exit_10() {
    let ns = namespace("cli-timeout").await;
    let kc = support::admin_kubeconfig(&ns);
    let r = cli(
        &kc,
        ns.name(),
        &["runqlat", "web-0", "--duration", "1s", "--timeout", "3s"],
    )
    .await;
    assert_eq!(r.code, 10, "{r:?}");
    assert!(
        r.stderr.contains("timed out after 3s") && r.stderr.contains("(phase Pending)"),
        "{}",
        r.stderr
    );
}
