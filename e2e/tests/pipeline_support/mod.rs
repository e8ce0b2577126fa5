//! The end-to-end pipeline fixture: a real control plane, agents (`flamefleet-agent serve`)
//! and an operator (`flamefleet-operator`) as processes, pods whose container IDs map to
//! real cgroups holding real workloads.
//!
//! Binaries: `flamefleet-agent` and `flamefleet-operator` are built with
//! `cargo build -p flamefleet-agent -p flamefleet-operator` into the target directory of the
//! running test (found from the test executable's path: `<target>/<profile>/deps/<test>`),
//! once per test process; a no-op when they are fresh. `FLAMEFLEET_AGENT_BIN` and
//! `FLAMEFLEET_OPERATOR_BIN` override the paths (then nothing is built).
//!
//! Isolation: every fixture has its own agent namespace, node names, cgroup directory,
//! store directory, ports and Lease, and its operator only handles requests labelled with
//! the fixture's id (`--request-selector`), so tests run in parallel on one API server.
#![allow(dead_code)]

pub mod otelcol;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use flamefleet_api::{
    Artifact, ProfileDownload, ProfileDownloadSpec, ProfileRequest, RequestPhase,
};
use flamefleet_e2e::TestNamespace;
use flamefleet_e2e::agent_pki::AgentPki;
use flamefleet_e2e::pods::PodFixture;
use flamefleet_e2e::workload::{self, remove_cgroup_tree};

/// The cgroup2 mount point (`/sys/fs/cgroup` or `/sys/fs/cgroup/unified`).
pub fn cgroup2_mount() -> PathBuf {
    workload::cgroup2_mount().expect("a cgroup2 mount")
}

fn free_port() -> u16 {
    workload::free_port().expect("a free port")
}

fn random_hex(bytes: usize) -> String {
    workload::random_hex(bytes).expect("random bytes")
}

fn spawn_in_cgroup(cgroup: &Path, program: &Path, args: &[&str]) -> Child {
    workload::spawn_in_cgroup(cgroup, program, args).expect("starting a workload in its cgroup")
}
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;

/// Label carried by every request of a fixture; the fixture's operator watches only these.
pub const RUN_LABEL: &str = "flamefleet.dev/e2e-run";

/// Serializes the CPU-heavy pipeline tests of one binary (2 cores).
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Fails (never skips) without root: agents load eBPF programs and tests create cgroups.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the pipeline tests run eBPF agents and create cgroups: expected root, found uid {}; run scripts/test.sh or `cargo test` as root",
        nix::unistd::geteuid()
    );
}

/// Paths of our own binaries.
#[derive(Debug)]
pub struct Bins {
    pub agent: PathBuf,
    pub operator: PathBuf,
    /// The kubectl plugin (`kubectl profile`), built beside them.
    pub kubectl_profile: PathBuf,
    /// The built-in store as its own process (`flamefleet-store`), built beside them.
    pub store: PathBuf,
}

/// Builds (once per process) and locates `flamefleet-agent`, `flamefleet-operator` and
/// `kubectl-profile`.
pub fn bins() -> &'static Bins {
    static BINS: OnceLock<Bins> = OnceLock::new();
    BINS.get_or_init(|| {
        if let (Some(agent), Some(operator)) = (
            std::env::var_os("FLAMEFLEET_AGENT_BIN"),
            std::env::var_os("FLAMEFLEET_OPERATOR_BIN"),
        ) {
            let agent = PathBuf::from(agent);
            let kubectl_profile = std::env::var_os("FLAMEFLEET_KUBECTL_PROFILE_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|| agent.with_file_name("kubectl-profile"));
            let store = std::env::var_os("FLAMEFLEET_STORE_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|| agent.with_file_name("flamefleet-store"));
            return Bins {
                agent,
                operator: operator.into(),
                kubectl_profile,
                store,
            };
        }
        let exe = std::env::current_exe().expect("the test executable's path");
        // <target>/<profile>/deps/<test-exe>
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test executable under <target>/<profile>/deps");
        let target_dir = profile_dir.parent().expect("<target>/<profile>");
        let profile = profile_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("debug");
        let mut build = flamefleet_e2e::binaries::nested_cargo();
        build
            .args([
                "build",
                "-p",
                "flamefleet-agent",
                "-p",
                "flamefleet-operator",
                "-p",
                "kubectl-profile",
                "--bins",
            ])
            .env("CARGO_TARGET_DIR", target_dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile == "release" {
            build.arg("--release");
        }
        let out = build
            .output()
            .expect("running cargo build for the agent and operator");
        assert!(
            out.status.success(),
            "building flamefleet-agent and flamefleet-operator failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Bins {
            agent: profile_dir.join("flamefleet-agent"),
            operator: profile_dir.join("flamefleet-operator"),
            kubectl_profile: profile_dir.join("kubectl-profile"),
            store: profile_dir.join("flamefleet-store"),
        }
    })
}

/// Runs `kubectl profile ARGS` with `kubeconfig` in `ns`; (success, stdout + stderr).
pub fn kubectl_profile(kubeconfig: &Path, ns: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(&bins().kubectl_profile)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-n", ns])
        .args(args)
        .output()
        .expect("running kubectl-profile");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The workload binary (spin / alloc / wake), compiled once per process with frame pointers.
pub fn workload_bin() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let dir =
            std::env::temp_dir().join(format!("flamefleet-e2e-workload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("workload dir");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pipeline_support/workload.c");
        let bin = dir.join("workload");
        let out = Command::new("cc")
            .args(["-O1", "-g", "-fno-omit-frame-pointer", "-o"])
            .arg(&bin)
            .arg(&src)
            .output()
            .expect("running cc (install gcc)");
        assert!(
            out.status.success(),
            "cc failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        bin
    })
}

/// A child process killed (SIGKILL) on drop, its output in a log file.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Fails when the process has exited.
    pub fn assert_alive(&mut self) {
        if let Some(c) = self.child.as_mut()
            && let Ok(Some(status)) = c.try_wait()
        {
            panic!("{} exited ({status}):\n{}", self.name, self.log_tail());
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Spawns `cmd` with stderr to `log`; returns the first stdout line matching `ready` (or
/// panics with the log after `timeout`). Stdout keeps being drained.
fn spawn_logged(
    name: &str,
    cmd: Command,
    log: &Path,
    ready: Option<&str>,
    timeout: Duration,
) -> (Proc, Option<String>) {
    let (proc, mut lines) = spawn_logged_lines(name, cmd, log, ready, timeout);
    let ready = ready.and_then(|_| lines.pop());
    (proc, ready)
}

/// As [`spawn_logged`], returning every stdout line up to and including the `ready` one.
fn spawn_logged_lines(
    name: &str,
    mut cmd: Command,
    log: &Path,
    ready: Option<&str>,
    timeout: Duration,
) -> (Proc, Vec<String>) {
    let err = std::fs::File::create(log).unwrap();
    cmd.stderr(err).stdout(Stdio::piped()).stdin(Stdio::null());
    // Die with the test process.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut proc = Proc {
        name: name.to_string(),
        child: Some(child),
        log: log.to_path_buf(),
    };
    let Some(marker) = ready else {
        return (proc, Vec::new());
    };
    let deadline = Instant::now() + timeout;
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(line) if line.contains(marker) => {
                seen.push(line);
                return (proc, seen);
            }
            Ok(line) => seen.push(line),
            Err(_) => {
                proc.assert_alive();
                assert!(
                    Instant::now() < deadline,
                    "{name} did not print {marker:?} within {timeout:?}:\n{}",
                    proc.log_tail()
                );
            }
        }
    }
}

/// Processes in a pod's container cgroup (cgroupfs kubelet layout).
#[derive(Debug)]
pub struct PodWorkload {
    pub pod: Pod,
    pub cgroup: PathBuf,
    children: Vec<Child>,
}

impl PodWorkload {
    /// PIDs of the workload processes.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }
}

impl Drop for PodWorkload {
    fn drop(&mut self) {
        let _ = std::fs::write(self.cgroup.join("cgroup.kill"), b"1");
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Options of a fixture.
#[derive(Debug, Clone)]
pub struct PipelineOptions {
    pub nodes: usize,
    pub capture_grace: Duration,
    pub lease_seconds: u64,
    /// More flags for the operator (e.g. tenant limits).
    pub operator_args: Vec<String>,
    /// The store URL the operator signs for agents (`--store-url`); its own built-in
    /// store's address when `None`.
    pub store_url: Option<String>,
    /// The operator's `--min-run-interval`: tests drive policies with schedules of a few
    /// seconds, below the cluster default of a minute. `None` passes no flag.
    pub min_run_interval: Option<String>,
    /// Another operator binary than the one built beside the test (a peer, in benchmarks).
    pub operator_bin: Option<PathBuf>,
    /// Runs the built-in store as its own process (`flamefleet-store`, the chart's layout)
    /// and the operator with `--store remote`, so that a test can stop the store alone.
    pub store_process: bool,
    /// The store's directory (default: `store` in the fixture's directory), e.g. a small
    /// volume a test fills.
    pub store_dir: Option<PathBuf>,
    /// Environment of the processes a node runs (operator, agents, store), e.g. a faked
    /// clock (`LD_PRELOAD` of libfaketime).
    pub node_env: Vec<(String, String)>,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        Self {
            nodes: 2,
            capture_grace: Duration::from_secs(20),
            lease_seconds: 4,
            operator_args: Vec::new(),
            store_url: None,
            min_run_interval: Some("1s".into()),
            operator_bin: None,
            store_process: false,
            store_dir: None,
            node_env: Vec::new(),
        }
    }
}

/// A running pipeline: agents on `nodes`, one operator, and the workloads of the pods.
pub struct Pipeline {
    pub id: String,
    pub agent_ns: TestNamespace,
    pub client: kube::Client,
    pub kubeconfig: PathBuf,
    pub dir: tempfile::TempDir,
    pub ca: AgentPki,
    pub cgroup_root: PathBuf,
    pub nodes: Vec<String>,
    pub agents: Vec<Proc>,
    pub agent_ports: Vec<u16>,
    /// The agents' probe ports (`/metrics`), by node index.
    pub agent_probe_ports: Vec<u16>,
    agent_restarts: usize,
    pub operator: Option<Proc>,
    operator_starts: u32,
    /// The store process, with [`PipelineOptions::store_process`].
    pub store: Option<Proc>,
    store_starts: u32,
    pub store_port: u16,
    pub metrics_port: u16,
    options: PipelineOptions,
    workloads: Vec<PodWorkload>,
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        // FLAMEFLEET_E2E_KEEP=1 keeps the logs, store and PKI for inspection.
        if std::env::var_os("FLAMEFLEET_E2E_KEEP").is_some() {
            self.dir.disable_cleanup(true);
            eprintln!("kept {}", self.dir.path().display());
        }
        self.operator = None;
        self.store = None;
        self.agents.clear();
        self.workloads.clear();
        remove_cgroup_tree(&self.cgroup_root);
        if let Some(name) = self.cgroup_root.file_name() {
            for line in std::fs::read_to_string("/proc/mounts")
                .unwrap_or_default()
                .lines()
            {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() > 3
                    && f[2] == "cgroup"
                    && f[3].split(',').any(|o| o == "memory" || o == "cpu")
                {
                    let dir = Path::new(f[1]).join(name);
                    if dir.exists() {
                        remove_cgroup_tree(&dir);
                    }
                }
            }
        }
    }
}

/// The mount point of the v1 hierarchy of `controller` (a hybrid host).
fn v1_root(controller: &str) -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/mounts").expect("reading /proc/mounts");
    mounts
        .lines()
        .find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 3 && f[2] == "cgroup" && f[3].split(',').any(|o| o == controller))
                .then(|| PathBuf::from(f[1]))
        })
        .unwrap_or_else(|| {
            panic!(
                "a {controller} controller: in cgroup v2 or a v1 {controller} hierarchy (mount one at /sys/fs/cgroup/{controller})"
            )
        })
}

/// What the operator logs once it holds the lease and its controllers start.
const LEADING_MARKER: &str = "leading; starting";

static FIXTURES: AtomicU32 = AtomicU32::new(0);

impl Pipeline {
    /// Starts agents and an operator.
    pub async fn start(options: PipelineOptions) -> Self {
        require_root();
        let bins = bins();
        let agent_ns = TestNamespace::create("ff-agents")
            .await
            .expect("control plane and namespace");
        let client = agent_ns.client();
        let kubeconfig = agent_ns.control_plane().kubeconfig().to_path_buf();
        let n = FIXTURES.fetch_add(1, Ordering::Relaxed);
        let id = format!("pl-{}-{n}", std::process::id());
        let dir = tempfile::Builder::new()
            .prefix("flamefleet-pipeline-")
            .tempdir()
            .unwrap();
        let ca = AgentPki::generate(&dir.path().join("pki"), "flamefleet-operator-ca")
            .expect("generating the agent PKI");
        let cgroup_root = cgroup2_mount().join(format!("flamefleet-e2e-{id}"));
        std::fs::create_dir_all(cgroup_root.join("kubepods/burstable"))
            .unwrap_or_else(|e| panic!("creating {}: {e}", cgroup_root.display()));
        let nodes: Vec<String> = (1..=options.nodes).map(|i| format!("{id}-n{i}")).collect();
        let mut pipeline = Self {
            id,
            agent_ns,
            client,
            kubeconfig,
            ca,
            cgroup_root,
            nodes: nodes.clone(),
            agents: Vec::new(),
            agent_ports: Vec::new(),
            agent_probe_ports: Vec::new(),
            agent_restarts: 0,
            operator: None,
            operator_starts: 0,
            store: None,
            store_starts: 0,
            store_port: free_port(),
            metrics_port: free_port(),
            options,
            workloads: Vec::new(),
            dir,
        };
        for i in 0..nodes.len() {
            let (proc, port, probe_port) = pipeline.spawn_agent(i);
            pipeline.agent_probe_ports.push(probe_port);
            pipeline.agents.push(proc);
            pipeline.agent_ports.push(port);
            pipeline.agent_pod(i, port).await;
        }
        let _ = bins;
        if pipeline.options.store_process {
            pipeline.start_store();
        }
        pipeline.start_operator();
        pipeline
    }

    fn spawn_agent(&self, i: usize) -> (Proc, u16, u16) {
        self.spawn_agent_on(i, 0, 0, self.agents.len())
    }

    /// Spawns the agent of node `i` listening on `port` and its probes on `probe_port` (0:
    /// any; the agent prints what it bound), logging to a file numbered `n`. Returns the
    /// process and both ports.
    fn spawn_agent_on(&self, i: usize, port: u16, probe_port: u16, n: usize) -> (Proc, u16, u16) {
        let node = &self.nodes[i];
        let (agent_cert, agent_key) = self
            .ca
            .issue_agent(node)
            .expect("issuing the agent's certificate");
        let mut cmd = Command::new(&bins().agent);
        cmd.arg("serve")
            .args([
                "--node-name",
                node,
                "--listen",
                &format!("127.0.0.1:{port}"),
            ])
            .arg("--tls-ca")
            .arg(&self.ca.files.ca_cert)
            .arg("--tls-cert")
            .arg(&agent_cert)
            .arg("--tls-key")
            .arg(&agent_key)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cgroup-root")
            .arg(&self.cgroup_root)
            .args(["--probe-listen", &format!("127.0.0.1:{probe_port}")])
            .env("RUST_LOG", "info")
            .envs(self.options.node_env.iter().cloned());
        let log = self.dir.path().join(format!("agent-{node}-{n}.log"));
        let (proc, mut lines) = spawn_logged_lines(
            &format!("agent {node}"),
            cmd,
            &log,
            Some("listening on"),
            Duration::from_secs(60),
        );
        let line = lines.pop().unwrap_or_default();
        let port_of = |line: &str, what: &str| -> u16 {
            line.rsplit(':')
                .next()
                .and_then(|p| p.trim().parse().ok())
                .unwrap_or_else(|| {
                    panic!("agent printed {line:?}, expected `{what} <addr>:<port>`")
                })
        };
        let port = port_of(&line, "listening on");
        let probes = lines
            .iter()
            .find(|l| l.starts_with("probes on"))
            .map(|l| port_of(l, "probes on"))
            .unwrap_or_else(|| panic!("agent printed no `probes on <addr>:<port>`: {lines:?}"));
        (proc, port, probes)
    }

    /// The agent Pod object of node `i` (as the DaemonSet and kubelet would make it).
    async fn agent_pod(&self, i: usize, port: u16) {
        let node = &self.nodes[i];
        let name = format!("agent-{node}");
        let api: Api<Pod> = self.agent_ns.api();
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "flamefleet-agent"}},
            "spec": {"nodeName": node, "containers": [{
                "name": "agent", "image": "registry.invalid/flamefleet-agent:e2e",
                "ports": [{"name": "grpc", "containerPort": port}]
            }]}
        }))
        .unwrap();
        match api.create(&PostParams::default(), &pod).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {
                api.patch(
                    &name,
                    &PatchParams::apply("e2e").force(),
                    &Patch::Apply(&pod),
                )
                .await
                .unwrap();
            }
            Err(e) => panic!("creating agent pod {name}: {e}"),
        }
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
        .unwrap();
    }

    /// Starts (or restarts) the operator process.
    /// Starts the operator and waits until it leads (its controllers are running), so a
    /// test's clock starts with an operator that can act. A slow or crashed start fails here
    /// with the operator's log instead of as a request that never got a status.
    pub fn start_operator(&mut self) {
        // With a store process, the operator's own store port stays unused.
        let store_port = if self.options.store_process {
            free_port()
        } else {
            self.store_port
        };
        let mut proc = self.spawn_operator(store_port, self.metrics_port);
        let deadline = Instant::now() + Duration::from_secs(120);
        while !proc.log_text().contains(LEADING_MARKER) {
            proc.assert_alive();
            assert!(
                Instant::now() < deadline,
                "the operator did not start leading within 120 s:\n{}",
                proc.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.operator = Some(proc);
    }

    /// Starts another operator replica (same Lease, same store directory and secret) on
    /// its own ports; returns it with its metrics port.
    pub fn start_replica(&mut self) -> (Proc, u16) {
        let metrics_port = free_port();
        (self.spawn_operator(free_port(), metrics_port), metrics_port)
    }

    fn spawn_operator(&mut self, store_port: u16, metrics_port: u16) -> Proc {
        let mut cmd = Command::new(
            self.options
                .operator_bin
                .clone()
                .unwrap_or_else(|| bins().operator.clone()),
        );
        if let Some(interval) = &self.options.min_run_interval {
            cmd.arg(format!("--min-run-interval={interval}"));
        }
        let store_dir = self.store_dir();
        let secret = self.store_secret();
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["--agent-namespace", self.agent_ns.name()])
            .arg("--tls-ca")
            .arg(&self.ca.files.ca_cert)
            .arg("--tls-cert")
            .arg(&self.ca.files.operator_cert)
            .arg("--tls-key")
            .arg(&self.ca.files.operator_key)
            .args([
                "--store",
                if self.options.store_process {
                    "remote"
                } else {
                    "builtin"
                },
            ])
            .arg("--store-dir")
            .arg(&store_dir)
            .arg("--store-secret-file")
            .arg(&secret)
            .args(["--store-listen", &format!("127.0.0.1:{store_port}")])
            .args([
                "--store-url",
                &self.options.store_url.clone().unwrap_or_else(|| {
                    // A store process serves at the fixture's store port; an operator's
                    // built-in store at its own.
                    let port = if self.options.store_process {
                        self.store_port
                    } else {
                        store_port
                    };
                    format!("http://127.0.0.1:{port}/")
                }),
            ])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
            .args(["--lease-name", &format!("flamefleet-operator-{}", self.id)])
            .args(["--lease-duration", &self.options.lease_seconds.to_string()])
            .args([
                "--identity",
                &format!("operator-{}-{}", self.id, self.operator_starts),
            ])
            .args([
                "--capture-grace",
                &format!("{}s", self.options.capture_grace.as_secs()),
            ])
            .args(["--request-selector", &format!("{RUN_LABEL}={}", self.id)])
            .args(&self.options.operator_args)
            .env(
                "RUST_LOG",
                "info,flamefleet_operator=debug,kube_lease_manager=warn",
            )
            .envs(self.options.node_env.iter().cloned());
        let log = self
            .dir
            .path()
            .join(format!("operator-{}.log", self.operator_starts));
        self.operator_starts += 1;
        let (proc, _) = spawn_logged("operator", cmd, &log, None, Duration::ZERO);
        proc
    }

    /// The built-in store's directory.
    pub fn store_dir(&self) -> PathBuf {
        self.options
            .store_dir
            .clone()
            .unwrap_or_else(|| self.dir.path().join("store"))
    }

    /// The store's URL-signing secret file (written on first use), shared by the operator
    /// and the store process.
    fn store_secret(&self) -> PathBuf {
        let secret = self.dir.path().join("store.secret");
        if !secret.exists() {
            std::fs::write(&secret, random_hex(32)).unwrap();
        }
        secret
    }

    /// Starts (or starts again, on the same port and directory) the store process, and
    /// waits until it listens.
    pub fn start_store(&mut self) {
        let mut cmd = Command::new(&bins().store);
        cmd.arg("--dir")
            .arg(self.store_dir())
            .arg("--secret-file")
            .arg(self.store_secret())
            .args(["--listen", &format!("127.0.0.1:{}", self.store_port)])
            .env("RUST_LOG", "info")
            .envs(self.options.node_env.iter().cloned());
        let log = self
            .dir
            .path()
            .join(format!("store-{}.log", self.store_starts));
        self.store_starts += 1;
        let (proc, _) = spawn_logged(
            "store",
            cmd,
            &log,
            Some("listening on"),
            Duration::from_secs(60),
        );
        self.store = Some(proc);
    }

    /// SIGKILLs the store process (as when its pod is deleted: nothing is flushed).
    pub fn kill_store(&mut self) {
        if let Some(mut p) = self.store.take() {
            p.kill();
        }
    }

    /// SIGKILLs the operator (no Lease release: the next one waits for the Lease to expire).
    pub fn kill_operator(&mut self) {
        if let Some(mut p) = self.operator.take() {
            p.kill();
            // Keep the log under a stable name for the assertions' messages.
            self.operator = None;
        }
    }

    /// Restarts the agent of node `i` (SIGKILL, then a new process on the same ports, as a
    /// container restart in its pod would): everything it kept in memory is gone.
    pub fn restart_agent(&mut self, i: usize) {
        self.agents[i].kill();
        self.agent_restarts += 1;
        let n = self.agents.len() + self.agent_restarts;
        let (proc, _, _) =
            self.spawn_agent_on(i, self.agent_ports[i], self.agent_probe_ports[i], n);
        self.agents[i] = proc;
    }

    /// The /metrics text of the agent of node `i`.
    pub async fn agent_metrics(&self, i: usize) -> String {
        metrics_at(self.agent_probe_ports[i]).await
    }

    /// SIGKILLs the agent of node `i`.
    pub fn kill_agent(&mut self, i: usize) {
        self.agents[i].kill();
    }

    /// The operator's log (all starts).
    pub fn operator_logs(&self) -> String {
        (0..self.operator_starts)
            .map(|i| {
                std::fs::read_to_string(self.dir.path().join(format!("operator-{i}.log")))
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join("\n--- restart ---\n")
    }

    /// Agent logs, for failure messages.
    pub fn agent_logs(&self) -> String {
        self.agents
            .iter()
            .map(|a| format!("--- {} ---\n{}", a.name, a.log_tail()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Restarts the container of pod `uid` (made by [`Pipeline::pod`]) as a runtime does:
    /// its processes move to a new container cgroup under a new ID and the old cgroup is
    /// removed. The API server is not told (a kubelet reports it later): the pod's status
    /// still names the old ID. Returns the new `containerd://` ID.
    #[allow(dead_code)] // not every test binary restarts containers
    pub fn restart_container(&mut self, uid: &str) -> String {
        let workload = self
            .workloads
            .iter_mut()
            .find(|w| w.pod.metadata.uid.as_deref() == Some(uid))
            .expect("a workload of that pod");
        let id = random_hex(32);
        let new = workload.cgroup.with_file_name(&id);
        std::fs::create_dir_all(&new).unwrap_or_else(|e| panic!("creating {}: {e}", new.display()));
        // Until the old cgroup is empty: a process may fork meanwhile.
        loop {
            let procs = std::fs::read_to_string(workload.cgroup.join("cgroup.procs"))
                .expect("reading the old container's cgroup.procs");
            if procs.trim().is_empty() {
                break;
            }
            for pid in procs.lines() {
                // A process that exited meanwhile cannot move (ESRCH); the loop rereads.
                let _ = std::fs::write(new.join("cgroup.procs"), pid);
            }
        }
        std::fs::remove_dir(&workload.cgroup)
            .unwrap_or_else(|e| panic!("removing {}: {e}", workload.cgroup.display()));
        workload.cgroup = new;
        format!("containerd://{id}")
    }

    /// Creates a Running pod in `ns` on node `node` whose container cgroup holds `procs`
    /// workload processes in `mode` (spin, alloc, wake).
    pub async fn pod(
        &mut self,
        ns: &TestNamespace,
        name: &str,
        node: usize,
        labels: &[(&str, &str)],
        mode: &str,
        procs: usize,
    ) -> Pod {
        let container_id = random_hex(32);
        let mut fixture = PodFixture::new(
            name,
            &self.nodes[node],
            &format!("containerd://{container_id}"),
        );
        for (k, v) in labels {
            fixture = fixture.label(k, v);
        }
        let pod = ns
            .running_pod(&fixture)
            .await
            .expect("creating a running pod");
        let uid = pod.metadata.uid.clone().expect("pod uid");
        let cgroup = self
            .cgroup_root
            .join(format!("kubepods/burstable/pod{uid}/{container_id}"));
        std::fs::create_dir_all(&cgroup)
            .unwrap_or_else(|e| panic!("creating {}: {e}", cgroup.display()));
        let children = (0..procs)
            .map(|_| spawn_in_cgroup(&cgroup, workload_bin(), &[mode]))
            .collect();
        self.workloads.push(PodWorkload {
            pod: pod.clone(),
            cgroup,
            children,
        });
        pod
    }

    /// A Running pod like [`Pipeline::pod`] whose pod-level cgroup has a memory limit of
    /// `limit_bytes`, as the kubelet sets it: cgroup v2 `memory.max` where the v2 hierarchy
    /// has the memory controller, else `memory.limit_in_bytes` in the v1 memory hierarchy at
    /// the same relative path (a hybrid host). One workload process runs with `args`.
    pub async fn memory_limited_pod(
        &mut self,
        ns: &TestNamespace,
        name: &str,
        node: usize,
        labels: &[(&str, &str)],
        limit_bytes: u64,
        args: &[&str],
    ) -> Pod {
        self.memory_limited_pod_running(ns, name, node, labels, limit_bytes, workload_bin(), args)
            .await
    }

    /// As [`Self::memory_limited_pod`], running `program` instead of the C workload.
    #[allow(clippy::too_many_arguments)]
    pub async fn memory_limited_pod_running(
        &mut self,
        ns: &TestNamespace,
        name: &str,
        node: usize,
        labels: &[(&str, &str)],
        limit_bytes: u64,
        program: &Path,
        args: &[&str],
    ) -> Pod {
        let container_id = random_hex(32);
        let mut fixture = PodFixture::new(
            name,
            &self.nodes[node],
            &format!("containerd://{container_id}"),
        );
        for (k, v) in labels {
            fixture = fixture.label(k, v);
        }
        let pod = ns
            .running_pod(&fixture)
            .await
            .expect("creating a running pod");
        let uid = pod.metadata.uid.clone().expect("pod uid");
        let rel = PathBuf::from(format!("kubepods/burstable/pod{uid}"));
        let pod_dir = self.cgroup_root.join(&rel);
        let cgroup = pod_dir.join(&container_id);
        std::fs::create_dir_all(&cgroup)
            .unwrap_or_else(|e| panic!("creating {}: {e}", cgroup.display()));
        let write = |path: PathBuf, value: &str| {
            std::fs::write(&path, value)
                .unwrap_or_else(|e| panic!("writing {value:?} to {}: {e}", path.display()))
        };
        let mount = cgroup2_mount();
        let controllers =
            std::fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
        let mut joined = vec![cgroup.clone()];
        if controllers.split_whitespace().any(|c| c == "memory") {
            // Enable the controller from the mount down to the pod's cgroup.
            let mut dir = mount.clone();
            for part in self
                .cgroup_root
                .strip_prefix(&mount)
                .expect("the fixture's cgroups under the cgroup2 mount")
                .join(&rel)
                .components()
            {
                write(dir.join("cgroup.subtree_control"), "+memory");
                dir = dir.join(part);
            }
            write(pod_dir.join("memory.max"), &limit_bytes.to_string());
            let _ = std::fs::write(pod_dir.join("memory.swap.max"), "0");
        } else {
            let v1 = self.v1_memory_root();
            let v1_pod = v1.join(&rel);
            let v1_container = v1_pod.join(&container_id);
            std::fs::create_dir_all(&v1_container)
                .unwrap_or_else(|e| panic!("creating {}: {e}", v1_container.display()));
            write(
                v1_pod.join("memory.limit_in_bytes"),
                &limit_bytes.to_string(),
            );
            joined.push(v1_container);
        }
        let joined: Vec<&Path> = joined.iter().map(PathBuf::as_path).collect();
        let child = workload::spawn_in_cgroups(&joined, program, args)
            .expect("starting a workload in its cgroups");
        self.workloads.push(PodWorkload {
            pod: pod.clone(),
            cgroup,
            children: vec![child],
        });
        pod
    }

    /// A Running pod like [`Pipeline::pod`] whose pod-level cgroup has a CFS quota of
    /// `millicores` per 100 ms period, as the kubelet sets a CPU limit: cgroup v2 `cpu.max`
    /// where the v2 hierarchy has the cpu controller, else `cpu.cfs_quota_us` in the v1 cpu
    /// hierarchy at the same relative path (a hybrid host). `procs` workload processes run
    /// with `args`.
    #[allow(clippy::too_many_arguments)]
    pub async fn cpu_limited_pod(
        &mut self,
        ns: &TestNamespace,
        name: &str,
        node: usize,
        labels: &[(&str, &str)],
        millicores: u64,
        procs: usize,
        args: &[&str],
    ) -> Pod {
        let container_id = random_hex(32);
        let mut fixture = PodFixture::new(
            name,
            &self.nodes[node],
            &format!("containerd://{container_id}"),
        );
        for (k, v) in labels {
            fixture = fixture.label(k, v);
        }
        let pod = ns
            .running_pod(&fixture)
            .await
            .expect("creating a running pod");
        let uid = pod.metadata.uid.clone().expect("pod uid");
        let rel = PathBuf::from(format!("kubepods/burstable/pod{uid}"));
        let pod_dir = self.cgroup_root.join(&rel);
        let cgroup = pod_dir.join(&container_id);
        std::fs::create_dir_all(&cgroup)
            .unwrap_or_else(|e| panic!("creating {}: {e}", cgroup.display()));
        let write = |path: PathBuf, value: &str| {
            std::fs::write(&path, value)
                .unwrap_or_else(|e| panic!("writing {value:?} to {}: {e}", path.display()))
        };
        let (period, quota) = (100_000u64, millicores * 100);
        let mount = cgroup2_mount();
        let controllers =
            std::fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
        let mut joined = vec![cgroup.clone()];
        if controllers.split_whitespace().any(|c| c == "cpu") {
            let mut dir = mount.clone();
            for part in self
                .cgroup_root
                .strip_prefix(&mount)
                .expect("the fixture's cgroups under the cgroup2 mount")
                .join(&rel)
                .components()
            {
                write(dir.join("cgroup.subtree_control"), "+cpu");
                dir = dir.join(part);
            }
            write(pod_dir.join("cpu.max"), &format!("{quota} {period}"));
        } else {
            let v1 = v1_root("cpu").join(
                self.cgroup_root
                    .file_name()
                    .expect("the fixture's cgroup directory name"),
            );
            let v1_pod = v1.join(&rel);
            let v1_container = v1_pod.join(&container_id);
            std::fs::create_dir_all(&v1_container)
                .unwrap_or_else(|e| panic!("creating {}: {e}", v1_container.display()));
            write(v1_pod.join("cpu.cfs_period_us"), &period.to_string());
            write(v1_pod.join("cpu.cfs_quota_us"), &quota.to_string());
            joined.push(v1_container);
        }
        let joined: Vec<&Path> = joined.iter().map(PathBuf::as_path).collect();
        let children = (0..procs)
            .map(|_| {
                workload::spawn_in_cgroups(&joined, workload_bin(), args)
                    .expect("starting a workload in its cgroups")
            })
            .collect();
        self.workloads.push(PodWorkload {
            pod: pod.clone(),
            cgroup,
            children,
        });
        pod
    }

    /// How the workload process of pod `uid` ended, once it has (`None` while it runs).
    pub fn workload_exit(&mut self, uid: &str) -> Option<std::process::ExitStatus> {
        self.workloads
            .iter_mut()
            .find(|w| w.pod.metadata.uid.as_deref() == Some(uid))?
            .children
            .first_mut()?
            .try_wait()
            .expect("waiting for a workload")
    }

    /// This fixture's directory in the v1 memory hierarchy (a hybrid host); removed with it.
    pub fn v1_memory_root(&self) -> PathBuf {
        let mounts = std::fs::read_to_string("/proc/mounts").expect("reading /proc/mounts");
        let v1 = mounts
            .lines()
            .find_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                (f.len() > 3 && f[2] == "cgroup" && f[3].split(',').any(|o| o == "memory"))
                    .then(|| PathBuf::from(f[1]))
            })
            .expect(
                "a memory controller: in cgroup v2 or a v1 memory hierarchy (mount one at /sys/fs/cgroup/memory)",
            );
        v1.join(
            self.cgroup_root
                .file_name()
                .expect("the fixture's cgroup directory name"),
        )
    }

    /// A ProfileRequest labelled for this fixture.
    pub fn request(&self, name: &str, spec: serde_json::Value) -> ProfileRequest {
        serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": name, "labels": {RUN_LABEL: self.id}},
            "spec": spec,
        }))
        .expect("a valid ProfileRequest")
    }

    /// A SamplingPolicy labelled for this fixture (so its runs are too).
    pub fn policy(&self, name: &str, spec: serde_json::Value) -> flamefleet_api::SamplingPolicy {
        serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "SamplingPolicy",
            "metadata": {"name": name, "labels": {RUN_LABEL: self.id}},
            "spec": spec,
        }))
        .expect("a valid SamplingPolicy")
    }

    /// A ClusterSamplingPolicy labelled for this fixture.
    pub fn cluster_policy(
        &self,
        name: &str,
        spec: serde_json::Value,
    ) -> flamefleet_api::ClusterSamplingPolicy {
        serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ClusterSamplingPolicy",
            "metadata": {"name": name, "labels": {RUN_LABEL: self.id}},
            "spec": spec,
        }))
        .expect("a valid ClusterSamplingPolicy")
    }

    /// Polls `check` (every 200 ms) until it returns `Some`, failing after `timeout` with
    /// `what` and the operator's log.
    pub async fn wait_for<T, F, Fut>(&mut self, what: &str, timeout: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let operator = &mut self.operator;
        let waited =
            flamefleet_e2e::cluster::wait_for(what, timeout, Duration::from_millis(200), || {
                if let Some(op) = operator.as_mut() {
                    op.assert_alive();
                }
                check()
            })
            .await;
        match waited {
            Ok(v) => v,
            Err(_) => panic!(
                "timed out after {timeout:?} waiting for {what}\n--- operator ---\n{}\n{}",
                self.operator_logs(),
                self.agent_logs()
            ),
        }
    }

    /// Creates `request` in `ns` and follows it to a terminal phase; returns the final
    /// object and every phase seen on the way, in order.
    pub async fn run(
        &mut self,
        ns: &TestNamespace,
        request: &ProfileRequest,
        timeout: Duration,
    ) -> (ProfileRequest, Vec<RequestPhase>) {
        let api: Api<ProfileRequest> = ns.api();
        let name = request.metadata.name.clone().unwrap();
        let phases = self.watch_phases(&api, &name).await;
        api.create(&PostParams::default(), request)
            .await
            .expect("creating the ProfileRequest");
        self.wait_terminal(&api, &name, timeout, phases).await
    }

    /// Starts recording the phases of `name`; returns once the watch has listed the
    /// current state, so every phase written afterwards is seen.
    pub async fn watch_phases(
        &self,
        api: &Api<ProfileRequest>,
        name: &str,
    ) -> Arc<Mutex<Vec<RequestPhase>>> {
        let phases = Arc::new(Mutex::new(Vec::new()));
        let seen = phases.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let stream = watcher::watcher(api.clone(), config);
        let (listed_tx, listed) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let mut listed_tx = Some(listed_tx);
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                if let Ok(watcher::Event::InitDone) = event
                    && let Some(tx) = listed_tx.take()
                {
                    let _ = tx.send(());
                }
                if let Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj)) = event
                    && let Some(phase) = obj.status.and_then(|s| s.phase)
                {
                    let mut v = seen.lock().unwrap();
                    if v.last() != Some(&phase) {
                        v.push(phase);
                    }
                    if phase.is_terminal() {
                        // Nothing more to see: done listing too.
                        if let Some(tx) = listed_tx.take() {
                            let _ = tx.send(());
                        }
                        break;
                    }
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(30), listed)
            .await
            .expect("the phase watch listed within 30 s")
            .expect("the phase watch ended before listing");
        phases
    }

    /// Waits for `name` to reach a terminal phase.
    pub async fn wait_terminal(
        &mut self,
        api: &Api<ProfileRequest>,
        name: &str,
        timeout: Duration,
        phases: Arc<Mutex<Vec<RequestPhase>>>,
    ) -> (ProfileRequest, Vec<RequestPhase>) {
        let deadline = Instant::now() + timeout;
        loop {
            let current = api.get(name).await.expect("getting the ProfileRequest");
            if current
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(RequestPhase::is_terminal)
            {
                // The watcher sees the terminal phase too (it stops there).
                let seen_by = Instant::now() + Duration::from_secs(30);
                loop {
                    let seen = phases.lock().unwrap().clone();
                    if seen.last().is_some_and(|p| p.is_terminal()) {
                        return (current, seen);
                    }
                    assert!(
                        Instant::now() < seen_by,
                        "the phase watch did not see {name} end within 30 s: {seen:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            if let Some(op) = self.operator.as_mut() {
                op.assert_alive();
            }
            assert!(
                Instant::now() < deadline,
                "ProfileRequest {name} not terminal after {timeout:?}: {:#?}\n--- operator ---\n{}\n{}",
                current.status,
                self.operator_logs(),
                self.agent_logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Where the operator's built-in store keeps `artifact` of `request` on disk.
    pub fn stored_artifact(&self, request: &ProfileRequest, artifact: &str) -> PathBuf {
        self.store_dir()
            .join(request.metadata.namespace.as_deref().unwrap_or_default())
            .join(format!(
                "{}-{}",
                request.metadata.name.as_deref().unwrap_or_default(),
                request.metadata.uid.as_deref().unwrap_or_default()
            ))
            .join(artifact)
    }

    /// A short-lived download URL of `artifact` of `request`, asked for as a user would:
    /// a ProfileDownload answered by the operator.
    pub async fn download_url(&self, request: &ProfileRequest, artifact: &str) -> String {
        let ns = request.metadata.namespace.clone().expect("namespace");
        let name = request.metadata.name.clone().expect("name");
        let api: Api<ProfileDownload> = Api::namespaced(self.client.clone(), &ns);
        let key = flamefleet_api::download_seal::AnswerKey::generate().expect("a key");
        let asked = api
            .create(
                &PostParams::default(),
                &ProfileDownload {
                    metadata: kube::api::ObjectMeta {
                        generate_name: Some("dl-".into()),
                        ..Default::default()
                    },
                    spec: ProfileDownloadSpec {
                        requests: vec![name.clone()],
                        nodes: Vec::new(),
                        recipient_key: key.public_key(),
                    },
                    status: None,
                },
            )
            .await
            .expect("creating a ProfileDownload");
        let download = asked.metadata.name.clone().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let answered = loop {
            if let Some(status) = api
                .get(&download)
                .await
                .ok()
                .and_then(|d| d.status)
                .filter(|s| s.phase.is_some())
            {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "the operator did not answer ProfileDownload {download}\n{}",
                self.operator_logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let sealed = answered
            .sealed_urls
            .as_deref()
            .unwrap_or_else(|| panic!("no sealed URLs: {answered:#?}"));
        let opened: flamefleet_api::SealedUrls = serde_json::from_slice(
            &key.open(sealed, &format!("{ns}/{download}"))
                .expect("opening the answer with the key that asked"),
        )
        .expect("the opened answer parses");
        opened
            .artifacts
            .iter()
            .find(|a| a.request == name && a.name == artifact)
            .unwrap_or_else(|| panic!("no URL for {artifact} of {name}: {answered:#?}"))
            .url
            .clone()
    }

    /// Downloads an artifact of `request` through a ProfileDownload, checks its sha256 and
    /// size, saves it in the fixture directory and returns the path.
    pub async fn download(&self, request: &ProfileRequest, artifact: &Artifact) -> PathBuf {
        let url = self.download_url(request, &artifact.name).await;
        let response = reqwest::get(&url).await.expect("downloading the artifact");
        assert_eq!(response.status(), 200, "GET {url}");
        let body = response.bytes().await.unwrap();
        check_digest(artifact, &body);
        let path = self
            .dir
            .path()
            .join(format!("{}-{}", random_hex(4), artifact.name));
        std::fs::write(&path, &body).unwrap();
        path
    }

    /// The operator's /metrics text.
    pub async fn operator_metrics(&self) -> String {
        metrics_at(self.metrics_port).await
    }
}

/// The /metrics text of the operator whose metrics listen on `port` (retried while it starts).
pub async fn metrics_at(port: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
            Ok(r) => return r.text().await.unwrap(),
            Err(e) => assert!(Instant::now() < deadline, "GET /metrics on {port}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Value of the leader gauge in a /metrics text.
pub fn is_leader(metrics: &str) -> bool {
    metrics
        .lines()
        .any(|l| l.trim() == "flamefleet_operator_leader 1")
}

/// Asserts that `body` has the artifact's sha256 and size.
pub fn check_digest(artifact: &Artifact, body: &[u8]) {
    use sha2::Digest;
    let sha = hex::encode(sha2::Sha256::digest(body));
    assert_eq!(
        Some(sha.as_str()),
        artifact.sha256.as_deref(),
        "sha256 of {}",
        artifact.name
    );
    assert_eq!(
        artifact.size_bytes,
        Some(body.len() as i64),
        "size of {}",
        artifact.name
    );
}

/// `go tool pprof -top` of a file; panics when pprof cannot read it.
pub fn pprof_top(file: &Path) -> String {
    let out = Command::new("go")
        .args(["tool", "pprof", "-top"])
        .arg(file)
        .output()
        .expect("running `go tool pprof` (install Go)");
    assert!(
        out.status.success(),
        "go tool pprof could not read {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Node entries of a request by node name, from its ProfileResultSlices (one list by the
/// label `flamefleet.dev/request-uid`); panics when slices the status announces are missing.
pub async fn node_results(
    client: &kube::Client,
    request: &ProfileRequest,
) -> BTreeMap<String, flamefleet_api::NodeStatus> {
    let results = flamefleet_api::results::fetch(client, request)
        .await
        .expect("listing the request's ProfileResultSlices");
    assert!(
        !results.incomplete(),
        "result slices {:?} of {} are missing",
        results.missing_slices,
        request.metadata.name.as_deref().unwrap_or("")
    );
    results.nodes
}

/// Every artifact of a request, node by node (see [`node_results`]).
pub async fn artifacts_of(client: &kube::Client, request: &ProfileRequest) -> Vec<Artifact> {
    node_results(client, request)
        .await
        .into_values()
        .flat_map(|n| n.artifacts)
        .collect()
}

/// The runs of the policy with `uid` (any namespace), oldest scheduled time first.
pub async fn runs_of(client: &kube::Client, uid: &str) -> Vec<ProfileRequest> {
    let api: Api<ProfileRequest> = Api::all(client.clone());
    let mut runs = api
        .list(&kube::api::ListParams::default().labels(&format!("flamefleet.dev/policy-uid={uid}")))
        .await
        .expect("listing runs")
        .items;
    runs.sort_by_key(|r| (scheduled_second(r), r.metadata.namespace.clone()));
    runs
}

/// A run's scheduled time (Unix seconds), from its label.
pub fn scheduled_second(run: &ProfileRequest) -> i64 {
    run.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("flamefleet.dev/scheduled-time"))
        .and_then(|v| v.parse().ok())
        .expect("a run has a scheduled-time label")
}

/// True once a request reached a terminal phase.
pub fn is_terminal(request: &ProfileRequest) -> bool {
    request
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .is_some_and(RequestPhase::is_terminal)
}
