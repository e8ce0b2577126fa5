//! `kubectl profile get NAME`: download, verify and render every artifact of a request.

use std::io::Write;
use std::path::{Path, PathBuf};

use flamefleet_api::{ProfileRequest, RequestPhase};

use crate::cluster::Cluster;
use crate::download::{Downloaded, fetch_all, write_atomic};
use crate::error::{Error, Result};
use crate::{flamegraph, profile_file, requests, stacks, top_functions};

/// How to hand the artifacts to the user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// The gzipped pprof files as stored.
    Pprof,
    /// A flame graph SVG per profile (and the pprof).
    Svg,
    /// Top functions printed like `pprof -top` (and the pprof).
    Text,
    /// Collapsed stacks per profile (and the pprof).
    Folded,
}

/// The node lines of a failed request: `node: phase: message`.
pub fn node_details(request: &ProfileRequest) -> String {
    let Some(status) = &request.status else {
        return "  (no status)".into();
    };
    status
        .nodes
        .iter()
        .map(|n| {
            format!(
                "  {}: {}: {}",
                n.node,
                n.phase.map_or("Pending", |p| p.as_str()),
                n.message.as_deref().unwrap_or("")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Downloads every listed artifact (all verified before any is written), writes them into
/// `dir`, renders per `format`, and prints what was written to `out`.
pub async fn run(
    cluster: &Cluster,
    name: &str,
    dir: &Path,
    format: Format,
    out: &mut dyn Write,
) -> Result<Vec<PathBuf>> {
    let request = requests::get(cluster, name).await?;
    download_request(cluster, &request, dir, format, out).await
}

/// The part of `get` after the request was read (shared with the capture commands).
pub async fn download_request(
    cluster: &Cluster,
    request: &ProfileRequest,
    dir: &Path,
    format: Format,
    out: &mut dyn Write,
) -> Result<Vec<PathBuf>> {
    let name = request.metadata.name.clone().unwrap_or_default();
    let phase = request.status.as_ref().and_then(|s| s.phase);
    let artifacts: Vec<_> = request
        .status
        .iter()
        .flat_map(|s| s.nodes.iter())
        .flat_map(|n| n.artifacts.iter())
        .collect();
    if phase == Some(RequestPhase::Failed) && artifacts.is_empty() {
        return Err(Error::RequestFailed {
            name,
            details: node_details(request),
        });
    }
    if artifacts.is_empty() {
        return Err(Error::NoArtifacts {
            name,
            phase: phase.map_or("Pending", |p| p.as_str()).to_string(),
        });
    }
    let downloaded: Vec<Downloaded> = fetch_all(cluster, &[request], |_| true)
        .await?
        .into_iter()
        .map(|(_, d)| d)
        .collect();
    let mut written = Vec::new();
    for d in &downloaded {
        written.extend(render(d, dir, format, out)?);
    }
    if phase == Some(RequestPhase::PartiallySucceeded) {
        let _ = writeln!(
            out,
            "warning: some nodes failed:\n{}",
            node_details(request)
        );
    }
    Ok(written)
}

/// Writes one artifact into `dir` and renders it per `format` (shared with the fleet views).
pub fn render(
    d: &Downloaded,
    dir: &Path,
    format: Format,
    out: &mut dyn Write,
) -> Result<Vec<PathBuf>> {
    let mut written = vec![write_atomic(dir, &d.name, &d.bytes)?];
    let _ = writeln!(out, "wrote {}", written[0].display());
    if d.name.ends_with(".txt") {
        let _ = writeln!(out, "{}:\n{}", d.name, String::from_utf8_lossy(&d.bytes));
        return Ok(written);
    }
    if format == Format::Pprof {
        return Ok(written);
    }
    let profile = profile_file::decode(&d.bytes, &d.name)?;
    let index = stacks::value_index(&profile);
    let stem = d.name.trim_end_matches(".gz").trim_end_matches(".pb");
    match format {
        Format::Pprof => {}
        Format::Text => {
            let _ = writeln!(
                out,
                "{}:\n{}",
                d.name,
                top_functions::render(&profile, index, 20)
            );
        }
        Format::Folded => {
            let text = stacks::folded_text(&stacks::folded(&profile, index));
            let path = write_atomic(dir, &format!("{stem}.folded"), text.as_bytes())?;
            let _ = writeln!(out, "wrote {}", path.display());
            written.push(path);
        }
        Format::Svg => {
            let (kind, unit) = stacks::value_type(&profile, index);
            let svg = flamegraph::render_svg(
                &stacks::folded(&profile, index),
                &format!("{} ({kind})", d.name),
                &unit,
            )?;
            let path = write_atomic(dir, &format!("{stem}.svg"), &svg)?;
            let _ = writeln!(out, "wrote {}", path.display());
            written.push(path);
        }
    }
    Ok(written)
}
