//! The synthetic but valid artifacts of a hollow capture: a small gzipped pprof (what `go
//! tool pprof` reads) per profile type, runqlat's text histogram, and the summary keys the
//! real agent reports (docs/capture.md, "Capture summary").

use std::collections::HashMap;
use std::io::Write as _;
use std::time::Duration;

use flamefleet_proto::agent::capture_summary::Kind;
use flamefleet_proto::agent::{
    CaptureSummary, CpuSummary, HeapSummary, LatencyHistogram, ProfileType, RunqlatSummary,
};
use flamefleet_proto::pprof as pb;
use prost::Message as _;

/// One artifact to upload.
#[derive(Debug, Clone)]
pub struct BuiltArtifact {
    /// Artifact name (the slot's name).
    pub name: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Samples it counts (0 for a text artifact).
    pub samples: u64,
    /// `type/unit` of its default sample type (empty for a text artifact).
    pub sample_type: String,
}

/// What a hollow capture produced.
#[derive(Debug, Clone)]
pub struct Built {
    /// The artifacts, in slot order.
    pub artifacts: Vec<BuiltArtifact>,
    /// The DONE summary.
    pub summary: CaptureSummary,
    /// runqlat: the node's histogram.
    pub runqlat_histogram: Option<LatencyHistogram>,
}

/// A tiny pprof string table and sample builder.
struct Builder {
    profile: pb::Profile,
    strings: HashMap<String, i64>,
}

impl Builder {
    fn new(sample_types: &[(&str, &str)], default: &str) -> Self {
        let mut b = Self {
            profile: pb::Profile::default(),
            strings: HashMap::new(),
        };
        b.string("");
        for (t, u) in sample_types {
            let vt = pb::ValueType {
                r#type: b.string(t),
                unit: b.string(u),
            };
            b.profile.sample_type.push(vt);
        }
        b.profile.default_sample_type = b.string(default);
        b
    }

    fn string(&mut self, s: &str) -> i64 {
        if let Some(i) = self.strings.get(s) {
            return *i;
        }
        let i = i64::try_from(self.profile.string_table.len()).unwrap_or(i64::MAX);
        self.profile.string_table.push(s.to_owned());
        self.strings.insert(s.to_owned(), i);
        i
    }

    /// A stack of functions, leaf first; one location per function.
    fn stack(&mut self, functions: &[&str]) -> Vec<u64> {
        functions
            .iter()
            .map(|f| {
                let name = self.string(f);
                let file = self.string("hollow.rs");
                let existing = self
                    .profile
                    .function
                    .iter()
                    .find(|func| func.name == name)
                    .map(|func| func.id);
                let function_id = existing.unwrap_or_else(|| {
                    let id = self.profile.function.len() as u64 + 1;
                    self.profile.function.push(pb::Function {
                        id,
                        name,
                        system_name: name,
                        filename: file,
                        start_line: 0,
                    });
                    id
                });
                let existing = self
                    .profile
                    .location
                    .iter()
                    .find(|l| l.line.first().is_some_and(|l| l.function_id == function_id))
                    .map(|l| l.id);
                existing.unwrap_or_else(|| {
                    let id = self.profile.location.len() as u64 + 1;
                    self.profile.location.push(pb::Location {
                        id,
                        mapping_id: 0,
                        address: 0x1000 * id,
                        line: vec![pb::Line {
                            function_id,
                            line: i64::try_from(id).unwrap_or(0),
                            column: 0,
                        }],
                        is_folded: false,
                    });
                    id
                })
            })
            .collect()
    }

    fn sample(&mut self, functions: &[&str], values: Vec<i64>, labels: &[(&str, &str)]) {
        let location_id = self.stack(functions);
        let label = labels
            .iter()
            .map(|(k, v)| pb::Label {
                key: self.string(k),
                str: self.string(v),
                ..Default::default()
            })
            .collect();
        self.profile.sample.push(pb::Sample {
            location_id,
            value: values,
            label,
        });
    }

    fn finish(self) -> pb::Profile {
        self.profile
    }
}

fn gzip(profile: &pb::Profile) -> std::io::Result<Vec<u8>> {
    let mut out = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    out.write_all(&profile.encode_to_vec())?;
    out.finish()
}

fn sample_type_of(p: &pb::Profile) -> String {
    let s = |i: i64| {
        usize::try_from(i)
            .ok()
            .and_then(|i| p.string_table.get(i))
            .cloned()
            .unwrap_or_default()
    };
    p.sample_type
        .iter()
        .find(|st| st.r#type == p.default_sample_type)
        .or_else(|| p.sample_type.last())
        .map(|st| format!("{}/{}", s(st.r#type), s(st.unit)))
        .unwrap_or_default()
}

/// The artifacts of a `ty` capture of `duration` on `node` for `pods`, under `names`
/// (`artifact_names(ty, node)`). Sizes are a few hundred bytes: what is measured is the
/// operator and the API server, not the store's bandwidth.
///
/// # Errors
/// Only when gzip encoding fails (it does not, into memory).
pub fn build(
    ty: ProfileType,
    node: &str,
    pods: &[(String, String)],
    duration: Duration,
    frequency_hz: u64,
    names: &[String],
) -> std::io::Result<Built> {
    let seconds = duration.as_secs_f64().max(0.001);
    let name = |i: usize| names.get(i).cloned().unwrap_or_default();
    let label_sets: Vec<Vec<(&str, &str)>> = if pods.is_empty() {
        vec![vec![("node", node)]]
    } else {
        pods.iter()
            .map(|(ns, pod)| vec![("node", node), ("namespace", ns.as_str()), ("pod", pod)])
            .collect()
    };
    match ty {
        ProfileType::Cpu | ProfileType::Unspecified => {
            let hz = frequency_hz.max(1);
            let period = 1_000_000_000 / i64::try_from(hz).unwrap_or(99);
            let mut b = Builder::new(&[("samples", "count"), ("cpu", "nanoseconds")], "");
            b.profile.period_type = Some(pb::ValueType {
                r#type: b.string("cpu"),
                unit: b.string("nanoseconds"),
            });
            b.profile.period = period;
            b.profile.duration_nanos = i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX);
            // Half a CPU busy in two stacks per pod.
            let per_pod = ((seconds * hz as f64) / 2.0).ceil() as i64;
            let mut total = 0;
            for labels in &label_sets {
                let hot = per_pod * 3 / 4;
                let cold = per_pod - hot;
                b.sample(
                    &["hollow::spin", "hollow::work", "main"],
                    vec![hot, hot * period],
                    labels,
                );
                b.sample(&["hollow::idle", "main"], vec![cold, cold * period], labels);
                total += per_pod;
            }
            let profile = b.finish();
            let total = u64::try_from(total).unwrap_or(0);
            let summary = CaptureSummary {
                kind: Some(Kind::Cpu(CpuSummary {
                    samples: total,
                    dropped_samples: 0,
                    unsymbolized_frames_pct: 0.0,
                    frequency_hz: hz,
                    requested_frequency_hz: hz,
                })),
            };
            Ok(Built {
                artifacts: vec![BuiltArtifact {
                    name: name(0),
                    bytes: gzip(&profile)?,
                    samples: total,
                    sample_type: sample_type_of(&profile),
                }],
                summary,
                runqlat_histogram: None,
            })
        }
        ProfileType::Heap => {
            let mut b = Builder::new(
                &[
                    ("alloc_objects", "count"),
                    ("alloc_space", "bytes"),
                    ("inuse_objects", "count"),
                    ("inuse_space", "bytes"),
                ],
                "inuse_space",
            );
            let mut allocations = 0;
            for labels in &label_sets {
                b.sample(
                    &["hollow::alloc", "hollow::work", "main"],
                    vec![64, 64 * 4096, 16, 16 * 4096],
                    labels,
                );
                allocations += 64;
            }
            let profile = b.finish();
            let summary = CaptureSummary {
                kind: Some(Kind::Heap(HeapSummary {
                    allocations,
                    reason: "hollow agent: a synthetic profile, nothing was captured".into(),
                    ..Default::default()
                })),
            };
            Ok(Built {
                artifacts: vec![BuiltArtifact {
                    name: name(0),
                    bytes: gzip(&profile)?,
                    samples: allocations,
                    sample_type: sample_type_of(&profile),
                }],
                summary,
                runqlat_histogram: None,
            })
        }
        ProfileType::Runqlat => {
            // Waits of 2-4 us mostly, a tail to 64 us.
            let buckets = vec![0, 10, 200, 40, 10, 5, 1];
            let histogram = LatencyHistogram {
                unit_ns: 1000,
                buckets: buckets.clone(),
            };
            let mut b = Builder::new(&[("count", "count"), ("latency", "nanoseconds")], "count");
            for labels in &label_sets {
                for (i, n) in buckets.iter().enumerate() {
                    let n = i64::try_from(*n).unwrap_or(0);
                    if n > 0 {
                        let bucket = format!("hollow::wait_{}us", 1u64 << i);
                        b.sample(&[bucket.as_str(), "main"], vec![n, n * (1000 << i)], labels);
                    }
                }
            }
            let profile = b.finish();
            let waits = histogram.count() * label_sets.len() as u64;
            let mut text = String::from("     usecs               : count\n");
            for (i, n) in buckets.iter().enumerate() {
                let lo = if i == 0 { 0 } else { 1u64 << i };
                text.push_str(&format!(
                    "{lo:>10} -> {:<10} : {n}\n",
                    (1u64 << (i + 1)) - 1
                ));
            }
            let summary = CaptureSummary {
                kind: Some(Kind::Runqlat(RunqlatSummary {
                    waits,
                    dropped_samples: 0,
                    p50_us: histogram.quantile_us(0.50),
                    p90_us: histogram.quantile_us(0.90),
                    p99_us: histogram.quantile_us(0.99),
                    max_us: histogram.max_us(),
                })),
            };
            Ok(Built {
                artifacts: vec![
                    BuiltArtifact {
                        name: name(0),
                        bytes: gzip(&profile)?,
                        samples: waits,
                        sample_type: sample_type_of(&profile),
                    },
                    BuiltArtifact {
                        name: name(1),
                        bytes: text.into_bytes(),
                        samples: 0,
                        sample_type: String::new(),
                    },
                ],
                summary,
                runqlat_histogram: Some(histogram),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_proto::agent::artifact_names;
    use std::io::Read as _;

    fn decode(bytes: &[u8]) -> pb::Profile {
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut raw)
            .unwrap();
        pb::Profile::decode(raw.as_slice()).unwrap()
    }

    #[test]
    fn cpu_profile_is_valid_pprof_with_the_reported_samples() {
        let names = artifact_names(ProfileType::Cpu, "n1");
        let pods = vec![("ns".to_string(), "web-1".to_string())];
        let built = build(
            ProfileType::Cpu,
            "n1",
            &pods,
            Duration::from_secs(2),
            99,
            &names,
        )
        .unwrap();
        let a = &built.artifacts[0];
        assert_eq!(a.name, "cpu-n1.pb.gz");
        assert_eq!(a.sample_type, "cpu/nanoseconds");
        let p = decode(&a.bytes);
        assert_eq!(p.string_table[0], "");
        let samples: i64 = p.sample.iter().map(|s| s.value[0]).sum();
        assert_eq!(u64::try_from(samples).unwrap(), a.samples);
        assert_eq!(built.summary.display()["samples"], a.samples.to_string());
        // Every location and function a sample names exists.
        for s in &p.sample {
            for id in &s.location_id {
                let loc = p.location.iter().find(|l| l.id == *id).unwrap();
                assert!(p.function.iter().any(|f| f.id == loc.line[0].function_id));
            }
        }
    }

    #[test]
    fn runqlat_has_a_text_artifact_and_a_histogram() {
        let names = artifact_names(ProfileType::Runqlat, "n2");
        let built = build(
            ProfileType::Runqlat,
            "n2",
            &[],
            Duration::from_secs(1),
            0,
            &names,
        )
        .unwrap();
        assert_eq!(built.artifacts.len(), 2);
        assert_eq!(built.artifacts[1].name, "runqlat-n2.txt");
        assert_eq!(built.artifacts[1].samples, 0);
        assert!(built.runqlat_histogram.is_some());
        assert_eq!(built.artifacts[0].sample_type, "count/count");
    }
}
