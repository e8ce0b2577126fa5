//! Starting, reaching and stopping a local etcd + kube-apiserver pair.

use std::ffi::OsString;
use std::fs::File;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::pki::{Pki, kubeconfig_text};
use crate::{Error, Result, binaries, io_err};

/// How long the API server may take to report ready.
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// Environment variable naming the kubeconfig of an already running control plane to reuse.
pub const KUBECONFIG_ENV: &str = "FLAMEFLEET_KUBECONFIG";

/// What happens to the processes when the starting process ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifetime {
    /// They get SIGKILL when the process that started them dies (tests).
    TiedToThisProcess,
    /// They run on in their own process group until `stop_detached` (scripts, demo).
    Detached,
}

/// A running (or reused) local control plane.
#[derive(Debug)]
pub struct ControlPlane {
    kubeconfig: PathBuf,
    server: String,
    dir: Option<PathBuf>,
    pki: Option<Pki>,
    children: Mutex<Vec<Child>>,
    lifetime: Option<Lifetime>,
    startup: Duration,
    /// How to start each child again (same order as `children`: etcd, kube-apiserver).
    respawn: Vec<Respawn>,
    etcd_url: String,
}

/// One process of the control plane, for tests that stop and restart it (faults).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    /// etcd.
    Etcd,
    /// kube-apiserver.
    ApiServer,
}

impl Component {
    fn index(self) -> usize {
        match self {
            Self::Etcd => 0,
            Self::ApiServer => 1,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Etcd => "etcd",
            Self::ApiServer => "kube-apiserver",
        }
    }
}

/// The command line and log of a control-plane process, to start it again on the same
/// ports and state after a fault test stopped it.
#[derive(Debug, Clone)]
struct Respawn {
    program: PathBuf,
    args: Vec<OsString>,
    log: PathBuf,
}

impl Respawn {
    fn of(cmd: &Command, log: &Path) -> Self {
        Self {
            program: PathBuf::from(cmd.get_program()),
            args: cmd.get_args().map(OsString::from).collect(),
            log: log.to_path_buf(),
        }
    }
}

/// Pid files of a detached control plane, in `dir`.
const PID_FILES: [&str; 2] = ["kube-apiserver.pid", "etcd.pid"];

static SHARED: OnceLock<std::result::Result<ControlPlane, String>> = OnceLock::new();

impl ControlPlane {
    /// The control plane shared by all tests of this process, started on first use.
    ///
    /// With `FLAMEFLEET_KUBECONFIG` set, that cluster is used instead and nothing is started.
    /// Otherwise etcd and kube-apiserver start in a fresh directory under the temp dir and are
    /// killed (PR_SET_PDEATHSIG) when the test process exits.
    ///
    /// # Errors
    /// When the binaries are missing or the control plane does not become ready; every later
    /// call in the same process returns the same error.
    pub fn shared() -> Result<&'static ControlPlane> {
        SHARED
            .get_or_init(|| {
                if let Some(kubeconfig) = std::env::var_os(KUBECONFIG_ENV) {
                    return Ok(Self::external(PathBuf::from(kubeconfig)));
                }
                // PR_SET_PDEATHSIG fires when the *thread* that forked exits, and test threads
                // come and go; fork from a thread that lives as long as the process.
                let (tx, rx) = std::sync::mpsc::channel();
                let spawned = std::thread::Builder::new()
                    .name("flamefleet-controlplane".into())
                    .spawn(move || {
                        let result = std::panic::catch_unwind(|| {
                            Self::start_in_temp_dir().map_err(|e| e.to_string())
                        })
                        .unwrap_or_else(|panic| {
                            Err(format!("starting panicked: {}", panic_text(&panic)))
                        });
                        let _ = tx.send(result);
                        loop {
                            std::thread::park();
                        }
                    });
                match spawned {
                    Ok(_) => rx
                        .recv()
                        .unwrap_or_else(|_| Err("the control-plane thread died".to_string())),
                    Err(e) => Err(format!("cannot spawn the control-plane thread: {e}")),
                }
            })
            .as_ref()
            .map_err(|e| Error::SharedUnavailable(e.clone()))
    }

    fn start_in_temp_dir() -> Result<Self> {
        remove_stale_temp_dirs();
        let dir = std::env::temp_dir().join(format!("flamefleet-e2e-{}", std::process::id()));
        Self::start(&dir, Lifetime::TiedToThisProcess)
    }

    /// Uses a control plane somebody else runs.
    pub fn external(kubeconfig: PathBuf) -> Self {
        Self {
            kubeconfig,
            server: String::new(),
            dir: None,
            pki: None,
            children: Mutex::new(Vec::new()),
            lifetime: None,
            startup: Duration::ZERO,
            respawn: Vec::new(),
            etcd_url: String::new(),
        }
    }

    /// Starts etcd and kube-apiserver with state in `dir` (wiped first) and waits until the
    /// API server is ready. Retries with new ports if one was taken in between.
    pub fn start(dir: &Path, lifetime: Lifetime) -> Result<Self> {
        let mut last_error = None;
        for _attempt in 0..3 {
            match Self::start_once(dir, lifetime) {
                Ok(cp) => return Ok(cp),
                Err(e @ Error::StartFailed { .. })
                    if e.to_string().contains("address already in use") =>
                {
                    last_error = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last_error.unwrap_or_else(|| Error::SharedUnavailable("no start attempt".into())))
    }

    fn start_once(dir: &Path, lifetime: Lifetime) -> Result<Self> {
        let apiserver_bin = binaries::kube_apiserver()?;
        let etcd_bin = binaries::etcd()?;
        if dir.exists() {
            std::fs::remove_dir_all(dir)
                .map_err(io_err(format!("removing old state {}", dir.display())))?;
        }
        std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let pki = Pki::generate(&dir.join("pki"))?;
        let [etcd_client, etcd_peer, apiserver_port] = free_ports()?;
        let started = Instant::now();

        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let mut etcd = Command::new(&etcd_bin);
        etcd.args(["--name", "flamefleet", "--data-dir"])
            .arg(dir.join("etcd-data"))
            .args([
                "--listen-client-urls",
                &etcd_url,
                "--advertise-client-urls",
                &etcd_url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("flamefleet={peer_url}")])
            // Test data is disposable: skip fsync, it is the slowest part of etcd on a VM.
            .args(["--unsafe-no-fsync", "--log-level", "warn"]);
        let mut children = Vec::new();
        let mut respawn = Vec::new();
        let etcd_log = dir.join("etcd.log");
        respawn.push(Respawn::of(&etcd, &etcd_log));
        children.push(spawn(&mut etcd, &etcd_log, lifetime)?);

        let server = format!("https://127.0.0.1:{apiserver_port}");
        let f = &pki.files;
        let mut apiserver = Command::new(&apiserver_bin);
        apiserver
            .arg(format!("--etcd-servers={etcd_url}"))
            .args(["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"])
            .arg(format!("--secure-port={apiserver_port}"))
            .arg(format!(
                "--cert-dir={}",
                dir.join("apiserver-certs").display()
            ))
            .arg(format!("--tls-cert-file={}", f.serving_cert.display()))
            .arg(format!(
                "--tls-private-key-file={}",
                f.serving_key.display()
            ))
            .arg(format!("--client-ca-file={}", f.ca_cert.display()))
            .arg("--authorization-mode=Node,RBAC")
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(format!("--service-account-key-file={}", f.sa_pub.display()))
            .arg(format!(
                "--service-account-signing-key-file={}",
                f.sa_key.display()
            ))
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            // No controller-manager creates the `default` ServiceAccount of new namespaces,
            // and no endpoint is reachable for the `kubernetes` Service on loopback.
            .arg("--disable-admission-plugins=ServiceAccount")
            .arg("--endpoint-reconciler-type=none")
            .arg("--profiling=false")
            .arg("--v=1");
        let apiserver_log = dir.join("kube-apiserver.log");
        respawn.push(Respawn::of(&apiserver, &apiserver_log));
        children.push(spawn(&mut apiserver, &apiserver_log, lifetime)?);

        if lifetime == Lifetime::Detached {
            for (child, file) in children.iter().rev().zip(PID_FILES) {
                std::fs::write(dir.join(file), child.id().to_string())
                    .map_err(io_err(format!("writing {file}")))?;
            }
        }

        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            kubeconfig_text(
                &server,
                &f.ca_cert,
                &f.admin_cert,
                &f.admin_key,
                "flamefleet-admin",
            ),
        )
        .map_err(io_err("writing the kubeconfig"))?;

        let mut cp = Self {
            kubeconfig,
            server,
            dir: Some(dir.to_path_buf()),
            pki: Some(pki),
            children: Mutex::new(children),
            lifetime: Some(lifetime),
            startup: Duration::ZERO,
            respawn,
            etcd_url,
        };
        let logs = [etcd_log, apiserver_log];
        if let Err(e) = cp.wait_ready(&logs) {
            cp.kill_children();
            return Err(e);
        }
        cp.startup = started.elapsed();
        Ok(cp)
    }

    fn kill_children(&self) {
        let children = self.children.lock().unwrap_or_else(|p| p.into_inner());
        // The API server first, so it does not log etcd errors while shutting down.
        for child in children.iter().rev() {
            if let Ok(pid) = i32::try_from(child.id()) {
                terminate(pid);
            }
        }
    }

    fn wait_ready(&self, logs: &[PathBuf; 2]) -> Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_err("creating a tokio runtime"))?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some((index, status)) = self.exited_child() {
                let log = logs[index].clone();
                return Err(Error::StartFailed {
                    reason: format!("{} exited with {status}", ["etcd", "kube-apiserver"][index]),
                    log_tail: tail(&log, 25),
                    log,
                });
            }
            let last = match runtime.block_on(self.readyz()) {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if Instant::now() > deadline {
                return Err(Error::StartFailed {
                    reason: format!(
                        "kube-apiserver not ready after {}s (last answer: {last})",
                        READY_TIMEOUT.as_secs()
                    ),
                    log_tail: tail(&logs[1], 25),
                    log: logs[1].clone(),
                });
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    async fn readyz(&self) -> std::result::Result<(), String> {
        let client = self.client().await.map_err(|e| e.to_string())?;
        let request = http::Request::get("/readyz")
            .body(Vec::new())
            .map_err(|e| e.to_string())?;
        let body = client
            .request_text(request)
            .await
            .map_err(|e| e.to_string())?;
        if body.trim() == "ok" {
            Ok(())
        } else {
            Err(body)
        }
    }

    /// Index (0 etcd, 1 apiserver) and status of a child that has exited, if any.
    fn exited_child(&self) -> Option<(usize, std::process::ExitStatus)> {
        let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
        children
            .iter_mut()
            .enumerate()
            .find_map(|(i, c)| c.try_wait().ok().flatten().map(|s| (i, s)))
    }

    /// The admin kubeconfig file.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The API server URL (empty for an external control plane).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The state directory (certificates, logs, etcd data), if this process started it.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// How long etcd + kube-apiserver took from spawn to `/readyz` ok (zero when reused).
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// A new admin client (system:masters). Create one per tokio runtime: a client's
    /// connections belong to the runtime that made them.
    pub async fn client(&self) -> Result<Client> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// Writes a kubeconfig authenticating as `user` in `groups` (no permissions unless RBAC
    /// grants them) and returns its path. For least-privilege tests.
    pub fn kubeconfig_for_user(&self, user: &str, groups: &[&str]) -> Result<PathBuf> {
        let (Some(pki), Some(dir)) = (&self.pki, &self.dir) else {
            return Err(Error::NotOwned("kubeconfig_for_user"));
        };
        let (cert, key) = pki.issue_client_cert(user, groups)?;
        let stem = cert
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let path = dir.join(format!("kubeconfig-{stem}"));
        std::fs::write(
            &path,
            kubeconfig_text(&self.server, &pki.files.ca_cert, &cert, &key, user),
        )
        .map_err(io_err(format!("writing {}", path.display())))?;
        Ok(path)
    }

    /// etcd's client URL (empty for an external control plane): fault tests talk to etcd
    /// directly (its JSON gateway), e.g. to compact its history.
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// Stops one process of the control plane (SIGTERM, SIGKILL after 10 s) and reaps it;
    /// its state stays for [`ControlPlane::restart`]. For fault tests, which must own the
    /// control plane: every other client of it loses it too.
    ///
    /// # Errors
    /// [`Error::NotOwned`] on a control plane this process did not start.
    pub fn stop(&self, component: Component) -> Result<()> {
        if self.respawn.is_empty() {
            return Err(Error::NotOwned("stopping a control-plane process"));
        }
        let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
        let child = &mut children[component.index()];
        if child.try_wait().ok().flatten().is_none()
            && let Ok(pid) = i32::try_from(child.id())
        {
            terminate(pid);
        }
        let _ = child.wait();
        Ok(())
    }

    /// Starts a process stopped by [`ControlPlane::stop`] again, with the same flags, ports
    /// and data, appending to its log, and waits until the API server answers `/readyz`
    /// (which checks etcd too).
    ///
    /// # Errors
    /// [`Error::NotOwned`] on a control plane this process did not start;
    /// [`Error::StartFailed`] when it exits or the API server is not ready in time.
    pub fn restart(&self, component: Component) -> Result<()> {
        let Some(respawn) = self.respawn.get(component.index()).cloned() else {
            return Err(Error::NotOwned("restarting a control-plane process"));
        };
        let lifetime = self.lifetime.unwrap_or(Lifetime::TiedToThisProcess);
        let child = if lifetime == Lifetime::TiedToThisProcess {
            // PR_SET_PDEATHSIG follows the forking thread (see `shared`): fork from a thread
            // that lives as long as the process, not from the calling test's.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name(format!("flamefleet-{}", component.name()))
                .spawn(move || {
                    let _ = tx.send(respawn.spawn(lifetime));
                    loop {
                        std::thread::park();
                    }
                })
                .map_err(io_err("spawning a control-plane thread"))?;
            rx.recv().map_err(|_| {
                Error::SharedUnavailable("the control-plane thread died".to_string())
            })??
        } else {
            respawn.spawn(lifetime)?
        };
        {
            let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
            children[component.index()] = child;
        }
        let logs = [self.respawn[0].log.clone(), self.respawn[1].log.clone()];
        self.wait_ready(&logs)
    }

    /// Stops a detached control plane whose state is in `dir` (SIGTERM, then SIGKILL after
    /// 10s). Returns how many processes were stopped.
    pub fn stop_detached(dir: &Path) -> Result<usize> {
        let mut stopped = 0;
        for file in PID_FILES {
            let pid_file = dir.join(file);
            let Some(pid) = read_pid(&pid_file) else {
                continue;
            };
            if is_ours(pid, dir) {
                terminate(pid);
                stopped += 1;
            }
            let _ = std::fs::remove_file(&pid_file);
        }
        Ok(stopped)
    }

    /// True when both processes of a detached control plane in `dir` are alive.
    pub fn detached_running(dir: &Path) -> bool {
        PID_FILES
            .iter()
            .all(|f| read_pid(&dir.join(f)).is_some_and(|pid| is_ours(pid, dir)))
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if self.lifetime != Some(Lifetime::TiedToThisProcess) {
            return;
        }
        self.kill_children();
    }
}

/// Builds a client from a kubeconfig file.
///
/// Installs rustls' ring provider as the process default first: the workspace enables both
/// ring and aws-lc-rs in rustls, and rustls refuses to guess between them.
pub async fn client_from_kubeconfig(path: &Path) -> Result<Client> {
    // Err only means a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kc_err = |reason: String| Error::Kubeconfig {
        path: path.to_path_buf(),
        reason,
    };
    let kubeconfig = Kubeconfig::read_from(path).map_err(|e| kc_err(e.to_string()))?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| kc_err(e.to_string()))?;
    Client::try_from(config).map_err(|e| kc_err(e.to_string()))
}

impl Respawn {
    fn spawn(&self, lifetime: Lifetime) -> Result<Child> {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        let out = File::options()
            .append(true)
            .create(true)
            .open(&self.log)
            .map_err(io_err(format!("opening {}", self.log.display())))?;
        spawn_to(&mut cmd, out, lifetime)
    }
}

fn spawn(cmd: &mut Command, log: &Path, lifetime: Lifetime) -> Result<Child> {
    let out = File::create(log).map_err(io_err(format!("creating {}", log.display())))?;
    spawn_to(cmd, out, lifetime)
}

fn spawn_to(cmd: &mut Command, out: File, lifetime: Lifetime) -> Result<Child> {
    let err = out
        .try_clone()
        .map_err(io_err("duplicating a log handle"))?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    match lifetime {
        Lifetime::TiedToThisProcess => {
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        Lifetime::Detached => {
            cmd.process_group(0);
        }
    }
    cmd.spawn().map_err(io_err(format!(
        "starting {}",
        cmd.get_program().to_string_lossy()
    )))
}

/// Picks free loopback ports (the kernel's choice; released just before use).
fn free_ports() -> Result<[u16; 3]> {
    let listeners = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(io_err("finding free loopback ports"))?;
    let mut ports = [0u16; 3];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener
            .local_addr()
            .map_err(io_err("reading a bound port"))?
            .port();
    }
    Ok(ports)
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// True when `pid` runs a process whose command line mentions `dir` (guards against a
/// recycled pid).
fn is_ours(pid: i32, dir: &Path) -> bool {
    let needle = dir.to_string_lossy();
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains(needle.as_ref()))
}

fn terminate(pid: i32) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let pid = Pid::from_raw(pid);
    if kill(pid, Signal::SIGTERM).is_err() {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        // Reap it if it is our child; otherwise just watch /proc.
        let _ = nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
        if kill(pid, None).is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = kill(pid, Signal::SIGKILL);
    let _ = nix::sys::wait::waitpid(pid, None);
}

/// Removes `flamefleet-e2e-<pid>` temp dirs whose test process is gone.
fn remove_stale_temp_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("flamefleet-e2e-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// The last `lines` lines of a file, for error messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
