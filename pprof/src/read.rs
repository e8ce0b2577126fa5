//! Reading a decoded profile: strings by index, sample types, value totals, and stacks as
//! function names.

use std::collections::HashMap;

use crate::pb::{Location, Mapping, Profile};

/// The string at `index` of the profile's string table (`""` when out of range).
pub fn string(profile: &Profile, index: i64) -> &str {
    usize::try_from(index)
        .ok()
        .and_then(|i| profile.string_table.get(i))
        .map_or("", String::as_str)
}

/// The sample types of a profile as `type/unit` strings, in order.
pub fn sample_types(profile: &Profile) -> Vec<String> {
    profile
        .sample_type
        .iter()
        .map(|vt| {
            format!(
                "{}/{}",
                string(profile, vt.r#type),
                string(profile, vt.unit)
            )
        })
        .collect()
}

/// The total of sample type `kind` (with unit `unit`) over the profile's samples; `None`
/// when the profile has no such sample type. Negative values count as 0.
pub fn value_total(profile: &Profile, kind: &str, unit: &str) -> Option<u64> {
    let index = profile
        .sample_type
        .iter()
        .position(|st| string(profile, st.r#type) == kind && string(profile, st.unit) == unit)?;
    Some(
        profile
            .sample
            .iter()
            .filter_map(|s| s.value.get(index))
            .map(|&v| u64::try_from(v).unwrap_or(0))
            .fold(0u64, u64::saturating_add),
    )
}

/// The `samples` of a heap profile: the allocations it accounts for, i.e. its
/// `alloc_objects/count` total (`inuse_objects/count` where it has no alloc types); 0 when
/// it counts no objects. (Not the number of pprof rows: one row is one stack.)
pub fn allocation_count(profile: &Profile) -> u64 {
    value_total(profile, "alloc_objects", "count")
        .or_else(|| value_total(profile, "inuse_objects", "count"))
        .unwrap_or(0)
}

/// Resolves a sample's location IDs to function names.
pub struct Frames<'a> {
    profile: &'a Profile,
    locations: HashMap<u64, &'a Location>,
    functions: HashMap<u64, &'a str>,
    mappings: HashMap<u64, &'a Mapping>,
}

impl<'a> Frames<'a> {
    /// Indexes the profile's locations, functions and mappings.
    pub fn new(profile: &'a Profile) -> Self {
        Self {
            profile,
            locations: profile.location.iter().map(|l| (l.id, l)).collect(),
            functions: profile
                .function
                .iter()
                .map(|f| (f.id, string(profile, f.name)))
                .collect(),
            mappings: profile.mapping.iter().map(|m| (m.id, m)).collect(),
        }
    }

    /// The function names of one sample's stack, root first, leaf last (inlined frames
    /// expanded; an unsymbolized frame named by its module and its offset in the file,
    /// see [`Frames::unsymbolized`]).
    pub fn root_to_leaf(&self, location_ids: &[u64]) -> Vec<String> {
        let mut out = Vec::with_capacity(location_ids.len());
        for id in location_ids.iter().rev() {
            let Some(loc) = self.locations.get(id) else {
                out.push(format!("<unknown location {id}>"));
                continue;
            };
            if loc.line.is_empty() {
                out.push(self.unsymbolized(loc));
                continue;
            }
            // pprof lists a location's lines innermost (inlined) first.
            for line in loc.line.iter().rev() {
                let name = self.functions.get(&line.function_id).copied().unwrap_or("");
                out.push(if name.is_empty() {
                    self.unsymbolized(loc)
                } else {
                    name.to_string()
                });
            }
        }
        out
    }

    /// The name of a frame without a function: `[libc.so.6+0x9a1f5]`, its module's file
    /// name (as `go tool pprof` shows such a frame, `[libc.so.6]`) and its offset in that
    /// file, the same in every process whatever the load address (so frames of one
    /// instruction merge, and `addr2line -e libc.so.6 0x9a1f5` finds it); the bare address
    /// when the profile names no module.
    pub fn unsymbolized(&self, loc: &Location) -> String {
        let module = self
            .mappings
            .get(&loc.mapping_id)
            .map(|m| (*m, string(self.profile, m.filename)))
            .filter(|(_, file)| !file.is_empty());
        match module {
            Some((m, file)) => {
                let base = file.rsplit('/').next().unwrap_or(file);
                let base = base.trim_start_matches('[').trim_end_matches(']');
                let offset = loc
                    .address
                    .checked_sub(m.memory_start)
                    .map_or(loc.address, |o| o.saturating_add(m.file_offset));
                format!("[{base}+{offset:#x}]")
            }
            None => format!("{:#x}", loc.address),
        }
    }

    /// The profile these frames belong to.
    pub fn profile(&self) -> &'a Profile {
        self.profile
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Frame, FrameLine, ProfileBuilder};

    #[test]
    fn totals_and_stacks_read_back_what_the_builder_wrote() {
        let mut b = ProfileBuilder::new(&[("alloc_objects", "count"), ("alloc_space", "bytes")]);
        let f = |address, name: &str| Frame {
            address,
            mapping: None,
            lines: vec![FrameLine {
                function: name.into(),
                file: String::new(),
                line: 0,
            }],
        };
        let unnamed = Frame {
            address: 0xabc,
            mapping: None,
            lines: vec![],
        };
        let libc = b.add_mapping(&crate::MappingInfo {
            start: 0x7fed_0970_0000,
            limit: 0x7fed_09a0_0000,
            file_offset: 0x2_8000,
            file: "/usr/lib/x86_64-linux-gnu/libc.so.6".into(),
            build_id: String::new(),
            has_functions: false,
        });
        let in_libc = Frame {
            address: 0x7fed_097a_91f5,
            mapping: Some(libc),
            lines: vec![],
        };
        b.add_sample(&[f(1, "leaf"), f(2, "main")], &[3, 300], &[]);
        b.add_sample(&[unnamed, f(2, "main")], &[2, -5], &[]);
        b.add_sample(&[in_libc, f(2, "main")], &[1, 10], &[]);
        let p = b.build();
        assert_eq!(
            sample_types(&p),
            ["alloc_objects/count", "alloc_space/bytes"]
        );
        assert_eq!(value_total(&p, "alloc_space", "bytes"), Some(310));
        assert_eq!(value_total(&p, "inuse_space", "bytes"), None);
        assert_eq!(allocation_count(&p), 6);
        let frames = Frames::new(&p);
        assert_eq!(
            frames.root_to_leaf(&p.sample[0].location_id),
            ["main", "leaf"]
        );
        assert_eq!(
            frames.root_to_leaf(&p.sample[1].location_id),
            ["main", "0xabc"],
            "no module: the address"
        );
        // Module and file offset: 0x7fed097a91f5 - 0x7fed09700000 + 0x28000.
        assert_eq!(
            frames.root_to_leaf(&p.sample[2].location_id),
            ["main", "[libc.so.6+0xd11f5]"]
        );
        assert_eq!(frames.root_to_leaf(&[99]), ["<unknown location 99>"]);
        assert_eq!(string(&p, -1), "");
        assert_eq!(string(&p, 1_000), "");
    }
}
