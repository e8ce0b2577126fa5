//! A hollow fleet on the local control plane: an agent pod per hollow node (Running, its
//! pod IP the node's loopback address, container port `grpc`), a target pod per node, and
//! the operator process trusting the fleet's CA, plus the measurements the scale test and
//! benchmark take (API server requests by verb and resource, operator CPU and peak RSS).
//!
//! Pods are written as a kubelet would (create, then status through the status
//! subresource: there is no kubelet), with bounded concurrency.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

use super::{HollowConfig, HollowFleet};
use crate::TestNamespace;
use crate::agent_pki::AgentPki;
use crate::pods::{PodFixture, create_running_pod};

/// Label every request of a hollow cluster carries; its operator watches only these.
pub const RUN_LABEL: &str = "flamefleet.dev/e2e-run";
/// Label of the target pods (value `fleet`).
pub const TARGET_LABEL: &str = "app";
/// What the operator logs once its controllers run.
const LEADING_MARKER: &str = "leading; starting";

/// A child process, killed (SIGKILL) and reaped on drop.
#[derive(Debug)]
pub struct ChildProcess(Child);

impl ChildProcess {
    /// Spawns `cmd` (running `program`) so that it dies with the process that started it
    /// (`PR_SET_PDEATHSIG`).
    ///
    /// # Errors
    /// When it cannot be spawned.
    pub fn spawn(cmd: &mut Command, program: &Path) -> anyhow::Result<Self> {
        // SAFETY: prctl is async-signal-safe, called between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        cmd.spawn()
            .map(Self)
            .map_err(|e| anyhow::anyhow!("spawning {}: {e}", program.display()))
    }

    /// PID.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// CPU seconds (user + system) so far and peak RSS (VmHWM) in bytes, from /proc.
    pub fn usage(&self) -> ProcessUsage {
        process_usage(self.pid())
    }

    /// Its exit status, if it exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.0.try_wait().ok().flatten()
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The operator process, killed (SIGKILL) on drop.
#[derive(Debug)]
pub struct OperatorProcess {
    child: ChildProcess,
    /// Its log (stderr).
    pub log: PathBuf,
    /// Its /metrics port on 127.0.0.1.
    pub metrics_port: u16,
    /// Its built-in store's port on 127.0.0.1.
    pub store_port: u16,
}

impl OperatorProcess {
    /// PID.
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// The last `lines` of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        crate::control_plane::tail(&self.log, lines)
    }

    /// `Err` with the log when it exited.
    ///
    /// # Errors
    /// The exit status and the log's tail.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.exited() {
            anyhow::bail!("the operator exited ({status}):\n{}", self.log_tail(60));
        }
        Ok(())
    }

    /// CPU seconds (user + system) so far and peak RSS (VmHWM) in bytes, from /proc.
    pub fn usage(&self) -> ProcessUsage {
        self.child.usage()
    }
}

/// The artifact store, in its own process as the chart runs it (`flamefleet-store`; the
/// operator talks to it with `--store remote`), so that the operator's figures are the
/// operator's and not the uploads'.
#[derive(Debug)]
pub struct StoreProcess {
    /// The process.
    pub process: ChildProcess,
    /// Its stdout and stderr.
    pub log: PathBuf,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

/// CPU time and memory of a process.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcessUsage {
    /// User + system CPU seconds.
    pub cpu_seconds: f64,
    /// Peak resident set (VmHWM), bytes.
    pub peak_rss_bytes: u64,
    /// Resident set now (VmRSS), bytes.
    pub rss_bytes: u64,
}

/// Reads `/proc/<pid>/stat` (utime, stime) and `/proc/<pid>/status` (VmHWM, VmRSS); zeros
/// for what cannot be read.
pub fn process_usage(pid: u32) -> ProcessUsage {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces) start after the last ')'.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the command.
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // SAFETY-free: sysconf is a plain libc query.
    let hz = match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        n if n > 0 => n as f64,
        _ => 100.0,
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    ProcessUsage {
        cpu_seconds: (ticks(11) + ticks(12)) as f64 / hz,
        peak_rss_bytes: kib("VmHWM:"),
        rss_bytes: kib("VmRSS:"),
    }
}

/// `apiserver_request_total` summed by (verb, resource), from the API server's /metrics.
///
/// # Errors
/// When /metrics cannot be read.
pub async fn apiserver_requests(
    client: &kube::Client,
) -> anyhow::Result<BTreeMap<(String, String), f64>> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(request).await?;
    Ok(parse_request_totals(&text))
}

/// Parses `apiserver_request_total{...,resource="pods",...,verb="LIST"} 12` lines (pure).
pub fn parse_request_totals(text: &str) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |key: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{key}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let subresource = label("subresource");
        let resource = if subresource.is_empty() {
            label("resource")
        } else {
            format!("{}/{subresource}", label("resource"))
        };
        if let Ok(v) = value.trim().parse::<f64>() {
            *out.entry((label("verb"), resource)).or_insert(0.0) += v;
        }
    }
    out
}

/// `after - before`, keeping what grew (pure).
pub fn request_delta(
    before: &BTreeMap<(String, String), f64>,
    after: &BTreeMap<(String, String), f64>,
) -> BTreeMap<(String, String), f64> {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0.0);
            (d > 0.0).then(|| (k.clone(), d))
        })
        .collect()
}

/// Settings of a hollow cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Hollow nodes (one agent pod and one target pod each).
    pub nodes: usize,
    /// Pod writes in flight at once while setting up.
    pub setup_concurrency: usize,
    /// The operator's --capture-grace.
    pub capture_grace: Duration,
    /// More operator flags.
    pub operator_args: Vec<String>,
    /// The operator's RUST_LOG.
    pub operator_log: String,
    /// Print setup progress every this many pods (0: never).
    pub progress_every: usize,
    /// Subsets: target pod `i` is labelled `flamefleet.dev/e2e-first-<k>=true` for every
    /// `k` here with `i < k`, so a request can select the first `k` nodes
    /// ([`HollowCluster::request_first`]).
    pub subsets: Vec<usize>,
    /// Where the artifact store keeps its files (default: `store/` in the working
    /// directory). The caller owns it and removes it.
    pub store_dir: Option<PathBuf>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            nodes: 100,
            setup_concurrency: 64,
            capture_grace: Duration::from_secs(20),
            operator_args: Vec::new(),
            operator_log: "info,kube_lease_manager=warn".into(),
            progress_every: 1000,
            subsets: Vec::new(),
            store_dir: None,
        }
    }
}

/// A hollow fleet with its pods and an operator.
#[derive(Debug)]
pub struct HollowCluster {
    /// Unique id (node-name prefix, request label value, Lease name).
    pub id: String,
    /// Namespace of the agent pods.
    pub agent_ns: TestNamespace,
    /// Namespace of the target pods (and of the requests).
    pub target_ns: TestNamespace,
    /// Working directory (PKI, store, logs); removed on drop unless FLAMEFLEET_E2E_KEEP.
    pub dir: PathBuf,
    /// The agents' CA and the operator's client certificate.
    pub pki: AgentPki,
    /// The hollow agents.
    pub fleet: HollowFleet,
    /// The operator, once started.
    pub operator: Option<OperatorProcess>,
    /// The artifact store, started with the first operator (and kept across operator
    /// restarts).
    pub store: Option<StoreProcess>,
    /// The operator binary.
    operator_bin: PathBuf,
    options: ClusterOptions,
}

impl Drop for HollowCluster {
    fn drop(&mut self) {
        self.operator = None;
        self.store = None;
        if std::env::var_os("FLAMEFLEET_E2E_KEEP").is_some() {
            eprintln!("kept {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut b);
    }
    u64::from_le_bytes(b) ^ u64::from(std::process::id())
}

impl HollowCluster {
    /// Creates the namespaces, the PKI and the hollow fleet, then every agent and target
    /// pod. The operator is started by [`HollowCluster::start_operator`].
    ///
    /// # Errors
    /// Whatever fails on the way, with what was being done.
    pub async fn create(operator_bin: &Path, options: ClusterOptions) -> anyhow::Result<Self> {
        let seed = random_u64();
        let id = format!("hc{:06x}", seed & 0xff_ffff);
        let agent_ns = TestNamespace::create("ff-hollow-agents").await?;
        let target_ns = TestNamespace::create("ff-hollow").await?;
        let dir = std::env::temp_dir().join(format!("flamefleet-hollow-{id}"));
        std::fs::create_dir_all(&dir)?;
        let pki = AgentPki::generate(&dir.join("pki"), "flamefleet-operator-ca")?;
        // A /16 of its own in 127.64.0.0 - 127.191.255.255, and a port in 20000 - 29999.
        let second = 64 + u8::try_from((seed >> 24) % 128).unwrap_or(0);
        let port = 20000 + u16::try_from((seed >> 32) % 10000).unwrap_or(0);
        let started = Instant::now();
        let fleet = HollowFleet::start(
            &pki,
            HollowConfig {
                nodes: options.nodes,
                node_prefix: id.clone(),
                first_address: Ipv4Addr::new(127, second, 0, 1),
                port,
                seed,
                ..HollowConfig::default()
            },
        )
        .await?;
        eprintln!(
            "hollow fleet: {} nodes on 127.{second}.x.x:{port} in {:.1?}",
            fleet.len(),
            started.elapsed()
        );
        let cluster = Self {
            id,
            agent_ns,
            target_ns,
            dir,
            pki,
            fleet,
            operator: None,
            store: None,
            operator_bin: operator_bin.to_path_buf(),
            options,
        };
        cluster.create_pods().await?;
        Ok(cluster)
    }

    async fn create_pods(&self) -> anyhow::Result<()> {
        let started = Instant::now();
        let agents: Api<Pod> = self.agent_ns.api();
        let targets: Api<Pod> = self.target_ns.api();
        let nodes = self.fleet.nodes();
        let total = nodes.len() * 2;
        let mut done = 0usize;
        let mut writes = futures::stream::iter(nodes.iter().enumerate().flat_map(|(i, node)| {
            let agents = agents.clone();
            let targets = targets.clone();
            let subsets: Vec<usize> = self
                .options
                .subsets
                .iter()
                .copied()
                .filter(|k| i < *k)
                .collect();
            let agent = async move {
                agent_pod(
                    &agents,
                    &node.name,
                    &node.address.ip().to_string(),
                    node.address.port(),
                )
                .await
            };
            let target = async move {
                let fixture = PodFixture::new(
                    &format!("w-{i:05}"),
                    &node.name,
                    &format!("containerd://{:064x}", i + 1),
                )
                .label(TARGET_LABEL, "fleet");
                let fixture = subsets
                    .iter()
                    .fold(fixture, |f, k| f.label(&subset_label(*k), "true"));
                create_running_pod(&targets, &fixture)
                    .await
                    .map(|_| ())
                    .map_err(anyhow::Error::from)
            };
            [
                futures::future::Either::Left(agent),
                futures::future::Either::Right(target),
            ]
        }))
        .buffer_unordered(self.options.setup_concurrency.max(1));
        while let Some(written) = writes.next().await {
            written?;
            done += 1;
            if self.options.progress_every > 0 && done.is_multiple_of(self.options.progress_every) {
                eprintln!(
                    "pods: {done}/{total} ({:.0}/s)",
                    done as f64 / started.elapsed().as_secs_f64()
                );
            }
        }
        eprintln!(
            "pods: {total} written in {:.1?} ({:.0}/s)",
            started.elapsed(),
            total as f64 / started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Starts the operator (built-in store, the fleet's PKI, the cluster's request label)
    /// and waits until it leads.
    ///
    /// # Errors
    /// When it cannot start, exits, or does not lead within 120 s (with its log).
    pub fn start_operator(&mut self) -> anyhow::Result<()> {
        let metrics_port = crate::workload::free_port()?;
        let secret = self.dir.join("store.secret");
        if !secret.exists() {
            std::fs::write(&secret, crate::workload::random_hex(32)?)?;
        }
        if self.store.is_none() {
            self.store = Some(self.start_store(&secret)?);
        }
        let store_port = self.store.as_ref().map_or(0, |s| s.port);
        let log = self.dir.join("operator.log");
        let mut cmd = Command::new(&self.operator_bin);
        cmd.arg("--kubeconfig")
            .arg(self.target_ns.control_plane().kubeconfig())
            .args(["--agent-namespace", self.agent_ns.name()])
            .arg("--tls-ca")
            .arg(&self.pki.files.ca_cert)
            .arg("--tls-cert")
            .arg(&self.pki.files.operator_cert)
            .arg("--tls-key")
            .arg(&self.pki.files.operator_key)
            .args(["--store", "remote"])
            .arg("--store-secret-file")
            .arg(&secret)
            .args(["--store-url", &format!("http://127.0.0.1:{store_port}/")])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
            .args(["--lease-name", &format!("flamefleet-operator-{}", self.id)])
            .args(["--lease-duration", "15"])
            .args(["--identity", &format!("operator-{}", self.id)])
            .args([
                "--capture-grace",
                &format!("{}ms", self.options.capture_grace.as_millis()),
            ])
            .args(["--request-selector", &format!("{RUN_LABEL}={}", self.id)])
            .args(&self.options.operator_args)
            .env("RUST_LOG", &self.options.operator_log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        let mut operator = OperatorProcess {
            child: ChildProcess::spawn(&mut cmd, &self.operator_bin)?,
            log,
            metrics_port,
            store_port,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while !std::fs::read_to_string(&operator.log)
            .unwrap_or_default()
            .contains(LEADING_MARKER)
        {
            operator.check_alive()?;
            anyhow::ensure!(
                Instant::now() < deadline,
                "the operator did not lead within 120 s:\n{}",
                operator.log_tail(60)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.operator = Some(operator);
        Ok(())
    }

    /// The built-in store's directory.
    pub fn store_dir(&self) -> PathBuf {
        self.options
            .store_dir
            .clone()
            .unwrap_or_else(|| self.dir.join("store"))
    }

    /// Starts `flamefleet-store` (next to the operator binary) over [`Self::store_dir`] and
    /// waits for its "listening on" line.
    fn start_store(&self, secret: &Path) -> anyhow::Result<StoreProcess> {
        let bin = self.operator_bin.with_file_name("flamefleet-store");
        let port = crate::workload::free_port()?;
        let log = self.dir.join("store.log");
        let out = std::fs::File::create(&log)?;
        let mut cmd = Command::new(&bin);
        cmd.arg("--dir")
            .arg(self.store_dir())
            .arg("--secret-file")
            .arg(secret)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--public-url", &format!("http://127.0.0.1:{port}/")])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let mut store = StoreProcess {
            process: ChildProcess::spawn(&mut cmd, &bin)?,
            log,
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let text = std::fs::read_to_string(&store.log).unwrap_or_default();
            if text.contains("listening on") {
                return Ok(store);
            }
            if let Some(status) = store.process.exited() {
                anyhow::bail!("the store exited ({status}):\n{text}");
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the store did not listen within 60 s:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Polls request `name` in the target namespace until it is terminal and returns it,
    /// checking on every round that the operator is still alive.
    ///
    /// # Panics
    /// When the operator died, or after `timeout`, with `what` failed, the request's status
    /// and the operator's log tail.
    pub async fn wait_terminal(
        &mut self,
        name: &str,
        timeout: Duration,
        what: &str,
    ) -> flamefleet_api::ProfileRequest {
        let api: Api<flamefleet_api::ProfileRequest> = self.target_ns.api();
        let deadline = Instant::now() + timeout;
        loop {
            let current = api.get(name).await.expect("reading the request");
            if current
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(flamefleet_api::RequestPhase::is_terminal)
            {
                return current;
            }
            if let Some(op) = self.operator.as_mut() {
                op.check_alive().expect("the operator is running");
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {:#?}\n--- operator ---\n{}",
                current.status,
                self.operator
                    .as_ref()
                    .map(|o| o.log_tail(40))
                    .unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A cpu ProfileRequest over every target pod, labelled for this cluster's operator.
    ///
    /// # Errors
    /// Never for valid names (serde).
    pub fn request(
        &self,
        name: &str,
        duration: Duration,
    ) -> anyhow::Result<flamefleet_api::ProfileRequest> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": name, "labels": {RUN_LABEL: self.id}},
            "spec": {
                "type": "cpu",
                "selector": {"matchLabels": {TARGET_LABEL: "fleet"}},
                "duration": format!("{}ms", duration.as_millis()),
            },
        }))?)
    }

    /// A cpu ProfileRequest over the first `k` nodes (one of [`ClusterOptions::subsets`]).
    ///
    /// # Errors
    /// Never for valid names (serde).
    pub fn request_first(
        &self,
        name: &str,
        duration: Duration,
        k: usize,
    ) -> anyhow::Result<flamefleet_api::ProfileRequest> {
        anyhow::ensure!(
            self.options.subsets.contains(&k),
            "no subset of {k} nodes; ClusterOptions::subsets is {:?}",
            self.options.subsets
        );
        let mut request = self.request(name, duration)?;
        request.spec.selector = Some(serde_json::from_value(
            json!({"matchLabels": {subset_label(k): "true"}}),
        )?);
        Ok(request)
    }

    /// Appends `text` to a file in the cluster's directory (figures for later reading).
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn note(&self, text: &str) -> anyhow::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("notes.txt"))?;
        writeln!(f, "{text}")?;
        Ok(())
    }
}

/// The label of the first `k` target pods.
pub fn subset_label(k: usize) -> String {
    format!("flamefleet.dev/e2e-first-{k}")
}

/// Creates (or re-applies) the agent pod of `node` at `ip:port`, Running and Ready.
async fn agent_pod(api: &Api<Pod>, node: &str, ip: &str, port: u16) -> anyhow::Result<()> {
    let name = format!("agent-{node}");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "flamefleet-agent"}},
        "spec": {"nodeName": node, "containers": [{
            "name": "agent", "image": "registry.invalid/flamefleet-agent:hollow",
            "ports": [{"name": "grpc", "containerPort": port}]
        }]}
    }))?;
    match api.create(&PostParams::default(), &pod).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => anyhow::bail!("creating agent pod {name}: {e}"),
    }
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    api.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Running", "podIP": ip, "hostIP": ip,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        }})),
    )
    .await
    .map_err(|e| anyhow::anyhow!("setting the status of agent pod {name}: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_totals_sum_by_verb_and_resource() {
        let text = r#"# HELP apiserver_request_total x
apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="POST",version="v1"} 10
apiserver_request_total{code="409",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="POST",version="v1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="status",verb="PATCH",version="v1"} 5
"#;
        let totals = parse_request_totals(text);
        assert_eq!(totals[&("POST".into(), "pods".into())], 12.0);
        assert_eq!(totals[&("PATCH".into(), "pods/status".into())], 5.0);
        let mut after = totals.clone();
        *after.get_mut(&("POST".into(), "pods".into())).unwrap() += 3.0;
        let d = request_delta(&totals, &after);
        assert_eq!(d.len(), 1);
        assert_eq!(d[&("POST".into(), "pods".into())], 3.0);
    }

    #[test]
    fn usage_of_this_process() {
        let u = process_usage(std::process::id());
        assert!(u.peak_rss_bytes > 0 && u.rss_bytes > 0, "{u:?}");
    }
}
