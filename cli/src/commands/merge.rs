//! `kubectl profile merge FILE|NAME... -o merged.pb.gz`.

use std::io::Write;
use std::path::Path;

use crate::cluster::Cluster;
use crate::download::{FromRequest, fetch_all};
use crate::error::{Error, Result};
use crate::output::{self, OutputFile};
use crate::{merge, profile_file, requests, stacks};

/// Merges local files and the pprof artifacts of named requests into `output`.
/// A cluster is only needed (and connected lazily by the caller) when a name is given.
pub async fn run(
    inputs: &[String],
    cluster: Option<&Cluster>,
    output: &Path,
    force: bool,
    out: &mut dyn Write,
) -> Result<()> {
    let mut profiles = Vec::new();
    for input in inputs {
        let path = Path::new(input);
        if path.is_file() {
            let bytes = std::fs::read(path).map_err(Error::io(format!("reading {input}")))?;
            profiles.push(merge::Input::new(
                input.clone(),
                profile_file::decode(&bytes, input)?,
            ));
            continue;
        }
        let cluster = cluster
            .ok_or_else(|| Error::Usage(format!("{input} is neither a file nor a request name")))?;
        let request = requests::get(cluster, input).await?;
        let results = requests::results(cluster, &request).await?;
        let is_pprof =
            |a: &flamefleet_api::Artifact| a.name.ends_with(".pb.gz") || a.name.ends_with(".pb");
        let has_pprof = results.artifacts().any(|(_, a)| is_pprof(a));
        if !has_pprof {
            return Err(Error::NoArtifacts {
                name: input.clone(),
                namespace: cluster.namespace.clone(),
                phase: request
                    .status
                    .as_ref()
                    .and_then(|s| s.phase)
                    .map_or("Pending", |p| p.as_str())
                    .to_string(),
            });
        }
        let from = FromRequest {
            name: input,
            results: &results,
            nodes: None,
        };
        for (_, d) in fetch_all(cluster, &[from], is_pprof).await? {
            let source = format!("{input}/{}", d.name);
            let profile = profile_file::decode(&d.bytes, &source)?;
            profiles.push(merge::Input::new(source, profile));
        }
    }
    let count = profiles.len();
    let merged = merge::merge(profiles)?;
    let dir = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = output
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::Usage(format!("{} is not a file path", output.display())))?;
    let file = OutputFile {
        name: name.to_owned(),
        bytes: profile_file::encode_gzip(&merged)?,
    };
    let written = output::write_all(dir, &[file], force, &mut std::io::sink())?;
    let _ = writeln!(
        out,
        "merged {count} profiles ({}) into {}",
        stacks::total_text(&merged),
        written
            .first()
            .map_or_else(String::new, |p| p.display().to_string())
    );
    Ok(())
}
