//! Real workloads in pod-shaped cgroups, for the pipeline tests and the demo: the cgroup2
//! mount, spawning a program inside a cgroup, removing a cgroup tree, and small helpers.

use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{Error, Result, io_err};

/// The cgroup2 mount point: `/sys/fs/cgroup` on real nodes, `/sys/fs/cgroup/unified` on
/// hybrid hosts.
///
/// # Errors
/// When /proc/mounts cannot be read or has no cgroup2 mount.
pub fn cgroup2_mount() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").map_err(io_err("reading /proc/mounts"))?;
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
        })
        .ok_or_else(|| Error::Io {
            action: "finding the cgroup2 mount in /proc/mounts (Flamefleet needs cgroup v2)".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })
}

/// Starts `program` with `args` inside `cgroup` (moved there between fork and exec, so it
/// never runs outside it). It gets SIGKILL when the calling thread's process dies.
///
/// # Errors
/// When the cgroup path is not a C string or the program cannot start there.
pub fn spawn_in_cgroup(cgroup: &Path, program: &Path, args: &[&str]) -> Result<Child> {
    spawn_in_cgroups(&[cgroup], program, args)
}

/// As [`spawn_in_cgroup`], joining every cgroup of `cgroups` (the cgroup2 directory and, on a
/// hybrid host, the v1 controllers' directories that hold its limits).
///
/// # Errors
/// When a cgroup path is not a C string or the program cannot start there.
pub fn spawn_in_cgroups(cgroups: &[&Path], program: &Path, args: &[&str]) -> Result<Child> {
    let procs = cgroups
        .iter()
        .map(|cgroup| {
            std::ffi::CString::new(cgroup.join("cgroup.procs").as_os_str().as_bytes()).map_err(
                |e| Error::Io {
                    action: format!("cgroup path {}", cgroup.display()),
                    source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
                },
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let mut cmd = Command::new(program);
    cmd.args(args).stdout(Stdio::null()).stderr(Stdio::null());
    // SAFETY: only async-signal-safe calls between fork and exec, on memory prepared before.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            for p in &procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                libc::close(fd);
                if !ok {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let first = cgroups
        .first()
        .map_or_else(String::new, |c| c.display().to_string());
    cmd.spawn()
        .map_err(io_err(format!("starting {} in {first}", program.display())))
}

/// Kills everything in the cgroup tree under `dir` and removes it, children first.
/// Best effort: a cgroup that stays busy for 2 s is left behind.
pub fn remove_cgroup_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    let _ = std::fs::write(dir.join("cgroup.kill"), b"1");
    for _ in 0..100 {
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A free TCP port on 127.0.0.1 (free when asked; bind it soon).
///
/// # Errors
/// When no port can be bound.
pub fn free_port() -> Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(io_err("binding a free port on 127.0.0.1"))
}

/// `bytes` random bytes from /dev/urandom, hex-encoded (container IDs, secrets).
///
/// # Errors
/// When /dev/urandom cannot be read.
pub fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut buf))
        .map_err(io_err("reading /dev/urandom"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}
