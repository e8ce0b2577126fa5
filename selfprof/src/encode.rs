//! CPU samples as gzipped pprof (the workspace's own `perftools.profiles` types) and as
//! flame graph SVGs.

use std::time::UNIX_EPOCH;

use flamefleet_pprof::{Label, ProfileBuilder};
use flamefleet_proto::pprof as pb;

use crate::sampler::Samples;
use crate::symbols::Locations;
use crate::{Error, Result};

/// The report as a pprof `Profile`: sample types `samples/count` and `cpu/nanoseconds`
/// (the process's measured CPU time, shared among the samples),
/// one location per code address, named from the symbol tables ([`crate::symbols`]), a
/// `thread` label per sample.
pub fn pprof(report: &Samples) -> pb::Profile {
    // CPU per sample: the process's measured CPU time shared among the samples (the timer
    // may deliver fewer signals than asked, see `sampler`); the nominal period when there
    // were none.
    let total: i64 = report.stacks.values().sum();
    let period = match i64::try_from(report.cpu_time.as_nanos()) {
        Ok(cpu) if total > 0 && cpu > 0 => cpu / total,
        _ => flamefleet_pprof::nanos_per_sample(u64::from(report.frequency)),
    };
    let mut b = ProfileBuilder::new(&[("samples", "count"), ("cpu", "nanoseconds")]);
    b.period("cpu", "nanoseconds", period).time(
        report
            .start
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
        i64::try_from(report.duration.as_nanos()).unwrap_or(i64::MAX),
    );
    let mut locations = Locations::new(&all_addresses(report));
    locations.add_mappings(&mut b);
    for ((tid, stack), &count) in &report.stacks {
        // Leaf first, as pprof wants them.
        let location_id = stack
            .iter()
            .map(|&addr| locations.id(addr, &mut b))
            .collect();
        let count = count.max(0);
        b.add_sample_at(
            location_id,
            &[count, count * period],
            &[Label::Str("thread".into(), report.thread(*tid))],
        );
    }
    b.build()
}

/// Every code address of the report's stacks.
fn all_addresses(report: &Samples) -> Vec<u64> {
    report
        .stacks
        .keys()
        .flat_map(|(_, stack)| stack.iter().copied())
        .collect()
}

/// [`pprof`], encoded and gzipped.
///
/// # Errors
/// [`Error::Render`] when compression fails.
pub fn pprof_gzip(report: &Samples) -> Result<Vec<u8>> {
    gzip(&pprof(report))
}

/// A profile, encoded and gzipped.
///
/// # Errors
/// [`Error::Render`] when compression fails.
pub fn gzip(profile: &pb::Profile) -> Result<Vec<u8>> {
    flamefleet_pprof::encode_gzip(profile).map_err(|e| Error::Render(e.to_string()))
}

/// Keeps the separators of the folded format (`;` between frames, the last space before
/// the count) out of a frame name.
fn folded_name(name: &str) -> String {
    name.replace(';', ":").replace(' ', "_")
}

/// The report as a flame graph SVG (one root per thread).
///
/// # Errors
/// [`Error::Render`] when there is nothing to draw or inferno fails.
pub fn svg(report: &Samples) -> Result<Vec<u8>> {
    let locations = Locations::new(&all_addresses(report));
    let lines: Vec<String> = report
        .stacks
        .iter()
        .filter(|&(_, &count)| count > 0)
        .map(|((tid, addrs), count)| {
            let mut stack = vec![folded_name(&report.thread(*tid))];
            for &addr in addrs.iter().rev() {
                stack.push(folded_name(&locations.name(addr)));
            }
            format!("{} {count}", stack.join(";"))
        })
        .collect();
    if lines.is_empty() {
        return Err(Error::Render(
            "no samples: the process used no CPU during the profile; profile longer or while it works"
                .into(),
        ));
    }
    let mut options = inferno::flamegraph::Options::default();
    options.title = "flamefleet self-profile".into();
    let mut out = Vec::new();
    inferno::flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut out)
        .map_err(|e| Error::Render(e.to_string()))?;
    Ok(out)
}
