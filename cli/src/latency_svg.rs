//! Run-queue latency drawn as latency, in SVG:
//!
//! - [`histogram`]: one bar per log2 bucket (the x axis is the latency, doubling at each
//!   band), its height the bucket's waits, with p50, p90 and p99 marked where they fall;
//! - [`heat_map`]: a policy's runs over time, as Brendan Gregg's latency heat maps: x is the
//!   runs' scheduled time, y the latency bucket, each cell's colour its waits (log scale),
//!   with the p50 and p99 of each run joined by lines.
//!
//! Written here, not with a plotting crate: the pictures are a few dozen rectangles, lines
//! and labels, and each element carries `data-*` attributes (bucket bounds, counts,
//! quantiles) so that a reader or a test can check the picture against the numbers.

use std::fmt::Write;

use flamefleet_proto::agent::LatencyHistogram;
use flamefleet_proto::latency::bucket_bounds;

use crate::error::{Error, Result};
use crate::latency::{QUANTILES, format_bound_ns, format_us, summary};

const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 540.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 40.0;
const TOP: f64 = 70.0;
const BOTTOM: f64 = 80.0;
const FONT: &str = "font-family=\"Verdana, sans-serif\"";

/// Text for XML character data and attribute values.
fn esc(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn header(svg: &mut String, title: &str, subtitle: &str) {
    let _ = writeln!(
        svg,
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" {FONT}>"
    );
    let _ = writeln!(
        svg,
        "<rect x=\"0\" y=\"0\" width=\"{WIDTH}\" height=\"{HEIGHT}\" fill=\"#ffffff\"/>"
    );
    let _ = writeln!(
        svg,
        "<text class=\"title\" x=\"{}\" y=\"24\" font-size=\"17\" text-anchor=\"middle\">{}</text>",
        WIDTH / 2.0,
        esc(title)
    );
    let _ = writeln!(
        svg,
        "<text class=\"subtitle\" x=\"{}\" y=\"44\" font-size=\"12\" fill=\"#444444\" text-anchor=\"middle\">{}</text>",
        WIDTH / 2.0,
        esc(subtitle)
    );
}

/// The first and last non-empty buckets.
fn span(h: &LatencyHistogram) -> Option<(usize, usize)> {
    let first = h.buckets.iter().position(|&n| n > 0)?;
    let last = h.buckets.iter().rposition(|&n| n > 0)?;
    Some((first, last))
}

/// Where `us` falls in the log2 buckets of `unit_ns`: its bucket and the fraction of the
/// way through it (the linear interpolation the percentiles use).
fn position(us: f64, unit_ns: u64) -> (usize, f64) {
    let units = us * 1e3 / unit_ns.max(1) as f64;
    let mut i = 0;
    while bucket_bounds(i).1 as f64 <= units && i < 63 {
        i += 1;
    }
    let (lo, hi) = bucket_bounds(i);
    let frac = ((units - lo as f64) / (hi - lo) as f64).clamp(0.0, 1.0);
    (i, frac)
}

fn axis_titles(svg: &mut String, x: &str, y: &str) {
    let _ = writeln!(
        svg,
        "<text x=\"{}\" y=\"{}\" font-size=\"13\" text-anchor=\"middle\">{}</text>",
        LEFT + (WIDTH - LEFT - RIGHT) / 2.0,
        HEIGHT - 16.0,
        esc(x)
    );
    let _ = writeln!(
        svg,
        "<text x=\"20\" y=\"{}\" font-size=\"13\" text-anchor=\"middle\" transform=\"rotate(-90 20 {})\">{}</text>",
        TOP + (HEIGHT - TOP - BOTTOM) / 2.0,
        TOP + (HEIGHT - TOP - BOTTOM) / 2.0,
        esc(y)
    );
}

/// The histogram of `h` as an SVG titled `title`: a bar per log2 bucket (`class="bar"`,
/// with `data-low-ns`, `data-high-ns`, `data-count`), p50/p90/p99 as dashed lines
/// (`class="percentile"`, `data-quantile`, `data-value-us`).
///
/// # Errors
/// [`Error::Render`] when the histogram is empty.
pub fn histogram(h: &LatencyHistogram, title: &str) -> Result<Vec<u8>> {
    let Some((first, last)) = span(h) else {
        return Err(Error::Render {
            artifact: title.to_owned(),
            reason: "the histogram counted no wait".into(),
        });
    };
    // One empty band either side, so the extremes do not sit on the axes.
    let first = first.saturating_sub(1);
    let last = last + 1;
    let bands = last - first + 1;
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let band = plot_w / bands as f64;
    let total = h.count();
    let max = h.buckets.iter().copied().max().unwrap_or(1).max(1);
    let mut svg = String::new();
    header(&mut svg, title, &summary(h));
    // Count grid and ticks.
    for k in 0..=4u64 {
        let value = max * k / 4;
        let y = TOP + plot_h - plot_h * value as f64 / max as f64;
        let _ = writeln!(
            svg,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#e0e0e0\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{value}</text>",
            LEFT + plot_w,
            LEFT - 6.0,
            y + 4.0
        );
    }
    let unit_ns = h.unit_ns.max(1);
    for (k, i) in (first..=last).enumerate() {
        let x = LEFT + band * k as f64;
        let (lo, hi) = bucket_bounds(i);
        let (lo_ns, hi_ns) = (lo * unit_ns, hi * unit_ns);
        let n = h.buckets.get(i).copied().unwrap_or(0);
        if n > 0 {
            let bar_h = plot_h * n as f64 / max as f64;
            let _ = writeln!(
                svg,
                "<rect class=\"bar\" x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bar_h:.1}\" fill=\"#e8743b\" data-low-ns=\"{lo_ns}\" data-high-ns=\"{hi_ns}\" data-count=\"{n}\"><title>{} to {}: {n} waits ({:.1}%)</title></rect>",
                x + band * 0.05,
                TOP + plot_h - bar_h,
                band * 0.9,
                format_bound_ns(lo_ns),
                format_bound_ns(hi_ns),
                100.0 * n as f64 / total.max(1) as f64
            );
        }
        let _ = writeln!(
            svg,
            "<text class=\"bound\" x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{}</text>",
            TOP + plot_h + 16.0,
            format_bound_ns(lo_ns)
        );
        if i == last {
            let _ = writeln!(
                svg,
                "<text class=\"bound\" x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{}</text>",
                x + band,
                TOP + plot_h + 16.0,
                format_bound_ns(hi_ns)
            );
        }
    }
    let _ = writeln!(
        svg,
        "<line x1=\"{LEFT}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#000000\"/>",
        TOP + plot_h,
        LEFT + plot_w,
        TOP + plot_h
    );
    for (k, &(q, name)) in QUANTILES.iter().enumerate() {
        let Some(us) = h.quantile_us(q) else {
            continue;
        };
        let (i, frac) = position(us, unit_ns);
        let x = LEFT + band * ((i.saturating_sub(first)) as f64 + frac);
        let _ = writeln!(
            svg,
            "<line class=\"percentile\" data-quantile=\"{q}\" data-value-us=\"{us:.3}\" x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#1f4e9c\" stroke-width=\"1.5\" stroke-dasharray=\"5,3\"/>\n<text class=\"percentile-label\" x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"#1f4e9c\">{name} {}</text>",
            TOP - 6.0 + 14.0 * k as f64,
            TOP + plot_h,
            x + 3.0,
            TOP + 8.0 + 14.0 * k as f64,
            format_us(us)
        );
    }
    axis_titles(
        &mut svg,
        "run-queue wait (log2 buckets: each band doubles)",
        "waits",
    );
    svg.push_str("</svg>\n");
    Ok(svg.into_bytes())
}

/// One run of a policy, a column of the heat map.
#[derive(Debug, Clone)]
pub struct HeatColumn {
    /// The run's scheduled time, Unix seconds.
    pub time: i64,
    /// The run's name.
    pub run: String,
    /// Its waits, all nodes and targets together.
    pub histogram: LatencyHistogram,
}

/// A colour from light (few waits) to dark red (the most), on a log scale of `n` in
/// `1..=max`.
fn heat_colour(n: u64, max: u64) -> String {
    let t = if max <= 1 {
        1.0
    } else {
        ((n as f64).ln_1p() / (max as f64).ln_1p()).clamp(0.0, 1.0)
    };
    let (a, b) = ((255.0, 237.0, 160.0), (128.0, 0.0, 38.0));
    let mix = |x: f64, y: f64| (x + (y - x) * t).round() as u8;
    format!(
        "#{:02x}{:02x}{:02x}",
        mix(a.0, b.0),
        mix(a.1, b.1),
        mix(a.2, b.2)
    )
}

fn time_label(second: i64, long: bool) -> String {
    let Ok(t) = k8s_openapi::jiff::Timestamp::from_second(second) else {
        return second.to_string();
    };
    t.strftime(if long { "%m-%d %H:%M" } else { "%H:%M:%S" })
        .to_string()
}

/// A latency heat map of a policy's runs as an SVG titled `title`: a column per run at its
/// scheduled time (`columns` in any order), a row per log2 bucket, a cell per non-empty
/// (run, bucket) (`class="cell"`, with `data-run`, `data-time`, `data-low-ns`,
/// `data-high-ns`, `data-count`) coloured by its waits, and the runs' p50 and p99 as lines
/// (`class="percentile"`, `data-quantile`).
///
/// # Errors
/// [`Error::Render`] when no run counted any wait, or the runs' units differ.
pub fn heat_map(columns: &[HeatColumn], title: &str) -> Result<Vec<u8>> {
    let render_err = |reason: String| Error::Render {
        artifact: title.to_owned(),
        reason,
    };
    let mut columns: Vec<&HeatColumn> =
        columns.iter().filter(|c| c.histogram.count() > 0).collect();
    columns.sort_by(|a, b| a.time.cmp(&b.time).then(a.run.cmp(&b.run)));
    let Some(unit_ns) = columns.first().map(|c| c.histogram.unit_ns.max(1)) else {
        return Err(render_err("no run counted any wait".into()));
    };
    if columns
        .iter()
        .any(|c| c.histogram.unit_ns.max(1) != unit_ns)
    {
        return Err(render_err(
            "the runs' histograms have different units (us and ms); draw them separately".into(),
        ));
    }
    let (first, last) = columns
        .iter()
        .filter_map(|c| span(&c.histogram))
        .fold((usize::MAX, 0), |(f, l), (a, b)| (f.min(a), l.max(b)));
    let rows = last - first + 1;
    let t0 = columns.first().map_or(0, |c| c.time);
    let t_last = columns.last().map_or(0, |c| c.time);
    // Each column is as wide as the shortest gap between runs (the schedule's period).
    let step = columns
        .windows(2)
        .map(|w| w[1].time - w[0].time)
        .filter(|d| *d > 0)
        .min()
        .unwrap_or(60);
    let span_s = (t_last - t0 + step) as f64;
    let plot_w = WIDTH - LEFT - RIGHT - 70.0;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let row_h = plot_h / rows as f64;
    let col_w = (plot_w * step as f64 / span_s).max(2.0);
    let x_of = |t: i64| LEFT + plot_w * (t - t0) as f64 / span_s;
    let y_of_row = |i: usize| TOP + plot_h - row_h * (i - first + 1) as f64;
    let max = columns
        .iter()
        .flat_map(|c| c.histogram.buckets.iter().copied())
        .max()
        .unwrap_or(1)
        .max(1);
    let mut all = LatencyHistogram {
        unit_ns,
        buckets: Vec::new(),
    };
    for c in &columns {
        all.merge(&c.histogram)
            .map_err(|e| render_err(format!("{e:?}")))?;
    }
    let mut svg = String::new();
    header(
        &mut svg,
        title,
        &format!(
            "{} runs; {}. Colour: waits per bucket and run (log scale); lines: each run's p50 and p99",
            columns.len(),
            summary(&all)
        ),
    );
    let _ = writeln!(
        svg,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{plot_w:.1}\" height=\"{plot_h:.1}\" fill=\"#ffffff\" stroke=\"#999999\"/>"
    );
    for i in first..=last {
        let (lo, _) = bucket_bounds(i);
        let y = y_of_row(i) + row_h;
        let _ = writeln!(
            svg,
            "<text class=\"bound\" x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{}</text>",
            LEFT - 6.0,
            y + 4.0,
            format_bound_ns(lo * unit_ns)
        );
    }
    for c in &columns {
        for (i, &n) in c
            .histogram
            .buckets
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
        {
            let (lo, hi) = bucket_bounds(i);
            let _ = writeln!(
                svg,
                "<rect class=\"cell\" x=\"{:.1}\" y=\"{:.1}\" width=\"{col_w:.1}\" height=\"{row_h:.1}\" fill=\"{}\" data-run=\"{}\" data-time=\"{}\" data-low-ns=\"{}\" data-high-ns=\"{}\" data-count=\"{n}\"><title>{} at {} UTC: {} to {}: {n} waits</title></rect>",
                x_of(c.time),
                y_of_row(i),
                heat_colour(n, max),
                esc(&c.run),
                c.time,
                lo * unit_ns,
                hi * unit_ns,
                esc(&c.run),
                time_label(c.time, true),
                format_bound_ns(lo * unit_ns),
                format_bound_ns(hi * unit_ns)
            );
        }
    }
    // Percentile lines through the middle of each column.
    for (q, name, colour) in [(0.5, "p50", "#1f4e9c"), (0.99, "p99", "#000000")] {
        let points: Vec<String> = columns
            .iter()
            .filter_map(|c| {
                let us = c.histogram.quantile_us(q)?;
                let (i, frac) = position(us, unit_ns);
                let i = i.clamp(first, last);
                let y = y_of_row(i) + row_h * (1.0 - frac);
                Some(format!("{:.1},{y:.1}", x_of(c.time) + col_w / 2.0))
            })
            .collect();
        let _ = writeln!(
            svg,
            "<polyline class=\"percentile\" data-quantile=\"{q}\" points=\"{}\" fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\"/>",
            points.join(" ")
        );
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"{colour}\">{name}</text>",
            WIDTH - RIGHT - 60.0,
            TOP + if q < 0.9 { 14.0 } else { 30.0 }
        );
    }
    // Time labels: at most eight, on columns.
    let long = t_last - t0 > 86_400;
    let every = columns.len().div_ceil(8).max(1);
    for c in columns.iter().step_by(every) {
        let _ = writeln!(
            svg,
            "<text class=\"time\" x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"start\">{}</text>",
            x_of(c.time),
            TOP + plot_h + 16.0,
            time_label(c.time, long)
        );
    }
    // Colour scale.
    let legend_x = WIDTH - RIGHT - 60.0;
    for k in 0..10u32 {
        let n = ((max as f64).ln_1p() * f64::from(k) / 9.0)
            .exp_m1()
            .round()
            .max(1.0) as u64;
        let _ = writeln!(
            svg,
            "<rect x=\"{legend_x:.1}\" y=\"{:.1}\" width=\"14\" height=\"18\" fill=\"{}\"/>",
            TOP + 50.0 + 18.0 * f64::from(9 - k),
            heat_colour(n, max)
        );
    }
    let _ = writeln!(
        svg,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\">{max}</text>\n<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\">1</text>",
        legend_x + 18.0,
        TOP + 64.0,
        legend_x + 18.0,
        TOP + 50.0 + 18.0 * 10.0
    );
    axis_titles(
        &mut svg,
        "scheduled time of the run (UTC)",
        "run-queue wait (log2 buckets)",
    );
    svg.push_str("</svg>\n");
    Ok(svg.into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(pairs: &[(usize, u64)]) -> LatencyHistogram {
        let mut h = LatencyHistogram {
            unit_ns: 1000,
            buckets: vec![0; 12],
        };
        for &(i, n) in pairs {
            h.buckets[i] = n;
        }
        h
    }

    fn parse(svg: &[u8]) -> String {
        String::from_utf8(svg.to_vec()).unwrap()
    }

    #[test]
    fn the_histogram_has_a_bar_per_bucket_and_the_percentiles() {
        let h = hist(&[(1, 700), (2, 200), (4, 90), (9, 10)]);
        let svg = parse(&histogram(&h, "web <pod> & co").unwrap());
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let bars: Vec<(u64, u64)> = doc
            .descendants()
            .filter(|n| n.attribute("class") == Some("bar"))
            .map(|n| {
                (
                    n.attribute("data-low-ns").unwrap().parse().unwrap(),
                    n.attribute("data-count").unwrap().parse().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            bars,
            [(2_000, 700), (4_000, 200), (16_000, 90), (512_000, 10)]
        );
        let marks: Vec<(f64, f64)> = doc
            .descendants()
            .filter(|n| n.tag_name().name() == "line" && n.attribute("class") == Some("percentile"))
            .map(|n| {
                (
                    n.attribute("data-quantile").unwrap().parse().unwrap(),
                    n.attribute("x1").unwrap().parse().unwrap(),
                )
            })
            .collect();
        assert_eq!(marks.len(), 3);
        assert!(
            marks[0].1 < marks[1].1 && marks[1].1 < marks[2].1,
            "{marks:?}"
        );
        assert!(svg.contains("web &lt;pod&gt; &amp; co"));
        assert!(histogram(&hist(&[]), "empty").is_err());
    }

    #[test]
    fn the_heat_map_has_a_cell_per_run_and_bucket() {
        let columns = [
            HeatColumn {
                time: 1_000_120,
                run: "p-1000120".into(),
                histogram: hist(&[(3, 5), (8, 1)]),
            },
            HeatColumn {
                time: 1_000_000,
                run: "p-1000000".into(),
                histogram: hist(&[(1, 100), (2, 50)]),
            },
            HeatColumn {
                time: 1_000_060,
                run: "p-1000060".into(),
                histogram: hist(&[]),
            },
        ];
        let svg = parse(&heat_map(&columns, "p").unwrap());
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let cells: Vec<(i64, u64, u64, f64)> = doc
            .descendants()
            .filter(|n| n.attribute("class") == Some("cell"))
            .map(|n| {
                (
                    n.attribute("data-time").unwrap().parse().unwrap(),
                    n.attribute("data-low-ns").unwrap().parse().unwrap(),
                    n.attribute("data-count").unwrap().parse().unwrap(),
                    n.attribute("x").unwrap().parse().unwrap(),
                )
            })
            .collect();
        assert_eq!(cells.len(), 4, "{cells:?}");
        // Earliest run first, at the left; the empty run has no cell.
        assert_eq!(
            (cells[0].0, cells[0].1, cells[0].2),
            (1_000_000, 2_000, 100)
        );
        assert_eq!((cells[2].0, cells[2].1, cells[2].2), (1_000_120, 8_000, 5));
        assert!(cells[0].3 < cells[2].3);
        // The busiest cell is the darkest.
        assert_eq!(heat_colour(100, 100), "#800026");
        assert!(heat_map(&columns[2..], "p").is_err());
    }
}
