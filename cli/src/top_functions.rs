//! The `pprof -top` view: functions by flat (leaf) and cumulative (anywhere on the stack) value.

use std::collections::{HashMap, HashSet};

use flamefleet_proto::pprof::Profile;

use crate::stacks::{Frames, format_value, value_type};

/// One function's totals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopEntry {
    /// The function's name.
    pub name: String,
    /// Value of the samples where it is the leaf.
    pub flat: i64,
    /// Value of the samples where it is anywhere on the stack (counted once per sample).
    pub cum: i64,
}

/// Functions sorted by flat value, then cumulative, then name; and the total value.
pub fn top(profile: &Profile, index: usize) -> (Vec<TopEntry>, i64) {
    let frames = Frames::new(profile);
    let mut flat: HashMap<String, i64> = HashMap::new();
    let mut cum: HashMap<String, i64> = HashMap::new();
    let mut total = 0;
    for sample in &profile.sample {
        let value = sample.value.get(index).copied().unwrap_or(0);
        if value == 0 {
            continue;
        }
        total += value;
        let stack = frames.root_to_leaf(&sample.location_id);
        if let Some(leaf) = stack.last() {
            *flat.entry(leaf.clone()).or_insert(0) += value;
        }
        let mut seen = HashSet::new();
        for f in stack {
            if seen.insert(f.clone()) {
                *cum.entry(f).or_insert(0) += value;
            }
        }
    }
    let mut entries: Vec<TopEntry> = cum
        .into_iter()
        .map(|(name, cum)| TopEntry {
            flat: flat.get(&name).copied().unwrap_or(0),
            name,
            cum,
        })
        .collect();
    entries.sort_by(|a, b| {
        b.flat
            .cmp(&a.flat)
            .then(b.cum.cmp(&a.cum))
            .then(a.name.cmp(&b.name))
    });
    (entries, total)
}

/// Renders the top `limit` functions as a table like `go tool pprof -top`.
pub fn render(profile: &Profile, index: usize, limit: usize) -> String {
    let (entries, total) = top(profile, index);
    let (kind, unit) = value_type(profile, index);
    let pct = |v: i64| {
        if total == 0 {
            0.0
        } else {
            100.0 * v as f64 / total as f64
        }
    };
    let mut out = format!(
        "Type: {kind}\nShowing top {} of {} functions, total {}\n{:>10} {:>6} {:>6} {:>10} {:>6}  {}\n",
        entries.len().min(limit),
        entries.len(),
        format_value(total, &unit),
        "flat",
        "flat%",
        "sum%",
        "cum",
        "cum%",
        "function"
    );
    let mut sum = 0;
    for e in entries.iter().take(limit) {
        sum += e.flat;
        out.push_str(&format!(
            "{:>10} {:>5.2}% {:>5.2}% {:>10} {:>5.2}%  {}\n",
            format_value(e.flat, &unit),
            pct(e.flat),
            pct(sum),
            format_value(e.cum, &unit),
            pct(e.cum),
            e.name
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stacks::tests::profile;

    #[test]
    fn flat_and_cumulative() {
        let p = profile(
            &[("cpu", "nanoseconds")],
            &[
                (&["hot", "work", "main"], &[70]),
                (&["cold", "work", "main"], &[20]),
                (&["main"], &[10]),
                // Recursion counts once in cum.
                (&["work", "work", "main"], &[5]),
            ],
        );
        let (entries, total) = top(&p, 0);
        assert_eq!(total, 105);
        assert_eq!(
            entries[0],
            TopEntry {
                name: "hot".into(),
                flat: 70,
                cum: 70
            }
        );
        let work = entries.iter().find(|e| e.name == "work").unwrap();
        assert_eq!((work.flat, work.cum), (5, 95));
        let main = entries.iter().find(|e| e.name == "main").unwrap();
        assert_eq!((main.flat, main.cum), (10, 105));
        let text = render(&p, 0, 10);
        let first_row = text.lines().nth(3).unwrap();
        assert!(first_row.ends_with(" hot"), "{text}");
        assert!(first_row.contains("66.67%"), "{text}");
    }

    #[test]
    fn units() {
        assert_eq!(format_value(1_500_000_000, "nanoseconds"), "1.50s");
        assert_eq!(format_value(2048, "bytes"), "2.00kB");
        assert_eq!(format_value(12, "count"), "12");
    }
}
