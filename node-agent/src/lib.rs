//! The Flamefleet node agent: turns targets (pods or raw cgroups) into
//! cgroup IDs, captures CPU profiles and run-queue latency with eBPF through
//! one shared sampler per profile type, symbolizes, and writes pprof.
//!
//! Layout: [`cgroup`] (targets → cgroups), [`capture`] (one engine per profile
//! type and the shared sampler registry), [`process`] (process snapshots),
//! [`symbolize`] (blazesym, kallsyms), [`pprof`] (the workspace's pprof kit),
//! [`unwind`] (CFI tables for the BPF stack walker), [`cli`] (the `capture`
//! subcommand), [`bpf`] (generated skeletons), [`service`] (the gRPC
//! AgentService: capture table, upload, status write-back, mTLS).

pub mod bpf;
pub mod capture;
pub mod cgroup;
pub mod cli;
pub mod perf_map;
pub mod process;
pub mod service;
pub mod symbolize;
pub mod unwind;

/// The pprof kit (`flamefleet-pprof`): builder, bounded decode, validation, merge, readers.
pub use flamefleet_pprof as pprof;
