//! Full user stacks for code without frame pointers (CFI unwinding in BPF),
//! frameless leaves, libc, processes starting and exiting during a capture,
//! JIT code named by perf maps, and bad CFI. Every workload is built here,
//! runs in its own cgroup, and the stacks are checked in
//! `go tool pprof -traces` output.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use flamefleet_agent::capture::cpu::{CpuOptions, CpuSamples};
use flamefleet_agent::capture::heap::ebpf::{self as heap_ebpf, EbpfHeapOptions};
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use flamefleet_agent::symbolize::StackSymbolizer;
use support::{TestCgroup, require_root, serial};

const HZ: u64 = 499;

/// One stack of `go tool pprof -traces`: its weight (ns) and frames, leaf first.
#[derive(Debug)]
struct Trace {
    weight: f64,
    frames: Vec<String>,
}

fn traces(file: &Path, extra: &[&str]) -> Vec<Trace> {
    let out = support::pprof()
        .arg("-traces")
        .args(extra)
        .arg(file)
        .output()
        .expect("running `go tool pprof` (install Go)");
    assert!(
        out.status.success(),
        "go tool pprof failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut all = Vec::new();
    for block in text.split("-----------+") {
        let mut cur: Option<Trace> = None;
        for line in block.lines() {
            let t = line.trim();
            if t.is_empty() || t.starts_with("File:") || t.starts_with("Type:") {
                continue;
            }
            // Label lines: "      comm:  chain".
            if t.split_once(": ")
                .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
            {
                continue;
            }
            let mut words = t.split_whitespace();
            let first = words.next().unwrap_or_default();
            if let Some(ns) = duration_ns(first) {
                if let Some(c) = cur.take() {
                    all.push(c);
                }
                let rest: Vec<&str> = words.collect();
                cur = Some(Trace {
                    weight: ns,
                    frames: vec![rest.join(" ")],
                });
            } else if let Some(c) = cur.as_mut() {
                c.frames.push(t.to_owned());
            }
        }
        all.extend(cur);
    }
    all
}

/// A trace's weight as `go tool pprof` prints it: a duration (in ns) or a
/// size (in bytes).
fn duration_ns(s: &str) -> Option<f64> {
    let split = s.find(|c: char| c.is_ascii_alphabetic())?;
    let (num, unit) = s.split_at(split);
    let v: f64 = num.parse().ok()?;
    Some(match unit {
        "ns" | "B" => v,
        "us" => v * 1e3,
        "ms" => v * 1e6,
        "s" => v * 1e9,
        "kB" => v * 1024.0,
        "MB" => v * 1024.0 * 1024.0,
        "GB" => v * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    })
}

/// Weight of traces containing `leaf`, and of those where the frames right
/// after `leaf` begin with `chain` (callers, innermost first; a frame matches
/// when its name contains the expected one).
fn chain_share(traces: &[Trace], leaf: &str, chain: &[&str]) -> (f64, f64) {
    let (mut with_leaf, mut full) = (0.0, 0.0);
    for t in traces {
        let Some(i) = t.frames.iter().position(|f| f.contains(leaf)) else {
            continue;
        };
        with_leaf += t.weight;
        let callers = &t.frames[i + 1..];
        if callers.len() >= chain.len()
            && chain
                .iter()
                .zip(callers)
                .all(|(want, got)| got.contains(want))
        {
            full += t.weight;
        }
    }
    (with_leaf, full)
}

fn assert_chain(file: &Path, leaf: &str, chain: &[&str], extra: &[&str]) -> f64 {
    let ts = traces(file, extra);
    let (with_leaf, full) = chain_share(&ts, leaf, chain);
    assert!(
        with_leaf > 0.0,
        "no sample in {leaf}; traces: {:#?}",
        ts.iter().take(5).collect::<Vec<_>>()
    );
    let pct = 100.0 * full / with_leaf;
    eprintln!("{leaf}: {pct:.1}% of its samples carry {chain:?}");
    assert!(
        pct >= 95.0,
        "expected >= 95% of {leaf}'s samples to carry {chain:?}, got {pct:.1}%; first traces: {:#?}",
        ts.iter()
            .filter(|t| t.frames.iter().any(|f| f.contains(leaf)))
            .take(4)
            .collect::<Vec<_>>()
    );
    pct
}

/// Captures the cgroup for `secs` with its processes' unwind tables loaded
/// (`start_cpu_with_tables`), writes the profile, returns it and the result.
fn capture(
    samplers: &Samplers,
    cg: &TestCgroup,
    dir: &Path,
    name: &str,
    secs: u64,
) -> (PathBuf, CpuSamples) {
    let pids = cg.cgroup.procs_recursive().expect("the cgroup's processes");
    let capture = support::start_cpu_with_tables(
        samplers,
        &[CaptureTarget::raw(cg.cgroup.clone())],
        &CpuOptions {
            frequency: HZ,
            ..CpuOptions::default()
        },
        &pids,
    );
    std::thread::sleep(Duration::from_secs(secs));
    finish(samplers, capture, dir, name)
}

fn finish(
    samplers: &Samplers,
    capture: flamefleet_agent::capture::cpu::CpuCapture,
    dir: &Path,
    name: &str,
) -> (PathBuf, CpuSamples) {
    let result = capture.finish().expect("finish capture");
    let mut sym = StackSymbolizer::new(samplers.catalog().clone());
    let profile = result.to_profile(&mut sym, "");
    let out = dir.join(format!("{name}.pb.gz"));
    flamefleet_agent::cli::write_profile(&out, &profile).unwrap();
    eprintln!(
        "{name}: {} samples, walk {:?}, tables {:?}",
        result.total(),
        result.walk,
        result.unwinder
    );
    (out, result)
}

fn run(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// C: main → ff_a → ff_b → ff_c → ff_leaf (3 parts) and main → ff_y → ff_leaf (1 part).
const C_CHAIN: &str = r#"
#include <stdlib.h>
static volatile unsigned long sink;
__attribute__((noinline)) void ff_leaf(long n) { for (long i = 0; i < n; i++) sink += i * 7; }
__attribute__((noinline)) void ff_c(long n) { ff_leaf(n); sink++; }
__attribute__((noinline)) void ff_b(long n) { ff_c(n); sink++; }
__attribute__((noinline)) void ff_a(long n) { ff_b(n); sink++; }
__attribute__((noinline)) void ff_y(long n) { ff_leaf(n); sink++; }
int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : -1;
    for (long r = 0; rounds < 0 || r < rounds; r++) { ff_a(3000000); ff_y(1000000); }
    return 0;
}
"#;

fn compile_c(dir: &Path, name: &str, src: &str, flags: &[&str]) -> PathBuf {
    let file = write(dir, &format!("{name}.c"), src);
    let bin = dir.join(name);
    run(Command::new("cc")
        .args(flags)
        .arg("-o")
        .arg(&bin)
        .arg(&file));
    bin
}

#[test]
fn c_without_frame_pointers_full_chain_and_caller_proportions() {
    c_full_chain(SamplerConfig::default());
}

/// The same with the programs of kernels without `bpf_loop` (Linux 5.10: bounded loops,
/// tail calls, probe reads), loaded here on purpose.
#[test]
fn c_without_frame_pointers_full_chain_with_the_bounded_walk() {
    c_full_chain(SamplerConfig {
        force_bounded_walk: true,
        ..SamplerConfig::default()
    });
}

fn c_full_chain(config: SamplerConfig) {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = compile_c(
        dir.path(),
        "ffchain",
        C_CHAIN,
        &["-O2", "-fomit-frame-pointer", "-g"],
    );
    let mut cg = TestCgroup::new("stacks-c");
    let pid = cg.spawn(&mut Command::new(&bin));
    support::wait_mapped(pid, "libc.so");
    let samplers = Samplers::new(config);
    // The walker is measured with the process's tables loaded (`start_cpu_with_tables`).
    let capture = support::start_cpu_with_tables(
        &samplers,
        &[CaptureTarget::raw(cg.cgroup.clone())],
        &CpuOptions {
            frequency: HZ,
            ..CpuOptions::default()
        },
        &[pid],
    );
    std::thread::sleep(Duration::from_secs(4));
    let (file, result) = finish(&samplers, capture, dir.path(), "c");
    assert_eq!(result.drops.total(), 0, "{:?}", result.drops);
    let ts = traces(&file, &[]);
    let (leaf, via_c) = chain_share(&ts, "ff_leaf", &["ff_c", "ff_b", "ff_a", "main"]);
    let (_, via_y) = chain_share(&ts, "ff_leaf", &["ff_y", "main"]);
    let full = 100.0 * (via_c + via_y) / leaf;
    let c_share = 100.0 * via_c / (via_c + via_y);
    eprintln!("C: {full:.1}% of ff_leaf full, ff_c share {c_share:.1}%");
    assert!(
        full >= 95.0,
        "expected >= 95% full chains, got {full:.1}%: {:#?}",
        &ts[..ts.len().min(4)]
    );
    assert!(
        (70.0..=80.0).contains(&c_share),
        "ff_c should be 75 ± 5% of ff_leaf's callers, got {c_share:.1}%"
    );
    // A frame-pointer walk of this binary loses the callers: the CFI walk found them.
    assert!(result.walk.frames_cfi > 0, "{:?}", result.walk);
}

#[test]
fn frame_pointer_walk_alone_loses_the_chain_of_the_same_binary() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = compile_c(
        dir.path(),
        "fffp",
        C_CHAIN,
        &["-O2", "-fomit-frame-pointer", "-g"],
    );
    let mut cg = TestCgroup::new("stacks-fp");
    cg.spawn(&mut Command::new(&bin));
    let samplers = Samplers::new(SamplerConfig::default());
    let capture = samplers
        .start_cpu(
            &[CaptureTarget::raw(cg.cgroup.clone())],
            &CpuOptions {
                frequency: HZ,
                cfi_unwind: false,
                ..CpuOptions::default()
            },
        )
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let (file, _) = finish(&samplers, capture, dir.path(), "fp");
    let ts = traces(&file, &[]);
    let (leaf, via_c) = chain_share(&ts, "ff_leaf", &["ff_c", "ff_b", "ff_a", "main"]);
    assert!(leaf > 0.0);
    assert!(
        via_c / leaf < 0.5,
        "the frame-pointer walk should not recover this chain (control for the CFI test)"
    );
}

const CPP_CHAIN: &str = r#"
#include <cstdlib>
#include <vector>
namespace ff {
static volatile unsigned long sink;
struct Stage { virtual void run(long n) = 0; virtual ~Stage() {} };
__attribute__((noinline)) void leaf(long n) { for (long i = 0; i < n; i++) sink += i * 3; }
struct Inner : Stage { __attribute__((noinline)) void run(long n) override { leaf(n); sink++; } };
template <typename T> __attribute__((noinline)) void middle(T &s, long n) { s.run(n); sink++; }
__attribute__((noinline)) void outer(Stage &s, long n) { middle(s, n); sink++; }
}
int main() {
    std::vector<ff::Stage *> v{new ff::Inner()};
    for (;;) ff::outer(*v[0], 2000000);
}
"#;

#[test]
fn cpp_o2_full_chain() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let src = write(dir.path(), "ffcpp.cc", CPP_CHAIN);
    let bin = dir.path().join("ffcpp");
    run(Command::new("g++").args(["-O2", "-o"]).arg(&bin).arg(&src));
    let mut cg = TestCgroup::new("stacks-cpp");
    cg.spawn(&mut Command::new(&bin));
    let samplers = Samplers::new(SamplerConfig::default());
    let (file, _) = capture(&samplers, &cg, dir.path(), "cpp", 3);
    assert_chain(
        &file,
        "ff::leaf",
        &["ff::Inner::run", "ff::middle", "ff::outer", "main"],
        &[],
    );
}

const RUST_CHAIN: &str = r#"
use std::hint::black_box;
#[inline(never)] fn ff_rust_leaf(n: u64) -> u64 { let mut s = 0u64; for i in 0..n { s = s.wrapping_add(black_box(i) * 5); } s }
#[inline(never)] fn ff_rust_c(n: u64) -> u64 { black_box(ff_rust_leaf(n)) + 1 }
#[inline(never)] fn ff_rust_b(n: u64) -> u64 { black_box(ff_rust_c(n)) + 1 }
#[inline(never)] fn ff_rust_a(n: u64) -> u64 { black_box(ff_rust_b(n)) + 1 }
fn main() { loop { black_box(ff_rust_a(black_box(2_000_000))); } }
"#;

#[test]
fn rust_release_full_chain() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let src = write(dir.path(), "ffrust.rs", RUST_CHAIN);
    let bin = dir.path().join("ffrust");
    // What `cargo build --release` does: opt-level 3, no frame pointers.
    run(Command::new("rustc")
        .args(["-C", "opt-level=3", "-C", "force-frame-pointers=no", "-o"])
        .arg(&bin)
        .arg(&src));
    let mut cg = TestCgroup::new("stacks-rust");
    cg.spawn(&mut Command::new(&bin));
    let samplers = Samplers::new(SamplerConfig::default());
    let (file, _) = capture(&samplers, &cg, dir.path(), "rust", 3);
    assert_chain(
        &file,
        "ff_rust_leaf",
        &["ff_rust_c", "ff_rust_b", "ff_rust_a", "ffrust::main"],
        &[],
    );
}

/// Hot frames inside libc.so.6 (built without frame pointers): a qsort
/// comparison callback and memcpy, each under a known chain in the program.
const LIBC_WORK: &str = r#"
#include <stdlib.h>
#include <string.h>
static volatile unsigned long sink;
__attribute__((noinline)) int ff_cmp(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    for (int i = 0; i < 20; i++) sink += i;
    return (x > y) - (x < y);
}
__attribute__((noinline)) void ff_sort_stage(long *v, long n) {
    for (long i = 0; i < n; i++) v[i] = (i * 7919) % n;
    qsort(v, n, sizeof(long), ff_cmp);
    sink += v[0]; /* not a tail call: ff_sort_stage keeps its frame */
}
__attribute__((noinline)) void ff_copy_stage(char *dst, const char *src, long n) {
    for (int r = 0; r < 50; r++) { memcpy(dst, src, n); sink += dst[r]; }
}
int main(void) {
    long n = 20000; long *v = malloc(n * sizeof(long));
    long m = 16 << 20; char *a = malloc(m), *b = malloc(m); memset(a, 1, m);
    for (;;) { ff_sort_stage(v, n); ff_copy_stage(b, a, m); }
}
"#;

#[test]
fn frames_in_libc_unwind_to_the_program() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = compile_c(
        dir.path(),
        "fflibc",
        LIBC_WORK,
        &["-O2", "-fomit-frame-pointer", "-g"],
    );
    let mut cg = TestCgroup::new("stacks-libc");
    cg.spawn(&mut Command::new(&bin));
    let samplers = Samplers::new(SamplerConfig::default());
    let (file, _) = capture(&samplers, &cg, dir.path(), "libc", 5);
    let ts = traces(&file, &[]);
    // The callback: ff_cmp ← libc's sort internals ← qsort ← ff_sort_stage ← main.
    let (cmp, cmp_ok) = {
        let (mut all, mut ok) = (0.0, 0.0);
        for t in &ts {
            let Some(i) = t.frames.iter().position(|f| f.contains("ff_cmp")) else {
                continue;
            };
            all += t.weight;
            let rest = &t.frames[i + 1..];
            let stage = rest.iter().position(|f| f.contains("ff_sort_stage"));
            if stage.is_some_and(|s| {
                rest[..s].iter().any(|f| f.contains("qsort"))
                    && rest.get(s + 1).is_some_and(|m| m == "main")
            }) {
                ok += t.weight;
            }
        }
        (all, ok)
    };
    assert!(cmp > 0.0, "no samples in the qsort callback");
    let pct = 100.0 * cmp_ok / cmp;
    eprintln!("qsort callback: {pct:.1}% reach ff_sort_stage ← main through libc");
    assert!(pct >= 95.0, "got {pct:.1}%");
    // memcpy's own frames (libc) → ff_copy_stage → main.
    assert_chain(&file, "memcpy", &["ff_copy_stage", "main"], &[]);
}

#[test]
fn processes_starting_and_exiting_during_the_capture_have_full_stacks() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let early = compile_c(
        dir.path(),
        "ffearly",
        C_CHAIN,
        &["-O2", "-fomit-frame-pointer", "-DEARLY"],
    );
    let late = compile_c(
        dir.path(),
        "fflate",
        C_CHAIN,
        &["-O2", "-fomit-frame-pointer", "-DLATE"],
    );
    let mut cg = TestCgroup::new("stacks-life");
    // Exits during the capture: a fixed number of rounds (a few seconds of CPU).
    let early_pid = cg.spawn(Command::new(&early).arg("400"));
    let samplers = Samplers::new(SamplerConfig::default());
    let target = [CaptureTarget::raw(cg.cgroup.clone())];
    let start = || {
        let options = CpuOptions {
            frequency: HZ,
            ..CpuOptions::default()
        };
        samplers.start_cpu(&target, &options).unwrap()
    };
    let capture = start();
    // Starts during the capture: a binary no process mapped before. Its unwind tables are
    // built in the background from the exec notification; the unwinder says when they
    // are loaded, which must happen while the capture runs (nothing else registers it).
    let late_pid = cg.spawn(&mut Command::new(&late));
    let unwinder = capture
        .sampler()
        .unwinder()
        .cloned()
        .expect("CFI unwinding is on by default");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !unwinder.is_registered(late_pid) {
        assert!(
            Instant::now() < deadline,
            "the process started during the capture got no unwind tables within 60 s: {:?}",
            unwinder.stats()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while Path::new(&format!("/proc/{early_pid}/stat")).exists()
        && std::fs::read_to_string(format!("/proc/{early_pid}/stat"))
            .is_ok_and(|s| !s.contains(") Z "))
    {
        assert!(Instant::now() < deadline, "early process did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (file, _) = finish(&samplers, capture, dir.path(), "life");
    // The samples of the started process from before its tables were loaded walk with
    // frame pointers only (how many depends on the machine's load), so its chain is
    // checked in a second capture on the same sampler, after the tables were announced.
    let after = start();
    std::thread::sleep(Duration::from_secs(2));
    let (file_after, _) = finish(&samplers, after, dir.path(), "life-after");
    for (name, pid, file) in [
        ("exiting", early_pid, &file),
        ("started", late_pid, &file_after),
    ] {
        let ts = traces(file, &["-tagfocus", &format!("pid={pid}")]);
        let (leaf, via_c) = chain_share(&ts, "ff_leaf", &["ff_c", "ff_b", "ff_a", "main"]);
        let (_, via_y) = chain_share(&ts, "ff_leaf", &["ff_y", "main"]);
        let pct = 100.0 * (via_c + via_y) / leaf;
        eprintln!("{name} process: {pct:.1}% of ff_leaf's samples with the full chain");
        assert!(leaf > 0.0 && pct >= 95.0, "{name} process: got {pct:.1}%");
    }
}

const GO_LEAF: &str = r#"
package main

var sink uint64

// A leaf without a frame: no locals on the stack, no calls.
//
//go:noinline
func leaf(n uint64) uint64 {
	s := uint64(0)
	for i := uint64(0); i < n; i++ {
		s += i ^ (s >> 3)
	}
	return s
}

// Inlined into worker: Go's profiler shows it as its own frame.
func step(n uint64) { sink += leaf(n) }

//go:noinline
func worker() {
	for i := 0; i < 1000; i++ {
		step(100000)
	}
}

func main() {
	for {
		worker()
	}
}
"#;

#[test]
fn go_frameless_leaf_names_its_caller_and_inlined_frames() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "main.go", GO_LEAF);
    write(dir.path(), "go.mod", "module fftest\n\ngo 1.22\n");
    let bin = dir.path().join("ffgo");
    run(Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(dir.path())
        .env("CGO_ENABLED", "0"));
    let mut cg = TestCgroup::new("stacks-go");
    cg.spawn(&mut Command::new(&bin));
    let samplers = Samplers::new(SamplerConfig::default());
    let (file, _) = capture(&samplers, &cg, dir.path(), "go", 3);
    assert_chain(
        &file,
        "main.leaf",
        &["main.step", "main.worker", "main.main"],
        &[],
    );
}

const JS_HOT: &str = r#"
function ffHotLoop(n) {
  let s = 0;
  for (let i = 0; i < n; i++) s = (s + i * 31) % 1000003;
  return s;
}
let t = 0;
const end = Date.now() + 1000 * Number(process.argv[2] || 60);
while (Date.now() < end) t += ffHotLoop(200000);
console.log(t);
"#;

#[test]
fn node_jit_functions_are_named_from_the_perf_map() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let js = write(dir.path(), "hot.js", JS_HOT);
    let mut cg = TestCgroup::new("stacks-node");
    let pid = cg.spawn(
        Command::new("node")
            .arg("--perf-basic-prof")
            .arg(&js)
            .arg("60")
            // V8 may write isolate logs to its working directory: not the source tree.
            .current_dir(dir.path()),
    );
    // Synchronize on the perf map naming the function (written when V8 compiles it).
    let map = PathBuf::from(format!("/tmp/perf-{pid}.map"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&map).is_ok_and(|t| t.contains("ffHotLoop")) {
        assert!(
            Instant::now() < deadline,
            "node wrote no perf map entry for ffHotLoop"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let samplers = Samplers::new(SamplerConfig::default());
    let (file, result) = capture(&samplers, &cg, dir.path(), "node", 3);
    let _ = std::fs::remove_file(&map);
    let ts = traces(&file, &[]);
    let total: f64 = ts.iter().map(|t| t.weight).sum();
    let hot: f64 = ts
        .iter()
        .filter(|t| t.frames.iter().any(|f| f.contains("ffHotLoop")))
        .map(|t| t.weight)
        .sum();
    eprintln!(
        "node: {:.1}% of samples name ffHotLoop ({} samples)",
        100.0 * hot / total,
        result.total()
    );
    assert!(
        hot / total >= 0.5,
        "expected most samples in ffHotLoop, got {:.1}%",
        100.0 * hot / total
    );
}

#[test]
fn corrupt_or_missing_cfi_falls_back_and_is_counted() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    // No CFI at all, frame pointers kept: the fallback walk still gets the chain.
    let nocfi = compile_c(
        dir.path(),
        "ffnocfi",
        C_CHAIN,
        &[
            "-O1",
            "-fno-omit-frame-pointer",
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
            "-DNOCFI",
        ],
    );
    run(Command::new("objcopy")
        .args([
            "--remove-section",
            ".eh_frame",
            "--remove-section",
            ".eh_frame_hdr",
        ])
        .arg(&nocfi));
    // Corrupt CFI: every byte of .eh_frame after the first CIE overwritten.
    let corrupt = compile_c(
        dir.path(),
        "ffcorrupt",
        C_CHAIN,
        &["-O2", "-fomit-frame-pointer", "-DCORRUPT"],
    );
    let mut bytes = std::fs::read(&corrupt).unwrap();
    let (off, size) = {
        use object::{Object as _, ObjectSection as _};
        let obj = object::File::parse(bytes.as_slice()).unwrap();
        obj.section_by_name(".eh_frame")
            .and_then(|s| s.file_range())
            .unwrap()
    };
    for (i, b) in bytes[off as usize + 24..(off + size) as usize]
        .iter_mut()
        .enumerate()
    {
        *b = (i as u8).wrapping_mul(37) ^ 0xa5;
    }
    std::fs::write(&corrupt, &bytes).unwrap();
    let mut cg = TestCgroup::new("stacks-badcfi");
    let nocfi_pid = cg.spawn(&mut Command::new(&nocfi));
    cg.spawn(&mut Command::new(&corrupt));
    let samplers = Samplers::new(SamplerConfig::default());
    let (file, result) = capture(&samplers, &cg, dir.path(), "badcfi", 3);
    let tables = result.unwinder.expect("CFI unwinding on");
    assert!(
        tables.binaries_without_cfi >= 1,
        "the binary without .eh_frame is counted: {tables:?}"
    );
    assert!(
        tables.binaries_without_cfi + tables.cfi_entries_skipped >= 2,
        "the corrupt .eh_frame is counted too: {tables:?}"
    );
    assert!(
        result.walk.frames_fp > 0,
        "frame-pointer fallback used: {:?}",
        result.walk
    );
    // Without CFI the walk is the frame-pointer one: the frameless leaf's
    // caller is skipped (no table says the leaf has no frame), the rest stands.
    let ts = traces(&file, &["-tagfocus", &format!("pid={nocfi_pid}")]);
    let (mut leaf, mut rooted) = (0.0, 0.0);
    for t in &ts {
        let Some(i) = t.frames.iter().position(|f| f.contains("ff_leaf")) else {
            continue;
        };
        leaf += t.weight;
        let rest = &t.frames[i + 1..];
        if rest.iter().any(|f| f == "main") {
            rooted += t.weight;
        }
    }
    assert!(
        leaf > 0.0 && rooted / leaf >= 0.95,
        "frame-pointer fallback reaches main: {:.1}%",
        100.0 * rooted / leaf.max(1.0)
    );
    // The corrupt binary's samples are there (leaf named), whatever their callers.
    let ts = traces(&file, &["-tagfocus", "comm=ffcorrupt"]);
    assert!(
        !ts.is_empty(),
        "samples of the corrupt-CFI process are kept"
    );
    let comments = support::pprof()
        .arg("-comments")
        .arg(&file)
        .output()
        .unwrap();
    let comments = String::from_utf8_lossy(&comments.stdout);
    assert!(comments.contains("without usable CFI"), "{comments}");
    assert!(comments.contains("unsymbolized"), "{comments}");
}

/// Allocations from one site under main → ff_h1 → ff_h2 → ff_h3 → ff_alloc_site,
/// with the blocks freed 256 allocations later.
const HEAP_CHAIN: &str = r#"
#include <stdlib.h>
static void *volatile keep[256];
static volatile unsigned long sink;
__attribute__((noinline)) void *ff_alloc_site(unsigned long n) {
    char *p = malloc(n);
    if (p) p[0] = 1; /* uses the result: malloc is not a tail call */
    return p;
}
__attribute__((noinline)) void ff_h3(long i) {
    void *p = ff_alloc_site(4096 + (i & 7) * 512);
    free(keep[i & 255]);
    keep[i & 255] = p;
    sink++;
}
__attribute__((noinline)) void ff_h2(long i) { ff_h3(i); sink++; }
__attribute__((noinline)) void ff_h1(long i) { ff_h2(i); sink++; }
int main(void) { for (long i = 0;; i++) ff_h1(i); }
"#;

/// A heap capture of `cg` for `secs`; the written profile and the capture's counters.
fn capture_heap(
    cg: &TestCgroup,
    dir: &Path,
    name: &str,
    cfi_unwind: bool,
) -> (PathBuf, heap_ebpf::EbpfHeapStats) {
    let (profile, stats) = heap_ebpf::capture(
        &flamefleet_agent::capture::Samplers::new(
            flamefleet_agent::capture::SamplerConfig::default(),
        ),
        &[CaptureTarget::raw(cg.cgroup.clone())],
        &EbpfHeapOptions {
            duration: Duration::from_secs(3),
            sample_bytes: 256 * 1024,
            cfi_unwind,
            // An allocation loop on purpose: the overhead guard would refuse it.
            max_overhead_percent: 0.0,
            ..EbpfHeapOptions::default()
        },
    )
    .expect("heap capture");
    let out = dir.join(format!("{name}.pb.gz"));
    flamefleet_agent::cli::write_profile(&out, &profile).unwrap();
    eprintln!("{name}: {stats:?}");
    (out, stats)
}

#[test]
fn heap_allocation_site_without_frame_pointers_has_its_callers() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bin = compile_c(
        dir.path(),
        "ffheap",
        HEAP_CHAIN,
        &["-O2", "-fomit-frame-pointer", "-g"],
    );
    let mut cg = TestCgroup::new("stacks-heap");
    cg.spawn(&mut Command::new(&bin));
    let chain = ["ff_h3", "ff_h2", "ff_h1", "main"];
    let (file, stats) = capture_heap(&cg, dir.path(), "heap", true);
    assert!(stats.sampled > 100, "too few samples: {stats:?}");
    let walk = stats.walk.expect("CFI walk counters");
    assert!(walk.frames_cfi > 0, "{walk:?}");
    assert_chain(
        &file,
        "ff_alloc_site",
        &chain,
        &["-sample_index=alloc_space"],
    );
    // Control: the frame-pointer walk of the same process loses the chain.
    let (file, _) = capture_heap(&cg, dir.path(), "heap-fp", false);
    let ts = traces(&file, &["-sample_index=alloc_space"]);
    let (leaf, full) = chain_share(&ts, "ff_alloc_site", &chain);
    assert!(leaf > 0.0, "no allocation attributed to ff_alloc_site");
    assert!(
        full / leaf < 0.5,
        "the frame-pointer walk should not recover this chain (control for the CFI test): {:.1}%",
        100.0 * full / leaf
    );
}
