//! What watching pods for triggers costs the agent, against polling the same files
//! (not a test: it prints, never asserts).
//!
//! ```text
//! cargo bench -p flamefleet-agent --bench trigger_cost -- [--cgroups 100] [--seconds 30]
//! ```
//!
//! Creates N cgroups with a memory limit and a CPU quota (v2, or the v1 hierarchies of a
//! hybrid host), one idle process in each, and watches every one with the triggers a
//! policy would set: memory above 90% of the limit, an `oom_kill` event, CPU throttled in
//! 50% of periods, CPU above 1 core for 60 s, memory pressure above 40%. Then, for the same
//! time each, measures:
//!
//! - *watcher*: the agent's watcher (`trigger::Watcher`, default configuration: 1 s tick);
//! - *poll 100 ms*: the peer, a loop reading every file the conditions depend on every
//!   100 ms (what watching costs without the kernel's notifications, at a latency the
//!   memory race needs — still slower than the watcher's notifications);
//! - *watcher + latency*: the watcher again, each cgroup with a sixth trigger, runqlat p99
//!   above 20 ms over 10 s: the node's runqlat sampler loaded with the cgroups as its
//!   targets. Besides the watcher thread, its BPF program's own cost: run time and runs of
//!   the programs it loaded, with the kernel's BPF statistics on for the row
//!   (`BPF_ENABLE_STATS`, what `sysctl kernel.bpf_stats_enabled=1` turns on; `bpftool prog
//!   show` prints the same `run_time_ns`/`run_cnt`). Every context switch of the node runs
//!   it, the watched cgroups' and everyone else's; `--wakers N` makes N of the cgroups'
//!   processes wake every millisecond, so that some switches are the watched pods' own.
//!
//! CPU is the thread's own on-CPU time (`/proc/self/task/<tid>/schedstat`); memory is the
//! process's RSS growth from before the cgroups were watched.

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};
use flamefleet_agent::trigger::files::Hierarchies;
use flamefleet_agent::trigger::{
    Condition, MemoryEvent, PsiResource, TriggerSpec, WatchTarget, Watcher, WatcherConfig,
};

fn flag(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A limited cgroup with one idle process; removed on drop.
struct Watched {
    cgroup: Cgroup,
    dirs: Vec<PathBuf>,
    child: Child,
}

impl Watched {
    fn new(root: &CgroupRoot, h: &Hierarchies, i: u64, waker: bool) -> Result<Self> {
        let rel = format!("flamefleet-bench-trigger-{}-{i}", std::process::id());
        let dir = root.path().join(&rel);
        std::fs::create_dir(&dir).with_context(|| dir.display().to_string())?;
        let controllers =
            std::fs::read_to_string(root.path().join("cgroup.controllers")).unwrap_or_default();
        let mut dirs = vec![dir.clone()];
        if controllers.contains("memory") && controllers.contains("cpu") {
            std::fs::write(root.path().join("cgroup.subtree_control"), "+memory +cpu")?;
            std::fs::write(dir.join("memory.max"), "268435456")?;
            std::fs::write(dir.join("cpu.max"), "50000 100000")?;
        } else {
            let (Some(mem), Some(cpu)) = (&h.v1_memory, &h.v1_cpu) else {
                bail!("no memory and cpu controllers in cgroup v2 nor v1 hierarchies");
            };
            let m = mem.join(&rel);
            let c = cpu.join(&rel);
            std::fs::create_dir(&m)?;
            std::fs::create_dir(&c)?;
            std::fs::write(m.join("memory.limit_in_bytes"), "268435456")?;
            std::fs::write(c.join("cpu.cfs_quota_us"), "50000")?;
            dirs.push(m);
            dirs.push(c);
        }
        let procs: Vec<std::ffi::CString> = dirs
            .iter()
            .map(|d| {
                use std::os::unix::ffi::OsStrExt as _;
                std::ffi::CString::new(d.join("cgroup.procs").as_os_str().as_bytes())
                    .expect("no NUL")
            })
            .collect();
        let mut cmd = if waker {
            // Wakes every millisecond: a run-queue wait per wakeup.
            let mut c = Command::new("perl");
            c.args(["-e", "select(undef,undef,undef,0.001) while 1"]);
            c
        } else {
            let mut c = Command::new("sleep");
            c.arg("3600");
            c
        };
        cmd.stdout(Stdio::null());
        // SAFETY: only open/write/close between fork and exec, on memory made before.
        unsafe {
            cmd.pre_exec(move || {
                for p in &procs {
                    let fd = libc::open(p.as_ptr(), libc::O_WRONLY);
                    if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    libc::close(fd);
                }
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        Ok(Self {
            cgroup: Cgroup::open(&dir)?,
            dirs,
            child,
        })
    }

    /// The files the conditions depend on, for the polling peer.
    fn files(&self) -> Vec<PathBuf> {
        let mut out = vec![
            self.cgroup.path.join("cpu.stat"),
            self.cgroup.path.join("memory.pressure"),
        ];
        if self.dirs.len() > 1 {
            out.extend([
                self.dirs[1].join("memory.usage_in_bytes"),
                self.dirs[1].join("memory.limit_in_bytes"),
                self.dirs[1].join("memory.oom_control"),
                self.dirs[2].join("cpu.stat"),
            ]);
        } else {
            out.extend([
                self.cgroup.path.join("memory.current"),
                self.cgroup.path.join("memory.max"),
                self.cgroup.path.join("memory.events"),
            ]);
        }
        out
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for d in self.dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

fn latency_trigger() -> TriggerSpec {
    TriggerSpec {
        name: "waiting-to-run".into(),
        condition: Condition::RunqlatP99 {
            micros: 20_000,
            window: Duration::from_secs(10),
        },
        cooldown: Duration::from_secs(600),
    }
}

/// (run time, runs) of the BPF programs whose IDs are in `ids`.
fn prog_stats(ids: &[u32]) -> (Duration, u64) {
    libbpf_rs::query::ProgInfoIter::default()
        .filter(|p| ids.contains(&p.id))
        .fold((Duration::ZERO, 0), |(t, n), p| {
            (t + Duration::from_nanos(p.run_time_ns), n + p.run_cnt)
        })
}

fn prog_ids() -> Vec<(u32, String)> {
    libbpf_rs::query::ProgInfoIter::default()
        .map(|p| (p.id, p.name.to_string_lossy().into_owned()))
        .collect()
}

/// Context switches of the node so far (`ctxt` of /proc/stat).
fn node_switches() -> u64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("ctxt "))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn triggers() -> Vec<TriggerSpec> {
    let spec = |name: &str, condition| TriggerSpec {
        name: name.into(),
        condition,
        cooldown: Duration::from_secs(600),
    };
    vec![
        spec("near-limit", Condition::MemoryAboveLimit { percent: 90 }),
        spec("oom-kill", Condition::MemoryEvent(MemoryEvent::OomKill)),
        spec("throttled", Condition::CpuThrottled { percent: 50 }),
        spec(
            "busy",
            Condition::CpuAbove {
                millicores: 1000,
                sustained: Duration::from_secs(60),
            },
        ),
        spec(
            "stalled",
            Condition::Pressure {
                resource: PsiResource::Memory,
                percent: 40,
            },
        ),
    ]
}

/// On-CPU time of this process's thread named `comm`, from its schedstat.
fn thread_cpu(comm: &str) -> Result<Duration> {
    for entry in std::fs::read_dir("/proc/self/task")? {
        let dir = entry?.path();
        if std::fs::read_to_string(dir.join("comm"))?.trim() == comm {
            let stat = std::fs::read_to_string(dir.join("schedstat"))?;
            let ns: u64 = stat
                .split_whitespace()
                .next()
                .and_then(|v| v.parse().ok())
                .context("schedstat")?;
            return Ok(Duration::from_nanos(ns));
        }
    }
    bail!("no thread named {comm}")
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn poll_peer(files: Vec<PathBuf>, stop: Instant) -> u64 {
    use std::os::unix::fs::FileExt as _;
    let open: Vec<std::fs::File> = files
        .iter()
        .filter_map(|p| std::fs::File::open(p).ok())
        .collect();
    let mut buf = [0u8; 4096];
    let mut reads = 0;
    while Instant::now() < stop {
        for f in &open {
            if f.read_at(&mut buf, 0).is_ok() {
                reads += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    reads
}

fn main() -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("creates cgroups: run as root");
    }
    let n = flag("--cgroups", 100);
    let secs = flag("--seconds", 30);
    let wakers = flag("--wakers", 10);
    let root = CgroupRoot::detect()?;
    let h = Hierarchies::detect(&root);
    let rss0 = rss_kib();
    let cgroups: Vec<Watched> = (0..n)
        .map(|i| Watched::new(&root, &h, i, i < wakers))
        .collect::<Result<_>>()?;

    // The watcher.
    let rss1 = rss_kib();
    let fds0 = open_fds();
    let (watcher, _fires) = Watcher::start(h.clone(), WatcherConfig::default())?;
    for (i, c) in cgroups.iter().enumerate() {
        watcher.watch(WatchTarget {
            key: format!("bench/pod-{i}/app"),
            cgroup: c.cgroup.clone(),
            triggers: triggers(),
        })?;
    }
    let rss2 = rss_kib();
    let fds1 = open_fds();
    let cpu0 = thread_cpu("trigger-watch")?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let cpu1 = thread_cpu("trigger-watch")?;
    let wall = t0.elapsed();
    let stats = watcher.stats();
    drop(watcher);

    // The peer: poll every file every 100 ms on a thread of its own.
    let files: Vec<PathBuf> = cgroups.iter().flat_map(Watched::files).collect();
    let stop = Instant::now() + Duration::from_secs(secs);
    let peer = std::thread::Builder::new()
        .name("poll-peer".into())
        .spawn(move || poll_peer(files, stop))?;
    std::thread::sleep(Duration::from_millis(200));
    let p0 = thread_cpu("poll-peer")?;
    let p_t0 = Instant::now();
    while Instant::now() + Duration::from_millis(150) < stop {
        std::thread::sleep(Duration::from_millis(100));
    }
    let p1 = thread_cpu("poll-peer")?;
    let p_wall = p_t0.elapsed();
    let peer_reads = peer.join().unwrap_or(0);

    // The watcher with a latency trigger on every cgroup: the runqlat sampler loaded.
    let samplers = std::sync::Arc::new(flamefleet_agent::capture::Samplers::new(
        flamefleet_agent::capture::SamplerConfig::default(),
    ));
    let before: Vec<u32> = prog_ids().into_iter().map(|(id, _)| id).collect();
    let rss3 = rss_kib();
    let (watcher, _fires) = Watcher::start_with_samplers(
        h.clone(),
        WatcherConfig::default(),
        Some(std::sync::Arc::clone(&samplers)),
    )?;
    let load_t0 = Instant::now();
    for (i, c) in cgroups.iter().enumerate() {
        let mut t = triggers();
        t.push(latency_trigger());
        watcher.watch(WatchTarget {
            key: format!("bench/pod-{i}/app"),
            cgroup: c.cgroup.clone(),
            triggers: t,
        })?;
    }
    let watch_all = load_t0.elapsed();
    let rss4 = rss_kib();
    let ours: Vec<(u32, String)> = prog_ids()
        .into_iter()
        .filter(|(id, _)| !before.contains(id))
        .collect();
    let ids: Vec<u32> = ours.iter().map(|(id, _)| *id).collect();
    // SAFETY: no pointers; the returned descriptor keeps the statistics on until closed.
    let stats_fd = unsafe {
        libbpf_rs::libbpf_sys::bpf_enable_stats(libbpf_rs::libbpf_sys::BPF_STATS_RUN_TIME)
    };
    if stats_fd < 0 {
        bail!(
            "BPF_ENABLE_STATS failed ({}); run as root on Linux ≥ 5.8",
            std::io::Error::last_os_error()
        );
    }
    let (b0, r0) = prog_stats(&ids);
    let s0 = node_switches();
    let l0 = thread_cpu("trigger-watch")?;
    let l_t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let l1 = thread_cpu("trigger-watch")?;
    let s1 = node_switches();
    let (b1, r1) = prog_stats(&ids);
    let l_wall = l_t0.elapsed();
    // SAFETY: our own descriptor, closed once.
    unsafe { libc::close(stats_fd) };
    let l_stats = watcher.stats();
    drop(watcher);
    drop(samplers);

    let pct = |cpu: Duration, wall: Duration| cpu.as_secs_f64() * 100.0 / wall.as_secs_f64();
    println!(
        "trigger watching cost, {n} cgroups, {} triggers each ({}), {secs} s per row",
        triggers().len(),
        if h.v1_memory.is_some() {
            "hybrid host: v1 memory and cpu"
        } else {
            "cgroup v2"
        }
    );
    println!("| what | CPU (% of one core) | CPU per cgroup (µs/s) | reads |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| watcher (1 s tick, notifications) | {:.3}% | {:.1} | {} |",
        pct(cpu1 - cpu0, wall),
        (cpu1 - cpu0).as_secs_f64() * 1e6 / wall.as_secs_f64() / n as f64,
        stats.reads
    );
    println!(
        "| peer: poll every file every 100 ms | {:.3}% | {:.1} | {} |",
        pct(p1 - p0, p_wall),
        (p1 - p0).as_secs_f64() * 1e6 / p_wall.as_secs_f64() / n as f64,
        peer_reads
    );
    let (bpf, runs) = (b1.saturating_sub(b0), r1.saturating_sub(r0));
    println!(
        "| watcher + runqlat p99 trigger (1 s tick) | {:.3}% | {:.1} | {} |",
        pct(l1 - l0, l_wall),
        (l1 - l0).as_secs_f64() * 1e6 / l_wall.as_secs_f64() / n as f64,
        l_stats.reads
    );
    println!(
        "| its BPF (sched_switch, every switch of the node) | {:.3}% | {:.1} | {runs} runs |",
        pct(bpf, l_wall),
        bpf.as_secs_f64() * 1e6 / l_wall.as_secs_f64() / n as f64,
    );
    println!(
        "runqlat BPF: {:.0} ns per run ({} runs, {:.0} context switches/s on the node, {wakers} \
         of the {n} cgroups waking every 1 ms); programs {:?}; watching {n} cgroups with it took \
         {:.2} s (sampler load included); RSS +{} KiB ({:.1} KiB per cgroup, watcher and sampler)",
        if runs > 0 {
            bpf.as_nanos() as f64 / runs as f64
        } else {
            0.0
        },
        runs,
        s1.saturating_sub(s0) as f64 / l_wall.as_secs_f64(),
        ours,
        watch_all.as_secs_f64(),
        rss4.saturating_sub(rss3),
        rss4.saturating_sub(rss3) as f64 / n as f64,
    );
    println!(
        "watcher memory: RSS +{} KiB for {n} cgroups ({:.1} KiB each; cgroups and processes \
         made before: +{} KiB); psi fallbacks {}, wakeups {}, fires {}",
        rss2.saturating_sub(rss1),
        rss2.saturating_sub(rss1) as f64 / n as f64,
        rss1.saturating_sub(rss0),
        stats.psi_fallbacks,
        stats.wakeups,
        stats.fires
    );
    println!(
        "descriptors: {fds0} before the watcher, {fds1} while it watched ({:.1} per cgroup)",
        fds1.saturating_sub(fds0) as f64 / n as f64
    );
    drop(cgroups);
    Ok(())
}
