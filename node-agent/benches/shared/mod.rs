//! Helpers the agent's benchmarks share (not a benchmark itself: cargo only builds
//! `benches/*.rs` and `benches/*/main.rs`): C workloads, a cgroup of the benchmark's own,
//! `kernel.bpf_stats_enabled` readings, tracers run in the background, the median.
//!
//! Each benchmark includes this with `mod shared;` and uses what it needs.
#![allow(dead_code)]

use std::collections::HashMap;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};

/// Compiles C `source` into `dir/name` with frame pointers and debug info (what the
/// benchmarks' workloads need to be unwound and symbolized).
pub fn compile_c(dir: &Path, name: &str, source: &str) -> Result<PathBuf> {
    compile_c_with(dir, name, source, &["-O1", "-g", "-fno-omit-frame-pointer"])
}

/// Compiles C `source` into `dir/name` with the compiler flags `flags`.
pub fn compile_c_with(dir: &Path, name: &str, source: &str, flags: &[&str]) -> Result<PathBuf> {
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

/// Share (percent) of a profile's first sample value in samples whose stack has a function
/// whose name contains `needle`.
pub fn named_share(profile: &flamefleet_proto::pprof::Profile, needle: &str) -> f64 {
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let funcs: std::collections::HashSet<u64> = profile
        .function
        .iter()
        .filter(|f| s(f.name).contains(needle))
        .map(|f| f.id)
        .collect();
    let locs: std::collections::HashSet<u64> = profile
        .location
        .iter()
        .filter(|l| l.line.iter().any(|line| funcs.contains(&line.function_id)))
        .map(|l| l.id)
        .collect();
    let (mut named, mut total) = (0i64, 0i64);
    for sample in &profile.sample {
        let v = sample.value.first().copied().unwrap_or(0);
        total += v;
        if sample.location_id.iter().any(|l| locs.contains(l)) {
            named += v;
        }
    }
    if total == 0 {
        0.0
    } else {
        100.0 * named as f64 / total as f64
    }
}

/// The value after `flag` on the command line, parsed (`None` when absent or unparsable).
pub fn flag<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<T> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

/// The machine's load averages (1, 5 and 15 minutes, from `/proc/loadavg`), for the
/// figures' context.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

/// The median (upper of the two middle values); NaN for no values.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A cgroup the benchmark creates under the cgroup2 root and removes (killing what is left
/// in it) when dropped.
pub struct BenchCgroup(Cgroup);

impl BenchCgroup {
    pub fn new(name: &str) -> Result<Self> {
        let root = CgroupRoot::detect()?;
        let dir = root
            .path()
            .join(format!("flamefleet-bench-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self(Cgroup::open(&dir)?))
    }

    pub fn path(&self) -> &Path {
        &self.0.path
    }

    /// A command whose process joins this cgroup before exec.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(program);
        join_before_exec(&mut c, &self.0.path);
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

/// Makes the process of `cmd` join the cgroup at `dir` before exec.
pub fn join_before_exec(cmd: &mut Command, dir: &Path) {
    use std::os::unix::ffi::OsStrExt as _;
    let procs = std::ffi::CString::new(dir.join("cgroup.procs").as_os_str().as_bytes())
        .expect("no NUL in path");
    // SAFETY: async-signal-safe calls only, on memory prepared before fork.
    unsafe {
        cmd.pre_exec(move || {
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
}

/// Makes `cmd` start with SIGINT at its default action, so that [`interrupt`] ends it: a
/// benchmark started in the background by a non-interactive shell inherits SIGINT ignored,
/// which would make its tracers last forever.
pub fn sigint_ends(cmd: &mut Command) {
    // SAFETY: signal(2) between fork and exec, async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
}

/// SIGINT, then wait: tracers (perf, libbpf-tools, the agent) exit cleanly on it.
pub fn interrupt(child: &mut Child) {
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
}

/// `run_time_ns` and `run_cnt` of each loaded BPF program named in `names` (kernel names
/// are cut at 15 characters), by program ID (`kernel.bpf_stats_enabled` must be 1 for
/// them to count). Diff two readings with [`bpf_delta`].
pub fn bpf_stats(names: &[&str]) -> Result<HashMap<u64, (u64, u64)>> {
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

/// IDs of the loaded BPF programs named `name` whose file descriptors process `pid` holds
/// (from `/proc/<pid>/fdinfo`): one agent's own programs, where another process on the
/// machine (a test, another agent) may have loaded programs of the same name.
pub fn prog_ids_of(pid: u32, name: &str) -> Result<std::collections::HashSet<u64>> {
    let held = held_prog_ids(pid)?;
    Ok(bpf_stats(&[name])?
        .into_keys()
        .filter(|id| held.contains(id))
        .collect())
}

/// IDs of the BPF programs whose file descriptors process `pid` holds (from
/// `/proc/<pid>/fdinfo`).
pub fn held_prog_ids(pid: u32) -> Result<std::collections::HashSet<u64>> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .with_context(|| format!("listing /proc/{pid}/fdinfo"))?
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
        .filter_map(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("prog_id:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .collect())
}

/// [`bpf_stats`] of the programs named in `names` that this process loaded (holds), by
/// ID: the samplers of an in-process benchmark, not the programs of the same name that
/// tests, other agents or the cluster's agent load beside it. A sampler this process
/// keeps loaded but idle (the CPU sampler lingers after its last capture) is listed but
/// runs no more: its delta is zero.
pub fn own_bpf_stats(names: &[&str]) -> Result<HashMap<u64, (u64, u64)>> {
    let held = held_prog_ids(std::process::id())?;
    let mut stats = bpf_stats(names)?;
    stats.retain(|id, _| held.contains(id));
    Ok(stats)
}

/// (ns, runs) between two [`bpf_stats`] readings, over the programs present in both: a
/// tracer stopped just before the first reading may still be listed in it while its
/// programs unload.
pub fn bpf_delta(
    before: &HashMap<u64, (u64, u64)>,
    after: &HashMap<u64, (u64, u64)>,
) -> (u64, u64) {
    after
        .iter()
        .filter_map(|(id, &(ns1, c1))| {
            let &(ns0, c0) = before.get(id)?;
            Some((ns1.saturating_sub(ns0), c1.saturating_sub(c0)))
        })
        .fold((0, 0), |(ns, c), (dn, dc)| (ns + dn, c + dc))
}

/// `perf bench sched pipe -l loops` in `cg`: operations per second.
pub fn sched_pipe(cg: &BenchCgroup, loops: &str) -> Result<f64> {
    let out = cg
        .command("perf")
        .args(["bench", "sched", "pipe", "-l", loops])
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
pub fn sched_messaging(cg: &BenchCgroup) -> Result<()> {
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

/// One CPU capture of `target` at `hz` for `seconds`: (BPF run time ns of this process's
/// CPU sampler, its runs, samples of the target), from `kernel.bpf_stats_enabled`.
pub fn cpu_sample_window(
    samplers: &flamefleet_agent::capture::Samplers,
    target: flamefleet_agent::capture::CaptureTarget,
    hz: u64,
    seconds: u64,
) -> Result<(u64, u64, u64)> {
    let options = flamefleet_agent::capture::cpu::CpuOptions {
        frequency: hz,
        ..Default::default()
    };
    let capture = samplers.start_cpu(&[target], &options)?;
    let before = own_bpf_stats(&["on_cpu_sample"])?;
    std::thread::sleep(Duration::from_secs(seconds));
    let (ns, runs) = bpf_delta(&before, &own_bpf_stats(&["on_cpu_sample"])?);
    let result = capture.finish()?;
    Ok((ns, runs, result.total()))
}

/// A benchmark's workload: a cgroup of its own with (but for an idle one) one process,
/// killed on drop. Only the workload being measured should run: [`Workload::pause`] the
/// others (CPU burners on a 2-core VM would compete with it and load the machine).
pub struct Workload {
    pub name: String,
    pub cgroup: BenchCgroup,
    pub child: Option<Child>,
}

impl Workload {
    /// Starts `cmd` (none: an empty cgroup) in a new cgroup `<prefix>-<name>`; with `ready`,
    /// waits for its first output line to be `ready`.
    pub fn start(prefix: &str, name: &str, cmd: Option<Command>, ready: bool) -> Result<Self> {
        use std::io::BufRead as _;
        use std::process::Stdio;
        let cgroup = BenchCgroup::new(&format!("{prefix}-{name}"))?;
        let mut child = cmd
            .map(|c| {
                cgroup
                    .command(c.get_program())
                    .args(c.get_args())
                    .stdout(if ready { Stdio::piped() } else { Stdio::null() })
                    .spawn()
                    .context("starting the workload")
            })
            .transpose()?;
        if let Some(out) = child.as_mut().and_then(|c| c.stdout.take()) {
            let mut line = String::new();
            std::io::BufReader::new(out)
                .read_line(&mut line)
                .context("reading the workload's ready line")?;
            if line.trim() != "ready" {
                bail!("{name}: expected its ready line, read {line:?}");
            }
        }
        Ok(Self {
            name: name.to_owned(),
            cgroup,
            child,
        })
    }

    /// Its process (0: none).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Its cgroup as a capture target.
    pub fn target(&self) -> Result<flamefleet_agent::capture::CaptureTarget> {
        Ok(flamefleet_agent::capture::CaptureTarget::raw(Cgroup::open(
            self.cgroup.path(),
        )?))
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: plain kill(2) on our own child, not yet reaped.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// Stops (`SIGSTOP`) its process, if any.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Continues (`SIGCONT`) its process, if any.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Kills its process, if any.
    pub fn stop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// One CPU capture window at `hz` with only this workload running (paused again
    /// after): (run time ns, program runs, samples of the target).
    pub fn cpu_window(
        &self,
        samplers: &flamefleet_agent::capture::Samplers,
        hz: u64,
        seconds: u64,
    ) -> Result<(u64, u64, u64)> {
        self.resume();
        let r = cpu_sample_window(samplers, self.target()?, hz, seconds);
        self.pause();
        r
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        self.stop();
    }
}
