//! A pprof `Profile` builder: string table (index 0 is `""`), deduplicated
//! mappings, functions and locations, labels, sample types.
//!
//! Producers (the agent's capture engines, selfprof) feed it symbolized frames; it knows
//! nothing about where they came from.

use std::collections::HashMap;

use crate::pb;

/// Nanoseconds of CPU one sample stands for at `frequency_hz` (0 Hz is taken as 1 Hz).
pub fn nanos_per_sample(frequency_hz: u64) -> i64 {
    i64::try_from(1_000_000_000 / frequency_hz.max(1)).unwrap_or(i64::MAX)
}

/// One frame of a symbolized stack, leaf first in a [`ProfileBuilder::add_sample`] call.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The instruction address as seen by the process (0 when unknown).
    pub address: u64,
    /// Index of the frame's mapping, from [`ProfileBuilder::add_mapping`]; `None` for none.
    pub mapping: Option<u64>,
    /// Functions at this address, innermost (inlined) first; empty when unsymbolized.
    pub lines: Vec<FrameLine>,
}

/// A function (and source line) a frame belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FrameLine {
    /// Human-readable function name.
    pub function: String,
    /// Source file, or empty.
    pub file: String,
    /// Source line, or 0.
    pub line: i64,
}

/// A mapped file of a process, as pprof `Mapping` describes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MappingInfo {
    /// First address of the mapping.
    pub start: u64,
    /// One past the last address.
    pub limit: u64,
    /// File offset of `start`.
    pub file_offset: u64,
    /// File name (path, or `[kernel.kallsyms]`, `[vdso]`).
    pub file: String,
    /// Hex GNU build ID, or empty.
    pub build_id: String,
    /// Whether frames in it were symbolized.
    pub has_functions: bool,
}

/// A sample label: a string or a number with an optional unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Label {
    /// `key=value`.
    Str(String, String),
    /// `key=num` with a unit such as `nanoseconds`, or empty.
    Num(String, i64, String),
}

/// Builds one pprof profile. Dedup tables keep the output small: a function,
/// location or mapping is written once however many samples reference it.
#[derive(Debug)]
pub struct ProfileBuilder {
    profile: pb::Profile,
    strings: HashMap<String, i64>,
    functions: HashMap<(i64, i64), u64>,
    locations: HashMap<Frame, u64>,
    mappings: HashMap<MappingInfo, u64>,
}

impl ProfileBuilder {
    /// Starts a profile with these `(type, unit)` sample types, e.g.
    /// `[("samples", "count"), ("cpu", "nanoseconds")]`.
    pub fn new(sample_types: &[(&str, &str)]) -> Self {
        let mut b = Self {
            profile: pb::Profile::default(),
            strings: HashMap::new(),
            functions: HashMap::new(),
            locations: HashMap::new(),
            mappings: HashMap::new(),
        };
        b.string("");
        b.profile.sample_type = sample_types
            .iter()
            .map(|(t, u)| pb::ValueType {
                r#type: b.string(t),
                unit: b.string(u),
            })
            .collect();
        b
    }

    /// Index of `s` in the string table, adding it once.
    pub fn string(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.strings.get(s) {
            return i;
        }
        let i = self.profile.string_table.len() as i64;
        self.profile.string_table.push(s.to_owned());
        self.strings.insert(s.to_owned(), i);
        i
    }

    /// Sets `period_type` and `period` (e.g. `("cpu", "nanoseconds")`, 1e9/Hz).
    pub fn period(&mut self, kind: &str, unit: &str, period: i64) -> &mut Self {
        self.profile.period_type = Some(pb::ValueType {
            r#type: self.string(kind),
            unit: self.string(unit),
        });
        self.profile.period = period;
        self
    }

    /// Sets the period of a CPU profile sampled at `frequency_hz`: `cpu/nanoseconds`, one
    /// sample standing for 1e9/Hz nanoseconds of CPU (0 Hz is taken as 1 Hz).
    pub fn cpu_period(&mut self, frequency_hz: u64) -> &mut Self {
        self.period("cpu", "nanoseconds", nanos_per_sample(frequency_hz))
    }

    /// Sets the start time (ns since the epoch) and the duration (ns).
    pub fn time(&mut self, time_nanos: i64, duration_nanos: i64) -> &mut Self {
        self.profile.time_nanos = time_nanos;
        self.profile.duration_nanos = duration_nanos;
        self
    }

    /// Sets the start time and the duration of a window that began at `started` (a start
    /// before the epoch counts as the epoch).
    pub fn window(
        &mut self,
        started: std::time::SystemTime,
        duration: std::time::Duration,
    ) -> &mut Self {
        let start = started
            .duration_since(std::time::SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        self.time(start, duration.as_nanos() as i64)
    }

    /// Adds a free-form comment (shown by `go tool pprof -comments`).
    pub fn comment(&mut self, text: &str) -> &mut Self {
        let i = self.string(text);
        self.profile.comment.push(i);
        self
    }

    /// Selects the sample type tools show by default.
    pub fn default_sample_type(&mut self, kind: &str) -> &mut Self {
        self.profile.default_sample_type = self.string(kind);
        self
    }

    /// Adds (or finds) a mapping and returns its ID for [`Frame::mapping`].
    pub fn add_mapping(&mut self, m: &MappingInfo) -> u64 {
        if let Some(&id) = self.mappings.get(m) {
            return id;
        }
        let id = self.profile.mapping.len() as u64 + 1;
        let filename = self.string(&m.file);
        let build_id = self.string(&m.build_id);
        self.profile.mapping.push(pb::Mapping {
            id,
            memory_start: m.start,
            memory_limit: m.limit,
            file_offset: m.file_offset,
            filename,
            build_id,
            has_functions: m.has_functions,
            has_filenames: m.has_functions,
            has_line_numbers: false,
            has_inline_frames: m.has_functions,
        });
        self.mappings.insert(m.clone(), id);
        id
    }

    fn function(&mut self, name: &str, file: &str) -> u64 {
        let key = (self.string(name), self.string(file));
        if let Some(&id) = self.functions.get(&key) {
            return id;
        }
        let id = self.profile.function.len() as u64 + 1;
        self.profile.function.push(pb::Function {
            id,
            name: key.0,
            system_name: key.0,
            filename: key.1,
            start_line: 0,
        });
        self.functions.insert(key, id);
        id
    }

    /// Adds (or finds) a location for a frame and returns its ID.
    pub fn location(&mut self, frame: &Frame) -> u64 {
        if let Some(&id) = self.locations.get(frame) {
            return id;
        }
        let id = self.profile.location.len() as u64 + 1;
        let line = frame
            .lines
            .iter()
            .map(|l| pb::Line {
                function_id: self.function(&l.function, &l.file),
                line: l.line,
                column: 0,
            })
            .collect();
        self.profile.location.push(pb::Location {
            id,
            mapping_id: frame.mapping.unwrap_or(0),
            address: frame.address,
            line,
            is_folded: false,
        });
        self.locations.insert(frame.clone(), id);
        id
    }

    /// Adds a sample: `stack` leaf first, one value per sample type.
    pub fn add_sample(&mut self, stack: &[Frame], values: &[i64], labels: &[Label]) {
        let location_id = stack.iter().map(|f| self.location(f)).collect();
        self.add_sample_at(location_id, values, labels);
    }

    /// Adds a sample over locations already added with [`ProfileBuilder::location`], leaf
    /// first (for producers that cache a location per address).
    pub fn add_sample_at(&mut self, location_id: Vec<u64>, values: &[i64], labels: &[Label]) {
        let label = labels
            .iter()
            .map(|l| match l {
                Label::Str(k, v) => pb::Label {
                    key: self.string(k),
                    str: self.string(v),
                    num: 0,
                    num_unit: 0,
                },
                Label::Num(k, n, unit) => pb::Label {
                    key: self.string(k),
                    str: 0,
                    num: *n,
                    num_unit: self.string(unit),
                },
            })
            .collect();
        self.profile.sample.push(pb::Sample {
            location_id,
            value: values.to_vec(),
            label,
        });
    }

    /// The finished profile message.
    pub fn build(self) -> pb::Profile {
        self.profile
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(addr: u64, name: &str) -> Frame {
        Frame {
            address: addr,
            mapping: None,
            lines: vec![FrameLine {
                function: name.into(),
                file: String::new(),
                line: 0,
            }],
        }
    }

    #[test]
    fn dedups_strings_functions_locations_and_round_trips() {
        let mut b = ProfileBuilder::new(&[("samples", "count"), ("cpu", "nanoseconds")]);
        b.period("cpu", "nanoseconds", 10_101_010);
        let m = b.add_mapping(&MappingInfo {
            start: 0x1000,
            limit: 0x2000,
            file_offset: 0,
            file: "/bin/x".into(),
            build_id: "abcd".into(),
            has_functions: true,
        });
        let mut leaf = frame(0x1010, "leaf");
        leaf.mapping = Some(m);
        let root = frame(0x1100, "main");
        b.add_sample(
            &[leaf.clone(), root.clone()],
            &[2, 20],
            &[Label::Str("comm".into(), "x".into())],
        );
        b.add_sample(
            &[leaf, root],
            &[1, 10],
            &[Label::Num("pid".into(), 7, String::new())],
        );
        let p = b.build();
        assert_eq!(p.string_table[0], "");
        assert_eq!(p.location.len(), 2);
        assert_eq!(p.function.len(), 2);
        assert_eq!(p.mapping.len(), 1);
        assert_eq!(p.sample.len(), 2);
        let unique: std::collections::HashSet<_> = p.string_table.iter().collect();
        assert_eq!(
            unique.len(),
            p.string_table.len(),
            "string table has duplicates"
        );
        let bytes = crate::encode_gzip(&p).unwrap();
        assert_eq!(crate::decode(&bytes).unwrap(), p);
    }
}
