//! What the older kernels' mechanisms cost: the BPF run time per CPU sample and per
//! scheduler event of each fallback (docs/capture.md, "Kernels"), against the mechanism
//! the newest kernels get, measured in the same kernel at the same time.
//!
//! Every mechanism that loads on the kernel runs at once, each in a sampler of its own
//! (one `Samplers` per mechanism), on the same workload in one cgroup: the CPU samplers'
//! perf events interrupt the same spinners, the runqlat programs see the same switches.
//! `kernel.bpf_stats_enabled=1` gives each program's run time and run count; a
//! mechanism's cost is its programs' time over its own events (CPU: runs of its sampling
//! program, tail calls included; runqlat: runs of its `sched_switch` program, its wakeup
//! programs' time included). Ratios are taken per round against the first mechanism of
//! the table that loads here and the median is printed; under QEMU without KVM every
//! figure is slower than on hardware, so only the ratios compare across kernels.
//!
//! Without `--here` the bench runs on this machine's kernel, then boots each Debian kernel
//! of the guest tier (`scripts/guest-kernels.sh`, `flamefleet_e2e::guest`) and runs itself
//! there. A benchmark: it prints, it never asserts.
//!
//! ```text
//! cargo bench -p flamefleet-agent --bench kernel_fallbacks -- [--rounds 3] [--window 5] [--kernel RELEASE]... [--here]
//! ```

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::capture::cpu::CpuOptions;
use flamefleet_agent::capture::kernel::KernelFeatures;
use flamefleet_agent::capture::runqlat::RunqlatOptions;
use flamefleet_agent::capture::{CaptureTarget, RunqlatClock, SamplerConfig, Samplers};
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};
use flamefleet_e2e::guest::{self, GuestConfig, Kernel};
use libbpf_rs::ProgramType;
use libbpf_rs::query::ProgInfoIter;

/// A CPU-bound program whose samples land 24 frames deep in code without frame pointers,
/// so that every mechanism walks the same long chain with CFI.
const SPINNER: &str = r#"
static volatile unsigned long sink;
__attribute__((noinline)) static void ff_leaf(void) { for (int i = 0; i < 2000; i++) sink += i; }
__attribute__((noinline)) void ff_deep(int n) { if (n) ff_deep(n - 1); else ff_leaf(); sink++; }
int main(void) { for (;;) ff_deep(24); }
"#;

/// Two processes waking each other over pipes (waits behind a running task), and one
/// that sleeps 1 ms at a time (waits ending on an idle CPU: where PSI's stamps serve).
const PING_PONG: &str = r#"
#include <time.h>
#include <unistd.h>
int main(void) {
    int a[2], b[2];
    char c = 0;
    struct timespec t = {0, 200000};
    if (pipe(a) || pipe(b)) return 1;
    if (fork() == 0) {
        for (;;) { if (read(a[0], &c, 1) != 1 || write(b[1], &c, 1) != 1) return 2; }
    }
    for (;;) {
        if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1) return 3;
        nanosleep(&t, 0);
    }
}
"#;

const SLEEPER: &str = r#"
#include <time.h>
int main(void) { struct timespec ms = {0, 1000000}; for (;;) nanosleep(&ms, 0); }
"#;

struct Args {
    rounds: usize,
    window: Duration,
    here: bool,
    kernels: Vec<String>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        rounds: 3,
        window: Duration::from_secs(5),
        here: false,
        kernels: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--rounds" => a.rounds = it.next().context("--rounds N")?.parse()?,
            "--window" => {
                a.window = Duration::from_secs(it.next().context("--window SECONDS")?.parse()?);
            }
            "--here" => a.here = true,
            "--kernel" => a.kernels.push(it.next().context("--kernel RELEASE")?),
            // cargo bench passes --bench.
            _ => {}
        }
    }
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    Ok(a)
}

/// One mechanism: a name, the sampler configuration that selects it, and whether this
/// kernel can load it.
struct Mechanism {
    name: &'static str,
    config: SamplerConfig,
    loads: bool,
}

fn cpu_mechanisms(f: &KernelFeatures) -> Vec<Mechanism> {
    let bpf_loop = f.frame_walk() == flamefleet_agent::capture::kernel::FrameWalk::BpfLoop;
    vec![
        Mechanism {
            name: "bpf_loop walk, cgroup-storage cache (6.2+)",
            config: SamplerConfig::default(),
            loads: bpf_loop && f.cgrp_storage.found,
        },
        Mechanism {
            name: "bpf_loop walk, ancestry walk (5.17-6.1)",
            config: SamplerConfig {
                no_target_cache: true,
                ..SamplerConfig::default()
            },
            loads: bpf_loop,
        },
        Mechanism {
            name: "bounded loop + tail calls, ancestry walk (5.10)",
            config: SamplerConfig {
                force_bounded_walk: true,
                ..SamplerConfig::default()
            },
            loads: true,
        },
    ]
}

fn runqlat_mechanisms(f: &KernelFeatures) -> Vec<Mechanism> {
    let with = |clock, no_target_cache, force_start_hash| SamplerConfig {
        runqlat_clock: clock,
        no_target_cache,
        force_start_hash,
        ..SamplerConfig::default()
    };
    let (psi, cache, task) = (
        f.rdonly_cast.found,
        f.cgrp_storage.found,
        f.task_storage.found,
    );
    vec![
        Mechanism {
            name: "hybrid, PSI stamps, cgroup-storage cache (6.2+)",
            config: with(RunqlatClock::Hybrid, false, false),
            loads: psi && cache,
        },
        Mechanism {
            name: "hybrid, PSI stamps, ancestry walk",
            config: with(RunqlatClock::Hybrid, true, false),
            loads: psi,
        },
        Mechanism {
            name: "hybrid, clock read after idle, cgroup-storage cache",
            config: with(RunqlatClock::HybridNoPsi, false, false),
            loads: cache,
        },
        Mechanism {
            name: "hybrid, clock read after idle, ancestry walk (5.10, 6.1)",
            config: with(RunqlatClock::HybridNoPsi, true, false),
            loads: true,
        },
        Mechanism {
            name: "own clock, task storage (--runqlat-clock own, 5.11+)",
            config: with(RunqlatClock::Own, false, false),
            loads: task,
        },
        Mechanism {
            name: "own clock, hash map (--runqlat-clock own, 5.10)",
            config: with(RunqlatClock::Own, false, true),
            loads: true,
        },
    ]
}

/// (run_time_ns, run_cnt, type, name) of every loaded program, by ID.
type ProgStats = HashMap<u32, (u64, u64, ProgramType, String)>;

fn prog_stats() -> ProgStats {
    ProgInfoIter::default()
        .map(|p| {
            (
                p.id,
                (
                    p.run_time_ns,
                    p.run_cnt,
                    p.ty,
                    p.name.to_string_lossy().into_owned(),
                ),
            )
        })
        .collect()
}

/// The programs loaded by `start` (those present after it and not before).
fn programs_of(start: impl FnOnce() -> Result<()>) -> Result<HashSet<u32>> {
    let before: HashSet<u32> = prog_stats().into_keys().collect();
    start()?;
    Ok(prog_stats()
        .into_keys()
        .filter(|id| !before.contains(id))
        .collect())
}

/// (ns, events) of one mechanism between two readings: the time of all its programs of
/// the kinds `counted` keeps, over the runs of those `is_event` names.
fn cost(
    ids: &HashSet<u32>,
    before: &ProgStats,
    after: &ProgStats,
    counted: impl Fn(ProgramType) -> bool,
    is_event: impl Fn(&str) -> bool,
) -> (u64, u64) {
    let (mut ns, mut events) = (0, 0);
    for id in ids {
        let (Some(b), Some(a)) = (before.get(id), after.get(id)) else {
            continue;
        };
        if !counted(a.2) {
            continue;
        }
        ns += a.0.saturating_sub(b.0);
        if is_event(&a.3) {
            events += a.1.saturating_sub(b.1);
        }
    }
    (ns, events)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Per-mechanism results over the rounds: ns per event, and the ratio to the reference.
struct Row {
    name: &'static str,
    ns: Vec<f64>,
    ratio: Vec<f64>,
    events: u64,
    /// Something to show the mechanism did the same work (frames per sample, waits).
    note: String,
}

fn print_table(title: &str, unit: &str, mechanisms: &[Mechanism], rows: &[Row]) {
    println!("## {title}");
    let reference = rows.first().map_or("", |r| r.name);
    println!(
        "{:<58} {:>12} {:>10} {:>9}  (ratio: against \"{reference}\")",
        "mechanism", unit, "events", "ratio"
    );
    for m in mechanisms.iter().filter(|m| !m.loads) {
        println!("{:<58} {:>12}", m.name, "does not load here");
    }
    for r in rows {
        println!(
            "{:<58} {:>12.0} {:>10} {:>9.2}  {}",
            r.name,
            median(r.ns.clone()),
            r.events,
            median(r.ratio.clone()),
            r.note
        );
    }
    println!();
}

struct Fixture {
    dir: std::path::PathBuf,
    children: Vec<Child>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // The ping-pong's forked child dies with its parent (PR_SET_PDEATHSIG is not
        // inherited across fork): kill what is left in the cgroup.
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn compile(dir: &Path, name: &str, source: &str, flags: &[&str]) -> Result<std::path::PathBuf> {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source)?;
    let bin = dir.join(name);
    let out = Command::new("cc")
        .args(flags)
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .output()
        .context("running cc")?;
    if !out.status.success() {
        bail!("cc: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(bin)
}

fn fixture(name: &str, programs: &[&Path]) -> Result<Fixture> {
    let dir = CgroupRoot::detect()?.path().join(format!(
        "flamefleet-fallbacks-{name}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut f = Fixture {
        dir,
        children: Vec::new(),
    };
    for p in programs {
        f.children
            .push(flamefleet_e2e::workload::spawn_in_cgroup(&f.dir, p, &[])?);
    }
    Ok(f)
}

/// What one engine's table measures: which of a mechanism's programs' run time counts,
/// and which programs' runs are its events.
struct Measured {
    title: &'static str,
    unit: &'static str,
    counted: fn(ProgramType) -> bool,
    is_event: fn(&str) -> bool,
}

/// Runs every mechanism of `mechanisms` that loads here at once for `args.rounds` rounds
/// of `args.window`: `start` starts one mechanism's capture in its own sampler, `finish`
/// ends it and says what it did (the table's note). Prints the table.
fn measure_rounds<C>(
    args: &Args,
    mechanisms: &[Mechanism],
    what: &Measured,
    start: impl Fn(&Samplers) -> Result<C>,
    finish: impl Fn(C) -> Result<String>,
) -> Result<()> {
    let loaded: Vec<&Mechanism> = mechanisms.iter().filter(|m| m.loads).collect();
    let samplers: Vec<Samplers> = loaded
        .iter()
        .map(|m| Samplers::new(m.config.clone()))
        .collect();
    let mut rows: Vec<Row> = loaded
        .iter()
        .map(|m| Row {
            name: m.name,
            ns: Vec::new(),
            ratio: Vec::new(),
            events: 0,
            note: String::new(),
        })
        .collect();
    // Each mechanism's programs: those its first start loaded (a sampler that stays
    // loaded between rounds loads nothing new), and any a later start loaded again.
    let mut ids: Vec<HashSet<u32>> = vec![HashSet::new(); samplers.len()];
    for _ in 0..args.rounds {
        let mut captures = Vec::new();
        for (i, s) in samplers.iter().enumerate() {
            let mut capture = None;
            ids[i].extend(programs_of(|| {
                capture = Some(start(s)?);
                Ok(())
            })?);
            captures.extend(capture);
        }
        let before = prog_stats();
        std::thread::sleep(args.window);
        let after = prog_stats();
        let mut per_round = Vec::new();
        for (i, capture) in captures.into_iter().enumerate() {
            let (ns, events) = cost(&ids[i], &before, &after, what.counted, what.is_event);
            rows[i].events += events;
            rows[i].note = finish(capture)?;
            per_round.push(ns as f64 / events.max(1) as f64);
        }
        for (i, ns) in per_round.iter().enumerate() {
            rows[i].ns.push(*ns);
            rows[i].ratio.push(ns / per_round[0]);
        }
    }
    print_table(what.title, what.unit, mechanisms, &rows);
    Ok(())
}

fn cpu_rounds(args: &Args, features: &KernelFeatures, dir: &Path) -> Result<()> {
    let spinner = compile(
        dir,
        "ff-fallback-spin",
        SPINNER,
        &[
            "-O2",
            "-g",
            "-fomit-frame-pointer",
            "-fno-optimize-sibling-calls",
        ],
    )?;
    let cpus = std::thread::available_parallelism().map_or(2, usize::from);
    let spinners: Vec<&Path> = (0..cpus).map(|_| spinner.as_path()).collect();
    let fx = fixture("cpu", &spinners)?;
    let target = [CaptureTarget::raw(Cgroup::open(&fx.dir)?)];
    let options = CpuOptions::default();
    measure_rounds(
        args,
        &cpu_mechanisms(features),
        &Measured {
            title: "CPU sampler: BPF run time per sample (99 Hz, one spinner per CPU, 24 frames without frame pointers)",
            unit: "ns/sample",
            counted: |t| t == ProgramType::PerfEvent,
            is_event: |n| n.starts_with("on_cpu_sample"),
        },
        |s| Ok(s.start_cpu(&target, &options)?),
        |capture| {
            let result = capture.finish()?;
            let (frames, samples) = result.samples.iter().fold((0u64, 0u64), |(f, n), s| {
                (f + s.user_stack.len() as u64 * s.count, n + s.count)
            });
            Ok(format!(
                "{:.1} user frames per sample",
                frames as f64 / samples.max(1) as f64
            ))
        },
    )
}

fn runqlat_rounds(args: &Args, features: &KernelFeatures, dir: &Path) -> Result<()> {
    let ping_pong = compile(dir, "ff-fallback-pingpong", PING_PONG, &["-O2"])?;
    let sleeper = compile(dir, "ff-fallback-sleep", SLEEPER, &["-O2"])?;
    let fx = fixture("rq", &[&ping_pong, &sleeper])?;
    let target = [CaptureTarget::raw(Cgroup::open(&fx.dir)?)];
    let options = RunqlatOptions::default();
    measure_rounds(
        args,
        &runqlat_mechanisms(features),
        &Measured {
            title: "runqlat: BPF run time per sched_switch (wakeup programs included; a ping-pong pair and a 1 ms sleeper)",
            unit: "ns/switch",
            counted: |_| true,
            is_event: |n| n.starts_with("switch_"),
        },
        |s| Ok(s.start_runqlat(&target, &options)?),
        |capture| {
            let result = capture.finish()?;
            let waits: u64 = result.per_target().iter().map(|h| h.count()).sum();
            Ok(match result.clock {
                Some(c) => format!("{waits} waits, {} PSI stamps", c.psi_stamps),
                None => format!("{waits} waits"),
            })
        },
    )
}

/// Measures on the running kernel.
fn here(args: &Args) -> Result<()> {
    let features = KernelFeatures::get();
    println!(
        "# kernel {} ({} CPUs), {} rounds of {} s",
        features.release,
        std::thread::available_parallelism().map_or(0, usize::from),
        args.rounds,
        args.window.as_secs()
    );
    let stats_path = "/proc/sys/kernel/bpf_stats_enabled";
    let stats_before = std::fs::read_to_string(stats_path).unwrap_or_else(|_| "0".into());
    std::fs::write(stats_path, "1").context("enabling kernel.bpf_stats_enabled")?;
    let tmp = tempfile::tempdir()?;
    let result = cpu_rounds(args, features, tmp.path())
        .and_then(|()| runqlat_rounds(args, features, tmp.path()));
    std::fs::write(stats_path, stats_before.trim())?;
    result
}

fn main() -> Result<()> {
    let args = args()?;
    if !nix::unistd::Uid::effective().is_root() {
        bail!("run as root: the bench loads eBPF programs and creates cgroups");
    }
    if args.here {
        return here(&args);
    }
    here(&args)?;
    let kernels: Vec<String> = if args.kernels.is_empty() {
        guest::DEBIAN_KERNELS
            .iter()
            .map(|k| (*k).to_owned())
            .collect()
    } else {
        args.kernels.clone()
    };
    let exe = std::env::current_exe()?;
    for release in kernels {
        let kernel = Kernel::find(&release)?;
        let command = format!(
            "{} --here --rounds {} --window {}",
            guest::shell_quote(&exe.display().to_string()),
            args.rounds,
            args.window.as_secs()
        );
        let config = GuestConfig {
            timeout: Duration::from_secs(30 * 60),
            ..GuestConfig::default()
        };
        let out = guest::run(&kernel, &config, &command)?;
        print!("{}", out.output);
        if out.status != 0 {
            bail!(
                "the bench failed under {release} (exit {}); console:\n{}",
                out.status,
                guest::tail(&out.console, 20)
            );
        }
        println!(
            "(guest {release}: {:.0} s from boot to power-off)\n",
            out.elapsed.as_secs_f64()
        );
    }
    Ok(())
}
