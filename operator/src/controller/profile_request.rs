//! The ProfileRequest reconciler: a `finalizer(...)` wrapper around an idempotent apply
//! (Pending → resolve → Running → aggregate → terminal → TTL) and a cleanup that deletes the
//! request's artifacts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use flamefleet_api::conditions::{new_condition, set_condition};
use flamefleet_api::{NodePhase, NodeStatus, ProfileRequest, ProfileRequestStatus, RequestPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Resource, ResourceExt};
use tracing::instrument;

use super::aggregate::{aggregate, outcome_message};
use super::dispatch::{CapturePlan, NodePlan, Session};
use super::node_outcome::{NodeFailure, NodeOutcome};
use super::ttl::{TtlAction, ttl_action};
use super::{Context, agents, limits, resolve, status};
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
    let _timer = ctx.metrics.reconcile();
    let namespace = request
        .namespace()
        .ok_or(Error::MissingMetadata("namespace"))?;
    let api: Api<ProfileRequest> = Api::namespaced(ctx.client.clone(), &namespace);
    finalizer(&api, FINALIZER, request, |event| async {
        match event {
            Event::Apply(request) => apply(request, &ctx, &api).await,
            Event::Cleanup(request) => cleanup(request, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// Retries failed reconciles: quickly after a write conflict (an agent wrote in between),
/// otherwise after a few seconds.
pub fn error_policy(request: Arc<ProfileRequest>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_failed(error);
    if error.is_conflict() {
        tracing::debug!(request = %request.name_any(), "status write conflicted; retrying");
        Action::requeue(Duration::from_millis(200))
    } else {
        tracing::warn!(request = %request.name_any(), "reconcile failed: {error}");
        Action::requeue(Duration::from_secs(5))
    }
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

/// The operator-owned fields of `current`, without node entries.
fn operator_fields(current: &ProfileRequestStatus) -> ProfileRequestStatus {
    ProfileRequestStatus {
        phase: current.phase,
        conditions: current.conditions.clone(),
        observed_generation: current.observed_generation,
        start_time: current.start_time.clone(),
        completion_time: current.completion_time.clone(),
        pod_count: current.pod_count,
        node_count: current.node_count,
        nodes: Vec::new(),
        summary: current.summary.clone(),
    }
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
        new_condition(
            CONDITION_ACCEPTED,
            true,
            "Accepted",
            "the operator accepted the request and is resolving its pods",
            ids.generation,
            now(),
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
    let running = limits::running(&ctx.client, ctx.request_selector.as_deref()).await?;
    let namespace_limit = limits::namespace_limit(&ctx.client, &ids.namespace, &ctx.limits).await?;
    if let Err(message) =
        limits::check_concurrency(&running, &ids.namespace, namespace_limit, &ctx.limits)
    {
        return queue(&request, ctx, api, message).await;
    }
    let resolution = match resolve::resolve(&ctx.client, &ids.namespace, spec).await {
        Ok(r) => r,
        Err(Error::Selector(m)) => {
            return fail_request(&request, ctx, api, "InvalidSelector", m).await;
        }
        Err(e) => return Err(e),
    };
    if resolution.pod_count() == 0 {
        let message = resolution.no_match_message(&ids.namespace);
        return fail_request(&request, ctx, api, "NoPodsMatched", message).await;
    }
    let agents = agents::discover(&ctx.client, &ctx.agent_namespace).await?;

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
                    message: Some(failure.to_string()),
                    ..Default::default()
                });
                settled.insert(node.clone(), NodeOutcome::Failed(failure));
            }
        }
    }

    let current = request.status.clone().unwrap_or_default();
    let mut status = operator_fields(&current);
    let pod_count = resolution.pod_count();
    let node_count = resolution.by_node.len();
    status.phase = Some(RequestPhase::Running);
    status.observed_generation = ids.generation;
    status.start_time = Some(now());
    status.pod_count = i32::try_from(pod_count).ok();
    status.node_count = i32::try_from(node_count).ok();
    status.nodes = entries;
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
        new_condition(
            CONDITION_RESOLVED,
            true,
            "PodsResolved",
            &resolved,
            ids.generation,
            now(),
        ),
    );
    if status
        .conditions
        .iter()
        .any(|c| c.type_ == CONDITION_QUEUED)
    {
        set_condition(
            &mut status.conditions,
            new_condition(
                CONDITION_QUEUED,
                false,
                "Started",
                "a capture slot is free",
                ids.generation,
                now(),
            ),
        );
    }
    set_condition(
        &mut status.conditions,
        new_condition(
            CONDITION_COMPLETED,
            false,
            "Capturing",
            format!("capturing {} for {}", spec.profile_type, spec.duration),
            ids.generation,
            now(),
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
    ctx.dispatcher.start(CapturePlan {
        request: request_ref,
        spec: spec.clone(),
        duration,
        nodes: plans,
        settled,
    });
    Ok(Action::requeue(RUNNING_RESYNC))
}

/// Builds the session of a Running request this process has no session for (the operator
/// restarted, or leadership moved): nodes already recorded are left alone, the others are
/// dispatched again and attach to the agents' running captures.
async fn resume(request: &ProfileRequest, ctx: &Context) -> Result<Arc<Session>> {
    let ids = ids(request)?;
    let spec = &request.spec;
    let current = request.status.clone().unwrap_or_default();
    let request_ref = RequestRef::new(&ids.namespace, &ids.name, &ids.uid)?;
    let duration = spec.capture_duration()?;
    let agents = agents::discover(&ctx.client, &ctx.agent_namespace).await?;
    let mut plans = Vec::new();
    let mut settled = BTreeMap::new();
    for entry in &current.nodes {
        if entry.phase.is_some_and(NodePhase::is_terminal) {
            continue;
        }
        let (targets, vanished) =
            resolve::refresh_targets(&ctx.client, &ids.namespace, &entry.node, &entry.pods).await?;
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
    Ok(ctx.dispatcher.start(CapturePlan {
        request: request_ref,
        spec: spec.clone(),
        duration,
        nodes: plans,
        settled,
    }))
}

/// Aggregates node results; writes what changed; finishes the request when all are in.
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
        None => resume(&request, ctx).await?,
    };
    let current = request.status.clone().unwrap_or_default();
    let outcomes = session.outcomes();
    let agg = aggregate(&current.nodes, &outcomes, session.settled());
    let terminal = agg.phase.is_terminal();
    let nodes_changed = agg.nodes != current.nodes;
    if !terminal && !nodes_changed {
        return Ok(Action::requeue(RUNNING_RESYNC));
    }
    let mut status = operator_fields(&current);
    status.phase = Some(agg.phase);
    status.nodes = agg.nodes.clone();
    let message = outcome_message(&agg.nodes);
    if terminal {
        status.completion_time = Some(now());
        status.summary = agg.summary.clone();
        set_condition(
            &mut status.conditions,
            new_condition(
                CONDITION_COMPLETED,
                true,
                agg.phase.as_str(),
                &message,
                ids.generation,
                now(),
            ),
        );
        let failed = agg.nodes.iter().any(|n| n.phase == Some(NodePhase::Failed));
        set_condition(
            &mut status.conditions,
            new_condition(
                CONDITION_DEGRADED,
                failed,
                if failed {
                    "NodesFailed"
                } else {
                    "AllNodesSucceeded"
                },
                &message,
                ids.generation,
                now(),
            ),
        );
    }
    let updated = status::apply(api, &ids.name, &status).await?;
    for node in &agg.nodes {
        let newly_failed = node.phase == Some(NodePhase::Failed)
            && current.node(&node.node).and_then(|n| n.phase) != Some(NodePhase::Failed);
        if newly_failed {
            let reason = match outcomes.get(&node.node) {
                Some(NodeOutcome::Failed(f)) => f.reason(),
                _ => "NodeFailed",
            };
            let note = format!(
                "node {}: {}",
                node.node,
                node.message.as_deref().unwrap_or("")
            );
            publish(ctx, &request, EventType::Warning, reason, note).await;
        }
    }
    if !terminal {
        return Ok(Action::requeue(RUNNING_RESYNC));
    }
    session.mark_completed();
    ctx.metrics.request_finished(agg.phase.as_str());
    let kind = if agg.phase == RequestPhase::Succeeded {
        EventType::Normal
    } else {
        EventType::Warning
    };
    publish(ctx, &request, kind, agg.phase.as_str(), message).await;
    expire(&updated, api).await
}

/// Marks the whole request Failed (nothing can be captured) with a reason and message.
/// Keeps the request Pending with a `Queued` condition saying why, and checks again soon.
async fn queue(
    request: &ProfileRequest,
    ctx: &Context,
    api: &Api<ProfileRequest>,
    message: String,
) -> Result<Action> {
    let ids = ids(request)?;
    let current = request.status.clone().unwrap_or_default();
    let already = current
        .conditions
        .iter()
        .any(|c| c.type_ == CONDITION_QUEUED && c.status == "True" && c.message == message);
    if !already {
        let mut status = operator_fields(&current);
        status.phase = Some(RequestPhase::Pending);
        set_condition(
            &mut status.conditions,
            new_condition(
                CONDITION_QUEUED,
                true,
                "ConcurrencyLimit",
                &message,
                ids.generation,
                now(),
            ),
        );
        status::apply(api, &ids.name, &status).await?;
        publish(ctx, request, EventType::Normal, "Queued", message).await;
    }
    Ok(Action::requeue(QUEUED_RECHECK))
}

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
        new_condition(
            CONDITION_RESOLVED,
            false,
            reason,
            &message,
            ids.generation,
            now(),
        ),
    );
    set_condition(
        &mut status.conditions,
        new_condition(
            CONDITION_COMPLETED,
            true,
            "Failed",
            &message,
            ids.generation,
            now(),
        ),
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

/// The request is being deleted: stop its captures and delete its artifacts.
async fn cleanup(request: Arc<ProfileRequest>, ctx: &Context) -> Result<Action> {
    let ids = ids(&request)?;
    ctx.dispatcher.cancel(&ids.uid).await;
    // A request whose name or UID cannot form a key never had artifacts.
    if let Ok(request_ref) = RequestRef::new(&ids.namespace, &ids.name, &ids.uid) {
        let deleted = ctx.store.delete_request(&request_ref).await?;
        tracing::info!(deleted, "deleted the request's artifacts");
    }
    Ok(Action::await_change())
}

/// Records an Event on the request; failures are logged, never fatal.
async fn publish(
    ctx: &Context,
    request: &ProfileRequest,
    type_: EventType,
    reason: &str,
    note: String,
) {
    // Event notes are limited to 1 KiB by the API server.
    let mut note = note;
    if note.len() > 1000 {
        let mut cut = 1000;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    let event = KubeEvent {
        type_,
        reason: reason.to_string(),
        note: Some(note),
        action: "Capture".to_string(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &request.object_ref(&())).await {
        tracing::warn!("recording event {reason}: {e}");
    }
}
