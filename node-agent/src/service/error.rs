//! Why a capture through the service failed: the error of the [`super::engine`] seam and of
//! the pipeline around it, whose Display text is the FAILED reason the operator records.

use super::upload::UploadError;
use crate::capture::CaptureError;
use crate::capture::heap::HeapError;

/// Why a capture failed; the Display text is the FAILED reason.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The request itself is wrong.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Targets did not resolve to cgroups.
    #[error("target resolution failed: {0}")]
    Targets(String),
    /// A CPU or runqlat engine failed.
    #[error("capture failed: {0}")]
    Capture(#[from] CaptureError),
    /// The heap engine failed.
    #[error("heap capture failed: {0}")]
    Heap(#[from] HeapError),
    /// An upload failed.
    #[error(transparent)]
    Upload(#[from] UploadError),
    /// `Cancel` was called.
    #[error("cancelled by the client")]
    Cancelled,
    /// The capture had not ended by the operator's deadline (plus a margin): whoever asked
    /// for it stopped waiting, so the agent stopped it.
    #[error(
        "abandoned: the capture had not ended {}s after it was requested (the operator's deadline plus {}s), so nobody was waiting for it any more; the agent stopped it and freed its eBPF state, and uploads nothing more for it",
        after.as_secs(),
        margin.as_secs()
    )]
    Abandoned {
        /// Time from the request to the stop.
        after: std::time::Duration,
        /// The margin past the operator's deadline.
        margin: std::time::Duration,
    },
    /// Something that should not happen (a worker thread died).
    #[error("internal error: {0}")]
    Internal(String),
}

impl PipelineError {
    /// The machine-readable reason of the FAILED message, when there is one the operator
    /// records as the node's reason (`CaptureProgress.reason`).
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            Self::Upload(UploadError::StorageFull { .. }) => Some("StorageFull"),
            Self::Abandoned { .. } => Some("Abandoned"),
            _ => None,
        }
    }
}
