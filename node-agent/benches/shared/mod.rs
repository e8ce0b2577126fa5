//! Helpers the agent's benchmarks share (not a benchmark itself: cargo only builds
//! `benches/*.rs` and `benches/*/main.rs`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, bail};

/// Compiles C `source` into `dir/name` with frame pointers and debug info (what the
/// benchmarks' workloads need to be unwound and symbolized).
pub fn compile_c(dir: &Path, name: &str, source: &str) -> Result<PathBuf> {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source)?;
    let bin = dir.join(name);
    let out = Command::new("cc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .context("running cc")?;
    if !out.status.success() {
        bail!("cc: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(bin)
}

/// Share (percent) of a profile's first sample value in samples whose stack has a function
/// whose name contains `needle`.
pub fn named_share(profile: &flamefleet_proto::pprof::Profile, needle: &str) -> f64 {
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let funcs: std::collections::HashSet<u64> = profile
        .function
        .iter()
        .filter(|f| s(f.name).contains(needle))
        .map(|f| f.id)
        .collect();
    let locs: std::collections::HashSet<u64> = profile
        .location
        .iter()
        .filter(|l| l.line.iter().any(|line| funcs.contains(&line.function_id)))
        .map(|l| l.id)
        .collect();
    let (mut named, mut total) = (0i64, 0i64);
    for sample in &profile.sample {
        let v = sample.value.first().copied().unwrap_or(0);
        total += v;
        if sample.location_id.iter().any(|l| locs.contains(l)) {
            named += v;
        }
    }
    if total == 0 {
        0.0
    } else {
        100.0 * named as f64 / total as f64
    }
}
