//! One hollow node's capture engine, plugged into the real agent's service shell
//! (`flamefleet_agent::service`: captures table, progress, upload, mutual TLS): it captures
//! nothing. A capture waits its window and finishes with the synthetic profile of
//! [`super::profile`]; the node's [`Behaviour`] decides whether a capture runs, fails right
//! after ACCEPTED, never answers, or is forgotten halfway through its window.

use std::sync::Arc;
use std::time::{Duration, Instant};

use flamefleet_agent::capture::lifecycle::Finished;
use flamefleet_agent::capture::window::Window;
use flamefleet_agent::service::engine::{
    Admission, CaptureEngine, EngineCapture, requested_frequency,
};
use flamefleet_agent::service::pipeline::PipelineError;
use flamefleet_proto::agent::{CaptureRequest, InfoResponse, ProfileType};

use super::{Behaviour, BehaviourCell, profile};

/// The engine of one hollow node.
#[derive(Debug)]
pub(crate) struct HollowEngine {
    node: String,
    behaviour: Arc<BehaviourCell>,
}

impl HollowEngine {
    pub(crate) fn new(node: &str, behaviour: Arc<BehaviourCell>) -> Self {
        Self {
            node: node.to_owned(),
            behaviour,
        }
    }
}

impl CaptureEngine for HollowEngine {
    fn admit(&self, request: &CaptureRequest) -> Admission {
        match self.behaviour.get() {
            Behaviour::Succeed | Behaviour::Fail | Behaviour::Oversized => Admission::Run,
            // A hung agent: not even ACCEPTED.
            Behaviour::Silent => Admission::Hang,
            // An agent that restarts halfway through the window loses the capture.
            Behaviour::Forget => {
                Admission::Forget(Duration::from_millis(u64::from(request.duration_ms) / 2))
            }
        }
    }

    fn start(
        &self,
        request: &CaptureRequest,
        profile_type: ProfileType,
        duration: Duration,
    ) -> Result<Box<dyn EngineCapture>, PipelineError> {
        if self.behaviour.get() == Behaviour::Fail {
            return Err(PipelineError::Targets(format!(
                "hollow agent {}: injected failure",
                self.node
            )));
        }
        Ok(Box::new(HollowCapture {
            node: self.node.clone(),
            profile_type,
            pods: request
                .targets
                .iter()
                .map(|t| (t.namespace.clone(), t.pod_name.clone()))
                .collect(),
            frequency_hz: requested_frequency(request),
            duration,
            deadline: Instant::now() + duration,
        }))
    }

    fn info(&self, node: &str) -> InfoResponse {
        InfoResponse {
            node_name: node.to_owned(),
            kernel_release: "hollow".into(),
            supported_types: vec![
                ProfileType::Cpu as i32,
                ProfileType::Heap as i32,
                ProfileType::Runqlat as i32,
                ProfileType::Offcpu as i32,
            ],
            agent_version: concat!("hollow-", env!("CARGO_PKG_VERSION")).into(),
            api_version: flamefleet_agent::service::info::API_VERSION.into(),
            missing_features: Vec::new(),
        }
    }
}

/// A hollow capture: its window, then a synthetic profile.
struct HollowCapture {
    node: String,
    profile_type: ProfileType,
    pods: Vec<(String, String)>,
    frequency_hz: u64,
    duration: Duration,
    deadline: Instant,
}

/// The window: its length, idle.
impl Window for HollowCapture {
    type Error = PipelineError;

    fn deadline(&self) -> Option<Instant> {
        Some(self.deadline)
    }

    fn next_work(&self) -> Option<Instant> {
        None
    }

    fn work(&mut self) -> Result<(), PipelineError> {
        Ok(())
    }
}

impl EngineCapture for HollowCapture {
    fn sampler(&self) -> Option<usize> {
        // Every capture of a hollow node "runs" on one sampler.
        Some(0)
    }

    fn finish(self: Box<Self>) -> Result<Finished, PipelineError> {
        Ok(profile::build(
            self.profile_type,
            &self.node,
            &self.pods,
            self.duration,
            self.frequency_hz,
        ))
    }
}
