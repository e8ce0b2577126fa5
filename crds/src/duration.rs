//! Durations as written in specs (`30s`, `2m`, `1m30s`, `1.5s`, `250ms`).
//!
//! The grammar is exactly [`DURATION_PATTERN`], the pattern the CRD schema enforces, and a
//! subset of what the API server's CEL `duration()` accepts, so anything the API server
//! admitted parses here. It is hand-written rather than taken from `humantime` because
//! `humantime` accepts a different language (`1min`, `30 s`, `1sec`) than the schema.

use std::time::Duration;

use crate::{Error, Result};

/// The regular expression the schema enforces on duration strings.
pub const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$";

/// Shortest capture a ProfileRequest may ask for.
pub const MIN_CAPTURE_DURATION: Duration = Duration::from_secs(1);
/// Longest capture a ProfileRequest may ask for.
pub const MAX_CAPTURE_DURATION: Duration = Duration::from_secs(600);

/// Parses a duration such as `30s`, `2m`, `1m30s`, `1.5s` or `250ms`.
///
/// # Errors
/// [`Error::InvalidDuration`] when `input` does not match [`DURATION_PATTERN`] or overflows.
pub fn parse_duration(input: &str) -> Result<Duration> {
    let invalid = |reason: &str| Error::InvalidDuration {
        found: input.to_string(),
        reason: reason.to_string(),
    };
    if input.is_empty() {
        return Err(invalid("it is empty"));
    }
    let mut rest = input;
    let mut total_nanos: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        if int_len == 0 {
            return Err(invalid("each part must start with a digit"));
        }
        let (int_part, after_int) = rest.split_at(int_len);
        let (frac_part, after_number) = match after_int.strip_prefix('.') {
            Some(after_dot) => {
                let frac_len = after_dot.bytes().take_while(u8::is_ascii_digit).count();
                if frac_len == 0 {
                    return Err(invalid("a decimal point must be followed by digits"));
                }
                after_dot.split_at(frac_len)
            }
            None => ("", after_int),
        };
        let (unit_nanos, unit_len): (u128, usize) = if after_number.starts_with("ms") {
            (1_000_000, 2)
        } else if after_number.starts_with('s') {
            (1_000_000_000, 1)
        } else if after_number.starts_with('m') {
            (60_000_000_000, 1)
        } else if after_number.starts_with('h') {
            (3_600_000_000_000, 1)
        } else {
            return Err(invalid("each number needs a unit: ms, s, m or h"));
        };
        let whole: u128 = int_part
            .parse()
            .map_err(|_| invalid("a number is too large"))?;
        // Only the first 9 fractional digits can matter at nanosecond resolution.
        let frac_digits = &frac_part[..frac_part.len().min(9)];
        let frac_value: u128 = if frac_digits.is_empty() {
            0
        } else {
            frac_digits
                .parse()
                .map_err(|_| invalid("a fraction is malformed"))?
        };
        let frac_scale = 10u128.pow(u32::try_from(frac_digits.len()).unwrap_or(9));
        let part = whole
            .checked_mul(unit_nanos)
            .and_then(|n| n.checked_add(frac_value * unit_nanos / frac_scale))
            .ok_or_else(|| invalid("it is too large"))?;
        total_nanos = total_nanos
            .checked_add(part)
            .ok_or_else(|| invalid("it is too large"))?;
        rest = &after_number[unit_len..];
    }
    let secs =
        u64::try_from(total_nanos / 1_000_000_000).map_err(|_| invalid("it is too large"))?;
    // The remainder is below 1e9 and always fits.
    let nanos = u32::try_from(total_nanos % 1_000_000_000).unwrap_or(0);
    Ok(Duration::new(secs, nanos))
}

/// Parses a capture duration and checks it lies within 1s..=10m, the schema's bounds.
///
/// # Errors
/// [`Error::InvalidDuration`] or [`Error::DurationOutOfRange`].
pub fn parse_capture_duration(input: &str) -> Result<Duration> {
    let duration = parse_duration(input)?;
    if !(MIN_CAPTURE_DURATION..=MAX_CAPTURE_DURATION).contains(&duration) {
        return Err(Error::DurationOutOfRange {
            found: input.to_string(),
            min: MIN_CAPTURE_DURATION,
            max: MAX_CAPTURE_DURATION,
        });
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_the_schema_accepts() {
        let cases = [
            ("30s", Duration::from_secs(30)),
            ("2m", Duration::from_secs(120)),
            ("1m30s", Duration::from_secs(90)),
            ("1.5s", Duration::from_millis(1500)),
            ("250ms", Duration::from_millis(250)),
            ("1h", Duration::from_secs(3600)),
            ("0.000000001s", Duration::from_nanos(1)),
            ("1m0.25s", Duration::from_millis(60_250)),
        ];
        for (input, expected) in cases {
            assert_eq!(parse_duration(input).unwrap(), expected, "{input}");
        }
    }

    #[test]
    fn rejects_what_the_schema_rejects() {
        for input in [
            "", "30", "s", "-5s", "1.s", ".5s", "5 s", "5sec", "1d", "5us", "abc",
        ] {
            let err = parse_duration(input).unwrap_err();
            assert!(
                matches!(err, Error::InvalidDuration { .. }),
                "{input}: {err}"
            );
            assert!(err.to_string().contains("e.g. \"30s\""), "{err}");
        }
    }

    #[test]
    fn rejects_overflow_instead_of_wrapping() {
        let huge = format!("{}h", "9".repeat(40));
        assert!(parse_duration(&huge).is_err());
    }

    #[test]
    fn capture_duration_bounds_are_inclusive() {
        assert_eq!(parse_capture_duration("1s").unwrap(), MIN_CAPTURE_DURATION);
        assert_eq!(parse_capture_duration("10m").unwrap(), MAX_CAPTURE_DURATION);
        for input in ["0s", "999ms", "10m1s", "1h"] {
            let err = parse_capture_duration(input).unwrap_err();
            assert!(
                matches!(err, Error::DurationOutOfRange { .. }),
                "{input}: {err}"
            );
        }
    }
}
