//! Test support: a real local control plane (etcd + kube-apiserver, no kubelet).
//!
//! - [`ControlPlane::shared`] starts one control plane per test binary (or reuses the one named
//!   by `FLAMEFLEET_KUBECONFIG`); its processes die with the test process.
//! - [`TestNamespace::create`] gives a test its own namespace and client, with the Flamefleet
//!   CRDs installed and Established.
//! - [`TestNamespace::running_pod`] creates a Pod and sets its status to Running, as a kubelet
//!   would, since there is none.
//!
//! The binaries are built by `scripts/controlplane.sh build` (run by `scripts/setup.sh`) at the
//! versions pinned in `e2e/controlplane/go.mod`. When they are missing, or the control plane
//! cannot start, every call here fails with a message saying what to run: tests never skip.

pub mod agent_pki;
pub mod binaries;
pub mod cluster;
pub mod control_plane;
pub mod crds;
pub mod guest;
pub mod hollow;
pub mod kubectl;
pub mod lead_up;
pub mod pki;
pub mod pod_usage;
pub mod pods;
pub mod test_namespace;
pub mod workload;

pub use cluster::Cluster;
pub use control_plane::{Component, ControlPlane, Lifetime};
pub use test_namespace::TestNamespace;

use std::path::PathBuf;

/// Errors of the control-plane harness.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A pinned binary is not where the build puts it.
    #[error(
        "{what} not found at {path}: build the local control plane first with `scripts/setup.sh` (as root) (or `scripts/controlplane.sh build`), or point {env} at a binary"
    )]
    MissingBinary {
        /// Which binary.
        what: &'static str,
        /// Where it was expected.
        path: PathBuf,
        /// The environment variable that overrides the path.
        env: &'static str,
    },
    /// A file or process operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being done.
        action: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Certificate generation failed.
    #[error("generating {what}: {source}")]
    Certificate {
        /// Which certificate or key.
        what: String,
        /// rcgen's error.
        source: rcgen::Error,
    },
    /// A control-plane process exited or never became ready.
    #[error(
        "the local control plane did not start: {reason}\n--- last lines of {log} ---\n{log_tail}"
    )]
    StartFailed {
        /// What went wrong.
        reason: String,
        /// The log file with details.
        log: PathBuf,
        /// Its last lines.
        log_tail: String,
    },
    /// The shared control plane failed to start earlier in this process.
    #[error("the shared local control plane is unavailable: {0}")]
    SharedUnavailable(String),
    /// The kubeconfig could not be used.
    #[error("cannot use kubeconfig {path}: {reason}")]
    Kubeconfig {
        /// The kubeconfig file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A request to the API server failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done.
        action: String,
        /// kube's error.
        source: kube::Error,
    },
    /// Waiting for a condition timed out.
    #[error("timed out after {seconds}s waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long.
        seconds: u64,
    },
    /// kubectl failed.
    #[error("`kubectl {args}` failed ({status}): {stderr}")]
    Kubectl {
        /// The arguments.
        args: String,
        /// Its exit status.
        status: String,
        /// Its standard error.
        stderr: String,
    },
    /// A fixture could not be converted to or from JSON.
    #[error("building {what}: {source}")]
    Json {
        /// What was being built.
        what: &'static str,
        /// serde_json's error.
        source: serde_json::Error,
    },
    /// The API crate's admission policies are unusable.
    #[error("{0}")]
    Api(#[from] flamefleet_api::Error),
    /// This operation needs a control plane this process started.
    #[error(
        "{0} is only available on a control plane started by this process, not one given by FLAMEFLEET_KUBECONFIG"
    )]
    NotOwned(&'static str),
}

/// The result type of the harness.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Wraps an io::Error with what was being done.
pub(crate) fn io_err(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let action = action.into();
    move |source| Error::Io { action, source }
}

/// Wraps a kube::Error with what was being done.
pub(crate) fn kube_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let action = action.into();
    move |source| Error::Kube { action, source }
}
