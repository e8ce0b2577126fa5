//! `kubectl-profile`: on PATH it runs as `kubectl profile`. Thin: parse flags, dispatch.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use flamefleet_api::ProfileType;
use flamefleet_api::profile_request::{
    MAX_BLOCK_MICROS, MAX_FREQUENCY_HZ, MAX_SAMPLE_BYTES, MIN_BLOCK_MICROS, MIN_FREQUENCY_HZ,
    MIN_SAMPLE_BYTES,
};
use kubectl_profile::cluster::{Cluster, ConnectOptions};
use kubectl_profile::commands::{capture, fleet, get, list, merge};
use kubectl_profile::{Error, Result, flags};

#[derive(Parser)]
#[command(
    name = "kubectl profile",
    bin_name = "kubectl profile",
    version,
    about = "Request, follow and download Flamefleet profiles"
)]
struct Cli {
    /// Path to the kubeconfig file (default: KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    context: Option<String>,
    /// The namespace (default: the context's namespace).
    #[arg(short = 'n', long, global = true)]
    namespace: Option<String>,
    #[command(subcommand)]
    command: Command,
}

/// The flags every profile type takes.
#[derive(clap::Args)]
struct CaptureArgs {
    /// POD, pod/NAME, deploy/NAME or sts/NAME.
    target: Option<String>,
    /// Label selector instead of a target, e.g. app=web.
    #[arg(short = 'l', long)]
    selector: Option<String>,
    /// How long to capture: 1s to 10m, e.g. 30s, 2m, 1m30s.
    #[arg(long, default_value = "30s", value_parser = flags::parse_capture)]
    duration: String,
    /// Give up waiting this long after the capture started (default: duration + 90s); a
    /// request queued behind a concurrency limit waits for its turn first.
    #[arg(long, value_parser = flags::parse_span)]
    timeout: Option<Duration>,
    /// Delete the request and its artifacts this long after it finished (at least 1m), or
    /// `never`.
    #[arg(long, default_value = flags::DEFAULT_TTL, value_parser = flags::parse_ttl)]
    ttl: flags::Ttl,
    /// A label for the created ProfileRequest, key=value (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = flags::parse_label)]
    labels: Vec<(String, String)>,
    /// Create the request and return without waiting.
    #[arg(long)]
    no_wait: bool,
    /// Keep this capture out of the cluster's OpenTelemetry export (`export: false`).
    #[arg(long)]
    no_export: bool,
    /// Directory for the downloaded files.
    #[arg(short = 'o', long, default_value = ".")]
    output: PathBuf,
    /// What to write besides the pprof files.
    #[arg(long, value_enum, default_value = "svg")]
    format: get::Format,
    /// Overwrite files in the directory that hold something else.
    #[arg(long)]
    force: bool,
}

/// `kubectl profile cpu`.
#[derive(clap::Args)]
struct CpuArgs {
    #[command(flatten)]
    common: CaptureArgs,
    /// Samples per second per CPU, 1 to 1000 (default 99).
    #[arg(long, value_name = "HZ", value_parser = clap::value_parser!(i32).range(i64::from(MIN_FREQUENCY_HZ)..=i64::from(MAX_FREQUENCY_HZ)))]
    frequency: Option<i32>,
}

/// `kubectl profile heap`.
#[derive(clap::Args)]
struct HeapArgs {
    #[command(flatten)]
    common: CaptureArgs,
    /// Where the heap profile comes from: the pod's pprof endpoint, the Go runtime's own
    /// profile, eBPF uprobes on the allocator, or `auto` (per process).
    #[arg(long, value_enum)]
    source: Option<capture::HeapSourceArg>,
    /// eBPF: mean bytes allocated between two samples, 1 to 1073741824.
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(i64).range(MIN_SAMPLE_BYTES..=MAX_SAMPLE_BYTES))]
    sample_bytes: Option<i64>,
}

/// `kubectl profile runqlat`.
#[derive(clap::Args)]
struct RunqlatArgs {
    #[command(flatten)]
    common: CaptureArgs,
    /// One histogram per process instead of one per container.
    #[arg(long)]
    per_process: bool,
    /// Unit of the histogram's buckets.
    #[arg(long, value_enum)]
    unit: Option<capture::RunqlatUnitArg>,
}

/// `kubectl profile offcpu`.
#[derive(clap::Args)]
struct OffcpuArgs {
    #[command(flatten)]
    common: CaptureArgs,
    /// Blocks shorter than this many microseconds are counted, not attributed to a stack
    /// (default 1000).
    #[arg(long, value_name = "MICROS", value_parser = clap::value_parser!(i32).range(i64::from(MIN_BLOCK_MICROS)..=i64::from(MAX_BLOCK_MICROS)))]
    min_block_micros: Option<i32>,
    /// Refuse when a first window projects more stack-walk overhead than this percent of
    /// the pods' CPU time, 0 to 100 (default 3; 0 turns the guard off).
    #[arg(long, value_name = "PERCENT", value_parser = clap::value_parser!(i32).range(0..=100))]
    max_overhead_percent: Option<i32>,
    /// The wall-clock view: on-CPU samples too, in the same profile (sample type
    /// wall/nanoseconds: on-CPU plus blocked time per stack).
    #[arg(long)]
    with_on_cpu: bool,
    /// With --with-on-cpu: on-CPU samples per second per CPU, 1 to 1000 (default 99).
    #[arg(long, value_name = "HZ", requires = "with_on_cpu", value_parser = clap::value_parser!(i32).range(i64::from(MIN_FREQUENCY_HZ)..=i64::from(MAX_FREQUENCY_HZ)))]
    frequency: Option<i32>,
}

#[derive(Subcommand)]
enum Command {
    /// Capture a CPU profile.
    Cpu(CpuArgs),
    /// Capture a heap profile.
    Heap(HeapArgs),
    /// Capture a run-queue latency histogram.
    Runqlat(RunqlatArgs),
    /// Capture an off-CPU profile: where the pods' threads block, by stack.
    Offcpu(OffcpuArgs),
    /// Download (and render) the artifacts of a request, or (sp/NAME, csp/NAME) the merged
    /// profiles of a sampling policy's runs over a time window.
    Get {
        /// A ProfileRequest's name, or sp/NAME, csp/NAME.
        name: String,
        /// Directory for the files.
        #[arg(short = 'o', long, default_value = ".")]
        output: PathBuf,
        /// What to write besides the pprof files.
        #[arg(long, value_enum, default_value = "pprof")]
        format: get::Format,
        /// With sp/NAME or csp/NAME: merge the runs scheduled within this long, e.g. 24h, 7d.
        #[arg(long, default_value = "24h", value_parser = flags::parse_span)]
        since: Duration,
        /// Only this node's artifacts (repeatable, or a comma-separated list).
        #[arg(long = "node", value_name = "NAME", value_delimiter = ',')]
        nodes: Vec<String>,
        /// At most this many nodes' artifacts (the first in name order).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        limit: Option<u32>,
        /// Overwrite files in the directory that hold something else.
        #[arg(long)]
        force: bool,
    },
    /// List the namespace's requests, or (sp/NAME, csp/NAME) a sampling policy's runs.
    List {
        /// sp/NAME or csp/NAME.
        policy: Option<String>,
    },
    /// Delete a request (its artifacts go with it).
    Delete {
        /// The ProfileRequest's name.
        name: String,
    },
    /// Merge profiles of one type (files or request names) into one pprof.
    Merge {
        /// pprof files or ProfileRequest names.
        #[arg(required = true)]
        inputs: Vec<String>,
        /// The merged file.
        #[arg(short = 'o', long, default_value = "merged.pb.gz")]
        output: PathBuf,
        /// Overwrite the output file if it holds something else.
        #[arg(long)]
        force: bool,
    },
}

async fn capture_cmd(
    cluster: &Cluster,
    profile_type: ProfileType,
    a: CaptureArgs,
    options: capture::TypeOptions,
    out: &mut dyn std::io::Write,
) -> Result<()> {
    let target = capture::parse_target(a.target.as_deref(), a.selector.as_deref())?;
    let opts = capture::CaptureOptions {
        profile_type,
        target,
        duration: a.duration,
        options,
        labels: a.labels,
        ttl_seconds: a.ttl.seconds(),
        export: a.no_export.then_some(false),
    };
    let (name, duration) = capture::create(cluster, &opts).await?;
    let _ = writeln!(out, "profilerequest.flamefleet.dev/{name} created");
    if a.no_wait {
        let _ = writeln!(
            out,
            "follow it with `kubectl get preq {name} -n {ns} -w`; download it with `kubectl profile get {name} -n {ns}`",
            ns = cluster.namespace
        );
        return Ok(());
    }
    let mut progress = std::io::stderr();
    let waited = capture::wait(cluster, &name, duration, a.timeout, &mut progress);
    let request = capture::interruptible(waited, || Error::Interrupted {
        name: name.clone(),
        namespace: cluster.namespace.clone(),
        finished: false,
    })
    .await?;
    let every_node = get::NodeSelection::default();
    let downloaded = get::download_request(
        cluster,
        &request,
        &a.output,
        a.format,
        &every_node,
        a.force,
        out,
    );
    capture::interruptible(downloaded, || Error::Interrupted {
        name: name.clone(),
        namespace: cluster.namespace.clone(),
        finished: true,
    })
    .await?;
    Ok(())
}

async fn run(cli: Cli) -> Result<()> {
    let opts = ConnectOptions {
        kubeconfig: cli.kubeconfig,
        context: cli.context,
        namespace: cli.namespace,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if let Command::Merge {
        inputs,
        output,
        force,
    } = &cli.command
    {
        // Files alone need no cluster.
        let cluster = if inputs.iter().all(|i| std::path::Path::new(i).is_file()) {
            None
        } else {
            Some(Cluster::connect(&opts).await?)
        };
        return merge::run(inputs, cluster.as_ref(), output, *force, &mut out).await;
    }
    let cluster = Cluster::connect(&opts).await?;
    match cli.command {
        Command::Cpu(a) => {
            let options = capture::TypeOptions::Cpu {
                frequency_hz: a.frequency,
            };
            capture_cmd(&cluster, ProfileType::Cpu, a.common, options, &mut out).await
        }
        Command::Heap(a) => {
            let options = capture::TypeOptions::Heap {
                source: a.source,
                sample_bytes: a.sample_bytes,
            };
            capture_cmd(&cluster, ProfileType::Heap, a.common, options, &mut out).await
        }
        Command::Runqlat(a) => {
            let options = capture::TypeOptions::Runqlat {
                per_process: a.per_process,
                unit: a.unit,
            };
            capture_cmd(&cluster, ProfileType::Runqlat, a.common, options, &mut out).await
        }
        Command::Offcpu(a) => {
            let options = capture::TypeOptions::Offcpu {
                min_block_micros: a.min_block_micros,
                max_overhead_percent: a.max_overhead_percent,
                with_on_cpu: a.with_on_cpu,
                frequency_hz: a.frequency,
            };
            capture_cmd(&cluster, ProfileType::Offcpu, a.common, options, &mut out).await
        }
        Command::Get {
            name,
            output,
            format,
            since,
            nodes,
            limit,
            force,
        } => match fleet::PolicyRef::parse(&name) {
            Some(_) if !nodes.is_empty() || limit.is_some() => Err(Error::Usage(
                "--node and --limit select nodes of one ProfileRequest; they do not apply to sp/NAME or csp/NAME".into(),
            )),
            Some(policy) => fleet::get(&cluster, &policy, since, &output, format, force, &mut out)
                .await
                .map(|_| ()),
            None => {
                let selection = get::NodeSelection {
                    nodes,
                    limit: limit.map(|n| n as usize),
                };
                get::run(&cluster, &name, &output, format, &selection, force, &mut out)
                    .await
                    .map(|_| ())
            }
        },
        Command::List { policy: None } => list::list(&cluster, &mut out).await,
        Command::List {
            policy: Some(policy),
        } => match fleet::PolicyRef::parse(&policy) {
            Some(p) => fleet::list(&cluster, &p, &mut out).await,
            None => Err(Error::Usage(format!(
                "{policy}: expected sp/NAME or csp/NAME (or nothing, for the namespace's requests)"
            ))),
        },
        Command::Delete { name } => list::delete(&cluster, &name, &mut out).await,
        Command::Merge { .. } => Err(Error::Usage("unreachable".into())),
    }
}

fn main() {
    let cli = Cli::parse();
    // The dependency tree enables both ring and aws-lc-rs, so rustls cannot pick one itself;
    // an Err only means a provider is already installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = runtime.block_on(run(cli)) {
        eprintln!("error: {e}");
        std::process::exit(e.exit_code());
    }
}
