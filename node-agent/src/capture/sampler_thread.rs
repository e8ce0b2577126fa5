//! The thread that owns a sampler's loaded BPF object.
//!
//! libbpf objects are neither `Send` nor free of borrows (skeletons borrow
//! their `OpenObject`), so each sampler keeps its object on the stack of one
//! thread, which also polls the object's ring buffer. Other threads talk to
//! the maps through `MapHandle`s (duplicated fds) the thread hands out once
//! loaded. Dropping the [`OwnerThread`] stops the thread, which detaches the
//! programs and closes the perf events. Between events the thread sleeps in
//! `poll(2)` ([`Waker::wait`]): no periodic wakeups.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::{CaptureError, Result};

/// Wakes an owner thread: to stop it, or to look at its inbox. An eventfd, so the thread
/// can sleep in `poll(2)` on it together with its ring buffer: a loaded sampler costs no
/// periodic wakeups (a daemon that samples around the clock would otherwise wake 20-50
/// times a second per sampler just to check a flag).
#[derive(Debug)]
pub(crate) struct Waker {
    stopped: AtomicBool,
    fd: OwnedFd,
}

/// Why [`Waker::wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Woken {
    /// The thread must stop.
    Stop,
    /// Kicked ([`Waker::kick`]), the watched fd is readable, or the timeout passed.
    Look,
}

impl Waker {
    fn new() -> std::io::Result<Self> {
        // SAFETY: eventfd(2) returns a new fd or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            stopped: AtomicBool::new(false),
            // SAFETY: a fresh fd nobody else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Wakes the thread (it looks at its inbox).
    pub(crate) fn kick(&self) {
        let one = 1u64;
        // SAFETY: writing 8 bytes from a valid u64 to our eventfd. A full counter (EAGAIN)
        // already means "wake up".
        unsafe { libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.kick();
    }

    /// Whether the thread must stop.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Sleeps until stopped or kicked, until `also` is readable (a ring buffer's epoll
    /// fd), or for at most `timeout` (`None`: no limit).
    pub(crate) fn wait(&self, also: Option<RawFd>, timeout: Option<Duration>) -> Woken {
        if self.stopped() {
            return Woken::Stop;
        }
        let mut fds = [
            libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: also.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX));
        // SAFETY: two valid pollfd entries (a negative fd is ignored by poll).
        unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if fds[0].revents & libc::POLLIN != 0 {
            let mut count = 0u64;
            // SAFETY: reading the 8-byte counter into a valid u64 (resets it).
            unsafe { libc::read(self.fd.as_raw_fd(), (&raw mut count).cast(), 8) };
        }
        if self.stopped() {
            Woken::Stop
        } else {
            Woken::Look
        }
    }
}

/// Handle on a running owner thread; stops and joins it on drop.
#[derive(Debug)]
pub(crate) struct OwnerThread {
    waker: Arc<Waker>,
    handle: Option<JoinHandle<()>>,
}

impl OwnerThread {
    /// Whether the thread still runs (it only ends when stopped, or by a panic).
    pub(crate) fn is_alive(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| !h.is_finished())
    }
}

impl OwnerThread {
    /// The thread's waker (to kick it after putting work in its inbox).
    pub(crate) fn waker(&self) -> Arc<Waker> {
        self.waker.clone()
    }
}

impl Drop for OwnerThread {
    fn drop(&mut self) {
        self.waker.stop();
        if let Some(h) = self.handle.take() {
            // A panicking sampler thread has nothing left to clean up.
            let _ = h.join();
        }
    }
}

/// Reports the load result from inside the owner thread.
pub(crate) type Ready<H> = mpsc::SyncSender<Result<H>>;

/// The body of the owner thread of a sampler whose programs announce processes on a ring
/// buffer: reports `loaded`'s handles (or its error), then consumes the ring whenever it
/// has process events, sleeping in between, until the sampler stops. `keep` (the links,
/// then the skeleton they borrow from) is dropped then, in that order.
pub(crate) fn serve_ring<H, K>(
    ready: Ready<H>,
    stop: &Waker,
    loaded: Result<(H, libbpf_rs::RingBuffer<'static>, K)>,
) {
    match loaded {
        Ok((handles, ring, keep)) => {
            if ready.send(Ok(handles)).is_err() {
                return;
            }
            // Consume errors are EINTR.
            while stop.wait(Some(ring.epoll_fd()), None) == Woken::Look {
                let _ = ring.consume();
            }
            drop(keep);
        }
        Err(e) => {
            let _ = ready.send(Err(e));
        }
    }
}

/// Runs `body` on a new thread named `name` and waits until it reports
/// through its `Ready` sender (handles after a successful load, or the load
/// error). `body` must then run until its [`Waker`] says stop, sleeping in
/// [`Waker::wait`] in between.
pub(crate) fn spawn<H, F>(name: &'static str, body: F) -> Result<(H, OwnerThread)>
where
    H: Send + 'static,
    F: FnOnce(Ready<H>, Arc<Waker>) + Send + 'static,
{
    let waker = Arc::new(Waker::new().map_err(|source| CaptureError::Io {
        action: format!("creating the {name} sampler thread's eventfd"),
        source,
    })?);
    let (tx, rx) = mpsc::sync_channel(1);
    let thread_waker = waker.clone();
    let handle = std::thread::Builder::new()
        .name(format!("ff-{name}"))
        .spawn(move || body(tx, thread_waker))
        .map_err(|source| CaptureError::Io {
            action: format!("starting the {name} sampler thread"),
            source,
        })?;
    let owner = OwnerThread {
        waker,
        handle: Some(handle),
    };
    match rx.recv() {
        Ok(Ok(handles)) => Ok((handles, owner)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(CaptureError::SamplerGone(name)),
    }
}
