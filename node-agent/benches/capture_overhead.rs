//! Overhead of the capture engines against the tools people use today, all
//! measured in one run on one machine (not a test: it prints, never asserts).
//!
//! ```text
//! sudo -E cargo bench -p flamefleet-agent --bench capture_overhead -- [--rounds 5] [--peer PATH]
//! ```
//!
//! `--peer PATH` measures another build of `flamefleet-agent` (e.g. one built from an
//! earlier commit) beside this one, in the same rounds: its rows say `peer`. It runs with
//! the default runqlat clock only.
//!
//! 1. runqlat: `perf bench sched pipe` throughput with no tracer, with
//!    libbpf-tools `runqlat` (all tasks, its default), with `runqlat -c <cg>`,
//!    and with ours filtered to the benchmark's cgroup, with each of its
//!    clocks (`--runqlat-clock hybrid`, the default; `hybrid-no-psi`, the same
//!    without PSI's switch stamps; `scheduler`; `own`).
//! 2. CPU sampler: throughput per CPU-second of a CPU-bound workload (one spinner per CPU)
//!    with no profiler, `perf record -F 99 -g -a -e cpu-clock -G <cg>`, and ours at 99 Hz.
//! 3. BPF cost per scheduler event (`kernel.bpf_stats_enabled=1`, run_time_ns
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
//! 4. The agent's own CPU time per 1,000 samples and its peak RSS.
//!
//! Each condition runs once per round, conditions interleaved, and the
//! median over rounds is printed (the machine may be shared).

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};

const AGENT: &str = env!("CARGO_BIN_EXE_flamefleet-agent");
const RUNQLAT: &str = "/usr/sbin/runqlat";
const PIPE_LOOPS: &str = "200000";
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

struct BenchCgroup(Cgroup);

impl BenchCgroup {
    fn new(name: &str) -> Result<Self> {
        let root = CgroupRoot::detect()?;
        let dir = root
            .path()
            .join(format!("flamefleet-bench-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self(Cgroup::open(&dir)?))
    }

    fn path(&self) -> &Path {
        &self.0.path
    }

    /// A command whose process joins this cgroup before exec.
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        use std::os::unix::ffi::OsStrExt as _;
        let procs = std::ffi::CString::new(self.0.path.join("cgroup.procs").as_os_str().as_bytes())
            .expect("no NUL in path");
        let mut c = Command::new(program);
        // SAFETY: async-signal-safe calls only, on memory prepared before fork.
        unsafe {
            c.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                libc::close(fd);
                if ok {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        c
    }
}

impl Drop for BenchCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0.path.join("cgroup.kill"), "1");
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

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
        // SIGINT ends the tracer (`stop`); a bench started in the background by a
        // non-interactive shell inherits SIGINT ignored, which would make it last forever.
        // SAFETY: signal(2) between fork and exec, async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                Ok(())
            });
        }
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
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
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

/// `perf bench sched pipe` in `cg`: operations per second.
fn sched_pipe(cg: &BenchCgroup) -> Result<f64> {
    let out = cg
        .command("perf")
        .args(["bench", "sched", "pipe", "-l", PIPE_LOOPS])
        .output()
        .context("running perf bench sched pipe (install linux-perf)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().strip_suffix("ops/sec"))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no ops/sec in perf bench output: {text}"))
}

/// `perf bench sched messaging` in `cg` (2 groups of 20 senders and 20 receivers over
/// pipes, 200 loops): many more runnable tasks than CPUs.
fn sched_messaging(cg: &BenchCgroup) -> Result<()> {
    let out = cg
        .command("perf")
        .args(["bench", "sched", "messaging", "-p", "-g", "2", "-l", "200"])
        .output()
        .context("running perf bench sched messaging (install linux-perf)")?;
    if !out.status.success() {
        bail!(
            "perf bench sched messaging failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// One spinner per CPU in `cg`, `millions` iterations each: iterations per
/// CPU-second of the spinners. CPU time (not wall time) keeps other load on a
/// shared machine out of the figure, while the sampling interrupts and BPF
/// programs, which run on the interrupted task's time, stay in it.
fn spin_throughput(cg: &BenchCgroup, spin: &Path, millions: u64, cpus: usize) -> Result<f64> {
    let mut kids = Vec::new();
    for _ in 0..cpus {
        kids.push(cg.command(spin).arg(millions.to_string()).spawn()?);
    }
    let mut cpu = Duration::ZERO;
    for k in kids {
        cpu += wait_cpu_time(k)?.0;
    }
    Ok((millions * 1_000_000 * cpus as u64) as f64 / cpu.as_secs_f64())
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn loss(base: f64, x: f64) -> f64 {
    100.0 * (base - x) / base
}

/// run_time_ns and run_cnt of each loaded program named in `names` (kernel names are cut
/// at 15 characters), by program ID. Callers diff two readings with [`bpf_delta`].
fn bpf_cost(names: &[&str]) -> Result<HashMap<u64, (u64, u64)>> {
    let out = Command::new("bpftool")
        .args(["prog", "show", "-j"])
        .output()?;
    let progs: Vec<serde_json::Value> =
        serde_json::from_slice(&out.stdout).context("parsing bpftool prog show -j")?;
    let mut by_id = HashMap::new();
    for p in progs {
        if names.contains(&p["name"].as_str().unwrap_or_default()) {
            by_id.insert(
                p["id"].as_u64().unwrap_or(0),
                (
                    p["run_time_ns"].as_u64().unwrap_or(0),
                    p["run_cnt"].as_u64().unwrap_or(0),
                ),
            );
        }
    }
    Ok(by_id)
}

/// (ns, runs) between two readings, over the programs present in both: a tracer stopped
/// just before the first reading may still be listed in it while its programs unload.
fn bpf_delta(before: &HashMap<u64, (u64, u64)>, after: &HashMap<u64, (u64, u64)>) -> (u64, u64) {
    after
        .iter()
        .filter_map(|(id, &(ns1, c1))| {
            let &(ns0, c0) = before.get(id)?;
            Some((ns1.saturating_sub(ns0), c1.saturating_sub(c0)))
        })
        .fold((0, 0), |(ns, c), (dn, dc)| (ns + dn, c + dc))
}

fn compile_spin(dir: &Path) -> Result<PathBuf> {
    let src = dir.join("ffbench_spin.c");
    let bin = dir.join("ffbench_spin");
    std::fs::write(&src, SPIN)?;
    let st = Command::new("cc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()?;
    if !st.success() {
        bail!("cc failed");
    }
    Ok(bin)
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
        bail!("the benchmark loads eBPF programs: expected root, run it with sudo -E");
    }
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let peer: Option<String> = args
        .iter()
        .position(|a| a == "--peer")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = tempfile::tempdir()?;
    let spin = compile_spin(dir.path())?;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!(
        "flamefleet capture overhead, kernel {}, {cpus} CPUs, {rounds} rounds (median)",
        kernel.trim()
    );
    if let Some(p) = &peer {
        println!("peer: {p}");
    }

    // 1. runqlat on perf bench sched pipe.
    let cg = BenchCgroup::new("pipe")?;
    let (mut none, mut theirs, mut theirs_cg) = (vec![], vec![], vec![]);
    let mut ours: Vec<Vec<f64>> = vec![vec![]; CLOCKS.len()];
    let mut peer_pipe = vec![];
    for _ in 0..rounds {
        none.push(sched_pipe(&cg)?);
        let t = start_libbpf_runqlat(None)?;
        theirs.push(sched_pipe(&cg)?);
        t.stop();
        let t = start_libbpf_runqlat(Some(cg.path()))?;
        theirs_cg.push(sched_pipe(&cg)?);
        t.stop();
        for (i, (_, args)) in CLOCKS.iter().enumerate() {
            let t = start_agent(AGENT, "runqlat", cg.path(), args)?;
            ours[i].push(sched_pipe(&cg)?);
            t.stop();
        }
        if let Some(p) = &peer {
            let t = start_agent(p, "runqlat", cg.path(), &CLOCKS[0].1)?;
            peer_pipe.push(sched_pipe(&cg)?);
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

    // 2. CPU sampler on a CPU-bound workload.
    let cg_name = cg
        .path()
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_owned();
    let perf_out = dir.path().join("perf.data");
    let millions = 400;
    let (mut none, mut perf, mut ours, mut peer_spin) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        none.push(spin_throughput(&cg, &spin, millions, cpus)?);
        let t = start_perf_record(&format!("/{cg_name}"), &perf_out)?;
        perf.push(spin_throughput(&cg, &spin, millions, cpus)?);
        t.stop();
        let t = start_agent(AGENT, "cpu", cg.path(), &["--frequency", "99"])?;
        ours.push(spin_throughput(&cg, &spin, millions, cpus)?);
        t.stop();
        if let Some(p) = &peer {
            let t = start_agent(p, "cpu", cg.path(), &["--frequency", "99"])?;
            peer_spin.push(spin_throughput(&cg, &spin, millions, cpus)?);
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

    // 3. BPF cost per event.
    let stats = "/proc/sys/kernel/bpf_stats_enabled";
    let before = std::fs::read_to_string(stats).unwrap_or_else(|_| "0".into());
    std::fs::write(stats, "1").context("enabling kernel.bpf_stats_enabled")?;
    // (BPF ns, BPF program runs) of one run of `workload`.
    let measure = |names: &[&str], workload: &dyn Fn() -> Result<()>| -> Result<(u64, u64)> {
        let before = bpf_cost(names)?;
        workload()?;
        Ok(bpf_delta(&before, &bpf_cost(names)?))
    };
    let per = |ns: u64, n: u64| ns as f64 / n.max(1) as f64;
    let pipe = || sched_pipe(&cg).map(|_| ());
    let messaging = || sched_messaging(&cg);
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
                .chain(peer.as_deref().map(|p| (p, &CLOCKS[0].1)));
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
    // (BPF ns, program runs) of the CPU sampler over one spin run, for `agent`.
    let sampler_cost = |agent: &str| -> Result<(u64, u64)> {
        let t = start_agent(agent, "cpu", cg.path(), &["--frequency", "99"])?;
        let sampler_before = bpf_cost(&["on_cpu_sample"])?;
        spin_throughput(&cg, &spin, 200, cpus)?;
        let cost = bpf_delta(&sampler_before, &bpf_cost(&["on_cpu_sample"])?);
        t.stop();
        Ok(cost)
    };
    let (cpu_ns, cpu_runs) = sampler_cost(AGENT)?;
    let peer_cpu = peer.as_deref().map(sampler_cost).transpose()?;
    std::fs::write(stats, before.trim())?;
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
    println!(
        "flamefleet CPU sampler            {:>7.0} ns/sample over {} samples",
        per(cpu_ns, cpu_runs),
        cpu_runs
    );
    if let Some((ns, runs)) = peer_cpu {
        println!(
            "peer CPU sampler                  {:>7.0} ns/sample over {runs} samples",
            per(ns, runs)
        );
    }

    // 4. The agent's own cost.
    let hogs: Vec<Child> = (0..cpus)
        .map(|_| cg.command(&spin).arg("100000").spawn())
        .collect::<std::io::Result<_>>()?;
    println!(
        "\n## Agent cost: flamefleet-agent capture --type cpu, 10 s at 99 Hz, {cpus} busy CPUs"
    );
    let agents = [("flamefleet", AGENT)]
        .into_iter()
        .chain(peer.as_deref().map(|p| ("peer", p)));
    for (name, agent) in agents {
        let (cpu_time, rss, samples) = agent_cost(agent, "cpu", cg.path(), 10)?;
        println!(
            "{name}: {samples} samples, agent CPU {:.1} ms total = {:.1} ms per 1,000 samples, peak RSS {:.1} MiB",
            cpu_time.as_secs_f64() * 1e3,
            cpu_time.as_secs_f64() * 1e6 / samples.max(1) as f64,
            rss as f64 / 1024.0
        );
    }
    for mut h in hogs {
        let _ = h.kill();
        let _ = h.wait();
    }
    Ok(())
}
