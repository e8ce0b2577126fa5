//! Always-on profiling's coverage and cost (docs/benchmarks.md, "Always-on profiling"): the
//! agent's own always-on engine ([`flamefleet_agent::continuous`], what the `Continuous`
//! call drives) over `--pods` pod cgroups laid out as the kubelet lays them out
//! (`kubepods/burstable/pod<UID>/<container>`), each running one process that spins
//! `--busy-us` every 20 ms, for `--seconds`, in the cluster's default windows (19 Hz, windows
//! of 20 s back to back; `--window 19 --period 20` for the pprof RFC's 19 s of every 20 s).
//! As in the agent, each window is split into one gzipped pprof per pod and queued for the
//! operator's stream; here a thread takes them off the queue.
//!
//! Prints:
//! * per pod: windows received, the sampled share of the wall time (each window's sampled
//!   time over the run; at most window/period: 19 s of every 20 s is 95%), the periods that got a window, samples;
//! * the agent's CPU (user + system of this process, every thread: the windows' thread,
//!   the sampler threads, symbolization, splitting and encoding), in percent of one core,
//!   in all and per profiled pod;
//! * the BPF program's run time (`kernel.bpf_stats_enabled`), charged by the kernel to the
//!   sampled pods, not to the agent;
//! * RSS every minute, to see it flat.
//!
//! A benchmark: it prints, it never asserts.
//!
//! ```text
//! cargo bench -p flamefleet-agent --bench always_on -- [--pods 10] [--seconds 600] [--frequency 19] [--window 20] [--period 20] [--busy-us 2000]
//! ```
//! (as root).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::capture::SamplerConfig;
use flamefleet_agent::cgroup::CgroupRoot;
use flamefleet_agent::continuous::Continuous;
use flamefleet_agent::process::ProcessCatalog;
use flamefleet_proto::agent::{
    ContinuousPod, ContinuousRequest, Target, WindowProfile, continuous_event,
};
use shared::{flag, loadavg};

mod shared;

const WORKLOAD: &str = r#"
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static volatile unsigned long sink;
__attribute__((noinline)) void ff_always_work(long busy_ns) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do { for (int i = 0; i < 1000; i++) sink += i; clock_gettime(CLOCK_MONOTONIC, &b); }
    while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) < busy_ns);
}
int main(int argc, char **argv) {
    long busy_ns = argc > 1 ? atol(argv[1]) * 1000L : 2000000L;
    for (;;) { ff_always_work(busy_ns); usleep(20000); }
}
"#;

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

/// (run_time_ns, run_cnt) of the CPU sampler programs this process loaded (bpftool lists
/// a program's processes where the kernel has BPF iterators; where it lists none, every
/// `on_cpu_sample` program counts, as in the `continuous` bench).
fn sampler_bpf_stats() -> (u64, u64) {
    let Ok(out) = Command::new("bpftool")
        .args(["prog", "show", "-j"])
        .output()
    else {
        return (0, 0);
    };
    let progs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
    progs
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
        })
}

/// The pods' cgroup tree and processes, removed when dropped.
struct Fixture {
    root: PathBuf,
    children: Vec<Child>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Deepest first.
        let mut dirs: Vec<PathBuf> = walk(&self.root);
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for d in dirs {
            let _ = std::fs::remove_dir(&d);
        }
    }
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(walk(&e.path()));
            }
        }
    }
    out
}

#[derive(Default)]
struct PodFigures {
    windows: u64,
    sampled: Duration,
    samples: u64,
    bytes: u64,
    periods: std::collections::BTreeSet<i64>,
    /// The first window: (its start after the set arrived, its length), in ms.
    first: Option<(i64, u32)>,
    /// Windows after the first that ended within the run: their sampled time and number
    /// (the steady state, against `window/period`).
    steady: Duration,
    steady_windows: u64,
}

fn main() -> Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    if argv.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "always_on: the always-on engine's coverage and cost (as root)\n\
             options: --pods N (10) --seconds S (600) --frequency HZ (19) --window S (20) \
             --period S (20) --busy-us US (2000: CPU each pod's process spins every 20 ms)"
        );
        return Ok(());
    }
    let pods: usize = flag(&argv, "--pods").unwrap_or(10);
    let seconds: u64 = flag(&argv, "--seconds").unwrap_or(600);
    let frequency: u32 = flag(&argv, "--frequency").unwrap_or(19);
    let window: u64 = flag(&argv, "--window").unwrap_or(20);
    let period: u64 = flag(&argv, "--period").unwrap_or(20);
    let busy_us: u64 = flag(&argv, "--busy-us").unwrap_or(2000);
    if !nix::unistd::Uid::effective().is_root() {
        bail!("run as root: the bench loads eBPF programs and creates cgroups");
    }
    let tmp = tempfile::tempdir()?;
    let program = shared::compile_c(tmp.path(), "ff-always-on", WORKLOAD)?;
    let root = CgroupRoot::detect()?
        .path()
        .join(format!("flamefleet-always-on-{}", std::process::id()));
    let mut fixture = Fixture {
        root: root.clone(),
        children: Vec::new(),
    };
    let mut targets = Vec::new();
    for i in 0..pods {
        let uid = format!("0000a11a-0000-4000-8000-{:012x}", i + 1);
        let container = format!("{:064x}", i + 1);
        let dir = root.join(format!("kubepods/burstable/pod{uid}/{container}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        fixture
            .children
            .push(flamefleet_e2e::workload::spawn_in_cgroup(
                &dir,
                &program,
                &[&busy_us.to_string()],
            )?);
        targets.push(Target {
            pod_uid: uid,
            namespace: "bench".into(),
            pod_name: format!("web-{i}"),
            ..Target::default()
        });
    }

    let stats_path = "/proc/sys/kernel/bpf_stats_enabled";
    let stats_before = std::fs::read_to_string(stats_path).unwrap_or_else(|_| "0".into());
    std::fs::write(stats_path, "1").context("enabling kernel.bpf_stats_enabled")?;

    let continuous = Continuous::new(
        CgroupRoot::at_or_under(&root)?,
        SamplerConfig {
            node: "bench".into(),
            ..SamplerConfig::default()
        },
        ProcessCatalog::new(),
    );
    let request = ContinuousRequest {
        pods: targets
            .iter()
            .map(|t| ContinuousPod {
                policy_uids: vec!["bench-policy".into()],
                target: Some(t.clone()),
                frequency_hz: frequency,
            })
            .collect(),
        window_ms: u32::try_from(window * 1000)?,
        period_ms: u32::try_from(period * 1000)?,
        max_profile_bytes: 1 << 20,
    };
    println!(
        "always-on: {pods} pods (one process each, {busy_us} µs of CPU every 20 ms), {frequency} Hz, {window} s windows every {period} s, for {seconds} s; load {}",
        loadavg()
    );
    let rss0 = status_kib("VmRSS:");
    let cpu0 = cpu_time();
    let wall0 = Instant::now();
    let unix0 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    let (session, _ack, mut rx) = continuous.replace(&request).map_err(anyhow::Error::msg)?;
    let deadline = wall0 + Duration::from_secs(seconds);
    let consumer = std::thread::spawn(move || {
        let mut windows: Vec<(WindowProfile, usize)> = Vec::new();
        while let Some(event) = rx.blocking_recv() {
            if let Some(continuous_event::Event::Window(mut w)) = event.event {
                let len = std::mem::take(&mut w.pprof).len();
                windows.push((w, len));
            }
        }
        windows
    });
    println!(
        "{:>7} {:>10} {:>9} {:>9}",
        "minute", "agent CPU%", "RSS MiB", "load"
    );
    let mut last = (cpu_time(), Instant::now());
    let mut rss = Vec::new();
    while Instant::now() < deadline {
        std::thread::sleep(
            Duration::from_secs(60).min(deadline.saturating_duration_since(Instant::now())),
        );
        let (cpu, at) = (cpu_time(), Instant::now());
        let share = (cpu - last.0).as_secs_f64() / (at - last.1).as_secs_f64() * 100.0;
        let mib = status_kib("VmRSS:") as f64 / 1024.0;
        rss.push(mib);
        println!(
            "{:>7.1} {:>10.3} {:>9.1} {:>9}",
            (at - wall0).as_secs_f64() / 60.0,
            share,
            mib,
            loadavg()
        );
        last = (cpu, at);
    }
    let wall = wall0.elapsed();
    let cpu = cpu_time() - cpu0;
    let (bpf_ns, bpf_cnt) = sampler_bpf_stats();
    // The window running at the end of the run is counted up to the end: let it finish
    // (ending the set now would end it early, and its profile would find no stream).
    std::thread::sleep(Duration::from_secs(window) + Duration::from_secs(2));
    continuous.end(session);
    drop(continuous);
    let windows = consumer
        .join()
        .map_err(|_| anyhow::anyhow!("consumer panicked"))?;
    std::fs::write(stats_path, stats_before.trim())?;

    let mut by_pod: BTreeMap<String, PodFigures> = BTreeMap::new();
    for (w, len) in &windows {
        if w.start_unix_ms >= unix0 + wall.as_millis() as i64 {
            // Started after the run (while the last one finished).
            continue;
        }
        let f = by_pod.entry(w.pod_name.clone()).or_default();
        f.bytes += *len as u64;
        // Only the part of the window inside the measured wall time.
        let start = w.start_unix_ms.max(unix0);
        let end = (w.start_unix_ms + i64::from(w.duration_ms)).min(unix0 + wall.as_millis() as i64);
        if end > start {
            f.sampled += Duration::from_millis((end - start) as u64);
        }
        let offset = w.start_unix_ms - unix0;
        match f.first {
            Some((first, _)) if first <= offset => {
                if w.start_unix_ms + i64::from(w.duration_ms) <= unix0 + wall.as_millis() as i64 {
                    f.steady += Duration::from_millis(u64::from(w.duration_ms));
                    f.steady_windows += 1;
                }
            }
            _ => f.first = Some((offset, w.duration_ms)),
        }
        f.windows += 1;
        f.samples += w.samples;
        f.periods
            .insert((w.start_unix_ms - unix0).div_euclid(period as i64 * 1000));
    }
    let periods = (wall.as_secs_f64() / period as f64).floor() as usize;
    println!();
    println!(
        "{:>8} {:>8} {:>16} {:>16} {:>8} {:>10}",
        "pod", "windows", "sampled % wall", "periods covered", "samples", "KiB/window"
    );
    let mut min_share = f64::MAX;
    let mut min_periods = f64::MAX;
    let mut min_steady = f64::MAX;
    let mut firsts = Vec::new();
    for (pod, f) in &by_pod {
        let share = f.sampled.as_secs_f64() / wall.as_secs_f64() * 100.0;
        let covered = f
            .periods
            .iter()
            .filter(|&&p| (p as usize) < periods)
            .count();
        let period_share = covered as f64 / periods.max(1) as f64 * 100.0;
        min_share = min_share.min(share);
        min_periods = min_periods.min(period_share);
        if f.steady_windows > 0 {
            min_steady =
                min_steady.min(f.steady.as_secs_f64() / (f.steady_windows * period) as f64 * 100.0);
        }
        firsts.extend(f.first);
        println!(
            "{pod:>8} {:>8} {:>15.2}% {:>9}/{:<3} {:>9} {:>10.1}",
            f.windows,
            share,
            covered,
            periods,
            f.samples,
            f.bytes as f64 / 1024.0 / f.windows.max(1) as f64
        );
    }
    println!(
        "\ncoverage: lowest sampled share of the wall time {:.2}% ({window} s of every {period} s is {:.1}%); lowest share of periods with a window {:.1}%",
        min_share,
        100.0 * window as f64 / period as f64,
        min_periods
    );
    println!(
        "steady state (windows after the first, within the run): lowest {:.2}% of their periods; first window: started {}..{} ms after the set arrived (loading the sampler), sampled {}..{} ms",
        min_steady,
        firsts.iter().map(|f| f.0).min().unwrap_or(0),
        firsts.iter().map(|f| f.0).max().unwrap_or(0),
        firsts.iter().map(|f| f.1).min().unwrap_or(0),
        firsts.iter().map(|f| f.1).max().unwrap_or(0),
    );
    let core = cpu.as_secs_f64() / wall.as_secs_f64() * 100.0;
    println!(
        "agent CPU: {:.3} s over {:.0} s = {:.4}% of one core, {:.4}% per profiled pod (all of it: windows' thread, sampler threads, symbolization, splitting, encoding)",
        cpu.as_secs_f64(),
        wall.as_secs_f64(),
        core,
        core / pods as f64
    );
    println!(
        "BPF (charged to the sampled pods): {} runs, {:.0} ns each, {:.4}% of one core in all",
        bpf_cnt,
        bpf_ns as f64 / bpf_cnt.max(1) as f64,
        bpf_ns as f64 / 1e9 / wall.as_secs_f64() * 100.0
    );
    let steady = if rss.len() > 1 { &rss[1..] } else { &rss[..] };
    println!(
        "RSS: {:.1} MiB before, {:.1}..{:.1} MiB from minute 2 on, {:.1} MiB at the end, {:.1} MiB at peak; load {}",
        rss0 as f64 / 1024.0,
        steady.iter().copied().reduce(f64::min).unwrap_or(0.0),
        steady.iter().copied().reduce(f64::max).unwrap_or(0.0),
        status_kib("VmRSS:") as f64 / 1024.0,
        status_kib("VmHWM:") as f64 / 1024.0,
        loadavg()
    );
    drop(fixture);
    Ok(())
}
