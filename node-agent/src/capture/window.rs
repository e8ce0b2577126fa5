//! A capture's window: until when it runs, the work an engine does during it (the heap
//! source's rescans, the CPU engine's early symbolization), and what ends it early, the
//! [`Stop`] a front door (the service's Cancel) sets. A window is idle between its works,
//! so a front door need not hold a thread for it: the service waits asynchronously and
//! hands each work to a thread; the command line runs it all on its own thread ([`run`]).

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

/// A capture's window, as the front door that runs it sees it.
pub trait Window {
    /// Why a work failed.
    type Error;

    /// When the window ends; `None` for a capture without one (it reads a snapshot and
    /// can finish at once).
    fn deadline(&self) -> Option<Instant>;

    /// When the capture next has work to do during its window; `None` for none before its
    /// deadline. Once [`Window::work`] ran, this moves on.
    fn next_work(&self) -> Option<Instant>;

    /// Does the work due now (blocking, short).
    ///
    /// # Errors
    /// The engine's.
    fn work(&mut self) -> Result<(), Self::Error>;
}

/// Runs `window` on this thread until its deadline, doing its work when due; ends early,
/// with [`WindowEnd::Stopped`], when `stop` is set.
///
/// # Errors
/// A failed work.
pub fn run<W: Window + ?Sized>(window: &mut W, stop: &Stop) -> Result<WindowEnd, W::Error> {
    let Some(deadline) = window.deadline() else {
        return Ok(WindowEnd::Elapsed);
    };
    loop {
        let wake = window.next_work().map_or(deadline, |t| t.min(deadline));
        if stop.sleep_until(wake) == WindowEnd::Stopped {
            return Ok(WindowEnd::Stopped);
        }
        if Instant::now() >= deadline {
            return Ok(WindowEnd::Elapsed);
        }
        window.work()?;
    }
}

/// How a capture's window ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowEnd {
    /// It ran its whole length.
    Elapsed,
    /// [`Stop::stop`] ended it early: the agent drops such a capture (a Cancel), the
    /// `capture` command finishes it (an interrupt keeps what was sampled).
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

    /// A window of 60 ms with work every 10 ms.
    struct Ticks {
        deadline: Instant,
        next: Instant,
        works: u32,
    }

    impl Window for Ticks {
        type Error = ();

        fn deadline(&self) -> Option<Instant> {
            Some(self.deadline)
        }

        fn next_work(&self) -> Option<Instant> {
            Some(self.next)
        }

        fn work(&mut self) -> Result<(), ()> {
            self.works += 1;
            self.next = Instant::now() + Duration::from_millis(10);
            Ok(())
        }
    }

    #[test]
    fn a_window_runs_its_work_until_its_deadline_or_a_stop() {
        let now = Instant::now();
        let mut w = Ticks {
            deadline: now + Duration::from_millis(60),
            next: now + Duration::from_millis(10),
            works: 0,
        };
        assert_eq!(run(&mut w, &Stop::new()), Ok(WindowEnd::Elapsed));
        assert!(Instant::now() >= w.deadline);
        assert!((2..=6).contains(&w.works), "{} works", w.works);
        let stop = Stop::new();
        stop.stop();
        let mut w = Ticks {
            deadline: Instant::now() + Duration::from_secs(3600),
            next: Instant::now(),
            works: 0,
        };
        assert_eq!(run(&mut w, &stop), Ok(WindowEnd::Stopped));
        assert_eq!(w.works, 0);
    }

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
