//! The operator's view of the fleet for sampling: in-memory caches (reflectors) of pods,
//! namespaces, ProfileRequests and their ProfileResultSlices, kept small by dropping the
//! fields sampling never reads, and the eligibility rules of a policy's pods.
//!
//! Slices are cached with only each node's name and phase (no pods, messages or
//! artifacts): the budget needs to know which nodes a Running request still captures on.
//!
//! Pods are cached cluster-wide as [`SlimPod`]s (name, namespace, UID, labels, node, phase,
//! IP, readiness and gRPC port), read straight from the watch's JSON. The same cache serves
//! agent discovery (`pods::agents`). Heap per pod: `cargo bench -p
//! flamefleet-operator --bench fleet_selection` (docs/benchmarks.md).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use flamefleet_api::{NodeStatus, ProfileRequest, ProfileResultSlice, SamplingPolicy};
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::Api;
use kube::core::{PartialObjectMeta, Selector, SelectorExt};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};

use super::rotation::{Candidate, position, sort};
use crate::pods::agents;
use crate::pods::slim::SlimPod;
use crate::{Error, Result};
use flamefleet_api::policy_runs::POLICY_UID_LABEL;

/// Which namespaces a policy samples.
#[derive(Debug, Clone)]
pub enum Scope {
    /// One namespace (a SamplingPolicy's own).
    Namespace(String),
    /// The namespaces matching a selector (a ClusterSamplingPolicy); all when `None`.
    Cluster(Option<Selector>),
}

/// The names of the cached pods by namespace, kept beside the pod cache from the same watch
/// events, so that a policy reads its own namespace's pods without walking the cluster's.
#[derive(Debug, Default, Clone)]
pub struct PodIndex {
    inner: Arc<Mutex<IndexState>>,
}

#[derive(Debug, Default)]
struct IndexState {
    live: HashMap<String, BTreeSet<String>>,
    /// A relist in progress (replaces `live` when it ends, as the pod cache does).
    relist: Option<HashMap<String, BTreeSet<String>>>,
}

fn key_of(pod: &SlimPod) -> Option<(String, String)> {
    Some((pod.metadata.namespace.clone()?, pod.metadata.name.clone()?))
}

impl PodIndex {
    /// Follows one watch event.
    pub fn apply(&self, event: &watcher::Event<SlimPod>) {
        let mut state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match event {
            watcher::Event::Init => state.relist = Some(HashMap::new()),
            watcher::Event::InitApply(pod) => {
                if let (Some((ns, name)), Some(relist)) = (key_of(pod), state.relist.as_mut()) {
                    relist.entry(ns).or_default().insert(name);
                }
            }
            watcher::Event::InitDone => {
                if let Some(relist) = state.relist.take() {
                    state.live = relist;
                }
            }
            watcher::Event::Apply(pod) => {
                if let Some((ns, name)) = key_of(pod) {
                    state.live.entry(ns).or_default().insert(name);
                }
            }
            watcher::Event::Delete(pod) => {
                if let Some((ns, name)) = key_of(pod)
                    && let Some(names) = state.live.get_mut(&ns)
                {
                    names.remove(&name);
                    if names.is_empty() {
                        state.live.remove(&ns);
                    }
                }
            }
        }
    }

    /// Names of the pods of `namespace`.
    pub fn names(&self, namespace: &str) -> Vec<String> {
        let state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        state
            .live
            .get(namespace)
            .map(|names| names.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// The caches sampling reads.
#[derive(Clone)]
pub struct Fleet {
    /// Pods, cluster-wide, slimmed.
    pub pods: Store<SlimPod>,
    /// The pods' names by namespace.
    pub pod_index: PodIndex,
    /// SamplingPolicies, metadata only (the per-namespace cap counts them).
    pub policies: Store<PartialObjectMeta<SamplingPolicy>>,
    /// Namespaces (labels and `flamefleet.dev/` annotations only).
    pub namespaces: Store<Namespace>,
    /// ProfileRequests, cluster-wide (ad hoc and runs: the budget counts them all).
    pub requests: Store<ProfileRequest>,
    /// ProfileResultSlices, cluster-wide, slimmed to node names and phases.
    pub results: Store<ProfileResultSlice>,
    /// Namespace of the agent pods.
    pub agent_namespace: String,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("pods", &self.pods.state().len())
            .field("requests", &self.requests.state().len())
            .finish_non_exhaustive()
    }
}

/// Keeps only what the budget reads of a result slice: the request's UID and each node's
/// name and phase.
pub fn slim_slice(slice: &mut ProfileResultSlice) {
    slice.metadata.managed_fields = None;
    slice.metadata.annotations = None;
    slice.metadata.owner_references = None;
    for node in &mut slice.spec.nodes {
        *node = NodeStatus {
            node: std::mem::take(&mut node.node),
            phase: node.phase,
            ..Default::default()
        };
    }
}

/// Keeps only the labels of a namespace and its `flamefleet.dev/` annotations (the cluster
/// admin's per-namespace overrides).
fn slim_namespace(ns: &mut Namespace) {
    ns.metadata.managed_fields = None;
    if let Some(annotations) = ns.metadata.annotations.as_mut() {
        annotations.retain(|k, _| k.starts_with("flamefleet.dev/"));
    }
    ns.spec = None;
    ns.status = None;
}

impl Fleet {
    /// Starts the reflectors; the returned future drives them (spawn it) and the caches are
    /// usable once [`Fleet::ready`] returns.
    pub fn start(
        client: &kube::Client,
        agent_namespace: &str,
    ) -> (Self, impl std::future::Future<Output = ()> + Send + 'static) {
        let (pods, pods_writer) = reflector::store();
        let (namespaces, ns_writer) = reflector::store();
        let (requests, requests_writer) = reflector::store();
        let (results, results_writer) = reflector::store();
        let (policies, policies_writer) = reflector::store();
        let pod_index = PodIndex::default();
        let index = pod_index.clone();
        let pod_stream = watcher(
            Api::<SlimPod>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(pods_writer)
        .for_each(move |event| {
            if let Ok(event) = event {
                index.apply(&event);
            }
            futures::future::ready(())
        });
        let policy_stream = watcher(
            Api::<PartialObjectMeta<SamplingPolicy>>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(|p: &mut PartialObjectMeta<SamplingPolicy>| p.metadata.managed_fields = None)
        .reflect(policies_writer)
        .for_each(|_| futures::future::ready(()));
        let ns_stream = watcher(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(slim_namespace)
        .reflect(ns_writer)
        .for_each(|_| futures::future::ready(()));
        let request_stream = watcher(
            Api::<ProfileRequest>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(|r: &mut ProfileRequest| r.metadata.managed_fields = None)
        .reflect(requests_writer)
        .for_each(|_| futures::future::ready(()));
        let results_stream = watcher(
            Api::<ProfileResultSlice>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(slim_slice)
        .reflect(results_writer)
        .for_each(|_| futures::future::ready(()));
        let driver = async move {
            futures::join!(
                pod_stream,
                ns_stream,
                request_stream,
                results_stream,
                policy_stream
            );
        }
        .boxed();
        (
            Self {
                pods,
                pod_index,
                policies,
                namespaces,
                requests,
                results,
                agent_namespace: agent_namespace.to_string(),
            },
            driver,
        )
    }

    /// Waits until every cache has its first full list.
    pub async fn ready(&self) -> Result<()> {
        let closed = |_| Error::Sampling("a sampling cache stopped before its first list".into());
        self.pods.wait_until_ready().await.map_err(closed)?;
        self.namespaces.wait_until_ready().await.map_err(closed)?;
        self.requests.wait_until_ready().await.map_err(closed)?;
        self.results.wait_until_ready().await.map_err(closed)?;
        self.policies.wait_until_ready().await.map_err(closed)?;
        Ok(())
    }

    /// The cached pods of `namespace`.
    pub fn pods_in(&self, namespace: &str) -> Vec<Arc<SlimPod>> {
        self.pod_index
            .names(namespace)
            .into_iter()
            .filter_map(|name| self.pods.get(&ObjectRef::new(&name).within(namespace)))
            .collect()
    }

    /// The cached pods of the namespaces in `scope`.
    fn pods_in_scope(&self, scope: &Scope) -> Vec<Arc<SlimPod>> {
        match self.namespaces_in(scope) {
            Some(namespaces) => namespaces.iter().flat_map(|ns| self.pods_in(ns)).collect(),
            None => self.pods.state(),
        }
    }

    /// Nodes that have a Running agent pod with an IP.
    pub fn agent_nodes(&self) -> BTreeSet<String> {
        let (key, value) = crate::pods::AGENT_LABEL
            .split_once('=')
            .unwrap_or((crate::pods::AGENT_LABEL, ""));
        let pods = self.pods_in(&self.agent_namespace);
        agents::agents_by_node(
            pods.iter()
                .map(AsRef::as_ref)
                .filter(|p| p.label(key) == Some(value)),
        )
        .into_keys()
        .collect()
    }

    /// The SamplingPolicies of `namespace`, oldest first (creation time, then name).
    pub fn policies_in(&self, namespace: &str) -> Vec<(Option<jiff::Timestamp>, String)> {
        let mut out: Vec<(Option<jiff::Timestamp>, String)> = self
            .policies
            .state()
            .iter()
            .filter(|p| p.metadata.namespace.as_deref() == Some(namespace))
            .map(|p| {
                (
                    p.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    p.metadata.name.clone().unwrap_or_default(),
                )
            })
            .collect();
        out.sort();
        out
    }

    /// Requests waiting to start (no phase yet, or Pending), by namespace.
    pub fn queued_by_namespace(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        for r in self.requests.state() {
            let phase = r.status.as_ref().and_then(|s| s.phase);
            if matches!(phase, None | Some(flamefleet_api::RequestPhase::Pending))
                && r.metadata.deletion_timestamp.is_none()
            {
                *out.entry(r.metadata.namespace.clone().unwrap_or_default())
                    .or_default() += 1;
            }
        }
        out
    }

    /// The ProfileRequests created by the policy with `uid`.
    pub fn runs_of(&self, uid: &str) -> Vec<Arc<ProfileRequest>> {
        self.requests.state_filter(|r| {
            r.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(POLICY_UID_LABEL))
                .is_some_and(|v| v == uid)
        })
    }

    /// Namespaces in `scope` (`None`: every namespace).
    pub fn namespaces_in(&self, scope: &Scope) -> Option<BTreeSet<String>> {
        match scope {
            Scope::Namespace(ns) => Some(BTreeSet::from([ns.clone()])),
            Scope::Cluster(None) => None,
            Scope::Cluster(Some(selector)) => Some(
                self.namespaces
                    .state()
                    .iter()
                    .filter(|ns| selector.matches(&ns.metadata.labels.clone().unwrap_or_default()))
                    .filter_map(|ns| ns.metadata.name.clone())
                    .collect(),
            ),
        }
    }

    /// The pods a policy may sample, in its rotation order.
    pub fn eligible(
        &self,
        policy_uid: &str,
        scope: &Scope,
        selector: Option<&Selector>,
        pod_names: &[String],
    ) -> Eligibility {
        let agents = self.agent_nodes();
        let mut out = Eligibility::default();
        for pod in self.pods_in_scope(scope) {
            let meta = &pod.metadata;
            let Some(ns) = meta.namespace.as_deref() else {
                continue;
            };
            let name = meta.name.as_deref().unwrap_or_default();
            let by_selector = selector.is_some_and(|s| match meta.labels.as_ref() {
                Some(labels) => s.matches(labels),
                None => s.matches(&BTreeMap::new()),
            });
            if !(by_selector || pod_names.iter().any(|n| n == name)) {
                continue;
            }
            let name = name.to_string();
            out.matched += 1;
            if meta.deletion_timestamp.is_some() {
                out.not_eligible(ns, &name, "being deleted".into());
                continue;
            }
            let phase = pod.phase.as_deref().unwrap_or("Unknown");
            if phase != "Running" {
                out.not_eligible(ns, &name, format!("phase is {phase}, expected Running"));
                continue;
            }
            let Some(node) = pod.node.clone() else {
                out.not_eligible(ns, &name, "not scheduled on a node".into());
                continue;
            };
            if !agents.contains(&node) {
                out.not_eligible(
                    ns,
                    &name,
                    format!("node {node} has no Running Flamefleet agent"),
                );
                continue;
            }
            let uid = meta.uid.clone().unwrap_or_default();
            out.candidates.push(Candidate {
                position: position(policy_uid, &uid),
                uid,
                namespace: ns.to_string(),
                name,
                node,
            });
        }
        sort(&mut out.candidates);
        out
    }
}

/// The pods a policy may sample now.
#[derive(Debug, Default, Clone)]
pub struct Eligibility {
    /// Eligible pods, in rotation order.
    pub candidates: Vec<Candidate>,
    /// Pods the selector matched, eligible or not.
    pub matched: usize,
    /// Up to ten matched pods that are not eligible, with why.
    pub reasons: Vec<String>,
}

impl Eligibility {
    fn not_eligible(&mut self, ns: &str, name: &str, why: String) {
        if self.reasons.len() < 10 {
            self.reasons.push(format!("{ns}/{name}: {why}"));
        }
    }

    /// Distinct nodes of the eligible pods.
    pub fn node_count(&self) -> usize {
        self.candidates
            .iter()
            .map(|c| c.node.as_str())
            .collect::<BTreeSet<_>>()
            .len()
    }

    /// Why nothing can be sampled, for the `PodsMatched` condition.
    pub fn nothing_message(&self, what: &str) -> String {
        if self.matched == 0 {
            format!("no pods match {what}; check the template's selector and labels")
        } else {
            format!(
                "{} pods match {what} but none is Running on a node with an agent: {}",
                self.matched,
                self.reasons.join("; ")
            )
        }
    }
}

/// A policy's label selector as a `Selector`.
pub fn selector_of(selector: Option<&LabelSelector>) -> Result<Option<Selector>> {
    selector
        .cloned()
        .map(Selector::try_from)
        .transpose()
        .map_err(|e| Error::Selector(e.to_string()))
}

/// Counts per node of the candidates (for messages and tests).
pub fn pods_per_node(candidates: &[Candidate]) -> BTreeMap<&str, usize> {
    let mut out = BTreeMap::new();
    for c in candidates {
        *out.entry(c.node.as_str()).or_default() += 1;
    }
    out
}
