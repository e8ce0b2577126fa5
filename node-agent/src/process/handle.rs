//! One profiled process, held by identity rather than by PID.
//!
//! A PID names a process only while it lives; once it exits, the kernel may hand the PID
//! to any new process, of any tenant. A reader that finds a process at the start of a
//! capture and reads its memory, maps or perf map at the end by PID alone could read
//! another process's data into the profile. So a reader takes a [`ProcessHandle`] when it
//! finds the process — a pidfd, which keeps referring to that one process — and asks it,
//! after each read, whether that process still lives ([`ProcessHandle::is_alive`]): a live
//! process keeps its PID, so whatever was read by PID came from it. Before data is
//! attributed to a target, [`ProcessHandle::in_cgroup`] checks the process is still in it.
//!
//! Where pidfds are refused (Linux < 5.3, a seccomp profile), the process's start time
//! (`/proc/<pid>/stat`) stands in: a reused PID has a later start time.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use crate::cgroup::Cgroup;

/// A process found by PID, kept by identity (see the module docs).
#[derive(Debug)]
pub struct ProcessHandle {
    pid: u32,
    pidfd: Option<OwnedFd>,
    start_time: u64,
}

impl ProcessHandle {
    /// The process that has PID `pid` now. `Err` (ESRCH) when there is none.
    pub fn open(pid: u32) -> std::io::Result<Self> {
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => Some(fd),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Err(e),
            // Pidfds refused: the start time alone identifies the process.
            Err(_) => None,
        };
        let start_time = start_time(pid)?;
        let handle = Self {
            pid,
            pidfd,
            start_time,
        };
        // The start time was read by PID after the pidfd was taken: it is that process's
        // only if the process still lives.
        if !handle.is_alive() {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(handle)
    }

    /// The PID.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The process's start time, in clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub fn start_time(&self) -> u64 {
        self.start_time
    }

    /// Whether the process still lives, so that its PID still names it.
    pub fn is_alive(&self) -> bool {
        match &self.pidfd {
            Some(fd) => {
                let mut pfd = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, no timeout. A pidfd polls readable once the
                // process has exited.
                let r = unsafe { libc::poll(&raw mut pfd, 1, 0) };
                r == 0
            }
            None => start_time(self.pid).ok() == Some(self.start_time),
        }
    }

    /// Sends signal `sig` to this very process, through its pidfd: never to another process
    /// that got its PID. Refused (`Unsupported`) where pidfds are, since a signal by PID
    /// alone could reach a reused PID.
    pub fn signal(&self, sig: i32) -> std::io::Result<()> {
        let Some(fd) = &self.pidfd else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "no pidfd for the process (Linux 5.3+): not signalled by PID alone",
            ));
        };
        // SAFETY: plain syscall: a pidfd we own, a signal number, no siginfo, no flags.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                libc::c_long::from(sig),
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether the process lives in `cgroup` or below it now.
    pub fn in_cgroup(&self, cgroup: &Cgroup) -> bool {
        // The PID is in the list, and the process still lives afterwards: the PID in the
        // list was this process.
        let listed = cgroup
            .procs_recursive()
            .is_ok_and(|pids| pids.contains(&self.pid));
        listed && self.is_alive()
    }
}

/// The start time of process `pid`, when `/proc/<pid>/stat` can be read: with
/// [`ProcessHandle::start_time`], tells a reused PID apart without holding a descriptor.
pub fn start_time(pid: u32) -> std::io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The comm (field 2) is parenthesized and may hold spaces and parentheses.
    let after_comm = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or_else(|| std::io::Error::other("malformed /proc/<pid>/stat"))?;
    // Field 3 (state) is the first after the comm; start time is field 22.
    after_comm
        .split_whitespace()
        .nth(22 - 3)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| std::io::Error::other("malformed /proc/<pid>/stat"))
}

/// A pidfd of `pid`.
fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::c_long::from(pid), 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel just returned this descriptor to us; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_alive_until_it_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let h = ProcessHandle::open(child.id()).unwrap();
        assert!(h.is_alive());
        assert_eq!(start_time(child.id()).unwrap(), h.start_time());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!h.is_alive());
        assert!(ProcessHandle::open(child.id()).is_err());
    }
}
