//! What reading Python frames costs the CPU sampler: the BPF program's run time per sample
//! of a CPython process (3.8-3.13, pyenv's, running three functions under main() under
//! `<module>`) against a native process (C, main → a → b → c → leaf) measured in the same
//! run, and the agent's per-process setup (detecting the interpreter and writing its entry).
//!
//! The program runs on every CPU's perf event, for the target's samples and (returning
//! early) for everything else on the machine: a capture of an empty cgroup first prices
//! that early return, and each workload's figure is its window's run time less those
//! early returns, per sample of the workload.
//!
//! The same native process is also measured on a sampler loaded without Python frames
//! (`SamplerConfig::python_frames: false`): what reading Python frames costs the samples
//! of processes that are not Python (one map lookup).
//!
//! Off-CPU, the same for the off-CPU program (`offcpu_switch` on `sched_switch`), which
//! reads a blocking thread's Python frames at its switch-out: BPF run time per block of a
//! target (its switch-out, where the stacks are walked, and its switch-in) for a CPython
//! process blocking every 200 µs under four Python frames, against a native process of
//! the same shape, and against the same CPython process on a sampler without Python
//! frames. The other runs of the program on the machine (two per context switch of
//! anything else) are priced by a capture of an empty cgroup, as above.
//!
//! Only the workload being measured runs: the others are stopped (`SIGSTOP`) between its
//! windows, so that seven CPU burners do not share the CPUs with it.
//!
//! A benchmark: it prints, it never asserts.
//!
//! ```text
//! cargo bench -p flamefleet-agent --bench python_cost -- [--seconds 4] [--rounds 3]
//! ```

use std::path::Path;
use std::process::{Child, Command};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::capture::offcpu::OffcpuOptions;
use flamefleet_agent::capture::{SamplerConfig, Samplers};
use flamefleet_agent::process::ProcessCatalog;
use flamefleet_agent::python::PythonRegistry;
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

/// The Python tests' 5:3:2 workload; it prints "ready" once warm.
const BURN: &str = include_str!("../tests/python_workloads/burn.py");

/// Off-CPU: a native process blocking every 200 µs under main → a → b → c → leaf.
const NATIVE_BLOCKER: &str = r#"
#include <time.h>
__attribute__((noinline)) void ff_leaf(void) { struct timespec t = {0, 200000}; nanosleep(&t, 0); }
__attribute__((noinline)) void ff_c(void) { ff_leaf(); }
__attribute__((noinline)) void ff_b(void) { ff_c(); }
__attribute__((noinline)) void ff_a(void) { ff_b(); }
int main(void) { for (;;) ff_a(); }
"#;

/// Off-CPU: the same shape in Python (`<module>` → main → a → b → leaf → time.sleep).
const PY_BLOCKER: &str = r#"
import time
def leaf():
    time.sleep(0.0002)
def b():
    leaf()
def a():
    b()
def main():
    a()
    print("ready", flush=True)
    while True:
        a()
main()
"#;

const VERSIONS: [&str; 6] = ["3.8.18", "3.9.18", "3.10.13", "3.11.7", "3.12.1", "3.13.0"];
const HZ: u64 = 499;

/// A workload in a cgroup `pycost-<name>`: `program` with `args` (none: an empty cgroup).
fn start(name: &str, program: Option<&Path>, args: &[&Path], ready: bool) -> Result<Workload> {
    let cmd = program.map(|p| {
        let mut c = Command::new(p);
        c.args(args);
        c
    });
    Workload::start("pycost", name, cmd, ready)
}

/// One off-CPU window: (run time ns, program runs, blocks of the target).
fn offcpu_window(samplers: &Samplers, w: &Workload, seconds: u64) -> Result<(u64, u64, u64)> {
    w.resume();
    let r = offcpu_window_running(samplers, w, seconds);
    w.pause();
    r
}

fn offcpu_window_running(
    samplers: &Samplers,
    w: &Workload,
    seconds: u64,
) -> Result<(u64, u64, u64)> {
    let capture = samplers.start_offcpu(&[w.target()?], &OffcpuOptions::default())?;
    let before = shared::own_bpf_stats(&["offcpu_switch"])?;
    std::thread::sleep(std::time::Duration::from_secs(seconds));
    let (ns, runs) = shared::bpf_delta(&before, &shared::own_bpf_stats(&["offcpu_switch"])?);
    let result = capture.finish()?;
    Ok((ns, runs, result.stats.blocks))
}

/// Off-CPU run time per block of the target: its window's run time less the runs that
/// were not its own (each block is two runs: its switch-out and its switch-in) at the
/// early-return price `early`.
fn per_block(window: (u64, u64, u64), early: f64) -> f64 {
    let (ns, runs, blocks) = window;
    let others = runs.saturating_sub(2 * blocks) as f64 * early;
    (ns as f64 - others).max(0.0) / blocks.max(1) as f64
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
    let native = shared::compile_c(tmp.path(), "ff-pycost-native", NATIVE)?;
    let script = tmp.path().join("burn.py");
    std::fs::write(&script, BURN)?;
    let pyenv = std::env::var("PYENV_ROOT").unwrap_or_else(|_| "/root/.pyenv".into());
    let mut workloads = vec![
        start("idle", None, &[], false)?,
        start("native", Some(&native), &[], false)?,
    ];
    for v in VERSIONS {
        let minor = v.rsplit_once('.').map_or(v, |(m, _)| m);
        let bin = Path::new(&pyenv).join(format!("versions/{v}/bin/python{minor}"));
        if !bin.exists() {
            bail!("{} is missing: pyenv install {v}", bin.display());
        }
        workloads.push(start(
            &format!("python{minor}"),
            Some(&bin),
            &[&script],
            true,
        )?);
    }
    for w in &workloads {
        w.pause();
    }
    // Per-process setup: detection and the BPF entry, for a new binary (the first
    // process of an interpreter the agent meets) then a known one (a second process of
    // the same interpreter: the binary's inspection is cached). The process snapshot
    // before it (maps, binaries, build IDs) is what every process sampled costs, Python
    // or not; it is printed beside it.
    let registry = PythonRegistry::shared()?;
    let catalog = ProcessCatalog::new();
    let script_idle = tmp.path().join("idle.py");
    std::fs::write(
        &script_idle,
        "import time\nprint('ready', flush=True)\ntime.sleep(3600)\n",
    )?;
    println!(
        "## Python process setup (detect the interpreter, write its py_procs entry; \
         the process snapshot every sampled process costs beside it)"
    );
    let setup = |pid: u32| -> Result<(f64, f64, String)> {
        let t = Instant::now();
        catalog.snapshot(pid);
        let snapshot = t.elapsed().as_secs_f64() * 1e3;
        let maps = catalog.lookup(pid).context("snapshot of the interpreter")?;
        let t = Instant::now();
        registry.register(pid, &maps);
        let register = t.elapsed().as_secs_f64() * 1e3;
        let status = registry
            .status(pid)
            .map_or_else(|| "not detected".into(), |s| s.to_string());
        Ok((snapshot, register, status))
    };
    for (v, w) in VERSIONS.iter().zip(&workloads[2..]) {
        let pid = w.child.as_ref().map(Child::id).unwrap_or(0);
        let (snap, cold, status) = setup(pid)?;
        let minor = v.rsplit_once('.').map_or(*v, |(m, _)| m);
        let bin = Path::new(&pyenv).join(format!("versions/{v}/bin/python{minor}"));
        let second = start(
            &format!("{}-second", w.name),
            Some(&bin),
            &[&script_idle],
            true,
        )?;
        let pid2 = second.child.as_ref().map(Child::id).unwrap_or(0);
        let (snap2, known, _) = setup(pid2)?;
        println!(
            "{:>10}: new binary {cold:>7.2} ms, known binary {known:>6.2} ms  \
             (snapshot {snap:>6.2} / {snap2:>6.2} ms)  {status}",
            w.name
        );
    }

    let stats_path = "/proc/sys/kernel/bpf_stats_enabled";
    let stats_before = std::fs::read_to_string(stats_path).unwrap_or_else(|_| "0".into());
    std::fs::write(stats_path, "1").context("enabling kernel.bpf_stats_enabled")?;
    let samplers = Samplers::new(SamplerConfig::default());
    let without = Samplers::new(SamplerConfig {
        python_frames: false,
        ..SamplerConfig::default()
    });
    // A first capture of each registers it (unwind tables, Python entry).
    for w in &workloads {
        w.cpu_window(&samplers, HZ, 1)?;
    }
    workloads[1].cpu_window(&without, HZ, 1)?;
    let mut per_sample: Vec<Vec<f64>> = vec![Vec::new(); workloads.len()];
    let mut native_without = Vec::new();
    for _ in 0..rounds {
        let (ns, cnt, _) = workloads[0].cpu_window(&samplers, HZ, seconds)?;
        let early = ns as f64 / cnt.max(1) as f64;
        per_sample[0].push(early);
        for (i, w) in workloads.iter().enumerate().skip(1) {
            let (ns, cnt, samples) = w.cpu_window(&samplers, HZ, seconds)?;
            let others = cnt.saturating_sub(samples) as f64 * early;
            per_sample[i].push((ns as f64 - others).max(0.0) / samples.max(1) as f64);
        }
        let (ns, cnt, samples) = workloads[1].cpu_window(&without, HZ, seconds)?;
        let others = cnt.saturating_sub(samples) as f64 * early;
        native_without.push((ns as f64 - others).max(0.0) / samples.max(1) as f64);
    }
    // Off-CPU: the CPU burners stop, and the blockers run (one at a time, as above), each
    // in a cgroup of its own.
    for w in &mut workloads {
        w.stop();
    }
    let native_blocker = shared::compile_c(tmp.path(), "ff-pycost-blocker", NATIVE_BLOCKER)?;
    let py_blocker = tmp.path().join("blocker.py");
    std::fs::write(&py_blocker, PY_BLOCKER)?;
    let mut blockers = vec![
        start("idle", None, &[], false)?,
        start("native", Some(&native_blocker), &[], false)?,
    ];
    for v in VERSIONS {
        let minor = v.rsplit_once('.').map_or(v, |(m, _)| m);
        let bin = Path::new(&pyenv).join(format!("versions/{v}/bin/python{minor}"));
        blockers.push(start(
            &format!("python{minor}"),
            Some(&bin),
            &[&py_blocker],
            true,
        )?);
        if let Some(w) = blockers.last() {
            w.pause();
        }
    }
    blockers[1].pause();
    for w in &blockers {
        offcpu_window(&samplers, w, 1)?;
    }
    for w in &blockers[2..] {
        offcpu_window(&without, w, 1)?;
    }
    let mut per_block_with: Vec<Vec<f64>> = vec![Vec::new(); blockers.len()];
    let mut per_block_without: Vec<Vec<f64>> = vec![Vec::new(); blockers.len()];
    for _ in 0..rounds {
        let (ns, cnt, _) = offcpu_window(&samplers, &blockers[0], seconds)?;
        let early = ns as f64 / cnt.max(1) as f64;
        per_block_with[0].push(early);
        for (i, w) in blockers.iter().enumerate().skip(1) {
            per_block_with[i].push(per_block(offcpu_window(&samplers, w, seconds)?, early));
            if i >= 2 {
                per_block_without[i].push(per_block(offcpu_window(&without, w, seconds)?, early));
            }
        }
    }

    let _ = std::fs::write(stats_path, stats_before.trim());
    println!(
        "\n## BPF run time per CPU sample (bpf_stats, {HZ} Hz, {seconds} s windows, median of {rounds})"
    );
    let native_ns = median(per_sample[1].clone());
    println!(
        "{:>10}: {:>8.0} ns per sample  (sampler without Python frames: the path before them)",
        "native",
        median(native_without)
    );
    for (i, w) in workloads.iter().enumerate() {
        let m = median(per_sample[i].clone());
        if i == 0 {
            println!(
                "{:>10}: {m:>8.0} ns per run returning early (not a target)",
                w.name
            );
        } else {
            println!(
                "{:>10}: {m:>8.0} ns per sample  ({:.2}x native)",
                w.name,
                m / native_ns.max(1.0)
            );
        }
    }
    println!(
        "\n## Off-CPU: BPF run time per block (switch-out with the stack walks, and switch-in; \
         bpf_stats, {seconds} s windows, median of {rounds})"
    );
    let native_block = median(per_block_with[1].clone());
    for (i, w) in blockers.iter().enumerate() {
        let m = median(per_block_with[i].clone());
        match i {
            0 => println!(
                "{:>10}: {m:>8.0} ns per run returning early (not a target)",
                w.name
            ),
            1 => println!("{:>10}: {m:>8.0} ns per block", w.name),
            _ => {
                let without = median(per_block_without[i].clone());
                println!(
                    "{:>10}: {m:>8.0} ns per block  ({:.2}x native); without Python frames \
                     {without:>6.0} ns: the Python walk {:>6.0} ns",
                    w.name,
                    m / native_block.max(1.0),
                    m - without
                );
            }
        }
    }
    println!("\nload average at the end: {}", shared::loadavg());
    Ok(())
}
