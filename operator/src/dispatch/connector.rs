//! mTLS gRPC connections from the operator to agents.
//!
//! Every connection verifies that the agent serves the node the operator wants
//! ([`agent_dns_name`] of that node), so a certificate stolen from one node cannot answer for
//! another. The operator's own client certificate comes either from files (set up by hand)
//! or from the operator's CA ([`AgentConnector::from_ca`]), which issues a short-lived one
//! and renews it in the background.
//!
//! Channels are cached per agent endpoint (node name and address), up to a capacity: calls
//! of later requests to the same agent multiplex on its connection (HTTP/2 streams) instead
//! of handshaking again, and a fleet larger than the capacity keeps only its most recently
//! used connections. See [`ChannelCache`] for what evicts an entry.
//!
//! All channels share one rustls client configuration (the CA as the only root, the
//! operator's client certificate, ALPN `h2`), built once per certificate generation and used
//! through [`AgentTlsConnector`]. tonic's own `ClientTlsConfig` would build a configuration
//! per channel: parse the CA and the key again, and pre-size a 256-server session cache, for
//! each of thousands of agents.

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use flamefleet_proto::agent::agent_service_client::AgentServiceClient;
use flamefleet_proto::identity::agent_dns_name;
use hyper_util::rt::TokioIo;
use rustls::client::Resumption;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tonic::transport::{Channel, Endpoint};

use super::tls_sessions::AgentSessions;
use crate::identity::ca::OperatorCa;
use crate::metrics::Metrics;
use crate::pods::agents::AgentEndpoint;
use crate::{Error, Result};

/// Lifetime of the operator's client certificates issued by its CA.
const CLIENT_CERT_TTL: Duration = Duration::from_secs(24 * 3600);
/// How often the client certificate is renewed (a third of its lifetime: two spare renewals).
const CLIENT_CERT_RENEWAL: Duration = Duration::from_secs(8 * 3600);
/// A cached channel unused for this long is closed on the next cache access. Long enough to
/// keep the connections of back-to-back requests and sampling-policy runs (minutes apart);
/// short enough that an idle operator does not hold one TLS connection (tens of KiB) per
/// agent of a large fleet for ever.
pub const CHANNEL_IDLE_TTL: Duration = Duration::from_secs(10 * 60);
/// Agents whose TLS session tickets the operator keeps (`tls_sessions`). A fleet larger
/// than this loses resumption for the collections: the agent added first is forgotten, and
/// a request starts and collects its nodes in the same order.
const RESUMPTION_AGENTS: usize = 8192;
/// Default of [`ChannelCache`]'s capacity (the operator's `--max-idle-agent-connections`).
pub const DEFAULT_CHANNEL_CAPACITY: usize = 512;
/// HTTP/2 keepalive ping interval on agent channels: a dead peer (node gone, agent killed
/// without a FIN) is noticed within interval + timeout instead of at the capture deadline.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The client side of the agents' mTLS: one rustls configuration for every agent channel.
#[derive(Clone)]
struct TlsMaterial {
    config: Arc<rustls::ClientConfig>,
    /// Bumped at every renewal: channels built with an older generation are replaced, so
    /// reconnections never present an expired client certificate.
    generation: u64,
}

impl TlsMaterial {
    /// Builds the configuration from the CA that agents' certificates chain to and the
    /// operator's client certificate chain and key, all PEM.
    ///
    /// TLS 1.3 session resumption is on: a node's capture connects twice (start, then
    /// collect: see `dispatch`), and the second handshake resumes the first's session
    /// instead of signing and verifying certificates again. A resumed session carries the
    /// identities both sides checked in the full handshake, and only this process knows its
    /// secret. Its ticket lives here, in a configuration rebuilt at every renewal of the
    /// operator's certificate (every 8 h with `--ca-secret`; certificate files are never
    /// renewed, and then the ticket's own lifetime, 24 h, bounds it) and forgotten when the
    /// operator restarts. The agent keeps its side of the session across a swap of its own
    /// certificate or CA (its rustls configuration is built once), so within those hours a
    /// session made under the old CA still resumes there. The cache
    /// ([`AgentSessions`]) holds the newest ticket of at most [`RESUMPTION_AGENTS`] agents,
    /// ~1 KiB each with the agent's certificate.
    ///
    /// # Errors
    /// [`Error::Tls`] when a PEM block does not parse, there is no CA certificate, or the key
    /// does not fit the certificate.
    fn build(ca_pem: &[u8], cert_pem: &[u8], key_pem: &[u8], generation: u64) -> Result<Self> {
        let tls = |what: &str, e: &dyn std::fmt::Display| Error::Tls(format!("{what}: {e}"));
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            let cert = cert.map_err(|e| tls("the agents' CA certificate does not parse", &e))?;
            roots
                .add(cert)
                .map_err(|e| tls("the agents' CA certificate is unusable", &e))?;
        }
        if roots.is_empty() {
            return Err(Error::Tls(
                "no CA certificate to check agents against: expected a PEM CERTIFICATE block"
                    .into(),
            ));
        }
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| tls("the operator's client certificate does not parse", &e))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| tls("the operator's client key does not parse", &e))?;
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| tls("TLS protocol versions", &e))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| tls("the operator's client certificate and key", &e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        // rustls' own cache counts tickets, eight per server: asked for 8,192 it held 1,024
        // agents, and no collection of a 5,000-node request resumed its session.
        config.resumption = Resumption::store(Arc::new(AgentSessions::new(RESUMPTION_AGENTS)))
            .tls12_resumption(rustls::client::Tls12Resumption::Disabled);
        Ok(Self {
            config: Arc::new(config),
            generation,
        })
    }
}

/// Connects to one agent: TCP, then TLS with the shared configuration, verifying that the
/// agent's certificate names `server_name` (its node's [`agent_dns_name`]) and that HTTP/2
/// was negotiated. tonic wraps it in the endpoint's connect timeout.
#[derive(Clone)]
struct AgentTlsConnector {
    address: String,
    server_name: ServerName<'static>,
    config: Arc<rustls::ClientConfig>,
    metrics: Option<Arc<Metrics>>,
}

impl tonic::codegen::Service<http::Uri> for AgentTlsConnector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let tcp = TcpStream::connect(this.address.as_str()).await?;
            tcp.set_nodelay(true)?;
            let tls = TlsConnector::from(this.config)
                .connect(this.server_name, tcp)
                .await?;
            let session = tls.get_ref().1;
            if session.alpn_protocol() != Some(b"h2".as_slice()) {
                return Err(std::io::Error::other(
                    "the agent did not negotiate HTTP/2 (ALPN h2)",
                ));
            }
            if let Some(metrics) = &this.metrics {
                metrics.agent_handshake(
                    session.handshake_kind() == Some(rustls::HandshakeKind::Resumed),
                );
            }
            Ok(TokioIo::new(tls))
        })
    }
}

/// Exponential backoff with full jitter (AWS Architecture Blog, "Exponential Backoff And
/// Jitter"): the delay before retry `attempt` (0-based) is uniform in
/// `[0, min(cap, base * 2^attempt)]`. Thousands of nodes retrying after one blip (an agent
/// DaemonSet rollout, a network partition healing) spread over the whole window instead of
/// arriving in lock-step waves, which the fixed `200 ms * attempt` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Upper bound of the first delay.
    pub base: Duration,
    /// Upper bound of any delay.
    pub cap: Duration,
    /// Attempts in all (the first one included).
    pub attempts: u32,
}

impl Default for Backoff {
    /// Three attempts within about a second and a half: an agent that is just starting
    /// refuses connections briefly; one that stays down is reported, not waited for (the
    /// request's deadline is the capture duration plus grace).
    fn default() -> Self {
        Self {
            base: Duration::from_millis(250),
            cap: Duration::from_secs(2),
            attempts: 3,
        }
    }
}

impl Backoff {
    /// The largest delay before retry `attempt` (0-based): `min(cap, base * 2^attempt)`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The delay before retry `attempt` (0-based), drawn from `rng`.
    pub fn delay(&self, attempt: u32, rng: &mut fastrand::Rng) -> Duration {
        let ceiling = u64::try_from(self.ceiling(attempt).as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(rng.u64(0..=ceiling))
    }
}

/// One cached channel.
#[derive(Debug, Clone)]
struct Cached {
    address: String,
    generation: u64,
    channel: Channel,
    last_used: Instant,
}

/// Open channels by node. An entry is replaced when the node's agent moves (a new pod, a
/// new address) or the operator's client certificate is renewed, removed after a
/// connection error ([`AgentConnector::evict`]) and closed after [`CHANNEL_IDLE_TTL`] unused.
/// At most `capacity` entries are kept. Once it is full, a new connection is used without
/// being cached (and closes when its call ends) until an entry leaves: idle past the TTL,
/// stale, or failed. Evicting the least recently used instead would be the worst choice
/// here: a request over more nodes than the capacity visits them in the same order twice
/// (start, then collect), so LRU would always drop the connection needed next, while a
/// stable set is reused by both calls of every request. Each connection costs the operator
/// 60-90 KiB (HTTP/2 codec buffers, hyper's and tonic's request queues, TLS state), so the
/// capacity, not the fleet's size, bounds what idle connections hold.
#[derive(Debug)]
pub struct ChannelCache {
    entries: Mutex<HashMap<String, Cached>>,
    capacity: usize,
}

impl Default for ChannelCache {
    fn default() -> Self {
        Self::with_capacity(DEFAULT_CHANNEL_CAPACITY)
    }
}

impl ChannelCache {
    /// An empty cache keeping at most `capacity` channels (at least one).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            entries: Mutex::default(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Cached>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live channel of `node` at `address` built with TLS `generation`, if any; drops a
    /// stale one (other address or generation) and every entry idle past `ttl`.
    fn get(
        &self,
        node: &str,
        address: &str,
        generation: u64,
        now: Instant,
        ttl: Duration,
    ) -> Option<Channel> {
        let mut entries = self.lock();
        entries.retain(|_, c| now.saturating_duration_since(c.last_used) <= ttl);
        match entries.get_mut(node) {
            Some(c) if c.address == address && c.generation == generation => {
                c.last_used = now;
                Some(c.channel.clone())
            }
            Some(_) => {
                entries.remove(node);
                None
            }
            None => None,
        }
    }

    /// Caches `channel` for `node` unless the cache is full of other nodes' channels; returns
    /// whether it was cached.
    fn insert(
        &self,
        node: &str,
        address: &str,
        generation: u64,
        channel: Channel,
        now: Instant,
    ) -> bool {
        let mut entries = self.lock();
        if entries.len() >= self.capacity && !entries.contains_key(node) {
            return false;
        }
        entries.insert(
            node.to_owned(),
            Cached {
                address: address.to_owned(),
                generation,
                channel,
                last_used: now,
            },
        );
        true
    }

    /// Forgets the channel of `node` if it still points at `address`.
    fn evict(&self, node: &str, address: &str) -> bool {
        let mut entries = self.lock();
        if entries.get(node).is_some_and(|c| c.address == address) {
            entries.remove(node);
            return true;
        }
        false
    }

    /// Number of cached channels.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no channel is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Opens mTLS channels to agents with the operator's client certificate, and keeps them.
#[derive(Clone)]
pub struct AgentConnector {
    material: Arc<RwLock<TlsMaterial>>,
    connect_timeout: Duration,
    channels: Arc<ChannelCache>,
    metrics: Option<Arc<Metrics>>,
}

impl std::fmt::Debug for AgentConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConnector")
            .field("connect_timeout", &self.connect_timeout)
            .field("channels", &self.channels.len())
            .finish_non_exhaustive()
    }
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        Error::Tls(format!(
            "cannot read the {what} {}: {e}; pass a PEM file",
            path.display()
        ))
    })
}

impl AgentConnector {
    /// Loads the CA (that signed the agents' serving certificates) and the operator's client
    /// certificate and key, all PEM.
    ///
    /// # Errors
    /// [`Error::Tls`] when a file cannot be read or its PEM does not make a client
    /// configuration.
    pub fn from_files(
        ca: &Path,
        cert: &Path,
        key: &Path,
        connect_timeout: Duration,
    ) -> Result<Self> {
        let material = TlsMaterial::build(
            &read(ca, "CA certificate")?,
            &read(cert, "client certificate")?,
            &read(key, "client key")?,
            0,
        )?;
        Ok(Self {
            material: Arc::new(RwLock::new(material)),
            connect_timeout,
            channels: Arc::default(),
            metrics: None,
        })
    }

    /// Issues the operator a client certificate from `ca` and renews it in the background
    /// for as long as the connector (or a clone) lives.
    ///
    /// # Errors
    /// [`Error::Tls`] when the first certificate cannot be issued.
    pub fn from_ca(ca: Arc<OperatorCa>, connect_timeout: Duration) -> Result<Self> {
        let issue = |ca: &OperatorCa, generation: u64| -> Result<TlsMaterial> {
            let pair = ca.issue_operator_client(CLIENT_CERT_TTL)?;
            TlsMaterial::build(
                ca.cert_pem().as_bytes(),
                pair.chain_pem.as_bytes(),
                pair.key_pem.as_bytes(),
                generation,
            )
        };
        let material = Arc::new(RwLock::new(issue(&ca, 0)?));
        let weak = Arc::downgrade(&material);
        tokio::spawn(async move {
            let mut generation = 0;
            loop {
                tokio::time::sleep(CLIENT_CERT_RENEWAL).await;
                let Some(material) = weak.upgrade() else {
                    return;
                };
                generation += 1;
                match issue(&ca, generation) {
                    Ok(fresh) => {
                        if let Ok(mut current) = material.write() {
                            *current = fresh;
                        }
                        tracing::info!("renewed the operator's agent client certificate");
                    }
                    Err(e) => tracing::error!(
                        "renewing the operator's agent client certificate: {e}; the current one stays in use"
                    ),
                }
            }
        });
        Ok(Self {
            material,
            connect_timeout,
            channels: Arc::default(),
            metrics: None,
        })
    }

    /// Reports connections and cached channels to `metrics`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Keeps at most `capacity` idle channels (see [`ChannelCache`]); call before first use.
    #[must_use]
    pub fn with_channel_capacity(mut self, capacity: usize) -> Self {
        self.channels = Arc::new(ChannelCache::with_capacity(capacity));
        self
    }

    /// The cached channels.
    pub fn channels(&self) -> &ChannelCache {
        &self.channels
    }

    fn material(&self) -> Result<TlsMaterial, String> {
        self.material
            .read()
            .map(|m| m.clone())
            .map_err(|_| "the TLS material lock is poisoned".to_owned())
    }

    /// A client of `agent`, which must prove it serves `agent.node`: on the cached channel
    /// when there is one, else on a new connection (then cached). The error is a
    /// human-readable transport error.
    pub async fn connect(
        &self,
        agent: &AgentEndpoint,
    ) -> std::result::Result<AgentServiceClient<Channel>, String> {
        let material = self.material()?;
        let generation = material.generation;
        let now = Instant::now();
        if let Some(channel) = self.channels.get(
            &agent.node,
            &agent.address,
            generation,
            now,
            CHANNEL_IDLE_TTL,
        ) {
            return Ok(AgentServiceClient::new(channel));
        }
        let server_name = ServerName::try_from(agent_dns_name(&agent.node))
            .map_err(|e| format!("node name {:?} makes no TLS server name: {e}", agent.node))?;
        // TLS is the connector's: tonic sees a plain-HTTP/2 URI (the authority is only
        // the :authority header; the connector dials `agent.address`).
        let uri = format!("http://{}", agent.address);
        let endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|e| format!("invalid agent address {uri}: {e}"))?
            .connect_timeout(self.connect_timeout)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT);
        let connector = AgentTlsConnector {
            address: agent.address.clone(),
            server_name,
            config: material.config,
            metrics: self.metrics.clone(),
        };
        let connected = endpoint
            .connect_with_connector(connector)
            .await
            .map_err(|e| describe(&e));
        if let Some(metrics) = &self.metrics {
            metrics.agent_connection(connected.is_ok());
        }
        let channel = connected?;
        self.channels.insert(
            &agent.node,
            &agent.address,
            generation,
            channel.clone(),
            Instant::now(),
        );
        self.report_channels();
        Ok(AgentServiceClient::new(channel))
    }

    /// Forgets the cached channel of `agent` (after a connection error), so the next call
    /// connects afresh.
    pub fn evict(&self, agent: &AgentEndpoint) {
        if self.channels.evict(&agent.node, &agent.address) {
            tracing::debug!(node = %agent.node, address = %agent.address, "dropped the cached agent channel");
        }
        self.report_channels();
    }

    fn report_channels(&self) {
        if let Some(metrics) = &self.metrics {
            metrics.set_agent_channels(self.channels.len());
        }
    }
}

/// The full chain of a transport error (tonic's top-level message is just "transport error").
pub fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![error.to_string()];
    let mut source = error.source();
    while let Some(e) = source {
        let text = e.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
        source = e.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_ceiling_doubles_up_to_the_cap() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_millis(700),
            attempts: 10,
        };
        let ceilings: Vec<u128> = (0..5).map(|a| b.ceiling(a).as_millis()).collect();
        assert_eq!(ceilings, [100, 200, 400, 700, 700]);
        // No overflow for absurd attempt numbers.
        assert_eq!(b.ceiling(u32::MAX), Duration::from_millis(700));
    }

    #[test]
    fn backoff_delays_are_spread_over_the_whole_window() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(10),
            attempts: 3,
        };
        let mut rng = fastrand::Rng::with_seed(7);
        let delays: Vec<Duration> = (0..2000).map(|_| b.delay(2, &mut rng)).collect();
        let ceiling = b.ceiling(2);
        assert!(delays.iter().all(|d| *d <= ceiling), "{delays:?}");
        // Full jitter: about uniform over [0, 400 ms]; each quarter gets a fair share.
        let quarter = ceiling / 4;
        for q in 0..4u32 {
            let (lo, hi) = (quarter * q, quarter * (q + 1));
            let n = delays.iter().filter(|d| **d >= lo && **d < hi).count();
            assert!((350..650).contains(&n), "quarter {q} got {n} of 2000");
        }
        // Two nodes with different random streams do not retry in lock-step.
        let mut other = fastrand::Rng::with_seed(8);
        let theirs: Vec<Duration> = (0..20).map(|_| b.delay(0, &mut other)).collect();
        let mut rng = fastrand::Rng::with_seed(7);
        let ours: Vec<Duration> = (0..20).map(|_| b.delay(0, &mut rng)).collect();
        assert_ne!(ours, theirs);
    }

    fn lazy_channel(address: &str) -> Channel {
        Endpoint::from_shared(format!("http://{address}"))
            .unwrap()
            .connect_lazy()
    }

    #[tokio::test]
    async fn cache_reuses_and_replaces_on_a_new_address_or_certificate() {
        let cache = ChannelCache::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(60);
        assert!(cache.get("n1", "10.0.0.1:7070", 0, t0, ttl).is_none());
        cache.insert("n1", "10.0.0.1:7070", 0, lazy_channel("10.0.0.1:7070"), t0);
        cache.insert("n2", "10.0.0.2:7070", 0, lazy_channel("10.0.0.2:7070"), t0);
        assert!(cache.get("n1", "10.0.0.1:7070", 0, t0, ttl).is_some());
        assert_eq!(cache.len(), 2);
        // The agent of n1 moved: the old channel goes.
        assert!(cache.get("n1", "10.0.0.9:7070", 0, t0, ttl).is_none());
        assert_eq!(cache.len(), 1);
        // A renewed client certificate replaces n2's channel.
        assert!(cache.get("n2", "10.0.0.2:7070", 1, t0, ttl).is_none());
        assert!(cache.is_empty());
    }

    #[tokio::test]
    async fn a_full_cache_keeps_its_channels_and_passes_new_ones_through() {
        let cache = ChannelCache::with_capacity(2);
        let ttl = Duration::from_secs(60);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(cache.insert(
            "n1",
            "10.0.0.1:7070",
            0,
            lazy_channel("10.0.0.1:7070"),
            at(0)
        ));
        assert!(cache.insert(
            "n2",
            "10.0.0.2:7070",
            0,
            lazy_channel("10.0.0.2:7070"),
            at(1)
        ));
        // Full: n3 is not cached, and neither n1 nor n2 is dropped for it.
        assert!(!cache.insert(
            "n3",
            "10.0.0.3:7070",
            0,
            lazy_channel("10.0.0.3:7070"),
            at(2)
        ));
        assert_eq!(cache.len(), 2);
        assert!(cache.get("n3", "10.0.0.3:7070", 0, at(3), ttl).is_none());
        assert!(cache.get("n1", "10.0.0.1:7070", 0, at(3), ttl).is_some());
        assert!(cache.get("n2", "10.0.0.2:7070", 0, at(3), ttl).is_some());
        // A cached node's channel is replaced in place, full or not.
        assert!(cache.insert(
            "n1",
            "10.0.0.1:7070",
            1,
            lazy_channel("10.0.0.1:7070"),
            at(4)
        ));
        // Once an entry leaves (a connection error here), there is room again.
        assert!(cache.evict("n2", "10.0.0.2:7070"));
        assert!(cache.insert(
            "n3",
            "10.0.0.3:7070",
            0,
            lazy_channel("10.0.0.3:7070"),
            at(5)
        ));
        assert!(cache.get("n3", "10.0.0.3:7070", 0, at(6), ttl).is_some());
    }

    #[tokio::test]
    async fn cache_evicts_on_error_and_when_idle() {
        let cache = ChannelCache::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(60);
        cache.insert("n1", "10.0.0.1:7070", 0, lazy_channel("10.0.0.1:7070"), t0);
        cache.insert("n2", "10.0.0.2:7070", 0, lazy_channel("10.0.0.2:7070"), t0);
        // An eviction for an address the node no longer has leaves the new channel alone.
        assert!(!cache.evict("n1", "10.0.0.7:7070"));
        assert!(cache.evict("n1", "10.0.0.1:7070"));
        assert!(cache.get("n1", "10.0.0.1:7070", 0, t0, ttl).is_none());
        // n2 used at t0 + 50 s stays until 60 s after that use.
        let t1 = t0 + Duration::from_secs(50);
        assert!(cache.get("n2", "10.0.0.2:7070", 0, t1, ttl).is_some());
        assert!(
            cache
                .get("n2", "10.0.0.2:7070", 0, t1 + Duration::from_secs(59), ttl)
                .is_some()
        );
        let later = t1 + Duration::from_secs(59) + Duration::from_secs(61);
        assert!(cache.get("n3", "10.0.0.3:7070", 0, later, ttl).is_none());
        assert!(cache.is_empty(), "idle entries are dropped on access");
    }
}
