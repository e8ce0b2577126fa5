//! The ProfileRequest reconciler: a `finalizer(...)` wrapper around an idempotent apply
//! (Pending → resolve → Running → aggregate → terminal → TTL) and a cleanup that deletes the
//! request's artifacts and result slices.
//!
//! Per-node results live in `ProfileResultSlice`s (at most 100 nodes each), the status only
//! in counts and a bounded failure list: at start the slices are written with every node
//! pending, then the status; each progress reconcile folds the new outcomes into the
//! session's [`ResultTable`], applies only the slices that changed, then the status.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use flamefleet_api::conditions::{new_condition, set_condition};
use flamefleet_api::profile_request::MAX_STATUS_FAILURES;
use flamefleet_api::{NodePhase, NodeStatus, ProfileRequest, ProfileRequestStatus, RequestPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Resource, ResourceExt};
use tracing::instrument;

use super::aggregate::{failure_reason, outcome_message};
use super::result_table::ResultTable;
use super::ttl::{TtlAction, ttl_action};
use super::{Context, admission, limits, resolve, result_slices, status, store_wait};
use crate::dispatch::outcome::{NodeFailure, NodeOutcome};
use crate::dispatch::{CapturePlan, NodePlan, Session};
use crate::pods::agents;
use crate::store::RequestRef;
use crate::{Error, Result};

/// The finalizer that keeps a request until its artifacts are deleted.
pub const FINALIZER: &str = "flamefleet.dev/artifacts";

/// Condition: the operator accepted the request.
pub const CONDITION_ACCEPTED: &str = "Accepted";
/// Condition: the targets were resolved (False when nothing could be targeted).
pub const CONDITION_RESOLVED: &str = "Resolved";
/// Condition: the request reached a terminal phase.
pub const CONDITION_COMPLETED: &str = "Completed";
/// Condition: some nodes failed.
pub const CONDITION_DEGRADED: &str = "Degraded";
/// Condition, set when the request ends: True only when every node succeeded (what
/// `kubectl wait --for=condition=Succeeded` waits for); False with why otherwise.
pub const CONDITION_SUCCEEDED: &str = "Succeeded";
/// The `Succeeded` condition's reason when it is True.
const REASON_ALL_SUCCEEDED: &str = "AllNodesSucceeded";

/// Condition: the request waits for a concurrency limit (Pending; see `limits`).
pub const CONDITION_QUEUED: &str = "Queued";
/// How often a queued request checks whether it may start.
const QUEUED_RECHECK: Duration = Duration::from_secs(2);

/// How often a Running request is looked at even without news (a safety net: the
/// dispatcher re-queues the request as each node ends).
const RUNNING_RESYNC: Duration = Duration::from_secs(30);

/// Reconciles one ProfileRequest.
#[instrument(skip_all, fields(namespace = request.namespace().unwrap_or_default(), request = %request.name_any()))]
pub async fn reconcile(request: Arc<ProfileRequest>, ctx: Arc<Context>) -> Result<Action> {
    // Runs never wait for a slot (see `Context::runs`).
    let _slot = if super::is_run(&request) {
        None
    } else {
        ctx.adhoc_slots.acquire().await
    };
    let _timer = ctx.metrics.reconcile();
    let namespace = request
        .namespace()
        .ok_or(Error::MissingMetadata("namespace"))?;
    let api: Api<ProfileRequest> = Api::namespaced(ctx.client_for(&request).clone(), &namespace);
    finalizer(&api, FINALIZER, request, |event| async {
        match event {
            Event::Apply(request) => apply(request, &ctx, &api).await,
            Event::Cleanup(request) => cleanup(request, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

fn now() -> Time {
    Time(Timestamp::now())
}

struct Ids {
    name: String,
    namespace: String,
    uid: String,
    generation: Option<i64>,
}

fn ids(request: &ProfileRequest) -> Result<Ids> {
    Ok(Ids {
        name: request
            .metadata
            .name
            .clone()
            .ok_or(Error::MissingMetadata("name"))?,
        namespace: request
            .metadata
            .namespace
            .clone()
            .ok_or(Error::MissingMetadata("namespace"))?,
        uid: request
            .metadata
            .uid
            .clone()
            .ok_or(Error::MissingMetadata("uid"))?,
        generation: request.metadata.generation,
    })
}

impl Ids {
    /// The condition `type_` (status `ok`) at the request's generation, stamped now.
    fn condition(
        &self,
        type_: &str,
        ok: bool,
        reason: &str,
        message: impl Into<String>,
    ) -> Condition {
        new_condition(type_, ok, reason, message, self.generation, now())
    }
}

/// The status to start from: the current one (the operator owns all of it).
fn operator_fields(current: &ProfileRequestStatus) -> ProfileRequestStatus {
    current.clone()
}

/// Sets the node counts, the slice count and the bounded failure list from `table`.
fn set_results(status: &mut ProfileRequestStatus, table: &ResultTable) {
    let (failures, omitted) = table.failures(MAX_STATUS_FAILURES);
    status.node_counts = Some(table.counts());
    status.result_slices = i32::try_from(table.slice_count()).ok();
    status.failures = failures;
    status.failures_omitted = (omitted > 0).then(|| i32::try_from(omitted).unwrap_or(i32::MAX));
}

async fn apply(
    request: Arc<ProfileRequest>,
    ctx: &Context,
    api: &Api<ProfileRequest>,
) -> Result<Action> {
    let phase = request.status.as_ref().and_then(|s| s.phase);
    let started_here = request
        .metadata
        .uid
        .as_deref()
        .is_some_and(|uid| ctx.dispatcher.get(uid).is_some());
    if started_here && matches!(phase, None | Some(RequestPhase::Pending)) {
        // This process already wrote Running and dispatched; the cache is behind.
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    match phase {
        None => {
            let pending = write_pending(&request, api).await?;
            start(Arc::new(pending), ctx, api).await
        }
        Some(RequestPhase::Pending) => start(request, ctx, api).await,
        Some(RequestPhase::Running) => progress(request, ctx, api).await,
        Some(_) => finished(&request, ctx, api).await,
    }
}

async fn write_pending(
    request: &ProfileRequest,
    api: &Api<ProfileRequest>,
) -> Result<ProfileRequest> {
    let ids = ids(request)?;
    let mut status = ProfileRequestStatus {
        phase: Some(RequestPhase::Pending),
        observed_generation: ids.generation,
        ..Default::default()
    };
    set_condition(
        &mut status.conditions,
        ids.condition(
            CONDITION_ACCEPTED,
            true,
            "Accepted",
            "the operator accepted the request and is resolving its pods",
        ),
    );
    status::apply(api, &ids.name, &status).await
}

/// Resolves targets and agents, writes Running, and starts the captures.
async fn start(
    request: Arc<ProfileRequest>,
    ctx: &Context,
    api: &Api<ProfileRequest>,
) -> Result<Action> {
    let ids = ids(&request)?;
    let spec = &request.spec;
    let duration = match spec.capture_duration() {
        Ok(d) => d,
        Err(e) => return fail_request(&request, ctx, api, "InvalidSpec", e.to_string()).await,
    };
    let request_ref = match RequestRef::new(&ids.namespace, &ids.name, &ids.uid) {
        Ok(r) => r,
        Err(e) => return fail_request(&request, ctx, api, "InvalidName", e.to_string()).await,
    };
    if let Err(message) = limits::check_spec(spec, &ctx.limits) {
        return fail_request(&request, ctx, api, "OutsideLimits", message).await;
    }
    // Before taking a capture slot: a store that cannot be reached yet (right after an
    // installation) keeps the request Pending instead of failing its nodes.
    match store_ready(ctx, &ids).await? {
        store_wait::Verdict::Ready => {}
        store_wait::Verdict::Wait { message, retry_in } => {
            return queue(&request, ctx, api, store_wait::REASON, message, retry_in).await;
        }
        store_wait::Verdict::GiveUp { message } => {
            return fail_request(&request, ctx, api, store_wait::FAILED_REASON, message).await;
        }
    }
    let requests = ctx
        .requests
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let sources = admission::Sources {
        client: ctx.client_for(&request),
        requests: requests.as_ref(),
        namespaces: ctx.namespaces.as_ref(),
        selector: ctx.request_selector.as_deref(),
        limits: &ctx.limits,
    };
    if let Err(message) = ctx
        .admission
        .admit(&sources, &ids.uid, &ids.namespace)
        .await?
    {
        return queue(
            &request,
            ctx,
            api,
            "ConcurrencyLimit",
            message,
            QUEUED_RECHECK,
        )
        .await;
    }
    // Admitted: the slot is reserved until the cache shows the request Running, unless the
    // start ends before writing Running.
    let uid = ids.uid.clone();
    let launched = launch(request, ctx, api, ids, duration, request_ref).await;
    if !matches!(launched, Ok((_, true))) {
        ctx.admission.release(&uid).await;
    }
    launched.map(|(action, _)| action)
}

/// Resolves targets and agents, writes Running, and starts the captures of an admitted
/// request; true once Running is written.
async fn launch(
    request: Arc<ProfileRequest>,
    ctx: &Context,
    api: &Api<ProfileRequest>,
    ids: Ids,
    duration: Duration,
    request_ref: RequestRef,
) -> Result<(Action, bool)> {
    let spec = &request.spec;
    let not_started = |action: Result<Action>| action.map(|a| (a, false));
    let resolution = match resolve::resolve(ctx.client_for(&request), &ids.namespace, spec).await {
        Ok(r) => r,
        Err(Error::Selector(m)) => {
            return not_started(fail_request(&request, ctx, api, "InvalidSelector", m).await);
        }
        Err(e) => return Err(e),
    };
    if resolution.pod_count() == 0 {
        let message = resolution.no_match_message(&ids.namespace);
        return not_started(fail_request(&request, ctx, api, "NoPodsMatched", message).await);
    }
    let agents = agents::discover(
        ctx.client_for(&request),
        &ctx.agent_namespace,
        ctx.pods.as_ref(),
        resolution.by_node.keys().map(String::as_str),
    )
    .await?;

    let mut entries = Vec::new();
    let mut plans = Vec::new();
    let mut settled = BTreeMap::new();
    for (node, targets) in &resolution.by_node {
        let pods: Vec<String> = targets.iter().map(|t| t.name.clone()).collect();
        match agents.get(node) {
            Some(agent) => {
                // No phase yet (Pending) until the node's outcome arrives.
                entries.push(NodeStatus {
                    node: node.clone(),
                    pods,
                    ..Default::default()
                });
                plans.push(NodePlan {
                    node: node.clone(),
                    agent: agent.clone(),
                    targets: targets.clone(),
                });
            }
            None => {
                let failure = NodeFailure::NoAgent {
                    node: node.clone(),
                    agent_namespace: ctx.agent_namespace.clone(),
                };
                entries.push(NodeStatus {
                    node: node.clone(),
                    phase: Some(NodePhase::Failed),
                    pods,
                    reason: Some(failure.reason().to_string()),
                    message: Some(failure.to_string()),
                    ..Default::default()
                });
                settled.insert(node.clone(), NodeOutcome::Failed(failure));
            }
        }
    }

    // The slices first, every node pending: once the status says Running, a restarted
    // operator resumes from them.
    let mut table = ResultTable::new(entries);
    result_slices::write_all(ctx.client_for(&request), &request, &mut table).await?;

    let current = request.status.clone().unwrap_or_default();
    let mut status = operator_fields(&current);
    let pod_count = resolution.pod_count();
    let node_count = resolution.by_node.len();
    status.phase = Some(RequestPhase::Running);
    status.observed_generation = ids.generation;
    status.start_time = Some(now());
    status.pod_count = i32::try_from(pod_count).ok();
    status.node_count = i32::try_from(node_count).ok();
    set_results(&mut status, &table);
    let mut resolved = format!("{pod_count} pods on {node_count} nodes");
    if !resolution.skipped.is_empty() {
        let skipped: Vec<String> = resolution
            .skipped
            .iter()
            .take(10)
            .map(|(p, why)| format!("{p}: {why}"))
            .collect();
        resolved.push_str(&format!("; skipped {}", skipped.join("; ")));
    }
    set_condition(
        &mut status.conditions,
        ids.condition(CONDITION_RESOLVED, true, "PodsResolved", &resolved),
    );
    if status
        .conditions
        .iter()
        .any(|c| c.type_ == CONDITION_QUEUED)
    {
        set_condition(
            &mut status.conditions,
            ids.condition(CONDITION_QUEUED, false, "Started", "a capture slot is free"),
        );
    }
    set_condition(
        &mut status.conditions,
        ids.condition(
            CONDITION_COMPLETED,
            false,
            "Capturing",
            format!("capturing {} for {}", spec.profile_type, spec.duration),
        ),
    );
    status::apply(api, &ids.name, &status).await?;
    publish(
        ctx,
        &request,
        EventType::Normal,
        "CaptureStarted",
        format!(
            "capturing {} for {} on {resolved}",
            spec.profile_type, spec.duration
        ),
    )
    .await;
    let artifact_quota = artifact_quota(ctx, &ids.namespace).await?;
    ctx.dispatcher.start(
        CapturePlan {
            request: request_ref,
            spec: spec.clone(),
            duration,
            nodes: plans,
            settled,
            artifact_quota,
            trigger_fire_id: trigger_fire_id(&request),
        },
        table,
    );
    Ok((Action::requeue(RUNNING_RESYNC), true))
}

/// The fire whose heap a triggered heap run takes (its annotation; empty: none).
fn trigger_fire_id(request: &ProfileRequest) -> String {
    request
        .annotations()
        .get(flamefleet_api::trigger::TRIGGER_FIRE_ANNOTATION)
        .filter(|id| id.len() <= 64)
        .cloned()
        .unwrap_or_default()
}

/// Builds the session of a Running request this process has no session for (the operator
/// restarted, or leadership moved) from the request's result slices: nodes already recorded
/// are left alone, the others are dispatched again and attach to the agents' running
/// captures. `None` when the request has no slices (they were deleted, or an operator
/// older than slices started it): it cannot be resumed.
async fn resume(
    request: &ProfileRequest,
    ctx: &Context,
) -> Result<Option<Arc<Session<ResultTable>>>> {
    let ids = ids(request)?;
    let spec = &request.spec;
    let request_ref = RequestRef::new(&ids.namespace, &ids.name, &ids.uid)?;
    let duration = spec.capture_duration()?;
    let table = result_slices::read_table(ctx.client_for(request), request).await?;
    if table.is_empty() {
        return Ok(None);
    }
    let expected = request.status.as_ref().and_then(|s| s.node_count);
    if expected.is_some_and(|n| usize::try_from(n).ok() != Some(table.len())) {
        tracing::warn!(
            request = %request_ref.prefix(),
            expected = ?expected,
            found = table.len(),
            "some result slices of a Running request are missing; their nodes are not resumed"
        );
    }
    let agents = agents::discover(
        ctx.client_for(request),
        &ctx.agent_namespace,
        ctx.pods.as_ref(),
        table
            .entries()
            .filter(|e| !e.phase.is_some_and(NodePhase::is_terminal))
            .map(|e| e.node.as_str()),
    )
    .await?;
    let mut plans = Vec::new();
    let mut settled = BTreeMap::new();
    for entry in table.entries() {
        if entry.phase.is_some_and(NodePhase::is_terminal) {
            continue;
        }
        let (targets, vanished) = resolve::refresh_targets(
            ctx.client_for(request),
            &ids.namespace,
            &entry.node,
            &entry.pods,
        )
        .await?;
        if targets.is_empty() {
            settled.insert(
                entry.node.clone(),
                NodeOutcome::Failed(NodeFailure::PodsVanished { pods: vanished }),
            );
            continue;
        }
        match agents.get(&entry.node) {
            Some(agent) => plans.push(NodePlan {
                node: entry.node.clone(),
                agent: agent.clone(),
                targets,
            }),
            None => {
                settled.insert(
                    entry.node.clone(),
                    NodeOutcome::Failed(NodeFailure::NoAgent {
                        node: entry.node.clone(),
                        agent_namespace: ctx.agent_namespace.clone(),
                    }),
                );
            }
        }
    }
    tracing::info!(
        request = %request_ref.prefix(),
        nodes = plans.len(),
        "resuming the captures of a Running request"
    );
    let artifact_quota = artifact_quota(ctx, &ids.namespace).await?;
    let session = ctx.dispatcher.start(
        CapturePlan {
            request: request_ref,
            spec: spec.clone(),
            duration,
            nodes: plans,
            settled,
            artifact_quota,
            trigger_fire_id: trigger_fire_id(request),
        },
        table,
    );
    Ok(Some(session))
}

/// Folds new outcomes into the session's result table, applies the slices that changed,
/// then the status; finishes the request when all results are in.
async fn progress(
    request: Arc<ProfileRequest>,
    ctx: &Context,
    api: &Api<ProfileRequest>,
) -> Result<Action> {
    let ids = ids(&request)?;
    let session = match ctx.dispatcher.get(&ids.uid) {
        // The terminal status is written; this is a stale copy from the cache.
        Some(session) if session.completed() => {
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        Some(session) => session,
        None => match resume(&request, ctx).await? {
            Some(session) => session,
            None => {
                let message = format!(
                    "the request is Running but its per-node results are missing: no ProfileResultSlice has label {}; it cannot be resumed, create it again",
                    flamefleet_api::result_slice::selector_for(&ids.uid)
                );
                return fail_request(&request, ctx, api, "ResultsMissing", message).await;
            }
        },
    };
    // One snapshot of the outcomes per reconcile: the slices written below and the status
    // computed after them agree (an outcome arriving meanwhile waits for the next round).
    session.absorb(|table, node, outcome| {
        table.apply(node, &outcome);
    });
    let dirty = session.with_results(|t| t.dirty_slices());
    let written = result_slices::write_dirty(ctx.client_for(&request), &request, dirty, |i| {
        session.with_results(|t| t.mark_clean(i));
    })
    .await?;
    if written > 0 {
        ctx.metrics.result_slices_written(written);
    }
    let settled = session.settled();
    let current = request.status.clone().unwrap_or_default();
    let mut status = operator_fields(&current);
    let (phase, counts, failures) = session.with_results(|t| {
        set_results(&mut status, t);
        // Terminal only once every slice is written as the table says.
        let phase = match t.phase(settled) {
            p if p.is_terminal() && t.has_dirty() => RequestPhase::Running,
            p => p,
        };
        (phase, t.counts(), t.failures(MAX_STATUS_FAILURES).0)
    });
    let terminal = phase.is_terminal();
    status.phase = Some(phase);
    if !terminal && status == current {
        return Ok(Action::requeue(RUNNING_RESYNC));
    }
    let message = outcome_message(counts, &failures);
    if terminal {
        status.completion_time = Some(now());
        status.summary = Some(session.with_results(|t| t.summary()));
        let succeeded = phase == RequestPhase::Succeeded;
        status.reason = if succeeded {
            None
        } else {
            Some(
                session
                    .with_results(|t| failure_reason(t.entries()))
                    .unwrap_or_else(|| "NodesFailed".to_owned()),
            )
        };
        set_condition(
            &mut status.conditions,
            ids.condition(
                CONDITION_SUCCEEDED,
                succeeded,
                status.reason.as_deref().unwrap_or(REASON_ALL_SUCCEEDED),
                &message,
            ),
        );
        set_condition(
            &mut status.conditions,
            ids.condition(CONDITION_COMPLETED, true, phase.as_str(), &message),
        );
        let failed = counts.failed > 0;
        set_condition(
            &mut status.conditions,
            ids.condition(
                CONDITION_DEGRADED,
                failed,
                if failed {
                    "NodesFailed"
                } else {
                    "AllNodesSucceeded"
                },
                &message,
            ),
        );
    }
    let updated = status::apply(api, &ids.name, &status).await?;
    let announcements = session.with_results(ResultTable::take_announcements);
    for failure in announcements {
        let note = format!("node {}: {}", failure.node, failure.message);
        publish(ctx, &request, EventType::Warning, &failure.reason, note).await;
    }
    if !terminal {
        return Ok(Action::requeue(RUNNING_RESYNC));
    }
    session.mark_completed();
    ctx.metrics.request_finished(phase.as_str());
    let kind = if phase == RequestPhase::Succeeded {
        EventType::Normal
    } else {
        EventType::Warning
    };
    publish(ctx, &request, kind, phase.as_str(), message).await;
    expire(&updated, api).await
}

/// Whether the artifact store can be reached for request `ids`, as far as starting it
/// needs the store: with a storage quota, the namespace's usage is read from the store
/// first (the quota ledger caches it). A store that cannot be reached is waited for
/// ([`store_wait`]); any other error is left to the node's capture, which fails with it.
async fn store_ready(ctx: &Context, ids: &Ids) -> Result<store_wait::Verdict> {
    let Some(ledger) = ctx.dispatcher.quota() else {
        return Ok(store_wait::Verdict::Ready);
    };
    let quota = ledger.quota_of(&ctx.client, &ids.namespace).await?;
    let checked = ledger.room(&ids.namespace, quota).await;
    let unreachable = match &checked {
        Err(Error::Store(e)) => store_wait::unavailable(e),
        _ => None,
    };
    let verdict = ctx
        .store_waits
        .check(&ids.uid, unreachable, std::time::Instant::now());
    if let (store_wait::Verdict::Wait { retry_in, .. }, Err(e)) = (&verdict, &checked) {
        tracing::info!(
            request = %ids.name,
            retry_in_ms = retry_in.as_millis(),
            "waiting for the artifact store: {e}"
        );
    }
    Ok(verdict)
}

/// Keeps the request Pending with a `Queued` condition (`reason`, `message`) saying why,
/// and checks again after `recheck`.
async fn queue(
    request: &ProfileRequest,
    ctx: &Context,
    api: &Api<ProfileRequest>,
    reason: &str,
    message: String,
    recheck: Duration,
) -> Result<Action> {
    let ids = ids(request)?;
    let current = request.status.clone().unwrap_or_default();
    let already = current.conditions.iter().any(|c| {
        c.type_ == CONDITION_QUEUED
            && c.status == "True"
            && c.reason == reason
            && c.message == message
    });
    if !already {
        let mut status = operator_fields(&current);
        status.phase = Some(RequestPhase::Pending);
        set_condition(
            &mut status.conditions,
            ids.condition(CONDITION_QUEUED, true, reason, &message),
        );
        status::apply(api, &ids.name, &status).await?;
        publish(ctx, request, EventType::Normal, "Queued", message).await;
    }
    Ok(Action::requeue(recheck))
}

/// Marks the whole request Failed (nothing can be captured) with a reason and message.
async fn fail_request(
    request: &ProfileRequest,
    ctx: &Context,
    api: &Api<ProfileRequest>,
    reason: &str,
    message: String,
) -> Result<Action> {
    let ids = ids(request)?;
    let current = request.status.clone().unwrap_or_default();
    let mut status = operator_fields(&current);
    status.phase = Some(RequestPhase::Failed);
    status.observed_generation = ids.generation;
    status.start_time = status.start_time.or_else(|| Some(now()));
    status.completion_time = Some(now());
    status.pod_count = Some(0);
    status.node_count = Some(0);
    set_condition(
        &mut status.conditions,
        ids.condition(CONDITION_RESOLVED, false, reason, &message),
    );
    set_condition(
        &mut status.conditions,
        ids.condition(CONDITION_COMPLETED, true, "Failed", &message),
    );
    status.reason = Some(reason.to_owned());
    set_condition(
        &mut status.conditions,
        ids.condition(CONDITION_SUCCEEDED, false, reason, &message),
    );
    let updated = status::apply(api, &ids.name, &status).await?;
    ctx.metrics.request_finished(RequestPhase::Failed.as_str());
    publish(ctx, request, EventType::Warning, reason, message).await;
    expire(&updated, api).await
}

/// A terminal request (as the cache shows it): forget its session, then apply
/// `ttlSecondsAfterFinished`.
async fn finished(
    request: &ProfileRequest,
    ctx: &Context,
    api: &Api<ProfileRequest>,
) -> Result<Action> {
    let ids = ids(request)?;
    if ctx.dispatcher.get(&ids.uid).is_some() {
        ctx.dispatcher.finish(&ids.uid);
    }
    expire(request, api).await
}

/// Deletes a finished request whose TTL passed, or says when to look again.
async fn expire(request: &ProfileRequest, api: &Api<ProfileRequest>) -> Result<Action> {
    let ids = ids(request)?;
    let completed = request
        .status
        .as_ref()
        .and_then(|s| s.completion_time.as_ref())
        .map(|t| t.0);
    match ttl_action(
        request.spec.ttl_seconds_after_finished,
        completed,
        Timestamp::now(),
    ) {
        TtlAction::Keep => Ok(Action::await_change()),
        TtlAction::RequeueAfter(after) => Ok(Action::requeue(after)),
        TtlAction::Delete => {
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(ids.uid.clone()),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match api.delete(&ids.name, &params).await {
                Ok(_) => {
                    tracing::info!("deleted after ttlSecondsAfterFinished");
                    Ok(Action::await_change())
                }
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {
                    Ok(Action::await_change())
                }
                Err(e) => Err(Error::kube(format!(
                    "deleting expired ProfileRequest {}",
                    ids.name
                ))(e)),
            }
        }
    }
}

/// The request is being deleted: stop its captures, delete its artifacts and its result
/// slices (their ownerReference lets a cluster's garbage collector delete them too, but a
/// control plane without one, like the e2e tests', would keep them).
async fn cleanup(request: Arc<ProfileRequest>, ctx: &Context) -> Result<Action> {
    let ids = ids(&request)?;
    ctx.store_waits.forget(&ids.uid);
    ctx.dispatcher.cancel(&ids.uid).await;
    result_slices::delete_all(ctx.client_for(&request), &ids.namespace, &ids.uid).await?;
    // A request whose name or UID cannot form a key never had artifacts.
    if let Ok(request_ref) = RequestRef::new(&ids.namespace, &ids.name, &ids.uid) {
        let deleted = ctx.store.delete_request(&request_ref).await?;
        if let Some(ledger) = ctx.dispatcher.quota() {
            ledger.forget(&request_ref).await;
        }
        tracing::info!(deleted, "deleted the request's artifacts");
    }
    Ok(Action::await_change())
}

/// The artifact storage quota of `namespace` (0: unlimited, or no quotas at all).
async fn artifact_quota(ctx: &Context, namespace: &str) -> Result<u64> {
    match ctx.dispatcher.quota() {
        Some(ledger) => ledger.quota_of(&ctx.client, namespace).await,
        None => Ok(0),
    }
}

/// Records an Event on the request; failures are logged, never fatal.
async fn publish(
    ctx: &Context,
    request: &ProfileRequest,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let object = request.object_ref(&());
    crate::events::publish(
        ctx.recorder_for(request),
        &object,
        type_,
        "Capture",
        reason,
        &note,
    )
    .await;
}
