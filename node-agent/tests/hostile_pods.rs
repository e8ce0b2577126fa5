//! Hostile workloads against their node's agent: what a profiled process puts in its
//! files, its memory or its endpoint must never hang the agent, exhaust its memory, crash
//! it, or show another tenant's data in a profile. Each test performs the attack for real
//! — real processes in real cgroups, the real `flamefleet-agent capture` run with only the
//! chart's capabilities inside a memory cgroup limited to the chart's agent memory — and
//! says what the agent did. Root only (scripts/test.sh runs it as root).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use flamefleet_agent::pprof::{Frame, FrameLine, ProfileBuilder, encode_gzip};
use support::chart_agent::{self, AgentRun};
use support::{Decoded, TestCgroup, require_root};

/// Longer than any capture here takes; an agent still running then is hung.
const DEADLINE: Duration = Duration::from_secs(90);

/// The tests take turns. Each starts busy workloads and an agent whose time and memory
/// it judges; on a 2-core machine the other tests' workloads would starve that agent
/// several times over (a capture of 18 s alone took 84 s beside two others).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Root, and this test's turn (held until the returned guard drops).
fn hostile_test() -> std::sync::MutexGuard<'static, ()> {
    require_root();
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn workload(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/hostile_workloads")
        .join(name)
}

/// `cc` with the given arguments (frame pointers, -O1, -g); panics with its output.
fn cc(args: &[&str]) {
    let out = Command::new("cc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer"])
        .args(args)
        .output()
        .expect("running cc (install gcc)");
    assert!(
        out.status.success(),
        "cc {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The workload's stdout, past its "ready" line (kept open: the workload writes on).
type Ready = std::io::BufReader<std::process::ChildStdout>;

/// Builds hostile_workloads/spin.c into `bin`, its hot function named `function`.
fn spin_binary(bin: &Path, function: &str) {
    cc(&[
        &format!("-DSPIN_FN={function}"),
        "-o",
        bin.to_str().unwrap(),
        workload("spin.c").to_str().unwrap(),
    ]);
}

/// `flamefleet-agent capture` arguments of a 2 s CPU capture of `cgroups` into `out`.
fn cpu_args<'a>(cgroups: &[&'a str], out: &'a Path) -> Vec<&'a str> {
    let mut args = vec![
        "--type",
        "cpu",
        "--duration",
        "2s",
        "-o",
        out.to_str().unwrap(),
    ];
    for cg in cgroups {
        args.extend(["--cgroup", cg]);
    }
    args
}

/// Starts `cmd` in `cg` and waits for its "ready" line; returns its PID and its stdout.
fn spawn_ready(cg: &mut TestCgroup, cmd: &mut Command) -> (u32, Ready) {
    use std::io::BufRead as _;
    let (pid, stdout) = cg.spawn_piped(cmd);
    let mut r = std::io::BufReader::new(stdout);
    let mut line = String::new();
    r.read_line(&mut line)
        .expect("reading the workload's ready line");
    assert!(line.starts_with("ready"), "workload said {line:?}");
    (pid, r)
}

fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
}

/// Function names of a profile's locations.
fn function_names(p: &Decoded) -> Vec<String> {
    p.profile
        .function
        .iter()
        .map(|f| p.string(f.name).to_owned())
        .collect()
}

/// The profile's comments.
fn comments(p: &Decoded) -> Vec<String> {
    p.profile
        .comment
        .iter()
        .map(|&i| p.string(i).to_owned())
        .collect()
}

fn assert_ended_well(run: &AgentRun) {
    assert!(!run.timed_out, "the agent hung: {}", run.summary());
    assert!(
        !run.oom_killed,
        "the agent was OOM-killed: {}",
        run.summary()
    );
    assert!(run.succeeded(), "the capture failed: {}", run.summary());
}

/// A workload replaces its (deleted) executable and library with FIFOs. Opening either
/// by path would block the agent forever; the capture must end on time, symbolize the
/// executable from the file the process runs, and say per process why the library's
/// frames are not named.
#[test]
fn fifo_at_a_deleted_binary_path_does_not_hang_the_capture() {
    let _turn = hostile_test();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (lib, app) = (d.join("libspin.so"), d.join("app"));
    cc(&[
        "-shared",
        "-fPIC",
        "-o",
        lib.to_str().unwrap(),
        workload("libspin.c").to_str().unwrap(),
    ]);
    // The hot loop in the executable, the library mapped (and unused).
    cc(&[
        "-DSPIN_FN=fifo_exe_spin",
        "-o",
        app.to_str().unwrap(),
        workload("spin.c").to_str().unwrap(),
        "-L",
        d.to_str().unwrap(),
        "-Wl,--no-as-needed",
        "-lspin",
        "-Wl,-rpath,$ORIGIN",
    ]);
    let mut cg = TestCgroup::new("hostile-fifo");
    let (pid, _out) = spawn_ready(&mut cg, &mut Command::new(&app));
    for f in [&app, &lib] {
        std::fs::remove_file(f).unwrap();
        mkfifo(f);
    }
    let out = d.join("cpu.pb.gz");
    let run = chart_agent::capture(&cpu_args(&[cg.path().to_str().unwrap()], &out), DEADLINE);
    assert_ended_well(&run);
    let p = Decoded::read(&out);
    let names = function_names(&p);
    assert!(
        names.iter().any(|n| n == "fifo_exe_spin"),
        "the executable is symbolized from the file it runs; functions: {names:?}"
    );
    let notes = comments(&p);
    let lib_name = lib.display().to_string();
    assert!(
        notes
            .iter()
            .any(|c| c.contains(&format!("pid {pid}")) && c.contains(&lib_name)),
        "a note names the process and its library; comments: {notes:#?}"
    );
}

/// A workload replaces its (deleted) executable with a symlink into another tenant's
/// process root. Followed in the agent's mount namespace, it would name that tenant's
/// functions in the attacker's profile.
#[test]
fn a_symlinked_mapping_names_no_foreign_frames() {
    let _turn = hostile_test();
    let dir = tempfile::tempdir().unwrap();
    let (victim_dir, attacker_dir) = (dir.path().join("victim"), dir.path().join("attacker"));
    std::fs::create_dir(&victim_dir).unwrap();
    std::fs::create_dir(&attacker_dir).unwrap();
    let (victim, attacker) = (victim_dir.join("app"), attacker_dir.join("app"));
    // Same code and layout, names of the same length: only the names differ.
    for (bin, name) in [
        (&victim, "victim_secret_fn_x"),
        (&attacker, "attacker_spin_fn_x"),
    ] {
        spin_binary(bin, name);
    }
    let mut victim_cg = TestCgroup::new("hostile-victim");
    let (victim_pid, _victim_out) = spawn_ready(&mut victim_cg, &mut Command::new(&victim));
    let mut attacker_cg = TestCgroup::new("hostile-attacker");
    let (_, _attacker_out) = spawn_ready(&mut attacker_cg, &mut Command::new(&attacker));
    std::fs::remove_file(&attacker).unwrap();
    std::os::unix::fs::symlink(
        format!("/proc/{victim_pid}/root{}", victim.display()),
        &attacker,
    )
    .unwrap();
    let out = dir.path().join("cpu.pb.gz");
    let run = chart_agent::capture(
        &cpu_args(&[attacker_cg.path().to_str().unwrap()], &out),
        DEADLINE,
    );
    assert_ended_well(&run);
    let names = function_names(&Decoded::read(&out));
    assert!(
        !names.iter().any(|n| n.contains("victim_secret")),
        "the victim's functions appear in the attacker's profile: {names:?}"
    );
    assert!(
        names.iter().any(|n| n == "attacker_spin_fn_x"),
        "the attacker's own code is still named: {names:?}"
    );
}

/// A well-behaved workload in a cgroup of its own: a capture that also targets hostile
/// ones must still profile it.
struct GoodTarget {
    cg: TestCgroup,
    _out: std::io::BufReader<std::process::ChildStdout>,
}

impl GoodTarget {
    const FUNCTION: &'static str = "good_target_spin";

    fn start(dir: &Path) -> Self {
        let bin = dir.join("good");
        spin_binary(&bin, Self::FUNCTION);
        let mut cg = TestCgroup::new("hostile-good");
        let (_, out) = spawn_ready(&mut cg, &mut Command::new(&bin));
        Self { cg, _out: out }
    }

    fn path(&self) -> &str {
        self.cg.path().to_str().unwrap()
    }

    fn assert_profiled(&self, p: &Decoded) {
        let names = function_names(p);
        assert!(
            names.iter().any(|n| n == Self::FUNCTION),
            "the good target is still profiled; functions: {names:?}"
        );
    }
}

/// A CPU capture of `hostile` (a cgroup path) and of a good target, as the chart runs the
/// agent. Returns the run and the profile (when one was written).
fn cpu_capture_with_good(
    dir: &Path,
    hostile: &str,
    good: &GoodTarget,
) -> (AgentRun, Option<Decoded>) {
    let out = dir.join("cpu.pb.gz");
    let run = chart_agent::capture(&cpu_args(&[hostile, good.path()], &out), DEADLINE);
    let profile = out.exists().then(|| Decoded::read(&out));
    (run, profile)
}

/// Prints the figure the report quotes.
fn report(what: &str, run: &AgentRun) {
    eprintln!(
        "{what}: agent peak RSS {:.1} MiB (cgroup peak {:.1} MiB) under the chart's limit of {} MiB",
        run.peak_rss as f64 / (1 << 20) as f64,
        run.cgroup_peak as f64 / (1 << 20) as f64,
        chart_agent::chart_limits().memory >> 20
    );
}

/// Processes whose perf maps are 64 MiB of 500-byte names each: kept per process with no
/// total, eight of them exceed the agent's memory.
#[test]
fn huge_perf_maps_cannot_exhaust_the_agent() {
    let _turn = hostile_test();
    // Not under /tmp, which the workloads mount over.
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let bin = dir.path().join("perfmap");
    cc(&[
        "-o",
        bin.to_str().unwrap(),
        workload("perfmap.c").to_str().unwrap(),
    ]);
    let good = GoodTarget::start(dir.path());
    let mut cg = TestCgroup::new("hostile-perfmap");
    let mut outs = Vec::new();
    for _ in 0..8 {
        // Each in a mount namespace of its own with a tmpfs on /tmp: the maps take no disk
        // and go with their process.
        let (_, out) = spawn_ready(
            &mut cg,
            Command::new("unshare")
                .args(["--mount", "--propagation", "private", "sh", "-c"])
                .arg(format!(
                    "mount -t tmpfs -o size=80m flamefleet-test /tmp && exec {}",
                    bin.display()
                )),
        );
        outs.push(out);
    }
    let (run, profile) = cpu_capture_with_good(dir.path(), cg.path().to_str().unwrap(), &good);
    report("8 perf maps of 64 MiB", &run);
    assert_ended_well(&run);
    let p = profile.expect("a profile");
    good.assert_profiled(&p);
    let names = function_names(&p);
    assert!(
        names.iter().any(|n| n == "JS:hostile_jit_loop"),
        "JIT frames are still named from what fits: {names:?}"
    );
}

/// A process mapping one file 60,000 times under a path of nearly PATH_MAX bytes: its
/// /proc/<pid>/maps is 230 MB of text, which the agent read whole, twice over.
#[test]
fn a_huge_maps_file_cannot_exhaust_the_agent() {
    let _turn = hostile_test();
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("maps");
    cc(&[
        "-o",
        bin.to_str().unwrap(),
        workload("maps.c").to_str().unwrap(),
    ]);
    let good = GoodTarget::start(dir.path());
    let mut cg = TestCgroup::new("hostile-maps");
    let mut outs = Vec::new();
    for i in 0..2 {
        let files = dir.path().join(format!("files{i}"));
        std::fs::create_dir(&files).unwrap();
        let (_, out) = spawn_ready(&mut cg, Command::new(&bin).arg(&files).arg("60000"));
        outs.push(out);
    }
    let (run, profile) = cpu_capture_with_good(dir.path(), cg.path().to_str().unwrap(), &good);
    report("2 processes with 230 MB maps files", &run);
    assert_ended_well(&run);
    let p = profile.expect("a profile");
    good.assert_profiled(&p);
    let names = function_names(&p);
    assert!(
        names.iter().any(|n| n == "maps_spin"),
        "the hostile processes' own code is still named from the mappings read: {names:?}"
    );
}

/// Writes a `.debug_frame` of one CIE and `fdes` identical FDEs (24 bytes each, all
/// covering the same 16 bytes at 0x1000) to `path`: the same bytes again and again, which
/// zlib shrinks about a thousand times.
fn write_debug_frame(path: &Path, fdes: u64) {
    use std::io::Write as _;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    // CIE: id 0xffffffff, version 1, no augmentation, code alignment 1, data alignment -8,
    // return address in r16; CFA = rsp + 8, return address at CFA - 8; padded to 24 bytes.
    let mut cie = vec![
        0xff, 0xff, 0xff, 0xff, 1, 0, 1, 0x78, 16, 0x0c, 7, 8, 0x90, 1,
    ];
    cie.resize(20, 0);
    f.write_all(&20u32.to_le_bytes()).unwrap();
    f.write_all(&cie).unwrap();
    let mut fde = Vec::with_capacity(24);
    fde.extend_from_slice(&20u32.to_le_bytes());
    fde.extend_from_slice(&0u32.to_le_bytes()); // the CIE at offset 0
    fde.extend_from_slice(&0x1000u64.to_le_bytes());
    fde.extend_from_slice(&0x10u64.to_le_bytes());
    let chunk: Vec<u8> = fde.iter().copied().cycle().take(24 * 4096).collect();
    let mut left = fdes;
    while left > 0 {
        let n = left.min(4096);
        f.write_all(&chunk[..(n * 24) as usize]).unwrap();
        left -= n;
    }
    f.flush().unwrap();
}

/// `bin` with `.debug_frame` set to `fdes` identical FDEs, zlib-compressed.
fn with_debug_frame_bomb(bin: &Path, fdes: u64, out: &Path) {
    // The uncompressed forms (up to 240 MB) are made in memory (tmpfs), not on disk.
    let scratch = tempfile::tempdir_in("/dev/shm").unwrap();
    let raw = scratch.path().join("debug_frame.raw");
    write_debug_frame(&raw, fdes);
    let plain = scratch.path().join("with_raw_debug_frame");
    let run = |args: &[&std::ffi::OsStr]| {
        let o = Command::new("objcopy")
            .args(args)
            .output()
            .expect("running objcopy (install binutils)");
        assert!(
            o.status.success(),
            "objcopy {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let section = format!(".debug_frame={}", raw.display());
    run(&[
        "--add-section".as_ref(),
        section.as_ref(),
        "--set-section-flags".as_ref(),
        ".debug_frame=readonly,debug".as_ref(),
        bin.as_os_str(),
        plain.as_os_str(),
    ]);
    run(&[
        "--compress-debug-sections=zlib".as_ref(),
        plain.as_os_str(),
        out.as_os_str(),
    ]);
    std::fs::remove_file(raw).unwrap();
    std::fs::remove_file(plain).unwrap();
}

/// Executables whose compressed `.debug_frame` holds millions of identical FDEs (a few
/// hundred KiB on disk): one of 10 million (240 MiB decompressed, every FDE kept with its
/// rows while the table is built), one of 2.5 million (60 MiB: within the section limit,
/// above what a build may keep).
#[test]
fn a_cfi_bomb_cannot_exhaust_the_agent() {
    let _turn = hostile_test();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = GoodTarget::start(d);
    let mut cg = TestCgroup::new("hostile-cfi");
    let mut outs = Vec::new();
    for (name, fdes) in [("bomb", 10_000_000u64), ("dense", 2_500_000)] {
        let plain = d.join(format!("{name}.plain"));
        spin_binary(&plain, &format!("{name}_spin"));
        let bin = d.join(name);
        with_debug_frame_bomb(&plain, fdes, &bin);
        eprintln!(
            "{name}: {fdes} FDEs, {} KiB on disk",
            std::fs::metadata(&bin).unwrap().len() >> 10
        );
        let (_, out) = spawn_ready(&mut cg, &mut Command::new(&bin));
        outs.push(out);
    }
    let (run, profile) = cpu_capture_with_good(d, cg.path().to_str().unwrap(), &good);
    report("CFI bombs of 10 and 2.5 million FDEs", &run);
    assert_ended_well(&run);
    let p = profile.expect("a profile");
    good.assert_profiled(&p);
    let notes = comments(&p);
    let tables = notes
        .iter()
        .find(|c| c.starts_with("unwind tables:"))
        .unwrap_or_else(|| panic!("an unwind tables comment in {notes:#?}"));
    let without: u64 = tables
        .split(';')
        .find_map(|part| part.trim().strip_suffix(" without usable CFI"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("a count of binaries without usable CFI in {tables:?}"));
    // The 240 MiB section is refused before anything is decompressed, at once. The other
    // is refused after a million FDEs, which may still be under way when a short capture
    // ends (a debug build parses them slowly): the memory it takes is in the figures above
    // either way (the unit test `what_a_build_keeps_of_many_fdes_is_bounded` shows the cut).
    assert!(
        without >= 1,
        "the bomb is refused (counted without usable CFI): {tables}"
    );
}

/// Builds the Go workload `tests/hostile_workloads/<name>` (standard library only).
fn build_go(dir: &Path, name: &str) -> PathBuf {
    let work = dir.join(format!("{name}-src"));
    std::fs::create_dir_all(&work).unwrap();
    for entry in std::fs::read_dir(workload(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), work.join(entry.file_name())).unwrap();
    }
    let bin = dir.join(name);
    let out = Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(&work)
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=mod")
        .output()
        .expect("running `go build` (install Go)");
    assert!(
        out.status.success(),
        "go build of {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

/// Go programs that point `runtime.mbuckets` at fake bucket lists in their own memory: one
/// that loops back on itself, and two of 30,000 overlapping buckets claiming 1,020 frames
/// each (245 MiB each for a reader that keeps what it reads, from 4 MiB of the workload's
/// memory). The agent reads Go heaps at the end of the capture and keeps every process's
/// buckets until the profile is built.
#[test]
fn hostile_go_bucket_lists_cannot_exhaust_the_agent() {
    let _turn = hostile_test();
    let dir = tempfile::tempdir().unwrap();
    let bin = build_go(dir.path(), "gobuckets");
    let mut good = TestCgroup::new("hostile-go-good");
    let (good_pid, _good_out) = spawn_ready(&mut good, Command::new(&bin).arg("good"));
    let mut cg = TestCgroup::new("hostile-go");
    let mut hostile = Vec::new();
    let mut outs = Vec::new();
    for mode in ["selfloop", "overlap", "overlap"] {
        let (pid, out) = spawn_ready(&mut cg, Command::new(&bin).arg(mode));
        outs.push(out);
        hostile.push((pid, mode));
    }
    let out = dir.path().join("heap.pb.gz");
    let run = chart_agent::capture(
        &[
            "--type",
            "heap",
            "--heap-source",
            "goruntime",
            "--cgroup",
            cg.path().to_str().unwrap(),
            "--cgroup",
            good.path().to_str().unwrap(),
            "--text",
            "-o",
            out.to_str().unwrap(),
        ],
        DEADLINE,
    );
    report("3 hostile Go bucket lists", &run);
    assert_ended_well(&run);
    let p = Decoded::read(&out);
    let names = function_names(&p);
    assert!(
        names.iter().any(|n| n == "main.keepGood"),
        "the good Go process's heap is still profiled: {names:?}"
    );
    assert!(
        p.profile
            .sample
            .iter()
            .all(|s| p.num_label(s, "pid") == Some(i64::from(good_pid))),
        "no sample of a hostile list is kept"
    );
    for (pid, mode) in hostile {
        let line = run
            .stdout
            .lines()
            .find(|l| l.contains(&format!("pid {pid} ")))
            .unwrap_or_else(|| panic!("a line for pid {pid} in:\n{}", run.stdout));
        let want = if mode == "selfloop" {
            "loops back"
        } else {
            "would hold more than"
        };
        assert!(line.contains(want), "pid {pid} ({mode}): {line}");
    }
}

/// A heap profile that a pod's endpoint serves: `members` gzip members, each 4 MiB of
/// string-table entries of 64 KiB (a valid start of a `perftools.profiles.Profile`) with
/// one byte in eight drawn at random, so that it shrinks about three times: a body just
/// under the 64 MiB response cap that inflates to about 200 MiB, each byte of it kept by
/// a decoder that keeps what it inflates. Returns the body and its inflated size.
fn hostile_pprof_body(max_bytes: usize) -> (Vec<u8>, u64) {
    use std::io::Write as _;
    const ENTRY: usize = 64 << 10;
    let mut payload = Vec::with_capacity(4 << 20);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..64 {
        // string_table (field 6, length-delimited), length 65536 as a varint.
        payload.extend_from_slice(&[0x32, 0x80, 0x80, 0x04]);
        for _ in 0..ENTRY {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            payload.push(if x & 7 == 0 {
                b'a' + (x >> 8) as u8 % 16
            } else {
                b'a'
            });
        }
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&payload).unwrap();
    let member = gz.finish().unwrap();
    let members = max_bytes / member.len();
    (member.repeat(members), (payload.len() * members) as u64)
}

/// An HTTP server on 127.0.0.1 answering every request with `body` (a gzipped pprof
/// profile). Returns its heap profile URL.
fn pprof_server(body: std::sync::Arc<Vec<u8>>) -> String {
    use std::io::{Read as _, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let body = body.clone();
            std::thread::spawn(move || {
                let mut s = stream;
                // The request head; its content does not matter.
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                // The agent may hang up once it has seen enough.
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(&body);
            });
        }
    });
    format!("http://{addr}/debug/pprof/heap")
}

/// The containers of a pod serve heap profiles of 64 MiB that inflate to 200 MiB, all
/// fetched in one capture: each is refused once what its decoding would keep passes the
/// cap, but fetched all at once their bodies and inflated bytes together exceed the
/// agent's memory. A well-behaved endpoint in the same capture is still profiled.
#[test]
fn hostile_pprof_endpoints_cannot_exhaust_the_agent() {
    let _turn = hostile_test();
    const HOSTILE: usize = 6;
    let (body, inflated) = hostile_pprof_body((64 << 20) - (1 << 20));
    eprintln!(
        "hostile endpoint body: {:.1} MiB, inflating to {:.1} MiB",
        body.len() as f64 / (1 << 20) as f64,
        inflated as f64 / (1 << 20) as f64
    );
    assert!(
        inflated > 128 << 20,
        "the body inflates past what a decode may keep (128 MiB)"
    );
    let body = std::sync::Arc::new(body);
    let hostile: Vec<String> = (0..HOSTILE).map(|_| pprof_server(body.clone())).collect();
    let mut good = ProfileBuilder::new(&[("inuse_space", "bytes")]);
    good.add_sample(
        &[Frame {
            address: 0x1000,
            mapping: None,
            lines: vec![FrameLine {
                function: "good_endpoint_alloc".into(),
                file: String::new(),
                line: 0,
            }],
        }],
        &[4096],
        &[],
    );
    let good = pprof_server(std::sync::Arc::new(encode_gzip(&good.build()).unwrap()));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("heap.pb.gz");
    let mut args = vec!["--type", "heap", "--heap-source", "endpoint"];
    for url in hostile.iter().chain([&good]) {
        args.extend(["--endpoint", url]);
    }
    args.extend(["--text", "-o", out.to_str().unwrap()]);
    let run = chart_agent::capture(&args, DEADLINE);
    report(&format!("{HOSTILE} hostile pprof endpoints"), &run);
    assert_ended_well(&run);
    let names = function_names(&Decoded::read(&out));
    assert!(
        names.iter().any(|n| n == "good_endpoint_alloc"),
        "the good endpoint's profile is still produced: {names:?}"
    );
    for url in &hostile {
        let line = run
            .stdout
            .lines()
            .find(|l| l.contains("warning:") && l.contains(url.as_str()))
            .unwrap_or_else(|| panic!("a warning for {url} in:\n{}", run.stdout));
        assert!(line.contains("refusing it"), "{line}");
    }
}

/// Whether process `pid` holds a uprobe (kprobe-type) BPF program: the eBPF heap sampler
/// is loaded, so the capture's processes were looked at and its window runs.
fn holds_uprobe_program(pid: u32) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|l| l.to_str() == Some("anon_inode:bpf-prog"))
            && std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .is_ok_and(|info| info.lines().any(|l| l == "prog_type:\t2"))
    })
}

/// `clone_args` of clone3(2), up to `cgroup` (CLONE_ARGS_SIZE_VER2).
#[repr(C)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// Starts `program args` with PID `pid` (which must be free) in `cgroup`, its stdout piped
/// back: what the kernel could do to any new process once `pid` was freed.
fn spawn_with_pid(
    pid: u32,
    cgroup: &Path,
    program: &Path,
    args: &[&str],
) -> std::io::BufReader<std::fs::File> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd as _, FromRawFd as _};
    let cg = std::fs::File::open(cgroup).unwrap();
    let mut fds = [0; 2];
    // SAFETY: a two-int array for pipe2.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let prog = CString::new(program.to_str().unwrap()).unwrap();
    let argv_c: Vec<CString> = std::iter::once(prog.clone())
        .chain(args.iter().map(|a| CString::new(*a).unwrap()))
        .collect();
    let mut argv: Vec<*const libc::c_char> = argv_c.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    let tid = [libc::pid_t::try_from(pid).unwrap()];
    let args = CloneArgs {
        flags: 0x2_0000_0000, // CLONE_INTO_CGROUP
        pidfd: 0,
        child_tid: 0,
        parent_tid: 0,
        exit_signal: libc::SIGCHLD as u64,
        stack: 0,
        stack_size: 0,
        tls: 0,
        set_tid: tid.as_ptr() as u64,
        set_tid_size: 1,
        cgroup: cg.as_raw_fd() as u64,
    };
    // SAFETY: clone3 without CLONE_VM forks this thread; the child makes only
    // async-signal-safe calls (dup2, execve, _exit) on memory prepared before.
    let r = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &raw const args,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if r == 0 {
        // SAFETY: in the child, as above.
        unsafe {
            libc::dup2(fds[1], 1);
            libc::execve(prog.as_ptr(), argv.as_ptr(), envp.as_ptr());
            libc::_exit(127);
        }
    }
    assert!(
        r > 0,
        "clone3 with set_tid {pid}: {}",
        std::io::Error::last_os_error()
    );
    assert_eq!(r as u32, pid);
    // SAFETY: closing our copy of the write end; the read end becomes a File we own.
    unsafe { libc::close(fds[1]) };
    let read = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    let mut r = std::io::BufReader::new(read);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut r, &mut line).unwrap();
    assert!(line.starts_with("ready"), "process {pid} said {line:?}");
    r
}

/// A Go process of the target exits during a heap capture and its PID goes to another
/// tenant's Go process (same image). Read by PID at the end, that process's heap — its
/// allocation sites, its memory — would land in the first tenant's profile.
#[test]
fn a_reused_pid_does_not_pull_another_process_into_a_heap_profile() {
    let _turn = hostile_test();
    let dir = tempfile::tempdir().unwrap();
    let go = build_go(dir.path(), "gobuckets");
    let spin = dir.path().join("spin");
    cc(&[
        "-o",
        spin.to_str().unwrap(),
        workload("spin.c").to_str().unwrap(),
    ]);
    let mut target = TestCgroup::new("hostile-reuse");
    let (go_pid, _go_out) = spawn_ready(&mut target, Command::new(&go).arg("good"));
    // A C process, so that the capture runs an eBPF window before reading Go heaps.
    let (_, _spin_out) = spawn_ready(&mut target, &mut Command::new(&spin));
    let other = TestCgroup::new("hostile-reuse-other");
    let out = dir.path().join("heap.pb.gz");
    let agent = chart_agent::start(&[
        "--type",
        "heap",
        "--heap-source",
        "auto",
        "--cgroup",
        target.path().to_str().unwrap(),
        "--duration",
        "6s",
        "--text",
        "-o",
        out.to_str().unwrap(),
    ]);
    support::wait_until("the agent's eBPF heap window", || {
        holds_uprobe_program(agent.pid)
    });
    // The Go process found at the start exits; another tenant's gets its PID.
    // SAFETY: signalling and reaping our own child.
    unsafe {
        assert_eq!(libc::kill(go_pid as i32, libc::SIGKILL), 0);
        assert_eq!(
            libc::waitpid(go_pid as i32, std::ptr::null_mut(), 0),
            go_pid as i32
        );
    }
    let _victim_out = spawn_with_pid(go_pid, other.path(), &go, &["victim"]);
    let run = agent.wait(DEADLINE);
    // SAFETY: the victim is our child; stop and reap it.
    unsafe {
        libc::kill(go_pid as i32, libc::SIGKILL);
        libc::waitpid(go_pid as i32, std::ptr::null_mut(), 0);
    }
    assert_ended_well(&run);
    let names = function_names(&Decoded::read(&out));
    assert!(
        !names.iter().any(|n| n.contains("keepVictimSecret")),
        "another tenant's heap is in the profile: {names:?}"
    );
    let line = run
        .stdout
        .lines()
        .find(|l| l.contains(&format!("pid {go_pid} ")))
        .unwrap_or_else(|| panic!("a line for pid {go_pid} in:\n{}", run.stdout));
    assert!(line.contains("exited before its heap was read"), "{line}");
}

/// C source of a shared library with `hot` small functions the workload calls in turn
/// (`big_fns`) and `cold` others with types of their own, so that its symbol table and
/// DWARF are large and symbolizing its frames reads them for a while.
fn big_library_source(hot: usize, cold: usize) -> String {
    let mut s = String::new();
    for i in 0..hot {
        s.push_str(&format!(
            "__attribute__((noinline)) unsigned long big_fn_{i}(unsigned long x)\n\
             {{ for (int i = 0; i < 2000; i++) x = x * 31 + {i}; return x; }}\n"
        ));
    }
    s.push_str("unsigned long (*big_fns[])(unsigned long) = {\n");
    for i in 0..hot {
        s.push_str(&format!("big_fn_{i},\n"));
    }
    s.push_str("};\nint big_fn_count = sizeof big_fns / sizeof big_fns[0];\n");
    for i in 0..cold {
        s.push_str(&format!(
            "struct cold_{i} {{ int a_{i}; long b_{i}; char c_{i}[{n}]; }};\n\
             int cold_fn_{i}(struct cold_{i} *p) {{ return p->a_{i} + p->c_{i}[1]; }}\n",
            n = i % 64 + 2
        ));
    }
    s
}

const BIG_APP: &str = r#"
#include <stdio.h>
extern unsigned long (*big_fns[])(unsigned long);
extern int big_fn_count;
volatile unsigned long sink;
__attribute__((noinline)) void sigbus_app_spin(void)
{
	for (unsigned long n = 0;; n++)
		sink += big_fns[n % big_fn_count](n);
}
int main(void)
{
	printf("ready\n");
	fflush(stdout);
	sigbus_app_spin();
}
"#;

/// Where the loadable segments of the ELF file `bytes` end (page-aligned): what a process
/// mapping it runs from. Past it: symbols, DWARF, section headers.
fn end_of_loaded_segments(bytes: &[u8]) -> u64 {
    use object::{Object as _, ObjectSegment as _};
    let obj = object::File::parse(bytes).expect("an ELF file");
    let end = obj
        .segments()
        .map(|s| {
            let (off, size) = s.file_range();
            off + size
        })
        .max()
        .expect("loadable segments");
    end.next_multiple_of(4096)
}

/// Whether process `pid` maps inode `ino`.
fn maps_inode(pid: u32, ino: u64) -> bool {
    let needle = format!(" {ino} ");
    std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| m.contains(&needle))
}

/// Whether process `pid` (our child) has exited (a zombie until reaped).
fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
    })
}

/// A workload truncates its own library while the agent reads it. The agent reads
/// binaries by mapping them (blazesym); an access past the new end of the file raises
/// SIGBUS, which kills the agent. Made deterministic: whenever the agent maps the library,
/// the test stops the agent, truncates the library past its loaded segments (the workload
/// keeps running: it executes only those), lets the agent go on, and restores the file
/// once the agent unmapped it.
#[test]
fn truncating_a_mapped_library_does_not_crash_the_agent() {
    let _turn = hostile_test();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (src, lib) = (d.join("libbig.c"), d.join("libbig.so"));
    std::fs::write(&src, big_library_source(300, 4000)).unwrap();
    cc(&[
        "-shared",
        "-fPIC",
        "-o",
        lib.to_str().unwrap(),
        src.to_str().unwrap(),
    ]);
    let app_src = d.join("app.c");
    std::fs::write(&app_src, BIG_APP).unwrap();
    let app = d.join("app");
    cc(&[
        "-o",
        app.to_str().unwrap(),
        app_src.to_str().unwrap(),
        "-L",
        d.to_str().unwrap(),
        "-lbig",
        "-Wl,-rpath,$ORIGIN",
    ]);
    let whole = std::fs::read(&lib).unwrap();
    let keep = end_of_loaded_segments(&whole);
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&lib).unwrap());
    eprintln!(
        "libbig.so: {} KiB, truncated to {} KiB",
        whole.len() >> 10,
        keep >> 10
    );
    let mut cg = TestCgroup::new("hostile-sigbus");
    let (_, _out) = spawn_ready(&mut cg, &mut Command::new(&app));
    let out = d.join("cpu.pb.gz");
    let agent = chart_agent::start(&cpu_args(&[cg.path().to_str().unwrap()], &out));
    let pid = agent.pid;
    let mut truncations = 0;
    let end = std::time::Instant::now() + DEADLINE;
    while !exited(pid) && std::time::Instant::now() < end {
        if maps_inode(pid, ino) {
            // SAFETY: stopping and resuming our own child.
            unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
            std::fs::OpenOptions::new()
                .write(true)
                .open(&lib)
                .and_then(|f| f.set_len(keep))
                .unwrap();
            truncations += 1;
            // SAFETY: as above.
            unsafe { libc::kill(pid as i32, libc::SIGCONT) };
            while maps_inode(pid, ino) && !exited(pid) {
                std::thread::sleep(Duration::from_millis(1));
            }
            // Whole again for the next reader (written in place: truncating to zero would
            // take the workload's own code away).
            std::os::unix::fs::FileExt::write_all_at(
                &std::fs::OpenOptions::new().write(true).open(&lib).unwrap(),
                &whole,
                0,
            )
            .unwrap();
        }
        // Polled: the agent's mappings change without any event to wait on.
        std::thread::sleep(Duration::from_millis(1));
    }
    let run = agent.wait(DEADLINE);
    eprintln!("the library was truncated {truncations} times under the agent's mapping");
    assert!(truncations > 0, "the agent never mapped the library");
    assert_ne!(
        run.signal,
        Some(libc::SIGBUS),
        "the agent died of SIGBUS: {}",
        run.summary()
    );
    assert_ended_well(&run);
    let p = Decoded::read(&out);
    let notes = comments(&p);
    assert!(
        notes.iter().any(|c| c.contains("truncated while mapped")),
        "the profile says reads of truncated files were answered with zeros: {notes:#?}"
    );
    let names = function_names(&p);
    assert!(
        names.iter().any(|n| n == "sigbus_app_spin"),
        "the executable is still named: {names:?}"
    );
}
