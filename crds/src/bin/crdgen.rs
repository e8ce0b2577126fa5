//! Writes the Flamefleet CRDs as YAML: `crdgen [--check] [DIR]` (DIR defaults to `crds/`).
//!
//! With `--check` nothing is written; the exit status is 1 when a file is missing or stale.

use std::path::PathBuf;

use anyhow::{Context, bail};
use flamefleet_api::crd_yaml;

fn main() -> anyhow::Result<()> {
    let mut check = false;
    let mut dir = crd_yaml::committed_dir();
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--check" => check = true,
            "-h" | "--help" => {
                println!(
                    "usage: crdgen [--check] [DIR]   (DIR defaults to {})",
                    dir.display()
                );
                return Ok(());
            }
            other if other.starts_with('-') => {
                bail!("unknown option {other:?}; expected --check or a directory")
            }
            other => dir = PathBuf::from(other),
        }
    }
    let mut stale = Vec::new();
    for crd in crd_yaml::crds() {
        let path = dir.join(crd_yaml::file_name(&crd));
        let text = crd_yaml::render(&crd)?;
        if check {
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            if committed != text {
                stale.push(path.display().to_string());
            }
        } else {
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {}", path.display());
        }
    }
    if !stale.is_empty() {
        bail!(
            "stale CRD YAML: {}; run `cargo run -p flamefleet-api --bin crdgen` and commit the result",
            stale.join(", ")
        );
    }
    Ok(())
}
