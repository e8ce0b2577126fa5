//! The real one-node cluster (`scripts/cluster.sh`): kubelet, containerd + runc, kube-proxy,
//! CoreDNS, with Flamefleet installed from its chart — for the tests that need what a user's
//! cluster has (real container IDs and cgroups, pod networking, ServiceAccount tokens bound
//! to pods and nodes, the agent as a DaemonSet with only the chart's privileges).
//!
//! [`Cluster::shared`] brings the node up once per test process through `cluster.sh up`
//! (idempotent and locked, so test binaries that run one after another share it), and
//! [`Cluster::install_flamefleet`] builds and imports the images and `helm install`s the chart
//! into a namespace of the caller's choosing. Nothing is skipped: a missing prerequisite
//! fails with what to run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kube::Client;

use crate::control_plane::client_from_kubeconfig;
use crate::{Error, Result, io_err};

/// What `cluster.sh env` reports about the running node.
#[derive(Debug, Clone)]
pub struct Cluster {
    repo: PathBuf,
    /// The admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// The node's name.
    pub node: String,
    /// The node's address (the API server's, NodePorts').
    pub node_ip: String,
    /// The node's containerd socket.
    pub containerd_sock: PathBuf,
}

static SHARED: OnceLock<std::result::Result<Cluster, String>> = OnceLock::new();

/// The repository root (this crate is `<repo>/e2e`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn script_error(what: &str, out: &Output) -> Error {
    Error::StartFailed {
        reason: format!("{what} failed ({})", out.status),
        log: PathBuf::from("(stderr)"),
        log_tail: format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// Runs `scripts/<script> args...` from the repository root.
pub fn run_script(script: &str, args: &[&str]) -> Result<Output> {
    let repo = repo_root();
    let out = Command::new(repo.join("scripts").join(script))
        .args(args)
        .current_dir(&repo)
        .output()
        .map_err(io_err(format!("running scripts/{script}")))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(script_error(
            &format!("scripts/{script} {}", args.join(" ")),
            &out,
        ))
    }
}

impl Cluster {
    /// The node, started by `scripts/cluster.sh up` on first use in this process.
    ///
    /// # Errors
    /// When the node does not come up; every later call returns the same error.
    pub fn shared() -> Result<&'static Cluster> {
        SHARED
            .get_or_init(|| Self::up().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Error::SharedUnavailable(e.clone()))
    }

    fn up() -> Result<Self> {
        run_script("cluster.sh", &["up"])?;
        let env = run_script("cluster.sh", &["env"])?;
        let vars: BTreeMap<String, String> = String::from_utf8_lossy(&env.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let get = |k: &str| {
            vars.get(k).cloned().ok_or_else(|| Error::StartFailed {
                reason: format!("scripts/cluster.sh env did not report {k}"),
                log: PathBuf::from("(cluster.sh env)"),
                log_tail: String::from_utf8_lossy(&env.stdout).into_owned(),
            })
        };
        Ok(Self {
            repo: repo_root(),
            kubeconfig: PathBuf::from(get("KUBECONFIG")?),
            node: get("NODE_NAME")?,
            node_ip: get("NODE_IP")?,
            containerd_sock: PathBuf::from(get("CONTAINERD_SOCK")?),
        })
    }

    /// An admin client. Create one per tokio runtime.
    ///
    /// # Errors
    /// When the kubeconfig is unusable.
    pub async fn client(&self) -> Result<Client> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// The pinned kubectl against this cluster; `Err` carries stderr.
    pub fn kubectl(&self, args: &[&str]) -> std::result::Result<String, String> {
        let bin = crate::binaries::kubectl().map_err(|e| e.to_string())?;
        let out = Command::new(bin)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// `kubectl apply` of `object` (written to a temporary file); `Err` carries stderr.
    pub fn apply(&self, object: &serde_json::Value) -> std::result::Result<String, String> {
        let file = tempfile_path("apply", "json");
        std::fs::write(&file, object.to_string())
            .map_err(|e| format!("writing {}: {e}", file.display()))?;
        let out = self.kubectl(&["apply", "-f", &file.to_string_lossy()]);
        let _ = std::fs::remove_file(&file);
        out
    }

    /// The pinned helm against this cluster; `Err` carries stderr.
    pub fn helm(&self, args: &[&str]) -> std::result::Result<String, String> {
        let out = Command::new(helm_binary())
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .current_dir(&self.repo)
            .output()
            .map_err(|e| format!("running helm: {e}; build it with scripts/tools.sh build"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "helm {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Builds the images (release binaries; cached by cargo) with `tag`, or the default tag,
    /// and imports them into the node's containerd. `label` tells two builds of one tag
    /// apart. Returns the tag.
    ///
    /// # Errors
    /// When a build or the import fails.
    pub fn build_images(&self, tag: Option<&str>, label: Option<&str>) -> Result<String> {
        let repo = repo_root();
        let mut cmd = Command::new(repo.join("scripts/images.sh"));
        crate::binaries::without_cargo_test_env(&mut cmd);
        if let Some(t) = tag {
            cmd.env("FLAMEFLEET_IMAGE_TAG", t);
        }
        if let Some(l) = label {
            cmd.env("FLAMEFLEET_IMAGE_LABEL", l);
        }
        for action in ["build", "import"] {
            let out = cmd
                .arg(action)
                .output()
                .map_err(io_err("running scripts/images.sh"))?;
            if !out.status.success() {
                return Err(script_error(&format!("scripts/images.sh {action}"), &out));
            }
            cmd = Command::new(repo.join("scripts/images.sh"));
            crate::binaries::without_cargo_test_env(&mut cmd);
            if let Some(t) = tag {
                cmd.env("FLAMEFLEET_IMAGE_TAG", t);
            }
            if let Some(l) = label {
                cmd.env("FLAMEFLEET_IMAGE_LABEL", l);
            }
        }
        let out = cmd
            .arg("tag")
            .output()
            .map_err(io_err("scripts/images.sh tag"))?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// The chart values for this node: local images never pulled, the store on a host
    /// directory (no storage provisioner here) and on a NodePort so the host can download.
    pub fn local_values(&self, tag: &str, store_node_port: u16) -> Vec<String> {
        vec![
            format!("image.tag={tag}"),
            "image.pullPolicy=Never".into(),
            "store.persistence.type=hostPath".into(),
            format!("store.persistence.hostPath={}", STORE_HOST_DIR),
            "store.service.type=NodePort".into(),
            format!("store.service.nodePort={store_node_port}"),
            format!(
                "store.publicUrl=https://{}:{store_node_port}/",
                self.node_ip
            ),
            "operator.podDisruptionBudget.enabled=false".into(),
        ]
    }

    /// The chart's CRDs, then `helm upgrade --install RELEASE charts/flamefleet -n
    /// NAMESPACE` with `values` (`key=value`), waiting for every workload to be ready.
    ///
    /// Helm installs a chart's `crds/` only when they are absent and never upgrades them, so
    /// on a cluster that kept the CRDs of an earlier checkout the operator of this one would
    /// write status fields the old schema does not declare, and server-side apply refuses
    /// them. The CRDs are applied first, as the README's upgrade instructions say.
    ///
    /// # Errors
    /// kubectl's or helm's message, with the pods' state.
    pub fn install_flamefleet(
        &self,
        release: &str,
        namespace: &str,
        values: &[String],
    ) -> std::result::Result<(), String> {
        prepare_store_dir().map_err(|e| e.to_string())?;
        let crds = self.repo.join("charts/flamefleet/crds");
        self.kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            &crds.to_string_lossy(),
        ])?;
        let mut args = vec![
            "upgrade",
            "--install",
            release,
            "charts/flamefleet",
            "--namespace",
            namespace,
            "--create-namespace",
            "--wait",
            "--timeout",
            "5m",
        ];
        for v in values {
            args.push("--set");
            args.push(v);
        }
        self.helm(&args).map(|_| ()).map_err(|e| {
            let pods = self
                .kubectl(&["get", "pods", "-n", namespace, "-o", "wide"])
                .unwrap_or_default();
            format!("{e}\n{pods}")
        })
    }

    /// `helm uninstall RELEASE -n NAMESPACE --wait` (3 min at most); with `if_present`, a
    /// missing release is not an error.
    ///
    /// # Errors
    /// helm's message.
    pub fn uninstall_flamefleet(
        &self,
        release: &str,
        namespace: &str,
        if_present: bool,
    ) -> std::result::Result<(), String> {
        let mut args = vec![
            "uninstall",
            release,
            "-n",
            namespace,
            "--wait",
            "--timeout",
            "3m",
        ];
        if if_present {
            args.push("--ignore-not-found");
        }
        self.helm(&args).map(|_| ())
    }

    /// Stops the node's kubelet (`scripts/cluster.sh kubelet stop`); the pods keep running.
    /// The returned guard starts it again when dropped, so a failing test leaves the node
    /// with its kubelet; [`KubeletStopped::start`] does so earlier.
    ///
    /// # Errors
    /// When the script fails.
    pub fn stop_kubelet(&self) -> Result<KubeletStopped> {
        run_script("cluster.sh", &["kubelet", "stop"])?;
        Ok(KubeletStopped { started: false })
    }

    /// Waits until `check` returns `Some` ([`wait_for`]).
    ///
    /// # Errors
    /// [`Error::Timeout`] naming `what`.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, timeout: Duration, check: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        wait_for(what, timeout, Duration::from_millis(500), check).await
    }
}

/// Waits until `check` returns `Some`, calling it every `interval`, for at most `timeout`.
///
/// # Errors
/// [`Error::Timeout`] naming `what`.
pub async fn wait_for<T, F, Fut>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(Error::Timeout {
                what: what.to_owned(),
                seconds: timeout.as_secs(),
            });
        }
        tokio::time::sleep(interval).await;
    }
}

/// A Deployment `name` (label `app=<name>`) of `replicas` pods of a demo image (built by
/// `scripts/images.sh`, never pulled), each with CPU `[request, limit]` (quantities) and run
/// with `args`.
pub fn demo_deployment(
    namespace: &str,
    name: &str,
    image: &str,
    replicas: u32,
    [cpu_request, cpu_limit]: [&str; 2],
    args: &[&str],
) -> serde_json::Value {
    let mut container = serde_json::json!({
        "name": name,
        "image": image,
        "imagePullPolicy": "Never",
        "resources": {
            "requests": {"cpu": cpu_request, "memory": "64Mi"},
            "limits": {"cpu": cpu_limit, "memory": "256Mi"},
        },
    });
    if !args.is_empty() {
        container["args"] = serde_json::json!(args);
    }
    serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [container]},
            },
        },
    })
}

/// A path in the temporary directory no other process of this run uses.
fn tempfile_path(what: &str, ext: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "flamefleet-{what}-{}-{}.{ext}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// The node's kubelet, stopped by [`Cluster::stop_kubelet`]: started again on drop.
#[derive(Debug)]
#[must_use = "dropping it starts the kubelet again"]
pub struct KubeletStopped {
    started: bool,
}

impl KubeletStopped {
    /// Starts the kubelet again (`scripts/cluster.sh kubelet start`), without waiting for
    /// the node to be Ready.
    ///
    /// # Errors
    /// When the script fails.
    pub fn start(mut self) -> Result<()> {
        self.started = true;
        run_script("cluster.sh", &["kubelet", "start"]).map(|_| ())
    }
}

impl Drop for KubeletStopped {
    fn drop(&mut self) {
        if !self.started
            && let Err(e) = run_script("cluster.sh", &["kubelet", "start"])
        {
            eprintln!("starting the kubelet again failed: {e}");
        }
    }
}

/// Where the built-in store keeps artifacts on this node (`store.persistence.hostPath`).
pub const STORE_HOST_DIR: &str = "/var/lib/flamefleet/artifacts";

/// The store runs as UID 65532 and a hostPath volume gets no fsGroup: hand it the directory.
fn prepare_store_dir() -> Result<()> {
    std::fs::create_dir_all(STORE_HOST_DIR)
        .map_err(io_err(format!("creating {STORE_HOST_DIR}")))?;
    nix::unistd::chown(
        STORE_HOST_DIR,
        Some(nix::unistd::Uid::from_raw(65532)),
        Some(nix::unistd::Gid::from_raw(65532)),
    )
    .map_err(|e| Error::Io {
        action: format!("chown 65532 {STORE_HOST_DIR}"),
        source: e.into(),
    })
}

/// The pinned helm binary (`scripts/tools.sh paths`).
pub fn helm_binary() -> PathBuf {
    tool_binary("HELM")
}

/// The pinned kubeconform binary.
pub fn kubeconform_binary() -> PathBuf {
    tool_binary("KUBECONFORM")
}

fn tool_binary(name: &str) -> PathBuf {
    Command::new(repo_root().join("scripts/tools.sh"))
        .arg("paths")
        .output()
        .ok()
        .and_then(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name}=")).map(PathBuf::from))
        })
        .unwrap_or_else(|| PathBuf::from(name.to_ascii_lowercase()))
}

/// `kubectl-profile`, built (once per process) in the cargo target directory of the running
/// test, so the CLI under test is the one of this checkout.
///
/// # Errors
/// When cargo fails.
pub fn kubectl_profile_binary() -> Result<PathBuf> {
    static BIN: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        // <target>/<profile>/deps/<test-exe>
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .ok_or("the test executable is not under <target>/<profile>/deps")?;
        let target_dir = profile_dir
            .parent()
            .ok_or("the test executable is not under <target>/<profile>")?;
        let mut build = crate::binaries::nested_cargo();
        build
            .args(["build", "-p", "kubectl-profile", "--bin", "kubectl-profile"])
            .env("CARGO_TARGET_DIR", target_dir)
            .current_dir(repo_root());
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            build.arg("--release");
        }
        let out = build.output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "building kubectl-profile failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(profile_dir.join("kubectl-profile"))
    })
    .clone()
    .map_err(Error::SharedUnavailable)
}
