//! The process's own heap profile: jemalloc's sampling profiler, dumped as pprof.
//!
//! jemalloc records a stack for about one allocation per `2^lg_prof_sample` bytes
//! allocated and keeps it while that allocation lives, so a dump is the sampled in-use
//! heap, scaled up to estimated bytes by `jemalloc_pprof`. Profiling has to be switched
//! on when jemalloc starts (its `malloc_conf` symbol, see
//! [`jemalloc_heap_profiling!`](crate::jemalloc_heap_profiling)); it cannot be turned on later.

use flamefleet_proto::pprof as pb;

use flamefleet_pprof::ProfileBuilder;

use crate::symbols::Locations;
use crate::{Error, Result};

/// jemalloc's start-up configuration for the binaries: profiling on and active, one sample
/// per 512 KiB allocated on average (jemalloc's default, written out so it is not a
/// surprise). The cost is one stack walk per sample; TiKV and Materialize run this way in
/// production.
///
/// Freed pages go back to the kernel after about a second instead of jemalloc's default
/// ten (`dirty_decay_ms`, `muzzy_decay_ms`): the operator's work is bursty (a request over
/// thousands of nodes allocates for seconds, then idles) and its resident size is what a
/// memory limit counts, so memory a burst freed should not stay resident through the next
/// one. The cost is more `madvise` calls while memory churns.
pub const MALLOC_CONF: &[u8] =
    b"prof:true,prof_active:true,lg_prof_sample:19,dirty_decay_ms:1000,muzzy_decay_ms:1000\0";

/// Makes jemalloc the global allocator of the binary that calls it (once, at its crate
/// root) and switches jemalloc's heap profiler on at start-up, so `/debug/pprof/heap`
/// answers. jemalloc reads the `malloc_conf` symbol before the first allocation; that is
/// why this must be a symbol of the binary and not a call made in `main`.
#[macro_export]
macro_rules! jemalloc_heap_profiling {
    () => {
        #[global_allocator]
        static FLAMEFLEET_GLOBAL_ALLOCATOR: $crate::Jemalloc = $crate::Jemalloc;

        /// jemalloc's start-up options, read by jemalloc itself through this symbol.
        #[allow(non_upper_case_globals)]
        #[unsafe(export_name = "malloc_conf")]
        pub static malloc_conf: &[u8] = $crate::heap::MALLOC_CONF;
    };
}

/// The in-use heap of this process as a gzipped pprof (sample type `inuse_space/bytes`),
/// functions named from the symbol tables ([`crate::symbols`]).
///
/// Blocking: jemalloc writes the dump to a temporary file (`$TMPDIR`), which is then parsed
/// and symbolized; call it off the async runtime.
///
/// # Errors
/// [`Error::HeapUnavailable`] when jemalloc's profiler is not on (the binary did not call
/// [`jemalloc_heap_profiling!`](crate::jemalloc_heap_profiling), or `MALLOC_CONF` in the
/// environment turned it off); [`Error::Profiler`] when the dump fails.
pub fn in_use_pprof() -> Result<Vec<u8>> {
    let Some(ctl) = jemalloc_pprof::PROF_CTL.as_ref() else {
        return Err(Error::HeapUnavailable(
            "jemalloc's heap profiler is off in this process (opt.prof=false): the binary \
             must be started with prof:true in jemalloc's malloc_conf (the \
             jemalloc_heap_profiling! macro sets it; a MALLOC_CONF environment variable \
             saying prof:false overrides it)"
                .into(),
        ));
    };
    let mut ctl = ctl.blocking_lock();
    if !ctl.activated() {
        return Err(Error::HeapUnavailable(
            "jemalloc's heap profiler is loaded but inactive (prof_active=false); start the \
             binary with prof_active:true in malloc_conf"
                .into(),
        ));
    }
    let profile = ctl
        .dump_profile()
        .map_err(|e| Error::Profiler(format!("dumping jemalloc's heap profile: {e:#}")))?;
    let lg_sample = ctl.lg_sample();
    drop(ctl);
    crate::encode::gzip(&pprof(&profile, lg_sample))
}

/// jemalloc's parsed dump as a pprof `Profile`: one sample per stack, its estimated bytes
/// in use; the period is jemalloc's mean bytes between samples (`2^lg_sample`).
fn pprof(dump: &jemalloc_pprof::StackProfile, lg_sample: usize) -> pb::Profile {
    let mut b = ProfileBuilder::new(&[("inuse_space", "bytes")]);
    b.period(
        "space",
        "bytes",
        1_i64
            .checked_shl(u32::try_from(lg_sample).unwrap_or(0))
            .unwrap_or(0),
    )
    .time(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
        0,
    );
    let addrs: Vec<u64> = dump
        .stacks
        .iter()
        .flat_map(|(stack, _)| stack.addrs.iter().map(|&a| a as u64))
        .collect();
    let mut locations = Locations::new(&addrs);
    locations.add_mappings(&mut b);
    for (stack, _) in &dump.stacks {
        // jemalloc_pprof keeps the stack root first; pprof wants the leaf first.
        let location_id = stack
            .addrs
            .iter()
            .rev()
            .map(|&a| locations.id(a as u64, &mut b))
            .collect();
        b.add_sample_at(location_id, &[stack.weight.trunc() as i64], &[]);
    }
    b.build()
}
