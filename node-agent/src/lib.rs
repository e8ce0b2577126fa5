//! The Flamefleet node agent: turns targets (pods or raw cgroups) into
//! cgroup IDs, captures CPU profiles and run-queue latency with eBPF through
//! one shared sampler per profile type, symbolizes, and writes pprof.
//!
//! Layout: [`cgroup`] (targets → cgroups), [`capture`] (one engine per profile
//! type and the shared sampler registry), [`process`] (process snapshots),
//! [`symbolize`] (blazesym, kallsyms), [`pprof`] (the workspace's pprof kit),
//! [`unwind`] (CFI tables for the BPF stack walker), [`gopclntab`] (Go's own function
//! table: names, lines and unwind rows of stripped Go binaries), [`cli`] (the `capture`
//! subcommand), [`bpf`] (generated skeletons), [`service`] (the gRPC
//! AgentService: capture table, upload, status write-back, mTLS), [`continuous`] (always-on
//! windows of the pods of continuous policies).
//!
//! What profiled processes own is read through [`process`], because a
//! workload may be hostile: [`process::files`] (their files: inside their
//! root, non-blocking, regular files only, bounded), [`process::maps`] (their
//! `/proc/<pid>/maps`, bounded) and [`process::handle`] (a process held by
//! identity, so a reused PID never mixes another process's data in); and
//! [`sigbus`] keeps a workload that truncates a file the agent has mapped
//! from killing it.

pub mod bpf;
pub mod capture;
pub mod cgroup;
pub mod cli;
pub mod continuous;
pub mod gopclntab;
pub mod java;
pub mod perf_map;
pub mod process;
pub mod python;
pub mod service;
pub mod sigbus;
pub mod symbolize;
pub mod trigger;
pub mod unwind;

/// The pprof kit (`flamefleet-pprof`): builder, bounded decode, validation, merge, readers.
pub use flamefleet_pprof as pprof;
