//! What bounds the fires: a cooldown per (cgroup, trigger) and a node-wide budget.
//!
//! A pod controls its own cgroup's counters: it can hold a condition true for hours or
//! flip it a thousand times a second. Neither may cost more than one fire per cooldown
//! per trigger, and all the pods of a node together no more than the node's budget of
//! fires per minute; what is held back is counted, never queued.

use std::time::{Duration, Instant};

/// The cooldown of one (cgroup, trigger).
#[derive(Debug, Clone)]
pub struct Cooldown {
    period: Duration,
    last: Option<Instant>,
    /// Times the condition held within the cooldown and did not fire.
    pub held_back: u64,
}

impl Cooldown {
    /// A cooldown of `period` that has not fired.
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            last: None,
            held_back: 0,
        }
    }

    /// Whether a fire is allowed at `now` (counting one held back when not).
    pub fn allows(&mut self, now: Instant) -> bool {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < self.period => {
                self.held_back += 1;
                false
            }
            _ => true,
        }
    }

    /// Records a fire at `now`.
    pub fn fired(&mut self, now: Instant) {
        self.last = Some(now);
    }

    /// When the cooldown ends (`None`: not cooling down).
    pub fn ends(&self, now: Instant) -> Option<Instant> {
        let end = self.last? + self.period;
        (end > now).then_some(end)
    }
}

/// The node's budget of fires: a token bucket of `per_minute` tokens, refilled evenly.
#[derive(Debug, Clone)]
pub struct FireBudget {
    per_minute: u32,
    tokens: f64,
    at: Instant,
    /// Fires refused for the budget.
    pub refused: u64,
}

impl FireBudget {
    /// A full bucket of `per_minute` (at least 1).
    pub fn new(per_minute: u32, now: Instant) -> Self {
        let per_minute = per_minute.max(1);
        Self {
            per_minute,
            tokens: f64::from(per_minute),
            at: now,
            refused: 0,
        }
    }

    /// Takes a token at `now` when there is one.
    pub fn take(&mut self, now: Instant) -> bool {
        let cap = f64::from(self.per_minute);
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * cap / 60.0).min(cap);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            self.refused += 1;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_condition_held_or_flapping_fires_once_per_cooldown() {
        let t0 = Instant::now();
        let mut c = Cooldown::new(Duration::from_secs(60));
        let mut fires = 0;
        // True every 10 ms for ten minutes.
        for i in 0..60_000u64 {
            let now = t0 + Duration::from_millis(i * 10);
            if c.allows(now) {
                c.fired(now);
                fires += 1;
            }
        }
        assert_eq!(fires, 10);
        assert_eq!(c.held_back, 60_000 - 10);
        assert!(c.ends(t0 + Duration::from_secs(590)).is_some());
        assert!(c.ends(t0 + Duration::from_secs(600)).is_none());
    }

    #[test]
    fn the_node_budget_refills_evenly() {
        let t0 = Instant::now();
        let mut b = FireBudget::new(6, t0);
        assert!((0..6).all(|_| b.take(t0)));
        assert!(!b.take(t0));
        assert!(!b.take(t0 + Duration::from_secs(9)));
        assert!(b.take(t0 + Duration::from_secs(10)));
        assert_eq!(b.refused, 2);
    }
}
