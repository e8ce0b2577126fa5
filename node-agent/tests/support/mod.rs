//! Fixtures for the kernel tests: root check, cgroups the test creates and
//! removes, C workloads compiled with frame pointers, and `go tool pprof`.
//!
//! Each test binary includes this with `mod support;` and uses what it needs.
#![allow(dead_code)]

pub mod chart_agent;
pub mod go;

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};

/// Serializes CPU-share- and timing-sensitive tests of one binary (2 cores).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Fails (never skips) when not root: CI runs these as root.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests load eBPF programs and create cgroups: expected to run as root, found uid {}; run `cargo test` as root or scripts/test.sh",
        nix::unistd::geteuid()
    );
}

/// A cgroup v2 directory created under the detected root, removed on drop
/// (after killing what still runs in it).
pub struct TestCgroup {
    pub cgroup: Cgroup,
    children: Vec<Child>,
}

impl TestCgroup {
    /// Creates `<root>/flamefleet-test-<name>-<pid>-<n>`.
    pub fn new(name: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let root = CgroupRoot::detect().expect("a cgroup2 mount");
        let dir = root.path().join(format!(
            "flamefleet-test-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir)
            .unwrap_or_else(|e| panic!("creating cgroup {}: {e}", dir.display()));
        Self {
            cgroup: Cgroup::open(&dir).expect("open test cgroup"),
            children: Vec::new(),
        }
    }

    /// Manages an existing cgroup (e.g. a child made with create_dir).
    pub fn adopt(cgroup: Cgroup) -> Self {
        Self {
            cgroup,
            children: Vec::new(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.cgroup.path
    }

    /// Spawns `cmd` inside this cgroup (the child moves itself before exec).
    pub fn spawn(&mut self, cmd: &mut Command) -> u32 {
        cmd.stdout(Stdio::null());
        self.spawn_keeping_stdout(cmd)
    }

    /// Like [`Self::spawn`] with stdout piped; returns the pid and stdout
    /// (e.g. to wait for a workload's ready line).
    pub fn spawn_piped(&mut self, cmd: &mut Command) -> (u32, std::process::ChildStdout) {
        cmd.stdout(Stdio::piped());
        let pid = self.spawn_keeping_stdout(cmd);
        let stdout = self
            .children
            .last_mut()
            .and_then(|c| c.stdout.take())
            .expect("piped stdout");
        (pid, stdout)
    }

    /// The stdin of child `pid`, when it was spawned with `Stdio::piped()`.
    pub fn take_stdin(&mut self, pid: u32) -> Option<std::process::ChildStdin> {
        self.children
            .iter_mut()
            .find(|c| c.id() == pid)
            .and_then(|c| c.stdin.take())
    }

    fn spawn_keeping_stdout(&mut self, cmd: &mut Command) -> u32 {
        use std::os::unix::ffi::OsStrExt as _;
        let procs =
            std::ffi::CString::new(self.cgroup.path.join("cgroup.procs").as_os_str().as_bytes())
                .expect("path without NUL");
        // SAFETY: between fork and exec only async-signal-safe calls
        // (prctl/open/write/close) on memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                // A test binary killed mid-test runs no Drop: the workload must not go on
                // burning a CPU for the tests that follow.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
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
        let child = cmd
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Total CPU time used by the cgroup so far (cpu.stat usage_usec).
    pub fn cpu_usage(&self) -> Duration {
        let text = std::fs::read_to_string(self.cgroup.path.join("cpu.stat")).expect("cpu.stat");
        let usec = text
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))
            .and_then(|v| v.trim().parse().ok())
            .expect("usage_usec in cpu.stat");
        Duration::from_micros(usec)
    }

    /// Waits until the cgroup's processes have used `amount` more CPU time
    /// than now, so a test's window holds a known amount of work whatever the
    /// machine's load (wall-clock sleeps do not: on a busy 2-core machine a
    /// spinner may get a tenth of a CPU). Panics after a minute.
    pub fn wait_cpu(&self, amount: Duration) {
        let start = self.cpu_usage();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while self.cpu_usage() - start < amount {
            assert!(
                std::time::Instant::now() < deadline,
                "{} used less than {amount:?} of CPU in a minute",
                self.path().display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills every process of the cgroup.
    pub fn kill_all(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
        // Descendants (e.g. spawned by a shell loop).
        let _ = std::fs::write(self.cgroup.path.join("cgroup.kill"), b"1");
        for _ in 0..100 {
            if self.cgroup.procs().map(|p| p.is_empty()).unwrap_or(true) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        self.kill_all();
        for _ in 0..50 {
            if std::fs::remove_dir(&self.cgroup.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Times `pid` has been switched in so far (/proc/PID/schedstat, third field).
pub fn switches(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().nth(2)?.parse().ok())
        .unwrap_or(0)
}

/// Waits until `pid` has been switched in `n` more times (each one ends a
/// run-queue wait), so a runqlat window holds a known number of events
/// whatever the load. Panics after a minute.
pub fn wait_switches(pid: u32, n: u64) {
    let start = switches(pid);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while switches(pid) < start + n {
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} was switched in fewer than {n} times in a minute"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `done` every 20 ms until it holds; panics, naming `what`, after a minute.
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "waited a minute for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Compiles a C workload with frame pointers (BPF walks stacks by them).
pub fn compile_c(dir: &Path, name: &str, source: &str) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    let bin = dir.join(name);
    std::fs::write(&src, source).expect("write C source");
    let out = Command::new("cc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("running cc (install gcc)");
    assert!(
        out.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

/// `go tool pprof`, or the pprof binary `FLAMEFLEET_PPROF` names: Go builds its pprof on
/// first use, which under QEMU without KVM takes minutes, so the guest tier
/// (`tests/kernels.rs`) passes the host's.
pub fn pprof() -> Command {
    match std::env::var_os("FLAMEFLEET_PPROF") {
        Some(bin) => Command::new(bin),
        None => {
            let mut c = Command::new("go");
            c.args(["tool", "pprof"]);
            c
        }
    }
}

/// `go tool pprof -top` of a file (plus extra flags); panics when go fails.
pub fn pprof_top(file: &Path, extra: &[&str]) -> String {
    let out = pprof()
        .arg("-top")
        .args(extra)
        .arg(file)
        .output()
        .expect("running `go tool pprof` (install Go)");
    assert!(
        out.status.success(),
        "go tool pprof failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A command pinned to one CPU with taskset.
pub fn pinned(cpu: u32, program: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("taskset");
    c.arg("-c").arg(cpu.to_string()).arg(program).args(args);
    c
}

/// Per-sample view of a decoded profile, for assertions.
pub struct Decoded {
    pub profile: flamefleet_proto::pprof::Profile,
}

impl Decoded {
    pub fn read(path: &Path) -> Self {
        let bytes = std::fs::read(path).expect("read profile");
        Self {
            profile: flamefleet_agent::pprof::decode(&bytes).expect("valid pprof"),
        }
    }

    pub fn string(&self, i: i64) -> &str {
        &self.profile.string_table[i as usize]
    }

    /// String label `key` of a sample.
    pub fn label<'a>(
        &'a self,
        s: &'a flamefleet_proto::pprof::Sample,
        key: &str,
    ) -> Option<&'a str> {
        s.label
            .iter()
            .find(|l| self.string(l.key) == key && l.str != 0)
            .map(|l| self.string(l.str))
    }

    /// Numeric label `key` of a sample.
    pub fn num_label(&self, s: &flamefleet_proto::pprof::Sample, key: &str) -> Option<i64> {
        s.label
            .iter()
            .find(|l| self.string(l.key) == key && l.str == 0)
            .map(|l| l.num)
    }

    /// Function names of a location, innermost first.
    pub fn functions(&self, location_id: u64) -> Vec<&str> {
        let loc = self
            .profile
            .location
            .iter()
            .find(|l| l.id == location_id)
            .expect("location");
        loc.line
            .iter()
            .map(|line| {
                let f = self
                    .profile
                    .function
                    .iter()
                    .find(|f| f.id == line.function_id)
                    .expect("function");
                self.string(f.name)
            })
            .collect()
    }

    /// Whether a location belongs to the kernel pseudo-mapping.
    pub fn is_kernel(&self, location_id: u64) -> bool {
        let loc = self
            .profile
            .location
            .iter()
            .find(|l| l.id == location_id)
            .expect("location");
        self.profile
            .mapping
            .iter()
            .find(|m| m.id == loc.mapping_id)
            .is_some_and(|m| self.string(m.filename) == flamefleet_agent::symbolize::KERNEL_MAPPING)
    }

    /// Leaf user-space location of a sample (skipping kernel frames).
    pub fn user_leaf(&self, s: &flamefleet_proto::pprof::Sample) -> Option<u64> {
        s.location_id
            .iter()
            .copied()
            .find(|&id| !self.is_kernel(id))
    }
}

/// The agent's capabilities as the chart grants them by default (`agent.capabilities` in
/// charts/flamefleet/values.yaml, and SYSLOG with `agent.kernelSymbols: true`), as
/// capability numbers.
pub fn chart_capabilities() -> Vec<u32> {
    let values = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/flamefleet/values.yaml"
    );
    let text = std::fs::read_to_string(values).expect("reading the chart's values.yaml");
    let list = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("capabilities: ["))
        .and_then(|l| l.split(']').next())
        .expect("agent.capabilities as a one-line list in values.yaml");
    let mut caps: Vec<u32> = list
        .split(',')
        .map(|name| match name.trim() {
            "DAC_READ_SEARCH" => 2,
            "SYS_PTRACE" => 19,
            "SYS_ADMIN" => 21,
            "SYS_RESOURCE" => 24,
            "SYSLOG" => 34,
            "PERFMON" => 38,
            "BPF" => 39,
            other => panic!("capability {other} in values.yaml: add its number here"),
        })
        .collect();
    let kernel_symbols = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("kernelSymbols:"))
        .map(|v| v.split('#').next().unwrap_or_default().trim())
        .expect("agent.kernelSymbols in values.yaml");
    if kernel_symbols == "true" && !caps.contains(&SYSLOG) {
        caps.push(SYSLOG);
    }
    caps
}

/// `CAP_SYSLOG`.
pub const SYSLOG: u32 = 34;

/// Makes `cmd` run with no capability but `keep`, as a container that drops ALL and adds
/// `keep` runs (root's exec takes its capabilities from the bounding set).
pub fn with_only_capabilities(cmd: &mut Command, keep: &[u32]) {
    let keep = keep.to_vec();
    // SAFETY: only async-signal-safe calls (prctl) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for cap in 0..64u32 {
                if keep.contains(&cap) {
                    continue;
                }
                // EINVAL past the last capability this kernel knows.
                if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) != 0
                    && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Waits until process `pid` maps a file whose path contains `name` (e.g. "libc.so": the
/// dynamic loader has mapped it, so the process is past its start and a snapshot of its
/// mappings holds what its stacks run through). Panics after a minute.
pub fn wait_mapped(pid: u32, name: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        if maps.lines().any(|l| l.contains(name)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} did not map {name} within a minute"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Starts a CPU capture whose whole window walks `pids` with their unwind tables loaded.
///
/// A capture's start gives the tables of its targets' processes a moment (the unwinder's
/// budget) and leaves what takes longer to the unwinder's worker, so samples taken until
/// the worker is done walk by frame pointers only: how many depends on the machine (a
/// second of libc's table under QEMU's TCG on a loaded host). A test of what the walker
/// does with tables therefore waits for the unwinder's own signal that each process is
/// registered, under a first capture that asked for them, and measures a second capture on
/// the same sampler; the first is finished and dropped. Panics when a process gets no
/// tables within a minute.
pub fn start_cpu_with_tables(
    samplers: &flamefleet_agent::capture::Samplers,
    targets: &[flamefleet_agent::capture::CaptureTarget],
    options: &flamefleet_agent::capture::cpu::CpuOptions,
    pids: &[u32],
) -> flamefleet_agent::capture::cpu::CpuCapture {
    let first = samplers
        .start_cpu(targets, options)
        .expect("start the capture that registers the processes");
    let unwinder = first
        .sampler()
        .unwinder()
        .cloned()
        .expect("CFI unwinding is on");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for &pid in pids {
        while !unwinder.is_registered(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "process {pid} got no unwind tables within a minute: {:?}",
                unwinder.stats()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let measured = samplers
        .start_cpu(targets, options)
        .expect("start the measured capture");
    drop(first.finish().expect("finish the registering capture"));
    measured
}
