//! Flamefleet on a real Kubernetes node: the one-node cluster of `scripts/cluster.sh`
//! (kubelet, containerd + runc, kube-proxy, CoreDNS), images built in this run and imported,
//! the chart installed with `helm`, and a workload Deployment profiled with
//! `kubectl profile`. Container IDs come from the kubelet, cgroups from runc, the agent runs
//! as the chart's DaemonSet with only the chart's privileges and gets its node certificate
//! through a CSR the operator signs.
//!
//! One test, in steps, because they share one installation and the last steps (upgrade,
//! uninstall) change it. The fault tier's faults of a real node (`real_node_faults/`: the
//! agent OOM-killed, the kubelet restarted, the agent DaemonSet rolled mid-capture) are
//! steps of it too, so that they cost no second installation. The installation exports to a
//! real OpenTelemetry Collector on the host (scripts/otelcol.sh), with always-on windows of
//! 2 s every 3 s for the always-on step (`e2e/benches/always_on_real_node.rs` runs the
//! defaults, 10 pods for 10 minutes).

mod pipeline_support;
mod real_node_faults;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use flamefleet_api::{ProfileRequest, RequestPhase};
use flamefleet_e2e::Cluster;
use flamefleet_e2e::cluster::kubectl_profile_binary;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

use pipeline_support::otelcol::{Collector, resource_attributes};

const RELEASE: &str = "flamefleet";
const NAMESPACE: &str = "flamefleet-system";
const STORE_NODE_PORT: u16 = 30808;
const TIMEOUT: Duration = Duration::from_secs(180);

fn step(what: &str) {
    eprintln!("\n=== {what}");
}

/// Runs `kubectl profile ARGS` against the cluster; returns (exit code, stdout, stderr).
fn kubectl_profile(cluster: &Cluster, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(kubectl_profile_binary().expect("building kubectl-profile"))
        .args(args)
        .env("KUBECONFIG", &cluster.kubeconfig)
        .output()
        .expect("running kubectl-profile");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    eprintln!("$ kubectl profile {}\n{stdout}{stderr}", args.join(" "));
    (out.status.code().unwrap_or(-1), stdout, stderr)
}

/// `go tool pprof ARGS FILE`: the referee for every artifact.
fn pprof(args: &[&str], file: &Path) -> String {
    let out = Command::new("go")
        .args(["tool", "pprof"])
        .args(args)
        .arg(file)
        .output()
        .expect("running go tool pprof (install Go)");
    assert!(
        out.status.success(),
        "go tool pprof {args:?} could not read {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The one `*.pb.gz` file written into `dir`.
fn profile_in(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("the output directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".pb.gz"))
        .collect();
    assert_eq!(files.len(), 1, "one pprof in {}: {files:?}", dir.display());
    files[0].clone()
}

/// The first function of `go tool pprof -top` output.
fn top_function(top: &str) -> String {
    top.lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .nth(1)
        .and_then(|l| l.split_whitespace().last())
        .unwrap_or_default()
        .to_owned()
}

/// The `cum%` of `function` in `go tool pprof -top -cum` output (0 when it is not listed).
fn cum_percent(top: &str, function: &str) -> f64 {
    top.lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() >= 6 && cols[5..].join(" ") == function).then(|| cols[4])
        })
        .find_map(|c| c.trim_end_matches('%').parse().ok())
        .unwrap_or(0.0)
}

/// The `flat%` of `function` in `go tool pprof -top` output (0 when it is not listed).
fn flat_percent(top: &str, function: &str) -> f64 {
    top.lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() >= 6 && cols[5..].join(" ") == function).then(|| cols[1])
        })
        .find_map(|c| c.trim_end_matches('%').parse().ok())
        .unwrap_or(0.0)
}

/// A runtime's demo Deployment (examples/demo-workload/): three functions burning CPU
/// 5:3:2, called from the frames in `callers`.
struct RuntimeDemo {
    name: &'static str,
    image: &'static str,
    /// The log line it prints once warm (the JVM: once the three are compiled).
    ready: &'static str,
    /// `go tool pprof -show` regex of its own frames.
    own: &'static str,
    /// The three, in the order of their 5:3:2 shares.
    hot: [&'static str; 3],
    /// Frames every sample of the three must sit under.
    callers: &'static [&'static str],
}

const RUNTIME_DEMOS: [RuntimeDemo; 2] = [
    RuntimeDemo {
        name: "catalog",
        image: "catalog-demo",
        ready: "catalog: serving",
        own: "^catalog\\.",
        hot: [
            "catalog.render_listing",
            "catalog.price_items",
            "catalog.parse_query",
        ],
        callers: &["catalog.serve", "catalog.<module>"],
    },
    RuntimeDemo {
        name: "ledger",
        image: "ledger-demo",
        ready: "ledger: serving",
        own: "^dev\\.flamefleet\\.demo\\.",
        hot: [
            "dev.flamefleet.demo.Ledger.reconcile",
            "dev.flamefleet.demo.Ledger.applyFees",
            "dev.flamefleet.demo.Ledger.postEntries",
        ],
        // main stays interpreted (it loops, far from the JIT's thresholds): its frame is
        // the interpreter's, found through the compiled frames' frame pointers.
        callers: &["Interpreter"],
    },
];

fn checkout_deployment(namespace: &str, tag: &str) -> Value {
    demo_deployment(
        namespace,
        "checkout",
        &format!("flamefleet.local/checkout-demo:{tag}"),
    )
}

/// A one-replica Deployment `name` (label `app=<name>`) of a demo image.
fn demo_deployment(namespace: &str, name: &str, image: &str) -> Value {
    flamefleet_e2e::cluster::demo_deployment(namespace, name, image, 1, ["100m", "1"], &[])
}

/// The chart values of this test: the node's (`Cluster::local_values`), export to the
/// Collector on the host at `otlp_port`, and short always-on windows.
fn values(cluster: &Cluster, tag: &str, otlp_port: u16) -> Vec<String> {
    let mut values = cluster.local_values(tag, STORE_NODE_PORT);
    values.extend([
        format!(
            "export.otlp.endpoint=http://{}:{otlp_port}",
            cluster.node_ip
        ),
        "continuous.window=2s".into(),
        "continuous.period=3s".into(),
    ]);
    values
}

/// Label of the namespaces this test creates.
const E2E_LABEL: &str = "flamefleet.dev/e2e";

/// Deletes a namespace (without waiting) when the test ends, passing or failing.
struct DeleteOnDrop<'a> {
    cluster: &'a Cluster,
    namespace: String,
}

impl Drop for DeleteOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self
            .cluster
            .kubectl(&["delete", "namespace", &self.namespace, "--wait=false"]);
    }
}

/// Every program the agent's BPF objects define, named as the kernel shows
/// them (at most 15 bytes), read from the sources so a new program cannot be
/// missed by the leak check.
fn agent_program_names() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bpf");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("the bpf sources") {
        let path = entry.expect("a bpf source").path();
        if !path.to_string_lossy().ends_with(".bpf.c") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("reading a bpf source");
        let lines: Vec<&str> = text.lines().collect();
        for pair in lines.windows(2) {
            if !pair[0].trim_start().starts_with("SEC(\"") {
                continue;
            }
            let Some((head, rest)) = pair[1].split_once('(') else {
                continue;
            };
            // `int BPF_PROG(name, ...)` or `int name(struct ... *ctx)`.
            let name = if head.trim_end().ends_with(|c: char| c.is_ascii_uppercase()) {
                rest.split([',', ')']).next().unwrap_or("")
            } else {
                head.split_whitespace().last().unwrap_or("")
            };
            let name = name.trim();
            if !name.is_empty() {
                names.push(name.chars().take(15).collect());
            }
        }
    }
    assert!(
        names.iter().any(|n| n == "on_cpu_sample") && names.iter().any(|n| n == "malloc_enter"),
        "read the agent's programs from {}: {names:?}",
        dir.display()
    );
    names
}

/// The agent's programs loaded now, from `bpftool prog show`.
fn loaded_agent_programs() -> Vec<String> {
    let ours = agent_program_names();
    let out = Command::new("bpftool")
        .args(["prog", "show", "--json"])
        .output()
        .expect("running bpftool");
    let progs: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
    progs
        .iter()
        .filter_map(|p| p["name"].as_str())
        .filter(|n| ours.iter().any(|o| o == n))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flamefleet_installed_with_helm_profiles_real_pods() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the real-node tests run a kubelet and containerd: run as root (scripts/test.sh)"
    );
    let cluster = Cluster::shared().expect("the one-node cluster (scripts/cluster.sh up)");
    let client = cluster.client().await.unwrap();

    step("build the images and install the chart");
    // Workload namespaces of an interrupted run (a passing or failing run deletes its own).
    let _ = cluster.kubectl(&[
        "delete",
        "namespace",
        "-l",
        &format!("{E2E_LABEL}=real-node"),
        "--wait=false",
    ]);
    // A release left by an interrupted run keeps pods of images built from another checkout
    // under the same tag (an upgrade with unchanged values rolls nothing): start clean.
    cluster
        .uninstall_flamefleet(RELEASE, NAMESPACE, true)
        .expect("helm uninstall of a leftover release");
    // What is loaded before any agent runs: the agent's programs and maps are told apart
    // from it when the agent is rolled.
    let bpf_before = real_node_faults::BpfIds::now();
    let tag = cluster
        .build_images(None, None)
        .expect("building the images");
    // The operator (in a pod) exports to a Collector on the host, at the node's address.
    let otlp_dir = tempfile::tempdir().unwrap();
    let otlp_port = flamefleet_e2e::workload::free_port().expect("a free port");
    let collector = Collector::start_on(otlp_dir.path(), &cluster.node_ip, otlp_port);
    cluster
        .install_flamefleet(RELEASE, NAMESPACE, &values(cluster, &tag, otlp_port))
        .expect("helm install");

    step("the agent runs with exactly the chart's privileges");
    let manifest = cluster
        .helm(&["get", "manifest", RELEASE, "-n", NAMESPACE])
        .unwrap();
    let rendered: DaemonSet = manifest
        .split("\n---")
        .filter_map(|doc| serde_yaml::from_str::<Value>(doc).ok())
        .find(|v| v["kind"] == "DaemonSet")
        .map(|v| serde_json::from_value(v).unwrap())
        .expect("the chart renders the agent DaemonSet");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let agents = pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=flamefleet-agent"))
        .await
        .unwrap();
    assert_eq!(agents.items.len(), 1, "one agent on the one node");
    let live = agents.items[0].spec.clone().unwrap();
    let chart = rendered.spec.unwrap().template.spec.unwrap();
    assert_eq!(
        live.containers[0].security_context, chart.containers[0].security_context,
        "the agent's securityContext is the chart's"
    );
    let sc = live.containers[0].security_context.clone().unwrap();
    assert_eq!(sc.privileged, Some(false));
    let caps = sc.capabilities.unwrap();
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    // The chart's defaults: capabilities [BPF, PERFMON, SYS_PTRACE] and kernelSymbols
    // (on by default) adding SYSLOG; nothing else, and never SYS_ADMIN or SYS_RESOURCE.
    assert_eq!(
        caps.add,
        Some(vec![
            "BPF".into(),
            "PERFMON".into(),
            "SYS_PTRACE".into(),
            "SYSLOG".into()
        ])
    );
    assert_eq!(live.host_pid, Some(true));
    let host_paths: Vec<String> = live
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.host_path.as_ref().map(|h| h.path.clone()))
        .collect();
    assert_eq!(host_paths, ["/sys/fs/cgroup"], "the only host path");

    step("each agent proved its node: a CSR the operator approved and signed");
    let csrs: Value =
        serde_json::from_str(&cluster.kubectl(&["get", "csr", "-o", "json"]).unwrap()).unwrap();
    let agent_user = format!("system:serviceaccount:{NAMESPACE}:{RELEASE}-agent");
    let issued = csrs["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["spec"]["signerName"] == "flamefleet.dev/agent-serving")
        .filter(|c| c["spec"]["username"] == agent_user.as_str())
        .filter(|c| {
            c["status"]["certificate"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
        .count();
    assert!(issued >= 1, "an issued agent CSR: {csrs:#}");
    // Anyone else asking for an agent certificate is denied, with the reason.
    let forged = format!("forged-{}", std::process::id());
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params =
        rcgen::CertificateParams::new(vec![format!("{}.agents.flamefleet.internal", cluster.node)])
            .unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "flamefleet-agent:forged");
    let request = params.serialize_request(&key).unwrap().pem().unwrap();
    let csr: k8s_openapi::api::certificates::v1::CertificateSigningRequest =
        serde_json::from_value(json!({
            "metadata": {"name": forged},
            "spec": {
                "signerName": "flamefleet.dev/agent-serving",
                "request": k8s_openapi::ByteString(request.into_bytes()),
                "usages": ["digital signature", "server auth"],
            }
        }))
        .unwrap();
    let csr_api: Api<k8s_openapi::api::certificates::v1::CertificateSigningRequest> =
        Api::all(client.clone());
    csr_api.create(&PostParams::default(), &csr).await.unwrap();
    let denial = cluster
        .wait_for("the forged CSR to be denied", TIMEOUT, || {
            let api = csr_api.clone();
            let name = forged.clone();
            async move {
                let c = api.get(&name).await.ok()?;
                c.status?
                    .conditions?
                    .into_iter()
                    .find(|c| c.type_ == "Denied")
                    .and_then(|c| c.message)
            }
        })
        .await
        .unwrap();
    assert!(denial.contains("only the agent ServiceAccount"), "{denial}");
    // The agent's credentials may ask for certificates and nothing about ProfileRequests.
    // `kubectl auth can-i` exits 0 for yes and 1 for no.
    let can = |verb: &str, resource: &str, subresource: Option<&str>| {
        let mut cmd = Command::new(flamefleet_e2e::binaries::kubectl().unwrap());
        cmd.arg("--kubeconfig").arg(&cluster.kubeconfig).args([
            "auth",
            "can-i",
            verb,
            resource,
            "--all-namespaces",
            "--as",
            &agent_user,
        ]);
        if let Some(sub) = subresource {
            cmd.arg(format!("--subresource={sub}"));
        }
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("kubectl auth can-i")
            .success()
    };
    assert!(can("create", "certificatesigningrequests", None));
    for (verb, resource, sub) in [
        ("patch", "profilerequests.flamefleet.dev", Some("status")),
        ("update", "profilerequests.flamefleet.dev", Some("status")),
        ("get", "profilerequests.flamefleet.dev", None),
        ("create", "profileresultslices.flamefleet.dev", None),
        ("patch", "profileresultslices.flamefleet.dev", None),
        ("get", "secrets", None),
        ("list", "pods", None),
    ] {
        assert!(
            !can(verb, resource, sub),
            "the agent may not {verb} {resource} {sub:?}"
        );
    }

    step("the store speaks only HTTPS, with a certificate from the operator's CA");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), NAMESPACE);
    let ca = secrets.get(&format!("{RELEASE}-ca")).await.unwrap();
    let ca_pem = ca.data.unwrap()["tls.crt"].0.clone();
    let store_tls = secrets
        .get(&format!("{RELEASE}-store-tls"))
        .await
        .expect("the operator issued the store's certificate")
        .metadata
        .annotations
        .unwrap_or_default()
        .get("flamefleet.dev/store-hosts")
        .cloned()
        .unwrap_or_default();
    assert!(
        store_tls.split(',').any(|h| h == cluster.node_ip),
        "the store certificate names the public URL's host {}: {store_tls}",
        cluster.node_ip
    );
    let healthz = format!("https://{}:{STORE_NODE_PORT}/healthz", cluster.node_ip);
    let trusting = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&ca_pem).unwrap())
        .build()
        .unwrap();
    let answer = trusting
        .get(&healthz)
        .send()
        .await
        .expect("HTTPS with the operator's CA");
    assert!(
        answer.status().is_success(),
        "{healthz}: {}",
        answer.status()
    );
    let untrusting = reqwest::Client::new();
    let refused = untrusting.get(&healthz).send().await;
    assert!(
        refused.is_err(),
        "a client without the operator's CA must not trust the store"
    );
    let plain = untrusting
        .get(format!(
            "http://{}:{STORE_NODE_PORT}/healthz",
            cluster.node_ip
        ))
        .send()
        .await;
    assert!(
        plain.as_ref().map_or(true, |r| !r.status().is_success()),
        "the store must not answer plain HTTP: {plain:?}"
    );

    step("a workload Deployment, profiled with kubectl profile");
    let shop = format!("shop-{}", std::process::id());
    cluster.kubectl(&["create", "namespace", &shop]).unwrap();
    // Busy demo workloads left running would slow every later run on this 2-core node.
    let _shop_guard = DeleteOnDrop {
        cluster,
        namespace: shop.clone(),
    };
    cluster
        .kubectl(&[
            "label",
            "namespace",
            &shop,
            &format!("{E2E_LABEL}=real-node"),
        ])
        .unwrap();
    let deployment = serde_json::to_string(&checkout_deployment(&shop, &tag)).unwrap();
    let file = std::env::temp_dir().join(format!("{shop}-checkout.json"));
    std::fs::write(&file, deployment).unwrap();
    cluster
        .kubectl(&["apply", "-f", file.to_str().unwrap()])
        .unwrap();
    cluster
        .kubectl(&[
            "-n",
            &shop,
            "rollout",
            "status",
            "deploy/checkout",
            "--timeout=120s",
        ])
        .unwrap();

    let cpu_dir = tempfile::tempdir().unwrap();
    let (code, out, _) = kubectl_profile(
        cluster,
        &[
            "cpu",
            "deploy/checkout",
            "-n",
            &shop,
            "--duration",
            "5s",
            "-o",
            cpu_dir.path().to_str().unwrap(),
            "--format",
            "text",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let cpu = profile_in(cpu_dir.path());
    let top = pprof(&["-top"], &cpu);
    assert_eq!(top_function(&top), "price_basket", "{top}");
    assert!(top.contains("render_receipt"), "{top}");
    let tags = pprof(&["-tags"], &cpu);
    assert!(
        tags.contains("container: checkout") || tags.contains("checkout"),
        "samples are labelled with the kubelet's container: {tags}"
    );

    let heap_dir = tempfile::tempdir().unwrap();
    let (code, out, _) = kubectl_profile(
        cluster,
        &[
            "heap",
            "deploy/checkout",
            "-n",
            &shop,
            "--duration",
            "5s",
            "-o",
            heap_dir.path().to_str().unwrap(),
            "--format",
            "pprof",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let heap = profile_in(heap_dir.path());
    let inuse = pprof(&["-sample_index=inuse_space", "-top"], &heap);
    assert!(inuse.contains("cache_session"), "{inuse}");
    let alloc = pprof(&["-sample_index=alloc_space", "-top"], &heap);
    assert!(alloc.contains("scratch_buffer"), "{alloc}");

    let rq_dir = tempfile::tempdir().unwrap();
    let (code, out, _) = kubectl_profile(
        cluster,
        &[
            "runqlat",
            "deploy/checkout",
            "-n",
            &shop,
            "--duration",
            "3s",
            "-o",
            rq_dir.path().to_str().unwrap(),
            "--format",
            "text",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("usecs") && out.contains("p50"), "{out}");

    // The checkout's two payment threads wait nearly all the time: one reading a pipe, one
    // asleep. Their blocked time goes to the functions that wait. The kernel function under
    // each is not named here: the chart's default capabilities leave out SYSLOG, without
    // which /proc/kallsyms hides kernel addresses (perf_event_paranoid > 1), so kernel
    // frames stay unsymbolized (node-agent/tests/offcpu_capture.rs checks them).
    let off_dir = tempfile::tempdir().unwrap();
    let (code, out, err) = kubectl_profile(
        cluster,
        &[
            "offcpu",
            "deploy/checkout",
            "-n",
            &shop,
            "--duration",
            "3s",
            "-o",
            off_dir.path().to_str().unwrap(),
            "--format",
            "text",
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let off = profile_in(off_dir.path());
    let cum = pprof(&["-top", "-cum", "-nodecount=200"], &off);
    for function in ["wait_for_payment", "call_payment_backend"] {
        let share = cum_percent(&cum, function);
        // Each is one thread blocked nearly all the window, among the workers' short
        // waits for the session lock (time throttled by the CPU quota is not off-CPU time).
        assert!(
            share >= 20.0,
            "{function}: {share}% of the off-CPU time:\n{cum}"
        );
    }
    let tags = pprof(&["-tags"], &off);
    assert!(
        tags.contains("checkout"),
        "labelled with the container: {tags}"
    );

    step("a Go Deployment with no endpoint: its heap comes from the Go runtime's own profile");
    let inventory = serde_json::to_string(&demo_deployment(
        &shop,
        "inventory",
        &format!("flamefleet.local/inventory-demo:{tag}"),
    ))
    .unwrap();
    let file = std::env::temp_dir().join(format!("{shop}-inventory.json"));
    std::fs::write(&file, inventory).unwrap();
    cluster
        .kubectl(&["apply", "-f", file.to_str().unwrap()])
        .unwrap();
    cluster
        .kubectl(&[
            "-n",
            &shop,
            "rollout",
            "status",
            "deploy/inventory",
            "--timeout=120s",
        ])
        .unwrap();
    let go_dir = tempfile::tempdir().unwrap();
    let (code, out, err) = kubectl_profile(
        cluster,
        &[
            "heap",
            "deploy/inventory",
            "-n",
            &shop,
            "--duration",
            "2s",
            "-o",
            go_dir.path().to_str().unwrap(),
            "--format",
            "pprof",
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let go_heap = profile_in(go_dir.path());
    let inuse = pprof(&["-sample_index=inuse_space", "-top"], &go_heap);
    assert_eq!(top_function(&inuse), "main.loadCatalog", "{inuse}");
    assert!(inuse.contains("main.indexSKUs"), "{inuse}");
    let tags = pprof(&["-tags"], &go_heap);
    assert!(
        tags.contains("goruntime"),
        "samples name their source: {tags}"
    );

    step("a Python and a Java Deployment: their functions and methods by name, 5:3:2");
    for demo in &RUNTIME_DEMOS {
        let started = std::time::Instant::now();
        let name = demo.name;
        let spec = serde_json::to_string(&demo_deployment(
            &shop,
            name,
            &format!("flamefleet.local/{}:{tag}", demo.image),
        ))
        .unwrap();
        let file = std::env::temp_dir().join(format!("{shop}-{name}.json"));
        std::fs::write(&file, spec).unwrap();
        cluster
            .kubectl(&["apply", "-f", file.to_str().unwrap()])
            .unwrap();
        cluster
            .kubectl(&[
                "-n",
                &shop,
                "rollout",
                "status",
                &format!("deploy/{name}"),
                "--timeout=120s",
            ])
            .unwrap();
        cluster
            .wait_for(
                &format!("{name}'s \"{}\" log line", demo.ready),
                TIMEOUT,
                || {
                    let logs = cluster.kubectl(&["-n", &shop, "logs", &format!("deploy/{name}")]);
                    async move { logs.ok()?.contains(demo.ready).then_some(()) }
                },
            )
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (code, out, err) = kubectl_profile(
            cluster,
            &[
                "cpu",
                &format!("deploy/{name}"),
                "-n",
                &shop,
                "--duration",
                "10s",
                // About 5,000 samples of a busy core: shares within a point or two.
                "--frequency",
                "499",
                "-o",
                dir.path().to_str().unwrap(),
                "--format",
                "pprof",
            ],
        );
        assert_eq!(code, 0, "{out}{err}");
        let cpu = profile_in(dir.path());
        // Its own frames only: each sample's time goes to the innermost of them.
        let own = pprof(&["-top", &format!("-show={}", demo.own)], &cpu);
        let flat: Vec<f64> = demo.hot.iter().map(|f| flat_percent(&own, f)).collect();
        let sum: f64 = flat.iter().sum();
        assert!(
            sum >= 80.0,
            "{name}: the three hold {sum:.1}% of its samples:\n{own}"
        );
        for (f, (share, want)) in demo.hot.iter().zip(flat.iter().zip([50.0, 30.0, 20.0])) {
            let share = 100.0 * share / sum;
            assert!(
                (share - want).abs() <= 5.0,
                "{f}: {share:.1}% of the three, expected {want}% (5:3:2):\n{own}"
            );
        }
        let cum = pprof(&["-top", "-cum", "-nodecount=200"], &cpu);
        for caller in demo.callers {
            let share = cum_percent(&cum, caller);
            assert!(
                share >= sum - 5.0,
                "{caller} under {share}% of the samples, the three in {sum:.1}%:\n{cum}"
            );
        }
        eprintln!(
            "{name}: {} {:.1}% / {:.1}% / {:.1}% of its samples",
            demo.hot.join(" / "),
            flat[0],
            flat[1],
            flat[2]
        );
        // It burns up to a core: stop it before the next steps (its Deployment stays).
        cluster
            .kubectl(&[
                "-n",
                &shop,
                "scale",
                &format!("deploy/{name}"),
                "--replicas=0",
            ])
            .unwrap();
        let shop_pods: Api<Pod> = Api::namespaced(client.clone(), &shop);
        cluster
            .wait_for(&format!("{name}'s pod to be gone"), TIMEOUT, || {
                let api = shop_pods.clone();
                async move {
                    let left = api
                        .list(&ListParams::default().labels(&format!("app={name}")))
                        .await
                        .ok()?;
                    left.items.is_empty().then_some(())
                }
            })
            .await
            .unwrap();
        eprintln!(
            "{name}: deployed, profiled and stopped in {:.0} s",
            started.elapsed().as_secs_f64()
        );
    }

    step("an always-on policy: every pod's windows exported, no ProfileRequest");
    always_on(cluster, &client, &shop, &tag, &collector).await;

    step("a container the kubelet restarts during a capture is still profiled");
    let requests: Api<ProfileRequest> = Api::namespaced(client.clone(), &shop);
    let pod = Api::<Pod>::namespaced(client.clone(), &shop)
        .list(&ListParams::default().labels("app=checkout"))
        .await
        .unwrap()
        .items
        .remove(0);
    let pod_name = pod.metadata.name.clone().unwrap();
    let restarts = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .map_or(0, |c| c.restart_count)
    };
    let before = restarts(&pod);
    let request: ProfileRequest = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
        "metadata": {"name": "across-restart"},
        "spec": {"type": "cpu", "podNames": [pod_name], "duration": "30s"},
    }))
    .unwrap();
    requests
        .create(&PostParams::default(), &request)
        .await
        .unwrap();
    cluster
        .wait_for("the capture to run", TIMEOUT, || {
            let api = requests.clone();
            async move {
                let r = api.get("across-restart").await.ok()?;
                (r.status?.phase? == RequestPhase::Running).then_some(())
            }
        })
        .await
        .unwrap();
    // Kill the container's processes from the host, as an OOM kill would.
    let uid = pod.metadata.uid.clone().unwrap();
    let container_id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.container_id.clone())
        .unwrap();
    let cid = container_id.rsplit("://").next().unwrap();
    let procs = walkdir_find(Path::new("/sys/fs/cgroup"), &format!("pod{uid}"), cid)
        .expect("the container's cgroup under the pod's");
    for pid in std::fs::read_to_string(procs.join("cgroup.procs"))
        .unwrap()
        .lines()
    {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid.trim().parse().unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &shop);
    cluster
        .wait_for("the kubelet to restart the container", TIMEOUT, || {
            let api = pods_api.clone();
            let name = pod_name.clone();
            async move {
                let p = api.get(&name).await.ok()?;
                let running = p
                    .status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .and_then(|c| c.first())
                    .and_then(|c| c.state.as_ref())
                    .and_then(|s| s.running.as_ref())
                    .is_some();
                (restarts(&p) > before && running).then_some(())
            }
        })
        .await
        .unwrap();
    let done = cluster
        .wait_for("the capture across the restart to finish", TIMEOUT, || {
            let api = requests.clone();
            async move {
                let r = api.get("across-restart").await.ok()?;
                r.status
                    .as_ref()?
                    .phase
                    .filter(|p| p.is_terminal())
                    .map(|_| r.clone())
            }
        })
        .await
        .unwrap();
    assert_eq!(
        done.status.as_ref().and_then(|s| s.phase),
        Some(RequestPhase::Succeeded),
        "{:#?}",
        done.status
    );
    let restart_dir = tempfile::tempdir().unwrap();
    let (code, out, _) = kubectl_profile(
        cluster,
        &[
            "get",
            "across-restart",
            "-n",
            &shop,
            "-o",
            restart_dir.path().to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{out}");
    let across = profile_in(restart_dir.path());
    let tags = pprof(&["-tags"], &across);
    assert!(
        tags.contains("(started during capture)"),
        "samples of the restarted container: {tags}"
    );
    let top = pprof(
        &["-tagfocus=container=(started during capture)", "-top"],
        &across,
    );
    assert!(top.contains("price_basket"), "{top}");

    let faulty = real_node_faults::Shop {
        cluster,
        client: client.clone(),
        ns: shop.clone(),
        pod: pod_name.clone(),
    };
    real_node_faults::agent_oom_killed_mid_capture(&faulty).await;
    real_node_faults::kubelet_restarted(&faulty).await;

    step("helm upgrade to a changed image keeps finished requests and their artifacts");
    let new_tag = format!("{tag}-upgrade");
    cluster
        .build_images(Some(&new_tag), Some("upgrade-test"))
        .expect("building the second tag");
    // Captures in flight while the upgrade rolls the agent (and the operators).
    let mut roll = real_node_faults::AgentRoll::start(&faulty, &bpf_before).await;
    cluster
        .install_flamefleet(RELEASE, NAMESPACE, &values(cluster, &new_tag, otlp_port))
        .expect("helm upgrade");
    roll.rolled();
    let agent_image = cluster
        .kubectl(&[
            "-n",
            NAMESPACE,
            "get",
            "ds",
            &format!("{RELEASE}-agent"),
            "-o",
            "jsonpath={.spec.template.spec.containers[0].image}",
        ])
        .unwrap();
    assert!(agent_image.ends_with(&new_tag), "{agent_image}");
    let kept_dir = tempfile::tempdir().unwrap();
    let (code, out, _) = kubectl_profile(
        cluster,
        &[
            "get",
            "across-restart",
            "-n",
            &shop,
            "-o",
            kept_dir.path().to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "the artifact outlives the upgrade: {out}");
    assert_eq!(
        std::fs::read(profile_in(kept_dir.path())).unwrap(),
        std::fs::read(&across).unwrap(),
        "the same bytes (the CLI checked their sha256)"
    );
    roll.check(&faulty).await;

    step("helm uninstall leaves no agent BPF program loaded");
    // A capture in flight when the agent goes: its programs must go with it.
    let long: ProfileRequest = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
        "metadata": {"name": "in-flight"},
        "spec": {"type": "runqlat", "podNames": [pod_name], "duration": "60s"},
    }))
    .unwrap();
    requests
        .create(&PostParams::default(), &long)
        .await
        .unwrap();
    cluster
        .wait_for("the agent's programs to be loaded", TIMEOUT, || async {
            (!loaded_agent_programs().is_empty()).then_some(())
        })
        .await
        .unwrap();
    cluster
        .uninstall_flamefleet(RELEASE, NAMESPACE, false)
        .expect("helm uninstall");
    let pods_left = pods.clone();
    cluster
        .wait_for("the agent pod to be gone", TIMEOUT, || {
            let api = pods_left.clone();
            async move {
                let left = api
                    .list(&ListParams::default().labels("app.kubernetes.io/name=flamefleet-agent"))
                    .await
                    .ok()?;
                left.items.is_empty().then_some(())
            }
        })
        .await
        .unwrap();
    let leftover = cluster
        .wait_for("the agent's BPF programs to unload", TIMEOUT, || async {
            loaded_agent_programs().is_empty().then_some(())
        })
        .await;
    assert!(
        leftover.is_ok(),
        "still loaded: {:?}",
        loaded_agent_programs()
    );
    let _ = cluster.kubectl(&["delete", "namespace", &shop, "--wait=false"]);
}

/// An always-on policy (`schedule: "@continuous"`, the chart's windows shortened to 2 s
/// every 3 s) over a two-pod Deployment: each pod's windows reach the Collector with the
/// kubelet's pod and the node, the Deployment and the pod's own samples; the policy's status
/// counts them with their coverage; no ProfileRequest is created; deleting the policy stops
/// the agent's windows.
async fn always_on(
    cluster: &Cluster,
    client: &kube::Client,
    namespace: &str,
    tag: &str,
    collector: &Collector,
) {
    use flamefleet_api::SamplingPolicy;
    use flamefleet_api::continuous::ContinuousStatus;
    let started = std::time::Instant::now();
    let all_requests: Api<ProfileRequest> = Api::all(client.clone());
    let requests_before = all_requests
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .len();
    // Two pods of the checkout demo, held to a tenth of a core each.
    cluster
        .apply(&flamefleet_e2e::cluster::demo_deployment(
            namespace,
            "always",
            &format!("flamefleet.local/checkout-demo:{tag}"),
            2,
            ["10m", "100m"],
            &["1"],
        ))
        .unwrap();
    cluster
        .kubectl(&[
            "-n",
            namespace,
            "rollout",
            "status",
            "deploy/always",
            "--timeout=120s",
        ])
        .unwrap();
    let pods: Vec<String> = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels("app=always"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    assert_eq!(pods.len(), 2, "{pods:?}");
    let policies: Api<SamplingPolicy> = Api::namespaced(client.clone(), namespace);
    let policy: SamplingPolicy = serde_json::from_value(json!({
        "apiVersion": "flamefleet.dev/v1alpha1", "kind": "SamplingPolicy",
        "metadata": {"name": "always"},
        "spec": {
            "schedule": "@continuous",
            "template": {
                "type": "cpu",
                "selector": {"matchLabels": {"app": "always"}},
                "duration": "10s",
                // A tenth of a core at 99 Hz: about 20 samples in each 2 s window.
                "cpu": {"frequencyHz": 99},
            },
        },
    }))
    .unwrap();
    policies
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    let policy_name = format!("{namespace}/always");
    let windows_of = |pod: &str| {
        collector
            .received()
            .into_iter()
            .filter(|d| {
                d.resource_profiles.first().is_some_and(|rp| {
                    let a = resource_attributes(rp);
                    a.get("flamefleet.policy.name") == Some(&policy_name)
                        && a.get("k8s.pod.name").map(String::as_str) == Some(pod)
                })
            })
            .collect::<Vec<_>>()
    };
    let status: ContinuousStatus = cluster
        .wait_for(
            "three windows of each pod exported and 85% coverage",
            TIMEOUT,
            || {
                let api = policies.clone();
                let ready = pods.iter().all(|p| windows_of(p).len() >= 3);
                async move {
                    let s = api.get("always").await.ok()?.status?.continuous?;
                    (ready && s.min_coverage_percent.is_some_and(|c| c >= 85)).then_some(s)
                }
            },
        )
        .await
        .unwrap();
    eprintln!(
        "always-on: {:.1} s to three windows of each pod and 85% coverage: {status:?}",
        started.elapsed().as_secs_f64()
    );
    assert_eq!((status.pods, status.nodes), (2, 1), "{status:#?}");
    assert_eq!((status.window_seconds, status.period_seconds), (2, 3));
    assert_eq!(status.dropped, 0, "{status:#?}");
    assert!(status.exported >= 6, "{status:#?}");
    for pod in &pods {
        let windows = windows_of(pod);
        // The operator reads a pod's owner once, beside its first window.
        let last = windows
            .last()
            .map(|d| resource_attributes(&d.resource_profiles[0]));
        assert_eq!(
            last.as_ref()
                .and_then(|a| a.get("k8s.deployment.name"))
                .map(String::as_str),
            Some("always"),
            "{last:?}"
        );
        for data in windows {
            let rp = &data.resource_profiles[0];
            let attrs = resource_attributes(rp);
            assert_eq!(attrs["k8s.namespace.name"], namespace, "{attrs:?}");
            assert_eq!(attrs["k8s.node.name"], cluster.node, "{attrs:?}");
            let back = flamefleet_pprof::otlp::to_pprof(
                &data.resource_profiles,
                data.dictionary.as_ref().expect("a dictionary"),
            )
            .expect("a window reads back as pprof");
            assert!(
                flamefleet_pprof::value_total(&back, "samples", "count").unwrap_or(0) > 0,
                "{pod}: an exported window has samples"
            );
            let functions: Vec<&str> = back
                .function
                .iter()
                .map(|f| back.string_table[f.name as usize].as_str())
                .collect();
            assert!(
                functions.contains(&"price_basket") || functions.contains(&"render_receipt"),
                "{pod}: the demo's own functions: {functions:?}"
            );
            for sample in &back.sample {
                let label = sample
                    .label
                    .iter()
                    .find(|l| back.string_table[l.key as usize] == "pod")
                    .map(|l| back.string_table[l.str as usize].as_str());
                assert_eq!(label, Some(pod.as_str()), "a sample of another pod");
            }
        }
    }
    let requests_after = all_requests
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .len();
    assert_eq!(
        requests_after, requests_before,
        "always-on windows created ProfileRequests"
    );
    // Deleted: the agent stops (its gauge of always-on pods, on its probe port).
    policies
        .delete("always", &kube::api::DeleteParams::default())
        .await
        .unwrap();
    let agent_ip = Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default().labels("app.kubernetes.io/name=flamefleet-agent"))
        .await
        .unwrap()
        .items
        .first()
        .and_then(|p| p.status.as_ref()?.pod_ip.clone())
        .expect("the agent's pod IP");
    cluster
        .wait_for("the agent to stop its always-on windows", TIMEOUT, || {
            let url = format!("http://{agent_ip}:9091/metrics");
            async move {
                let text = reqwest::get(url).await.ok()?.text().await.ok()?;
                text.lines()
                    .any(|l| l == "flamefleet_agent_continuous_pods 0")
                    .then_some(())
            }
        })
        .await
        .unwrap();
    cluster
        .kubectl(&["-n", namespace, "delete", "deploy/always", "--wait=false"])
        .unwrap();
    eprintln!("always-on step: {:.1} s", started.elapsed().as_secs_f64());
}

/// The directory named `leaf` below a directory named `parent`, anywhere under `root`.
fn walkdir_find(root: &Path, parent: &str, leaf: &str) -> Option<PathBuf> {
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if path.file_name().is_some_and(|n| n == leaf)
                && dir.file_name().is_some_and(|n| n == parent)
                && path.join("cgroup.procs").exists()
                && std::fs::read_to_string(path.join("cgroup.procs"))
                    .is_ok_and(|p| !p.trim().is_empty())
            {
                return Some(path);
            }
            stack.push(path);
        }
    }
    None
}
