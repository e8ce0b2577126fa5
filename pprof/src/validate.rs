//! The invariants pprof readers rely on (and [`merge`](crate::merge()) indexes by), checked
//! so that a decodable but inconsistent message is refused instead of misread later.

use crate::pb::Profile;
use crate::{Error, Result};

/// The IDs of one table, for membership tests. Producers number their tables 1..=n in order
/// (Go's runtime, our builder), which needs no memory at all; anything else is sorted once.
/// [`footprint`](crate::footprint) budgets the sorted form: 8 bytes per ID.
enum Ids {
    Dense(u64),
    Sorted(Vec<u64>),
}

impl Ids {
    fn new(ids: impl ExactSizeIterator<Item = u64> + Clone) -> Self {
        let n = ids.len() as u64;
        if ids.clone().zip(1..).all(|(id, want)| id == want) {
            return Ids::Dense(n);
        }
        let mut sorted: Vec<u64> = ids.collect();
        sorted.sort_unstable();
        Ids::Sorted(sorted)
    }

    fn contains(&self, id: u64) -> bool {
        match self {
            Ids::Dense(n) => (1..=*n).contains(&id),
            Ids::Sorted(ids) => ids.binary_search(&id).is_ok(),
        }
    }

    fn has_zero(&self) -> bool {
        match self {
            Ids::Dense(_) => false,
            Ids::Sorted(ids) => ids.first() == Some(&0),
        }
    }
}

/// Checks that every string index is in range, the string table starts with `""`, every
/// ID is non-zero and every reference resolves, and every sample has one value per
/// sample type.
///
/// # Errors
/// [`Error::Invalid`] naming the first broken invariant.
pub fn validate(p: &Profile) -> Result<()> {
    check(p).map_err(Error::Invalid)
}

fn check(p: &Profile) -> Result<(), String> {
    let strings = p.string_table.len() as i64;
    if p.string_table.first().map(String::as_str) != Some("") {
        return Err("string_table[0] must be the empty string".into());
    }
    let string_ok = |i: i64| (0..strings).contains(&i);
    if p.sample_type.is_empty() {
        return Err("no sample types".into());
    }
    for vt in p.sample_type.iter().chain(p.period_type.iter()) {
        if !string_ok(vt.r#type) || !string_ok(vt.unit) {
            return Err("a value type names a string out of range".into());
        }
    }
    let mappings = Ids::new(p.mapping.iter().map(|m| m.id));
    let functions = Ids::new(p.function.iter().map(|f| f.id));
    let locations = Ids::new(p.location.iter().map(|l| l.id));
    if mappings.has_zero() || functions.has_zero() || locations.has_zero() {
        return Err("id 0 is reserved for mappings, functions and locations".into());
    }
    for m in &p.mapping {
        if !string_ok(m.filename) || !string_ok(m.build_id) {
            return Err(format!("mapping {} names a string out of range", m.id));
        }
    }
    for f in &p.function {
        if !string_ok(f.name) || !string_ok(f.system_name) || !string_ok(f.filename) {
            return Err(format!("function {} names a string out of range", f.id));
        }
    }
    for l in &p.location {
        if l.mapping_id != 0 && !mappings.contains(l.mapping_id) {
            return Err(format!(
                "location {} names unknown mapping {}",
                l.id, l.mapping_id
            ));
        }
        if let Some(line) = l.line.iter().find(|ln| !functions.contains(ln.function_id)) {
            return Err(format!(
                "location {} names unknown function {}",
                l.id, line.function_id
            ));
        }
    }
    for (i, s) in p.sample.iter().enumerate() {
        if s.value.len() != p.sample_type.len() {
            return Err(format!(
                "sample {i} has {} values for {} sample types",
                s.value.len(),
                p.sample_type.len()
            ));
        }
        if let Some(id) = s.location_id.iter().find(|&&id| !locations.contains(id)) {
            return Err(format!("sample {i} names unknown location {id}"));
        }
        if s.label
            .iter()
            .any(|l| !string_ok(l.key) || !string_ok(l.str) || !string_ok(l.num_unit))
        {
            return Err(format!(
                "sample {i} has a label naming a string out of range"
            ));
        }
    }
    let default_ok = p.default_sample_type == 0 || string_ok(p.default_sample_type);
    let comments_ok = p.comment.iter().all(|&c| string_ok(c));
    if !default_ok || !comments_ok {
        return Err("default_sample_type or a comment names a string out of range".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{Function, Line, Location, Sample, ValueType};

    fn reason(p: &Profile) -> String {
        validate(p).unwrap_err().to_string()
    }

    #[test]
    fn validation_refuses_inconsistent_profiles() {
        let mut p = Profile {
            string_table: vec!["".into(), "space".into(), "bytes".into()],
            sample_type: vec![ValueType { r#type: 1, unit: 2 }],
            sample: vec![Sample {
                location_id: vec![],
                value: vec![1],
                label: vec![],
            }],
            ..Default::default()
        };
        assert!(validate(&p).is_ok());
        p.sample[0].location_id.push(9);
        assert!(reason(&p).contains("unknown location 9"));
        p.sample[0].location_id.clear();
        p.sample[0].value.push(2);
        assert!(reason(&p).contains("2 values for 1 sample types"));
        p.sample[0].value.pop();
        p.sample_type[0].unit = 7;
        assert!(validate(&p).is_err());
        p.sample_type[0].unit = 2;
        p.string_table[0] = "x".into();
        assert!(validate(&p).is_err());
    }

    #[test]
    fn ids_in_any_order_resolve_and_zero_is_refused() {
        let mut p = Profile {
            string_table: vec!["".into(), "f".into()],
            sample_type: vec![ValueType { r#type: 1, unit: 1 }],
            function: vec![Function {
                id: 7,
                name: 1,
                ..Default::default()
            }],
            location: [30, 10, 20]
                .map(|id| Location {
                    id,
                    line: vec![Line {
                        function_id: 7,
                        ..Default::default()
                    }],
                    ..Default::default()
                })
                .into(),
            sample: vec![Sample {
                location_id: vec![20, 10, 30],
                value: vec![1],
                label: vec![],
            }],
            ..Default::default()
        };
        assert!(validate(&p).is_ok());
        p.location[0].line[0].function_id = 8;
        assert!(reason(&p).contains("location 30 names unknown function 8"));
        p.location[0].line[0].function_id = 7;
        p.location[1].id = 0;
        assert!(reason(&p).contains("id 0 is reserved"));
    }
}
