//! Boots another Linux kernel under QEMU and runs a shell command in it, on this machine's
//! own files: the guest tier of the capture engines (`node-agent/tests/kernels.rs`) runs the
//! engines' tests inside Debian's 5.10, 6.1 and 6.12 kernels this way.
//!
//! How a run goes:
//!
//! 1. [`Kernel::find`] takes a Debian kernel package unpacked by `scripts/guest-kernels.sh`
//!    (`boot/vmlinuz-<release>`, `lib/modules/<release>/` with `modules.dep`).
//! 2. [`initramfs`] writes a cpio archive holding busybox, the kernel modules that reach the
//!    host's files (virtio, 9p, overlayfs; `modprobe --show-depends` lists them in load
//!    order) and [`INIT`], the guest's first process.
//! 3. [`run`] starts `qemu-system-x86_64` (TCG: nested KVM fails on the VMs this runs on)
//!    with two 9p shares: the host's root, read-only, and a job directory, writable, holding
//!    the command. `INIT` loads the modules, mounts the host root as the lower layer of an
//!    overlay whose upper layer is guest memory (the guest can write anywhere; the host sees
//!    none of it), mounts proc, sys, dev, cgroup2, bpffs, tracefs and a fresh /tmp in it,
//!    `chroot`s there and runs the command with its output in the job directory, writes the
//!    exit status next to it and powers off.
//! 4. The result is the command's exit status and output; a guest that never wrote a status
//!    (did not boot, panicked, hung past the timeout) is an error carrying the tail of its
//!    serial console.
//!
//! Because the guest sees the host's root, the host's binaries (the agent's test
//! executables, compilers, Go, libbpf-tools) run there unchanged: same glibc, same paths.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Errors of the guest harness.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// A tool the harness needs is missing.
    #[error("{what} not found at {path}: install it with `scripts/setup.sh` (as root) ({package})")]
    MissingTool {
        /// The tool.
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// The Debian package or script providing it.
        package: &'static str,
    },
    /// The kernel is not unpacked where `scripts/guest-kernels.sh` puts it.
    #[error(
        "kernel {release} not found in {dir} (expected boot/vmlinuz-{release} and lib/modules/{release}/modules.dep): run `scripts/guest-kernels.sh` as root (scripts/setup.sh runs it)"
    )]
    MissingKernel {
        /// The kernel release, e.g. `5.10.0-32-amd64`.
        release: String,
        /// Where it was expected.
        dir: PathBuf,
    },
    /// A file or process operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being done.
        action: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// `modprobe --show-depends` did not list the modules.
    #[error("listing the modules of kernel {release} with modprobe failed: {detail}")]
    Modules {
        /// The kernel release.
        release: String,
        /// modprobe's answer.
        detail: String,
    },
    /// The guest did not report the command's exit status.
    #[error(
        "the {release} guest did not finish its command ({reason}) after {seconds}s\n--- last lines of the command's output ---\n{output_tail}\n--- last lines of the guest's console ---\n{console_tail}"
    )]
    NoStatus {
        /// The kernel release.
        release: String,
        /// What happened (timeout, QEMU's exit status).
        reason: String,
        /// How long the guest ran.
        seconds: u64,
        /// The command's output so far.
        output_tail: String,
        /// The serial console's last lines.
        console_tail: String,
    },
}

/// Result of the guest harness.
pub type Result<T, E = GuestError> = std::result::Result<T, E>;

fn io(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> GuestError {
    let action = action.into();
    move |source| GuestError::Io { action, source }
}

/// The Debian kernels `scripts/guest-kernels.sh` unpacks (keep the two in step): 5.10
/// (bullseye), 6.1 (bookworm), 6.12 (bookworm-backports).
pub const DEBIAN_KERNELS: &[&str] = &["5.10.0-32-amd64", "6.1.0-50-amd64", "6.12.95+deb12-amd64"];

/// Where `scripts/guest-kernels.sh` unpacks kernels: `$FLAMEFLEET_CACHE/guest-kernels`.
pub fn kernels_dir() -> PathBuf {
    crate::binaries::cache_dir().join("guest-kernels")
}

/// A kernel unpacked from its Debian package.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// The release, as `uname -r` prints it in the guest.
    pub release: String,
    /// The unpacked package (`boot/`, `lib/modules/`).
    pub root: PathBuf,
}

impl Kernel {
    /// The kernel `release` in [`kernels_dir`]; fails with what to run when it is missing.
    pub fn find(release: &str) -> Result<Self> {
        let root = kernels_dir().join(release);
        let kernel = Self {
            release: release.to_owned(),
            root,
        };
        if kernel.image().is_file() && kernel.modules_dir().join("modules.dep").is_file() {
            Ok(kernel)
        } else {
            Err(GuestError::MissingKernel {
                release: release.to_owned(),
                dir: kernel.root,
            })
        }
    }

    /// The kernel image QEMU boots.
    pub fn image(&self) -> PathBuf {
        self.root
            .join("boot")
            .join(format!("vmlinuz-{}", self.release))
    }

    fn modules_dir(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }

    /// The module files that provide `modules` (with their dependencies), in load order,
    /// without repeats; modules built into the kernel are left out.
    pub fn module_files(&self, modules: &[&str]) -> Result<Vec<PathBuf>> {
        let out = Command::new(tool(
            "modprobe",
            &["/usr/sbin/modprobe", "/sbin/modprobe"],
            "kmod",
        )?)
        .arg("-d")
        .arg(&self.root)
        .args(["-S", &self.release, "--show-depends", "-a"])
        .args(modules)
        .output()
        .map_err(io("running modprobe --show-depends"))?;
        if !out.status.success() {
            return Err(GuestError::Modules {
                release: self.release.clone(),
                detail: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        let mut files: Vec<PathBuf> = Vec::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "insmod <file> [options]" or "builtin <name>".
            let mut words = line.split_whitespace();
            if words.next() == Some("insmod")
                && let Some(file) = words.next().map(PathBuf::from)
                && !files.contains(&file)
            {
                files.push(file);
            }
        }
        Ok(files)
    }
}

/// What the guest loads to reach the host's files: the virtio PCI transport, 9p over
/// virtio, and overlayfs (modules in Debian's kernels; any built in are skipped).
pub const GUEST_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

/// The 9p tags of the two shares, as `INIT` mounts them.
const ROOT_TAG: &str = "hostroot";
const JOB_TAG: &str = "job";

/// The guest's first process (busybox sh). The job directory holds `env` (sourced) and
/// `command` (run with /bin/sh); the guest writes `output` and then `status`.
pub const INIT: &str = r#"#!/bin/busybox sh
bb=/bin/busybox
$bb mkdir -p /proc /sys /dev /lower /upper /newroot
$bb mount -t proc proc /proc
$bb mount -t sysfs sys /sys
$bb mount -t devtmpfs dev /dev
for m in /modules/*.ko; do $bb insmod "$m" || echo "flamefleet-guest: insmod $m failed"; done
# The host's root, read-only, under an overlay whose writes stay in guest memory.
$bb mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=loose,ro hostroot /lower
$bb mount -t tmpfs -o mode=0755 upper /upper
$bb mkdir -p /upper/data /upper/work
$bb mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot
r=/newroot
$bb mount -t proc proc $r/proc
$bb mount -t sysfs sys $r/sys
$bb mount -t devtmpfs dev $r/dev
$bb mkdir -p $r/dev/pts $r/dev/shm
$bb mount -t devpts devpts $r/dev/pts
$bb mount -t tmpfs shm $r/dev/shm
$bb mount -t tmpfs -o mode=1777 tmp $r/tmp
$bb mount -t tmpfs -o mode=0755 run $r/run
$bb mount -t cgroup2 cgroup2 $r/sys/fs/cgroup
$bb mount -t bpf bpf $r/sys/fs/bpf
$bb mount -t tracefs tracefs $r/sys/kernel/tracing
$bb mount -t debugfs debugfs $r/sys/kernel/debug
$bb mkdir -p $r/flamefleet-job
$bb mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 job $r/flamefleet-job
$bb ip link set lo up
$bb hostname flamefleet-guest
echo "flamefleet-guest: running the command on $($bb uname -r)"
$bb chroot $r /bin/sh -c '. /flamefleet-job/env; /bin/sh /flamefleet-job/command >/flamefleet-job/output 2>&1; echo $? >/flamefleet-job/status.tmp'
$bb mv $r/flamefleet-job/status.tmp $r/flamefleet-job/status
echo "flamefleet-guest: command exited with status $($bb cat $r/flamefleet-job/status)"
$bb sync
$bb poweroff -f
"#;

/// Where a program is: the first of `candidates` that exists.
fn tool(what: &'static str, candidates: &[&str], package: &'static str) -> Result<PathBuf> {
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| GuestError::MissingTool {
            what,
            path: PathBuf::from(candidates.first().copied().unwrap_or(what)),
            package,
        })
}

/// Writes the guest's initramfs for `kernel` to `dest`: busybox, the modules of
/// [`GUEST_MODULES`] (numbered in load order) and [`INIT`].
pub fn initramfs(kernel: &Kernel, dest: &Path) -> Result<()> {
    let busybox = tool(
        "busybox",
        &["/bin/busybox", "/usr/bin/busybox"],
        "busybox-static",
    )?;
    let mut archive = Cpio::default();
    for dir in ["bin", "dev", "modules", "proc", "sys"] {
        archive.dir(dir);
    }
    let read = |p: &Path| std::fs::read(p).map_err(io(format!("reading {}", p.display())));
    archive.file("bin/busybox", 0o755, &read(&busybox)?);
    for (i, module) in kernel.module_files(GUEST_MODULES)?.iter().enumerate() {
        let name = module.file_name().map(|n| n.to_string_lossy().into_owned());
        archive.file(
            &format!("modules/{i:02}-{}", name.unwrap_or_default()),
            0o644,
            &read(module)?,
        );
    }
    archive.file("init", 0o755, INIT.as_bytes());
    std::fs::write(dest, archive.finish()).map_err(io(format!("writing {}", dest.display())))
}

/// A cpio archive in the kernel's initramfs format ("newc": a 110-byte ASCII header per
/// entry, name and data padded to 4 bytes, a `TRAILER!!!` entry last). Written here rather
/// than with cpio(1): the archive is a handful of entries built from memory, no staging
/// directory needed, and the whole format is these few lines.
#[derive(Default)]
struct Cpio {
    bytes: Vec<u8>,
    inode: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.inode += 1;
        let name_len = name.len() + 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.inode,
            mode,
            0, // uid
            0, // gid
            1, // nlink
            0, // mtime
            data.len(),
            0, // dev major
            0, // dev minor
            0, // rdev major
            0, // rdev minor
            name_len,
            0, // check
        );
        self.bytes.extend_from_slice(header.as_bytes());
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, &[]);
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | perm, data);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.bytes
    }
}

/// The guest machine.
#[derive(Debug, Clone)]
pub struct GuestConfig {
    /// Memory in MiB (the overlay's writes and /tmp live in it too).
    pub memory_mib: u32,
    /// Virtual CPUs.
    pub cpus: u32,
    /// How long the command may run before the guest is killed (counted from the end of
    /// the boot timeout at the latest).
    pub timeout: Duration,
    /// How long a boot may take, from QEMU's start to `INIT` starting the command (about
    /// 15 s here under TCG; minutes on a loaded host).
    pub boot_timeout: Duration,
    /// Boots tried before giving up on a guest that keeps hanging before the command.
    pub boot_attempts: u32,
    /// Environment variables the command sees (besides PATH and HOME, copied from here).
    pub env: Vec<(String, String)>,
}

impl Default for GuestConfig {
    fn default() -> Self {
        Self {
            memory_mib: 3072,
            cpus: 2,
            timeout: Duration::from_secs(20 * 60),
            boot_timeout: Duration::from_secs(180),
            boot_attempts: 3,
            env: Vec::new(),
        }
    }
}

/// What a command run in a guest left.
#[derive(Debug, Clone)]
pub struct GuestOutput {
    /// The kernel it ran on.
    pub release: String,
    /// Its exit status.
    pub status: i32,
    /// Its standard output and error, interleaved.
    pub output: String,
    /// The guest's serial console (kernel messages, INIT's lines).
    pub console: String,
    /// From QEMU's start to the guest's power-off (of the boot that ran the command).
    pub elapsed: Duration,
    /// Boots that hung before the command started and were killed and tried again.
    pub hung_boots: Vec<HungBoot>,
}

/// A boot killed because it had not started the command by the boot timeout.
#[derive(Debug, Clone)]
pub struct HungBoot {
    /// How long it ran.
    pub seconds: u64,
    /// The last lines of its serial console.
    pub console_tail: String,
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Boots `kernel` and runs the shell script `command` (as root, in the host's root seen
/// through the guest's overlay, working directory `/`); returns its exit status and
/// output once the guest powered off.
///
/// A guest that has not started the command within [`GuestConfig::boot_timeout`] is killed
/// and booted again, up to [`GuestConfig::boot_attempts`] times in all: under TCG on a loaded
/// host a guest kernel now and then stops early in its boot (seen once in about a hundred
/// boots, silent on the console), and without this a hung boot would hold the caller until
/// the command's whole timeout. Each hung boot is kept in [`GuestOutput::hung_boots`].
///
/// # Errors
/// When QEMU, busybox or the kernel is missing, or the guest reports no exit status (it
/// did not boot in any attempt, crashed, or ran past [`GuestConfig::timeout`]): the error
/// holds the tail of the guest's console.
pub fn run(kernel: &Kernel, config: &GuestConfig, command: &str) -> Result<GuestOutput> {
    let qemu = tool(
        "qemu-system-x86_64",
        &["/usr/bin/qemu-system-x86_64"],
        "qemu-system-x86",
    )?;
    let work = std::env::temp_dir().join(format!(
        "flamefleet-guest-{}-{}",
        std::process::id(),
        kernel.release
    ));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(io(format!("creating {}", work.display())))?;
    let _cleanup = RemoveOnDrop(work.clone());
    let initrd = work.join("initramfs.cpio");
    initramfs(kernel, &initrd)?;

    let mut env = String::new();
    let host_path = std::env::var("PATH").unwrap_or_default();
    for (k, v) in [("PATH", host_path.as_str()), ("HOME", "/root")]
        .into_iter()
        .chain(config.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    {
        env.push_str(&format!("export {k}={}\n", shell_quote(v)));
    }
    let mut hung_boots = Vec::new();
    let attempts = config.boot_attempts.max(1);
    for attempt in 1..=attempts {
        // A fresh job directory per boot: a hung boot may have left nothing, or anything.
        let job = work.join(format!("job-{attempt}"));
        std::fs::create_dir_all(&job).map_err(io(format!("creating {}", job.display())))?;
        let write = |name: &str, text: &str| {
            std::fs::write(job.join(name), text).map_err(io(format!("writing the guest's {name}")))
        };
        write("env", &env)?;
        write("command", command)?;
        let console = work.join(format!("console-{attempt}.log"));
        match boot(&qemu, kernel, config, &initrd, &job, &console)? {
            Boot::Ran(mut out) => {
                out.hung_boots = hung_boots;
                return Ok(out);
            }
            Boot::Hung {
                seconds,
                console_tail,
            } if attempt < attempts => {
                hung_boots.push(HungBoot {
                    seconds,
                    console_tail,
                });
            }
            Boot::Hung {
                seconds,
                console_tail,
            } => {
                return Err(GuestError::NoStatus {
                    release: kernel.release.clone(),
                    reason: format!(
                        "it had not started the command {}s after QEMU started, in each of {attempts} boots",
                        config.boot_timeout.as_secs()
                    ),
                    seconds,
                    output_tail: String::new(),
                    console_tail,
                });
            }
            Boot::Failed(e) => return Err(e),
        }
    }
    unreachable!("the last attempt returns")
}

/// The line `INIT` prints on the console just before it runs the command.
const STARTED: &str = "flamefleet-guest: running the command on";

enum Boot {
    /// The guest ran the command and reported its status.
    Ran(GuestOutput),
    /// The guest had not started the command by the boot timeout; it was killed.
    Hung { seconds: u64, console_tail: String },
    /// It booted, but reported no status.
    Failed(GuestError),
}

/// One QEMU run.
fn boot(
    qemu: &Path,
    kernel: &Kernel,
    config: &GuestConfig,
    initrd: &Path,
    job: &Path,
    console: &Path,
) -> Result<Boot> {
    let began = Instant::now();
    let mut qemu = Command::new(qemu);
    qemu.args([
        "-machine",
        "q35",
        "-cpu",
        "max",
        "-accel",
        "tcg,thread=multi",
    ])
    .args(["-smp", &config.cpus.to_string()])
    .args(["-m", &config.memory_mib.to_string()])
    .args([
        "-display",
        "none",
        "-no-reboot",
        "-nic",
        "none",
        "-monitor",
        "none",
    ])
    .arg("-serial")
    .arg(format!("file:{}", console.display()))
    .arg("-kernel")
    .arg(kernel.image())
    .arg("-initrd")
    .arg(initrd)
    // tsc=reliable: under TCG the guest's TSC is the host's (QEMU reads it for the guest's
    // rdtsc), constant-rate and in step across vCPUs, but the clocksource watchdog reads
    // the HPET and the TSC back to back, and when the host deschedules the vCPU between
    // the two reads (a loaded machine) it declares the TSC unstable. The kernel then marks
    // its scheduler clock unstable too: a per-CPU clock kept within a tick of the last
    // timer tick, which after a vCPU stall stamps waits early by up to the stall, so the
    // run-queue clock and ktime stop agreeing (runqlat's comparison with libbpf-tools
    // measured waits milliseconds apart). A real node's TSC or kvm-clock stays stable.
    .args(["-append", "console=ttyS0 panic=-1 oops=panic tsc=reliable"])
    .arg("-virtfs")
    .arg(format!(
        "local,path=/,mount_tag={ROOT_TAG},security_model=none,readonly=on,multidevs=remap"
    ))
    .arg("-virtfs")
    .arg(format!(
        "local,path={},mount_tag={JOB_TAG},security_model=none,multidevs=remap",
        job.display()
    ))
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    // The guest dies with the process that started it, even when that one is killed.
    // SAFETY: prctl is async-signal-safe and takes no pointers here.
    unsafe {
        use std::os::unix::process::CommandExt as _;
        qemu.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = KillOnDrop(qemu.spawn().map_err(io("starting qemu-system-x86_64"))?);
    let exited = wait_for_guest(&mut child.0, config, console)?;
    let elapsed = began.elapsed();
    let console_text = read_lossy(console);
    let Some(exited) = exited else {
        return Ok(Boot::Hung {
            seconds: elapsed.as_secs(),
            console_tail: tail(&console_text, 60),
        });
    };
    let output = read_lossy(&job.join("output"));
    let status = std::fs::read_to_string(job.join("status"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok());
    Ok(match status {
        Some(status) => Boot::Ran(GuestOutput {
            release: kernel.release.clone(),
            status,
            output,
            console: console_text,
            elapsed,
            hung_boots: Vec::new(),
        }),
        None => {
            let reason = match exited {
                Exit::TimedOut => format!("killed at the timeout of {:?}", config.timeout),
                Exit::Exited(s) => {
                    let mut stderr = String::new();
                    if let Some(mut e) = child.0.stderr.take() {
                        use std::io::Read as _;
                        let _ = e.read_to_string(&mut stderr);
                    }
                    format!("QEMU exited with {s}: {}", stderr.trim())
                }
            };
            Boot::Failed(GuestError::NoStatus {
                release: kernel.release.clone(),
                reason,
                seconds: elapsed.as_secs(),
                output_tail: tail(&output, 40),
                console_tail: tail(&console_text, 60),
            })
        }
    })
}

enum Exit {
    Exited(std::process::ExitStatus),
    TimedOut,
}

/// Waits for the guest: `None` when it had not started the command by the boot timeout
/// (killed then), [`Exit::TimedOut`] when it ran past the command's timeout (killed too).
fn wait_for_guest(child: &mut Child, config: &GuestConfig, console: &Path) -> Result<Option<Exit>> {
    let began = Instant::now();
    let mut started = false;
    loop {
        if let Some(status) = child.try_wait().map_err(io("waiting for QEMU"))? {
            return Ok(Some(Exit::Exited(status)));
        }
        if !started {
            started = read_lossy(console).contains(STARTED);
            if !started && began.elapsed() >= config.boot_timeout {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(None);
            }
        }
        if began.elapsed() >= config.boot_timeout + config.timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(Some(Exit::TimedOut));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// `value` in single quotes for sh.
pub fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_entries_are_aligned_and_end_with_the_trailer() {
        let mut c = Cpio::default();
        c.dir("bin");
        c.file("bin/x", 0o755, b"hello");
        let bytes = c.finish();
        assert_eq!(bytes.len() % 4, 0);
        assert!(bytes.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("bin/x\0"));
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!\0"));
        // The file's header: mode 100755, size 5, name length 6.
        let at = text.find("bin/x").unwrap() - 110;
        let header = &text[at..at + 110];
        assert_eq!(&header[14..22], "000081ed");
        assert_eq!(&header[54..62], "00000005");
        assert_eq!(&header[94..102], "00000006");
    }

    #[test]
    fn shell_quote_survives_quotes() {
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
    }
}
