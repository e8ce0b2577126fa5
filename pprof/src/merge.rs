//! Merging profiles of one kind into one: every sample of every part kept as it is (values
//! unchanged, stacks and labels exact), the string, mapping, function and location tables
//! re-indexed and deduplicated across the parts, and each part's samples labelled with
//! where it came from (container, node, run, ...).

use std::collections::HashMap;

use crate::pb::{Function, Label as PbLabel, Line, Location, Mapping, Profile, Sample, ValueType};
use crate::read::{sample_types, string};
use crate::{Error, Label, Result};

/// A profile and the labels each of its samples gets in the merge.
#[derive(Debug, Clone)]
pub struct LabelledProfile {
    /// The profile (one that passed [`validate`](crate::validate()): IDs it does not
    /// define are dropped from stacks).
    pub profile: Profile,
    /// Labels to set on every sample, e.g. namespace, pod, container, node. A label
    /// replaces one of the same key the sample already has, so a profile cannot name its
    /// own origin; a string label with an empty value is left out.
    pub labels: Vec<Label>,
}

/// How the parts' capture windows relate, which decides the merged `duration_nanos`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    /// Captured over the same window (the containers of one capture, the nodes of one
    /// request): the merged duration is the longest part's.
    Shared,
    /// Captured one after another (the runs of a policy) or unrelated: durations add up,
    /// as `go tool pprof` merges them.
    Successive,
}

/// Merges `parts` into one profile with the first part's sample types, period and default
/// sample type; the earliest non-zero start time; each distinct comment once; and the
/// duration `window` says.
///
/// # Errors
/// [`Error::NothingToMerge`] for no parts; [`Error::MixedSampleTypes`] when a part's sample
/// types (`type/unit`, in order) differ from the first's.
pub fn merge(parts: &[LabelledProfile], window: Window) -> Result<Profile> {
    let first = &parts.first().ok_or(Error::NothingToMerge)?.profile;
    let types = sample_types(first);
    for (i, part) in parts.iter().enumerate().skip(1) {
        let found = sample_types(&part.profile);
        if found != types {
            return Err(Error::MixedSampleTypes {
                expected: format!("[{}]", types.join(", ")),
                other: i,
                found: format!("[{}]", found.join(", ")),
            });
        }
    }
    let mut m = Merger::default();
    m.intern("");
    for vt in &first.sample_type {
        let vt = m.value_type(first, vt);
        m.out.sample_type.push(vt);
    }
    if let Some(pt) = &first.period_type {
        m.out.period_type = Some(m.value_type(first, pt));
    }
    m.out.period = first.period;
    if first.default_sample_type != 0 {
        m.out.default_sample_type = m.intern(string(first, first.default_sample_type));
    }
    let reserve = |f: fn(&Profile) -> usize| parts.iter().map(|p| f(&p.profile)).sum::<usize>();
    m.out.sample.reserve(reserve(|p| p.sample.len()));
    for part in parts {
        m.add(part);
    }
    let durations = parts.iter().map(|p| p.profile.duration_nanos);
    m.out.duration_nanos = match window {
        Window::Shared => durations.max().unwrap_or(0),
        Window::Successive => durations.fold(0, i64::saturating_add),
    };
    m.out.time_nanos = parts
        .iter()
        .map(|p| p.profile.time_nanos)
        .filter(|&t| t > 0)
        .min()
        .unwrap_or(0);
    Ok(m.out)
}

/// A location's identity in the merged profile: mapping, address, (function, line, column)
/// per line, is_folded.
type LocationKey = (u64, u64, Vec<(u64, i64, i64)>, bool);

/// The merged profile and its dedup tables (keys in merged string indexes and IDs).
#[derive(Default)]
struct Merger {
    out: Profile,
    strings: HashMap<String, i64>,
    functions: HashMap<(i64, i64, i64, i64), u64>,
    mappings: HashMap<(u64, u64, u64, i64, i64), u64>,
    locations: HashMap<LocationKey, u64>,
    comments: std::collections::HashSet<i64>,
}

impl Merger {
    fn intern(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.strings.get(s) {
            return i;
        }
        let i = self.out.string_table.len() as i64;
        self.out.string_table.push(s.to_owned());
        self.strings.insert(s.to_owned(), i);
        i
    }

    fn value_type(&mut self, p: &Profile, vt: &ValueType) -> ValueType {
        ValueType {
            r#type: self.intern(string(p, vt.r#type)),
            unit: self.intern(string(p, vt.unit)),
        }
    }

    fn add(&mut self, part: &LabelledProfile) {
        let p = &part.profile;
        let mut mapping_ids = HashMap::with_capacity(p.mapping.len());
        for m in &p.mapping {
            let filename = self.intern(string(p, m.filename));
            let build_id = self.intern(string(p, m.build_id));
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
        let mut function_ids = HashMap::with_capacity(p.function.len());
        for f in &p.function {
            let key = (
                self.intern(string(p, f.name)),
                self.intern(string(p, f.system_name)),
                self.intern(string(p, f.filename)),
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
        let mut location_ids = HashMap::with_capacity(p.location.len());
        for l in &p.location {
            let mapping_id = mapping_ids.get(&l.mapping_id).copied().unwrap_or(0);
            let lines: Vec<(u64, i64, i64)> = l
                .line
                .iter()
                .map(|ln| {
                    let function_id = function_ids.get(&ln.function_id).copied().unwrap_or(0);
                    (function_id, ln.line, ln.column)
                })
                .collect();
            let key = (mapping_id, l.address, lines, l.is_folded);
            let id = match self.locations.get(&key) {
                Some(&id) => id,
                None => {
                    let id = self.out.location.len() as u64 + 1;
                    self.out.location.push(Location {
                        id,
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
                    self.locations.insert(key, id);
                    id
                }
            };
            location_ids.insert(l.id, id);
        }
        let extra: Vec<PbLabel> = part
            .labels
            .iter()
            .filter(|l| !matches!(l, Label::Str(_, v) if v.is_empty()))
            .map(|l| match l {
                Label::Str(k, v) => PbLabel {
                    key: self.intern(k),
                    str: self.intern(v),
                    num: 0,
                    num_unit: 0,
                },
                Label::Num(k, n, unit) => PbLabel {
                    key: self.intern(k),
                    str: 0,
                    num: *n,
                    num_unit: self.intern(unit),
                },
            })
            .collect();
        for s in &p.sample {
            let mut label: Vec<PbLabel> = s
                .label
                .iter()
                .map(|l| PbLabel {
                    key: self.intern(string(p, l.key)),
                    str: self.intern(string(p, l.str)),
                    num: l.num,
                    num_unit: self.intern(string(p, l.num_unit)),
                })
                .filter(|l| !extra.iter().any(|e| e.key == l.key))
                .collect();
            label.extend_from_slice(&extra);
            self.out.sample.push(Sample {
                location_id: s
                    .location_id
                    .iter()
                    .filter_map(|id| location_ids.get(id).copied())
                    .collect(),
                value: s.value.clone(),
                label,
            });
        }
        for &c in &p.comment {
            let c = self.intern(string(p, c));
            if self.comments.insert(c) {
                self.out.comment.push(c);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Frame, FrameLine, MappingInfo, ProfileBuilder, validate};

    fn frame(address: u64, function: &str, mapping: Option<u64>) -> Frame {
        Frame {
            address,
            mapping,
            lines: vec![FrameLine {
                function: function.into(),
                file: "main.go".into(),
                line: 7,
            }],
        }
    }

    fn heap_profile(function: &str, inuse: i64) -> Profile {
        let mut b = ProfileBuilder::new(&[("inuse_objects", "count"), ("inuse_space", "bytes")]);
        b.period("space", "bytes", 524_288)
            .default_sample_type("inuse_space")
            .comment("from go");
        b.add_sample(
            &[frame(0x1234, function, None)],
            &[1, inuse],
            &[Label::Num("bytes".into(), inuse, String::new())],
        );
        b.build()
    }

    fn part(profile: Profile, labels: &[(&str, &str)]) -> LabelledProfile {
        LabelledProfile {
            profile,
            labels: labels
                .iter()
                .map(|(k, v)| Label::Str((*k).into(), (*v).into()))
                .collect(),
        }
    }

    fn label_of<'a>(m: &'a Profile, sample: usize, key: &str) -> Vec<(&'a str, i64)> {
        m.sample[sample]
            .label
            .iter()
            .filter(|l| string(m, l.key) == key)
            .map(|l| (string(m, l.str), l.num))
            .collect()
    }

    #[test]
    fn merges_and_labels_each_part() {
        let parts = [
            part(
                heap_profile("main.a", 100),
                &[("container", "a"), ("pod", "")],
            ),
            part(heap_profile("main.b", 300), &[("container", "b")]),
        ];
        let m = merge(&parts, Window::Shared).unwrap();
        validate(&m).unwrap();
        assert_eq!(m.sample.len(), 2);
        assert_eq!(m.function.len(), 2);
        assert_eq!(m.location.len(), 2, "same address, other function");
        assert_eq!(m.period, 524_288);
        assert_eq!(string(&m, m.default_sample_type), "inuse_space");
        assert_eq!(m.comment.len(), 1, "identical comments are kept once");
        assert_eq!(label_of(&m, 0, "container"), [("a", 0)]);
        assert_eq!(label_of(&m, 1, "container"), [("b", 0)]);
        assert_eq!(label_of(&m, 1, "bytes"), [("", 300)]);
        assert!(
            label_of(&m, 0, "pod").is_empty(),
            "empty labels are left out"
        );
        assert_eq!(m.sample[1].value, vec![1, 300]);
    }

    #[test]
    fn the_merge_is_exact_tables_dedup_and_values_sum_to_the_inputs() {
        // Two profiles sharing a mapping and `main`, each with its own leaf, built in a
        // different order so that every ID and string index differs between them.
        let build = |leaf: &str, leaf_addr: u64, values: [i64; 2], time: i64, duration: i64| {
            let mut b = ProfileBuilder::new(&[("samples", "count"), ("cpu", "nanoseconds")]);
            b.cpu_period(100).time(time, duration);
            b.string(leaf);
            let m = b.add_mapping(&MappingInfo {
                start: 0x1000,
                limit: 0x9000,
                file_offset: 0,
                file: "/bin/app".into(),
                build_id: "beef".into(),
                has_functions: true,
            });
            let main = frame(0x1100, "main", Some(m));
            b.add_sample(
                &[frame(leaf_addr, leaf, Some(m)), main.clone()],
                &[values[0], values[0] * 10_000_000],
                &[Label::Num("pid".into(), values[1], String::new())],
            );
            b.add_sample(&[main], &[1, 10_000_000], &[]);
            b.build()
        };
        let a = build("hot", 0x1200, [5, 1], 2_000, 10);
        let b = build("cold", 0x1300, [2, 2], 1_000, 30);
        let parts = [
            part(a.clone(), &[("run", "a")]),
            part(b.clone(), &[("run", "b")]),
        ];
        let shared = merge(&parts, Window::Shared).unwrap();
        validate(&shared).unwrap();
        assert_eq!(shared.mapping.len(), 1);
        assert_eq!(shared.function.len(), 3, "main, hot, cold");
        assert_eq!(shared.location.len(), 3);
        assert_eq!(shared.sample.len(), 4);
        let total = |p: &Profile, i: usize| p.sample.iter().map(|s| s.value[i]).sum::<i64>();
        for i in 0..2 {
            assert_eq!(total(&shared, i), total(&a, i) + total(&b, i));
        }
        let frames = crate::Frames::new(&shared);
        assert_eq!(
            frames.root_to_leaf(&shared.sample[2].location_id),
            ["main", "cold"]
        );
        assert_eq!(label_of(&shared, 2, "run"), [("b", 0)]);
        assert_eq!(label_of(&shared, 2, "pid"), [("", 2)]);
        assert_eq!(shared.period, 10_000_000);
        assert_eq!((shared.time_nanos, shared.duration_nanos), (1_000, 30));
        let successive = merge(&parts, Window::Successive).unwrap();
        assert_eq!(successive.duration_nanos, 40);
        // Merging one profile gives it back with the labels added.
        let alone = merge(&parts[..1], Window::Shared).unwrap();
        assert_eq!(alone.sample.len(), a.sample.len());
        assert_eq!(alone.location.len(), a.location.len());
    }

    #[test]
    fn a_part_label_replaces_the_samples_own_of_that_key() {
        let mut b = ProfileBuilder::new(&[("inuse_space", "bytes")]);
        b.add_sample(
            &[frame(1, "f", None)],
            &[1],
            &[Label::Str("pod".into(), "someone-else".into())],
        );
        let m = merge(&[part(b.build(), &[("pod", "web-1")])], Window::Shared).unwrap();
        assert_eq!(label_of(&m, 0, "pod"), [("web-1", 0)]);
    }

    #[test]
    fn refuses_mismatched_sample_types() {
        let mut other = ProfileBuilder::new(&[("space", "bytes")]);
        other.string("x");
        let parts = [part(heap_profile("a", 1), &[]), part(other.build(), &[])];
        let e = merge(&parts, Window::Shared).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("[space/bytes]"), "{msg}");
        assert!(msg.contains("profile 1"), "{msg}");
        assert!(matches!(
            merge(&[], Window::Shared),
            Err(Error::NothingToMerge)
        ));
    }
}
