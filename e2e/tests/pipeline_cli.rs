//! The user's way in and out, through the whole real pipeline: `kubectl profile cpu` creates
//! a ProfileRequest that the operator dispatches to a real agent, waits for it, downloads the
//! artifact (sha256 checked) and renders it; then `get`, `merge`, `list` and `delete` work on
//! the finished request.

mod pipeline_support;

use std::path::Path;

use flamefleet_e2e::TestNamespace;
use pipeline_support::{Pipeline, PipelineOptions, RUN_LABEL, kubectl_profile, pprof_top, serial};

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_profile_cpu_through_the_pipeline() {
    let _serial = serial().await;
    let mut pipeline = Pipeline::start(PipelineOptions {
        nodes: 1,
        ..Default::default()
    })
    .await;
    let ns = TestNamespace::create("ff-cli").await.unwrap();
    pipeline
        .pod(&ns, "web-1", 0, &[("app", "web")], "spin", 1)
        .await;
    let out_dir = pipeline.dir.path().join("cli-out");
    let out_arg = out_dir.to_string_lossy().into_owned();
    let label = format!("{RUN_LABEL}={}", pipeline.id);

    // create -> wait -> download, with a flame graph.
    let (ok, text) = kubectl_profile(
        &pipeline.kubeconfig,
        ns.name(),
        &[
            "cpu",
            "web-1",
            "--duration",
            "2s",
            "--label",
            &label,
            "-o",
            &out_arg,
            "--format",
            "svg",
        ],
    );
    assert!(
        ok,
        "kubectl profile cpu failed:\n{text}\n{}\n{}",
        pipeline.operator_logs(),
        pipeline.agent_logs()
    );
    let name = text
        .lines()
        .find_map(|l| l.strip_prefix("profilerequest.flamefleet.dev/"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("no request name in:\n{text}"))
        .to_string();
    let node = &pipeline.nodes[0];
    // Named after the request and the node.
    let pprof = out_dir.join(format!("{name}-{node}.pb.gz"));
    let svg = out_dir.join(format!("{name}-{node}.svg"));
    assert!(
        pprof.is_file() && svg.is_file(),
        "files: {:?}",
        files_in(&out_dir)
    );
    assert!(pprof_top(&pprof).contains("burn_cpu"), "go tool pprof -top");
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg_text.contains("burn_cpu"),
        "the flame graph names the hot function"
    );

    // get --format text lists the hot function first.
    let (ok, text) = kubectl_profile(
        &pipeline.kubeconfig,
        ns.name(),
        &["get", &name, "--format", "text", "-o", &out_arg],
    );
    assert!(ok, "{text}");
    let first_function = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .nth(1)
        .unwrap_or_default();
    assert!(
        first_function.contains("burn_cpu"),
        "top function should be burn_cpu:\n{text}"
    );

    // merge (by request name), list, delete.
    let merged = out_dir.join("merged.pb.gz");
    let (ok, text) = kubectl_profile(
        &pipeline.kubeconfig,
        ns.name(),
        &["merge", &name, "-o", &merged.to_string_lossy()],
    );
    assert!(ok, "{text}");
    assert!(pprof_top(&merged).contains("burn_cpu"));
    let (ok, text) = kubectl_profile(&pipeline.kubeconfig, ns.name(), &["list"]);
    assert!(
        ok && text.contains(&name) && text.contains("Succeeded"),
        "{text}"
    );
    let (ok, text) = kubectl_profile(&pipeline.kubeconfig, ns.name(), &["delete", &name]);
    assert!(ok, "{text}");
    // The operator's finalizer removes the artifacts, then the request goes.
    let mut last = String::new();
    for _ in 0..30 {
        let (ok, text) = kubectl_profile(
            &pipeline.kubeconfig,
            ns.name(),
            &["get", &name, "-o", &out_arg],
        );
        if !ok && text.contains("not found") {
            return;
        }
        last = text;
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    panic!("{name} still there 30 s after delete: {last}");
}
