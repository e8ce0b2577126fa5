//! CPU samples as gzipped pprof (the workspace's own `perftools.profiles` types) and as
//! flame graph SVGs.

use std::io::Write as _;
use std::time::UNIX_EPOCH;

use flamefleet_proto::pprof as pb;
use prost::Message as _;

use crate::sampler::Samples;
use crate::symbols::{Locations, Strings};
use crate::{Error, Result};

/// The report as a pprof `Profile`: sample types `samples/count` and `cpu/nanoseconds`
/// (the process's measured CPU time, shared among the samples),
/// one location per code address, named from the symbol tables ([`crate::symbols`]), a
/// `thread` label per sample.
pub fn pprof(report: &Samples) -> pb::Profile {
    let mut strings = Strings::new();
    // CPU per sample: the process's measured CPU time shared among the samples (the timer
    // may deliver fewer signals than asked, see `sampler`); the nominal period when there
    // were none.
    let total: i64 = report.stacks.values().sum();
    let period = match i64::try_from(report.cpu_time.as_nanos()) {
        Ok(cpu) if total > 0 && cpu > 0 => cpu / total,
        _ => 1_000_000_000 / i64::from(report.frequency.max(1)),
    };
    let sample_type = vec![
        pb::ValueType {
            r#type: strings.get("samples"),
            unit: strings.get("count"),
        },
        pb::ValueType {
            r#type: strings.get("cpu"),
            unit: strings.get("nanoseconds"),
        },
    ];
    let period_type = Some(pb::ValueType {
        r#type: strings.get("cpu"),
        unit: strings.get("nanoseconds"),
    });
    let thread_key = strings.get("thread");
    let mut locations = Locations::new(&all_addresses(report), &mut strings);
    let mut samples = Vec::new();
    for ((tid, stack), &count) in &report.stacks {
        // Leaf first, as pprof wants them.
        let location_id = stack
            .iter()
            .map(|&addr| locations.id(addr, &mut strings))
            .collect();
        let count = count.max(0);
        samples.push(pb::Sample {
            location_id,
            value: vec![count, count * period],
            label: vec![pb::Label {
                key: thread_key,
                str: strings.get(&report.thread(*tid)),
                ..Default::default()
            }],
        });
    }
    pb::Profile {
        sample_type,
        sample: samples,
        mapping: locations.mappings,
        location: locations.locations,
        function: locations.functions,
        string_table: strings.into_table(),
        time_nanos: report
            .start
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
        duration_nanos: i64::try_from(report.duration.as_nanos()).unwrap_or(i64::MAX),
        period_type,
        period,
        ..Default::default()
    }
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
    let raw = profile.encode_to_vec();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&raw)
        .and_then(|()| gz.finish())
        .map_err(|e| Error::Render(e.to_string()))
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
    let mut strings = Strings::new();
    let locations = Locations::new(&all_addresses(report), &mut strings);
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
