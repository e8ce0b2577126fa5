//! Fixtures of the heap tests: root check, cgroups created (and removed) under
//! the detected cgroup2 root, workloads compiled in the test and started
//! inside a cgroup, pprof helpers.
#![allow(dead_code)]

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use flamefleet_agent::cgroup::{Cgroup, CgroupRoot};
use flamefleet_proto::pprof::Profile;

/// Fails (never skips) when the test cannot do real eBPF / cgroup work.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test loads eBPF programs and creates cgroups: run it as root (CI does)"
    );
}

/// A cgroup created for one test, killed and removed on drop.
pub struct TestCgroup {
    pub cgroup: Cgroup,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl TestCgroup {
    pub fn new(tag: &str) -> Self {
        require_root();
        let root = CgroupRoot::detect().expect("a cgroup2 mount is needed for this test");
        let name = format!(
            "ff-heap-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = root.path().join(name);
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        let cgroup = Cgroup::open(&path).expect("just-created cgroup opens");
        Self { cgroup }
    }

    pub fn path(&self) -> &Path {
        &self.cgroup.path
    }

    /// Starts `cmd` inside this cgroup (it joins before exec, so every
    /// allocation it makes happens in the cgroup).
    pub fn spawn(&self, cmd: &mut Command) -> Child {
        let procs = self.path().join("cgroup.procs");
        // SAFETY: only async-signal-safe work (open/write/close) after fork.
        unsafe {
            cmd.pre_exec(move || std::fs::write(&procs, b"0"));
        }
        cmd.spawn().expect("spawning a workload")
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            let pids = self.cgroup.procs_recursive().unwrap_or_default();
            for pid in &pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            if pids.is_empty() && std::fs::remove_dir(self.path()).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Compiles a C workload with frame pointers, as the issue asks.
pub fn compile_c(src: &Path, out: &Path) -> PathBuf {
    let bin = out.join(src.file_stem().expect("a file name"));
    let status = Command::new("cc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer", "-o"])
        .arg(&bin)
        .arg(src)
        .status()
        .expect("running cc (install gcc)");
    assert!(status.success(), "compiling {} failed", src.display());
    bin
}

/// Path of a file in tests/heap_workloads.
pub fn workload(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/heap_workloads")
        .join(name)
}

/// Lines of a child's stdout, read on a thread so waits can time out.
pub struct Lines(mpsc::Receiver<String>);

impl Lines {
    pub fn new(out: ChildStdout) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self(rx)
    }

    /// Waits for a line starting with `prefix`, returning it (all lines seen go to `seen`).
    pub fn wait_for(&self, prefix: &str, timeout: Duration, seen: &mut Vec<String>) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.0.recv_timeout(left) {
                Ok(line) => {
                    seen.push(line.clone());
                    if line.starts_with(prefix) {
                        return line;
                    }
                }
                Err(_) => {
                    panic!("no line starting with {prefix:?} within {timeout:?}; saw {seen:?}")
                }
            }
        }
    }
}

/// Writes a line to a child's stdin.
pub fn say(child: &mut Child, line: &str) {
    let stdin = child.stdin.as_mut().expect("stdin is piped");
    writeln!(stdin, "{line}").expect("writing to the workload");
}

/// Runs `go tool pprof -top` on a profile and returns its output, failing
/// the test when pprof cannot read the file.
pub fn pprof_top(profile: &Profile, args: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("heap.pb.gz");
    let bytes = flamefleet_agent::pprof::encode_gzip(profile).expect("encoding");
    std::fs::write(&file, bytes).expect("writing the profile");
    let out = Command::new("go")
        .args(["tool", "pprof", "-top"])
        .args(args)
        .arg(&file)
        .env("PPROF_TMPDIR", dir.path())
        .stdin(Stdio::null())
        .output()
        .expect("running `go tool pprof` (install Go)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "go tool pprof could not read the profile: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The string at index `i` of the profile's table.
pub fn s(p: &Profile, i: i64) -> &str {
    &p.string_table[i as usize]
}

/// Index of the sample type named `name`.
pub fn sample_index(p: &Profile, name: &str) -> usize {
    p.sample_type
        .iter()
        .position(|vt| s(p, vt.r#type) == name)
        .unwrap_or_else(|| panic!("no sample type {name}"))
}

/// Function names on a sample's stack, leaf first.
pub fn stack_functions(p: &Profile, sample: &flamefleet_proto::pprof::Sample) -> Vec<String> {
    let mut out = Vec::new();
    for id in &sample.location_id {
        let loc = p
            .location
            .iter()
            .find(|l| l.id == *id)
            .expect("location exists");
        for line in &loc.line {
            let f = p
                .function
                .iter()
                .find(|f| f.id == line.function_id)
                .expect("function exists");
            out.push(s(p, f.name).to_owned());
        }
    }
    out
}

/// The numeric label `key` of a sample.
pub fn num_label(p: &Profile, sample: &flamefleet_proto::pprof::Sample, key: &str) -> Option<i64> {
    sample
        .label
        .iter()
        .find(|l| s(p, l.key) == key)
        .map(|l| l.num)
}

/// The string label `key` of a sample.
pub fn str_label<'a>(
    p: &'a Profile,
    sample: &flamefleet_proto::pprof::Sample,
    key: &str,
) -> Option<&'a str> {
    sample
        .label
        .iter()
        .find(|l| s(p, l.key) == key)
        .map(|l| s(p, l.str))
}
