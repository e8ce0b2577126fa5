//! Fixtures of the agent-service tests: an mTLS PKI, the agent binary as a
//! real process, a gRPC client, kubelet-style pod cgroup trees with real
//! workloads, and an HTTP upload server that checks the sha256 header.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use flamefleet_agent::cgroup::CgroupRoot;
use flamefleet_e2e::agent_pki::{AgentPki, agent_dns_name};
use flamefleet_proto::agent::agent_service_client::AgentServiceClient;
use flamefleet_proto::agent::capture_progress::Stage;
use flamefleet_proto::agent::{
    CaptureProgress, CaptureRequest, Container, CpuOptions, ProfileType, Target, UploadSlot,
};
use sha2::{Digest as _, Sha256};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// Fails (never skips) when not root: CI runs these as root.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests create cgroups and load eBPF programs: expected to run as root, found uid {}; run scripts/test.sh or `cargo test` as root",
        nix::unistd::geteuid()
    );
}

/// A unique suffix for names in this process.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A PKI in a temporary directory.
pub struct TestPki {
    pub dir: tempfile::TempDir,
    pub pki: AgentPki,
}

impl TestPki {
    pub fn new(ca_name: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = AgentPki::generate(dir.path(), ca_name).expect("generate agent PKI");
        Self { dir, pki }
    }
}

/// A running `flamefleet-agent serve`, killed on drop.
pub struct AgentProcess {
    child: Child,
    pub addr: String,
    /// The probe server's address, when started with `--probe-listen`.
    pub probes: Option<String>,
    pub node: String,
    stderr_log: PathBuf,
}

impl AgentProcess {
    /// Starts the agent binary for `node`, serving with `pki`'s agent pair.
    pub fn start(node: &str, pki: &TestPki, cgroup_root: &Path, kubeconfig: Option<&Path>) -> Self {
        Self::start_with(node, pki, cgroup_root, kubeconfig, &[])
    }

    /// [`AgentProcess::start`] with extra `serve` arguments.
    pub fn start_with(
        node: &str,
        pki: &TestPki,
        cgroup_root: &Path,
        kubeconfig: Option<&Path>,
        extra: &[&str],
    ) -> Self {
        let log = pki.dir.path().join(format!("agent-{node}.log"));
        let stderr = std::fs::File::create(&log).expect("agent log");
        let files = &pki.pki.files;
        let (agent_cert, agent_key) = pki.pki.issue_agent(node).expect("agent certificate");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"));
        cmd.arg("serve")
            .args(["--node-name", node, "--listen", "127.0.0.1:0"])
            .arg("--tls-ca")
            .arg(&files.ca_cert)
            .arg("--tls-cert")
            .arg(&agent_cert)
            .arg("--tls-key")
            .arg(&agent_key)
            .arg("--cgroup-root")
            .arg(cgroup_root)
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("KUBECONFIG")
            .stdout(Stdio::piped())
            .stderr(stderr);
        if let Some(k) = kubeconfig {
            cmd.arg("--kubeconfig").arg(k);
        } else {
            // No API access: point the default config lookup at nothing.
            cmd.env("HOME", pki.dir.path());
        }
        // Dies with the test process.
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawning flamefleet-agent serve");
        let stdout = child.stdout.take().expect("piped stdout");
        // With --probe-listen, `probes on ADDR` comes first.
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let mut read = reader.read_line(&mut line);
        let probes = line.trim().strip_prefix("probes on ").map(str::to_owned);
        if probes.is_some() {
            line.clear();
            read = reader.read_line(&mut line);
        }
        let addr = line.trim().strip_prefix("listening on ").map(str::to_owned);
        let Some(addr) = addr.filter(|_| read.is_ok()) else {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the agent did not start (first stdout line {line:?}); log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        };
        Self {
            child,
            addr,
            probes,
            node: node.to_owned(),
            stderr_log: log,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// Waits (up to 30 s) until the agent's log contains `needle`: the agent logs a refused
    /// handshake from its accept task, which can run after the client has seen the refusal.
    pub async fn wait_for_log(&self, needle: &str) -> Result<String, String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let log = self.log();
            if log.contains(needle) {
                return Ok(log);
            }
            if std::time::Instant::now() > deadline {
                return Err(log);
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The eBPF objects the agent holds now: file descriptors of programs, maps and perf
    /// events (what a capture's samplers attach with), from `/proc/PID/fd`.
    pub fn bpf_fds(&self) -> BpfFds {
        let mut fds = BpfFds::default();
        let dir = format!("/proc/{}/fd", self.pid());
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {dir}: {e}")) {
            let Ok(target) = entry.and_then(|e| std::fs::read_link(e.path())) else {
                continue; // closed meanwhile
            };
            match target.to_string_lossy().as_ref() {
                "anon_inode:bpf-prog" => fds.programs += 1,
                "anon_inode:bpf-map" => fds.maps += 1,
                "anon_inode:[perf_event]" => fds.perf_events += 1,
                _ => {}
            }
        }
        fds
    }
}

/// Counts of a process's eBPF file descriptors ([`AgentProcess::bpf_fds`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BpfFds {
    pub programs: usize,
    pub maps: usize,
    pub perf_events: usize,
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Client TLS settings for the agent of `node`: trust `ca`, present `identity` (if any).
pub fn tls(node: &str, ca: &Path, identity: Option<(&Path, &Path)>) -> ClientTlsConfig {
    let mut c = ClientTlsConfig::new()
        .domain_name(agent_dns_name(node))
        .ca_certificate(Certificate::from_pem(std::fs::read(ca).expect("read CA")));
    if let Some((cert, key)) = identity {
        c = c.identity(Identity::from_pem(
            std::fs::read(cert).expect("read cert"),
            std::fs::read(key).expect("read key"),
        ));
    }
    c
}

/// Connects with `tls`; returns the error text on failure.
pub async fn connect(
    agent: &AgentProcess,
    tls: ClientTlsConfig,
) -> Result<AgentServiceClient<Channel>, String> {
    let channel = Channel::from_shared(agent.url())
        .map_err(|e| e.to_string())?
        .tls_config(tls)
        .map_err(|e| format!("{e:?}"))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(AgentServiceClient::new(channel))
}

/// The operator's client.
pub async fn operator_client(pki: &TestPki, agent: &AgentProcess) -> AgentServiceClient<Channel> {
    let f = &pki.pki.files;
    connect(
        agent,
        tls(
            &agent.node,
            &f.ca_cert,
            Some((&f.operator_cert, &f.operator_key)),
        ),
    )
    .await
    .expect("operator client connects")
}

/// Collects a Capture stream to its end.
pub async fn collect(
    client: &mut AgentServiceClient<Channel>,
    req: CaptureRequest,
) -> Vec<CaptureProgress> {
    let mut stream = client
        .capture(req)
        .await
        .expect("Capture call accepted")
        .into_inner();
    let mut out = Vec::new();
    while let Some(p) = stream.message().await.expect("progress message") {
        out.push(p);
    }
    out
}

/// Like [`collect`], and sends on `ready` when the first message satisfying
/// `when` arrives (e.g. RUNNING "sampler attached"): the readiness signal a
/// test waits for instead of sleeping.
pub async fn collect_signalling(
    client: &mut AgentServiceClient<Channel>,
    req: CaptureRequest,
    when: impl Fn(&CaptureProgress) -> bool,
    ready: tokio::sync::oneshot::Sender<()>,
) -> Vec<CaptureProgress> {
    let mut stream = client
        .capture(req)
        .await
        .expect("Capture call accepted")
        .into_inner();
    let mut ready = Some(ready);
    let mut out = Vec::new();
    while let Some(p) = stream.message().await.expect("progress message") {
        if when(&p)
            && let Some(tx) = ready.take()
        {
            let _ = tx.send(());
        }
        out.push(p);
    }
    out
}

/// True for the RUNNING message the agent sends once the sampler runs.
pub fn sampler_attached(p: &CaptureProgress) -> bool {
    p.stage() == Stage::Running && p.message == "sampler attached"
}

/// Asserts the stream went ACCEPTED → RUNNING → UPLOADING → DONE.
pub fn assert_full_lifecycle(progress: &[CaptureProgress], agent: &AgentProcess) {
    assert_eq!(
        stages(progress),
        vec![
            Stage::Accepted,
            Stage::Running,
            Stage::Uploading,
            Stage::Done
        ],
        "{progress:#?}\n{}",
        agent.log()
    );
}

pub fn stages(progress: &[CaptureProgress]) -> Vec<Stage> {
    let mut s: Vec<Stage> = progress.iter().map(CaptureProgress::stage).collect();
    s.dedup();
    s
}

/// Serializes the CPU- and timing-sensitive tests of one binary (2 cores).
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// A compiled allocator loop whose allocation site is `grow_heap`: keeps up
/// to 256 blocks of 64 KiB live, replacing one every 2 ms.
pub fn allocator() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        compile(
            "allocator",
            "#include <stdlib.h>\n#include <string.h>\n#include <unistd.h>\n\
             static void *live[256];\n\
             __attribute__((noinline)) void *grow_heap(size_t n) { void *p = malloc(n); if (p) memset(p, 1, n); return p; }\n\
             int main(void) { for (unsigned i = 0;; i++) { free(live[i % 256]); live[i % 256] = grow_heap(65536); usleep(2000); } }\n",
        )
    })
}

fn compile(name: &str, source: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique("flamefleet-svc-bin"));
    std::fs::create_dir_all(&dir).expect("bin dir");
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).expect("write C source");
    let bin = dir.join(name);
    let out = Command::new("cc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("running cc (install gcc)");
    assert!(
        out.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

/// A compiled CPU burner whose hot function is `burn_cpu`.
pub fn burner() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        compile(
            "burner",
            "#include <stdint.h>\n\
             __attribute__((noinline)) uint64_t burn_cpu(uint64_t x) {\n\
               for (int i = 0; i < 1000000; i++) x = x * 6364136223846793005ULL + 1442695040888963407ULL;\n\
               return x;\n}\n\
             int main(void) { volatile uint64_t x = 1; for (;;) x = burn_cpu(x); }\n",
        )
    })
}

/// A kubelet cgroupfs-driver tree under a unique directory of the cgroup2
/// mount: `<root>/kubepods/burstable/pod<uid>/<container id>`, with a real
/// workload in the container's cgroup. Removed (workloads killed) on drop.
pub struct PodTree {
    /// The directory to pass as `--cgroup-root`.
    pub root: PathBuf,
    pub pod_uid: String,
    pub container_id: String,
    pub leaf: PathBuf,
    children: Vec<Child>,
}

impl PodTree {
    pub fn new() -> Self {
        let mount = CgroupRoot::detect().expect("a cgroup2 mount");
        let root = mount.path().join(unique("flamefleet-svc"));
        let n = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let pod_uid = format!(
            "0000{:08x}-1111-2222-3333-{:012x}",
            std::process::id(),
            n % (1 << 48)
        );
        let container_id = hex::encode(Sha256::digest(format!("{pod_uid}-c").as_bytes()));
        let leaf = root
            .join("kubepods/burstable")
            .join(format!("pod{pod_uid}"))
            .join(&container_id);
        std::fs::create_dir_all(&leaf)
            .unwrap_or_else(|e| panic!("creating {}: {e}", leaf.display()));
        Self {
            root,
            pod_uid,
            container_id,
            leaf,
            children: Vec::new(),
        }
    }

    /// Starts the CPU burner inside the container cgroup.
    pub fn start_burner(&mut self) -> u32 {
        self.start(burner())
    }

    /// Starts `program` inside the container cgroup.
    pub fn start(&mut self, program: &Path) -> u32 {
        let child = Command::new(program)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn burner");
        let pid = child.id();
        std::fs::write(self.leaf.join("cgroup.procs"), pid.to_string())
            .expect("move the burner into its cgroup");
        self.children.push(child);
        pid
    }

    /// A Target for this pod.
    pub fn target(&self, namespace: &str, pod: &str, container: &str) -> Target {
        Target {
            pod_uid: self.pod_uid.clone(),
            namespace: namespace.into(),
            pod_name: pod.into(),
            containers: vec![Container {
                name: container.into(),
                container_id: format!("containerd://{}", self.container_id),
            }],
            annotations: HashMap::new(),
            pod_ip: String::new(),
        }
    }
}

impl Drop for PodTree {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let mut dir = self.leaf.clone();
        while dir.starts_with(&self.root) {
            for _ in 0..50 {
                if std::fs::remove_dir(&dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if !dir.pop() {
                break;
            }
        }
    }
}

/// What the upload server received: path → body.
pub type Received = Arc<Mutex<HashMap<String, Vec<u8>>>>;

/// The upload server's state: bodies, refusal, accepted PUTs.
type StoreState = (Received, Refusal, Arc<AtomicU32>, Arc<AtomicU32>);

/// Answer the first `n` PUTs with (status, body); `None`: accept all.
pub type Refusal = Option<(u16, &'static str, u32)>;

/// A tiny artifact store: accepts PUT /<name> when `x-flamefleet-sha256`
/// matches the body (else 422), after refusing the first PUTs as `refuse` says.
pub struct UploadServer {
    pub base: String,
    pub received: Received,
    /// Accepted PUTs.
    pub puts: Arc<AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

impl UploadServer {
    pub async fn start(refuse: Refusal) -> Self {
        use axum::body::Bytes;
        use axum::extract::{Path as AxPath, State};
        use axum::http::{HeaderMap, StatusCode};
        let received: Received = Arc::default();
        let puts = Arc::new(AtomicU32::new(0));
        let refused = Arc::new(AtomicU32::new(0));
        let state = (received.clone(), refuse, puts.clone(), refused);
        let app = axum::Router::new()
            .route(
                "/{*name}",
                axum::routing::put(
                    |State((received, refuse, puts, refused)): State<StoreState>,
                     AxPath(name): AxPath<String>,
                     headers: HeaderMap,
                     body: Bytes| async move {
                        if let Some((code, text, n)) = refuse
                            && refused.fetch_add(1, Ordering::SeqCst) < n
                        {
                            return (StatusCode::from_u16(code).unwrap(), text.to_owned());
                        }
                        let want = headers
                            .get("x-flamefleet-sha256")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned();
                        let got = hex::encode(Sha256::digest(&body));
                        if want != got {
                            return (
                                StatusCode::UNPROCESSABLE_ENTITY,
                                format!("sha256 mismatch: header {want:?}, body {got}"),
                            );
                        }
                        received.lock().unwrap().insert(name, body.to_vec());
                        puts.fetch_add(1, Ordering::SeqCst);
                        (StatusCode::CREATED, String::new())
                    },
                ),
            )
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upload server");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            base,
            received,
            puts,
            task,
        }
    }

    /// Upload slots for `names` under a `prefix` directory.
    pub fn slots(&self, prefix: &str, names: &[String]) -> Vec<UploadSlot> {
        names
            .iter()
            .map(|n| UploadSlot {
                artifact_name: n.clone(),
                put_url: format!("{}/{prefix}/{n}?sig=test", self.base),
                download_url: format!("{}/{prefix}/{n}", self.base),
                max_bytes: 64 << 20,
            })
            .collect()
    }

    pub fn body(&self, prefix: &str, name: &str) -> Option<Vec<u8>> {
        self.received
            .lock()
            .unwrap()
            .get(&format!("{prefix}/{name}"))
            .cloned()
    }
}

impl Drop for UploadServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A cpu CaptureRequest for one pod tree.
pub fn cpu_request(
    uid: &str,
    node: &str,
    tree: &PodTree,
    upload: &UploadServer,
    duration_ms: u32,
) -> CaptureRequest {
    CaptureRequest {
        request_uid: uid.into(),
        request_namespace: "shop".into(),
        request_name: String::new(),
        r#type: ProfileType::Cpu as i32,
        duration_ms,
        cpu: Some(CpuOptions { frequency_hz: 99 }),
        heap: None,
        runqlat: None,
        offcpu: None,
        targets: vec![tree.target("shop", "checkout-1", "app")],
        uploads: upload.slots(uid, &[format!("cpu-{node}.pb.gz")]),
        deadline_ms: 0,
        trigger_fire_id: String::new(),
    }
}

/// `go tool pprof -top` of `bytes`; panics when go fails.
pub fn pprof_top(bytes: &[u8]) -> String {
    pprof_top_with(bytes, &[])
}

/// `go tool pprof -top [extra args]` on a profile's bytes.
pub fn pprof_top_with(bytes: &[u8], extra: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("profile.pb.gz");
    std::fs::write(&file, bytes).expect("write profile");
    let out = Command::new("go")
        .args(["tool", "pprof", "-top"])
        .args(extra)
        .arg(&file)
        .output()
        .expect("running `go tool pprof` (install Go)");
    assert!(
        out.status.success(),
        "go tool pprof failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The usual fixture: a PKI, a pod tree running `workload`, an upload
/// server, the agent for `node` (no API access) and an operator client.
/// Fields drop in order: the agent goes before its cgroups.
pub struct Setup {
    pub client: AgentServiceClient<Channel>,
    pub agent: AgentProcess,
    pub upload: UploadServer,
    pub tree: PodTree,
    pub pki: TestPki,
}

impl Setup {
    pub async fn new(node: &str, workload: &Path) -> Self {
        let pki = TestPki::new("ca");
        let mut tree = PodTree::new();
        tree.start(workload);
        let upload = UploadServer::start(None).await;
        let agent = AgentProcess::start(node, &pki, &tree.root, None);
        let client = operator_client(&pki, &agent).await;
        Self {
            client,
            agent,
            upload,
            tree,
            pki,
        }
    }

    /// Another operator client (another connection).
    pub async fn client(&self) -> AgentServiceClient<Channel> {
        operator_client(&self.pki, &self.agent).await
    }
}
