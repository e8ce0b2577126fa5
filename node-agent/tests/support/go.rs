//! Go workloads of the heap tests (`tests/heap_workloads/<name>`), built with `go build`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Set by the guest tier (`tests/kernels.rs`) to `goruntime` built on the host with the
/// installed toolchain: a guest sees the host's files, and `go build` under TCG takes
/// minutes. Read by the heap test that runs in the guests.
pub const PREBUILT_GORUNTIME: &str = "FLAMEFLEET_PREBUILT_GORUNTIME";

/// Builds workload `name` (a folder of tests/heap_workloads) into `dir` with `toolchain`
/// (`None`: the installed `go`), `-ldflags ldflags`, cgo on or off and `extra` flags of
/// `go build` (e.g. `-buildmode=pie`).
pub fn build_workload(
    dir: &Path,
    name: &str,
    toolchain: Option<&str>,
    ldflags: &str,
    cgo: bool,
    extra: &[&str],
) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/heap_workloads")
        .join(name);
    let work = dir.join(format!(
        "{name}-{}{}{}",
        toolchain.unwrap_or("local"),
        extra.join(""),
        ldflags.replace(' ', "")
    ));
    std::fs::create_dir_all(&work).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), work.join(entry.file_name())).unwrap();
    }
    let bin = work.join(name);
    let mut cmd = Command::new("go");
    cmd.args(["build", "-ldflags", ldflags])
        .args(extra)
        .arg("-o")
        .arg(&bin)
        .arg(".")
        .current_dir(&work)
        .env("GOFLAGS", "-mod=mod")
        .env("CGO_ENABLED", if cgo { "1" } else { "0" })
        .env("GOTOOLCHAIN", toolchain.unwrap_or("local"));
    let out = cmd.output().expect("running `go build` (install Go)");
    assert!(
        out.status.success(),
        "go build of {name} with {toolchain:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}
