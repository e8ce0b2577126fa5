//! Flamefleet wire formats.

/// The pprof `Profile` messages (package `perftools.profiles`), as read by
/// `go tool pprof` and every other pprof consumer.
pub mod pprof {
    #![allow(missing_docs, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/perftools.profiles.rs"));
}

/// The operator-to-agent gRPC service, `flamefleet.agent.v1.AgentService`.
pub mod agent {
    #![allow(missing_docs, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/flamefleet.agent.v1.rs"));
}
