//! Flame graph SVG rendering with inferno from folded stacks.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// Renders folded stacks as a flame graph SVG titled `title`, counting `unit`.
pub fn render_svg(stacks: &BTreeMap<String, i64>, title: &str, unit: &str) -> Result<Vec<u8>> {
    let render_err = |reason: String| Error::Render {
        artifact: title.to_string(),
        reason,
    };
    let mut options = inferno::flamegraph::Options::default();
    options.title = title.to_string();
    options.count_name = unit.to_string();
    let lines: Vec<String> = stacks
        .iter()
        .filter(|(_, v)| **v > 0)
        .map(|(s, v)| format!("{s} {v}"))
        .collect();
    if lines.is_empty() {
        return Err(render_err(
            "the profile has no samples with a positive value".into(),
        ));
    }
    let mut svg = Vec::new();
    inferno::flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut svg)
        .map_err(|e| render_err(e.to_string()))?;
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_names_functions_and_empty_is_an_error() {
        let mut stacks = BTreeMap::new();
        stacks.insert("main;work;hot_loop".to_string(), 90);
        stacks.insert("main;cold".to_string(), 10);
        let svg = String::from_utf8(render_svg(&stacks, "cpu", "nanoseconds").unwrap()).unwrap();
        assert!(svg.contains("<svg"), "{svg}");
        assert!(svg.contains("hot_loop"));
        assert!(render_svg(&BTreeMap::new(), "cpu", "ns").is_err());
    }
}
