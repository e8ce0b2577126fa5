//! pprof-rs reports as gzipped pprof (the workspace's own `perftools.profiles` types) and as
//! flame graph SVGs.

use std::collections::HashMap;
use std::io::Write as _;
use std::time::UNIX_EPOCH;

use flamefleet_proto::pprof as pb;
use prost::Message as _;

use crate::{Error, Result};

/// A string table with `""` at index 0.
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        let mut s = Self::default();
        s.get("");
        s
    }

    fn get(&mut self, v: &str) -> i64 {
        if let Some(&i) = self.index.get(v) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(v.to_owned());
        self.index.insert(v.to_owned(), i);
        i
    }
}

/// The report as a pprof `Profile`: sample types `samples/count` and `cpu/nanoseconds`,
/// one location per (function, file, line), a `thread` label per sample.
pub fn pprof(report: &pprof::Report) -> pb::Profile {
    let mut strings = Strings::new();
    let period = 1_000_000_000 / i64::from(report.timing.frequency.max(1));
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
    let mut functions: Vec<pb::Function> = Vec::new();
    let mut function_ids: HashMap<(String, String), u64> = HashMap::new();
    let mut locations: Vec<pb::Location> = Vec::new();
    let mut location_ids: HashMap<(u64, u32), u64> = HashMap::new();
    let mut samples = Vec::new();
    for (frames, &count) in &report.data {
        let mut location_id = Vec::new();
        // pprof-rs lists frames leaf first, as pprof wants them.
        for frame in &frames.frames {
            for symbol in frame {
                let name = symbol.name();
                let file = symbol.filename().into_owned();
                let function = *function_ids
                    .entry((name.clone(), file.clone()))
                    .or_insert_with(|| {
                        let id = functions.len() as u64 + 1;
                        functions.push(pb::Function {
                            id,
                            name: strings.get(&name),
                            system_name: strings.get(&symbol.sys_name()),
                            filename: strings.get(&file),
                            start_line: 0,
                        });
                        id
                    });
                let line = symbol.lineno();
                let id = *location_ids.entry((function, line)).or_insert_with(|| {
                    let id = locations.len() as u64 + 1;
                    locations.push(pb::Location {
                        id,
                        line: vec![pb::Line {
                            function_id: function,
                            line: i64::from(line),
                            ..Default::default()
                        }],
                        ..Default::default()
                    });
                    id
                });
                location_id.push(id);
            }
        }
        let count = count.max(0) as i64;
        samples.push(pb::Sample {
            location_id,
            value: vec![count, count * period],
            label: vec![pb::Label {
                key: thread_key,
                str: strings.get(&frames.thread_name_or_id()),
                ..Default::default()
            }],
        });
    }
    pb::Profile {
        sample_type,
        sample: samples,
        location: locations,
        function: functions,
        string_table: strings.table,
        time_nanos: report
            .timing
            .start_time
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
        duration_nanos: i64::try_from(report.timing.duration.as_nanos()).unwrap_or(i64::MAX),
        period_type,
        period,
        ..Default::default()
    }
}

/// [`pprof`], encoded and gzipped.
///
/// # Errors
/// [`Error::Render`] when compression fails.
pub fn pprof_gzip(report: &pprof::Report) -> Result<Vec<u8>> {
    let raw = pprof(report).encode_to_vec();
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

/// The report as a flame graph SVG (one root per thread, as pprof-rs draws it).
///
/// # Errors
/// [`Error::Render`] when there is nothing to draw or inferno fails.
pub fn svg(report: &pprof::Report) -> Result<Vec<u8>> {
    let lines: Vec<String> = report
        .data
        .iter()
        .filter(|&(_, &count)| count > 0)
        .map(|(frames, count)| {
            let mut stack = vec![folded_name(&frames.thread_name_or_id())];
            for frame in frames.frames.iter().rev() {
                for symbol in frame.iter().rev() {
                    stack.push(folded_name(&symbol.name()));
                }
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
