//! Per-tenant cost limits, set by the cluster admin: how many captures may run at once in the
//! cluster and in each namespace, the smallest heap sampling interval, the highest CPU
//! sampling frequency and the highest overhead guards of heap and off-CPU captures a request
//! may ask for.
//!
//! Creating ProfileRequests is the only RBAC gate, so without these any tenant allowed to
//! create them could stack captures on shared nodes (each heap capture traps every allocation
//! of the allocator it probes) or ask for `sampleBytes: 1`. A request over a concurrency limit
//! waits (phase Pending, condition `Queued` saying why) until captures finish; a request outside
//! the spec limits fails with the limit and who sets it. Other namespaces are unaffected by one
//! namespace's limit.

use std::collections::{BTreeMap, HashMap};

use flamefleet_api::{ProfileRequest, ProfileRequestSpec, ProfileType, RequestPhase};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::{ObjectRef, Store};

use crate::{Error, Result};

/// Namespace annotation that overrides the per-namespace limit of concurrent captures
/// (namespaces are usually editable by cluster admins only).
pub const NAMESPACE_LIMIT_ANNOTATION: &str = "flamefleet.dev/max-concurrent-captures";

/// The agent's own default `heap.maxOverheadPercent`, and the operator's default ceiling.
pub const DEFAULT_MAX_HEAP_OVERHEAD_PERCENT: u32 = 3;

/// The agent's own default `offcpu.maxOverheadPercent`, and the operator's default ceiling.
pub const DEFAULT_MAX_OFFCPU_OVERHEAD_PERCENT: u32 = 3;

/// The limits, from the operator's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantLimits {
    /// Captures running at once in the whole cluster (0: unlimited).
    pub max_concurrent: u32,
    /// Captures running at once in one namespace (0: unlimited), unless the namespace's
    /// [`NAMESPACE_LIMIT_ANNOTATION`] says otherwise.
    pub max_concurrent_per_namespace: u32,
    /// Smallest `heap.sampleBytes` accepted.
    pub min_heap_sample_bytes: i64,
    /// Highest `cpu.frequencyHz` accepted.
    pub max_cpu_frequency_hz: i32,
    /// Highest `heap.maxOverheadPercent` accepted, and the one sent when a request names
    /// none (0: no ceiling, and a request may turn the guard off with 0). The heap probes
    /// fire in every process that maps the probed allocator, not only the tenant's, so the
    /// cluster admin sets this and a tenant can only ask for less.
    pub max_heap_overhead_percent: u32,
    /// Highest `offcpu.maxOverheadPercent` accepted, and the one sent when a request names
    /// none (0: no ceiling, and a request may turn the guard off with 0). A node has one
    /// off-CPU sampler for all captures: a target's blocks fill the stack and count maps
    /// every other capture on the node shares, and its stack walks run inside context
    /// switches, which the scheduler bills to the task switched in, often another pod's. So
    /// the cluster admin sets this and a tenant can only ask for less.
    pub max_offcpu_overhead_percent: u32,
}

impl Default for TenantLimits {
    fn default() -> Self {
        Self {
            max_concurrent: 100,
            max_concurrent_per_namespace: 10,
            min_heap_sample_bytes: 64 * 1024,
            max_cpu_frequency_hz: 1000,
            max_heap_overhead_percent: DEFAULT_MAX_HEAP_OVERHEAD_PERCENT,
            max_offcpu_overhead_percent: DEFAULT_MAX_OFFCPU_OVERHEAD_PERCENT,
        }
    }
}

/// Checks a spec against the spec limits (pure); the error is the Failed message.
pub fn check_spec(
    spec: &ProfileRequestSpec,
    limits: &TenantLimits,
) -> std::result::Result<(), String> {
    match spec.profile_type {
        ProfileType::Cpu => {
            let hz = spec.frequency_hz();
            if hz > limits.max_cpu_frequency_hz {
                return Err(format!(
                    "cpu.frequencyHz {hz} is above this cluster's limit of {} Hz (set by the cluster admin with the operator's --max-cpu-frequency-hz); ask for less",
                    limits.max_cpu_frequency_hz
                ));
            }
        }
        ProfileType::Heap => {
            if let Some(bytes) = spec.heap_options().sample_bytes
                && bytes < limits.min_heap_sample_bytes
            {
                return Err(format!(
                    "heap.sampleBytes {bytes} is below this cluster's minimum of {} bytes (set by the cluster admin with the operator's --min-heap-sample-bytes): smaller intervals cost every allocation on the node; ask for more",
                    limits.min_heap_sample_bytes
                ));
            }
            check_overhead_guard(
                "heap",
                spec.heap_options().max_overhead_percent,
                limits.max_heap_overhead_percent,
                "the heap probes slow every process on the node that maps the same allocator, not only yours",
            )?;
        }
        ProfileType::Offcpu => check_overhead_guard(
            "offcpu",
            spec.offcpu_options().max_overhead_percent,
            limits.max_offcpu_overhead_percent,
            "the node's one off-CPU sampler walks your pods' stacks inside context switches billed to other pods too, into maps every capture on the node shares",
        )?,
        ProfileType::Runqlat => {}
    }
    Ok(())
}

/// A request's `<kind>.maxOverheadPercent` (`asked`) against the cluster admin's `ceiling`
/// (`--max-<kind>-overhead-percent`; 0: none): above it, or 0 (the guard off) while there is
/// one, fails saying `why` the tenant may not.
fn check_overhead_guard(
    kind: &str,
    asked: Option<i32>,
    ceiling: u32,
    why: &str,
) -> std::result::Result<(), String> {
    let Some(percent) = asked else {
        return Ok(());
    };
    if ceiling == 0 || (percent > 0 && i64::from(percent) <= i64::from(ceiling)) {
        return Ok(());
    }
    let asked = if percent <= 0 {
        format!("{kind}.maxOverheadPercent {percent} (the overhead guard turned off)")
    } else {
        format!("{kind}.maxOverheadPercent {percent}")
    };
    Err(format!(
        "{asked} is above this cluster's ceiling of {ceiling}% (set by the cluster admin with the operator's --max-{kind}-overhead-percent): {why}; ask for {ceiling} or less"
    ))
}

/// The `heap.maxOverheadPercent` or `offcpu.maxOverheadPercent` to send for `asked` (pure):
/// `ceiling` ([`TenantLimits::max_heap_overhead_percent`],
/// [`TenantLimits::max_offcpu_overhead_percent`]) when the request names none or more than
/// the ceiling allows (never 0, which turns the guard off, while a ceiling is set); `asked`
/// otherwise.
pub fn overhead_percent(asked: Option<u32>, ceiling: u32) -> Option<u32> {
    match asked {
        _ if ceiling == 0 => asked,
        Some(p) if p > 0 && p <= ceiling => Some(p),
        _ => Some(ceiling),
    }
}

/// Captures running now: in total and by namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Running {
    /// All running requests.
    pub total: u32,
    /// Running requests by namespace.
    pub by_namespace: BTreeMap<String, u32>,
}

/// Whether one more capture may start in `namespace` (pure); the error is the `Queued`
/// message. `namespace_limit` is the namespace's effective limit (0: unlimited).
pub fn check_concurrency(
    running: &Running,
    namespace: &str,
    namespace_limit: u32,
    limits: &TenantLimits,
) -> std::result::Result<(), String> {
    let here = running.by_namespace.get(namespace).copied().unwrap_or(0);
    if namespace_limit > 0 && here >= namespace_limit {
        return Err(format!(
            "namespace {namespace} already has {here} captures running (limit {namespace_limit}); this request starts when one finishes"
        ));
    }
    if limits.max_concurrent > 0 && running.total >= limits.max_concurrent {
        return Err(format!(
            "the cluster already has {} captures running (limit {}); this request starts when one finishes",
            running.total, limits.max_concurrent
        ));
    }
    Ok(())
}

/// Counts the Running requests among `requests` (pure).
pub fn count_running<'a>(requests: impl IntoIterator<Item = &'a ProfileRequest>) -> Running {
    let mut out = Running::default();
    for request in requests {
        if request.status.as_ref().and_then(|s| s.phase) == Some(RequestPhase::Running) {
            out.total += 1;
            *out.by_namespace
                .entry(request.metadata.namespace.clone().unwrap_or_default())
                .or_default() += 1;
        }
    }
    out
}

/// The phase (and namespace) of every request this operator handles (`selector`), by UID:
/// from the controller's cache `requests` when there is one (no API call; it first waits
/// for the cache's initial list, so that right after a start or a regained leadership no
/// Running request is missed), else by listing them.
///
/// # Errors
/// API errors of the list.
pub async fn phases(
    client: &kube::Client,
    requests: Option<&Store<ProfileRequest>>,
    selector: Option<&str>,
) -> Result<HashMap<String, (String, Option<RequestPhase>)>> {
    let entry = |r: &ProfileRequest| {
        (
            r.metadata.uid.clone().unwrap_or_default(),
            (
                r.metadata.namespace.clone().unwrap_or_default(),
                r.status.as_ref().and_then(|s| s.phase),
            ),
        )
    };
    if let Some(store) = requests {
        // Err: the controller that filled the cache stopped; list instead.
        if store.wait_until_ready().await.is_ok() {
            return Ok(store.state().iter().map(|r| entry(r)).collect());
        }
    }
    let api: Api<ProfileRequest> = Api::all(client.clone());
    let mut params = ListParams::default();
    if let Some(s) = selector {
        params = params.labels(s);
    }
    let list = api.list(&params).await.map_err(Error::kube(
        "listing ProfileRequests to count running captures",
    ))?;
    Ok(list.items.iter().map(entry).collect())
}

/// The effective per-namespace limit: the namespace's annotation when it holds a number,
/// else the operator's default. Read from `namespaces` (the operator's watch-fed cache)
/// when it holds its first list; else with a GET.
///
/// # Errors
/// API errors of the GET.
pub async fn namespace_limit(
    client: &kube::Client,
    namespaces: Option<&Store<Namespace>>,
    namespace: &str,
    limits: &TenantLimits,
) -> Result<u32> {
    let cached = namespaces
        .filter(|store| {
            futures::FutureExt::now_or_never(store.wait_until_ready()).is_some_and(|r| r.is_ok())
        })
        .map(|store| store.get(&ObjectRef::new(namespace)));
    let found = match cached {
        Some(ns) => ns.map(|ns| (*ns).clone()),
        None => {
            let api: Api<Namespace> = Api::all(client.clone());
            api.get_opt(namespace)
                .await
                .map_err(Error::kube(format!("reading namespace {namespace}")))?
        }
    };
    let annotated = found
        .and_then(|ns| ns.metadata.annotations)
        .and_then(|a| a.get(NAMESPACE_LIMIT_ANNOTATION).cloned());
    Ok(match annotated.map(|v| v.trim().parse::<u32>()) {
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            tracing::warn!(%namespace, "annotation {NAMESPACE_LIMIT_ANNOTATION} is not a number; using the default limit");
            limits.max_concurrent_per_namespace
        }
        None => limits.max_concurrent_per_namespace,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(v: serde_json::Value) -> ProfileRequestSpec {
        serde_json::from_value(v).expect("spec")
    }

    #[test]
    fn only_running_requests_count_by_namespace() {
        let request = |ns: &str, phase: Option<&str>| -> ProfileRequest {
            serde_json::from_value(json!({
                "apiVersion": "flamefleet.dev/v1alpha1",
                "kind": "ProfileRequest",
                "metadata": {"name": "r", "namespace": ns},
                "spec": {"type": "cpu", "podNames": ["p"], "duration": "1s"},
                "status": phase.map_or(json!({}), |p| json!({"phase": p})),
            }))
            .expect("request")
        };
        let requests = [
            request("a", Some("Running")),
            request("a", Some("Running")),
            request("b", Some("Running")),
            request("b", Some("Succeeded")),
            request("c", Some("Pending")),
            request("c", None),
        ];
        let running = count_running(&requests);
        assert_eq!(running.total, 3);
        assert_eq!(
            running.by_namespace,
            BTreeMap::from([("a".to_owned(), 2), ("b".to_owned(), 1)])
        );
    }

    #[test]
    fn spec_limits_name_the_limit_and_who_sets_it() {
        let limits = TenantLimits {
            max_cpu_frequency_hz: 199,
            ..TenantLimits::default()
        };
        let fast = spec(
            json!({"type": "cpu", "podNames": ["p"], "duration": "1s", "cpu": {"frequencyHz": 500}}),
        );
        let err = check_spec(&fast, &limits).unwrap_err();
        assert!(
            err.contains("500") && err.contains("199 Hz") && err.contains("--max-cpu-frequency-hz"),
            "{err}"
        );
        let tiny = spec(
            json!({"type": "heap", "podNames": ["p"], "duration": "1s", "heap": {"sampleBytes": 1}}),
        );
        let err = check_spec(&tiny, &limits).unwrap_err();
        assert!(
            err.contains("sampleBytes 1") && err.contains("65536"),
            "{err}"
        );
        let fine = spec(json!({"type": "heap", "podNames": ["p"], "duration": "1s"}));
        assert!(check_spec(&fine, &limits).is_ok());
        let default_cpu = spec(json!({"type": "cpu", "podNames": ["p"], "duration": "1s"}));
        assert!(
            check_spec(&default_cpu, &limits).is_ok(),
            "99 Hz by default"
        );
    }

    #[test]
    fn one_namespace_at_its_limit_does_not_hold_up_another() {
        let limits = TenantLimits {
            max_concurrent: 3,
            ..TenantLimits::default()
        };
        let running = Running {
            total: 2,
            by_namespace: BTreeMap::from([("a".to_string(), 2)]),
        };
        let err = check_concurrency(&running, "a", 2, &limits).unwrap_err();
        assert!(
            err.contains("namespace a already has 2 captures running (limit 2)"),
            "{err}"
        );
        assert!(check_concurrency(&running, "b", 2, &limits).is_ok());
        assert!(
            check_concurrency(&running, "a", 0, &limits).is_ok(),
            "0: unlimited"
        );
        let full = Running {
            total: 3,
            ..running
        };
        let err = check_concurrency(&full, "b", 2, &limits).unwrap_err();
        assert!(err.contains("cluster already has 3"), "{err}");
    }

    #[test]
    fn tenants_can_only_lower_the_heap_overhead_guard() {
        let limits = TenantLimits::default();
        let heap = |percent: i32| {
            spec(json!({"type": "heap", "podNames": ["p"], "duration": "1s",
                "heap": {"source": "ebpf", "maxOverheadPercent": percent}}))
        };
        assert!(check_spec(&heap(1), &limits).is_ok());
        assert!(check_spec(&heap(3), &limits).is_ok());
        let off = check_spec(&heap(0), &limits).unwrap_err();
        assert!(off.contains("overhead guard turned off"), "{off}");
        assert!(off.contains("--max-heap-overhead-percent"), "{off}");
        assert!(check_spec(&heap(4), &limits).is_err());
        let open = TenantLimits {
            max_heap_overhead_percent: 0,
            ..TenantLimits::default()
        };
        assert!(check_spec(&heap(0), &open).is_ok());
        // What is sent: the ceiling unless the request asks for less.
        assert_eq!(overhead_percent(None, 3), Some(3));
        assert_eq!(overhead_percent(Some(0), 3), Some(3));
        assert_eq!(overhead_percent(Some(9), 3), Some(3));
        assert_eq!(overhead_percent(Some(2), 3), Some(2));
        assert_eq!(overhead_percent(None, 0), None);
        assert_eq!(overhead_percent(Some(0), 0), Some(0));
    }

    #[test]
    fn tenants_can_only_lower_the_offcpu_overhead_guard() {
        let limits = TenantLimits::default();
        let offcpu = |percent: i32| {
            spec(
                json!({"type": "offcpu", "podNames": ["p"], "duration": "1s",
                "offcpu": {"maxOverheadPercent": percent}}),
            )
        };
        assert!(check_spec(&offcpu(1), &limits).is_ok());
        assert!(check_spec(&offcpu(3), &limits).is_ok());
        let none = spec(json!({"type": "offcpu", "podNames": ["p"], "duration": "1s"}));
        assert!(check_spec(&none, &limits).is_ok());
        let off = check_spec(&offcpu(0), &limits).unwrap_err();
        assert!(
            off.contains("offcpu.maxOverheadPercent 0 (the overhead guard turned off)"),
            "{off}"
        );
        assert!(off.contains("--max-offcpu-overhead-percent"), "{off}");
        let raised = check_spec(&offcpu(20), &limits).unwrap_err();
        assert!(
            raised.contains("offcpu.maxOverheadPercent 20 is above this cluster's ceiling of 3%"),
            "{raised}"
        );
        // One ceiling does not lift the other.
        let heap_open = TenantLimits {
            max_heap_overhead_percent: 0,
            ..TenantLimits::default()
        };
        assert!(check_spec(&offcpu(20), &heap_open).is_err());
        let open = TenantLimits {
            max_offcpu_overhead_percent: 20,
            ..TenantLimits::default()
        };
        assert!(check_spec(&offcpu(20), &open).is_ok());
        assert!(check_spec(&offcpu(21), &open).is_err());
        let heap = spec(json!({"type": "heap", "podNames": ["p"], "duration": "1s",
            "heap": {"source": "ebpf", "maxOverheadPercent": 20}}));
        assert!(check_spec(&heap, &open).is_err());
    }
}
