//! Compiles every `bpf/*.bpf.c` into a libbpf-rs skeleton in `OUT_DIR` and
//! writes `skeletons.rs`, one `pub mod <name>` per program, so adding a BPF
//! program is adding a file. `vmlinux.h` is generated from the running
//! kernel's BTF (CO-RE makes the result portable across kernels).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::{env, fs};

use libbpf_cargo::SkeletonBuilder;

fn main() {
    if let Err(e) = run() {
        // A build script reports failure by panicking; the message is the point.
        panic!("\n\nflamefleet-agent build failed: {e}\n\n");
    }
}

fn run() -> Result<(), String> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let bpf_dir = manifest.join("../bpf");
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    println!("cargo:rerun-if-changed={}", bpf_dir.display());

    let vmlinux = out.join("vmlinux.h");
    generate_vmlinux_h(&vmlinux)?;

    let mut sources: Vec<PathBuf> = fs::read_dir(&bpf_dir)
        .map_err(|e| format!("cannot list {}: {e}", bpf_dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .collect();
    sources.sort();
    let mut index = String::new();
    for path in &sources {
        let file = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        println!("cargo:rerun-if-changed={}", path.display());
        let Some(name) = file.strip_suffix(".bpf.c") else {
            continue;
        };
        let skel = out.join(format!("{name}.skel.rs"));
        SkeletonBuilder::new()
            .source(path)
            .clang_args([
                "-I".as_ref(),
                out.as_os_str(),
                "-I".as_ref(),
                bpf_dir.as_os_str(),
                "-Wall".as_ref(),
                "-Werror".as_ref(),
            ])
            .build_and_generate(&skel)
            .map_err(|e| format!("compiling {}: {e:#}", path.display()))?;
        writeln!(
            index,
            "/// Skeleton of `bpf/{file}`.\n#[allow(clippy::all, missing_docs, dead_code, unsafe_op_in_unsafe_fn, unused_imports, non_camel_case_types, non_upper_case_globals, non_snake_case)]\npub mod {name} {{ include!(concat!(env!(\"OUT_DIR\"), \"/{name}.skel.rs\")); }}"
        )
        .map_err(|e| e.to_string())?;
    }
    fs::write(out.join("skeletons.rs"), index).map_err(|e| e.to_string())
}

/// Dumps the kernel's BTF as C with bpftool; fails with advice when it can't.
fn generate_vmlinux_h(dst: &Path) -> Result<(), String> {
    let btf = env::var("FLAMEFLEET_BTF").unwrap_or_else(|_| "/sys/kernel/btf/vmlinux".into());
    println!("cargo:rerun-if-env-changed=FLAMEFLEET_BTF");
    if !Path::new(&btf).exists() {
        return Err(format!(
            "expected kernel BTF at {btf} to generate vmlinux.h, found nothing; \
             build on a kernel with CONFIG_DEBUG_INFO_BTF=y or point FLAMEFLEET_BTF at a BTF file"
        ));
    }
    let output = Command::new("bpftool")
        .args(["btf", "dump", "file", &btf, "format", "c"])
        .output()
        .map_err(|e| {
            format!("cannot run bpftool ({e}); install it (Debian: apt-get install bpftool)")
        })?;
    if !output.status.success() {
        return Err(format!(
            "bpftool btf dump {btf} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    fs::write(dst, output.stdout).map_err(|e| format!("writing {}: {e}", dst.display()))
}
