//! `/debug/pprof/heap` over real HTTP in a process whose global allocator is jemalloc with
//! its profiler on (this test binary calls `jemalloc_heap_profiling!` as the agent and the
//! operator do; it is a binary of its own so the other tests keep a profiler-less
//! jemalloc and their 501). A function holding 64 MiB must lead the in-use profile as
//! `go tool pprof` reads it.

use std::hint::black_box;
use std::io::Read as _;
use std::process::Command;

use flamefleet_proto::pprof::Profile;
use prost::Message as _;

flamefleet_selfprof::jemalloc_heap_profiling!();

const CHUNK: usize = 1 << 20;
const CHUNKS: usize = 64;

/// Allocates and keeps `CHUNKS` MiB; its name is what the profile must show.
#[inline(never)]
fn selfprof_heap_hold() -> Vec<Vec<u8>> {
    (0..CHUNKS)
        .map(|i| {
            // Written to, so the pages are real and nothing is optimized away.
            let v = vec![u8::try_from(i % 251).unwrap_or(0); CHUNK];
            black_box(v)
        })
        .collect()
}

fn decode(gz: &[u8]) -> Profile {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut raw)
        .expect("gzip");
    Profile::decode(&raw[..]).expect("pprof")
}

/// Bytes of `value[index]` over the samples whose stack names `function`.
fn bytes_under(p: &Profile, function: &str, index: usize) -> i64 {
    let named: std::collections::HashSet<u64> = p
        .function
        .iter()
        .filter(|f| p.string_table[f.name as usize].contains(function))
        .map(|f| f.id)
        .collect();
    let in_stack = |loc: &u64| {
        p.location
            .iter()
            .find(|l| l.id == *loc)
            .is_some_and(|l| l.line.iter().any(|line| named.contains(&line.function_id)))
    };
    p.sample
        .iter()
        .filter(|s| s.location_id.iter().any(in_stack))
        .map(|s| s.value[index])
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heap_profile_names_the_function_holding_memory() {
    let held = selfprof_heap_hold();
    let addr = flamefleet_selfprof::spawn("127.0.0.1:0".parse().expect("address"))
        .await
        .expect("bind");
    let heap = reqwest::get(format!("http://{addr}/debug/pprof/heap"))
        .await
        .expect("GET heap");
    assert_eq!(
        heap.status(),
        200,
        "{}",
        heap.text().await.unwrap_or_default()
    );
    let body = heap.bytes().await.expect("body");
    black_box(&held);

    // Our own reading: the sample type, and jemalloc's estimate of what the function holds
    // (sampled once per 512 KiB on average, scaled back up; 1 MiB chunks are all but always
    // sampled, so the estimate is near 64 MiB).
    let p = decode(&body);
    let types: Vec<&str> = p
        .sample_type
        .iter()
        .map(|t| p.string_table[t.r#type as usize].as_str())
        .collect();
    assert_eq!(types, ["inuse_space"]);
    let held_bytes = bytes_under(&p, "selfprof_heap_hold", 0);
    assert!(
        held_bytes >= (CHUNKS * CHUNK / 2) as i64,
        "selfprof_heap_hold holds {held_bytes} bytes in the profile, expected about {}",
        CHUNKS * CHUNK
    );

    // And Go's: the function is at the top of the in-use space.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("heap.pb.gz");
    std::fs::write(&file, &body).expect("write profile");
    let out = Command::new("go")
        .args(["tool", "pprof", "-top", "-cum", "-sample_index=inuse_space"])
        .arg(&file)
        .output()
        .expect("running `go tool pprof` (install Go)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "go tool pprof failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.contains("selfprof_heap_hold"))
        .unwrap_or_else(|| panic!("selfprof_heap_hold is not in go tool pprof -top:\n{text}"));
    // `flat flat% sum% cum cum%`: the function's cumulative share is most of the heap.
    let cum_pct: f64 = line
        .split_whitespace()
        .nth(4)
        .and_then(|c| c.trim_end_matches('%').parse().ok())
        .unwrap_or_else(|| panic!("no cum% in {line:?}"));
    assert!(cum_pct >= 50.0, "{line}\n{text}");
    drop(held);
}
