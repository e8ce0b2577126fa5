//! Running the pinned kubectl against a control plane.

use std::path::Path;
use std::process::Command;

use crate::{Error, Result, binaries, io_err};

/// Runs `kubectl --kubeconfig <kubeconfig> <args>` and returns its standard output.
///
/// # Errors
/// [`Error::MissingBinary`] without a kubectl; [`Error::Kubectl`] when it exits non-zero.
pub fn kubectl(kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let bin = binaries::kubectl()?;
    let output = Command::new(&bin)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .map_err(io_err(format!("running {}", bin.display())))?;
    if !output.status.success() {
        return Err(Error::Kubectl {
            args: args.join(" "),
            status: output.status.to_string(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
