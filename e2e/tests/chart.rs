//! The Helm chart, checked without a cluster and against a real API server:
//! - `helm lint --strict`;
//! - `helm template` with several value sets, validated by `kubeconform -strict` against JSON
//!   schemas generated from the real kube-apiserver's OpenAPI (every built-in kind and our
//!   CRDs; no schema is downloaded: nothing outside this machine is reachable);
//! - the same manifests applied with `kubectl apply --dry-run=server`;
//! - values.schema.json refusing bad values with a clear message.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use flamefleet_e2e::TestNamespace;
use flamefleet_e2e::cluster::{helm_binary, kubeconform_binary, repo_root};
use serde_json::{Map, Value, json};

/// `helm ARGS` in the repository root; (success, stdout, stderr).
fn helm(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(helm_binary())
        .args(args)
        .current_dir(repo_root())
        .output()
        .expect("running helm: build it with scripts/tools.sh build (scripts/setup.sh does)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn template(values: &[&str]) -> (bool, String, String) {
    let mut args = vec![
        "template",
        "ff",
        "charts/flamefleet",
        "--namespace",
        "flamefleet-system",
        "--kube-version",
        "1.34.4",
    ];
    for v in values {
        args.push("--set");
        args.push(v);
    }
    helm(&args)
}

/// Rewrites OpenAPI `#/components/schemas/` references to `#/definitions/`, and makes every
/// object schema with declared properties refuse others (kubeconform's strict schemas).
fn strictify(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get_mut("$ref") {
                *r = r.replace("#/components/schemas/", "#/definitions/");
            }
            let open = map
                .get("x-kubernetes-preserve-unknown-fields")
                .is_some_and(|v| v == &Value::Bool(true));
            if map.contains_key("properties") && !map.contains_key("additionalProperties") && !open
            {
                map.insert("additionalProperties".into(), Value::Bool(false));
            }
            for v in map.values_mut() {
                strictify(v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(strictify),
        _ => {}
    }
}

/// kubeconform's file name for a kind: `<kind>-<first part of the group, or v1>-<version>`.
fn schema_file(group: &str, version: &str, kind: &str) -> String {
    let group_part = if group.is_empty() {
        version.to_owned()
    } else {
        format!(
            "{}-{version}",
            group
                .split('.')
                .next()
                .unwrap_or(group)
                .to_ascii_lowercase()
        )
    };
    format!("{}-{group_part}.json", kind.to_ascii_lowercase())
}

/// Writes a standalone strict JSON schema per kind served by the API server into `dir`.
async fn write_schemas(client: &kube::Client, dir: &Path) -> usize {
    let get = |path: String| {
        let client = client.clone();
        async move {
            let req = http::Request::get(path.as_str()).body(Vec::new()).unwrap();
            let text = client
                .request_text(req)
                .await
                .unwrap_or_else(|e| panic!("GET {path}: {e}"));
            // A group without schemas may answer with an empty body.
            serde_json::from_str::<Value>(&text).unwrap_or(Value::Null)
        }
    };
    // The API server publishes a new CRD's OpenAPI a moment after the CRD is Established, and
    // one CRD at a time: wait until the group's document holds every Flamefleet kind.
    const KINDS: [&str; 4] = [
        "ProfileRequest",
        "ProfileDownload",
        "SamplingPolicy",
        "ClusterSamplingPolicy",
    ];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    let index = loop {
        let index = get("/openapi/v3".into()).await;
        let published: Vec<String> =
            match index["paths"]["apis/flamefleet.dev/v1alpha1"]["serverRelativeURL"].as_str() {
                Some(url) => get(url.to_owned()).await["components"]["schemas"]
                    .as_object()
                    .into_iter()
                    .flat_map(|schemas| schemas.values())
                    .filter_map(|s| s["x-kubernetes-group-version-kind"].as_array())
                    .flatten()
                    .filter_map(|gvk| gvk["kind"].as_str().map(str::to_owned))
                    .collect(),
                None => Vec::new(),
            };
        if KINDS.iter().all(|k| published.iter().any(|p| p == k)) {
            break index;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the API server never published every Flamefleet CRD's OpenAPI (published: {published:?})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    };
    let mut written = 0;
    for (_, entry) in index["paths"].as_object().unwrap() {
        let url = entry["serverRelativeURL"].as_str().unwrap().to_owned();
        let doc = get(url).await;
        let Some(components) = doc["components"]["schemas"].as_object() else {
            continue;
        };
        let mut definitions = Value::Object(components.clone());
        strictify(&mut definitions);
        for (name, schema) in components {
            let Some(gvks) = schema["x-kubernetes-group-version-kind"].as_array() else {
                continue;
            };
            for gvk in gvks {
                let (group, version, kind) = (
                    gvk["group"].as_str().unwrap_or_default(),
                    gvk["version"].as_str().unwrap_or_default(),
                    gvk["kind"].as_str().unwrap_or_default(),
                );
                let mut standalone = Map::new();
                standalone.insert("$ref".into(), json!(format!("#/definitions/{name}")));
                standalone.insert("definitions".into(), definitions.clone());
                std::fs::write(
                    dir.join(schema_file(group, version, kind)),
                    serde_json::to_vec(&Value::Object(standalone)).unwrap(),
                )
                .unwrap();
                written += 1;
            }
        }
    }
    written
}

fn kubeconform(dir: &Path, manifests: &str) -> (bool, String) {
    let file = dir.join("manifests.yaml");
    std::fs::write(&file, manifests).unwrap();
    let location = format!(
        "{}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json",
        dir.display()
    );
    let out = Command::new(kubeconform_binary())
        .args(["-strict", "-summary", "-schema-location", &location])
        .arg(&file)
        .output()
        .expect("running kubeconform: build it with scripts/tools.sh build");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The value sets the chart must render correctly.
fn value_sets() -> BTreeMap<&'static str, Vec<&'static str>> {
    BTreeMap::from([
        ("defaults", vec![]),
        (
            "s3",
            vec![
                "store.type=s3",
                "store.s3.endpoint=https://s3.example.test",
                "store.s3.bucket=profiles",
                "store.s3.existingSecret=s3-credentials",
            ],
        ),
        (
            "single-node dev",
            vec![
                "store.persistence.type=hostPath",
                "store.service.type=NodePort",
                "store.service.nodePort=30808",
                "store.publicUrl=http://192.0.2.2:30808/",
                "image.pullPolicy=Never",
                "networkPolicy.enabled=true",
            ],
        ),
        (
            "otlp export with CA and headers",
            vec![
                "export.otlp.endpoint=https://otel-collector.observability:4317",
                "export.otlp.caSecret=otel-ca",
                "export.otlp.headersSecret=otel-headers",
                "export.otlp.compression=none",
                "export.queue.perNamespace=8",
            ],
        ),
        (
            "existing claim, more limits",
            vec![
                "store.persistence.existingClaim=artifacts",
                "operator.limits.maxConcurrentCapturesPerNamespace=2",
                "agent.capabilities={BPF,PERFMON,SYS_PTRACE,DAC_READ_SEARCH}",
                "agent.seccompProfile=Unconfined",
                "operator.replicas=3",
            ],
        ),
    ])
}

#[test]
fn helm_lint_is_clean() {
    let (ok, out, err) = helm(&["lint", "--strict", "charts/flamefleet"]);
    assert!(ok, "helm lint --strict:\n{out}{err}");
    assert!(out.contains("0 chart(s) failed"), "{out}");
}

#[tokio::test]
async fn rendered_manifests_pass_kubeconform_strict_and_server_dry_run() {
    let ns = TestNamespace::create("chart").await.unwrap();
    let schemas = tempfile::tempdir().unwrap();
    let written = write_schemas(&ns.client(), schemas.path()).await;
    assert!(
        written > 50,
        "schemas generated from the API server: {written}"
    );
    for needed in [
        "deployment-apps-v1.json",
        "daemonset-apps-v1.json",
        "clusterrole-rbac-v1.json",
        "validatingadmissionpolicy-admissionregistration-v1.json",
        "profilerequest-flamefleet-v1alpha1.json",
    ] {
        assert!(schemas.path().join(needed).exists(), "{needed}");
    }
    // kubeconform with these schemas is not vacuous: a misspelt field fails.
    let (ok, out) = kubeconform(
        schemas.path(),
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replicaz: 1\n  selector: {matchLabels: {a: b}}\n  template: {metadata: {labels: {a: b}}, spec: {containers: [{name: c, image: i}]}}\n",
    );
    assert!(
        !ok && out.contains("replicaz"),
        "kubeconform must refuse unknown fields: {out}"
    );

    for (name, values) in value_sets() {
        let (ok, rendered, err) = template(&values);
        assert!(ok, "{name}: helm template failed: {err}");
        let (ok, out) = kubeconform(schemas.path(), &rendered);
        assert!(ok, "{name}: kubeconform -strict:\n{out}");
        assert!(out.contains("Invalid: 0, Errors: 0"), "{name}: {out}");
        // The API server accepts every object (namespaced ones in the test's namespace).
        let rendered = rendered.replace(
            "namespace: flamefleet-system",
            &format!("namespace: {}", ns.name()),
        );
        let file = schemas
            .path()
            .join(format!("{}.yaml", name.replace([' ', ','], "-")));
        std::fs::write(&file, &rendered).unwrap();
        let out = flamefleet_e2e::kubectl::kubectl(
            ns.control_plane().kubeconfig(),
            &[
                "apply",
                "--dry-run=server",
                "--validate=strict",
                "-f",
                file.to_str().unwrap(),
            ],
        );
        assert!(
            out.is_ok(),
            "{name}: kubectl apply --dry-run=server: {out:?}"
        );
    }
}

/// The defaults close what tenants' pods could reach: the debug servers listen on the pods'
/// loopback only (`kubectl port-forward` reaches them), the NetworkPolicies are rendered
/// (the server dry run above applies them; the one-node cluster's bridge CNI accepts them
/// without enforcing them), and the operator gets the tenant limits of the store and the
/// heap guard.
#[test]
fn defaults_close_the_debug_ports_and_render_the_network_policies() {
    let (ok, rendered, err) = template(&[]);
    assert!(ok, "helm template failed: {err}");
    assert_eq!(
        rendered.matches("--debug-listen=127.0.0.1:6060").count(),
        2,
        "the operator's and the agents' debug servers listen on loopback by default"
    );
    assert!(!rendered.contains("--debug-listen=0.0.0.0"), "{rendered}");
    for policy in ["name: ff-flamefleet-agent", "name: ff-flamefleet-operator"] {
        let found = rendered
            .split("\n---")
            .any(|doc| doc.contains("kind: NetworkPolicy") && doc.contains(policy));
        assert!(found, "no NetworkPolicy {policy} in the default rendering");
    }
    for flag in [
        "--artifact-quota-per-namespace=2Gi",
        "--store-gc-interval=10m",
        "--max-heap-overhead-percent=3",
        "--max-offcpu-overhead-percent=3",
    ] {
        assert!(rendered.contains(flag), "{flag} missing");
    }
    assert!(rendered.contains("name: flamefleet-namespace-limits"));
}

/// The agent gets CAP_SYSLOG (kernel frames' names, the kernel log) with
/// `agent.kernelSymbols`, on by default, CAP_SETUID and CAP_SETGID with
/// `agent.javaAttachOtherUsers`, off by default, and only the listed capabilities without
/// them.
/// The export values become the operator's flags, its CA and headers Secrets read-only
/// mounts; without an endpoint nothing of it is rendered.
#[test]
fn export_values_become_operator_flags_and_secret_mounts() {
    let (ok, rendered, err) = template(&[
        "export.otlp.endpoint=https://otel.example.test:4317",
        "export.otlp.caSecret=otel-ca",
        "export.otlp.headersSecret=otel-headers",
    ]);
    assert!(ok, "helm template failed: {err}");
    for want in [
        "--export-otlp-endpoint=https://otel.example.test:4317",
        "--export-otlp-ca-file=/etc/flamefleet/export-ca/ca.crt",
        "--export-otlp-headers-dir=/etc/flamefleet/export-headers",
        "--export-queue-per-namespace=32",
        "--export-max-retry-time=5m",
        "--export-otlp-max-message-bytes=4194304",
        "secretName: otel-ca",
        "secretName: otel-headers",
        "mountPath: /etc/flamefleet/export-headers, readOnly: true",
    ] {
        assert!(rendered.contains(want), "{want} missing");
    }
    assert!(!rendered.contains("--export-otlp-no-compression"));
    let (ok, rendered, err) = template(&[]);
    assert!(ok, "helm template failed: {err}");
    assert!(
        !rendered.contains("--export-"),
        "export flags without an endpoint"
    );
}

#[test]
fn kernel_symbols_add_syslog_to_the_agents_capabilities() {
    let agent_caps = |values: &[&str]| {
        let (ok, rendered, err) = template(values);
        assert!(ok, "helm template failed: {err}");
        let agent = rendered
            .split("\n---")
            .find(|doc| doc.contains("kind: DaemonSet"))
            .expect("the agent's DaemonSet")
            .to_owned();
        agent
            .split_once("add:")
            .expect("capabilities.add")
            .1
            .lines()
            .skip(1)
            .take_while(|l| l.trim_start().starts_with("- "))
            .map(|l| l.trim().trim_start_matches("- ").to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        agent_caps(&[]),
        ["BPF", "PERFMON", "SYS_PTRACE", "SYSLOG"],
        "the default"
    );
    assert_eq!(
        agent_caps(&["agent.kernelSymbols=false"]),
        ["BPF", "PERFMON", "SYS_PTRACE"]
    );
    assert_eq!(
        agent_caps(&["agent.capabilities={BPF,PERFMON,SYSLOG}"]),
        ["BPF", "PERFMON", "SYSLOG"],
        "listed already: once"
    );
    assert_eq!(
        agent_caps(&["agent.javaAttachOtherUsers=true"]),
        ["BPF", "PERFMON", "SYS_PTRACE", "SYSLOG", "SETUID", "SETGID"],
        "JVMs of other users: the attach thread takes their user and group"
    );
    assert_eq!(
        agent_caps(&[
            "agent.javaAttachOtherUsers=true",
            "agent.javaAttach=false",
            "agent.kernelSymbols=false"
        ]),
        ["BPF", "PERFMON", "SYS_PTRACE"],
        "no attach at all: no identity to take"
    );
}

#[test]
fn values_schema_refuses_bad_values_with_a_clear_message() {
    let cases = [
        (vec!["store.type=gcs"], "store/type"),
        (
            vec!["agent.capabilities={SYS_MODULE}"],
            "agent/capabilities",
        ),
        (vec!["operator.replicas=0"], "operator/replicas"),
        (vec!["store.type=s3"], "existingSecret"),
        (
            vec!["agent.seccompProfile=Localhost"],
            "agent/seccompProfile",
        ),
        (vec!["store.publicUrl=ftp://x"], "store/publicUrl"),
        (
            vec!["operator.limits.maxCpuFrequencyHz=5000"],
            "maxCpuFrequencyHz",
        ),
        (
            vec!["operator.limits.maxOffcpuOverheadPercent=101"],
            "maxOffcpuOverheadPercent",
        ),
        (
            vec!["export.otlp.endpoint=collector:4317"],
            "export/otlp/endpoint",
        ),
        (vec!["export.queue.perNamespace=0"], "perNamespace"),
        (vec!["notAValue=1"], "notAValue"),
    ];
    for (values, mentions) in cases {
        let (ok, _, err) = template(&values);
        assert!(!ok, "{values:?} must be refused");
        assert!(
            err.contains("values don't meet the specifications of the schema")
                && err.contains(mentions),
            "{values:?}: {err}"
        );
    }
}
