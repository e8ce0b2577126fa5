//! Merging pprof profiles of one type: samples concatenated, string/function/location/mapping
//! tables re-indexed and deduplicated. Written here because no well-kept Rust crate merges
//! pprof protobufs (the `pprof` crate only builds profiles of its own process).

use std::collections::HashMap;

use flamefleet_proto::pprof::{
    Function, Label, Line, Location, Mapping, Profile, Sample, ValueType,
};

use crate::error::{Error, Result};
use crate::profile_file::{sample_types, string};

/// A location's identity in the merged profile: mapping, address, (function, line, column)
/// per line, is_folded.
type LocationKey = (u64, u64, Vec<(u64, i64, i64)>, bool);

/// Builds the merged profile's tables.
#[derive(Default)]
struct Merger {
    out: Profile,
    strings: HashMap<String, i64>,
    functions: HashMap<(i64, i64, i64, i64), u64>,
    mappings: HashMap<(u64, u64, u64, i64, i64), u64>,
    locations: HashMap<LocationKey, u64>,
}

impl Merger {
    fn intern(&mut self, s: &str) -> i64 {
        if let Some(i) = self.strings.get(s) {
            return *i;
        }
        let i = self.out.string_table.len() as i64;
        self.out.string_table.push(s.to_string());
        self.strings.insert(s.to_string(), i);
        i
    }

    fn add(&mut self, p: &Profile) {
        let s = |m: &mut Self, i: i64| m.intern(string(p, i));
        let mut mapping_ids = HashMap::new();
        for m in &p.mapping {
            let filename = s(self, m.filename);
            let build_id = s(self, m.build_id);
            let key = (
                m.memory_start,
                m.memory_limit,
                m.file_offset,
                filename,
                build_id,
            );
            let next = self.out.mapping.len() as u64 + 1;
            let id = *self.mappings.entry(key).or_insert_with(|| {
                self.out.mapping.push(Mapping {
                    id: next,
                    filename,
                    build_id,
                    ..*m
                });
                next
            });
            mapping_ids.insert(m.id, id);
        }
        let mut function_ids = HashMap::new();
        for f in &p.function {
            let key = (
                s(self, f.name),
                s(self, f.system_name),
                s(self, f.filename),
                f.start_line,
            );
            let next = self.out.function.len() as u64 + 1;
            let id = *self.functions.entry(key).or_insert_with(|| {
                self.out.function.push(Function {
                    id: next,
                    name: key.0,
                    system_name: key.1,
                    filename: key.2,
                    start_line: key.3,
                });
                next
            });
            function_ids.insert(f.id, id);
        }
        let mut location_ids = HashMap::new();
        for l in &p.location {
            let mapping_id = mapping_ids.get(&l.mapping_id).copied().unwrap_or(0);
            let lines: Vec<(u64, i64, i64)> = l
                .line
                .iter()
                .map(|ln| {
                    (
                        function_ids.get(&ln.function_id).copied().unwrap_or(0),
                        ln.line,
                        ln.column,
                    )
                })
                .collect();
            let key = (mapping_id, l.address, lines, l.is_folded);
            let next = self.out.location.len() as u64 + 1;
            let id = match self.locations.get(&key) {
                Some(id) => *id,
                None => {
                    self.out.location.push(Location {
                        id: next,
                        mapping_id,
                        address: l.address,
                        line: key
                            .2
                            .iter()
                            .map(|&(function_id, line, column)| Line {
                                function_id,
                                line,
                                column,
                            })
                            .collect(),
                        is_folded: l.is_folded,
                    });
                    self.locations.insert(key, next);
                    next
                }
            };
            location_ids.insert(l.id, id);
        }
        for sample in &p.sample {
            let label = sample
                .label
                .iter()
                .map(|lb| Label {
                    key: s(self, lb.key),
                    str: s(self, lb.str),
                    num: lb.num,
                    num_unit: s(self, lb.num_unit),
                })
                .collect();
            self.out.sample.push(Sample {
                location_id: sample
                    .location_id
                    .iter()
                    .map(|id| location_ids.get(id).copied().unwrap_or(0))
                    .collect(),
                value: sample.value.clone(),
                label,
            });
        }
        for c in &p.comment {
            let c = s(self, *c);
            self.out.comment.push(c);
        }
        if p.time_nanos != 0 && (self.out.time_nanos == 0 || p.time_nanos < self.out.time_nanos) {
            self.out.time_nanos = p.time_nanos;
        }
        self.out.duration_nanos += p.duration_nanos;
    }
}

/// Adds the string label `key`=`value` to every sample of `profile` (e.g. which run a
/// sample came from, before merging the runs of a policy).
pub fn add_label(profile: &mut Profile, key: &str, value: &str) {
    let mut index = |s: &str| -> i64 {
        if let Some(i) = profile.string_table.iter().position(|t| t == s) {
            return i64::try_from(i).unwrap_or(0);
        }
        if profile.string_table.is_empty() {
            profile.string_table.push(String::new());
        }
        profile.string_table.push(s.to_owned());
        i64::try_from(profile.string_table.len() - 1).unwrap_or(0)
    };
    let (key, value) = (index(key), index(value));
    for sample in &mut profile.sample {
        sample.label.retain(|l| l.key != key);
        sample.label.push(Label {
            key,
            str: value,
            ..Label::default()
        });
    }
}

/// Merges `(source name, profile)` pairs; all must have the same sample types.
///
/// # Errors
/// [`Error::MixedSampleTypes`] naming the first input and the first one that differs;
/// [`Error::Usage`] when there is no input.
pub fn merge(profiles: &[(String, Profile)]) -> Result<Profile> {
    let Some((first_name, first)) = profiles.first() else {
        return Err(Error::Usage("merge needs at least one profile".into()));
    };
    let first_types = sample_types(first);
    for (name, p) in &profiles[1..] {
        let types = sample_types(p);
        if types != first_types {
            return Err(Error::MixedSampleTypes {
                first_source: first_name.clone(),
                first: first_types.join(", "),
                other_source: name.clone(),
                other: types.join(", "),
            });
        }
    }
    let mut m = Merger::default();
    m.intern("");
    for vt in &first.sample_type {
        let vt = ValueType {
            r#type: m.intern(string(first, vt.r#type)),
            unit: m.intern(string(first, vt.unit)),
        };
        m.out.sample_type.push(vt);
    }
    if let Some(pt) = &first.period_type {
        m.out.period_type = Some(ValueType {
            r#type: m.intern(string(first, pt.r#type)),
            unit: m.intern(string(first, pt.unit)),
        });
    }
    m.out.period = first.period;
    if first.default_sample_type != 0 {
        m.out.default_sample_type = m.intern(string(first, first.default_sample_type));
    }
    for (_, p) in profiles {
        m.add(p);
    }
    Ok(m.out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stacks::{folded, tests::profile};

    #[test]
    fn merge_sums_stacks_and_dedups_tables() {
        let a = profile(
            &[("cpu", "nanoseconds")],
            &[(&["hot", "main"], &[10]), (&["cold", "main"], &[1])],
        );
        // Different table order in b: ids and string indexes differ.
        let b = profile(
            &[("cpu", "nanoseconds")],
            &[(&["other", "main"], &[4]), (&["hot", "main"], &[5])],
        );
        let merged = merge(&[("a".into(), a), ("b".into(), b)]).unwrap();
        let f = folded(&merged, 0);
        assert_eq!(f.get("main;hot"), Some(&15));
        assert_eq!(f.get("main;cold"), Some(&1));
        assert_eq!(f.get("main;other"), Some(&4));
        assert_eq!(merged.function.len(), 4);
        // Locations are keyed by address too: b's `hot` sits at another address than a's,
        // while `main` shares one (same function, same address).
        assert_eq!(merged.location.len(), 5);
        assert_eq!(merged.sample.len(), 4);
        assert_eq!(merged.string_table[0], "");
    }

    #[test]
    fn mixed_types_are_refused() {
        let a = profile(&[("cpu", "nanoseconds")], &[]);
        let b = profile(&[("inuse_space", "bytes")], &[]);
        let err = merge(&[("a.pb.gz".into(), a), ("b.pb.gz".into(), b)]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("a.pb.gz") && msg.contains("inuse_space/bytes"),
            "{msg}"
        );
        assert_eq!(err.exit_code(), 11);
    }
}
