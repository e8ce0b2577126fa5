//! Stacks of a pprof profile: which sample type to read and how its values read (seconds,
//! bytes, counts), function names root→leaf, collapsed ("folded") stacks for flame graphs.

use std::collections::BTreeMap;

use flamefleet_proto::pprof::Profile;

use crate::profile_file::string;

/// Sample types preferred, in order, when the profile sets no default: CPU time,
/// sample counts, live heap bytes, run-queue event counts.
const PREFERRED_TYPES: &[&str] = &["cpu", "samples", "inuse_space", "count"];

/// Index of the sample value to read: the profile's `default_sample_type`, else the first
/// preferred type present, else the last one (pprof's own default).
pub fn value_index(profile: &Profile) -> usize {
    let types: Vec<&str> = profile
        .sample_type
        .iter()
        .map(|vt| string(profile, vt.r#type))
        .collect();
    if profile.default_sample_type != 0 {
        let wanted = string(profile, profile.default_sample_type);
        if let Some(i) = types.iter().position(|t| *t == wanted) {
            return i;
        }
    }
    PREFERRED_TYPES
        .iter()
        .find_map(|p| types.iter().position(|t| t == p))
        .unwrap_or(types.len().saturating_sub(1))
}

/// The `type/unit` of the value at `index`.
pub fn value_type(profile: &Profile, index: usize) -> (String, String) {
    profile.sample_type.get(index).map_or_else(
        || (String::new(), String::new()),
        |vt| {
            (
                string(profile, vt.r#type).to_string(),
                string(profile, vt.unit).to_string(),
            )
        },
    )
}

/// Formats a value in its unit the way pprof does (seconds, bytes, or plain counts).
pub fn format_value(value: i64, unit: &str) -> String {
    let v = value as f64;
    match unit {
        "nanoseconds" => format!("{:.2}s", v / 1e9),
        "microseconds" => format!("{:.2}s", v / 1e6),
        "bytes" => {
            let units = ["B", "kB", "MB", "GB", "TB"];
            let mut v = v;
            let mut i = 0;
            while v.abs() >= 1024.0 && i + 1 < units.len() {
                v /= 1024.0;
                i += 1;
            }
            if i == 0 {
                format!("{value}B")
            } else {
                format!("{v:.2}{}", units[i])
            }
        }
        _ => value.to_string(),
    }
}

/// The sum over all samples of the value at `index`.
pub fn total(profile: &Profile, index: usize) -> i64 {
    profile
        .sample
        .iter()
        .map(|s| s.value.get(index).copied().unwrap_or(0))
        .fold(0i64, i64::saturating_add)
}

/// What a profile holds, in the words a reader counts it in: `187 samples` (the `samples`
/// type's total, as `go tool pprof` counts them), `5210 waits` (a runqlat profile's
/// `count`), else the total of the profile's default value with its unit (`48.00MB
/// inuse_space`). Not the number of sample records, which merging and aggregation change.
pub fn total_text(profile: &Profile) -> String {
    let position = |wanted: &str| {
        profile
            .sample_type
            .iter()
            .position(|vt| string(profile, vt.r#type) == wanted)
    };
    if let Some(i) = position("samples") {
        return format!("{} samples", total(profile, i));
    }
    if let (Some(i), Some(_)) = (position("count"), position("latency")) {
        return format!("{} waits", total(profile, i));
    }
    let index = value_index(profile);
    let (kind, unit) = value_type(profile, index);
    format!("{} {kind}", format_value(total(profile, index), &unit))
}

/// Resolves a sample's location IDs to function names (the pprof kit's reader).
pub use flamefleet_pprof::Frames;

/// Collapsed stacks (`root;...;leaf` → summed value of sample type `index`), sorted by stack,
/// zero-valued stacks left out.
pub fn folded(profile: &Profile, index: usize) -> BTreeMap<String, i64> {
    let frames = Frames::new(profile);
    let mut out = BTreeMap::new();
    for sample in &profile.sample {
        let value = sample.value.get(index).copied().unwrap_or(0);
        if value == 0 {
            continue;
        }
        // inferno splits on ';' and on the last space: keep both out of frame names.
        let stack = frames
            .root_to_leaf(&sample.location_id)
            .iter()
            .map(|f| f.replace(';', ":").replace(' ', "_"))
            .collect::<Vec<_>>()
            .join(";");
        let stack = if stack.is_empty() {
            "<no stack>".to_string()
        } else {
            stack
        };
        *out.entry(stack).or_insert(0) += value;
    }
    out
}

/// Folded stacks as text lines `stack value`, the input format of flame graph tools.
pub fn folded_text(stacks: &BTreeMap<String, i64>) -> String {
    let mut text = String::new();
    for (stack, value) in stacks {
        text.push_str(stack);
        text.push(' ');
        text.push_str(&value.to_string());
        text.push('\n');
    }
    text
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use flamefleet_proto::pprof::{Function, Line, Sample, ValueType};

    /// Builds a profile from (stack leaf-first, values) pairs with the given sample types.
    pub(crate) fn profile(types: &[(&str, &str)], samples: &[(&[&str], &[i64])]) -> Profile {
        let mut p = Profile {
            string_table: vec![String::new()],
            ..Default::default()
        };
        let intern = |p: &mut Profile, s: &str| -> i64 {
            if let Some(i) = p.string_table.iter().position(|x| x == s) {
                return i as i64;
            }
            p.string_table.push(s.to_string());
            (p.string_table.len() - 1) as i64
        };
        for (t, u) in types {
            let vt = ValueType {
                r#type: intern(&mut p, t),
                unit: intern(&mut p, u),
            };
            p.sample_type.push(vt);
        }
        for (stack, values) in samples {
            let mut ids = Vec::new();
            for name in *stack {
                let name_idx = intern(&mut p, name);
                let fid = match p.function.iter().find(|f| f.name == name_idx) {
                    Some(f) => f.id,
                    None => {
                        let id = p.function.len() as u64 + 1;
                        p.function.push(Function {
                            id,
                            name: name_idx,
                            ..Default::default()
                        });
                        p.location.push(flamefleet_proto::pprof::Location {
                            id,
                            address: 0x1000 * id,
                            line: vec![Line {
                                function_id: id,
                                ..Default::default()
                            }],
                            ..Default::default()
                        });
                        id
                    }
                };
                ids.push(fid);
            }
            p.sample.push(Sample {
                location_id: ids,
                value: values.to_vec(),
                label: vec![],
            });
        }
        p
    }

    #[test]
    fn folded_is_root_to_leaf_and_summed() {
        let p = profile(
            &[("samples", "count"), ("cpu", "nanoseconds")],
            &[
                (&["hot", "work", "main"], &[3, 30]),
                (&["hot", "work", "main"], &[1, 10]),
                (&["cold", "main"], &[1, 10]),
                (&["idle", "main"], &[0, 0]),
            ],
        );
        let idx = value_index(&p);
        assert_eq!(value_type(&p, idx), ("cpu".into(), "nanoseconds".into()));
        let f = folded(&p, idx);
        assert_eq!(f.get("main;work;hot"), Some(&40));
        assert_eq!(f.get("main;cold"), Some(&10));
        assert_eq!(f.len(), 2, "{f:?}");
        assert_eq!(folded_text(&f), "main;cold 10\nmain;work;hot 40\n");
    }

    #[test]
    fn value_index_prefers_default_then_known_types() {
        let mut p = profile(
            &[
                ("alloc_space", "bytes"),
                ("inuse_space", "bytes"),
                ("inuse_objects", "count"),
            ],
            &[],
        );
        assert_eq!(value_index(&p), 1);
        p.string_table.push("inuse_objects".into());
        p.default_sample_type = (p.string_table.len() - 1) as i64;
        assert_eq!(value_index(&p), 2);
        let q = profile(&[("latency", "nanoseconds")], &[]);
        assert_eq!(value_index(&q), 0);
    }

    #[test]
    fn inlined_frames_expand_caller_first() {
        let mut p = profile(&[("samples", "count")], &[(&["leaf", "main"], &[2])]);
        // Make location 1 hold `leaf` inlined into `inl`.
        p.string_table.push("inl".into());
        let name = (p.string_table.len() - 1) as i64;
        p.function.push(Function {
            id: 9,
            name,
            ..Default::default()
        });
        p.location[0].line.push(Line {
            function_id: 9,
            ..Default::default()
        });
        assert_eq!(folded(&p, 0).keys().next().unwrap(), "main;inl;leaf");
    }
}
