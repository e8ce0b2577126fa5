//! A capture's window and what ends it early: the [`Stop`] a front door (the service's
//! Cancel) sets, which the thread running the window sees at once, whatever the engine is
//! waiting for.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

/// How a capture's window ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowEnd {
    /// It ran its whole length.
    Elapsed,
    /// [`Stop::stop`] ended it early; the capture is to be dropped, not finished.
    Stopped,
}

/// Ends a capture's window early. Cheap to clone: the thread running the window and the
/// one that stops it share it.
#[derive(Debug, Clone, Default)]
pub struct Stop(Arc<(Mutex<bool>, Condvar)>);

impl Stop {
    /// A stop nobody has set yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Ends the window: every sleep on this stop returns at once, now and later.
    pub fn stop(&self) {
        let (stopped, changed) = &*self.0;
        *stopped.lock().unwrap_or_else(PoisonError::into_inner) = true;
        changed.notify_all();
    }

    /// Whether [`Self::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        *self.0.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sleeps until `deadline`, or less when stopped; [`WindowEnd::Stopped`] then.
    pub fn sleep_until(&self, deadline: Instant) -> WindowEnd {
        let (stopped, changed) = &*self.0;
        let mut guard = stopped.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if *guard {
                return WindowEnd::Stopped;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return WindowEnd::Elapsed;
            };
            guard = changed
                .wait_timeout(guard, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_stop_ends_a_sleep_at_once_and_every_later_one() {
        let stop = Stop::new();
        let far = Instant::now() + Duration::from_secs(3600);
        let sleeper = {
            let stop = stop.clone();
            std::thread::spawn(move || stop.sleep_until(far))
        };
        stop.stop();
        assert_eq!(sleeper.join().unwrap(), WindowEnd::Stopped);
        assert!(stop.is_stopped());
        assert_eq!(stop.sleep_until(far), WindowEnd::Stopped);
        let fresh = Stop::new();
        assert_eq!(
            fresh.sleep_until(Instant::now() + Duration::from_millis(5)),
            WindowEnd::Elapsed
        );
    }
}
