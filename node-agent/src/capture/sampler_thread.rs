//! The thread that owns a sampler's loaded BPF object.
//!
//! libbpf objects are neither `Send` nor free of borrows (skeletons borrow
//! their `OpenObject`), so each sampler keeps its object on the stack of one
//! thread, which also polls the object's ring buffer. Other threads talk to
//! the maps through `MapHandle`s (duplicated fds) the thread hands out once
//! loaded. Dropping the [`OwnerThread`] stops the thread, which detaches the
//! programs and closes the perf events.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use super::{CaptureError, Result};

/// Handle on a running owner thread; stops and joins it on drop.
#[derive(Debug)]
pub(crate) struct OwnerThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl OwnerThread {
    /// Whether the thread still runs (it only ends when stopped, or by a panic).
    pub(crate) fn is_alive(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| !h.is_finished())
    }
}

impl Drop for OwnerThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            // A panicking sampler thread has nothing left to clean up.
            let _ = h.join();
        }
    }
}

/// Reports the load result from inside the owner thread.
pub(crate) type Ready<H> = mpsc::SyncSender<Result<H>>;

/// Runs `body` on a new thread named `name` and waits until it reports
/// through its `Ready` sender (handles after a successful load, or the load
/// error). `body` must then run until the stop flag is set.
pub(crate) fn spawn<H, F>(name: &'static str, body: F) -> Result<(H, OwnerThread)>
where
    H: Send + 'static,
    F: FnOnce(Ready<H>, Arc<AtomicBool>) + Send + 'static,
{
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::sync_channel(1);
    let flag = stop.clone();
    let handle = std::thread::Builder::new()
        .name(format!("ff-{name}"))
        .spawn(move || body(tx, flag))
        .map_err(|source| CaptureError::Io {
            action: format!("starting the {name} sampler thread"),
            source,
        })?;
    let owner = OwnerThread {
        stop,
        handle: Some(handle),
    };
    match rx.recv() {
        Ok(Ok(handles)) => Ok((handles, owner)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(CaptureError::SamplerGone(name)),
    }
}
