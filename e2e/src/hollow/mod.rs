//! Hollow agents: thousands of Flamefleet agents in one process, each the real agent's
//! service shell (`flamefleet_agent::service`: the `AgentService`, its captures table and
//! progress, its uploads, its mutual TLS) around an engine that captures nothing
//! ([`engine`]).
//!
//! **A load generator for the operator and the API server, never a substitute for the real
//! agent in functional tests.** A hollow capture measures nothing: it waits the requested
//! duration and uploads a small synthetic pprof. What is real is everything the operator
//! sees: each hollow node listens on its own loopback address (Linux routes all of
//! 127.0.0.0/8 to `lo`: 127.A.B.C:port, one per node) and serves its own certificate from
//! the CA the operator trusts, naming the node with `agent_dns_name` (so the operator's
//! per-node identity check runs for real); only the operator's client certificate is
//! accepted; `Capture` streams the real agent's stages and is idempotent per request UID;
//! artifacts go to the signed upload URL with a PUT carrying their sha256, by the real
//! agent's uploader; DONE carries the artifacts (name, size, sha256, samples, sample type)
//! and the summary of the real agent.
//!
//! A failure mix is configurable: a fraction of the nodes fails every capture (FAILED with
//! a reason, right after ACCEPTED) and a fraction never answers (the stream stays open,
//! without a message, until the operator cancels). Which nodes do what is drawn once from a
//! seed, exactly `round(fraction * nodes)` of each ([`HollowFleet::nodes`] says).
//!
//! File descriptors: one listening socket per node plus one per operator connection, and
//! the uploads' connections (bounded by [`HollowConfig::max_concurrent_uploads`], which
//! real agents, one per node, do not have: one process uploading for 5,000 nodes at once
//! would otherwise open 5,000 connections to the store).

pub mod cluster;
mod compromised;
mod engine;
pub mod profile;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flamefleet_agent::service::reporter::{CallOutcome, Outcome, Reporter, Rpc};
use flamefleet_agent::service::upload::{UploadPolicy, Uploader};
use flamefleet_agent::service::{Agent, Context, ServingIdentity, TlsMaterial, serve_service};
use flamefleet_proto::agent::{CaptureSummary, TriggerFired};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::agent_pki::AgentPki;
use compromised::WatchScript;
use engine::HollowEngine;

/// Errors of starting a hollow fleet.
#[derive(Debug, thiserror::Error)]
pub enum HollowError {
    /// A node's certificate could not be issued.
    #[error("issuing the certificate of hollow node {node}: {source}")]
    Certificate {
        /// The node.
        node: String,
        /// The PKI's error.
        source: crate::Error,
    },
    /// A certificate or key could not be read back.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// TLS material is unusable.
    #[error("hollow agent TLS: {0}")]
    Tls(String),
    /// A node's address could not be bound.
    #[error(
        "binding hollow node {node} on {addr}: {source}; is the port used on 0.0.0.0 or by another fleet? pick another port or first address"
    )]
    Bind {
        /// The node.
        node: String,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The fleet does not fit in 127.0.0.0/8 from the first address.
    #[error("{nodes} hollow nodes from {first} leave 127.0.0.0/8; pick a lower first address")]
    Addresses {
        /// Nodes asked for.
        nodes: usize,
        /// The first address.
        first: Ipv4Addr,
    },
    /// The upload client could not be built.
    #[error("building the upload client: {0}")]
    Client(flamefleet_agent::service::upload::UploadError),
    /// A fraction is outside 0..=1 or they add up to more than 1.
    #[error(
        "failure fractions must be within 0..=1 and add up to at most 1, found fail {fail} and silent {silent}"
    )]
    Fractions {
        /// Failing fraction.
        fail: f64,
        /// Silent fraction.
        silent: f64,
    },
}

/// What a hollow node does with a capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Behaviour {
    /// Streams every stage, uploads, reports DONE.
    Succeed,
    /// Reports FAILED right after ACCEPTED.
    Fail,
    /// Never answers: the stream stays open until the capture is cancelled.
    Silent,
    /// Accepts, then forgets the capture halfway through its window, as an agent that
    /// restarted would: its stream ends without a result and `Collect` answers NOT_FOUND.
    Forget,
    /// A compromised node: captures and uploads like [`Behaviour::Succeed`], then reports
    /// DONE with every free-text field as large as a gRPC message allows (see
    /// `compromised.rs`): what the operator records from it must stay bounded.
    Oversized,
}

impl Behaviour {
    fn code(self) -> u8 {
        match self {
            Self::Succeed => 0,
            Self::Fail => 1,
            Self::Silent => 2,
            Self::Forget => 3,
            Self::Oversized => 4,
        }
    }

    fn from_code(code: u8) -> Self {
        match code {
            1 => Self::Fail,
            2 => Self::Silent,
            3 => Self::Forget,
            4 => Self::Oversized,
            _ => Self::Succeed,
        }
    }
}

/// A node's behaviour, changeable between requests ([`HollowFleet::set_mix`]); a capture
/// keeps the behaviour it started with.
#[derive(Debug, Default)]
pub struct BehaviourCell(std::sync::atomic::AtomicU8);

impl BehaviourCell {
    fn new(b: Behaviour) -> Self {
        Self(std::sync::atomic::AtomicU8::new(b.code()))
    }

    /// The current behaviour.
    pub fn get(&self) -> Behaviour {
        Behaviour::from_code(self.0.load(Ordering::Relaxed))
    }

    fn set(&self, b: Behaviour) {
        self.0.store(b.code(), Ordering::Relaxed);
    }
}

/// Settings of a hollow fleet.
#[derive(Debug, Clone)]
pub struct HollowConfig {
    /// Number of nodes.
    pub nodes: usize,
    /// Node names are `<prefix>-<index>` (index from 0, zero-padded to 5 digits).
    pub node_prefix: String,
    /// Address of node 0; the next nodes count up, skipping host parts .0 and .255. Must
    /// be in 127.0.0.0/8.
    pub first_address: Ipv4Addr,
    /// The port every node listens on (each on its own address).
    pub port: u16,
    /// Fraction of nodes that fail every capture.
    pub fail_fraction: f64,
    /// Fraction of nodes that never answer.
    pub silent_fraction: f64,
    /// How often RUNNING progress is sent (the real agent: every second).
    pub progress_period: Duration,
    /// The store's CA (for an `https` store), trusted for uploads.
    pub store_ca_pem: Option<Vec<u8>>,
    /// Uploads in flight at once, over the whole fleet.
    pub max_concurrent_uploads: usize,
    /// Seed of the draw of failing and silent nodes.
    pub seed: u64,
}

impl Default for HollowConfig {
    fn default() -> Self {
        Self {
            nodes: 100,
            node_prefix: "hollow".into(),
            first_address: Ipv4Addr::new(127, 64, 0, 1),
            port: 17070,
            fail_fraction: 0.0,
            silent_fraction: 0.0,
            progress_period: Duration::from_secs(1),
            store_ca_pem: None,
            max_concurrent_uploads: 256,
            seed: 1,
        }
    }
}

/// Counters over the whole fleet.
#[derive(Debug, Default)]
pub struct Stats {
    /// Captures started (first call of a UID on a node).
    pub captures: AtomicU64,
    /// Calls that attached to a running capture.
    pub attached: AtomicU64,
    /// Calls that got a finished capture's result replayed.
    pub replayed: AtomicU64,
    /// `Collect` calls (each also counts as attached or replayed, or as unknown).
    pub collects: AtomicU64,
    /// `Collect` calls for a UID the node does not know (answered NOT_FOUND).
    pub collects_unknown: AtomicU64,
    /// Captures forgotten mid-window ([`Behaviour::Forget`]).
    pub forgotten: AtomicU64,
    /// Captures that ended DONE.
    pub done: AtomicU64,
    /// Captures that ended FAILED (injected, cancelled, or an upload refused).
    pub failed: AtomicU64,
    /// Captures ended by Cancel.
    pub cancelled: AtomicU64,
    /// Cancel calls received.
    pub cancel_calls: AtomicU64,
    /// Artifacts uploaded.
    pub uploads: AtomicU64,
    /// Uploads that failed.
    pub upload_errors: AtomicU64,
}

/// A copy of [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// See [`Stats::captures`].
    pub captures: u64,
    /// See [`Stats::attached`].
    pub attached: u64,
    /// See [`Stats::replayed`].
    pub replayed: u64,
    /// See [`Stats::collects`].
    pub collects: u64,
    /// See [`Stats::collects_unknown`].
    pub collects_unknown: u64,
    /// See [`Stats::forgotten`].
    pub forgotten: u64,
    /// See [`Stats::done`].
    pub done: u64,
    /// See [`Stats::failed`].
    pub failed: u64,
    /// See [`Stats::cancelled`].
    pub cancelled: u64,
    /// See [`Stats::cancel_calls`].
    pub cancel_calls: u64,
    /// See [`Stats::uploads`].
    pub uploads: u64,
    /// See [`Stats::upload_errors`].
    pub upload_errors: u64,
}

impl Stats {
    fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            captures: get(&self.captures),
            attached: get(&self.attached),
            replayed: get(&self.replayed),
            collects: get(&self.collects),
            collects_unknown: get(&self.collects_unknown),
            forgotten: get(&self.forgotten),
            done: get(&self.done),
            failed: get(&self.failed),
            cancelled: get(&self.cancelled),
            cancel_calls: get(&self.cancel_calls),
            uploads: get(&self.uploads),
            upload_errors: get(&self.upload_errors),
        }
    }
}

/// The fleet's counters, from the events of every node's service.
impl Reporter for Stats {
    fn call(&self, rpc: Rpc, outcome: CallOutcome) {
        let add = |c: &AtomicU64| c.fetch_add(1, Ordering::Relaxed);
        if rpc == Rpc::Collect {
            add(&self.collects);
        }
        match outcome {
            CallOutcome::Started => add(&self.captures),
            CallOutcome::Attached => add(&self.attached),
            CallOutcome::Replayed => add(&self.replayed),
            CallOutcome::Unknown => add(&self.collects_unknown),
        };
    }

    fn cancel_called(&self, _found: bool) {
        self.cancel_calls.fetch_add(1, Ordering::Relaxed);
    }

    fn uploaded(&self, _bytes: usize) {
        self.uploads.fetch_add(1, Ordering::Relaxed);
    }

    fn upload_failed(&self) {
        self.upload_errors.fetch_add(1, Ordering::Relaxed);
    }

    fn capture_finished(&self, _type: &'static str, outcome: Outcome, _: Option<&CaptureSummary>) {
        match outcome {
            Outcome::Succeeded => self.done.fetch_add(1, Ordering::Relaxed),
            Outcome::Failed | Outcome::Abandoned => self.failed.fetch_add(1, Ordering::Relaxed),
            // A cancelled capture ends FAILED ("cancelled by the client").
            Outcome::Cancelled => {
                self.cancelled.fetch_add(1, Ordering::Relaxed);
                self.failed.fetch_add(1, Ordering::Relaxed)
            }
        };
    }

    fn capture_forgotten(&self) {
        self.forgotten.fetch_add(1, Ordering::Relaxed);
    }
}

/// One hollow node.
#[derive(Debug, Clone)]
pub struct HollowNode {
    /// Node name.
    pub name: String,
    /// Where it listens.
    pub address: SocketAddrV4,
    /// What it does with captures.
    pub behaviour: Behaviour,
}

struct NodeEntry {
    name: String,
    address: SocketAddrV4,
    behaviour: Arc<BehaviourCell>,
    watch_script: Arc<WatchScript>,
}

impl std::fmt::Debug for NodeEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// A running hollow fleet; stops (every listener and capture) when dropped.
#[derive(Debug)]
pub struct HollowFleet {
    nodes: Vec<NodeEntry>,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
    servers: Vec<JoinHandle<()>>,
}

impl Drop for HollowFleet {
    fn drop(&mut self) {
        self.shutdown.cancel();
        for s in &self.servers {
            s.abort();
        }
    }
}

/// The addresses of `n` nodes from `first`: counting up, skipping host parts .0 and .255
/// (pure).
///
/// # Errors
/// [`HollowError::Addresses`] when they leave 127.0.0.0/8.
pub fn addresses(first: Ipv4Addr, n: usize) -> Result<Vec<Ipv4Addr>, HollowError> {
    let mut out = Vec::with_capacity(n);
    let mut next = u32::from(first);
    while out.len() < n {
        let addr = Ipv4Addr::from(next);
        if addr.octets()[0] != 127 {
            return Err(HollowError::Addresses { nodes: n, first });
        }
        if !matches!(addr.octets()[3], 0 | 255) {
            out.push(addr);
        }
        next = next
            .checked_add(1)
            .ok_or(HollowError::Addresses { nodes: n, first })?;
    }
    Ok(out)
}

/// The behaviour of each of `n` nodes: exactly `round(fail * n)` fail and
/// `round(silent * n)` stay silent, picked by a shuffle seeded with `seed` (pure).
///
/// # Errors
/// [`HollowError::Fractions`] for fractions outside 0..=1 or adding up to more than 1.
pub fn behaviours(
    n: usize,
    fail: f64,
    silent: f64,
    seed: u64,
) -> Result<Vec<Behaviour>, HollowError> {
    let valid = |f: f64| (0.0..=1.0).contains(&f);
    if !valid(fail) || !valid(silent) || fail + silent > 1.0 {
        return Err(HollowError::Fractions { fail, silent });
    }
    let failing = (fail * n as f64).round() as usize;
    let silent = ((silent * n as f64).round() as usize).min(n - failing.min(n));
    let mut order: Vec<usize> = (0..n).collect();
    fastrand::Rng::with_seed(seed).shuffle(&mut order);
    let mut out = vec![Behaviour::Succeed; n];
    for (rank, i) in order.into_iter().enumerate() {
        if rank < failing {
            out[i] = Behaviour::Fail;
        } else if rank < failing + silent {
            out[i] = Behaviour::Silent;
        }
    }
    Ok(out)
}

impl HollowFleet {
    /// Issues every node's certificate from `pki`, binds every node's address and starts
    /// serving.
    ///
    /// # Errors
    /// See [`HollowError`]; nothing keeps running on error.
    pub async fn start(pki: &AgentPki, config: HollowConfig) -> Result<Self, HollowError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let addresses = addresses(config.first_address, config.nodes)?;
        let behaviours = behaviours(
            config.nodes,
            config.fail_fraction,
            config.silent_fraction,
            config.seed,
        )?;
        let ca_pem = std::fs::read(&pki.files.ca_cert).map_err(|source| HollowError::Read {
            path: pki.files.ca_cert.clone(),
            source,
        })?;
        // One connection pool and one bound on uploads in flight for the whole fleet (real
        // agents, one per node, need no bound: one process uploading for 5,000 nodes at once
        // would otherwise open 5,000 connections to the store).
        let uploader = Uploader::trusting(
            UploadPolicy {
                idle_connections_per_host: Some(config.max_concurrent_uploads),
                ..UploadPolicy::default()
            },
            config.store_ca_pem.as_deref(),
        )
        .map_err(HollowError::Client)?;
        let upload_permits = Arc::new(tokio::sync::Semaphore::new(
            config.max_concurrent_uploads.max(1),
        ));
        let mut fleet = Self {
            nodes: Vec::with_capacity(config.nodes),
            stats: Arc::new(Stats::default()),
            shutdown: CancellationToken::new(),
            servers: Vec::with_capacity(config.nodes),
        };
        for (i, (ip, behaviour)) in addresses.into_iter().zip(behaviours).enumerate() {
            let name = format!("{}-{i:05}", config.node_prefix);
            let (cert, key) =
                pki.issue_agent(&name)
                    .map_err(|source| HollowError::Certificate {
                        node: name.clone(),
                        source,
                    })?;
            let read = |path: &std::path::Path| {
                std::fs::read(path).map_err(|source| HollowError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            };
            let identity = ServingIdentity::new(&TlsMaterial {
                chain_pem: read(&cert)?,
                key_pem: read(&key)?,
                ca_pem: ca_pem.clone(),
            })
            .map_err(|e| HollowError::Tls(e.to_string()))?;
            // The PEM files are no longer needed: the fleet holds the keys in memory.
            let _ = std::fs::remove_file(&cert);
            let _ = std::fs::remove_file(&key);
            let address = SocketAddrV4::new(ip, config.port);
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .map_err(|source| HollowError::Bind {
                    node: name.clone(),
                    addr: address.into(),
                    source,
                })?;
            let behaviour = Arc::new(BehaviourCell::new(behaviour));
            let agent = Agent::with_engine(Context {
                node: name.clone(),
                engine: Arc::new(HollowEngine::new(&name, behaviour.clone())),
                uploader: uploader.clone(),
                upload_permits: Some(Arc::clone(&upload_permits)),
                reporter: fleet.stats.clone(),
                progress_period: config.progress_period.max(Duration::from_millis(10)),
                shutdown: fleet.shutdown.clone(),
            });
            let watch_script = Arc::new(WatchScript::default());
            let service = compromised::NodeService {
                agent,
                behaviour: behaviour.clone(),
                watch_script: Arc::clone(&watch_script),
            };
            // The service's own shutdown token is the fleet's: serving ends with it.
            let shutdown = fleet.shutdown.clone();
            fleet.servers.push(tokio::spawn(async move {
                let _ = serve_service(
                    service,
                    listener,
                    identity.server_config(),
                    shutdown.cancelled_owned(),
                )
                .await;
            }));
            fleet.nodes.push(NodeEntry {
                name,
                address,
                behaviour,
                watch_script,
            });
        }
        Ok(fleet)
    }

    /// The nodes, in index order, with their current behaviour.
    pub fn nodes(&self) -> Vec<HollowNode> {
        self.nodes
            .iter()
            .map(|n| HollowNode {
                name: n.name.clone(),
                address: n.address,
                behaviour: n.behaviour.get(),
            })
            .collect()
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True for a fleet of no node.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Number of nodes that behave as `behaviour` now.
    pub fn count(&self, behaviour: Behaviour) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.behaviour.get() == behaviour)
            .count()
    }

    /// Draws the failure mix again (see [`behaviours`]); captures started from now on follow
    /// it, running ones keep theirs.
    ///
    /// # Errors
    /// [`HollowError::Fractions`] for invalid fractions (nothing changes).
    pub fn set_mix(&self, fail: f64, silent: f64, seed: u64) -> Result<(), HollowError> {
        let drawn = behaviours(self.nodes.len(), fail, silent, seed)?;
        for (node, b) in self.nodes.iter().zip(drawn) {
            node.behaviour.set(b);
        }
        Ok(())
    }

    /// Makes up to `count` nodes that would succeed forget their next captures
    /// ([`Behaviour::Forget`]), in node order; returns how many.
    pub fn set_forgetful(&self, count: usize) -> usize {
        let mut set = 0;
        for node in &self.nodes {
            if set == count {
                break;
            }
            if node.behaviour.get() == Behaviour::Succeed {
                node.behaviour.set(Behaviour::Forget);
                set += 1;
            }
        }
        set
    }

    /// Sets the behaviour of node `index` (captures started from now on follow it).
    /// Returns false for an index outside the fleet.
    pub fn set_behaviour(&self, index: usize, behaviour: Behaviour) -> bool {
        self.nodes
            .get(index)
            .map(|n| n.behaviour.set(behaviour))
            .is_some()
    }

    /// Makes node `index` a compromised node on its trigger stream: the next `Watch` the
    /// operator opens to it is answered with an acknowledgement of every pod it was given
    /// and then `fires`, whatever they claim, after which the stream stays open and
    /// silent. Later streams are refused as a hollow node refuses them (no triggers).
    /// Returns false for an index outside the fleet.
    pub fn script_watch(&self, index: usize, fires: Vec<TriggerFired>) -> bool {
        self.nodes
            .get(index)
            .map(|n| n.watch_script.set(fires, false))
            .is_some()
    }

    /// As [`Self::script_watch`], but the fires wait after the acknowledgement until
    /// [`Self::release_watch_script`].
    pub fn script_watch_held(&self, index: usize, fires: Vec<TriggerFired>) -> bool {
        self.nodes
            .get(index)
            .map(|n| n.watch_script.set(fires, true))
            .is_some()
    }

    /// Lets node `index`'s held fires go (see [`Self::script_watch_held`]).
    pub fn release_watch_script(&self, index: usize) -> bool {
        self.nodes
            .get(index)
            .map(|n| n.watch_script.release())
            .is_some()
    }

    /// Whether node `index`'s scripted call was answered (its acknowledgement sent).
    pub fn watch_script_opened(&self, index: usize) -> bool {
        self.nodes
            .get(index)
            .is_some_and(|n| n.watch_script.opened())
    }

    /// Whether node `index`'s scripted fires (see [`Self::script_watch`]) were sent.
    pub fn watch_script_sent(&self, index: usize) -> bool {
        self.nodes.get(index).is_some_and(|n| n.watch_script.sent())
    }

    /// The fleet's counters now.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_skip_network_and_broadcast_host_parts_and_stay_in_loopback() {
        let a = addresses(Ipv4Addr::new(127, 64, 0, 253), 4).unwrap();
        assert_eq!(
            a,
            [
                Ipv4Addr::new(127, 64, 0, 253),
                Ipv4Addr::new(127, 64, 0, 254),
                Ipv4Addr::new(127, 64, 1, 1),
                Ipv4Addr::new(127, 64, 1, 2),
            ]
        );
        assert_eq!(
            addresses(Ipv4Addr::new(127, 0, 0, 1), 5000).unwrap().len(),
            5000
        );
        assert!(addresses(Ipv4Addr::new(127, 255, 255, 250), 10).is_err());
    }

    #[test]
    fn behaviours_are_exact_counts_and_reproducible() {
        let b = behaviours(5000, 0.05, 0.01, 7).unwrap();
        let count = |x| b.iter().filter(|y| **y == x).count();
        assert_eq!(count(Behaviour::Fail), 250);
        assert_eq!(count(Behaviour::Silent), 50);
        assert_eq!(count(Behaviour::Succeed), 4700);
        assert_eq!(b, behaviours(5000, 0.05, 0.01, 7).unwrap());
        assert_ne!(b, behaviours(5000, 0.05, 0.01, 8).unwrap());
        assert!(behaviours(10, 0.7, 0.5, 1).is_err());
        assert!(behaviours(10, -0.1, 0.0, 1).is_err());
    }
}
