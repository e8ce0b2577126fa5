//! The agent's gRPC service (`flamefleet.agent.v1.AgentService`) over mutual
//! TLS: `Capture` (idempotent per request UID, streaming progress), `Cancel`
//! and `Info`.
//!
//! Layout: [`tls`] (certificates, operator-only client auth), [`identity`] (this node's
//! certificate from a Kubernetes CSR, renewed), [`probes`] (`/healthz`, `/readyz`,
//! `/metrics`), [`captures`] (the UID table:
//! start / attach / replay / cancel), [`engine`] (what captures: the node's samplers, or a
//! load generator's stand-in), [`targets`] (pods → cgroups and labels), [`pipeline`] (one
//! capture: engine, artifacts, upload, report), [`reporter`] (events for `/metrics`),
//! [`upload`] (HTTP PUT with sha256 and retries), [`info`] (kernel release and features).
//!
//! The agent reports results only over the `Capture` stream; the operator alone writes
//! ProfileRequest status, so agents need no access to ProfileRequests at all (a node
//! cannot forge another node's result).

pub mod captures;
pub mod continuous;
pub mod engine;
mod error;
pub mod identity;
pub mod info;
pub mod metrics;
pub mod pipeline;
pub mod probes;
pub mod reporter;
pub mod targets;
pub mod tls;
pub mod upload;
pub mod watch;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use flamefleet_proto::agent::agent_service_server::{AgentService, AgentServiceServer};
use flamefleet_proto::agent::capture_progress::Stage;
use flamefleet_proto::agent::{
    CancelRequest, CancelResponse, CaptureProgress, CaptureRequest, CollectRequest,
    ContinuousEvent, ContinuousRequest, InfoRequest, InfoResponse, WatchEvent, WatchRequest,
};
use futures::{Stream, StreamExt as _};
use tonic::{Request, Response, Status};

use self::captures::{CacheLimits, CaptureTable, Collected, Joined, follow};
use self::engine::{Admission, NodeEngine};
pub use self::pipeline::Context;
use self::pipeline::progress;
use self::probes::ProbeState;
use self::reporter::{CallOutcome, Reporter, Rpc};
pub use self::tls::{ServingIdentity, TlsFiles, TlsMaterial};
use self::upload::{UploadPolicy, Uploader};
use crate::capture::{SamplerConfig, Samplers};
use crate::cgroup::{CgroupError, CgroupRoot};
use crate::trigger::fire_heaps::{FireHeapLimits, FireHeaps};
use crate::trigger::fire_lead_ups::{FireLeadUps, LeadUpLimits};

/// Errors of starting or running the service.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// A TLS file could not be read.
    #[error("reading the {what} {path}: {source}")]
    TlsFile {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A TLS file holds no PEM data.
    #[error("the {what} {path} holds no PEM block; expected a file starting with -----BEGIN")]
    TlsPem {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
    },
    /// The node name is missing or not a valid name.
    #[error(
        "invalid node name {0:?}: expected a Kubernetes node name (lowercase letters, digits, '-', '.'); pass --node-name or set NODE_NAME"
    )]
    NodeName(String),
    /// The cgroup root is unusable.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The kubeconfig could not be used.
    #[error("cannot use kubeconfig {path}: {reason}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The HTTP client for uploads could not be built.
    #[error(transparent)]
    Upload(#[from] upload::UploadError),
    /// Binding the listen address failed.
    #[error("listening on {addr}: {source}; is another process using the port?")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The self-profiling server could not start.
    #[error(transparent)]
    Debug(#[from] flamefleet_selfprof::Error),
    /// The gRPC server failed.
    #[error("the gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// TLS material is unusable, or the node certificate could not be obtained.
    #[error("agent TLS: {0}")]
    Tls(String),
    /// `--tls-bootstrap csr` without a Kubernetes configuration.
    #[error(
        "--tls-bootstrap csr needs a Kubernetes client (in-cluster configuration or --kubeconfig) to request this node's certificate"
    )]
    NoKubernetesForCsr,
}

/// Result of this module.
pub type Result<T, E = ServiceError> = std::result::Result<T, E>;

/// Where the agent's serving certificate comes from.
#[derive(Debug, Clone)]
pub enum TlsSource {
    /// PEM files set up by hand.
    Files(TlsFiles),
    /// A Kubernetes CSR signed by the operator (renewed automatically).
    Csr,
}

/// Everything `serve` needs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// This node's name.
    pub node_name: String,
    /// Address to listen on (port 0: any free port, printed at start).
    pub listen: SocketAddr,
    /// Where the serving certificate comes from.
    pub tls: TlsSource,
    /// Address of `/healthz`, `/readyz` and `/metrics` (none: not served).
    pub probe_listen: Option<SocketAddr>,
    /// Address of the agent's own profiles, `/debug/pprof/{profile,heap}` (none: not served).
    pub debug_listen: Option<SocketAddr>,
    /// Sizes of the samplers' BPF maps.
    pub map_sizes: crate::capture::MapSizes,
    /// Kubeconfig for the CSR of `--tls-bootstrap csr`; `None`: in-cluster configuration.
    /// The agent writes nothing else to the API: it reports results to the operator.
    pub kubeconfig: Option<PathBuf>,
    /// cgroup2 root pods are looked up under; `None`: the cgroup2 mount.
    pub cgroup_root: Option<PathBuf>,
    /// The trigger watcher's bounds (least cooldown, cgroups watched, fires per minute).
    pub triggers: crate::trigger::WatcherConfig,
    /// The lead-up ring of CPU and pressure triggers (frequency, lookback).
    pub lead_up: crate::trigger::cpu_ring::RingConfig,
}

/// The tonic service: the captures table, progress, uploads and reporting around a
/// [`engine::CaptureEngine`].
#[derive(Clone)]
pub struct Agent {
    ctx: Arc<Context>,
    table: Arc<CaptureTable>,
    probes: Arc<ProbeState>,
    /// The node's triggers (`Watch`); `None`: this agent watches nothing.
    watch: Option<Arc<watch::NodeWatch>>,
    /// The node's always-on profiling (`Continuous`); `None`: this agent does none.
    continuous: Option<Arc<crate::continuous::Continuous>>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("node", &self.ctx.node)
            .finish_non_exhaustive()
    }
}

fn valid_node_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 253
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// The Kubernetes client the agent needs for its CSR: from `--kubeconfig`, else in-cluster.
async fn kube_client(kubeconfig: Option<&PathBuf>) -> Result<kube::Client> {
    let label = kubeconfig.map_or_else(|| PathBuf::from("(in-cluster)"), Clone::clone);
    let err = |reason: String| ServiceError::Kubeconfig {
        path: label.clone(),
        reason,
    };
    let cfg = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| err(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| err(e.to_string()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|_| ServiceError::NoKubernetesForCsr)?,
    };
    kube::Client::try_from(cfg).map_err(|e| err(e.to_string()))
}

/// The node's service and what `serve` also needs of it (health, metrics).
struct NodeAgent {
    agent: Agent,
    samplers: Arc<Samplers>,
    metrics: Arc<metrics::AgentMetrics>,
    watch: Arc<watch::NodeWatch>,
    continuous: Arc<crate::continuous::Continuous>,
}

impl NodeAgent {
    /// The node's service: checks the node name and cgroup root; captures with the node's
    /// samplers, sized by the configured map sizes.
    fn new(config: &AgentConfig) -> Result<Self> {
        if !valid_node_name(&config.node_name) {
            return Err(ServiceError::NodeName(config.node_name.clone()));
        }
        let cgroup_root = match &config.cgroup_root {
            Some(p) => CgroupRoot::at_or_under(p)?,
            None => CgroupRoot::detect()?,
        };
        let mut sampler_config = SamplerConfig {
            node: config.node_name.clone(),
            ..SamplerConfig::default()
        };
        config.map_sizes.apply(&mut sampler_config);
        let samplers = Arc::new(Samplers::new(sampler_config.clone()));
        let continuous = crate::continuous::Continuous::new(
            cgroup_root.clone(),
            sampler_config,
            samplers.catalog().clone(),
        );
        let metrics = Arc::new(metrics::AgentMetrics::default());
        let fire_heaps = Arc::new(FireHeaps::new(FireHeapLimits::default()));
        let fire_lead_ups = Arc::new(FireLeadUps::new(LeadUpLimits::default()));
        let watch = Arc::new(
            watch::NodeWatch::new(cgroup_root.clone(), config.triggers.clone())
                .with_heap_at_fire(watch::HeapAtFireReader {
                    samplers: Arc::clone(&samplers),
                    spool: Arc::clone(&fire_heaps),
                })
                .with_lead_up_at_fire(watch::LeadUpAtFireReader {
                    config: config.lead_up,
                    spool: Arc::clone(&fire_lead_ups),
                }),
        );
        let agent = Agent::with_engine(Context {
            node: config.node_name.clone(),
            engine: Arc::new(NodeEngine {
                cgroup_root,
                samplers: Arc::clone(&samplers),
                fire_heaps: Some(fire_heaps),
                fire_lead_ups: Some(fire_lead_ups),
            }),
            uploader: Uploader::new(UploadPolicy::default())?,
            upload_permits: None,
            reporter: Arc::clone(&metrics) as Arc<dyn Reporter>,
            progress_period: pipeline::PROGRESS_PERIOD,
            shutdown: tokio_util::sync::CancellationToken::new(),
        })
        .with_watch(Arc::clone(&watch))
        .with_continuous(Arc::clone(&continuous));
        Ok(Self {
            agent,
            samplers,
            metrics,
            watch,
            continuous,
        })
    }
}

impl Agent {
    /// A service capturing with `ctx.engine`.
    pub fn with_engine(ctx: Context) -> Self {
        Self {
            ctx: Arc::new(ctx),
            table: Arc::new(CaptureTable::new(CacheLimits::default())),
            probes: ProbeState::new("starting"),
            watch: None,
            continuous: None,
        }
    }

    /// Serves `Continuous` with `continuous` (the node's always-on profiling).
    #[must_use]
    pub fn with_continuous(mut self, continuous: Arc<crate::continuous::Continuous>) -> Self {
        self.continuous = Some(continuous);
        self
    }

    /// Serves `Watch` with `watch` (the node's trigger watcher).
    #[must_use]
    pub fn with_watch(mut self, watch: Arc<watch::NodeWatch>) -> Self {
        self.watch = Some(watch);
        self
    }

    /// Serves this service on `listener` over mutual TLS (`tls`: the node's certificate,
    /// the operator's client certificate required) until `shutdown` resolves; running
    /// captures that wait for nothing else (see [`Admission`]) end then.
    ///
    /// # Errors
    /// A failure of the gRPC server.
    pub async fn serve_on(
        self,
        listener: tokio::net::TcpListener,
        tls: Arc<rustls::ServerConfig>,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<()> {
        let token = self.ctx.shutdown.clone();
        let shutdown = async move {
            shutdown.await;
            token.cancel();
        };
        serve_service(self, listener, tls, shutdown).await
    }
}

/// Serves `service` (an [`Agent`], or a service delegating to one, as the load generator's
/// compromised nodes do) on `listener` over mutual TLS until `shutdown` resolves.
///
/// # Errors
/// A failure of the gRPC server.
pub async fn serve_service<S: AgentService>(
    service: S,
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    tonic::transport::Server::builder()
        .add_service(AgentServiceServer::new(service))
        .serve_with_incoming_shutdown(tls::incoming(listener, tls, HANDSHAKE_TIMEOUT), shutdown)
        .await?;
    Ok(())
}

impl Agent {
    /// Uploads trust `ca_pem` (the operator's CA) for an `https` store. Called before the
    /// agent serves.
    fn trust_store_ca(&mut self, ca_pem: &[u8]) -> Result<()> {
        let uploader = Uploader::trusting(UploadPolicy::default(), Some(ca_pem))?;
        match Arc::get_mut(&mut self.ctx) {
            Some(ctx) => {
                ctx.uploader = uploader;
                Ok(())
            }
            None => Err(ServiceError::Tls(
                "the agent is already serving; its store trust cannot change".into(),
            )),
        }
    }
}

/// The stream type of `Capture`.
pub type ProgressStream = Pin<Box<dyn Stream<Item = Result<CaptureProgress, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for Agent {
    type CaptureStream = ProgressStream;

    async fn capture(
        &self,
        request: Request<CaptureRequest>,
    ) -> Result<Response<Self::CaptureStream>, Status> {
        let req = request.into_inner();
        let uid = req.request_uid.trim().to_owned();
        if uid.is_empty() {
            return Err(Status::invalid_argument(
                "request_uid is empty; expected the ProfileRequest's metadata.uid",
            ));
        }
        let admission = self.ctx.engine.admit(&req);
        let accepted = (admission != Admission::Hang).then(|| {
            progress(
                Stage::Accepted,
                format!("accepted by node {}", self.ctx.node),
            )
        });
        let report = |outcome| self.ctx.reporter.call(Rpc::Capture, outcome);
        let stream = match self.table.join(&uid, accepted) {
            Joined::New(handle, rx) => {
                tracing::info!(%uid, name = %req.request_name, "new capture");
                report(CallOutcome::Started);
                let ctx = Arc::clone(&self.ctx);
                let probes = Arc::clone(&self.probes);
                probes.capture_delta(true);
                tokio::spawn(async move {
                    pipeline::run(ctx, handle, req, admission).await;
                    probes.capture_delta(false);
                });
                Box::pin(follow(rx, true).map(Ok)) as ProgressStream
            }
            Joined::Attached(rx) => {
                tracing::info!(%uid, "attaching to running capture");
                report(CallOutcome::Attached);
                Box::pin(follow(rx, false).map(Ok)) as ProgressStream
            }
            Joined::Finished(last) => {
                tracing::info!(%uid, "replaying finished capture");
                report(CallOutcome::Replayed);
                Box::pin(futures::stream::iter([Ok(last)])) as ProgressStream
            }
        };
        Ok(Response::new(stream))
    }

    type CollectStream = ProgressStream;

    async fn collect(
        &self,
        request: Request<CollectRequest>,
    ) -> Result<Response<Self::CollectStream>, Status> {
        let uid = request.into_inner().request_uid.trim().to_owned();
        if uid.is_empty() {
            return Err(Status::invalid_argument(
                "request_uid is empty; expected the ProfileRequest's metadata.uid",
            ));
        }
        let report = |outcome| self.ctx.reporter.call(Rpc::Collect, outcome);
        let stream = match self.table.collect(&uid) {
            Some(Collected::Running(rx)) => {
                report(CallOutcome::Attached);
                Box::pin(follow(rx, false).map(Ok)) as ProgressStream
            }
            Some(Collected::Finished(last)) => {
                report(CallOutcome::Replayed);
                Box::pin(futures::stream::iter([Ok(last)])) as ProgressStream
            }
            None => {
                report(CallOutcome::Unknown);
                return Err(Status::not_found(format!(
                    "node {} has no capture for request {uid}: it never got the Capture call, \
                     the agent restarted since, or the result left its cache",
                    self.ctx.node
                )));
            }
        };
        tracing::debug!(%uid, "collecting capture");
        Ok(Response::new(stream))
    }

    async fn cancel(
        &self,
        request: Request<CancelRequest>,
    ) -> Result<Response<CancelResponse>, Status> {
        let uid = request.into_inner().request_uid;
        let found = self.table.cancel(uid.trim());
        tracing::info!(%uid, found, "cancel");
        self.ctx.reporter.cancel_called(found);
        Ok(Response::new(CancelResponse { found }))
    }

    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        Ok(Response::new(self.ctx.engine.info(&self.ctx.node)))
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, Status>> + Send>>;

    async fn watch(
        &self,
        request: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let Some(watch) = self.watch.clone() else {
            return Err(Status::unimplemented(format!(
                "the agent of node {} watches no triggers (a capture-only agent)",
                self.ctx.node
            )));
        };
        let req = request.into_inner();
        let pods = req.pods.len();
        let node_watch = Arc::clone(&watch);
        let (session, ack, rx) = tokio::task::spawn_blocking(move || node_watch.replace(&req))
            .await
            .map_err(|e| Status::internal(format!("replacing the watch set: {e}")))?;
        tracing::info!(session, pods, "watch set replaced");
        Ok(Response::new(Box::pin(watch::WatchStream::new(
            watch, session, ack, rx,
        ))))
    }

    type ContinuousStream = Pin<Box<dyn Stream<Item = Result<ContinuousEvent, Status>> + Send>>;

    async fn continuous(
        &self,
        request: Request<ContinuousRequest>,
    ) -> Result<Response<Self::ContinuousStream>, Status> {
        let Some(continuous) = self.continuous.clone() else {
            return Err(Status::unimplemented(format!(
                "the agent of node {} does no always-on profiling (a capture-only agent)",
                self.ctx.node
            )));
        };
        let req = request.into_inner();
        let pods = req.pods.len();
        let (session, ack, rx) = continuous.replace(&req).map_err(Status::invalid_argument)?;
        tracing::info!(session, pods, "always-on set replaced");
        Ok(Response::new(Box::pin(continuous::ContinuousStream::new(
            continuous, session, ack, rx,
        ))))
    }
}

/// How long a client may take to complete the TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves the agent until `shutdown` resolves. Prints `listening on ADDR`
/// on stdout once bound (useful with port 0), and `probes on ADDR` for the
/// probe server.
///
/// With [`TlsSource::Csr`] the agent first obtains this node's certificate (the probes
/// answer meanwhile: healthy, not ready), then renews it in the background.
///
/// # Errors
/// Configuration errors (a bad node name or cgroup root, [`TlsFiles::read`]),
/// a port in use, or a failure of the server.
pub async fn serve(
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    // kube (ring) and other dependencies may link more than one rustls
    // provider; pick ring explicitly so TLS setup never has to guess.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let material = match &config.tls {
        TlsSource::Files(files) => Some(files.read()?),
        TlsSource::Csr => None,
    };
    let NodeAgent {
        mut agent,
        samplers,
        metrics,
        watch,
        continuous,
    } = NodeAgent::new(&config)?;
    // What this node's kernel offers and what each engine runs with (also on /metrics).
    tracing::info!(
        "{}",
        crate::capture::kernel::KernelFeatures::get().summary()
    );
    let probes = Arc::clone(&agent.probes);
    let health = Arc::clone(&samplers);
    probes.set_health_check(Box::new(move || health.health()));
    probes.set_metrics(metrics, samplers);
    probes.set_trigger_metrics(watch);
    probes.set_continuous_metrics(continuous);
    if let Some(listen) = config.probe_listen {
        let bound = probes::spawn(listen, Arc::clone(&probes)).await?;
        println!("probes on {bound}");
    }
    if let Some(listen) = config.debug_listen {
        // Logged (not printed: stdout's first line is the gRPC address tools read).
        flamefleet_selfprof::spawn(listen).await?;
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServiceError::Bind {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| ServiceError::Bind {
        addr: config.listen,
        source,
    })?;
    let identity = match material {
        Some(material) => {
            agent.trust_store_ca(&material.ca_pem)?;
            ServingIdentity::new(&material)?
        }
        None => {
            let client = kube_client(config.kubeconfig.as_ref()).await?;
            probes.set_waiting("waiting for the operator to sign this node's certificate (CSR)");
            let issued = identity::first_certificate(&client, &config.node_name).await;
            agent.trust_store_ca(&issued.material.ca_pem)?;
            let serving = ServingIdentity::new(&issued.material)?;
            probes.set_cert_expiry(issued.not_after);
            tokio::spawn(identity::keep_renewed(
                client,
                config.node_name.clone(),
                Arc::clone(&serving),
                issued.not_after,
            ));
            serving
        }
    };
    tracing::info!(%addr, node = %config.node_name, "agent serving");
    println!("listening on {addr}");
    probes.set_waiting("");
    probes.set_serving(true);
    let result = agent
        .serve_on(listener, identity.server_config(), shutdown)
        .await;
    probes.set_serving(false);
    result
}
