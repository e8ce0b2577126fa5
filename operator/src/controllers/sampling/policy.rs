//! The reconciler of both policy kinds: a `finalizer(...)` wrapper around an idempotent
//! apply (schedule → history → due runs → status) and a cleanup that deletes the runs.
//!
//! Exactly once per scheduled time, across restarts: a run's requests are named from the
//! policy and the scheduled time ([`run_name`]); before creating them the plan is written to
//! `status.pendingRun` together with the rotation's next state (one write guarded by the
//! policy's resourceVersion, so a stale view fails instead of planning twice), and cleared
//! with `lastScheduleTime` once they exist. A restart at any point either finds the plan
//! and finishes it (creating what is missing; `AlreadyExists` is success) or finds the time
//! recorded and moves on.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use flamefleet_api::conditions::{new_condition, set_condition};
use flamefleet_api::profile_request::CpuOptions;
use flamefleet_api::{
    Coverage, PendingRun, PlannedRequest, ProfileRequest, ProfileType, RotationState,
    SamplingPolicyStatus, SkippedPod,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{Event, finalizer};
use tracing::instrument;

use super::budget::{Budget, Reservation};
use super::fleet::{Scope, selector_of};
use super::rotation::{self, Limits};
use super::{Policy, SamplingContext, history, schedule};
use crate::{Error, Result};
use flamefleet_api::policy_runs::{
    DEFAULT_STARTING_DEADLINE_SECONDS, POLICY_KIND_LABEL, POLICY_NAME_LABEL, POLICY_UID_LABEL,
    PolicyKind, RunIdentity, SCHEDULED_AT_ANNOTATION, SCHEDULED_TIME_LABEL, is_label_value,
    run_name, scheduled_second,
};

/// The finalizer that deletes a policy's runs (and, through theirs, their artifacts).
pub const FINALIZER: &str = "flamefleet.dev/runs";
/// Condition: the schedule parses and matches.
pub const CONDITION_SCHEDULE_VALID: &str = "ScheduleValid";
/// Condition: the template's selector matches pods that can be sampled.
pub const CONDITION_PODS_MATCHED: &str = "PodsMatched";
/// Default `startingDeadlineSeconds`.
pub const DEFAULT_STARTING_DEADLINE: Duration =
    Duration::from_secs(DEFAULT_STARTING_DEADLINE_SECONDS.unsigned_abs());
/// CPU frequency of a run whose template sets none: continuous profiling at 19 Hz costs
/// about 0.1% of a CPU (docs/benchmarks.md, "Continuous profiling"), against the 99 Hz of
/// an ad hoc request.
pub const DEFAULT_POLICY_FREQUENCY_HZ: i32 = 19;
/// Longest wait between two looks at a policy (status and coverage refresh).
const MAX_REQUEUE: Duration = Duration::from_secs(300);
/// Most skipped pods recorded in `lastRunSkipped`.
const MAX_SKIPPED_RECORDED: usize = 20;
/// Condition: the policy is within the cluster's number of policies per namespace (set
/// only once a policy was refused).
pub const CONDITION_ADMITTED: &str = "Admitted";
/// How often a policy over the per-namespace cap looks again.
const POLICY_CAP_RECHECK: Duration = Duration::from_secs(60);

/// The cluster's minimum interval: after the last scheduled time handled, the next one
/// counted lies strictly after this (the times in between are neither run nor missed).
fn interval_floor(ctx: &SamplingContext, status: &SamplingPolicyStatus) -> Option<Timestamp> {
    let previous = status.last_schedule_time.as_ref()?;
    let gap = jiff::SignedDuration::try_from(ctx.limits.min_run_interval)
        .unwrap_or_default()
        .checked_sub(jiff::SignedDuration::from_secs(1))
        .unwrap_or_default()
        .max(jiff::SignedDuration::ZERO);
    previous.0.checked_add(gap).ok()
}

/// Why a SamplingPolicy may not run: its namespace holds more policies than the cluster
/// admin allows and it is not among the oldest. ClusterSamplingPolicies are the admin's own.
fn over_policy_cap<P: Policy>(ctx: &SamplingContext, policy: &P) -> Option<String> {
    let cap = ctx.limits.max_policies_per_namespace;
    if P::KIND != PolicyKind::Namespaced || cap == 0 {
        return None;
    }
    let ns = policy.meta().namespace.as_deref()?;
    let name = policy.name_any();
    let all = ctx.fleet.policies_in(ns);
    // Not cached yet: created just now, so among the newest.
    let rank = all
        .iter()
        .position(|(_, n)| *n == name)
        .unwrap_or(all.len());
    (rank >= cap).then(|| {
        format!(
            "namespace {ns} has {} SamplingPolicies; this cluster runs the oldest {cap} of a namespace (set by the cluster admin with the operator's --max-policies-per-namespace); this one creates no runs until older ones are deleted",
            all.len().max(rank + 1)
        )
    })
}

/// Reconciles one policy.
#[instrument(skip_all, fields(kind = P::kind(&()).as_ref(), policy = %policy.name_any()))]
pub async fn reconcile<P: Policy>(policy: Arc<P>, ctx: Arc<SamplingContext>) -> Result<Action> {
    let _timer = ctx.metrics.reconcile();
    let api = policy_api::<P>(&ctx.client, &policy)?;
    finalizer(&api, FINALIZER, policy, |event| async {
        match event {
            Event::Apply(policy) => apply(policy, &ctx, &api).await,
            Event::Cleanup(policy) => cleanup(policy, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

fn policy_api<P: Policy>(client: &kube::Client, policy: &P) -> Result<Api<P>> {
    if P::KIND == PolicyKind::Namespaced && policy.meta().namespace.is_none() {
        return Err(Error::MissingMetadata("namespace"));
    }
    Ok(P::api_for(client, policy))
}

fn to_std(d: jiff::SignedDuration) -> Duration {
    Duration::try_from(d).unwrap_or(Duration::ZERO)
}

/// Writes `status` on `current` (full replace of the status, guarded by `current`'s
/// resourceVersion) and returns the updated policy.
async fn write_status<P: Policy>(
    api: &Api<P>,
    current: &P,
    status: &SamplingPolicyStatus,
) -> Result<P> {
    let name = current.name_any();
    let json_error = |source| flamefleet_api::Error::Json {
        what: format!("status of {} {name}", P::kind(&())),
        source,
    };
    let mut body = serde_json::to_value(current).map_err(json_error)?;
    body["status"] = serde_json::to_value(status).map_err(json_error)?;
    let object: P = serde_json::from_value(body).map_err(json_error)?;
    api.replace_status(&name, &PostParams::default(), &object)
        .await
        .map_err(Error::kube(format!(
            "writing the status of {} {name}",
            P::kind(&())
        )))
}

async fn apply<P: Policy>(policy: Arc<P>, ctx: &SamplingContext, api: &Api<P>) -> Result<Action> {
    let name = policy.name_any();
    let uid = policy
        .meta()
        .uid
        .clone()
        .ok_or(Error::MissingMetadata("uid"))?;
    // The controller's copy may predate our own last status write; plan from the latest.
    let Some(mut current) = api
        .get_opt(&name)
        .await
        .map_err(Error::kube(format!("getting {} {name}", P::kind(&()))))?
    else {
        return Ok(Action::await_change());
    };
    if current.meta().uid.as_deref() != Some(uid.as_str()) {
        return Ok(Action::await_change());
    }
    let spec = current.policy_spec().clone();
    let generation = current.meta().generation;
    let now = ctx.now();
    let mut status = current.policy_status().cloned().unwrap_or_default();
    let before = status.clone();
    status.observed_generation = generation;

    if let Some(message) = over_policy_cap(ctx, &current) {
        let newly = !status
            .conditions
            .iter()
            .any(|c| c.type_ == CONDITION_ADMITTED && c.status == "False");
        set_condition(
            &mut status.conditions,
            new_condition(
                CONDITION_ADMITTED,
                false,
                "TooManyPolicies",
                &message,
                generation,
                Time(now),
            ),
        );
        status.next_schedule_time = None;
        ctx.triggers.register(&uid, None, &[]);
        ctx.continuous.register(&uid, None);
        if status != before {
            write_status(api, &current, &status).await?;
        }
        if newly {
            publish(
                ctx,
                &current,
                EventType::Warning,
                "TooManyPolicies",
                message,
            )
            .await;
        }
        return Ok(Action::requeue(POLICY_CAP_RECHECK));
    }
    if status
        .conditions
        .iter()
        .any(|c| c.type_ == CONDITION_ADMITTED)
    {
        set_condition(
            &mut status.conditions,
            new_condition(
                CONDITION_ADMITTED,
                true,
                "Admitted",
                "the namespace is within the cluster's number of policies",
                generation,
                Time(now),
            ),
        );
    }

    // Triggers are watched whatever the schedule says (a suspended policy watches nothing).
    ctx.triggers
        .register(&uid, registered(&current, &spec, &uid)?, &status.triggers);
    status.triggers = ctx.triggers.status_of(&uid, &spec.triggers);

    if spec
        .schedule
        .as_deref()
        .is_some_and(flamefleet_api::continuous::is_continuous)
    {
        return apply_continuous(ctx, api, &current, &spec, &uid, status).await;
    }
    ctx.continuous.register(&uid, None);
    status.continuous = None;

    // No schedule (the API server admits that only with triggers): runs come from fires.
    let parsed = spec
        .schedule
        .as_deref()
        .map(|text| (text, schedule::parse(text, spec.time_zone.as_deref(), now)));
    let schedule = match parsed {
        None => {
            set_condition(
                &mut status.conditions,
                new_condition(
                    CONDITION_SCHEDULE_VALID,
                    true,
                    "TriggersOnly",
                    "no schedule: the policy captures when its triggers fire",
                    generation,
                    Time(now),
                ),
            );
            None
        }
        Some((text, Ok(s))) => {
            let mut message = format!(
                "schedule {:?} in {}",
                text,
                spec.time_zone.as_deref().unwrap_or("UTC")
            );
            let min = ctx.limits.min_run_interval;
            let first = s.next_after(now);
            let second = first.and_then(|t| s.next_after(t));
            if let (Some(a), Some(b)) = (first, second)
                && to_std(b.duration_since(a)) < min
            {
                message.push_str(&format!(
                    "; runs start at most once every {} (the cluster's minimum interval, set by the cluster admin with the operator's --min-run-interval)",
                    humantime::format_duration(min)
                ));
            }
            set_condition(
                &mut status.conditions,
                new_condition(
                    CONDITION_SCHEDULE_VALID,
                    true,
                    "ScheduleParsed",
                    message,
                    generation,
                    Time(now),
                ),
            );
            Some(s)
        }
        Some((_, Err(e))) => {
            set_condition(
                &mut status.conditions,
                new_condition(
                    CONDITION_SCHEDULE_VALID,
                    false,
                    e.reason(),
                    e.to_string(),
                    generation,
                    Time(now),
                ),
            );
            status.next_schedule_time = None;
            if status != before {
                write_status(api, &current, &status).await?;
                publish(ctx, &current, EventType::Warning, e.reason(), e.to_string()).await;
            }
            return Ok(Action::await_change());
        }
    };

    let deadline = spec
        .starting_deadline_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(DEFAULT_STARTING_DEADLINE, Duration::from_secs);

    // History: finished runs beyond the limits go (their finalizer deletes the artifacts).
    let runs = runs_of(ctx, &current, &status, &uid)?;
    for run in history::expired(&runs, spec.history.as_ref()) {
        delete_run(ctx, &run).await?;
    }
    record_profiled(ctx, &uid, &runs);

    // A run planned before a restart: finish it first, unless its starting deadline passed
    // (a run created later than that would not be recognised as one).
    if let Some(pending) = status.pending_run.clone() {
        let late = to_std(now.duration_since(pending.scheduled_time.0)) > deadline;
        if late {
            status.missed_runs = Some(status.missed_runs.unwrap_or(0) + 1);
            publish(
                ctx,
                &current,
                EventType::Warning,
                "MissedSchedule",
                format!(
                    "the run planned for {} was not created before its starting deadline ({}s)",
                    pending.scheduled_time.0,
                    deadline.as_secs()
                ),
            )
            .await;
        } else {
            create_requests(ctx, &current, &spec, &pending).await?;
        }
        status.pending_run = None;
        status.last_schedule_time = Some(pending.scheduled_time.clone());
        current = write_status(api, &current, &status).await?;
    }

    let mut action = Action::requeue(MAX_REQUEUE);
    if let Some(schedule) = schedule.filter(|_| spec.suspend != Some(true)) {
        let mut last = status
            .last_schedule_time
            .as_ref()
            .or(current.meta().creation_timestamp.as_ref())
            .map_or(now, |t| t.0);
        if let Some(floor) = interval_floor(ctx, &status) {
            last = last.max(floor);
        }
        let due = schedule.due(last, now, deadline);
        if due.missed > 0 {
            status.missed_runs = Some(
                status.missed_runs.unwrap_or(0) + i64::try_from(due.missed).unwrap_or(i64::MAX),
            );
            if due.run.is_empty() {
                // Record how far the missed times go, so they are not counted again.
                let oldest_allowed = now
                    .checked_sub(jiff::SignedDuration::try_from(deadline).unwrap_or_default())
                    .unwrap_or(now);
                status.last_schedule_time = Some(Time(oldest_allowed));
            }
            publish(
                ctx,
                &current,
                EventType::Warning,
                "MissedSchedule",
                format!("{} scheduled time(s) passed more than {}s ago without a run (startingDeadlineSeconds)", due.missed, deadline.as_secs()),
            )
            .await;
        }
        let ran = !due.run.is_empty();
        for t in due.run {
            current = run_at(ctx, api, current, &mut status, &uid, t).await?;
        }
        let next = match interval_floor(ctx, &status) {
            // The times just run move the floor of the next one.
            Some(floor) if ran => schedule.next_after(floor.max(now)),
            _ => due.next,
        };
        status.next_schedule_time = next.map(Time);
        if let Some(next) = next {
            let wait = to_std(next.duration_since(ctx.now())) + Duration::from_millis(20);
            action = Action::requeue(wait.min(MAX_REQUEUE));
        }
    } else {
        status.next_schedule_time = None;
    }

    // Active runs, last success and coverage, from the cache.
    let runs = runs_of(ctx, &current, &status, &uid)?;
    status.active = history::active(&runs);
    status.active_count = Some(i32::try_from(status.active.len()).unwrap_or(i32::MAX));
    if let Some(t) = history::last_success(&runs)
        && status
            .last_successful_time
            .as_ref()
            .is_none_or(|old| old.0 < t.0)
    {
        status.last_successful_time = Some(t);
    }
    record_profiled(ctx, &uid, &runs);
    let eligibility = eligibility(ctx, &current, &spec, &uid)?;
    status.coverage = Some(coverage(ctx, &uid, &eligibility, &status));
    status.triggers = ctx.triggers.status_of(&uid, &spec.triggers);
    let current_status = current.policy_status().cloned().unwrap_or_default();
    if status != current_status {
        write_status(api, &current, &status).await?;
    }
    Ok(action)
}

/// What the trigger hub watches for `policy`: `None` when it has no triggers or is
/// suspended.
fn registered<P: Policy>(
    policy: &P,
    spec: &flamefleet_api::SamplingPolicySpec,
    uid: &str,
) -> Result<Option<super::triggers::Registered>> {
    if spec.triggers.is_empty() || spec.suspend == Some(true) {
        return Ok(None);
    }
    Ok(Some(super::triggers::Registered {
        kind: P::KIND,
        name: policy.name_any(),
        namespace: policy.meta().namespace.clone(),
        uid: uid.to_string(),
        labels: policy.labels().clone(),
        spec: spec.clone(),
        scope: scope_of(policy)?,
    }))
}

/// The policy's runs among the cached requests that carry its UID label: only those
/// [`RunIdentity`] recognises (a tenant can copy the label, not the rest). The budget
/// learns them too, so that only genuine runs count as scheduled capture time.
fn runs_of<P: Policy>(
    ctx: &SamplingContext,
    policy: &P,
    status: &SamplingPolicyStatus,
    uid: &str,
) -> Result<Vec<Arc<ProfileRequest>>> {
    let identity = RunIdentity::of_policy(
        P::KIND,
        &policy.name_any(),
        uid,
        policy.policy_spec(),
        Some(status),
        ctx.fleet.namespaces_in(&scope_of(policy)?),
    );
    let (runs, claimed) = identity.partition(ctx.fleet.runs_of(uid));
    for r in claimed.iter().take(3) {
        tracing::debug!(
            namespace = r.namespace().unwrap_or_default(),
            request = %r.name_any(),
            why = identity.why_not(r).unwrap_or_default(),
            "a request carries the policy's UID label but is not one of its runs"
        );
    }
    ctx.ledger.recognise(uid, &runs);
    Ok(runs)
}

fn scope_of<P: Policy>(policy: &P) -> Result<Scope> {
    Ok(match P::KIND {
        PolicyKind::Namespaced => Scope::Namespace(
            policy
                .meta()
                .namespace
                .clone()
                .ok_or(Error::MissingMetadata("namespace"))?,
        ),
        PolicyKind::Cluster => Scope::Cluster(selector_of(policy.namespace_selector())?),
    })
}

fn eligibility<P: Policy>(
    ctx: &SamplingContext,
    policy: &P,
    spec: &flamefleet_api::SamplingPolicySpec,
    uid: &str,
) -> Result<super::fleet::Eligibility> {
    let scope = scope_of(policy)?;
    let selector = selector_of(spec.template.selector.as_ref())?;
    Ok(ctx
        .fleet
        .eligible(uid, &scope, selector.as_ref(), &spec.template.pod_names))
}

/// Plans, records and creates the run of scheduled time `t`; returns the updated policy.
async fn run_at<P: Policy>(
    ctx: &SamplingContext,
    api: &Api<P>,
    current: P,
    status: &mut SamplingPolicyStatus,
    uid: &str,
    t: Timestamp,
) -> Result<P> {
    let spec = current.policy_spec().clone();
    let generation = current.meta().generation;
    let eligibility = eligibility(ctx, &current, &spec, uid)?;
    let what = match P::KIND {
        PolicyKind::Namespaced => "the template's selector in this namespace".to_string(),
        PolicyKind::Cluster => {
            "the template's selector in the namespaces of namespaceSelector".to_string()
        }
    };
    if eligibility.candidates.is_empty() {
        let message = eligibility.nothing_message(&what);
        set_condition(
            &mut status.conditions,
            new_condition(
                CONDITION_PODS_MATCHED,
                false,
                "NoEligiblePods",
                &message,
                generation,
                Time(t),
            ),
        );
        status.last_schedule_time = Some(Time(t));
        publish(
            ctx,
            &current,
            EventType::Warning,
            "NoEligiblePods",
            format!("no run at {t}: {message}"),
        )
        .await;
        return Ok(current);
    }
    set_condition(
        &mut status.conditions,
        new_condition(
            CONDITION_PODS_MATCHED,
            true,
            "PodsMatched",
            format!(
                "{} pods on {} nodes can be sampled",
                eligibility.candidates.len(),
                eligibility.node_count()
            ),
            generation,
            Time(t),
        ),
    );
    let duration = spec.template.capture_duration()?;
    let planning = ctx.planning.lock().await;
    let now = ctx.now();
    let load = ctx.ledger.load(
        &ctx.fleet.requests.state(),
        &ctx.fleet.results.state(),
        &ctx.fleet.pods.state(),
        now,
    );
    let mut gate = load.gate(
        Budget::from_spec(spec.budget.as_ref()),
        spec.template.profile_type,
        duration,
        now,
    );
    let limits = Limits::from_spec(spec.sampling.as_ref(), eligibility.candidates.len());
    let state = status.rotation.clone().unwrap_or_default();
    let selection = rotation::select(&eligibility.candidates, &state, limits, &mut gate, t);
    let budget_skips = selection
        .skipped
        .iter()
        .filter(|(_, r, _)| r.is_budget())
        .count();
    status.skipped_for_budget =
        Some(status.skipped_for_budget.unwrap_or(0) + i64::try_from(budget_skips).unwrap_or(0));
    status.last_run_skipped = selection
        .skipped
        .iter()
        .take(MAX_SKIPPED_RECORDED)
        .map(|(i, reason, message)| {
            let c = &eligibility.candidates[*i];
            SkippedPod {
                namespace: c.namespace.clone(),
                pod: c.name.clone(),
                node: c.node.clone(),
                reason: reason.as_str().to_string(),
                message: message.clone(),
            }
        })
        .collect();
    if budget_skips > 0 {
        ctx.metrics.budget_skips(budget_skips);
    }
    let mut coverage = status.coverage.clone().unwrap_or_default();
    if let Some(profiled) = selection.completed {
        coverage.rotations_completed += 1;
        coverage.last_rotation_completed_time = Some(Time(t));
        coverage.last_rotation_pods = Some(profiled);
    }
    status.coverage = Some(coverage);
    status.rotation = Some(selection.state.clone());
    if selection.taken.is_empty() {
        status.last_schedule_time = Some(Time(t));
        let why = status
            .last_run_skipped
            .first()
            .map_or_else(String::new, |s| format!(": {}", s.message));
        publish(
            ctx,
            &current,
            EventType::Warning,
            "RunSkipped",
            format!("no pod of the run at {t} could be captured within the node budget{why}"),
        )
        .await;
        return Ok(current);
    }
    // One request per namespace, pods in rotation order.
    let mut by_namespace: BTreeMap<String, (Vec<String>, BTreeSet<String>)> = BTreeMap::new();
    for &i in &selection.taken {
        let c = &eligibility.candidates[i];
        let entry = by_namespace.entry(c.namespace.clone()).or_default();
        entry.0.push(c.name.clone());
        entry.1.insert(c.node.clone());
    }
    // A namespace already holding its share of queued requests is passed over: its runs
    // would only queue behind the ones waiting.
    let cap = ctx.limits.max_queued_per_namespace;
    if cap > 0 {
        let queued = ctx.fleet.queued_by_namespace();
        let mut full = Vec::new();
        by_namespace.retain(|ns, (pods, _)| {
            let waiting = queued.get(ns).copied().unwrap_or(0);
            if waiting < cap {
                return true;
            }
            for pod in pods.iter() {
                if status.last_run_skipped.len() < MAX_SKIPPED_RECORDED {
                    status.last_run_skipped.push(SkippedPod {
                        namespace: ns.clone(),
                        pod: pod.clone(),
                        node: String::new(),
                        reason: "QueueFull".into(),
                        message: format!(
                            "namespace {ns} holds {waiting} requests waiting to start (limit {cap}, set by the cluster admin with the operator's --max-queued-runs-per-namespace)"
                        ),
                    });
                }
            }
            full.push(format!("{ns} ({waiting} waiting)"));
            false
        });
        if !full.is_empty() {
            publish(
                ctx,
                &current,
                EventType::Warning,
                "QueueFull",
                format!(
                    "the run at {t} passes over namespaces whose queue is full (limit {cap} requests waiting, --max-queued-runs-per-namespace): {}",
                    full.join(", ")
                ),
            )
            .await;
        }
        if by_namespace.is_empty() {
            status.last_schedule_time = Some(Time(t));
            return Ok(current);
        }
    }
    let name = current.name_any();
    let pending = PendingRun {
        scheduled_time: Time(t),
        requests: by_namespace
            .into_iter()
            .map(|(namespace, (pods, nodes))| PlannedRequest {
                namespace,
                name: run_name(&name, P::KIND, t),
                pods,
                nodes: nodes.into_iter().collect(),
            })
            .collect(),
    };
    // The run's nodes are booked before its writes, and other policies plan meanwhile: the
    // writes go to the API server, which can be slow (a new leader resuming hundreds of
    // requests), and holding the planning lock through them queued every policy's runs
    // behind each other's API calls (measured with 1,000 requests in flight: runs created
    // in turn, up to 44 s apart, so that times passed their starting deadline). A run
    // whose writes fail keeps its booking until its request appears or the booking expires:
    // the budget is then under-used for a while, never over-booked.
    for r in &pending.requests {
        ctx.ledger.reserve(Reservation {
            request: format!("{}/{}", r.namespace, r.name),
            profile_type: spec.template.profile_type,
            nodes: r.nodes.clone(),
            start: now.as_second(),
            duration: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        });
    }
    drop(planning);
    status.pending_run = Some(pending.clone());
    // The planned pods count as covered from the first write of the run on (a pending run is
    // always created, by this reconcile or the next): a rotation this run completes is never
    // written beside a coverage that misses the pods completing it.
    for r in &pending.requests {
        remember_profiled(ctx, uid, &r.namespace, &r.pods, t.as_second());
    }
    status.coverage = Some(self::coverage(ctx, uid, &eligibility, status));
    let current = write_status(api, &current, status).await?;
    create_requests(ctx, &current, &spec, &pending).await?;
    // Recorded by the next write (the next run's plan, or the reconcile's last write) and
    // not at once: a write less per run, which counts when the API server is slow (a new
    // leader resuming 1,000 requests on a 2-core VM: each write took seconds and the runs
    // fell behind their schedule). Until then the plan stays in the status, and a restart
    // finishes it again (creating nothing: its requests exist).
    status.pending_run = None;
    status.last_schedule_time = Some(Time(t));
    ctx.metrics.policy_run_created();
    let pods: usize = pending.requests.iter().map(|r| r.pods.len()).sum();
    // The run's (first) request as the Event's related object: one Event per run.
    let run = pending.requests.first().map(|r| ObjectReference {
        api_version: Some(format!(
            "{}/{}",
            flamefleet_api::GROUP,
            flamefleet_api::VERSION
        )),
        kind: Some("ProfileRequest".into()),
        namespace: Some(r.namespace.clone()),
        name: Some(r.name.clone()),
        ..ObjectReference::default()
    });
    publish_related(
        ctx,
        &current,
        run,
        EventType::Normal,
        "RunCreated",
        format!(
            "run at {t}: {pods} pod(s) in {} request(s) ({}), {} passed over",
            pending.requests.len(),
            pending
                .requests
                .iter()
                .map(|r| format!("{}/{}", r.namespace, r.name))
                .collect::<Vec<_>>()
                .join(", "),
            selection.skipped.len()
        ),
    )
    .await;
    Ok(current)
}

/// The ProfileRequest of one planned request.
pub fn run_request<P: Policy>(
    policy: &P,
    spec: &flamefleet_api::SamplingPolicySpec,
    planned: &PlannedRequest,
    scheduled: &Time,
) -> ProfileRequest {
    let mut labels = policy.labels().clone();
    labels.insert(POLICY_KIND_LABEL.into(), P::kind(&()).to_string());
    labels.insert(
        POLICY_UID_LABEL.into(),
        policy.meta().uid.clone().unwrap_or_default(),
    );
    let name = policy.name_any();
    if is_label_value(&name) {
        labels.insert(POLICY_NAME_LABEL.into(), name.clone());
    } else {
        labels.remove(POLICY_NAME_LABEL);
    }
    labels.insert(
        SCHEDULED_TIME_LABEL.into(),
        scheduled.0.as_second().to_string(),
    );
    let annotations =
        BTreeMap::from([(SCHEDULED_AT_ANNOTATION.to_string(), scheduled.0.to_string())]);
    let mut template = spec.template.clone();
    template.selector = None;
    template.pod_names = planned.pods.clone();
    if template.profile_type == ProfileType::Cpu && template.cpu.is_none() {
        template.cpu = Some(CpuOptions {
            frequency_hz: DEFAULT_POLICY_FREQUENCY_HZ,
        });
    }
    let mut request = ProfileRequest::new(&planned.name, template);
    request.metadata.namespace = Some(planned.namespace.clone());
    request.metadata.labels = Some(labels);
    request.metadata.annotations = Some(annotations);
    request.metadata.owner_references = Some(vec![OwnerReference {
        api_version: P::api_version(&()).to_string(),
        kind: P::kind(&()).to_string(),
        name,
        uid: policy.meta().uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }]);
    request
}

/// Creates the requests of `pending` that do not exist yet.
async fn create_requests<P: Policy>(
    ctx: &SamplingContext,
    policy: &P,
    spec: &flamefleet_api::SamplingPolicySpec,
    pending: &PendingRun,
) -> Result<()> {
    let uid = policy.meta().uid.clone().unwrap_or_default();
    for planned in &pending.requests {
        let api: Api<ProfileRequest> = Api::namespaced(ctx.client.clone(), &planned.namespace);
        let request = run_request(policy, spec, planned, &pending.scheduled_time);
        match api.create(&PostParams::default(), &request).await {
            Ok(_) => {
                tracing::info!(namespace = %planned.namespace, request = %planned.name, pods = planned.pods.len(), "created run");
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let existing = api
                    .get_opt(&planned.name)
                    .await
                    .map_err(Error::kube(format!(
                        "getting ProfileRequest {}/{}",
                        planned.namespace, planned.name
                    )))?;
                let ours = existing
                    .as_ref()
                    .is_some_and(|e| e.owner_references().iter().any(|o| o.uid == uid));
                if !ours {
                    let message = format!(
                        "ProfileRequest {}/{} exists and is not a run of this policy; rename one of them",
                        planned.namespace, planned.name
                    );
                    publish(ctx, policy, EventType::Warning, "RunNameTaken", message).await;
                }
            }
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => {
                // The namespace is gone (or terminating): this part of the run cannot exist.
                let message = format!(
                    "cannot create ProfileRequest {}/{}: {}",
                    planned.namespace, planned.name, s.message
                );
                publish(ctx, policy, EventType::Warning, "RunNotCreated", message).await;
            }
            Err(e) => {
                return Err(Error::kube(format!(
                    "creating ProfileRequest {}/{}",
                    planned.namespace, planned.name
                ))(e));
            }
        }
    }
    Ok(())
}

async fn delete_run(ctx: &SamplingContext, run: &ProfileRequest) -> Result<()> {
    let ns = run.namespace().unwrap_or_default();
    let name = run.name_any();
    let api: Api<ProfileRequest> = Api::namespaced(ctx.client.clone(), &ns);
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: run.metadata.uid.clone(),
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(&name, &params).await {
        Ok(_) => {
            tracing::info!(namespace = %ns, request = %name, "deleted run beyond the history limit");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(Error::kube(format!("deleting run {ns}/{name}"))(e)),
    }
}

/// The policy is being deleted: delete its runs (their finalizer deletes the artifacts).
async fn cleanup<P: Policy>(policy: Arc<P>, ctx: &SamplingContext) -> Result<Action> {
    let uid = policy.meta().uid.clone().unwrap_or_default();
    let selector = format!("{POLICY_UID_LABEL}={uid}");
    let api: Api<ProfileRequest> = match &policy.meta().namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let runs = api
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(Error::kube(format!(
            "listing the runs of {}",
            policy.name_any()
        )))?;
    // Only requests the policy controls: a request that merely copies the UID label is not
    // the policy's to delete.
    let kind = P::kind(&());
    for run in runs.items.iter().filter(|r| {
        r.owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && o.uid == uid && o.kind == kind)
    }) {
        delete_run(ctx, run).await?;
    }
    ctx.profiled
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&uid);
    ctx.ledger.forget_policy(&uid);
    ctx.triggers.forget(&uid);
    ctx.continuous.forget(&uid);
    tracing::info!(runs = runs.items.len(), "deleted the policy's runs");
    Ok(Action::await_change())
}

fn remember_profiled(ctx: &SamplingContext, uid: &str, namespace: &str, pods: &[String], at: i64) {
    let mut all = ctx.profiled.lock().unwrap_or_else(|e| e.into_inner());
    let map = all.entry(uid.to_string()).or_default();
    for pod in pods {
        let slot = map.entry(format!("{namespace}/{pod}")).or_insert(at);
        *slot = (*slot).max(at);
    }
}

/// Learns when pods were profiled from the runs in the cache (after a restart, this is all
/// there is; runs deleted by the history limits are remembered only by a running operator).
fn record_profiled(ctx: &SamplingContext, uid: &str, runs: &[Arc<ProfileRequest>]) {
    for run in runs {
        if let Some(t) = scheduled_second(run) {
            remember_profiled(
                ctx,
                uid,
                &run.namespace().unwrap_or_default(),
                &run.spec.pod_names,
                t,
            );
        }
    }
}

/// How often an always-on policy's status is refreshed (coverage, windows, export health).
const CONTINUOUS_STATUS_PERIOD: Duration = Duration::from_secs(10);
/// Condition of an always-on policy: its pods are profiled (or why not).
pub const CONDITION_CONTINUOUS: &str = "Continuous";

/// An always-on policy (`schedule: "@continuous"`): registered with the continuous hub,
/// which profiles its pods in windows on their agents (no runs); its status says what the
/// windows did. Looked at again every [`CONTINUOUS_STATUS_PERIOD`].
async fn apply_continuous<P: Policy>(
    ctx: &SamplingContext,
    api: &Api<P>,
    current: &P,
    spec: &flamefleet_api::SamplingPolicySpec,
    uid: &str,
    mut status: SamplingPolicyStatus,
) -> Result<Action> {
    let generation = current.meta().generation;
    let now = ctx.now();
    let hub = &ctx.continuous;
    let frequency = spec
        .template
        .cpu
        .as_ref()
        .map_or(DEFAULT_POLICY_FREQUENCY_HZ, |c| c.frequency_hz);
    let max = hub.settings().max_cpu_frequency_hz;
    let refusal = if spec.suspend == Some(true) {
        Some(("Suspended", "suspended: no pod is profiled".to_string()))
    } else if spec.template.profile_type != ProfileType::Cpu {
        Some((
            "NotCpu",
            "an always-on policy profiles CPU only: template.type must be cpu".to_string(),
        ))
    } else if frequency > max {
        Some((
            "FrequencyTooHigh",
            format!(
                "template.cpu.frequencyHz {frequency} is above the cluster's limit of {max} Hz (set by the cluster admin with the operator's --max-cpu-frequency-hz)"
            ),
        ))
    } else if spec.template.export == Some(false) {
        Some((
            "ExportDisabled",
            "template.export is false: always-on windows exist only to be exported, so none is taken".to_string(),
        ))
    } else if !hub.exports() {
        Some((
            "NoExportSink",
            "the cluster has no export endpoint (the operator's --export-otlp-endpoint, chart value export.otlp.endpoint): always-on windows exist only to be exported, so none is taken".to_string(),
        ))
    } else {
        None
    };
    let registered = match &refusal {
        Some(_) => None,
        None => Some(super::continuous::Registered {
            kind: P::KIND,
            name: current.name_any(),
            namespace: current.meta().namespace.clone(),
            uid: uid.to_string(),
            spec: spec.clone(),
            scope: scope_of(current)?,
            frequency_hz: u32::try_from(frequency).unwrap_or(1).max(1),
        }),
    };
    hub.register(uid, registered);
    set_condition(
        &mut status.conditions,
        new_condition(
            CONDITION_SCHEDULE_VALID,
            true,
            "Continuous",
            format!(
                "always-on: windows of {} every {}, at {frequency} Hz",
                humantime::format_duration(hub.settings().window),
                humantime::format_duration(hub.settings().period)
            ),
            generation,
            Time(now),
        ),
    );
    let (reason, message) = refusal.clone().unwrap_or((
        "Profiling",
        "every selected pod is profiled in windows, each exported".to_string(),
    ));
    set_condition(
        &mut status.conditions,
        new_condition(
            CONDITION_CONTINUOUS,
            refusal.is_none(),
            reason,
            message,
            generation,
            Time(now),
        ),
    );
    status.next_schedule_time = None;
    status.pending_run = None;
    let (continuous, matching, covered) = hub.status_of(uid);
    let mut coverage = status.coverage.clone().unwrap_or_default();
    coverage.matching_pods = i64::try_from(matching).unwrap_or(i64::MAX);
    coverage.covered_pods = i64::try_from(covered).unwrap_or(i64::MAX);
    coverage.summary = match (covered * 100).checked_div(matching) {
        Some(percent) => format!("{covered}/{matching} ({percent}%)"),
        None => "0/0".into(),
    };
    status.coverage = Some(coverage);
    status.continuous = Some(continuous);
    if current.policy_status() != Some(&status) {
        write_status(api, current, &status).await?;
    }
    Ok(Action::requeue(CONTINUOUS_STATUS_PERIOD))
}

/// Coverage: of the eligible pods now, those profiled since the start of the last full
/// rotation (the current one while none has completed).
fn coverage(
    ctx: &SamplingContext,
    uid: &str,
    eligibility: &super::fleet::Eligibility,
    status: &SamplingPolicyStatus,
) -> Coverage {
    let rotation: RotationState = status.rotation.clone().unwrap_or_default();
    let since = rotation
        .previous_start_time
        .as_ref()
        .or(rotation.start_time.as_ref())
        .map_or(i64::MAX, |t| t.0.as_second());
    let all = ctx.profiled.lock().unwrap_or_else(|e| e.into_inner());
    let profiled = all.get(uid);
    let matching = eligibility.candidates.len();
    let covered = eligibility
        .candidates
        .iter()
        .filter(|c| {
            profiled
                .and_then(|m| m.get(&format!("{}/{}", c.namespace, c.name)))
                .is_some_and(|&at| at >= since)
        })
        .count();
    let mut out = status.coverage.clone().unwrap_or_default();
    out.matching_pods = i64::try_from(matching).unwrap_or(i64::MAX);
    out.covered_pods = i64::try_from(covered).unwrap_or(i64::MAX);
    out.summary = match (covered * 100).checked_div(matching) {
        Some(percent) => format!("{covered}/{matching} ({percent}%)"),
        None => "0/0".into(),
    };
    out
}

/// Records an Event on the policy; failures are logged, never fatal.
///
/// Events of a cluster-scoped object (a ClusterSamplingPolicy) are stored in the `default`
/// namespace, whose tenants may read events: theirs say what happened and where to look
/// ([`cluster_scoped_note`]), never which namespaces or pods. A SamplingPolicy's events stay
/// in its own namespace, about its own pods, with every detail.
async fn publish<P: Policy>(
    ctx: &SamplingContext,
    policy: &P,
    type_: EventType,
    reason: &str,
    note: String,
) {
    publish_related(ctx, policy, None, type_, reason, note).await;
}

/// Records an Event on the policy about `related` (see [`crate::events::publish_related`]),
/// in the background.
async fn publish_related<P: Policy>(
    ctx: &SamplingContext,
    policy: &P,
    related: Option<ObjectReference>,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let object = policy.object_ref(&());
    // A cluster-scoped policy's Events are stored in `default`: neither the note nor the
    // related object may name a namespace or pod there.
    let (note, related) = match object.namespace {
        Some(_) => (note, related),
        None => (cluster_scoped_note(reason, &policy.name_any()), None),
    };
    // Not waited for: the schedule goes on while the API server records it (a slow API
    // server made every run wait for its Event).
    let recorder = ctx.recorder.clone();
    let reason = reason.to_string();
    tokio::spawn(async move {
        crate::events::publish_related(
            &recorder, &object, related, type_, "Schedule", &reason, &note,
        )
        .await;
    });
}

/// The note of an Event about a cluster-scoped policy: the reason, and where the details
/// (namespaces, pods, errors) are, readable by cluster admins only.
pub fn cluster_scoped_note(reason: &str, policy: &str) -> String {
    format!(
        "{reason}: see `kubectl get clustersamplingpolicy {policy} -o yaml` (status) and the operator's log for the namespaces and pods involved; this Event is stored in the default namespace, where tenants may read it, so it names none"
    )
}
