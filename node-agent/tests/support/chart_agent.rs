//! `flamefleet-agent capture` run the way the chart runs the agent: only the chart's
//! capabilities (`agent.capabilities`, dropped from the bounding set before exec), in a
//! memory cgroup of its own limited to the chart's `agent.resources.limits.memory`, with a
//! deadline. For the hostile-workload tests: whatever a workload does, the agent must end
//! on time, within that memory, with a clear message.

use std::io::Read as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// What the chart gives the agent.
#[derive(Debug, Clone)]
pub struct ChartLimits {
    /// `agent.resources.limits.memory`, in bytes.
    pub memory: u64,
    /// `agent.capabilities`, as capability numbers.
    pub capabilities: Vec<u32>,
}

/// Capability numbers by name (linux/capability.h).
fn capability_number(name: &str) -> u32 {
    match name {
        "CHOWN" => 0,
        "DAC_OVERRIDE" => 1,
        "DAC_READ_SEARCH" => 2,
        "FOWNER" => 3,
        "KILL" => 5,
        "SETGID" => 6,
        "SETUID" => 7,
        "NET_ADMIN" => 12,
        "NET_RAW" => 13,
        "SYS_CHROOT" => 18,
        "SYS_PTRACE" => 19,
        "SYS_ADMIN" => 21,
        "SYS_RESOURCE" => 24,
        "SYSLOG" => 34,
        "PERFMON" => 38,
        "BPF" => 39,
        "CHECKPOINT_RESTORE" => 40,
        other => panic!("capability {other} of the chart is not in the test's table: add it"),
    }
}

/// Reads the agent's limits from `charts/flamefleet/values.yaml`, so the tests follow the
/// chart.
pub fn chart_limits() -> ChartLimits {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/flamefleet/values.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let values: serde_yaml::Value = serde_yaml::from_str(&text).expect("values.yaml parses");
    let agent = &values["agent"];
    let memory = agent["resources"]["limits"]["memory"]
        .as_str()
        .expect("agent.resources.limits.memory in values.yaml");
    let memory = parse_quantity(memory);
    let capabilities = agent["capabilities"]
        .as_sequence()
        .expect("agent.capabilities in values.yaml")
        .iter()
        .map(|c| capability_number(c.as_str().expect("capability names")))
        .collect();
    ChartLimits {
        memory,
        capabilities,
    }
}

fn parse_quantity(q: &str) -> u64 {
    let (n, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let n: u64 = n.parse().expect("a memory quantity");
    n * match unit {
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "" => 1,
        other => panic!("memory unit {other} not handled"),
    }
}

/// How an agent run ended.
#[derive(Debug)]
pub struct AgentRun {
    /// Exit code, when it exited.
    pub code: Option<i32>,
    /// Signal that ended it, when one did.
    pub signal: Option<i32>,
    /// Killed by this harness at the deadline.
    pub timed_out: bool,
    /// The memory cgroup's OOM killer killed something in it.
    pub oom_killed: bool,
    /// Peak resident set of the agent process (`ru_maxrss`), in bytes.
    pub peak_rss: u64,
    /// Peak memory of its cgroup (page cache included), in bytes.
    pub cgroup_peak: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Its output.
    pub stdout: String,
    /// Its messages.
    pub stderr: String,
}

impl AgentRun {
    /// Whether it exited by itself with status 0.
    pub fn succeeded(&self) -> bool {
        self.code == Some(0)
    }

    /// A one-line account for assertion messages and the test log.
    pub fn summary(&self) -> String {
        format!(
            "exit {:?}, signal {:?}, timed out {}, OOM-killed {}, peak RSS {:.1} MiB, cgroup \
             peak {:.1} MiB, {:.1} s; stderr: {}",
            self.code,
            self.signal,
            self.timed_out,
            self.oom_killed,
            self.peak_rss as f64 / (1 << 20) as f64,
            self.cgroup_peak as f64 / (1 << 20) as f64,
            self.elapsed.as_secs_f64(),
            self.stderr.trim()
        )
    }
}

/// A memory cgroup of its own (cgroup v1's memory hierarchy where the host has one, else
/// the unified one), removed on drop.
struct MemoryCgroup {
    dir: PathBuf,
    v1: bool,
}

impl MemoryCgroup {
    fn new(limit: u64) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "flamefleet-test-agent-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let v1_root = Path::new("/sys/fs/cgroup/memory");
        let (dir, v1) = if v1_root.join("memory.limit_in_bytes").exists() {
            (v1_root.join(&name), true)
        } else {
            let root = flamefleet_agent::cgroup::CgroupRoot::detect().expect("a cgroup2 mount");
            let controllers = std::fs::read_to_string(root.path().join("cgroup.subtree_control"))
                .unwrap_or_default();
            assert!(
                controllers.contains("memory"),
                "no memory controller: expected cgroup v1's memory hierarchy at \
                 /sys/fs/cgroup/memory or `memory` in {}/cgroup.subtree_control",
                root.path().display()
            );
            (root.path().join(&name), false)
        };
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let cg = Self { dir, v1 };
        if v1 {
            cg.write("memory.limit_in_bytes", &limit.to_string());
            // Without swap accounting the limit is on memory alone, which is what we want.
            let _ = std::fs::write(
                cg.dir.join("memory.memsw.limit_in_bytes"),
                limit.to_string(),
            );
        } else {
            cg.write("memory.max", &limit.to_string());
            let _ = std::fs::write(cg.dir.join("memory.swap.max"), "0");
        }
        cg
    }

    fn write(&self, file: &str, value: &str) {
        std::fs::write(self.dir.join(file), value)
            .unwrap_or_else(|e| panic!("writing {value} to {}/{file}: {e}", self.dir.display()));
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.join(file)).unwrap_or_default()
    }

    fn peak(&self) -> u64 {
        let file = if self.v1 {
            "memory.max_usage_in_bytes"
        } else {
            "memory.peak"
        };
        self.read(file).trim().parse().unwrap_or(0)
    }

    fn oom_kills(&self) -> u64 {
        let file = if self.v1 {
            "memory.oom_control"
        } else {
            "memory.events"
        };
        self.read(file)
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Runs `flamefleet-agent capture ARGS` as the chart runs the agent, killing it at
/// `deadline`.
pub fn capture(args: &[&str], deadline: Duration) -> AgentRun {
    start(args).wait(deadline)
}

/// A running `flamefleet-agent capture`.
pub struct RunningAgent {
    /// Its PID.
    pub pid: u32,
    memcg: MemoryCgroup,
    started: Instant,
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
    /// Lines of its stderr as they come.
    pub stderr_lines: std::sync::mpsc::Receiver<String>,
}

/// Starts `flamefleet-agent capture ARGS` as the chart runs the agent.
pub fn start(args: &[&str]) -> RunningAgent {
    let limits = chart_limits();
    let memcg = MemoryCgroup::new(limits.memory);
    let procs = std::ffi::CString::new(
        memcg
            .dir
            .join("cgroup.procs")
            .to_str()
            .expect("UTF-8 cgroup path"),
    )
    .expect("no NUL");
    let keep = limits.capabilities.clone();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_flamefleet-agent"));
    cmd.arg("capture")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: between fork and exec only async-signal-safe calls (open, write, close,
    // prctl) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
            libc::close(fd);
            if !ok {
                return Err(std::io::Error::last_os_error());
            }
            // Root keeps after exec exactly the capabilities of its bounding set.
            for cap in 0..=40u32 {
                if !keep.contains(&cap)
                    && libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) != 0
                    && *libc::__errno_location() != libc::EINVAL
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let started = Instant::now();
    let mut child = cmd.spawn().expect("starting flamefleet-agent capture");
    let pid = child.id();
    let mut stdout = child.stdout.take().expect("stdout");
    let out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let stderr = child.stderr.take().expect("stderr");
    let (tx, stderr_lines) = std::sync::mpsc::channel();
    let err = std::thread::spawn(move || {
        use std::io::BufRead as _;
        let mut all = String::new();
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    // Reaped below with wait4 (for its rusage), not through `child`.
    drop(child);
    RunningAgent {
        pid,
        memcg,
        started,
        out,
        err,
        stderr_lines,
    }
}

impl RunningAgent {
    /// Waits for the agent to end, killing it at `deadline` after its start.
    pub fn wait(self, deadline: Duration) -> AgentRun {
        let pid = self.pid as libc::pid_t;
        let mut status = 0;
        // SAFETY: rusage is plain data.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let mut timed_out = false;
        loop {
            // SAFETY: our own child; status and usage are valid out-pointers.
            let r = unsafe { libc::wait4(pid, &raw mut status, libc::WNOHANG, &raw mut usage) };
            if r == pid {
                break;
            }
            assert!(r >= 0, "wait4: {}", std::io::Error::last_os_error());
            if self.started.elapsed() > deadline && !timed_out {
                timed_out = true;
                // SAFETY: signalling our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            // The process's exit is what this waits for; there is no other event to wait
            // on with a deadline.
            std::thread::sleep(Duration::from_millis(10));
        }
        let elapsed = self.started.elapsed();
        let run = AgentRun {
            code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
            signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
            timed_out,
            oom_killed: self.memcg.oom_kills() > 0,
            peak_rss: usage.ru_maxrss as u64 * 1024,
            cgroup_peak: self.memcg.peak(),
            elapsed,
            stdout: self.out.join().unwrap_or_default(),
            stderr: self.err.join().unwrap_or_default(),
        };
        eprintln!("agent: {}", run.summary());
        run
    }

    /// Waits for a line of its stderr containing `needle` (panics after `deadline` or
    /// when it closes stderr first).
    pub fn wait_for_stderr(&self, needle: &str, deadline: Duration) -> String {
        let end = Instant::now() + deadline;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.stderr_lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(e) => panic!("no stderr line with {needle:?} from the agent: {e}"),
            }
        }
    }
}
