//! pprof to OpenTelemetry profiles (`opentelemetry.proto.profiles.v1development`) and back.
//!
//! The OTLP messages are those of the `opentelemetry-proto` crate, generated from
//! opentelemetry-proto 1.10.0: the shape the OpenTelemetry Collector v0.165 reads (its pdata
//! v1.71.0 has the same messages and field numbers: one sample type per `Profile`, a shared
//! `ProfilesDictionary` with a stack table and `KeyValueAndUnit` attributes).
//!
//! [`to_otlp`] keeps everything pprof holds that a profile reader uses:
//!
//! - every sample type becomes one OTLP `Profile` with that `sample_type`, the same samples
//!   (one value each) and the pprof `period_type`, `period`, `time_nanos` and
//!   `duration_nanos`;
//! - stacks (leaf first, as in pprof), locations (address, mapping, inlined lines with
//!   function, line and column), functions (name, system name, file, start line) and
//!   mappings (range, offset, file, build ID) go to the dictionary;
//! - every sample label becomes a sample attribute under the same key (numeric labels keep
//!   their unit);
//! - what has no OTLP field goes to attributes of the `pprof.*` semantic conventions:
//!   comments, drop/keep frames, the default sample type, mapping flags, folded locations.
//!
//! Samples are grouped by whose they are (their `namespace`, `pod` and `container` labels,
//! see [`Owner`]): each owner becomes one `ResourceProfiles` whose resource attributes the
//! caller gives (the exporter adds the Kubernetes ones it knows for that pod). [`to_pprof`]
//! turns such a request back into one pprof profile, which is how the tests prove nothing
//! was lost.

use std::collections::HashMap;
use std::hash::Hash;

use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;
use opentelemetry_proto::tonic::common::v1::{
    AnyValue, ArrayValue, InstrumentationScope, KeyValue, any_value,
};
use opentelemetry_proto::tonic::profiles::v1development as otlp;
use opentelemetry_proto::tonic::resource::v1::Resource;

use crate::pb;
use crate::{Error, Result};

/// The OTLP profiles service (`opentelemetry.proto.collector.profiles.v1development`): the
/// request message and the gRPC client.
pub use opentelemetry_proto::tonic::collector::profiles::v1development as collector;
/// The OTLP common messages (`KeyValue`, `AnyValue`).
pub use opentelemetry_proto::tonic::common::v1 as common;
/// The OTLP profiles messages (`opentelemetry.proto.profiles.v1development`).
pub use opentelemetry_proto::tonic::profiles::v1development as messages;

/// The sample labels that say whose a sample is (the agent's label contract).
pub const NAMESPACE_LABEL: &str = "namespace";
/// See [`NAMESPACE_LABEL`].
pub const POD_LABEL: &str = "pod";
/// See [`NAMESPACE_LABEL`].
pub const CONTAINER_LABEL: &str = "container";

/// Profile attributes for what pprof has and OTLP has no field for (semantic conventions'
/// `pprof.*` attributes).
const COMMENT: &str = "pprof.profile.comment";
const DROP_FRAMES: &str = "pprof.profile.drop_frames";
const KEEP_FRAMES: &str = "pprof.profile.keep_frames";
const DEFAULT_SAMPLE_TYPE: &str = "pprof.scope.default_sample_type";
const HAS_FUNCTIONS: &str = "pprof.mapping.has_functions";
const HAS_FILENAMES: &str = "pprof.mapping.has_filenames";
const HAS_LINE_NUMBERS: &str = "pprof.mapping.has_line_numbers";
const HAS_INLINE_FRAMES: &str = "pprof.mapping.has_inline_frames";
const IS_FOLDED: &str = "pprof.location.is_folded";
/// Build IDs: GNU build IDs are hex; anything else (Go's `go build` IDs) is kept as Go's.
const BUILD_ID_GNU: &str = "process.executable.build_id.gnu";
const BUILD_ID_GO: &str = "process.executable.build_id.go";

/// Whose samples a resource holds: the values of a sample's `namespace`, `pod` and
/// `container` labels (`None` when it has none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner {
    /// The `namespace` label.
    pub namespace: Option<String>,
    /// The `pod` label.
    pub pod: Option<String>,
    /// The `container` label.
    pub container: Option<String>,
}

/// What an export adds around the profile.
#[derive(Debug, Clone)]
pub struct Options {
    /// The instrumentation scope (`flamefleet`) and its version.
    pub scope_name: String,
    /// See [`Options::scope_name`].
    pub scope_version: String,
    /// Makes the profiles' IDs: each profile's ID is this with its ordinal in the request
    /// mixed into the last bytes (an all-zero ID is invalid in OTLP, so the caller gives a
    /// non-zero one, e.g. from the artifact's SHA-256).
    pub profile_id: [u8; 16],
}

/// A string table with `""` at index 0.
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i32>,
}

impl Strings {
    fn new() -> Self {
        let mut s = Strings::default();
        s.get("");
        s
    }

    fn get(&mut self, s: &str) -> i32 {
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as i32;
        self.table.push(s.to_owned());
        self.index.insert(s.to_owned(), i);
        i
    }
}

/// A deduplicated table whose entry 0 is the zero value, as OTLP requires.
struct Table<K, V> {
    entries: Vec<V>,
    index: HashMap<K, i32>,
}

impl<K: Eq + Hash, V: Default> Table<K, V> {
    fn new() -> Self {
        Table {
            entries: vec![V::default()],
            index: HashMap::new(),
        }
    }

    fn get(&mut self, key: K, make: impl FnOnce() -> V) -> i32 {
        if let Some(&i) = self.index.get(&key) {
            return i;
        }
        let i = self.entries.len() as i32;
        self.entries.push(make());
        self.index.insert(key, i);
        i
    }
}

/// An attribute's identity in the dictionary's attribute table.
#[derive(PartialEq, Eq, Hash)]
enum AttrValue {
    Str(String),
    Int(i64),
    Bool(bool),
    Strs(Vec<String>),
}

struct Dictionary {
    strings: Strings,
    attributes: Table<(i32, AttrValue, i32), otlp::KeyValueAndUnit>,
}

impl Dictionary {
    fn attribute(&mut self, key: &str, value: AttrValue, unit: &str) -> i32 {
        let key = self.strings.get(key);
        let unit = self.strings.get(unit);
        let any = match &value {
            AttrValue::Str(s) => any_value::Value::StringValue(s.clone()),
            AttrValue::Int(n) => any_value::Value::IntValue(*n),
            AttrValue::Bool(b) => any_value::Value::BoolValue(*b),
            AttrValue::Strs(v) => any_value::Value::ArrayValue(ArrayValue {
                values: v
                    .iter()
                    .map(|s| AnyValue {
                        value: Some(any_value::Value::StringValue(s.clone())),
                    })
                    .collect(),
            }),
        };
        self.attributes
            .get((key, value, unit), || otlp::KeyValueAndUnit {
                key_strindex: key,
                value: Some(AnyValue { value: Some(any) }),
                unit_strindex: unit,
            })
    }
}

fn string_at(p: &pb::Profile, i: i64) -> &str {
    crate::read::string(p, i)
}

/// Converts a (validated) pprof profile into one OTLP export request: one
/// `ResourceProfiles` per [`Owner`] (in owner order) whose resource attributes are
/// `resource(owner)`, holding one `Profile` per sample type.
///
/// # Errors
/// [`Error::Invalid`] when the profile is inconsistent (run [`validate`](crate::validate())
/// first, as [`decode`](crate::decode()) does) or has more entries than OTLP's 32-bit
/// indices address.
pub fn to_otlp(
    profile: &pb::Profile,
    mut resource: impl FnMut(&Owner) -> Vec<KeyValue>,
    options: &Options,
) -> Result<ExportProfilesServiceRequest> {
    crate::validate(profile)?;
    let too_many = |what: &str| Error::Invalid(format!("more {what} than OTLP can index (2^31)"));
    if profile.location.len() >= i32::MAX as usize
        || profile.function.len() >= i32::MAX as usize
        || profile.mapping.len() >= i32::MAX as usize
        || profile.string_table.len() >= i32::MAX as usize
    {
        return Err(too_many("table entries"));
    }
    let s = |i: i64| string_at(profile, i);
    let mut dict = Dictionary {
        strings: Strings::new(),
        attributes: Table::new(),
    };

    let mut mappings: Vec<otlp::Mapping> = vec![otlp::Mapping::default()];
    let mut mapping_index: HashMap<u64, i32> = HashMap::new();
    for m in &profile.mapping {
        let mut attribute_indices = Vec::new();
        let build_id = s(m.build_id);
        if !build_id.is_empty() {
            let key = if build_id.bytes().all(|b| b.is_ascii_hexdigit()) {
                BUILD_ID_GNU
            } else {
                BUILD_ID_GO
            };
            attribute_indices.push(dict.attribute(key, AttrValue::Str(build_id.into()), ""));
        }
        for (flag, key) in [
            (m.has_functions, HAS_FUNCTIONS),
            (m.has_filenames, HAS_FILENAMES),
            (m.has_line_numbers, HAS_LINE_NUMBERS),
            (m.has_inline_frames, HAS_INLINE_FRAMES),
        ] {
            if flag {
                attribute_indices.push(dict.attribute(key, AttrValue::Bool(true), ""));
            }
        }
        mapping_index.insert(m.id, mappings.len() as i32);
        mappings.push(otlp::Mapping {
            memory_start: m.memory_start,
            memory_limit: m.memory_limit,
            file_offset: m.file_offset,
            filename_strindex: dict.strings.get(s(m.filename)),
            attribute_indices,
        });
    }

    let mut functions: Vec<otlp::Function> = vec![otlp::Function::default()];
    let mut function_index: HashMap<u64, i32> = HashMap::new();
    for f in &profile.function {
        function_index.insert(f.id, functions.len() as i32);
        functions.push(otlp::Function {
            name_strindex: dict.strings.get(s(f.name)),
            system_name_strindex: dict.strings.get(s(f.system_name)),
            filename_strindex: dict.strings.get(s(f.filename)),
            start_line: f.start_line,
        });
    }

    let mut locations: Vec<otlp::Location> = vec![otlp::Location::default()];
    let mut location_index: HashMap<u64, i32> = HashMap::new();
    for l in &profile.location {
        let lines = l
            .line
            .iter()
            .map(|line| otlp::Line {
                // validate() checked every function ID resolves.
                function_index: function_index.get(&line.function_id).copied().unwrap_or(0),
                line: line.line,
                column: line.column,
            })
            .collect();
        let attribute_indices = if l.is_folded {
            vec![dict.attribute(IS_FOLDED, AttrValue::Bool(true), "")]
        } else {
            Vec::new()
        };
        location_index.insert(l.id, locations.len() as i32);
        locations.push(otlp::Location {
            mapping_index: mapping_index.get(&l.mapping_id).copied().unwrap_or(0),
            address: l.address,
            lines,
            attribute_indices,
        });
    }

    let mut stacks: Table<Vec<i32>, otlp::Stack> = Table::new();
    // Samples by owner, in the order owners first appear; each sample as (stack, attributes,
    // index in the pprof sample list).
    let mut by_owner: HashMap<Owner, Vec<(i32, Vec<i32>, usize)>> = HashMap::new();
    for (n, sample) in profile.sample.iter().enumerate() {
        let stack: Vec<i32> = sample
            .location_id
            .iter()
            .map(|id| location_index.get(id).copied().unwrap_or(0))
            .collect();
        let stack_index = stacks.get(stack.clone(), || otlp::Stack {
            location_indices: stack,
        });
        let mut owner = Owner::default();
        let mut attribute_indices = Vec::with_capacity(sample.label.len());
        for label in &sample.label {
            let key = s(label.key);
            if label.str != 0 {
                let value = s(label.str);
                match key {
                    NAMESPACE_LABEL => owner.namespace = Some(value.to_owned()),
                    POD_LABEL => owner.pod = Some(value.to_owned()),
                    CONTAINER_LABEL => owner.container = Some(value.to_owned()),
                    _ => {}
                }
                attribute_indices.push(dict.attribute(key, AttrValue::Str(value.into()), ""));
            } else {
                attribute_indices.push(dict.attribute(
                    key,
                    AttrValue::Int(label.num),
                    s(label.num_unit),
                ));
            }
        }
        by_owner
            .entry(owner)
            .or_default()
            .push((stack_index, attribute_indices, n));
    }
    let mut owners: Vec<Owner> = by_owner.keys().cloned().collect();
    owners.sort();

    let mut profile_attributes = Vec::new();
    let comments: Vec<String> = profile.comment.iter().map(|&i| s(i).to_owned()).collect();
    if !comments.is_empty() {
        profile_attributes.push(dict.attribute(COMMENT, AttrValue::Strs(comments), ""));
    }
    for (index, key) in [
        (profile.drop_frames, DROP_FRAMES),
        (profile.keep_frames, KEEP_FRAMES),
    ] {
        if index != 0 {
            profile_attributes.push(dict.attribute(key, AttrValue::Str(s(index).into()), ""));
        }
    }
    let period_type = profile.period_type.as_ref().map(|vt| otlp::ValueType {
        type_strindex: dict.strings.get(s(vt.r#type)),
        unit_strindex: dict.strings.get(s(vt.unit)),
    });
    let sample_types: Vec<otlp::ValueType> = profile
        .sample_type
        .iter()
        .map(|vt| otlp::ValueType {
            type_strindex: dict.strings.get(s(vt.r#type)),
            unit_strindex: dict.strings.get(s(vt.unit)),
        })
        .collect();
    let scope = InstrumentationScope {
        name: options.scope_name.clone(),
        version: options.scope_version.clone(),
        attributes: if profile.default_sample_type != 0 {
            vec![KeyValue {
                key: DEFAULT_SAMPLE_TYPE.into(),
                value: Some(AnyValue {
                    value: Some(any_value::Value::StringValue(
                        s(profile.default_sample_type).into(),
                    )),
                }),
                key_strindex: 0,
            }]
        } else {
            Vec::new()
        },
        dropped_attributes_count: 0,
    };

    let mut ordinal: u32 = 0;
    let mut resource_profiles = Vec::with_capacity(owners.len());
    for owner in owners {
        let samples = &by_owner[&owner];
        let mut profiles = Vec::with_capacity(sample_types.len());
        for (t, sample_type) in sample_types.iter().enumerate() {
            ordinal += 1;
            let mut profile_id = options.profile_id;
            for (b, o) in profile_id[12..].iter_mut().zip(ordinal.to_be_bytes()) {
                *b ^= o;
            }
            profiles.push(otlp::Profile {
                sample_type: Some(*sample_type),
                samples: samples
                    .iter()
                    .map(|(stack_index, attribute_indices, n)| otlp::Sample {
                        stack_index: *stack_index,
                        attribute_indices: attribute_indices.clone(),
                        link_index: 0,
                        values: vec![profile.sample[*n].value[t]],
                        timestamps_unix_nano: Vec::new(),
                    })
                    .collect(),
                time_unix_nano: u64::try_from(profile.time_nanos).unwrap_or(0),
                duration_nano: u64::try_from(profile.duration_nanos).unwrap_or(0),
                period_type,
                period: profile.period,
                profile_id: profile_id.to_vec(),
                dropped_attributes_count: 0,
                original_payload_format: String::new(),
                original_payload: Vec::new(),
                attribute_indices: profile_attributes.clone(),
            });
        }
        resource_profiles.push(otlp::ResourceProfiles {
            resource: Some(Resource {
                attributes: resource(&owner),
                dropped_attributes_count: 0,
                entity_refs: Vec::new(),
            }),
            scope_profiles: vec![otlp::ScopeProfiles {
                scope: Some(scope.clone()),
                profiles,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        });
    }
    if dict.attributes.entries.len() >= i32::MAX as usize
        || dict.strings.table.len() >= i32::MAX as usize
    {
        return Err(too_many("attributes or strings"));
    }
    Ok(ExportProfilesServiceRequest {
        resource_profiles,
        dictionary: Some(otlp::ProfilesDictionary {
            mapping_table: mappings,
            location_table: locations,
            function_table: functions,
            link_table: vec![otlp::Link::default()],
            string_table: dict.strings.table,
            attribute_table: dict.attributes.entries,
            stack_table: stacks.entries,
        }),
    })
}

/// Converts like [`to_otlp`], into as many requests as keep each one's encoded size at most
/// `max_bytes`: an OTLP endpoint refuses larger messages (the OpenTelemetry Collector's gRPC
/// receiver takes 4 MiB by default, `max_recv_msg_size_mib`). A profile that fits is the one
/// request [`to_otlp`] makes. One that does not is split by its samples into parts of
/// consecutive samples, each part with only the table entries its samples use (a part whose
/// request is still too large is halved again): every sample is in exactly one part, so the
/// parts' sums per sample type are the profile's, and each part keeps the profile's time,
/// duration, period and attributes. The parts' profiles have IDs of their own (the caller's
/// ID with the part's number mixed into bytes 8..12).
///
/// # Errors
/// As [`to_otlp`]; [`Error::Invalid`] when one sample alone (its stack, labels and the table
/// entries they use) makes a request larger than `max_bytes`.
pub fn to_otlp_requests(
    profile: &pb::Profile,
    mut resource: impl FnMut(&Owner) -> Vec<KeyValue>,
    options: &Options,
    max_bytes: usize,
) -> Result<Vec<ExportProfilesServiceRequest>> {
    use prost::Message as _;

    let whole = to_otlp(profile, &mut resource, options)?;
    let size = whole.encoded_len();
    if size <= max_bytes {
        return Ok(vec![whole]);
    }
    drop(whole);
    // One part more than the size asks for: each part repeats the table entries it shares
    // with the others.
    let wanted = size.div_ceil(max_bytes.max(1)) + 1;
    let per_part = profile.sample.len().div_ceil(wanted).max(1);
    let mut pending: Vec<pb::Profile> = consecutive(profile, per_part);
    pending.reverse();
    let mut out = Vec::new();
    let mut part_number: u32 = 0;
    while let Some(part) = pending.pop() {
        let mut part_options = options.clone();
        part_number += 1;
        for (b, n) in part_options.profile_id[8..12]
            .iter_mut()
            .zip(part_number.to_be_bytes())
        {
            *b ^= n;
        }
        let request = to_otlp(&part, &mut resource, &part_options)?;
        let part_size = request.encoded_len();
        if part_size <= max_bytes {
            out.push(request);
            continue;
        }
        if part.sample.len() <= 1 {
            return Err(Error::Invalid(format!(
                "one sample makes an OTLP request of {part_size} bytes, more than the \
                 {max_bytes} bytes a request may have"
            )));
        }
        part_number -= 1;
        let mut halves = consecutive(&part, part.sample.len().div_ceil(2));
        halves.reverse();
        pending.extend(halves);
    }
    Ok(out)
}

/// `profile` in parts of `per_part` consecutive samples (the last may have fewer), each with
/// only the table entries it uses.
fn consecutive(profile: &pb::Profile, per_part: usize) -> Vec<pb::Profile> {
    let mut n = 0usize;
    crate::split(profile, |_, _| {
        let part = n / per_part;
        n += 1;
        Some(part)
    })
    .into_values()
    .collect()
}

/// Resolves the string-table references of resource and scope attributes (`key_strindex`,
/// `string_value_strindex`) into plain keys and string values, in place. Senders may write
/// either form; the OpenTelemetry Collector (v0.165) writes references, so its output reads
/// back with empty keys until resolved. [`to_pprof`] and attribute checks want plain ones.
///
/// # Errors
/// [`Error::Invalid`] when a reference points outside the string table.
pub fn resolve_references(
    resource_profiles: &mut [otlp::ResourceProfiles],
    dictionary: &otlp::ProfilesDictionary,
) -> Result<()> {
    fn value(v: &mut AnyValue, table: &[String]) -> Result<()> {
        match v.value.as_mut() {
            Some(any_value::Value::StringValueStrindex(i)) => {
                let s = usize::try_from(*i)
                    .ok()
                    .and_then(|i| table.get(i))
                    .ok_or_else(|| {
                        bad(format!(
                            "string_value_strindex {i} outside the string table"
                        ))
                    })?;
                v.value = Some(any_value::Value::StringValue(s.clone()));
            }
            Some(any_value::Value::ArrayValue(a)) => {
                for v in &mut a.values {
                    value(v, table)?;
                }
            }
            Some(any_value::Value::KvlistValue(l)) => key_values(&mut l.values, table)?,
            _ => {}
        }
        Ok(())
    }
    fn key_values(kvs: &mut [KeyValue], table: &[String]) -> Result<()> {
        for kv in kvs {
            if kv.key_strindex != 0 {
                let i = kv.key_strindex;
                kv.key = usize::try_from(i)
                    .ok()
                    .and_then(|i| table.get(i))
                    .ok_or_else(|| bad(format!("key_strindex {i} outside the string table")))?
                    .clone();
                kv.key_strindex = 0;
            }
            if let Some(v) = kv.value.as_mut() {
                value(v, table)?;
            }
        }
        Ok(())
    }
    let table = &dictionary.string_table;
    for rp in resource_profiles {
        if let Some(resource) = rp.resource.as_mut() {
            key_values(&mut resource.attributes, table)?;
        }
        for sp in &mut rp.scope_profiles {
            if let Some(scope) = sp.scope.as_mut() {
                key_values(&mut scope.attributes, table)?;
            }
        }
    }
    Ok(())
}

/// One pprof sample being rebuilt: stack index, attribute indices, (type, value) pairs.
type Row = (i32, Vec<i32>, Vec<(usize, i64)>);

/// Why an OTLP message could not be read back as pprof.
fn bad(what: impl Into<String>) -> Error {
    Error::Invalid(format!("OTLP profiles: {}", what.into()))
}

/// Reads every profile of an OTLP export (as the Collector's file exporter writes it, a
/// `ProfilesData`: resource profiles and their dictionary) back into one pprof profile:
/// sample types in the order they first appear, samples with equal stack and attributes
/// in one resource joined into one pprof sample with a value per type, attributes as
/// labels. What [`to_otlp`] wrote converts back to the profile it came from, up to the order
/// of the tables.
///
/// # Errors
/// [`Error::Invalid`] when an index points outside its table or a profile has no sample
/// type.
pub fn to_pprof(
    resource_profiles: &[otlp::ResourceProfiles],
    dictionary: &otlp::ProfilesDictionary,
) -> Result<pb::Profile> {
    let d = dictionary;
    let string = |i: i32| -> Result<&str> {
        usize::try_from(i)
            .ok()
            .and_then(|i| d.string_table.get(i))
            .map(String::as_str)
            .ok_or_else(|| bad(format!("string index {i} outside the string table")))
    };
    let mut out = pb::Profile {
        string_table: vec![String::new()],
        ..Default::default()
    };
    let mut strings: HashMap<String, i64> = HashMap::from([(String::new(), 0)]);
    let mut intern = |out: &mut pb::Profile, s: &str| -> i64 {
        if let Some(&i) = strings.get(s) {
            return i;
        }
        let i = out.string_table.len() as i64;
        out.string_table.push(s.to_owned());
        strings.insert(s.to_owned(), i);
        i
    };
    let attribute = |i: i32| -> Result<&otlp::KeyValueAndUnit> {
        usize::try_from(i)
            .ok()
            .and_then(|i| d.attribute_table.get(i))
            .ok_or_else(|| bad(format!("attribute index {i} outside the attribute table")))
    };
    let attr_bool = |indices: &[i32], key: &str| -> Result<bool> {
        for &i in indices {
            let a = attribute(i)?;
            if string(a.key_strindex)? == key {
                return Ok(matches!(
                    a.value.as_ref().and_then(|v| v.value.as_ref()),
                    Some(any_value::Value::BoolValue(true))
                ));
            }
        }
        Ok(false)
    };
    let attr_str = |indices: &[i32], keys: &[&str]| -> Result<Option<String>> {
        for &i in indices {
            let a = attribute(i)?;
            if keys.contains(&string(a.key_strindex)?)
                && let Some(any_value::Value::StringValue(v)) =
                    a.value.as_ref().and_then(|v| v.value.as_ref())
            {
                return Ok(Some(v.clone()));
            }
        }
        Ok(None)
    };

    // Tables: pprof IDs are OTLP indices (entry 0 is OTLP's zero value, and ID 0 means
    // "none" in pprof).
    for (i, m) in d.mapping_table.iter().enumerate().skip(1) {
        let build_id = attr_str(&m.attribute_indices, &[BUILD_ID_GNU, BUILD_ID_GO])?;
        let filename = intern(&mut out, string(m.filename_strindex)?);
        let build_id = intern(&mut out, build_id.as_deref().unwrap_or(""));
        out.mapping.push(pb::Mapping {
            id: i as u64,
            memory_start: m.memory_start,
            memory_limit: m.memory_limit,
            file_offset: m.file_offset,
            filename,
            build_id,
            has_functions: attr_bool(&m.attribute_indices, HAS_FUNCTIONS)?,
            has_filenames: attr_bool(&m.attribute_indices, HAS_FILENAMES)?,
            has_line_numbers: attr_bool(&m.attribute_indices, HAS_LINE_NUMBERS)?,
            has_inline_frames: attr_bool(&m.attribute_indices, HAS_INLINE_FRAMES)?,
        });
    }
    for (i, f) in d.function_table.iter().enumerate().skip(1) {
        let name = intern(&mut out, string(f.name_strindex)?);
        let system_name = intern(&mut out, string(f.system_name_strindex)?);
        let filename = intern(&mut out, string(f.filename_strindex)?);
        out.function.push(pb::Function {
            id: i as u64,
            name,
            system_name,
            filename,
            start_line: f.start_line,
        });
    }
    let in_range = |i: i32, len: usize, what: &str| -> Result<u64> {
        match usize::try_from(i) {
            Ok(u) if u < len => Ok(u as u64),
            _ => Err(bad(format!("{what} index {i} outside its table of {len}"))),
        }
    };
    for (i, l) in d.location_table.iter().enumerate().skip(1) {
        let mut line = Vec::with_capacity(l.lines.len());
        for ln in &l.lines {
            line.push(pb::Line {
                function_id: in_range(ln.function_index, d.function_table.len(), "function")?,
                line: ln.line,
                column: ln.column,
            });
        }
        out.location.push(pb::Location {
            id: i as u64,
            mapping_id: in_range(l.mapping_index, d.mapping_table.len(), "mapping")?,
            address: l.address,
            line,
            is_folded: attr_bool(&l.attribute_indices, IS_FOLDED)?,
        });
    }

    // Sample types, and samples keyed by (resource, stack, attributes).
    let mut types: Vec<(String, String)> = Vec::new();
    let mut rows: Vec<Row> = Vec::new();
    let mut row_of: HashMap<(usize, i32, Vec<i32>), usize> = HashMap::new();
    let mut first: Option<&otlp::Profile> = None;
    for (r, rp) in resource_profiles.iter().enumerate() {
        for sp in &rp.scope_profiles {
            if let Some(default) = sp.scope.as_ref().and_then(|scope| {
                scope
                    .attributes
                    .iter()
                    .find_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
                        any_value::Value::StringValue(v) if kv.key == DEFAULT_SAMPLE_TYPE => {
                            Some(v.clone())
                        }
                        _ => None,
                    })
            }) {
                out.default_sample_type = intern(&mut out, &default);
            }
            for p in &sp.profiles {
                first.get_or_insert(p);
                let vt = p
                    .sample_type
                    .as_ref()
                    .ok_or_else(|| bad("a profile has no sample_type"))?;
                let key = (
                    string(vt.type_strindex)?.to_owned(),
                    string(vt.unit_strindex)?.to_owned(),
                );
                let t = match types.iter().position(|k| *k == key) {
                    Some(t) => t,
                    None => {
                        types.push(key);
                        types.len() - 1
                    }
                };
                for sample in &p.samples {
                    in_range(sample.stack_index, d.stack_table.len(), "stack")?;
                    let k = (r, sample.stack_index, sample.attribute_indices.clone());
                    let row = *row_of.entry(k).or_insert_with(|| {
                        rows.push((
                            sample.stack_index,
                            sample.attribute_indices.clone(),
                            Vec::new(),
                        ));
                        rows.len() - 1
                    });
                    let sum: i64 = sample.values.iter().sum();
                    rows[row].2.push((t, sum));
                }
            }
        }
    }
    for (kind, unit) in &types {
        let vt = pb::ValueType {
            r#type: intern(&mut out, kind),
            unit: intern(&mut out, unit),
        };
        out.sample_type.push(vt);
    }
    for (stack_index, attribute_indices, values) in rows {
        let stack = &d.stack_table[stack_index as usize];
        let mut location_id = Vec::with_capacity(stack.location_indices.len());
        for &l in &stack.location_indices {
            location_id.push(in_range(l, d.location_table.len(), "location")?);
        }
        let mut value = vec![0i64; types.len()];
        for (t, v) in values {
            value[t] += v;
        }
        let mut label = Vec::with_capacity(attribute_indices.len());
        for &i in &attribute_indices {
            let a = attribute(i)?;
            let key = intern(&mut out, string(a.key_strindex)?);
            match a.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(v)) => {
                    let str = intern(&mut out, v);
                    label.push(pb::Label {
                        key,
                        str,
                        ..Default::default()
                    });
                }
                Some(any_value::Value::IntValue(n)) => {
                    let num_unit = intern(&mut out, string(a.unit_strindex)?);
                    label.push(pb::Label {
                        key,
                        num: *n,
                        num_unit,
                        ..Default::default()
                    });
                }
                other => {
                    return Err(bad(format!(
                        "sample attribute {} has a value pprof labels cannot hold: {other:?}",
                        string(a.key_strindex)?
                    )));
                }
            }
        }
        out.sample.push(pb::Sample {
            location_id,
            value,
            label,
        });
    }
    if let Some(p) = first {
        out.time_nanos = i64::try_from(p.time_unix_nano).unwrap_or(i64::MAX);
        out.duration_nanos = i64::try_from(p.duration_nano).unwrap_or(i64::MAX);
        out.period = p.period;
        if let Some(vt) = &p.period_type {
            out.period_type = Some(pb::ValueType {
                r#type: intern(&mut out, string(vt.type_strindex)?),
                unit: intern(&mut out, string(vt.unit_strindex)?),
            });
        }
        for &i in &p.attribute_indices {
            let a = attribute(i)?;
            let value = a.value.as_ref().and_then(|v| v.value.as_ref());
            match (string(a.key_strindex)?, value) {
                (COMMENT, Some(any_value::Value::ArrayValue(list))) => {
                    for v in &list.values {
                        if let Some(any_value::Value::StringValue(c)) = &v.value {
                            let c = intern(&mut out, c);
                            out.comment.push(c);
                        }
                    }
                }
                (DROP_FRAMES, Some(any_value::Value::StringValue(v))) => {
                    out.drop_frames = intern(&mut out, v);
                }
                (KEEP_FRAMES, Some(any_value::Value::StringValue(v))) => {
                    out.keep_frames = intern(&mut out, v);
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

/// The resource attribute `key` of `attributes`, as a string (`None` when absent or not a
/// string).
pub fn resource_string<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a str> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref()?.value.as_ref()? {
            any_value::Value::StringValue(s) => Some(s.as_str()),
            _ => None,
        }
    })
}

/// A string resource attribute.
pub fn string_attribute(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_owned())),
        }),
        key_strindex: 0,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use prost::Message as _;

    use super::*;
    use crate::{Frame, FrameLine, Label, MappingInfo, ProfileBuilder};

    /// A profile's content independent of table order and IDs: for every (stack as
    /// frames with function, system name, file, lines, address and mapping; labels), the
    /// values per sample type, summed.
    type Normal = BTreeMap<(Vec<String>, Vec<String>), Vec<i64>>;

    fn normal(p: &pb::Profile) -> (Vec<String>, Normal, Vec<String>) {
        let s = |i: i64| string_at(p, i).to_owned();
        let loc = |id: u64| {
            let l = p.location.iter().find(|l| l.id == id).expect("location");
            let m = p.mapping.iter().find(|m| m.id == l.mapping_id);
            let mapping = m.map_or(String::new(), |m| {
                format!(
                    "{:#x}-{:#x}@{:#x} {} {} {}{}{}{}",
                    m.memory_start,
                    m.memory_limit,
                    m.file_offset,
                    s(m.filename),
                    s(m.build_id),
                    m.has_functions,
                    m.has_filenames,
                    m.has_line_numbers,
                    m.has_inline_frames
                )
            });
            let lines: Vec<String> = l
                .line
                .iter()
                .map(|ln| {
                    let f = p.function.iter().find(|f| f.id == ln.function_id).unwrap();
                    format!(
                        "{}|{}|{}|{}:{}:{}",
                        s(f.name),
                        s(f.system_name),
                        s(f.filename),
                        f.start_line,
                        ln.line,
                        ln.column
                    )
                })
                .collect();
            format!("{:#x} [{mapping}] {} {lines:?}", l.address, l.is_folded)
        };
        let mut samples = Normal::new();
        for sample in &p.sample {
            let stack = sample.location_id.iter().map(|&id| loc(id)).collect();
            let mut labels: Vec<String> = sample
                .label
                .iter()
                .map(|l| format!("{}={}/{}{}", s(l.key), s(l.str), l.num, s(l.num_unit)))
                .collect();
            labels.sort();
            let entry = samples
                .entry((stack, labels))
                .or_insert_with(|| vec![0; p.sample_type.len()]);
            for (e, v) in entry.iter_mut().zip(&sample.value) {
                *e += v;
            }
        }
        let mut meta = vec![
            format!("time={} duration={}", p.time_nanos, p.duration_nanos),
            format!(
                "period={:?} {}",
                p.period_type.as_ref().map(|vt| (s(vt.r#type), s(vt.unit))),
                p.period
            ),
            format!("default={}", s(p.default_sample_type)),
            format!("drop={} keep={}", s(p.drop_frames), s(p.keep_frames)),
        ];
        meta.extend(p.comment.iter().map(|&c| format!("comment {}", s(c))));
        (crate::sample_types(p), samples, meta)
    }

    fn sample_profile() -> pb::Profile {
        let mut b = ProfileBuilder::new(&[("samples", "count"), ("cpu", "nanoseconds")]);
        b.cpu_period(99)
            .time(1_700_000_000_000_000_000, 2_000_000_000)
            .comment("frequency 99 Hz")
            .default_sample_type("cpu");
        let bin = b.add_mapping(&MappingInfo {
            start: 0x40_0000,
            limit: 0x50_0000,
            file_offset: 0x1000,
            file: "/usr/bin/web".into(),
            build_id: "0123abcd".into(),
            has_functions: true,
        });
        let kernel = b.add_mapping(&MappingInfo {
            start: 0xffff_ffff_8100_0000,
            limit: 0xffff_ffff_8200_0000,
            file_offset: 0,
            file: "[kernel.kallsyms]".into(),
            build_id: String::new(),
            has_functions: true,
        });
        let line = |f: &str, file: &str, line: i64| FrameLine {
            function: f.into(),
            file: file.into(),
            line,
        };
        // An inlined frame (two lines at one address), a plain one, an unsymbolized one
        // and a kernel frame.
        let hot = Frame {
            address: 0x40_1234,
            mapping: Some(bin),
            lines: vec![line("hot_inner", "hot.c", 12), line("hot", "hot.c", 30)],
        };
        let main = Frame {
            address: 0x40_0100,
            mapping: Some(bin),
            lines: vec![line("main", "main.c", 5)],
        };
        let raw = Frame {
            address: 0x40_9999,
            mapping: Some(bin),
            lines: Vec::new(),
        };
        let sys = Frame {
            address: 0xffff_ffff_8100_1000,
            mapping: Some(kernel),
            lines: vec![line("do_syscall_64", "", 0)],
        };
        let labels = |pod: &str, container: &str, pid: i64| {
            vec![
                Label::Str(NAMESPACE_LABEL.into(), "shop".into()),
                Label::Str(POD_LABEL.into(), pod.into()),
                Label::Str(CONTAINER_LABEL.into(), container.into()),
                Label::Num("pid".into(), pid, String::new()),
                Label::Str("comm".into(), "web".into()),
            ]
        };
        b.add_sample(
            &[hot.clone(), main.clone()],
            &[3, 30],
            &labels("web-1", "app", 7),
        );
        b.add_sample(
            &[sys.clone(), raw.clone(), main.clone()],
            &[1, 10],
            &labels("web-1", "app", 7),
        );
        b.add_sample(&[hot, main.clone()], &[5, 50], &labels("web-2", "app", 9));
        b.add_sample(
            std::slice::from_ref(&main),
            &[0, 0],
            &labels("web-2", "sidecar", 11),
        );
        // A sample with no owner labels (a kernel thread, say) and a numeric label with a
        // unit.
        b.add_sample(
            &[sys, main],
            &[2, 20],
            &[Label::Num("bytes".into(), 4096, "bytes".into())],
        );
        b.build()
    }

    fn options() -> Options {
        Options {
            scope_name: "flamefleet".into(),
            scope_version: "0.1.0".into(),
            profile_id: [7; 16],
        }
    }

    fn pod_resource(owner: &Owner) -> Vec<KeyValue> {
        let mut out = Vec::new();
        if let Some(ns) = &owner.namespace {
            out.push(string_attribute("k8s.namespace.name", ns));
        }
        if let Some(pod) = &owner.pod {
            out.push(string_attribute("k8s.pod.name", pod));
        }
        if let Some(c) = &owner.container {
            out.push(string_attribute("k8s.container.name", c));
        }
        out
    }

    #[test]
    fn one_resource_per_owner_and_one_profile_per_sample_type() {
        let p = sample_profile();
        let req = to_otlp(&p, pod_resource, &options()).unwrap();
        let owners: Vec<(Option<&str>, Option<&str>)> = req
            .resource_profiles
            .iter()
            .map(|rp| {
                let attrs = &rp.resource.as_ref().unwrap().attributes;
                (
                    resource_string(attrs, "k8s.pod.name"),
                    resource_string(attrs, "k8s.container.name"),
                )
            })
            .collect();
        assert_eq!(
            owners,
            [
                (None, None),
                (Some("web-1"), Some("app")),
                (Some("web-2"), Some("app")),
                (Some("web-2"), Some("sidecar"))
            ]
        );
        let d = req.dictionary.as_ref().unwrap();
        let mut ids = std::collections::HashSet::new();
        for rp in &req.resource_profiles {
            let profiles = &rp.scope_profiles[0].profiles;
            let types: Vec<&str> = profiles
                .iter()
                .map(|p| d.string_table[p.sample_type.unwrap().type_strindex as usize].as_str())
                .collect();
            assert_eq!(types, ["samples", "cpu"]);
            for p in profiles {
                assert!(ids.insert(p.profile_id.clone()), "profile IDs are unique");
                assert_eq!(p.period, 1_000_000_000 / 99);
                assert_eq!(p.time_unix_nano, 1_700_000_000_000_000_000);
                assert_eq!(p.duration_nano, 2_000_000_000);
                assert!(p.samples.iter().all(|s| s.values.len() == 1));
            }
        }
        // OTLP's zero-value entry 0 in every table.
        assert_eq!(d.string_table[0], "");
        assert_eq!(d.mapping_table[0], otlp::Mapping::default());
        assert_eq!(d.location_table[0], otlp::Location::default());
        assert_eq!(d.function_table[0], otlp::Function::default());
        assert_eq!(d.stack_table[0], otlp::Stack::default());
        assert_eq!(d.attribute_table[0], otlp::KeyValueAndUnit::default());
        assert_eq!(d.link_table[0], otlp::Link::default());
        // Totals per type are those of the pprof profile.
        for (t, (kind, unit)) in [("samples", "count"), ("cpu", "nanoseconds")]
            .into_iter()
            .enumerate()
        {
            let otlp_total: i64 = req
                .resource_profiles
                .iter()
                .map(|rp| {
                    rp.scope_profiles[0].profiles[t]
                        .samples
                        .iter()
                        .map(|s| s.values[0])
                        .sum::<i64>()
                })
                .sum();
            assert_eq!(
                Some(otlp_total as u64),
                crate::value_total(&p, kind, unit),
                "{kind}"
            );
        }
    }

    #[test]
    fn converts_back_to_the_same_profile_through_the_wire() {
        let p = sample_profile();
        let req = to_otlp(&p, pod_resource, &options()).unwrap();
        // Through protobuf bytes, as the Collector receives them.
        let bytes = req.encode_to_vec();
        let req = collector::ExportProfilesServiceRequest::decode(&bytes[..]).unwrap();
        let back = to_pprof(&req.resource_profiles, req.dictionary.as_ref().unwrap()).unwrap();
        crate::validate(&back).unwrap();
        assert_eq!(normal(&back), normal(&p));
    }

    /// A profile of `n` samples with deep stacks of their own (functions named per sample),
    /// over three pods.
    fn wide_profile(n: usize) -> pb::Profile {
        let mut b = ProfileBuilder::new(&[("samples", "count"), ("cpu", "nanoseconds")]);
        b.cpu_period(19)
            .time(1_700_000_000_000_000_000, 20_000_000_000)
            .comment("frequency 19 Hz")
            .default_sample_type("cpu");
        let bin = b.add_mapping(&MappingInfo {
            start: 0x40_0000,
            limit: 0x90_0000,
            file_offset: 0,
            file: "/usr/bin/shop".into(),
            build_id: "feedface".into(),
            has_functions: true,
        });
        for i in 0..n {
            let stack: Vec<Frame> = (0..16)
                .map(|depth| Frame {
                    address: 0x40_0000 + (i * 32 + depth) as u64,
                    mapping: Some(bin),
                    lines: vec![FrameLine {
                        function: format!("shop::handler_{i}::step_{depth}"),
                        file: format!("src/handler_{i}.rs"),
                        line: depth as i64 + 1,
                    }],
                })
                .collect();
            let pod = format!("web-{}", i % 3);
            b.add_sample(
                &stack,
                &[1 + (i % 5) as i64, 52_631_578 * (1 + (i % 5) as i64)],
                &[
                    Label::Str(NAMESPACE_LABEL.into(), "shop".into()),
                    Label::Str(POD_LABEL.into(), pod),
                    Label::Num("pid".into(), i as i64, String::new()),
                ],
            );
        }
        b.build()
    }

    #[test]
    fn a_profile_over_the_size_limit_is_sent_in_parts_that_sum_to_it() {
        let p = wide_profile(300);
        let whole = to_otlp(&p, pod_resource, &options()).unwrap().encoded_len();
        let limit = whole / 5;
        let parts = to_otlp_requests(&p, pod_resource, &options(), limit).unwrap();
        assert!(parts.len() >= 5, "{} parts for {whole} bytes", parts.len());
        let mut ids = std::collections::HashSet::new();
        let mut sum = Normal::new();
        let mut samples = 0;
        for part in &parts {
            let bytes = part.encode_to_vec();
            assert!(bytes.len() <= limit, "{} bytes over {limit}", bytes.len());
            let part = collector::ExportProfilesServiceRequest::decode(&bytes[..]).unwrap();
            for rp in &part.resource_profiles {
                for profile in &rp.scope_profiles[0].profiles {
                    assert!(ids.insert(profile.profile_id.clone()), "IDs are unique");
                }
            }
            let back =
                to_pprof(&part.resource_profiles, part.dictionary.as_ref().unwrap()).unwrap();
            crate::validate(&back).unwrap();
            let (types, normal_part, meta) = normal(&back);
            assert_eq!((types, meta), (normal(&p).0, normal(&p).2));
            samples += back.sample.len();
            for (key, values) in normal_part {
                let entry = sum.entry(key).or_insert_with(|| vec![0; values.len()]);
                for (e, v) in entry.iter_mut().zip(values) {
                    *e += v;
                }
            }
        }
        assert_eq!(samples, p.sample.len(), "every sample in exactly one part");
        assert_eq!(sum, normal(&p).1, "the parts sum to the profile");
        // Each part carries only what its samples use: together hardly more than the whole.
        let total: usize = parts.iter().map(|r| r.encoded_len()).sum();
        assert!(
            total < whole + whole / 4,
            "{total} bytes in parts for {whole}"
        );
    }

    #[test]
    fn a_profile_within_the_limit_is_one_request_and_a_sample_over_it_is_refused() {
        let p = sample_profile();
        let one = to_otlp(&p, pod_resource, &options()).unwrap();
        let parts = to_otlp_requests(&p, pod_resource, &options(), one.encoded_len()).unwrap();
        assert_eq!(parts, [one]);
        let err = to_otlp_requests(&wide_profile(2), pod_resource, &options(), 300).unwrap_err();
        assert!(
            err.to_string()
                .contains("one sample makes an OTLP request of"),
            "{err}"
        );
    }

    #[test]
    fn a_real_shaped_heap_profile_round_trips() {
        // Four sample types, Go build IDs, no period type: what the heap sources write.
        let mut b = ProfileBuilder::new(&[
            ("alloc_objects", "count"),
            ("alloc_space", "bytes"),
            ("inuse_objects", "count"),
            ("inuse_space", "bytes"),
        ]);
        b.default_sample_type("inuse_space");
        let m = b.add_mapping(&MappingInfo {
            start: 0x1000,
            limit: 0x9000,
            file_offset: 0,
            file: "/app/server".into(),
            build_id: "Go-abc/def".into(),
            has_functions: true,
        });
        let f = Frame {
            address: 0x1100,
            mapping: Some(m),
            lines: vec![FrameLine {
                function: "main.alloc".into(),
                file: "/src/main.go".into(),
                line: 42,
            }],
        };
        b.add_sample(
            &[f],
            &[10, 1024, 4, 512],
            &[Label::Str(POD_LABEL.into(), "api-0".into())],
        );
        let p = b.build();
        let req = to_otlp(&p, pod_resource, &options()).unwrap();
        let d = req.dictionary.as_ref().unwrap();
        let build_id = &d.attribute_table[d.mapping_table[1].attribute_indices[0] as usize];
        assert_eq!(d.string_table[build_id.key_strindex as usize], BUILD_ID_GO);
        let back = to_pprof(&req.resource_profiles, d).unwrap();
        assert_eq!(normal(&back), normal(&p));
    }

    #[test]
    fn references_resolve_as_the_collector_writes_them() {
        let p = sample_profile();
        let mut req = to_otlp(&p, pod_resource, &options()).unwrap();
        let want = req.resource_profiles.clone();
        // What the Collector does on output: keys and string values into the string table.
        let mut d = req.dictionary.take().unwrap();
        for rp in &mut req.resource_profiles {
            let scope = rp.scope_profiles[0].scope.as_mut().unwrap();
            let resource = rp.resource.as_mut().unwrap();
            for kv in resource
                .attributes
                .iter_mut()
                .chain(scope.attributes.iter_mut())
            {
                d.string_table.push(std::mem::take(&mut kv.key));
                kv.key_strindex = d.string_table.len() as i32 - 1;
                if let Some(any_value::Value::StringValue(v)) =
                    kv.value.as_mut().and_then(|v| v.value.take())
                {
                    d.string_table.push(v);
                    kv.value.as_mut().unwrap().value = Some(any_value::Value::StringValueStrindex(
                        d.string_table.len() as i32 - 1,
                    ));
                }
            }
        }
        assert_ne!(req.resource_profiles, want);
        resolve_references(&mut req.resource_profiles, &d).unwrap();
        assert_eq!(req.resource_profiles, want);
        let back = to_pprof(&req.resource_profiles, &d).unwrap();
        assert_eq!(normal(&back), normal(&p));
        // A reference past the table is refused.
        let scope = req.resource_profiles[0].scope_profiles[0]
            .scope
            .as_mut()
            .unwrap();
        scope.attributes[0].key_strindex = 1 << 20;
        let err = resolve_references(&mut req.resource_profiles, &d).unwrap_err();
        assert!(
            err.to_string().contains("outside the string table"),
            "{err}"
        );
    }

    #[test]
    fn an_index_outside_its_table_is_refused_not_followed() {
        let p = sample_profile();
        let mut req = to_otlp(&p, pod_resource, &options()).unwrap();
        req.resource_profiles[0].scope_profiles[0].profiles[0].samples[0].stack_index = 10_000;
        let err = to_pprof(&req.resource_profiles, req.dictionary.as_ref().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("stack index 10000 outside its table"), "{err}");
    }
}
