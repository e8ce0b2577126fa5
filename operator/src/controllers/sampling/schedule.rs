//! Schedules of sampling policies: cron patterns parsed by the `croner` crate (five fields,
//! or six with a leading seconds field, or a macro such as `@hourly`), evaluated in the
//! policy's IANA time zone (UTC by default), as a CronJob's `timeZone` is.

use std::time::Duration;

use croner::Cron;
use croner::parser::{CronParser, Seconds};
use jiff::tz::TimeZone;
use jiff::{Timestamp, Zoned};

/// At most this many missed times are created late in one go (older ones count as missed).
pub const MAX_LATE_RUNS: usize = 10;
/// Missed times are counted up to this many; past it the count says "at least".
const MISSED_COUNT_LIMIT: u64 = 10_000;

/// A parsed schedule.
#[derive(Debug, Clone)]
pub struct Schedule {
    cron: Cron,
    zone: TimeZone,
}

/// Why a schedule cannot be used (the text goes into the `ScheduleValid` condition).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// The cron library refused the pattern.
    #[error("schedule {schedule:?} is not a valid cron pattern: {reason}")]
    Pattern {
        /// The schedule as written.
        schedule: String,
        /// The parser's message.
        reason: String,
    },
    /// The time zone is not in the IANA database.
    #[error(
        "timeZone {zone:?} is not a known IANA time zone ({reason}); use a name such as \"Europe/Paris\" or \"UTC\""
    )]
    Zone {
        /// The zone as written.
        zone: String,
        /// The lookup's message.
        reason: String,
    },
    /// The pattern parses but no time ever matches it (e.g. February 30).
    #[error("schedule {schedule:?} never matches any time: {reason}")]
    NeverMatches {
        /// The schedule as written.
        schedule: String,
        /// The search's message.
        reason: String,
    },
}

impl ScheduleError {
    /// The condition reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Pattern { .. } => "InvalidSchedule",
            Self::Zone { .. } => "UnknownTimeZone",
            Self::NeverMatches { .. } => "ScheduleNeverMatches",
        }
    }
}

/// Parses `schedule` in `time_zone` and checks that it matches at least once after `now`.
///
/// # Errors
/// [`ScheduleError`] naming what is wrong.
pub fn parse(
    schedule: &str,
    time_zone: Option<&str>,
    now: Timestamp,
) -> Result<Schedule, ScheduleError> {
    let cron = CronParser::builder()
        .seconds(Seconds::Optional)
        .build()
        .parse(schedule.trim())
        .map_err(|e| ScheduleError::Pattern {
            schedule: schedule.to_string(),
            reason: e.to_string(),
        })?;
    let zone = match time_zone {
        None => TimeZone::UTC,
        Some(name) => TimeZone::get(name).map_err(|e| ScheduleError::Zone {
            zone: name.to_string(),
            reason: e.to_string(),
        })?,
    };
    let parsed = Schedule { cron, zone };
    parsed
        .cron
        .find_next_occurrence(&parsed.zoned(now), false)
        .map_err(|e| ScheduleError::NeverMatches {
            schedule: schedule.to_string(),
            reason: e.to_string(),
        })?;
    Ok(parsed)
}

/// What is due at `now`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Due {
    /// Scheduled times to create runs for now, ascending: every time after the last one
    /// handled and no older than the starting deadline (at most [`MAX_LATE_RUNS`], the most
    /// recent).
    pub run: Vec<Timestamp>,
    /// Scheduled times passed over: older than the deadline, or beyond [`MAX_LATE_RUNS`].
    pub missed: u64,
    /// The next scheduled time after `now`.
    pub next: Option<Timestamp>,
}

impl Schedule {
    fn zoned(&self, t: Timestamp) -> Zoned {
        t.to_zoned(self.zone.clone())
    }

    /// The first scheduled time strictly after `t`.
    pub fn next_after(&self, t: Timestamp) -> Option<Timestamp> {
        self.cron
            .find_next_occurrence(&self.zoned(t), false)
            .ok()
            .map(|z| z.timestamp())
    }

    /// The scheduled times in `(last, now]` that are due, given a starting deadline.
    pub fn due(&self, last: Timestamp, now: Timestamp, deadline: Duration) -> Due {
        let deadline =
            jiff::SignedDuration::try_from(deadline).unwrap_or(jiff::SignedDuration::MAX);
        let oldest_allowed = now.checked_sub(deadline).unwrap_or(Timestamp::MIN);
        let mut due = Due::default();
        let mut t = last;
        let mut counted = 0u64;
        // Times older than the deadline are counted, never run. Jump over a long gap instead
        // of walking it second by second: start the walk just before the window.
        if t < oldest_allowed {
            let before_window = oldest_allowed
                .checked_sub(jiff::SignedDuration::from_secs(1))
                .unwrap_or(oldest_allowed);
            while let Some(next) = self.next_after(t) {
                if next >= oldest_allowed || counted >= MISSED_COUNT_LIMIT {
                    break;
                }
                counted += 1;
                t = next;
            }
            if counted >= MISSED_COUNT_LIMIT {
                t = before_window;
            }
            due.missed = counted;
        }
        while let Some(next) = self.next_after(t) {
            if next > now {
                due.next = Some(next);
                break;
            }
            due.run.push(next);
            t = next;
        }
        if due.run.len() > MAX_LATE_RUNS {
            let extra = due.run.len() - MAX_LATE_RUNS;
            due.run.drain(..extra);
            due.missed += extra as u64;
        }
        if due.next.is_none() {
            due.next = self.next_after(now);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn now() -> Timestamp {
        at("2026-01-05T10:00:30Z")
    }

    #[test]
    fn rejects_what_the_old_schema_let_through() {
        for bad in [
            "99 99 99 99 99",
            "xyz abc def ghi jkl",
            "* * * *",
            "61 * * * *",
        ] {
            let err = parse(bad, None, now()).unwrap_err();
            assert_eq!(err.reason(), "InvalidSchedule", "{bad}: {err}");
        }
        let never = parse("0 0 30 2 *", None, now()).unwrap_err();
        assert_eq!(never.reason(), "ScheduleNeverMatches", "{never}");
        let zone = parse("* * * * *", Some("Mars/Olympus"), now()).unwrap_err();
        assert_eq!(zone.reason(), "UnknownTimeZone");
        assert!(zone.to_string().contains("Mars/Olympus"));
    }

    #[test]
    fn five_and_six_fields_and_macros() {
        let every_5m = parse("*/5 * * * *", None, now()).unwrap();
        assert_eq!(every_5m.next_after(now()), Some(at("2026-01-05T10:05:00Z")));
        let every_10s = parse("*/10 * * * * *", None, now()).unwrap();
        assert_eq!(
            every_10s.next_after(now()),
            Some(at("2026-01-05T10:00:40Z"))
        );
        let hourly = parse("@hourly", None, now()).unwrap();
        assert_eq!(hourly.next_after(now()), Some(at("2026-01-05T11:00:00Z")));
        let weekdays = parse("0 9 * * MON-FRI", None, now()).unwrap();
        // 2026-01-05 is a Monday.
        assert_eq!(weekdays.next_after(now()), Some(at("2026-01-06T09:00:00Z")));
    }

    #[test]
    fn time_zone_shifts_the_schedule() {
        let paris = parse("0 12 * * *", Some("Europe/Paris"), now()).unwrap();
        // Noon in Paris in January is 11:00 UTC.
        assert_eq!(paris.next_after(now()), Some(at("2026-01-05T11:00:00Z")));
    }

    #[test]
    fn due_runs_every_time_within_the_deadline_and_counts_the_rest() {
        let s = parse("*/10 * * * * *", None, now()).unwrap();
        // Last handled 10:00:00; now 10:00:30; deadline 60s: 10, 20, 30 are due.
        let due = s.due(at("2026-01-05T10:00:00Z"), now(), Duration::from_secs(60));
        assert_eq!(
            due.run,
            [
                at("2026-01-05T10:00:10Z"),
                at("2026-01-05T10:00:20Z"),
                at("2026-01-05T10:00:30Z")
            ]
        );
        assert_eq!(due.missed, 0);
        assert_eq!(due.next, Some(at("2026-01-05T10:00:40Z")));
        // Deadline 15s: only 20 and 30 are still in time; 10 is missed.
        let due = s.due(at("2026-01-05T10:00:00Z"), now(), Duration::from_secs(15));
        assert_eq!(due.run.len(), 2);
        assert_eq!(due.missed, 1);
        // Nothing new since the last run.
        let due = s.due(now(), now(), Duration::from_secs(15));
        assert!(due.run.is_empty());
        assert_eq!(due.missed, 0);
    }

    #[test]
    fn a_long_outage_is_counted_without_walking_every_second() {
        let s = parse("* * * * * *", None, now()).unwrap();
        let due = s.due(at("2025-01-05T10:00:00Z"), now(), Duration::from_secs(5));
        // 10:00:25 ..= 10:00:30: the deadline's both ends are in time.
        assert_eq!(due.run.len(), 6);
        assert!(due.missed >= MISSED_COUNT_LIMIT, "{}", due.missed);
        // More than MAX_LATE_RUNS in the window: the most recent ones run.
        let due = s.due(at("2026-01-05T10:00:00Z"), now(), Duration::from_secs(60));
        assert_eq!(due.run.len(), MAX_LATE_RUNS);
        assert_eq!(due.run.last(), Some(&now()));
        assert_eq!(due.missed, 20);
    }
}
