//! `kubectl-profile`: on PATH it runs as `kubectl profile`. Thin: parse flags, dispatch.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use flamefleet_api::ProfileType;
use kubectl_profile::cluster::{Cluster, ConnectOptions};
use kubectl_profile::commands::{capture, fleet, get, list, merge};
use kubectl_profile::{Error, Result};

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

#[derive(clap::Args)]
struct CaptureArgs {
    /// POD, pod/NAME, deploy/NAME or sts/NAME.
    target: Option<String>,
    /// Label selector instead of a target, e.g. app=web.
    #[arg(short = 'l', long)]
    selector: Option<String>,
    /// How long to capture.
    #[arg(long, default_value = "30s")]
    duration: String,
    /// CPU samples per second (cpu only; default 99).
    #[arg(long)]
    frequency: Option<i32>,
    /// Give up waiting after this long, e.g. 2m (default: duration + 90s).
    #[arg(long)]
    timeout: Option<String>,
    /// A label for the created ProfileRequest, key=value (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    labels: Vec<String>,
    /// Create the request and return without waiting.
    #[arg(long)]
    no_wait: bool,
    /// Directory for the downloaded files.
    #[arg(short = 'o', long, default_value = ".")]
    output: PathBuf,
    /// What to write besides the pprof files.
    #[arg(long, value_enum, default_value = "svg")]
    format: get::Format,
}

#[derive(Subcommand)]
enum Command {
    /// Capture a CPU profile.
    Cpu(CaptureArgs),
    /// Capture a heap profile.
    Heap(CaptureArgs),
    /// Capture a run-queue latency histogram.
    Runqlat(CaptureArgs),
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
        /// With sp/NAME or csp/NAME: merge the runs scheduled within this long, e.g. 24h.
        #[arg(long, default_value = "24h")]
        since: String,
        /// Only this node's artifacts (repeatable, or a comma-separated list).
        #[arg(long = "node", value_name = "NAME", value_delimiter = ',')]
        nodes: Vec<String>,
        /// At most this many nodes' artifacts (the first in name order).
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
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
    },
}

async fn capture_cmd(
    cluster: &Cluster,
    profile_type: ProfileType,
    a: CaptureArgs,
    out: &mut dyn std::io::Write,
) -> Result<()> {
    let target = capture::parse_target(a.target.as_deref(), a.selector.as_deref())?;
    let timeout = a
        .timeout
        .as_deref()
        .map(flamefleet_api::duration::parse_duration)
        .transpose()
        .map_err(|e| Error::Usage(format!("--timeout: {e}")))?;
    let opts = capture::CaptureOptions {
        profile_type,
        target,
        duration: a.duration,
        frequency_hz: a.frequency,
        labels: a.labels,
    };
    let (name, duration) = capture::create(cluster, &opts).await?;
    let _ = writeln!(out, "profilerequest.flamefleet.dev/{name} created");
    if a.no_wait {
        return Ok(());
    }
    let request = capture::wait(cluster, &name, duration, timeout, out).await?;
    get::download_request(
        cluster,
        &request,
        &a.output,
        a.format,
        &get::NodeSelection::default(),
        out,
    )
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
    if let Command::Merge { inputs, output } = &cli.command {
        // Files alone need no cluster.
        let cluster = if inputs.iter().all(|i| std::path::Path::new(i).is_file()) {
            None
        } else {
            Some(Cluster::connect(&opts).await?)
        };
        return merge::run(inputs, cluster.as_ref(), output, &mut out).await;
    }
    let cluster = Cluster::connect(&opts).await?;
    match cli.command {
        Command::Cpu(a) => capture_cmd(&cluster, ProfileType::Cpu, a, &mut out).await,
        Command::Heap(a) => capture_cmd(&cluster, ProfileType::Heap, a, &mut out).await,
        Command::Runqlat(a) => capture_cmd(&cluster, ProfileType::Runqlat, a, &mut out).await,
        Command::Get {
            name,
            output,
            format,
            since,
            nodes,
            limit,
        } => match fleet::PolicyRef::parse(&name) {
            Some(_) if !nodes.is_empty() || limit.is_some() => Err(Error::Usage(
                "--node and --limit select nodes of one ProfileRequest; they do not apply to sp/NAME or csp/NAME".into(),
            )),
            Some(policy) => {
                let since = flamefleet_api::duration::parse_duration(&since)
                    .map_err(|e| Error::Usage(format!("--since: {e}")))?;
                fleet::get(&cluster, &policy, since, &output, format, &mut out)
                    .await
                    .map(|_| ())
            }
            None => {
                let selection = get::NodeSelection { nodes, limit };
                get::run(&cluster, &name, &output, format, &selection, &mut out)
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
