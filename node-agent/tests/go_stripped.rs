//! Go binaries built with `-ldflags="-s -w"` (no symbol table, no DWARF: what most
//! production images ship) against the same program built plain, for each supported Go
//! toolchain (1.23 to 1.26):
//!
//! - Go's function table of the stripped build names every function as the plain build's
//!   symbol table does, and gives the function, inlined functions and lines blazesym reads
//!   from the plain build's DWARF;
//! - the unwind rows built from its pc/sp tables are the rows built from the plain build's
//!   `.debug_frame`;
//! - the runtime's heap profile globals found from its code are where the plain build's
//!   symbol table puts them;
//! - live, both builds running side by side: the same CPU chains (function names per
//!   sample, through a frameless leaf and an inlined frame) in the same shares.
//!
//! The heap profiles of both builds against the process's own `/debug/pprof/heap` are
//! compared in `heap_goruntime.rs`.

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolizer};
use flamefleet_agent::capture::cpu::CpuOptions;
use flamefleet_agent::capture::heap::goruntime::binary::GoSymbols;
use flamefleet_agent::capture::heap::goruntime::locate;
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use flamefleet_agent::gopclntab::GoTable;
use flamefleet_agent::symbolize::StackSymbolizer;
use flamefleet_agent::unwind::table::{self, BinaryTable, Row};
use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
use support::{Decoded, TestCgroup, require_root, serial};

/// The supported versions' toolchains (scripts/setup.sh fetches them); `None` is the
/// installed `go` (1.26).
const TOOLCHAINS: [Option<&str>; 4] = [Some("go1.23.12"), Some("go1.24.0"), Some("go1.25.0"), None];

/// The workload built plain and with `-s -w` by `toolchain`.
fn builds(dir: &Path, toolchain: Option<&str>) -> (PathBuf, PathBuf) {
    let build =
        |ldflags| support::go::build_workload(dir, "goruntime", toolchain, ldflags, false, &[]);
    (build(""), build("-s -w"))
}

fn label(toolchain: Option<&str>) -> &str {
    toolchain.unwrap_or("installed go")
}

/// The rule of `t` at `pc`: (CFA offset, kind, rbp offset) of the last row at or before it.
fn rule_at(t: &BinaryTable, pc: u32) -> Option<(i16, u8, i8)> {
    let i = t.rows.partition_point(|r| r.pc <= pc);
    let r: &Row = t.rows[..i].last()?;
    Some((r.cfa_off, r.kind, r.rbp_off))
}

/// Function names (innermost first) and lines of `vaddr` in the plain build, from DWARF.
fn dwarf_frames(blaze: &Symbolizer, plain: &Path, vaddr: u64) -> Vec<(String, u32)> {
    let src = Source::Elf(Elf::new(plain));
    let Ok(sym) = blaze.symbolize_single(&src, Input::VirtOffset(vaddr)) else {
        return Vec::new();
    };
    let Some(sym) = sym.as_sym() else {
        return Vec::new();
    };
    let line = |c: Option<&blazesym::symbolize::CodeInfo<'_>>| c.and_then(|c| c.line).unwrap_or(0);
    let mut out: Vec<(String, u32)> = sym
        .inlined
        .iter()
        .rev()
        .map(|f| (f.name.to_string(), line(f.code_info.as_ref())))
        .collect();
    out.push((sym.name.to_string(), line(sym.code_info.as_deref())));
    out
}

#[test]
fn a_stripped_build_is_named_unwound_and_its_heap_located_as_the_plain_build_says() {
    let dir = tempfile::tempdir().unwrap();
    let blaze = Symbolizer::builder()
        .enable_code_info(true)
        .enable_inlined_fns(true)
        .build();
    for toolchain in TOOLCHAINS {
        let label = label(toolchain);
        let (plain, stripped) = builds(dir.path(), toolchain);
        let plain_bytes = std::fs::read(&plain).unwrap();
        let stripped_bytes = std::fs::read(&stripped).unwrap();
        let plain_elf = object::File::parse(plain_bytes.as_slice()).unwrap();
        let stripped_elf = object::File::parse(stripped_bytes.as_slice()).unwrap();
        assert!(
            stripped_elf.symbols().next().is_none(),
            "{label}: the -s -w build still has a symbol table"
        );
        let table = GoTable::from_elf(&stripped_elf)
            .unwrap_or_else(|e| panic!("{label}: {e}"))
            .expect("a Go binary has .gopclntab");
        assert!(table.has_inline_trees(), "{label}: go:func.* not found");

        // Names: every function of the table is the plain build's symbol at that address.
        let mut symbols: HashMap<u64, Vec<String>> = HashMap::new();
        for s in plain_elf.symbols() {
            if let Ok(name) = s.name() {
                symbols
                    .entry(s.address())
                    .or_default()
                    .push(name.to_owned());
            }
        }
        let (mut named, mut wrong) = (0usize, Vec::new());
        for f in table.funcs() {
            let name = table.name(&f).unwrap_or_default().into_owned();
            // Assembly functions' ELF symbols carry their ABI (`.abi0`) and the linker writes
            // local types' `·N` as `.N` there; Go's table keeps the runtime's spelling.
            let name = name.replace('·', ".");
            let abi0 = format!("{name}.abi0");
            if symbols
                .get(&f.entry)
                .is_some_and(|n| n.contains(&name) || n.contains(&abi0))
            {
                named += 1;
            } else {
                wrong.push((f.entry, name));
            }
        }
        eprintln!(
            "{label}: {} functions in .gopclntab, {named} named as the symbol table does",
            table.len()
        );
        assert!(
            named > 1000 && wrong.is_empty(),
            "{label}: {named} agree; differ: {:?}",
            &wrong[..wrong.len().min(10)]
        );

        // Frames and lines: at the start of every stack-pointer run of every main and runtime
        // function, and inside them, as DWARF says.
        let (mut compared, mut same, mut inlined) = (0usize, 0usize, 0usize);
        let mut differ = Vec::new();
        for f in table.funcs() {
            let name = table.name(&f).unwrap_or_default().into_owned();
            if !(name.starts_with("main.") || name.starts_with("runtime.mallocgc")) {
                continue;
            }
            let (runs, end) = table.sp_deltas(&f);
            let pcs = runs
                .iter()
                .map(|r| r.0)
                .chain((f.entry..end).step_by(7))
                .collect::<Vec<_>>();
            for pc in pcs {
                let ours: Vec<(String, u32)> = table
                    .frames(pc)
                    .into_iter()
                    .map(|l| (l.function, l.line as u32))
                    .collect();
                let theirs = dwarf_frames(&blaze, &plain, pc);
                compared += 1;
                if ours.len() > 1 {
                    inlined += 1;
                }
                if ours == theirs {
                    same += 1;
                } else if differ.len() < 5 {
                    differ.push((pc, ours, theirs));
                }
            }
        }
        let pct = 100.0 * same as f64 / compared as f64;
        eprintln!(
            "{label}: frames at {compared} addresses ({inlined} with inlined functions): \
             {pct:.2}% as DWARF says"
        );
        assert!(
            compared > 500 && inlined > 10 && pct >= 99.0,
            "{label}: {same} of {compared} agree with DWARF; first that differ: {differ:#?}"
        );

        // Unwind rows: the stripped build's from its pc/sp tables are the plain build's from
        // .debug_frame, wherever .debug_frame has a rule.
        let rows_plain = table::build(plain_bytes.as_slice()).unwrap();
        let rows_stripped = table::build(stripped_bytes.as_slice())
            .unwrap_or_else(|e| panic!("{label}: no table from the pc/sp tables: {e}"));
        let (mut checked, mut differ) = (0usize, Vec::new());
        for r in rows_plain
            .rows
            .iter()
            .filter(|r| r.kind != table::kind::NONE)
        {
            checked += 1;
            let want = Some((r.cfa_off, r.kind, r.rbp_off));
            let got = rule_at(&rows_stripped, r.pc);
            if got != want && differ.len() < 10 {
                differ.push((r.pc, want, got));
            }
        }
        eprintln!(
            "{label}: {} rows from .debug_frame, {} from the pc/sp tables, {checked} compared",
            rows_plain.rows.len(),
            rows_stripped.rows.len()
        );
        assert!(
            checked > 1000 && differ.is_empty(),
            "{label}: rows that differ (pc, .debug_frame, pc/sp): {differ:?}"
        );
        assert!(
            rows_stripped
                .rows
                .iter()
                .any(|r| r.kind == table::kind::GO_MCALL),
            "{label}: runtime.mcall not found in the stripped build"
        );

        // The heap profile's globals.
        let sym = |name: &str| {
            plain_elf
                .symbols()
                .find(|s| s.name() == Ok(name))
                .map(|s| s.address())
                .unwrap_or_else(|| panic!("{label}: {name} in the plain build"))
        };
        let want = GoSymbols {
            mbuckets: sym("runtime.mbuckets"),
            mem_profile_rate: sym("runtime.MemProfileRate"),
            disable_memory_profiling: sym("runtime.disableMemoryProfiling"),
            mprof_cycle: sym("runtime.mProfCycle"),
        };
        let plain_table = GoTable::from_elf(&plain_elf).unwrap().unwrap();
        let found = locate::locate(&plain_elf, &plain_table)
            .unwrap_or_else(|e| panic!("{label} plain: locating the globals: {e}"));
        assert_eq!(found, want, "{label} plain");
        // The stripped build's data may start elsewhere (its sections move), but each global
        // is at the same place in the same section.
        let found = locate::locate(&stripped_elf, &table)
            .unwrap_or_else(|e| panic!("{label} stripped: locating the globals: {e}"));
        let in_section = |elf: &object::File<'_>, addr: u64| {
            elf.sections()
                .find(|s| addr >= s.address() && addr < s.address() + s.size())
                .map(|s| (s.name().unwrap_or_default().to_owned(), addr - s.address()))
        };
        for (what, got, want) in [
            ("mbuckets", found.mbuckets, want.mbuckets),
            (
                "MemProfileRate",
                found.mem_profile_rate,
                want.mem_profile_rate,
            ),
            (
                "disableMemoryProfiling",
                found.disable_memory_profiling,
                want.disable_memory_profiling,
            ),
            ("mProfCycle", found.mprof_cycle, want.mprof_cycle),
        ] {
            let (got, want) = (in_section(&stripped_elf, got), in_section(&plain_elf, want));
            assert!(
                got.is_some() && got == want,
                "{label}: runtime.{what}: stripped {got:?}, plain {want:?}"
            );
        }
    }
}

/// A hostile binary: the stripped build with its `.gopclntab` overwritten in places (every
/// 7th byte, then every 3rd) is read without a panic, a loop or an unbounded read: what
/// still checks out is named and unwound, the rest is left out.
#[test]
fn a_corrupt_function_table_is_read_without_panic_or_loop() {
    let dir = tempfile::tempdir().unwrap();
    let (_, stripped) = builds(dir.path(), None);
    let original = std::fs::read(&stripped).unwrap();
    let (off, size) = {
        let elf = object::File::parse(original.as_slice()).unwrap();
        let s = elf.section_by_name(".gopclntab").unwrap();
        s.file_range().unwrap()
    };
    for (every, value) in [(7usize, 0xffu8), (3, 0x80), (11, 0x00)] {
        let mut bytes = original.clone();
        // The header's first 8 bytes stay: past them, anything.
        for (i, b) in bytes[off as usize + 8..(off + size) as usize]
            .iter_mut()
            .enumerate()
        {
            if i % every == 0 {
                *b = value;
            }
        }
        let started = std::time::Instant::now();
        let elf = object::File::parse(bytes.as_slice()).unwrap();
        let (mut funcs, mut frames) = (0usize, 0usize);
        if let Ok(Some(t)) = GoTable::from_elf(&elf) {
            for f in t.funcs().take(100_000) {
                funcs += 1;
                frames += t.frames(f.entry).len();
                let _ = t.sp_deltas(&f);
            }
            let _ = locate::locate(&elf, &t);
        }
        let _ = table::build(bytes.as_slice());
        eprintln!(
            "every {every}th byte {value:#x}: {funcs} functions still check out, {frames} frames, \
             {:?}",
            started.elapsed()
        );
    }
}

/// Function names of a sample's user stack, leaf first (inlined functions included).
fn chain(d: &Decoded, s: &flamefleet_proto::pprof::Sample) -> Vec<String> {
    s.location_id
        .iter()
        .filter(|&&id| !d.is_kernel(id))
        .flat_map(|&id| d.functions(id).into_iter().map(str::to_owned))
        .collect()
}

/// CPU time of process `pid` so far, in seconds (`utime + stime` of `/proc/PID/stat`).
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(") ").map_or("", |(_, a)| a);
    let f: Vec<f64> = after
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    // utime and stime (fields 14 and 15) are the 11th and 12th numbers after the state.
    let ticks = f.get(10).copied().unwrap_or(0.0) + f.get(11).copied().unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

#[test]
fn plain_and_stripped_builds_give_the_same_cpu_chains() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let samplers = Samplers::new(SamplerConfig::default());
    for toolchain in TOOLCHAINS {
        let label = label(toolchain);
        let (plain, stripped) = builds(dir.path(), toolchain);
        let mut cg = TestCgroup::new("go-stripped-cpu");
        let plain_pid = cg.spawn(&mut Command::new(&plain));
        let stripped_pid = cg.spawn(&mut Command::new(&stripped));
        // Both processes' first run of spin, past their start.
        cg.wait_cpu(Duration::from_millis(300));
        let capture = support::start_cpu_with_tables(
            &samplers,
            &[CaptureTarget::raw(cg.cgroup.clone())],
            &CpuOptions {
                frequency: 499,
                ..CpuOptions::default()
            },
            &[plain_pid, stripped_pid],
        );
        // Until each build has had 2 s of CPU (about 1,000 samples at 499 Hz), at most 30 s:
        // a loaded machine lengthens the capture instead of thinning the sample.
        let (start, began) = (
            [cpu_secs(plain_pid), cpu_secs(stripped_pid)],
            Instant::now(),
        );
        while began.elapsed() < Duration::from_secs(30)
            && (cpu_secs(plain_pid) - start[0] < 2.0 || cpu_secs(stripped_pid) - start[1] < 2.0)
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        let result = capture.finish().expect("finish the capture");
        let mut sym = StackSymbolizer::new(samplers.catalog().clone());
        let d = Decoded {
            profile: result.to_profile(&mut sym, ""),
        };
        cg.kill_all();
        eprintln!("{label}: walk {:?}", result.walk);
        // Per build: samples by chain from the leaf down to main.spin.
        let mut by: [HashMap<String, f64>; 2] = Default::default();
        let mut totals = [0.0f64; 2];
        for s in &d.profile.sample {
            let k = match d.num_label(s, "pid") {
                Some(p) if p == i64::from(plain_pid) => 0,
                Some(p) if p == i64::from(stripped_pid) => 1,
                _ => continue,
            };
            let c = chain(&d, s);
            let Some(leaf) = c.first().filter(|f| *f == "main.leaf") else {
                continue;
            };
            let key = match c.iter().position(|f| f == "main.spin") {
                Some(i) => c[..=i].join(" ← "),
                None => format!("{leaf} ← (cut) {}", c[1..].join(" ← ")),
            };
            *by[k].entry(key).or_default() += s.value[0] as f64;
            totals[k] += s.value[0] as f64;
        }
        let share =
            |k: usize, key: &str| 100.0 * by[k].get(key).copied().unwrap_or(0.0) / totals[k];
        let a = "main.leaf ← main.step ← main.hotA ← main.spin";
        let b = "main.leaf ← main.step ← main.hotB ← main.spin";
        for (k, build) in [(0, "plain"), (1, "stripped")] {
            let mut chains: Vec<_> = by[k].iter().collect();
            chains.sort_by(|x, y| y.1.total_cmp(x.1));
            eprintln!(
                "{label} {build}: {} samples in main.leaf; {:.1}% via hotA, {:.1}% via hotB; chains: {:?}",
                totals[k],
                share(k, a),
                share(k, b),
                &chains[..chains.len().min(4)]
            );
            assert!(
                totals[k] >= 200.0,
                "{label} {build}: {} samples in main.leaf",
                totals[k]
            );
            assert!(
                share(k, a) + share(k, b) >= 95.0,
                "{label} {build}: {:.1}% of main.leaf's samples carry a whole chain",
                share(k, a) + share(k, b)
            );
        }
        // The same chains in both builds, in shares equal within sampling noise: three
        // standard errors of the difference of two proportions (about 6 points for 600
        // samples each).
        let pooled = (share(0, a) + share(1, a)) / 200.0;
        let se = 100.0 * (pooled * (1.0 - pooled) * (1.0 / totals[0] + 1.0 / totals[1])).sqrt();
        let (p, s) = (share(0, a), share(1, a));
        eprintln!(
            "{label}: via hotA {p:.1}% plain, {s:.1}% stripped: {:+.1} points, 3 standard errors {:.1}",
            s - p,
            3.0 * se
        );
        assert!(
            (p - s).abs() <= 3.0 * se,
            "{label}: {a}: {p:.1}% of the plain build's leaf samples, {s:.1}% of the stripped \
             build's (limit 3 standard errors, {:.1} points)",
            3.0 * se
        );
    }
}
