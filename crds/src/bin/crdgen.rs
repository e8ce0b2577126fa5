//! Writes the Flamefleet CRDs as YAML into `crds/` and the Helm chart's `crds/`, and the
//! admission policies into the chart's templates: `crdgen [--check]`.
//!
//! With `--check` nothing is written; the exit status is 1 when a file is missing or stale.

use anyhow::{Context, bail};
use flamefleet_api::crd_yaml;

fn main() -> anyhow::Result<()> {
    let mut check = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--check" => check = true,
            "-h" | "--help" => {
                println!("usage: crdgen [--check]");
                return Ok(());
            }
            other => bail!("unknown argument {other:?}; expected --check"),
        }
    }
    let mut stale = Vec::new();
    for (path, text) in crd_yaml::generated_files()? {
        if check {
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            if committed != text {
                stale.push(path.display().to_string());
            }
        } else {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {}", path.display());
        }
    }
    if !stale.is_empty() {
        bail!(
            "stale generated YAML: {}; run `cargo run -p flamefleet-api --bin crdgen` and commit the result",
            stale.join(", ")
        );
    }
    Ok(())
}
