//! Cost of off-CPU profiles against libbpf-tools' `offcputime`, measured in one run on one
//! machine (not a test: it prints, never asserts).
//!
//! ```text
//! sudo -E cargo bench -p flamefleet-agent --bench offcpu_overhead -- [--rounds 3]
//! ```
//!
//! Per round, each condition once, interleaved; the median over rounds is printed:
//!
//! 1. BPF time per context switch (`kernel.bpf_stats_enabled=1`: `run_time_ns / run_cnt`
//!    of each tracer's own `sched_switch` program, told apart from other programs of the
//!    same name by ID), on `perf bench sched pipe` (two processes waking each other through
//!    pipes: every switch a block of well under 1 ms) and `perf bench sched messaging`
//!    (40 tasks per group over pipes, more runnable tasks than CPUs):
//!    - *target-less*: the benchmark runs outside the traced threads: ours targets an idle
//!      cgroup, `offcputime -p` an idle process. What every other pod's switch pays.
//!    - *traced*: every switch of the benchmark is traced: ours targets the benchmark's
//!      cgroup (minimum block 1 ms, the default, and 0: every block walked whole),
//!      `offcputime -m 1000` traces every task (it has no cgroup filter; the benchmark's
//!      tasks make nearly all the switches meanwhile).
//! 2. The throughput of the same runs against no tracer (`ops/s` of sched pipe, the
//!    run time of sched messaging).

use std::collections::{HashMap, HashSet};
use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};

const AGENT: &str = env!("CARGO_BIN_EXE_flamefleet-agent");
const OFFCPUTIME: &str = "/usr/sbin/offcputime";
const PIPE_LOOPS: &str = "100000";
/// Our program and libbpf-tools offcputime's (tp_btf and raw_tp builds).
const OURS: [&str; 1] = ["offcpu_switch"];
const THEIRS: [&str; 2] = ["sched_switch", "sched_switch_raw"];

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

/// A tracer running in the background for one measurement, and the IDs of its programs.
struct Tracer {
    child: Child,
    programs: HashSet<u64>,
}

impl Tracer {
    /// Starts `cmd`; it is attached once programs named in `names` that were not loaded
    /// before show up (polled: neither tracer says when it is attached on every build).
    fn start(mut cmd: Command, names: &[&str]) -> Result<Self> {
        let before: HashSet<u64> = bpf_stats(names)?.into_keys().collect();
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        // SIGINT ends the tracer; a bench started in the background by a non-interactive
        // shell inherits SIGINT ignored.
        // SAFETY: signal(2) between fork and exec, async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().with_context(|| format!("starting {cmd:?}"))?;
        let stderr = child.stderr.take().context("stderr")?;
        std::thread::spawn(move || for _ in BufReader::new(stderr).lines() {});
        let began = Instant::now();
        loop {
            let now: HashSet<u64> = bpf_stats(names)?.into_keys().collect();
            let programs: HashSet<u64> = now.difference(&before).copied().collect();
            if !programs.is_empty() {
                // The link follows the load; give the attach its moment by polling once more.
                std::thread::sleep(Duration::from_millis(200));
                return Ok(Self { child, programs });
            }
            if let Some(status) = child.try_wait()? {
                bail!("{cmd:?} exited ({status}) before loading {names:?}");
            }
            if began.elapsed() > Duration::from_secs(120) {
                bail!("{cmd:?} loaded none of {names:?} in 2 minutes");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// (ns, runs) of this tracer's programs now.
    fn stats(&self, names: &[&str]) -> Result<(u64, u64)> {
        Ok(bpf_stats(names)?
            .into_iter()
            .filter(|(id, _)| self.programs.contains(id))
            .fold((0, 0), |(ns, n), (_, (a, b))| (ns + a, n + b)))
    }

    fn stop(mut self) {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
    }
}

/// run_time_ns and run_cnt of each loaded program named in `names`, by ID.
fn bpf_stats(names: &[&str]) -> Result<HashMap<u64, (u64, u64)>> {
    let out = Command::new("bpftool")
        .args(["prog", "show", "-j"])
        .output()
        .context("running bpftool (install bpftool)")?;
    let progs: Vec<serde_json::Value> =
        serde_json::from_slice(&out.stdout).context("parsing bpftool prog show -j")?;
    Ok(progs
        .into_iter()
        .filter(|p| names.contains(&p["name"].as_str().unwrap_or_default()))
        .map(|p| {
            (
                p["id"].as_u64().unwrap_or(0),
                (
                    p["run_time_ns"].as_u64().unwrap_or(0),
                    p["run_cnt"].as_u64().unwrap_or(0),
                ),
            )
        })
        .collect())
}

fn ours(cg: &Path, min_block: &str) -> Result<Tracer> {
    let mut c = Command::new(AGENT);
    c.args([
        "capture",
        "--type",
        "offcpu",
        "--duration",
        "1h",
        "-o",
        "/dev/null",
        "--force",
        "--min-block",
        min_block,
        "--cgroup",
    ])
    .arg(cg);
    Tracer::start(c, &OURS)
}

fn theirs(pid: Option<u32>) -> Result<Tracer> {
    let mut c = Command::new(OFFCPUTIME);
    c.args(["-m", "1000", "--stack-storage-size", "65536"]);
    if let Some(pid) = pid {
        c.arg("-p").arg(pid.to_string());
    }
    c.arg("3600");
    Tracer::start(c, &THEIRS)
}

/// The workloads: `perf bench sched pipe` (ops/s) and `sched messaging` (1 / seconds), so
/// that higher is better for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Bench {
    Pipe,
    Messaging,
}

impl Bench {
    fn name(self) -> &'static str {
        match self {
            Self::Pipe => "perf bench sched pipe",
            Self::Messaging => "perf bench sched messaging",
        }
    }

    fn run(self, cg: &BenchCgroup) -> Result<f64> {
        let mut cmd = cg.command("perf");
        match self {
            Self::Pipe => cmd.args(["bench", "sched", "pipe", "-l", PIPE_LOOPS]),
            Self::Messaging => {
                cmd.args(["bench", "sched", "messaging", "-p", "-g", "2", "-l", "200"])
            }
        };
        let began = Instant::now();
        let out = cmd
            .output()
            .context("running perf bench (install linux-perf)")?;
        let secs = began.elapsed().as_secs_f64();
        if !out.status.success() {
            bail!(
                "{} failed: {}",
                self.name(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        match self {
            Self::Pipe => text
                .lines()
                .find_map(|l| l.trim().strip_suffix("ops/sec"))
                .and_then(|v| v.trim().parse().ok())
                .with_context(|| format!("no ops/sec in perf bench output: {text}")),
            Self::Messaging => Ok(1.0 / secs),
        }
    }
}

/// The conditions of a round, in the order they run.
const CONDITIONS: [&str; 6] = [
    "no tracer",
    "offcputime -p <idle> (target-less)",
    "flamefleet, idle target (target-less)",
    "offcputime -m 1000 (all tasks)",
    "flamefleet, min block 1ms (traced)",
    "flamefleet, min block 0 (traced)",
];

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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
        .unwrap_or(3);
    let stats_path = "/proc/sys/kernel/bpf_stats_enabled";
    let stats_before = std::fs::read_to_string(stats_path).unwrap_or_default();
    std::fs::write(stats_path, "1").context("enabling kernel.bpf_stats_enabled")?;
    let result = run(rounds);
    let _ = std::fs::write(stats_path, stats_before.trim());
    result
}

fn run(rounds: usize) -> Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!(
        "flamefleet off-CPU overhead vs libbpf-tools offcputime, kernel {}, {cpus} CPUs, {rounds} rounds (median)",
        kernel.trim()
    );
    let bench_cg = BenchCgroup::new("offcpu-bench")?;
    let idle_cg = BenchCgroup::new("offcpu-idle")?;
    let mut idle = idle_cg.command("sleep").arg("3600").spawn()?;
    // (bench, condition) -> per-round throughput and BPF ns per program run.
    let mut speed: HashMap<(Bench, usize), Vec<f64>> = HashMap::new();
    let mut cost: HashMap<(Bench, usize), Vec<f64>> = HashMap::new();
    for _ in 0..rounds {
        for bench in [Bench::Pipe, Bench::Messaging] {
            for (i, _) in CONDITIONS.iter().enumerate() {
                let (tracer, names): (Option<Tracer>, &[&str]) = match i {
                    0 => (None, &[]),
                    1 => (Some(theirs(Some(idle.id()))?), &THEIRS),
                    2 => (Some(ours(idle_cg.path(), "1ms")?), &OURS),
                    3 => (Some(theirs(None)?), &THEIRS),
                    4 => (Some(ours(bench_cg.path(), "1ms")?), &OURS),
                    _ => (Some(ours(bench_cg.path(), "0s")?), &OURS),
                };
                let before = match &tracer {
                    Some(t) => t.stats(names)?,
                    None => (0, 0),
                };
                speed
                    .entry((bench, i))
                    .or_default()
                    .push(bench.run(&bench_cg)?);
                if let Some(t) = tracer {
                    let after = t.stats(names)?;
                    let (ns, runs) = (after.0 - before.0, after.1 - before.1);
                    cost.entry((bench, i))
                        .or_default()
                        .push(ns as f64 / runs.max(1) as f64);
                    t.stop();
                }
            }
        }
    }
    let _ = idle.kill();
    let _ = idle.wait();
    for bench in [Bench::Pipe, Bench::Messaging] {
        let unit = match bench {
            Bench::Pipe => "ops/s",
            Bench::Messaging => "runs/s",
        };
        println!(
            "\n## {} ({unit}, higher is better; BPF ns per sched_switch run)",
            bench.name()
        );
        let base = median(speed.remove(&(bench, 0)).unwrap_or_default());
        println!("{:<40} {base:>10.1} {unit}", CONDITIONS[0]);
        for (i, name) in CONDITIONS.iter().enumerate().skip(1) {
            let s = median(speed.remove(&(bench, i)).unwrap_or_default());
            let ns = median(cost.remove(&(bench, i)).unwrap_or_default());
            println!(
                "{name:<40} {s:>10.1} {unit}  loss {:>5.1}%  {ns:>7.1} ns/switch",
                100.0 * (base - s) / base
            );
        }
    }
    println!(
        "\n(ns/switch: run_time_ns / run_cnt of the tracer's own sched_switch program over the benchmark's run; \
         other engineers' builds may share the machine)"
    );
    Ok(())
}
