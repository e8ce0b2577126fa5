//! Merging the heap profiles fetched from several containers into one
//! profile, each sample labelled with where it came from, through the
//! shared [`ProfileBuilder`] (which re-deduplicates strings, functions,
//! locations and mappings across the inputs).

use std::collections::HashMap;

use flamefleet_proto::pprof::Profile;

use crate::pprof::{Frame, FrameLine, Label, MappingInfo, ProfileBuilder};

/// A fetched profile and the labels every one of its samples gets.
#[derive(Debug, Clone)]
pub struct LabelledProfile {
    /// A profile that passed `endpoint::validate_profile`.
    pub profile: Profile,
    /// Labels to add, e.g. namespace, pod, container, node.
    pub labels: Vec<Label>,
}

/// Why profiles could not be merged.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// Nothing to merge.
    #[error("no heap profile to merge")]
    Empty,
    /// The inputs measure different things.
    #[error(
        "cannot merge heap profiles with different sample types: expected {expected}, found \
         {found}; the containers serve different profile kinds (e.g. Go and jemalloc)"
    )]
    SampleTypes {
        /// Sample types of the first profile.
        expected: String,
        /// Sample types of the mismatching one.
        found: String,
    },
}

fn string(p: &Profile, i: i64) -> &str {
    // Indices were validated; an out-of-range one degrades to "".
    usize::try_from(i)
        .ok()
        .and_then(|i| p.string_table.get(i))
        .map_or("", String::as_str)
}

fn sample_types(p: &Profile) -> Vec<(String, String)> {
    p.sample_type
        .iter()
        .map(|vt| {
            (
                string(p, vt.r#type).to_owned(),
                string(p, vt.unit).to_owned(),
            )
        })
        .collect()
}

fn describe(types: &[(String, String)]) -> String {
    let parts: Vec<String> = types.iter().map(|(t, u)| format!("{t}/{u}")).collect();
    format!("[{}]", parts.join(", "))
}

/// Merges `parts` into one profile with the first part's sample types,
/// period and default sample type; the earliest start time and the longest
/// duration; and each part's labels added to each of its samples.
pub fn merge(parts: &[LabelledProfile]) -> Result<Profile, MergeError> {
    let first = &parts.first().ok_or(MergeError::Empty)?.profile;
    let types = sample_types(first);
    for part in &parts[1..] {
        let found = sample_types(&part.profile);
        if found != types {
            return Err(MergeError::SampleTypes {
                expected: describe(&types),
                found: describe(&found),
            });
        }
    }
    let type_refs: Vec<(&str, &str)> = types
        .iter()
        .map(|(t, u)| (t.as_str(), u.as_str()))
        .collect();
    let mut b = ProfileBuilder::new(&type_refs);
    if let Some(pt) = &first.period_type {
        b.period(
            string(first, pt.r#type),
            string(first, pt.unit),
            first.period,
        );
    }
    let start = parts
        .iter()
        .map(|p| p.profile.time_nanos)
        .filter(|&t| t > 0)
        .min()
        .unwrap_or(0);
    let duration = parts
        .iter()
        .map(|p| p.profile.duration_nanos)
        .max()
        .unwrap_or(0);
    b.time(start, duration);
    if first.default_sample_type != 0 {
        b.default_sample_type(string(first, first.default_sample_type));
    }
    let mut comments: Vec<&str> = Vec::new();
    for part in parts {
        for &c in &part.profile.comment {
            let text = string(&part.profile, c);
            if !comments.contains(&text) {
                comments.push(text);
            }
        }
    }
    for c in comments {
        b.comment(c);
    }
    for part in parts {
        add_part(&mut b, part);
    }
    Ok(b.build())
}

fn add_part(b: &mut ProfileBuilder, part: &LabelledProfile) {
    let p = &part.profile;
    let mut mappings: HashMap<u64, u64> = HashMap::new();
    for m in &p.mapping {
        let id = b.add_mapping(&MappingInfo {
            start: m.memory_start,
            limit: m.memory_limit,
            file_offset: m.file_offset,
            file: string(p, m.filename).to_owned(),
            build_id: string(p, m.build_id).to_owned(),
            has_functions: m.has_functions,
        });
        mappings.insert(m.id, id);
    }
    let functions: HashMap<u64, (&str, &str)> = p
        .function
        .iter()
        .map(|f| (f.id, (string(p, f.name), string(p, f.filename))))
        .collect();
    let frames: HashMap<u64, Frame> = p
        .location
        .iter()
        .map(|l| {
            let lines = l
                .line
                .iter()
                .map(|ln| {
                    let (function, file) =
                        functions.get(&ln.function_id).copied().unwrap_or(("", ""));
                    FrameLine {
                        function: function.to_owned(),
                        file: file.to_owned(),
                        line: ln.line,
                    }
                })
                .collect();
            let frame = Frame {
                address: l.address,
                mapping: mappings.get(&l.mapping_id).copied(),
                lines,
            };
            (l.id, frame)
        })
        .collect();
    let extra: Vec<&Label> = part
        .labels
        .iter()
        .filter(|l| !matches!(l, Label::Str(_, v) if v.is_empty()))
        .collect();
    for s in &p.sample {
        let stack: Vec<Frame> = s
            .location_id
            .iter()
            .filter_map(|id| frames.get(id).cloned())
            .collect();
        let mut labels: Vec<Label> = s
            .label
            .iter()
            .map(|l| {
                let key = string(p, l.key).to_owned();
                if l.str != 0 {
                    Label::Str(key, string(p, l.str).to_owned())
                } else {
                    Label::Num(key, l.num, string(p, l.num_unit).to_owned())
                }
            })
            .collect();
        labels.extend(extra.iter().map(|l| (*l).clone()));
        b.add_sample(&stack, &s.value, &labels);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heap_profile(function: &str, inuse: i64) -> Profile {
        let mut b = ProfileBuilder::new(&[("inuse_objects", "count"), ("inuse_space", "bytes")]);
        b.period("space", "bytes", 524_288)
            .default_sample_type("inuse_space")
            .comment("from go");
        let frame = Frame {
            address: 0x1234,
            mapping: None,
            lines: vec![FrameLine {
                function: function.into(),
                file: "main.go".into(),
                line: 7,
            }],
        };
        b.add_sample(
            &[frame],
            &[1, inuse],
            &[Label::Num("bytes".into(), inuse, String::new())],
        );
        b.build()
    }

    #[test]
    fn merges_and_labels_each_part() {
        let parts = vec![
            LabelledProfile {
                profile: heap_profile("main.a", 100),
                labels: vec![
                    Label::Str("container".into(), "a".into()),
                    Label::Str("pod".into(), String::new()),
                ],
            },
            LabelledProfile {
                profile: heap_profile("main.b", 300),
                labels: vec![Label::Str("container".into(), "b".into())],
            },
        ];
        let m = merge(&parts).unwrap();
        assert_eq!(m.sample.len(), 2);
        assert_eq!(m.function.len(), 2);
        assert_eq!(m.period, 524_288);
        assert_eq!(string(&m, m.default_sample_type), "inuse_space");
        assert_eq!(m.comment.len(), 1, "identical comments are kept once");
        let label_of = |i: usize, key: &str| {
            m.sample[i]
                .label
                .iter()
                .find(|l| string(&m, l.key) == key)
                .map(|l| (string(&m, l.str).to_owned(), l.num))
        };
        assert_eq!(label_of(0, "container"), Some(("a".into(), 0)));
        assert_eq!(label_of(1, "container"), Some(("b".into(), 0)));
        assert_eq!(label_of(1, "bytes"), Some((String::new(), 300)));
        assert_eq!(label_of(0, "pod"), None, "empty labels are left out");
        assert_eq!(m.sample[1].value, vec![1, 300]);
        crate::capture::heap::endpoint::validate_profile(&m).unwrap();
    }

    #[test]
    fn refuses_mismatched_sample_types() {
        let mut other = ProfileBuilder::new(&[("space", "bytes")]);
        other.string("x");
        let parts = vec![
            LabelledProfile {
                profile: heap_profile("a", 1),
                labels: vec![],
            },
            LabelledProfile {
                profile: other.build(),
                labels: vec![],
            },
        ];
        let e = merge(&parts).unwrap_err();
        assert!(e.to_string().contains("[space/bytes]"), "{e}");
        assert!(matches!(merge(&[]), Err(MergeError::Empty)));
    }
}
