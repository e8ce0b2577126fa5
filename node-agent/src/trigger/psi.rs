//! The kernel's PSI triggers on a cgroup's pressure files.
//!
//! Writing `some <stall_us> <window_us>` to `<cgroup>/{cpu,memory,io}.pressure` asks the
//! kernel to wake the writer's `poll` with `POLLPRI` when the cgroup's tasks stalled for
//! `stall_us` within any `window_us`; the trigger lives as long as the file descriptor. The
//! kernel checks the stall itself and wakes at most once per window, so a pressured pod costs
//! the agent one wakeup per window whatever it does.
//!
//! What it needs (Linux ≥ 5.2 in cgroups, `psi=1` where the kernel defaults it off): write
//! access to the pressure file (the cgroup directory's owner: root on the node) and, for a
//! window that is not a multiple of 2 s, `CAP_SYS_RESOURCE` (the kernel's real-time polling
//! thread; Linux ≥ 6.5 lets anyone else have 2 s multiples, served by the ordinary averaging
//! worker). The agent uses a 10 s window, a multiple of 2 s, so the trigger is also what
//! `some avg10` would show, without the capability on recent kernels; where the write is
//! refused, the watcher falls back to reading `some avg10` on its tick.

use std::fs::File;
use std::io::Write as _;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::time::Duration;

use super::TriggerError;

/// The pressure resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PsiResource {
    /// `cpu.pressure`.
    Cpu,
    /// `memory.pressure`.
    Memory,
    /// `io.pressure`.
    Io,
}

impl PsiResource {
    /// The file name in a cgroup directory.
    pub fn file(self) -> &'static str {
        match self {
            Self::Cpu => "cpu.pressure",
            Self::Memory => "memory.pressure",
            Self::Io => "io.pressure",
        }
    }
}

/// The window of the agent's triggers: the span of `avg10`, a multiple of 2 s.
pub const WINDOW: Duration = Duration::from_secs(10);

/// The text written to arm a trigger at `percent` of [`WINDOW`].
pub fn trigger_text(percent: u8, window: Duration) -> String {
    let window_us = window.as_micros() as u64;
    let stall_us = window_us * u64::from(percent.clamp(1, 100)) / 100;
    format!("some {stall_us} {window_us}")
}

/// An armed PSI trigger: poll its descriptor for `POLLPRI`.
#[derive(Debug)]
pub struct PsiTrigger {
    /// The pressure file.
    pub path: PathBuf,
    file: File,
}

impl PsiTrigger {
    /// Arms `some <percent>% of window` on `path`.
    ///
    /// # Errors
    /// [`TriggerError::Psi`] when the kernel refuses (no PSI, no permission, a window it
    /// does not take without `CAP_SYS_RESOURCE`).
    pub fn arm(path: PathBuf, percent: u8, window: Duration) -> Result<Self, TriggerError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let text = trigger_text(percent, window);
        let psi_err = |source| TriggerError::Psi {
            path: path.clone(),
            text: text.clone(),
            source,
        };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)
            .map_err(psi_err)?;
        // The kernel parses the whole write as one trigger, NUL-terminated.
        let mut bytes = text.clone().into_bytes();
        bytes.push(0);
        file.write_all(&bytes).map_err(psi_err)?;
        Ok(Self { path, file })
    }
}

impl AsFd for PsiTrigger {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_text_is_a_share_of_the_window() {
        assert_eq!(trigger_text(20, WINDOW), "some 2000000 10000000");
        assert_eq!(trigger_text(0, WINDOW), "some 100000 10000000");
        assert_eq!(
            trigger_text(200, Duration::from_secs(2)),
            "some 2000000 2000000"
        );
    }
}
