//! Turning the buckets read from Go processes into one pprof profile in the
//! layout `runtime/pprof` writes for `/debug/pprof/heap`: the same sample
//! types, `period` = the process's `MemProfileRate`, counts unsampled with
//! Go's `scaleHeapSample`, leading runtime frames hidden, a `bytes` label.

use flamefleet_proto::pprof::Profile;

use super::buckets::Bucket;
use crate::pprof::{Frame, Label, ProfileBuilder};
use crate::symbolize::StackSymbolizer;

/// Go's `scaleHeapSample` (runtime/pprof/protomem.go), bit for bit: the
/// estimated number and bytes of all allocations behind `count` sampled
/// ones totalling `size` bytes at `rate`.
pub fn scale_heap_sample(count: i64, size: i64, rate: i64) -> (i64, i64) {
    if count == 0 || size == 0 {
        return (0, 0);
    }
    if rate <= 1 {
        // Rate 1 recorded everything; below that Go treats the rate as unknown.
        return (count, size);
    }
    let avg = size as f64 / count as f64;
    let scale = 1.0 / (1.0 - (-avg / rate as f64).exp());
    ((count as f64 * scale) as i64, (size as f64 * scale) as i64)
}

/// The buckets of one process and the labels its samples get.
#[derive(Debug, Clone)]
pub struct ProcessBuckets {
    /// Process ID (stacks are symbolized in its address space).
    pub pid: u32,
    /// `MemProfileRate` read from the process.
    pub rate: i64,
    /// The buckets.
    pub buckets: Vec<Bucket>,
    /// Labels for every sample (namespace, pod, pid, ...).
    pub labels: Vec<Label>,
}

/// Whether a function belongs to the runtime (hidden at the top of a stack,
/// as `runtime/pprof` does).
fn is_runtime(frame: &Frame) -> bool {
    frame.lines.last().is_some_and(|l| {
        l.function.starts_with("runtime.") || l.function.starts_with("internal/runtime/")
    })
}

/// Builds the profile of `processes`; `comments` are added as they are.
pub fn build(
    processes: &[ProcessBuckets],
    symbolizer: &mut StackSymbolizer,
    comments: &[String],
    time_nanos: i64,
) -> Profile {
    let mut b = ProfileBuilder::new(&[
        ("alloc_objects", "count"),
        ("alloc_space", "bytes"),
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    ]);
    b.period("space", "bytes", processes.first().map_or(0, |p| p.rate));
    b.default_sample_type("inuse_space");
    b.time(time_nanos, 0);
    for c in comments {
        b.comment(c);
    }
    for p in processes {
        for bucket in &p.buckets {
            let r = &bucket.record;
            if r.allocs == 0 {
                continue;
            }
            let mut frames = symbolizer.return_address_frames(&mut b, p.pid, &bucket.stack);
            // runtime/pprof drops leading runtime frames, unless nothing is left.
            if let Some(first) = frames.iter().position(|f| !is_runtime(f)) {
                frames.drain(..first);
            }
            let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            let (ao, ab) = scale_heap_sample(as_i64(r.allocs), as_i64(r.alloc_bytes), p.rate);
            let (io, ib) = scale_heap_sample(
                as_i64(r.allocs) - as_i64(r.frees),
                as_i64(r.alloc_bytes) - as_i64(r.free_bytes),
                p.rate,
            );
            let mut labels = p.labels.clone();
            labels.push(Label::Num(
                "bytes".into(),
                as_i64(r.alloc_bytes / r.allocs),
                String::new(),
            ));
            symbolizer.account(&frames, 1);
            b.add_sample(&frames, &[ao, ab, io, ib], &labels);
        }
    }
    b.build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaling_matches_go() {
        // Values computed with Go's scaleHeapSample.
        assert_eq!(scale_heap_sample(0, 0, 524288), (0, 0));
        assert_eq!(scale_heap_sample(3, 300, 1), (3, 300));
        assert_eq!(scale_heap_sample(3, 300, 0), (3, 300));
        // 1 MiB blocks at 512 KiB: scale 1/(1-e^-2) = 1.15652...
        let (c, s) = scale_heap_sample(64, 64 << 20, 512 << 10);
        assert_eq!(c, 74);
        assert_eq!(s, (64.0 * 1048576.0 / (1.0 - (-2f64).exp())) as i64);
    }
}
