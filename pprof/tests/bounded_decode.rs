//! Hostile profiles against the bounded decoder, each decoded in a child process of its own
//! so that its peak resident memory (`VmHWM`, reset just before the decode) is the decode's
//! alone: a zip bomb, a protobuf built to expand in memory (gzipped and plain), nested
//! groups, and a large real-looking profile that must still decode within its estimate.
//!
//! A test binary without the libtest harness: it re-runs itself once per case (the case in
//! `FF_BOUNDED_DECODE_CASE`) and prints `N passed, N failed`.

use std::io::Write as _;
use std::process::Command;
use std::time::Instant;

use flamefleet_pprof::footprint::Scanner;
use flamefleet_pprof::{DecodeLimits, Error};

#[path = "support/heap_like.rs"]
mod heap_like;

const CASE_VAR: &str = "FF_BOUNDED_DECODE_CASE";
const MIB: u64 = 1 << 20;

/// The agent's limits for one endpoint fetch (`FetchLimits::default()`).
const AGENT: DecodeLimits = DecodeLimits {
    max_decompressed_bytes: 256 * MIB,
    max_kept_bytes: 128 * MIB,
};

/// Gzips `total` bytes made of `unit` repeated, streaming (never holding the inflated form).
fn gzip_repeated(unit: &[u8], total: u64) -> Vec<u8> {
    let block: Vec<u8> = unit.iter().copied().cycle().take(64 * 1024).collect();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut written = 0;
    while written < total {
        let n = block.len().min((total - written) as usize);
        gz.write_all(&block[..n]).expect("gzip into memory");
        written += n as u64;
    }
    gz.finish().expect("gzip into memory")
}

/// One `Sample { location_id: [1] }`: 4 bytes on the wire, a 72-byte `Sample` and a
/// 32-byte vector in memory.
const TINY_SAMPLE: [u8; 4] = [0x12, 0x02, 0x08, 0x01];

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .expect("/proc/self/status")
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"))
}

/// The child: builds its input, resets the peak, decodes, prints one line
/// `peak_growth_bytes kept_growth_bytes estimate_bytes result`.
fn child(case: &str) {
    let (input, limits) = match case {
        // 1 GiB of zeros (not even a protobuf) in about 1 MiB of gzip, against a 64 MiB
        // cap (inflating is slow in debug builds; the cap's size does not change the peak).
        "zip-bomb" => (
            gzip_repeated(&[0], 1 << 30),
            DecodeLimits {
                max_decompressed_bytes: 64 * MIB,
                ..AGENT
            },
        ),
        // 256 MiB of tiny samples: 64 M `Sample`s, about 7 GiB once decoded.
        "expanding-gzip" => (gzip_repeated(&TINY_SAMPLE, 256 * MIB), AGENT),
        // The same built plain, 64 MiB of it: 16 M samples, about 1.7 GiB decoded.
        "expanding-plain" => (TINY_SAMPLE.repeat(16 << 20), AGENT),
        // 1 MiB of nested group starts (field 1, wire type 3).
        "nested-groups" => (vec![0x0b; 1 << 20], AGENT),
        // A large real-looking profile within the budget.
        "realistic" => (
            flamefleet_pprof::encode_gzip(&heap_like::heap_profile(20_000, 7)).expect("gzip"),
            AGENT,
        ),
        other => panic!("unknown case {other}"),
    };
    // What the budget judges the realistic profile on (the scan allocates nothing but its
    // state), computed before the measured decode.
    let estimate = if case == "realistic" {
        let mut raw = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&input[..]), &mut raw)
            .expect("gunzip");
        let mut scan = Scanner::new();
        scan.feed(&raw).expect("scan");
        scan.finish().expect("scan").decoded_bytes + raw.len() as u64
    } else {
        0
    };
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting VmHWM (Linux 4.0+)");
    let before = status_kib("VmRSS:");
    let started = Instant::now();
    let result = flamefleet_pprof::decode_with(&input, &limits);
    let took = started.elapsed();
    let peak = status_kib("VmHWM:").saturating_sub(before) * 1024;
    let kept = status_kib("VmRSS:").saturating_sub(before) * 1024;
    let outcome = match &result {
        Ok(p) => format!("ok: {} samples", p.sample.len()),
        Err(e) => format!("error: {e}"),
    };
    let kind = match &result {
        Ok(_) => "ok",
        Err(Error::TooLargeDecompressed { .. }) => "too-large-decompressed",
        Err(Error::TooLargeDecoded { .. }) => "too-large-decoded",
        Err(Error::Protobuf(_)) => "protobuf",
        Err(_) => "other",
    };
    println!(
        "RESULT {peak} {kept} {estimate} {} {kind} {}",
        took.as_millis(),
        outcome
    );
    drop(result);
}

struct Outcome {
    peak: u64,
    kept: u64,
    estimate: u64,
    millis: u64,
    kind: String,
    message: String,
}

fn run_case(case: &str) -> Outcome {
    let out = Command::new(std::env::current_exe().expect("this test binary"))
        .env(CASE_VAR, case)
        .output()
        .expect("running the case in a child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{case}: the child failed ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("{case}: no RESULT line in {stdout}"));
    let mut parts = line.splitn(6, ' ');
    let mut num = || -> u64 { parts.next().and_then(|v| v.parse().ok()).expect("a number") };
    let (peak, kept, estimate, millis) = (num(), num(), num(), num());
    let kind = parts.next().unwrap_or_default().to_owned();
    let message = parts.next().unwrap_or_default().to_owned();
    Outcome {
        peak,
        kept,
        estimate,
        millis,
        kind,
        message,
    }
}

type Check = fn(&Outcome) -> Result<(), String>;

fn expect_refused(o: &Outcome, kind: &str, text: &str, max_peak: u64) -> Result<(), String> {
    if o.kind != kind {
        return Err(format!("expected {kind}, got {}: {}", o.kind, o.message));
    }
    if !o.message.contains(text) {
        return Err(format!("the message should say {text:?}: {}", o.message));
    }
    if o.peak > max_peak {
        return Err(format!(
            "peak memory grew by {:.1} MiB, bound {:.1} MiB",
            o.peak as f64 / MIB as f64,
            max_peak as f64 / MIB as f64
        ));
    }
    Ok(())
}

fn main() {
    if let Ok(case) = std::env::var(CASE_VAR) {
        child(&case);
        return;
    }
    let cases: [(&str, Check); 5] = [
        ("zip-bomb", |o| {
            // Inflated in 64 KiB chunks and never kept: nothing near the 64 MiB cap.
            expect_refused(o, "too-large-decompressed", "zip bomb", 8 * MIB)
        }),
        ("expanding-gzip", |o| {
            // Refused once the kept chunks plus their decoded form pass 128 MiB: the peak
            // stays under the budget, not the 256 MiB inflated nor the ~7 GiB decoded.
            expect_refused(
                o,
                "too-large-decoded",
                "more than its budget",
                AGENT.max_kept_bytes,
            )
        }),
        ("expanding-plain", |o| {
            // The scan allocates nothing; the body (the caller's) counts against the budget.
            expect_refused(o, "too-large-decoded", "before decoding", 8 * MIB)
        }),
        ("nested-groups", |o| {
            expect_refused(o, "protobuf", "pprof does not use groups", 8 * MIB)
        }),
        ("realistic", |o| {
            if o.kind != "ok" {
                return Err(format!("a real profile was refused: {}", o.message));
            }
            // The estimate is what the budget is judged on: it must not be below what
            // decoding really keeps.
            if o.peak > o.estimate {
                return Err(format!(
                    "decoding peaked {} bytes above its start, over the estimate of {}",
                    o.peak, o.estimate
                ));
            }
            Ok(())
        }),
    ];
    let (mut passed, mut failed) = (0, 0);
    for (name, check) in cases {
        let o = run_case(name);
        println!(
            "{name:<16} peak +{:>7.1} MiB  held after +{:>7.1} MiB  estimate {:>7.1} MiB  {:>6} ms  {}",
            o.peak as f64 / MIB as f64,
            o.kept as f64 / MIB as f64,
            o.estimate as f64 / MIB as f64,
            o.millis,
            o.message
        );
        match check(&o) {
            Ok(()) => passed += 1,
            Err(e) => {
                println!("FAILED {name}: {e}");
                failed += 1;
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}
