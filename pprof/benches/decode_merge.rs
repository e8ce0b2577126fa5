//! The heap endpoint path's pprof work, per profile: decode (gunzip + protobuf + validate)
//! and merge of the containers' profiles, each printed beside the way the agent did it
//! before the kit (measured in the same run): an unbounded gunzip into one growing buffer
//! and a plain prost decode, and a merge that rebuilt every part through
//! `ProfileBuilder` frame by frame.
//!
//! `cargo bench -p flamefleet-pprof --bench decode_merge [-- --samples 5000 --parts 8 --rounds 20]`
//!
//! A benchmark: it prints, it never asserts.

use std::collections::HashMap;
use std::hint::black_box;
use std::io::Read as _;
use std::time::{Duration, Instant};

use flamefleet_pprof::pb::Profile;
use flamefleet_pprof::{
    Frame, FrameLine, Label, LabelledProfile, MappingInfo, ProfileBuilder, Window, string,
};
use prost::Message as _;

#[path = "../tests/support/heap_like.rs"]
mod heap_like;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The agent's decode before the kit: the whole body inflated into one growing buffer,
/// decoded by prost with no bound on what it allocates, then validated.
fn decode_before(body: &[u8]) -> Profile {
    let mut raw = Vec::new();
    flate2::read::MultiGzDecoder::new(body)
        .take(256 << 20)
        .read_to_end(&mut raw)
        .expect("gunzip");
    let p = Profile::decode(&raw[..]).expect("decode");
    flamefleet_pprof::validate(&p).expect("valid");
    p
}

/// The agent's heap merge before the kit: every part's samples rebuilt through
/// `ProfileBuilder`, frame by frame, with the part's labels appended.
fn merge_before(parts: &[LabelledProfile]) -> Profile {
    let first = &parts[0].profile;
    let types: Vec<(String, String)> = first
        .sample_type
        .iter()
        .map(|vt| {
            (
                string(first, vt.r#type).to_owned(),
                string(first, vt.unit).to_owned(),
            )
        })
        .collect();
    let refs: Vec<(&str, &str)> = types
        .iter()
        .map(|(t, u)| (t.as_str(), u.as_str()))
        .collect();
    let mut b = ProfileBuilder::new(&refs);
    for part in parts {
        let p = &part.profile;
        let mut mappings = HashMap::new();
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
            labels.extend(part.labels.iter().cloned());
            b.add_sample(&stack, &s.value, &labels);
        }
    }
    b.build()
}

/// The fastest of `rounds` runs of `f` (the figure least disturbed by other work).
fn best<T>(rounds: usize, mut f: impl FnMut() -> T) -> Duration {
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            black_box(f());
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let samples = arg("--samples", 5_000);
    let parts_n = arg("--parts", 8);
    let rounds = arg("--rounds", 20);
    let profiles: Vec<Profile> = (0..parts_n)
        .map(|i| heap_like::heap_profile(samples, 0x9e37_79b9 + i as u64))
        .collect();
    let bodies: Vec<Vec<u8>> = profiles
        .iter()
        .map(|p| flamefleet_pprof::encode_gzip(p).expect("gzip"))
        .collect();
    println!(
        "{parts_n} containers, each a heap profile of {samples} stacks x 30 frames: {} KiB gzipped, {} KiB of protobuf; best of {rounds} rounds",
        bodies[0].len() / 1024,
        profiles[0].encoded_len() / 1024
    );
    let body = &bodies[0];
    let before = best(rounds, || decode_before(body));
    let after = best(rounds, || {
        flamefleet_pprof::decode_with(body, &flamefleet_pprof::DecodeLimits::default())
            .expect("decode")
    });
    println!(
        "decode one body:   kit (bounded) {:>8.2} ms   before (unbounded) {:>8.2} ms   ratio {:.2}",
        ms(after),
        ms(before),
        after.as_secs_f64() / before.as_secs_f64()
    );
    let parts: Vec<LabelledProfile> = profiles
        .iter()
        .enumerate()
        .map(|(i, p)| LabelledProfile {
            profile: p.clone(),
            labels: vec![
                Label::Str("pod".into(), format!("web-{i}")),
                Label::Str("container".into(), "app".into()),
            ],
        })
        .collect();
    let before = best(rounds, || merge_before(&parts));
    let after = best(rounds, || {
        flamefleet_pprof::merge(&parts, Window::Shared).expect("merge")
    });
    println!(
        "merge {parts_n} parts:    kit (exact)   {:>8.2} ms   before (rebuild)   {:>8.2} ms   ratio {:.2}",
        ms(after),
        ms(before),
        after.as_secs_f64() / before.as_secs_f64()
    );
    let merged = flamefleet_pprof::merge(&parts, Window::Shared).expect("merge");
    let encode = best(rounds, || {
        flamefleet_pprof::encode_gzip(&merged).expect("gzip")
    });
    println!(
        "encode the merge:  {:>8.2} ms ({} KiB gzipped)",
        ms(encode),
        flamefleet_pprof::encode_gzip(&merged).map_or(0, |b| b.len() / 1024)
    );
}
