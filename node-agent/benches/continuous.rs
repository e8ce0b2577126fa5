//! Continuous profiling cost: what the agent pays to keep a CPU profile of every pod on
//! the node, as fleet sampling runs it — 19 Hz, back-to-back captures (each next window
//! starts before the previous one is finished, so the sampler never unloads), every
//! capture symbolized and gzip-encoded as the agent service does, over one pod cgroup of
//! `--processes` mostly idle processes (each spins ~200 µs, then sleeps 20 ms).
//!
//! Prints, separately:
//! * the agent's own CPU (user + system of this process, all threads) during the windows
//!   (sampler thread: ring buffers, process snapshots; and the half-way pass that
//!   symbolizes the frames not cached yet, shown apart) and after each window (reading the
//!   maps, symbolizing, encoding): per capture, and as a share of one core on average;
//! * per sample: the BPF program's run time (`kernel.bpf_stats_enabled`), which the kernel
//!   charges to the interrupted task, not to the agent;
//! * per process: the time to snapshot one process's maps for the symbolizer;
//! * RSS now and at its peak.
//!
//! A benchmark: it prints, it never asserts.
//!
//! ```text
//! cargo bench -p flamefleet-agent --bench continuous -- [--processes 50] [--window 60] [--windows 4] [--frequency 19] [--no-window-pass]
//! ```

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::capture::cpu::CpuOptions;
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};
use flamefleet_agent::process::ProcessCatalog;
use flamefleet_agent::symbolize::StackSymbolizer;
use shared::named_share;

mod shared;

const WORKLOAD: &str = r#"
#include <time.h>
#include <unistd.h>
static volatile unsigned long sink;
__attribute__((noinline)) void ff_cont_work(void) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do { for (int i = 0; i < 1000; i++) sink += i; clock_gettime(CLOCK_MONOTONIC, &b); }
    while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) < 200000L);
}
int main(void) { for (;;) { ff_cont_work(); usleep(20000); } }
"#;

struct Args {
    processes: usize,
    window: Duration,
    windows: usize,
    frequency: u64,
    /// `--no-window-pass`: skip the half-way symbolization pass (to price it).
    window_pass: bool,
}

fn args() -> Result<Args> {
    let mut a = Args {
        processes: 50,
        window: Duration::from_secs(60),
        windows: 4,
        frequency: 19,
        window_pass: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--processes" => a.processes = it.next().context("--processes N")?.parse()?,
            "--window" => {
                a.window = Duration::from_secs(it.next().context("--window SECONDS")?.parse()?);
            }
            "--windows" => a.windows = it.next().context("--windows N")?.parse()?,
            "--frequency" => a.frequency = it.next().context("--frequency HZ")?.parse()?,
            "--no-window-pass" => a.window_pass = false,
            // cargo bench passes --bench.
            _ => {}
        }
    }
    Ok(a)
}

/// User + system CPU time of this process (every thread).
fn cpu_time() -> Duration {
    // SAFETY: getrusage only writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// (run_time_ns, run_cnt) of this process's CPU sampler program, from bpftool (another
/// agent on the machine loads a program of the same name).
fn sampler_bpf_stats() -> Result<(u64, u64)> {
    let out = Command::new("bpftool")
        .args(["prog", "show", "-j"])
        .output()
        .context("running bpftool (apt install bpftool)")?;
    let progs: Vec<serde_json::Value> =
        serde_json::from_slice(&out.stdout).context("parsing bpftool prog show -j")?;
    Ok(progs
        .iter()
        .filter(|p| p["name"].as_str() == Some("on_cpu_sample"))
        .filter(|p| {
            p["pids"].as_array().is_none_or(|pids| {
                pids.iter()
                    .any(|x| x["pid"].as_u64() == Some(u64::from(std::process::id())))
            })
        })
        .fold((0, 0), |(ns, cnt), p| {
            (
                ns + p["run_time_ns"].as_u64().unwrap_or(0),
                cnt + p["run_cnt"].as_u64().unwrap_or(0),
            )
        }))
}

struct Fixture {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir(&self.dir);
        if let Some(parent) = self.dir.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

struct Window {
    samples: u64,
    during: Duration,
    /// Of `during`: the half-way symbolization pass, as the agent service makes it.
    pass: Duration,
    after: Duration,
    named_pct: f64,
}

fn main() -> Result<()> {
    let args = args()?;
    if !nix::unistd::Uid::effective().is_root() {
        bail!("run as root: the bench loads eBPF programs and creates cgroups");
    }
    let tmp = tempfile::tempdir()?;
    let program = shared::compile_c(tmp.path(), "ff-continuous", WORKLOAD)?;
    let pod = CgroupRoot::detect()?
        .path()
        .join(format!("flamefleet-continuous-{}", std::process::id()))
        .join("pod");
    std::fs::create_dir_all(&pod).with_context(|| format!("creating {}", pod.display()))?;
    let mut fixture = Fixture {
        dir: pod.clone(),
        children: Vec::new(),
    };
    for _ in 0..args.processes {
        fixture
            .children
            .push(flamefleet_e2e::workload::spawn_in_cgroup(
                &pod,
                &program,
                &[],
            )?);
    }
    let pids: Vec<u32> = fixture.children.iter().map(Child::id).collect();

    // Per process: a maps snapshot, what the samplers take for each new process.
    let catalog = ProcessCatalog::new();
    let t = Instant::now();
    let snapped = pids.iter().filter(|&&p| catalog.snapshot(p)).count();
    let per_process = t.elapsed() / snapped.max(1) as u32;
    drop(catalog);

    let stats_path = "/proc/sys/kernel/bpf_stats_enabled";
    let stats_before = std::fs::read_to_string(stats_path).unwrap_or_else(|_| "0".into());
    std::fs::write(stats_path, "1").context("enabling kernel.bpf_stats_enabled")?;

    let target = CaptureTarget::raw(Cgroup::open(&pod)?);
    let options = CpuOptions {
        frequency: args.frequency,
        ..CpuOptions::default()
    };
    let samplers = Samplers::new(SamplerConfig::default());
    println!(
        "continuous CPU profile: {} processes (each ~200 µs of CPU every 20 ms), {} Hz, {} back-to-back windows of {} s",
        args.processes,
        args.frequency,
        args.windows,
        args.window.as_secs()
    );
    println!(
        "{:>6} {:>8} {:>12} {:>9} {:>12} {:>8} {:>8}",
        "window", "samples", "during ms", "(pass ms)", "after ms", "named %", "RSS MiB"
    );
    let rss0 = status_kib("VmRSS:");
    let cpu0 = cpu_time();
    let wall0 = Instant::now();
    // The program's counters run from its load (stats are on by then) until it is
    // unloaded with the last capture, so they are read before each window is finished.
    let mut bpf = (0, 0);
    let mut windows = Vec::new();
    let mut running = samplers.start_cpu(std::slice::from_ref(&target), &options)?;
    let mut window_cpu0 = cpu_time();
    for i in 0..args.windows {
        // Half-way, the frames sampled so far that are not cached yet are symbolized
        // into the caches, as the agent service does during a window that opens a busy
        // spell of the sampler.
        let end = Instant::now() + args.window;
        std::thread::sleep(args.window / 2);
        let pass0 = cpu_time();
        // Only the first window opens a busy spell; the agent skips the pass for the
        // others (they join the running capture).
        if args.window_pass && running.opened_busy_spell() {
            running
                .peek()?
                .warm_symbols(&mut StackSymbolizer::new(samplers.catalog().clone()));
        }
        let pass = cpu_time() - pass0;
        std::thread::sleep(end.saturating_duration_since(Instant::now()));
        let during = cpu_time() - window_cpu0;
        bpf = sampler_bpf_stats()?;
        // The next window starts before this one is read: the sampler stays loaded.
        let next = (i + 1 < args.windows)
            .then(|| samplers.start_cpu(std::slice::from_ref(&target), &options))
            .transpose()?;
        let after0 = cpu_time();
        let result = running.finish()?;
        let mut symbolizer = StackSymbolizer::new(samplers.catalog().clone());
        let profile = result.to_profile(&mut symbolizer, "continuous");
        let bytes = flamefleet_agent::pprof::encode_gzip(&profile)?;
        std::hint::black_box(bytes);
        let after = cpu_time() - after0;
        window_cpu0 = cpu_time();
        let w = Window {
            samples: result.total(),
            during,
            pass,
            after,
            named_pct: named_share(&profile, "ff_cont_work"),
        };
        println!(
            "{:>6} {:>8} {:>12.1} {:>9.1} {:>12.1} {:>8.1} {:>8.1}",
            i,
            w.samples,
            w.during.as_secs_f64() * 1e3,
            w.pass.as_secs_f64() * 1e3,
            w.after.as_secs_f64() * 1e3,
            w.named_pct,
            status_kib("VmRSS:") as f64 / 1024.0
        );
        windows.push(w);
        match next {
            Some(n) => running = n,
            None => break,
        }
    }
    let wall = wall0.elapsed();
    let cpu = cpu_time() - cpu0;
    let (bpf_ns, bpf_cnt) = bpf;
    std::fs::write(stats_path, stats_before.trim())?;
    drop(samplers);

    let samples: u64 = windows.iter().map(|w| w.samples).sum();
    let steady: Vec<&Window> = windows.iter().skip(1).collect();
    let avg = |f: &dyn Fn(&Window) -> Duration| {
        steady.iter().map(|w| f(w)).sum::<Duration>() / steady.len().max(1) as u32
    };
    let bpf_per_sample = bpf_ns as f64 / bpf_cnt.max(1) as f64;
    println!();
    println!(
        "agent CPU: {:.3} s over {:.0} s of wall time = {:.3}% of one core on average (all windows, the first pays loading the programs)",
        cpu.as_secs_f64(),
        wall.as_secs_f64(),
        100.0 * cpu.as_secs_f64() / wall.as_secs_f64()
    );
    if !steady.is_empty() {
        let per_window = avg(&|w| w.during + w.after);
        println!(
            "steady state (windows 1..): {:.3}% of one core; per capture {:.1} ms during the window (of which {:.1} ms the half-way symbolization pass) + {:.1} ms after it",
            100.0 * per_window.as_secs_f64() / args.window.as_secs_f64(),
            avg(&|w| w.during).as_secs_f64() * 1e3,
            avg(&|w| w.pass).as_secs_f64() * 1e3,
            avg(&|w| w.after).as_secs_f64() * 1e3,
        );
    }
    println!(
        "per sample: BPF {:.0} ns (charged to the sampled task) over {} samples; {:.1} µs of agent CPU per sample after the window",
        bpf_per_sample,
        bpf_cnt,
        windows
            .iter()
            .map(|w| w.after)
            .sum::<Duration>()
            .as_secs_f64()
            * 1e6
            / samples.max(1) as f64
    );
    println!(
        "per process: {:.0} µs to snapshot one process's maps ({} processes)",
        per_process.as_secs_f64() * 1e6,
        snapped
    );
    println!(
        "RSS: {:.1} MiB before the first capture, {:.1} MiB now, {:.1} MiB at peak",
        rss0 as f64 / 1024.0,
        status_kib("VmRSS:") as f64 / 1024.0,
        status_kib("VmHWM:") as f64 / 1024.0
    );
    drop(fixture);
    Ok(())
}
