//! Soak: the node's samplers as a 24/7 daemon uses them. Hundreds of back-to-back,
//! overlapping captures of mixed types (CPU, runqlat, eBPF heap) of three "pods" whose
//! containers (cgroups with processes) start and stop all the time. Prints the curve of
//! this process's RSS and of every sampler map's fill over time, the drops, and how correct
//! the first and the last captures are. A benchmark: it prints, it never asserts.
//!
//! ```text
//! cargo bench -p flamefleet-agent --bench soak -- [--captures 500] [--parallel 3]
//! ```

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::capture::cpu::CpuOptions;
use flamefleet_agent::capture::heap::{self, HeapSource};
use flamefleet_agent::capture::runqlat::RunqlatOptions;
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};
use flamefleet_agent::symbolize::StackSymbolizer;
use shared::named_share;

mod shared;

/// A container's process: recursion of changing depth (many distinct stacks), a short
/// sleep now and then (wakeups, so run-queue waits), and malloc/free (heap samples).
const WORKLOAD: &str = r#"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static volatile unsigned long sink;
__attribute__((noinline)) void ff_soak_depth(int n) {
    if (n > 0) { ff_soak_depth(n - 1); sink++; return; }
    for (int i = 0; i < 20000; i++) sink += i;
}
__attribute__((noinline)) void *ff_soak_alloc(size_t n) { void *p = malloc(n); if (p) memset(p, 1, 64); return p; }
int main(void) {
    static void *live[64];
    for (unsigned i = 0;; i++) {
        ff_soak_depth(i % 48);
        if (i % 16 == 0) { free(live[i % 64]); live[i % 64] = ff_soak_alloc(4096 + (i % 8) * 1024); }
        if (i % 64 == 0) usleep(300);
    }
}
"#;

struct Args {
    captures: usize,
    parallel: usize,
}

fn args() -> Result<Args> {
    let mut a = Args {
        captures: 500,
        parallel: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--captures" => a.captures = it.next().context("--captures N")?.parse()?,
            "--parallel" => a.parallel = it.next().context("--parallel N")?.parse()?,
            // cargo bench passes --bench.
            _ => {}
        }
    }
    Ok(a)
}

/// A pod cgroup whose containers come and go.
struct Pod {
    dir: PathBuf,
    containers: VecDeque<(PathBuf, Child)>,
    started: usize,
}

impl Pod {
    fn new(root: &Path, name: &str) -> Result<Self> {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            dir,
            containers: VecDeque::new(),
            started: 0,
        })
    }

    fn start_container(&mut self, program: &Path) -> Result<()> {
        self.started += 1;
        let dir = self.dir.join(format!("container-{}", self.started));
        std::fs::create_dir(&dir)?;
        let mut cmd = Command::new(program);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        shared::join_before_exec(&mut cmd, &dir);
        let child = cmd.spawn().context("spawning a container process")?;
        self.containers.push_back((dir, child));
        Ok(())
    }

    fn stop_oldest(&mut self) {
        if let Some((dir, mut child)) = self.containers.pop_front() {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir(&dir);
        }
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        while !self.containers.is_empty() {
            self.stop_oldest();
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Cpu,
    Runqlat,
    Heap,
}

/// What one capture gave.
#[derive(Debug, Clone)]
struct Outcome {
    index: usize,
    kind: Kind,
    /// CPU samples, runqlat waits, heap allocation samples.
    count: u64,
    drops: u64,
    /// CPU: share of samples whose stack names the workload's function.
    named_pct: Option<f64>,
    error: Option<String>,
}

/// One point of the curve.
struct Point {
    t: Duration,
    done: usize,
    rss_kib: u64,
    cpu: flamefleet_agent::capture::cpu::CpuMapFill,
    runqlat: flamefleet_agent::capture::runqlat::RunqlatMapFill,
}

fn print_point(p: &Point) {
    use std::io::Write as _;
    println!(
        "{:>6.0} {:>5} {:>8.1} | {:>4} {:>7} {:>7} {:>7} | {:>4} {:>6} {:>6}",
        p.t.as_secs_f64(),
        p.done,
        p.rss_kib as f64 / 1024.0,
        p.cpu.targets,
        p.cpu.counts,
        p.cpu.kernel_stacks,
        p.cpu.user_stacks,
        p.runqlat.targets,
        p.runqlat.histograms,
        p.runqlat
            .starts
            .map_or_else(|| "-".to_string(), |n| n.to_string()),
    );
    let _ = std::io::stdout().flush();
}

fn run_one(samplers: &Samplers, index: usize, target: &CaptureTarget) -> Outcome {
    // Mixed: every 25th a heap capture (it loads its own BPF object), then CPU and runqlat.
    let kind = if index % 25 == 24 {
        Kind::Heap
    } else if index.is_multiple_of(2) {
        Kind::Cpu
    } else {
        Kind::Runqlat
    };
    // 200-590 ms, different for neighbours so captures overlap in every way.
    let duration = Duration::from_millis(200 + (index as u64 * 37) % 400);
    let mut out = Outcome {
        index,
        kind,
        count: 0,
        drops: 0,
        named_pct: None,
        error: None,
    };
    let result: Result<()> = (|| {
        match kind {
            Kind::Cpu => {
                let c = samplers.start_cpu(std::slice::from_ref(target), &CpuOptions::default())?;
                std::thread::sleep(duration);
                let r = c.finish()?;
                let mut symbolizer = StackSymbolizer::new(samplers.catalog().clone());
                let profile = r.to_profile(&mut symbolizer, "soak");
                out.count = r.total();
                out.drops = r.drops.total();
                out.named_pct = Some(named_share(&profile, "ff_soak_depth"));
            }
            Kind::Runqlat => {
                let c = samplers
                    .start_runqlat(std::slice::from_ref(target), &RunqlatOptions::default())?;
                std::thread::sleep(duration);
                let r = c.finish()?;
                out.count = r.histograms.iter().map(|h| h.count()).sum();
                out.drops = r.drops.hists_full + r.drops.start_full;
            }
            Kind::Heap => {
                let req = heap::cli_request(
                    HeapSource::Ebpf,
                    std::slice::from_ref(target),
                    Vec::new(),
                    duration,
                    heap::sampling::DEFAULT_SAMPLE_BYTES / 64,
                    0,
                    "soak",
                )?;
                let r = heap::capture(samplers, &req)?;
                out.count = flamefleet_agent::pprof::allocation_count(&r.profile);
            }
        }
        Ok(())
    })();
    if let Err(e) = result {
        out.error = Some(format!("{e:#}"));
    }
    out
}

fn main() -> Result<()> {
    let args = args()?;
    if !nix::unistd::Uid::effective().is_root() {
        bail!("run as root: the soak loads eBPF programs and creates cgroups");
    }
    let dir = tempfile::tempdir()?;
    let program = shared::compile_c(dir.path(), "ff-soak", WORKLOAD)?;
    let root = CgroupRoot::detect()?
        .path()
        .join(format!("flamefleet-soak-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let quiet_dir = root.join("quiet");
    std::fs::create_dir_all(&quiet_dir)?;
    let pods: Vec<Arc<Mutex<Pod>>> = (0..3)
        .map(|i| Pod::new(&root, &format!("pod-{i}")).map(|p| Arc::new(Mutex::new(p))))
        .collect::<Result<_>>()?;
    for pod in &pods {
        let mut p = pod.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        p.start_container(&program)?;
        p.start_container(&program)?;
    }
    let targets: Vec<CaptureTarget> = pods
        .iter()
        .map(|p| {
            let dir = p.lock().map(|p| p.dir.clone()).unwrap_or_default();
            Cgroup::open(&dir).map(CaptureTarget::raw)
        })
        .collect::<Result<_, _>>()?;

    let samplers = Arc::new(Samplers::new(SamplerConfig::default()));
    // A capture of an empty cgroup keeps one sampler of each type alive throughout, as
    // back-to-back captures do in continuous mode: the worst case for anything that leaks.
    let quiet = CaptureTarget::raw(Cgroup::open(&quiet_dir)?);
    let hold_cpu = samplers.start_cpu(std::slice::from_ref(&quiet), &CpuOptions::default())?;
    let hold_rq =
        samplers.start_runqlat(std::slice::from_ref(&quiet), &RunqlatOptions::default())?;
    let cpu_sampler = Arc::clone(hold_cpu.sampler());
    let rq_sampler = Arc::clone(hold_rq.sampler());

    let stop = Arc::new(AtomicBool::new(false));
    // Containers start and stop: every 150 ms one pod gets a new container and loses its
    // oldest when it has three.
    let churn = {
        let (pods, stop, program) = (pods.clone(), Arc::clone(&stop), program.clone());
        std::thread::spawn(move || {
            let mut i = 0usize;
            let mut changes = 0usize;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(mut pod) = pods[i % pods.len()].lock() {
                    if pod.start_container(&program).is_ok() {
                        changes += 1;
                    }
                    if pod.containers.len() > 3 {
                        pod.stop_oldest();
                        changes += 1;
                    }
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(150));
            }
            changes
        })
    };

    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..args.parallel)
        .map(|_| {
            let (samplers, next, done, outcomes, targets) = (
                Arc::clone(&samplers),
                Arc::clone(&next),
                Arc::clone(&done),
                Arc::clone(&outcomes),
                targets.clone(),
            );
            let total = args.captures;
            std::thread::spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let o = run_one(&samplers, i, &targets[i % targets.len()]);
                    if let Ok(mut all) = outcomes.lock() {
                        all.push(o);
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    // The curve is printed as it is taken (a long soak shows its progress).
    println!(
        "{:>6} {:>5} {:>8} | {:>4} {:>7} {:>7} {:>7} | {:>4} {:>6} {:>6}",
        "t(s)", "done", "RSS MiB", "cpuT", "counts", "kstacks", "ustacks", "rqT", "hists", "starts"
    );
    let mut curve = Vec::new();
    loop {
        let finished = workers.iter().all(std::thread::JoinHandle::is_finished);
        curve.push(Point {
            t: started.elapsed(),
            done: done.load(Ordering::Relaxed),
            rss_kib: rss_kib(),
            cpu: cpu_sampler.map_fill(),
            runqlat: rq_sampler.map_fill(),
        });
        if let Some(p) = curve.last() {
            print_point(p);
        }
        if finished {
            break;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    for w in workers {
        let _ = w.join();
    }
    stop.store(true, Ordering::Relaxed);
    let changes = churn.join().unwrap_or(0);
    drop(hold_cpu);
    drop(hold_rq);

    let mut outcomes = outcomes.lock().map(|o| o.clone()).unwrap_or_default();
    outcomes.sort_by_key(|o| o.index);
    println!(
        "soak: {} captures ({} at a time) in {:.0?}; {changes} container starts/stops",
        outcomes.len(),
        args.parallel,
        started.elapsed()
    );
    let errors: Vec<_> = outcomes.iter().filter(|o| o.error.is_some()).collect();
    let drops: u64 = outcomes.iter().map(|o| o.drops).sum();
    println!("errors: {}; drops (all captures): {drops}", errors.len());
    for e in errors.iter().take(5) {
        println!(
            "  capture {} ({:?}): {}",
            e.index,
            e.kind,
            e.error.as_deref().unwrap_or("")
        );
    }
    for kind in [Kind::Cpu, Kind::Runqlat, Kind::Heap] {
        let of: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| std::mem::discriminant(&o.kind) == std::mem::discriminant(&kind))
            .filter(|o| o.error.is_none())
            .collect();
        if let (Some(first), Some(last)) = (of.first(), of.last()) {
            println!(
                "{kind:?}: {} captures; first #{}: {} counted{}; last #{}: {} counted{}",
                of.len(),
                first.index,
                first.count,
                first.named_pct.map_or(String::new(), |p| format!(
                    ", {p:.1}% of samples in ff_soak_depth"
                )),
                last.index,
                last.count,
                last.named_pct.map_or(String::new(), |p| format!(
                    ", {p:.1}% of samples in ff_soak_depth"
                )),
            );
        }
    }
    if let (Some(first), Some(last)) = (curve.get(1).or(curve.first()), curve.last()) {
        println!(
            "RSS: {:.1} MiB after the first 2 s, {:.1} MiB at the end, {:.1} MiB at most",
            first.rss_kib as f64 / 1024.0,
            last.rss_kib as f64 / 1024.0,
            curve.iter().map(|p| p.rss_kib).max().unwrap_or(0) as f64 / 1024.0
        );
    }
    drop(pods);
    let _ = std::fs::remove_dir(&quiet_dir);
    let _ = std::fs::remove_dir(&root);
    Ok(())
}
