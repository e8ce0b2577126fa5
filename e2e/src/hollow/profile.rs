//! What a hollow capture "finishes" with: a small but valid profile per profile type (what
//! `go tool pprof` reads), runqlat's text histogram, and a summary of the numbers the
//! profile holds (docs/capture.md, "Capture summary"). The agent's service shell turns it
//! into artifacts, uploads them and reports them, as for a real capture.

use std::time::Duration;

use flamefleet_agent::capture::lifecycle::{Finished, Symbolized};
use flamefleet_pprof::{Frame, FrameLine, Label, ProfileBuilder};
use flamefleet_proto::agent::capture_summary::Kind;
use flamefleet_proto::agent::{
    BlockingFunction, CaptureSummary, CpuSummary, HeapSummary, LatencyHistogram, OffcpuSummary,
    ProfileType, RunqlatSummary,
};

/// A synthetic stack of `functions`, leaf first.
fn stack(functions: &[&str]) -> Vec<Frame> {
    functions
        .iter()
        .map(|f| Frame {
            // A made-up address per function, within a small text segment.
            address: 0x1000
                + 0x10
                    * (f.bytes()
                        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
                        % 0x10000),
            mapping: None,
            lines: vec![FrameLine {
                function: (*f).to_owned(),
                file: "hollow.rs".into(),
                line: 1,
            }],
        })
        .collect()
}

/// What a `ty` capture of `duration` on `node` of `pods` (namespace, name) finishes with.
/// Profiles are a few hundred bytes: what is measured is the operator and the API server,
/// not the store's bandwidth.
pub fn build(
    ty: ProfileType,
    node: &str,
    pods: &[(String, String)],
    duration: Duration,
    frequency_hz: u64,
) -> Finished {
    let seconds = duration.as_secs_f64().max(0.001);
    let label_sets: Vec<Vec<Label>> = if pods.is_empty() {
        vec![vec![Label::Str("node".into(), node.into())]]
    } else {
        pods.iter()
            .map(|(ns, pod)| {
                vec![
                    Label::Str("node".into(), node.into()),
                    Label::Str("namespace".into(), ns.clone()),
                    Label::Str("pod".into(), pod.clone()),
                ]
            })
            .collect()
    };
    let finished = |profile, summary, histogram_text, runqlat_histogram| Finished {
        profile,
        histogram_text,
        report: String::new(),
        summary: CaptureSummary {
            kind: Some(summary),
            ..Default::default()
        },
        runqlat_histogram,
        symbolized: Symbolized::default(),
    };
    match ty {
        ProfileType::Cpu | ProfileType::Unspecified => {
            let hz = frequency_hz.max(1);
            let mut b = ProfileBuilder::new(&[("samples", "count"), ("cpu", "nanoseconds")]);
            b.cpu_period(hz)
                .time(0, i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX));
            let period = flamefleet_pprof::nanos_per_sample(hz);
            // Half a CPU busy in two stacks per pod.
            let per_pod = ((seconds * hz as f64) / 2.0).ceil() as i64;
            let mut total = 0;
            for labels in &label_sets {
                let hot = per_pod * 3 / 4;
                let cold = per_pod - hot;
                b.add_sample(
                    &stack(&["hollow::spin", "hollow::work", "main"]),
                    &[hot, hot * period],
                    labels,
                );
                b.add_sample(
                    &stack(&["hollow::idle", "main"]),
                    &[cold, cold * period],
                    labels,
                );
                total += per_pod;
            }
            let summary = Kind::Cpu(CpuSummary {
                samples: u64::try_from(total).unwrap_or(0),
                dropped_samples: 0,
                unsymbolized_frames_pct: 0.0,
                frequency_hz: hz,
                requested_frequency_hz: hz,
                runtimes: Vec::new(),
            });
            finished(b.build(), summary, None, None)
        }
        ProfileType::Heap => {
            let mut b = ProfileBuilder::new(&[
                ("alloc_objects", "count"),
                ("alloc_space", "bytes"),
                ("inuse_objects", "count"),
                ("inuse_space", "bytes"),
            ]);
            b.default_sample_type("inuse_space");
            let mut allocations = 0;
            for labels in &label_sets {
                b.add_sample(
                    &stack(&["hollow::alloc", "hollow::work", "main"]),
                    &[64, 64 * 4096, 16, 16 * 4096],
                    labels,
                );
                allocations += 64;
            }
            let summary = Kind::Heap(HeapSummary {
                allocations,
                reason: "hollow agent: a synthetic profile, nothing was captured".into(),
                ..Default::default()
            });
            finished(b.build(), summary, None, None)
        }
        ProfileType::Runqlat => {
            // Waits of 2-4 us mostly, a tail to 64 us.
            let buckets = vec![0, 10, 200, 40, 10, 5, 1];
            let histogram = LatencyHistogram {
                unit_ns: 1000,
                buckets: buckets.clone(),
            };
            let mut b = ProfileBuilder::new(&[("count", "count"), ("latency", "nanoseconds")]);
            b.default_sample_type("count");
            for labels in &label_sets {
                for (i, n) in buckets.iter().enumerate() {
                    let n = i64::try_from(*n).unwrap_or(0);
                    if n > 0 {
                        let bucket = format!("hollow::wait_{}us", 1u64 << i);
                        b.add_sample(
                            &stack(&[bucket.as_str(), "main"]),
                            &[n, n * (1000 << i)],
                            labels,
                        );
                    }
                }
            }
            let waits = histogram.count() * label_sets.len() as u64;
            let mut text = String::from("     usecs               : count\n");
            for (i, n) in buckets.iter().enumerate() {
                let lo = if i == 0 { 0 } else { 1u64 << i };
                text.push_str(&format!(
                    "{lo:>10} -> {:<10} : {n}\n",
                    (1u64 << (i + 1)) - 1
                ));
            }
            let summary = Kind::Runqlat(RunqlatSummary {
                waits,
                dropped_samples: 0,
                p50_us: histogram.quantile_us(0.50),
                p90_us: histogram.quantile_us(0.90),
                p99_us: histogram.quantile_us(0.99),
                max_us: histogram.max_us(),
            });
            finished(b.build(), summary, Some(text), Some(histogram))
        }
        ProfileType::Offcpu => {
            // Each pod's thread blocked half the window, in two stacks.
            let mut b = ProfileBuilder::new(&[("off_cpu", "nanoseconds"), ("blocks", "count")]);
            b.default_sample_type("off_cpu");
            let per_pod = i64::try_from(duration.as_nanos() / 2).unwrap_or(i64::MAX);
            let (mut blocked, mut blocks) = (0u64, 0u64);
            for labels in &label_sets {
                let (read, sleep) = (per_pod * 3 / 4, per_pod / 4);
                b.add_sample(
                    &stack(&["futex_wait_queue", "hollow::lock", "main"]),
                    &[read, 300],
                    labels,
                );
                b.add_sample(
                    &stack(&["hrtimer_nanosleep", "hollow::nap", "main"]),
                    &[sleep, 100],
                    labels,
                );
                blocked += u64::try_from(read + sleep).unwrap_or(0);
                blocks += 400;
            }
            let summary = Kind::Offcpu(OffcpuSummary {
                blocked_ns: blocked,
                blocks,
                min_block_micros: 1000,
                top_blocking: vec![BlockingFunction {
                    function: "futex_wait_queue".into(),
                    blocked_ns: blocked * 3 / 4,
                }],
                ..Default::default()
            });
            finished(b.build(), summary, None, None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_profile_is_valid_pprof_with_the_reported_samples() {
        let pods = vec![("ns".to_string(), "web-1".to_string())];
        let built = build(ProfileType::Cpu, "n1", &pods, Duration::from_secs(2), 99);
        let p = &built.profile;
        assert_eq!(p.string_table[0], "");
        assert_eq!(
            flamefleet_pprof::sample_types(p).last().map(String::as_str),
            Some("cpu/nanoseconds")
        );
        let samples: i64 = p.sample.iter().map(|s| s.value[0]).sum();
        assert_eq!(u64::try_from(samples).unwrap(), built.summary.samples());
        assert_eq!(
            built.summary.display()["samples"],
            built.summary.samples().to_string()
        );
        // Every location and function a sample names exists.
        for s in &p.sample {
            for id in &s.location_id {
                let loc = p.location.iter().find(|l| l.id == *id).unwrap();
                assert!(p.function.iter().any(|f| f.id == loc.line[0].function_id));
            }
        }
        flamefleet_pprof::validate(p).expect("a valid profile");
    }

    #[test]
    fn runqlat_has_a_text_histogram_and_a_histogram() {
        let built = build(ProfileType::Runqlat, "n2", &[], Duration::from_secs(1), 0);
        assert!(built.histogram_text.is_some());
        assert!(built.runqlat_histogram.is_some());
        let p = &built.profile;
        assert_eq!(p.string_table[p.default_sample_type as usize], "count");
    }
}
