//! Where the pinned kube-apiserver, etcd and kubectl binaries live.
//!
//! Versions come from `e2e/controlplane/go.mod`, the one place they are pinned;
//! `scripts/controlplane.sh build` writes `<cache>/bin/<name>-<version>`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Error, Result};

const GO_MOD: &str = include_str!("../controlplane/go.mod");

/// Default cache directory for binaries and build output, outside any clone.
pub const DEFAULT_CACHE: &str = "/var/cache/flamefleet";

/// The version `e2e/controlplane/go.mod` requires for `module`.
pub fn pinned_version(module: &str) -> Option<&'static str> {
    GO_MOD.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some(module))
            .then(|| words.next())
            .flatten()
            .filter(|v| v.starts_with('v'))
    })
}

/// The pinned Kubernetes version, e.g. `v1.34.4`.
pub fn kubernetes_version() -> &'static str {
    pinned_version("k8s.io/kubernetes").unwrap_or("unknown")
}

/// The pinned etcd version, e.g. `v3.6.4`.
pub fn etcd_version() -> &'static str {
    pinned_version("go.etcd.io/etcd/server/v3").unwrap_or("unknown")
}

/// `$FLAMEFLEET_CACHE`, or [`DEFAULT_CACHE`].
pub fn cache_dir() -> PathBuf {
    std::env::var_os("FLAMEFLEET_CACHE").map_or_else(|| PathBuf::from(DEFAULT_CACHE), PathBuf::from)
}

fn locate(what: &'static str, env: &'static str, file: String) -> Result<PathBuf> {
    let path =
        std::env::var_os(env).map_or_else(|| cache_dir().join("bin").join(file), PathBuf::from);
    if is_executable(&path) {
        Ok(path)
    } else {
        Err(Error::MissingBinary { what, path, env })
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The kube-apiserver binary (`$FLAMEFLEET_KUBE_APISERVER` overrides).
pub fn kube_apiserver() -> Result<PathBuf> {
    locate(
        "kube-apiserver",
        "FLAMEFLEET_KUBE_APISERVER",
        format!("kube-apiserver-{}", kubernetes_version()),
    )
}

/// The etcd binary (`$FLAMEFLEET_ETCD` overrides).
pub fn etcd() -> Result<PathBuf> {
    locate(
        "etcd",
        "FLAMEFLEET_ETCD",
        format!("etcd-{}", etcd_version()),
    )
}

/// The kubectl binary (`$FLAMEFLEET_KUBECTL` overrides).
pub fn kubectl() -> Result<PathBuf> {
    locate(
        "kubectl",
        "FLAMEFLEET_KUBECTL",
        format!("kubectl-{}", kubernetes_version()),
    )
}

/// Removes from `cmd`'s environment what `cargo test` sets for a test of one package
/// (`CARGO_PKG_*`, `CARGO_MANIFEST_DIR`, `CARGO_BIN_EXE_*`, `OUT_DIR` …), for a cargo a test
/// runs (directly or through a script such as `scripts/images.sh`): some build scripts
/// track those variables (ring's tracks `CARGO_PKG_NAME` and `CARGO_MANIFEST_DIR`), so a
/// nested build with the test's values would run them again and rebuild everything that
/// depends on them (rustls, kube and up: minutes), and the next build from a shell would
/// do it once more.
pub fn without_cargo_test_env(cmd: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let set_by_cargo_test = name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_EXE_")
            || matches!(
                name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "OUT_DIR"
            );
        if set_by_cargo_test {
            cmd.env_remove(name);
        }
    }
    cmd
}

/// A `cargo` command for a build a test runs: the cargo running the tests (`$CARGO`), with
/// [`without_cargo_test_env`].
pub fn nested_cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    without_cargo_test_env(&mut cmd);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_come_from_go_mod() {
        assert!(
            kubernetes_version().starts_with("v1."),
            "{}",
            kubernetes_version()
        );
        assert!(etcd_version().starts_with("v3."), "{}", etcd_version());
        assert_eq!(pinned_version("no.such/module"), None);
    }
}
