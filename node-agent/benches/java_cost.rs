//! What naming Java frames costs: the agent's per-JVM setup when it builds a profile
//! (attaching — the trigger file, SIGQUIT and the listener's start the first time —,
//! `VM.version`, `VM.flags`, `Compiler.perfmap`, then reading the perf map), and the CPU
//! sampler's BPF run time per sample of a JVM (OpenJDK 17 and Temurin 25 with
//! `-XX:+PreserveFramePointer`, running the tests' 5:3:2 workload) against a native
//! process (C, main → a → b → c → leaf) measured in the same run.
//!
//! "Without Java frames", two peers in the same run: the same OpenJDK 17 workload without
//! `-XX:+PreserveFramePointer` (the walk stops at the first compiled frame), for the BPF
//! cost; and, for the agent's CPU time to build a profile of a JVM's samples, the same
//! capture built with the attach off and no perf map (compiled frames left unnamed)
//! against it built with the attach on (commands, the JVM's perf map read and applied).
//! The native process's profile is built the same way, as the baseline.
//!
//! The program runs on every CPU's perf event, for the target's samples and (returning
//! early) for everything else on the machine: a capture of an empty cgroup first prices
//! that early return, and each workload's figure is its window's run time less those
//! early returns, per sample of the workload.
//!
//! Only the workload being measured runs: the others are stopped (`SIGSTOP`) meanwhile.
//!
//! A benchmark: it prints, it never asserts.
//!
//! ```text
//! cargo bench -p flamefleet-agent --bench java_cost -- [--seconds 4] [--rounds 3]
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::capture::{SamplerConfig, Samplers};
use flamefleet_agent::perf_map::{PerfMap, PerfMapBudget};
use flamefleet_agent::process::ProcessCatalog;
use flamefleet_agent::symbolize::StackSymbolizer;
use shared::{Workload, flag, median};

mod shared;

const NATIVE: &str = r#"
static volatile unsigned long sink;
__attribute__((noinline)) void ff_leaf(long n) { for (long i = 0; i < n; i++) sink += i * 7; }
__attribute__((noinline)) void ff_c(long n) { ff_leaf(n); sink++; }
__attribute__((noinline)) void ff_b(long n) { ff_c(n); sink++; }
__attribute__((noinline)) void ff_a(long n) { ff_b(n); sink++; }
int main(void) { for (;;) ff_a(1000000); }
"#;

/// The Java tests' 5:3:2 workload; it prints "ready" once compiled.
const BURN: &str = include_str!("../tests/java_workloads/Burn.java");
const JDKS: [(&str, &str); 2] = [
    ("java17", "/usr/lib/jvm/java-17-openjdk-amd64"),
    ("java25", "/usr/lib/jvm/temurin-25-jdk-amd64"),
];
const HZ: u64 = 499;

/// Compiles Burn.java with the JDK at `home` into `dir`.
fn javac(home: &str, dir: &Path) -> Result<PathBuf> {
    let src = dir.join("Burn.java");
    std::fs::write(&src, BURN)?;
    let javac = Path::new(home).join("bin/javac");
    if !javac.exists() {
        bail!(
            "{} is missing: scripts/setup.sh installs the JDKs",
            javac.display()
        );
    }
    let out_dir = dir.join(home.rsplit('/').next().unwrap_or("jdk"));
    let status = Command::new(javac)
        .arg("-d")
        .arg(&out_dir)
        .arg(&src)
        .status()?;
    if !status.success() {
        bail!("javac failed");
    }
    Ok(out_dir)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let seconds: u64 = flag(&args, "--seconds").unwrap_or(4);
    let rounds: usize = flag(&args, "--rounds").unwrap_or(3);
    if !nix::unistd::Uid::effective().is_root() {
        bail!("run as root: the bench loads eBPF programs and creates cgroups");
    }
    println!("load average at start: {}", shared::loadavg());
    let tmp = tempfile::tempdir()?;
    let native = shared::compile_c(tmp.path(), "ff-javacost-native", NATIVE)?;
    let mut workloads = vec![
        Workload::start("javacost", "idle", None, false)?,
        Workload::start("javacost", "native", Some(Command::new(&native)), false)?,
    ];
    workloads[1].pause();
    for (name, home) in JDKS {
        let classes = javac(home, tmp.path())?;
        let mut cmd = Command::new(Path::new(home).join("bin/java"));
        cmd.arg("-XX:+PreserveFramePointer")
            .arg("-cp")
            .arg(&classes)
            .arg("dev.flamefleet.burn.Burn");
        workloads.push(Workload::start("javacost", name, Some(cmd), true)?);
        if let Some(w) = workloads.last() {
            w.pause();
        }
    }
    // The peer without frame pointers in compiled code.
    let (_, home17) = JDKS[0];
    let classes = javac(home17, tmp.path())?;
    let mut cmd = Command::new(Path::new(home17).join("bin/java"));
    cmd.arg("-cp").arg(&classes).arg("dev.flamefleet.burn.Burn");
    workloads.push(Workload::start("javacost", "java17-nofp", Some(cmd), true)?);
    if let Some(w) = workloads.last() {
        w.pause();
    }

    // Per-JVM setup: what the symbolizer does for a JVM it meets, first with the attach
    // listener to start (signal), then with it running, then reading the perf map.
    let catalog = ProcessCatalog::new();
    println!("## Per-JVM setup when a profile is built (attach + commands; perf map read)");
    for w in &workloads[2..] {
        let pid = w.pid();
        w.resume();
        catalog.snapshot(pid);
        let maps = catalog.lookup(pid).context("snapshot of the JVM")?;
        let mut first = flamefleet_agent::java::prepare(pid, &maps, true)
            .context("the JVM is not detected as HotSpot")?;
        let mut again = Vec::new();
        let mut read = Vec::new();
        let mut entries = 0;
        for _ in 0..5 {
            let s = flamefleet_agent::java::prepare(pid, &maps, true)
                .context("the JVM is not detected as HotSpot")?;
            again.push(s.setup.as_secs_f64() * 1e3);
            let t = Instant::now();
            let map = PerfMap::read(pid, maps.start_time, &mut PerfMapBudget::default());
            read.push(t.elapsed().as_secs_f64() * 1e3);
            entries = map.map_or(0, |m| m.len());
        }
        // prepare() asks for the map; the symbolizer reads it. Report what was read, or
        // the status would say the map was not found.
        first.perf_map_entries = entries;
        println!(
            "{:>8}: first {:>7.2} ms (starts the listener); later {:>6.2} ms; perf map read \
             {:>6.2} ms ({entries} entries); {}",
            w.name,
            first.setup.as_secs_f64() * 1e3,
            median(again),
            median(read),
            first
        );
        w.pause();
    }

    let stats_path = "/proc/sys/kernel/bpf_stats_enabled";
    let stats_before = std::fs::read_to_string(stats_path).unwrap_or_else(|_| "0".into());
    std::fs::write(stats_path, "1").context("enabling kernel.bpf_stats_enabled")?;
    let samplers = Samplers::new(SamplerConfig::default());
    // A first capture of each registers it (unwind tables).
    for w in &workloads {
        w.cpu_window(&samplers, HZ, 1)?;
    }
    let mut per_sample: Vec<Vec<f64>> = vec![Vec::new(); workloads.len()];
    for _ in 0..rounds {
        let (ns, cnt, _) = workloads[0].cpu_window(&samplers, HZ, seconds)?;
        let early = ns as f64 / cnt.max(1) as f64;
        per_sample[0].push(early);
        for (i, w) in workloads.iter().enumerate().skip(1) {
            let (ns, cnt, samples) = w.cpu_window(&samplers, HZ, seconds)?;
            let others = cnt.saturating_sub(samples) as f64 * early;
            per_sample[i].push((ns as f64 - others).max(0.0) / samples.max(1) as f64);
        }
    }
    // The agent's CPU time to build a profile from one capture of each workload, with a
    // symbolizer of its own each time (as each capture's is): the native process, then
    // each JVM with the attach off and its perf map removed (Java frames unnamed) and
    // with the attach on (named).
    let mut build: Vec<(String, Vec<f64>, Vec<f64>, f64)> = Vec::new();
    for w in workloads.iter().skip(1) {
        w.resume();
        let capture = samplers.start_cpu(
            &[w.target()?],
            &flamefleet_agent::capture::cpu::CpuOptions {
                frequency: HZ,
                ..Default::default()
            },
        )?;
        std::thread::sleep(std::time::Duration::from_secs(seconds));
        let result = capture.finish()?;
        let is_jvm = w.name.starts_with("java");
        let (mut off, mut on) = (Vec::new(), Vec::new());
        let mut named = 0.0;
        for _ in 0..rounds {
            for attach in [false, true] {
                if attach && !is_jvm {
                    continue;
                }
                if !attach {
                    let _ = std::fs::remove_file(format!("/tmp/perf-{}.map", w.pid()));
                }
                let mut sym = StackSymbolizer::new(samplers.catalog().clone());
                sym.java_attach(attach);
                let before = cpu_time();
                let profile = result.to_profile(&mut sym, "");
                let spent = (cpu_time() - before) * 1e3;
                if attach {
                    on.push(spent);
                    named = shared::named_share(&profile, "dev.flamefleet.burn.Burn.");
                } else {
                    off.push(spent);
                }
            }
        }
        w.pause();
        build.push((w.name.clone(), off, on, named));
    }

    let _ = std::fs::write(stats_path, stats_before.trim());
    println!(
        "\n## BPF run time per CPU sample (bpf_stats, {HZ} Hz, {seconds} s windows, median of {rounds})"
    );
    let native_ns = median(per_sample[1].clone());
    for (i, w) in workloads.iter().enumerate() {
        let m = median(per_sample[i].clone());
        if i == 0 {
            println!(
                "{:>12}: {m:>8.0} ns per run returning early (not a target)",
                w.name
            );
        } else {
            println!(
                "{:>12}: {m:>8.0} ns per sample  ({:.2}x native)",
                w.name,
                m / native_ns.max(1.0)
            );
        }
    }
    println!(
        "\n## Agent CPU time to build one profile ({seconds} s capture at {HZ} Hz, user + \
         system time of the whole process, median of {rounds})"
    );
    for (name, off, on, named) in build {
        if on.is_empty() {
            println!("{name:>12}: {:>7.1} ms", median(off));
        } else {
            println!(
                "{name:>12}: {:>7.1} ms without Java frames (attach off, no perf map); \
                 {:>7.1} ms with them (attach on: {named:.1}% of samples under a named Burn \
                 method)",
                median(off),
                median(on)
            );
        }
    }
    println!("\nload average at the end: {}", shared::loadavg());
    Ok(())
}

/// User plus system CPU time of this process so far, seconds.
fn cpu_time() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}
