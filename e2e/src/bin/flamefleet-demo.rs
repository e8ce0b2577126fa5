//! `flamefleet-demo`: the main job, locally. Against a running local control plane
//! (`flamefleet-controlplane up`), it starts a demo workload in a real pod-shaped cgroup, a
//! node agent and the operator as processes, then profiles the workload with
//! `kubectl profile cpu|heap|runqlat` and downloads the results. Run by `scripts/demo.sh`.
//!
//! There is no kubelet: the demo creates the Pod objects and writes their status as a kubelet
//! would, with container IDs that name the cgroups it made.

use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use flamefleet_e2e::agent_pki::AgentPki;
use flamefleet_e2e::control_plane::client_from_kubeconfig;
use flamefleet_e2e::pods::{PodFixture, create_running_pod};
use flamefleet_e2e::workload::{
    cgroup2_mount, free_port, random_hex, remove_cgroup_tree, spawn_in_cgroup,
};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

const DEMO_NS: &str = "flamefleet-demo";
const AGENT_NS: &str = "flamefleet";
const NODE: &str = "demo-node";

#[derive(Parser)]
#[command(about = "Run Flamefleet end to end on this machine")]
struct Args {
    /// Kubeconfig of the local control plane.
    #[arg(long)]
    kubeconfig: PathBuf,
    /// Where the demo keeps its state, logs and downloaded profiles.
    #[arg(long)]
    dir: PathBuf,
    /// Directory holding flamefleet-agent, flamefleet-operator and kubectl-profile.
    #[arg(long)]
    bins: PathBuf,
    /// Source of the demo workload.
    #[arg(long)]
    workload: PathBuf,
    /// Capture duration of each request.
    #[arg(long, default_value = "10s")]
    duration: String,
}

/// Child processes that die with the demo (SIGKILL on drop, PR_SET_PDEATHSIG on crash).
struct Procs(Vec<(String, Child)>);

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Spawns `cmd` logging to `log`; waits for a stdout line containing `ready` when given.
fn spawn(name: &str, mut cmd: Command, log: &Path, ready: Option<&str>) -> Result<Child> {
    let err = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    cmd.stderr(err).stdout(Stdio::piped()).stdin(Stdio::null());
    die_with_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting the {name}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let Some(marker) = ready else {
        return Ok(child);
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) if line.contains(marker) => return Ok(child),
            Ok(_) => {}
            Err(_) => {
                if let Ok(Some(status)) = child.try_wait() {
                    bail!(
                        "the {name} exited ({status}); its log, {}:\n{}",
                        log.display(),
                        std::fs::read_to_string(log).unwrap_or_default()
                    );
                }
                if Instant::now() > deadline {
                    bail!(
                        "the {name} did not get ready in 60 s; see {}",
                        log.display()
                    );
                }
            }
        }
    }
}

async fn ensure_namespace(client: &kube::Client, name: &str) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating namespace {name}")),
    }
}

/// The agent's Pod object, as its DaemonSet and the kubelet would make it.
async fn agent_pod(client: &kube::Client, port: u16) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), AGENT_NS);
    let name = format!("flamefleet-agent-{NODE}");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "flamefleet-agent"}},
        "spec": {"nodeName": NODE, "containers": [{
            "name": "agent", "image": "flamefleet-agent:local",
            "ports": [{"name": "grpc", "containerPort": port}]
        }]}
    }))?;
    api.patch(
        &name,
        &PatchParams::apply("flamefleet-demo").force(),
        &Patch::Apply(&pod),
    )
    .await
    .context("creating the agent pod")?;
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    api.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        }})),
    )
    .await
    .context("setting the agent pod Running")?;
    Ok(())
}

fn step(text: &str) {
    println!("\n==> {text}");
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if !nix::unistd::geteuid().is_root() {
        bail!("the demo loads eBPF programs and creates cgroups: run it as root");
    }
    let dir = std::path::absolute(&args.dir)?;
    let profiles = dir.join("profiles");
    let logs = dir.join("logs");
    for d in [&profiles, &logs] {
        if d.exists() {
            std::fs::remove_dir_all(d).with_context(|| format!("clearing {}", d.display()))?;
        }
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let client = client_from_kubeconfig(&args.kubeconfig).await?;
    for ns in [DEMO_NS, AGENT_NS] {
        ensure_namespace(&client, ns).await?;
    }

    step("demo workload: a checkout service in a pod-shaped cgroup");
    let workload_bin = dir.join("checkout");
    let out = Command::new("cc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-o"])
        .arg(&workload_bin)
        .arg(&args.workload)
        .output()
        .context("running cc (install gcc)")?;
    if !out.status.success() {
        bail!(
            "compiling the demo workload failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let container_id = random_hex(32)?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), DEMO_NS);
    let pod_name = format!("checkout-{}", &container_id[..5]);
    let pod = create_running_pod(
        &pods,
        &PodFixture::new(&pod_name, NODE, &format!("containerd://{container_id}"))
            .label("app", "checkout"),
    )
    .await?;
    let uid = pod.metadata.uid.clone().context("the pod has no UID")?;
    let cgroup_root = cgroup2_mount()?.join("flamefleet-demo");
    let cgroup = cgroup_root.join(format!("kubepods/burstable/pod{uid}/{container_id}"));
    std::fs::create_dir_all(&cgroup).with_context(|| format!("creating {}", cgroup.display()))?;
    let mut procs = Procs(Vec::new());
    procs.0.push((
        "workload".into(),
        spawn_in_cgroup(&cgroup, &workload_bin, &[])?,
    ));
    println!(
        "pod {DEMO_NS}/{pod_name} on node {NODE}: cgroup {}",
        cgroup.display()
    );

    step("node agent and operator (mTLS between them, built-in artifact store)");
    let ca = AgentPki::generate(&dir.join("pki"), "flamefleet-demo-ca")?;
    let (agent_cert, agent_key) = ca.issue_agent(NODE)?;
    let pki = ca.files;
    let agent_port = free_port()?;
    let mut agent = Command::new(args.bins.join("flamefleet-agent"));
    agent
        .arg("serve")
        .args([
            "--node-name",
            NODE,
            "--listen",
            &format!("127.0.0.1:{agent_port}"),
        ])
        .arg("--tls-ca")
        .arg(&pki.ca_cert)
        .arg("--tls-cert")
        .arg(&agent_cert)
        .arg("--tls-key")
        .arg(&agent_key)
        .arg("--kubeconfig")
        .arg(&args.kubeconfig)
        .arg("--cgroup-root")
        .arg(&cgroup_root)
        .env("RUST_LOG", "info");
    let agent_log = logs.join("agent.log");
    procs.0.push((
        "agent".into(),
        spawn("agent", agent, &agent_log, Some("listening on"))?,
    ));
    agent_pod(&client, agent_port).await?;
    let secret = dir.join("store.secret");
    std::fs::write(&secret, random_hex(32)?)?;
    let store_port = free_port()?;
    let mut operator = Command::new(args.bins.join("flamefleet-operator"));
    operator
        .arg("--kubeconfig")
        .arg(&args.kubeconfig)
        .args(["--agent-namespace", AGENT_NS])
        .arg("--tls-ca")
        .arg(&pki.ca_cert)
        .arg("--tls-cert")
        .arg(&pki.operator_cert)
        .arg("--tls-key")
        .arg(&pki.operator_key)
        .args(["--store", "builtin"])
        .arg("--store-dir")
        .arg(dir.join("store"))
        .arg("--store-secret-file")
        .arg(&secret)
        .args(["--store-listen", &format!("127.0.0.1:{store_port}")])
        .args(["--store-url", &format!("http://127.0.0.1:{store_port}/")])
        .args(["--metrics-listen", &format!("127.0.0.1:{}", free_port()?)])
        .env("RUST_LOG", "info");
    let operator_log = logs.join("operator.log");
    procs.0.push((
        "operator".into(),
        spawn("operator", operator, &operator_log, None)?,
    ));
    println!(
        "agent log: {}\noperator log: {}",
        agent_log.display(),
        operator_log.display()
    );

    step(&format!(
        "kubectl profile cpu|heap|runqlat -l app=checkout --duration {} (in parallel)",
        args.duration
    ));
    let kp = args.bins.join("kubectl-profile");
    let mut captures = Vec::new();
    for (kind, format) in [("cpu", "svg"), ("heap", "svg"), ("runqlat", "text")] {
        let out_dir = profiles.join(kind);
        let mut cmd = Command::new(&kp);
        cmd.arg(kind)
            .args(["-l", "app=checkout", "--duration", &args.duration])
            .args(["-n", DEMO_NS, "--format", format])
            .arg("--kubeconfig")
            .arg(&args.kubeconfig)
            .arg("-o")
            .arg(&out_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        die_with_parent(&mut cmd);
        captures.push((kind, cmd.spawn().context("running kubectl-profile")?));
    }
    let mut failed = Vec::new();
    let mut names = Vec::new();
    for (kind, child) in captures {
        let out = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!(
            "\n--- kubectl profile {kind} ---\n{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            failed.push(kind);
        }
        if let Some(name) = stdout
            .lines()
            .find_map(|l| l.strip_prefix("profilerequest.flamefleet.dev/"))
            .and_then(|l| l.split_whitespace().next())
        {
            names.push((kind, name.to_string()));
        }
    }
    if !failed.is_empty() {
        bail!(
            "the {} capture(s) failed; agent log: {}, operator log: {}",
            failed.join(", "),
            agent_log.display(),
            operator_log.display()
        );
    }

    step("top functions of the CPU and heap profiles (kubectl profile get NAME --format text)");
    for (kind, name) in names.iter().filter(|(k, _)| *k != "runqlat") {
        let out = Command::new(&kp)
            .args(["get", name, "-n", DEMO_NS, "--format", "text"])
            .arg("--kubeconfig")
            .arg(&args.kubeconfig)
            .arg("-o")
            .arg(profiles.join(kind))
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        println!("\n--- {kind}: {name} ---");
        for line in text.lines().take(14) {
            println!("{line}");
        }
        if !out.status.success() {
            bail!(
                "kubectl profile get {name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    drop(procs);
    remove_cgroup_tree(&cgroup_root);
    step("done: real profiles, downloaded and checked against their sha256");
    let mut files: Vec<PathBuf> = Vec::new();
    for kind in ["cpu", "heap", "runqlat"] {
        if let Ok(entries) = std::fs::read_dir(profiles.join(kind)) {
            files.extend(entries.flatten().map(|e| e.path()));
        }
    }
    files.sort();
    for f in &files {
        println!("  {}", f.display());
    }
    println!(
        "\nOpen one with: go tool pprof -http=: {}\nThe requests stay in the API server: kubectl get preq -n {DEMO_NS}",
        files
            .iter()
            .find(|f| f.to_string_lossy().ends_with(".pb.gz"))
            .map(|f| f.display().to_string())
            .unwrap_or_default()
    );
    Ok(())
}
