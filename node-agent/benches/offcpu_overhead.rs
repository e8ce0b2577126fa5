//! Cost of off-CPU profiles against libbpf-tools' `offcputime`, measured in one run on one
//! machine (not a test: it prints, never asserts).
//!
//! ```text
//! cargo bench -p flamefleet-agent --bench offcpu_overhead -- [--rounds 3] [--peer PATH]
//! ```
//!
//! `--peer PATH` measures another build of `flamefleet-agent` (e.g. one built from an
//! earlier commit) beside this one, target-less, in the same rounds: its row says `peer`.
//!
//! Per round, each condition once, interleaved; the median over rounds is printed:
//!
//! 1. BPF time per context switch (`kernel.bpf_stats_enabled=1`: `run_time_ns / run_cnt`
//!    of each tracer's own `sched_switch` program, told apart from other programs of the
//!    same name by ID), on `perf bench sched pipe` (two processes waking each other through
//!    pipes: every switch a block of well under 1 ms) and `perf bench sched messaging`
//!    (40 tasks per group over pipes, more runnable tasks than CPUs):
//!    - *floor*: an empty `tp_btf/sched_switch` program (compiled with clang at run time):
//!      what bpf_stats charges any program on this machine (its two clock reads around the
//!      run), which no program can go below. The cost of a program's own work is its
//!      figure minus this one.
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
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use shared::{
    BenchCgroup, bpf_stats, flag, interrupt, median, sched_messaging, sched_pipe, sigint_ends,
};

mod shared;

const AGENT: &str = env!("CARGO_BIN_EXE_flamefleet-agent");
const OFFCPUTIME: &str = "/usr/sbin/offcputime";
const PIPE_LOOPS: &str = "100000";
/// Our program and libbpf-tools offcputime's (tp_btf and raw_tp builds).
const OURS: [&str; 1] = ["offcpu_switch"];
/// The empty program that measures the floor.
const FLOOR: [&str; 1] = ["offcpu_floor"];
/// Its source: no headers, so that any clang with the BPF target builds it.
const FLOOR_SOURCE: &str = r#"
__attribute__((section("tp_btf/sched_switch"), used)) int offcpu_floor(void *ctx) { return 0; }
char _license[] __attribute__((section("license"), used)) = "GPL";
"#;
const THEIRS: [&str; 2] = ["sched_switch", "sched_switch_raw"];

/// A tracer running for one measurement, and the IDs of its programs.
struct Tracer {
    /// A tracer process, or the floor's program loaded by this one (its link attached).
    child: Option<Child>,
    floor: Option<(libbpf_rs::Object, libbpf_rs::Link)>,
    programs: HashSet<u64>,
}

impl Tracer {
    /// Starts `cmd`; it is attached once programs named in `names` that were not loaded
    /// before show up (polled: neither tracer says when it is attached on every build).
    fn start(mut cmd: Command, names: &[&str]) -> Result<Self> {
        let before: HashSet<u64> = bpf_stats(names)?.into_keys().collect();
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        sigint_ends(&mut cmd);
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
                return Ok(Self {
                    child: Some(child),
                    floor: None,
                    programs,
                });
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

    /// The empty program, built from [`FLOOR_SOURCE`] in `dir` and attached.
    fn floor(dir: &Path) -> Result<Self> {
        let src = dir.join("offcpu_floor.bpf.c");
        let obj = dir.join("offcpu_floor.bpf.o");
        std::fs::write(&src, FLOOR_SOURCE)?;
        let out = Command::new("clang")
            .args(["-O2", "-g", "-target", "bpf", "-c"])
            .arg(&src)
            .arg("-o")
            .arg(&obj)
            .output()
            .context("running clang (install clang)")?;
        if !out.status.success() {
            bail!("clang: {}", String::from_utf8_lossy(&out.stderr));
        }
        let before: HashSet<u64> = bpf_stats(&FLOOR)?.into_keys().collect();
        let object = libbpf_rs::ObjectBuilder::default()
            .open_file(&obj)
            .context("opening the floor program")?
            .load()
            .context("loading the floor program")?;
        let link = object
            .progs_mut()
            .next()
            .context("no program in the floor object")?
            .attach()
            .context("attaching the floor program")?;
        let now: HashSet<u64> = bpf_stats(&FLOOR)?.into_keys().collect();
        Ok(Self {
            child: None,
            floor: Some((object, link)),
            programs: now.difference(&before).copied().collect(),
        })
    }

    /// (ns, runs) of this tracer's programs now.
    fn stats(&self, names: &[&str]) -> Result<(u64, u64)> {
        Ok(bpf_stats(names)?
            .into_iter()
            .filter(|(id, _)| self.programs.contains(id))
            .fold((0, 0), |(ns, n), (_, (a, b))| (ns + a, n + b)))
    }

    fn stop(self) {
        if let Some(mut child) = self.child {
            interrupt(&mut child);
        }
        // The floor's link detaches as it drops.
        drop(self.floor);
    }
}

fn ours(agent: &str, cg: &Path, min_block: &str) -> Result<Tracer> {
    let mut c = Command::new(agent);
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
        match self {
            Self::Pipe => sched_pipe(cg, PIPE_LOOPS),
            Self::Messaging => {
                let began = Instant::now();
                sched_messaging(cg)?;
                Ok(1.0 / began.elapsed().as_secs_f64())
            }
        }
    }
}

/// The conditions of a round, in the order they run (the peer's only with `--peer`).
const CONDITIONS: [&str; 8] = [
    "no tracer",
    "empty tp_btf program (floor)",
    "offcputime -p <idle> (target-less)",
    "flamefleet, idle target (target-less)",
    "peer, idle target (target-less)",
    "offcputime -m 1000 (all tasks)",
    "flamefleet, min block 1ms (traced)",
    "flamefleet, min block 0 (traced)",
];
const FLOOR_CONDITION: usize = 1;
const PEER_CONDITION: usize = 4;

fn main() -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("the benchmark loads eBPF programs: expected to run as root");
    }
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = flag(&args, "--rounds").unwrap_or(3);
    let stats_path = "/proc/sys/kernel/bpf_stats_enabled";
    let stats_before = std::fs::read_to_string(stats_path).unwrap_or_default();
    std::fs::write(stats_path, "1").context("enabling kernel.bpf_stats_enabled")?;
    let peer: Option<String> = flag(&args, "--peer");
    let result = run(rounds, peer.as_deref());
    let _ = std::fs::write(stats_path, stats_before.trim());
    result
}

fn run(rounds: usize, peer: Option<&str>) -> Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!(
        "flamefleet off-CPU overhead vs libbpf-tools offcputime, kernel {}, {cpus} CPUs, {rounds} rounds (median)",
        kernel.trim()
    );
    if let Some(p) = peer {
        println!("peer: {p}");
    }
    let work = tempfile::tempdir()?;
    let bench_cg = BenchCgroup::new("offcpu-bench")?;
    let idle_cg = BenchCgroup::new("offcpu-idle")?;
    let mut idle = idle_cg.command("sleep").arg("3600").spawn()?;
    // (bench, condition) -> per-round throughput and BPF ns per program run.
    let mut speed: HashMap<(Bench, usize), Vec<f64>> = HashMap::new();
    let mut cost: HashMap<(Bench, usize), Vec<f64>> = HashMap::new();
    for _ in 0..rounds {
        for bench in [Bench::Pipe, Bench::Messaging] {
            for (i, _) in CONDITIONS.iter().enumerate() {
                let (tracer, names): (Option<Tracer>, &[&str]) = match (i, peer) {
                    (0, _) => (None, &[]),
                    (1, _) => (Some(Tracer::floor(work.path())?), &FLOOR),
                    (2, _) => (Some(theirs(Some(idle.id()))?), &THEIRS),
                    (3, _) => (Some(ours(AGENT, idle_cg.path(), "1ms")?), &OURS),
                    (4, None) => continue,
                    (4, Some(p)) => (Some(ours(p, idle_cg.path(), "1ms")?), &OURS),
                    (5, _) => (Some(theirs(None)?), &THEIRS),
                    (6, _) => (Some(ours(AGENT, bench_cg.path(), "1ms")?), &OURS),
                    _ => (Some(ours(AGENT, bench_cg.path(), "0s")?), &OURS),
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
        let floor = median(
            cost.get(&(bench, FLOOR_CONDITION))
                .cloned()
                .unwrap_or_default(),
        );
        for (i, name) in CONDITIONS.iter().enumerate().skip(1) {
            if i == PEER_CONDITION && peer.is_none() {
                continue;
            }
            let s = median(speed.remove(&(bench, i)).unwrap_or_default());
            let ns = median(cost.remove(&(bench, i)).unwrap_or_default());
            let over = if i == FLOOR_CONDITION {
                String::new()
            } else {
                format!("  ({:+.1} over the floor)", ns - floor)
            };
            println!(
                "{name:<40} {s:>10.1} {unit}  loss {:>5.1}%  {ns:>7.1} ns/switch{over}",
                100.0 * (base - s) / base
            );
        }
    }
    println!(
        "\n(ns/switch: run_time_ns / run_cnt of the tracer's own sched_switch program over the benchmark's run; \
         the floor is bpf_stats' own charge to an empty program; other engineers' builds may share the machine)"
    );
    Ok(())
}
