//! The `flamefleet-agent` command line: `capture` runs one capture locally,
//! with no Kubernetes, and writes a gzipped pprof file.
//!
//! ```text
//! flamefleet-agent capture --type cpu|runqlat|offcpu --cgroup PATH... [--duration 10s]
//!     [--frequency 99] [--min-block 1ms] -o out.pb.gz [--text]
//! flamefleet-agent capture --type heap [--heap-source auto|endpoint|ebpf|goruntime]
//!     [--cgroup PATH...] [--sample-bytes 524288]
//!     [--endpoint URL... | --port P [--pid PID] [--path /debug/pprof/heap]] -o out.pb.gz
//! ```

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::capture::cpu::{CpuOptions, PerfEventKind};
use crate::capture::heap::{self, HeapError, HeapSource};
use crate::capture::lifecycle::{self, CaptureSpec, EngineError};
use crate::capture::offcpu::{OffcpuGuard, OffcpuOptions};
use crate::capture::runqlat::{LatencyUnit, RunqlatOptions};
use crate::capture::window::{Stop, WindowEnd};
use crate::capture::{CaptureError, CaptureTarget, SamplerConfig, Samplers, TargetLabels};
use crate::cgroup::{CgroupError, CgroupRoot};
use crate::pprof;

/// Top-level command line.
#[derive(Debug, Parser)]
#[command(name = "flamefleet-agent", version, about = "Flamefleet node agent")]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Capture a profile of cgroups on this host and write a pprof file.
    Capture(CaptureArgs),
    /// Serve the gRPC AgentService (mutual TLS) for the operator.
    Serve(ServeArgs),
}

/// Arguments of `serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// This node's name (the downward API's spec.nodeName in a cluster).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Address to listen on; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "0.0.0.0:7070")]
    pub listen: std::net::SocketAddr,
    /// Where this node's serving certificate comes from: `files` (--tls-ca, --tls-cert,
    /// --tls-key) or `csr` (a Kubernetes CertificateSigningRequest the operator signs for
    /// this node alone; renewed automatically).
    #[arg(long, value_enum, default_value = "files")]
    pub tls_bootstrap: TlsBootstrap,
    /// CA certificate (PEM) the operator's client certificate must chain to (files mode).
    #[arg(long, required_if_eq("tls_bootstrap", "files"))]
    pub tls_ca: Option<PathBuf>,
    /// Serving certificate (PEM) for this node (files mode).
    #[arg(long, required_if_eq("tls_bootstrap", "files"))]
    pub tls_cert: Option<PathBuf>,
    /// Serving private key (PEM) (files mode).
    #[arg(long, required_if_eq("tls_bootstrap", "files"))]
    pub tls_key: Option<PathBuf>,
    /// Address of the probe server (`/healthz`, `/readyz`, `/metrics`); none when absent.
    #[arg(long)]
    pub probe_listen: Option<std::net::SocketAddr>,
    /// Address of the agent's own profiles (`/debug/pprof/profile`, `/debug/pprof/heap`);
    /// none when absent. Keep it cluster-internal (the chart does).
    #[arg(long)]
    pub debug_listen: Option<std::net::SocketAddr>,
    /// Sizes of the samplers' BPF maps.
    #[command(flatten)]
    pub map_sizes: crate::capture::MapSizes,
    /// Kubeconfig for the CSR of `--tls-bootstrap csr` (default: in-cluster config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// cgroup2 directory pod cgroups are looked up under, or a directory holding the host's
    /// cgroup filesystem (its `unified/` is used on hybrid hosts), e.g. /host/sys/fs/cgroup
    /// in a container (default: the cgroup2 mount).
    #[arg(long)]
    pub cgroup_root: Option<PathBuf>,
    /// Container runtime hint (accepted for compatibility; every runtime's layout is tried).
    #[arg(long)]
    pub container_runtime_hint: Option<String>,
    /// Least cooldown of a policy trigger on this node, e.g. `60s`: a trigger asking for less
    /// fires at most once per this long per container (docs/triggers.md).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub min_trigger_cooldown: std::time::Duration,
    /// Most cgroups the node's trigger watcher watches at once; one more is refused.
    #[arg(long, default_value_t = 1024)]
    pub max_watched_cgroups: usize,
    /// The node's budget of trigger fires per minute, all pods together.
    #[arg(long, default_value_t = 30)]
    pub trigger_fires_per_minute: u32,
    /// Samples per second on each CPU of the lead-up ring, the in-kernel ring of recent CPU
    /// samples of the pods CPU and pressure triggers watch (1-99; docs/triggers.md).
    #[arg(long, default_value_t = 19)]
    pub trigger_lead_up_hz: u64,
    /// How far before a CPU or pressure fire its CPU profile reaches (at most 30s).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub trigger_lead_up: std::time::Duration,
}

/// Runs `serve` until SIGINT or SIGTERM.
pub fn run_serve(args: &ServeArgs) -> anyhow::Result<()> {
    let config = crate::service::AgentConfig {
        node_name: args.node_name.clone(),
        listen: args.listen,
        tls: match (
            args.tls_bootstrap,
            &args.tls_ca,
            &args.tls_cert,
            &args.tls_key,
        ) {
            (TlsBootstrap::Csr, ..) => crate::service::TlsSource::Csr,
            (TlsBootstrap::Files, Some(ca), Some(cert), Some(key)) => {
                crate::service::TlsSource::Files(crate::service::TlsFiles {
                    ca: ca.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                })
            }
            (TlsBootstrap::Files, ..) => anyhow::bail!(
                "--tls-bootstrap files needs --tls-ca, --tls-cert and --tls-key (or use --tls-bootstrap csr in a cluster)"
            ),
        },
        probe_listen: args.probe_listen,
        debug_listen: args.debug_listen,
        map_sizes: args.map_sizes.clone(),
        kubeconfig: args.kubeconfig.clone(),
        cgroup_root: args.cgroup_root.clone(),
        triggers: crate::trigger::WatcherConfig {
            min_cooldown: args.min_trigger_cooldown,
            max_watched: args.max_watched_cgroups,
            fires_per_minute: args.trigger_fires_per_minute,
            ..crate::trigger::WatcherConfig::default()
        },
        lead_up: crate::trigger::cpu_ring::RingConfig {
            frequency: args.trigger_lead_up_hz,
            lookback: args.trigger_lead_up,
            ..crate::trigger::cpu_ring::RingConfig::default()
        },
    };
    config.lead_up.validate().map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let shutdown = async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("shutting down");
        };
        crate::service::serve(config, shutdown).await?;
        Ok(())
    })
}

/// Sources of the agent's serving certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TlsBootstrap {
    /// PEM files.
    Files,
    /// A Kubernetes CSR signed by the operator.
    Csr,
}

/// Profile types the `capture` subcommand knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProfileType {
    /// On-CPU stacks sampled by a perf event.
    Cpu,
    /// Run-queue latency histograms.
    Runqlat,
    /// Heap profile, from a pprof endpoint or eBPF allocation sampling.
    Heap,
    /// Off-CPU time: where threads block, by stack.
    Offcpu,
}

/// Histogram unit on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum UnitArg {
    /// Microseconds.
    Us,
    /// Milliseconds.
    Ms,
}

/// Perf event on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EventArg {
    /// Software cpu-clock.
    CpuClock,
    /// Hardware cycles.
    Cycles,
}

/// Arguments of `capture`.
#[derive(Debug, Args)]
pub struct CaptureArgs {
    /// Profile type.
    #[arg(long = "type", value_enum)]
    pub profile_type: ProfileType,
    /// Target cgroup v2 directory (absolute, or relative to the cgroup2 root); repeatable.
    #[arg(long = "cgroup", required_unless_present_any = ["endpoints", "port"], num_args = 1..)]
    pub cgroups: Vec<PathBuf>,
    /// Capture length, e.g. 10s, 500ms, 1m.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// CPU: samples per second per CPU.
    #[arg(long, default_value_t = 99)]
    pub frequency: u64,
    /// CPU: perf event.
    #[arg(long, value_enum, default_value = "cpu-clock")]
    pub event: EventArg,
    /// CPU: do not record kernel stacks.
    #[arg(long)]
    pub no_kernel_stacks: bool,
    /// CPU and heap (eBPF): walk user stacks by frame pointers only (no CFI
    /// unwind tables); code built without frame pointers then loses its callers.
    #[arg(long)]
    pub frame_pointers_only: bool,
    /// runqlat: one histogram per process.
    #[arg(long)]
    pub per_process: bool,
    /// runqlat: histogram unit.
    #[arg(long, value_enum, default_value = "us")]
    pub unit: UnitArg,
    /// runqlat: where timestamps come from (see `serve --help`).
    #[arg(long, value_enum)]
    pub runqlat_clock: Option<crate::capture::RunqlatClock>,
    /// Heap: where the profile comes from.
    #[arg(long, value_enum, default_value = "auto")]
    pub heap_source: HeapSource,
    /// Heap (eBPF): mean bytes allocated between samples; 0 samples every allocation.
    #[arg(long, default_value_t = heap::sampling::DEFAULT_SAMPLE_BYTES)]
    pub sample_bytes: u64,
    /// Heap (eBPF) and off-CPU: refuse when a short first window projects more
    /// overhead (uprobe traps, stack walks) than this percent of the targets' CPU time
    /// (0: no guard).
    #[arg(long, default_value_t = heap::overhead::DEFAULT_MAX_OVERHEAD_PERCENT)]
    pub max_overhead_percent: f64,
    /// Heap (eBPF) and off-CPU: capture even above --max-overhead-percent.
    #[arg(long)]
    pub force: bool,
    /// Off-CPU: blocks shorter than this are counted, not attributed to a stack.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1ms")]
    pub min_block: Duration,
    /// Off-CPU: the wall-clock view, on-CPU samples (at --frequency, --event) in the same
    /// profile, its default sample type wall/nanoseconds (docs/offcpu.md).
    #[arg(long)]
    pub with_on_cpu: bool,
    /// Heap: pprof endpoint URL, e.g. http://10.0.0.5:6060/debug/pprof/heap; repeatable
    /// (fetched as a pod's containers are: a few at a time), each with the --cgroup given
    /// in the same place, if any.
    #[arg(long = "endpoint", conflicts_with = "port")]
    pub endpoints: Vec<String>,
    /// Heap: endpoint port on 127.0.0.1 (inside --pid's network namespace if given).
    #[arg(long)]
    pub port: Option<u16>,
    /// Heap: process whose network namespace to connect from (with --port).
    #[arg(long, requires = "port")]
    pub pid: Option<u32>,
    /// Heap: endpoint path (with --port).
    #[arg(long, default_value = heap::endpoint::DEFAULT_PATH)]
    pub path: String,
    /// Heap (endpoint): Go's delta form, allocations over this many seconds (0: current heap).
    #[arg(long, default_value_t = 0)]
    pub delta_seconds: u64,
    /// Output file (gzipped pprof).
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// Also print a text report (runqlat histogram, CPU top functions).
    #[arg(long)]
    pub text: bool,
    /// cgroup2 mount to resolve paths under (default: found in /proc/mounts).
    #[arg(long)]
    pub cgroup_root: Option<PathBuf>,
    /// Value of the `node` label (default: host name).
    #[arg(long)]
    pub node: Option<String>,
}

/// Errors of the command line, each with what to do.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad argument values.
    #[error("{0}")]
    Usage(String),
    /// Target resolution failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The capture failed.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// The heap capture failed.
    #[error(transparent)]
    Heap(#[from] HeapError),
    /// Writing the output failed.
    #[error("writing {path}: {source}")]
    Output {
        /// The output path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// What a finished capture wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureReport {
    /// The pprof file.
    pub output: PathBuf,
    /// Number of samples (CPU), waits (runqlat) or allocations (heap), as the capture
    /// summary defines them (docs/capture.md).
    pub samples: u64,
    /// Text report (always computed; printed with `--text`).
    pub text: String,
}

impl From<EngineError> for CliError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Capture(e) => Self::Capture(e),
            EngineError::Heap(e) => Self::Heap(e),
        }
    }
}

/// Runs `capture`: validates, resolves targets, captures, writes the file.
pub fn run_capture(args: &CaptureArgs) -> Result<CaptureReport, CliError> {
    if args.duration.is_zero() {
        return Err(CliError::Usage(
            "--duration must be greater than 0, found 0; e.g. --duration 10s".into(),
        ));
    }
    let root = match &args.cgroup_root {
        Some(p) => CgroupRoot::new(p)?,
        None => CgroupRoot::detect()?,
    };
    let targets = args
        .cgroups
        .iter()
        .map(|p| root.resolve_path(p).map(CaptureTarget::raw))
        .collect::<Result<Vec<_>, _>>()?;
    let mut config = SamplerConfig::default();
    if let Some(clock) = args.runqlat_clock {
        config.runqlat_clock = clock;
    }
    if let Some(node) = &args.node {
        config.node = node.clone();
    }
    let samplers = Samplers::new(config);
    let cpu_options = CpuOptions {
        frequency: args.frequency,
        event: match args.event {
            EventArg::CpuClock => PerfEventKind::CpuClock,
            EventArg::Cycles => PerfEventKind::Cycles,
        },
        kernel_stacks: !args.no_kernel_stacks,
        cfi_unwind: !args.frame_pointers_only,
    };
    let spec = match args.profile_type {
        ProfileType::Cpu => CaptureSpec::Cpu {
            targets,
            options: cpu_options,
            duration: args.duration,
        },
        ProfileType::Runqlat => CaptureSpec::Runqlat {
            targets,
            options: RunqlatOptions {
                per_process: args.per_process,
                unit: match args.unit {
                    UnitArg::Us => LatencyUnit::Micros,
                    UnitArg::Ms => LatencyUnit::Millis,
                },
            },
            duration: args.duration,
        },
        ProfileType::Heap => {
            let mut request = heap::cli_request(
                args.heap_source,
                &targets,
                heap_endpoints(args)?,
                args.duration,
                args.sample_bytes,
                args.delta_seconds,
                &samplers.config().node,
            )?;
            request.ebpf.cfi_unwind = !args.frame_pointers_only;
            request.ebpf.max_overhead_percent = args.max_overhead_percent;
            request.ebpf.force = args.force;
            CaptureSpec::Heap(request)
        }
        ProfileType::Offcpu => CaptureSpec::Offcpu {
            targets,
            options: OffcpuOptions {
                min_block: args.min_block,
                kernel_stacks: !args.no_kernel_stacks,
                cfi_unwind: !args.frame_pointers_only,
            },
            guard: OffcpuGuard {
                max_overhead_percent: args.max_overhead_percent,
                force: args.force,
            },
            on_cpu: args.with_on_cpu.then_some(cpu_options),
            duration: args.duration,
        },
    };
    let announced = match &spec {
        CaptureSpec::Cpu { targets, .. } => Some(("cpu", targets.len())),
        CaptureSpec::Runqlat { targets, .. } => Some(("runqlat", targets.len())),
        CaptureSpec::Offcpu { targets, .. } => Some(("offcpu", targets.len())),
        CaptureSpec::Heap(_) => None,
    };
    let stop = Stop::new();
    stop_on_interrupt(&stop);
    let mut running = lifecycle::start(&samplers, spec)?;
    if let Some((kind, targets)) = announced {
        announce(kind, targets, args.duration);
    }
    if running.run_window(&stop)? == WindowEnd::Stopped {
        eprintln!("interrupted: writing what was captured so far (interrupt again to abandon it)");
    }
    let finished = running.finish()?;
    let (profile, samples, text) = (
        finished.profile,
        finished.summary.samples(),
        finished.report,
    );
    write_profile(&args.output, &profile)?;
    Ok(CaptureReport {
        output: args.output.clone(),
        samples,
        text,
    })
}

/// Ends the capture's window early on the first SIGINT or SIGTERM, so that an interrupted
/// capture still writes its profile (as `perf record` does); a second one exits at once
/// (status 130). The signals are blocked in this thread before any other starts, so every
/// thread inherits the mask and only the waiting thread takes them.
fn stop_on_interrupt(stop: &Stop) {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    if set.thread_block().is_err() {
        return;
    }
    let stop = stop.clone();
    let spawned = std::thread::Builder::new()
        .name("ff-interrupt".into())
        .spawn(move || {
            let mut seen = 0;
            while let Ok(signal) = set.wait() {
                seen += 1;
                if seen > 1 {
                    eprintln!("interrupted again ({signal}): exiting without writing");
                    std::process::exit(130);
                }
                stop.stop();
            }
        });
    if spawned.is_err() {
        // Nobody would take the signals: let them act as before.
        let _ = set.thread_unblock();
    }
}

/// The heap endpoints named by `--endpoint` or `--port`/`--pid`/`--path`.
fn heap_endpoints(args: &CaptureArgs) -> Result<Vec<heap::endpoint::HeapEndpoint>, CliError> {
    use heap::endpoint::{HeapEndpoint, parse_path};
    if let Some(port) = args.port {
        return Ok(vec![HeapEndpoint {
            host: "127.0.0.1".into(),
            port,
            path: parse_path(&args.path, "--path").map_err(HeapError::from)?,
            netns_pid: args.pid,
        }]);
    }
    args.endpoints
        .iter()
        .map(|url| Ok(HeapEndpoint::parse_url(url).map_err(HeapError::from)?))
        .collect()
}

/// Tells the user (and scripts waiting on stderr) that sampling has begun.
fn announce(kind: &str, targets: usize, duration: Duration) {
    eprintln!(
        "capturing {kind} of {targets} cgroup(s) for {}",
        humantime::format_duration(duration)
    );
}

/// Gzips and writes a profile.
pub fn write_profile(
    path: &std::path::Path,
    profile: &flamefleet_proto::pprof::Profile,
) -> Result<(), CliError> {
    let out_err = |source| CliError::Output {
        path: path.to_path_buf(),
        source,
    };
    let bytes = pprof::encode_gzip(profile).map_err(|e| out_err(std::io::Error::other(e)))?;
    let mut file = std::fs::File::create(path).map_err(out_err)?;
    file.write_all(&bytes).map_err(out_err)
}

/// Labels for targets resolved from pods (used by the gRPC server later).
pub fn labels(namespace: &str, pod: &str, container: &str) -> TargetLabels {
    TargetLabels {
        namespace: namespace.into(),
        pod: pod.into(),
        container: container.into(),
    }
}
