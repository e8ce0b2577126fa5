//! Overhead of the capture engines against the tools people use today, all
//! measured in one run on one machine (not a test: it prints, never asserts).
//!
//! ```text
//! cargo bench -p flamefleet-agent --bench capture_overhead -- [--rounds 5] [--peer PATH]
//! ```
//!
//! `--peer PATH` measures another build of `flamefleet-agent` (e.g. one built from an
//! earlier commit) beside this one, in the same rounds: its rows say `peer`. It runs with
//! the default runqlat clock only.
//!
//! `--only pipe,spin,bpf,sampler,agent` runs only the named sections (default: all);
//! `--sampler-millions N` sets the spin behind the CPU sampler's per-sample BPF cost
//! (default 10,000 million iterations per CPU, a few seconds: over a thousand samples) and
//! `--sampler-hz N` its sampling frequency (default 99).
//!
//! 1. `pipe`, runqlat: `perf bench sched pipe` throughput with no tracer, with
//!    libbpf-tools `runqlat` (all tasks, its default), with `runqlat -c <cg>`,
//!    and with ours filtered to the benchmark's cgroup, with each of its
//!    clocks (`--runqlat-clock hybrid`, the default; `hybrid-no-psi`, the same
//!    without PSI's switch stamps; `scheduler`; `own`).
//! 2. `spin`, CPU sampler: throughput per CPU-second of a CPU-bound workload (one spinner per CPU)
//!    with no profiler, `perf record -F 99 -g -a -e cpu-clock -G <cg>`, and ours at 99 Hz.
//! 3. `bpf`, BPF cost per scheduler event (`kernel.bpf_stats_enabled=1`, run_time_ns
//!    and run_cnt from `bpftool prog show`), ours (each clock) vs libbpf-tools
//!    `runqlat -c` and `runqlat` (all tasks), with the waits each of those recorded
//!    (`-c` tests the task running at the event, so it skips a wait that ends on an
//!    idle CPU: nearly all of sched pipe's on a quiet machine), per round over one run of each of two workloads: `perf bench
//!    sched pipe` (two tasks waking each other: nearly every wait ends on a CPU
//!    that was idle, where the run-queue clock is stale and the hybrid clock
//!    takes PSI's stamp of the switch, or pays a clock read without it) and `perf bench sched messaging` (hackbench: 40 tasks
//!    per group over pipes on few CPUs, so waits also end behind other tasks).
//!    libbpf-tools attaches to `sched_switch`, `sched_wakeup` and
//!    `sched_wakeup_new`, so its program runs count the scheduler events of the
//!    run; ours, with the hybrid or scheduler clock, runs on `sched_switch`
//!    only. Every total is divided by that event count (the workloads do the
//!    same work in every run). `bpf_call_cost.sh` prices the building blocks.
//!    `sampler`: the CPU sampler's BPF cost per sample over a spin run (`--sampler-millions`)
//!    of two workloads, a frame-pointer spinner and a four-deep call chain built without
//!    frame pointers (every caller found by the CFI walk): ours and the peer's in turn, the
//!    order swapped every round, each agent's own program read by the IDs its process holds,
//!    with the ratio ours / peer of each round.
//! 4. `agent`, the agent's own CPU time per 1,000 samples and its peak RSS.
//!
//! Each condition runs once per round, conditions interleaved, and the
//! median over rounds is printed (the machine may be shared).

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use shared::{
    BenchCgroup, bpf_delta, bpf_stats, flag, interrupt, median, prog_ids_of, sched_messaging,
    sched_pipe, sigint_ends,
};

mod shared;

const AGENT: &str = env!("CARGO_BIN_EXE_flamefleet-agent");
const RUNQLAT: &str = "/usr/sbin/runqlat";
const PIPE_LOOPS: &str = "200000";
/// The sections `--only` chooses from, in the order they run.
const SECTIONS: [&str; 5] = ["pipe", "spin", "bpf", "sampler", "agent"];
/// Our runqlat's clocks: (name, agent arguments).
const CLOCKS: [(&str, [&str; 2]); 4] = [
    ("hybrid (default)", ["--runqlat-clock", "hybrid"]),
    ("hybrid-no-psi", ["--runqlat-clock", "hybrid-no-psi"]),
    ("scheduler", ["--runqlat-clock", "scheduler"]),
    ("own", ["--runqlat-clock", "own"]),
];
/// Our runqlat programs (any clock) and libbpf-tools' (tp_btf and raw_tp builds).
const OUR_RQ_PROGS: [&str; 5] = [
    "switch_hybrid",
    "switch_queued",
    "switch_task",
    "wakeup_task",
    "wakeup_new_task",
];
const THEIR_RQ_PROGS: [&str; 5] = [
    "sched_switch",
    "sched_wakeup",
    "sched_wakeup_new",
    "handle_sched_sw",
    "handle_sched_wa",
];

/// One spinner: `argv[1]` million iterations, then exit.
const SPIN: &str = r#"
#include <stdlib.h>
static volatile unsigned long sink;
__attribute__((noinline)) void spin(long n) { for (long i = 0; i < n; i++) sink += i; }
int main(int argc, char **argv) { spin(atol(argv[1]) * 1000000L); return 0; }
"#;

/// The same spin four calls deep (leaf <- f3 <- f2 <- f1 <- main), built without frame
/// pointers (-O2 -fomit-frame-pointer): every caller is found by the CFI walk.
const CHAIN: &str = r#"
#include <stdlib.h>
static volatile unsigned long sink;
__attribute__((noinline)) void leaf(long n) { for (long i = 0; i < n; i++) sink += i; }
__attribute__((noinline)) void f3(long n) { leaf(n); sink++; }
__attribute__((noinline)) void f2(long n) { f3(n); sink++; }
__attribute__((noinline)) void f1(long n) { f2(n); sink++; }
int main(int argc, char **argv) { long m = atol(argv[1]); for (long k = 0; k < m; k++) f1(1000000L); return 0; }
"#;

/// A tracer/profiler running in the background for one measurement.
struct Tracer {
    child: Child,
    /// The rest of the watched stream, line by line, until the tracer exits.
    output: std::thread::JoinHandle<Vec<String>>,
}

impl Tracer {
    /// Starts `cmd` and waits until a line containing `ready` appears on
    /// stdout (`from_stderr` false) or stderr.
    fn start(mut cmd: Command, ready: &str, from_stderr: bool) -> Result<Self> {
        if from_stderr {
            cmd.stderr(Stdio::piped()).stdout(Stdio::null());
        } else {
            cmd.stdout(Stdio::piped()).stderr(Stdio::null());
        }
        sigint_ends(&mut cmd);
        let mut child = cmd.spawn().with_context(|| format!("starting {cmd:?}"))?;
        let stream: Box<dyn std::io::Read + Send> = if from_stderr {
            Box::new(child.stderr.take().context("stderr")?)
        } else {
            Box::new(child.stdout.take().context("stdout")?)
        };
        let mut lines = BufReader::new(stream).lines();
        loop {
            match lines.next() {
                Some(Ok(l)) if l.contains(ready) => break,
                Some(Ok(_)) => continue,
                _ => bail!("{cmd:?} exited before printing {ready:?}"),
            }
        }
        // Keep draining so the tracer never blocks on a full pipe.
        let output = std::thread::spawn(move || lines.map_while(|l| l.ok()).collect());
        Ok(Self { child, output })
    }

    /// SIGINT, then wait (perf and runqlat exit cleanly on it); returns what the tracer
    /// printed after its ready line.
    fn stop(mut self) -> Vec<String> {
        interrupt(&mut self.child);
        self.output.join().unwrap_or_default()
    }
}

fn start_libbpf_runqlat(cg: Option<&Path>) -> Result<Tracer> {
    let mut c = Command::new("stdbuf");
    c.args(["-oL", RUNQLAT]);
    if let Some(cg) = cg {
        c.arg("-c").arg(cg);
    }
    Tracer::start(c, "Tracing", false)
}

/// The waits in the histogram libbpf-tools' runqlat prints when it stops
/// (`     2 -> 3          : 12       |**   |`).
fn hist_waits(lines: &[String]) -> u64 {
    lines
        .iter()
        .filter(|l| l.contains('|'))
        .filter_map(|l| {
            l.split(':')
                .nth(1)?
                .split('|')
                .next()?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .sum()
}

fn start_agent(agent: &str, kind: &str, cg: &Path, extra: &[&str]) -> Result<Tracer> {
    let mut c = Command::new(agent);
    c.args([
        "capture",
        "--type",
        kind,
        "--duration",
        "1h",
        "-o",
        "/dev/null",
        "--cgroup",
    ])
    .arg(cg)
    .args(extra);
    Tracer::start(c, "capturing", true)
}

fn start_perf_record(cg_name: &str, out: &Path) -> Result<Tracer> {
    let mut c = Command::new("perf");
    c.args([
        "record",
        "-F",
        "99",
        "-g",
        "-a",
        "-e",
        "cpu-clock",
        "-G",
        cg_name,
        "-o",
    ])
    .arg(out);
    // perf prints nothing when it starts; give it a moment instead.
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let child = c.spawn().context("starting perf record")?;
    std::thread::sleep(Duration::from_millis(700));
    Ok(Tracer {
        child,
        output: std::thread::spawn(Vec::new),
    })
}

/// One spinner per CPU in `cg`, `millions` iterations each: iterations per
/// CPU-second of the spinners. CPU time (not wall time) keeps other load on a
/// shared machine out of the figure, while the sampling interrupts and BPF
/// programs, which run on the interrupted task's time, stay in it.
fn spin_throughput(cg: &BenchCgroup, spin: &Path, millions: u64, cpus: usize) -> Result<f64> {
    let cpu = spin_cpu_time(cg, spin, millions, cpus)?;
    Ok((millions * 1_000_000 * cpus as u64) as f64 / cpu.as_secs_f64())
}

/// One spinner per CPU in `cg`, `millions` iterations each: their CPU time together.
fn spin_cpu_time(cg: &BenchCgroup, spin: &Path, millions: u64, cpus: usize) -> Result<Duration> {
    let mut kids = Vec::new();
    for _ in 0..cpus {
        kids.push(cg.command(spin).arg(millions.to_string()).spawn()?);
    }
    let mut cpu = Duration::ZERO;
    for k in kids {
        cpu += wait_cpu_time(k)?.0;
    }
    Ok(cpu)
}

/// Waits for a child; returns its user+system time and peak RSS (KiB).
fn wait_cpu_time(child: Child) -> Result<(Duration, i64)> {
    let pid = child.id() as i32;
    let mut status = 0;
    // SAFETY: rusage is plain data that wait4 fills.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting for our own child with valid pointers.
    if unsafe { libc::wait4(pid, &mut status, 0, &mut ru) } != pid {
        bail!("wait4({pid}) failed: {}", std::io::Error::last_os_error());
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Ok((tv(ru.ru_utime) + tv(ru.ru_stime), ru.ru_maxrss))
}

/// Our figures for one clock over the rounds: ns per scheduler event, ns per program
/// run, and the per-round ratios to each libbpf-tools reference.
#[derive(Clone, Default)]
struct Refs {
    ns_event: Vec<f64>,
    ns_run: Vec<f64>,
    ratio_c: Vec<f64>,
    ratio_all: Vec<f64>,
}

fn loss(base: f64, x: f64) -> f64 {
    100.0 * (base - x) / base
}

/// Runs the agent to completion and returns (cpu time, peak RSS KiB, samples).
fn agent_cost(agent: &str, kind: &str, cg: &Path, secs: u64) -> Result<(Duration, i64, u64)> {
    let mut child = Command::new(agent)
        .args([
            "capture",
            "--type",
            kind,
            "--duration",
            &format!("{secs}s"),
            "-o",
        ])
        .arg(std::env::temp_dir().join(format!("ffbench-{kind}.pb.gz")))
        .arg("--cgroup")
        .arg(cg)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    let mut stderr_pipe = child.stderr.take().context("stderr")?;
    let (cpu_time, rss) = wait_cpu_time(child)?;
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut stderr_pipe, &mut stderr)?;
    let samples = stderr
        .rsplit_once('(')
        .and_then(|(_, s)| s.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("agent output: {stderr}"))?;
    Ok((cpu_time, rss, samples))
}

fn main() -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("the benchmark loads eBPF programs: expected to run as root");
    }
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = flag(&args, "--rounds").unwrap_or(5);
    let peer: Option<String> = flag(&args, "--peer");
    let only: Option<Vec<String>> =
        flag::<String>(&args, "--only").map(|v| v.split(',').map(str::to_owned).collect());
    if let Some(bad) = only
        .iter()
        .flatten()
        .find(|s| !SECTIONS.contains(&s.as_str()))
    {
        bail!("--only: expected some of {SECTIONS:?}, found {bad:?}");
    }
    let runs = |section: &str| only.as_ref().is_none_or(|o| o.iter().any(|s| s == section));
    let sampler_millions: u64 = flag(&args, "--sampler-millions").unwrap_or(10_000);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = tempfile::tempdir()?;
    let spin = shared::compile_c(dir.path(), "ffbench_spin", SPIN)?;
    let chain = shared::compile_c_with(
        dir.path(),
        "ffbench_chain",
        CHAIN,
        &["-O2", "-g", "-fomit-frame-pointer"],
    )?;
    let sampler_hz: u64 = flag(&args, "--sampler-hz").unwrap_or(99);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!(
        "flamefleet capture overhead, kernel {}, {cpus} CPUs, {rounds} rounds (median)",
        kernel.trim()
    );
    if let Some(p) = &peer {
        println!("peer: {p}");
    }

    let cg = BenchCgroup::new("pipe")?;
    if runs("pipe") {
        runqlat_pipe(&cg, rounds, peer.as_deref())?;
    }
    if runs("spin") {
        sampler_spin(&cg, &spin, rounds, cpus, peer.as_deref())?;
    }
    if runs("bpf") || runs("sampler") {
        let stats = "/proc/sys/kernel/bpf_stats_enabled";
        let before = std::fs::read_to_string(stats).unwrap_or_else(|_| "0".into());
        std::fs::write(stats, "1").context("enabling kernel.bpf_stats_enabled")?;
        let measured = (|| {
            if runs("bpf") {
                runqlat_bpf(&cg, rounds, peer.as_deref())?;
            }
            if runs("sampler") {
                let workloads: [(&str, &Path); 2] = [
                    (
                        "spin (-O1, frame pointers): spin <- main <- libc's start",
                        &spin,
                    ),
                    (
                        "chain (-O2 -fomit-frame-pointer): leaf <- f3 <- f2 <- f1 <- main <- libc's start",
                        &chain,
                    ),
                ];
                sampler_bpf(
                    &cg,
                    &workloads,
                    rounds,
                    cpus,
                    (sampler_millions, sampler_hz),
                    peer.as_deref(),
                )?;
            }
            Ok::<_, anyhow::Error>(())
        })();
        std::fs::write(stats, before.trim())?;
        measured?;
    }
    if runs("agent") {
        agent_cpu(&cg, &spin, rounds, cpus, peer.as_deref())?;
    }
    Ok(())
}

/// 1. runqlat on perf bench sched pipe.
fn runqlat_pipe(cg: &BenchCgroup, rounds: usize, peer: Option<&str>) -> Result<()> {
    let (mut none, mut theirs, mut theirs_cg) = (vec![], vec![], vec![]);
    let mut ours: Vec<Vec<f64>> = vec![vec![]; CLOCKS.len()];
    let mut peer_pipe = vec![];
    for _ in 0..rounds {
        none.push(sched_pipe(cg, PIPE_LOOPS)?);
        let t = start_libbpf_runqlat(None)?;
        theirs.push(sched_pipe(cg, PIPE_LOOPS)?);
        t.stop();
        let t = start_libbpf_runqlat(Some(cg.path()))?;
        theirs_cg.push(sched_pipe(cg, PIPE_LOOPS)?);
        t.stop();
        for (i, (_, args)) in CLOCKS.iter().enumerate() {
            let t = start_agent(AGENT, "runqlat", cg.path(), args)?;
            ours[i].push(sched_pipe(cg, PIPE_LOOPS)?);
            t.stop();
        }
        if let Some(p) = peer {
            let t = start_agent(p, "runqlat", cg.path(), &CLOCKS[0].1)?;
            peer_pipe.push(sched_pipe(cg, PIPE_LOOPS)?);
            t.stop();
        }
    }
    let (n, a, b) = (median(none), median(theirs), median(theirs_cg));
    println!(
        "\n## runqlat overhead: perf bench sched pipe -l {PIPE_LOOPS} (ops/s, higher is better)"
    );
    println!("no tracer                         {n:>10.0} ops/s");
    println!(
        "libbpf-tools runqlat (all tasks)  {a:>10.0} ops/s  loss {:>5.1}%",
        loss(n, a)
    );
    println!(
        "libbpf-tools runqlat -c <cgroup>  {b:>10.0} ops/s  loss {:>5.1}%",
        loss(n, b)
    );
    for ((name, _), v) in CLOCKS.iter().zip(ours) {
        let o = median(v);
        println!(
            "flamefleet runqlat, {name:<16} {o:>8.0} ops/s  loss {:>5.1}%  (loss ratio vs -c {:.2})",
            loss(n, o),
            loss(n, o) / loss(n, b).max(f64::EPSILON)
        );
    }
    if !peer_pipe.is_empty() {
        let o = median(peer_pipe);
        println!(
            "peer runqlat, {:<22} {o:>8.0} ops/s  loss {:>5.1}%  (loss ratio vs -c {:.2})",
            CLOCKS[0].0,
            loss(n, o),
            loss(n, o) / loss(n, b).max(f64::EPSILON)
        );
    }

    Ok(())
}

/// 2. CPU sampler on a CPU-bound workload.
fn sampler_spin(
    cg: &BenchCgroup,
    spin: &Path,
    rounds: usize,
    cpus: usize,
    peer: Option<&str>,
) -> Result<()> {
    let cg_name = cg
        .path()
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_owned();
    let perf_out = std::env::temp_dir().join(format!("ffbench-perf-{}.data", std::process::id()));
    let millions = 400;
    let (mut none, mut perf, mut ours, mut peer_spin) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        none.push(spin_throughput(cg, spin, millions, cpus)?);
        let t = start_perf_record(&format!("/{cg_name}"), &perf_out)?;
        perf.push(spin_throughput(cg, spin, millions, cpus)?);
        t.stop();
        let t = start_agent(AGENT, "cpu", cg.path(), &["--frequency", "99"])?;
        ours.push(spin_throughput(cg, spin, millions, cpus)?);
        t.stop();
        if let Some(p) = peer {
            let t = start_agent(p, "cpu", cg.path(), &["--frequency", "99"])?;
            peer_spin.push(spin_throughput(cg, spin, millions, cpus)?);
            t.stop();
        }
    }
    let (n, p, o) = (median(none), median(perf), median(ours));
    println!(
        "\n## CPU sampler overhead: {cpus} spinners x {millions}M iterations (iterations per CPU-second)"
    );
    println!("no profiler                          {:>8.1} M/s", n / 1e6);
    println!(
        "perf record -F 99 -g -a -G <cgroup>  {:>8.1} M/s  loss {:>5.2}%",
        p / 1e6,
        loss(n, p)
    );
    println!(
        "flamefleet capture --type cpu, 99 Hz {:>8.1} M/s  loss {:>5.2}%",
        o / 1e6,
        loss(n, o)
    );
    if !peer_spin.is_empty() {
        let o = median(peer_spin);
        println!(
            "peer capture --type cpu, 99 Hz       {:>8.1} M/s  loss {:>5.2}%",
            o / 1e6,
            loss(n, o)
        );
    }

    let _ = std::fs::remove_file(&perf_out);
    Ok(())
}

/// (BPF ns, BPF program runs) of the programs named `names` over one run of `workload`
/// (kernel.bpf_stats_enabled on).
fn measure(names: &[&str], workload: &dyn Fn() -> Result<()>) -> Result<(u64, u64)> {
    let before = bpf_stats(names)?;
    workload()?;
    Ok(bpf_delta(&before, &bpf_stats(names)?))
}

fn per(ns: u64, n: u64) -> f64 {
    ns as f64 / n.max(1) as f64
}

/// 3. BPF cost per scheduler event (kernel.bpf_stats_enabled on).
fn runqlat_bpf(cg: &BenchCgroup, rounds: usize, peer: Option<&str>) -> Result<()> {
    let pipe = || sched_pipe(cg, PIPE_LOOPS).map(|_| ());
    let messaging = || sched_messaging(cg);
    let workloads: [(&str, &dyn Fn() -> Result<()>); 2] = [
        ("perf bench sched pipe", &pipe),
        ("perf bench sched messaging -p -g 2 -l 200", &messaging),
    ];
    let mut bpf_rows = Vec::new();
    for (wname, workload) in workloads {
        // Two references: `runqlat -c <cgroup>` and `runqlat` (all tasks). The first
        // tests the cgroup of the task running at each event; at the switch that ends a
        // wait on an idle CPU that is the idle task, so it skips those waits (nearly all
        // of them on sched pipe on a quiet machine). The second records every wait,
        // ours included.
        let mut theirs: [(Vec<f64>, Vec<f64>); 2] = Default::default();
        let mut ours: Vec<Refs> = vec![Refs::default(); CLOCKS.len()];
        let mut peer_refs = Refs::default();
        let mut events = 0;
        for _ in 0..rounds {
            let mut per_ref = [0.0; 2];
            for (r, cgroup) in [Some(cg.path()), None].into_iter().enumerate() {
                let t = start_libbpf_runqlat(cgroup)?;
                let (tns, tcnt) = measure(&THEIR_RQ_PROGS, workload)?;
                let waits = hist_waits(&t.stop());
                // Scheduler events of a run: libbpf-tools' program runs (one per event
                // on its three tracepoints); ours ran on a run of the same work.
                per_ref[r] = per(tns, tcnt);
                theirs[r].0.push(per_ref[r]);
                theirs[r].1.push(waits as f64);
                if r == 0 {
                    events = tcnt;
                }
            }
            let runs = CLOCKS
                .iter()
                .map(|(_, args)| (AGENT, args))
                .chain(peer.map(|p| (p, &CLOCKS[0].1)));
            for (i, (agent, args)) in runs.enumerate() {
                let t = start_agent(agent, "runqlat", cg.path(), args)?;
                let (ons, ocnt) = measure(&OUR_RQ_PROGS, workload)?;
                t.stop();
                let o = match ours.get_mut(i) {
                    Some(o) => o,
                    None => &mut peer_refs,
                };
                o.ns_event.push(per(ons, events));
                o.ns_run.push(per(ons, ocnt));
                o.ratio_c
                    .push(per(ons, events) / per_ref[0].max(f64::MIN_POSITIVE));
                o.ratio_all
                    .push(per(ons, events) / per_ref[1].max(f64::MIN_POSITIVE));
            }
        }
        bpf_rows.push((wname, theirs, events, ours, peer_refs));
    }
    println!(
        "\n## BPF run time per scheduler event (bpf_stats, one run of each workload per round, median of {rounds})"
    );
    for (wname, [(c_ns, c_waits), (all_ns, all_waits)], events, ours, peer_refs) in bpf_rows {
        println!("{wname}:");
        println!(
            "  libbpf-tools runqlat -c          {:>7.1} ns/event (one program run per event; last round {events} events), {:.0} waits recorded",
            median(c_ns),
            median(c_waits)
        );
        println!(
            "  libbpf-tools runqlat (all tasks) {:>7.1} ns/event, {:.0} waits recorded",
            median(all_ns),
            median(all_waits)
        );
        for ((name, _), o) in CLOCKS.iter().zip(ours) {
            println!(
                "  flamefleet, {name:<16}     {:>7.1} ns/event ({:.1} ns per program run), ratio to runqlat -c {:.2}, to runqlat {:.2} (medians of per-round ratios)",
                median(o.ns_event),
                median(o.ns_run),
                median(o.ratio_c),
                median(o.ratio_all)
            );
        }
        if !peer_refs.ns_event.is_empty() {
            let o = peer_refs;
            println!(
                "  peer, {:<16}           {:>7.1} ns/event ({:.1} ns per program run), ratio to runqlat -c {:.2}, to runqlat {:.2} (medians of per-round ratios)",
                CLOCKS[0].0,
                median(o.ns_event),
                median(o.ns_run),
                median(o.ratio_c),
                median(o.ratio_all)
            );
        }
    }
    Ok(())
}

/// One agent's figures for one workload over the rounds.
#[derive(Clone, Default)]
struct SamplerRuns {
    /// BPF ns per program run (every sample of every CPU, early returns included).
    ns_run: Vec<f64>,
    /// BPF ns per sample of the target: all the runs' time over the target's samples,
    /// counted as the frequency times the spinners' CPU time (the agent, ended by a signal,
    /// prints no count).
    ns_target: Vec<f64>,
    runs: u64,
    target_samples: f64,
}

/// `values` as "median (min-max)".
fn spread(values: &[f64]) -> String {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.0} ({min:.0}-{max:.0})", median(values.to_vec()))
}

/// `values` as "median [v1, v2, ...]".
fn ratios(values: &[f64]) -> String {
    let all: Vec<String> = values.iter().map(|v| format!("{v:.3}")).collect();
    format!("{:.3} [{}]", median(values.to_vec()), all.join(", "))
}

/// 3b. The CPU sampler's BPF cost per sample (kernel.bpf_stats_enabled on), ours and the
/// peer's on the same spins: each round runs every agent once per workload, the agents'
/// order swapped from one round to the next (A B, B A, ...) so that a drift of the
/// machine's load weighs on both alike. Each agent's own program is read, by the IDs its
/// process holds: tests or other agents running beside the benchmark load programs of
/// the same name.
fn sampler_bpf(
    cg: &BenchCgroup,
    workloads: &[(&str, &Path)],
    rounds: usize,
    cpus: usize,
    (millions, hz): (u64, u64),
    peer: Option<&str>,
) -> Result<()> {
    let hz_arg = hz.to_string();
    // (BPF ns, program runs, target samples) of one agent's CPU sampler over one spin run.
    let sampler_cost = |agent: &str, spin: &Path| -> Result<(u64, u64, f64)> {
        let t = start_agent(agent, "cpu", cg.path(), &["--frequency", &hz_arg])?;
        let measured = (|| {
            let ids = prog_ids_of(t.child.id(), "on_cpu_sample")?;
            if ids.is_empty() {
                bail!("{agent} holds no on_cpu_sample program");
            }
            let read = || -> Result<HashMap<u64, (u64, u64)>> {
                let mut all = bpf_stats(&["on_cpu_sample"])?;
                all.retain(|id, _| ids.contains(id));
                Ok(all)
            };
            let before = read()?;
            let cpu = spin_cpu_time(cg, spin, millions, cpus)?;
            let (ns, runs) = bpf_delta(&before, &read()?);
            Ok((ns, runs, hz as f64 * cpu.as_secs_f64()))
        })();
        t.stop();
        measured
    };
    let agents: Vec<(&str, &str)> = [("flamefleet", AGENT)]
        .into_iter()
        .chain(peer.map(|p| ("peer", p)))
        .collect();
    let mut figures = vec![vec![SamplerRuns::default(); agents.len()]; workloads.len()];
    for round in 0..rounds {
        for (w, (_, spin)) in workloads.iter().enumerate() {
            for k in 0..agents.len() {
                let i = if round % 2 == 0 {
                    k
                } else {
                    agents.len() - 1 - k
                };
                let (ns, runs, samples) = sampler_cost(agents[i].1, spin)?;
                let f = &mut figures[w][i];
                f.ns_run.push(per(ns, runs));
                f.ns_target.push(ns as f64 / samples.max(1.0));
                f.runs += runs;
                f.target_samples += samples;
            }
        }
    }
    println!(
        "\n## CPU sampler BPF run time per sample (bpf_stats of each agent's own program, {hz} Hz, {cpus} spinners x {millions}M iterations per run, {rounds} rounds, agents' order alternating): median (min-max) over rounds"
    );
    for ((wname, _), per_agent) in workloads.iter().zip(&figures) {
        println!("{wname}:");
        for ((name, _), f) in agents.iter().zip(per_agent) {
            println!(
                "  {name:<10} {} ns per program run, {} ns per target sample ({} runs, {:.0} target samples over the rounds)",
                spread(&f.ns_run),
                spread(&f.ns_target),
                f.runs,
                f.target_samples
            );
        }
        if let [ours, theirs] = per_agent.as_slice() {
            let ratio = |a: &[f64], b: &[f64]| -> Vec<f64> {
                a.iter()
                    .zip(b)
                    .map(|(a, b)| a / b.max(f64::MIN_POSITIVE))
                    .collect()
            };
            println!(
                "  ratio flamefleet / peer, median of per-round ratios [rounds]: per program run {}, per target sample {}",
                ratios(&ratio(&ours.ns_run, &theirs.ns_run)),
                ratios(&ratio(&ours.ns_target, &theirs.ns_target))
            );
        }
    }
    Ok(())
}

/// 4. The agent's own cost: ours and the peer's in turn, once per round.
fn agent_cpu(
    cg: &BenchCgroup,
    spin: &Path,
    rounds: usize,
    cpus: usize,
    peer: Option<&str>,
) -> Result<()> {
    let hogs: Vec<Child> = (0..cpus)
        .map(|_| cg.command(spin).arg("100000").spawn())
        .collect::<std::io::Result<_>>()?;
    println!(
        "\n## Agent cost: flamefleet-agent capture --type cpu, 10 s at 99 Hz, {cpus} busy CPUs, median of {rounds}"
    );
    let agents: Vec<(&str, &str)> = [("flamefleet", AGENT)]
        .into_iter()
        .chain(peer.map(|p| ("peer", p)))
        .collect();
    let mut per_1000 = vec![Vec::new(); agents.len()];
    let mut rss = vec![Vec::new(); agents.len()];
    let measured = (|| {
        for _ in 0..rounds {
            for (i, (_, agent)) in agents.iter().enumerate() {
                let (cpu_time, peak, samples) = agent_cost(agent, "cpu", cg.path(), 10)?;
                per_1000[i].push(cpu_time.as_secs_f64() * 1e6 / samples.max(1) as f64);
                rss[i].push(peak as f64 / 1024.0);
            }
        }
        Ok::<_, anyhow::Error>(())
    })();
    for mut h in hogs {
        let _ = h.kill();
        let _ = h.wait();
    }
    measured?;
    for ((name, _), (ms, mib)) in agents.iter().zip(per_1000.into_iter().zip(rss)) {
        println!(
            "{name}: agent CPU {:.1} ms per 1,000 samples (rounds: {}), peak RSS {:.1} MiB",
            median(ms.clone()),
            ms.iter()
                .map(|v| format!("{v:.1}"))
                .collect::<Vec<_>>()
                .join(", "),
            median(mib)
        );
    }
    Ok(())
}
