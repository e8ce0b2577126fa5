//! The operator process: flags, and the wiring of store, probes, election and controller.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Parser, ValueEnum};
use futures::FutureExt as _;
use kube::runtime::events::{Recorder, Reporter};

use crate::api_clients::ApiClients;
use crate::controllers::download::{self, DownloadContext};
use crate::controllers::profile_request::limits::TenantLimits;
use crate::controllers::profile_request::store_wait::StoreWaits;
use crate::controllers::profile_request::{self, Context};
use crate::controllers::sampling::{
    self, SamplingContext, SamplingLimits, budget::Ledger, fleet::Fleet,
};
use crate::dispatch::connector::{AgentConnector, Backoff};
use crate::dispatch::uploads::UrlPolicy;
use crate::dispatch::{DispatchSettings, Dispatcher};
use crate::export::{ExportSettings, Exporter, SinkConfig, read_headers};
use crate::identity::ca::OperatorCa;
use crate::identity::csr_signer::{AgentIdentityPolicy, CsrSigner};
use crate::identity::store_cert;
use crate::leader::{Election, LeaseConfig};
use crate::metrics::Metrics;
use crate::owned_secret;
use crate::probes::{self, ProbeState};
use crate::store::builtin::{BuiltinConfig, server};
use crate::store::gc::{self, GcSettings};
use crate::store::quota::QuotaLedger;
use crate::store::remote::{RemoteConfig, RemoteStore};
use crate::store::s3::{S3Config, S3Store};
use crate::store::{ArtifactStore, install_default_crypto_provider};

/// Which artifact store backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// The built-in HTTP store over a directory, served by the operator itself.
    Builtin,
    /// The built-in store served by `flamefleet-store` at --store-url (the chart's layout).
    Remote,
    /// An S3-compatible bucket.
    S3,
}

/// Flags of `flamefleet-operator`.
#[derive(Debug, Parser)]
#[command(
    name = "flamefleet-operator",
    version,
    about = "Flamefleet operator: ProfileRequest and sampling-policy controllers, artifact store"
)]
pub struct Options {
    /// Kubeconfig file; in-cluster configuration (or $KUBECONFIG) when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Namespace of the agent pods (and of the leader Lease).
    #[arg(long, default_value = "flamefleet")]
    pub agent_namespace: String,
    /// Secret (`kubernetes.io/tls`, in the agent namespace) holding the operator's CA; created
    /// with a new CA on first start when missing. The CA signs agents' per-node serving
    /// certificates (their CSRs, signer `flamefleet.dev/agent-serving`) and the operator's
    /// own client certificate. Alternative to --tls-ca/--tls-cert/--tls-key.
    #[arg(long, conflicts_with_all = ["tls_ca", "tls_cert", "tls_key"])]
    pub ca_secret: Option<String>,
    /// ServiceAccount of the agent pods (only it may request agent certificates).
    #[arg(long, default_value = "flamefleet-agent")]
    pub agent_service_account: String,
    /// CA certificate (PEM) that signed the agents' serving certificates (file-based TLS).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// The operator's client certificate (PEM), presented to agents (file-based TLS).
    #[arg(long, requires = "tls_ca")]
    pub tls_cert: Option<PathBuf>,
    /// The operator's client key (PEM) (file-based TLS).
    #[arg(long, requires = "tls_ca")]
    pub tls_key: Option<PathBuf>,
    /// Artifact store backend.
    #[arg(long, value_enum, default_value = "builtin")]
    pub store: StoreKind,
    /// Directory of the built-in store.
    #[arg(long, default_value = "/var/lib/flamefleet/artifacts")]
    pub store_dir: PathBuf,
    /// File holding the built-in store's HMAC secret (at least 32 bytes; same on every replica).
    #[arg(long, conflicts_with = "store_secret_name")]
    pub store_secret_file: Option<PathBuf>,
    /// Secret (in the agent namespace, key `secret`) holding the store's HMAC secret; created
    /// with 48 random bytes on first start when missing.
    #[arg(long)]
    pub store_secret_name: Option<String>,
    /// Address the built-in store listens on.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub store_listen: SocketAddr,
    /// Base URL at which agents (and, without --store-public-url, users) reach the built-in
    /// store.
    #[arg(long)]
    pub store_url: Option<url::Url>,
    /// Base URL users download artifacts from (default: --store-url).
    #[arg(long)]
    pub store_public_url: Option<url::Url>,
    /// Secret (`kubernetes.io/tls`, in the agent namespace) for the HTTPS certificate of the
    /// store (`--store remote`): the operator's CA issues it for the hosts of --store-url and
    /// --store-public-url and renews it; the store mounts it. Agents, the operator and
    /// `kubectl profile` trust the operator's CA for the store. Needs --ca-secret.
    #[arg(long, requires = "ca_secret")]
    pub store_tls_secret: Option<String>,
    /// Largest artifact accepted, bytes.
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    pub store_max_bytes: u64,
    /// Artifact storage each namespace may use (bytes, or a quantity such as 5Gi; 0:
    /// unlimited). A namespace's `flamefleet.dev/artifact-quota` annotation overrides it.
    /// Past it, a node's capture fails with a message saying so.
    #[arg(long, default_value = "0", value_parser = parse_quota)]
    pub artifact_quota_per_namespace: u64,
    /// Time between sweeps of the store for artifacts whose ProfileRequest no longer exists
    /// (0s: never).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10m")]
    pub store_gc_interval: Duration,
    /// Artifacts modified more recently than this are never swept.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10m")]
    pub store_gc_grace: Duration,
    /// S3 endpoint URL.
    #[arg(long)]
    pub s3_endpoint: Option<String>,
    /// S3 bucket (must exist).
    #[arg(long)]
    pub s3_bucket: Option<String>,
    /// S3 region.
    #[arg(long, default_value = "us-east-1")]
    pub s3_region: String,
    /// S3 access key ID.
    #[arg(long, env = "AWS_ACCESS_KEY_ID", hide_env_values = true)]
    pub s3_access_key_id: Option<String>,
    /// S3 secret access key.
    #[arg(long, env = "AWS_SECRET_ACCESS_KEY", hide_env_values = true)]
    pub s3_secret_access_key: Option<String>,
    /// Allow a plain-HTTP S3 endpoint.
    #[arg(long)]
    pub s3_allow_http: bool,
    /// How long the download URLs given in a ProfileDownload's status stay valid.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    pub download_url_ttl: Duration,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:9090")]
    pub metrics_listen: SocketAddr,
    /// Address of the operator's own profiles (`/debug/pprof/profile`, `/debug/pprof/heap`);
    /// none when absent. Keep it cluster-internal (the chart does).
    #[arg(long)]
    pub debug_listen: Option<SocketAddr>,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "flamefleet-operator")]
    pub lease_name: String,
    /// Namespace of the Lease (default: the agent namespace).
    #[arg(long)]
    pub lease_namespace: Option<String>,
    /// Seconds a leader's lock stays valid without renewal.
    #[arg(long, default_value_t = 15)]
    pub lease_duration: u64,
    /// This replica's identity in the election (default: $POD_NAME, else host name and PID).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Only handle ProfileRequests and sampling policies matching this label selector
    /// (e.g. `shard=a`); a policy's runs carry its labels.
    #[arg(long)]
    pub request_selector: Option<String>,
    /// Time allowed beyond the capture duration before a node is declared timed out.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub capture_grace: Duration,
    /// How long a new request waits, Pending, for an artifact store it cannot reach (right
    /// after an installation, its Service may have no endpoint yet) before it fails with
    /// reason StoreUnavailable.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2m")]
    pub store_wait: Duration,
    /// Captures running at once in the whole cluster; more wait, Pending (0: unlimited).
    #[arg(long, default_value_t = 100)]
    pub max_concurrent_captures: u32,
    /// Captures running at once in one namespace; more wait, Pending (0: unlimited). A
    /// namespace's `flamefleet.dev/max-concurrent-captures` annotation overrides it.
    #[arg(long, default_value_t = 10)]
    pub max_concurrent_captures_per_namespace: u32,
    /// Smallest heap.sampleBytes a request may ask for (smaller ones fail).
    #[arg(long, default_value_t = 64 * 1024)]
    pub min_heap_sample_bytes: i64,
    /// Highest cpu.frequencyHz a request may ask for (higher ones fail).
    #[arg(long, default_value_t = 1000)]
    pub max_cpu_frequency_hz: i32,
    /// Highest heap.maxOverheadPercent a request may ask for, and the one sent when it names
    /// none (higher ones, and 0, which turns the heap overhead guard off, fail). The heap
    /// probes fire in every process on the node that maps the probed allocator, so only the
    /// cluster admin may raise it; 0 lets requests set any value, 0 included.
    #[arg(long, default_value_t = crate::controllers::profile_request::limits::DEFAULT_MAX_HEAP_OVERHEAD_PERCENT)]
    pub max_heap_overhead_percent: u32,
    /// Highest offcpu.maxOverheadPercent a request may ask for, and the one sent when it
    /// names none (higher ones, and 0, which turns the off-CPU overhead guard off, fail). A
    /// node's one off-CPU sampler walks the targets' stacks inside context switches the
    /// scheduler bills to whichever task is switched in, into maps all captures share, so
    /// only the cluster admin may raise it; 0 lets requests set any value, 0 included.
    #[arg(long, default_value_t = crate::controllers::profile_request::limits::DEFAULT_MAX_OFFCPU_OVERHEAD_PERCENT)]
    pub max_offcpu_overhead_percent: u32,
    /// Least time between two runs of one sampling policy, whatever its schedule says (a
    /// schedule firing more often runs at most this often).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub min_run_interval: Duration,
    /// SamplingPolicies of one namespace that run, the oldest first; the others create no
    /// runs and say why in their status (0: unlimited).
    #[arg(long, default_value_t = 20)]
    pub max_policies_per_namespace: usize,
    /// Pending ProfileRequests a namespace may hold before scheduled runs pass it over
    /// (0: unlimited).
    #[arg(long, default_value_t = 10)]
    pub max_queued_runs_per_namespace: usize,
    /// Ad hoc ProfileRequests reconciled at once (0: unlimited); the others wait their turn
    /// in the operator, in order. A new leader resumes every Running request at once: all
    /// at once, each one's API calls waited behind all the others' (1,000 requests: none
    /// started for 3 minutes). The policies' runs are never held by this bound.
    #[arg(long, default_value_t = 32)]
    pub max_concurrent_reconciles: usize,
    /// Timeout of a connection attempt to an agent.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub agent_connect_timeout: Duration,
    /// Agent calls being set up at once (connection or cached channel, TLS handshake, call
    /// start: a capture's start and the collection of its result), over all requests; an
    /// open stream holds no slot (0: unlimited).
    #[arg(long, default_value_t = 256)]
    pub max_concurrent_dispatch: usize,
    /// Result collections open at once, over all requests (0: unlimited). A collection's
    /// stream holds its agent's connection (60-90 KiB) until the agent has uploaded and
    /// answered; further collections wait for a slot, and lose nothing by waiting (the
    /// agent finishes regardless and replays its result).
    #[arg(long, default_value_t = 1024)]
    pub max_concurrent_collects: usize,
    /// Agent connections kept open between calls; once that many are open, further ones
    /// close after their call (a stable set is reused by every request). Each
    /// costs 60-90 KiB; a capture holds its node's connection only while it is started and
    /// while its result is collected, so this (with --max-concurrent-dispatch), not the
    /// fleet's size, bounds the operator's connection memory.
    #[arg(long, default_value_t = crate::dispatch::connector::DEFAULT_CHANNEL_CAPACITY)]
    pub max_idle_agent_connections: usize,
    /// Attempts to reach an agent before its node fails as unreachable; retries wait with
    /// exponential backoff and full jitter.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=10))]
    pub agent_connect_attempts: u32,
    /// OTLP/gRPC endpoint that every finished capture is also exported to, as OpenTelemetry
    /// profiles (e.g. http://otel-collector.observability:4317, or https://...); none when
    /// absent. Requests and policy templates opt out with `export: false`.
    #[arg(long)]
    pub export_otlp_endpoint: Option<String>,
    /// CA bundle (PEM) of an https export endpoint (default: the public web roots).
    #[arg(long, requires = "export_otlp_endpoint")]
    pub export_otlp_ca_file: Option<PathBuf>,
    /// Directory of headers sent with every export, one file per header (a mounted Secret:
    /// key = header name, e.g. `authorization`; value = its value).
    #[arg(long, requires = "export_otlp_endpoint")]
    pub export_otlp_headers_dir: Option<PathBuf>,
    /// Deadline of one export call.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub export_otlp_timeout: Duration,
    /// Send exports uncompressed (default: gzip).
    #[arg(long)]
    pub export_otlp_no_compression: bool,
    /// Captures waiting to be exported, in all; more are dropped and counted.
    #[arg(long, default_value_t = 256)]
    pub export_queue_capacity: usize,
    /// Captures of one namespace waiting to be exported; more are dropped and counted, so
    /// one namespace cannot take the queue from the others.
    #[arg(long, default_value_t = 32)]
    pub export_queue_per_namespace: usize,
    /// How long a capture's export is retried while the endpoint is unavailable before it
    /// is dropped and counted.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    pub export_max_retry_time: Duration,
    /// Longest wait between two attempts of an export (exponential backoff from 1 s, full
    /// jitter).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub export_max_retry_delay: Duration,
    /// Largest OTLP request sent, in bytes (before compression): a profile whose request
    /// would be larger is sent in parts of consecutive samples, each within this. The
    /// OpenTelemetry Collector's gRPC receiver refuses requests over 4 MiB by default
    /// (`max_recv_msg_size_mib`).
    #[arg(long, default_value_t = 4 << 20, value_parser = clap::value_parser!(u64).range(4096..=(1 << 30)))]
    pub export_otlp_max_message_bytes: u64,
    /// Always-on policies (`schedule: "@continuous"`): how long each window samples
    /// (docs/export.md, "Always-on profiling"); as long as the period by default: windows
    /// that follow each other with no gap.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "20s")]
    pub continuous_window: Duration,
    /// Always-on policies: time from one window's start to the next (at least the window,
    /// at most 1h).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "20s")]
    pub continuous_period: Duration,
    /// Always-on policies: most pods profiled always-on on one node, all policies together;
    /// the others are listed in their policies' status.
    #[arg(long, default_value_t = 100)]
    pub max_continuous_pods_per_node: usize,
    /// Always-on policies: largest gzipped profile of one pod's window (at most 3 MiB);
    /// a larger one is dropped and counted.
    #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(1024..=(3 << 20)))]
    pub continuous_max_profile_bytes: u64,
}

/// The always-on settings from the flags.
fn continuous_settings(
    options: &Options,
) -> anyhow::Result<crate::controllers::sampling::continuous::ContinuousSettings> {
    let (window, period) = (options.continuous_window, options.continuous_period);
    if window < Duration::from_secs(1) || period < window || period > Duration::from_secs(3600) {
        bail!(
            "--continuous-window must be at least 1s and --continuous-period from the window to 1h; found {} and {}",
            humantime::format_duration(window),
            humantime::format_duration(period)
        );
    }
    Ok(
        crate::controllers::sampling::continuous::ContinuousSettings {
            window,
            period,
            max_profile_bytes: options.continuous_max_profile_bytes,
            max_pods_per_node: options.max_continuous_pods_per_node.max(1),
            max_cpu_frequency_hz: options.max_cpu_frequency_hz,
        },
    )
}

/// The export settings from the flags; `None` without --export-otlp-endpoint.
fn export_settings(options: &Options) -> anyhow::Result<Option<ExportSettings>> {
    let Some(endpoint) = options.export_otlp_endpoint.clone() else {
        return Ok(None);
    };
    let ca_pem = match &options.export_otlp_ca_file {
        Some(file) => Some(
            std::fs::read_to_string(file)
                .with_context(|| format!("reading the export CA {}", file.display()))?,
        ),
        None => None,
    };
    let headers = match &options.export_otlp_headers_dir {
        Some(dir) => read_headers(dir).map_err(anyhow::Error::msg)?,
        None => Vec::new(),
    };
    Ok(Some(ExportSettings {
        sink: SinkConfig {
            endpoint,
            ca_pem,
            headers,
            timeout: options.export_otlp_timeout,
            gzip: !options.export_otlp_no_compression,
        },
        queue_capacity: options.export_queue_capacity,
        queue_per_namespace: options.export_queue_per_namespace,
        max_retry_time: options.export_max_retry_time,
        max_retry_delay: options
            .export_max_retry_delay
            .max(Duration::from_millis(10)),
        max_artifact_bytes: options.store_max_bytes,
        max_message_bytes: usize::try_from(options.export_otlp_max_message_bytes)
            .unwrap_or(usize::MAX),
    }))
}

fn parse_quota(text: &str) -> Result<u64, String> {
    crate::store::quota::parse_quantity(text)
        .ok_or_else(|| format!("{text:?} is not a byte count or a quantity such as 500Mi or 5Gi"))
}

/// The configuration of the API server connection: from `kubeconfig`, or the in-cluster
/// configuration when `None`.
///
/// # Errors
/// An unreadable kubeconfig or no configuration at all.
pub async fn kube_config(kubeconfig: Option<&PathBuf>) -> anyhow::Result<kube::Config> {
    match kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))
        }
        None => kube::Config::infer()
            .await
            .context("no --kubeconfig and no in-cluster configuration"),
    }
}

/// The store's URL-signing secret: from --store-secret-file, or the --store-secret-name
/// Secret (created when missing).
async fn store_secret(options: &Options, client: &kube::Client) -> anyhow::Result<Vec<u8>> {
    if let Some(file) = &options.store_secret_file {
        return std::fs::read(file)
            .with_context(|| format!("reading the store secret {}", file.display()));
    }
    let Some(name) = &options.store_secret_name else {
        bail!(
            "the built-in store needs --store-secret-file or --store-secret-name (at least 32 random bytes, the same for every replica)"
        );
    };
    let secret =
        owned_secret::get_or_create(client, &options.agent_namespace, name, "Opaque", || {
            let mut bytes = [0u8; 48];
            getrandom_fill(&mut bytes)?;
            Ok(std::collections::BTreeMap::from([(
                STORE_SECRET_KEY.to_owned(),
                k8s_openapi::ByteString(bytes.to_vec()),
            )]))
        })
        .await?;
    Ok(owned_secret::field(&secret, STORE_SECRET_KEY)?.to_vec())
}

/// Key of the store's signing secret in its Secret.
pub const STORE_SECRET_KEY: &str = "secret";

fn getrandom_fill(buf: &mut [u8]) -> crate::Result<()> {
    use std::io::Read as _;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|e| crate::Error::Tls(format!("reading /dev/urandom: {e}")))
}

async fn open_store(
    options: &Options,
    client: &kube::Client,
    store_ca: Option<String>,
) -> anyhow::Result<Arc<dyn ArtifactStore>> {
    match options.store {
        StoreKind::Builtin => {
            let secret = store_secret(options, client).await?;
            let public_url = match &options.store_url {
                Some(url) => url.clone(),
                None => format!("http://{}/", options.store_listen)
                    .parse()
                    .context("building the store URL from --store-listen; pass --store-url")?,
            };
            let (store, _) = server::spawn(
                BuiltinConfig {
                    root: options.store_dir.clone(),
                    public_url,
                    secret,
                    max_upload_bytes: options.store_max_bytes,
                },
                options.store_listen,
                None,
            )
            .await
            .context("starting the built-in artifact store")?;
            Ok(store)
        }
        StoreKind::Remote => {
            let Some(internal_url) = options.store_url.clone() else {
                bail!("--store remote needs --store-url (where flamefleet-store serves)");
            };
            let secret = store_secret(options, client).await?;
            let store = RemoteStore::new(RemoteConfig {
                internal_url,
                public_url: options.store_public_url.clone(),
                secret,
                max_upload_bytes: options.store_max_bytes,
                ca_pem: store_ca,
            })
            .context("configuring the remote artifact store")?;
            Ok(Arc::new(store))
        }
        StoreKind::S3 => {
            let need = |v: &Option<String>, flag: &str| {
                v.clone()
                    .with_context(|| format!("--store s3 needs {flag}"))
            };
            let store = S3Store::new(S3Config {
                endpoint: need(&options.s3_endpoint, "--s3-endpoint")?,
                bucket: need(&options.s3_bucket, "--s3-bucket")?,
                region: options.s3_region.clone(),
                access_key_id: need(&options.s3_access_key_id, "--s3-access-key-id")?,
                secret_access_key: need(&options.s3_secret_access_key, "--s3-secret-access-key")?,
                allow_http: options.s3_allow_http,
            })
            .context("configuring the S3 artifact store")?;
            Ok(Arc::new(store))
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

/// Runs the operator until SIGTERM/Ctrl-C, or fails when it loses the leader Lease.
pub async fn run(options: Options) -> anyhow::Result<()> {
    install_default_crypto_provider();
    let clients = ApiClients::new(&kube_config(options.kubeconfig.as_ref()).await?)?;
    let client = clients.control.clone();
    let metrics = Arc::new(Metrics::new());
    let probe_state = ProbeState::new(metrics.clone());
    let listener = tokio::net::TcpListener::bind(options.metrics_listen)
        .await
        .with_context(|| format!("binding the metrics server to {}", options.metrics_listen))?;
    let probe_router = probes::router(probe_state.clone());
    tokio::spawn(flamefleet_proto::http_serve::serve(
        listener,
        probe_router,
        flamefleet_proto::http_serve::ServeLimits::PROBES,
    ));
    if let Some(listen) = options.debug_listen {
        flamefleet_selfprof::spawn(listen).await?;
    }
    let ca = match &options.ca_secret {
        Some(name) => Some(Arc::new(
            OperatorCa::load_or_create(&client, &options.agent_namespace, name)
                .await
                .with_context(|| format!("loading the operator CA from Secret {name}"))?,
        )),
        None => None,
    };
    // The store's certificate first: the store pod waits for its Secret.
    let store_ca = match (&options.store_tls_secret, &ca) {
        (Some(secret), Some(ca)) => {
            let hosts = store_cert::hosts_of(
                options
                    .store_url
                    .iter()
                    .chain(options.store_public_url.iter()),
            );
            store_cert::ensure(&client, &options.agent_namespace, secret, ca, &hosts)
                .await
                .with_context(|| {
                    format!("issuing the store's TLS certificate into Secret {secret}")
                })?;
            tokio::spawn(store_cert::maintain(
                client.clone(),
                options.agent_namespace.clone(),
                secret.clone(),
                ca.clone(),
                hosts,
            ));
            Some(ca.cert_pem().to_owned())
        }
        _ => None,
    };
    let store = open_store(&options, &client, store_ca.clone()).await?;
    // Checked before leading, so a bad export configuration fails the start, not later.
    let export = export_settings(&options)?;
    let continuous = continuous_settings(&options)?;
    let connector = match (&ca, &options.tls_ca, &options.tls_cert, &options.tls_key) {
        (Some(ca), ..) => AgentConnector::from_ca(ca.clone(), options.agent_connect_timeout)?,
        (None, Some(ca), Some(cert), Some(key)) => {
            AgentConnector::from_files(ca, cert, key, options.agent_connect_timeout)?
        }
        _ => bail!(
            "agent TLS is not configured: pass --ca-secret NAME (the operator manages a CA and signs agents' certificates) or --tls-ca, --tls-cert and --tls-key"
        ),
    };
    let identity = options.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    client
        .apiserver_version()
        .await
        .context("reaching the API server")?;
    probe_state.set_ready(true);

    let lease = LeaseConfig {
        namespace: options
            .lease_namespace
            .clone()
            .unwrap_or_else(|| options.agent_namespace.clone()),
        name: options.lease_name.clone(),
        identity: identity.clone(),
        duration_seconds: options.lease_duration.max(2),
        grace_seconds: (options.lease_duration / 3).max(1),
    };
    let mut election = Election::start(client.clone(), &lease).await?;
    tracing::info!(lease = %lease.name, %identity, "waiting for the leader Lease");
    tokio::select! {
        acquired = election.acquired() => acquired?,
        () = shutdown_signal() => return Ok(()),
    }
    metrics.set_leader(true);
    tracing::info!(%identity, "leading; starting the ProfileRequest and sampling-policy controllers");

    let signer = ca.map(|ca| {
        let signer = CsrSigner::new(
            client.clone(),
            ca,
            AgentIdentityPolicy {
                namespace: options.agent_namespace.clone(),
                service_account: options.agent_service_account.clone(),
            },
        );
        tokio::spawn(signer.run(std::future::pending::<()>()))
    });
    let (trigger, triggers) = tokio::sync::mpsc::unbounded_channel();
    let exporter = match export {
        Some(settings) => {
            let endpoint = settings.sink.endpoint.clone();
            let exporter = Exporter::start(settings, store.clone(), metrics.clone())
                .map_err(anyhow::Error::msg)
                .context("configuring the OTLP export")?;
            tracing::info!(%endpoint, "exporting finished captures as OTLP profiles");
            Some(exporter)
        }
        None => None,
    };
    let quota = Arc::new(QuotaLedger::new(
        store.clone(),
        options.artifact_quota_per_namespace,
    ));
    let connector = connector
        .with_channel_capacity(options.max_idle_agent_connections)
        .with_metrics(metrics.clone());
    let mut dispatcher = Dispatcher::new(
        connector.clone(),
        store.clone(),
        trigger,
        DispatchSettings {
            grace: options.capture_grace,
            urls: UrlPolicy {
                max_bytes: options.store_max_bytes,
            },
            max_concurrent_dispatch: options.max_concurrent_dispatch,
            max_concurrent_collects: options.max_concurrent_collects,
            backoff: Backoff {
                attempts: options.agent_connect_attempts,
                ..Backoff::default()
            },
            max_heap_overhead_percent: options.max_heap_overhead_percent,
            max_offcpu_overhead_percent: options.max_offcpu_overhead_percent,
        },
        metrics.clone(),
    )
    .with_quota(quota.clone())
    .with_agent_pods(crate::dispatch::agent_restarts::AgentPods::new(
        clients.requests.clone(),
        options.agent_namespace.clone(),
    ));
    if let Some(exporter) = exporter.clone() {
        dispatcher = dispatcher.with_exporter(exporter);
    }
    let dispatcher = Arc::new(dispatcher);
    let reporter = Reporter {
        controller: "flamefleet-operator".into(),
        instance: Some(identity.clone()),
    };
    let recorder = Recorder::new(clients.requests.clone(), reporter.clone());
    let (fleet, fleet_driver) = Fleet::start(&client, &options.agent_namespace);
    let fleet_task = tokio::spawn(fleet_driver);
    let sampling = Arc::new(SamplingContext {
        limits: SamplingLimits {
            min_run_interval: options.min_run_interval,
            max_policies_per_namespace: options.max_policies_per_namespace,
            max_queued_per_namespace: options.max_queued_runs_per_namespace,
        },
        client: client.clone(),
        fleet,
        ledger: Ledger::default(),
        planning: tokio::sync::Mutex::new(()),
        profiled: std::sync::Mutex::new(Default::default()),
        // Its own: a recorder's Events go through its client, and its cache is locked by
        // every Event it records.
        recorder: Recorder::new(client.clone(), reporter.clone()),
        metrics: metrics.clone(),
        triggers: sampling::triggers::TriggerHub::new(connector.clone()),
        continuous: sampling::continuous::ContinuousHub::new(
            connector,
            continuous,
            exporter.clone(),
        ),
    });
    let context = Arc::new(Context {
        limits: TenantLimits {
            max_concurrent: options.max_concurrent_captures,
            max_concurrent_per_namespace: options.max_concurrent_captures_per_namespace,
            min_heap_sample_bytes: options.min_heap_sample_bytes,
            max_cpu_frequency_hz: options.max_cpu_frequency_hz,
            max_heap_overhead_percent: options.max_heap_overhead_percent,
            max_offcpu_overhead_percent: options.max_offcpu_overhead_percent,
        },
        request_selector: options.request_selector.clone(),
        requests: std::sync::RwLock::new(None),
        client: clients.requests,
        runs: profile_request::Lane {
            recorder: Recorder::new(clients.runs.clone(), reporter.clone()),
            client: clients.runs,
        },
        store,
        dispatcher,
        recorder,
        metrics: metrics.clone(),
        agent_namespace: options.agent_namespace.clone(),
        pods: Some(sampling.fleet.pods.clone()),
        namespaces: Some(sampling.fleet.namespaces.clone()),
        admission: Default::default(),
        store_waits: StoreWaits::new(options.store_wait),
        adhoc_slots: profile_request::ReconcileSlots::new(options.max_concurrent_reconciles),
    });
    let lost = election.lost();
    let (lost_tx, mut lost_rx) = tokio::sync::oneshot::channel::<bool>();
    let shutdown = async move {
        let leadership_lost = tokio::select! {
            () = lost => true,
            () = shutdown_signal() => false,
        };
        let _ = lost_tx.send(leadership_lost);
    }
    .shared();
    // The budget reads the caches: policies wait for their first full lists.
    let policies = {
        let sampling = sampling.clone();
        let selector = options.request_selector.clone();
        let shutdown = shutdown.clone();
        async move {
            tokio::select! {
                ready = sampling.fleet.ready() => {
                    if let Err(e) = ready {
                        tracing::error!("sampling policies stopped: {e}");
                        return;
                    }
                }
                () = shutdown.clone() => return,
            }
            tracing::info!("sampling caches ready; starting the policy controllers");
            sampling::run(sampling, selector, shutdown).await;
        }
    };
    let downloads = download::run(
        Arc::new(DownloadContext {
            client: context.client.clone(),
            store: context.store.clone(),
            url_ttl: options.download_url_ttl,
            request_selector: options.request_selector.clone(),
            ca_bundle: store_ca,
            namespace: None,
            metrics: metrics.clone(),
        }),
        shutdown.clone(),
    );
    let store_gc = gc::run(
        context.client.clone(),
        context.store.clone(),
        Some(quota),
        GcSettings {
            interval: options.store_gc_interval,
            grace: options.store_gc_grace,
        },
        shutdown.clone(),
    );
    let requests = {
        let selector = options.request_selector.clone();
        async move {
            profile_request::run(context, triggers, selector.as_deref(), shutdown).await;
        }
    };
    // Each controller is a task of its own, run by whichever runtime thread is free: on one
    // task, the policies' reconciles were polled in turn with a new leader's hundreds of
    // resumed requests, all on one thread.
    let tasks = [
        tokio::spawn(store_gc),
        tokio::spawn(downloads),
        tokio::spawn(requests),
        tokio::spawn(policies),
    ];
    for task in tasks {
        if let Err(e) = task.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
    fleet_task.abort();
    if let Some(signer) = signer {
        signer.abort();
    }
    let leadership_lost = lost_rx.try_recv().unwrap_or(false);
    if let Some(exporter) = &exporter {
        exporter.abandon(if leadership_lost {
            "leader_lost"
        } else {
            "shutdown"
        });
    }
    metrics.set_leader(false);
    if leadership_lost {
        bail!(
            "lost the leader Lease {}; exiting so that only the new leader acts",
            lease.name
        );
    }
    Ok(())
}
