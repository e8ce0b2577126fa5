//! What taking the process's own profiles costs in resident memory: RSS before and after
//! each `/debug/pprof` dump of a process holding some heap, printed.
//!
//! `cargo bench -p flamefleet-selfprof --bench dump_cost`

use std::hint::black_box;
use std::time::Duration;

use flamefleet_selfprof::{CpuProfileRequest, Format, SelfProfiler};

flamefleet_selfprof::jemalloc_heap_profiling!();

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

#[inline(never)]
fn hold() -> Vec<Vec<u8>> {
    (0..64).map(|i| vec![i as u8; 256 * 1024]).collect()
}

#[inline(never)]
fn dump_cost_spin() -> u64 {
    let t = std::time::Instant::now();
    let mut x = 0u64;
    while t.elapsed() < Duration::from_secs(2) {
        x = black_box(x.wrapping_mul(31).wrapping_add(7));
    }
    x
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let held = black_box(hold());
    println!(
        "RSS holding {} MiB of heap: {:.1} MiB",
        held.len() / 4,
        rss_mib()
    );
    for round in 1..=3 {
        let size = tokio::task::spawn_blocking(flamefleet_selfprof::heap::in_use_pprof)
            .await??
            .len();
        println!(
            "after heap dump {round} ({size} bytes): RSS {:.1} MiB",
            rss_mib()
        );
    }
    let profiler = SelfProfiler::default();
    let spin = std::thread::Builder::new()
        .name("spinner".into())
        .spawn(dump_cost_spin)?;
    let query = CpuProfileRequest {
        duration: Duration::from_secs(1),
        frequency: 499,
        format: Format::Pprof,
        force: false,
    };
    let profile = profiler.profile(query).await?;
    let size = profile.len();
    if let Ok(path) = std::env::var("DUMP_COST_WRITE") {
        std::fs::write(path, &profile)?;
    }
    let _ = spin.join();
    println!("after CPU profile ({size} bytes): RSS {:.1} MiB", rss_mib());
    // jemalloc returns freed pages after its decay time (1 s, `heap::MALLOC_CONF`).
    tokio::time::sleep(Duration::from_secs(3)).await;
    println!("3 s later: RSS {:.1} MiB", rss_mib());
    let size = profiler.profile(query).await?.len();
    println!(
        "after a second CPU profile ({size} bytes): RSS {:.1} MiB",
        rss_mib()
    );
    drop(held);
    Ok(())
}
