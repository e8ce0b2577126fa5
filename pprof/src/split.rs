//! Splitting a profile into parts by a key of each sample (the agent's always-on windows: one
//! node-wide capture into one profile per pod). Each part keeps its samples exactly (stacks,
//! values, labels) and only the table entries they refer to, so a part is as small as if it
//! had been built alone.

use std::collections::{BTreeMap, HashMap};

use crate::pb::{Function, Label, Line, Location, Mapping, Profile, Sample, ValueType};
use crate::read::string;

/// Splits `profile` into one profile per key `key_of` returns for its samples (samples
/// without a key are left out). Every part has the whole profile's sample types, period,
/// time, duration, comments, drop and keep frames and default sample type.
pub fn split<K: Ord>(
    profile: &Profile,
    mut key_of: impl FnMut(&Profile, &Sample) -> Option<K>,
) -> BTreeMap<K, Profile> {
    let mut groups: BTreeMap<K, Vec<&Sample>> = BTreeMap::new();
    for sample in &profile.sample {
        if let Some(key) = key_of(profile, sample) {
            groups.entry(key).or_default().push(sample);
        }
    }
    let locations: HashMap<u64, &Location> = profile.location.iter().map(|l| (l.id, l)).collect();
    let functions: HashMap<u64, &Function> = profile.function.iter().map(|f| (f.id, f)).collect();
    let mappings: HashMap<u64, &Mapping> = profile.mapping.iter().map(|m| (m.id, m)).collect();
    groups
        .into_iter()
        .map(|(key, samples)| {
            let mut part = Part::new(profile);
            for sample in samples {
                part.sample(sample, &locations, &functions, &mappings);
            }
            (key, part.out)
        })
        .collect()
}

/// The string value of label `key` of `sample`, if it has one.
pub fn label<'a>(profile: &'a Profile, sample: &Sample, key: &str) -> Option<&'a str> {
    sample
        .label
        .iter()
        .find(|l| l.str != 0 && string(profile, l.key) == key)
        .map(|l| string(profile, l.str))
}

/// One part being built: the source profile and the part's re-indexed tables.
struct Part<'a> {
    src: &'a Profile,
    out: Profile,
    strings: HashMap<i64, i64>,
    locations: HashMap<u64, u64>,
    functions: HashMap<u64, u64>,
    mappings: HashMap<u64, u64>,
}

impl<'a> Part<'a> {
    fn new(src: &'a Profile) -> Self {
        let mut part = Self {
            src,
            out: Profile::default(),
            strings: HashMap::new(),
            locations: HashMap::new(),
            functions: HashMap::new(),
            mappings: HashMap::new(),
        };
        part.string(0);
        part.out.sample_type = src
            .sample_type
            .iter()
            .map(|vt| part.value_type(vt))
            .collect();
        part.out.period_type = src.period_type.as_ref().map(|vt| part.value_type(vt));
        part.out.period = src.period;
        part.out.time_nanos = src.time_nanos;
        part.out.duration_nanos = src.duration_nanos;
        part.out.comment = src.comment.iter().map(|&c| part.string(c)).collect();
        part.out.drop_frames = part.string(src.drop_frames);
        part.out.keep_frames = part.string(src.keep_frames);
        part.out.default_sample_type = part.string(src.default_sample_type);
        part
    }

    /// The part's index of the source's string `i` (out of range: `""`).
    fn string(&mut self, i: i64) -> i64 {
        if let Some(&j) = self.strings.get(&i) {
            return j;
        }
        let j = self.out.string_table.len() as i64;
        self.out.string_table.push(string(self.src, i).to_owned());
        self.strings.insert(i, j);
        j
    }

    fn value_type(&mut self, vt: &ValueType) -> ValueType {
        ValueType {
            r#type: self.string(vt.r#type),
            unit: self.string(vt.unit),
        }
    }

    fn mapping(&mut self, id: u64, mappings: &HashMap<u64, &Mapping>) -> u64 {
        if id == 0 {
            return 0;
        }
        if let Some(&j) = self.mappings.get(&id) {
            return j;
        }
        let Some(m) = mappings.get(&id) else {
            return 0;
        };
        let j = self.out.mapping.len() as u64 + 1;
        let filename = self.string(m.filename);
        let build_id = self.string(m.build_id);
        self.out.mapping.push(Mapping {
            id: j,
            filename,
            build_id,
            ..**m
        });
        self.mappings.insert(id, j);
        j
    }

    fn function(&mut self, id: u64, functions: &HashMap<u64, &Function>) -> u64 {
        if let Some(&j) = self.functions.get(&id) {
            return j;
        }
        let Some(f) = functions.get(&id) else {
            return 0;
        };
        let j = self.out.function.len() as u64 + 1;
        let (name, system_name, filename) = (
            self.string(f.name),
            self.string(f.system_name),
            self.string(f.filename),
        );
        self.out.function.push(Function {
            id: j,
            name,
            system_name,
            filename,
            start_line: f.start_line,
        });
        self.functions.insert(id, j);
        j
    }

    fn location(
        &mut self,
        id: u64,
        locations: &HashMap<u64, &Location>,
        functions: &HashMap<u64, &Function>,
        mappings: &HashMap<u64, &Mapping>,
    ) -> Option<u64> {
        if let Some(&j) = self.locations.get(&id) {
            return Some(j);
        }
        let l = locations.get(&id)?;
        let mapping_id = self.mapping(l.mapping_id, mappings);
        let line = l
            .line
            .iter()
            .map(|ln| Line {
                function_id: self.function(ln.function_id, functions),
                line: ln.line,
                column: ln.column,
            })
            .collect();
        let j = self.out.location.len() as u64 + 1;
        self.out.location.push(Location {
            id: j,
            mapping_id,
            address: l.address,
            line,
            is_folded: l.is_folded,
        });
        self.locations.insert(id, j);
        Some(j)
    }

    fn sample(
        &mut self,
        s: &Sample,
        locations: &HashMap<u64, &Location>,
        functions: &HashMap<u64, &Function>,
        mappings: &HashMap<u64, &Mapping>,
    ) {
        let location_id = s
            .location_id
            .iter()
            .filter_map(|&id| self.location(id, locations, functions, mappings))
            .collect();
        let label = s
            .label
            .iter()
            .map(|l| Label {
                key: self.string(l.key),
                str: self.string(l.str),
                num: l.num,
                num_unit: self.string(l.num_unit),
            })
            .collect();
        self.out.sample.push(Sample {
            location_id,
            value: s.value.clone(),
            label,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Frame, FrameLine, Label as BLabel, MappingInfo, ProfileBuilder, validate};

    fn frame(address: u64, function: &str, mapping: Option<u64>) -> Frame {
        Frame {
            address,
            mapping,
            lines: vec![FrameLine {
                function: function.into(),
                file: "main.c".into(),
                line: 3,
            }],
        }
    }

    #[test]
    fn each_part_keeps_its_samples_and_only_the_entries_they_use() {
        let mut b = ProfileBuilder::new(&[("samples", "count"), ("cpu", "nanoseconds")]);
        b.cpu_period(19).comment("node n1");
        let libc = b.add_mapping(&MappingInfo {
            start: 0x1000,
            limit: 0x9000,
            file_offset: 0,
            file: "/lib/libc.so.6".into(),
            build_id: "abcd".into(),
            has_functions: true,
        });
        let pod = |name: &str| {
            vec![
                BLabel::Str("namespace".into(), "shop".into()),
                BLabel::Str("pod".into(), name.into()),
            ]
        };
        b.add_sample(
            &[
                frame(0x1100, "memcpy", Some(libc)),
                frame(0x20, "main", None),
            ],
            &[3, 3],
            &pod("a"),
        );
        b.add_sample(&[frame(0x30, "serve", None)], &[2, 2], &pod("b"));
        b.add_sample(&[frame(0x20, "main", None)], &[1, 1], &pod("b"));
        b.add_sample(&[frame(0x40, "orphan", None)], &[5, 5], &[]);
        let whole = b.build();
        validate(&whole).unwrap();

        let parts = split(&whole, |p, s| label(p, s, "pod").map(str::to_owned));
        assert_eq!(parts.keys().collect::<Vec<_>>(), ["a", "b"]);
        for part in parts.values() {
            validate(part).unwrap();
            assert_eq!(part.period, whole.period);
            assert_eq!(crate::sample_types(part), crate::sample_types(&whole));
            assert_eq!(
                part.comment
                    .iter()
                    .map(|&c| string(part, c))
                    .collect::<Vec<_>>(),
                ["node n1"]
            );
        }
        let a = &parts["a"];
        assert_eq!(a.sample.len(), 1);
        assert_eq!(a.sample[0].value, [3, 3]);
        assert_eq!(a.mapping.len(), 1);
        assert_eq!(string(a, a.mapping[0].filename), "/lib/libc.so.6");
        let names: Vec<&str> = a.function.iter().map(|f| string(a, f.name)).collect();
        assert_eq!(names, ["memcpy", "main"]);
        let b = &parts["b"];
        assert_eq!(b.sample.len(), 2);
        assert!(b.mapping.is_empty(), "b uses no mapping");
        assert!(
            !b.string_table
                .iter()
                .any(|s| s == "orphan" || s == "memcpy")
        );
        let stacks: Vec<Vec<&str>> = b
            .sample
            .iter()
            .map(|s| {
                s.location_id
                    .iter()
                    .map(|id| {
                        let l = &b.location[*id as usize - 1];
                        let f = &b.function[l.line[0].function_id as usize - 1];
                        string(b, f.name)
                    })
                    .collect()
            })
            .collect();
        assert_eq!(stacks, [vec!["serve"], vec!["main"]]);
        assert_eq!(label(b, &b.sample[0], "namespace"), Some("shop"));
    }
}
