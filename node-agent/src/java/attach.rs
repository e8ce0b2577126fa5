//! HotSpot's attach protocol, the way `jcmd` speaks it, done inside the JVM's own root.
//!
//! The JVM listens on a Unix socket, `/tmp/.java_pid<PID>` (its PID in its own PID
//! namespace), once its attach listener started. It starts it when it receives SIGQUIT
//! and finds a file `.attach_pid<PID>` owned by its user or root in its working directory
//! or `/tmp`. A request is `1\0jcmd\0<command>\0\0\0`; the reply is a status line (`0`:
//! done) and the command's output, then the JVM closes the connection.
//!
//! The JVM's `/tmp` belongs to the workload, which may be hostile:
//! * the directory is reached from `/proc/<pid>/root` with `openat2(RESOLVE_IN_ROOT |
//!   RESOLVE_NO_MAGICLINKS)`, and the socket and the trigger file below it with
//!   `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`: a planted symlink leads nowhere outside that
//!   root, nor to another file inside it;
//! * the socket is used only if `fstat` says it is a socket owned by the JVM's user (or
//!   root), and it is connected through `/proc/self/fd/N` of that very inode (no second
//!   lookup by path);
//! * the trigger file is created with `O_CREAT | O_EXCL | O_NOFOLLOW`, handed to the JVM's
//!   user where the agent may (`CAP_CHOWN`; the JVM accepts root's too), and removed once
//!   the listener answers or the wait gives up;
//! * the signal goes through a pidfd ([`ProcessHandle::signal`]) taken before any check,
//!   so a PID reused meanwhile is never signalled;
//! * replies are read with a timeout and a deadline, at most [`MAX_REPLY`] bytes.
//!
//! A JVM of another user than the agent's: the JVM takes a trigger file and a connection
//! only from its own user or root, its socket is mode 0600, and the kernel lets a process
//! signal only processes of its user. Rather than holding `CAP_KILL` and `CAP_DAC_OVERRIDE`
//! (every file and process of the node) for that, the agent does the attach on a thread of
//! its own that first becomes the JVM's user and group ([`as_user`]), as `jcmd` run by
//! that user would: it needs `CAP_SETUID` and `CAP_SETGID`, which only that thread uses,
//! and its peer credentials are then the ones the JVM checks for. A root JVM in a pod with
//! a user namespace is such a JVM too: its root is another user on the node.
//!
//! Whether the process may be signalled at all is the caller's decision
//! ([`super::detect`]).

use std::io::{Read as _, Write as _};
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::Mode;

use crate::process::handle::ProcessHandle;

/// Largest reply read (VM.flags and VM.version print a few KiB).
pub const MAX_REPLY: usize = 64 << 10;
/// How often the listener's socket is looked for after the signal.
const POLL: Duration = Duration::from_millis(10);

/// Why a command could not be run in a JVM.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The JVM's `/tmp` could not be opened.
    #[error("opening /tmp in the root of process {pid}: {source}")]
    Tmp {
        /// The process.
        pid: u32,
        /// The cause.
        source: std::io::Error,
    },
    /// Something other than the JVM's socket is at the listener's path.
    #[error(
        "/tmp/.java_pid{nspid} of process {pid} is not a socket owned by the JVM's user \
         (uid {uid}): not connected"
    )]
    NotOurSocket {
        /// The process.
        pid: u32,
        /// Its PID in its own namespace.
        nspid: u32,
        /// The JVM's effective user.
        uid: u32,
    },
    /// The listener did not appear in time after the signal.
    #[error(
        "the JVM (pid {pid}) did not start its attach listener within {waited:?} of SIGQUIT \
         (attach mechanism disabled, or the JVM is busy)"
    )]
    NoListener {
        /// The process.
        pid: u32,
        /// How long the agent waited.
        waited: Duration,
    },
    /// The listener is not running and the caller did not allow a signal.
    #[error("the JVM (pid {pid}) runs no attach listener")]
    NotListening {
        /// The process.
        pid: u32,
    },
    /// A system call failed.
    #[error("{what} for process {pid}: {source}")]
    Io {
        /// The process.
        pid: u32,
        /// What was being done.
        what: &'static str,
        /// The cause.
        source: std::io::Error,
    },
    /// The attach thread could not take the JVM's user and group.
    #[error("{}", switch_message(*.pid, *.uid, *.gid, .source))]
    AsUser {
        /// The process.
        pid: u32,
        /// The JVM's effective user (`u32::MAX`: unknown).
        uid: u32,
        /// The JVM's effective group.
        gid: u32,
        /// The cause.
        source: std::io::Error,
    },
    /// The JVM answered with an error.
    #[error("the JVM (pid {pid}) refused `{command}`: status {status}: {message}")]
    Refused {
        /// The process.
        pid: u32,
        /// The command.
        command: String,
        /// Its status line.
        status: String,
        /// The start of its output.
        message: String,
    },
}

/// One JVM, held by identity, and where its attach files are.
#[derive(Debug)]
pub struct Jvm {
    handle: ProcessHandle,
    /// Its PID in its own PID namespace (the one in the attach files' names).
    nspid: u32,
    /// Effective user and group IDs.
    uid: u32,
    gid: u32,
    /// Its `/tmp`, an `O_PATH` descriptor.
    tmp: OwnedFd,
}

impl Jvm {
    /// The JVM `handle` (effective IDs `uid`, `gid`; `nspid` in its namespace).
    pub fn open(
        handle: ProcessHandle,
        nspid: u32,
        uid: u32,
        gid: u32,
    ) -> Result<Self, AttachError> {
        let pid = handle.pid();
        let tmp = tmp_dir(pid).map_err(|source| AttachError::Tmp { pid, source })?;
        Ok(Self {
            handle,
            nspid,
            uid,
            gid,
            tmp,
        })
    }

    /// Whether the JVM's attach listener answers now (its socket is there).
    pub fn listening(&self) -> Result<bool, AttachError> {
        Ok(self.socket()?.is_some())
    }

    /// Starts the JVM's attach listener: the trigger file, SIGQUIT, then a wait of at most
    /// `wait` for its socket. The caller has checked that the process is a HotSpot JVM
    /// that handles SIGQUIT ([`super::detect`]).
    pub fn start_listener(&self, wait: Duration) -> Result<(), AttachError> {
        let pid = self.handle.pid();
        let io = |what: &'static str| move |source| AttachError::Io { pid, what, source };
        let name = format!(".attach_pid{}", self.nspid);
        let created = match nix::fcntl::openat(
            self.tmp.as_fd(),
            name.as_str(),
            OFlag::O_CREAT
                | OFlag::O_EXCL
                | OFlag::O_WRONLY
                | OFlag::O_NOFOLLOW
                | OFlag::O_NONBLOCK
                | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        ) {
            Ok(fd) => {
                // The JVM takes a trigger file of its own user or root's; its own user's
                // can also be removed by it should the agent not get to it.
                let _ = nix::unistd::fchown(
                    &fd,
                    Some(nix::unistd::Uid::from_raw(self.uid)),
                    Some(nix::unistd::Gid::from_raw(self.gid)),
                );
                true
            }
            // One is there already (another attacher's, or the workload's own): the JVM
            // decides whether it counts; it is not the agent's to remove.
            Err(nix::errno::Errno::EEXIST) => false,
            Err(e) => return Err(io("creating the attach trigger file")(e.into())),
        };
        let result = (|| {
            self.handle
                .signal(libc::SIGQUIT)
                .map_err(io("sending SIGQUIT"))?;
            let started = Instant::now();
            loop {
                if self.socket()?.is_some() {
                    return Ok(());
                }
                if started.elapsed() >= wait {
                    return Err(AttachError::NoListener {
                        pid,
                        waited: started.elapsed(),
                    });
                }
                std::thread::sleep(POLL);
            }
        })();
        if created {
            let _ = nix::unistd::unlinkat(
                self.tmp.as_fd(),
                name.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
        result
    }

    /// Runs diagnostic command `command` (as `jcmd PID command` does), waiting at most
    /// `timeout` for the whole reply; its output.
    pub fn jcmd(&self, command: &str, timeout: Duration) -> Result<String, AttachError> {
        let pid = self.handle.pid();
        let io = |what: &'static str| move |source| AttachError::Io { pid, what, source };
        let socket = self.socket()?.ok_or(AttachError::NotListening { pid })?;
        let mut stream = UnixStream::connect(format!("/proc/self/fd/{}", socket.as_raw_fd()))
            .map_err(io("connecting to the attach listener"))?;
        let deadline = Instant::now() + timeout;
        stream
            .set_write_timeout(Some(timeout))
            .and_then(|()| stream.set_read_timeout(Some(timeout)))
            .map_err(io("setting the attach socket's timeouts"))?;
        let mut request = b"1\0jcmd\0".to_vec();
        request.extend_from_slice(command.as_bytes());
        request.extend_from_slice(b"\0\0\0");
        stream
            .write_all(&request)
            .map_err(io("writing to the attach listener"))?;
        let mut reply = Vec::new();
        let mut buf = [0u8; 8192];
        while reply.len() < MAX_REPLY {
            if Instant::now() >= deadline {
                return Err(io("reading the attach reply")(std::io::Error::from(
                    std::io::ErrorKind::TimedOut,
                )));
            }
            let n = stream
                .read(&mut buf)
                .map_err(io("reading the attach reply"))?;
            if n == 0 {
                break;
            }
            reply.extend_from_slice(&buf[..n.min(MAX_REPLY - reply.len())]);
        }
        let text = String::from_utf8_lossy(&reply);
        let (status, output) = text.split_once('\n').unwrap_or((&text, ""));
        if status.trim() != "0" {
            return Err(AttachError::Refused {
                pid,
                command: command.to_owned(),
                status: status.trim().chars().take(32).collect(),
                message: output.chars().take(200).collect(),
            });
        }
        Ok(output.to_owned())
    }

    /// The listener's socket, if one is there: an `O_PATH` descriptor of it, checked.
    fn socket(&self) -> Result<Option<OwnedFd>, AttachError> {
        let pid = self.handle.pid();
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(
                ResolveFlag::RESOLVE_BENEATH
                    | ResolveFlag::RESOLVE_NO_SYMLINKS
                    | ResolveFlag::RESOLVE_NO_MAGICLINKS,
            );
        let fd = match openat2(
            self.tmp.as_fd(),
            format!(".java_pid{}", self.nspid).as_str(),
            how,
        ) {
            Ok(fd) => fd,
            Err(nix::errno::Errno::ENOENT) => return Ok(None),
            Err(e) => {
                return Err(AttachError::Io {
                    pid,
                    what: "opening the attach listener's socket",
                    source: e.into(),
                });
            }
        };
        let st = nix::sys::stat::fstat(&fd).map_err(|e| AttachError::Io {
            pid,
            what: "checking the attach listener's socket",
            source: e.into(),
        })?;
        let is_socket = st.st_mode & libc::S_IFMT == libc::S_IFSOCK;
        if !is_socket || (st.st_uid != self.uid && st.st_uid != 0) {
            return Err(AttachError::NotOurSocket {
                pid,
                nspid: self.nspid,
                uid: self.uid,
            });
        }
        Ok(Some(fd))
    }
}

/// What [`AttachError::AsUser`] says: for a refusal, which capabilities to grant and how.
fn switch_message(pid: u32, uid: u32, gid: u32, source: &std::io::Error) -> String {
    if uid == u32::MAX || gid == u32::MAX {
        return format!("not attached: the user and group of process {pid} could not be read");
    }
    let agent = nix::unistd::geteuid();
    if source.raw_os_error() == Some(libc::EPERM) {
        return format!(
            "not attached: the JVM (pid {pid}) runs as uid {uid} (gid {gid}), the agent as \
             uid {agent}: the agent attaches as the JVM's user, which needs CAP_SETUID and CAP_SETGID, and it \
             has not got them (set the chart value agent.javaAttachOtherUsers=true; \
             docs/security.md, \"JVMs of other users\")"
        );
    }
    format!(
        "taking the user (uid {uid}) and group (gid {gid}) of the JVM (pid {pid}) for the \
         attach: {source}"
    )
}

/// Runs `f` on a thread of its own that first takes user `uid` and group `gid` (and no
/// supplementary groups), and ends with `f`: every other thread of the agent keeps its
/// identity and capabilities. The switch goes through the raw system calls, which change
/// the calling thread only (libc's wrappers change every thread of the process), and drops
/// the thread's capabilities (its IDs are no longer 0). Needs `CAP_SETUID` and `CAP_SETGID`;
/// without them, [`AttachError::AsUser`] says so and `f` does not run.
pub fn as_user<T: Send>(
    pid: u32,
    uid: u32,
    gid: u32,
    f: impl FnOnce() -> T + Send,
) -> Result<T, AttachError> {
    let refused = |source| AttachError::AsUser {
        pid,
        uid,
        gid,
        source,
    };
    // -1 leaves an ID unchanged: an unknown ID must never mean "stay root".
    if uid == u32::MAX || gid == u32::MAX {
        return Err(refused(std::io::Error::from(
            std::io::ErrorKind::InvalidData,
        )));
    }
    // A thread's change of user makes the kernel mark the whole process not dumpable
    // (`/proc/<agent>` then belongs to root, core dumps stop): put back what it was.
    // SAFETY: prctl(PR_GET_DUMPABLE) takes no pointer.
    let dumpable = unsafe { libc::prctl(libc::PR_GET_DUMPABLE) };
    let outcome = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("java-attach".into())
            .spawn_scoped(scope, move || {
                take_identity(uid, gid)?;
                Ok(f())
            })
            .map(|thread| thread.join())
    });
    if dumpable == 1 {
        // SAFETY: prctl(PR_SET_DUMPABLE, 1) takes no pointer.
        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1) };
    }
    match outcome {
        Ok(Ok(result)) => result.map_err(refused),
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(spawn) => Err(refused(spawn)),
    }
}

/// The calling thread becomes `uid`/`gid` with no supplementary groups.
fn take_identity(uid: u32, gid: u32) -> std::io::Result<()> {
    let check = |r: libc::c_long| {
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    // SAFETY: raw set*id system calls on the calling thread: integer arguments and, for
    // setgroups, an empty list (no pointer is read).
    unsafe {
        check(libc::syscall(
            libc::SYS_setgroups,
            0 as libc::c_long,
            std::ptr::null::<libc::gid_t>(),
        ))?;
        let (uid, gid) = (libc::c_long::from(uid), libc::c_long::from(gid));
        check(libc::syscall(libc::SYS_setresgid, gid, gid, gid))?;
        check(libc::syscall(libc::SYS_setresuid, uid, uid, uid))?;
    }
    Ok(())
}

/// `/tmp` inside the root of `pid`, as an `O_PATH` directory descriptor.
fn tmp_dir(pid: u32) -> std::io::Result<OwnedFd> {
    let root = nix::fcntl::open(
        format!("/proc/{pid}/root").as_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    Ok(openat2(root.as_fd(), "tmp", how)?)
}
