//! `kubectl profile get NAME [--node N]... [--limit N]`: download, verify and render the
//! artifacts of a request (every node's, or a subset's), listed in its result slices.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use flamefleet_api::results::RequestResults;
use flamefleet_api::{NodePhase, ProfileRequest, RequestPhase};

use crate::cluster::Cluster;
use crate::download::{Downloaded, FromRequest, fetch_all};
use crate::error::{Error, Result};
use crate::output::{self, OutputFile, artifact_file_name};
use crate::{flamegraph, latency, latency_svg, profile_file, requests, stacks, top_functions};

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

/// Most node lines [`node_details`] prints.
const DETAIL_LINES: usize = 20;

/// Which nodes' artifacts to download (`--node`, `--limit`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeSelection {
    /// Only these nodes; every node when empty.
    pub nodes: Vec<String>,
    /// At most this many nodes (the first in name order among those with artifacts).
    pub limit: Option<usize>,
}

impl NodeSelection {
    /// True when every node's artifacts are wanted.
    pub fn is_all(&self) -> bool {
        self.nodes.is_empty() && self.limit.is_none()
    }

    /// The nodes of `results` this selection picks, or `None` for all of them.
    ///
    /// # Errors
    /// [`Error::Usage`] naming a node the request does not have.
    pub fn resolve(
        &self,
        request: &ProfileRequest,
        results: &RequestResults,
    ) -> Result<Option<BTreeSet<String>>> {
        let name = request.metadata.name.as_deref().unwrap_or("");
        let namespace = request.metadata.namespace.as_deref().unwrap_or("");
        let uid = request.metadata.uid.as_deref().unwrap_or("");
        if self.is_all() {
            return Ok(None);
        }
        let unknown: Vec<&str> = self
            .nodes
            .iter()
            .filter(|n| !results.nodes.contains_key(n.as_str()))
            .map(String::as_str)
            .collect();
        if !unknown.is_empty() {
            return Err(Error::Usage(format!(
                "profilerequest {name:?} has no node {}; it ran on {} nodes (list them with `kubectl get prslice -l {} -n {} -o yaml`)",
                unknown.join(", "),
                results.nodes.len(),
                flamefleet_api::result_slice::selector_for(uid),
                namespace,
            )));
        }
        let picked = results
            .nodes
            .values()
            .filter(|n| self.nodes.is_empty() || self.nodes.contains(&n.node))
            .filter(|n| !n.artifacts.is_empty())
            .take(self.limit.unwrap_or(usize::MAX))
            .map(|n| n.node.clone())
            .collect();
        Ok(Some(picked))
    }
}

/// The node lines of a failed or partly failed request: `node: phase: message` for each node
/// that did not succeed (at most 20, then how many more), or the request's own message when
/// it failed before reaching any node.
pub fn node_details(request: &ProfileRequest, results: &RequestResults) -> String {
    let unsucceeded: Vec<_> = results
        .nodes
        .values()
        .filter(|n| n.phase != Some(NodePhase::Succeeded))
        .collect();
    if unsucceeded.is_empty() {
        let completed = request
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Completed"))
            .map(|c| c.message.clone());
        return format!("  {}", completed.unwrap_or_else(|| "(no status)".into()));
    }
    let mut lines: Vec<String> = unsucceeded
        .iter()
        .take(DETAIL_LINES)
        .map(|n| {
            format!(
                "  {}: {}: {}",
                n.node,
                n.phase.map_or("Pending", |p| p.as_str()),
                n.message.as_deref().unwrap_or("")
            )
        })
        .collect();
    if unsucceeded.len() > DETAIL_LINES {
        lines.push(format!(
            "  ... and {} more nodes (`kubectl get prslice -l {} -n {} -o yaml`)",
            unsucceeded.len() - DETAIL_LINES,
            flamefleet_api::result_slice::selector_for(
                request.metadata.uid.as_deref().unwrap_or("")
            ),
            request.metadata.namespace.as_deref().unwrap_or("")
        ));
    }
    lines.join("\n")
}

/// Downloads the selected artifacts (all verified before any is written), writes them into
/// `dir` as `<request>-<node>.*`, renders per `format`, and prints what was written to
/// `out`.
pub async fn run(
    cluster: &Cluster,
    name: &str,
    dir: &Path,
    format: Format,
    selection: &NodeSelection,
    force: bool,
    out: &mut dyn Write,
) -> Result<Vec<PathBuf>> {
    let request = requests::get(cluster, name).await?;
    download_request(cluster, &request, dir, format, selection, force, out).await
}

/// The part of `get` after the request was read (shared with the capture commands).
pub async fn download_request(
    cluster: &Cluster,
    request: &ProfileRequest,
    dir: &Path,
    format: Format,
    selection: &NodeSelection,
    force: bool,
    out: &mut dyn Write,
) -> Result<Vec<PathBuf>> {
    let name = request.metadata.name.clone().unwrap_or_default();
    let phase = request.status.as_ref().and_then(|s| s.phase);
    let results = requests::results(cluster, request).await?;
    let artifacts = results.artifacts().count();
    if phase == Some(RequestPhase::Failed) && artifacts == 0 {
        return Err(Error::RequestFailed {
            name,
            details: node_details(request, &results),
        });
    }
    if artifacts == 0 {
        return Err(Error::NoArtifacts {
            name,
            namespace: cluster.namespace.clone(),
            phase: phase.map_or("Pending", |p| p.as_str()).to_string(),
        });
    }
    let nodes = selection.resolve(request, &results)?;
    let from = FromRequest {
        name: &name,
        results: &results,
        nodes: nodes.as_ref(),
    };
    let downloaded: Vec<Downloaded> = fetch_all(cluster, &[from], |_| true)
        .await?
        .into_iter()
        .map(|(_, d)| d)
        .collect();
    if downloaded.is_empty() {
        return Err(Error::Usage(format!(
            "no artifacts of the selected nodes of profilerequest {name:?}; the nodes that failed have none"
        )));
    }
    let profile_type = request.spec.profile_type.as_str();
    let mut files = Vec::new();
    let mut text = String::new();
    for d in &downloaded {
        let local = artifact_file_name(&name, profile_type, &d.name);
        files.extend(render(&local, &d.bytes, format, &mut text)?);
    }
    let written = output::write_all(dir, &files, force, out)?;
    let _ = write!(out, "{text}");
    if phase == Some(RequestPhase::PartiallySucceeded) {
        let _ = writeln!(
            out,
            "warning: some nodes failed:\n{}",
            node_details(request, &results)
        );
    }
    Ok(written)
}

/// The files of one artifact, named `name` locally: the artifact as stored, and what
/// `format` renders from it; what to print (a runqlat histogram, the top functions) is
/// appended to `text` (shared with the fleet views).
///
/// A run-queue latency profile renders as latency: a histogram SVG with its percentiles
/// marked, and percentiles and histogram as text.
pub fn render(
    name: &str,
    bytes: &[u8],
    format: Format,
    text: &mut String,
) -> Result<Vec<OutputFile>> {
    use std::fmt::Write as _;
    let mut files = vec![OutputFile {
        name: name.to_owned(),
        bytes: bytes.to_vec(),
    }];
    if name.ends_with(".txt") {
        let _ = writeln!(text, "{name}:\n{}", String::from_utf8_lossy(bytes));
        return Ok(files);
    }
    if format == Format::Pprof {
        return Ok(files);
    }
    let profile = profile_file::decode(bytes, name)?;
    let index = stacks::value_index(&profile);
    let stem = output::stem(name);
    let latency = latency::histogram(&profile);
    match (format, latency) {
        (Format::Pprof, _) => {}
        (Format::Text, Some(h)) => {
            let _ = writeln!(text, "{name}:\n{}", latency::text(&h));
        }
        (Format::Text, None) => {
            let _ = writeln!(
                text,
                "{name}:\n{}",
                top_functions::render(&profile, index, 20)
            );
        }
        (Format::Folded, _) => {
            let folded = stacks::folded_text(&stacks::folded(&profile, index));
            files.push(OutputFile {
                name: format!("{stem}.folded"),
                bytes: folded.into_bytes(),
            });
        }
        (Format::Svg, Some(h)) => {
            files.push(OutputFile {
                name: format!("{stem}.svg"),
                bytes: latency_svg::histogram(&h, &format!("{stem}: run-queue latency"))?,
            });
        }
        (Format::Svg, None) => {
            let (kind, unit) = stacks::value_type(&profile, index);
            let svg = flamegraph::render_svg(
                &stacks::folded(&profile, index),
                &format!("{name} ({kind})"),
                &unit,
            )?;
            files.push(OutputFile {
                name: format!("{stem}.svg"),
                bytes: svg,
            });
        }
    }
    Ok(files)
}
