//! Checking command-line values before anything is sent: the same bounds and syntax as the
//! API server's schema (taken from `flamefleet-api`'s constants, which the schema is
//! generated from), so a bad value is a one-line usage error (exit 2), never an API error.
//!
//! Each `parse_*` function is a clap value parser: its `Err` text is what clap prints after
//! `invalid value 'X' for '--flag'`.

use std::time::Duration;

use flamefleet_api::duration::{parse_capture_duration, parse_duration};

/// Seconds in a day: `--since` and `--ttl` take days (`1d`), which the schema's durations
/// (`ms`, `s`, `m`, `h`) do not.
const DAY: u64 = 86_400;

/// Shortest `--ttl`: the CLI downloads the artifacts after the request finished, and the
/// operator deletes them with the request.
pub const MIN_TTL: Duration = Duration::from_secs(60);

/// Default `--ttl`: a day, long enough to download again, short enough not to pile up.
pub const DEFAULT_TTL: &str = "24h";

/// `--duration`: a capture duration as the schema accepts it (`30s`, `2m`, `1m30s`; 1s..10m).
pub fn parse_capture(text: &str) -> Result<String, String> {
    parse_capture_duration(text)
        .map(|_| text.to_owned())
        .map_err(|e| e.to_string())
}

/// A span of time for the CLI's own flags (`--since`, `--timeout`, `--ttl`): the schema's
/// duration forms, and days before them (`1d`, `2d12h`).
pub fn parse_span(text: &str) -> Result<Duration, String> {
    let invalid = |why: String| {
        format!(
            "{why}; expected a number with a unit (d, h, m, s, ms), e.g. \"90s\", \"2h\" or \"1d\""
        )
    };
    let (days, rest) = match text.split_once('d') {
        Some((days, rest)) if !days.is_empty() && days.bytes().all(|b| b.is_ascii_digit()) => {
            let days: u64 = days
                .parse()
                .map_err(|_| invalid(format!("{days} days is too long")))?;
            (days, rest)
        }
        _ => (0, text),
    };
    let rest = if rest.is_empty() && days > 0 {
        Duration::ZERO
    } else {
        parse_duration(rest).map_err(|_| invalid(format!("{text:?} is not a duration")))?
    };
    days.checked_mul(DAY)
        .map(Duration::from_secs)
        .and_then(|d| d.checked_add(rest))
        .ok_or_else(|| invalid(format!("{text:?} is too long")))
}

/// `--ttl`: how long the request and its artifacts are kept after it finished; `never`
/// keeps them until deleted.
pub fn parse_ttl(text: &str) -> Result<Ttl, String> {
    if text == "never" {
        return Ok(Ttl::Never);
    }
    let span = parse_span(text).map_err(|e| format!("{e}, or \"never\""))?;
    if span < MIN_TTL {
        return Err(format!(
            "at least {}s: the request and its artifacts are deleted that long after it finishes, and the download needs them (\"never\" keeps them)",
            MIN_TTL.as_secs()
        ));
    }
    i64::try_from(span.as_secs())
        .map(Ttl::Seconds)
        .map_err(|_| format!("{text:?} is too long"))
}

/// What `--ttl` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ttl {
    /// `ttlSecondsAfterFinished`.
    Seconds(i64),
    /// No `ttlSecondsAfterFinished`: kept until deleted.
    Never,
}

impl Ttl {
    /// The spec's `ttlSecondsAfterFinished`.
    pub fn seconds(self) -> Option<i64> {
        match self {
            Self::Seconds(s) => Some(s),
            Self::Never => None,
        }
    }
}

/// A label `key=value` for the created request, checked as the API server checks labels.
pub fn parse_label(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("expected key=value, found {text:?}"))?;
    check_label_key(key)?;
    check_label_value(value)?;
    Ok((key.to_owned(), value.to_owned()))
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a name of at most 63
/// characters (alphanumerics, `-`, `_`, `.`; alphanumeric at both ends).
pub fn check_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        check_dns_subdomain(prefix).map_err(|e| format!("label key {key:?}: prefix {e}"))?;
    }
    if name.is_empty() {
        return Err(format!("label key {key:?} has an empty name"));
    }
    check_label_value(name).map_err(|e| format!("label key {key:?}: {e}"))
}

/// A label value: empty, or at most 63 alphanumerics, `-`, `_`, `.`, alphanumeric at both
/// ends.
pub fn check_label_value(value: &str) -> Result<(), String> {
    let ends_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if value.is_empty() {
        return Ok(());
    }
    if value.len() > 63 {
        return Err(format!(
            "{value:?} is {} characters long; a label value has at most 63",
            value.len()
        ));
    }
    if !value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        || !ends_ok(value.chars().next())
        || !ends_ok(value.chars().last())
    {
        return Err(format!(
            "{value:?} is not a label value: use letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

/// An object name that is a DNS subdomain (pods, deployments, statefulsets, requests): at
/// most 253 lowercase alphanumerics, `-` and `.`, alphanumeric at both ends.
pub fn check_dns_subdomain(name: &str) -> Result<(), String> {
    let ends_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if name.is_empty() || name.len() > 253 {
        return Err(format!(
            "{name:?} must be 1 to 253 characters long, not {}",
            name.len()
        ));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'))
        || !ends_ok(name.chars().next())
        || !ends_ok(name.chars().last())
    {
        return Err(format!(
            "{name:?} is not a valid name: use lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_take_days_and_the_schema_forms() {
        assert_eq!(parse_span("1d"), Ok(Duration::from_secs(DAY)));
        assert_eq!(
            parse_span("2d12h"),
            Ok(Duration::from_secs(2 * DAY + 12 * 3600))
        );
        assert_eq!(parse_span("90m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_span("1m30s"), Ok(Duration::from_secs(90)));
        for bad in ["", "d", "1 day", "5 seconds", "1dd", "-1d", "1.5d"] {
            assert!(parse_span(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(parse_span("99999999999999999999d").is_err());
    }

    #[test]
    fn capture_durations_have_the_schemas_bounds() {
        assert_eq!(parse_capture("30s").as_deref(), Ok("30s"));
        assert_eq!(parse_capture("10m").as_deref(), Ok("10m"));
        let err = parse_capture("20m").unwrap_err();
        assert!(err.contains("at most 600s"), "{err}");
        let err = parse_capture("5 seconds").unwrap_err();
        assert!(err.contains("expected a number with a unit"), "{err}");
    }

    #[test]
    fn ttl_has_a_floor_and_never() {
        assert_eq!(parse_ttl("24h"), Ok(Ttl::Seconds(86_400)));
        assert_eq!(parse_ttl("7d"), Ok(Ttl::Seconds(7 * 86_400)));
        assert_eq!(parse_ttl("never"), Ok(Ttl::Never));
        assert_eq!(parse_ttl(DEFAULT_TTL), Ok(Ttl::Seconds(86_400)));
        assert!(parse_ttl("10s").unwrap_err().contains("at least 60s"));
        assert!(parse_ttl("forever").is_err());
    }

    #[test]
    fn labels_as_the_api_server_checks_them() {
        assert_eq!(parse_label("team=shop"), Ok(("team".into(), "shop".into())));
        assert!(parse_label("example.com/owner=a-b_c.d").is_ok());
        assert!(parse_label("empty=").is_ok());
        for bad in [
            "novalue",
            "=x",
            "a b=c",
            "k=-starts-with-dash",
            "Bad_Prefix.COM/x=y",
            "k=has space",
        ] {
            assert!(parse_label(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(parse_label(&format!("k={}", "a".repeat(64))).is_err());
        assert!(check_dns_subdomain("web-0").is_ok());
        assert!(check_dns_subdomain("Web").is_err());
        assert!(check_dns_subdomain(&"a".repeat(254)).is_err());
    }
}
