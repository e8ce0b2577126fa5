//! The `Continuous` call: the operator's always-on set of this node becomes the set of
//! [`Continuous`], and each pod's windows go back on the call's stream (docs/export.md,
//! "Always-on profiling"). A new call replaces the set whole and ends the previous call's
//! stream; when the current call's stream ends, the node profiles nothing always-on.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use flamefleet_proto::agent::ContinuousEvent;
use futures::Stream;
use tonic::Status;

use crate::continuous::Continuous;

/// The stream of one `Continuous` call: its acknowledgement, then its windows.
pub struct ContinuousStream {
    ack: Option<ContinuousEvent>,
    rx: tokio::sync::mpsc::Receiver<ContinuousEvent>,
    continuous: Arc<Continuous>,
    session: u64,
}

impl ContinuousStream {
    /// The stream of call `session`.
    pub fn new(
        continuous: Arc<Continuous>,
        session: u64,
        ack: ContinuousEvent,
        rx: tokio::sync::mpsc::Receiver<ContinuousEvent>,
    ) -> Self {
        Self {
            ack: Some(ack),
            rx,
            continuous,
            session,
        }
    }
}

impl Stream for ContinuousStream {
    type Item = Result<ContinuousEvent, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        if let Some(ack) = self.ack.take() {
            return Poll::Ready(Some(Ok(ack)));
        }
        self.rx.poll_recv(cx).map(|e| e.map(Ok))
    }
}

impl Drop for ContinuousStream {
    fn drop(&mut self) {
        self.continuous.end(self.session);
    }
}
